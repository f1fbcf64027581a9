"""llmtrain's GRPO with tools vs TRL's GRPOTrainer(tools=...), side by side: the same model,
prompts, tools, reward, group and steps.

    python benchmarks/agents_vs_trl.py                   # CPU workload, about 15 minutes on 2 idle cores
    python benchmarks/agents_vs_trl.py --repeats 1 --systems llmtrain trl-best
    python benchmarks/agents_vs_trl.py --workload gpu --repeats 1      # one GPU, bigger steps
    python benchmarks/agents_vs_trl.py --workload cpu-cued               # prompts cued to use a tool

Needs `pip install trl` beside llmtrain. The workload is the offline calculator demo's
(docs/agents.md):
- the model is the demo's calculator SFT model, tiny-llama-calc (built on first use: the SFT
  demo's model, then the calculator's SFT stage, about five minutes), which seldom calls a
  tool when asked plainly, as these prompts ask;
- the prompts are the demo's calculator questions (a sum of two two-digit numbers), as
  user messages, so both systems render them, and the tools' schemas, with the same chat
  template;
- the tools are the calculator's `add` and `multiply` (llmtrain/calculator.py), given to
  TRL's `tools=` as the functions themselves and to llmtrain as `grpo.tools`;
- the tool calls are read by the same parser (the ChatML <tool_call> response template
  llmtrain sets for the demo's tokenizer, which TRL uses when a tokenizer has one);
- the reward is answer accuracy against each row's `answer`: llmtrain's built-in
  `accuracy`, which TRL calls as one of its own reward functions (the episode's last
  answer, from the completion's messages).

Both systems run the same steps: 4 prompts a step, 8 episodes each, at most 160 completion
tokens and two model turns (TRL: one tool-calling iteration), temperature 1.0, the dapo
loss, group-scaled advantages, no KL term, one optimizer step per generation batch, lr 1e-4
(constant), fp32, one process. Each run is in a fresh process, in the order A B C A B C.

Reported for each system:
- held-out success: the share of 300 fresh calculator questions the saved model answers
  right, each played as a greedy episode with the tools, by the same code after training
  (`python -m llmtrain.demo score`'s);
- the reward during training (sampled episodes, the mean over the steps);
- step time: the mean over the optimizer steps, generation and tool calls included,
  start-up excluded;
- peak memory: the process's peak resident set on CPU, or GPU memory allocated.

The peers are TRL's defaults, and TRL's best: the same, with gradient checkpointing off
(TRL's default is on), as llmtrain's default. Run it on an otherwise idle machine.
"""

from __future__ import annotations

from pathlib import Path

import harness

LR, GROUP, MAX_TOKENS, TEMPERATURE, TURNS = 1e-4, 8, 160, 1.0, 2
WORKLOADS = {
    # prompts per step, steps, max length (prompt + completion)
    "cpu": dict(prompts=4, steps=40, seq=256, precision="no"),
    # the same, with the prompts cued to use a tool (the SFT stage's system message), which
    # the model then does from the first step: both systems play episodes of the same kind
    # from start to end, so their step times compare the same work
    "cpu-cued": dict(prompts=4, steps=40, seq=256, precision="no", cued=True),
    # the same model and prompts, twice the prompts a step, on one GPU
    "gpu": dict(prompts=8, steps=25, seq=256, precision="no"),
}
OURS_CONFIG = """\
# llmtrain's side of benchmarks/agents_vs_trl.py (written by it; the rest comes on the command line)
train: {schedule: constant, warmup_steps: 0, grad_accum_steps: 1}
eval: {every_steps: 0, sample_prompts: []}
checkpoint: {every_steps: 0}
log: {tracker: none, progress_bar: false, every_steps: 1}
grpo: {rewards: [accuracy], loss_type: dapo, scale_rewards: group, beta: 0.0, num_iterations: 1, log_completions: 0}
"""


def prepare(workload: str, root: Path) -> dict:
    """The demo's calculator SFT model, the prompts as chat messages, and llmtrain's config."""
    from llmtrain import demo

    w = WORKLOADS[workload]
    cache = demo.cache_dir()
    demo.build_assets(cache)
    demo.build_calc_model(cache)
    rows = demo.make_calc_prompts(w["steps"] * w["prompts"], 41)
    demo.write_jsonl([as_user_message(r, w.get("cued", False)) for r in rows], root / "train.jsonl")
    (root / "llmtrain_grpo.yaml").write_text(OURS_CONFIG)
    return {"model": str(cache / "tiny-llama-calc"), "data": str(root / "train.jsonl"), **w}


def as_user_message(row: dict, cued: bool = False) -> dict:
    """A calculator prompt row as one user message (after the SFT stage's cue to use a tool
    where `cued`), for both systems alike."""
    from llmtrain.demo import CALC_CUE

    cue = [{"role": "system", "content": CALC_CUE}] if cued else []
    return {"prompt": [*cue, {"role": "user", "content": row["prompt"]}], "answer": row["answer"]}


def held_out(model_dir: str) -> float:
    from llmtrain.demo import score_calculator

    return score_calculator(model_dir)[0]


