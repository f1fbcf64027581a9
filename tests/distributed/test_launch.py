"""Launch topologies that would silently not be what was asked for are refused, and the
recipe's batch settings drive DeepSpeed's."""

import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
from accelerate.utils import DistributedType

from llmtrain.config import load_config
from llmtrain.distributed.launch import check_topology, configure_deepspeed, process_group_backend
from llmtrain.errors import ConfigError
from tests.support.accelerate_config import MULTI_CPU_CONFIG


def fake(kind, fsdp_version=2, precision="no", scaler=None):
    return SimpleNamespace(
        distributed_type=kind,
        state=SimpleNamespace(fsdp_plugin=SimpleNamespace(fsdp_version=fsdp_version)),
        mixed_precision=precision,
        scaler=scaler,
    )


@pytest.mark.parametrize(
    "kind",
    [
        DistributedType.NO,
        DistributedType.MULTI_GPU,
        DistributedType.MULTI_CPU,
        DistributedType.DEEPSPEED,
        DistributedType.FSDP,
    ],
)
def test_supported_topologies_run(kind, monkeypatch):
    monkeypatch.delenv("ACCELERATE_USE_DEEPSPEED", raising=False)
    monkeypatch.delenv("ACCELERATE_USE_FSDP", raising=False)
    if kind == DistributedType.FSDP:
        monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    check_topology(fake(kind))


