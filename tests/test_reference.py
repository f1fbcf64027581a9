"""The reference pass of a full fine-tune's preference run: every pair's answers get the
log-probs they have under the starting weights, numbered across train and eval, and the
table is cached in output_dir under a key of the model's files and the data."""

import os
import shutil

import pytest
import torch

from llmtrain.config import DPOConfig, load_config
from llmtrain.pairs import PairCollator
from llmtrain.preference import PreferenceLoss
from llmtrain.reference import CACHE, ReferencePass, compute


@pytest.fixture(scope="module")
def sets(tmp_path_factory, tokenizer):
    """7 train pairs and 4 eval pairs, numbered 0..6 and 7..10."""
    from llmtrain.config import DataConfig
    from llmtrain.demo import make_pairs, write_jsonl
    from llmtrain.pairs import prepare_pairs

    root = tmp_path_factory.mktemp("ref")
    out, first = [], 0
    for name, n, seed in (("train", 7, 1), ("eval", 4, 2)):
        write_jsonl(make_pairs(n, seed), root / f"{name}.jsonl")
        ds, _ = prepare_pairs(f"data.{name}", [str(root / f"{name}.jsonl")], tokenizer, DataConfig(max_seq_len=256))
        out.append(ds.add_column("pair_index", list(range(first, first + len(ds)))))
        first += len(ds)
    return out


@pytest.fixture(scope="module")
def model(tiny_model):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)


def alone(model, pair) -> list[float]:
    with torch.no_grad():
        sums, _ = PreferenceLoss("sigmoid", 0.1).logps(model.eval(), PairCollator(0)([pair]))
    return sums.tolist()


@pytest.fixture
def accelerator():
    from accelerate import Accelerator

    return Accelerator(cpu=True)


def test_every_pair_gets_the_log_probs_of_its_answers_alone(model, sets, accelerator):
    empty = PairCollator(0).empty_batch()
    table = compute(model, PreferenceLoss("sigmoid", 0.1), sets, PairCollator(0), 3, accelerator, empty, None)
    pairs = [p for s in sets for p in s]
    assert table.shape == (len(pairs), 2)
    for pair in pairs:
        assert table[pair["pair_index"]].tolist() == pytest.approx(alone(model, pair), abs=1e-4)
    model.train()  # the pass restores the mode it found
    compute(model, PreferenceLoss("sigmoid", 0.1), sets, PairCollator(0), 3, accelerator, empty, None)
    assert model.training


def test_the_table_is_cached_and_computed_again_when_the_model_files_change(
    model, sets, accelerator, tiny_model, tmp_path, monkeypatch
):
    import llmtrain.reference as reference

    copy = tmp_path / "model"
    shutil.copytree(tiny_model, copy)  # keeps the files' modification times
    cfg = load_config(None, [f"model.name_or_path={copy}", "data.train=x.jsonl", f"output_dir={tmp_path}"], DPOConfig)
    empty = PairCollator(0).empty_batch()
    calls = []
    real = reference.compute

    def counted(*args):
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(reference, "compute", counted)
    objective = PreferenceLoss("sigmoid", 0.1)
    ReferencePass(cfg, objective, [*sets, None], PairCollator(0))(model, accelerator, empty, lambda _: None)
    first = objective.reference.clone()
    assert (tmp_path / CACHE).is_file() and len(calls) == 1
    objective.reference = None
    ReferencePass(cfg, objective, sets, PairCollator(0))(model, accelerator, empty, lambda _: None)
    assert len(calls) == 1 and torch.equal(objective.reference, first)  # read back, not computed

    # New weights of the same size under the old modification time (`cp -p`, `rsync -t`):
    # the key is the files' content, so the table is computed again.
    weights = copy / "model.safetensors"
    stat, data = weights.stat(), bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    ReferencePass(cfg, objective, sets, PairCollator(0))(model, accelerator, empty, lambda _: None)
    assert len(calls) == 2
    (tmp_path / CACHE).write_bytes(b"torn")  # a torn or foreign file: computed again
    ReferencePass(cfg, objective, sets, PairCollator(0))(model, accelerator, empty, lambda _: None)
    assert len(calls) == 3 and torch.equal(objective.reference, first)
