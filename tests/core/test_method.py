"""A method is one object (core/method.Method): a toy one declared here, with a config section,
an objective and a checkpoint position key of its own, and one line in the method table,
is planned by `llmtrain plan`, listed in the config reference, refused by the other recipes
as another's section, and trained by the shared recipe code, with no edit outside this file."""

import json
from dataclasses import dataclass, field
from typing import ClassVar

import pytest

from llmtrain.config import Config, load_config
from llmtrain.config.schema import field_docs
from llmtrain.core.method import Method, Parts, PlanFigures
from llmtrain.core.objective import Loss, TokenLoss
from llmtrain.core.source import loader_source
from llmtrain.data.batches import Collator
from llmtrain.data.build import ROWS
from llmtrain.errors import ConfigError
from llmtrain.methods import METHODS, sections
from llmtrain.model import pad_id
from tests.support.runs import ROOT, launch, recipe_args, train_rows


@dataclass
class ToySection:
    scale: float = 1.0
    """What the toy objective multiplies the token loss by."""


@dataclass
class ToyConfig(Config):
    RECIPE: ClassVar[str] = "recipes/toy.py"

    toy: ToySection = field(default_factory=ToySection)


class ScaledTokenLoss:
    """The summed cross-entropy of the trained tokens, times a scale."""

    unit = "tokens"
    metric_names = ("scaled",)
    progress_metrics = {"scaled": "x"}

    def __init__(self, model, scale: float):
        self.tokens, self.scale = TokenLoss.for_model(model, 0), scale
        self.head = None

    def count(self, batch: dict) -> int:
        return self.tokens.count(batch)

    def __call__(self, model, batch: dict) -> Loss:
        total = self.tokens(model, batch).total * self.scale
        return Loss(total, {"scaled": total.detach()})


def toy_parts(cfg, accelerator, model, tokenizer, train_set, eval_set) -> Parts:
    objective = ScaledTokenLoss(model, cfg.toy.scale)
    collator = Collator(pad_id(tokenizer), cfg.data.max_seq_len if cfg.data.packing else 0)
    return Parts(objective, loader_source(cfg, accelerator, objective, train_set, eval_set, collator))


TOY = Method(
    name="toy",
    schema=ToyConfig,
    description="Train the toy objective.",
    data=ROWS,
    parts=toy_parts,
    describe=lambda cfg, first, tokenizer: ["\n== toy ==", f"  scale {cfg.toy.scale:g}"],
    position=lambda cfg: {"toy.scale": cfg.toy.scale},
    plan=PlanFigures(sequences=lambda cfg: 3),
)

# The toy's recipe script, as recipes/<name>.py would be, with the toy's line of the table.
SCRIPT = f"""
import sys
sys.path.insert(0, {str(ROOT)!r})
from llmtrain.cli import run_cli
from llmtrain.methods import METHODS
from llmtrain.recipe import run
from tests.core.test_method import TOY

METHODS["toy"] = TOY
run_cli(lambda argv: run("toy", argv), sys.argv[1:])
"""


@pytest.fixture
def toy(monkeypatch):
    monkeypatch.setitem(METHODS, "toy", TOY)
    return TOY


def test_the_method_owns_its_section_and_the_others_name_it(toy):
    assert toy.section == "toy" and sections()["toy"] == "recipes/toy.py"
    with pytest.raises(ConfigError, match=r"^toy: unknown key for recipes/dpo.py; toy settings are recipes/toy.py's"):
        load_config(None, ["model.name_or_path=m", "data.train=d", "toy.scale=2"], METHODS["dpo"].schema, sections())
    keys = {key: doc for key, _, doc in field_docs([m.schema for m in METHODS.values()])}
    assert keys["toy.scale"] == "What the toy objective multiplies the token loss by."


def test_llmtrain_plan_describes_it(toy, tiny_model, chat_file, tmp_path, capsys):
    from llmtrain.commands import main
    from llmtrain.plan import Launch, count_params, memory_estimate

    config = tmp_path / "toy.yaml"
    data = f"data:\n  train: {chat_file}\n  max_seq_len: 128\n"
    config.write_text(f"model:\n  name_or_path: {tiny_model}\n{data}toy:\n  scale: 2.5\n")
    main(["plan", "--config", str(config), "train.micro_batch_size=2"])
    out = capsys.readouterr().out
    assert "\n== toy ==\n  scale 2.5\n" in out  # the recipe found from its section, and its own lines
    assert "== first training row" not in out  # its lines, not finetune's
    # Its figures size the batch: 3 sequences per row, so 3 times a row's activations
    # (whole logits here, which also scale with the tokens).
    cfg = load_config(config, ["train.loss_chunk_logits=0"], ToyConfig)
    counts = count_params(cfg)
    toy_memory = memory_estimate(cfg, TOY, Launch(), *counts)["activations"]
    assert toy_memory == 3 * memory_estimate(cfg, METHODS["finetune"], Launch(), *counts)["activations"]


def test_the_shared_recipe_trains_it(toy, base_config, tiny_model, chat_file, cache_env, tmp_path):
    script = tmp_path / "toy.py"
    script.write_text(SCRIPT)
    plain, scaled = tmp_path / "plain", tmp_path / "scaled"
    common = ["train.max_steps=2", "checkpoint.every_steps=1", "eval.every_steps=0"]
    launch(recipe_args(base_config, tiny_model, chat_file, plain, *common), cache_env, "one")
    args = recipe_args(base_config, tiny_model, chat_file, scaled, *common, "toy.scale=2")
    launch(args, cache_env, "one", recipe=script)
    ref, got = train_rows(plain), train_rows(scaled)
    assert [r["loss"] for r in got] == pytest.approx([2 * r["loss"] for r in ref], rel=1e-6)
    assert [r["scaled"] for r in got] == [r["loss"] for r in got]  # its own metric, in the metrics row
    assert json.loads((scaled / "run.json").read_text())["recipe"] == "toy"
    state = json.loads((scaled / "checkpoints" / "step-2" / "train_state.json").read_text())
    assert state["settings"]["toy.scale"] == 2.0  # its position key, checked on resume
    assert (scaled / "final" / "config.json").is_file()
