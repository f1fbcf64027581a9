"""The real recipe, launched as a user launches it (python, or accelerate launch with two
DDP processes on CPU), on a tiny model."""

import json
import re
import signal
import time
from pathlib import Path

import pytest
import torch

from llmtrain.demo import make_rows, write_jsonl
from tests.support.runs import (
    ROOT,
    final_weights,
    kill_run,
    metrics,
    recipe_args,
    rewind,
    run_recipe,
    start_run,
    train_rows,
    wait_for,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def common(base_config, tiny_model):
    def args(data, out) -> list[str]:
        return recipe_args(base_config, tiny_model, data, out)

    return args


@pytest.fixture(scope="module")
def rows18(tmp_path_factory) -> Path:
    """18 rows: a global batch of 8 leaves a last step of 2 rows, which with 2 processes x
    micro-batch 2 falls on one process only (the other runs an empty batch)."""
    path = tmp_path_factory.mktemp("d") / "rows18.jsonl"
    write_jsonl(make_rows(18, seed=11), path)
    return path


def test_loss_and_update_do_not_depend_on_how_the_global_batch_is_split(common, rows18, cache_env, tmp_path):
    """Also with the cross-entropy in chunks of 7 tokens (recomputed in backward) on the
    two-process layout (DDP gets the same gradients), and with two data-loader workers.
    The two-process run profiles its second step (train.profile_steps), which must change
    no number and leave a trace from each process."""
    layouts = {
        "8x1": (1, 8, 1, ["train.loss_chunk_logits=0"]),
        "2x4": (1, 2, 4, ["data.num_workers=2"]),
        "2proc_2x2": (
            2,
            2,
            2,
            ["train.loss_chunk_logits=2000", "train.profile_steps=2", "export.max_shard_size=100KB"],
        ),
    }
    eval_file = tmp_path / "eval.jsonl"
    write_jsonl(make_rows(5, seed=13), eval_file)  # 3 eval batches of 2: one process gets 1, the other 2
    results, evals, stdout = {}, {}, {}
    for name, (nproc, micro, accum, extra) in layouts.items():
        out = tmp_path / name
        stdout[name] = run_recipe(
            common(rows18, out)
            + extra
            + [
                f"train.micro_batch_size={micro}",
                f"train.grad_accum_steps={accum}",
                f"data.eval={eval_file}",
                "eval.micro_batch_size=2",
            ],
            cache_env,
            nproc=nproc,
        ).stdout
        results[name] = (train_rows(out), final_weights(out / "final"))
        evals[name] = [(r["step"], r["eval_loss"]) for r in metrics(out) if "eval_loss" in r]
    ref_rows, ref_w = results["8x1"]
    assert (tmp_path / "2proc_2x2" / "final" / "model.safetensors.index.json").is_file()  # 100 KB shards
    assert [r["step"] for r in ref_rows] == [1, 2, 3]
    for name, got in evals.items():
        assert [s for s, _ in got] == [0, 3], name
        assert [v for _, v in got] == pytest.approx([v for _, v in evals["8x1"]], rel=1e-5), name
    for name, (rows, weights) in results.items():
        assert [r["tokens"] for r in rows] == [r["tokens"] for r in ref_rows], name
        for a, b in zip(rows, ref_rows):
            assert a["loss"] == pytest.approx(b["loss"], rel=1e-5), name
            assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4), name
        for key in ref_w:
            torch.testing.assert_close(weights[key], ref_w[key], rtol=1e-5, atol=1e-6, msg=f"{name}: {key}")
    profile = tmp_path / "2proc_2x2" / "profile" / "steps-2-2"
    for rank in (0, 1):
        assert len(list(profile.glob(f"rank{rank}.*.pt.trace.json"))) == 1, rank
        assert "aten::" in (profile / f"rank{rank}-top-ops.txt").read_text()
    assert stdout["2proc_2x2"].count("profile of steps 2-2 written to") == 1  # printed by the main process


