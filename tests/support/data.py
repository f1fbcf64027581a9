"""Rows and datasets the tests share: a chat row of two exchanges (CHAT), a chat template
that renders tools and tool calls (TOOLS_TEMPLATE), rows written as a JSONL file (`write`),
an in-memory Dataset (`rows_dataset`), each sample of a packed set (`packed_samples`), a
tokenizer carrying a given template (`templated`), a batch of random prompts and answers
(`answered_batch`), and the data that the mixing and
streaming tests share with their launches in tests/launch/ (`write_sources`; `mixed_rows`
read with `stream_config`)."""

import json

from llmtrain.config import DataConfig
from llmtrain.demo import make_rows, write_jsonl

CHAT = {
    "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3 + 3?"},
        {"role": "assistant", "content": "6"},
    ]
}

TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\ntools: {{ tools | map(attribute='name') | join(',') }}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<call>{{ c.function.name }}({{ c.function.arguments }})</call>{% endfor %}"
    "<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def write(path, rows):
    """`rows` as a JSONL file at `path`; returns the path as a string."""
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def rows_dataset(rows: list[dict], name: str):
    """An in-memory Dataset of `rows` under a given fingerprint. Dataset.from_list computes
    one by pickling the table with dill, which failed on the GPU machine (Python 3.12,
    pyarrow 26: "Can't pickle <class 'MonthDayNano'>"); a test's rows need none."""
    import datasets
    import pyarrow as pa

    return datasets.Dataset(pa.Table.from_pylist(rows), fingerprint=name)


def packed_samples(packed, examples):
    """(pack index, the sample's span in that pack, its input ids alone as a batch of one)
    for every sample of a PackedDataset built from `examples`."""
    import torch

    for j, rows in enumerate(packed.bins):
        start = 0
        for i in rows:
            ids = torch.tensor([examples[i]["input_ids"]])
            yield j, slice(start, start + ids.shape[1]), ids
            start += ids.shape[1]


def templated(tokenizer, template: str):
    """A copy of `tokenizer` carrying `template`: what model.load_tokenizer gives for a run
    with data.chat_template set (the data code reads the template from the tokenizer)."""
    import copy

    tok = copy.deepcopy(tokenizer)
    tok.chat_template = template
    return tok


def write_sources(tmp_path):
    """Two chat files to mix, of 20 and 10 rows; returns their paths."""
    """Two chat files to mix, of 20 and 10 rows; returns their paths."""
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    write_jsonl(make_rows(20, seed=1), a)
    write_jsonl(make_rows(10, seed=2), b)
    return str(a), str(b)


def mixed_rows(n: int, seed: int) -> list[dict]:
    """Chat rows of many lengths, and after every third an over-long text row (dropped
    with data.overlong=drop at data.max_seq_len=128)."""
    rows = []
    for i, row in enumerate(make_rows(n, seed=seed)):
        rows.append(row)
        if i % 3 == 0:
            rows.append({"text": "x" * 300})
    return rows


def stream_config(**kw) -> DataConfig:
    """The streaming tests' data settings (`kw` overrides them): mixed_rows' over-long rows
    dropped at data.max_seq_len=128, a shuffle buffer of 8."""
    return DataConfig(**({"train": "x", "max_seq_len": 128, "overlong": "drop", "shuffle_buffer": 8} | kw))


def answered_batch(vocab: int, lengths: list[tuple[int, int]], width: int, seed: int) -> dict:
    """Rows of random tokens from `seed` (ids 5 and up), row r a prompt of lengths[r][0]
    tokens and an answer of lengths[r][1], right-padded to `width`, with shifted labels on the
    answer (the position before each answer token predicts it), as the collator gives them."""
    import torch

    from llmtrain.data.rows import IGNORE

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, vocab, (len(lengths), width), generator=g)
    labels = torch.full_like(ids, IGNORE)
    attention = torch.zeros_like(ids)
    for r, (prompt, answer) in enumerate(lengths):
        attention[r, : prompt + answer] = 1
        labels[r, prompt - 1 : prompt + answer - 1] = ids[r, prompt : prompt + answer]
    return {"input_ids": ids, "attention_mask": attention, "labels": labels}
