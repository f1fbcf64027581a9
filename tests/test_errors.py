"""One clear line for every mistake a user can make: the gist of a library's exception,
and, end to end through the command lines, a careless user's mistakes, each one
`error:` line naming the key (or file and line) and the fix, exit 2, no traceback."""

import importlib.util
import json
import shutil
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from llmtrain.errors import describe
from tests.support.runs import ROOT


def test_describe_gives_the_first_line_and_what_a_colon_announces():
    assert describe(ValueError("")) == "ValueError"
    assert describe(ValueError("\n  bad value\nmore detail\n")) == "ValueError: bad value"
    message = "Couldn't instantiate the backend tokenizer from one of: \n(1) a file, \n(2) a slow one"
    assert describe(ValueError(message)) == (
        "ValueError: Couldn't instantiate the backend tokenizer from one of: (1) a file, (2) a slow one"
    )


# name -> (command, arguments, the one error line). {M}: the tiny model, {D}: its chat rows,
# {T}: this test's folder (with the files `outcomes` makes there), {O}: an output_dir.
SFT = ("--config", "{T}/base.yaml", "model.name_or_path={M}", "data.train={D}", "output_dir={O}")
PLAN = ("--config", "{T}/base.yaml", "model.name_or_path={M}", "data.train={D}")
SAVED = "give a model directory as save_pretrained writes it (config.json, the weights, and the tokenizer's files)"
CASES = {
    "empty output_dir": (
        "finetune",
        [*SFT, "output_dir="],
        "output_dir: required; give the directory the run writes to, e.g. output_dir=runs/my-run",
    ),
    "empty checkpoint.resume": (
        "finetune",
        [*SFT, "checkpoint.resume="],
        "checkpoint.resume: empty; give auto, none or a checkpoint directory (output_dir/checkpoints/step-N)",
    ),
    "a section set to true": (
        "finetune",
        [*SFT, "model.lora=true"],
        "model.lora: is a section; to turn it on set model.lora.enabled=true",
    ),
    "a dpo key for finetune.py": (
        "finetune",
        [*SFT, "dpo.beta=0.2"],
        "dpo: unknown key for recipes/finetune.py; dpo settings are recipes/dpo.py's: run that recipe, or "
        "remove the dpo section",
    ),
    "a data.train mapping outside a list": (
        "finetune",
        [*SFT, "data.train={path: a.jsonl, fraction: 0.5}"],
        "data.train: expected a string or a list of strings or {path: ..., fraction: ...} mappings, got "
        "{'path': 'a.jsonl', 'fraction': 0.5}; a source written as a mapping goes in a list: "
        "data.train=[{path: a.jsonl, fraction: 0.5}]",
    ),
    "a number in data.train's list": (
        "finetune",
        [*SFT, "data.train=[a.jsonl, 5]"],
        "data.train[1]: expected a string or a mapping {path: ..., fraction: ...}, got 5; YAML reads it unquoted as "
        "a number: put it in quotes for a text",
    ),
    "a data.eval mapping": (
        "finetune",
        [*SFT, "data.eval=[{path: a.jsonl}]"],
        "data.eval[0]: expected a string, got {'path': 'a.jsonl'}; give the path itself (only data.train entries "
        "are mappings)",
    ),
    "a model directory without config.json": (
        "finetune",
        [*SFT, "model.name_or_path={T}/no-config"],
        "model.name_or_path: {T}/no-config has no config.json; " + SAVED,
    ),
    "an empty model directory": (
        "finetune",
        [*SFT, "model.name_or_path={T}/empty"],
        "model.name_or_path: {T}/empty has no config.json; " + SAVED,
    ),
    "a model directory without tokenizer files": (
        "finetune",
        [*SFT, "model.name_or_path={T}/no-tokenizer"],
        "model.name_or_path: {T}/no-tokenizer has no tokenizer files (tokenizer.json); " + SAVED,
    ),
    "a model directory without weights": (
        "finetune",
        [*SFT, "model.name_or_path={T}/no-weights"],
        "model.name_or_path: {T}/no-weights has no weights (model.safetensors); " + SAVED,
    ),
    "a config.json from another model than the weights": (
        "finetune",
        [*SFT, "model.name_or_path={T}/other-config"],
        "model.name_or_path: the weights in '{T}/other-config' do not have the shapes its config.json gives "
        "(transformers' load report above lists them); config.json and the weights must come from the same model",
    ),
    "a tokenizer with more tokens than the model embeds": (
        "finetune",
        [*SFT, "model.name_or_path={T}/small-vocab"],
        "model.name_or_path: the tokenizer of '{T}/small-vocab' has a vocabulary of 261 tokens, but the model "
        "embeds only 50 tokens (config.json vocab_size); use the tokenizer saved with this model",
    ),
    "a directory of LoRA adapters": (
        "finetune",
        [*SFT, "model.name_or_path={T}/adapter"],
        "model.name_or_path: {T}/adapter holds LoRA adapters only (adapter_config.json), not a model; train from "
        "their base ({M}), or from a merged export (a LoRA run with export.merge_lora=true writes one)",
    ),
    "a run's output_dir as the model": (
        "finetune",
        [*SFT, "model.name_or_path={T}/run"],
        "model.name_or_path: {T}/run has no config.json; it is a run's output_dir: give its model, "
        "model.name_or_path={T}/run/final",
    ),
    "a run's output_dir to resume": (
        "finetune",
        [*SFT, "checkpoint.resume={T}/run"],
        "checkpoint.resume: {T}/run is not a complete llmtrain checkpoint (no train_state.json); it is a run's "
        "output_dir: to continue that run, give output_dir={T}/run checkpoint.resume=auto",
    ),
    "data files separated by a comma": (
        "finetune",
        [*SFT, "data.train=a.jsonl,b.jsonl"],
        f"data.train: no such file: a.jsonl,b.jsonl (in the working directory {ROOT}); several files go in a list: "
        "data.train=[a.jsonl, b.jsonl]",
    ),
    "a config file that is a list": (
        "finetune",
        ["--config", "{T}/list.yaml", *SFT[2:]],
        "{T}/list.yaml: the top level must be a mapping of sections; write e.g. 'train:' with its keys indented below",
    ),
    "a hub revision for a local model": (
        "finetune",
        [*SFT, "model.revision=v2"],
        "model.revision: v2 selects a hub revision, but {M} is a local directory, read as it is; remove "
        "model.revision, or give the hub name",
    ),
    "checkpoint.resume that does not exist": (
        "finetune",
        [*SFT, "checkpoint.resume={T}/gone/checkpoints/step-4"],
        "checkpoint.resume: no such directory: {T}/gone/checkpoints/step-4; give a checkpoints/step-N directory "
        "of an earlier run, or checkpoint.resume=auto",
    ),
    "checkpoint.resume that is a file": (
        "finetune",
        [*SFT, "checkpoint.resume={D}"],
        "checkpoint.resume: {D} is not a directory; give a checkpoints/step-N directory of an earlier run, or "
        "checkpoint.resume=auto",
    ),
    "data.train that is a directory": (
        "finetune",
        [*SFT, "data.train={T}/empty"],
        "data.train: {T}/empty is a directory; give its data files (.jsonl, .json, .parquet or .csv): it holds none",
    ),
    "a data path that does not exist, with no data file's ending": (
        "finetune",
        [*SFT, "data.train={T}/nothere.txt"],
        "data.train: no such file: {T}/nothere.txt; give a .jsonl, .json, .parquet or .csv file",
    ),
    "a Parquet file with no rows": (
        "finetune",
        [*SFT, "data.train={T}/empty.parquet"],
        "data.train: {T}/empty.parquet has no rows; give a file with at least one row",
    ),
    "data.format that the rows do not have": (
        "finetune",
        [*SFT, "data.format=text"],
        "data.train: {D}: data.format=text needs columns ['text'], found ['messages']; set data.format=auto to take "
        "each row's format from its fields",
    ),
    "a row whose text is null": (
        "finetune",
        [*SFT, "data.train={T}/null.jsonl"],
        "data.train: {T}/null.jsonl line 2: no known format fits this row's fields [] (text: null); a row needs "
        "'text', 'prompt'+'completion', 'instruction'+'output', 'messages' or 'conversations'; data.bad_rows=skip "
        "would drop malformed rows instead",
    ),
    "every row longer than data.max_seq_len, dropped": (
        "finetune",
        [*SFT, "data.max_seq_len=8", "data.overlong=drop"],
        "data.train: no usable rows: data.train: 0/20 rows kept, 0 trained tokens; 20 dropped (longer than "
        "data.max_seq_len); raise data.max_seq_len, or set data.overlong=truncate",
    ),
    "every row malformed, skipped": (
        "finetune",
        [*SFT, "data.train={T}/numbers.jsonl", "data.bad_rows=skip", "data.max_bad_fraction=1"],
        "data.train: no usable rows: data.train: 0/1 rows kept, 0 trained tokens; 1 dropped (malformed, "
        "data.bad_rows=skip: {T}/numbers.jsonl line 1: 'text' must be a string); fix the malformed rows",
    ),
    "pairs with identical answers": (
        "dpo",
        [*SFT, "data.train={T}/same.jsonl"],
        "data.train: no usable pairs: data.train: 0/1 rows kept, 0 trained tokens; 1 dropped (identical answers); "
        "give pairs with two different, non-empty answers",
    ),
    "chat rows for dpo.py": (
        "dpo",
        list(SFT),
        "data.train: {D}: preference pairs need 'chosen' and 'rejected' (and 'prompt' unless they are whole "
        "conversations); found columns ['messages']; give pair rows, or train on these rows with recipes/finetune.py",
    ),
    "an accelerate config's process count that is no number": (
        "plan",
        [*PLAN, "--accelerate-config", "{T}/two.yaml"],
        "--accelerate-config: num_processes: expected a whole number of at least 1 in {T}/two.yaml, got 'two'",
    ),
    "an accelerate config's DeepSpeed accumulation that is no number": (
        "plan",
        [*PLAN, "--accelerate-config", "{T}/ds.yaml"],
        "--accelerate-config: deepspeed_config.gradient_accumulation_steps: expected a whole number of at least 1 "
        "in {T}/ds.yaml, got 'four'",
    ),
    "an accelerate config that is a list": (
        "plan",
        [*PLAN, "--accelerate-config", "{T}/list.yaml"],
        "--accelerate-config: {T}/list.yaml is not a mapping of settings; write it with `accelerate config`",
    ),
    # Run in {T}: plan finds the demo's config from its own checkout, so the typo is what it reports.
    "llmtrain plan without --config, outside the checkout": (
        "plan",
        ["train.lrr=1"],
        "train.lrr: unknown key; did you mean 'train.lr'?",
    ),
}
CASES["a system prompt the chat template refuses"] = (
    "finetune",
    [*SFT, "data.train={T}/no-system.jsonl", "data.chat_template={T}/no-system.jinja", "data.system_prompt=Be brief."],
    "data.train: {T}/no-system.jsonl line 1: the chat template refuses the system message data.system_prompt puts "
    "first (TemplateError: System role not supported); unset data.system_prompt, or set data.chat_template to a "
    "template that takes one",
)
ELSEWHERE = {"llmtrain plan without --config, outside the checkout"}
if not torch.cuda.is_available():
    CASES["flash attention on CPU"] = (
        "finetune",
        [*SFT, "model.attn_implementation=flash_attention_2"],
        "model.attn_implementation: flash_attention_2 runs on CUDA GPUs only, and this run is on CPU; use auto, "
        "eager or sdpa",
    )
