"""The benchmarks compare like with like: on its template, llmtrain trains exactly the
tokens that transformers' assistant mask (what TRL's assistant_only_loss uses) marks, and
on the DPO benchmark's pairs the sequences and answer tokens of TRL's DPOTrainer."""

import importlib.util
import sys

import pytest

from llmtrain.config import DataConfig
from llmtrain.data.rows import IGNORE, process_row
from llmtrain.preference.pairs import PAIRS
from tests.support.runs import ROOT


def load(name: str):
    """A benchmark script as a module; its folder goes on sys.path as when it is run."""
    if str(ROOT / "benchmarks") not in sys.path:
        sys.path.insert(0, str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


bench = load("sft_vs_trl")
dpo_bench = load("dpo_vs_trl")


def test_trained_tokens_match_the_assistant_mask(tokenizer):
    tok = type(tokenizer).from_pretrained(tokenizer.name_or_path)
    tok.chat_template = bench.TEMPLATE
    for row in bench.make_rows(20, seed=1, seq=256):
        ours = process_row(row, "chat", tok, DataConfig(max_seq_len=10_000))
        theirs = tok.apply_chat_template(
            row["messages"], return_dict=True, return_assistant_tokens_mask=True, tokenize=True
        )
        assert ours["input_ids"] == theirs["input_ids"]
        trained_positions = [t + 1 for t, label in enumerate(ours["labels"]) if label != IGNORE]
        assert trained_positions == [i for i, m in enumerate(theirs["assistant_masks"]) if m]


def test_row_lengths_spread_like_instruction_data():
    lengths = sorted(sum(len(m["content"]) for m in r["messages"]) for r in bench.make_rows(500, seed=0, seq=512))
    median, p95 = lengths[250], lengths[475]
    assert 50 < median < 250 and p95 > 2 * median  # a long tail


def test_dpo_pairs_train_the_tokens_trl_trains(tokenizer):
    """llmtrain's pairs (pairs.PAIRS.process) against TRL's DPOTrainer tokenization (its
    _prepare_dataset; the collator then joins prompt and answer, the completion mask on
    the answer): the same sequences, and the same answer tokens trained."""
    pytest.importorskip("trl")
    from types import SimpleNamespace

    import datasets
    from trl import DPOTrainer

    rows = dpo_bench.make_pairs(20, seed=1, seq=256)
    # DPOTrainer.__init__ would load a model and build an Accelerator; tokenizing reads only these.
    trainer = object.__new__(DPOTrainer)
    trainer._tokenizer = tokenizer
    args = SimpleNamespace(dataset_num_proc=None, max_length=256, truncation_mode="keep_start")
    theirs = DPOTrainer._prepare_dataset(trainer, datasets.Dataset.from_list(rows), tokenizer, args, "train")
    assert len(theirs) == len(rows)
    for row, trl_row in zip(rows, theirs):
        ours = PAIRS.process(row, tokenizer, DataConfig(max_seq_len=256))
        assert ours["status"] == "ok"
        prompt = len(trl_row["prompt_ids"])
        for side in ("chosen", "rejected"):
            ids = trl_row["prompt_ids"] + trl_row[f"{side}_ids"]
            assert ours[f"{side}_input_ids"] == ids
            trained_positions = [t + 1 for t, label in enumerate(ours[f"{side}_labels"]) if label != IGNORE]
            assert trained_positions == list(range(prompt, len(ids)))


def test_dpo_pairs_spread_and_fit_the_max_length(tokenizer):
    """Lengths with a long tail and answers of their own lengths, and no pair over the
    maximum length (the two systems would truncate it differently)."""
    for seq in (256, 512):
        done = [PAIRS.process(r, tokenizer, DataConfig(max_seq_len=seq)) for r in dpo_bench.make_pairs(200, 0, seq)]
        assert {d["status"] for d in done} == {"ok"}
        longest = sorted(max(len(d["chosen_input_ids"]), len(d["rejected_input_ids"])) for d in done)
        assert longest[-1] <= seq and longest[190] > 1.5 * longest[100]  # a long tail
        assert sum(len(d["chosen_input_ids"]) != len(d["rejected_input_ids"]) for d in done) > 180


def test_the_checksum_measurement_runs():
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "benchmarks/checkpoint_checksums.py", "--gib", "0.01"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "checksums after writing" in proc.stdout and "verifying before a resume" in proc.stdout


def test_grpo_benchmark_asks_both_systems_the_same_questions():
    """Both systems get each demo question as one user message (no system turn), with its
    answer, which llmtrain's accuracy reward (TRL calls it as one of its own) checks."""
    grpo_bench = load("grpo_vs_trl")
    from llmtrain.demo import make_prompts
    from llmtrain.rl.rewards import accuracy

    rows = [grpo_bench.as_user_message(r) for r in make_prompts(6, seed=1)]
    assert all(r["prompt"] == [{"role": "user", "content": r["prompt"][0]["content"]}] for r in rows)
    assert (
        accuracy(None, [[{"role": "assistant", "content": r["answer"]}] for r in rows], [r["answer"] for r in rows])
        == [1.0] * 6
    )


BENCH_SETUP = {"micro": 8, "seq": 512, "precision": "no", "mean_row_tokens": 180.0, "steps": 22}


def test_trl_at_its_best_recomputes_nothing(tmp_path):
    """TRL's SFTConfig turns gradient checkpointing on by default, llmtrain's config off:
    TRL's best settings, and the step-time comparison, must turn it off, or TRL pays for a
    second forward pass that llmtrain does not (an earlier table did exactly that)."""
    pytest.importorskip("trl")
    from trl import SFTConfig

    assert SFTConfig(output_dir=str(tmp_path), use_cpu=True).gradient_checkpointing  # TRL's default
    assert not bench.trl_config(BENCH_SETUP, tmp_path, best=True).gradient_checkpointing
    assert bench.trl_config(BENCH_SETUP, tmp_path, best=False).gradient_checkpointing  # its defaults, as they come


@pytest.mark.parametrize("compiled", [False, True])
def test_the_step_time_comparison_is_the_same_work(tmp_path, compiled):
    """Both systems train on the same rows in each step (file order, no shuffling), padded,
    8 to a step, without recomputing activations; with --compile both compile, else neither."""
    pytest.importorskip("trl")
    step = load("sft_step_time")
    setup = BENCH_SETUP | {"compile": compiled}
    theirs = step.trl_config(setup, tmp_path)
    assert theirs.train_sampling_strategy == "sequential" and not theirs.gradient_checkpointing
    assert not theirs.packing and not theirs.padding_free and theirs.per_device_train_batch_size == 8
    assert theirs.gradient_accumulation_steps == 1 and theirs.max_steps == 22
    assert theirs.torch_compile is compiled
    ours = step.ours_args(setup | {"model": "m", "data": "d"}, 22)
    for override in ("data.shuffle=false", "data.packing=false", "train.micro_batch_size=8", "train.max_steps=22"):
        assert override in ours
    assert f"train.compile={str(compiled).lower()}" in ours
    assert not any(a.startswith(("model.gradient_checkpointing", "train.grad_accum_steps")) for a in ours)


def test_a_benchmark_run_starts_from_an_empty_output_directory(tmp_path):
    """llmtrain takes a finished run with the same settings in its output_dir as done and
    trains nothing, so a benchmark rerun would read the last run's metrics: run_ours
    empties the directory first."""
    harness = load("harness")
    out = tmp_path / "llmtrain-0"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')
    with pytest.raises(RuntimeError, match="config"):
        harness.run_ours("finetune.py", {"precision": "no"}, out, ["--config", str(tmp_path / "missing.yaml")])
    assert not (out / "metrics.jsonl").exists()


def test_every_part_step_checks_times_is_a_function_the_loop_calls():
    """benchmarks/step_checks.py wraps functions by module and name: each must exist (a
    rename would otherwise surface only when the benchmark is next run)."""
    import importlib

    checks = load("step_checks")
    for _, module, path in checks.PARTS:
        owner = importlib.import_module(module)
        for part in path.split("."):
            owner = getattr(owner, part)
        assert callable(owner), path
    assert set(checks.OUTER) | set(checks.INNER) <= {path for _, _, path in checks.PARTS}


def test_the_padding_mask_timing_pads_as_llmtrain_pads_and_compares_the_same_work():
    """Rows right-padded to the longest of their batch (as batches.Collator pads), the padding
    holding no token, and the two passes giving the same output at the real positions."""
    import torch

    mask_bench = load("padding_mask")
    w = dict(mask_bench.WORKLOADS["cpu"], hidden=32, layers=2, heads=2, kv=2, ffn=64, seq=48)
    data = mask_bench.batches(w, 3, torch.device("cpu"))
    for ids, mask in data:
        lengths = mask.sum(1)
        assert mask.shape[1] == int(lengths.max()) and int(lengths.min()) >= w["seq"] // 4
        assert torch.equal(mask, (torch.arange(mask.shape[1]) < lengths[:, None]).long())  # on the right
        assert not ids[mask == 0].any()
    model = mask_bench.build(w, torch.device("cpu"))
    _, given = mask_bench.passes(model, data, True, torch.device("cpu"))
    _, left_out = mask_bench.passes(model, data, False, torch.device("cpu"))
    assert all(torch.equal(a, b) for a, b in zip(given, left_out, strict=True))


def test_the_cpu_load_benchmark_compares_libgomps_own_wait_with_llmtrains():
    """benchmarks/cpu_load.py's first row must be the behaviour before llmtrain set a spin
    count (libgomp's 300,000 spins, which llmtrain then leaves alone), its second llmtrain's
    default, its third sleeping at once."""
    import subprocess
    import sys

    cpu_load = load("cpu_load")
    probe = "import os, llmtrain; print(os.getenv('OMP_WAIT_POLICY'), os.getenv('GOMP_SPINCOUNT'))"
    seen = []
    for extra in cpu_load.VARIANTS.values():
        env = cpu_load.base_env() | extra
        proc = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=60)
        seen.append(proc.stdout.split())
    assert seen[:3] == [["None", "300000"], ["None", "3000"], ["PASSIVE", "None"]]


