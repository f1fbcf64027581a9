"""recipes/grpo.py launched as a user launches it, on a tiny model, prompts with answers,
and a reward function from a file: the same global batch of prompts gives the same
completions, rewards and update on one process or two, in any split into micro-batches,
under DDP, ZeRO-3 and FSDP2; a run killed within a generation round resumes exactly;
a broken reward function is one line."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from llmtrain.demo import make_prompts, write_jsonl
from tests.support.runs import (
    assert_same_rounds,
    check_card,
    kill_run,
    launch,
    launch_command,
    llmtrain_eval,
    metrics,
    recipe_args,
    rewind,
    run_python,
    run_recipe,
    start_run,
    train_rows,
    wait_for,
)

pytestmark = pytest.mark.slow

GRPO_RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "grpo.py"
# Generated the same on every layout: compared exactly.
SAME = ["reward", "reward_even", "reward_accuracy", "completion_len", "completion_len_max", "zero_spread_groups"]


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("grpo")
    write_jsonl(make_prompts(24, seed=31), root / "prompts.jsonl")
    (root / "rewards.py").write_text(
        "def even(prompts, completions, completion_ids, **kwargs):\n"
        "    # the share of even token ids: a reward a random model's samples spread over\n"
        "    return [sum(t % 2 == 0 for t in ids) / len(ids) for ids in completion_ids]\n"
    )
    return root / "prompts.jsonl", root / "rewards.py"


@pytest.fixture(scope="module")
def args(base_config, tiny_model, files):
    prompts, rewards = files

    def make(out: Path, *extra: str) -> list[str]:
        return recipe_args(
            base_config,
            tiny_model,
            prompts,
            out,
            "data.max_seq_len=96",
            "grpo.num_generations=4",
            "grpo.max_completion_length=8",
            f"grpo.rewards=[{rewards}:even,accuracy]",
            "grpo.reward_weights=[1.0,0.5]",
            "grpo.log_completions=1",
            *extra,
        )

    return make


def grpo(args: list[str], env: dict, nproc: int = 1, **kw):
    return run_recipe(args, env, nproc=nproc, recipe=GRPO_RECIPE, **kw)


def assert_same_steps(got: Path, want: Path, name: str, weights: bool = True) -> None:
    assert_same_rounds(got, want, name, SAME, weights)  # the same completions


# Four prompts (16 completions) a step, two optimizer steps per generation round, a KL term
# to the starting weights (a frozen copy): every part of the loss in play.
RUN = ["train.max_steps=4", "grpo.num_iterations=2", "grpo.beta=0.05", "train.lr=1e-3", "log.every_steps=1"]


# The held-out evaluation, sampled: three completions per prompt at a temperature of its own,
# before the first step and after the last (the runs compared with one_process that leave it
# out train alike: evaluating changes no training number).
def sampled_eval(files) -> list[str]:
    return [f"data.eval={files[0]}", "grpo.eval_samples=3", "grpo.eval_temperature=0.7"]


@pytest.fixture(scope="module")
def one_process(args, cache_env, files, tmp_path_factory):
    out = tmp_path_factory.mktemp("grpo-one") / "run"
    run = [*RUN, "train.micro_batch_size=4", "checkpoint.every_steps=1", *sampled_eval(files)]
    proc = grpo(args(out, *run), cache_env)
    assert "completion> " in proc.stdout and "global batch 4 prompts" in proc.stdout
    return out


def test_the_first_steps_learn_from_real_rewards(one_process):
    rows = train_rows(one_process)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(0 < r["reward_even"] <= 1 and r["completion_len"] > 0 for r in rows)
    assert rows[0]["clip_ratio"] == 0.0 and rows[0]["kl"] == pytest.approx(0.0, abs=1e-6)  # the policy is the reference
    assert rows[1]["kl"] > 0  # after one update, the round's second step
    assert rows[0]["reward"] == rows[1]["reward"] != rows[2]["reward"]  # a round's two steps share its completions
    assert all(0 < r["generation_s"] < r["step_s"] for r in rows[::2])  # a round's first step generates


def test_lora_measures_its_kl_against_the_adapters_off(args, cache_env, tmp_path):
    """With LoRA the reference is the same model with its adapters off: no KL before the
    first update, some after it; final/ holds the adapter and the merged model."""
    out = tmp_path / "lora"
    lora = ["model.lora.enabled=true", "model.lora.r=4", "train.micro_batch_size=4", "export.merge_lora=true"]
    lora.append("model.gradient_checkpointing=true")  # generation runs in eval mode, with its cache
    proc = grpo(args(out, *RUN, *lora), cache_env)
    assert "frozen" not in proc.stdout
    rows = train_rows(out)
    assert rows[0]["kl"] == pytest.approx(0.0, abs=1e-7) and rows[1]["kl"] > 0
    assert (out / "final" / "adapter" / "adapter_config.json").is_file() or (
        out / "final" / "adapter_config.json"
    ).is_file()
    check_card(out / "final", ["grpo", "lora"], "AutoModelForCausalLM")  # merged


@pytest.mark.parametrize(
    ("nproc", "micro", "accum"),
    [(1, 1, 4), (2, 2, 1), (2, 1, 2)],
    ids=["1proc_1x4", "2proc_2x1", "2proc_1x2"],
)
def test_every_layout_generates_scores_and_updates_the_same(
    args, cache_env, files, one_process, tmp_path, nproc, micro, accum
):
    out = tmp_path / "run"
    layout = [f"train.micro_batch_size={micro}", f"train.grad_accum_steps={accum}"]
    grpo(args(out, *RUN, *layout, *sampled_eval(files)), cache_env, nproc=nproc)
    assert_same_steps(out, one_process, f"{nproc} x {micro} x {accum}")
    # The sampled evaluation draws the same completions on any layout: the same mean reward
    # and pass@k, up to the order the processes' sums are added in.
    evals, want = [[r for r in metrics(run) if "eval_reward" in r] for run in (out, one_process)]
    assert [r["step"] for r in evals] == [r["step"] for r in want] == [0, 4]
    for a, b in zip(evals, want):
        assert set(a) == set(b) and {"eval_pass@1", "eval_pass@2", "eval_pass@3_even"} <= set(a), sorted(a)
        assert a == pytest.approx(b, rel=1e-6, abs=1e-7)
    assert 0 < want[0]["eval_reward_even"] < 1 and want[0]["eval_pass@1"] <= want[0]["eval_pass@3"]


# The newer entries of the loss and advantage tables, and the sampler correction (on CPU the
# sampler and the trainer agree, so its weights are 1 to float rounding): each one's run on
# one process x 4 prompts and on two processes x 1 x 2 accumulated.
ENTRIES = {
    "cispo-rloo-tis": ["grpo.loss_type=cispo", "grpo.cispo_epsilon_high=0.1", "grpo.scale_rewards=rloo"]
    + ["grpo.importance_correction=tis"],
    "gspo-mis-sequence": ["grpo.loss_type=gspo", "grpo.importance_correction=mis", "grpo.importance_level=sequence"],
    "gspo_token": ["grpo.loss_type=gspo_token"],
}


@pytest.mark.parametrize("entry", sorted(ENTRIES))
def test_each_loss_estimator_and_correction_updates_the_same_on_any_layout(
    args, cache_env, one_process, tmp_path, entry
):
    one, two = tmp_path / "one", tmp_path / "two"
    grpo(args(one, *RUN, "train.micro_batch_size=4", *ENTRIES[entry]), cache_env)
    layout = ["train.micro_batch_size=1", "train.grad_accum_steps=2"]
    grpo(args(two, *RUN, *layout, *ENTRIES[entry]), cache_env, nproc=2)
    assert_same_steps(two, one, entry)
    rows, default = train_rows(one), train_rows(one_process)
    assert [r["reward"] for r in rows[:2]] == [r["reward"] for r in default[:2]]  # the first round's completions
    assert rows[1]["loss"] != pytest.approx(default[1]["loss"], rel=1e-3)  # but another loss
    if "importance_correction" in " ".join(ENTRIES[entry]):  # the sampler is the trainer here
        assert all(r["sampler_kl"] < 1e-6 and r["sampler_corrected"] == 0 for r in rows)
        assert all(r["sampler_ratio_p05"] == pytest.approx(1, abs=1e-4) for r in rows)


@pytest.mark.parametrize("topology", ["ds_zero3", "fsdp2"])
def test_sharded_models_generate_the_same(args, cache_env, one_process, tmp_path, topology):
    """ZeRO-3 and FSDP2: each process holds a shard, so every forward of generation is a
    collective; the completions and the update are those of one process."""
    out = tmp_path / "run"
    layout = ["train.micro_batch_size=1", "train.grad_accum_steps=2"]
    proc = launch(args(out, *RUN, *layout), cache_env, topology, recipe=GRPO_RECIPE, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert_same_steps(out, one_process, topology)


def test_a_run_killed_within_a_generation_round_resumes_exactly(args, cache_env, one_process, tmp_path):
    """SIGKILLed, then taken back to step 3's checkpoint: the round of steps 3 and 4 is
    half done, so the resumed run must train step 4 on the completions (and old
    log-probs) of the run it continues, kept in the checkpoint."""
    from llmtrain.output.checkpoint import complete_checkpoints

    out = tmp_path / "killed"
    run = [*RUN, "train.micro_batch_size=2", "train.grad_accum_steps=1", "checkpoint.every_steps=1"]
    proc = start_run(args(out, *run, "checkpoint.resume=auto"), cache_env, recipe=GRPO_RECIPE)
    assert wait_for(lambda: any(step >= 3 for step, _ in complete_checkpoints(out)), proc)
    kill_run(proc)
    if not (out / "final").exists():
        (out / "final").mkdir()  # killed before it finished: rewind removes what would be there
    rewind(out, 3)
    assert (out / "checkpoints" / "step-3" / "rollout.safetensors").is_file()
    relaid = tmp_path / "relaid"
    shutil.copytree(out, relaid)
    done = grpo(args(out, *run, "checkpoint.resume=auto"), cache_env, nproc=2)
    assert "resumed from" in done.stdout and "at step 3" in done.stdout
    ref = tmp_path / "uninterrupted"
    grpo(args(ref, *run), cache_env, nproc=2)
    assert [r["loss"] for r in train_rows(out)] == [r["loss"] for r in train_rows(ref)]  # exactly
    assert [r["reward"] for r in train_rows(out)] == [r["reward"] for r in train_rows(ref)]
    for key, value in load_file(ref / "final" / "model.safetensors").items():
        torch.testing.assert_close(load_file(out / "final" / "model.safetensors")[key], value, rtol=0, atol=0)
    assert_same_steps(out, one_process, "resumed")
    # The same checkpoint resumed as one process of 4 prompts: each process takes its share
    # of the kept round, and the run goes on as the one-process run did.
    layout = ["train.micro_batch_size=4", "checkpoint.every_steps=1", "checkpoint.resume=auto"]
    done = grpo(args(relaid, *RUN, *layout), cache_env)
    assert "resuming a run of 2 process(es) x 2 x 1 as 1 process(es) x 4 x 1" in done.stdout
    assert_same_steps(relaid, one_process, "resumed as one process")


def test_a_broken_reward_function_is_one_line(args, cache_env, files, tmp_path):
    prompts, rewards = files
    broken = tmp_path / "broken.py"
    broken.write_text("def r(completions, **kwargs):\n    return [len(c) / 0 for c in completions]\n")
    proc = grpo(args(tmp_path / "a", f"grpo.rewards=[{broken}:r]", "grpo.reward_weights=[]"), cache_env, check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert (
        f"grpo.rewards: {broken}:r raised ZeroDivisionError" in proc.stderr and "nothing was trained yet" in proc.stderr
    )
    needs = tmp_path / "needs.py"
    needs.write_text("def r(completions, solution):\n    return [1.0] * len(completions)\n")
    proc = grpo(args(tmp_path / "b", f"grpo.rewards=[{needs}:r]", "grpo.reward_weights=[]"), cache_env, check=False)
    assert proc.returncode == 2 and "needs column(s) ['solution']" in proc.stderr
    assert "Loading weights" not in proc.stdout + proc.stderr  # found before the model loads


# A reward file that works, but meddles with the process at its top and in every call.
MEDDLING = """
import os, threading, time, torch
torch.set_grad_enabled(False)
threading.Thread(target=time.sleep, args=(3600,), name="forever").start()

