import pytest

from llmtrain.config import Config, load_config
from llmtrain.config.load import overridden, parse_override, read_config, set_values
from llmtrain.errors import ConfigError
from llmtrain.methods import METHODS, sections
from llmtrain.preference.config import DPOConfig, RewardConfig
from llmtrain.rl.config import GRPOConfig
from tests.support.runs import ROOT, run_recipe

SHIPPED = sorted((ROOT / "recipes" / "configs").glob("*.yaml"))


def test_there_are_shipped_configs():
    assert len(SHIPPED) >= 3


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_every_shipped_config_loads(path):
    """Each loads into its recipe's tree: recipes/dpo.py's configs have a dpo section,
    recipes/grpo.py's a grpo section, recipes/reward.py's a reward section."""
    import yaml

    text = path.read_text()
    assert text.startswith("#"), "each shipped YAML opens with the command that uses it"
    raw = yaml.safe_load(text)
    trees = [(m.section, m.schema) for m in METHODS.values() if m.section]
    recipe, schema = next(((r, s) for r, s in trees if r in raw), ("", Config))
    header = "".join(line for line in text.splitlines() if line.startswith("#"))
    for name, _ in trees:
        assert (f"recipes/{name}.py" in header) == (recipe == name), "the opening comment names the recipe"
    cfg = load_config(path, schema=schema)
    assert type(cfg) is schema


@pytest.mark.parametrize("name", METHODS)
def test_each_recipe_ships_a_config_for_your_own_model_and_data(name):
    """The config a recipe's note points a run of your own model to (Method.template): shipped
    beside the demo's, for that recipe, and no demo config (it trains no `demo:` name)."""
    method = METHODS[name]
    path = ROOT / "recipes" / "configs" / method.template
    assert path.is_file() and path.name != method.demo
    written = set_values(read_config(path))
    assert not any(str(v).startswith("demo:") for v in written.values())
    assert type(load_config(path, schema=method.schema, sections=sections())) is method.schema


def test_the_keys_an_override_sets_are_its_leaves():
    """Where a setting came from (cli.run_config) reads these: a mapping for a section sets
    its keys one by one, a list is one value, a later override wins."""
    assert overridden(["train={lr: 0.5, epochs: 2}", "data.train=[a.jsonl, {path: b.jsonl, fraction: 0.5}]"]) == {
        "train.lr": 0.5,
        "train.epochs": 2,
        "data.train": ["a.jsonl", {"path": "b.jsonl", "fraction": 0.5}],
    }
    assert overridden(["train.lr=1", "train={lr: 2}", "data={}"]) == {"train.lr": 2, "data": {}}
    assert set_values({"model": {"name_or_path": "m", "lora": {"r": 4}}, "output_dir": "x"}) == {
        "model.name_or_path": "m",
        "model.lora.r": 4,
        "output_dir": "x",
    }


def test_overrides_are_typed():
    cfg = load_config(
        ROOT / "recipes/configs/demo.yaml",
        ["train.lr=2e-5", "data.packing=false", "data.train=[a.jsonl,b.parquet]", "train.max_steps=7"],
    )
    assert cfg.train.lr == 2e-5 and isinstance(cfg.train.lr, float)
    assert cfg.data.packing is False
    assert cfg.data.train == ["a.jsonl", "b.parquet"]
    assert cfg.train.max_steps == 7


def test_unknown_key_names_the_closest_valid_one():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["model.name_or_path=x", "data.train=a.jsonl", "train.lrr=1e-4"])
    assert "train.lrr: unknown key; did you mean 'train.lr'?" in str(e.value)


def test_a_key_outside_its_section_names_the_section_it_belongs_to():
    """Flat keys as other tools write them (lr, seed), or a key in the wrong section."""
    with pytest.raises(ConfigError) as e:
        load_config(None, ["model.name_or_path=x", "data.train=a.jsonl", "lr=1e-4", "train.max_seq_len=64"])
    assert e.value.problems == [
        "lr: unknown key; did you mean 'train.lr'? (each key goes in its section)",
        "train.max_seq_len: unknown key; did you mean 'data.max_seq_len'? (each key goes in its section)",
    ]


