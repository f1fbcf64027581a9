"""The embedded offline demo: a tiny Llama-architecture model, a tokenizer trained here,
and a generated instruction data set whose answers can be checked.

Nothing is downloaded. `resolve_demo_names` turns the reserved names (`demo:tiny-llama`,
`demo:train`, ... config/validate.DEMO_NAMES) into real paths, building the assets once
into a cache directory; the model and tokenizer are then loaded through the same
`from_pretrained` path a user's model takes.

One process builds at a time (`building`: a lock beside the cache, locks.py): every
builder (`build_*`) that finds its products missing takes it, and one that finds them
built takes nothing, so a run never waits for a build it does not need. A second run that
needs what another is building waits, saying for whom, then uses it. An asset appears
whole or not at all (built aside and renamed into place), and what a killed builder left
half done is removed by the next one. The SFT model is trained by a child process that
dies with its parent (distributed/stop.run_child). `llmtrain plan` trains nothing
(`resolve_demo_names(train=False)`): it builds what takes seconds (the base model, the
chat rows, the RL prompts) and plans the rest from stand-ins it names (`stand_ins`).
"""

from __future__ import annotations

import functools
import json
import os
import random
import shutil
import sys
import tempfile
import threading
from contextlib import contextmanager
from pathlib import Path

from . import locks, safefs
from .calculator import add, multiply
from .config.schema import as_list
from .config.validate import DEMO_NAMES, PathKey, map_paths, named
from .data.rows import stop_ids
from .distributed.stop import run_child
from .errors import warn
from .processor import load_processor
from .rl.episodes import play
from .rl.prompts import prompt_ids
from .rl.rewards import completion_text
from .rl.sampling import HFGenerator
from .rl.tools import ToolBox, load_tools
from .rl.turns import check_parser

# The cache directory's version: a change to what the demo builds (its rows, its model, the SFT
# run that trains tiny-llama-sft, or llmtrain's training numbers) needs a new one, or a cache
# built before keeps serving the old assets and the docs' figures no longer hold for it. v4: a
# cache from 2026-11-26 held an SFT model that scored 59.3%; builds since score 48.0%. v5: the
# images demo's dots sit in the patch grid, and its rows begin with a counting file.
DEMO_VERSION = "v5"
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# The calculator demo's (docs/agents.md): ChatML with tools, rendered as Qwen's template renders
# them (calls as <tool_call> blocks of JSON in the assistant turn, results as <tool_response>
# blocks in a user turn), with two changes for a tiny model of character-level tokens: each
# tool is listed as a short signature, not its JSON schema (hundreds of tokens), and a call's
# JSON gives its arguments before its name, which puts the numbers the model copies from the
# question nearer to it. Without tools it renders as CHAT_TEMPLATE does.
TOOL_CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n{% endif %}"
    "Tools:{% for tool in tools %} {{ tool['function']['name'] }}"
    "({{ tool['function']['parameters']['properties'] | join(', ') }}){% endfor %}<|im_end|>\n"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' and tools and loop.first %}"
    "{% elif message['role'] == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}<|im_start|>user{% endif %}"
    "{{ '\\n' }}<tool_response>\n{{ message['content'] }}\n</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}<|im_end|>\n{% endif %}"
    "{% else %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "{% for call in message['tool_calls'] or [] %}<tool_call>\n"
    "{{ {'arguments': call['function']['arguments'], 'name': call['function']['name']} | tojson }}"
    "\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% endif %}"
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


def _wrong(question: str, answer: str, rng: random.Random) -> str:
    """A plausible wrong answer to one of `_task`'s questions: an off-by-one number, a word
    left as it was, half upper-cased, or another word's opposite."""
    if answer.isdigit():
        return str(abs(int(answer) + rng.choice([-2, -1, 1, 2])) or 1)
    word = question.rsplit(" ", 1)[-1].rstrip("?")
    if question.startswith("Uppercase"):
        return rng.choice([word, word[:2].upper() + word[2:]])
    if question.startswith("Reverse"):
        return rng.choice([word, word[1:] + word[0]]) if word != word[::-1] else word + word[0]
    return rng.choice([w for w in list(OPPOSITES.values()) + [word] if w != answer])


def make_pairs(n: int, seed: int, answer=None) -> list[dict]:
    """Preference pairs whose chosen answer is right and rejected one wrong, in the three
    shapes recipes/dpo.py reads, in turn: prompt/chosen/rejected strings; a message-list
    prompt (some with a system turn) with assistant answers; whole conversations.

    With `answer` (prompts as message lists -> a model's answers), the rejected answer is
    the model's own where it is wrong, as in preference data sampled from the model being
    tuned; otherwise, and where the model is right, a plausible wrong one (`_wrong`)."""
    rng = random.Random(seed)
    tasks = []
    for _ in range(n):
        q, a = _task(rng)
        system = [{"role": "system", "content": SYSTEM_PROMPT}] if rng.random() < 0.5 else []
        tasks.append((system + [{"role": "user", "content": q}], q, a, _wrong(q, a, rng)))
    said = answer([t[0] for t in tasks]) if answer is not None else [None] * n
    rows = []
    for i, ((prompt, q, a, w), own) in enumerate(zip(tasks, said)):
        if own and own != a:
            w = own
        if i % 3 == 0:
            rows.append({"prompt": q, "chosen": a, "rejected": w})
        elif i % 3 == 1:
            chosen, rejected = ([{"role": "assistant", "content": x}] for x in (a, w))
            rows.append({"prompt": prompt, "chosen": chosen, "rejected": rejected})
        else:
            chosen, rejected = ([*prompt, {"role": "assistant", "content": x}] for x in (a, w))
            rows.append({"chosen": chosen, "rejected": rejected})
    return rows


