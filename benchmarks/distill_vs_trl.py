"""llmtrain's GKD (recipes/distill.py) vs TRL's GKDTrainer, side by side: the same teacher,
student, rows, steps and settings.

    python benchmarks/distill_vs_trl.py                    # CPU workload, a few minutes on 2 idle cores
    python benchmarks/distill_vs_trl.py --repeats 1 --systems llmtrain trl-best
    python benchmarks/distill_vs_trl.py --workload gpu --repeats 1      # one GPU, bigger steps

Needs `pip install trl` beside llmtrain. The workload is the offline distillation demo's
(docs/distill.md): the teacher is the SFT demo's model (tiny-llama-teacher, built on first use,
about a minute and a half), the student the demo's smaller model from random weights
(tiny-llama-small), and the rows the SFT demo's chat rows with one exchange (TRL's GKD
collator trains the last assistant message alone; llmtrain trains every answer, so rows
with one answer give both the same tokens to train).

Both systems run GKD as TRL defines it: for about half the rows the student samples its own
answer (TRL: a coin per batch, lmbda; llmtrain: a coin per step, distill.on_policy_fraction),
at temperature 1 up to 16 new tokens, and the loss is the generalized JSD with beta 0.5
between the two models' distributions at every answer token; 8 rows a step (32 on the gpu workload), the same
learning rate (constant), fp32, one process, in a fresh process per run, in the order
A B C A B C.

Reported for each system:
- held-out divergence: after training, the generalized JSD (beta 0.5) per answer token
  between the saved student and the teacher on 200 held-out rows' own answers, computed by
  the same code for both (llmtrain's distill.loss.DistillLoss);
- step time: the mean over the optimizer steps, generation included, start-up excluded;
- the mean step on the student's own answers and on the data's, and the two mixed as the
  on-policy fraction asks (0.5 each), which compares the same work: the share of steps a
  run draws on-policy is a coin's (llmtrain drew 42 of 80 here, TRL 32), and a step that
  generates costs about twice one that does not;
- peak memory: the process's peak resident set on CPU, or GPU memory allocated.

The peers are TRL's defaults, and TRL's best: the same, with gradient checkpointing off (TRL's
default is on), as llmtrain's default. Run it on an otherwise idle machine.
"""

from __future__ import annotations

import json
from pathlib import Path

import harness

LR, BETA, FRACTION, NEW_TOKENS, TEMPERATURE = 1e-3, 0.5, 0.5, 16, 1.0
WORKLOADS = {
    # rows per step, steps, max length
    "cpu": dict(micro=8, steps=80, seq=256, precision="no"),
    # the same models and rows, four times the rows a step, on one GPU
    "gpu": dict(micro=32, steps=60, seq=256, precision="no"),
}
OURS_CONFIG = """\
# llmtrain's side of benchmarks/distill_vs_trl.py (written by it; the rest comes on the command line)
train: {schedule: constant, warmup_steps: 0, grad_accum_steps: 1}
eval: {every_steps: 0, sample_prompts: []}
checkpoint: {every_steps: 0}
log: {tracker: none, progress_bar: false, every_steps: 1}
distill: {loss: jsd}
"""


def one_answer(rows: list[dict]) -> list[dict]:
    """The rows with a single assistant answer, as {"messages": ...}."""
    return [{"messages": r["messages"]} for r in rows if sum(m["role"] == "assistant" for m in r["messages"]) == 1]


def prepare(workload: str, root: Path) -> dict:
    """The teacher and student, the training and held-out rows, and llmtrain's config."""
    from llmtrain import demo

    cache = demo.cache_dir()
    demo.build_teacher_model(cache)
    demo.build_small_model(cache)
    demo.write_jsonl(one_answer(demo.make_rows(3000, seed=1)), root / "train.jsonl")
    demo.write_jsonl(one_answer(demo.make_rows(300, seed=2))[:200], root / "eval.jsonl")
    (root / "llmtrain_distill.yaml").write_text(OURS_CONFIG)
    w = WORKLOADS[workload]
    return {
        "teacher": str(cache / "tiny-llama-teacher"),
        "student": str(cache / "tiny-llama-small"),
        "data": str(root / "train.jsonl"),
        "eval": str(root / "eval.jsonl"),
        **w,
    }


