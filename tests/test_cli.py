"""User errors are reported once per job: by the main process, and by another process
only when the error was its alone; no process exits before the main one has reported. A
run's settings come from the demo only for a run of the demo (`run_config`)."""

import itertools
from pathlib import Path
from types import SimpleNamespace

import pytest

from llmtrain import cli
from llmtrain.cli import TRAINED_KEYS, is_demo, names, parse_args, run_config
from llmtrain.config import load_config
from llmtrain.config.load import read_config, set_values
from llmtrain.config.validate import named
from llmtrain.errors import ConfigError, DataError
from llmtrain.methods import METHODS, demo_config, sections
from llmtrain.plan import recipe_named
from tests.support.configs import own_required
from tests.support.runs import ROOT, free_port


class Store:
    def __init__(self):
        self.keys = {}

    def set(self, key, value):
        self.keys[key] = value

    def check(self, keys):
        return all(k in self.keys for k in keys)


@pytest.fixture
def store(monkeypatch):
    s = Store()
    monkeypatch.setattr(cli, "default_store", lambda: s)
    monkeypatch.setattr(cli, "REPORT_WAIT_S", 0.2)
    return s


def state(rank: int, world: int = 2):
    return SimpleNamespace(num_processes=world, is_main_process=rank == 0)


def test_the_main_process_reports_and_says_so(store, capsys):
    cli.report_once(DataError("data.train: a.jsonl line 3: bad\nsecond problem"), state(0))
    assert capsys.readouterr().err == "error: data.train: a.jsonl line 3: bad\nerror: second problem\n"
    assert store.check(["llmtrain/error-reported/0"])


def test_another_process_stays_silent_once_the_main_one_has_reported(store, capsys):
    store.set("llmtrain/error-reported/0", "1")
    cli.report_once(DataError("data.train: bad"), state(1))
    assert capsys.readouterr().err == ""


def test_an_error_of_another_process_alone_is_reported_by_it(store, capsys):
    cli.report_once(DataError("data.train: bad"), state(1))  # the main process never reports
    assert capsys.readouterr().err == "error: data.train: bad\n"


def test_one_process_reports_without_a_store(capsys):
    with pytest.raises(SystemExit) as exited, cli.user_errors(state(0, world=1)):
        raise DataError("data.train: bad")
    assert exited.value.code == 2 and capsys.readouterr().err == "error: data.train: bad\n"


ENDING = """
import atexit, sys
from pathlib import Path
from llmtrain.cli import run_cli

out = Path(sys.argv[1])


class Finalized:  # its __del__ runs only if the interpreter tears itself down
    def __init__(self, path):
        self.path, self.open = path, open  # builtins are gone by then

    def __del__(self):
        self.open(self.path, "w").close()


def main(argv):
    global rank, keep
    import torch.distributed as dist

    rank = dist.get_rank()
    keep = Finalized(str(out / f"finalized-{rank}"))
    atexit.register(lambda: (out / f"atexit-{rank}").write_text(""))
    print(f"rank {rank} done", end="")  # unflushed
    if argv[0] != "0":
        sys.exit(int(argv[0]))


run_cli(main, sys.argv[2:])
"""


@pytest.mark.parametrize("code", [0, 3])
def test_a_multi_process_run_ends_with_its_code_without_interpreter_teardown(tmp_path, code):
    """After the run, a gloo worker thread may still free a collective's Python tensors;
    during interpreter teardown that aborts the process (see cli.exit_now). So a
    multi-process run exits right after its atexit handlers, with its own code."""
    import subprocess
    import sys

    script = tmp_path / "ending.py"
    script.write_text(ENDING)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port())]
    # The launcher ends the other workers once it sees one fail; polling every 3 s rather than
    # every 0.1 s leaves rank 1, exiting with the same code, the time to finish on a busy machine.
    cmd += ["--monitor_interval", "3"]
    env = {k: v for k, v in __import__("os").environ.items() if k != "ACCELERATE_USE_CPU"}
    env["ACCELERATE_USE_CPU"] = "1"
    proc = subprocess.run(
        [*cmd, str(script), str(tmp_path), str(code)], capture_output=True, text=True, timeout=120, cwd=ROOT, env=env
    )
    assert (proc.returncode == 0) == (code == 0), proc.stderr[-3000:]
    if code:
        assert f"exitcode  : {code}" in proc.stderr
    assert "rank 0 done" in proc.stdout and "rank 1 done" in proc.stdout
    made = sorted(p.name for p in tmp_path.iterdir() if p.name != "ending.py")
    assert made == ["atexit-0", "atexit-1"]


