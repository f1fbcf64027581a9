"""The offline demo's generated data: preference pairs whose chosen answer is right and
rejected one wrong, in the three row shapes, with the model's own wrong answers where it
has them; the same pairs as KTO's unpaired rows."""

import contextlib
import json
import os
import stat
import subprocess
import sys
import threading
import time

import pytest

from llmtrain import demo
from llmtrain.demo import OPPOSITES, make_pairs, unpaired_rows
from llmtrain.preference.pairs import pair_messages

PYTHON = sys.executable  # the fake_build fixture swaps sys.executable


def right_answer(question: str) -> str:
    """The demo's questions, answered independently of demo._task."""
    word = question.rsplit(" ", 1)[-1].rstrip("?")
    if question.startswith("What is") and "+" in question:
        a, b = question[len("What is ") : -1].split(" + ")
        return str(int(a) + int(b))
    if question.startswith("Uppercase"):
        return word.upper()
    if question.startswith("Reverse"):
        return word[::-1]
    if question.startswith("What number comes after"):
        return str(int(word) + 1)
    return OPPOSITES[word]


def test_pairs_come_in_three_shapes_with_the_right_answer_chosen():
    rows = make_pairs(60, seed=1)
    shapes = {("prompt" in r, isinstance(r["chosen"], str)) for r in rows}
    assert shapes == {(True, True), (True, False), (False, False)}
    for row in rows:
        prompt, chosen, rejected = pair_messages(row)
        question = prompt if isinstance(prompt, str) else prompt[-1]["content"]
        chosen = chosen if isinstance(chosen, str) else chosen[-1]["content"]
        rejected = rejected if isinstance(rejected, str) else rejected[-1]["content"]
        assert chosen == right_answer(question) != rejected, row


def test_the_models_own_wrong_answers_are_the_rejected_ones():
    """An `answer` that is wrong on every other question: those answers are rejected; where
    it is right, a made-up wrong answer is."""
    asked = []

    def answer(prompts):
        asked.extend(prompts)
        return ["oops" if i % 2 else right_answer(p[-1]["content"]) for i, p in enumerate(prompts)]

    rows = make_pairs(12, seed=2, answer=answer)
    assert len(asked) == 12 and all(p[-1]["role"] == "user" for p in asked)
    for i, row in enumerate(rows):
        _, _, rejected = pair_messages(row)
        rejected = rejected if isinstance(rejected, str) else rejected[-1]["content"]
        assert (rejected == "oops") == (i % 2 == 1), (i, row)
    assert make_pairs(12, seed=2) == make_pairs(12, seed=2)  # seeded


def test_unpaired_rows_are_the_pairs_answers_labelled_in_two_blocks(tokenizer):
    """Every chosen answer (label true), then every rejected one (label false), each after
    its pair's prompt, as KTO reads them (the same tokens as the pair's answers)."""
    from llmtrain.config import DataConfig
    from llmtrain.preference.pairs import PAIRS
    from llmtrain.preference.unpaired import UNPAIRED

    pairs = make_pairs(9, seed=3)
    rows = unpaired_rows(pairs)
    assert [r["label"] for r in rows] == [True] * 9 + [False] * 9
    cfg = DataConfig(max_seq_len=256)
    for i, pair in enumerate(pairs):
        tokens = PAIRS.process(pair, tokenizer, cfg)
        for row, side in ((rows[i], "chosen"), (rows[9 + i], "rejected")):
            out = UNPAIRED.process(row, tokenizer, cfg)
            assert (out["input_ids"], out["labels"]) == (tokens[f"{side}_input_ids"], tokens[f"{side}_labels"])


