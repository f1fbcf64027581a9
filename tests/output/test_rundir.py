"""One run per output directory, and no finished work lost on a rerun: the settings that
changed since a checkpoint, a rerun of a finished run, a torn or hand-edited metrics file on
resume, and the checks that refuse another run's data, recipe or checkpoint, or a fresh
start over a finished run. The recipe launched against a run directory (the lock, a rerun
that fails, going back to a checkpoint, the free-space check): tests/launch/test_rundir.py."""

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from llmtrain.config import load_config
from llmtrain.errors import CheckpointError
from llmtrain.observe.metrics import MetricsLog, plot_losses
from llmtrain.output.checkpoint import STATE_FILE
from llmtrain.output.rundir import changed_settings, check_same_run, identity
from tests.support.runs import metrics, run_recipe, snapshot


def test_changed_settings_name_what_alters_the_run():
    before = load_config(None, ["model.name_or_path=m", "data.train=[a.jsonl]"])
    after = load_config(
        None,
        [
            "model.name_or_path=m",
            "data.train=[a.jsonl,b.jsonl]",
            "train.lr=1e-4",
            "log.progress_bar=false",
            "checkpoint.keep_last=5",
            "output_dir=elsewhere",
        ],
    )
    from llmtrain.config import to_yaml

    assert changed_settings(to_yaml(before), after) == [
        "data.train: ['a.jsonl'] -> ['a.jsonl', 'b.jsonl']",
        "train.lr: 2e-05 -> 0.0001",
    ]  # how it reports, checkpoints or where it writes do not change the run


def test_a_relative_path_saved_before_paths_were_absolute_is_the_same_setting(tmp_path, monkeypatch):
    """A run saved before the recipe made paths absolute recorded them as given: rerun from
    the same directory, it is the same run, not one with changed data."""
    from llmtrain.config import to_yaml
    from llmtrain.config.load import absolute_paths

    (tmp_path / "a.jsonl").write_text("{}")
    monkeypatch.chdir(tmp_path)
    now = load_config(None, ["model.name_or_path=m", "data.train=[a.jsonl]"])
    absolute_paths(now)
    assert now.data.train == [str(tmp_path / "a.jsonl")]
    saved = to_yaml(now).replace(str(tmp_path / "a.jsonl"), "a.jsonl")
    assert changed_settings(saved, now) == []
    assert changed_settings(saved.replace("a.jsonl", "b.jsonl"), now) == [
        f"data.train: ['b.jsonl'] -> ['{tmp_path}/a.jsonl']"
    ]


