"""recipes/distill.py launched as a user launches it, on the tiny model as student and a
teacher of its tokenizer with other weights: the step is the divergence over every trained
token of the global batch whatever its layout, offline (packed) and with the student's own
answers (GKD, on-policy), under ZeRO-3 and FSDP2 too, with the teacher held whole; a run SIGKILLed
after a checkpoint resumes to the same losses and weights; a bad teacher is one line."""

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.support.runs import (
    assert_same_weights,
    check_card,
    kill_run,
    launch,
    recipe_args,
    run_recipe,
    start_run,
    train_rows,
    wait_for,
)

pytestmark = pytest.mark.slow

DISTILL_RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "distill.py"


@pytest.fixture(scope="module")
def teacher(tiny_model, tmp_path_factory) -> Path:
    """The tiny model's config and tokenizer with other (random) weights: a teacher whose
    distribution differs from the student's."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = tmp_path_factory.mktemp("teacher") / "teacher"
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.2)
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(tiny_model).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def args(base_config, tiny_model, chat_file, teacher):
    def make(out: Path, *extra: str) -> list[str]:
        return recipe_args(
            base_config, tiny_model, chat_file, out, f"distill.teacher={teacher}", "log.every_steps=1", *extra
        )

    return make


def distill(args: list[str], env: dict, nproc: int = 1, **kw):
    return run_recipe(args, env, nproc=nproc, recipe=DISTILL_RECIPE, **kw)


def assert_same_steps(got: Path, want: Path, name: str, keys=("loss",), atol: float = 1e-5) -> None:
    rows, ref = train_rows(got), train_rows(want)
    assert [r["step"] for r in rows] == [r["step"] for r in ref], name
    assert [r["tokens"] for r in rows] == [r["tokens"] for r in ref], name
    for a, b in zip(rows, ref):
        for key in keys:
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), (name, a["step"], key)
    assert_same_weights(got, want, name, atol)


OFFLINE = ["distill.on_policy_fraction=0", "distill.beta=0.5", "data.packing=true", "train.max_steps=3"]
GKD = ["distill.on_policy_fraction=0.5", "distill.max_completion_length=12", "train.max_steps=3"]


@pytest.fixture(scope="module")
def offline_one(args, cache_env, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("offline") / "run"
    distill(args(out, *OFFLINE, "train.micro_batch_size=4"), cache_env)
    return out


def test_offline_distillation_learns_and_is_the_same_on_two_processes(args, cache_env, offline_one, tmp_path):
    rows = train_rows(offline_one)
    assert rows[-1]["loss"] < rows[0]["loss"] and "on_policy" not in rows[0]
    two = tmp_path / "two"
    layout = ["train.micro_batch_size=1", "train.grad_accum_steps=2", "distill.shard_teacher=true"]
    proc = distill(args(two, *OFFLINE, *layout), cache_env, nproc=2)
    assert "warning: distill.shard_teacher: the student is not sharded" in proc.stderr  # DDP: the teacher stays whole
    assert_same_steps(two, offline_one, "offline 2 x 1 x 2")


@pytest.mark.parametrize(
    ("topology", "shard"),
    [("ds_zero3", False), ("ds_zero3", True), ("fsdp2", True)],
    ids=["zero3_whole_teacher", "zero3_sharded_teacher", "fsdp2_sharded_teacher"],
)
def test_a_whole_or_sharded_teacher_beside_a_sharded_student(args, cache_env, offline_one, tmp_path, topology, shard):
    """The teacher held whole on each process, or sharded as the student is
    (distill.shard_teacher: every forward a collective): the steps of one process. (A whole
    teacher beside an FSDP2 student runs in the GKD layouts below.)"""
    out = tmp_path / topology
    layout = ["train.micro_batch_size=1", "train.grad_accum_steps=2", f"distill.shard_teacher={str(shard).lower()}"]
    proc = launch(args(out, *OFFLINE, *layout), cache_env, topology, recipe=DISTILL_RECIPE, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert ("distill.teacher: sharded across 2 processes" in proc.stdout) == shard
    assert_same_steps(out, offline_one, f"{topology}, teacher {'sharded' if shard else 'whole'}")


@pytest.fixture(scope="module")
def gkd_one(args, cache_env, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("gkd") / "run"
    distill(args(out, *GKD, "train.micro_batch_size=4"), cache_env)
    return out


@pytest.mark.parametrize(
    ("topology", "nproc", "micro", "accum"),
    [("", 1, 1, 4), ("", 2, 1, 2), ("ds_zero3", 2, 1, 2), ("fsdp2", 2, 2, 1)],
    ids=["1proc_1x4", "2proc_1x2", "zero3", "fsdp2"],
)
def test_the_students_own_answers_are_the_same_on_any_layout(
    args, cache_env, gkd_one, tmp_path, topology, nproc, micro, accum
):
    """GKD: about half the steps answered by the student, each answer from its row's seed; the
    answers, the losses and the update are one process x 4's on every layout, under ZeRO-3
    and FSDP2 too, where the processes generate together."""
    rows = train_rows(gkd_one)
    assert sorted({r["on_policy"] for r in rows}) == [0.0, 1.0]  # the share of trained tokens the student sampled
    out = tmp_path / "run"
    layout = [f"train.micro_batch_size={micro}", f"train.grad_accum_steps={accum}"]
    if topology == "ds_zero3":  # the teacher sharded too: the processes generate, then gather it, together
        layout.append("distill.shard_teacher=true")
    if topology:
        proc = launch(args(out, *GKD, *layout), cache_env, topology, recipe=DISTILL_RECIPE, check=False)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    else:
        distill(args(out, *GKD, *layout), cache_env, nproc=nproc)
    assert_same_steps(out, gkd_one, f"{topology or nproc} x {micro} x {accum}", keys=("loss", "on_policy"))


def test_the_sampled_token_reverse_kl_is_the_same_on_two_processes(args, cache_env, tmp_path):
    """On-policy distillation with the k3 estimator and the forward KL over the teacher's top 4:
    one process x 4 and two processes x 1 x 2 sample the same answers and take the same steps."""
    run = ["distill.loss=reverse_kl", "distill.estimator=k3", "distill.forward_top_k=4", "distill.on_policy_fraction=1"]
    run += ["distill.max_completion_length=12", "train.max_steps=3"]
    one, two = tmp_path / "one", tmp_path / "two"
    distill(args(one, *run, "train.micro_batch_size=4"), cache_env)
    distill(args(two, *run, "train.micro_batch_size=1", "train.grad_accum_steps=2"), cache_env, nproc=2)
    # Losses agree to rel 1e-6; a weight may differ by ~1e-5: gradients summed in another order
    # differ by float rounding, and Adam's first steps divide each by its own tiny magnitude.
    keys = ("loss", "reverse_kl", "on_policy")
    assert_same_steps(two, one, "reverse_kl k3 2 x 1 x 2", keys=keys, atol=5e-5)
    assert all(r["loss"] > 0 for r in train_rows(one))  # k3 and a KL: never below 0


def test_on_policy_distillation_resumes_exactly_after_a_sigkill(args, cache_env, tmp_path):
    """The reverse KL at the student's own samples (k1): killed after a checkpoint, the rerun
    samples the same answers from the restored weights and ends with the same weights."""
    from llmtrain.output.checkpoint import complete_checkpoints

    run = [
        "distill.loss=reverse_kl",
        "distill.on_policy_fraction=1",
        "distill.max_completion_length=12",
        "train.micro_batch_size=2",
        "train.epochs=2",
        "checkpoint.every_steps=3",
        "checkpoint.resume=auto",
    ]
    ref, out = tmp_path / "ref", tmp_path / "killed"
    distill(args(ref, *run), cache_env)
    assert all(r["on_policy"] == 1 for r in train_rows(ref)) and "reverse_kl" in train_rows(ref)[0]
    proc = start_run(args(out, *run), cache_env, nproc=1, recipe=DISTILL_RECIPE)
    assert wait_for(lambda: any(step >= 6 for step, _ in complete_checkpoints(out)), proc)
    kill_run(proc)
    step, path = complete_checkpoints(out)[-1]
    assert 6 <= step < 20 and not (out / "final").exists()
    done = distill(args(out, *run), cache_env)
    assert f"resumed from {path} at step {step}" in done.stdout
    assert [r["loss"] for r in train_rows(out)] == [r["loss"] for r in train_rows(ref)]  # exactly
    for key, value in load_file(ref / "final" / "model.safetensors").items():
        torch.testing.assert_close(load_file(out / "final" / "model.safetensors")[key], value, rtol=0, atol=0)


def test_a_teacher_that_cannot_teach_is_one_line(args, cache_env, tmp_path, tiny_model):
    from transformers import AutoConfig

    small = tmp_path / "small"
    config = AutoConfig.from_pretrained(tiny_model)
    config.vocab_size = 40
    config.save_pretrained(small)
    for teacher, says in [
        (small, "distill.teacher: '"),
        (tmp_path / "missing", "distill.teacher: "),
    ]:
        proc = distill(args(tmp_path / "out", *OFFLINE, f"distill.teacher={teacher}"), cache_env, check=False)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
        assert says in proc.stderr


def test_a_lora_student_learns_from_its_own_answers_and_exports_its_adapter(args, cache_env, tmp_path):
    """On-policy distillation of a LoRA student: the adapted model samples its answers, only
    the adapters train (the teacher is never adapted), and final/ holds the adapter."""
    out = tmp_path / "lora"
    lora = ["model.lora.enabled=true", "model.lora.r=4", "train.lr=1e-2", "train.micro_batch_size=4"]
    run = ["distill.loss=reverse_kl", "distill.on_policy_fraction=1", "distill.max_completion_length=8"]
    distill(args(out, *run, *lora, "train.max_steps=4"), cache_env)
    rows = train_rows(out)
    assert len(rows) == 4 and all(r["on_policy"] == 1 for r in rows)
    assert rows[-1]["reverse_kl"] != rows[0]["reverse_kl"]  # the adapters moved the student
    final = out / "final"
    assert (final / "adapter_config.json").is_file() or (final / "adapter" / "adapter_config.json").is_file()
    check_card(final, ["distillation", "lora"], "AutoPeftModelForCausalLM")
