"""The embedded offline demo: a tiny Llama-architecture model, a tokenizer trained here,
and a generated instruction data set whose answers can be checked.

Nothing is downloaded. `resolve_demo_names` turns the reserved names `demo:tiny-llama`,
`demo:train` and `demo:eval` into real paths, building the assets once into a cache
directory; the model and tokenizer are then loaded through the same `from_pretrained`
path a user's model takes.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
from pathlib import Path

DEMO_VERSION = "v3"
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<pad>", "<s>", "<|im_start|>", "<|im_end|>", "<unk>"]
SYSTEM_PROMPT = "You are a careful assistant. Answer with the result only."


def cache_dir() -> Path:
    root = os.environ.get("LLMTRAIN_CACHE") or Path.home() / ".cache" / "llmtrain"
    return Path(root) / f"demo-{DEMO_VERSION}"


# --- data ---------------------------------------------------------------------------


WORDS = [
    "cat",
    "dog",
    "sun",
    "tree",
    "blue",
    "fish",
    "milk",
    "star",
    "rain",
    "bird",
    "book",
    "lamp",
    "frog",
    "cake",
    "ship",
    "wolf",
    "king",
    "rose",
    "snow",
    "gold",
]
OPPOSITES = {
    "hot": "cold",
    "up": "down",
    "big": "small",
    "fast": "slow",
    "day": "night",
    "old": "new",
    "open": "closed",
    "left": "right",
    "early": "late",
    "full": "empty",
    "wet": "dry",
    "loud": "quiet",
}


def _task(rng: random.Random) -> tuple[str, str]:
    """One question with a single right answer, drawn from a small closed world so that a
    tiny model can learn it within a minute on a CPU."""
    kind = rng.randrange(5)
    if kind == 0:
        a, b = rng.randrange(10), rng.randrange(10)
        return f"What is {a} + {b}?", str(a + b)
    if kind == 1:
        word = rng.choice(WORDS)
        return f"Uppercase: {word}", word.upper()
    if kind == 2:
        word = rng.choice(WORDS)
        return f"Reverse the word: {word}", word[::-1]
    if kind == 3:
        n = rng.randrange(30)
        return f"What number comes after {n}?", str(n + 1)
    word, opposite = rng.choice(sorted(OPPOSITES.items()))
    return f"What is the opposite of {word}?", opposite


def make_rows(n: int, seed: int) -> list[dict]:
    """Chat rows ({'messages': [...]}) with one or two exchanges and an optional system turn."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        messages = [{"role": "system", "content": SYSTEM_PROMPT}] if rng.random() < 0.5 else []
        for _ in range(1 if rng.random() < 0.7 else 2):
            q, a = _task(rng)
            messages += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
        rows.append({"messages": messages})
    return rows


def write_jsonl(rows: list[dict], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


# --- tokenizer and model -------------------------------------------------------------------


def build_tokenizer(corpus: list[str], vocab_size: int = 261):
    """A byte-level tokenizer with a ChatML chat template. The default vocabulary is the 256
    bytes plus the special tokens (no merges): character-level tokens make the demo's copy
    tasks (reverse, upper-case) learnable by a tiny model in a minute."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="<|im_end|>",
        pad_token="<pad>",
        unk_token="<unk>",
        chat_template=CHAT_TEMPLATE,
        model_max_length=512,
    )


def build_model_dir(
    path: Path, corpus: list[str], hidden_size: int = 128, num_layers: int = 4, vocab_size: int = 261, seed: int = 0
) -> Path:
    """Save a randomly initialised tiny Llama and its tokenizer with save_pretrained."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = build_tokenizer(corpus, vocab_size)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 3,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def build_assets(root: Path, train_rows: int = 3000, eval_rows: int = 200) -> None:
    """Write train.jsonl, eval.jsonl and tiny-llama/ under root (atomically)."""
    if (root / "tiny-llama" / "config.json").exists():
        return
    root.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=root.name + ".tmp-", dir=root.parent))
    train, evals = make_rows(train_rows, seed=1), make_rows(eval_rows, seed=2)
    write_jsonl(train, tmp / "train.jsonl")
    write_jsonl(evals, tmp / "eval.jsonl")
    corpus = [m["content"] for r in train for m in r["messages"]]
    build_model_dir(tmp / "tiny-llama", corpus)
    try:
        os.rename(tmp, root)
    except OSError:  # another process finished first
        shutil.rmtree(tmp, ignore_errors=True)


DEMO_NAMES = {"demo:tiny-llama": "tiny-llama", "demo:train": "train.jsonl", "demo:eval": "eval.jsonl"}


def uses_demo(cfg) -> bool:
    names = [cfg.model.name_or_path] + _as_list(cfg.data.train) + _as_list(cfg.data.eval)
    return any(n in DEMO_NAMES for n in names)


def resolve_demo_names(cfg) -> None:
    """Replace demo:* names in cfg with paths to the built assets (building them if needed)."""
    if not uses_demo(cfg):
        return
    root = cache_dir()
    build_assets(root)

    def fix(name: str) -> str:
        return str(root / DEMO_NAMES[name]) if name in DEMO_NAMES else name

    cfg.model.name_or_path = fix(cfg.model.name_or_path)
    cfg.data.train = [fix(n) for n in _as_list(cfg.data.train)]
    cfg.data.eval = [fix(n) for n in _as_list(cfg.data.eval)]


def _as_list(x) -> list[str]:
    return [x] if isinstance(x, str) and x else list(x or [])
