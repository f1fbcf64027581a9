"""Launch checks and the Accelerator: what `accelerate launch` set up, checked before
anything loads, and the recipe's batch settings made DeepSpeed's."""

from __future__ import annotations

import math
import os
import sys
import warnings
from contextlib import contextmanager
from pathlib import Path

import torch
from accelerate.utils import DistributedType, parse_flag_from_env

from ..config import Config
from ..errors import ConfigError, UserError
from ..observe.metrics import tracker_name
from .stop import launcher_strings
from .topology import Topology


def process_group_backend() -> str | None:
    """gloo for DeepSpeed on a CPU-only machine (its CPU accelerator): Accelerate finds no
    device backend there and would leave the processes without a group. None otherwise
    (Accelerate chooses)."""
    if (
        parse_flag_from_env("ACCELERATE_USE_DEEPSPEED")
        and not parse_flag_from_env("ACCELERATE_USE_CPU")
        and not torch.cuda.is_available()
    ):
        return "gloo"
    return None


def setup_accelerator(cfg: Config):
    """The Accelerator; topology and precision come from `accelerate launch` / its config."""
    from accelerate import Accelerator
    from accelerate.utils import (
        DataLoaderConfiguration,
        InitProcessGroupKwargs,
        ProjectConfiguration,
        set_seed,
    )

    check_process_count()
    backend = process_group_backend()
    handlers = [InitProcessGroupKwargs(backend=backend)] if backend else []
    tracker = tracker_name(cfg.log.tracker)
    accelerator = Accelerator(
        log_with=tracker,
        project_config=ProjectConfiguration(project_dir=cfg.output_dir, logging_dir=str(Path(cfg.output_dir) / "logs")),
        # Uneven last batches are not padded by repeating rows (which would count them
        # twice); a process with nothing left runs an empty batch instead (see `window`).
        # Batches from pinned memory (batches.make_loader) are copied to the GPU without blocking.
        dataloader_config=DataLoaderConfiguration(even_batches=False, non_blocking=True),
        kwargs_handlers=handlers,
    )
    check_topology(accelerator)
    # torchrun/accelerate launch tell every process the world size. If the processes did
    # not form a group (no GPU and no ACCELERATE_USE_CPU=1), each would train alone on the
    # whole data set and overwrite the others' output.
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched > 1 and accelerator.num_processes != launched:
        raise ConfigError(
            [
                f"launch: {launched} processes were started but they did not join one process group "
                "(no GPU found); for DDP on CPU set ACCELERATE_USE_CPU=1 before accelerate launch"
            ]
        )
    if Topology.of(accelerator).deepspeed:
        configure_deepspeed(accelerator, cfg)
        # DeepSpeed calls torch.distributed functions that torch has renamed; torch warns on
        # every call, burying the training log under advice meant for DeepSpeed's authors.
        warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning)
    threads = use_cpu_cores(accelerator.device.type)
    if threads:
        accelerator.print(
            f"launch: {threads} CPU threads per process (the launcher set OMP_NUM_THREADS=1, its default for GPU "
            "runs); set OMP_NUM_THREADS or --num_cpu_threads_per_process to choose"
        )
    set_seed(cfg.train.seed)
    return accelerator


# The variables an MPI launcher (mpirun) gives each process its world size in; Accelerate
# reads them for a multi-CPU launch through mpirun.
MPI_WORLD_SIZE = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE")


def check_process_count() -> None:
    """Refuse a launch that started fewer processes than it was asked for. accelerate launch
    gives what is neither --multi_gpu, DeepSpeed nor FSDP (a `distributed_type: MULTI_CPU`
    config, which `accelerate config` writes for "multi-CPU", --cpu, a bare --num_processes)
    to its one-process launcher, which without mpirun starts one process whatever
    num_processes says: the run would train alone, one process's share of the global batch a
    step, without a word. That launcher tells it only one way: it exports MASTER_ADDR when
    asked for several processes or machines, and no WORLD_SIZE. The launcher's own
    environment says whether it set MASTER_ADDR or passed on the user's (a Slurm script's
    export); where it cannot be read (not Linux) nothing is checked."""
    if "WORLD_SIZE" in os.environ or any(key in os.environ for key in MPI_WORLD_SIZE):
        return  # torchrun, DeepSpeed's launcher or mpirun started the processes and said how many
    if "MASTER_ADDR" not in os.environ or (launcher := launcher_strings()) is None:
        return
    if any(v.startswith("MASTER_ADDR=") for v in launcher[1]):
        return  # the user's MASTER_ADDR, passed on
    raise ConfigError(
        [
            "launch: accelerate launch was asked for several processes but started only this one, which would "
            "train alone (its one-process launcher runs a distributed_type: MULTI_CPU config, --cpu or a bare "
            "--num_processes, without mpirun); for DDP on CPU run `ACCELERATE_USE_CPU=1 accelerate launch "
            "--multi_gpu --num_processes N ...` or --config_file accelerate_configs/cpu_ddp.yaml, on GPUs add "
            "--multi_gpu (docs/launching.md)"
        ]
    )