def test_agents_benchmark_gives_both_systems_the_same_tools_calls_and_questions(tokenizer):
    """Both systems get each calculator question as one user message, the same tools (TRL the
    functions, llmtrain their names), and read the demo model's calls alike: TRL's
    parse_response on the tokenizer llmtrain prepares gives the calls llmtrain's parser gives.
    The accuracy reward reads an episode's last answer, not a tool's result."""
    import copy

    from trl.chat_template_utils import parse_response, supports_tool_calling

    from llmtrain.calculator import add, multiply
    from llmtrain.demo import CALC_CUE, CALC_TOOLS, TOOL_CHAT_TEMPLATE, make_calc_prompts
    from llmtrain.rl.prompts import prompt_ids
    from llmtrain.rl.rewards import accuracy
    from llmtrain.rl.tools import load_tools
    from llmtrain.rl.turns import check_parser, parse_turn

    agents_bench = load("agents_vs_trl")
    assert [t.fn for t in load_tools(CALC_TOOLS)] == [add, multiply]
    rows = [agents_bench.as_user_message(r) for r in make_calc_prompts(4, seed=1)]
    assert all(r["prompt"] == [{"role": "user", "content": r["prompt"][0]["content"]}] for r in rows)
    cued = agents_bench.as_user_message(make_calc_prompts(1, seed=1)[0], cued=True)["prompt"]
    assert cued == [{"role": "system", "content": CALC_CUE}, rows[0]["prompt"][0]]
    cued = agents_bench.as_user_message(make_calc_prompts(1, seed=1)[0], cued=True)["prompt"]
    assert cued == [{"role": "system", "content": CALC_CUE}, rows[0]["prompt"][0]]
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = TOOL_CHAT_TEMPLATE
    check_parser(tok)
    assert supports_tool_calling(tok)
    schemas = [t.schema for t in load_tools(CALC_TOOLS)]
    prompt = prompt_ids(rows[0]["prompt"], tok, schemas)
    call = '<tool_call>\n{"arguments": {"a": 12, "b": 34}, "name": "multiply"}\n</tool_call>'
    ids = tok(call, add_special_tokens=False)["input_ids"] + [tok.convert_tokens_to_ids("<|im_end|>")]
    ours = parse_turn(tok, ids, prompt, [ids[-1]], tools=schemas).calls
    theirs = parse_response(tok, ids, prefix=prompt, tools=[add, multiply])["tool_calls"]
    assert ours == [("multiply", {"a": 12, "b": 34})]
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in theirs] == ours
    episode = [
        {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": theirs[0]["function"]}]},
        {"role": "tool", "name": "multiply", "content": "408"},
        {"role": "assistant", "content": "408"},
    ]
    assert accuracy(None, [episode, episode[:2]], ["408", "408"]) == [1.0, 0.0]


def test_distillation_benchmark_trains_the_answer_tokens_trl_trains(tokenizer):
    """On the benchmark's one-answer rows, llmtrain's trained tokens are TRL's GKD collator's
    (DataCollatorForChatML: everything after the prompt), but for the newline the chat
    template writes after the end of turn, which TRL trains too; the held-out measure is the
    divergence over the same tokens for both systems."""
    from trl.experimental.utils import DataCollatorForChatML

    from llmtrain.data.build import ROWS
    from llmtrain.demo import make_rows

    distill_bench = load("distill_vs_trl")
    rows = distill_bench.one_answer(make_rows(40, seed=1))
    assert len(rows) > 10 and all(sum(m["role"] == "assistant" for m in r["messages"]) == 1 for r in rows)
    theirs = DataCollatorForChatML(tokenizer=tokenizer, max_length=256)
    for row in rows:
        ours = ROWS.process(row, tokenizer, DataConfig(max_seq_len=256))
        trained = [t for t in ours["labels"] if t != IGNORE]
        batch = theirs([row])
        labels = batch["labels"][0][batch["attention_mask"][0] == 1].tolist()
        trl_trained = [t for t in labels if t != IGNORE]
        assert trl_trained[: len(trained)] == trained
        assert tokenizer.decode(trl_trained[len(trained) :]) in ("", "\n")