def test_fsdp1_is_refused(monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    with pytest.raises(ConfigError, match="fsdp_version: 2"):
        check_topology(fake(DistributedType.FSDP, fsdp_version=1))


def test_fsdp_asked_for_without_a_process_group_is_refused(monkeypatch):
    """A process started without a launcher (or several without ACCELERATE_USE_CPU=1 on a
    machine without a GPU): Accelerate drops FSDP silently, and training without it would
    mislead. CPU processes under accelerate launch run real FSDP2 (tests/launch/test_fsdp.py),
    one of them too."""
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    with pytest.raises(ConfigError, match="no process group to shard over"):
        check_topology(fake(DistributedType.NO))


def test_fp16_without_a_loss_scaler_is_refused(monkeypatch):
    """Accelerate gives fp16 on CPU neither autocast nor a loss scaler: the run would train
    in float32 while its run.json said fp16. A real Accelerator, so a change of that gate
    in Accelerate shows here; where a scaler exists, or DeepSpeed scales, fp16 runs."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    monkeypatch.delenv("ACCELERATE_USE_DEEPSPEED", raising=False)
    monkeypatch.delenv("ACCELERATE_USE_FSDP", raising=False)
    AcceleratorState._reset_state(True)
    try:
        with pytest.raises(ConfigError, match="fp16 has no loss scaler on CPU"):
            check_topology(Accelerator(cpu=True, mixed_precision="fp16"))
    finally:
        AcceleratorState._reset_state(True)
    check_topology(fake(DistributedType.MULTI_GPU, precision="fp16", scaler=object()))
    check_topology(fake(DistributedType.DEEPSPEED, precision="fp16"))


def test_deepspeed_with_use_cpu_is_refused(monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    with pytest.raises(ConfigError, match="turns DeepSpeed off"):
        check_topology(fake(DistributedType.MULTI_CPU))


def test_deepspeed_on_a_cpu_machine_uses_gloo(monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.delenv("ACCELERATE_USE_CPU", raising=False)
    assert process_group_backend() == "gloo"
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "false")
    assert process_group_backend() is None


def recipe(*overrides):
    return load_config(None, ["model.name_or_path=m", "data.train=d.jsonl", *overrides])


def ds_accelerator(ds_config: dict, world: int = 2):
    plugin = SimpleNamespace(deepspeed_config=ds_config, zero_stage=ds_config["zero_optimization"]["stage"])
    return SimpleNamespace(
        distributed_type=DistributedType.DEEPSPEED,
        mixed_precision="no",
        state=SimpleNamespace(deepspeed_plugin=plugin),
        num_processes=world,
        gradient_accumulation_steps=1,
    )


def test_recipe_fills_deepspeed_auto_values():
    cfg = recipe("train.micro_batch_size=3", "train.grad_accum_steps=4", "train.max_grad_norm=0.5")
    ds = {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "zero_optimization": {"stage": 3},
    }
    acc = ds_accelerator(ds, world=2)
    configure_deepspeed(acc, cfg)
    assert ds["train_micro_batch_size_per_gpu"] == 3
    assert ds["gradient_accumulation_steps"] == 4
    assert ds["train_batch_size"] == 24
    assert ds["gradient_clipping"] == 0.5
    assert acc.gradient_accumulation_steps == 4


def test_conflicting_deepspeed_value_names_both_settings(monkeypatch):
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", "ds.json")
    cfg = recipe("train.micro_batch_size=2", "train.grad_accum_steps=4")
    ds = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 8, "zero_optimization": {"stage": 2}}
    with pytest.raises(ConfigError) as err:
        configure_deepspeed(ds_accelerator(ds), cfg)
    msg = str(err.value)
    assert "train.grad_accum_steps=4 conflicts with gradient_accumulation_steps=8 in ds.json" in msg
    assert "micro_batch" not in msg  # equal values are no conflict


@pytest.mark.parametrize("stage", [2, 3])
def test_quantized_weights_are_refused_under_zero3_only(stage):
    cfg = recipe("model.quantization=nf4", "model.lora.enabled=true")
    acc = ds_accelerator({"zero_optimization": {"stage": stage}})
    if stage == 2:
        configure_deepspeed(acc, cfg)
        return
    with pytest.raises(ConfigError, match="cannot be partitioned by DeepSpeed ZeRO-3"):
        configure_deepspeed(acc, cfg)


def test_a_deepspeed_value_that_is_no_number_names_its_key(monkeypatch):
    """A typo in the DeepSpeed config is the user's to fix, not a float() traceback."""
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", "ds.json")
    ds = {"gradient_accumulation_steps": "four", "zero_optimization": {"stage": 2}}
    with pytest.raises(ConfigError) as err:
        configure_deepspeed(ds_accelerator(ds), recipe("train.grad_accum_steps=4"))
    assert err.value.problems == [
        "gradient_accumulation_steps='four' in ds.json is not a number; set it to \"auto\" (the recipe's "
        "train.grad_accum_steps is then used)"
    ]


def cores() -> int:
    from llmtrain.distributed.launch import physical_cores

    return physical_cores()


THREADS_SCRIPT = """
import os
import torch
from llmtrain.distributed.launch import use_cpu_cores
print("threads", use_cpu_cores("cuda"), use_cpu_cores("cpu"), torch.get_num_threads(), os.environ["OMP_NUM_THREADS"])
"""
LAUNCH = [sys.executable, "-m", "accelerate.commands.launch", "-q", "--num_processes", "1"]


def threads_under(tmp_path, command: list[str], **env) -> str:
    """What THREADS_SCRIPT prints when `command` runs it (its last word), without an
    OMP_NUM_THREADS of the test's and without the user's accelerate config."""
    script = tmp_path / "threads.py"
    script.write_text(THREADS_SCRIPT)
    base = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"} | {"HF_HOME": str(tmp_path / "hf")}
    proc = subprocess.run([*command, str(script)], env=base | env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return next(line for line in proc.stdout.splitlines() if line.startswith("threads"))


@pytest.mark.skipif(cores() < 2, reason="needs 2 CPU cores")
def test_a_cpu_run_under_accelerate_launch_uses_the_cores(tmp_path):
    """accelerate launch without --cpu gives its one process OMP_NUM_THREADS=1; on CPU the
    run takes the machine's cores back, for the processes it starts too (on a GPU it leaves
    the launcher's choice)."""
    n = cores()
    assert threads_under(tmp_path, LAUNCH) == f"threads None {n} {n} {n}"


@pytest.mark.skipif(cores() < 2, reason="needs 2 CPU cores")
@pytest.mark.parametrize("how", ["environment", "script", "flag"])
def test_a_thread_count_the_user_set_is_kept(tmp_path, how):
    if how == "environment":  # OMP_NUM_THREADS=1 accelerate launch ...
        assert threads_under(tmp_path, LAUNCH, OMP_NUM_THREADS="1") == "threads None None 1 1"
    elif how == "script":  # a script that exports it, then launches
        command = ["bash", "-c", f'export OMP_NUM_THREADS=1; "{LAUNCH[0]}" {" ".join(LAUNCH[1:])} "$0"']
        assert threads_under(tmp_path, command) == "threads None None 1 1"
    else:  # accelerate's own flag, which reaches only the worker's environment
        command = [*LAUNCH, "--num_cpu_threads_per_process", "1"]
        assert threads_under(tmp_path, command) == "threads None None 1 1"


def test_a_cpu_process_without_a_launcher_is_left_alone(tmp_path):
    """A plain process (its parent a shell) keeps whatever threads it was given, even one
    that the shell exported after it started."""
    command = ["bash", "-c", f'export OMP_NUM_THREADS=1; "{sys.executable}" "$0"']
    assert threads_under(tmp_path, command) == "threads None None 1 1"


@pytest.mark.parametrize(
    ("files", "quota"),
    [
        ({"cpu.max": "150000 100000\n"}, 1.5),  # cgroup v2, a container's --cpus=1.5
        ({"cpu.max": "max 100000\n"}, None),  # no quota
        ({"job/cpu.max": "400000 100000\n", "cpu.max": "max 100000\n"}, 4.0),  # its own cgroup's, on a host
        ({"job/step/cpu.max": "max 100000\n", "job/cpu.max": "300000 100000\n"}, 3.0),  # set on a parent
        ({"job/step/cpu.max": "800000 100000\n", "job/cpu.max": "200000 50000\n"}, 4.0),  # the smallest binds
        ({"cpu/cpu.cfs_quota_us": "200000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 2.0),  # cgroup v1
        ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),  # v1, no quota
        ({"cpu/job/cpu.cfs_quota_us": "50000\n", "cpu/job/cpu.cfs_period_us": "100000\n"}, 0.5),  # v1, a parent's
        ({}, None),  # no cgroup files at all
    ],
)
def test_a_cgroup_cpu_quota_is_read(tmp_path, files, quota):
    """A quota caps the threads (physical_cores): 16 threads in a 2-CPU container wait."""
    from llmtrain.distributed.launch import cpu_quota

    root = tmp_path / "cgroup"
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    own = tmp_path / "self-cgroup"
    host = any(name.startswith(("job/", "cpu/job/")) for name in files)
    own.write_text("4:cpu,cpuacct:/job/step\n0::/job/step\n" if host else "4:cpu,cpuacct:/\n0::/\n")
    assert cpu_quota(str(root), str(own)) == quota


def test_the_thread_count_stays_within_the_quota(monkeypatch):
    import llmtrain.distributed.launch as launch

    monkeypatch.setattr(launch, "cpu_quota", lambda: 0.5)
    assert launch.physical_cores() == 1
    monkeypatch.setattr(launch, "cpu_quota", lambda: None)
    unlimited = launch.physical_cores()
    monkeypatch.setattr(launch, "cpu_quota", lambda: unlimited + 8.0)
    assert launch.physical_cores() == unlimited  # a quota above the cores changes nothing


COUNT_SCRIPT = """
from llmtrain.distributed.launch import check_process_count
from llmtrain.errors import ConfigError
try:
    check_process_count()
    print("count ok")
except ConfigError as e:
    print("count refused:", e)
"""
ACCELERATE = [sys.executable, "-m", "accelerate.commands.launch", "-q"]


def test_a_multi_cpu_config_without_mpirun_starts_one_process_and_is_refused(tmp_path):
    """accelerate launch runs a MULTI_CPU config without mpirun (and --cpu or a bare
    --num_processes N) through its one-process launcher: one process, whatever it names.
    The check reads what the real launcher leaves (test_the_process_count_check_reads_the_launcher
    takes each case)."""
    config = tmp_path / "multi_cpu.yaml"
    config.write_text(MULTI_CPU_CONFIG)  # what `accelerate config` wrote from the answers
    script = tmp_path / "count.py"
    script.write_text(COUNT_SCRIPT)
    drop = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "ACCELERATE_USE_CPU")
    env = {k: v for k, v in os.environ.items() if k not in drop} | {"HF_HOME": str(tmp_path / "hf")}
    command = [*ACCELERATE, "--config_file", str(config), str(script)]
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(line for line in proc.stdout.splitlines() if line.startswith("count"))
    assert line.startswith("count refused: launch: accelerate launch was asked for several processes")
    assert "ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes N" in line


@pytest.mark.parametrize(
    ("env", "parent_argv", "parent_env", "refused"),
    [
        ({"MASTER_ADDR": "127.0.0.1"}, ["python", "accelerate", "launch", "--cpu"], [], True),
        ({"MASTER_ADDR": "127.0.0.1"}, ["accelerate-launch", "x.py"], ["PATH=/bin"], True),
        # the launcher passed on the user's MASTER_ADDR (a Slurm script's export): nothing to say
        ({"MASTER_ADDR": "h"}, ["accelerate", "launch"], ["MASTER_ADDR=h"], False),
        ({}, ["accelerate", "launch"], [], False),  # one process asked for: no MASTER_ADDR
        ({"MASTER_ADDR": "h", "WORLD_SIZE": "2"}, ["torchrun"], [], False),  # the launcher said how many
        ({"MASTER_ADDR": "h", "PMI_SIZE": "2"}, ["hydra_pmi_proxy"], [], False),  # mpirun
        ({"MASTER_ADDR": "h"}, ["bash", "job.sh"], [], False),  # no launcher
        ({"MASTER_ADDR": "h"}, ["accelerate", "launch"], None, False),  # the launcher cannot be read
    ],
)
def test_the_process_count_check_reads_the_launcher(monkeypatch, env, parent_argv, parent_env, refused):
    import llmtrain.distributed.launch as launch
    import llmtrain.distributed.stop as stop

    for key in ("MASTER_ADDR", "WORLD_SIZE", *launch.MPI_WORLD_SIZE):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(stop, "proc_strings", lambda pid, name: parent_argv if name == "cmdline" else parent_env)
    if refused:
        with pytest.raises(ConfigError, match="started only this one"):
            launch.check_process_count()
    else:
        launch.check_process_count()