LEAVING = """
import os, sys, time
from llmtrain.cli import run_cli


def main(argv):
    import torch.distributed as dist

    if dist.get_rank() == 1:
        time.sleep(0.5)
        print("rank 1 ends", flush=True)
        os._exit(5)  # as a crash or a kill would end it
    dist.broadcast_object_list([None], src=1)


run_cli(main, sys.argv[1:])
"""


def test_a_process_whose_peer_left_says_so_in_one_line(tmp_path):
    """Rank 0 waits in a collective on rank 1, which dies: gloo's error is no fault of rank
    0's, and its traceback would bury what rank 1 printed. One line points there."""
    import os
    import subprocess
    import sys

    script = tmp_path / "leaving.py"
    script.write_text(LEAVING)
    # torchrun stops the other ranks once it sees one gone: checking every 5 s rather than
    # every 0.1 s leaves rank 0 the time to meet the error and say so on a loaded machine.
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port())]
    cmd += ["--monitor-interval", "5"]
    env = dict(os.environ, ACCELERATE_USE_CPU="1")
    proc = subprocess.run([*cmd, str(script)], capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    assert proc.returncode != 0 and "rank 1 ends" in proc.stdout
    assert "error: rank 0: another process left the job (gloo: Connection closed by peer); its own output says why" in (
        proc.stderr
    ), proc.stderr[-3000:]
    assert "[rank0]: Traceback" not in proc.stderr


def test_processes_that_formed_no_group_report_on_rank_0_alone(monkeypatch, capsys):
    """Launched as 2 processes without a process group, each is a world of one: rank 0
    reports; rank 1 waits, silent, for the launcher to stop it."""
    import signal

    from llmtrain.distributed.stop import GRACEFUL

    monkeypatch.setattr(cli, "REPORT_WAIT_S", 0.2)
    monkeypatch.setenv("WORLD_SIZE", "2")
    saved = {sig: signal.getsignal(sig) for sig in GRACEFUL}  # rank 1 hands them back to the default action
    try:
        for rank, printed in (("0", "error: launch: no group\n"), ("1", "")):
            monkeypatch.setenv("RANK", rank)
            with pytest.raises(SystemExit) as exited, cli.user_errors(state(0, world=1)):
                raise DataError("launch: no group")
            assert exited.value.code == 2 and capsys.readouterr().err == printed
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def test_a_signal_while_a_finished_one_process_run_exits_is_ignored(tmp_path):
    """A second Ctrl-C just after final/ was saved interrupted the atexit handlers
    ('Exception ignored in atexit callback ... KeyboardInterrupt'), exit 130."""
    import subprocess
    import sys

    script = (
        "import atexit, os, signal\n"
        "from llmtrain.cli import run_cli\n"
        "from llmtrain.distributed.stop import StopRequest\n"
        "def main(argv):\n"
        "    StopRequest().install()\n"
        "    atexit.register(lambda: (os.kill(os.getpid(), signal.SIGINT), print('flushed', flush=True)))\n"
        "run_cli(main, [])\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout == "flushed\n", proc.stderr
    assert "Exception ignored" not in proc.stderr and "stopped on" not in proc.stderr


FINETUNE = METHODS["finetune"]
DEMO = demo_config(FINETUNE)


@pytest.mark.parametrize(
    ("argv", "problems"),
    [
        (
            ["--learning_rate", "1e-5", "train.max_steps=3"],
            ["--learning_rate: not an option; settings are dotted overrides: train.lr=1e-5"],
        ),
        (
            ["train.max_steps=3", "--learning_rate=1e-5"],
            ["--learning_rate: not an option; settings are dotted overrides: train.lr=1e-5"],
        ),
        (
            ["--per_device_train_batch_size", "8", "--gradient_accumulation_steps", "4"],
            [
                "--per_device_train_batch_size: not an option; settings are dotted overrides: train.micro_batch_size=8",
                "--gradient_accumulation_steps: not an option; settings are dotted overrides: train.grad_accum_steps=4",
            ],
        ),
        (
            ["--warmup_ratio", "0.03"],
            [
                "--warmup_ratio: not an option; settings are dotted overrides: train.warmup_steps=<steps> (a number of "
                "steps, not a share of the run: 0.03 of 1000 steps is train.warmup_steps=30)"
            ],
        ),
        (
            ["--bf16"],
            [
                "--bf16: not an option; it is set at launch: accelerate launch --mixed_precision bf16 ... (model.dtype "
                "is the dtype the weights load in)"
            ],
        ),
        (["--seed", "3"], ["--seed: not an option; settings are dotted overrides: train.seed=3"]),
        (["--max_steps", "-1"], ["--max_steps: not an option; settings are dotted overrides: train.max_steps=-1"]),
        (
            ["--gradient_checkpointing"],
            [
                "--gradient_checkpointing: not an option; settings are dotted overrides: "
                "model.gradient_checkpointing=true"
            ],
        ),
        (["--output_dir", "runs/x"], ["--output_dir: not an option; settings are dotted overrides: output_dir=runs/x"]),
        (
            ["--conifg", "c.yaml"],
            [
                "--conifg: not an option; did you mean --config? Settings are dotted overrides, key.sub=value (python "
                "-m llmtrain.config lists them)"
            ],
        ),
    ],
)
def test_options_users_bring_from_transformers_are_one_line_each(argv, problems):
    """argparse would print its usage and 'unrecognized arguments: --learning_rate'."""
    with pytest.raises(ConfigError) as e:
        cli.parse_args(argv, FINETUNE, DEMO)
    assert e.value.problems == problems


def test_a_restartable_job_refuses_a_resume_it_cannot_keep(tmp_path):
    """--restartable (recipes/slurm/job.sh): each start of the job runs the same command,
    and a restart must continue from the job's own checkpoints, which none would refuse."""
    base = ["model.name_or_path=m", "data.train=d.jsonl"]
    with pytest.raises(ConfigError, match="checkpoint.resume: none cannot hold in a job that restarts itself"):
        cli.parse_args(["--restartable", *base, "checkpoint.resume=none"], FINETUNE, None)
    path = tmp_path / "c.yaml"
    path.write_text("checkpoint:\n  resume: none\n")
    with pytest.raises(ConfigError, match="checkpoint.resume: none cannot hold"):
        cli.parse_args(["--config", str(path), *base, "--restartable"], FINETUNE, None)
    cfg, args = cli.parse_args(["--restartable", *base], FINETUNE, None)
    assert args.restartable and cfg.checkpoint.resume == "auto"
    assert cli.parse_args([*base, "checkpoint.resume=none"], FINETUNE, None)[0].checkpoint.resume == "none"


def test_workers_that_torchrun_restarts_refuse_a_resume_they_cannot_keep(monkeypatch):
    """`accelerate launch --max_restarts N` restarts the workers with the same command (torchrun
    gives each TORCHELASTIC_MAX_RESTARTS): resume=none is refused at the first start, naming
    the launch, not at the first restart as if another run had written the job's checkpoints."""
    base = ["model.name_or_path=m", "data.train=d.jsonl", "checkpoint.resume=none"]
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "0")
    assert cli.parse_args(base, FINETUNE, None)[0].checkpoint.resume == "none"
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "3")
    with pytest.raises(ConfigError, match=r"itself \(accelerate launch --max_restarts 3: a worker restart must"):
        cli.parse_args(base, FINETUNE, None)
    assert cli.parse_args(base[:-1], FINETUNE, None)[0].checkpoint.resume == "auto"


