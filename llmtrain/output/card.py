"""final/README.md: the model card, in the Hugging Face Hub's format (YAML front matter the
Hub reads, then Markdown), written with final/ by the main process.

It says what the model is and how it was made: the base model, the recipe and its
objective, the data files (by name, with their content hashes), steps, trained units,
time, hardware, precision and process layout, the final training and evaluation figures
beside the baseline evaluation, the loss curve (final/loss.png), and how to load it.

A card is shared with the model, so it names no local path: a local model or data file is
given by its file name (a demo asset by its demo: name), never the directory it sits in,
and nothing from the environment (tokens, user names) is read into it. `public_name` is
the one rule, and `model_card` checks its own text against the run's local paths."""

from __future__ import annotations

import copy
import dataclasses
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
import yaml
from huggingface_hub import try_to_load_from_cache

from ..config.validate import map_paths
from ..distributed.topology import Topology
from ..errors import warn
from ..observe.metrics import METRICS_FILE, plot_losses
from ..processor import is_vision

MAX_BASE_CARD_BYTES = 1 << 16  # the base model's README.md front matter is read from its head only


@dataclass
class CardFacts:
    """What a model card says, gathered by `gather` from the run (plain values: a test can
    build one by hand)."""

    name: str  # the model's: its output directory's name
    recipe: str  # methods.METHODS name
    base: str  # the base model, public (public_name)
    hub_base: bool  # the base is a hub name (front matter base_model)
    settings: dict  # the method's own section and the keys that shape training, public
    data: list[dict]  # {name, sha256 (local files), fraction}, public
    eval_data: list[dict]  # {name, sha256 (local files)}, public
    hub_datasets: list[str]
    steps: int
    epochs: int
    trained: int
    unit: str  # what `trained` counts: tokens, completions, prompts...
    seconds: float
    hardware: str
    precision: str
    layout: str
    loading: str  # "causal-lm", "adapter", "vision", "classifier"
    license: str = ""
    final: dict = field(default_factory=dict)  # the last training row's figures
    evals: dict = field(default_factory=dict)  # eval key -> (first value, its step, last value, its step)
    curve: bool = False  # final/loss.png is written beside the card
    tags: list[str] = field(default_factory=list)


def public_name(value: str, demo_name=None) -> str:
    """How a card names a model or data set: a demo asset by its demo: name (`demo_name(path)`
    gives it, None for others), a local file or directory by its own name only, a hub name as
    it is."""
    if not value:
        return value
    if demo_name is not None and (name := demo_name(value)):
        return name
    if os.path.isabs(value) or Path(value).exists() or value.startswith(("~", ".")):
        return Path(value).name or value
    return value


def is_hub_name(value: str) -> bool:
    """A name the Hub could hold (org/name, or a bare name) that is not a local path."""
    return bool(re.fullmatch(r"[\w.-]+(/[\w.-]+)?", value)) and not Path(value).exists() and ":" not in value


def base_license(path: str) -> str:
    """The `license` in the front matter of the base model's README.md, if it is a local
    directory that holds one (a hub model's files are local once downloaded); else ''."""
    readme = Path(path) / "README.md"
    if not Path(path).is_dir():
        try:
            found = try_to_load_from_cache(path, "README.md")
        except Exception:  # not a repo name, or no cache: no license known
            return ""
        if not isinstance(found, str):
            return ""
        readme = Path(found)
    try:
        with open(readme, "rb") as f:
            head = f.read(MAX_BASE_CARD_BYTES).decode("utf-8", errors="replace")
    except OSError:
        return ""
    match = re.match(r"---\s*\n(.*?)\n---", head, re.S)
    if not match:
        return ""
    try:
        meta = yaml.safe_load(match.group(1))
    except yaml.YAMLError:
        return ""
    value = meta.get("license") if isinstance(meta, dict) else None
    return value if isinstance(value, str) and re.fullmatch(r"[\w.+-]{1,64}", value) else ""


