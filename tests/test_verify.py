"""llmtrain verify's parts (llmtrain/verify.py): the user's architecture shrunk with what
makes it that architecture kept, and runs compared figure by figure against tolerances.
The command on real runs, passing and failing, is tests/launch/test_verify.py's."""

import json
import math
import os
from pathlib import Path

import pytest

import llmtrain.verify as verify
from llmtrain.config import ModelConfig, load_config
from llmtrain.errors import ConfigError
from llmtrain.methods import METHODS, sections
from llmtrain.model import check_model, random_draws
from llmtrain.plan import recipe_named
from llmtrain.verify import (
    FLOAT32,
    HALF,
    Check,
    Findings,
    Where,
    compare,
    explain,
    packing,
    runs_seq_len,
    shrink,
    table,
)
from tests.support.vision_models import COLOURS, FAMILIES, build, png

# Larger than the shrunk size, so every setting that shrinks is seen to.
MIXED = ["sliding_attention", "full_attention"]
BIG = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=8)


@pytest.mark.parametrize(
    "cls, settings, kept",
    [
        ("LlamaConfig", {}, {}),
        (
            "Gemma2Config",
            {"sliding_window": 8, "head_dim": 32, "layer_types": ["sliding_attention", "full_attention"] * 3},
            {"sliding_window": 8},
        ),
        ("Qwen3MoeConfig", {"num_experts": 16, "num_experts_per_tok": 4, "moe_intermediate_size": 128}, {}),
        ("Phi3Config", {}, {}),
        ("GPT2Config", {"n_embd": 256, "n_layer": 6, "n_head": 8, "n_positions": 512}, {"n_positions": 512}),
    ],
)
def test_shrinking_keeps_the_architecture_and_the_vocabulary(cls, settings, kept, tokenizer, tmp_path):
    import transformers
    from transformers import AutoConfig

    kwargs = {} if cls == "GPT2Config" else dict(BIG)
    ids = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    ids["pad_token_id"] = tokenizer.pad_token_id
    config = getattr(transformers, cls)(vocab_size=len(tokenizer), **ids, **kwargs | settings)
    config.save_pretrained(tmp_path / "big")
    tokenizer.save_pretrained(tmp_path / "big")
    model_cfg = ModelConfig(name_or_path=str(tmp_path / "big"))
    out = shrink(model_cfg, check_model(model_cfg, 256), tmp_path / "small")
    small = AutoConfig.from_pretrained(out)
    assert type(small) is type(config) and small.vocab_size == len(tokenizer)
    assert small.num_hidden_layers == 2 and small.hidden_size == 64
    for key, value in kept.items():
        assert getattr(small, key) == value, key
    if cls == "Gemma2Config":
        assert small.layer_types == MIXED  # one layer of each kind
    if cls == "Qwen3MoeConfig":
        assert small.num_experts == 4 and small.num_experts_per_tok == 2
    if cls == "GPT2Config":
        assert random_draws(small) == ["config.attn_pdrop=0.1", "config.embd_pdrop=0.1", "config.resid_pdrop=0.1"]
    assert (out / "model.safetensors").is_file() and (out / "tokenizer_config.json").is_file()


def run_dir(path, losses, norms, weight: float = 1.0):
    import torch
    from safetensors.torch import save_file

    (path / "final").mkdir(parents=True)
    rows = [{"step": i + 1, "loss": loss, "grad_norm": g} for i, (loss, g) in enumerate(zip(losses, norms))]
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    save_file({"w": torch.tensor([weight, 2.0])}, path / "final" / "model.safetensors")
    return path