def held_out(student_dir: str, setup: dict) -> float:
    """The generalized JSD (beta 0.5) per answer token between a saved student and the
    teacher on the held-out rows' own answers."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from llmtrain.config import DataConfig
    from llmtrain.data.batches import Collator
    from llmtrain.data.build import ROWS
    from llmtrain.distill.loss import DistillLoss

    tokenizer = AutoTokenizer.from_pretrained(student_dir)
    student = AutoModelForCausalLM.from_pretrained(student_dir, dtype=torch.float32).eval()
    teacher = AutoModelForCausalLM.from_pretrained(setup["teacher"], dtype=torch.float32).eval()
    cfg = DataConfig(max_seq_len=setup["seq"])
    rows = [json.loads(line) for line in Path(setup["eval"]).read_text().splitlines()]
    examples = [ROWS.process(row, tokenizer, cfg) for row in rows]
    collate, loss = Collator(tokenizer.pad_token_id), DistillLoss(teacher, "jsd", BETA)
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(examples), 16):
            batch = collate([{k: e[k] for k in ("input_ids", "labels")} for e in examples[i : i + 16]])
            total += float(loss(student, batch).total)
            count += loss.count(batch)
    return total / count


def ours(setup: dict, out: Path, overrides: list[str]) -> dict:
    args = [
        "--config",
        str(Path(setup["data"]).parent / "llmtrain_distill.yaml"),
        f"model.name_or_path={setup['student']}",
        f"distill.teacher={setup['teacher']}",
        f"data.train={setup['data']}",
        f"data.max_seq_len={setup['seq']}",
        f"train.micro_batch_size={setup['micro']}",
        f"train.max_steps={setup['steps']}",
        f"train.lr={LR}",
        "model.dtype=float32",
        f"distill.beta={BETA}",
        f"distill.on_policy_fraction={FRACTION}",
        f"distill.temperature={TEMPERATURE}",
        f"distill.max_completion_length={NEW_TOKENS}",
        *overrides,
    ]
    steps, _ = harness.run_ours("distill.py", setup, out, args)
    return {
        "step_s": sum(r["step_s"] for r in steps) / len(steps),
        **by_kind([(r["step_s"], r.get("on_policy", 0) > 0) for r in steps]),
        "steps": len(steps),
        "held_out": held_out(str(out / "final"), setup),
        "peak_mem_gib": max(r["peak_mem_gib"] for r in steps),
    }


def by_kind(steps: list[tuple[float, bool]]) -> dict:
    """The mean step (seconds) on the student's own answers (`on_s`) and on the data's
    (`off_s`), from (seconds, on-policy) per step, and the two mixed at the on-policy
    fraction (`mix_s`)."""
    on = [s for s, policy in steps if policy]
    off = [s for s, policy in steps if not policy]
    on_s, off_s = sum(on) / max(len(on), 1), sum(off) / max(len(off), 1)
    return {"on_s": on_s, "off_s": off_s, "on_steps": len(on), "mix_s": FRACTION * on_s + (1 - FRACTION) * off_s}


def run_trl(setup: dict, out: Path, best: bool) -> dict:
    """Runs in its own process (see --worker)."""
    import datasets
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl.experimental.gkd import GKDConfig, GKDTrainer

    # Which steps sample the student's answers (TRL's coin, drawn inside its training step):
    # noted around its generation, which is left as it is.
    timer, sampled = harness.step_timer(), set()
    generate = GKDTrainer.generate_on_policy_outputs

    def noted(*args, **kwargs):
        sampled.add(len(timer.steps))  # the step in progress
        return generate(*args, **kwargs)

    GKDTrainer.generate_on_policy_outputs = staticmethod(noted)

    student = AutoModelForCausalLM.from_pretrained(setup["student"], dtype=torch.float32, attn_implementation="sdpa")
    teacher = AutoModelForCausalLM.from_pretrained(setup["teacher"], dtype=torch.float32, attn_implementation="sdpa")
    tokenizer = AutoTokenizer.from_pretrained(setup["student"])
    data = datasets.load_dataset("json", data_files=setup["data"], split="train")
    config = GKDConfig(
        output_dir=str(out),
        per_device_train_batch_size=setup["micro"],
        gradient_accumulation_steps=1,
        max_steps=setup["steps"],
        learning_rate=LR,
        lr_scheduler_type="constant",
        warmup_steps=0,
        lmbda=FRACTION,
        beta=BETA,
        temperature=TEMPERATURE,
        max_new_tokens=NEW_TOKENS,
        max_length=setup["seq"],
        gradient_checkpointing=not best,  # TRL's default is on
        bf16=False,
        use_cpu=not torch.cuda.is_available(),
        **harness.TRL_RUN,
        logging_steps=1,
    )
    trainer = GKDTrainer(
        model=student,
        teacher_model=teacher,
        args=config,
        train_dataset=data,
        processing_class=tokenizer,
        callbacks=[timer],
    )
    trainer.train()
    trainer.save_model(str(out / "final"))
    tokenizer.save_pretrained(str(out / "final"))
    return {
        "step_s": timer.seconds / trainer.state.global_step,
        **by_kind([(t, k in sampled) for k, t in enumerate(timer.steps)]),
        "steps": trainer.state.global_step,
        "held_out": held_out(str(out / "final"), setup),
        "peak_mem_gib": harness.peak_memory_gib(),
    }


def main() -> None:
    harness.rl_benchmark(
        __file__,
        __doc__,
        WORKLOADS,
        "distill",
        "distillation workload is sized by steps",
        prepare,
        lambda setup: held_out(setup["student"], setup),
        ours,
        run_trl,
        report,
    )


def report(args, setup: dict, before: float, results: dict) -> None:
    import trl

    lines = [
        harness.heading(f"GKD distillation, {args.workload}"),
        "",
        harness.command("distill_vs_trl.py", args, harness.systems_flag(args)) + "; "
        f"the distillation demo's teacher (821k parameters) and student (115k, random weights), its one-exchange "
        f"chat rows, {setup['micro']} rows a step, {setup['steps']} steps, on-policy fraction {FRACTION} "
        f"(TRL's lmbda), at most {NEW_TOKENS} new tokens at temperature {TEMPERATURE}, generalized JSD with beta "
        f"{BETA}, lr {LR}, fp32, one process; TRL {trl.__version__}. Held-out JSD per answer token before "
        f"training: {before:.4f} (200 rows).",
        "",
        "| system | held-out JSD after | step time | on-policy steps | on-policy step | data step "
        f"| steps mixed {FRACTION:g} / {1 - FRACTION:g} | peak memory | ours / this, step time | ours / this, mixed |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    ours = min(results["llmtrain"], key=lambda x: x["mix_s"]) if "llmtrain" in results else None
    for name, r, held, ratio in harness.rl_rows(results, 4):
        m = min(results[name], key=lambda x: x["mix_s"])  # the least disturbed repeat, by the mixed figure
        mixed = f"{m['mix_s'] / ours['mix_s']:.2f}x" if ours else "n/a"
        lines.append(
            f"| {name} | {held} | {r['step_s']:.3f} s | {r['on_steps']} of {r['steps']} | {m['on_s']:.3f} s | "
            f"{m['off_s']:.3f} s | {m['mix_s']:.3f} s | {r['peak_mem_gib']:.2f} GiB | {ratio} | {mixed} |"
        )
    harness.publish(lines, args.results)


if __name__ == "__main__":
    main()