def eval_figures(rows: list[dict]) -> tuple[dict, dict]:
    """(the last training row's figures, {eval key: (first value, step, last value, step)})
    from metrics.jsonl's rows; eval keys are the evaluation rows' (eval_*) and lm-eval's on
    checkpoints (lm_eval/*)."""
    final = next((r for r in reversed(rows) if "loss" in r), {})
    keep = {
        k: v
        for k, v in final.items()
        if isinstance(v, (int, float)) and k not in SPEED_KEYS and not k.endswith("_per_s") and k not in UNITS
    }
    evals: dict[str, tuple] = {}
    for row in rows:  # lm-eval's rows are joined when they finish: ordered by step, not place
        step = row["step"]
        for key, value in row.items():
            if key.startswith(("eval_", "lm_eval/")) and isinstance(value, (int, float)):
                first, at, last, last_at = evals.get(key, (value, step, value, step))
                if step < at:
                    first, at = value, step
                if step >= last_at:
                    last, last_at = value, step
                evals[key] = (first, at, last, last_at)
    return keep, evals


# Figures of how fast a step ran or how big it was, not of what was learnt: left out of the
# card's results (as are rates, *_per_s).
SPEED_KEYS = {"step", "epoch", "lr", "step_s", "data_wait", "peak_mem_gib", "mfu"}
UNITS = {"tokens", "completions", "prompts", "rows", "pairs", "sequences"}  # a step's count, by Objective.unit


def _number(v) -> str:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return str(v)
    return f"{v:,}" if isinstance(v, int) else f"{v:.4g}"


def _duration(seconds: float) -> str:
    s = round(seconds)
    return f"{s // 3600} h {s % 3600 // 60} min" if s >= 3600 else f"{s // 60} min {s % 60} s"


LOADING = {
    "causal-lm": (
        "from transformers import AutoModelForCausalLM, AutoTokenizer\n\n"
        "model = AutoModelForCausalLM.from_pretrained(path)\ntokenizer = AutoTokenizer.from_pretrained(path)"
    ),
    "adapter": (
        "from peft import AutoPeftModelForCausalLM\nfrom transformers import AutoTokenizer\n\n"
        "model = AutoPeftModelForCausalLM.from_pretrained(path)  # the base model, with this LoRA adapter\n"
        "tokenizer = AutoTokenizer.from_pretrained(path)"
    ),
    "vision": (
        "from transformers import AutoModelForImageTextToText, AutoProcessor\n\n"
        "model = AutoModelForImageTextToText.from_pretrained(path)\nprocessor = AutoProcessor.from_pretrained(path)"
    ),
    "classifier": (
        "from transformers import AutoModelForSequenceClassification, AutoTokenizer\n\n"
        "model = AutoModelForSequenceClassification.from_pretrained(path)  # one score per sequence\n"
        "tokenizer = AutoTokenizer.from_pretrained(path)"
    ),
    "adapter-vision": (
        "from peft import PeftConfig, PeftModel\n"
        "from transformers import AutoModelForImageTextToText, AutoProcessor\n\n"
        "base = AutoModelForImageTextToText.from_pretrained(PeftConfig.from_pretrained(path).base_model_name_or_path)\n"
        "model = PeftModel.from_pretrained(base, path)  # the base model, with this LoRA adapter\n"
        "processor = AutoProcessor.from_pretrained(path)"
    ),
    "adapter-classifier": (
        "from peft import AutoPeftModelForSequenceClassification\nfrom transformers import AutoTokenizer\n\n"
        "model = AutoPeftModelForSequenceClassification.from_pretrained(path)  # one score per sequence\n"
        "tokenizer = AutoTokenizer.from_pretrained(path)"
    ),
}
PIPELINES = {
    "causal-lm": "text-generation",
    "adapter": "text-generation",
    "vision": "image-text-to-text",
    "adapter-vision": "image-text-to-text",
}