def test_a_check_reports_the_figure_furthest_beyond_its_tolerance(tmp_path):
    want = run_dir(tmp_path / "want", [2.0, 1.5], [1.0, 0.8])
    same = run_dir(tmp_path / "same", [2.0, 1.5 * (1 + 1e-6)], [1.0, 0.8])
    check = compare("accumulation vs one micro-batch", same, want, FLOAT32, 1.0)
    assert check.passed and check.where == "loss at step 2" and check.worst == pytest.approx(1e-6)
    off = run_dir(tmp_path / "off", [2.0, 1.5], [1.0, 0.8 * 1.01])
    check = compare("2 processes vs one micro-batch", off, want, FLOAT32, 1.0)
    assert not check.passed and check.where == "grad_norm at step 2" and check.tolerance == FLOAT32["grad_norm"]
    exact = dict.fromkeys(FLOAT32, 0.0)
    weights = run_dir(tmp_path / "weights", [2.0, 1.5], [1.0, 0.8], weight=1.0 + 1e-7)
    check = compare("resume vs uninterrupted", weights, want, exact, 1.0)
    assert not check.passed and check.where == "final weights"
    assert "FAIL" in table([check]) and "exact" in table([check])
    # a loss near zero (GRPO's sums signed terms of about 1): rounding passes, a tenth of it does not
    near = run_dir(tmp_path / "near", [1e-3, 1e-3], [1.0, 0.8])
    rounded = run_dir(tmp_path / "rounded", [1e-3 + 2e-8, 1e-3], [1.0, 0.8])
    assert compare("2 processes vs one micro-batch", rounded, near, FLOAT32, 1.0).passed
    tenth = run_dir(tmp_path / "tenth", [1.1e-3, 1e-3], [1.0, 0.8])
    assert not compare("2 processes vs one micro-batch", tenth, near, FLOAT32, 1.0).passed
    short = run_dir(tmp_path / "short", [2.0], [1.0])
    assert math.isinf(compare("resume vs uninterrupted", short, want, exact, 1.0).worst)


# --- packed vs unpacked, for each kind of packed example ----------------------------------