def greedy_answers(model_dir: Path, max_new_tokens: int = 12, batch: int = 64):
    """`answer` for make_pairs: the model's greedy answers to prompts (message lists),
    in batches, left-padded."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()

    def answer(prompts: list[list[dict]]) -> list[str]:
        out = []
        for start in range(0, len(prompts), batch):
            texts = [
                tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True)
                for p in prompts[start : start + batch]
            ]
            enc = tokenizer(texts, add_special_tokens=False, return_tensors="pt", padding=True)
            with torch.no_grad():
                ids = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False)
            out += [
                t.strip() for t in tokenizer.batch_decode(ids[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
            ]
        return out

    return answer


def write_jsonl(rows: list[dict], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with safefs.open_write(path, what="LLMTRAIN_CACHE") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


# --- building, one process at a time ------------------------------------------------------

_DEPTH = threading.local()  # how deep this thread is in `building` (builders call builders)


@contextmanager
def building(root: Path):
    """Hold the demo cache's lock (beside it: root itself appears by a rename) while
    building into `root`. Another holder is waited for, saying once for whom; a builder's
    nested builders hold it once. Holding it, what a killed builder left half done is
    removed first (`clean_leftovers`)."""
    if getattr(_DEPTH, "n", 0):
        _DEPTH.n += 1
        try:
            yield
        finally:
            _DEPTH.n -= 1
        return
    root.parent.mkdir(parents=True, exist_ok=True)
    path = root.parent / f"{root.name}.lock"

    def wait(holder: str) -> None:
        print(f"demo: waiting for {holder}, which is building the demo's assets in {root}; then this run uses them")
        sys.stdout.flush()

    try:
        handle = locks.take(path, wait, what="LLMTRAIN_CACHE")
    except locks.NoLocks as e:
        handle = None
        warn(
            f"LLMTRAIN_CACHE: cannot lock {path} ({e.reason}); two runs that build the demo at once would collide: "
            "start one alone first, or set LLMTRAIN_CACHE to a local directory"
        )
    _DEPTH.n = 1
    try:
        clean_leftovers(root)
        yield
    finally:
        _DEPTH.n = 0
        if handle is not None:
            handle.close()


def clean_leftovers(root: Path) -> None:
    """What a builder killed mid-build left (called holding the lock, so no builder is at
    work): its scratch directories beside root and in it, its temporary files in root, the
    run directories of the models it trains (train_child)."""
    for path in root.parent.glob(f"{root.name}.tmp-*"):
        safefs.rmtree(path)
    if root.is_dir():
        for path in root.glob(".tmp-*"):
            path.unlink(missing_ok=True)
        for path in [*root.glob("*.tmp-*"), *root.glob("*-run")]:
            safefs.rmtree(path)


def builds(*products: str):
    """A builder of `products` (paths under the cache root, its first argument): where
    they all exist it returns at once, taking no lock; otherwise it runs holding the lock
    (`building`), skipping what another builder finished meanwhile."""

    def wrap(build):
        @functools.wraps(build)
        def locked(root: Path, *args, **kwargs):
            if all((root / p).exists() for p in products):
                return None
            with building(root):
                return build(root, *args, **kwargs)

        return locked

    return wrap


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


@builds("tiny-llama/config.json", "train.jsonl", "eval.jsonl")
def build_assets(root: Path, train_rows: int = 3000, eval_rows: int = 200) -> None:
    """Write train.jsonl, eval.jsonl and tiny-llama/ under root (atomically: root itself
    is renamed into place whole)."""
    if (root / "tiny-llama" / "config.json").exists():
        return
    tmp = Path(tempfile.mkdtemp(prefix=root.name + ".tmp-", dir=root.parent))
    train, evals = make_rows(train_rows, seed=1), make_rows(eval_rows, seed=2)
    write_jsonl(train, tmp / "train.jsonl")
    write_jsonl(evals, tmp / "eval.jsonl")
    corpus = [m["content"] for r in train for m in r["messages"]]
    build_model_dir(tmp / "tiny-llama", corpus)
    into_place(tmp, root)


def into_place(tmp: Path, target: Path) -> None:
    """A directory built in `tmp` (mkdtemp's, beside `target`) renamed to `target` whole, with
    the umask's modes (private while it was built, mkdtemp's 0700: a cache may be shared);
    dropped if another process finished first."""
    safefs.opened(tmp)
    try:
        os.rename(tmp, target)
    except OSError:  # another process finished first
        safefs.rmtree(tmp)


def write_once(root: Path, name: str, rows: list[dict]) -> None:
    """root/name written whole, through a temporary file created exclusively (never a
    planted link) and renamed into place."""
    tmp = safefs.new_temp(root, f".tmp-{name}-")
    write_jsonl(rows, tmp)
    os.replace(tmp, root / name)


# The demo's pairs: file -> (rows, seed).
PAIRS = {"pairs-train.jsonl": (2000, 3), "pairs-eval.jsonl": (200, 4)}


@builds(*PAIRS)
def build_pairs(root: Path) -> None:
    """pairs-train.jsonl (2000) and pairs-eval.jsonl (200) under root, once: the questions'
    right answers against tiny-llama-sft's own wrong ones (see make_pairs)."""
    todo = [(name, n, seed) for name, (n, seed) in PAIRS.items() if not (root / name).exists()]
    if not todo:
        return
    build_sft_model(root)
    answer = greedy_answers(root / "tiny-llama-sft")
    for name, n, seed in todo:
        write_once(root, name, make_pairs(n, seed, answer))