# --- Where a run's settings come from (cli.run_config; docs/config.md) ---------------------

MINE = {"model.name_or_path": "org/my-model", "data.train": "mine.jsonl", "data.eval": "mine-eval.jsonl"}
# Every shipped demo config (its model or training data is a `demo:` name) and its recipe.
DEMO_CONFIGS = [
    (path, recipe_named(path, []))
    for path in sorted((ROOT / "recipes" / "configs").glob("*.yaml"))
    if any(is_demo(n) for key in TRAINED_KEYS for n in names(set_values(read_config(path)).get(key)))
]


def settings(name: str, config: Path | None, overrides: list[str]):
    """(config, notes) of a run of recipe `name` with this --config (or none) and overrides."""
    notes: list[str] = []
    method = METHODS[name]
    return run_config(config, overrides, method, demo_config(method), sections(), notes.append), notes


def demo_names(cfg) -> set[str]:
    return {name for _, name in named(cfg) if is_demo(name)}


def test_the_shipped_demo_configs_are_found():
    assert {p.name for p, _ in DEMO_CONFIGS} == {
        "agent_demo.yaml",
        "agent_sft_demo.yaml",
        "demo.yaml",
        "distill_demo.yaml",
        "dpo_demo.yaml",
        "grpo_demo.yaml",
        "kto_demo.yaml",
        "orpo_demo.yaml",
        "reward_demo.yaml",
        "vision_demo.yaml",
    }
    assert {m.demo for m in METHODS.values()} <= {p.name for p, _ in DEMO_CONFIGS}