def test_scoring_a_directory_that_holds_no_model_is_one_line(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "llmtrain.demo", "score", str(tmp_path / "runs" / "dpo-demo" / "final")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.splitlines() == [
        f"error: {tmp_path / 'runs' / 'dpo-demo' / 'final'}: no model directory (no config.json); give the "
        "directory a run saved, e.g. runs/dpo-demo/final"
    ]


# A stand-in for `python recipes/finetune.py output_dir=DIR ...` in the SFT build: it notes
# that it ran (its pid, in $FAKE_LOG), and writes DIR/final/config.json after $FAKE_SLEEP s.
FAKE_PYTHON = """#!{python}
import os, sys, time
from pathlib import Path
out = Path(next(a for a in sys.argv if a.startswith("output_dir=")).split("=", 1)[1])
with open(os.environ["FAKE_LOG"], "a") as log:
    log.write(f"{{os.getpid()}}\\n")
(out / "final").mkdir(parents=True, exist_ok=True)
time.sleep(float(os.environ["FAKE_SLEEP"]))
(out / "final" / "config.json").write_text("{{}}")
"""


@pytest.fixture
def fake_build(tmp_path, monkeypatch):
    """A demo cache whose base assets are built (stand-ins), and an SFT build that runs the
    fake recipe above (sys.executable swapped for it): (cache root, the log of its runs)."""
    root = tmp_path / "cache" / "demo-v5"
    (root / "tiny-llama").mkdir(parents=True)
    for name in ("tiny-llama/config.json", "train.jsonl", "eval.jsonl"):
        (root / name).write_text("{}\n")
    fake = tmp_path / "python"
    fake.write_text(FAKE_PYTHON.format(python=PYTHON))
    fake.chmod(0o755)
    log = tmp_path / "builds.log"
    monkeypatch.setattr(sys, "executable", str(fake))
    monkeypatch.setenv("FAKE_LOG", str(log))
    monkeypatch.setenv("FAKE_SLEEP", "1")
    return root, log


def test_two_builders_started_together_build_once_and_both_use_it(fake_build, capsys):
    """Two runs that need the SFT model, started together on a fresh cache: the second
    deleted the first's half-built model. Now the second waits, saying once for whom, and
    finds it built."""
    root, log = fake_build
    errors = []

    def build():
        try:
            demo.build_sft_model(root)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=build) for _ in range(2)]
    for t in threads:
        t.start()
        time.sleep(0.2)
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    assert len(log.read_text().split()) == 1  # trained once
    assert (root / "tiny-llama-sft" / "config.json").exists() and not (root / "tiny-llama-sft-run").exists()
    waits = [line for line in capsys.readouterr().out.splitlines() if line.startswith("demo: waiting for")]
    assert len(waits) == 1 and f"pid {os.getpid()} on " in waits[0], waits


HOLDER = """
import sys, time
from pathlib import Path
from llmtrain import locks
handle = locks.take(Path(sys.argv[1]))
print("held", flush=True)
time.sleep(120)
"""


