"""`llmtrain eval` (llmtrain/evaluation.py) on real runs: its figures for a model are the ones
the run's own evaluation rows show for it, on one process and under DDP, with the difference
between two models."""

import json
import math
from pathlib import Path

import pytest

from llmtrain.demo import make_prompts, write_jsonl
from tests.support.runs import llmtrain_eval, metrics, recipe_args, run_recipe


def task_files(root: Path) -> tuple[Path, Path]:
    """Prompts with answers, and a reward a random model's answers spread over."""
    write_jsonl(make_prompts(7, seed=5), root / "task.jsonl")
    (root / "task_rewards.py").write_text(
        "def even(completion_ids, **kwargs):\n"
        "    return [sum(t % 2 == 0 for t in ids) / max(len(ids), 1) for ids in completion_ids]\n"
    )
    return root / "task.jsonl", root / "task_rewards.py"


LM_EVAL_TASK = """task: llmtrain_tiny_sums
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""


@pytest.fixture(scope="module")
def lm_tasks(tmp_path_factory) -> Path:
    """A folder with a local lm-eval task (offline: its data is a file): 12 sums, 3 choices."""
    import random

    rng, rows = random.Random(0), []
    for _ in range(12):
        a, b = rng.randint(1, 9), rng.randint(1, 9)
        rows.append({"question": f"What is {a} + {b}?", "choices": [str(a + b), str(a * b + 1), "0"], "answer": 0})
    tasks = tmp_path_factory.mktemp("lm-tasks")
    (tasks / "sums.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tasks / "sums.yaml").write_text(LM_EVAL_TASK.format(data=tasks / "sums.jsonl"))
    return tasks


@pytest.fixture(scope="module")
def sft_run(base_config, tiny_model, chat_file, cache_env, lm_tasks, tmp_path_factory):
    """A 3-step SFT run evaluated at steps 0 and 3: its held-out loss, and a generation task
    of 7 prompts, 3 answers each, sampled, scored by two functions; and the lm-eval task on
    its checkpoint of step 3, in a process of its own."""
    out, (prompts, rewards) = tmp_path_factory.mktemp("eval") / "run", task_files(tmp_path_factory.mktemp("task"))
    task = f"{{name: sums, prompts: {prompts}, rewards: [accuracy, {rewards}:even], samples: 3, max_new_tokens: 6, "
    task += "pass_threshold: 0.5, temperature: 1.5}"
    extra = [f"data.eval={chat_file}", "train.micro_batch_size=2", "train.max_steps=3", "eval.every_steps=3"]
    extra += [f"eval.tasks=[{task}]"]
    lm_eval = ["eval.lm_eval_tasks=[llmtrain_tiny_sums]", f"eval.lm_eval_include={lm_tasks}"]
    run_recipe(
        recipe_args(base_config, tiny_model, chat_file, out, *extra, *lm_eval, "checkpoint.every_steps=3"), cache_env
    )
    evals = [r for r in metrics(out) if "eval_loss" in r]
    assert [r["step"] for r in evals] == [0, 3]
    return out, evals, extra


@pytest.mark.parametrize("nproc", [1, 2], ids=["1proc", "2proc"])
def test_eval_gives_the_runs_own_evaluation_of_the_base_and_the_trained_model(
    sft_run, base_config, tiny_model, chat_file, cache_env, tmp_path, nproc
):
    out, evals, extra = sft_run
    results = tmp_path / "results.json"
    args = [str(tiny_model), str(out / "final"), "--config", str(base_config), "--output", str(results)]
    args += [f"model.name_or_path={tiny_model}", f"data.train={chat_file}", *extra]
    proc = llmtrain_eval(args, cache_env, nproc=nproc)
    report = json.loads(results.read_text())
    base, trained = report["models"][str(tiny_model)], report["models"][str(out / "final")]
    assert base["eval_loss"] == pytest.approx(evals[0]["eval_loss"], rel=1e-6)  # the run's step 0: its base
    assert trained["eval_loss"] == pytest.approx(evals[1]["eval_loss"], rel=1e-6)  # and its last step
    assert trained["eval_perplexity"] == pytest.approx(math.exp(trained["eval_loss"]))
    assert report["difference"]["eval_loss"] == pytest.approx(trained["eval_loss"] - base["eval_loss"])
    # The generation task: the run's own figures on one process, whatever the layout here.
    task = {k for k in evals[0] if k.startswith("eval_sums/")}
    assert {"eval_sums/pass@1", "eval_sums/pass@2", "eval_sums/pass@3", "eval_sums/pass@3_even"} <= task
    assert {"eval_sums/reward_accuracy", "eval_sums/reward_even"} <= task
    for got, row in ((base, evals[0]), (trained, evals[1])):
        assert {k: got[k] for k in task} == pytest.approx({k: row[k] for k in task}, rel=1e-6, abs=1e-9)
    assert evals[0]["eval_sums/pass@3_even"] > 0 and evals[0]["eval_sums/pass@1_even"] < 1  # a spread to compare
    lines = proc.stdout.splitlines()
    header = next(line for line in lines if line.split()[-1:] == ["difference"])
    assert header.split() == [tiny_model.name, "run/final", "difference"]
    row = next(line for line in lines if line.startswith("eval_loss "))
    assert row.split()[1:] == [
        f"{base['eval_loss']:.4f}",
        f"{trained['eval_loss']:.4f}",
        f"{trained['eval_loss'] - base['eval_loss']:+.4f}",
    ]
    assert not any(p.name != "run" for p in out.parent.iterdir())  # nothing written beside the run


def test_eval_loads_a_checkpoint_into_the_model_its_run_built(
    sft_run, base_config, tiny_model, chat_file, cache_env, tmp_path
):
    """checkpoints/step-N holds what Accelerate saved, not a model directory: measured on the
    model its run's config.yaml builds, with those weights."""
    out, evals, extra = sft_run
    results = tmp_path / "results.json"
    step = out / "checkpoints" / "step-3"
    args = [str(step), "--config", str(base_config), "--output", str(results), f"data.train={chat_file}"]
    llmtrain_eval([*args, f"model.name_or_path={tiny_model}", *extra], cache_env)
    got = json.loads(results.read_text())["models"][str(step)]
    assert got["eval_loss"] == pytest.approx(evals[1]["eval_loss"], rel=1e-6)


