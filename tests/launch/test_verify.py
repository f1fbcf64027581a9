"""`llmtrain verify` (llmtrain/verify.py) as a user runs it: it passes on a model and data
that keep the guarantees, and fails, naming the check and why, where they cannot hold."""

import json
import os
import sys

import pytest
import torch

from tests.support.runs import LLMTRAIN, run_python

pytestmark = pytest.mark.slow


def verify(args: list[str], env: dict):
    return run_python([sys.executable, str(LLMTRAIN), "verify", *args], env, 900)


def test_verify_passes_where_the_guarantees_hold(base_config, tiny_model, chat_file, cache_env, tmp_path):
    report = tmp_path / "report.json"
    given = ["--config", str(base_config), f"model.name_or_path={tiny_model}", f"data.train={chat_file}"]
    proc = verify([*given, "data.packing=true", "--output", str(report)], cache_env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    checks = json.loads(report.read_text())["checks"]
    names = [c["name"] for c in checks]
    assert names == [
        "packed vs each sample alone",
        "accumulation vs one micro-batch",
        "2 processes vs one micro-batch",
        "the same run twice",
        "resume vs uninterrupted",
        "resume on 2 processes vs uninterrupted",
    ]
    assert all(c["passed"] for c in checks)
    assert next(c for c in checks if c["name"] == "resume vs uninterrupted")["worst"] == 0.0  # exact
    assert "6 of 6 checks passed" in proc.stdout
    for name in names:
        assert any(line.startswith(name) and "pass" in line for line in proc.stdout.splitlines()), name


def test_verify_names_random_draws_left_on(tokenizer, chat_file, base_config, cache_env, tmp_path):
    """A mixture-of-experts model whose config keeps dropout and router jitter on (SFT's
    model.dropout=model, the default, keeps them): said before the runs, and each layout
    draws other masks, so the layout check fails saying why and what to set
    (tests/test_model.py: model.dropout=none turns every one of them off)."""
    from transformers import AutoConfig

    from tests.support.architectures import build

    model = build("mixtral", tmp_path / "jittery", tokenizer)
    config = AutoConfig.from_pretrained(model)
    config.attention_dropout, config.router_jitter_noise = 0.2, 0.1
    config.save_pretrained(model)
    given = ["--config", str(base_config), f"model.name_or_path={model}", f"data.train={chat_file}"]
    proc = verify([*given, "--only", "accumulation"], cache_env)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    draws = "config.attention_dropout=0.2, config.router_jitter_noise=0.1"
    assert f"note: the model draws at random in training ({draws}); set model.dropout=none" in proc.stdout
    said = f"dropout or router jitter is on ({draws}): each layout draws other masks; set model.dropout=none"
    assert f"accumulation vs one micro-batch: {said}" in proc.stdout


# Bugs put in on purpose, each in every process of the runs (a sitecustomize on PYTHONPATH),
# which verify must catch and name.
BUGS = {
    # each micro-batch's loss is its own token mean, not its share of the global batch's
    "per_micro_batch": """
import llmtrain.core.objective as o

call = o.TokenLoss.__call__


def per_micro_batch(self, model, batch):
    out = call(self, model, batch)
    return o.Loss(out.total / max(self.count(batch), 1) * 8.0, out.metrics)


o.TokenLoss.__call__ = per_micro_batch
""",
    # the second process trains one row fewer of each micro-batch
    "drops_a_row": """
import llmtrain.core.source as s

epoch = s.LoaderBatches.epoch


def dropping(self, e, skip=0):
    batches = epoch(self, e, skip)
    if self.accelerator.process_index != 1:
        return batches
    return ({k: v[:-1] if getattr(v, "ndim", 0) and v.shape[0] > 1 else v for k, v in b.items()} for b in batches)


s.LoaderBatches.epoch = dropping
""",
    # packed samples see each other: the model gets the packed tokens alone, without the
    # positions and masks that keep each sample to itself
    "sees_the_others": """
import llmtrain.core.objective as o

o.model_inputs = lambda model, batch: {"input_ids": batch["input_ids"]}
""",
}


@pytest.mark.parametrize(
    "bug, only, failed",
    [
        ("per_micro_batch", "accumulation", "accumulation vs one micro-batch"),
        ("drops_a_row", "processes", "2 processes vs one micro-batch"),
        ("sees_the_others", "packing", "packed vs each sample alone"),
    ],
)
def test_verify_fails_on_a_bug_naming_the_check(
    bug, only, failed, base_config, tiny_model, chat_file, cache_env, tmp_path
):
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(BUGS[bug])
    env = dict(cache_env, PYTHONPATH=os.pathsep.join(p for p in (str(site), cache_env.get("PYTHONPATH")) if p))
    given = ["--config", str(base_config), f"model.name_or_path={tiny_model}", f"data.train={chat_file}"]
    full = ["--full"] if only == "packing" else []  # the packed check on the model's own weights
    proc = verify([*given, "data.packing=true", "--only", only, *full], env)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"; failed: {failed}" in proc.stdout
    if full:
        assert f"on {tiny_model} with its own weights, on the CPU in float32" in proc.stdout


BATCHY = """
import torch
from transformers import LlamaConfig, LlamaForCausalLM


class BatchyConfig(LlamaConfig):
    model_type = "batchy"


class Centred(torch.nn.Embedding):
    def forward(self, ids):  # a layer whose output depends on the batch: centred over it
        out = super().forward(ids)
        return out - 0.5 * out.mean(0, keepdim=True)


class BatchyForCausalLM(LlamaForCausalLM):
    config_class = BatchyConfig

    def __init__(self, config):
        super().__init__(config)
        self.model.embed_tokens = Centred(config.vocab_size, config.hidden_size, config.pad_token_id)
"""


def test_verify_fails_on_a_model_whose_layers_depend_on_the_batch(
    base_config, tiny_model, chat_file, cache_env, tmp_path
):
    """A model of the user's own code (model.trust_remote_code=true) that centres its
    embeddings over the batch: a micro-batch of 1 computes another function than one of 4."""
    from transformers import AutoConfig, AutoTokenizer

    model = tmp_path / "batchy"
    model.mkdir()
    (model / "modeling_batchy.py").write_text(BATCHY)
    config = AutoConfig.from_pretrained(tiny_model).to_dict()
    config |= {"model_type": "batchy", "architectures": ["BatchyForCausalLM"]}
    config["auto_map"] = {
        "AutoConfig": "modeling_batchy.BatchyConfig",
        "AutoModelForCausalLM": "modeling_batchy.BatchyForCausalLM",
    }
    (model / "config.json").write_text(json.dumps(config))
    AutoTokenizer.from_pretrained(tiny_model).save_pretrained(model)
    given = ["--config", str(base_config), f"model.name_or_path={model}", f"data.train={chat_file}"]
    proc = verify([*given, "model.trust_remote_code=true", "--only", "accumulation"], cache_env)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "; failed: accumulation vs one micro-batch" in proc.stdout
    assert "a layer whose output depends on the batch" in proc.stdout


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_verify_runs_on_the_gpus_in_their_precision(base_config, tiny_model, chat_file, cache_env, tmp_path):
    """--device: every run on the GPUs here, in bf16, held to bf16's bounds; on one GPU the
    checks of 2 processes are skipped, saying so, and the others pass."""
    report = tmp_path / "report.json"
    given = ["--config", str(base_config), f"model.name_or_path={tiny_model}", f"data.train={chat_file}"]
    proc = verify(
        [*given, "data.packing=true", "--device", "--mixed-precision", "bf16", "--output", str(report)], cache_env
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    got = json.loads(report.read_text())
    assert got["device"] == f"{torch.cuda.device_count()} gpu" and got["mixed_precision"] == "bf16"
    ran = [c for c in got["checks"] if not c["skipped"]]
    assert all(c["passed"] for c in ran) and len(ran) >= 4
    assert all(c["tolerance"] in (0.0, 1e-2, 5e-2) for c in ran)  # bf16's bounds, or exact
    if torch.cuda.device_count() == 1:
        assert [c["name"] for c in got["checks"] if c["skipped"]] == [
            "2 processes vs one micro-batch",
            "resume on 2 processes vs uninterrupted",
        ]