def pair_rows(path):
    rows = [{"prompt": f"say {w}", "chosen": w * (1 + i % 3), "rejected": "no"} for i, w in enumerate("abcdefghij")]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def image_rows(root):
    """Chat rows about pictures in a folder beside the file, one picture each."""
    lines = []
    for i, colour in enumerate(sorted(COLOURS) * 3):
        png(root / f"{i}.png", size=(32 + 8 * (i % 2), 32), colour=COLOURS[colour])
        user = [{"type": "image", "image": f"{i}.png"}, {"type": "text", "text": "what colour?"}]
        lines.append({"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": colour}]})
    (root / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    return root / "rows.jsonl"


@pytest.fixture(scope="module")
def kinds(tiny_model, chat_file, tmp_path_factory):
    """(recipe, model, data, overrides) of each kind of packed example: SFT rows,
    preference pairs, a vision-language model's rows with their pictures."""
    root = tmp_path_factory.mktemp("kinds")
    (root / "images").mkdir()
    return {
        "rows": ("finetune", tiny_model, chat_file, []),
        "rows of bf16 weights": ("finetune", tiny_model, chat_file, ["model.dtype=bfloat16"]),
        "pairs": ("dpo", tiny_model, pair_rows(root / "pairs.jsonl"), []),
        "images": ("finetune", build("llava", root / "llava"), image_rows(root / "images"), []),
    }


def packed_check(kind, kinds, base_config):
    recipe, model, data, extra = kinds[kind]
    method = METHODS[recipe]
    given = [f"model.name_or_path={model}", f"data.train={data}", "data.packing=true", "data.max_seq_len=96", *extra]
    cfg = load_config(base_config, given, method.schema)
    return packing(cfg, method, model, [data], Where())


@pytest.mark.parametrize("kind", ["rows", "rows of bf16 weights", "pairs", "images"])
def test_packing_is_checked_sample_by_sample_for_every_kind(kind, kinds, base_config, monkeypatch):
    """Packed as a run packs them, every sample of every kind computes what it computes
    alone, to float32's rounding whatever the weights' dtype; given to the model without
    the positions and masks that isolate them (or, for pictures, with each sequence's
    pictures in another order), the check fails."""
    check = packed_check(kind, kinds, base_config)
    assert check.passed and check.tolerance == FLOAT32["loss"] and check.worst < 1e-5, check
    if kind == "images":  # each sample's pictures must land on its own tokens
        monkeypatch.setattr(verify.ImageCollator, "__call__", shuffled_images(verify.ImageCollator.__call__))
    else:
        monkeypatch.setattr(verify, "model_inputs", lambda model, batch: {"input_ids": batch["input_ids"]})
    check = packed_check(kind, kinds, base_config)
    assert not check.passed and check.where.startswith("sample ")


def shuffled_images(call):
    def collate(self, examples):
        batch = call(self, examples)
        if "doc_ids" in batch and len(batch["pixel_values"]) > 1:  # a packed sequence's pictures rolled
            batch["pixel_values"] = batch["pixel_values"].roll(1, dims=0)
        return batch

    return collate


# --- what makes layouts differ by design, and where the runs go ---------------------------


def test_what_the_config_does_by_design_is_said_with_the_layout_checks_it_fails():
    layouts = [Check("accumulation vs one micro-batch", 1e-3, 1e-5, 1.0), Check("resume vs uninterrupted", 1e-3, 0, 0)]
    explain(layouts, Findings(["config.router_jitter_noise=0.1"], []))
    assert layouts[0].note.startswith("dropout or router jitter is on (config.router_jitter_noise=0.1)")
    assert layouts[0].note.endswith("set model.dropout=none")
    assert not layouts[1].note  # the same draws after a resume: not the config's doing
    capacity = "config.capacity_factor=1.0: experts drop the tokens routed to them past their capacity"
    checks = [Check("2 processes vs one micro-batch", 1e-3, 1e-5, 1.0)]
    explain(checks, Findings([], [capacity]))
    assert checks[0].note.startswith("the update depends on the batch by design (config.capacity_factor=1.0")
    assert Findings(["config.attn_pdrop=0.1"], [capacity]).lines() == [
        "the model draws at random in training (config.attn_pdrop=0.1); set model.dropout=none",
        f"the update depends on the batch by design: {capacity}",
    ]


def test_the_runs_go_to_the_cpu_in_float32_unless_asked(monkeypatch, tmp_path):
    """By default every run is on the CPU, even where GPUs are, in float32; --mixed-precision
    sets the runs' precision and bounds; --device without a GPU is one line."""
    where = Where.chosen(False, None, None, None)
    assert (where.gpus, where.precision, where.rounding) == (0, "no", FLOAT32) and str(where) == "on the CPU in float32"
    assert Where.chosen(False, "bf16", None, None).rounding == HALF
    monkeypatch.setattr(verify, "gpu_count", lambda: 0)
    with pytest.raises(ConfigError, match="--device: no GPU is visible here"):
        Where.chosen(True, None, None, None)
    seen = []

    def run(command, env, **kw):
        seen.append((command, env))
        return type("Done", (), {"returncode": 0})()

    monkeypatch.setattr(verify.subprocess, "run", run)
    runner = verify.Runner("finetune", None, [], tmp_path, Where())
    runner.run(verify.Layout("reference", 1, 4, 1), tmp_path / "a")
    runner.run(verify.Layout("2 processes", 2, 2, 1), tmp_path / "b")
    assert all(env["CUDA_VISIBLE_DEVICES"] == "" and env["ACCELERATE_MIXED_PRECISION"] == "no" for _, env in seen)
    assert seen[1][1]["ACCELERATE_USE_CPU"] == "1" and "--multi_gpu" in seen[1][0]
    seen.clear()
    monkeypatch.setattr(verify, "gpu_count", lambda: 2)
    on_gpus = Where.chosen(True, "bf16", None, None)
    verify.Runner("finetune", None, [], tmp_path, on_gpus).run(verify.Layout("2", 2, 2, 1, precision="bf16"), tmp_path)
    command, env = seen[0]
    assert env.get("CUDA_VISIBLE_DEVICES") == os.environ.get("CUDA_VISIBLE_DEVICES")  # the GPUs, as they are
    assert "ACCELERATE_USE_CPU" not in env and command[command.index("--mixed_precision") + 1] == "bf16"


# --- a vision-language model: its tower shrunk too ------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_a_vision_tower_is_shrunk_and_its_images_still_pack_exactly(family, kinds, base_config, tmp_path):
    """A larger model than the test family's (its tower 3 times as wide and twice as deep,
    its language model twice as wide), with no weights at all (shrink reads the config,
    tokenizer and processor alone), comes back with a tower of 2 layers of width 32
    feeding the shrunk language model; the shrunk model takes the image rows, packed, each
    sample as it is alone."""
    import shutil

    from transformers import AutoConfig

    big = build(family, tmp_path / "big")
    for weights in big.glob("*.safetensors"):
        weights.unlink()
    config = AutoConfig.from_pretrained(big)
    tower, text = config.vision_config, config.get_text_config()
    for key in ("hidden_size", "embed_dim", "intermediate_size", "projection_dim"):
        if isinstance(getattr(tower, key, None), int):
            setattr(tower, key, 3 * getattr(tower, key))
    for key in ("num_hidden_layers", "depth", "num_attention_heads", "num_heads"):
        if isinstance(getattr(tower, key, None), int):
            setattr(tower, key, 2 * getattr(tower, key))
    text.hidden_size, text.num_attention_heads = 2 * text.hidden_size, 2 * text.num_attention_heads  # heads of 16
    if hasattr(tower, "out_hidden_size"):
        tower.out_hidden_size = text.hidden_size
    config.save_pretrained(big)
    given = ModelConfig(name_or_path=str(big))
    small = shrink(given, check_model(given, 256), tmp_path / "s")
    shrunk = AutoConfig.from_pretrained(small).vision_config
    width = next(v for k in ("embed_dim", "hidden_size") if isinstance(v := getattr(shrunk, k, None), int))
    layers = next(v for k in ("num_hidden_layers", "depth") if isinstance(v := getattr(shrunk, k, None), int))
    assert width == 32 and layers == 2, shrunk
    assert getattr(shrunk, "out_hidden_size", 64) == 64  # what the tower hands the language model
    _, _, data, _ = kinds["images"]
    method = METHODS["finetune"]
    given = [f"model.name_or_path={small}", f"data.train={data}", "data.packing=true", "data.max_seq_len=128"]
    check = packing(load_config(base_config, given, method.schema), method, small, [data], Where())
    assert check.passed and check.worst < 1e-5, check
    shutil.rmtree(small)


SHIPPED = sorted((Path(__file__).parents[1] / "recipes" / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_every_shipped_config_stays_valid_under_the_runs_settings(path, tmp_path):
    """What verify's runs take (data.max_seq_len capped, 3 steps, a checkpoint each, the
    method's own: GRPO's extra reward, completions as much shorter as the sequences) on top
    of each shipped config is still a config its recipe accepts: a completion length the
    cap left no prompt room for was refused before any run."""
    method = METHODS[recipe_named(path, [])]
    cfg = load_config(path, [], method.schema, sections())
    given = [*verify.fixed(cfg, tmp_path / "model", [tmp_path / "rows.jsonl"]), *method.verify(cfg, runs_seq_len(cfg))]
    runs = load_config(path, given, method.schema, sections())
    assert runs.data.max_seq_len == min(cfg.data.max_seq_len, verify.MAX_SEQ_LEN) and runs.train.max_steps == 3
    for section in ("grpo", "distill"):
        if hasattr(cfg, section) and cfg.data.max_seq_len > verify.MAX_SEQ_LEN:  # scaled as the sequences are
            want = getattr(cfg, section).max_completion_length * verify.MAX_SEQ_LEN // cfg.data.max_seq_len
            assert getattr(runs, section).max_completion_length == want


def test_a_failed_run_is_one_line_naming_the_users_model_not_the_scratch_copy(monkeypatch, tmp_path):
    scratch = str(tmp_path / "model")
    said = f"error: model.name_or_path: cannot build a model from the config of '{scratch}' (no such class)\n"

    def run(command, env, **kw):
        return type("Failed", (), {"returncode": 1, "stderr": "Traceback ...\n" + said})()

    monkeypatch.setattr(verify.subprocess, "run", run)
    runner = verify.Runner("reward", None, [], tmp_path, Where(), {scratch: "org/granite (shrunk)"})
    with pytest.raises(ConfigError) as e:
        runner.run(verify.Layout("reference", 1, 4, 1), tmp_path / "a")
    assert e.value.problems == [
        "llmtrain verify: the reference run failed: model.name_or_path: cannot build a model from the config of "
        "'org/granite (shrunk)' (no such class)"
    ]


def test_the_runs_read_the_shrunk_copy_without_the_users_hub_revision(tmp_path):
    """A hub model pinned to a revision: the shrunk copy is a local directory, which a run
    refuses beside model.revision, so the runs clear it; with --full the runs take the hub
    model itself, at its revision."""
    method = METHODS["finetune"]
    given = ["model.name_or_path=org/model", "model.revision=v1", "data.train=rows.jsonl"]
    cfg = load_config(None, given, method.schema, sections())
    shrunk = load_config(None, [*given, *verify.fixed(cfg, tmp_path / "model", [tmp_path / "r.jsonl"])], method.schema)
    assert shrunk.model.revision == "" and shrunk.model.name_or_path == str(tmp_path / "model")
    full = load_config(None, [*given, *verify.fixed(cfg, "org/model", [tmp_path / "r.jsonl"])], method.schema)
    assert full.model.revision == "v1"