for tracker in ("wandb", "mlflow"):
    if importlib.util.find_spec(tracker) is None:
        CASES[f"log.tracker={tracker}, not installed"] = (
            "finetune",
            [*SFT, f"log.tracker={tracker}"],
            f"log.tracker: {tracker} is not installed; pip install {tracker}, or set log.tracker=none",
        )

FILES = {
    "base.yaml": "log: {tracker: none, progress_bar: false}\ntrain: {max_steps: 1}\ndata: {max_seq_len: 256}\n",
    "null.jsonl": '{"text": "a row"}\n{"text": null}\n',
    "numbers.jsonl": '{"text": 5}\n',
    "same.jsonl": '{"prompt": "q", "chosen": "a", "rejected": "a"}\n',
    "two.yaml": "distributed_type: MULTI_GPU\nnum_processes: two\n",
    "ds.yaml": "distributed_type: DEEPSPEED\nnum_processes: 2\ndeepspeed_config: {gradient_accumulation_steps: four}\n",
    "list.yaml": "- distributed_type: NO\n",
    "no-system.jsonl": '{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]}\n',
    "no-system.jinja": "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}",
}


def fill(text: str, values: dict) -> str:
    """`text` with its placeholders ({M}, ...) filled in; other braces are YAML's."""
    for key, value in values.items():
        text = text.replace("{" + key + "}", value)
    return text


