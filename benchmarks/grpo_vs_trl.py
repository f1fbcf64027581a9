"""llmtrain's GRPO recipe vs TRL's GRPOTrainer, side by side: the same model, prompts, reward, group and steps.

    python benchmarks/grpo_vs_trl.py                     # CPU workload, about 10 minutes on 2 idle cores
    python benchmarks/grpo_vs_trl.py --repeats 1 --ours grpo.loss_type=grpo
    python benchmarks/grpo_vs_trl.py --workload gpu --repeats 1      # one GPU, bigger steps
    python benchmarks/grpo_vs_trl.py --systems llmtrain trl-default --results /tmp/r.md

Needs `pip install trl` beside llmtrain. The workload is the offline demo's:
- the model is the SFT demo's model, tiny-llama-sft (built on first use, about a minute);
- the prompts are the demo's questions, as user messages, so both systems render them with
  the same chat template;
- the reward is answer accuracy against each row's `answer`: llmtrain's built-in `accuracy`,
  which TRL calls as one of its own reward functions (it has TRL's signature).

Both systems run the same steps: 8 prompts a step, 8 completions each, at most 12 new
tokens, temperature 1, the dapo loss, group-scaled advantages, no KL term (beta 0, both
defaults), one optimizer step per generation batch, lr 1e-4 (constant), fp32, one process.
Each run is in a fresh process, in the order A B C A B C.

Reported for each system:
- held-out reward: the share of 200 held-out questions answered right, greedy, by the
  model each system saved, scored by the same code after training;
- the reward during training (sampled completions, the mean over the steps);
- step time: the mean over the optimizer steps, generation included, start-up excluded;
- generation tokens/s: completion tokens generated over the seconds spent generating;
- peak memory: the process's peak resident set on CPU, or GPU memory allocated.

The peers are TRL's defaults, and TRL's best: the same, with gradient checkpointing off
(TRL's default is on), as llmtrain's default. On CPU, run it on an otherwise idle machine:
with another busy process, torch's threads wait on each other. The fastest repeat is
reported, but only an idle one is a measurement.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import harness

LR, GROUP, NEW_TOKENS, TEMPERATURE = 1e-4, 8, 12, 1.0
WORKLOADS = {
    # prompts per step, steps, held-out prompts, max length (prompt + completion)
    "cpu": dict(prompts=8, steps=60, questions=200, seq=64, precision="no"),
    # the same model and questions, twice the prompts a step, on one GPU
    "gpu": dict(prompts=16, steps=40, questions=200, seq=64, precision="no"),
}
OURS_CONFIG = """\
# llmtrain's side of benchmarks/grpo_vs_trl.py (written by it; the rest comes on the command line)
train: {schedule: constant, warmup_steps: 0, grad_accum_steps: 1}
eval: {every_steps: 0, sample_prompts: []}
checkpoint: {every_steps: 0}
log: {tracker: none, progress_bar: false, every_steps: 1}
grpo: {rewards: [accuracy], loss_type: dapo, scale_rewards: group, beta: 0.0, num_iterations: 1, log_completions: 0}
"""


def prepare(workload: str, root: Path) -> dict:
    """The demo's SFT model, the prompts (training and held out) as chat messages, and
    llmtrain's config."""
    from llmtrain import demo

    w = WORKLOADS[workload]
    cache = demo.cache_dir()
    demo.build_assets(cache)
    demo.build_sft_model(cache)
    steps = w["steps"] * w["prompts"]
    for name, n, seed in (("train.jsonl", steps, 41), ("held_out.jsonl", w["questions"], 42)):
        demo.write_jsonl([as_user_message(r) for r in demo.make_prompts(n, seed)], root / name)
    (root / "llmtrain_grpo.yaml").write_text(OURS_CONFIG)
    return {
        "model": str(cache / "tiny-llama-sft"),
        "data": str(root / "train.jsonl"),
        "held_out": str(root / "held_out.jsonl"),
        "config": str(root / "llmtrain_grpo.yaml"),
        **w,
    }


def as_user_message(row: dict) -> dict:
    """A demo prompt row as one user message (no system turn), for both systems alike."""
    question = row["prompt"] if isinstance(row["prompt"], str) else row["prompt"][-1]["content"]
    return {"prompt": [{"role": "user", "content": question}], "answer": row["answer"]}