def test_dropout_off_gives_every_layout_the_same_update(base_config, zoo, rows18, cache_env, tmp_path):
    """GPT-2's config sets dropout (0.1), whose masks are drawn per micro-batch: 8 x 1 and
    2 x 4 differ with the model's dropout kept, and train alike with model.dropout=none."""
    got = {}
    for dropout in ("model", "none"):
        for micro, accum in ((8, 1), (2, 4)):
            out = tmp_path / f"{dropout}-{micro}x{accum}"
            extra = [f"model.dropout={dropout}", f"train.micro_batch_size={micro}", f"train.grad_accum_steps={accum}"]
            run_recipe(recipe_args(base_config, zoo("gpt2"), rows18, out, "train.max_steps=1", *extra), cache_env)
            (row,) = train_rows(out)
            got[dropout, micro] = row["loss"], row["grad_norm"]
    assert got["none", 8] == pytest.approx(got["none", 2], rel=1e-5)
    assert got["model", 8][1] != pytest.approx(got["model", 2][1], rel=1e-3)  # the masks differ


def test_compiled_and_eager_runs_give_the_same_losses(common, rows18, cache_env, tmp_path):
    """train.compile on two DDP processes, with rows of many lengths (so shapes change from
    batch to batch and the compiled blocks are recompiled for dynamic shapes)."""
    runs = {}
    for compiled in (False, True):
        out = tmp_path / f"compile-{compiled}"
        proc = run_recipe(
            common(rows18, out)
            + [
                "train.micro_batch_size=2",
                "train.grad_accum_steps=2",
                "train.epochs=2",
                f"train.compile={str(compiled).lower()}",
            ],
            cache_env,
            nproc=2,
        )
        assert ("compiling 2 transformer blocks" in proc.stdout) == compiled
        runs[compiled] = (train_rows(out), final_weights(out / "final"))
    (eager, eager_w), (comp, comp_w) = runs[False], runs[True]
    assert len(comp) == len(eager) == 6
    assert [r["loss"] for r in comp] == pytest.approx([r["loss"] for r in eager], rel=1e-5)
    assert [r["grad_norm"] for r in comp] == pytest.approx([r["grad_norm"] for r in eager], rel=1e-4)
    for key in eager_w:
        torch.testing.assert_close(comp_w[key], eager_w[key], rtol=1e-4, atol=1e-5, msg=key)


RESUME_ARGS = [
    "train.micro_batch_size=2",
    "train.epochs=2",
    "checkpoint.every_steps=5",
    "checkpoint.keep_last=2",
    "checkpoint.resume=auto",
    "train.schedule=cosine",
]