def test_a_section_given_a_value_is_one_problem_not_its_keys_missing_too():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["model=llama", "data.train=a.jsonl"])
    assert e.value.problems == ["model: is a section; set its keys (e.g. model.<key>=value), got 'llama'"]


def test_unknown_section_and_nested_key(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model:\n  name_or_path: x\n  lora:\n    rank: 8\ndata:\n  train: a.jsonl\ntrian:\n  lr: 1\n")
    with pytest.raises(ConfigError) as e:
        load_config(path)
    text = str(e.value)
    assert "model.lora.rank: unknown key; did you mean 'model.lora.r'?" in text
    assert "trian: unknown key; did you mean 'train'?" in text


def test_all_problems_reported_at_once():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["train.micro_batch_size=abc", "train.lr=-1", "data.overlong=cut", "data.max_seq_len=0"])
    problems = e.value.problems
    keys = [p.split(":")[0] for p in problems]
    for key in [
        "train.micro_batch_size",
        "train.lr",
        "data.overlong",
        "data.max_seq_len",
        "model.name_or_path",
        "data.train",
    ]:
        assert key in keys, problems
    assert any("expected an integer" in p for p in problems)
    assert any("one of 'truncate', 'drop', 'error'" in p for p in problems)


def test_a_stream_needs_max_steps():
    with pytest.raises(ConfigError) as e:
        load_config(
            None, ["model.name_or_path=m", "data.train=d.jsonl", "data.streaming=true", "data.shuffle_buffer=0"]
        )
    assert e.value.problems == [
        "data.streaming: a stream's length is not known ahead; set train.max_steps",
        "data.shuffle_buffer: must be at least 1, got 0",
    ]
    load_config(None, ["model.name_or_path=m", "data.train=d.jsonl", "data.streaming=true", "train.max_steps=5"])


def test_bool_is_not_an_int_and_string_is_not_a_bool():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["model.name_or_path=x", "data.train=a", "train.epochs=true", "data.packing=yes please"])
    assert {p.split(":")[0] for p in e.value.problems} == {"train.epochs", "data.packing"}


def test_override_syntax_error():
    with pytest.raises(ConfigError, match="key.sub=value"):
        parse_override("train.lr")


