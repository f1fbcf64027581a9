"""Path keys: every key the schema marks as a path (config/validate.PathKey), in Config's
sections and every method's own, gets `~` and $VARS expanded by one rule, is checked as a
path, and names a model or data set where it is an asset (the demo's names resolve there).
The keys are found by walking the schema, so a method's new path key is covered without a
word here."""

import dataclasses
import re
import typing

import pytest

from llmtrain.config import load_config
from llmtrain.config.load import absolute_paths
from llmtrain.config.validate import PathKey, named, path_kind, path_values
from llmtrain.errors import ConfigError
from llmtrain.methods import METHODS, sections
from tests.support.configs import own_required

TREES = {m.name: m.schema for m in METHODS.values()}
TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


def schema_paths(cls, prefix: str = "") -> list[tuple[str, PathKey, bool]]:
    """(dotted key, PathKey, whether the key takes a list) of every path key of a tree,
    read from its annotations (not from an instance)."""
    found = []
    hints = typing.get_type_hints(cls, include_extras=True)
    for f in dataclasses.fields(cls):
        tp = typing.get_type_hints(cls)[f.name]
        if dataclasses.is_dataclass(tp):
            found += schema_paths(tp, f"{prefix}{f.name}.")
        elif (kind := path_kind(hints[f.name])) is not None:
            found.append((f"{prefix}{f.name}", kind, "list" in str(tp)))
    return found


def required(name: str) -> list[str]:
    own = [f"{key}={value}" for key, value in own_required(METHODS[name]).items()]
    return ["model.name_or_path=m", "data.train=d.jsonl", *own] + (["grpo.beta=0.1"] if name == "grpo" else [])


def test_the_schema_marks_the_path_keys_of_every_tree():
    """The walk finds the keys users give paths in, each method's included."""
    keys = {key for tree in TREES.values() for key, _, _ in schema_paths(tree)}
    assert {
        "output_dir",
        "model.name_or_path",
        "data.train",
        "data.eval",
        "data.chat_template",
        "checkpoint.resume",
        "dpo.reference",
        "grpo.reference",
        "grpo.rewards",
    } <= keys


def test_every_string_key_whose_docstring_says_path_is_marked():
    """A guard for keys added later: a text key documented as a path or directory carries a
    PathKey (or it would take `~` and $VARS literally)."""
    from llmtrain.config.schema import field_docs

    marked = {key for tree in TREES.values() for key, _, _ in schema_paths(tree)}
    unmarked = []
    for key, default, doc in field_docs(list(TREES.values())):
        if default.startswith(('"', "[")) and re.search(r"\b(paths?|director(y|ies)|DIR)\b", doc):
            unmarked += [key] if key not in marked else []
    assert not unmarked, f"string keys documented as paths without a PathKey: {unmarked}"


@pytest.mark.parametrize("name", sorted(TREES))
def test_every_path_key_expands_home_and_variables(name, tmp_path, monkeypatch):
    home = tmp_path / "home"
    (home / "p").mkdir(parents=True)
    (home / "p" / "t.jinja").write_text(TEMPLATE)  # data.chat_template must be a readable template
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("LLMTRAIN_TEST_ROOT", str(home))
    for key, kind, many in schema_paths(TREES[name]):
        for given in ("~/p/t.jinja", "$LLMTRAIN_TEST_ROOT/p/t.jinja", "${LLMTRAIN_TEST_ROOT}/p/t.jinja"):
            value = f"reward_model:{given}" if kind.parts else given
            override = f"{key}=['{value}']" if many else f"{key}={value}"  # quoted: YAML reads { as a mapping
            cfg = load_config(None, [*required(name), override], TREES[name], sections())
            got = [v for k, v, _ in path_values(cfg) if k == key]
            want = str(home / "p" / "t.jinja")
            assert got == [f"reward_model:{want}" if kind.parts else want], (key, given, got)


def test_a_path_in_a_name_expands_each_part():
    """grpo.rewards: reward_model:DIR and path/to/file.py:function, each path part alike;
    built-ins and module:function names are left as they are."""
    import os

    home = os.path.expanduser("~")
    cfg = load_config(
        None, [*required("grpo"), "grpo.rewards=[accuracy, ~/r.py:short, mod:fn, reward_model:~/rm]"], TREES["grpo"]
    )
    assert cfg.grpo.rewards == ["accuracy", f"{home}/r.py:short", "mod:fn", f"reward_model:{home}/rm"]


