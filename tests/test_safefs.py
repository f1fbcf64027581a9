"""llmtrain never writes through a symbolic link it did not make (an output_dir may be
shared with others, who can plant one), and an unusable cache is one line at start-up
(llmtrain/safefs.py). A recipe refusing either: tests/launch/test_safefs.py."""

import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from llmtrain import safefs
from llmtrain.errors import CacheError, LinkError
from tests.support.links import untouched


class OneProcess:
    is_main_process = True
    num_processes = 1

    def wait_for_everyone(self):
        pass

    def save_state(self, path):
        (Path(path) / "model.safetensors").write_bytes(b"weights")

    def log(self, *args, **kwargs):
        pass


NAMES = [
    *safefs.OUTPUT_NAMES,
    "checkpoints/step-3",
    "checkpoints/.tmp-step-4",
    "profile/steps-1-2",
    "logs/llmtrain",  # a tracker's directory (log.project)
]


@pytest.mark.parametrize("name", NAMES)
def test_a_link_in_place_of_anything_a_run_writes_is_refused_at_start_up(victim, name):
    link = victim.out / name
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(victim.dir)
    with pytest.raises(LinkError) as e:
        safefs.check_output_dir(victim.out)
    message = str(e.value)
    assert "\n" not in message
    assert message.startswith(f"output_dir: {link} is a symbolic link (to ")
    assert "llmtrain does not write through links it did not make" in message
    untouched(victim)


@pytest.mark.parametrize("name", ["metrics.jsonl", ".llmtrain.lock", "config.yaml", "checkpoints", "logs"])
@pytest.mark.parametrize("planted", ["pipe", "the other kind"])
def test_a_pipe_or_the_wrong_kind_of_entry_where_a_run_writes_is_refused_at_start_up(victim, name, planted):
    """A named pipe at metrics.jsonl hung the run at its first write; a directory there (or
    a file where llmtrain writes into a directory) was a traceback."""
    path = victim.out / name
    directory = name in safefs.OUTPUT_DIRS
    if planted == "pipe":
        os.mkfifo(path)
    elif directory:
        path.write_text("a file")
    else:
        path.mkdir()
    with pytest.raises(LinkError) as e:
        safefs.check_output_dir(victim.out)
    what = "a named pipe" if planted == "pipe" else "a regular file" if directory else "a directory"
    assert str(e.value) == (
        f"output_dir: {path} is {what}, where llmtrain writes {'a directory' if directory else 'a file'}; remove it "
        "or choose another output_dir"
    )


def test_a_pipe_planted_after_the_check_is_an_oserror_not_a_wait(victim):
    """As a full disk is: metrics.jsonl's writer warns and training goes on."""
    os.mkfifo(victim.out / "metrics.jsonl")
    with pytest.raises(OSError) as e:
        safefs.open_write(victim.out / "metrics.jsonl", append=True)
    assert not isinstance(e.value, LinkError)


def test_output_dir_itself_may_be_a_link(victim, tmp_path):
    (tmp_path / "alias").symlink_to(victim.out)
    safefs.check_output_dir(tmp_path / "alias")


