"""The reference pass of a full fine-tune's preference run: every pair's answers get the
log-probs they have under the starting weights, numbered across train and eval, and the
table is cached in output_dir under a key of the model's files and the data."""

import json
import os
import shutil

import pytest
import torch

from llmtrain.config import load_config
from llmtrain.preference.config import DPOConfig
from llmtrain.preference.loss import PreferenceLoss
from llmtrain.preference.pairs import PairCollator
from llmtrain.preference.reference import CACHE, ReferencePass, compute


@pytest.fixture(scope="module")
def sets(tmp_path_factory, tokenizer):
    """7 train pairs and 4 eval pairs, numbered 0..6 and 7..10."""
    from llmtrain.config import DataConfig
    from llmtrain.demo import make_pairs, write_jsonl
    from llmtrain.preference.pairs import PAIRS

    root = tmp_path_factory.mktemp("ref")
    out, first = [], 0
    for name, n, seed in (("train", 7, 1), ("eval", 4, 2)):
        write_jsonl(make_pairs(n, seed), root / f"{name}.jsonl")
        ds, _ = PAIRS.prepare(f"data.{name}", [str(root / f"{name}.jsonl")], tokenizer, DataConfig(max_seq_len=256))
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


def test_a_stop_signal_ends_the_pass_at_an_agreed_batch(model, sets, accelerator, capsys, monkeypatch):
    """Every process leaves the pass at the same batch (the window agreement carries the
    signal), so no process is left waiting in a collective for one that exited."""
    import os
    import signal

    from llmtrain.distributed.stop import StopRequest

    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    stop, objective = StopRequest().install(), PreferenceLoss("sigmoid", 0.1)
    passes = []
    logps = objective.logps

    def counted(*args):
        passes.append(1)
        if len(passes) == 2:
            os.kill(os.getpid(), signal.SIGUSR1)  # one process's preemption warning, mid-pass
        return logps(*args)

    monkeypatch.setattr(objective, "logps", counted)
    empty = PairCollator(0).empty_batch()
    try:
        with pytest.raises(SystemExit) as exited, stop.deferred(after=None):
            compute(model, objective, sets, PairCollator(0), 1, accelerator, empty, None, stop=stop)
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
    assert exited.value.code == 0 and len(passes) == 2  # the batch under way ends, no other starts
    assert capsys.readouterr().out == "stopped on SIGUSR1 during the reference pass; nothing was trained yet\n"


def test_bad_data_in_the_pass_is_its_one_error_line(model, sets, accelerator):
    """Drawn with the stop protocol, a DataError becomes the window's fault: it is raised as
    itself on every process, not as 'pairs got no log-probs' (a bug's error)."""
    from llmtrain.distributed.stop import StopRequest
    from llmtrain.errors import DataError

    class Collate(PairCollator):
        def __call__(self, rows):
            raise DataError("data.train: prefs.jsonl line 4: an answer the template cannot render")

    with pytest.raises(DataError, match="^data.train: prefs.jsonl line 4: an answer"):
        compute(model, PreferenceLoss("sigmoid", 0.1), sets, Collate(0), 1, accelerator, {}, None, stop=StopRequest())


def test_the_table_is_cached_and_computed_again_when_the_model_files_change(
    model, sets, accelerator, tiny_model, tmp_path, monkeypatch
):
    import llmtrain.preference.reference as reference

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


def test_a_cache_that_cannot_be_written_is_a_warning_and_training_goes_on(
    model, sets, accelerator, tiny_model, tmp_path, monkeypatch, capsys
):
    """A full disk at the cache (torch's writer: 'unexpected pos') crashed the main process,
    and the other ranks with it; the table is in memory on every process."""
    import llmtrain.preference.reference as reference

    def full(path, key, table):
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 832 vs 726")

    monkeypatch.setattr(reference, "save_cached", full)
    given = [f"model.name_or_path={tiny_model}", "data.train=x.jsonl", f"output_dir={tmp_path}"]
    cfg, objective = load_config(None, given, DPOConfig), PreferenceLoss("sigmoid", 0.1)
    ReferencePass(cfg, objective, sets, PairCollator(0))(model, accelerator, PairCollator(0).empty_batch(), print)
    assert objective.reference is not None and objective.reference.shape == (sum(len(s) for s in sets), 2)
    assert f"warning: reference log-probs: cannot cache them in {tmp_path / CACHE} (unexpected pos" in (
        capsys.readouterr().err
    )