@pytest.mark.parametrize("name", METHODS)
def test_without_config_the_demo_applies_only_while_nothing_names_a_model_or_data(name, monkeypatch):
    """Nothing named, or only `demo:` names: the demo config, without a note. A model or data
    set of the user's: the defaults, as from an empty YAML, in runs/<recipe>, with one note
    naming both configs to start from; a required key left out is its usual one line."""
    monkeypatch.chdir(ROOT)
    method, demo = METHODS[name], demo_config(METHODS[name])
    cfg, notes = settings(name, None, ["train.lr=0.5"])
    assert cfg == load_config(demo, ["train.lr=0.5"], method.schema, sections()) and notes == []
    cfg, notes = settings(name, None, ["model.name_or_path=demo:tiny-llama", "data.eval=[]", "eval.every_steps=0"])
    assert (
        cfg.model.name_or_path == "demo:tiny-llama"
        and cfg.output_dir == load_config(demo, schema=method.schema).output_dir
    )
    assert notes == []
    for n in range(1, len(MINE) + 1):
        for keys in itertools.combinations(MINE, n):
            given = [f"{key}={MINE[key]}" for key in keys]
            missing = [key for key in ("model.name_or_path", "data.train", *own_required(method)) if key not in keys]
            notes = []
            try:
                cfg = run_config(None, given, method, demo, sections(), notes.append)
            except ConfigError as e:
                assert missing and [q.split(":")[0] for q in e.problems] == missing, (keys, e.problems)
                assert all(q.endswith(": required") or ": required; " in q for q in e.problems)
            else:
                assert not missing
                empty = load_config(None, [f"output_dir=runs/{name}", *given], method.schema, sections())
                assert cfg == empty and not demo_names(cfg) and cfg.output_dir == f"runs/{name}"
            assert notes == [
                f"note: the command line names a model or data of your own ({', '.join(keys)}) and no --config, so "
                "the demo's settings do not apply: the run starts from the defaults (docs/config.md), writing to "
                f"runs/{name}; --config recipes/configs/{method.template} starts from a config for your own "
                f"model, --config recipes/configs/{method.demo} from the demo's settings"
            ]
    own = [f"{key}={value}" for key, value in own_required(method).items()]
    cfg, notes = settings(name, None, ["model.name_or_path=m", "data.train=d.jsonl", "output_dir=mine", *own])
    assert cfg.output_dir == "mine" and ", writing to" not in notes[0]