def use_cpu_cores(device_type: str) -> int | None:
    """On CPU, undo a launcher's one thread per process. accelerate launch starts its workers
    with OMP_NUM_THREADS=1 unless it was told a thread count or --cpu (so the README's
    `accelerate launch recipes/finetune.py` on a machine with no GPU trained on one core of
    many), and torchrun does the same for several processes: right for GPU runs, where
    threads would compete with the data loaders. Where the launcher chose it (no
    OMP_NUM_THREADS in the launcher's own environment, no --num_cpu_threads_per_process on
    its command line), each process of this machine takes its share of the physical cores it
    may run on, as accelerate does under --cpu; a count the user set is kept, and the count
    set is passed on to processes this one starts. Written by hand because the workers
    cannot tell Accelerate's default from a user's choice without reading the launcher's
    environment and command line. Returns the threads set, or None where nothing changed."""
    if device_type != "cpu" or os.environ.get("OMP_NUM_THREADS") != "1" or torch.get_num_threads() != 1:
        return None
    if (launcher := launcher_strings()) is None:
        return None  # no launcher (a script that exported the variable, say), or one that cannot be read
    argv, environ = launcher
    if any(v.startswith("OMP_NUM_THREADS=") for v in environ) or any(
        a.startswith("--num_cpu_threads_per_process") for a in argv
    ):
        return None
    threads = physical_cores() // local_processes()
    if threads <= 1:
        return None
    torch.set_num_threads(threads)
    os.environ["OMP_NUM_THREADS"] = str(threads)  # for processes this one starts (the demo's model build)
    return threads