def test_a_reference_with_non_finite_log_probs_is_one_error_naming_the_model(
    model, sets, accelerator, tiny_model, tmp_path
):
    """Not "pairs got no log-probs": the cause is the model, and nothing is cached."""
    import copy

    from llmtrain.errors import UserError

    broken = copy.deepcopy(model)
    with torch.no_grad():
        broken.model.norm.weight[0] = float("nan")
    cfg = load_config(
        None, [f"model.name_or_path={tiny_model}", "data.train=x.jsonl", f"output_dir={tmp_path}"], DPOConfig
    )
    empty = PairCollator(0).empty_batch()
    with pytest.raises(UserError) as e:
        ReferencePass(cfg, PreferenceLoss("sigmoid", 0.1), sets, PairCollator(0))(
            broken, accelerator, empty, lambda _: None
        )
    assert str(e.value).splitlines() == [
        f"model.name_or_path: the reference model '{tiny_model}' gives non-finite log-probs for 11 of 11 pairs "
        "(model.dtype=float32); its weights hold NaN or inf, or its activations overflow in half precision: "
        "check the model's weights, or run with model.dtype=float32 or bfloat16"
    ]
    assert not (tmp_path / CACHE).exists()


@pytest.fixture(scope="module")
def references(tmp_path_factory, tiny_model):
    """Reference model directories (configs and tokenizers only: the check loads no
    weights) that do and do not read the policy's token ids as the policy does."""
    from transformers import AutoConfig, AutoTokenizer

    root = tmp_path_factory.mktemp("references")
    config, tok = AutoConfig.from_pretrained(tiny_model), AutoTokenizer.from_pretrained(tiny_model)
    n = config.vocab_size

    def save(name, vocab_size, tokenizer=None):
        config.vocab_size = vocab_size
        config.save_pretrained(root / name)
        if tokenizer is not None:
            tokenizer.save_pretrained(root / name)
        return root / name

    def other_tokenizer():  # the policy's, with the ids of two letters swapped
        path = save("other_tokenizer", n, tok) / "tokenizer.json"
        data = json.loads(path.read_text())
        vocab = data["model"]["vocab"]
        vocab["a"], vocab["b"] = vocab["b"], vocab["a"]
        path.write_text(json.dumps(data))
        return path.parent

    return {
        "same": save("same", n, tok),
        "padded": save("padded", n + 64, tok),  # the same tokenizer, embeddings padded to a round size
        "weights_only": save("weights_only", n),
        "smaller": save("smaller", n - 10),
        "other_tokenizer": other_tokenizer(),
        "bigger_no_tokenizer": save("bigger_no_tokenizer", n + 50),
    }


@pytest.mark.parametrize("name", ["same", "padded", "weights_only"])
def test_a_reference_with_the_policys_token_ids_is_accepted(references, tiny_model, tokenizer, name):
    from llmtrain.model import check_reference

    cfg = load_config(
        None, [f"model.name_or_path={tiny_model}", "data.train=x.jsonl", f"dpo.reference={references[name]}"], DPOConfig
    )
    check_reference(cfg.dpo.reference, "dpo.reference", cfg.model, tokenizer)


@pytest.mark.parametrize(
    "name,says",
    [
        ("smaller", "embeds {small} tokens, but the policy's tokenizer has a vocabulary of {n} tokens"),
        ("other_tokenizer", "maps"),
        ("bigger_no_tokenizer", "and no tokenizer to show it is the policy's"),
    ],
)
def test_a_reference_that_reads_other_token_ids_is_one_error_before_anything_loads(
    references, tiny_model, tokenizer, name, says
):
    """A smaller vocabulary used to end in an IndexError in the reference pass; another
    tokenizer, or a bigger vocabulary that cannot be shown to be the policy's, trained
    against log-probs of other texts without a word."""
    from llmtrain.errors import UserError
    from llmtrain.model import check_reference

    cfg = load_config(
        None, [f"model.name_or_path={tiny_model}", "data.train=x.jsonl", f"dpo.reference={references[name]}"], DPOConfig
    )
    with pytest.raises(UserError) as e:
        check_reference(cfg.dpo.reference, "dpo.reference", cfg.model, tokenizer)
    lines = str(e.value).splitlines()
    assert len(lines) == 1 and lines[0].startswith("dpo.reference: ") and str(references[name]) in lines[0]
    assert says.format(small=len(tokenizer) - 10, n=len(tokenizer)) in lines[0]


@pytest.mark.parametrize("section", ["dpo", "grpo"])
def test_a_reference_path_that_is_no_directory_says_so(tiny_model, tokenizer, tmp_path, section):
    """Not the hub's rules for repository names, which a path never meets."""
    from llmtrain.errors import UserError
    from llmtrain.model import check_reference
    from llmtrain.rl.config import GRPOConfig

    missing = tmp_path / "sft" / "final"
    overrides = [f"model.name_or_path={tiny_model}", "data.train=x.jsonl", f"{section}.reference={missing}"]
    if section == "grpo":
        overrides.append("grpo.beta=0.1")
    cfg = load_config(None, overrides, DPOConfig if section == "dpo" else GRPOConfig)
    with pytest.raises(UserError) as e:
        check_reference(getattr(cfg, section).reference, f"{section}.reference", cfg.model, tokenizer)
    assert str(e.value).startswith(f"{section}.reference: no such directory: {missing}; give a local model directory")
