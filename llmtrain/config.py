"""The one typed config tree for llmtrain.

A run is described by a YAML file plus dotted `key.sub=value` overrides from the
command line. Every field has a default here (never in `cfg.get(...)` calls), a
docstring below it, and is checked at start-up before any model is loaded. All
problems are collected and reported together; each line names the key.
"""

from __future__ import annotations

import dataclasses
import difflib
import errno
import importlib.util
import math
import os
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal, Union

import yaml

from .errors import UserError, shown
from .files import size_text


class ConfigError(UserError):
    """Bad configuration. `problems` holds one line per problem, each naming its key."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("\n".join(problems))


@dataclass(frozen=True)
class Bounds:
    """The valid range of a number field. Every number is checked at start-up
    (`validate`): finite, and within its Bounds, which are "not negative" unless the
    field's annotation gives others."""

    low: float = 0
    high: float = math.inf
    low_open: bool = False  # low itself is not allowed
    high_open: bool = False  # high itself is not allowed

    def problem(self, value) -> str | None:
        if isinstance(value, int) and abs(value) >= 2**63:  # beyond what torch or the OS take
            return f"must be below 2**63, got a number of {len(str(abs(value)))} digits"
        if not math.isfinite(value):
            return f"must be a finite number, got {value}"
        too_low = value <= self.low if self.low_open else value < self.low
        too_high = value >= self.high if self.high_open else value > self.high
        return f"must be {self.describe()}, got {value}" if too_low or too_high else None

    def describe(self) -> str:
        low, high = (str(int(x)) if float(x).is_integer() else f"{x:g}" for x in (self.low, self.high))
        if self.high == math.inf:
            if self.low == 0:
                return "positive" if self.low_open else "zero or more"
            return f"above {low}" if self.low_open else f"at least {low}"
        return f"in {'(' if self.low_open else '['}{low}, {high}{')' if self.high_open else ']'}"


AT_LEAST_1 = Bounds(1)
POSITIVE = Bounds(0, low_open=True)
FRACTION = Bounds(0, 1)
BELOW_1 = Bounds(0, 1, high_open=True)


@dataclass
class LoraConfig:
    enabled: bool = False
    """Train LoRA adapters (through peft) instead of all weights."""
    r: Annotated[int, AT_LEAST_1] = 16
    """Rank of the LoRA update matrices."""
    alpha: Annotated[int, AT_LEAST_1] = 32
    """LoRA scaling numerator; the update is scaled by alpha / r."""
    dropout: Annotated[float, BELOW_1] = 0.05
    """Dropout on the LoRA input."""
    target_modules: str | list[str] = "all-linear"
    """Modules to adapt: 'all-linear' (every linear layer but the output layer and MoE
    routers, plus fused expert weights when dropout is 0) or names such as [q_proj, v_proj]."""


@dataclass
class ModelConfig:
    name_or_path: str = ""
    """Hugging Face hub name or local directory loaded with AutoModelForCausalLM.
    'demo:tiny-llama' builds the small offline demo model."""
    revision: str = ""
    """Hub revision (branch, tag or commit); empty for the default branch."""
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = "float32"
    """dtype the weights are loaded in. Keep float32 master weights and choose bf16/fp16
    compute with Accelerate's mixed_precision; bfloat16 here halves weight memory."""
    attn_implementation: str = "auto"
    """Attention backend passed to transformers: sdpa, eager, flex_attention,
    flash_attention_2, ... 'auto' takes flex_attention for packed data on a GPU (block-sparse
    masks), else sdpa where the model supports it, else flex_attention on a GPU and eager
    on CPU (Gemma 2's soft-capping, gpt-oss's sinks); llmtrain plan says which and why."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass to save memory."""
    trust_remote_code: bool = False
    """Allow model code from the hub to run. Off unless you trust the repository."""
    quantization: Literal["none", "nf4", "fp4", "int8"] = "none"
    """Load the frozen base weights quantized by bitsandbytes (QLoRA): 'nf4' or 'fp4'
    (4-bit) or 'int8'; only with model.lora.enabled. Needs pip install -e ".[qlora]"."""
    router_aux_loss: Literal["model", "train", "log"] = "model"
    """Mixture-of-experts models: the router load-balancing loss, times the model's
    router_aux_loss_coef, is trained as the model's config says (output_router_logits),
    'train': always, 'log': never; the metrics row logs it (router_aux) in each case."""
    lora: LoraConfig = field(default_factory=LoraConfig)


@dataclass
class DataSource:
    """A data.train entry written as a mapping: {path: a.jsonl, fraction: 0.5}."""

    path: str = ""
    """A file or hub data set, as a plain data.train entry."""
    fraction: Annotated[float, POSITIVE] = 1.0
    """How much of the source one epoch takes: below 1 a seeded subset of its rows, drawn
    again every epoch; above 1 whole repeats plus a seeded subset for the rest."""


