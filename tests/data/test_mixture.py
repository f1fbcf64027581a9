"""Mixing sources by fraction (a seeded share of each source per epoch, the same count
every epoch), data.eval_fraction's held-out rows, per-source packing, streamed sources drawn
by fraction, and what the summary and `llmtrain plan` say. A mixed run resumed exactly:
tests/launch/test_mixture.py."""

from collections import Counter
from itertools import islice

import pytest
import torch

from llmtrain.config import DataConfig, DataSource, load_config
from llmtrain.data.batches import EpochSampler
from llmtrain.data.build import ROWS
from llmtrain.data.mixture import Mix, Mixture, hold_out, split_and_mix, training_set
from llmtrain.data.packing import PackedDataset, pack_sources
from llmtrain.data.stream import StreamedRows
from llmtrain.demo import write_jsonl
from llmtrain.errors import ConfigError, DataError
from tests.support.data import write_sources
from tests.test_plan import plan


def epoch(mix: Mix, seed: int, e: int, shuffle: bool = True) -> list[int]:
    sampler = EpochSampler(sum(mix.sizes), seed, shuffle, mix)
    sampler.set_epoch(e)
    return list(sampler)


def test_each_source_gives_an_epoch_its_share_drawn_again_each_epoch():
    mix = Mix((10, 4, 6), (0.5, 2.5, 1.0))  # sources at 0-9, 10-13, 14-19
    assert mix.counts() == [5, 10, 6]
    seen = []
    for e in range(4):
        order = epoch(mix, seed=3, e=e)
        assert len(order) == 21  # every epoch the same size: the step count is known ahead
        n = Counter(order)
        first = sorted(i for i in n if i < 10)
        assert len(first) == 5 and all(n[i] == 1 for i in first)  # half of source 0, each once
        assert sorted(n[i] for i in range(10, 14)) == [2, 2, 3, 3]  # twice over, plus half again
        assert all(n[i] == 1 for i in range(14, 20))  # fraction 1: every row once
        assert order == epoch(mix, seed=3, e=e)  # drawn from (seed, epoch) alone: a resume draws the same
        seen.append(first)
    assert len({tuple(s) for s in seen}) > 1  # a different subset in other epochs
    assert epoch(mix, seed=4, e=0) != epoch(mix, seed=3, e=0)


def test_an_unshuffled_mixture_keeps_each_sources_rows_in_file_order():
    order = epoch(Mix((6, 3), (0.5, 2)), seed=1, e=0, shuffle=False)
    assert order[3:] == [6, 7, 8, 6, 7, 8]
    assert order[:3] == sorted(order[:3]) and set(order[:3]) <= set(range(6))


def test_without_fractions_the_order_is_the_plain_seeded_permutation():
    """The order existing runs had: a mixture of fraction-1 sources changes no number."""
    for shuffle in (True, False):
        plain = EpochSampler(20, 5, shuffle)
        mixed = EpochSampler(20, 5, shuffle, Mix((12, 8), (1.0, 1.0)))
        for e in (0, 3):
            plain.set_epoch(e)
            mixed.set_epoch(e)
            want = torch.randperm(20, generator=torch.Generator().manual_seed(5 + e)).tolist() if shuffle else None
            assert list(plain) == list(mixed) == (want or list(range(20)))


def test_packing_a_mixture_packs_each_source_alone():
    lengths = [5, 3, 4, 6, 2, 7, 1, 1]
    bins, counts = pack_sources(lengths, 10, [3, 5])
    assert sum(counts) == len(bins) and counts[0] == 2
    assert all(max(b) < 3 for b in bins[: counts[0]]) and all(min(b) >= 3 for b in bins[counts[0] :])
    assert sorted(i for b in bins for i in b) == list(range(8))
    assert all(sum(lengths[i] for i in b) <= 10 for b in bins)
    assert pack_sources(lengths, 10, None)[1] == [len(pack_sources(lengths, 10, None)[0])]