def even(prompts, completions, completion_ids, **kwargs):
    scores = [sum(t % 2 == 0 for t in ids) / len(ids) for ids in completion_ids]
    for ids in completion_ids:
        ids[:] = [0] * len(ids)
    os.chdir(os.path.join(os.path.dirname(__file__), "elsewhere"))
    torch.set_grad_enabled(False)
    return scores
"""


def test_a_reward_module_that_meddles_with_the_process_trains_the_same_and_exits(
    args, cache_env, one_process, tmp_path
):
    """Gradients turned off at its top and in each call, the working directory changed, the
    completion_ids it receives edited in place, a thread that never ends: the run trains
    what the plain one does, writes its relative output_dir where it was started, and
    exits 0 (before, in turn: a bare backward traceback; final/ under elsewhere/; other
    tokens trained; a process alive after final/ that only SIGKILL ended)."""
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "meddling.py").write_text(MEDDLING)
    argv = args(Path("out"), *RUN, "train.micro_batch_size=4", "grpo.rewards=[meddling.py:even,accuracy]")
    proc = run_python(launch_command(argv, "one", recipe=GRPO_RECIPE), cache_env, 600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert (tmp_path / "out" / "final").is_dir() and not (tmp_path / "elsewhere" / "out").exists()
    assert_same_steps(tmp_path / "out", one_process, "meddling")
    name = f"grpo.rewards: {tmp_path}/meddling.py:even"  # its path made absolute (config.load.absolute_paths)
    for said in (
        f"{name}: its import changed torch's grad mode (to False); llmtrain put it back",
        f"{name}: its import started thread(s) 'forever' that still run",
        f"{name} changed the working directory (to '{tmp_path}/elsewhere')",
        "warning: thread(s) 'forever' still running 5 s after the run was over",
    ):
        assert said in proc.stderr, (said, proc.stderr[-3000:])


def test_rewards_see_every_column_and_the_training_state_in_evaluation_too(args, cache_env, tmp_path):
    """Half the prompts lack `answer`: accuracy leaves theirs unscored whichever prompts are
    drawn together, and the evaluation's reward calls get trainer_state as training's do."""
    import json

    rows = make_prompts(24, seed=31)
    for row in rows[1::2]:
        del row["answer"]
    write_jsonl(rows, tmp_path / "some.jsonl")
    staged = tmp_path / "staged.py"
    staged.write_text(
        "def staged(completions, trainer_state, **kwargs):\n"
        "    return [float(trainer_state.global_step)] * len(completions)\n"
    )
    out = tmp_path / "out"
    run = [f"data.train={tmp_path / 'some.jsonl'}", f"data.eval={tmp_path / 'some.jsonl'}", "eval.every_steps=2"]
    run += [f"grpo.rewards=[accuracy,{staged}:staged]", "grpo.reward_weights=[]", "train.max_steps=2"]
    proc = grpo(args(out, *run), cache_env)
    evals = [r for r in metrics(out) if "eval_reward" in r]
    assert [(r["step"], r["eval_reward_staged"]) for r in evals] == [(0, 0.0), (2, 2.0)], json.dumps(evals)
    assert all(0 <= r["eval_reward_accuracy"] <= 1 for r in evals)
    assert "warning: grpo.rewards: accuracy: 12 of 24 prompts of data.train have no usable 'answer'" in proc.stderr

    # No usable answer at all (none, or lists): accuracy would score nothing; refused before any weights load.
    for row in rows:
        row["answer"] = None if "answer" not in row else [row["answer"]]
    write_jsonl(rows, tmp_path / "none.jsonl")
    proc = grpo(args(tmp_path / "none", *run, f"data.train={tmp_path / 'none.jsonl'}"), cache_env, check=False)
    assert proc.returncode == 2 and "Loading weights" not in proc.stdout + proc.stderr
    assert "error: grpo.rewards: accuracy: no prompt of data.train has a usable 'answer'" in proc.stderr


def test_lora_under_fsdp2_generates_and_updates_as_one_process(args, cache_env, tmp_path):
    """peft's generate calls the inner model's, so FSDP2's root module (the PeftModel) never
    ran its forward: its lazy set-up and the all-gather of its own weights (embeddings, the
    output layer) were skipped, and the first generation failed."""
    lora = ["model.lora.enabled=true", "model.lora.r=4", "model.lora.alpha=8"]
    one, fsdp = tmp_path / "one", tmp_path / "fsdp"
    grpo(args(one, *RUN, *lora, "train.micro_batch_size=4"), cache_env)
    layout = ["train.micro_batch_size=1", "train.grad_accum_steps=2"]
    proc = launch(args(fsdp, *RUN, *lora, *layout), cache_env, "fsdp2", recipe=GRPO_RECIPE, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert_same_steps(fsdp, one, "fsdp2 lora", weights=False)
    mine = load_file(fsdp / "final" / "adapter_model.safetensors")
    for key, value in load_file(one / "final" / "adapter_model.safetensors").items():
        torch.testing.assert_close(mine[key], value, rtol=1e-4, atol=1e-5, msg=key)


def test_llmtrain_eval_draws_the_runs_own_sampled_evaluation(args, cache_env, files, one_process, tmp_path):
    """`llmtrain eval` on the run's final/ with its config: the same seeded completions, so
    the same mean reward and pass@k as the run's last evaluation row."""
    results = tmp_path / "results.json"
    run = args(tmp_path / "unused", *RUN, *sampled_eval(files))
    llmtrain_eval([str(one_process / "final"), "--output", str(results), *run], cache_env)
    got = json.loads(results.read_text())["models"][str(one_process / "final")]
    want = {k: v for k, v in [r for r in metrics(one_process) if "eval_reward" in r][-1].items() if k != "step"}
    assert got == pytest.approx(want, rel=1e-6, abs=1e-7) and "eval_pass@3" in got