def held_out_reward(model_dir: str, prompts_file: str) -> float:
    """The share of held-out questions a saved model answers right: greedy, left-padded
    batches, the accuracy reward, the same for every system."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from llmtrain.rl.rewards import accuracy

    rows = [json.loads(line) for line in Path(prompts_file).read_text().splitlines()]
    tokenizer = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    said = []
    for start in range(0, len(rows), 50):
        texts = [
            tokenizer.apply_chat_template(r["prompt"], tokenize=False, add_generation_prompt=True)
            for r in rows[start : start + 50]
        ]
        enc = tokenizer(texts, add_special_tokens=False, return_tensors="pt", padding=True)
        with torch.no_grad():
            out = model.generate(**enc, max_new_tokens=NEW_TOKENS, do_sample=False)
        said += tokenizer.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    scores = accuracy(None, said, [r["answer"] for r in rows])
    return sum(scores) / len(scores)


def ours(setup: dict, out: Path, overrides: list[str]) -> dict:
    args = [
        "--config",
        setup["config"],
        f"model.name_or_path={setup['model']}",
        f"data.train={setup['data']}",
        f"data.max_seq_len={setup['seq']}",
        f"train.micro_batch_size={setup['prompts']}",
        f"train.max_steps={setup['steps']}",
        f"train.lr={LR}",
        "model.dtype=float32",
        f"grpo.num_generations={GROUP}",
        f"grpo.max_completion_length={NEW_TOKENS}",
        f"grpo.temperature={TEMPERATURE}",
        *overrides,
    ]
    steps, _ = harness.run_ours("grpo.py", setup, out, args)
    generated = sum(r["completion_len"] * setup["prompts"] * GROUP for r in steps)
    return {
        "step_s": sum(r["step_s"] for r in steps) / len(steps),  # generation included
        "generation_tokens_per_s": generated / sum(r["generation_s"] for r in steps),
        "steps": len(steps),
        "train_reward": sum(r["reward"] for r in steps) / len(steps),
        "held_out": held_out_reward(str(out / "final"), setup["held_out"]),
        "peak_mem_gib": max(r["peak_mem_gib"] for r in steps),
    }


def run_trl(setup: dict, out: Path, best: bool) -> dict:
    """Runs in its own process (see --worker)."""
    import datasets
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from llmtrain.rl.rewards import accuracy

    class TimedGRPOTrainer(GRPOTrainer):
        """Adds up the seconds and tokens of generation."""

        generation_seconds, generated = 0.0, 0

        def _generate_single_turn(self, *args, **kwargs):
            harness.sync()
            start = time.perf_counter()
            try:
                result = super()._generate_single_turn(*args, **kwargs)
            finally:
                harness.sync()
                self.generation_seconds += time.perf_counter() - start
            completion_ids = result[0]
            self.generated += sum(len(c) for c in completion_ids)
            return result

    model = AutoModelForCausalLM.from_pretrained(setup["model"], dtype=torch.float32, attn_implementation="sdpa")
    tokenizer = AutoTokenizer.from_pretrained(setup["model"], padding_side="left")
    data = datasets.load_dataset("json", data_files=setup["data"], split="train")
    config = GRPOConfig(
        output_dir=str(out),
        per_device_train_batch_size=setup["prompts"] * GROUP,  # completions
        gradient_accumulation_steps=1,
        num_generations=GROUP,
        max_completion_length=NEW_TOKENS,
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
    trainer = TimedGRPOTrainer(
        model=model,
        reward_funcs=[accuracy],
        args=config,
        train_dataset=data,
        processing_class=tokenizer,
        callbacks=[timer],
    )
    trainer.train()
    trainer.save_model(str(out / "final"))
    tokenizer.save_pretrained(str(out / "final"))
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    return {
        "step_s": timer.seconds / trainer.state.global_step,
        "generation_tokens_per_s": trainer.generated / trainer.generation_seconds,
        "steps": trainer.state.global_step,
        "train_reward": sum(rewards) / len(rewards),
        "held_out": held_out_reward(str(out / "final"), setup["held_out"]),
        "peak_mem_gib": harness.peak_memory_gib(),
    }


def main() -> None:
    harness.rl_benchmark(
        __file__,
        __doc__,
        WORKLOADS,
        "grpo",
        "GRPO workload is sized by prompts and steps",
        prepare,
        lambda setup: held_out_reward(setup["model"], setup["held_out"]),
        ours,
        run_trl,
        report,
    )


def report(args, setup: dict, before: float, results: dict) -> None:
    import trl

    lines = [
        harness.heading(f"GRPO, {args.workload}"),
        "",
        harness.command("grpo_vs_trl.py", args, harness.systems_flag(args)) + "; "
        f"the demo's SFT model and questions, {setup['prompts']} prompts x {GROUP} completions a step, "
        f"{setup['steps']} steps, at most {NEW_TOKENS} new tokens, temperature {TEMPERATURE}, dapo loss, lr {LR}, "
        f"fp32, one process; TRL {trl.__version__}. Held-out reward before training: {before:.3f} "
        f"({setup['questions']} questions, greedy).",
        "",
        "| system | held-out reward after | reward while training | step time | generation tokens/s | peak memory "
        "| ours / this, step time |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, r, held, ratio in harness.rl_rows(results, 3):
        lines.append(
            f"| {name} | {held} | {r['train_reward']:.3f} | {r['step_s']:.2f} s | "
            f"{r['generation_tokens_per_s']:.0f} | {r['peak_mem_gib']:.2f} GiB | {ratio} |"
        )
    harness.publish(lines, args.results)


if __name__ == "__main__":
    main()