@dataclass
class DataConfig:
    train: str | list[str | DataSource] = field(default_factory=list)
    """Training data: a path (jsonl, json, parquet, csv), a hub data set name
    ('owner/name' or 'owner/name:split'), or a list of these; an entry may be a mapping
    {path: ..., fraction: 0.5} to take a seeded share of that source each epoch (3: three
    times over). Streamed sources are interleaved in proportion to their fractions."""
    eval: str | list[str] = field(default_factory=list)
    """Evaluation data, same forms as data.train (without fractions); empty for none."""
    eval_fraction: Annotated[float, BELOW_1] = 0.0
    """With no data.eval, hold out this share of each training source's rows (seeded by
    train.seed) as the evaluation set; 0 for none."""
    format: Literal["auto", "text", "prompt_completion", "alpaca", "chat", "sharegpt"] = "auto"
    """Row format; 'auto' takes each row's format from the fields it fills (see README)."""
    chat_template: str = ""
    """Jinja chat template (or a path to a .jinja file) used instead of the tokenizer's."""
    loss_on: Literal["assistant", "all"] = "assistant"
    """Which tokens are trained: the assistant turns / completions (end-of-turn token
    included), or every token of the row."""
    max_seq_len: Annotated[int, AT_LEAST_1] = 1024
    """Longest sequence in tokens; packed sequences have exactly this length."""
    overlong: Literal["truncate", "drop", "error"] = "truncate"
    """What to do with a row longer than max_seq_len."""
    bad_rows: Literal["error", "skip"] = "error"
    """A malformed row (wrong types, an unknown role, unreadable content) stops the run
    naming its file and line; 'skip' drops and counts it, naming the first few."""
    max_bad_fraction: Annotated[float, FRACTION] = 0.01
    """With data.bad_rows=skip, the run stops anyway when more than this fraction of a
    split's rows are malformed."""
    system_prompt: str = ""
    """A system message put first in chat rows that have none of their own."""
    packing: bool = False
    """Pack rows into max_seq_len sequences. Samples never attend to each other and their
    positions restart at 0."""
    streaming: bool = False
    """Read data.train as a stream: rows are tokenized (and packed) while training runs,
    never prepared or cached whole; for corpora too large to prepare up front. Needs
    train.max_steps. Each process reads its own part of each source; a bad row stops the
    run with a checkpoint when it is reached. data.eval is still prepared whole."""
    shuffle_buffer: Annotated[int, AT_LEAST_1] = 10000
    """With data.streaming and data.shuffle, rows held in the shuffle buffer: each row
    read is drawn at random from a buffer of this many. Larger mixes better, at the cost
    of memory and a slower first step."""
    num_workers: Annotated[int, Bounds(0, 64)] = 0
    """DataLoader worker processes (per training process)."""
    shuffle: bool = True
    """Shuffle the training rows (or packed sequences) every epoch, seeded by train.seed;
    false keeps the order of the files (a curriculum)."""