@pytest.mark.parametrize("name", sorted(TREES))
def test_an_unset_variable_in_any_path_key_is_one_problem_naming_it(name):
    for key, _, many in schema_paths(TREES[name]):
        value = "$LLMTRAIN_NOT_SET_ANYWHERE/x"
        with pytest.raises(ConfigError) as e:
            load_config(None, [*required(name), f"{key}=[{value}]" if many else f"{key}={value}"], TREES[name])
        assert any(p.startswith(f"{key}: ") and "$LLMTRAIN_NOT_SET_ANYWHERE" in p for p in e.value.problems), key


def test_every_asset_key_is_named_and_takes_the_demos_names():
    """named() (the demo's names, the demo-name check) reads every asset key of any tree, a
    {path, fraction} data.train entry's too."""
    cfg = load_config(
        None,
        [
            "model.name_or_path=demo:tiny-llama",
            "data.train=[demo:train, {path: demo:pairs-train, fraction: 0.5}]",
            "data.eval=demo:eval",
            "dpo.reference=demo:tiny-llama-sft",
        ],
        TREES["dpo"],
    )
    assert named(cfg) == [
        ("model.name_or_path", "demo:tiny-llama"),
        ("data.train", "demo:train"),
        ("data.train", "demo:pairs-train"),
        ("data.eval", "demo:eval"),
        ("dpo.reference", "demo:tiny-llama-sft"),
    ]
    with pytest.raises(ConfigError, match=r"grpo.reference: demo:tiny-lama is not one of the demo's assets; did you"):
        load_config(None, [*required("grpo"), "grpo.reference=demo:tiny-lama"], TREES["grpo"])


def test_a_name_no_filesystem_takes_is_refused_in_any_path_key():
    for key, _, many in schema_paths(TREES["grpo"]):
        value = "x" * 5000
        with pytest.raises(ConfigError) as e:
            load_config(None, [*required("grpo"), f"{key}=[{value}]" if many else f"{key}={value}"], TREES["grpo"])
        assert any(p.startswith(f"{key}: a name of 5000 characters") for p in e.value.problems), key


def test_tilde_is_expanded_in_every_path_key_from_yaml_and_overrides(monkeypatch, tmp_path):
    from llmtrain.config import load_config
    from llmtrain.preference.config import DPOConfig

    home = tmp_path / "home"
    (home / "t").mkdir(parents=True)
    (home / "t" / "chat.jinja").write_text("{{ messages }}")
    monkeypatch.setenv("HOME", str(home))
    config = tmp_path / "c.yaml"
    config.write_text(
        "output_dir: ~/runs/x\n"
        "model: {name_or_path: ~/models/m}\n"
        "data: {train: [~/a.jsonl, {path: ~/b.jsonl, fraction: 0.5}], eval: ~/e.jsonl, chat_template: ~/t/chat.jinja}\n"
        "checkpoint: {resume: ~/runs/old/checkpoints/step-2}\n"
        "dpo: {reference: ~/models/ref}\n"
    )
    cfg = load_config(config, [], DPOConfig)
    assert cfg.output_dir == f"{home}/runs/x"
    assert cfg.model.name_or_path == f"{home}/models/m"
    assert cfg.data.train[0] == f"{home}/a.jsonl" and cfg.data.train[1].path == f"{home}/b.jsonl"
    assert cfg.data.eval == [f"{home}/e.jsonl"] or cfg.data.eval == f"{home}/e.jsonl"
    assert cfg.data.chat_template == f"{home}/t/chat.jinja"
    assert cfg.checkpoint.resume == f"{home}/runs/old/checkpoints/step-2"
    assert cfg.dpo.reference == f"{home}/models/ref"
    cfg = load_config(None, ["output_dir=~/runs/y", "data.train=~/c.jsonl", "model.name_or_path=owner/name"])
    assert cfg.output_dir == f"{home}/runs/y" and cfg.data.train in (f"{home}/c.jsonl", [f"{home}/c.jsonl"])
    assert cfg.model.name_or_path == "owner/name"  # a hub name is left alone