def physical_cores() -> int:
    """The physical cores this process may run on: the CPUs of its affinity mask (a Slurm or
    taskset allotment) scaled by the machine's physical to logical ratio, so that two
    hardware threads of one core count once, and at most its cgroup's CPU quota (a
    container's --cpus, a Kubernetes CPU limit), where threads past it only wait."""
    import psutil

    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    logical, physical = psutil.cpu_count() or usable, psutil.cpu_count(logical=False) or usable
    cores = max(1, usable * physical // logical)
    quota = cpu_quota()
    return max(1, min(cores, math.ceil(quota))) if quota else cores


def cpu_quota(root: str = "/sys/fs/cgroup", own: str = "/proc/self/cgroup") -> float | None:
    """CPUs this process's cgroup may use (quota / period), or None without a quota. cgroup
    v2's cpu.max ("200000 100000", or "max ..."), read at the process's own cgroup and every
    ancestor up to the root (a container sees its own cgroup at the root), the smallest
    counting: a limit on a parent slice (a Slurm job, a systemd slice) binds its children.
    Else cgroup v1's cpu.cfs_quota_us and cpu.cfs_period_us, likewise. Written by hand:
    neither torch nor psutil reads quotas."""

    def read(path: Path) -> str | None:
        try:
            with open(path) as f:
                return f.read(256)
        except (OSError, UnicodeDecodeError):
            return None

    def ratio(quota: str, period: str) -> float | None:
        try:
            q, p = float(quota), float(period)
        except ValueError:
            return None
        return q / p if q > 0 and p > 0 else None

    def chain(top: Path, path: str) -> list[Path]:
        """`top` and the cgroups from it down to `path` (bounded: a path is a few levels)."""
        parts = [p for p in path.strip().split("/") if p not in ("", ".", "..")][:64]
        return [top.joinpath(*parts[:n]) for n in range(len(parts) + 1)]

    base, v2, v1 = Path(root), [Path(root)], [Path(root) / "cpu"]
    for line in (read(Path(own)) or "").splitlines():
        number, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if number == "0" and not controllers:  # cgroup v2: this process's own cgroup
            v2 = chain(base, path)
        elif "cpu" in controllers.split(","):  # cgroup v1's cpu controller
            v1 = chain(base / "cpu", path)
    texts = [t.split() for t in (read(level / "cpu.max") for level in v2) if t is not None]
    if texts:
        quotas = [ratio(*fields) for fields in texts if len(fields) == 2]
    else:
        quotas = [ratio(*(read(at / name) or "" for name in ("cpu.cfs_quota_us", "cpu.cfs_period_us"))) for at in v1]
    return min((q for q in quotas if q), default=None)


def local_processes() -> int:
    """Processes on this machine, as the launcher says (torchrun and accelerate: LOCAL_WORLD_SIZE;
    DeepSpeed's launcher: LOCAL_SIZE); 1 when it says nothing (accelerate's one-process launcher)."""
    for key in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE"):
        try:
            n = int(os.environ.get(key, ""))
        except ValueError:
            continue
        if n > 0:
            return n
    return 1


def check_topology(accelerator) -> None:
    """Refuse launches that would silently not be what was asked for. Reads what
    Accelerate made of the launch (`distributed_type`) rather than a `Topology`: it runs
    before that is settled, and settles it (`fsdp_on_cpu`)."""
    kind = accelerator.distributed_type
    if accelerator.mixed_precision == "fp16" and accelerator.scaler is None and kind != DistributedType.DEEPSPEED:
        # Accelerate makes fp16's autocast and loss scaler for GPUs only (DeepSpeed scales
        # its own): on CPU the run would train in float32, or under FSDP2 in fp16 unscaled.
        raise ConfigError(
            [
                "launch: --mixed_precision fp16 has no loss scaler on CPU (Accelerate makes fp16 autocast and "
                "its scaler on a GPU only), so the run would not train in fp16; use bf16 or no on CPU"
            ]
        )
    if kind == DistributedType.MULTI_CPU and parse_flag_from_env("ACCELERATE_USE_DEEPSPEED"):
        raise ConfigError(
            [
                "launch: ACCELERATE_USE_CPU=1 (or use_cpu: true) turns DeepSpeed off in Accelerate; "
                "for DeepSpeed on CPU launch without it (DeepSpeed picks its CPU accelerator by itself)"
            ]
        )
    if parse_flag_from_env("ACCELERATE_USE_FSDP") and kind == DistributedType.MULTI_CPU:
        fsdp_on_cpu(accelerator)
        kind = accelerator.distributed_type
    if parse_flag_from_env("ACCELERATE_USE_FSDP") and kind != DistributedType.FSDP:
        raise ConfigError(
            [
                "launch: FSDP was asked for but this launch has no process group to shard over (a process "
                "started without accelerate launch, or no GPU without ACCELERATE_USE_CPU=1); launch with accelerate "
                "launch, on CPU with ACCELERATE_USE_CPU=1 (see accelerate_configs/fsdp2.yaml)"
            ]
        )
    if kind == DistributedType.FSDP and accelerator.state.fsdp_plugin.fsdp_version != 2:
        raise ConfigError(
            [
                "launch: FSDP1 is not supported; set fsdp_config.fsdp_version: 2 in the accelerate config "
                "(see accelerate_configs/fsdp2.yaml)"
            ]
        )


def fsdp_on_cpu(accelerator) -> None:
    """Make a CPU launch that asked for FSDP (ACCELERATE_USE_FSDP, set by accelerate
    launch from an FSDP config) an FSDP run. PyTorch's FSDP2 (fully_shard) runs on CPU over
    gloo, but Accelerate turns FSDP on only for device backends and leaves a CPU launch
    MULTI_CPU. Written by hand because Accelerate has no switch for it: its state objects
    keep their fields in class-level shared dicts, and `prepare`, `save_state`,
    `load_state` and `get_state_dict` all read `distributed_type` and `fsdp_plugin` from
    there, so both are set in AcceleratorState's and PartialState's (the plugin built from
    the same FSDP_* variables Accelerate reads). tests/distributed/test_launch.py fails if an
    Accelerate upgrade moves this."""
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin()
    if accelerator.mixed_precision != "no":
        plugin.set_mixed_precision(accelerator.mixed_precision)
    for shared in (AcceleratorState._shared_state, PartialState._shared_state):
        shared["distributed_type"] = DistributedType.FSDP
    AcceleratorState._shared_state["fsdp_plugin"] = plugin
    if accelerator.distributed_type != DistributedType.FSDP or accelerator.state.fsdp_plugin is not plugin:
        raise RuntimeError("Accelerate no longer keeps its state where distributed.launch.fsdp_on_cpu sets FSDP")


def configure_deepspeed(accelerator, cfg: Config) -> None:
    """Make the recipe's batch settings DeepSpeed's: "auto" (or absent) values are filled
    in from train.*; an explicit value that differs is an error naming both settings."""
    plugin = accelerator.state.deepspeed_plugin
    ds = plugin.deepspeed_config
    t, world = cfg.train, accelerator.num_processes
    if t.spike_factor:
        raise ConfigError(
            [
                "train.spike_factor: the spike guard cannot run under DeepSpeed (its engine takes the "
                "optimizer step inside backward, before the step's loss is known); "
                "set train.spike_factor=0"
            ]
        )
    if t.compile:
        raise ConfigError(
            [
                "train.compile: not supported with DeepSpeed (its ZeRO hooks run inside every block); "
                "set train.compile=false, or use DDP or FSDP2"
            ]
        )
    if cfg.model.quantization != "none" and Topology.of(accelerator).zero3:
        raise ConfigError(
            [
                f"model.quantization: {cfg.model.quantization} weights cannot be partitioned by DeepSpeed ZeRO-3; "
                "use ZeRO-1/2, DDP or FSDP2 for QLoRA, or set model.quantization=none"
            ]
        )
    where = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE") or "the accelerate config's deepspeed_config"
    wanted = [
        ("train_micro_batch_size_per_gpu", t.micro_batch_size, "train.micro_batch_size"),
        ("gradient_accumulation_steps", t.grad_accum_steps, "train.grad_accum_steps"),
        (
            "train_batch_size",
            t.global_batch(world),
            f"train.micro_batch_size x train.grad_accum_steps x {world} processes",
        ),
        ("gradient_clipping", float(t.max_grad_norm or 0.0), "train.max_grad_norm"),
    ]
    problems = []
    for key, ours, name in wanted:
        theirs = ds.get(key, "auto")
        if theirs == "auto":
            ds[key] = ours
        elif not _is_number(theirs):
            problems.append(
                f'{key}={theirs!r} in {where} is not a number; set it to "auto" (the recipe\'s {name} is then used)'
            )
        elif float(theirs) != float(ours):
            problems.append(
                f'{name}={ours} conflicts with {key}={theirs} in {where}; set {key} to "auto" '
                f"there (the recipe's value is then used) or make them equal"
            )
    if problems:
        raise ConfigError(problems)
    # Accelerate compares its own count with DeepSpeed's; it does not scale the loss
    # under DeepSpeed, so matching it only silences a mismatch warning.
    accelerator.gradient_accumulation_steps = t.grad_accum_steps


def _is_number(value) -> bool:
    """Whether a DeepSpeed config value reads as a number (a typo such as "four" is the user's to fix)."""
    try:
        float(value)
    except (TypeError, ValueError):
        return False
    return not isinstance(value, bool)


@contextmanager
def main_first(accelerator):
    """Like `accelerator.main_process_first()`: the main process runs the body first (it
    builds the demo files and the data cache), then the others. Unlike it, a user error
    the main process meets there reaches every process: the others wait for the main
    process's outcome rather than in a barrier it never joins, and raise the same error
    (printed once, `cli.report_once`) instead of dying in a broken collective."""
    if accelerator.num_processes == 1:
        yield
        return
    from accelerate.utils import broadcast_object_list

    outcome: list = [None]
    if not accelerator.is_main_process:
        broadcast_object_list(outcome)
        if outcome[0] == FAILED:
            sys.exit(1)  # the main process shows the traceback
        if outcome[0] is not None:
            raise UserError(outcome[0])
        yield
        return
    try:
        yield
    except UserError as e:
        broadcast_object_list([str(e)])
        raise
    except Exception:
        broadcast_object_list([FAILED])
        raise
    broadcast_object_list(outcome)


FAILED = "\0failed"  # what main_first sends when the main process met a bug