class Rows(list):
    """Enough of a datasets.Dataset for hold_out and PackedDataset."""

    def select(self, indices):
        return Rows(self[i] for i in indices)

    def __getitem__(self, key):
        if isinstance(key, str):
            return [r[key] for r in self]
        return super().__getitem__(key)


def test_eval_fraction_holds_out_a_seeded_share_of_each_source():
    rows = Rows({"id": i, "n_trained": 1} for i in range(30))
    train, sizes, held = hold_out(rows, [20, 10], 0.2, seed=9)
    assert sizes == [16, 8] and len(held) == 6
    assert sum(1 for r in held if r["id"] < 20) == 4  # in proportion, from each source
    assert sorted(train["id"] + held["id"]) == list(range(30))  # disjoint, and nothing lost
    assert train["id"][:16] == sorted(train["id"][:16]) and max(train["id"][:16]) < 20  # sources stay in order
    again = hold_out(rows, [20, 10], 0.2, seed=9)
    assert again[2]["id"] == held["id"] and hold_out(rows, [20, 10], 0.2, seed=10)[2]["id"] != held["id"]
    with pytest.raises(DataError, match="data.eval_fraction: 0.01 of data.train's 30 usable rows holds out none"):
        hold_out(rows, [20, 10], 0.01, seed=9)


def test_a_source_with_too_small_a_share_is_warned_about_and_an_empty_epoch_refused(capsys):
    rows = Rows({"length": 4} for _ in range(12))
    examples = training_set(rows, Mix((10, 2), (0.1, 0.2)))
    assert isinstance(examples, Mixture) and examples.mix.counts() == [1, 0]
    assert "warning: data.train[1].fraction: 0.2 of 2 rows is none per epoch" in capsys.readouterr().err
    with pytest.raises(DataError, match="take no row from any source"):
        training_set(rows, Mix((10, 2), (0.01, 0.2)))

    def pack(r, sizes):
        return PackedDataset(r, 8, sizes)

    packed = training_set(rows, Mix((10, 2), (0.5, 1.0)), pack)
    assert packed.mix.sizes == (5, 1) and len(packed) == 6  # two rows a sequence, each source alone


def test_data_train_entries_take_a_path_and_a_fraction_with_errors_naming_the_entry():
    base = ["model.name_or_path=m", "output_dir=o"]
    cfg = load_config(None, [*base, "data.train=[a.jsonl, {path: b.jsonl, fraction: 0.5}]"])
    assert cfg.data.train == ["a.jsonl", DataSource("b.jsonl", 0.5)]
    for train, why in [
        ("[{path: b.jsonl, fraction: 0}]", "data.train[0].fraction: must be positive, got 0.0"),
        ("[a.jsonl, {path: b.jsonl, fracton: 2}]", "data.train[1].fracton: unknown key; did you mean"),
        ("[{fraction: 2}]", "data.train[0].path: empty"),
        ("[3]", "data.train[0]: expected a string or a mapping {path: ..., fraction: ...}, got 3"),
    ]:
        with pytest.raises(ConfigError) as e:
            load_config(None, [*base, f"data.train={train}"])
        assert str(e.value).splitlines() == [why] or str(e.value).startswith(why), str(e.value)
    with pytest.raises(ConfigError, match="data.eval_fraction: data.eval is set too"):
        load_config(None, [*base, "data.train=a.jsonl", "data.eval=b.jsonl", "data.eval_fraction=0.1"])
    with pytest.raises(ConfigError, match="data.eval_fraction: a stream cannot hold rows out"):
        load_config(None, [*base, "data.train=a", "data.eval_fraction=0.1", "data.streaming=true", "train.max_steps=5"])
    cfg = load_config(None, [*base, "data.train=a.jsonl", "data.eval_fraction=0.1", "eval.every_steps=5"])
    assert cfg.data.eval_fraction == 0.1  # evaluation needs no data.eval then