@dataclass
class TrainConfig:
    micro_batch_size: Annotated[int, AT_LEAST_1] = 4
    """Rows (or packed sequences) per forward pass on each process."""
    grad_accum_steps: Annotated[int, AT_LEAST_1] = 1
    """Micro-batches per optimizer step on each process."""
    max_steps: int = 0
    """Optimizer steps to run; 0 means run train.epochs epochs."""
    epochs: int = 1
    """Passes over the training data when train.max_steps is 0."""
    lr: Annotated[float, POSITIVE] = 2e-5
    """Peak learning rate."""
    schedule: Literal["cosine", "linear", "constant"] = "cosine"
    """Learning-rate decay after warm-up."""
    warmup_steps: int = 0
    """Linear warm-up steps from 0 to train.lr."""
    min_lr_ratio: Annotated[float, FRACTION] = 0.0
    """Final learning rate of the cosine/linear decay, as a fraction of train.lr."""
    weight_decay: float = 0.0
    """AdamW weight decay (not applied to biases and norm weights)."""
    adam_beta1: Annotated[float, BELOW_1] = 0.9
    """AdamW beta1."""
    adam_beta2: Annotated[float, BELOW_1] = 0.999
    """AdamW beta2."""
    adam_eps: Annotated[float, POSITIVE] = 1e-8
    """AdamW epsilon."""
    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this value; 0 disables clipping."""
    seed: Annotated[int, Bounds(0, 2**32 - 1)] = 42
    """Seed for weights of new modules, data order and dropout."""
    on_nonfinite: Literal["skip", "abort"] = "skip"
    """When a step's loss or gradient norm is NaN or infinite (decided on all processes
    together, before the optimizer step): skip the step, leaving weights, optimizer and
    schedule as they were, or abort."""
    max_consecutive_skips: Annotated[int, AT_LEAST_1] = 5
    """Abort after this many skipped steps in a row."""
    spike_factor: float = 0.0
    """Loss-spike guard, off at 0: skip a step whose loss is above spike_factor times the
    median of the last spike_window accepted steps (counted like a non-finite step, so
    max_consecutive_skips bounds it). Not available under DeepSpeed, whose engine steps
    inside backward. Try 3.0 for long runs on noisy data."""
    spike_window: Annotated[int, AT_LEAST_1] = 50
    """Accepted steps the spike guard compares against; it acts once it has this many."""
    loss_chunk_tokens: int = 1024
    """Compute the cross-entropy this many tokens at a time, and only at trained positions,
    so the full fp32 logits (tokens x vocabulary) never exist; each chunk's logits are
    recomputed in backward. 0 computes whole logits. Models whose output layer is not a
    plain Linear, or whose architecture changes logits after it, always get whole logits."""
    compile: bool = False
    """torch.compile each transformer block (regional compilation: one compile serves all
    layers). The first steps are slower while it compiles. Not with DeepSpeed."""
    hang_timeout_s: int = 1800
    """A process that makes no progress for this long (another rank died or hung, so a
    collective never returns) exits with an error naming its rank and the ranks that
    stopped reporting, and the launcher stops the rest. Must exceed the longest step,
    evaluation or checkpoint write; 0 disables."""
    profile_steps: str | int = ""
    """Record a torch.profiler trace of these optimizer steps on every process, e.g.
    '10-12' or '5' (empty or 0: off). Writes output_dir/profile/steps-A-B/: a trace per
    process (rankN.<time>.pt.trace.json, for Perfetto, chrome://tracing or TensorBoard's profiler
    plugin), a table of the top operators (printed by the main process), and on CUDA a
    memory snapshot (rankN-memory.pickle, for pytorch.org/memory_viz). Skip the first
    steps, which include warm-up and compilation."""

    # Batch arithmetic, in one place for the recipe, `llmtrain plan` and DeepSpeed's config.

    def global_batch(self, world: int) -> int:
        """Sequences (rows, or packed sequences) per optimizer step on `world` processes."""
        return self.micro_batch_size * self.grad_accum_steps * world

    def steps_per_epoch(self, sequences: int, world: int) -> int:
        """Optimizer steps in one pass over `sequences` on `world` processes: the
        micro-batches are dealt out to the processes in turn, each step takes
        grad_accum_steps of a process's micro-batches, and a short last step counts."""
        per_process = math.ceil(math.ceil(sequences / self.micro_batch_size) / world)
        return math.ceil(per_process / self.grad_accum_steps)

    def total_steps(self, steps_per_epoch: int | None) -> int:
        """train.max_steps, or train.epochs passes (a stream, whose length is unknown,
        has train.max_steps)."""
        return self.max_steps or self.epochs * steps_per_epoch

    def profile_range(self) -> tuple[int, int] | None:
        """train.profile_steps as (first, last) optimizer step, both counted from 1 and
        included; None when off. Raises ValueError for text that is neither N nor A-B."""
        if not self.profile_steps:
            return None
        found = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", str(self.profile_steps))
        if found and found[1].strip("0") == "" and not found[2]:
            return None  # "0", quoted or not, is off as well
        first, last = (int(found[1]), int(found[2] or found[1])) if found else (0, 0)
        if not 1 <= first <= last:
            raise ValueError(self.profile_steps)
        return first, last


@dataclass
class EvalConfig:
    every_steps: int = 0
    """Evaluate every N optimizer steps (0: only at the end). Needs data.eval."""
    micro_batch_size: int = 0
    """Rows per evaluation forward pass; 0 uses train.micro_batch_size."""
    sample_prompts: list[str] = field(default_factory=list)
    """User messages answered by the trained model at the end of the run (printed)."""
    sample_max_new_tokens: Annotated[int, AT_LEAST_1] = 64
    """Longest generated answer for eval.sample_prompts."""


@dataclass
class LogConfig:
    every_steps: Annotated[int, AT_LEAST_1] = 1
    """Write a train row to metrics.jsonl (and the tracker) every N steps."""
    tracker: Literal["auto", "none", "tensorboard", "wandb", "mlflow"] = "auto"
    """Experiment tracker through Accelerate; 'auto' uses TensorBoard when installed."""
    project: str = "llmtrain"
    """Project name given to the tracker."""
    progress_bar: bool = True
    """Show a progress bar on the main process."""


@dataclass
class CheckpointConfig:
    every_steps: int = 0
    """Write a resumable checkpoint every N steps (0: only the final export)."""
    keep_last: int = 2
    """Complete checkpoints to keep (0 keeps all). The previous one is deleted only after
    the new one is complete."""
    resume: str = "auto"
    """'auto' continues from the newest complete checkpoint in output_dir if there is one,
    'none' starts fresh (refusing to mix with an earlier run's checkpoints), or a path to a
    checkpoint directory."""
    require_rng_state: bool = True
    """Refuse to resume from a checkpoint whose per-rank RNG state is missing or unreadable
    (resume=auto falls back to an earlier checkpoint). false resumes from it anyway, with a
    warning: random draws such as dropout then differ from the uninterrupted run."""


@dataclass
class ExportConfig:
    merge_lora: bool = False
    """For LoRA runs, write the merged full model to final/ (the adapter goes to
    final/adapter/). Without it, final/ holds the adapter."""
    max_shard_size: int | str = "5GB"
    """Largest safetensors file in final/ (bytes, or a size such as 5GB or 500MB): a
    bigger model is written as numbered shards with model.safetensors.index.json, as
    from_pretrained reads them. Under ZeRO-3 and FSDP2 the weights are gathered one shard
    at a time, so the main process holds about one shard, not the whole model."""

    def shard_bytes(self) -> int | None:
        """max_shard_size in bytes (KB, MB, GB, TB are powers of 1000, as the Hub counts
        them); None when it is not a positive size."""
        from huggingface_hub.serialization._base import parse_size_to_int

        size = self.max_shard_size
        if isinstance(size, str):
            try:
                size = parse_size_to_int(size)
            except ValueError:
                return None
        return size if size > 0 else None


