"""recipes/grpo.py with tools, launched as a user launches it: a tiny model taught the
calculator's call format by a short SFT run on tool traces (recipes/finetune.py, the same
rendering), then GRPO whose episodes call add and multiply. The same global batch of prompts
plays the same episodes (turns, calls, tool results) and makes the same update on one process
or two, in any micro-batch split, under DDP, ZeRO-3 and FSDP2, where episodes of unequal
length end at different turns on each process without a hang; a run killed within a
generation round resumes exactly."""

import shutil
from pathlib import Path

import pytest

from llmtrain.demo import CALC_CUE, CALC_TOOLS, TOOL_CHAT_TEMPLATE, make_calc_prompts, make_calc_traces, write_jsonl
from tests.support.runs import (
    assert_same_rounds,
    kill_run,
    launch,
    recipe_args,
    rewind,
    run_recipe,
    start_run,
    train_rows,
    wait_for,
)

pytestmark = pytest.mark.slow

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
# What the episodes were, per round: compared exactly across layouts.
SAME = [
    "reward",
    "reward_accuracy",
    "reward_called",
    "reward_even",
    "completion_len",
    "completion_len_max",
    "clipped_completions",
    "turns",
    "turns_max",
    "tool_calls",
    "tool_errors",
    "malformed_turns",
    "out_of_turns",
    "sampled_tokens",
    "context_tokens",
]


@pytest.fixture(scope="module")
def tool_model(tiny_model, base_config, cache_env, tmp_path_factory) -> Path:
    """The tiny model with the calculator demo's tool template, after SFT on tool traces."""
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("agents")
    shutil.copytree(tiny_model, root / "base")
    tok = AutoTokenizer.from_pretrained(root / "base")
    tok.chat_template = TOOL_CHAT_TEMPLATE
    tok.save_pretrained(root / "base")
    write_jsonl(make_calc_traces(200, seed=1), root / "traces.jsonl")
    sft = ["train.lr=3e-3", "train.epochs=3", "train.micro_batch_size=8", "checkpoint.every_steps=0"]
    run_recipe(recipe_args(base_config, root / "base", root / "traces.jsonl", root / "sft", *sft), cache_env)
    return root / "sft" / "final"