@pytest.mark.parametrize("name", METHODS)
def test_a_demo_config_brings_no_demo_name_nor_output_dir_to_a_run_of_your_own(name, monkeypatch):
    """Whatever the command line names, a run whose model or training data is the user's
    keeps no `demo:` name the recipe's demo config brought, nor its output_dir; names written
    on the command line are the user's and stay. Every combination, for every recipe."""
    monkeypatch.chdir(ROOT)
    path = demo_config(METHODS[name])
    written = set_values(read_config(path))
    choices = {
        "model.name_or_path": [None, "org/my-model", "demo:tiny-llama"],
        "data.train": [None, "[demo:train, mine.jsonl]"],
        "data.eval": [None, "demo:eval"],
        "output_dir": [None, "runs/mine"],
    }
    for key, value in written.items():  # a demo model of the method's own (distill.teacher)
        if key not in choices and any(is_demo(n) for n in names(value)):
            choices[key] = [None, "org/other"]
    runs = 0
    for values in itertools.product(*choices.values()):
        given = [f"{key}={v}" for key, v in zip(choices, values) if v is not None]
        on_line = {v for v in values if v} | ({"demo:train"} if "[demo:train" in str(values[1]) else set())
        try:
            cfg, _ = settings(name, path, given)
        except ConfigError as e:
            refused = tuple(f"{key}:" for key in choices)
            assert all(q.startswith(refused) and "is the demo's" in q for q in e.problems), (given, e.problems)
            continue
        own = [n for key, n in named(cfg) if key in TRAINED_KEYS and not is_demo(n)]
        if own:
            runs += 1
            assert demo_names(cfg) <= on_line, (given, demo_names(cfg))
            assert cfg.output_dir == "runs/mine", given
        else:  # the demo, perhaps varied: as the file says where the command line is silent
            assert cfg.output_dir == (values[3] or written.get("output_dir", f"runs/{path.stem}"))
        assert cfg.data.eval  # nothing dropped silently
    assert runs == 2  # the user's data (and model), the demo's eval data written out, an output_dir


@pytest.mark.parametrize("path, name", DEMO_CONFIGS, ids=lambda x: getattr(x, "name", x))
def test_what_a_demo_config_brings_is_refused_in_one_line_each_and_its_settings_noted(path, name, monkeypatch):
    """Each shipped demo config given to a run of the user's: one line per `demo:` name it
    brings and for its output_dir, each naming the key, the file and the fix; one note listing
    every other setting it brings, and the recipe's config to start from instead."""
    monkeypatch.chdir(ROOT)
    written = set_values(read_config(path))
    where = f"recipes/configs/{path.name}"
    mine = ["model.name_or_path=org/m", "data.train=mine.jsonl"]
    with pytest.raises(ConfigError) as e:
        settings(name, path, mine)
    own_run = "in a run of your own model or data"
    off = " eval.every_steps=0" if written.get("eval.every_steps") else ""
    # A demo model of the method's own (distill.teacher: required, so no empty value offered).
    shared = ("model.name_or_path", "data.train", "data.eval")
    brought = [k for k, v in written.items() if k not in shared and any(is_demo(n) for n in names(v))]
    own_lines = [f"{k}: {written[k]} is the demo's, from {where}, {own_run}; set {k}=<your model>" for k in brought]
    assert e.value.problems == [
        f"data.eval: {written['data.eval']} is the demo's, from {where}, {own_run}; set data.eval=<your file> or "
        f"data.eval=[]{off}",
        *own_lines,
        f"output_dir: {written['output_dir']} is the demo's, from {where}, {own_run}; name your own: "
        "output_dir=runs/<name>",
    ]
    with pytest.raises(ConfigError) as e:  # the demo's model, with data of the user's
        settings(name, path, ["data.train=mine.jsonl", "data.eval=mine-eval.jsonl", "output_dir=runs/x"])
    model = written["model.name_or_path"]
    assert e.value.problems == [
        f"model.name_or_path: {model} is the demo's, from {where}, {own_run}; set model.name_or_path=<your model>",
        *own_lines,
    ]
    given = [*mine, f"data.eval={written['data.eval']}", "output_dir=runs/x", "train.lr=1e-5"]
    given += [f"{k}=org/other" for k in brought]
    cfg, notes = settings(name, path, given)  # the demo's eval data, written on the command line: kept
    assert cfg.data.eval == written["data.eval"] and cfg.train.lr == 1e-5 and len(notes) == 1
    kept = {"model.name_or_path", "data.train", "data.eval", "output_dir", "train.lr", *brought}
    tuned = [key for key in written if key not in kept]
    assert notes[0].startswith(f"note: {where} is a demo config, tuned for the demo's tiny model; this run of your")
    listed = notes[0].split("takes these settings from it: ", 1)[1]
    assert [key for key in written if f"{key}=" in listed] == tuned
    template = METHODS[name].template
    assert notes[0].endswith(f"; override those that do not suit yours, or start from recipes/configs/{template}")