@dataclass
class Config:
    output_dir: str = "runs/demo"
    """Where config.yaml, metrics.jsonl, checkpoints/ and final/ are written."""
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    log: LogConfig = field(default_factory=LogConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    export: ExportConfig = field(default_factory=ExportConfig)


@dataclass
class PreferenceConfig:
    beta: Annotated[float, POSITIVE] = 0.1
    """How far the policy may move from the reference: the scale of the log-ratios in
    the loss (recipes/dpo.py). Lower lets it move further."""
    loss: Literal["sigmoid", "ipo", "simpo"] = "sigmoid"
    """sigmoid: DPO; ipo: IPO (squared, per-token log-ratios); simpo: SimPO (per-token
    log-probs of the policy alone, no reference) (recipes/dpo.py)."""
    simpo_gamma: float = 0.5
    """SimPO's target reward margin (dpo.loss=simpo only)."""
    sft_weight: float = 0.0
    """Adds this much of the chosen answers' per-token negative log-likelihood to the
    loss (RPO); 0 for none (recipes/dpo.py)."""
    reference: str = ""
    """The reference model: empty for the policy's starting weights (with LoRA, the same
    model with its adapters off; for a full fine-tune, log-probs computed once before
    training), or a hub name or directory of another model, whose log-probs are computed
    once before training (recipes/dpo.py)."""


@dataclass
class DPOConfig(Config):
    """recipes/dpo.py's tree: every section of Config, plus dpo."""

    dpo: PreferenceConfig = field(default_factory=PreferenceConfig)


# ---------------------------------------------------------------------------------------
# Loading: YAML + dotted overrides -> typed tree, collecting every problem.


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if typing.get_origin(tp) in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if typing.get_origin(tp) is list:
        item = typing.get_args(tp)[0]
        if typing.get_origin(item) in (Union, types.UnionType):  # data.train: paths or {path, fraction}
            return "a list of strings or {path: ..., fraction: ...} mappings"
        return "a list of " + {str: "strings", int: "integers", float: "numbers"}.get(item, "values")
    if dataclasses.is_dataclass(tp):
        return "a mapping {" + ", ".join(f"{f.name}: ..." for f in dataclasses.fields(tp)) + "}"
    return {str: "a string", int: "an integer", float: "a number", bool: "true/false"}.get(tp, str(tp))


class _EntryProblems(Exception):
    """The problems of a mapping inside a list (a data.train entry), each naming its key."""

    def __init__(self, problems: list[str]):
        self.problems = problems


def _coerce(value: Any, tp: Any, key: str = "") -> Any:
    """Return `value` as type `tp`, or raise TypeError. Strings from the command line
    arrive already parsed by YAML; a few YAML 1.1 quirks (like '2e-5' being a string)
    are mended here. A mapping inside a list becomes its dataclass (`key`: the list's key,
    to name the entry's problems)."""
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise TypeError
        problems: list[str] = []
        entry = _build(tp, value, f"{key}.", problems)
        if problems:
            raise _EntryProblems(problems)
        return entry
    if origin is Literal:
        if value in typing.get_args(tp):
            return value
        raise TypeError
    if origin in (Union, types.UnionType):
        for arg in typing.get_args(tp):
            try:
                return _coerce(value, arg, key)
            except TypeError:
                continue
        raise TypeError
    if origin is list:
        if not isinstance(value, list):
            raise TypeError
        item, items = typing.get_args(tp)[0], []
        for i, v in enumerate(value):
            try:
                items.append(_coerce(v, item, f"{key}[{i}]"))
            except TypeError:  # name the entry, not the whole list
                mapping = isinstance(v, dict) and "path" in v  # data.eval=[{path: ...}]: only data.train's take one
                hint = "; give the path itself (only data.train entries are mappings)" if mapping else ""
                raise _EntryProblems([f"{key}[{i}]: expected {_type_name(item)}, got {shown(v)}{hint}"]) from None
        return items
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise TypeError
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise TypeError
    if tp is float:
        if isinstance(value, (int, float, str)) and not isinstance(value, bool):
            try:
                return float(value)
            except ValueError:
                raise TypeError from None
            except OverflowError:  # an integer beyond any float: Bounds refuses it as not finite
                return math.inf
        raise TypeError
    if tp is str:
        if isinstance(value, str):
            return value
        if value is None:
            return ""
        raise TypeError
    raise TypeError


def _closest(key: str, names: list[str]) -> str | None:
    """The valid name a typo most likely meant: a close spelling, else a shared prefix."""
    close = difflib.get_close_matches(key, names, n=1)
    if close:
        return close[0]
    related = [n for n in names if key.startswith(n) or n.startswith(key)]
    return max(related, key=len) if related else None


def _build(cls: type, raw: dict, prefix: str, problems: list[str]) -> Any:
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in raw.items():
        full = f"{prefix}{key}"
        if key not in names:
            if full == "dpo":  # recipes/dpo.py's section, in another recipe's config
                problems.append(
                    "dpo: unknown key for recipes/finetune.py; preference settings are recipes/dpo.py's: run that "
                    "recipe, or remove the dpo section"
                )
                continue
            close = _closest(str(key), names)
            hint = (
                f"; did you mean '{prefix}{close}'?"
                if close
                else f"; valid keys: {', '.join(prefix + n for n in names)}"
            )
            problems.append(f"{full}: unknown key{hint}")
            continue
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            if not isinstance(value, dict):
                problems.append(_section_problem(full, value, tp))
                continue
            kwargs[key] = _build(tp, value, f"{full}.", problems)
            continue
        try:
            kwargs[key] = _coerce(value, tp, full)
        except TypeError:
            hint = ""
            if full == "data.train" and isinstance(value, dict):
                hint = "; a source written as a mapping goes in a list: data.train=[{path: a.jsonl, fraction: 0.5}]"
            problems.append(f"{full}: expected {_type_name(tp)}, got {shown(value)}{hint}")
        except _EntryProblems as e:
            problems += e.problems
    return cls(**kwargs)


def _section_problem(dotted: str, value: Any, section: type | None) -> str:
    """A value that is not a mapping, given for a whole section: what to write instead
    (model.lora=true means model.lora.enabled=true)."""
    if isinstance(value, bool) and section is not None and "enabled" in {f.name for f in dataclasses.fields(section)}:
        on = str(value).lower()
        return f"{dotted}: is a section; to turn it {'on' if value else 'off'} set {dotted}.enabled={on}"
    return f"{dotted}: is a section; set its keys (e.g. {dotted}.<key>=value), got {shown(value)}"


def _section_type(schema: type | None, dotted: str) -> type | None:
    """The dataclass of the section at `dotted` in `schema`, or None."""
    for part in dotted.split("."):
        if schema is None or not dataclasses.is_dataclass(schema):
            return None
        schema = typing.get_type_hints(schema).get(part)
    return schema if dataclasses.is_dataclass(schema) else None


def _set_dotted(tree: dict, dotted: str, value: Any, schema: type | None = None) -> None:
    """Set tree[a][b][c] = value for 'a.b.c'. A mapping given for a section is merged
    into it key by key (train={lr: 1e-4} changes only train.lr); a value that is not a
    mapping never replaces a section, nor is a section made inside one."""
    parts = dotted.split(".")
    if not all(parts):
        raise ConfigError([f"{dotted or '(empty)'}={shown(value)}: the key has an empty part; write key.sub=value"])
    node = tree
    for i, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            above = ".".join(parts[: i + 1])
            raise ConfigError([f"{dotted}: {above} is set to {shown(child)}, not a section; set {above} as a section"])
        node = child
    last, old = parts[-1], node.get(parts[-1])
    if isinstance(old, dict) and isinstance(value, dict):
        for key, sub in value.items():
            _set_dotted(old, str(key), sub, _section_type(schema, dotted))
    elif isinstance(old, dict) and value != old:
        raise ConfigError([_section_problem(dotted, value, _section_type(schema, dotted))])
    else:
        node[last] = value


def parse_override(text: str) -> tuple[str, Any]:
    """'train.lr=2e-5' -> ('train.lr', 2e-5). Values are parsed as YAML, so lists work:
    data.train=[a.jsonl,b.jsonl]."""
    if "=" not in text:
        raise ConfigError([f"{text}: overrides look like key.sub=value (e.g. train.lr=2e-5)"])
    key, raw = text.split("=", 1)
    try:
        value = yaml.load(raw, Loader=BoundedLoader) if raw != "" else ""
    except TooLarge as e:
        raise ConfigError([f"{key.strip()}: the value given on the command line {e}"]) from None
    except yaml.YAMLError:
        value = raw
    return key.strip(), value


MAX_CONFIG_BYTES = 1 << 20  # a config file; long texts (a chat template) belong in files of their own
MAX_YAML_DEPTH = 32  # mappings and lists inside each other; a config needs 3 or 4
MAX_YAML_SIZE = 4 << 20  # nodes plus characters of a document, counted with its aliases expanded


class TooLarge(yaml.YAMLError):
    """A YAML document past a bound: nested too deeply, or too large once its aliases are
    expanded (a "billion laughs" document: a few lines whose aliases repeat each other)."""

    def __init__(self, message: str, line: int):
        self.line = line
        super().__init__(message)


class BoundedLoader(yaml.SafeLoader):
    """YAML's safe loader with bounds checked on the composed node graph, before any
    Python object is built: nesting at most MAX_YAML_DEPTH levels (the composer recurses,
    so a deeper document would end in a RecursionError), and at most MAX_YAML_SIZE nodes
    and characters once aliases are expanded (the constructor shares an aliased value, but
    whatever walks the result, an error message quoting it, a comparison, walks it
    expanded). PyYAML bounds neither."""

    _depth = 0

    def compose_node(self, parent, index):
        if self._depth >= MAX_YAML_DEPTH:
            line = self.peek_event().start_mark.line + 1
            raise TooLarge(f"is nested more than {MAX_YAML_DEPTH} levels deep; flatten it", line)
        self._depth += 1
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def compose_document(self):
        node = super().compose_document()
        _expanded_size(node, {}, set())
        return node


def _expanded_size(node, sizes: dict, open_: set) -> int:
    """Nodes plus scalar characters under `node`, aliases counted each time they occur;
    memoized per node, so it takes time linear in the document as written."""
    key = id(node)
    if key in sizes:
        return sizes[key]
    line = node.start_mark.line + 1
    if key in open_:
        raise TooLarge("holds an alias (*name) inside the value it names; write it out", line)
    open_.add(key)
    if isinstance(node, yaml.ScalarNode):
        size = 1 + len(node.value)
    else:
        children = node.value if isinstance(node, yaml.SequenceNode) else [n for pair in node.value for n in pair]
        size = 1
        for child in children:
            size += _expanded_size(child, sizes, open_)
            if size > MAX_YAML_SIZE:
                raise TooLarge(
                    f"is larger than {MAX_YAML_SIZE} nodes and characters once its aliases (*name) are expanded; "
                    "write the values out instead of repeating aliases",
                    line,
                )
    open_.discard(key)
    sizes[key] = size
    return size


class DuplicateKey(yaml.YAMLError):
    def __init__(self, key, line: int, first: int):
        self.line = line
        super().__init__(f"'{key}' is given twice (first on line {first}); give each key once")


class BadKey(yaml.YAMLError):
    def __init__(self, key, line: int):
        self.line = line
        kind = {list: "a list", dict: "a mapping"}.get(type(key), type(key).__name__)
        super().__init__(f"a key here is {kind}, not a name; keys are plain names such as lr")


class UniqueKeyLoader(BoundedLoader):
    """YAML's safe loader, except that a key given twice in one mapping is an error: the
    plain loader keeps the last, so a second `train:` block would silently replace the
    first. Keys merged in with `<<: *anchor` may be overridden, as YAML intends."""

    def construct_mapping(self, node, deep=False):
        seen: dict = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<`, resolved by the loader
                continue
            key = self.construct_object(key_node, deep=deep)
            line = key_node.start_mark.line + 1
            if not isinstance(key, (str, int, float, bool)) and key is not None:
                raise BadKey(key, line)
            if key in seen:
                raise DuplicateKey(key, line, seen[key])
            seen[key] = line
        return super().construct_mapping(node, deep)


def load_config(path: str | Path | None = None, overrides: list[str] | tuple = (), schema: type = Config) -> Config:
    """Load a YAML file (optional) and apply dotted overrides into `schema` (Config, or a
    recipe's extension of it such as DPOConfig); validate everything."""
    raw: dict = {}
    problems: list[str] = []
    if path is not None:
        path = Path(path)
        try:
            exists, regular = path.exists(), path.is_file()
        except (OSError, ValueError):  # a name too long for a path, or with a null character
            why = f"--config: {shown(str(path))} cannot be a path; give the path of a YAML file"
            raise ConfigError([why]) from None
        if not exists:
            raise ConfigError([f"--config: no such file: {path}"])
        if not regular:
            raise ConfigError([f"--config: {path} is not a regular file; give a YAML file"])
        try:
            with open(path, "rb") as f:
                data = f.read(MAX_CONFIG_BYTES + 1)
        except OSError as e:
            raise ConfigError([f"--config: cannot read {path} ({e.strerror}); check its permissions"]) from None
        if len(data) > MAX_CONFIG_BYTES:
            raise ConfigError(
                [
                    f"--config: {path} is larger than {size_text(MAX_CONFIG_BYTES)}, more than any config needs; "
                    "put long texts (data.chat_template) in files of their own and give their paths"
                ]
            )
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            line = data[: e.start].count(b"\n") + 1
            raise ConfigError([f"{path}:{line}: not UTF-8 text; save the file as UTF-8"]) from None
        try:
            loaded = yaml.load(text, Loader=UniqueKeyLoader)
        except (DuplicateKey, BadKey) as e:
            raise ConfigError([f"{path}:{e.line}: {e}"]) from None
        except TooLarge as e:
            raise ConfigError([f"{path}:{e.line}: the document {e}"]) from None
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f"{path}:{mark.line + 1}" if mark else str(path)
            raise ConfigError([f"{where}: invalid YAML ({getattr(e, 'problem', e)})"]) from None
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(
                [
                    f"{path}: the top level must be a mapping of sections; write e.g. 'train:' with its keys "
                    "indented below"
                ]
            )
        raw = loaded
    for item in overrides:
        key, value = parse_override(item)
        _set_dotted(raw, key, value, schema)
    cfg = _build(schema, raw, "", problems)
    expand_home(cfg)
    # A key whose value was refused keeps its default; validate would call that missing too.
    refused = {re.split(r"[:\[]", q, maxsplit=1)[0] for q in problems}
    problems += [q for q in validate(cfg) if q.split(":", 1)[0] not in refused]
    if problems:
        raise ConfigError(problems)
    return cfg


# What Accelerate imports for each log.tracker: without it, it logs nothing and only warns.
TRACKER_MODULES = {"tensorboard": ("tensorboard", "tensorboardX"), "wandb": ("wandb",), "mlflow": ("mlflow",)}


def _expand(value):
    """`~` or `~user` at the start of a path, expanded; anything else (a hub name, inline
    template text) as it is."""
    if isinstance(value, str) and re.match(r"~[\w.-]*(/|$)", value):
        return os.path.expanduser(value)
    return value


def expand_home(cfg: Config) -> None:
    """Expand `~` in every path-valued key alike, whether it came from the YAML file or a
    dotted override (a shell expands it in neither: not inside YAML, not after `key=`).
    Without this, output_dir: ~/runs/x would make a directory named `~`."""
    cfg.output_dir = _expand(cfg.output_dir)
    cfg.model.name_or_path = _expand(cfg.model.name_or_path)
    cfg.checkpoint.resume = _expand(cfg.checkpoint.resume)
    cfg.data.chat_template = _expand(cfg.data.chat_template)
    for key in ("train", "eval"):
        value = getattr(cfg.data, key)
        entries = [
            dataclasses.replace(e, path=_expand(e.path)) if isinstance(e, DataSource) else _expand(e)
            for e in (value if isinstance(value, list) else [value])
        ]
        setattr(cfg.data, key, entries if isinstance(value, list) else entries[0])
    if hasattr(cfg, "dpo"):
        cfg.dpo.reference = _expand(cfg.dpo.reference)


def validate(cfg: Config) -> list[str]:
    """Range and consistency checks; returns one line per problem."""
    p = []
    t = cfg.train
    if not cfg.model.name_or_path:
        p.append("model.name_or_path: required; a hub name or a local model directory")
    if not cfg.data.train:
        p.append("data.train: required; a path, a list of paths, or a hub data set name")
    if not cfg.output_dir:
        p.append("output_dir: required; give the directory the run writes to, e.g. output_dir=runs/my-run")
    if not cfg.checkpoint.resume.strip():
        p.append("checkpoint.resume: empty; give auto, none or a checkpoint directory (output_dir/checkpoints/step-N)")
    for key, names in (("data.train", cfg.data.train), ("data.eval", cfg.data.eval)):
        if isinstance(names, list):
            p += [
                f"{key}[{i}]{'.path' if isinstance(n, DataSource) else ''}: empty; give a file path or a hub data "
                "set name"
                for i, n in enumerate(names)
                if not getattr(n, "path", n)
            ]
    for i, entry in enumerate(cfg.data.train if isinstance(cfg.data.train, list) else []):
        if isinstance(entry, DataSource):
            p += [f"data.train[{i}].{why}" for why in number_problems(entry)]
    if cfg.data.eval_fraction and cfg.data.eval:
        p.append("data.eval_fraction: data.eval is set too; give one of them (data.eval_fraction=0 keeps data.eval)")
    if cfg.data.eval_fraction and cfg.data.streaming:
        p.append("data.eval_fraction: a stream cannot hold rows out ahead; give data.eval, or set data.eval_fraction=0")
    if cfg.data.streaming and t.max_steps == 0:
        p.append("data.streaming: a stream's length is not known ahead; set train.max_steps")
    if t.max_steps == 0 and t.epochs == 0:
        p.append(f"train.epochs: must be at least 1 when train.max_steps is 0, got {t.epochs}")
    if t.spike_factor and math.isfinite(t.spike_factor) and not t.spike_factor > 1:
        p.append(f"train.spike_factor: must be above 1 (or 0 to turn the guard off), got {t.spike_factor}")
    try:
        t.profile_range()
    except ValueError:
        p.append(
            f"train.profile_steps: expected a step or a range of steps such as 10-12 (counted from 1), "
            f"got {shown(t.profile_steps)}"
        )
    tracker = cfg.log.tracker
    if tracker in TRACKER_MODULES and not any(importlib.util.find_spec(m) for m in TRACKER_MODULES[tracker]):
        p.append(f"log.tracker: {tracker} is not installed; pip install {tracker}, or set log.tracker=none")
    if cfg.eval.every_steps and not (cfg.data.eval or cfg.data.eval_fraction):
        p.append("eval.every_steps: set data.eval (or data.eval_fraction) too, or set eval.every_steps=0")
    from .data import chat_template_problem

    paths = path_problems(cfg)
    p += paths
    looked_up = not any(q.startswith("data.chat_template:") for q in paths)
    if looked_up and (problem := chat_template_problem(cfg.data)) is not None:
        p.append(problem)
    lora = cfg.model.lora
    p += demo_name_problems(cfg)
    if cfg.export.merge_lora and not lora.enabled:
        p.append("export.merge_lora: only applies with model.lora.enabled=true")
    if cfg.export.shard_bytes() is None:
        p.append(
            f"export.max_shard_size: {cfg.export.max_shard_size} is not a positive size; give bytes "
            "or a number with KB, MB, GB or TB, such as 5GB"
        )
    if cfg.model.quantization != "none" and not lora.enabled:
        p.append(
            f"model.quantization: {cfg.model.quantization} weights cannot be trained directly; set "
            "model.lora.enabled=true (QLoRA: adapters on the quantized base) or model.quantization=none"
        )
    if isinstance(cfg, DPOConfig):
        if cfg.dpo.loss == "simpo" and cfg.dpo.reference:
            p.append("dpo.reference: dpo.loss=simpo uses no reference model; remove dpo.reference")
        if cfg.data.streaming:
            p.append("data.streaming: recipes/dpo.py prepares its pairs whole; set data.streaming=false")
        if cfg.data.format != "auto":
            p.append(
                f"data.format: recipes/dpo.py tells pair shapes by their fields; remove data.format={cfg.data.format}"
            )
        if cfg.data.loss_on != "assistant":
            p.append("data.loss_on: recipes/dpo.py trains the answers only; remove data.loss_on=all")
    return p + number_problems(cfg)


def demo_name_problems(cfg: Config) -> list[str]:
    """A `demo:` name that is none of the demo's assets (a typo would otherwise be looked
    up on the hub), with the closest one."""
    from .demo import DEMO_NAMES, named

    problems = []
    for key, name in named(cfg):
        if isinstance(name, str) and name.startswith("demo:") and name not in DEMO_NAMES:
            close = _closest(name, list(DEMO_NAMES))
            hint = f"did you mean {close}? " if close else ""
            problems.append(f"{key}: {name} is not one of the demo's assets; {hint}they are {', '.join(DEMO_NAMES)}")
    return problems


def path_problems(cfg: Config) -> list[str]:
    """A name the config gives as a path (or hub name) that no filesystem can look up: too
    long (a part over 255 bytes, or the whole over 4096, on Linux) or holding a null
    character. Every later look-up (exists, is_file) would raise on it."""
    from .demo import named

    template = cfg.data.chat_template
    names = [
        *named(cfg),
        ("output_dir", cfg.output_dir),
        ("checkpoint.resume", cfg.checkpoint.resume),
        ("data.chat_template", template if "{" not in template else ""),
    ]
    problems = []
    for key, name in names:
        if not isinstance(name, str) or not name:
            continue
        try:
            os.stat(os.path.expanduser(name))
        except OSError as e:
            if e.errno == errno.ENAMETOOLONG:
                problems.append(
                    f"{key}: a name of {len(name)} characters ({shown(name)}), longer than a path may be; "
                    "give a shorter path or name"
                )
        except ValueError:  # a null character
            problems.append(f"{key}: {shown(name)} holds a null character, which no path may; remove it")
    return problems


def number_problems(node, prefix: str = "") -> list[str]:
    """Every int and float field of the tree against its Bounds (see `Bounds`)."""
    problems = []
    hints = typing.get_type_hints(type(node), include_extras=True)
    for f in dataclasses.fields(node):
        tp, value = hints[f.name], getattr(node, f.name)
        if dataclasses.is_dataclass(value):
            problems += number_problems(value, f"{prefix}{f.name}.")
            continue
        base, *extras = typing.get_args(tp) if typing.get_origin(tp) is Annotated else (tp,)
        if base in (int, float):
            bounds = next((e for e in extras if isinstance(e, Bounds)), Bounds())
            if (why := bounds.problem(value)) is not None:
                problems.append(f"{prefix}{f.name}: {why}")
    return problems


def as_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


def to_yaml(cfg: Config) -> str:
    return yaml.safe_dump(as_dict(cfg), sort_keys=False)


def flat_dict(cfg: Config) -> dict:
    """{'train.lr': 2e-5, ...} for trackers, which want scalars."""
    out = {}

    def walk(d: dict, prefix: str):
        for k, v in d.items():
            if isinstance(v, dict):
                walk(v, f"{prefix}{k}.")
            else:
                out[f"{prefix}{k}"] = v if isinstance(v, (int, float, str, bool)) else str(v)

    walk(as_dict(cfg), "")
    return out


def field_docs() -> list[tuple[str, str, str]]:
    """(dotted key, default, docstring) for every leaf field, read from this file's source
    so the reference can never drift from the schema."""
    import ast
    import inspect
    import json
    import sys

    tree = ast.parse(inspect.getsource(sys.modules[__name__]))
    docs: dict[tuple[str, str], str] = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            body = node.body
            for a, b in zip(body, body[1:]):
                if isinstance(a, ast.AnnAssign) and isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant):
                    docs[(node.name, a.target.id)] = " ".join(b.value.value.split())
    rows = []

    def walk(cls, prefix):
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if dataclasses.is_dataclass(hints[f.name]):
                walk(hints[f.name], f"{prefix}{f.name}.")
                continue
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            doc = next((docs[(c.__name__, f.name)] for c in cls.__mro__ if (c.__name__, f.name) in docs), "")
            rows.append((f"{prefix}{f.name}", json.dumps(default), doc))

    walk(DPOConfig, "")  # every recipe's keys: Config's, then the dpo section
    return rows


if __name__ == "__main__":
    print("| key | default | meaning |\n| --- | --- | --- |")
    for key, default, doc in field_docs():
        print(f"| `{key}` | `{default}` | {doc} |")
