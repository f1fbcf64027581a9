"""A training method as one object: what a recipe trains and everything the rest of the
house asks of it. Each method's wing declares its own (core/finetune.py; preference/method.py:
dpo, reward; rl/method.py: grpo), and one table, llmtrain/methods.py, lists them: the recipes
(`recipe.run`), `llmtrain plan`, the config reference and the run directory all read it, and
nothing outside a wing asks which method a run is.

A method supplies:
- its config tree (`schema`: config.Config, or an extension with a section of its own, whose
  `~`/$VARS path keys and checks come with its annotations and `problems()`);
- its data (`data`: a data/kind.DataKind, or cfg -> one) and its start-up checks (`check`);
- `parts`: the objective and the loop's data source (`Parts`), built once the model is loaded;
- what a checkpoint's position means beyond the shared settings (`position`), which a resume
  must keep;
- what `llmtrain plan` says of it (`describe`, and the figures of `PlanFigures`);
- its offline demo (`demo`), run when a recipe is given no --config and no model or data of
  the user's, and its config for the user's own model and data (`template`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

from ..config import Config
from ..data.kind import DataKind
from ..data.rows import IGNORE
from .objective import Objective
from .source import MakeBatches


@dataclass(frozen=True)
class Parts:
    """A method's pieces for one run, built once the model is loaded."""

    objective: Objective
    # Makes the loop's micro-batches once the model is prepared for the distributed backend:
    # source(prepared model, backend, beat) -> core/source.Batches (source.loader_source for
    # prepared data; rl/rollout.Rollouts generates them).
    source: MakeBatches
    # Runs once the model is prepared and before a resumed run's weights are loaded, so the
    # model still holds its starting weights (the reference log-probs of preference tuning):
    # after_prepare(model, accelerator, empty_batch, beat, stop).
    after_prepare: Callable | None = None


def scaled_length(length: int, cfg, max_seq_len: int) -> int:
    """A length that must fit within data.max_seq_len (a completion's), scaled as
    data.max_seq_len is to the shorter `max_seq_len` of `llmtrain verify`'s runs."""
    return length if max_seq_len >= cfg.data.max_seq_len else max(1, length * max_seq_len // cfg.data.max_seq_len)


def no_position(cfg) -> dict:
    return {}


@dataclass(frozen=True)
class PlanFigures:
    """How `llmtrain plan` sizes a method's batches, where it differs from token rows."""

    # Sequences one example brings to a forward pass (a pair: 2; a prompt: its group).
    sequences: Callable[[Config], int] = lambda cfg: 1
    # Tokens of one example in the global batch's figure, from the mean example length, or
    # None for the rows' own (data.max_seq_len x the kind's width when packed, else the mean).
    tokens: Callable[[Config, float], float | None] = lambda cfg, mean: None
    # Optimizer steps in a pass over n examples on `world` processes, or None for the
    # loader's (train.steps_per_epoch).
    steps_per_epoch: Callable[[Config, int, int], int | None] = lambda cfg, n, world: None
    # Memory beyond weights, gradients, optimizer and activations:
    # (cfg, model config, parameters, weight bytes, tokens per micro-batch) -> {what: bytes}.
    memory: Callable = lambda cfg, mcfg, total, width, tokens: {}


@dataclass(frozen=True)
class Method:
    # What the run trains for: recipes/<name>.py runs it, `llmtrain plan --recipe <name>`
    # plans it, and an output_dir records it (rundir.identity) and is checked on every rerun.
    name: str
    schema: type  # its config tree (config.Config or an extension of it)
    description: str  # one line, the recipe's --help
    data: DataKind | Callable[[Config], DataKind]  # what its examples are, or cfg -> that
    parts: Callable  # (cfg, accelerator, model, tokenizer, train set, eval set) -> Parts
    # `llmtrain plan`'s lines of its own: (cfg, the first training example, tokenizer) -> lines.
    describe: Callable
    demo: str = ""  # its offline demo's YAML in recipes/configs/, run when no --config is given
    # Its YAML in recipes/configs/ for a run of your own model and data, beside the demo's: a
    # run that names its own model without --config points to it (cli.run_config).
    template: str = ""
    # Start-up checks before any data or weights load: check(cfg, tokenizer).
    check: Callable | None = None
    # Settings of its own that a checkpoint's data position depends on (a resume must keep
    # them): cfg -> {key: value}, recorded beside the shared ones (checkpoint.position_settings).
    position: Callable = no_position
    plan: PlanFigures = field(default_factory=PlanFigures)
    # What a model it trained is tagged with on the Hub (its model card, output/card.py),
    # after "llmtrain": cfg -> tags, e.g. the objective ("sft", "dpo", "kto").
    tags: Callable = lambda cfg: []
    # Figures `llmtrain eval` derives from the evaluation's: figures -> more (SFT's perplexity).
    derived: Callable = lambda figures: {}
    # Overrides `llmtrain verify` adds to its runs of a shrunk random model, so that they
    # train something to compare and fit its shorter sequences: (cfg, the runs'
    # data.max_seq_len) -> overrides (GRPO's rewards, which a random model's answers would
    # all meet alike; a completion length scaled as data.max_seq_len is).
    verify: Callable = lambda cfg, max_seq_len: []
    # Whether its runs keep the model's own random draws in training (dropout, router
    # jitter; model.disable_dropout turns them off): cfg -> bool. SFT and distillation keep
    # them unless model.dropout=none; the others always turn them off.
    keeps_dropout: Callable = lambda cfg: False

    @property
    def section(self) -> str | None:
        """The config section its tree adds to Config's (dpo, grpo, reward), or None."""
        shared = {f.name for f in dataclasses.fields(Config)}
        own = [f.name for f in dataclasses.fields(self.schema) if f.name not in shared]
        return own[0] if own else None

    def kind(self, cfg):
        """Its DataKind for this config."""
        return self.data(cfg) if callable(self.data) else self.data


# How plan lines show a tokenized example: trained tokens inside these marks.
TRAINED_OPEN, TRAINED_CLOSE = "\u27e6", "\u27e7"  # ⟦ trained tokens ⟧


def preview_row(row: dict, tokenizer) -> str:
    """The row (input_ids, labels) as text with trained tokens inside ⟦ ⟧ (labels are
    shifted: token t+1 is trained when labels[t] is set)."""
    ids, labels = row["input_ids"], row["labels"]
    trained = [False] + [lab != IGNORE for lab in labels[:-1]]
    out, inside = [], False
    for tok, is_trained in zip(ids, trained):
        if is_trained != inside:
            out.append(TRAINED_OPEN if is_trained else TRAINED_CLOSE)
            inside = is_trained
        out.append(tokenizer.decode([tok]))
    if inside:
        out.append(TRAINED_CLOSE)
    return "".join(out)