def unpaired_rows(pairs: list[dict]) -> list[dict]:
    """KTO rows ({prompt, completion, label}) from make_pairs' pairs: every chosen answer
    (label true), then every rejected one (label false), each after its pair's prompt (a
    whole conversation's prompt is all but its last message). In two blocks, so that rows
    next to each other, whose completions are each other's KL completions
    (preference/unpaired.py), answer different questions."""
    rows = []
    for label, side in ((True, "chosen"), (False, "rejected")):
        for pair in pairs:
            if "prompt" in pair:
                prompt, completion = pair["prompt"], pair[side]
            else:
                prompt, completion = pair[side][:-1], pair[side][-1:]
            rows.append({"prompt": prompt, "completion": completion, "label": label})
    return rows


@builds("kto-train.jsonl", "kto-eval.jsonl")
def build_unpaired(root: Path) -> None:
    """kto-train.jsonl (4000 rows) and kto-eval.jsonl (400) under root, once: the demo's
    pairs (build_pairs) as unpaired rows."""
    build_pairs(root)
    for split in ("train", "eval"):
        if not (root / f"kto-{split}.jsonl").exists():
            pairs = [json.loads(line) for line in (root / f"pairs-{split}.jsonl").read_text().splitlines() if line]
            write_once(root, f"kto-{split}.jsonl", unpaired_rows(pairs))


# The RL demo's kinds of question: copying words (upper-cased, reversed), where the SFT
# demo's model is right 80-90% of the time and its sampled answers differ often enough to
# learn from. Measured on 2 CPU cores, 200 steps: these kinds 0.85 -> 0.92 held-out; all five
# kinds 0.51 -> 0.52 in 150 steps, and these with counting 0.57 -> 0.55 in 200 (a model right
# 8% of the time at counting seldom samples a right count to reinforce).
RL_KINDS = ("Uppercase", "Reverse")


def make_prompts(n: int, seed: int) -> list[dict]:
    """Prompt rows for the RL demo: a question of RL_KINDS and its checkable `answer`, which
    the built-in accuracy reward compares with."""
    rng = random.Random(seed)
    rows = []
    while len(rows) < n:
        q, a = _task(rng)
        if q.startswith(RL_KINDS):
            rows.append({"prompt": q, "answer": a})
    return rows


# --- the calculator demo (docs/agents.md): tools, traces that call them, sums to solve ---


CALC_TOOLS = ["llmtrain.calculator:add", "llmtrain.calculator:multiply"]  # as grpo.tools names them


CALC_CUE = "Use a tool."  # the system message of the SFT stage's tool traces; GRPO's prompts have none


def calc_question(rng: random.Random) -> tuple[str, int, int]:
    """(question, a, b): a sum of two two-digit numbers, written as the bare expression
    ('89 + 42'), which the demo model cannot add in its head."""
    a, b = rng.randint(10, 99), rng.randint(10, 99)
    return f"{a} + {b}", a, b


def make_calc_prompts(n: int, seed: int) -> list[dict]:
    """Prompt rows for the calculator demo (no system message), each with its `answer`."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        q, a, b = calc_question(rng)
        rows.append({"prompt": q, "answer": str(add(a, b))})
    return rows


def make_calc_traces(n: int, seed: int) -> list[dict]:
    """Chat rows for the calculator demo's SFT stage, with the tools' schemas as grpo.tools
    gives them (so SFT and GRPO render the same prompt). In 10 rows of 20 a system message
    asks for a tool (CALC_CUE) and the assistant calls `add`, reads its result and answers
    with it; in 1 it calls the tool unasked; in 9 it answers unasked, in its head. So the
    model learns the call format and to copy numbers, but asked plainly it seldom calls the
    tool: the GRPO demo's prompts ask plainly, and GRPO finds that calling it pays."""
    from transformers.utils import get_json_schema

    schemas = [get_json_schema(add), get_json_schema(multiply)]
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        q, a, b = calc_question(rng)
        result = str(add(a, b))
        call = {"type": "function", "function": {"name": "add", "arguments": {"a": a, "b": b}}}
        used = [
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "name": "add", "content": result},
            {"role": "assistant", "content": result},
        ]
        if i % 20 < 10:
            messages = [{"role": "system", "content": CALC_CUE}, {"role": "user", "content": q}, *used]
        elif i % 20 < 11:
            messages = [{"role": "user", "content": q}, *used]
        else:
            messages = [{"role": "user", "content": q}, {"role": "assistant", "content": result}]
        rows.append({"messages": messages, "tools": schemas})
    return rows