def render(facts: CardFacts) -> str:
    """The card's text."""
    meta: dict = {}
    if facts.hub_base:
        meta["base_model"] = facts.base
    meta["library_name"] = "peft" if facts.loading.startswith("adapter") else "transformers"
    if facts.license:
        meta["license"] = facts.license
    if facts.loading in PIPELINES:
        meta["pipeline_tag"] = PIPELINES[facts.loading]
    meta["tags"] = facts.tags
    if facts.hub_datasets:
        meta["datasets"] = facts.hub_datasets
    lines = ["---", yaml.safe_dump(meta, sort_keys=False).rstrip(), "---", ""]
    lines += [
        f"# {facts.name}",
        "",
        f"Trained from `{facts.base}` with llmtrain's `{facts.recipe}` recipe (`recipes/{facts.recipe}.py`).",
        "",
        "## Training",
        "",
        "| | |",
        "|---|---|",
        f"| steps | {facts.steps:,} (epochs begun: {facts.epochs + 1}) |",
        f"| trained {facts.unit} | {facts.trained:,} |",
        f"| time in training steps | {_duration(facts.seconds)} |",
        f"| hardware | {facts.hardware} |",
        f"| precision | {facts.precision} |",
        f"| layout | {facts.layout} |",
        "",
        "Data (training files with their SHA-256):",
        "",
    ]
    for d in facts.data + [e | {"eval": True} for e in facts.eval_data]:
        line = f"- `{d['name']}`" + (" (evaluation)" if d.get("eval") else "")
        if d.get("sha256"):
            line += f", sha256 `{d['sha256']}`"
        if d.get("fraction", 1) != 1:
            line += f", fraction {d['fraction']:g}"
        lines.append(line)
    lines += ["", "Settings (the recipe's own and those that shape training):", "", "```yaml"]
    lines += [yaml.safe_dump(facts.settings, sort_keys=False).rstrip(), "```", ""]
    lines += ["## Results", ""]
    if facts.evals:
        lines += ["| evaluation | at the start | at the end |", "|---|---|---|"]
        for key, (first, first_step, last, last_step) in facts.evals.items():
            lines.append(f"| {key} | {_number(first)} (step {first_step}) | {_number(last)} (step {last_step}) |")
        lines.append("")
    if facts.final:
        lines += ["Last training step:", "", "| | |", "|---|---|"]
        lines += [f"| {k} | {_number(v)} |" for k, v in facts.final.items()]
        lines.append("")
    if facts.curve:
        lines += ["![loss curve](loss.png)", ""]
    lines += [
        "## How to load",
        "",
        "```python",
        LOADING[facts.loading].replace("\n\n", '\n\npath = "path/to/this/directory"  # or its name on the Hub\n', 1),
        "```",
        "",
    ]
    return "\n".join(lines)


def check_public(text: str, local: list[str]) -> None:
    """Raise if the card's text holds any of the run's `local` paths (its output directory,
    its model's and data's directories, the home directory): the card is public."""
    for path in local:
        if len(path) > 1 and re.search(rf"(?<![\w./-]){re.escape(path)}(?![\w.-])", text):
            raise ValueError(f"the model card would name the local path {path}")


def settings(cfg, section: str | None, demo_name=None) -> dict:
    """The config keys a card shows: the method's own section whole, then the training
    keys that shape the run, with every path in them public (`public_name`; a grpo.rewards
    file.py:function keeps its function)."""
    public = copy.deepcopy(cfg)

    def name(key, value, kind):
        if kind.text and "{" in value:
            return "(template text)"
        if kind.parts and ":" in value:
            head, _, tail = value.rpartition(":")
            return f"{public_name(head, demo_name)}:{tail}"
        return public_name(value, demo_name)

    map_paths(public, name)
    out = {section: dataclasses.asdict(getattr(public, section))} if section else {}
    t, m, d = public.train, public.model, public.data
    shown = ["lr", "epochs", "max_steps", "micro_batch_size", "grad_accum_steps", "schedule", "warmup_steps"]
    out["train"] = {k: getattr(t, k) for k in [*shown, "weight_decay", "max_grad_norm", "seed"]}
    out["data"] = {"max_seq_len": d.max_seq_len, "packing": d.packing, "loss_on": d.loss_on}
    model = {"dtype": m.dtype, "quantization": m.quantization}
    if m.lora.enabled:
        model["lora"] = dataclasses.asdict(m.lora)
    out["model"] = model
    return out