def test_environment_variables_are_expanded_in_path_keys_and_an_unset_one_is_an_error(monkeypatch, tmp_path):
    from llmtrain.config import load_config
    from llmtrain.errors import ConfigError
    from llmtrain.preference.config import DPOConfig

    monkeypatch.setenv("SCRATCH", str(tmp_path / "scratch"))
    monkeypatch.setenv("RUN", "r1")
    monkeypatch.delenv("NOPE", raising=False)
    config = tmp_path / "c.yaml"
    config.write_text(
        "output_dir: $SCRATCH/runs/${RUN}-x\n"
        "model: {name_or_path: $SCRATCH/m}\n"
        "data:\n"
        "  train:\n"
        "    - $SCRATCH/a.jsonl\n"
        "    - {path: '${SCRATCH}/b.jsonl', fraction: 0.5}\n"
        "  chat_template: \"{{ '$RUN' }}\"\n"
        "dpo: {reference: $SCRATCH/ref}\n"
    )
    cfg = load_config(config, [], DPOConfig)
    assert cfg.output_dir == f"{tmp_path}/scratch/runs/r1-x" and cfg.model.name_or_path == f"{tmp_path}/scratch/m"
    scratch = tmp_path / "scratch"
    assert cfg.data.train[0] == f"{scratch}/a.jsonl" and cfg.data.train[1].path == f"{scratch}/b.jsonl"
    assert cfg.dpo.reference == f"{tmp_path}/scratch/ref"
    assert cfg.data.chat_template == "{{ '$RUN' }}"  # inline template text is not a path
    with pytest.raises(ConfigError) as e:
        load_config(None, ["output_dir=$NOPE/runs/x", "data.train=${NOPE}/c.jsonl", "model.name_or_path=m"])
    assert str(e.value).splitlines() == [
        "output_dir: '$NOPE/runs/x' names the environment variable $NOPE, which is not set; export it before "
        "launching, or write the path out",
        "data.train: '${NOPE}/c.jsonl' names the environment variable $NOPE, which is not set; export it before "
        "launching, or write the path out",
    ]


def test_local_paths_are_absolute_so_that_a_later_change_of_directory_moves_nothing(tmp_path, monkeypatch):
    """User code the run imports or calls may change the working directory (a reward
    function's os.chdir, from a thread too): every local path is made absolute before it runs, so
    checkpoints, final/ and the files read stay where the command meant. output_dir and a
    checkpoint.resume path always; others where they name an existing file or directory. A
    hub or demo name, a missing file (its error names it as given), template text and a
    reward module's name stay as written."""
    from llmtrain.rl.config import GRPOConfig

    for name in ("data/a.jsonl", "data/b.jsonl", "chat.jinja", "r.py", "models/m/config.json", "rm/config.json"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("{}")
    monkeypatch.chdir(tmp_path)
    overrides = [
        "output_dir=runs/x",
        "model.name_or_path=models/m",
        "data.train=[data/a.jsonl,{path: data/b.jsonl, fraction: 0.5}]",
        "data.eval=missing.jsonl",
        "data.chat_template=chat.jinja",
        "checkpoint.resume=runs/old/checkpoints/step-2",
        "grpo.rewards=[accuracy,r.py:fn,my_module:fn,reward_model:./rm,reward_model:owner/rm]",
    ]
    cfg = load_config(None, overrides, GRPOConfig)
    absolute_paths(cfg)  # as recipe.run does, before any user code
    assert cfg.output_dir == f"{tmp_path}/runs/x" and cfg.model.name_or_path == f"{tmp_path}/models/m"
    assert cfg.data.train[0] == f"{tmp_path}/data/a.jsonl" and cfg.data.train[1].path == f"{tmp_path}/data/b.jsonl"
    assert cfg.data.eval in ("missing.jsonl", ["missing.jsonl"]) and cfg.data.chat_template == f"{tmp_path}/chat.jinja"
    assert cfg.checkpoint.resume == f"{tmp_path}/runs/old/checkpoints/step-2"
    assert cfg.grpo.rewards == ["accuracy", f"{tmp_path}/r.py:fn", "my_module:fn", f"reward_model:{tmp_path}/rm"] + [
        "reward_model:owner/rm"
    ]
    cfg = load_config(
        None, ["model.name_or_path=owner/name", "data.train=demo:train", f"data.chat_template={TEMPLATE}"]
    )
    absolute_paths(cfg)
    assert cfg.model.name_or_path == "owner/name" and cfg.data.train in ("demo:train", ["demo:train"])
    assert cfg.data.chat_template == TEMPLATE and cfg.checkpoint.resume == "auto"