def ours(setup: dict, out: Path, overrides: list[str]) -> dict:
    from llmtrain.demo import CALC_TOOLS

    args = [
        "--config",
        str(Path(setup["data"]).parent / "llmtrain_grpo.yaml"),
        f"model.name_or_path={setup['model']}",
        f"data.train={setup['data']}",
        f"data.max_seq_len={setup['seq']}",
        f"train.micro_batch_size={setup['prompts']}",
        f"train.max_steps={setup['steps']}",
        f"train.lr={LR}",
        "model.dtype=float32",
        f"grpo.num_generations={GROUP}",
        f"grpo.max_completion_length={MAX_TOKENS}",
        f"grpo.temperature={TEMPERATURE}",
        f"grpo.max_turns={TURNS}",
        f"grpo.tools=[{','.join(CALC_TOOLS)}]",
        *overrides,
    ]
    steps, _ = harness.run_ours("grpo.py", setup, out, args)
    return {
        "step_s": sum(r["step_s"] for r in steps) / len(steps),  # generation and tool calls included
        "steps": len(steps),
        "train_reward": sum(r["reward"] for r in steps) / len(steps),
        "tool_calls": sum(r["tool_calls"] for r in steps) / len(steps),
        "held_out": held_out(str(out / "final")),
        "peak_mem_gib": max(r["peak_mem_gib"] for r in steps),
    }


def run_trl(setup: dict, out: Path, best: bool) -> dict:
    """Runs in its own process (see --worker)."""
    import datasets
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from llmtrain.calculator import add, multiply
    from llmtrain.rl.rewards import accuracy
    from llmtrain.rl.turns import check_parser

    model = AutoModelForCausalLM.from_pretrained(setup["model"], dtype=torch.float32, attn_implementation="sdpa")
    tokenizer = AutoTokenizer.from_pretrained(setup["model"], padding_side="left")
    check_parser(tokenizer)  # the same response template for TRL's parse_response as for llmtrain's
    data = datasets.load_dataset("json", data_files=setup["data"], split="train")
    config = GRPOConfig(
        output_dir=str(out),
        per_device_train_batch_size=setup["prompts"] * GROUP,  # completions
        gradient_accumulation_steps=1,
        num_generations=GROUP,
        max_completion_length=MAX_TOKENS,
        max_tool_calling_iterations=TURNS - 1,  # tool-calling rounds after the first turn
        temperature=TEMPERATURE,
        max_steps=setup["steps"],
        learning_rate=LR,
        lr_scheduler_type="constant",
        warmup_steps=0,
        beta=0.0,
        loss_type="dapo",
        scale_rewards="group",
        num_iterations=1,
        gradient_checkpointing=not best,  # TRL's default is on
        bf16=False,
        use_cpu=not torch.cuda.is_available(),
        **harness.TRL_RUN,
        logging_steps=1,
    )
    timer = harness.step_timer()
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[accuracy],
        args=config,
        train_dataset=data,
        processing_class=tokenizer,
        tools=[add, multiply],
        callbacks=[timer],
    )
    trainer.train()
    trainer.save_model(str(out / "final"))
    tokenizer.save_pretrained(str(out / "final"))
    history = trainer.state.log_history
    rewards = [h["reward"] for h in history if "reward" in h]
    calls = [h[k] for h in history for k in h if k.startswith("tools/call_frequency")]
    return {
        "step_s": timer.seconds / trainer.state.global_step,
        "steps": trainer.state.global_step,
        "train_reward": sum(rewards) / len(rewards),
        "tool_calls": sum(calls) / len(calls) if calls else float("nan"),
        "held_out": held_out(str(out / "final")),
        "peak_mem_gib": harness.peak_memory_gib(),
    }


def main() -> None:
    harness.rl_benchmark(
        __file__,
        __doc__,
        WORKLOADS,
        "agents",
        "agents workload is sized by prompts and steps",
        prepare,
        lambda setup: held_out(setup["model"]),
        ours,
        run_trl,
        report,
    )


def report(args, setup: dict, before: float, results: dict) -> None:
    import trl

    lines = [
        harness.heading(f"GRPO with tools, {args.workload}"),
        "",
        harness.command("agents_vs_trl.py", args, harness.systems_flag(args)) + "; "
        f"the calculator demo's SFT model and questions{' cued to use a tool' if setup.get('cued') else ''}, tools "
        f"add and multiply, {setup['prompts']} prompts x "
        f"{GROUP} episodes a step, {setup['steps']} steps, at most {MAX_TOKENS} completion tokens and {TURNS} "
        f"turns, temperature {TEMPERATURE}, dapo loss, lr {LR}, fp32, one process; TRL {trl.__version__}. "
        f"Held-out success before training: {before:.3f} (300 questions, greedy episodes).",
        "",
        "| system | held-out success after | reward while training | tool calls per episode | step time "
        "| peak memory | ours / this, step time |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, r, held, ratio in harness.rl_rows(results, 3):
        lines.append(
            f"| {name} | {held} | {r['train_reward']:.3f} | {r['tool_calls']:.2f} | {r['step_s']:.2f} s | "
            f"{r['peak_mem_gib']:.2f} GiB | {ratio} |"
        )
    harness.publish(lines, args.results)


if __name__ == "__main__":
    main()