def test_the_summary_names_each_sources_rows_tokens_and_share(tmp_path, tokenizer):
    a, b = write_sources(tmp_path)
    train = [DataSource(a, 0.5), b]
    cfg = load_config(None, ["model.name_or_path=m", "output_dir=o", "data.train=x", "data.eval_fraction=0.1"])
    cfg.data.train = train
    rows, stats = ROWS.prepare("data.train", [a, b], tokenizer, cfg.data)
    rows, mix, held, lines = split_and_mix(cfg, rows, stats, tokenizer, ROWS.prepare)
    assert mix == Mix((18, 9), (0.5, 1.0)) and len(held) == 3 and len(rows) == 27
    assert lines[0].startswith("data.train: 30/30 rows kept")
    assert lines[1].startswith(
        "data.eval: 3 rows held out of data.train (data.eval_fraction=0.1, seeded by train.seed)"
    )
    assert lines[1].endswith("trained tokens; 27 rows left in data.train")  # data.train's line counts them before
    tokens_a = sum(rows["n_trained"][:18])
    assert lines[2] == (
        f"  {a}: 18 rows, {tokens_a} trained tokens; fraction 0.5: 9 rows, about {round(tokens_a / 2)} trained "
        "tokens per epoch"
    )
    assert lines[3] == f"  {b}: 9 rows, {sum(rows['n_trained'][18:])} trained tokens"


def texts(stream, tokenizer) -> list[str]:
    return [tokenizer.decode(e["input_ids"], skip_special_tokens=True) for e in stream]


def test_streamed_sources_are_drawn_in_proportion_to_their_fractions(tmp_path, tokenizer):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    write_jsonl([{"text": f"a{i}"} for i in range(400)], a)
    write_jsonl([{"text": f"b{i}"} for i in range(400)], b)
    config = DataConfig(train=[DataSource(str(a), 3.0), DataSource(str(b), 1.0)], max_seq_len=32, shuffle=False)

    def read(e=0, rank=0):
        stream = StreamedRows("data.train", tokenizer, config, seed=7, rank=rank, world=1)
        stream.set_epoch(e)
        return texts(stream, tokenizer)

    first = read()
    share = sum(t.startswith("a") for t in first[:200]) / 200
    assert 0.68 < share < 0.82  # about 3 in 4 while both last
    assert sorted(first) == sorted([f"a{i}" for i in range(400)] + [f"b{i}" for i in range(400)])  # a pass reads all
    assert [t for t in first if t.startswith("a")] == [f"a{i}" for i in range(400)]  # each source in its order
    assert read() == first and read(e=1) != first  # the same draw again (resume), another each pass

    # Per-source counts of what was read so far, as llmtrain plan shows for a stream's start
    stream = StreamedRows("data.train", tokenizer, config, seed=7, rank=0, world=1)
    start = list(islice(stream.rows(), 200))
    source = [t[0] for t in texts(start, tokenizer)]
    n_a = source.count("a")
    tokens = [sum(sum(x != -100 for x in e["labels"]) for e, s in zip(start, source) if s == name) for name in "ab"]
    assert stream.source_lines() == [
        f"  {a} (fraction 3): {n_a}/{n_a} rows kept, {tokens[0]} trained tokens, {n_a / 200:.1%} of the rows",
        f"  {b}: {200 - n_a}/{200 - n_a} rows kept, {tokens[1]} trained tokens, {(200 - n_a) / 200:.1%} of the rows",
    ]


def test_plan_counts_rows_and_tokens_per_source_and_the_mixed_epoch(base_config, tiny_model, cache_env, tmp_path):
    a, b = write_sources(tmp_path)
    proc = plan(
        "--config",
        str(base_config),
        f"model.name_or_path={tiny_model}",
        f"data.train=[{{path: {a}, fraction: 0.5}}, {{path: {b}, fraction: 2}}]",
        "data.eval_fraction=0.1",
        "train.micro_batch_size=2",
        env=cache_env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "data.eval: 3 rows held out of data.train" in out
    assert f"  {a}: 18 rows," in out and "fraction 0.5: 9 rows" in out
    assert f"  {b}: 9 rows," in out and "fraction 2: 18 rows" in out
    assert "steps per epoch: 14" in out  # 9 + 18 rows, 2 per step