# The calculator demo's rows: (file, rows, seed).
CALC_FILES = {
    "demo:calc-traces": (make_calc_traces, 2000, 7),
    "demo:calc-traces-eval": (make_calc_traces, 200, 10),
    "demo:calc-train": (make_calc_prompts, 2000, 8),
    "demo:calc-eval": (make_calc_prompts, 200, 9),
}


@builds(*(DEMO_NAMES[n] for n in CALC_FILES))
def build_calc_rows(root: Path) -> None:
    """The calculator demo's tool traces (its SFT stage) and its prompts, under root, once."""
    for name, (make, n, seed) in CALC_FILES.items():
        if not (root / DEMO_NAMES[name]).exists():
            write_once(root, DEMO_NAMES[name], make(n, seed))


@builds(DEMO_NAMES["demo:prompts-train"], DEMO_NAMES["demo:prompts-eval"])
def build_prompts(root: Path) -> None:
    """The RL demo's prompts under root, once: 2000 for training, 200 held out."""
    for name, n, seed in ((DEMO_NAMES["demo:prompts-train"], 2000, 5), (DEMO_NAMES["demo:prompts-eval"], 200, 6)):
        if not (root / name).exists():
            write_once(root, name, make_prompts(n, seed))


SFT_OVERRIDES = ["train.epochs=2", "checkpoint.every_steps=0", "eval.every_steps=0", "log.progress_bar=false"]


@builds("tiny-llama-sft/config.json")
def build_sft_model(root: Path) -> None:
    """tiny-llama-sft/ under root: the SFT demo's model (recipes/finetune.py with its
    demo config), trained for two epochs of three, so that its answers are right about
    half the time, which leaves the preference demo something to improve. Runs the recipe in a
    process of its own, outside any distributed job this one belongs to, that dies with
    this one (run_child). The assets it trains on are built first, here: it finds them
    built and never waits for the lock this builder holds."""
    target = root / "tiny-llama-sft"
    if (target / "config.json").exists():
        return
    build_assets(root)
    train_child(root, "tiny-llama-sft", None, "the preference demo's starting model", SFT_TIME, SFT_OVERRIDES)


@builds("tiny-llama-teacher/config.json")
def build_teacher_model(root: Path) -> None:
    """tiny-llama-teacher/ under root: the distillation demo's teacher, the SFT demo's model
    trained as `python recipes/finetune.py` trains it (all three epochs of its demo), in a
    process of its own (train_child)."""
    build_assets(root)
    quiet = ["checkpoint.every_steps=0", "eval.every_steps=0", "log.progress_bar=false"]
    train_child(root, "tiny-llama-teacher", None, "the distillation demo's teacher", TEACHER_TIME, quiet)


SFT_TIME = "about a minute on an idle CPU, longer on a busy one"
TEACHER_TIME = "about a minute and a half on an idle CPU, longer on a busy one"
CALC_SFT_TIME = "about four minutes on an idle CPU, longer on a busy one"