@pytest.fixture(scope="module")
def outcomes(tiny_model, chat_file, cache_env, tmp_path_factory):
    """Every case run once, in one process (tests/support/error_runs.py); returns (what each
    printed and exited with, the values of the placeholders)."""
    root = tmp_path_factory.mktemp("mistakes")
    for name, text in FILES.items():
        (root / name).write_text(text)
    (root / "empty").mkdir()
    pq.write_table(pa.table({"text": pa.array([], pa.string())}), root / "empty.parquet")
    for name, drop in (
        ("no-config", "config.json"),
        ("no-tokenizer", "tokenizer.json"),
        ("no-weights", "model.safetensors"),
    ):
        shutil.copytree(tiny_model, root / name)
        (root / name / drop).unlink()
    shutil.copytree(tiny_model, root / "other-config")
    config = json.loads((tiny_model / "config.json").read_text())
    (root / "other-config" / "config.json").write_text(json.dumps(config | {"hidden_size": 2 * config["hidden_size"]}))
    shutil.copytree(tiny_model, root / "small-vocab")  # its tokenizer, with a model of a smaller vocabulary
    config = AutoConfig.from_pretrained(tiny_model)
    config.vocab_size = 50
    AutoModelForCausalLM.from_config(config).save_pretrained(root / "small-vocab")
    (root / "run" / "checkpoints").mkdir(parents=True)  # an output_dir, as a run leaves it
    (root / "run" / "final").mkdir()
    (root / "adapter").mkdir()  # as a LoRA run's final/ without export.merge_lora
    (root / "adapter" / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": str(tiny_model)}))
    values = {"M": str(tiny_model), "D": str(chat_file), "T": str(root), "O": str(root / "out")}
    spec = {
        name: [command, [fill(a, values) for a in args], str(root) if name in ELSEWHERE else None]
        for name, (command, args, _) in CASES.items()
    }
    (root / "cases.json").write_text(json.dumps(spec))
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "support" / "error_runs.py"), str(root / "cases.json")],
        env=cache_env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1]), values


@pytest.mark.parametrize("name", CASES)
def test_a_careless_users_mistake_is_one_line_naming_the_fix(outcomes, name):
    results, values = outcomes
    result, expected = results[name], fill(CASES[name][2], values)
    assert not result["traceback"] and "Traceback" not in result["stderr"], result["traceback"] or result["stderr"]
    assert result["code"] == 2
    assert [line for line in result["stderr"].splitlines() if line.startswith("error:")] == [f"error: {expected}"]
