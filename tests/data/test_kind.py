"""Every kind of example through the one row pipeline (data/kind.DataKind, data/prepare.prepare):
SFT rows, pairs, reward-model pairs, KTO rows and prompts make, of rows kept, truncated,
dropped and malformed, the very examples, counts and errors that the four prepare functions
before it made (prepare_split, prepare_pairs, prepare_unpaired, prepare_prompts: the digests
below were taken from them, at a967bdf), and their cache keys hold the versions they held."""

import hashlib
import json

import pytest

from llmtrain.config import DataConfig
from llmtrain.data import prepare as prepare_module
from llmtrain.data.build import ROWS
from llmtrain.demo import make_pairs, make_prompts, make_rows, unpaired_rows, write_jsonl
from llmtrain.errors import DataError
from llmtrain.preference.pairs import PAIRS
from llmtrain.preference.reward_model import REWARD_PAIRS
from llmtrain.preference.unpaired import UNPAIRED
from llmtrain.rl.prompts import prompt_kind
from tests.support.data import templated

LONG = "x" * 300
SFT = make_rows(6, seed=3) + [
    {"text": "hello world"},
    {"text": LONG},  # truncated on the right, or dropped
    {"text": " "},  # nothing to train
    {"text": 5},  # malformed
    {"prompt": "2+2=", "completion": "4"},
    {"prompt": LONG, "completion": "ok"},  # the completion cut off: no trained token once truncated
    {"instruction": "do", "input": "it", "output": "done"},
    {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]},
    {"messages": [{"role": "user", "content": LONG}, {"role": "assistant", "content": "fine"}]},
    {"messages": [{"role": "bogus", "content": "a"}]},  # malformed
    {"messages": [{"role": "user", "content": "a"}]},  # no assistant turn
]
PAIR_ROWS = make_pairs(6, seed=5) + [
    {"prompt": "1+1=", "chosen": "2", "rejected": "2"},  # identical answers
    {"prompt": "1+1=", "chosen": "", "rejected": "3"},  # an empty answer
    {"prompt": LONG, "chosen": "good answer", "rejected": "bad"},  # its prompt cut from the left
    {"prompt": "q", "chosen": LONG, "rejected": LONG + "y"},  # identical once cut on the right
    {"prompt": "x", "chosen": 1, "rejected": "y"},  # malformed
    {
        "prompt": [{"role": "user", "content": LONG}],
        "chosen": [{"role": "assistant", "content": "a"}],
        "rejected": "b",
    },
    {"chosen": [{"role": "user", "content": "hi"}], "rejected": [{"role": "user", "content": "ho"}]},  # malformed
]
MARGINS = [0.5, 1, None, "x", 2.5, True]  # "x" and True are malformed margins
KTO = unpaired_rows(make_pairs(4, seed=7)) + [
    {"prompt": LONG, "completion": "answer", "label": True},  # its prompt cut from the left
    {"prompt": "q", "completion": LONG, "label": False},  # its completion cut on the right
    {"prompt": "q", "completion": "", "label": True},  # empty answer
    {"prompt": "", "completion": "a", "label": True},  # malformed without a template: no prompt token
    {"prompt": "q", "completion": "a", "label": "maybe"},  # malformed
    {"prompt": [{"role": "user", "content": LONG}], "completion": [{"role": "assistant", "content": "ok"}], "label": 0},
]
PROMPTS = make_prompts(6, seed=3) + [
    {"prompt": LONG, "answer": "1"},  # cut from the left
    {"prompt": " "},  # empty prompt
    {"question": "x"},  # malformed
    {"prompt": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure"}], "id": 3},
    {"prompt": [{"role": "user", "content": LONG}]},
]

KINDS = {
    "rows": (ROWS, SFT),
    "pairs": (PAIRS, PAIR_ROWS),
    "reward": (REWARD_PAIRS, [dict(r, margin=m) for r, m in zip(PAIR_ROWS, MARGINS * 3)]),
    "unpaired": (UNPAIRED, KTO),
    "prompts": (prompt_kind(20), PROMPTS),
}
SKIP = {"bad_rows": "skip", "max_bad_fraction": 1.0}
CONFIGS = {
    "long": DataConfig(max_seq_len=256, **SKIP),
    "truncate": DataConfig(max_seq_len=60, overlong="truncate", **SKIP),
    "drop": DataConfig(max_seq_len=100, overlong="drop", system_prompt="Be brief.", **SKIP),
    "none": DataConfig(max_seq_len=4, overlong="drop", **SKIP),  # every row dropped: an error
}
# sha256 of (columns, examples, the split's summary), or of the error, as prepare_split,
# prepare_pairs (margins=True for reward), prepare_unpaired and prepare_prompts made them,
# with the chat template (True) and without (False: plain text; SFT's chat rows need one).
BEFORE = {
    ("rows", "long", True): "77dd5799a120ed65",
    ("rows", "truncate", True): "1ef5559d2f9bfc40",
    ("rows", "drop", True): "78f6029c7cb98e94",
    ("rows", "none", True): "f93e4f414f0a7949",
    ("pairs", "long", True): "2088f5a5d5fdd87c",
    ("pairs", "long", False): "cf331a279bd072fb",
    ("pairs", "truncate", True): "c8c8801b23c6260c",
    ("pairs", "truncate", False): "39c39dda1da9a254",
    ("pairs", "drop", True): "7fe2e45ceb4027cb",
    ("pairs", "drop", False): "72d5f2ea2d2d98b2",
    ("pairs", "none", True): "70ca22dfaa942539",
    ("pairs", "none", False): "4039db3ea539a963",
    ("reward", "long", True): "27c3b47c2f6491e9",
    ("reward", "long", False): "0422acd9bd8d71a4",
    ("reward", "truncate", True): "587577d0fabe2cc5",
    ("reward", "truncate", False): "b25f52e820e79a58",
    ("reward", "drop", True): "2e5baeec4282945e",
    ("reward", "drop", False): "2bd28059e402b9ab",
    ("reward", "none", True): "99b2434616997913",
    ("reward", "none", False): "c572b0b567a18f7b",
    ("unpaired", "long", True): "94dec1cc6c343f73",
    ("unpaired", "long", False): "917e7f68e4833f78",
    ("unpaired", "truncate", True): "f12fdd04917fdf65",
    ("unpaired", "truncate", False): "1fc3c85af5e40447",
    ("unpaired", "drop", True): "fad2ed702ced1962",
    ("unpaired", "drop", False): "76cc87a05e9a2938",
    ("unpaired", "none", True): "efe4e01b27cb3969",
    ("unpaired", "none", False): "6deca44b8133e13e",
    ("prompts", "long", True): "83745c1d0ecfe591",
    ("prompts", "long", False): "89fe1cfc3f38d928",
    ("prompts", "truncate", True): "dedfbcbdf5ecce0b",
    ("prompts", "truncate", False): "aa623ef7bff03568",
    ("prompts", "drop", True): "3d48f13523ec3de4",
    ("prompts", "drop", False): "c1febec0c99e81d7",
    ("prompts", "none", True): "482e04cb9034c418",
    ("prompts", "none", False): "d27a9369df20f247",
}


def digest(kind, rows, cfg, path, tokenizer) -> str:
    write_jsonl(rows, path)
    try:
        ds, stats = kind.prepare("data.train", [str(path)], tokenizer, cfg)
    except DataError as e:
        made = str(e).replace(str(path), "FILE")
    else:
        made = [ds.column_names, ds.to_dict(), stats.summary("data.train").replace(str(path), "FILE")]
    return hashlib.sha256(json.dumps(made).encode()).hexdigest()[:16]


@pytest.mark.parametrize(("name", "config", "template"), list(BEFORE))
def test_each_kind_makes_the_examples_it_made_before_the_one_pipeline(tmp_path, tokenizer, name, config, template):
    kind, rows = KINDS[name]
    tok = tokenizer if template else templated(tokenizer, None)  # plain text: no chat template
    assert digest(kind, rows, CONFIGS[config], tmp_path / f"{name}.jsonl", tok) == BEFORE[name, config, template]


@pytest.mark.parametrize("name", list(KINDS))
def test_every_way_a_row_ends_is_covered(tokenizer, name):
    """The rows above are kept, truncated, dropped as too long, dropped for the kind's own
    reasons and malformed, so the digests hold each kind's every path."""
    kind, rows = KINDS[name]
    statuses = set()
    for config in ("long", "truncate", "drop"):
        statuses |= {kind.process(r, tokenizer, CONFIGS[config])["status"].split(" (")[0] for r in rows}
    assert {"ok", "truncated", "too long"} <= statuses
    assert any(s.startswith("error: ") for s in statuses)
    assert statuses - {"ok", "truncated", "too long"} - {s for s in statuses if s.startswith("error")}


def test_a_dropped_row_holds_the_kinds_empty_example(tokenizer):
    for kind, _ in KINDS.values():
        out = kind.process({"nothing": 1}, tokenizer, CONFIGS["long"])
        assert out["status"].startswith("error: ")
        assert list(out)[: len(kind.empty)] == list(kind.empty) and out["n_trained"] == 0


def test_each_kinds_cache_key_holds_the_version_it_held(tmp_path, tokenizer, monkeypatch):
    """prepare._fingerprint is given each kind's version, as before the one pipeline (kind.py
    holds their history); SFT rows give data.format instead."""
    given = []
    real = prepare_module._fingerprint
    monkeypatch.setattr(prepare_module, "_fingerprint", lambda src, v, *a: given.append(v) or real(src, v, *a))
    for name, (kind, rows) in KINDS.items():
        digest(kind, rows, CONFIGS["long"], tmp_path / f"{name}.jsonl", tokenizer)
    digest(ROWS, SFT, DataConfig(max_seq_len=256, format="chat", **SKIP), tmp_path / "chat.jsonl", tokenizer)
    assert given == ["auto", "pairs-v4", "pairs-v4-margins-v2", "unpaired-v3", "prompts-v2-20", "chat"]