def test_eval_merges_a_lora_runs_adapters_into_their_base(base_config, tiny_model, chat_file, cache_env, tmp_path):
    """A LoRA run's final/ holds adapters only: they are measured on the base they name."""
    out = tmp_path / "lora"
    extra = [f"data.eval={chat_file}", "train.micro_batch_size=4", "train.max_steps=2", "train.lr=1e-2"]
    lora = ["model.lora.enabled=true", "checkpoint.every_steps=2"]
    run_recipe(recipe_args(base_config, tiny_model, chat_file, out, *extra, *lora), cache_env)
    assert (out / "final" / "adapter_config.json").is_file() and not (out / "final" / "config.json").exists()
    results = tmp_path / "results.json"
    args = [str(out / "final"), "--config", str(base_config), "--output", str(results), f"data.train={chat_file}"]
    llmtrain_eval([*args, f"model.name_or_path={tiny_model}", *extra], cache_env)
    got = json.loads(results.read_text())["models"][str(out / "final")]
    last = [r for r in metrics(out) if "eval_loss" in r][-1]["eval_loss"]
    assert got["eval_loss"] == pytest.approx(last, rel=1e-5)
    step = out / "checkpoints" / "step-2"  # its checkpoint: the adapters on the base, as the run built them
    llmtrain_eval([str(step), *args[1:], f"model.name_or_path={tiny_model}", *extra], cache_env)
    assert json.loads(results.read_text())["models"][str(step)]["eval_loss"] == pytest.approx(last, rel=1e-5)


