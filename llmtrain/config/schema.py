"""The one typed config tree: a dataclass per section, a docstring below every field (the
configuration reference is generated from them, `python -m llmtrain.config`), the batch
arithmetic, and each section's own checks (`problems()`), which Config gathers with the
checks between sections. Loading a YAML file and overrides into it is load.py's.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import inspect
import json
import math
import re
import textwrap
import typing
from dataclasses import dataclass, field
from typing import Annotated, ClassVar, Literal

from ..errors import shown
from .validate import (
    ASSET,
    AT_LEAST_1,
    BELOW_1,
    FRACTION,
    PATH,
    PATH_OR_TEXT,
    PATHS_IN_NAME,
    POSITIVE,
    Bounds,
    chat_template_problem,
    demo_name_problems,
    number_problems,
    path_problems,
    resolve_chat_template,
    tracker_problem,
)


def as_list(value) -> list:
    """A key that takes one entry or a list of them (data.train, data.eval), as a list."""
    return [value] if isinstance(value, str) and value else list(value or [])


@dataclass
class LoraConfig:
    enabled: bool = False
    """Train LoRA adapters (through peft) instead of all weights."""
    r: Annotated[int, AT_LEAST_1] = 16
    """Rank of the LoRA update matrices."""
    alpha: Annotated[int, AT_LEAST_1] = 32
    """LoRA scaling numerator; the update is scaled by alpha / r."""
    dropout: Annotated[float, BELOW_1] = 0.0
    """Dropout on the LoRA input. 0 (peft's default too) keeps a step's update the same for
    every batch layout and lets 'all-linear' adapt fused expert weights; dropout draws its
    masks per micro-batch, so 8 x 1 and 2 x 4 then differ by the draw."""
    target_modules: str | list[str] = "all-linear"
    """Modules to adapt: 'all-linear' (every linear layer but the output layer and MoE
    routers, plus fused expert weights when dropout is 0) or names such as [q_proj, v_proj]."""
    projector: bool = False
    """Vision-language models with model.freeze_vision: also adapt every linear layer of the
    projector that carries image features into the language model (LLaVA's, Idefics3's,
    Qwen-VL's merger), besides the language model's target_modules; the vision tower stays
    without adapters."""


@dataclass
class ModelConfig:
    name_or_path: Annotated[str, ASSET] = ""
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
    dropout: Literal["model", "none"] = "model"
    """The model's own random draws in training, in finetune.py and distill.py: the dropout
    rates its config sets (GPT-2's 0.1; LoRA's is model.lora.dropout) and its
    mixture-of-experts routers' jitter (Mixtral's router_jitter_noise). 'model' keeps them,
    as TRL's SFTTrainer does; 'none' sets every one to 0, so any batch layout gives the same
    update. dpo.py, reward.py and grpo.py always turn them off."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass to save memory."""
    trust_remote_code: bool = False
    """Allow model code from the hub to run. Off unless you trust the repository."""
    quantization: Literal["none", "nf4", "fp4", "int8"] = "none"
    """Load the frozen base weights quantized by bitsandbytes (QLoRA): 'nf4' or 'fp4'
    (4-bit) or 'int8'; only with model.lora.enabled. Needs pip install -e ".[qlora]"."""
    head: Literal["auto", "lm", "score"] = "auto"
    """The head on the model's body, which the recipe decides (auto): 'lm', its
    language-modelling head (AutoModelForCausalLM: finetune.py, dpo.py, grpo.py); 'score',
    one number per sequence (AutoModelForSequenceClassification with one label:
    recipes/reward.py). Another recipe's head is an error."""
    router_aux_loss: Literal["model", "train", "log"] = "model"
    """Mixture-of-experts models: the router load-balancing loss, times the model's
    router_aux_loss_coef, is trained as the model's config says (output_router_logits),
    'train': always, 'log': never; the metrics row logs it (router_aux) in each case."""
    freeze_vision: bool = True
    """Vision-language models (loaded with AutoModelForImageTextToText and their processor):
    keep the vision tower and the projector into the language model frozen, training the
    language model alone (LoRA then adapts its layers only); false trains them too."""
    lora: LoraConfig = field(default_factory=LoraConfig)

    def problems(self) -> list[str]:
        p = []
        if not self.name_or_path:
            p.append("model.name_or_path: required; a hub name or a local model directory")
        if self.quantization != "none" and not self.lora.enabled:
            p.append(
                f"model.quantization: {self.quantization} weights cannot be trained directly; set "
                "model.lora.enabled=true (QLoRA: adapters on the quantized base) or model.quantization=none"
            )
        return p


@dataclass
class DataSource:
    """A data.train entry written as a mapping: {path: a.jsonl, fraction: 0.5}."""

    path: Annotated[str, ASSET] = ""
    """A file or hub data set, as a plain data.train entry."""
    fraction: Annotated[float, POSITIVE] = 1.0
    """How much of the source one epoch takes: below 1 a seeded subset of its rows, drawn
    again every epoch; above 1 whole repeats plus a seeded subset for the rest."""


@dataclass
class DataConfig:
    train: Annotated[str | list[str | DataSource], ASSET] = field(default_factory=list)
    """Training data: a path (jsonl, json, parquet, csv), a hub data set name
    ('owner/name' or 'owner/name:split'), or a list of these; an entry may be a mapping
    {path: ..., fraction: 0.5} to take a seeded share of that source each epoch (3: three
    times over). Streamed sources are interleaved in proportion to their fractions."""
    eval: Annotated[str | list[str], ASSET] = field(default_factory=list)
    """Evaluation data, same forms as data.train (without fractions); empty for none."""
    eval_fraction: Annotated[float, BELOW_1] = 0.0
    """With no data.eval, hold out this share of each training source's rows (seeded by
    train.seed) as the evaluation set; 0 for none."""
    format: Literal["auto", "text", "prompt_completion", "alpaca", "chat", "sharegpt"] = "auto"
    """Row format; 'auto' takes each row's format from the fields it fills (see docs/data.md)."""
    chat_template: Annotated[str, PATH_OR_TEXT] = ""
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
    max_images: Annotated[int, Bounds(0, 1024)] = 16
    """Images one row may hold (vision-language models); a row with more is malformed."""
    max_image_bytes: Annotated[int, AT_LEAST_1] = 32 << 20
    """Largest image file read, in bytes; a larger one makes its row malformed."""
    max_image_pixels: Annotated[int, AT_LEAST_1] = 40_000_000
    """Largest image decoded, in pixels (width x height, checked before decoding); a
    larger one makes its row malformed. The processor then resizes it as the model needs."""
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
    """DataLoader worker processes (per training process). With data.streaming they also
    set the order rows are read in (each reads shards of its own), so a resume keeps it."""
    shuffle: bool = True
    """Shuffle the training rows (or packed sequences) every epoch, seeded by train.seed;
    false keeps the order of the files (a curriculum), packed too: rows then fill each
    sequence in their order, less tightly than the length-sorted packing."""

    def sources(self) -> list[DataSource]:
        """data.train's entries, each a DataSource (a plain path or hub name takes fraction 1)."""
        return [v if isinstance(v, DataSource) else DataSource(v) for v in as_list(self.train)]

    def names(self, split: str = "train") -> list[str]:
        """The paths or hub names of data.train (split 'train') or data.eval ('eval')."""
        return [v.path if isinstance(v, DataSource) else v for v in as_list(getattr(self, split))]

    def chat_template_text(self) -> str | None:
        """The template to put on the tokenizer: data.chat_template's text (read from its
        file where it names one), or None for the tokenizer's own."""
        return resolve_chat_template(self.chat_template)

    def problems(self) -> list[str]:
        p = []
        if not self.train:
            p.append("data.train: required; a path, a list of paths, or a hub data set name")
        for key, names in (("data.train", self.train), ("data.eval", self.eval)):
            if isinstance(names, list):
                p += [
                    f"{key}[{i}]{'.path' if isinstance(n, DataSource) else ''}: empty; give a file path or a hub "
                    "data set name"
                    for i, n in enumerate(names)
                    if not getattr(n, "path", n)
                ]
        for i, entry in enumerate(self.train if isinstance(self.train, list) else []):
            if isinstance(entry, DataSource):
                p += [f"data.train[{i}].{why}" for why in number_problems(entry)]
        if self.eval_fraction and self.eval:
            p.append(
                "data.eval_fraction: data.eval is set too; give one of them (data.eval_fraction=0 keeps data.eval)"
            )
        if self.eval_fraction and self.streaming:
            p.append(
                "data.eval_fraction: a stream cannot hold rows out ahead; give data.eval, or set data.eval_fraction=0"
            )
        return p


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
    loss_chunk_logits: int = 2**27
    """Compute the loss at most this many logits (positions x vocabulary) at a time, and only
    at trained positions, so the full fp32 logits never exist: 2**27 is 1024 positions of a
    128k vocabulary (0.5 GiB of fp32 logits), 4096 of a 32k one. With more than one chunk each
    chunk's logits are recomputed in backward. 0 computes whole logits. Models whose output
    layer is not a plain Linear, or whose architecture changes logits after it, always get
    whole logits."""
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

    def problems(self) -> list[str]:
        p = []
        if self.max_steps == 0 and self.epochs == 0:
            p.append(f"train.epochs: must be at least 1 when train.max_steps is 0, got {self.epochs}")
        if self.spike_factor and math.isfinite(self.spike_factor) and not self.spike_factor > 1:
            p.append(f"train.spike_factor: must be above 1 (or 0 to turn the guard off), got {self.spike_factor}")
        try:
            self.profile_range()
        except ValueError:
            p.append(
                f"train.profile_steps: expected a step or a range of steps such as 10-12 (counted from 1), "
                f"got {shown(self.profile_steps)}"
            )
        return p


@dataclass
class EvalTask:
    """An eval.tasks entry: a generation task, prompts answered by the model and scored."""

    name: str = ""
    """The task's name: its figures are eval_<name>/reward, eval_<name>/reward_<function>,
    eval_<name>/pass@<k> (letters, digits, _ and -)."""
    prompts: Annotated[str, ASSET] = ""
    """Prompt rows, as recipes/grpo.py reads them: a 'prompt' (a string or messages) and the
    columns the reward functions read ('answer' for accuracy)."""
    rewards: Annotated[str | list[str], PATHS_IN_NAME] = field(default_factory=lambda: ["accuracy"])
    """Functions that score each answer, as grpo.rewards names them: accuracy, format,
    reward_model:DIR, module:function or path/to/file.py:function."""
    format_pattern: str = ""
    """The regular expression the 'format' function asks a whole answer to match."""
    samples: Annotated[int, AT_LEAST_1] = 1
    """Answers per prompt: 1 is greedy; more are sampled at its temperature, each
    with a seed of its own (the same at every evaluation), and give pass@k for k up to this."""
    temperature: Annotated[float, POSITIVE] = 1.0
    """Sampling temperature for samples > 1."""
    max_new_tokens: Annotated[int, AT_LEAST_1] = 64
    """Longest answer; a prompt must leave room for it within data.max_seq_len."""
    pass_threshold: float = 1.0
    """The score at which an answer passes a function, for pass@k."""

    def reward_names(self) -> list[str]:
        return as_list(self.rewards)


@dataclass
class EvalConfig:
    every_steps: int = 0
    """Evaluate every N optimizer steps too (0: only before the first step, the baseline, and
    after the last). Needs data.eval or eval.tasks."""
    micro_batch_size: int = 0
    """Rows per evaluation forward pass; 0 uses train.micro_batch_size."""
    sample_prompts: list[str] = field(default_factory=list)
    """User messages answered by the trained model at the end of the run (printed)."""
    sample_max_new_tokens: Annotated[int, AT_LEAST_1] = 64
    """Longest generated answer for eval.sample_prompts."""
    lm_eval_tasks: list[str] = field(default_factory=list)
    """lm-evaluation-harness tasks `llmtrain eval` runs on each model (pip install -e
    ".[eval]"): names lm-eval knows, or tasks defined in eval.lm_eval_include."""
    lm_eval_include: Annotated[str, PATH] = ""
    """A folder of lm-eval task definitions (YAML) of your own, found by name in
    eval.lm_eval_tasks; with local data files they run offline."""
    lm_eval_limit: Annotated[int, Bounds(0)] = 0
    """Examples per lm-eval task (0: all): a quick look, not a score to report."""
    tasks: list[EvalTask] = field(default_factory=list)
    """Generation tasks, evaluated with the held-out loss (before the first step, every
    eval.every_steps, after the last; and by `llmtrain eval`), in any recipe: a list of
    {name, prompts, rewards, samples, ...} mappings (see eval.tasks[].* below)."""

    def problems(self) -> list[str]:
        p = []
        if self.lm_eval_tasks and importlib.util.find_spec("lm_eval") is None:
            p.append('eval.lm_eval_tasks: lm-eval is not installed; pip install -e ".[eval]" (or pip install lm_eval)')
        seen = set()
        for i, task in enumerate(self.tasks):
            key = f"eval.tasks[{i}]"
            if not re.fullmatch(r"[A-Za-z0-9_-]+", task.name):
                p.append(f"{key}.name: give a name of letters, digits, _ and - (eval_<name>/...); got {task.name!r}")
            elif task.name in seen:
                p.append(f"{key}.name: {task.name!r} names an earlier task too; give each task a name of its own")
            seen.add(task.name)
            if not task.prompts:
                p.append(f"{key}.prompts: required; give a file of prompt rows (a 'prompt' column)")
            if not task.reward_names():
                p.append(f"{key}.rewards: give at least one function that scores the answers, e.g. [accuracy]")
        return p


@dataclass
class LogConfig:
    every_steps: Annotated[int, AT_LEAST_1] = 1
    """Write a train row to metrics.jsonl (and the tracker) every N steps."""
    tracker: Literal["auto", "none", "tensorboard", "trackio", "wandb", "mlflow"] = "auto"
    """Experiment tracker through Accelerate; 'auto' uses TensorBoard when installed. The
    run is named after output_dir. TensorBoard writes to output_dir/logs, trackio to its own
    local database (TRACKIO_DIR; `trackio show`), wandb to output_dir/logs/wandb (online, or
    offline with WANDB_MODE=offline)."""
    project: str = "llmtrain"
    """Project name given to the tracker."""
    progress_bar: bool = True
    """Show training progress on the main process: a bar on a terminal, else (a log file, a
    pipe) its figures as a line every 30 s."""

    def problems(self) -> list[str]:
        return [problem] if (problem := tracker_problem(self.tracker)) else []


@dataclass
class CheckpointConfig:
    every_steps: int = 0
    """Write a resumable checkpoint every N steps (0: by time alone, every_minutes)."""
    every_minutes: float = 30.0
    """Also write one once this many minutes have passed since the last checkpoint (or the
    start of training), so a crash or a killed job loses at most that much; 0: off. All
    processes write it after the same step."""
    keep_last: int = 2
    """Complete checkpoints to keep (0 keeps all). The previous one is deleted only after
    the new one is complete."""
    resume: Annotated[str, PATH] = "auto"
    """'auto' continues from the newest complete checkpoint in output_dir if there is one,
    'none' starts fresh (refusing to mix with an earlier run's checkpoints), or a path to a
    checkpoint directory."""
    require_rng_state: bool = True
    """Refuse to resume from a checkpoint whose per-rank RNG state is missing or unreadable
    (resume=auto falls back to an earlier checkpoint). false resumes from it anyway, with a
    warning: random draws such as dropout then differ from the uninterrupted run."""
    write_retry_s: int = 1800
    """How long to keep trying again, once a minute, a checkpoint or final/ that could not
    be written (a full disk, no permission): the steps since the last complete checkpoint
    are only in memory, and before the first checkpoint that is the whole run. A stop signal while
    waiting gives up; 0 gives up at once."""

    def problems(self) -> list[str]:
        if not 0 <= self.every_minutes < math.inf:
            return [f"checkpoint.every_minutes: {self.every_minutes} is not a number of minutes >= 0 (0: off)"]
        if self.write_retry_s < 0:
            return [f"checkpoint.write_retry_s: {self.write_retry_s} is negative; give seconds (0 gives up at once)"]
        if not self.resume.strip():
            return [
                "checkpoint.resume: empty; give auto, none or a checkpoint directory (output_dir/checkpoints/step-N)"
            ]
        return []


@dataclass
class ExportConfig:
    merge_lora: bool | Literal["auto"] = "auto"
    """For LoRA runs, true writes the merged full model to final/ (the adapter goes to
    final/adapter/), false the adapter alone. auto: merged for recipes/reward.py, whose
    final/ must score text in plain transformers, the adapter for the other recipes."""
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

    def problems(self) -> list[str]:
        if self.shard_bytes() is None:
            return [
                f"export.max_shard_size: {self.max_shard_size} is not a positive size; give bytes "
                "or a number with KB, MB, GB or TB, such as 5GB"
            ]
        return []


@dataclass
class Config:
    RECIPE: ClassVar[str] = "recipes/finetune.py"  # the recipe that reads this tree
    HEAD: ClassVar[str] = "lm"  # the model.head the recipe trains
    MERGES_LORA: ClassVar[bool] = False  # what export.merge_lora=auto means for a LoRA run

    output_dir: Annotated[str, PATH] = "runs/demo"
    """Where config.yaml, metrics.jsonl, checkpoints/ and final/ are written. A config file
    that sets none gets runs/ and the file's name without its ending (my_sft.yaml:
    runs/my_sft), so that runs of different configs never share a directory."""
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    log: LogConfig = field(default_factory=LogConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    export: ExportConfig = field(default_factory=ExportConfig)

    def __post_init__(self):
        if self.model.head == "auto":
            self.model.head = self.HEAD
        if self.export.merge_lora == "auto":
            self.export.merge_lora = self.MERGES_LORA and self.model.lora.enabled

    def problems(self) -> list[str]:
        """Every problem of the tree, one line each naming its key: each section's own,
        those between sections, then every number against its Bounds. A recipe's tree adds
        its own (preference/config.DPOConfig)."""
        p = []
        if not self.output_dir:
            p.append("output_dir: required; give the directory the run writes to, e.g. output_dir=runs/my-run")
        for section in (self.model, self.data, self.train, self.eval, self.log, self.checkpoint, self.export):
            p += section.problems()
        if self.model.head != self.HEAD:
            p.append(f"model.head: this recipe trains the '{self.HEAD}' head; remove model.head={self.model.head}")
        if self.data.streaming and self.train.max_steps == 0:
            p.append("data.streaming: a stream's length is not known ahead; set train.max_steps")
        if self.eval.every_steps and not (self.data.eval or self.data.eval_fraction or self.eval.tasks):
            p.append(
                "eval.every_steps: set data.eval (or data.eval_fraction, or eval.tasks) too, or set eval.every_steps=0"
            )
        if self.export.merge_lora and not self.model.lora.enabled:
            p.append("export.merge_lora: only applies with model.lora.enabled=true")
        paths = path_problems(self)  # every path key of the tree, a method's section's too
        p += paths
        looked_up = not any(q.startswith("data.chat_template:") for q in paths)
        if looked_up and (problem := chat_template_problem(self.data.chat_template)) is not None:
            p.append(problem)
        p += demo_name_problems(self)
        return p + number_problems(self)


def field_docs(trees, entries: bool = False) -> list[tuple[str, str, str]]:
    """(dotted key, default, docstring) for every leaf field of the given config trees
    (Config's keys first, then each tree's own), read from the source of the classes that
    declare them (a method's section lives in its wing), so the reference can never drift
    from the schema. With `entries`, the keys of a list of mappings' entries too
    (eval.tasks[].name), which are given in the list, not as dotted keys."""
    docs: dict[tuple[type, str], str] = {}
    read_classes: set[type] = set()

    def read(cls) -> None:
        """The docstring under each field of `cls`, from its source."""
        read_classes.add(cls)
        node = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0]
        for a, b in zip(node.body, node.body[1:]):
            if isinstance(a, ast.AnnAssign) and isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant):
                docs[(cls, a.target.id)] = " ".join(b.value.value.split())

    rows = []

    def walk(cls, prefix):
        hints = typing.get_type_hints(cls)
        for c in cls.__mro__:
            if dataclasses.is_dataclass(c) and c not in read_classes:
                read(c)
        for f in dataclasses.fields(cls):
            if dataclasses.is_dataclass(hints[f.name]):
                walk(hints[f.name], f"{prefix}{f.name}.")
                continue
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            doc = next((docs[(c, f.name)] for c in cls.__mro__ if (c, f.name) in docs), "")
            rows.append((f"{prefix}{f.name}", json.dumps(default), doc))
            entry = typing.get_args(hints[f.name])[0] if typing.get_origin(hints[f.name]) is list else None
            if entries and dataclasses.is_dataclass(entry):  # a list of mappings (eval.tasks): each entry's keys
                walk(entry, f"{prefix}{f.name}[].")

    for cls in (Config, *trees):
        walk(cls, "")
    return list({key: (key, default, doc) for key, default, doc in rows}.values())