@pytest.fixture(scope="module")
def resume_data(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("resume") / "rows.jsonl"
    write_jsonl(make_rows(120, seed=12), path)  # 2 processes x 2 rows: 30 steps per epoch, 2 epochs
    return path


@pytest.fixture(scope="module")
def reference_run(common, resume_data, cache_env, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("resume") / "ref"
    run_recipe(common(resume_data, out) + RESUME_ARGS, cache_env, nproc=2)
    return out


def assert_same_run(out: Path, ref: Path):
    got_rows, ref_rows = train_rows(out), train_rows(ref)
    assert [r["step"] for r in got_rows] == list(range(1, 61))
    assert [r["loss"] for r in got_rows] == [r["loss"] for r in ref_rows]  # exactly
    assert [r["tokens"] for r in got_rows] == [r["tokens"] for r in ref_rows]
    for key, value in final_weights(ref / "final").items():
        torch.testing.assert_close(final_weights(out / "final")[key], value, rtol=0, atol=0)


def test_killed_run_resumes_to_the_same_losses(common, resume_data, reference_run, cache_env, tmp_path):
    from llmtrain.output.checkpoint import complete_checkpoints

    out = tmp_path / "killed"
    args = common(resume_data, out) + RESUME_ARGS
    proc = start_run(args, cache_env)
    assert wait_for(lambda: any(step >= 10 for step, _ in complete_checkpoints(out)), proc)
    kill_run(proc)  # every rank and the launcher, mid-epoch
    step, path = complete_checkpoints(out)[-1]
    assert 10 <= step < 30, step  # 30 steps per epoch: killed mid-epoch, before the second epoch
    assert not (out / "final").exists()

    proc = run_recipe(args, cache_env, nproc=2)
    assert f"resumed from {path} at step {step} (epoch 0)" in proc.stdout + proc.stderr
    assert_same_run(out, reference_run)
    kept = sorted(p.name for p in (out / "checkpoints").iterdir() if p.name.startswith("step-"))
    assert kept == ["step-55", "step-60"]


def test_resume_is_exact_with_dropout(common, resume_data, cache_env, tmp_path):
    """Dropout (LoRA's default 0.05 here) draws its masks from torch's generator, whose state
    a checkpoint keeps: nothing may draw from it between the restore and the next step (a
    DataLoader iterator drew its workers' seed from it, shifting every mask after a resume)."""
    extra = ["model.lora.enabled=true", "model.lora.dropout=0.05", "train.micro_batch_size=4", "train.max_steps=12"]
    extra += ["checkpoint.every_steps=4", "checkpoint.keep_last=3", "checkpoint.resume=auto"]
    ref, out = tmp_path / "ref", tmp_path / "resumed"
    run_recipe(common(resume_data, ref) + extra, cache_env)
    rewind(out, 4, source=ref)
    proc = run_recipe(common(resume_data, out) + extra, cache_env)
    assert "resumed from" in proc.stdout + proc.stderr
    assert [r["loss"] for r in train_rows(out)] == [r["loss"] for r in train_rows(ref)]  # exactly


def test_sigterm_checkpoints_at_an_agreed_step_and_resumes(common, resume_data, reference_run, cache_env, tmp_path):
    out = tmp_path / "term"
    args = common(resume_data, out) + RESUME_ARGS
    proc = start_run(args, cache_env)
    assert wait_for(lambda: (out / "metrics.jsonl").exists() and len(train_rows(out)) >= 7, proc)
    proc.send_signal(signal.SIGTERM)  # to the launcher, which passes it on to both ranks
    output, _ = proc.communicate(timeout=120)
    stopped = train_rows(out)[-1]["step"]
    assert 7 <= stopped < 60 and f"stopped on SIGTERM after step {stopped}" in output
    # What the README says comes last: the launcher's own report, after the ranks stopped.
    assert proc.returncode == 1 and output.index("SignalException") > output.index("stopped on SIGTERM"), output
    assert (out / "checkpoints" / f"step-{stopped}" / "train_state.json").exists()
    assert not (out / "final").exists()

    run_recipe(args, cache_env, nproc=2)
    assert_same_run(out, reference_run)


def test_sigusr1_checkpoints_and_exits_zero(common, resume_data, cache_env, tmp_path):
    out = tmp_path / "usr1"
    proc = start_run(common(resume_data, out) + RESUME_ARGS[1:] + ["train.micro_batch_size=4"], cache_env, nproc=1)
    assert wait_for(lambda: (out / "metrics.jsonl").exists() and len(train_rows(out)) >= 3, proc)
    proc.send_signal(signal.SIGUSR1)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, output
    stopped = train_rows(out)[-1]["step"]
    assert f"stopped on SIGUSR1 after step {stopped}; checkpoint " in output
    assert "is complete; run the same command again to continue" in output  # resume=auto is the default
    assert (out / "checkpoints" / f"step-{stopped}" / "train_state.json").exists()
    assert not (out / "final").exists()


def test_ctrl_c_with_a_closed_pipe_still_checkpoints_and_the_rerun_resumes(common, resume_data, cache_env, tmp_path):
    """`python recipes/finetune.py ... 2>&1 | tee log`, then Ctrl-C: tee exits too, and the
    run's next writes (an eval line at every step here, then the stop message) meet a closed
    pipe. The run still stops at a step with a checkpoint and its signal's exit code, and the
    same command continues from it."""
    out, evals = tmp_path / "tee", tmp_path / "eval.jsonl"
    write_jsonl(make_rows(2, seed=5), evals)
    args = common(resume_data, out) + ["train.micro_batch_size=2", f"data.eval={evals}", "eval.every_steps=1"]
    proc = start_run(args, cache_env, nproc=1)  # stdout and stderr into one pipe; 60 steps
    assert wait_for(lambda: (out / "metrics.jsonl").exists() and len(train_rows(out)) >= 3, proc)
    proc.stdout.close()  # tee is gone
    time.sleep(0.3)  # the next eval lines meet the closed pipe first
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=120) == 128 + signal.SIGINT
    stopped = train_rows(out)[-1]["step"]
    assert stopped < 60 and (out / "checkpoints" / f"step-{stopped}" / "train_state.json").exists()
    rerun = run_recipe(args, cache_env)
    assert f"resumed from {out / 'checkpoints' / f'step-{stopped}'} at step {stopped}" in rerun.stdout + rerun.stderr
    assert [r["step"] for r in train_rows(out)] == list(range(1, 61))


# Rank 1's training loop reads a clock that runs a million times fast (llmtrain.train's
# `time` module is swapped once imported); nothing else in that process sees it.
FAST_CLOCK = """
import importlib.abc, importlib.util, os, sys, time

class Fast:
    def __init__(self):
        self.t0 = time.monotonic()
    def __getattr__(self, name):
        return getattr(time, name)
    def monotonic(self):
        return self.t0 + (time.monotonic() - self.t0) * 1e6

class Hook(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "llmtrain.train":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module
        def exec_module(module):
            run(module)
            module.time = Fast()
        spec.loader.exec_module = exec_module
        return spec

if os.environ.get("RANK") == "1":
    sys.meta_path.insert(0, Hook())
"""


def test_checkpoints_by_the_clock_are_agreed_when_one_process_clock_says_so(common, chat_file, cache_env, tmp_path):
    """checkpoint.every_minutes=1 with every_steps=0: rank 1's clock (a million times fast)
    says a checkpoint is due at every step, rank 0's never in this short run. Both must write
    it after the same steps (a checkpoint is a collective: a process writing alone hangs)."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(FAST_CLOCK)
    out = tmp_path / "clock"
    args = common(chat_file, out) + ["train.max_steps=3", "checkpoint.every_minutes=1", "checkpoint.keep_last=0"]
    run_recipe(args, dict(cache_env, PYTHONPATH=str(site)), nproc=2, timeout=300)
    steps = sorted(int(p.name.split("-")[1]) for p in (out / "checkpoints").iterdir())
    assert steps and set(steps) <= {1, 2, 3} and (2 in steps or 3 in steps), steps  # a whole step since any save
    for step in steps:
        state = json.loads((out / "checkpoints" / f"step-{step}" / "train_state.json").read_text())
        assert state["step"] == step and state["settings"]["world_size"] == 2
        assert sorted(f for f in state["files"] if f.startswith("random_states")) == [
            "random_states_0.pkl",
            "random_states_1.pkl",
        ]


def test_a_full_disk_at_the_export_waits_for_space_instead_of_losing_the_run(common, chat_file, cache_env, tmp_path):
    """No checkpoint before the export: final/ is the only copy of the run. Files may not grow past
    200 kB (RLIMIT_FSIZE: writes fail with EFBIG, as on a full disk) until the run says it
    waits; then the limit is lifted and the same processes write final/. Two processes: the
    failure and the retry are agreed (one process: tests/test_train.py)."""
    import resource

    import psutil

    out = tmp_path / "full"
    args = common(chat_file, out) + ["train.max_steps=3", "checkpoint.write_retry_s=3"]  # a retry 2-3 s later
    limit = (200_000, resource.RLIM_INFINITY)
    proc = start_run(args, cache_env, nproc=2, preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, limit))
    seen = []
    while (line := proc.stdout.readline()) and "trying again" not in line:
        seen.append(line)
    assert "final/: writing it failed (File too large" in line, "".join(seen)
    assert re.search(r"trying again in [1-3] s", line) and not (out / "final").exists()
    parent = psutil.Process(proc.pid)
    for p in [parent, *parent.children(recursive=True)]:
        p.rlimit(psutil.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, "".join(seen) + line + output
    assert f"saved {out / 'final'}" in output
    assert json.loads((out / "final" / "train_state.json").read_text())["step"] == 3
    assert final_weights(out / "final")


@pytest.mark.parametrize("topology", ["single_gpu", "cpu_ddp"])  # accelerate's one-process launcher; torchrun
def test_a_killed_launcher_leaves_no_worker_training(common, resume_data, cache_env, tmp_path, topology):
    """A launcher that dies without passing a signal on (SIGKILL; on one process accelerate
    passes on none) stops its workers as SIGTERM would: at an agreed step, checkpointed."""
    import psutil

    out = tmp_path / topology
    proc = start_run(
        common(resume_data, out) + RESUME_ARGS, cache_env, nproc=1 + (topology == "cpu_ddp"), topology=topology
    )
    assert wait_for(lambda: (out / "metrics.jsonl").exists() and len(train_rows(out)) >= 3, proc)
    workers = psutil.Process(proc.pid).children()
    proc.kill()
    output, _ = proc.communicate(timeout=120)  # the workers hold the pipe until they exit
    assert not psutil.wait_procs(workers, timeout=30)[1]
    stopped = train_rows(out)[-1]["step"]
    assert f"stopped on SIGTERM after step {stopped}" in output, output[-3000:]
    assert (out / "checkpoints" / f"step-{stopped}" / "train_state.json").exists()
    assert not (out / "final").exists()


def test_outputs_export_and_reload(common, tiny_model, chat_file, cache_env, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "run"
    eval_file = tmp_path / "eval.jsonl"
    write_jsonl(make_rows(6, seed=99), eval_file)
    proc = run_recipe(
        common(chat_file, out)
        + [
            f"data.eval={eval_file}",
            "log.tracker=tensorboard",
            "train.max_steps=6",
            "eval.every_steps=3",
            "log.every_steps=2",
            "log.progress_bar=true",
            "data.packing=true",
            "data.max_seq_len=128",
            "eval.sample_prompts=['What is 1 + 1?']",
            "eval.sample_max_new_tokens=4",
        ],
        cache_env,
    )
    assert "sample> 'What is 1 + 1?' ->" in proc.stdout
    # stderr is a file here, no terminal: no bar frames (the libraries' or the loop's), one progress line
    assert "\r" not in proc.stderr and "train: step 6/6 (100%), " in proc.stderr, proc.stderr[-2000:]
    for name in [
        "config.yaml",
        "run.json",
        "metrics.jsonl",
        "loss.png",
        "final/model.safetensors",
        "final/config.json",
        "final/tokenizer.json",
        "final/llmtrain_config.yaml",
    ]:
        assert (out / name).exists(), name
    assert list((out / "logs").rglob("events.out.tfevents*")), "tensorboard events"
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "loss" in r]
    assert {
        "step",
        "loss",
        "lr",
        "grad_norm",
        "tokens",
        "step_s",
        "tokens_per_s",
        "input_tokens_per_s",
        "data_wait",
        "peak_mem_gib",
    } <= set(train[0])
    assert all(0 <= r["data_wait"] < 1 and r["peak_mem_gib"] > 0 for r in train)
    assert "mfu" not in train[0]  # no known peak for a CPU
    assert [r["step"] for r in rows if "eval_loss" in r] == [0, 3, 6]
    assert [r["step"] for r in train] == [2, 4, 6]
    assert not list(out.rglob("*.bin")) and not list(out.rglob("*.pt"))

    model = AutoModelForCausalLM.from_pretrained(out / "final")
    tok = AutoTokenizer.from_pretrained(out / "final")
    assert tok.chat_template and "<|im_start|>" in tok.chat_template
    before = AutoModelForCausalLM.from_pretrained(tiny_model).state_dict()
    after = model.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)
    assert all(torch.equal(after[k], v) for k, v in final_weights(out / "final").items())


def test_lora_saves_adapter_and_merged_model(common, tiny_model, chat_file, cache_env, tmp_path):
    """The base given by a path relative to the working directory: the adapter names it by
    its absolute path, so final/ loads from any directory (and never looks it up on the hub,
    as 'a/model' would be)."""
    import os

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    out = tmp_path / "lora"
    run_recipe(
        common(chat_file, out)
        + [
            f"model.name_or_path={os.path.relpath(tiny_model, ROOT)}",  # recipes run in ROOT
            "model.lora.enabled=true",
            "model.lora.r=4",
            "model.gradient_checkpointing=true",
            "export.merge_lora=true",
            "train.max_steps=3",
        ],
        cache_env,
    )
    adapter = json.loads((out / "final" / "adapter" / "adapter_config.json").read_text())
    assert adapter["base_model_name_or_path"] == str(tiny_model.resolve())
    merged = AutoModelForCausalLM.from_pretrained(out / "final").eval()
    base = AutoModelForCausalLM.from_pretrained(tiny_model)
    peft = PeftModel.from_pretrained(base, out / "final" / "adapter").eval()
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, peft(ids).logits, atol=1e-4, rtol=1e-4)
        assert not torch.allclose(merged(ids).logits, AutoModelForCausalLM.from_pretrained(tiny_model)(ids).logits)


BAD_FILES = {
    "invalid": ("bad.jsonl", b'{"text": "fine"}\n{"text": "fine"}\n{"text": oops}\n', "line 3: invalid JSON"),
    "latin1": ("latin1.csv", 'prompt,completion\na,b\n"two\nlines",caf\xe9\n'.encode("latin-1"), "line 4: not UTF-8"),
    "empty": ("empty.jsonl", b"", "has no rows"),
}


@pytest.mark.parametrize("case, nproc", [("invalid", 1), ("invalid", 2), ("latin1", 1), ("empty", 1)])
def test_bad_data_is_one_clear_error(common, cache_env, tmp_path, case, nproc):
    name, content, message = BAD_FILES[case]
    data = tmp_path / name
    data.write_bytes(content)
    proc = run_recipe(common(data, tmp_path / "out"), cache_env, nproc=nproc, check=False)
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, proc.stderr[-3000:]
    assert errors[0].startswith(f"error: data.train: {data} {message}"), errors[0]
    assert "Traceback" not in proc.stderr.split("error:")[0]  # nothing before it but the run's own lines
    if nproc > 1:  # torchrun's report after it names the same error as the root cause, not a link to its docs
        root_cause = proc.stderr.split("Root Cause (first observed failure):", 1)[1]
        assert f"traceback : {errors[0]}" in root_cause, root_cause


def test_missing_model_is_one_clear_error(base_config, chat_file, cache_env, tmp_path):
    proc = run_recipe(
        [
            "--config",
            str(base_config),
            f"model.name_or_path={tmp_path}/no-model",
            f"data.train={chat_file}",
            f"output_dir={tmp_path}/out",
        ],
        cache_env,
        check=False,
    )
    assert proc.returncode == 2
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1
    assert errors[0].startswith(f"error: model.name_or_path: no such directory: {tmp_path}/no-model;")


def test_step_counts_the_run_never_reaches_are_warned_about(capsys):
    from llmtrain.config import load_config
    from llmtrain.train import check_lengths

    cfg = load_config(
        None, ["model.name_or_path=m", "data.train=d.jsonl", "train.warmup_steps=50", "train.profile_steps=30-32"]
    )
    check_lengths(cfg.train, 20)
    assert capsys.readouterr().err.splitlines() == [
        "warning: train.warmup_steps: 50 is not below the run's 20 steps, so the learning rate never reaches "
        "train.lr=2e-05; lower train.warmup_steps",
        "warning: train.profile_steps: steps 30-32 are beyond the run's 20 steps; nothing is profiled",
    ]
    check_lengths(cfg.train, 100)
    assert capsys.readouterr().err == ""