def test_run_files_are_never_written_through_a_link(victim):
    """Past the start-up check (a link planted while the run goes on), each writer refuses
    rather than follows: the lock, config.yaml, run.json, metrics.jsonl, loss.png."""
    from llmtrain.config import Config
    from llmtrain.observe.metrics import MetricsLog, describe_run, plot_losses
    from llmtrain.output import rundir

    def planted(name):
        path = victim.out / name
        path.unlink(missing_ok=True)
        path.symlink_to(victim.file)
        return path

    planted(rundir.LOCK_FILE)
    with pytest.raises(LinkError, match=r"\.llmtrain\.lock is a symbolic link"):
        rundir.lock(str(victim.out), OneProcess())
    cfg = Config(output_dir=str(victim.out))
    accelerator = SimpleNamespace(
        is_main_process=True, num_processes=1, distributed_type=SimpleNamespace(value="NO"), mixed_precision="no"
    )
    for name in ("config.yaml", "run.json"):
        planted(name)
        if name == "run.json":
            (victim.out / "config.yaml").unlink()
        with pytest.raises(LinkError, match=rf"{name} is a symbolic link"):
            describe_run(cfg, accelerator, None)
    planted("metrics.jsonl")
    with pytest.raises(LinkError, match=r"metrics\.jsonl is a symbolic link"):
        MetricsLog(OneProcess(), str(victim.out), resume_step=None)
    (victim.out / "metrics.jsonl").unlink()
    log = MetricsLog(OneProcess(), str(victim.out), resume_step=None)
    log.log({"step": 1, "loss": 1.0})
    planted("metrics.jsonl")
    with pytest.raises(LinkError):
        log.log({"step": 2, "loss": 1.0})
    (victim.out / "metrics.jsonl").unlink()
    (victim.out / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')
    planted("loss.png")
    with pytest.raises(LinkError):
        plot_losses(victim.out / "metrics.jsonl", victim.out / "loss.png")
    untouched(victim)


def test_checkpoint_directories_replace_links_instead_of_writing_through_them(victim):
    """A link left where a checkpoint's temporary directory goes is removed, not written
    into or emptied; pruning a step-N that is a link removes the link, not its target."""
    from llmtrain.core.state import TrainState
    from llmtrain.output.checkpoint import clean_leftovers, remove, save

    root = victim.out / "checkpoints"
    root.mkdir()
    (root / ".tmp-step-4").symlink_to(victim.dir)
    path = save(OneProcess(), str(victim.out), TrainState(step=4), {}, "", keep_last=0)
    assert path.is_dir() and not path.is_symlink() and (path / "model.safetensors").is_file()
    (root / "step-9").symlink_to(victim.dir)
    remove(root / "step-9")
    (root / ".deleting-step-5").symlink_to(victim.dir)
    (root / ".old-step-6").symlink_to(victim.dir)
    clean_leftovers(victim.out)
    assert sorted(p.name for p in root.iterdir()) == ["step-4"]
    untouched(victim)


def test_temporary_files_and_directories_are_never_links(victim):
    """The reference cache's temporary file is made exclusively and renamed over a link at
    its name; the export's and profiler's directories are made afresh; the demo's rows
    refuse a link."""
    from llmtrain.demo import write_jsonl
    from llmtrain.preference.reference import CACHE, save_cached

    (victim.out / f".tmp-{CACHE}").symlink_to(victim.file)
    (victim.out / CACHE).symlink_to(victim.file)
    save_cached(victim.out / CACHE, "key", torch.zeros(2, 2))
    assert not (victim.out / CACHE).is_symlink()
    assert torch.load(victim.out / CACHE, weights_only=True)["key"] == "key"
    (victim.out / ".tmp-final").symlink_to(victim.dir)
    safefs.fresh_dir(victim.out / ".tmp-final")
    assert (victim.out / ".tmp-final").is_dir() and not (victim.out / ".tmp-final").is_symlink()
    (victim.out / "profile").symlink_to(victim.dir)
    with pytest.raises(LinkError):
        safefs.make_dir(victim.out / "profile")
    (victim.out / "train.jsonl").symlink_to(victim.file)
    with pytest.raises(LinkError, match=r"^LLMTRAIN_CACHE: .*train\.jsonl is a symbolic link"):
        write_jsonl([{"a": 1}], victim.out / "train.jsonl")
    untouched(victim)


def test_directories_libraries_write_into_are_private_until_complete(tmp_path):
    """Under a group-writable umask a group member could plant links inside a checkpoint's
    or the export's directory while save_state or save_pretrained write into it: it is
    0700 until it is published, then gets the umask's mode."""
    import os
    import stat

    from llmtrain import safefs
    from llmtrain.output.checkpoint import publish

    old = os.umask(0o002)
    try:
        safefs.fresh_dir(tmp_path / ".tmp-step-2")
        assert stat.S_IMODE((tmp_path / ".tmp-step-2").stat().st_mode) == 0o700
        publish(tmp_path / ".tmp-step-2", tmp_path / "step-2")
        assert stat.S_IMODE((tmp_path / "step-2").stat().st_mode) == 0o775
    finally:
        os.umask(old)


class SavesWeights(OneProcess):
    def save_state(self, path):
        from safetensors.torch import save_file

        save_file({"w": torch.ones(2)}, Path(path) / "w.safetensors")


def test_every_file_a_run_writes_follows_the_umask(tmp_path):
    """Under umask 002 (an output_dir shared with a group) every file a run's own writers
    leave is 0664 and every directory 0775: the lock, config.yaml, run.json, metrics.jsonl
    (rewritten whole through a temporary file on resume), loss.png, a checkpoint whose
    weights safetensors writes (0600 on its own) and the reference log-probs' cache (a
    recipe's whole output_dir: tests/launch/test_rundir.py)."""
    import stat

    from llmtrain.config import Config
    from llmtrain.core.state import TrainState
    from llmtrain.observe.metrics import MetricsLog, describe_run, plot_losses
    from llmtrain.output import checkpoint, rundir
    from llmtrain.preference.reference import CACHE, save_cached

    out = tmp_path / "out"
    out.mkdir()
    old = os.umask(0o002)
    try:
        rundir.lock(str(out), OneProcess())
        accelerator = SimpleNamespace(
            is_main_process=True, num_processes=1, distributed_type=SimpleNamespace(value="NO"), mixed_precision="no"
        )
        describe_run(Config(output_dir=str(out)), accelerator, None)
        log = MetricsLog(OneProcess(), str(out), resume_step=None)
        log.log({"step": 1, "loss": 1.0})
        MetricsLog(OneProcess(), str(out), resume_step=1)  # a resume rewrites it whole
        pytest.importorskip("matplotlib")
        plot_losses(out / "metrics.jsonl", out / "loss.png")
        checkpoint.save(SavesWeights(), str(out), TrainState(step=1), {}, "{}\n", keep_last=0)
        save_cached(out / CACHE, "key", torch.zeros(2, 2))
    finally:
        os.umask(old)
    modes = {str(p.relative_to(out)): stat.S_IMODE(p.stat().st_mode) for p in out.rglob("*")}
    assert "metrics.jsonl" in modes and "checkpoints/step-1/w.safetensors" in modes
    assert {name: mode for name, mode in modes.items() if mode != (0o775 if (out / name).is_dir() else 0o664)} == {}


# --- caches -----------------------------------------------------------------------------


@pytest.fixture
def env(monkeypatch, tmp_path):
    for var in ("HF_DATASETS_CACHE", "HF_HOME", "XDG_CACHE_HOME", "LLMTRAIN_CACHE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "a_file").write_text("")
    return SimpleNamespace(set=monkeypatch.setenv, file=tmp_path / "a_file", tmp=tmp_path)


def test_usable_caches_pass(env):
    safefs.check_caches(uses_demo=True)  # HOME does not exist yet: its parent is writable
    env.set("HF_DATASETS_CACHE", str(env.tmp / "datasets"))
    env.set("LLMTRAIN_CACHE", str(env.tmp / "llmtrain"))
    safefs.check_caches(uses_demo=True)


@pytest.mark.parametrize(
    "var, value, demo, line",
    [
        ("HF_DATASETS_CACHE", "{file}", False, "HF_DATASETS_CACHE: {file} is not a directory; set HF_DATASETS_CACHE"),
        ("HF_DATASETS_CACHE", "{file}/sub", False, "HF_DATASETS_CACHE: {file}/sub cannot be made ({file} is not a"),
        ("HF_HOME", "{file}", False, "HF_HOME: {file} is not a directory; set HF_HOME to a directory"),
        (
            "HOME",
            "{file}",
            False,
            "HOME: {file}/.cache/huggingface/datasets cannot be made ({file} is not a directory)",
        ),
        ("LLMTRAIN_CACHE", "{file}", True, "LLMTRAIN_CACHE: {file} is not a directory; set LLMTRAIN_CACHE"),
    ],
)
def test_an_unusable_cache_is_one_line_naming_its_variable(env, var, value, demo, line):
    env.set(var, value.format(file=env.file))
    with pytest.raises(CacheError) as e:
        safefs.check_caches(uses_demo=demo)
    assert str(e.value).startswith(line.format(file=env.file)), str(e.value)
    assert "\n" not in str(e.value)


def test_the_demo_cache_is_checked_only_for_demo_names(env):
    env.set("LLMTRAIN_CACHE", str(env.file))
    safefs.check_caches(uses_demo=False)


@pytest.mark.skipif(
    not Path("/proc/self").is_dir() or not Path("/sys/kernel").is_dir(), reason="Linux's /proc and /sys"
)
@pytest.mark.parametrize(
    "var, value, line",
    [
        (
            "HF_DATASETS_CACHE",
            "/proc/llmtrain-cache",
            "HF_DATASETS_CACHE: /proc/llmtrain-cache cannot be made (/proc is",
        ),
        ("HF_DATASETS_CACHE", "/sys/kernel", "HF_DATASETS_CACHE: /sys/kernel is not writable; set HF_DATASETS_CACHE"),
        ("HF_HOME", "/sys/kernel/llmtrain", "HF_HOME: /sys/kernel/llmtrain/datasets cannot be made (/sys/kernel is"),
        ("XDG_CACHE_HOME", "/sys", "XDG_CACHE_HOME: /sys/huggingface/datasets cannot be made (/sys is not writable)"),
        ("HOME", "/proc", "HOME: /proc/.cache/huggingface/datasets cannot be made (/proc is not writable)"),
        ("LLMTRAIN_CACHE", "/proc/llmtrain", "LLMTRAIN_CACHE: /proc/llmtrain cannot be made (/proc is not writable)"),
    ],
)
def test_a_cache_under_proc_or_sys_is_one_line_even_for_root(env, var, value, line):
    """Permission bits do not bind root, but /proc and /sys take no new files whoever asks:
    the check writes for real (and leaves nothing behind)."""
    env.set(var, value)
    with pytest.raises(CacheError) as e:
        safefs.check_caches(uses_demo=True)
    assert str(e.value).startswith(line), str(e.value)
    assert "\n" not in str(e.value)


def test_the_cache_check_leaves_nothing_behind(env):
    for name in ("datasets", "llmtrain"):
        (env.tmp / name).mkdir()
    env.set("HF_DATASETS_CACHE", str(env.tmp / "datasets"))
    env.set("LLMTRAIN_CACHE", str(env.tmp / "llmtrain" / "missing"))
    safefs.check_caches(uses_demo=True)
    assert [p for p in env.tmp.rglob("*") if p.name.startswith(".llmtrain")] == []
    assert not (env.tmp / "llmtrain" / "missing").exists()