@pytest.mark.parametrize("name", METHODS)
def test_the_recipes_command_line_reads_its_settings_by_the_rule(name, capsys, monkeypatch):
    """parse_args, as recipes/<name>.py calls it: the demo's data never reaches a run of the
    user's model, and the note is printed."""
    monkeypatch.chdir(ROOT)
    method = METHODS[name]
    given = ["model.name_or_path=m", "data.train=d.jsonl", *(f"{k}={v}" for k, v in own_required(method).items())]
    cfg, args = parse_args(given, method, demo_config(method), sections())
    assert not demo_names(cfg) and args.config is None and cfg.output_dir == f"runs/{name}"
    out = capsys.readouterr().out
    assert out.startswith("note: the command line names a model or data of your own") and out.count("\n") == 1
    cfg, _ = parse_args([], method, demo_config(method), sections())
    assert cfg == load_config(demo_config(method), [], method.schema, sections())
    assert capsys.readouterr().out == ""


def test_without_config_a_missing_demo_asks_for_one(tmp_path):
    method = METHODS["dpo"]
    with pytest.raises(ConfigError) as e:
        run_config(None, ["train.lr=1e-5"], method, tmp_path / "dpo_demo.yaml", sections())
    assert e.value.problems == [
        f"--config: required; the demo's {tmp_path / 'dpo_demo.yaml'} is not here, so give your YAML"
    ]
    with pytest.raises(ConfigError) as e:
        run_config(None, [], method, None, sections())
    assert e.value.problems == ["--config: required; dpo has no demo, so give your YAML"]
    cfg = run_config(None, ["model.name_or_path=m", "data.train=d.jsonl"], method, None, sections(), print)
    assert cfg.output_dir == "runs/dpo"  # no demo to speak of: no note


@pytest.mark.parametrize("code", [0, 2])
def test_a_one_process_run_exits_though_a_thread_it_started_never_ends(code):
    """A thread that is no daemon (a reward function's) kept the process alive after final/,
    with the stop signals ignored: only SIGKILL ended it. Python waits THREAD_WAIT_S for it,
    then the run exits with its own code, naming the thread, after its atexit handlers."""
    import subprocess
    import sys

    script = (
        "import atexit, sys, threading, time\n"
        "from llmtrain import cli\n"
        "from llmtrain.errors import DataError\n"
        "cli.THREAD_WAIT_S = 0.5\n"
        "def main(argv):\n"
        "    threading.Thread(target=time.sleep, args=(600,), name='poller').start()\n"
        "    atexit.register(lambda: print('atexit ran', flush=True))\n"
        f"    if {code}:\n"
        "        raise DataError('data.train: bad')\n"
        "cli.run_cli(main, [])\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert proc.returncode == code and proc.stdout == "atexit ran\n", proc.stderr
    assert "warning: thread(s) 'poller' still running 0.5 s after the run was over" in proc.stderr