def test_a_builder_killed_mid_build_is_waited_for_then_taken_over(fake_build, capsys):
    """The next builder waits for a live holder, naming it; once that holder is killed
    (SIGKILL: the kernel frees its lock), it takes the lock, removes what the dead one left
    half built, and builds."""
    root, log = fake_build
    scraps = [root.parent / "demo-v5.tmp-abc123", root / "tiny-llama-sft-run" / "final", root / "x.tmp-1"]
    for path in scraps:
        path.mkdir(parents=True)
    lock = root.parent / "demo-v5.lock"
    holder = subprocess.Popen([PYTHON, "-c", HOLDER, str(lock)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        builder = threading.Thread(target=demo.build_sft_model, args=(root,))
        builder.start()
        builder.join(timeout=1)
        assert builder.is_alive() and not log.exists()  # waiting
        holder.kill()
        builder.join(timeout=60)
        assert not builder.is_alive()
    finally:
        holder.kill()
        holder.wait()
    assert len(log.read_text().split()) == 1 and (root / "tiny-llama-sft" / "config.json").exists()
    assert not any(path.exists() for path in scraps)
    waits = [line for line in capsys.readouterr().out.splitlines() if line.startswith("demo: waiting for")]
    assert len(waits) == 1 and f"pid {holder.pid} on " in waits[0], waits


PARENT = """
import sys
from pathlib import Path
from llmtrain import demo
sys.executable = sys.argv[2]  # the recipe's interpreter, swapped for the fake after llmtrain loaded
demo.build_sft_model(Path(sys.argv[1]))
"""


def test_a_killed_parent_leaves_no_sft_build_running(fake_build, tmp_path):
    """The SFT build's child (a training run, here the fake recipe sleeping) dies with the
    process that started it, SIGKILL included: before, it trained on as an orphan."""
    import psutil

    root, log = fake_build
    parent = subprocess.Popen([PYTHON, "-c", PARENT, str(root), sys.executable], env=dict(os.environ, FAKE_SLEEP="60"))
    try:
        deadline = time.monotonic() + 60
        while not (log.exists() and log.read_text().strip()) and time.monotonic() < deadline:
            time.sleep(0.05)
        child = psutil.Process(int(log.read_text().split()[0]))
        parent.kill()
        parent.wait()
        assert not psutil.wait_procs([child], timeout=10)[1]  # gone
    finally:
        parent.kill()
        with contextlib.suppress(psutil.NoSuchProcess):
            psutil.Process(int(log.read_text().split()[0])).kill()


def test_resolving_for_a_plan_trains_nothing_and_names_its_stand_ins(fake_build, monkeypatch):
    """`llmtrain plan` (train=False) on a fresh cache: the SFT model is stood in for by the
    base model it is trained from, its pairs and KTO rows by rows with made-up wrong answers
    in plan-stand-ins/, never where a run looks; each said in a line. Nothing is trained."""
    from llmtrain.config import load_config

    root, log = fake_build
    monkeypatch.setenv("LLMTRAIN_CACHE", str(root.parent))
    cfg = load_config(
        None, ["model.name_or_path=demo:tiny-llama-sft", "data.train=demo:pairs-train", "data.eval=demo:kto-eval"]
    )
    notes = demo.resolve_demo_names(cfg, train=False)
    assert not log.exists() and not (root / "tiny-llama-sft").exists()  # no training child ran
    aside = root / "plan-stand-ins"
    assert cfg.model.name_or_path == str(root / "tiny-llama")
    assert (cfg.data.train, cfg.data.eval) == ([str(aside / "pairs-train.jsonl")], [str(aside / "kto-eval.jsonl")])
    assert len((aside / "pairs-train.jsonl").read_text().splitlines()) == 2000
    assert len((aside / "kto-eval.jsonl").read_text().splitlines()) == 400
    assert not (root / "pairs-train.jsonl").exists() and not (root / "kto-eval.jsonl").exists()
    assert notes[0].startswith("demo:tiny-llama-sft is not built yet: the run builds it first (")
    assert [n.split(" is not built yet")[0] for n in notes[1:]] == ["demo:pairs-train", "demo:kto-eval"]


@pytest.mark.parametrize("umask", [0o022, 0o002])
def test_the_demos_assets_follow_the_umask(tmp_path, umask):
    """The demo's model and data, built private, end with the modes the umask gives (a cache
    may be shared, as LLMTRAIN_CACHE on a team's disk): no directory left 0700, no file 0600."""
    was = os.umask(umask)
    try:
        demo.build_assets(tmp_path / "demo", train_rows=20, eval_rows=4)
    finally:
        os.umask(was)
    paths = [tmp_path / "demo", *(tmp_path / "demo").rglob("*")]
    modes = {str(p.relative_to(tmp_path)): stat.S_IMODE(p.stat().st_mode) for p in paths}
    assert {
        name: mode for name, mode in modes.items() if mode != (0o777 if (tmp_path / name).is_dir() else 0o666) & ~umask
    } == {}
    assert "demo/tiny-llama/model.safetensors" in modes


def test_calculator_traces_call_the_tool_when_asked_and_render_as_grpo_prompts(tokenizer):
    """The calculator demo's SFT rows: asked for a tool (CALC_CUE), the assistant calls add with
    the question's numbers and answers with its result; unasked it mostly answers in its head,
    now and then calls it (10, 1 and 9 rows of 20). Every answer is the sum. An unasked row's
    prompt is the GRPO demo's prompt token for token (the same tools, the same template), and
    a call is read back by llmtrain's parser."""
    import copy

    from llmtrain.demo import CALC_CUE, CALC_TOOLS, TOOL_CHAT_TEMPLATE, make_calc_prompts, make_calc_traces
    from llmtrain.rl.prompts import prompt_ids
    from llmtrain.rl.tools import load_tools
    from llmtrain.rl.turns import check_parser, parse_turn

    tok = copy.deepcopy(tokenizer)
    tok.chat_template = TOOL_CHAT_TEMPLATE
    check_parser(tok)
    schemas = [t.schema for t in load_tools(CALC_TOOLS)]
    end = tok.convert_tokens_to_ids("<|im_end|>")
    kinds = []
    for row, prompt in zip(make_calc_traces(40, seed=3), make_calc_prompts(40, seed=3)):
        messages = row["messages"]
        asked = messages[0]["role"] == "system"
        if asked:
            assert messages[0]["content"] == CALC_CUE
            messages = messages[1:]
        question, *said = messages
        a, op, b = question["content"].split()
        assert question["content"] == prompt["prompt"] and row["tools"] == schemas and op == "+"
        assert said[-1]["content"] == prompt["answer"] == str(int(a) + int(b))
        calls = len(said) == 3
        kinds.append((asked, calls))
        if calls:
            function = said[0]["tool_calls"][0]["function"]
            assert function == {"name": "add", "arguments": {"a": int(a), "b": int(b)}}
            assert said[1] == {"role": "tool", "name": "add", "content": prompt["answer"]}
        if asked:
            continue
        ids = prompt_ids([question], tok, schemas)
        whole = tok.apply_chat_template(row["messages"], tools=schemas, tokenize=True, return_dict=False)
        assert whole[: len(ids)] == ids  # the SFT row's prompt is the GRPO prompt, token for token
        turn = whole[len(ids) : whole.index(end, len(ids)) + 1]
        want = [("add", {"a": int(a), "b": int(b)})] if calls else []
        assert parse_turn(tok, turn, ids, [end], tools=schemas).calls == want
    assert [kinds.count(k) for k in ((True, True), (False, True), (False, False))] == [20, 2, 18]


def test_the_calculator_score_plays_episodes_as_the_grpo_demo_does():
    """`python -m llmtrain.demo score` plays each question with the GRPO demo's turns and token
    budget, so a score measures the episodes the demo trains."""
    from llmtrain.config.load import read_config, set_values
    from llmtrain.demo import CALC_TOKENS, CALC_TOOLS, CALC_TURNS
    from tests.support.runs import ROOT

    written = set_values(read_config(ROOT / "recipes" / "configs" / "agent_demo.yaml"))
    assert (written["grpo.max_turns"], written["grpo.max_completion_length"]) == (CALC_TURNS, CALC_TOKENS)
    assert written["grpo.tools"] == CALC_TOOLS


def test_the_distillation_demo_plans_its_teacher_and_builds_its_student_untrained(fake_build, monkeypatch, tiny_model):
    """`llmtrain plan` of the distillation demo on a fresh cache: the teacher (a training run)
    is stood in for by the base model, said in a line; the student, built not trained, is
    built from the same rows: the base model's tokenizer and layers, half as wide and half as
    deep."""
    import shutil

    from transformers import AutoConfig, AutoTokenizer

    from llmtrain.config import load_config
    from llmtrain.distill.config import DistillConfig

    root, log = fake_build
    shutil.copytree(tiny_model, root / "tiny-llama", dirs_exist_ok=True)  # a real base model to build from
    demo.write_jsonl(demo.make_rows(200, seed=0), root / "train.jsonl")  # and the rows it was built from (conftest)
    monkeypatch.setenv("LLMTRAIN_CACHE", str(root.parent))
    names = ["model.name_or_path=demo:tiny-llama-small", "data.train=demo:train"]
    cfg = load_config(None, [*names, "distill.teacher=demo:tiny-llama-teacher"], DistillConfig)
    notes = demo.resolve_demo_names(cfg, train=False)
    assert not log.exists() and not (root / "tiny-llama-teacher").exists()  # no training child ran
    assert cfg.distill.teacher == str(root / "tiny-llama")
    assert notes == [n for n in notes if n.startswith("demo:tiny-llama-teacher is not built yet: the run builds it")]
    assert len(notes) == 1 and "three epochs" in notes[0]
    small, base = AutoConfig.from_pretrained(cfg.model.name_or_path), AutoConfig.from_pretrained(root / "tiny-llama")
    assert (small.hidden_size, small.num_hidden_layers) == (base.hidden_size // 2, base.num_hidden_layers // 2)
    assert small.head_dim * small.num_attention_heads == small.hidden_size
    vocab = AutoTokenizer.from_pretrained(cfg.model.name_or_path).get_vocab()
    assert vocab == AutoTokenizer.from_pretrained(root / "tiny-llama").get_vocab()


def test_the_images_demo_draws_answerable_pictures_for_a_model_that_reads_them(tmp_path):
    """Each picture's answer is what was drawn (its colour is in its pixels; the dots are
    black 2x2 squares), and the demo's model, loaded as a run loads it, turns a row into its
    image tokens (one per 4x4 patch) with the answer alone trained."""
    import random

    import numpy as np

    from llmtrain.config import DataConfig, ModelConfig
    from llmtrain.data.rows import IGNORE, FileRow
    from llmtrain.model import load_tokenizer
    from llmtrain.vision import IMAGE_ROWS

    rng = random.Random(0)
    for _ in range(20):
        image, answers = demo.draw_shape(rng)
        pixels = [tuple(p) for p in np.asarray(image).reshape(-1, 3).tolist()]
        assert demo.SHADES[answers["colour"]] in pixels and answers["shape"] in demo.SHAPES
        assert pixels.count((0, 0, 0)) == 4 * int(answers["dots"])
        black = np.argwhere((np.asarray(image) == 0).all(-1))
        cells = {(int(y) // demo.IMAGE_PATCH, int(x) // demo.IMAGE_PATCH) for y, x in black}
        assert len(cells) == int(answers["dots"])  # each dot whole inside a patch of its own
    demo.build_shapes(tmp_path, count_rows=3, train_rows=4, eval_rows=2)
    counting = [json.loads(line) for line in (tmp_path / "shapes" / "count.jsonl").read_text().splitlines()]
    assert len(counting) == 3 and {r["messages"][0]["content"][1]["text"] for r in counting} == {"How many dots?"}
    demo.build_vision_model(tmp_path)
    tokenizer = load_tokenizer(ModelConfig(name_or_path=str(tmp_path / "tiny-vlm")), vision=True)
    rows = (tmp_path / "shapes" / "train.jsonl").read_text().splitlines()
    example = IMAGE_ROWS.process(json.loads(rows[0]), tokenizer, DataConfig())
    assert example["status"].startswith("error: image 'img/train-0.png' is a relative path")  # no data file's folder
    row = FileRow(json.loads(rows[0]))
    row.root = tmp_path / "shapes"
    example = IMAGE_ROWS.process(row, tokenizer, DataConfig())
    assert example["input_ids"].count(tokenizer.convert_tokens_to_ids("<image>")) == (32 // 4) ** 2
    answer = json.loads(rows[0])["messages"][1]["content"]
    assert tokenizer.decode([t for t in example["labels"] if t != IGNORE]) == f"{answer}<|im_end|>\n"