def hardware(accelerator) -> str:
    """The processes and what each ran on, e.g. '8 x NVIDIA H200 on 2 nodes'."""
    world = accelerator.num_processes
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world) or world)
    device = accelerator.device
    if device.type == "cuda":
        what = torch.cuda.get_device_name(device)
    else:
        what = f"{device.type.upper()} ({os.cpu_count()} cores{' each' if local > 1 else ''})"
    nodes = max(1, world // max(local, 1))
    return f"{world} x {what}" + (f" on {nodes} nodes" if nodes > 1 else "")


def layout(accelerator, cfg) -> str:
    """The distributed backend and the global batch it made."""

    topology, world = Topology.of(accelerator), accelerator.num_processes
    backend = (
        f"DeepSpeed ZeRO-{topology.zero_stage}"
        if topology.deepspeed
        else "FSDP2"
        if topology.fsdp
        else "DDP"
        if world > 1
        else "one process"
    )
    t = cfg.train
    return (
        f"{backend}; {t.micro_batch_size} per micro-batch x {t.grad_accum_steps} accumulated x {world} "
        f"process(es) = {t.global_batch(world)} a step"
    )


def precision(accelerator, cfg) -> str:
    mixed = accelerator.mixed_precision
    text = f"weights {cfg.model.dtype}" + (f", {mixed} mixed precision" if mixed not in ("no", None) else "")
    if cfg.model.quantization != "none":
        text += f", base weights quantized to {cfg.model.quantization} (QLoRA)"
    return text


def gather(cfg, method, state, unit: str, accelerator, model, rows, demo_name=None) -> CardFacts:
    """The card's facts for a finished run of `method` (core/method.Method): `state` its
    TrainState, `model` the trained (unwrapped) model, `rows` its metrics.jsonl rows."""
    recipe, section = method.name, method.section

    inner = model.get_base_model() if hasattr(model, "peft_config") else model
    adapter = hasattr(model, "peft_config") and cfg.export.merge_lora is not True
    classifier = type(inner).__name__.endswith("ForSequenceClassification")
    kind = "classifier" if classifier else "vision" if is_vision(inner.config) else "causal-lm"
    loading = {"classifier": "adapter-classifier", "vision": "adapter-vision", "causal-lm": "adapter"}[kind]
    loading = loading if adapter else kind
    hashes = state.identity.get("data", {}) if isinstance(state.identity, dict) else {}
    data, hub_datasets = [], []
    for source in cfg.data.sources():
        entry = {"name": public_name(source.path, demo_name), "fraction": source.fraction}
        if source.path in hashes:
            entry["sha256"] = hashes[source.path]
        elif is_hub_name(source.path):
            hub_datasets.append(source.path)
        data.append(entry)
    eval_hashes = state.identity.get("inputs", {}).get("data.eval", {}) if isinstance(state.identity, dict) else {}
    eval_data = []
    for name in cfg.data.names("eval"):
        found = eval_hashes.get(name)
        eval_data.append({"name": public_name(name, demo_name)} | ({"sha256": found} if isinstance(found, str) else {}))
    final, evals = eval_figures(rows)
    tags = ["llmtrain", *method.tags(cfg)]
    if cfg.model.lora.enabled:
        tags.append("qlora" if cfg.model.quantization != "none" else "lora")
    if kind == "vision":
        tags.append("vision-language")
    base = cfg.model.name_or_path
    return CardFacts(
        name=Path(cfg.output_dir).name,
        recipe=recipe,
        base=public_name(base, demo_name),
        hub_base=is_hub_name(base),
        settings=settings(cfg, section, demo_name),
        data=data,
        eval_data=eval_data,
        hub_datasets=hub_datasets,
        steps=state.step,
        epochs=state.epoch,
        trained=state.trained,
        unit=unit,
        seconds=state.seconds,
        hardware=hardware(accelerator),
        precision=precision(accelerator, cfg),
        layout=layout(accelerator, cfg),
        loading=loading,
        license=base_license(base),
        final=final,
        evals=evals,
        tags=tags,
    )


def write(directory: Path, facts: CardFacts, output_dir: str, local: list[str]) -> None:
    """README.md (the card) and loss.png (its curve, when matplotlib is installed) into
    `directory`, the final/ being written. A card that would name one of the `local` paths
    is left out with a warning (never expected: every name in it went through `public_name`)."""

    metrics = Path(output_dir) / METRICS_FILE
    facts.curve = metrics.is_file() and plot_losses(metrics, directory / "loss.png")
    text = render(facts)
    try:
        check_public(text, local)
    except ValueError as e:
        warn(f"final/README.md: not written: {e}")
        (directory / "README.md").unlink(missing_ok=True)  # peft's, which names the base's path
        return
    (directory / "README.md").write_text(text)