def test_a_metrics_line_cut_short_by_a_kill_does_not_stop_a_resume(tmp_path):
    rows = [{"step": 1, "loss": 2.0}, {"step": 2, "loss": 1.5}, {"step": 3, "loss": 1.2}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 4, "lo')
    accelerator = SimpleNamespace(is_main_process=True, num_processes=1, log=lambda *a, **k: None)
    MetricsLog(accelerator, str(tmp_path), resume_step=3)
    assert metrics(tmp_path) == rows


def test_a_resume_that_cannot_rewrite_the_metrics_keeps_them(tmp_path, monkeypatch):
    """The kept rows are written into a new file renamed over the old: a write that fails (a
    file size limit, a full disk) or a kill leaves every row, where the file was truncated
    first and a resume then lost the rows it could not write back."""
    import errno

    from llmtrain.errors import CheckpointError

    rows = [{"step": s, "loss": 2.0 - s / 10} for s in range(1, 6)]
    text = "".join(json.dumps(r) + "\n" for r in rows)
    (tmp_path / "metrics.jsonl").write_text(text)
    real = Path.write_text

    def full(self, data, *args, **kwargs):
        real(self, data[:10], *args, **kwargs)
        raise OSError(errno.EFBIG, "File too large")

    monkeypatch.setattr(Path, "write_text", full)
    accelerator = SimpleNamespace(is_main_process=True, num_processes=1, log=lambda *a, **k: None)
    with pytest.raises(CheckpointError) as e:
        MetricsLog(accelerator, str(tmp_path), resume_step=3)
    assert str(e.value).startswith(f"output_dir: cannot write {tmp_path / 'metrics.jsonl'} (File too large); the rows")
    monkeypatch.undo()
    assert (tmp_path / "metrics.jsonl").read_text() == text
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.jsonl"]  # no temporary file left


def test_hand_edited_metrics_lines_do_not_stop_a_resume(tmp_path, capsys):
    """A step that is not a number is not a row (dropped, with one warning); another field
    that is not a number stays, and the loss curve leaves it out."""
    rows = [{"step": 1, "loss": 2.0}, {"step": 2, "loss": "abc"}, {"step": 3, "loss": 1.2}]
    lines = [json.dumps(r) for r in rows] + ['{"step": "abc", "loss": 1.0}', "[1, 2]", json.dumps({"step": 4})]
    (tmp_path / "metrics.jsonl").write_bytes("\n".join(lines).encode() + b"\n\xff\xfe\n")
    accelerator = SimpleNamespace(is_main_process=True, num_processes=1, log=lambda *a, **k: None)
    MetricsLog(accelerator, str(tmp_path), resume_step=3)
    assert metrics(tmp_path) == rows
    assert capsys.readouterr().err == (
        f"warning: {tmp_path / 'metrics.jsonl'}: 3 line(s) are not a metrics row (a JSON object with a numeric "
        "step; first at line 4), dropped on resume\n"
    )
    pytest.importorskip("matplotlib")
    assert plot_losses(tmp_path / "metrics.jsonl", tmp_path / "loss.png")


def recorded_checkpoint(out: Path, run: dict) -> Path:
    """A checkpoint directory whose train_state.json records `run` (only what
    check_same_run reads)."""
    path = out / "checkpoints" / "step-2"
    path.mkdir(parents=True)
    (path / STATE_FILE).write_text(json.dumps({"step": 2, "run": run}))
    return path


def test_a_resume_on_changed_data_or_by_another_recipe_is_refused(tmp_path):
    """The training file replaced by one of the same size and mtime (`cp -p`): the
    checkpoint's position would read other rows. A checkpoint of another recipe holds its
    optimizer and schedule. A checkpoint written before runs were recorded passes."""
    data = tmp_path / "train.jsonl"
    data.write_text('{"text": "first"}\n')
    cfg = load_config(None, ["model.name_or_path=m", f"data.train=[{data}, owner/hub]", f"output_dir={tmp_path}"])
    saved = identity("finetune", cfg)
    checkpoint = recorded_checkpoint(tmp_path / "out", saved)
    check_same_run(str(tmp_path / "out"), identity("finetune", cfg), checkpoint)  # the same run

    stat = data.stat()
    data.write_text('{"text": "fir5t"}\n')
    os.utime(data, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    with pytest.raises(CheckpointError) as e:
        check_same_run(str(tmp_path / "out"), identity("finetune", cfg), checkpoint)
    assert str(e.value) == (
        f"output_dir: {checkpoint} was trained on other content of {data} (the file changed since, same path): "
        "its position and weights are from the old rows; restore the file, or choose another output_dir to train "
        "on the new one"
    )
    with pytest.raises(CheckpointError, match=r"was trained by the finetune recipe, not dpo: its optimizer"):
        check_same_run(str(tmp_path / "out"), saved | {"recipe": "dpo"}, checkpoint)
    # Another directory's checkpoint (checkpoint.resume=<path>): the key and the fix are that setting's.
    with pytest.raises(CheckpointError) as e:
        check_same_run(str(tmp_path / "new"), saved | {"recipe": "dpo"}, checkpoint)
    assert str(e.value).startswith(f"checkpoint.resume: {checkpoint} was trained by the finetune recipe, not dpo")
    assert "resume from a checkpoint of a dpo run instead" in str(e.value)
    (checkpoint / STATE_FILE).write_text(json.dumps({"step": 2}))  # an older llmtrain's
    check_same_run(str(tmp_path / "out"), identity("dpo", cfg), checkpoint)


def test_a_rerun_of_a_finished_run_says_so_and_changes_nothing(finished_run, cache_env):
    out, args = finished_run
    before = snapshot(out)
    proc = run_recipe(args + ["log.progress_bar=true"], cache_env)  # a setting that does not alter the run
    assert f"{out} already finished at step 4 with these settings; final/ is up to date" in proc.stdout
    assert snapshot(out) == before
    (out / "loss.png").unlink()  # the run was stopped after final/, before its plot
    run_recipe(args, cache_env)
    assert (out / "loss.png").is_file()
    assert snapshot(out) == before


def test_a_final_dir_whose_state_cannot_be_read_still_holds_a_finished_run(tmp_path):
    from llmtrain.errors import CheckpointError
    from llmtrain.output.rundir import already_finished, check_rerun, finished_state

    cfg = SimpleNamespace(output_dir=str(tmp_path))
    assert finished_state(str(tmp_path)) is None  # no final/: nothing finished here
    (tmp_path / "final").mkdir()
    for text in ("oops", "[]", '{"step": "4"}', '{"step": true}'):
        (tmp_path / "final" / "train_state.json").write_text(text)
        assert finished_state(str(tmp_path)) == {"step": None}
        assert already_finished(cfg, 1) is None  # unknown: not called up to date
        with pytest.raises(CheckpointError) as e:
            check_rerun(cfg, None, 1)  # a fresh start would overwrite it
        assert str(e.value).startswith(
            f"output_dir: {tmp_path} holds a finished run (final/ whose train_state.json cannot be read)"
        )


def test_a_finished_run_on_another_process_count_is_another_run_when_its_global_batch_differs(tmp_path):
    """The config does not hold the process count: final/ records it, with the global batch.
    Without a checkpoint to resume from, a rerun that changes the global batch is refused as
    a fresh start over a finished run would be, saying what changed."""
    from llmtrain.config import load_config, to_yaml
    from llmtrain.errors import CheckpointError
    from llmtrain.output.checkpoint import STATE_FILE, position_settings
    from llmtrain.output.rundir import already_finished, check_rerun, up_to_date

    given = [f"output_dir={tmp_path}", "model.name_or_path=m", "data.train=d.jsonl", "train.micro_batch_size=4"]
    cfg = load_config(None, [*given, "train.grad_accum_steps=2"])
    (tmp_path / "final").mkdir()
    (tmp_path / "final" / "llmtrain_config.yaml").write_text(to_yaml(cfg))
    (tmp_path / "final" / STATE_FILE).write_text(json.dumps({"step": 9, "settings": position_settings(cfg, 1)}))
    assert already_finished(cfg, 1) == 9 and up_to_date(cfg, 9, 9, 1)
    assert already_finished(cfg, 2) is None
    with pytest.raises(CheckpointError) as e:
        check_rerun(cfg, None, 2)
    assert str(e.value).startswith(
        f"output_dir: {tmp_path} holds a finished run (final/ exported at step 9) with other settings "
        "(processes: 1 -> 2 (global batch 8 -> 16)), and no checkpoint"
    )
    halved = load_config(None, [*given, "train.grad_accum_steps=1"])
    assert already_finished(halved, 2) is None  # the same global batch, but a config change (a re-split)
    (tmp_path / "final" / STATE_FILE).write_text(json.dumps({"step": 9}))  # exported before final/ recorded it
    assert already_finished(cfg, 2) == 9


def test_another_runs_checkpoint_is_resumed_only_into_a_directory_without_a_run(tmp_path):
    from llmtrain.errors import CheckpointError
    from llmtrain.output.rundir import check_rerun

    other = tmp_path / "other" / "checkpoints" / "step-2"
    other.mkdir(parents=True)
    new, own = tmp_path / "new", tmp_path / "own"
    new.mkdir()
    (own / "checkpoints" / "step-4").mkdir(parents=True)
    (own / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n')
    check_rerun(SimpleNamespace(output_dir=str(new)), other, 1)  # an empty directory: fine
    check_rerun(SimpleNamespace(output_dir=str(own)), own / "checkpoints" / "step-4", 1)  # its own checkpoint
    for holds in ("metrics.jsonl", "final"):
        target = tmp_path / f"with-{holds}"
        target.mkdir()
        (target / holds).mkdir() if holds == "final" else (target / holds).write_text("{}\n")
        with pytest.raises(CheckpointError) as e:
            check_rerun(SimpleNamespace(output_dir=str(target)), other, 1)
        assert str(e.value) == (
            f"output_dir: {target} holds another run, and resuming {other} into it would mix the two runs' "
            "metrics, checkpoints and final/; resume it into a new output_dir"
        )


def test_a_saved_config_that_cannot_be_read_is_reported_as_such():
    cfg = load_config(None, ["model.name_or_path=m", "data.train=a.jsonl"])
    for saved in ("", "train: [", "- a list"):
        assert changed_settings(saved, cfg) == ["(the saved config cannot be read, so changes are not known)"]


def test_keep_finished_takes_a_free_name_and_leaves_a_re_export_alone(tmp_path, capsys):
    from llmtrain.config import to_yaml
    from llmtrain.output.checkpoint import STATE_FILE, position_settings
    from llmtrain.output.rundir import keep_finished

    accelerator = SimpleNamespace(is_main_process=True, num_processes=1, wait_for_everyone=lambda: None)
    given = [f"output_dir={tmp_path}", "model.name_or_path=m", "data.train=d.jsonl"]
    cfg = load_config(None, given)
    final = tmp_path / "final"

    def finish(config, state: str) -> None:
        final.mkdir()
        (final / "llmtrain_config.yaml").write_text(to_yaml(config))
        (final / STATE_FILE).write_text(state)

    finish(cfg, json.dumps({"step": 9, "settings": position_settings(cfg, 1)}))
    assert keep_finished(load_config(None, [*given, "export.max_shard_size=1GB"]), accelerator) is None  # a re-export
    assert keep_finished(load_config(None, [*given, "train.lr=1e-6"]), accelerator) == tmp_path / "final-step-9"
    assert "(train.lr: 2e-05 -> 1e-06); it is kept as final-step-9/" in capsys.readouterr().err
    finish(cfg, "oops")
    (tmp_path / "final-earlier").mkdir()
    assert keep_finished(cfg, accelerator) == tmp_path / "final-earlier-2"
    assert "(its train_state.json cannot be read); it is kept as final-earlier-2/" in capsys.readouterr().err
    assert not final.exists()


# --- the files a run depends on ------------------------------------------------------------


@pytest.fixture
def inputs(tmp_path):
    """A local model directory, a chat template, a reward function and an eval file: the
    files a config names beside its training data."""
    for model in (tmp_path / "model", tmp_path / "other"):  # the base, and another (a reference, a reward model)
        model.mkdir()
        for name, text in (("config.json", '{"a": 1}'), ("tokenizer.json", "{}"), ("model.safetensors", "w" * 64)):
            (model / name).write_text(text)
    (tmp_path / "chat.jinja").write_text("{{ messages[0]['content'] }}")
    (tmp_path / "score.py").write_text("def score(completions, **kw):\n    return [1.0 for _ in completions]\n")
    (tmp_path / "eval.jsonl").write_text('{"text": "held out"}\n')
    (tmp_path / "train.jsonl").write_text('{"text": "train"}\n')
    return tmp_path


def finish(out: Path, cfg, recipe: str, step: int = 9) -> None:
    """final/ as a run of `recipe` with `cfg` leaves it: its config, and its state with the
    run's record."""
    from llmtrain.config import to_yaml
    from llmtrain.output.checkpoint import position_settings

    (out / "final").mkdir(parents=True)
    (out / "final" / "llmtrain_config.yaml").write_text(to_yaml(cfg))
    state = {"step": step, "settings": position_settings(cfg, 1), "run": identity(recipe, cfg)}
    (out / "final" / STATE_FILE).write_text(json.dumps(state))


def rewrite(path: Path, text: str, keep_time: bool = False) -> None:
    """New content at `path`; with keep_time, under its old modification time (cp -p)."""
    stat = path.stat()
    path.write_text(text)
    if keep_time:
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    else:
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))


GRPO_GIVEN = ["grpo.beta=0.1", "grpo.reference={d}/other"]


@pytest.mark.parametrize(
    "recipe, given, change, line",
    [
        # The base model retrained into the same directory: weights, tokenizer, config.
        (
            "finetune",
            [],
            ("model/model.safetensors", "v" * 64),
            "model.name_or_path: {d}/model changed (model.safetensors)",
        ),
        (
            "finetune",
            [],
            ("model/tokenizer.json", '{"x": 1}'),
            "model.name_or_path: {d}/model changed (tokenizer.json)",
        ),
        ("finetune", [], ("model/new.json", "{}"), "model.name_or_path: {d}/model changed (new.json)"),
        (
            "finetune",
            ["data.chat_template={d}/chat.jinja"],
            ("chat.jinja", "{{ messages[1]['content'] }}"),
            "data.chat_template: {d}/chat.jinja changed",
        ),
        (
            "finetune",
            ["data.eval={d}/eval.jsonl"],
            ("eval.jsonl", '{"text": "held 0ut"}\n'),
            "data.eval: {d}/eval.jsonl changed",
        ),
        (
            "grpo",
            ["grpo.rewards=[{d}/score.py:score]"],
            ("score.py", "def score(completions, **kw):\n    return []\n"),
            "grpo.rewards: {d}/score.py changed",
        ),
        (
            "grpo",
            ["grpo.rewards=[reward_model:{d}/other]"],
            ("other/config.json", '{"a": 2}'),
            "grpo.rewards: {d}/other changed (config.json)",
        ),
        ("grpo", GRPO_GIVEN, ("other/config.json", '{"a": 2}'), "grpo.reference: {d}/other changed (config.json)"),
        (
            "dpo",
            ["dpo.reference={d}/other"],
            ("other/config.json", '{"a": 2}'),
            "dpo.reference: {d}/other changed (config.json)",
        ),
    ],
)
def test_a_finished_run_whose_files_changed_is_not_up_to_date(inputs, recipe, given, change, line):
    """Everything the config names that decides what a run trains is part of its record:
    a file that changed since final/ (even under its old size and time, as `cp -p` leaves
    it) is a change of the setting that names it, as a new value would be: not 'already
    finished', a fresh start over final/ refused naming it. The same files unchanged are
    the same run."""
    from llmtrain.methods import METHODS
    from llmtrain.output.rundir import already_finished, check_rerun, final_changes

    d, out = inputs, inputs / "out"
    base = [f"output_dir={out}", f"model.name_or_path={d}/model", f"data.train={d}/train.jsonl"]
    overrides = base + [g.format(d=d) for g in given]
    cfg = load_config(None, overrides, schema=METHODS[recipe].schema)
    finish(out, cfg, recipe)
    assert already_finished(cfg, 1) == 9  # nothing changed: up to date
    name, text = change
    rewrite(d / name, text, keep_time=True) if (d / name).exists() else (d / name).write_text(text)
    assert final_changes(cfg, 1, {"step": 9, **json.loads((out / "final" / STATE_FILE).read_text())}) == [
        line.format(d=d)
    ]
    assert already_finished(cfg, 1) is None
    with pytest.raises(CheckpointError, match=r"holds a finished run .* with other settings \(" + r".*changed"):
        check_rerun(cfg, None, 1)


def test_a_large_file_is_known_by_its_size_and_time(inputs, monkeypatch):
    """Weights of tens of GB are not read at every start: a file above files.HASHED_BYTES is
    known by its size and modification time (a model retrained into the directory writes
    it anew), a smaller one by its content."""
    from llmtrain import files
    from llmtrain.output.rundir import already_finished

    monkeypatch.setattr(files, "HASHED_BYTES", 16)
    d, out = inputs, inputs / "out"
    cfg = load_config(None, [f"output_dir={out}", f"model.name_or_path={d}/model", f"data.train={d}/train.jsonl"])
    finish(out, cfg, "finetune")
    rewrite(d / "model" / "model.safetensors", "v" * 64, keep_time=True)  # 64 bytes: not read
    assert already_finished(cfg, 1) == 9
    rewrite(d / "model" / "model.safetensors", "v" * 64)  # written anew
    assert already_finished(cfg, 1) is None


REWARD_CODE = {
    "score.py": "import json\nfrom helpers import scale\nimport lib.util\n\ndef score(completions, **kw):\n"
    "    return [scale(1.0) for _ in completions]\n",
    "helpers.py": "from lib import util\n\ndef scale(x):\n    return 2 * x\n",
    "lib/__init__.py": "from .inner import *\n",
    "lib/util.py": "from . import shared\n",
    "lib/inner.py": "X = 1\n",
    "lib/shared.py": "Y = 1\n",
    "json.py": "# the standard library's json is what `import json` gives\n",
    "unused.py": "# imported by nothing\n",
}


@pytest.mark.parametrize("spec", ["{d}/score.py:score", "score:score"])
def test_the_modules_a_reward_function_imports_are_part_of_the_run(tmp_path, monkeypatch, spec):
    """A reward file's own modules (helpers beside it, a package of the user's, relative
    imports within it), read from its imports, are part of the run: editing any of them
    is a change of grpo.rewards, given as a path or as a module of the working directory.
    A file that the import finds elsewhere first (json.py: the standard library's) and a
    file nothing imports are not."""
    from llmtrain.methods import METHODS
    from llmtrain.output.rundir import already_finished, final_changes

    d, out = tmp_path, tmp_path / "out"
    (d / "lib").mkdir()
    for name, text in REWARD_CODE.items():
        (d / name).write_text(text)
    (d / "train.jsonl").write_text('{"prompt": "p", "answer": "1"}\n')
    monkeypatch.chdir(d)
    overrides = [f"output_dir={out}", "model.name_or_path=gpt2", f"data.train={d}/train.jsonl"]
    cfg = load_config(None, [*overrides, f"grpo.rewards=[{spec.format(d=d)}]"], schema=METHODS["grpo"].schema)
    finish(out, cfg, "grpo")
    record = {"step": 9, **json.loads((out / "final" / STATE_FILE).read_text())}
    for name in ("json.py", "unused.py"):
        rewrite(d / name, "# changed\n", keep_time=True)
        assert already_finished(cfg, 1) == 9, name
    for name in ("score.py", "helpers.py", "lib/__init__.py", "lib/util.py", "lib/inner.py", "lib/shared.py"):
        was = (d / name).read_text()
        rewrite(d / name, was + "# changed\n", keep_time=True)
        assert final_changes(cfg, 1, record) == [f"grpo.rewards: {d / name} changed"], name
        rewrite(d / name, was)
        assert already_finished(cfg, 1) == 9, name


def test_a_resume_after_a_file_changed_names_it(inputs, capsys):
    """A checkpoint written before the reward function changed: the run goes on with the
    new one, as with any other changed setting, saying so."""
    from llmtrain.config import to_yaml
    from llmtrain.methods import METHODS
    from llmtrain.output.rundir import warn_changes

    d = inputs
    cfg = load_config(
        None,
        [f"model.name_or_path={d}/model", f"data.train={d}/train.jsonl", f"grpo.rewards=[{d}/score.py:score]"],
        schema=METHODS["grpo"].schema,
    )
    checkpoint = recorded_checkpoint(d / "out", identity("grpo", cfg))
    (checkpoint / "config.yaml").write_text(to_yaml(cfg))
    warn_changes(checkpoint, cfg)
    assert capsys.readouterr().err == ""
    rewrite(d / "score.py", "def score(completions, **kw):\n    return [0.0 for _ in completions]\n")
    warn_changes(checkpoint, cfg)
    assert f"the run goes on with the new ones: grpo.rewards: {d}/score.py changed" in (capsys.readouterr().err)


def test_hub_names_and_settings_that_do_not_alter_the_run_are_not_fingerprinted(inputs):
    cfg = load_config(
        None, ["model.name_or_path=owner/model", f"data.train={inputs}/train.jsonl", f"output_dir={inputs}"]
    )
    assert identity("finetune", cfg)["inputs"] == {}  # output_dir is where it writes, not what it reads