@pytest.fixture(scope="module")
def args(base_config, tool_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("calc")
    prompts = root / "prompts.jsonl"
    write_jsonl(make_calc_prompts(48, seed=2), prompts)
    # Rewards with spread for a model that rarely answers right: a call made (the episode's
    # messages, as TRL passes them), and the share of even token ids.
    (root / "rewards.py").write_text(
        "def called(completions, **kwargs):\n"
        "    return [float(any(m['role'] == 'tool' for m in c)) for c in completions]\n\n\n"
        "def even(completion_ids, **kwargs):\n"
        "    return [sum(t % 2 == 0 for t in ids) / len(ids) for ids in completion_ids]\n"
    )

    def make(out: Path, *extra: str) -> list[str]:
        return recipe_args(
            base_config,
            tool_model,
            prompts,
            out,
            f"grpo.tools=[{','.join(CALC_TOOLS)}]",
            "grpo.num_generations=4",
            "grpo.max_completion_length=176",
            "data.max_seq_len=320",
            "grpo.max_turns=3",
            "grpo.log_completions=1",
            f"data.system_prompt={CALC_CUE}",  # asked for a tool, as half the traces are: episodes call it
            f"grpo.rewards=[accuracy,{root / 'rewards.py'}:called,{root / 'rewards.py'}:even]",
            *extra,
        )

    return make


def grpo(args: list[str], env: dict, nproc: int = 1, **kw):
    return run_recipe(args, env, nproc=nproc, recipe=RECIPES / "grpo.py", **kw)


def assert_same_steps(got: Path, want: Path, name: str) -> None:
    # The same update up to the order of float sums: Adam's step of lr=1e-3 divides by the root
    # of each element's squared gradients, so an element whose gradient is near zero moves by a
    # share of lr that rounding can change (5e-5 seen, on 4 steps); a wrong mask or count
    # changes the losses, and weights by far more.
    assert_same_rounds(got, want, name, SAME, atol=1e-4)  # the same episodes


# Four prompts (16 episodes) a step, two optimizer steps per round, a KL term: every part of
# the loss in play, on tokens that are partly the tools'.
RUN = ["train.max_steps=4", "grpo.num_iterations=2", "grpo.beta=0.05", "train.lr=1e-3", "log.every_steps=1"]


@pytest.fixture(scope="module")
def one_process(args, cache_env, tmp_path_factory):
    out = tmp_path_factory.mktemp("agents-one") / "run"
    proc = grpo(args(out, *RUN, "train.micro_batch_size=4", "checkpoint.every_steps=1"), cache_env)
    assert "completion> '" in proc.stdout and " -> " in proc.stdout
    return out


def test_episodes_call_tools_and_train_on_what_was_sampled(one_process):
    rows = train_rows(one_process)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert sum(r["tool_calls"] for r in rows) > 0 and max(r["turns_max"] for r in rows) >= 2
    assert all(r["context_tokens"] > 0 for r in rows if r["tool_calls"] > 0)  # tool results are in the episodes
    assert rows[1]["kl"] > 0 and all(r["loss"] == r["loss"] for r in rows)


@pytest.mark.parametrize(
    "nproc, micro, accum",
    [(2, 2, 1), (2, 1, 2)],
    ids=["2proc_2x1", "2proc_1x2"],
)
def test_every_layout_plays_the_same_episodes(args, cache_env, one_process, tmp_path, nproc, micro, accum):
    out = tmp_path / "run"
    grpo(args(out, *RUN, f"train.micro_batch_size={micro}", f"train.grad_accum_steps={accum}"), cache_env, nproc=nproc)
    assert_same_steps(out, one_process, f"{nproc} x {micro} x {accum}")


@pytest.mark.parametrize("topology", ["ds_zero3", "fsdp2"])
def test_sharded_models_play_episodes_of_unequal_length_without_a_hang(
    args, cache_env, one_process, tmp_path, topology
):
    """Each forward of generation is a collective: a process whose episodes have ended keeps
    generating while the other's go on, and the episodes and update are one process's."""
    out = tmp_path / "run"
    layout = ["train.micro_batch_size=1", "train.grad_accum_steps=2"]
    proc = launch(args(out, *RUN, *layout), cache_env, topology, recipe=RECIPES / "grpo.py", check=False, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert_same_steps(out, one_process, topology)


def test_a_run_killed_within_a_round_resumes_its_episodes_exactly(args, cache_env, one_process, tmp_path):
    """SIGKILLed, then taken back to step 3's checkpoint, inside the round of steps 3 and 4:
    the resumed run trains step 4 on the episodes the killed one played (tokens, sampled
    mask, old log-probs), never playing them again."""
    from llmtrain.output.checkpoint import complete_checkpoints

    out = tmp_path / "killed"
    run = [*RUN, "train.micro_batch_size=2", "train.grad_accum_steps=1", "checkpoint.every_steps=1"]
    proc = start_run(args(out, *run, "checkpoint.resume=auto"), cache_env, recipe=RECIPES / "grpo.py")
    assert wait_for(lambda: any(step >= 3 for step, _ in complete_checkpoints(out)), proc)
    kill_run(proc)
    if not (out / "final").exists():
        (out / "final").mkdir()  # killed before it finished: rewind removes what would be there
    rewind(out, 3)
    assert (out / "checkpoints" / "step-3" / "rollout.safetensors").is_file()
    done = grpo(args(out, *run, "checkpoint.resume=auto"), cache_env, nproc=2)
    assert "resumed from" in done.stdout and "at step 3" in done.stdout
    assert_same_steps(out, one_process, "resumed")