def test_invalid_yaml_names_file_and_line(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("train:\n  lr: 1\n  epochs: [1\n")
    with pytest.raises(ConfigError, match=r"bad.yaml:\d+: invalid YAML"):
        load_config(path)


def test_recipe_reports_config_errors_before_loading_anything(cache_env, tmp_path):
    proc = run_recipe(
        [
            f"output_dir={tmp_path}/out",
            "train.lrr=1",
            "model.name_or_path=/nonexistent",
            "data.train=/nonexistent.jsonl",
        ],
        cache_env,
        check=False,
    )
    assert proc.returncode == 2
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert errors == ["error: train.lrr: unknown key; did you mean 'train.lr'?"]
    assert not (tmp_path / "out").exists()


def test_batch_arithmetic_is_one_set_of_methods():
    """What the recipe, `llmtrain plan` and the DeepSpeed config use for steps and batches."""
    from llmtrain.config import TrainConfig

    t = TrainConfig(micro_batch_size=2, grad_accum_steps=2)
    assert t.global_batch(2) == 8
    assert t.steps_per_epoch(20, 2) == 3  # 10 micro-batches, 5 per process: steps of 2, 2 and 1
    assert t.steps_per_epoch(18, 2) == 3  # 9 micro-batches: 5 and 4, the last step on one process only
    assert t.steps_per_epoch(16, 2) == 2
    assert t.total_steps(3) == 3 and TrainConfig(epochs=2).total_steps(3) == 6
    assert TrainConfig(max_steps=5, epochs=2).total_steps(None) == 5  # a stream, or a fixed length


@pytest.mark.parametrize(
    "value, expected", [("10-12", (10, 12)), ("5", (5, 5)), ("", None), ("0", None), ("'0'", None)]
)
def test_profile_steps_take_a_step_or_a_range(value, expected):
    cfg = load_config(None, ["model.name_or_path=m", "data.train=d.jsonl", f"train.profile_steps={value}"])
    assert cfg.train.profile_range() == expected


@pytest.mark.parametrize("value", ["12-10", "x", "3-", "0-2", "1-2-3"])
def test_a_bad_profile_range_names_the_key(value):
    with pytest.raises(ConfigError) as e:
        load_config(None, ["model.name_or_path=m", "data.train=d.jsonl", f"train.profile_steps={value}"])
    assert e.value.problems == [
        f"train.profile_steps: expected a step or a range of steps such as 10-12 (counted from 1), got {value!r}"
    ]


def schema_of(key: str) -> type:
    """The tree a key belongs to: the method's whose section it is in, or Config's."""
    return next((m.schema for m in METHODS.values() if m.section and key.startswith(f"{m.section}.")), Config)


def numeric_keys() -> list[str]:
    import typing

    from llmtrain.config.schema import field_docs

    keys = []
    for key, _, _ in field_docs([m.schema for m in METHODS.values()]):
        node = schema_of(key)()
        *parents, leaf = key.split(".")
        for part in parents:
            node = getattr(node, part)
        if typing.get_type_hints(type(node))[leaf] in (int, float):
            keys.append(key)
    return keys


@pytest.mark.parametrize("key", numeric_keys())
def test_every_number_is_checked_from_the_schema(key):
    """No numeric field can take a value that cannot train: inf and nan for every float,
    negative values for every number (all are counts, sizes, rates or factors), and a
    number beyond any float or 64-bit integer."""
    huge = "1" + "0" * 400
    values = ["-1", ".nan", ".inf", huge] if isinstance(_default(key), float) else ["-1", huge]
    for value in values:
        with pytest.raises(ConfigError) as e:
            load_config(None, ["model.name_or_path=m", "data.train=d.jsonl", f"{key}={value}"], schema_of(key))
        assert [p for p in e.value.problems if p.startswith(f"{key}: ")], (key, value, e.value.problems)


def _default(key: str):
    node = schema_of(key)()
    for part in key.split("."):
        node = getattr(node, part)
    return node


def test_number_messages_say_the_range():
    with pytest.raises(ConfigError) as e:
        overrides = ["train.lr=.inf", "train.adam_eps=-1e-8", "train.seed=-3", "model.lora.dropout=1"]
        load_config(None, ["model.name_or_path=m", "data.train=d.jsonl", *overrides, "eval.sample_max_new_tokens=0"])
    assert e.value.problems == [
        "model.lora.dropout: must be in [0, 1), got 1.0",
        "train.lr: must be a finite number, got inf",
        "train.adam_eps: must be positive, got -1e-08",
        "train.seed: must be in [0, 4294967295], got -3",
        "eval.sample_max_new_tokens: must be at least 1, got 0",
    ]


def test_a_key_given_twice_in_yaml_is_an_error_naming_it_and_its_line(tmp_path):
    path = tmp_path / "twice.yaml"
    path.write_text("train:\n  lr: 1.0e-3\ndata:\n  train: a.jsonl\ntrain:\n  epochs: 2\n")
    with pytest.raises(ConfigError) as e:
        load_config(path, ["model.name_or_path=m"])
    assert e.value.problems == [f"{path}:5: 'train' is given twice (first on line 1); give each key once"]


def test_a_config_file_that_is_not_utf8_names_its_line(tmp_path):
    path = tmp_path / "latin1.yaml"
    path.write_bytes("output_dir: runs/x\n# caf\xe9\n".encode("latin-1"))
    with pytest.raises(ConfigError) as e:
        load_config(path, ["model.name_or_path=m", "data.train=d.jsonl"])
    assert e.value.problems == [f"{path}:2: not UTF-8 text; save the file as UTF-8"]


def test_a_chat_template_path_must_exist_and_a_template_must_parse(tmp_path):
    base = ["model.name_or_path=m", "data.train=d.jsonl"]
    with pytest.raises(ConfigError) as e:
        load_config(None, [*base, f"data.chat_template={tmp_path}/chat.jinja"])
    assert e.value.problems == [
        f"data.chat_template: no such file: {tmp_path}/chat.jinja; give a Jinja template file, or the template "
        "text itself"
    ]
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}\n{{ m.content }\n{% endfor %}")
    with pytest.raises(ConfigError) as e:
        load_config(None, [*base, f"data.chat_template={broken}"])
    assert e.value.problems[0].startswith(f"data.chat_template: {broken} line 2: Jinja syntax error (")
    good = tmp_path / "good.jinja"
    good.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    assert load_config(None, [*base, f"data.chat_template={good}"]).data.chat_template == str(good)


def test_keys_in_yaml_are_names_and_merge_keys_work(tmp_path):
    merged = tmp_path / "merged.yaml"
    merged.write_text("data:\n  <<: &d {max_seq_len: 64, packing: true}\n  max_seq_len: 128\n")
    cfg = load_config(merged, ["model.name_or_path=m", "data.train=d.jsonl"])
    assert (cfg.data.max_seq_len, cfg.data.packing) == (128, True)  # merged, and overridden after the merge
    odd = tmp_path / "odd.yaml"
    odd.write_text("train:\n  ? [a, b]\n  : 1\n")
    with pytest.raises(ConfigError) as e:
        load_config(odd, ["model.name_or_path=m", "data.train=d.jsonl"])
    assert e.value.problems == [f"{odd}:2: a key here is a list, not a name; keys are plain names such as lr"]


def test_a_config_path_that_is_no_file_says_what_it_is(tmp_path):
    assert_problems(tmp_path, [f"--config: {tmp_path} is not a regular file; give a YAML file"])
    assert_problems(tmp_path / "no.yaml", [f"--config: no such file: {tmp_path / 'no.yaml'}"])


def assert_problems(path, problems, overrides=()):
    with pytest.raises(ConfigError) as e:
        load_config(path, ["model.name_or_path=m", "data.train=d.jsonl", *overrides])
    assert e.value.problems == problems


@pytest.mark.parametrize(
    ("override", "problem"),
    [
        ("train=5", "train: is a section; set its keys (e.g. train.<key>=value), got 5"),
        ("train=null", "train: is a section; set its keys (e.g. train.<key>=value), got None"),
        (
            "train={lr: 1e-4, epochs: 2",
            "train: '{lr: 1e-4, epochs: 2' is not a YAML mapping (check its braces and quotes: "
            "train={key: value, ...}); or set its keys one by one (e.g. train.<key>=value)",
        ),
        ("train.lr.x=1", "train.lr.x: train.lr is set to 2e-05, not a section; set train.lr as a section"),
        ("=5", "(empty)=5: the key has an empty part; write key.sub=value"),
        ("train..lr=1", "train..lr=1: the key has an empty part; write key.sub=value"),
        ("data.train=[a.jsonl, '', null]", "data.train[1]: empty; give a file path or a hub data set name"),
    ],
)
def test_an_override_never_silently_drops_a_section(tmp_path, override, problem):
    """A value for a whole section is refused, not put in place of the YAML's section."""
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  lr: 2.0e-5\n  max_steps: 3\n")
    with pytest.raises(ConfigError) as e:
        load_config(path, ["model.name_or_path=m", "data.train=d.jsonl", override])
    assert e.value.problems[0] == problem


def test_a_mapping_for_a_section_sets_only_its_keys(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  lr: 2.0e-5\n  max_steps: 3\n")
    cfg = load_config(path, ["model.name_or_path=m", "data.train=d.jsonl", "train={lr: 1.0e-4, epochs: 2}"])
    assert (cfg.train.lr, cfg.train.max_steps, cfg.train.epochs) == (1e-4, 3, 2)


def test_preference_settings_that_cannot_apply_are_errors_naming_the_key():
    base = ["model.name_or_path=m", "data.train=d.jsonl"]
    bad = ["dpo.loss=simpo", "dpo.reference=other", "data.streaming=true", "train.max_steps=5"]
    with pytest.raises(ConfigError) as e:
        load_config(None, [*base, *bad, "data.format=chat", "data.loss_on=all", "dpo.beta=0"], DPOConfig)
    keys = sorted(problem.split(":")[0] for problem in e.value.problems)
    assert keys == ["data.format", "data.loss_on", "data.streaming", "dpo.beta", "dpo.reference"]
    with pytest.raises(ConfigError, match="dpo: unknown key"):
        load_config(None, [*base, "dpo.beta=0.2"])  # finetune.py's tree has no dpo section


@pytest.mark.parametrize(
    ("schema", "override", "message"),
    [
        (Config, "dpo.beta=0.2", "dpo: unknown key for recipes/finetune.py; dpo settings are recipes/dpo.py's"),
        (RewardConfig, "dpo.beta=0.2", "dpo: unknown key for recipes/reward.py; dpo settings are recipes/dpo.py's"),
        (GRPOConfig, "dpo.beta=0.2", "dpo: unknown key for recipes/grpo.py; dpo settings are recipes/dpo.py's"),
        (DPOConfig, "grpo.beta=0.1", "grpo: unknown key for recipes/dpo.py; grpo settings are recipes/grpo.py's"),
        (Config, "reward.center_coefficient=0.1", "reward: unknown key for recipes/finetune.py; reward settings are"),
    ],
)
def test_another_recipes_section_names_both_recipes(schema, override, message):
    with pytest.raises(ConfigError, match=rf"^{message}"):
        load_config(None, ["model.name_or_path=m", "data.train=d.jsonl", override], schema, sections())


def test_kto_refuses_packing_and_the_sft_term_and_takes_positive_weights():
    base = ["model.name_or_path=m", "data.train=d.jsonl", "dpo.loss=kto"]
    bad = ["data.packing=true", "dpo.sft_weight=0.5", "dpo.desirable_weight=0", "dpo.undesirable_weight=-1"]
    with pytest.raises(ConfigError) as e:
        load_config(None, [*base, *bad], DPOConfig)
    keys = sorted(problem.split(":")[0] for problem in e.value.problems)
    assert keys == ["data.packing", "dpo.desirable_weight", "dpo.sft_weight", "dpo.undesirable_weight"]
    assert "set data.packing=false" in str(e.value)
    cfg = load_config(None, [*base, "dpo.desirable_weight=1.33"], DPOConfig)
    assert (cfg.dpo.desirable_weight, cfg.dpo.undesirable_weight) == (1.33, 1.0)


def test_quantization_needs_lora_and_names_both_keys():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["model.name_or_path=m", "data.train=d.jsonl", "model.quantization=nf4"])
    assert e.value.problems[0].startswith("model.quantization: nf4 weights cannot be trained directly")
    assert "model.lora.enabled=true" in e.value.problems[0]
    cfg = load_config(
        None, ["model.name_or_path=m", "data.train=d.jsonl", "model.quantization=nf4", "model.lora.enabled=true"]
    )
    assert cfg.model.quantization == "nf4"


def test_a_config_filled_in_at_start_up_is_checked_again():
    """What start-up fills in (demo names, the attention backend) is checked like the YAML:
    a value that would fail the checks stops the run naming its key."""
    from llmtrain.config.load import check

    cfg = load_config(None, ["model.name_or_path=m", "data.train=d.jsonl"])
    check(cfg)  # as loaded: fine
    cfg.data.train = ""  # a start-up step that left a required key empty
    with pytest.raises(ConfigError) as e:
        check(cfg)
    assert e.value.problems == ["data.train: required; a path, a list of paths, or a hub data set name"]


def test_merge_lora_auto_merges_reward_models_only():
    """export.merge_lora=auto: a LoRA reward model's final/ is merged (an adapter would not
    load as a one-label classifier in plain transformers), other recipes keep the adapter;
    a reward model's adapter alone is refused naming the key."""
    base = ["model.name_or_path=x", "data.train=a.jsonl"]
    lora = [*base, "model.lora.enabled=true"]
    assert load_config(None, lora, schema=RewardConfig).export.merge_lora is True
    assert load_config(None, base, schema=RewardConfig).export.merge_lora is False
    for schema in (Config, DPOConfig):
        assert load_config(None, lora, schema=schema).export.merge_lora is False
        assert load_config(None, [*lora, "export.merge_lora=true"], schema=schema).export.merge_lora is True
    with pytest.raises(ConfigError, match=r"export.merge_lora: a reward model's final/ is merged"):
        load_config(None, [*lora, "export.merge_lora=false"], schema=RewardConfig)
    with pytest.raises(ConfigError, match=r"export.merge_lora: only applies with model.lora.enabled=true"):
        load_config(None, [*base, "export.merge_lora=true"], schema=RewardConfig)


def test_a_number_out_of_its_range_gets_that_problem_alone():
    """Checks between keys would read the bad value as one meant: eval.every_steps=-1 is not an
    evaluation that needs eval data."""
    with pytest.raises(ConfigError) as e:
        load_config(None, ["model.name_or_path=m", "data.train=d.jsonl", "eval.every_steps=-1"])
    assert e.value.problems == ["eval.every_steps: must be zero or more, got -1"]
    with pytest.raises(ConfigError) as e:  # a meant value still gets the check between keys
        load_config(None, ["model.name_or_path=m", "data.train=d.jsonl", "eval.every_steps=5"])
    assert e.value.problems == [
        "eval.every_steps: set data.eval (or data.eval_fraction, or eval.tasks) too, or set eval.every_steps=0"
    ]


def test_a_config_file_without_output_dir_gets_one_named_after_it(tmp_path):
    """Not the default runs/demo, where runs of different configs (and the demo) would meet."""
    path = tmp_path / "my_sft.yaml"
    path.write_text("model:\n  name_or_path: m\ndata:\n  train: d.jsonl\n")
    assert load_config(path).output_dir == "runs/my_sft"
    assert load_config(path, ["output_dir=elsewhere"]).output_dir == "elsewhere"
    path.write_text(path.read_text() + "output_dir: mine\n")
    assert load_config(path).output_dir == "mine"


@pytest.mark.parametrize("schema", [Config, DPOConfig, GRPOConfig, RewardConfig], ids=lambda s: s.__name__)
def test_model_head_is_the_recipes_own_and_another_is_refused(schema):
    given = ["model.name_or_path=m", "data.train=d.jsonl"]
    assert load_config(None, given, schema=schema).model.head == schema.HEAD
    assert load_config(None, [*given, f"model.head={schema.HEAD}"], schema=schema).model.head == schema.HEAD
    other = "lm" if schema.HEAD == "score" else "score"
    with pytest.raises(ConfigError) as e:
        load_config(None, [*given, f"model.head={other}"], schema=schema)
    assert e.value.problems == [f"model.head: this recipe trains the '{schema.HEAD}' head; remove model.head={other}"]


BASE = ["model.name_or_path=m", "data.train=d.jsonl"]


@pytest.mark.parametrize(
    ("override", "key", "value"),
    [
        ("output_dir=exp #3", "output_dir", "exp #3"),  # YAML: exp, the rest a comment
        ("data.system_prompt=Be brief.\nAnswer in French.", "data.system_prompt", "Be brief.\nAnswer in French."),
        ("data.system_prompt=Note: be brief", "data.system_prompt", "Note: be brief"),  # YAML: a mapping
        ("data.system_prompt= Be brief. ", "data.system_prompt", " Be brief. "),
        ("output_dir=&run exp", "output_dir", "&run exp"),  # YAML: exp, &run an anchor
        ("output_dir=!!python/name:os.system", "output_dir", "!!python/name:os.system"),
        ("model.revision=0123", "model.revision", "0123"),  # YAML 1.1: the octal number 83
        ("model.revision=1.10", "model.revision", "1.10"),  # YAML: 1.1
        ("log.project=null", "log.project", "null"),
        ("output_dir='exp #3'", "output_dir", "exp #3"),  # one quoted YAML text: its text
        ('data.system_prompt="Be brief.\\nAnswer in French."', "data.system_prompt", "Be brief.\nAnswer in French."),
        ("output_dir='a' #b", "output_dir", "'a' #b"),  # more than one quoted text: as written
        ("data.train=my #1.jsonl", "data.train", "my #1.jsonl"),  # a key that takes a text or a list
        ("data.eval=2024", "data.eval", "2024"),
        ("export.max_shard_size=500MB #x", "export.max_shard_size", "500MB #x"),
        ("export.max_shard_size=1000", "export.max_shard_size", 1000),  # a number where the key takes one
        ("export.merge_lora=true", "export.merge_lora", True),
        ("train.profile_steps=5", "train.profile_steps", 5),
    ],
)
def test_an_override_of_a_key_that_takes_a_text_keeps_it_as_written(override, key, value):
    """YAML would drop a comment, fold a line break into a space, strip the ends, drop an
    anchor, read `a: b` as a mapping or 0123 as a number: a key that takes a text gets the
    text after = as it was written instead (quoted YAML text still gives its text)."""
    key_, parsed = parse_override(override, Config)
    assert (key_, parsed) == (key, value)
    if not key.startswith(("data.train", "export.")):  # those would fail other checks here
        cfg = load_config(None, [*BASE, override])
        section, _, name = key.rpartition(".")
        assert getattr(getattr(cfg, section) if section else cfg, name) == value


@pytest.mark.parametrize(
    ("override", "problem"),
    [
        (
            "data.train=[a.jsonl, b.jsonl] #x",
            "data.train: YAML reads '#x' in '[a.jsonl, b.jsonl] #x' as a comment and drops it; remove it, or put the "
            'text that holds it in quotes (e.g. ["run #1"]), and the override in the shell\'s quotes',
        ),
        ("train.lr=1e-4 #lower", "train.lr: YAML reads '#lower' in '1e-4 #lower' as a comment and drops it;"),
        (
            "data.train=[a.jsonl,\n b c.jsonl\n d.jsonl]",
            "data.train: YAML turns the line break inside 'b c.jsonl\\n d.jsonl' into a space; write the entry in "
            'double quotes with \\n for the line break: "b c.jsonl\\n d.jsonl"',
        ),
        ("data.train=[&x a.jsonl, b.jsonl]", "data.train: YAML reads &x as an anchor in '[&x a.jsonl, b.jsonl]'; put "),
        (
            "data.train=[a.jsonl, ${X}/b.jsonl]",
            "data.train: '[a.jsonl, ${X}/b.jsonl]' is not valid YAML (expected ',' or ']', but got '{'); put its texts "
            'in double quotes, e.g. ["What is 7 + 5?", "${X}/b.jsonl"], and the whole override in the shell\'s single '
            "quotes",
        ),
        ("eval.sample_prompts=[What is 7 + 5?]", "eval.sample_prompts: '[What is 7 + 5?]' is not valid YAML"),
        ("output_dir='a\nb'", "output_dir: \"'a\\nb'\": YAML turns a line break inside quotes into a space;"),
    ],
)
def test_an_override_that_yaml_would_change_is_refused_saying_how_to_quote(override, problem):
    """In a list or mapping (or a number), a text YAML would change is refused: before, a
    comment or a folded line break went unseen, and a list YAML could not read became one
    path ('[a.jsonl, ${X}/b.jsonl]')."""
    with pytest.raises(ConfigError) as e:
        load_config(None, [*BASE, override])
    assert len(e.value.problems) == 1 and e.value.problems[0].startswith(problem)


def test_quoted_texts_in_a_list_are_read_as_yaml_quotes():
    cfg = load_config(None, [*BASE, 'eval.sample_prompts=["What is 7 + 5?", "Uppercase: wolf", "a #1"]'])
    assert cfg.eval.sample_prompts == ["What is 7 + 5?", "Uppercase: wolf", "a #1"]


COLON = (
    "eval.sample_prompts[0]: expected a string, got {'Uppercase': 'wolf'}; YAML reads Uppercase: wolf as a mapping, "
    "for the ': ' in it: put it in quotes, \"Uppercase: wolf\" (on the command line: "
    "'eval.sample_prompts=[\"Uppercase: wolf\"]')"
)


def test_a_text_read_as_a_mapping_for_its_colon_says_yaml_needs_quotes(tmp_path):
    """[Uppercase: wolf] is a list of one mapping to YAML, on the command line and in a file;
    any key that takes texts (or a text among other things) says to quote it."""
    with pytest.raises(ConfigError) as e:
        load_config(None, [*BASE, "eval.sample_prompts=[Uppercase: wolf]"])
    assert e.value.problems == [COLON]
    path = tmp_path / "c.yaml"
    path.write_text("eval:\n  sample_prompts: [Uppercase: wolf]\n")
    with pytest.raises(ConfigError) as e:
        load_config(path, BASE)
    assert e.value.problems == [COLON]
    with pytest.raises(ConfigError) as e:
        load_config(None, [*BASE, "eval.sample_prompts=[a, b]", "model.lora.target_modules=[q_proj, v: w]"])
    assert e.value.problems[0].endswith(
        'put it in quotes, "v: w" (on the command line: \'model.lora.target_modules=["q_proj", "v: w"]\')'
    )
    with pytest.raises(ConfigError) as e:
        load_config(None, ["model.name_or_path=m", "data.train=[a.jsonl, owner/set: train]"])
    assert "YAML reads owner/set: train as a mapping" in e.value.problems[0]
    with pytest.raises(ConfigError) as e:
        load_config(None, ["model.name_or_path=m", "data.train=d.jsonl", "grpo.rewards=[reward_model: rm]"], GRPOConfig)
    assert "YAML reads reward_model: rm as a mapping" in e.value.problems[0]


def test_a_number_or_truth_value_where_a_text_goes_says_to_quote_it(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model:\n  revision: 0123\neval:\n  sample_prompts: [yes, 12]\n")
    with pytest.raises(ConfigError) as e:
        load_config(path, BASE)
    assert e.value.problems == [
        "model.revision: expected a string, got 83; YAML reads it unquoted as a number: put it in quotes for a text",
        "eval.sample_prompts[0]: expected a string, got True; YAML reads it unquoted as true/false: put it in quotes "
        "for a text",
    ]


@pytest.mark.parametrize(
    ("given", "problem"),
    [
        ("train.learning_rate=1e-5", "train.learning_rate: unknown key; did you mean 'train.lr'?"),
        ("learning_rate=1e-5", "learning_rate: unknown key; did you mean 'train.lr'?"),
        (
            "model.per_device_train_batch_size=4",
            "model.per_device_train_batch_size: unknown key; did you mean 'train.micro_batch_size'?",
        ),
        (
            "gradient_accumulation_steps=4",
            "gradient_accumulation_steps: unknown key; did you mean 'train.grad_accum_steps'?",
        ),
        (
            "train.warmup_ratio=0.03",
            "train.warmup_ratio: unknown key; did you mean 'train.warmup_steps'? (a number of steps, not a share of "
            "the run: 0.03 of 1000 steps is train.warmup_steps=30)",
        ),
        (
            "bf16=true",
            "bf16: unknown key; bf16 is set at launch here: accelerate launch --mixed_precision bf16 (model.dtype is "
            "the dtype the weights load in)",
        ),
        ("train.max_seq_length=512", "train.max_seq_length: unknown key; did you mean 'data.max_seq_len'?"),
        ("save_total_limit=2", "save_total_limit: unknown key; did you mean 'checkpoint.keep_last'?"),
        ("seed=3", "seed: unknown key; did you mean 'train.seed'? (each key goes in its section)"),
    ],
)
def test_names_from_transformers_are_answered_with_ours(tmp_path, given, problem):
    """TrainingArguments' and TRL's names, as overrides (in any section) and in a YAML file."""
    with pytest.raises(ConfigError) as e:
        load_config(None, [*BASE, given])
    assert e.value.problems == [problem]
    key, _, value = given.partition("=")
    *sections, name = key.split(".")
    path = tmp_path / "c.yaml"
    path.write_text(
        "".join(f"{'  ' * i}{s}:\n" for i, s in enumerate(sections)) + f"{'  ' * len(sections)}{name}: {value}\n"
    )
    with pytest.raises(ConfigError) as e:
        load_config(path, BASE)
    assert e.value.problems == [problem]


def test_every_name_from_transformers_names_a_key_we_have():
    """Each entry names a key of some recipe's tree (or a launch flag), and none is a name
    llmtrain has itself: those the schema places (seed: train.seed)."""
    from llmtrain.config.foreign import FOREIGN
    from llmtrain.config.load import key_for, key_type

    schemas = [m.schema for m in METHODS.values()]
    for name, ours in FOREIGN.items():
        assert ours.flag or any(key_type(s, ours.key) is not None for s in schemas), name
        assert all(key_for(name, s) is None for s in schemas), name