def test_evaluating_changes_no_training_number(base_config, tiny_model, chat_file, cache_env, tmp_path):
    """The same run with an evaluation after every step (held-out loss and a sampled
    generation task) and without any: the same losses, gradient norms and final weights,
    bit for bit. The model has dropout, so an evaluation that left it in eval mode, or drew
    from the training's random state, would show."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dropped = tmp_path / "dropout-model"
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    model.config.attention_dropout = 0.2
    model.save_pretrained(dropped)
    AutoTokenizer.from_pretrained(tiny_model).save_pretrained(dropped)
    common = ["train.micro_batch_size=2", "train.max_steps=4", "model.dropout=model"]
    with_eval, without = tmp_path / "with", tmp_path / "without"
    prompts, rewards = task_files(tmp_path)
    task = f"{{name: t, prompts: {prompts}, rewards: [{rewards}:even], samples: 2, max_new_tokens: 4}}"
    evaluating = [f"data.eval={chat_file}", "eval.every_steps=1", "eval.micro_batch_size=3", f"eval.tasks=[{task}]"]
    run_recipe(recipe_args(base_config, dropped, chat_file, with_eval, *common, *evaluating), cache_env)
    run_recipe(recipe_args(base_config, dropped, chat_file, without, *common), cache_env)
    evals = [r for r in metrics(with_eval) if "eval_loss" in r]
    assert len(evals) == 5 and all("eval_t/pass@2" in r for r in evals)  # before the first step and after each
    rows = [[(r["loss"], r["grad_norm"]) for r in metrics(run) if "loss" in r] for run in (with_eval, without)]
    assert rows[0] == rows[1] and len(rows[0]) == 4
    mine, theirs = (load_file(run / "final" / "model.safetensors") for run in (with_eval, without))
    assert all(torch.equal(mine[k], theirs[k]) for k in theirs)


@pytest.mark.parametrize("nproc", [1, 2], ids=["1proc", "2proc"])
def test_lm_eval_tasks_score_as_lm_eval_run_by_hand(
    sft_run, base_config, tiny_model, chat_file, cache_env, lm_tasks, tmp_path, nproc
):
    """A local lm-eval task on the trained model: llmtrain eval gives the score `lm_eval
    --model hf` gives, on one process and on two; and so did the run itself, on the
    checkpoint of its last step (the same weights), in a process of its own."""
    import sys

    from tests.support.runs import run_python

    tasks = lm_tasks
    out, _, extra = sft_run
    results = tmp_path / "results.json"
    args = [str(out / "final"), "--config", str(base_config), "--output", str(results), f"data.train={chat_file}"]
    args += [f"model.name_or_path={tiny_model}", *extra, "eval.lm_eval_tasks=[llmtrain_tiny_sums]"]
    llmtrain_eval([*args, f"eval.lm_eval_include={tasks}"], cache_env, nproc=nproc)
    got = json.loads(results.read_text())["models"][str(out / "final")]

    by_hand = tmp_path / "by-hand"
    command = [sys.executable, str(Path(sys.executable).parent / "lm_eval"), "--model", "hf"]
    command += ["--model_args", f"pretrained={out / 'final'}", "--tasks", "llmtrain_tiny_sums"]
    command += ["--include_path", str(tasks), "--device", "cpu", "--batch_size", "2", "--output_path", str(by_hand)]
    proc = run_python(command, cache_env, 600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (written,) = by_hand.rglob("results_*.json")
    want = json.loads(written.read_text())["results"]["llmtrain_tiny_sums"]["acc,none"]
    assert got["llmtrain_tiny_sums/acc"] == pytest.approx(want) and 0 <= want <= 1
    in_run = [r for r in metrics(out) if "lm_eval/llmtrain_tiny_sums/acc" in r]
    assert [r["step"] for r in in_run] == [3] and in_run[0]["lm_eval/llmtrain_tiny_sums/acc"] == pytest.approx(want)
    assert "eval_loss" in got  # beside the recipe's own measures
    if nproc == 1:  # a task lm-eval does not know: one line, naming where tasks come from
        proc = llmtrain_eval(
            [*args, f"eval.lm_eval_include={tasks}", "eval.lm_eval_tasks=[sumz]"], cache_env, check=False
        )
        error = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
        assert proc.returncode == 2 and error == [f"error: eval.lm_eval_tasks: no task sumz in lm-eval or in {tasks}"]


def test_a_resumed_run_joins_finished_lm_evals_and_redoes_only_unfinished_ones(
    base_config, tiny_model, chat_file, cache_env, lm_tasks, tmp_path
):
    """As a kill leaves a run: the lm-eval of step 1 finished but never joined (its result,
    no row), that of step 2 started but unfinished (its linked checkpoint, no result). The
    resumed run joins step 1's result without running it again, runs step 2's, then its own
    of step 3; checkpoint.keep_last=1 removing checkpoints meanwhile takes nothing they read."""
    import os
    import shutil

    out = tmp_path / "run"
    lm_eval = ["eval.lm_eval_tasks=[llmtrain_tiny_sums]", f"eval.lm_eval_include={lm_tasks}"]
    common = ["train.micro_batch_size=2", "checkpoint.every_steps=1", "checkpoint.keep_last=1", *lm_eval]
    run_recipe(recipe_args(base_config, tiny_model, chat_file, out, *common, "train.max_steps=2"), cache_env)
    key = "lm_eval/llmtrain_tiny_sums/acc"
    first = {r["step"]: r[key] for r in metrics(out) if key in r}
    assert sorted(first) == [1, 2] and not (out / "checkpoints" / "step-1").exists()
    evals = out / "evals"
    assert sorted(p.name for p in evals.iterdir()) == ["step-1.json", "step-1.log", "step-2.json", "step-2.log"]
    rows = (out / "metrics.jsonl").read_text().splitlines()
    (out / "metrics.jsonl").write_text("".join(row + "\n" for row in rows if key not in row))  # neither joined
    (evals / "step-2.json").unlink()
    (evals / "step-2").mkdir()
    for name in ("model.safetensors", "config.yaml", "train_state.json"):
        shutil.copy(out / "checkpoints" / "step-2" / name, evals / "step-2" / name)
    (evals / "step-1.log").write_text("the first run's\n")
    os.utime(evals / "step-1.json", (1, 1))

    run_recipe(recipe_args(base_config, tiny_model, chat_file, out, *common, "train.max_steps=3"), cache_env)
    again = [(r["step"], r[key]) for r in metrics(out) if key in r]
    assert sorted(again) == [(1, first[1]), (2, first[2]), (3, again[-1][1])] and len(again) == 3
    assert (evals / "step-1.log").read_text() == "the first run's\n" and os.stat(evals / "step-1.json").st_mtime == 1
    assert (evals / "step-2.json").is_file() and not (evals / "step-2").exists()