@builds("tiny-llama-small/config.json")
def build_small_model(root: Path) -> None:
    """tiny-llama-small/ under root: the distillation demo's student, a randomly initialised
    Llama built as tiny-llama is (build_model_dir, from the same rows: the same tokenizer and
    chat template) but half as wide and half as deep (115k parameters against 821k)."""
    build_assets(root)
    base = json.loads((root / "tiny-llama" / "config.json").read_text())
    rows = [json.loads(line) for line in (root / "train.jsonl").read_text().splitlines() if line]
    corpus = [m["content"] for r in rows for m in r["messages"]]
    tmp = Path(tempfile.mkdtemp(prefix="tiny-llama-small.tmp-", dir=root))
    build_model_dir(tmp, corpus, base["hidden_size"] // 2, base["num_hidden_layers"] // 2, seed=1)
    into_place(tmp, root / "tiny-llama-small")


# --- the images demo (docs/vision.md) ------------------------------------------------------

SHAPES, SHADES = (
    ("square", "circle", "triangle"),
    {
        "red": (220, 40, 40),
        "green": (40, 170, 60),
        "blue": (40, 70, 220),
        "yellow": (230, 200, 30),
    },
)
SHAPE_QUESTIONS = {"colour": "What colour is the shape?", "shape": "What shape is it?", "dots": "How many dots?"}
IMAGE_SIZE, IMAGE_PATCH = 32, 4
# ChatML as the demo's, with an image part rendered as the processor's <image> placeholder.
VISION_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<image>{% else %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def draw_shape(rng: random.Random):
    """(a 32x32 picture, {question kind: answer}): a square, circle or triangle of one of
    four colours at a random place and size on white, with one to four black dots beside it.
    Each dot is 2x2 pixels inside a cell of its own of the vision tower's 4x4 patch grid, on
    white, apart from the shape: one patch sees one whole dot. (Dots anywhere, cut across
    patches, are not learnt to be counted by this tiny tower in minutes: 24% held out.)"""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), (255, 255, 255))
    draw = ImageDraw.Draw(image)
    shape, shade, dots = rng.choice(SHAPES), rng.choice(sorted(SHADES)), rng.randint(1, 4)
    size = rng.randint(12, 20)
    x, y = rng.randint(1, IMAGE_SIZE - size - 1), rng.randint(1, IMAGE_SIZE - size - 1)
    box = (x, y, x + size, y + size)
    if shape == "square":
        draw.rectangle(box, fill=SHADES[shade])
    elif shape == "circle":
        draw.ellipse(box, fill=SHADES[shade])
    else:
        draw.polygon([(x, y + size), (x + size, y + size), (x + size // 2, y)], fill=SHADES[shade])
    cells = [
        (i * IMAGE_PATCH, j * IMAGE_PATCH)
        for i in range(IMAGE_SIZE // IMAGE_PATCH)
        for j in range(IMAGE_SIZE // IMAGE_PATCH)
    ]
    rng.shuffle(cells)
    white = (255, 255, 255)
    free = [  # cells whose pixels, and their neighbours' facing ones, are all white
        (cx, cy)
        for cx, cy in cells
        if all(
            image.getpixel((a, b)) == white
            for a in range(max(cx - 1, 0), min(cx + IMAGE_PATCH + 1, IMAGE_SIZE))
            for b in range(max(cy - 1, 0), min(cy + IMAGE_PATCH + 1, IMAGE_SIZE))
        )
    ]
    for cx, cy in free[:dots]:  # a 32x32 picture with a shape of at most 20x20 leaves 20 free cells
        draw.rectangle((cx + 1, cy + 1, cx + 2, cy + 2), fill=(0, 0, 0))
    return image, {"colour": shade, "shape": shape, "dots": str(dots)}


def shape_rows(folder: Path, n: int, seed: int, prefix: str, kinds: tuple[str, ...] = ()) -> list[dict]:
    """`n` chat rows, each a picture drawn into folder/img/ (named relative to the data file
    beside it) with one of the questions `kinds` (all three if none) about it, and its answer."""
    kinds = kinds or tuple(sorted(SHAPE_QUESTIONS))
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        image, answers = draw_shape(rng)
        name = f"img/{prefix}-{i}.png"
        image.save(folder / name)
        kind = rng.choice(kinds)
        content = [{"type": "image", "image": name}, {"type": "text", "text": SHAPE_QUESTIONS[kind]}]
        rows.append(
            {"messages": [{"role": "user", "content": content}, {"role": "assistant", "content": answers[kind]}]}
        )
    return rows


@builds("shapes/count.jsonl", "shapes/train.jsonl", "shapes/eval.jsonl")
def build_shapes(root: Path, count_rows: int = 6000, train_rows: int = 6000, eval_rows: int = 300) -> None:
    """shapes/ under root: the images demo's pictures (img/) and its chat rows about them,
    count.jsonl (how many dots, only), train.jsonl and eval.jsonl (all three questions),
    built in a temporary folder renamed into place whole."""
    tmp = Path(tempfile.mkdtemp(prefix="shapes.tmp-", dir=root))
    (tmp / "img").mkdir()
    write_jsonl(shape_rows(tmp, count_rows, 10, "count", ("dots",)), tmp / "count.jsonl")
    write_jsonl(shape_rows(tmp, train_rows, 11, "train"), tmp / "train.jsonl")
    write_jsonl(shape_rows(tmp, eval_rows, 12, "eval"), tmp / "eval.jsonl")
    into_place(tmp, root / "shapes")


@builds("tiny-vlm/config.json")
def build_vision_model(root: Path) -> None:
    """tiny-vlm/ under root: a LLaVA-shaped model with random weights (a 2-layer CLIP vision
    tower on 32x32 pictures in 4x4 patches, a projector, and a Llama language model of
    tiny-llama's size), with the demo's byte-level tokenizer and an <image> token, and its
    processor, saved with save_pretrained."""
    import torch
    from transformers import LlavaConfig, LlavaForConditionalGeneration, LlavaProcessor
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    corpus = [*SHAPE_QUESTIONS.values(), *SHAPES, *SHADES, "1 2 3 4", "user assistant"]
    tokenizer = build_tokenizer(corpus)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    tokenizer.chat_template = VISION_TEMPLATE
    grid = (IMAGE_SIZE // IMAGE_PATCH) ** 2
    text = dict(model_type="llama", vocab_size=len(tokenizer), hidden_size=128, intermediate_size=384)
    text |= dict(num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    text |= dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    text |= dict(pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=True)
    vision = dict(model_type="clip_vision_model", hidden_size=64, intermediate_size=128, num_hidden_layers=2)
    vision |= dict(num_attention_heads=4, image_size=IMAGE_SIZE, patch_size=IMAGE_PATCH, projection_dim=64)
    config = LlavaConfig(
        text_config=text,
        vision_config=vision,
        image_token_index=tokenizer.convert_tokens_to_ids("<image>"),
        vision_feature_select_strategy="default",  # the patches, not the class token
        vision_feature_layer=-1,
        image_seq_length=grid,
        tie_word_embeddings=True,
    )
    size = {"size": {"shortest_edge": IMAGE_SIZE}, "crop_size": {"height": IMAGE_SIZE, "width": IMAGE_SIZE}}
    processor = LlavaProcessor(
        image_processor=CLIPImageProcessorPil(**size),
        tokenizer=tokenizer,
        patch_size=IMAGE_PATCH,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        chat_template=VISION_TEMPLATE,
    )
    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    tmp = Path(tempfile.mkdtemp(prefix="tiny-vlm.tmp-", dir=root))
    model.save_pretrained(tmp)
    processor.save_pretrained(tmp)
    into_place(tmp, root / "tiny-vlm")


def score_shapes(model_dir: str | Path, eval_file: str | Path) -> tuple[float, dict[str, float]]:
    """The share of the images demo's held-out questions (`eval_file`) a model answers
    exactly right (greedy), overall and by kind of question."""
    import torch
    from PIL import Image
    from transformers import AutoModelForImageTextToText

    processor = load_processor(str(model_dir))
    model = AutoModelForImageTextToText.from_pretrained(model_dir).eval()
    rows = [json.loads(line) for line in Path(eval_file).read_text().splitlines() if line]
    processor.tokenizer.padding_side = "left"  # generation continues each prompt where it ends
    kinds: dict[str, list[bool]] = {}
    for start in range(0, len(rows), 50):
        part = rows[start : start + 50]
        prompts = [r["messages"][:1] for r in part]
        texts = [
            processor.tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True) for p in prompts
        ]
        shown = [next(c["image"] for c in p[0]["content"] if c["type"] == "image") for p in prompts]
        images = [[Image.open(Path(eval_file).parent / name).convert("RGB")] for name in shown]
        inputs = processor(text=texts, images=images, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=8, do_sample=False)
        said = processor.tokenizer.batch_decode(out[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
        for r, got in zip(part, said):
            question = next(c["text"] for c in r["messages"][0]["content"] if c["type"] == "text")
            kind = next(k for k, q in SHAPE_QUESTIONS.items() if q == question)
            kinds.setdefault(kind, []).append(got.strip() == r["messages"][1]["content"])
    right = [ok for v in kinds.values() for ok in v]
    return sum(right) / len(right), {k: sum(v) / len(v) for k, v in sorted(kinds.items())}


def with_tool_template(source: Path, target: Path) -> None:
    """`source`'s model saved to `target` with the calculator demo's tool template."""
    from transformers import AutoTokenizer

    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".tmp-", dir=target.parent))
    for f in source.iterdir():
        if f.is_file():
            shutil.copy2(f, tmp / f.name)
    tokenizer = AutoTokenizer.from_pretrained(source)
    tokenizer.chat_template = TOOL_CHAT_TEMPLATE
    tokenizer.save_pretrained(tmp)
    into_place(tmp, target)


@builds("tiny-llama-tools/config.json")
def build_tools_model(root: Path) -> None:
    """tiny-llama-tools/ under root: the SFT demo's model (built first) with the tool template,
    where the calculator demo's SFT stage starts (its copying of the demo's words helps it
    learn to copy numbers into calls)."""
    build_sft_model(root)
    with_tool_template(root / "tiny-llama-sft", root / "tiny-llama-tools")


@builds("tiny-llama-calc/config.json")
def build_calc_model(root: Path) -> None:
    """tiny-llama-calc/ under root: the calculator demo's SFT stage (recipes/finetune.py with
    recipes/configs/agent_sft_demo.yaml) on tool traces, where its GRPO demo starts."""
    build_tools_model(root)
    build_calc_rows(root)
    quiet = ["checkpoint.every_steps=0", "log.progress_bar=false"]
    train_child(root, "tiny-llama-calc", "agent_sft_demo.yaml", "the calculator demo's SFT stage", CALC_SFT_TIME, quiet)


def train_child(root: Path, name: str, config: str | None, what: str, takes: str, overrides: list[str]) -> None:
    """Train `root/name` with recipes/finetune.py, `config` (None: its embedded demo) and
    `overrides` in a process of its own, outside any distributed job this one belongs to,
    that dies with this one (run_child); its final/ becomes `root/name`."""
    recipes = Path(__file__).resolve().parents[1] / "recipes"
    script = recipes / "finetune.py"
    if not script.is_file():
        raise FileNotFoundError(f"{script} is missing: the demo trains {what} with it")
    run_dir = root / f"{name}-run"
    safefs.rmtree(run_dir)
    print(f"building {what}: {script.name}{f' --config recipes/configs/{config}' if config else ''} ({takes})")
    sys.stdout.flush()
    launcher = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "MASTER_ADDR")
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(launcher + ("ROLE_", "GROUP_", "MASTER_", "TORCHELASTIC_", "ACCELERATE_"))
        or k == "ACCELERATE_USE_CPU"
    }
    args = ["--config", str(recipes / "configs" / config)] if config else []
    code = run_child([sys.executable, str(script), *args, f"output_dir={run_dir}", *overrides], env)
    if code != 0:
        raise RuntimeError(f"building {what} failed (exit {code}); see the lines above")
    os.replace(run_dir / "final", root / name)
    safefs.rmtree(run_dir)


def built(path: Path) -> bool:
    """Whether a demo asset is in the cache (a model directory: its config.json)."""
    return (path / "config.json").exists() if path.suffix != ".jsonl" else path.exists()


def stand_ins(root: Path, names: set[str], paths: dict[str, Path]) -> list[str]:
    """For `llmtrain plan`, which trains nothing: each of `names` that needs the SFT model
    trained and is not built yet gets a stand-in in `paths` that plans alike, and a line
    saying so. The SFT model: the base model it is trained from (the same config and
    tokenizer, so the same parameters, memory and tokens). The pairs and KTO rows, made from
    its answers: the same questions and right answers with made-up wrong ones (the same
    rows, their rejected answers a few tokens apart), written to plan-stand-ins/ in the
    cache, never where the run looks."""
    notes = []
    sft = "demo:tiny-llama-sft"
    trained = {sft: f"two epochs: {SFT_TIME}", "demo:tiny-llama-teacher": f"three epochs: {TEACHER_TIME}"}
    for name, takes in trained.items():
        if name in names and not built(paths[name]):
            paths[name] = root / DEMO_NAMES["demo:tiny-llama"]
            notes.append(
                f"{name} is not built yet: the run builds it first (recipes/finetune.py's demo, {takes}); planned "
                "with demo:tiny-llama's config and tokenizer, which it shares"
            )
    aside = root / "plan-stand-ins"
    tools = [n for n in ("demo:tiny-llama-tools", "demo:tiny-llama-calc") if n in names and not built(paths[n])]
    if tools:  # both are the SFT demo's model with the tool template: planned as the base model with it
        aside.mkdir(exist_ok=True)
        if not built(aside / "tiny-llama-tools"):
            with_tool_template(root / DEMO_NAMES["demo:tiny-llama"], aside / "tiny-llama-tools")
        for name in tools:
            paths[name] = aside / "tiny-llama-tools"
        notes.append(
            f"{' and '.join(tools)} not built yet: the run builds them first (the calculator demo's SFT stage: "
            f"{CALC_SFT_TIME}); planned with demo:tiny-llama's config and tokenizer and the tool template, which "
            "they share"
        )
    rows = {"pairs": make_pairs, "kto": lambda n, seed: unpaired_rows(make_pairs(n, seed))}
    for kind, make in rows.items():
        todo = sorted(n for n in names if n.startswith(f"demo:{kind}-") and not built(paths[n]))
        for name in todo:
            n, seed = PAIRS[f"pairs-{name.rsplit('-', 1)[1]}.jsonl"]
            aside.mkdir(exist_ok=True)
            if not (aside / DEMO_NAMES[name]).exists():
                write_once(aside, DEMO_NAMES[name], make(n, seed))
            paths[name] = aside / DEMO_NAMES[name]
        if todo:
            are, them = ("are", "them") if len(todo) > 1 else ("is", "it")
            notes.append(
                f"{' and '.join(todo)} {are} not built yet: the run builds {them} from {sft}'s answers; planned on "
                f"stand-in rows in {aside}, the same questions and right answers with made-up wrong ones"
            )
    return notes


def uses_demo(cfg) -> bool:
    """Whether the config names any of the demo's assets."""
    return any(name in DEMO_NAMES for _, name in named(cfg))


def demo_name(path: str) -> str | None:
    """The demo: name of a built demo asset's path (a model card names it so), else None."""
    root = cache_dir()
    try:
        target = Path(path).resolve()
        return next((n for n, f in DEMO_NAMES.items() if (root / f).resolve() == target), None)
    except (OSError, ValueError):
        return None


def resolve_demo_names(cfg, train: bool = True) -> list[str]:
    """Replace demo:* names in cfg (wherever it names a model or data set) with paths to the
    built assets, building them if needed. With train=False (`llmtrain plan`) the SFT model
    is never trained: what needs it and is not built yet is planned from stand-ins
    (`stand_ins`), and the lines saying so are returned."""
    if not uses_demo(cfg):
        return []
    root = cache_dir()
    names = {name for _, name in named(cfg) if name in DEMO_NAMES}
    paths = {name: root / file for name, file in DEMO_NAMES.items()}
    build_assets(root)
    if any(n.startswith("demo:prompts") for n in names):
        build_prompts(root)
    if any(n.startswith("demo:calc-") for n in names):
        build_calc_rows(root)
    if "demo:tiny-llama-small" in names:  # built, not trained: seconds
        build_small_model(root)
    if "demo:tiny-vlm" in names:
        build_vision_model(root)
    if any(n.startswith("demo:shapes") for n in names):
        build_shapes(root)
    notes = [] if train else stand_ins(root, names, paths)
    if train:
        if any(n.startswith("demo:pairs") for n in names):
            build_pairs(root)
        if any(n.startswith("demo:kto") for n in names):
            build_unpaired(root)
        if "demo:tiny-llama-sft" in names:
            build_sft_model(root)
        if "demo:tiny-llama-tools" in names:
            build_tools_model(root)
        if "demo:tiny-llama-calc" in names:
            build_calc_model(root)
        if "demo:tiny-llama-teacher" in names:
            build_teacher_model(root)

    def fix(key: str, name: str, kind: PathKey) -> str:
        return str(paths[name]) if kind.asset and name in DEMO_NAMES else name

    map_paths(cfg, fix)
    cfg.data.train, cfg.data.eval = as_list(cfg.data.train), as_list(cfg.data.eval)  # as every run records them
    return notes


def score(model_dir: str | Path, n: int = 300, seed: int = 99) -> tuple[float, dict[str, float]]:
    """The share of `n` fresh demo questions a model answers exactly right (greedy), overall
    and by kind of question."""
    rng = random.Random(seed)
    tasks = [_task(rng) for _ in range(n)]
    said = greedy_answers(Path(model_dir))([[{"role": "user", "content": q}] for q, _ in tasks])
    right = [got == want for (_, want), got in zip(tasks, said)]
    kinds: dict[str, list[bool]] = {}
    for (q, _), ok in zip(tasks, right):
        kinds.setdefault(kind(q), []).append(ok)
    return sum(right) / n, {k: sum(v) / len(v) for k, v in sorted(kinds.items())}


# The calculator demo's grpo.max_turns and grpo.max_completion_length (agent_demo.yaml's).
CALC_TURNS, CALC_TOKENS = 2, 160


def score_calculator(model_dir: str | Path, n: int = 300, seed: int = 99) -> tuple[float, float]:
    """(the share of `n` fresh calculator questions a model with the calculator's tools
    answers exactly right, its tool calls per question), each question played as a greedy
    episode of the GRPO demo's turns and tokens (rl/episodes.play, the tools called as in
    training)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    check_parser(tokenizer)
    tools = load_tools(CALC_TOOLS)
    schemas = [t.schema for t in tools]
    rows = make_calc_prompts(n, seed + 1_000_000)  # seeds apart from the training and evaluation prompts'
    stops = stop_ids(model.generation_config, tokenizer)
    generator = HFGenerator(tokenizer, CALC_TOKENS)
    right, calls = [], 0
    for start in range(0, n, 50):
        part = rows[start : start + 50]
        prompts = [prompt_ids([{"role": "user", "content": r["prompt"]}], tokenizer, schemas) for r in part]
        boxes = [ToolBox(tools, 5.0, 1000) for _ in part]
        episodes = play(generator, model, tokenizer, prompts, None, boxes, CALC_TURNS, CALC_TOKENS, stops)
        for r, e in zip(part, episodes):
            right.append(completion_text(e.messages).strip() == r["answer"])
            calls += e.calls
    return sum(right) / n, calls / n


def kind(question: str) -> str:
    """A demo question's kind, by its opening words."""
    for opening, name in (("Uppercase", "uppercase"), ("Reverse", "reverse"), ("What number", "counting")):
        if question.startswith(opening):
            return name
    return "sums" if "+" in question else "opposites"


if __name__ == "__main__":
    if sys.argv[1:2] != ["score"] or len(sys.argv) < 3:
        sys.exit("usage: python -m llmtrain.demo score MODEL_DIR|demo:NAME [MODEL_DIR ...]")
    if "demo:tiny-vlm" in sys.argv[2:]:  # the images demo's model before training: built if need be
        build_vision_model(cache_dir())
    sys.argv[2:] = [str(cache_dir() / DEMO_NAMES[p]) if p in DEMO_NAMES else p for p in sys.argv[2:]]
    if missing := [p for p in sys.argv[2:] if not (Path(p) / "config.json").is_file()]:
        print(
            f"error: {', '.join(missing)}: no model directory (no config.json); give the directory a run saved, "
            "e.g. runs/dpo-demo/final",
            file=sys.stderr,
        )
        sys.exit(2)
    for path in sys.argv[2:]:
        if "vision_config" in json.loads((Path(path) / "config.json").read_text()):  # the images demo's model
            shapes = cache_dir() / DEMO_NAMES["demo:shapes-eval"]
            build_shapes(cache_dir())
            overall, by_kind = score_shapes(path, shapes)
            kinds = ", ".join(f"{k} {v:.0%}" for k, v in by_kind.items())
            print(f"{path}: {overall:.1%} of 300 held-out picture questions answered right ({kinds})")
            continue
        if "<tool_call>" in (Path(path) / "tokenizer_config.json").read_text() + "".join(
            f.read_text() for f in Path(path).glob("*.jinja")
        ):  # the calculator demo's model (docs/agents.md): questions played as episodes with its tools
            overall, calls = score_calculator(path)
            print(
                f"{path}: {overall:.1%} of 300 held-out calculator questions answered right "
                f"(tool calls per question {calls:.2f})"
            )
            continue
        overall, by_kind = score(path)
        kinds = ", ".join(f"{k} {v:.0%}" for k, v in by_kind.items())
        print(f"{path}: {overall:.1%} of 300 held-out demo questions answered right ({kinds})")
