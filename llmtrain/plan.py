"""`llmtrain plan`: see a run before spending GPU hours.

Prints, without loading any weights or training anything: the resolved config (the demo's
assets that a run would train first stood in for, and named: demo.stand_ins); the launch
settings from the Accelerate config file (DeepSpeed and FSDP sections included) with
conflicts flagged; world size, global batch, steps per epoch; a per-GPU memory estimate;
and one tokenized training row with its trained tokens marked.

    llmtrain plan --config recipes/configs/llama_full.yaml --accelerate-config accelerate_configs/multi_gpu.yaml
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import sys
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path

import torch
import yaml

from . import demo
from .attention import text_config
from .cli import refuse_options, run_config
from .config import to_yaml
from .config.load import MAX_CONFIG_BYTES, BoundedLoader, TooLarge, absolute_paths, check
from .data.batches import EpochSampler
from .data.mixture import packer, split_and_mix, training_set
from .data.stream import StreamedRows
from .errors import ConfigError, DataError, describe
from .files import read_own
from .methods import DEFAULT, METHODS, demo_config, sections
from .model import (
    attention_backend,
    check_model,
    check_vocab,
    chunkable_head,
    hub_kwargs,
    load_dtype,
    load_tokenizer,
    meta_model,
)
from .processor import is_vision, processor_of
from .train import check_lengths
from .vision import decode, rows_kind

STREAM_SAMPLE = 1000  # rows read from the start of a stream (data.streaming) for the figures


@dataclass
class Launch:
    """What `accelerate launch` would use, read from its config file."""

    source: str = "defaults (no accelerate config file)"
    distributed_type: str = "NO"
    num_processes: int = 1
    num_machines: int = 1
    mixed_precision: str = "no"
    zero_stage: int = 0
    offload_optimizer: bool = False
    offload_params: bool = False
    fsdp: bool = False
    settings: dict = field(default_factory=dict)
    conflicts: list[str] = field(default_factory=list)


def read_launch(path: str | None, cfg) -> Launch:
    from accelerate.commands.config.config_args import (
        default_config_file,
        load_config_from_file,
    )

    if path is None and Path(default_config_file).is_file():
        path = default_config_file
    if path is None:
        return Launch()
    if not Path(path).is_file():
        raise ConfigError([f"--accelerate-config: no such file: {path}"])
    # Read here first with bounds (size, nesting, aliases), which Accelerate's reader lacks:
    # a hostile or damaged file must be one line, not a RecursionError or a memory blow-up.
    try:
        settings = yaml.load(read_own(Path(path), MAX_CONFIG_BYTES), Loader=BoundedLoader)
    except TooLarge as e:
        raise ConfigError([f"--accelerate-config: {path} line {e.line}: {e}"]) from None
    except ValueError as e:  # larger than any config, or not UTF-8
        raise ConfigError([f"--accelerate-config: {path}: {describe(e)}; write it with `accelerate config`"]) from None
    except (OSError, yaml.YAMLError):
        settings = {}  # Accelerate's reader reports those
    if not isinstance(settings, dict):
        raise ConfigError(
            [f"--accelerate-config: {path} is not a mapping of settings; write it with `accelerate config`"]
        )
    try:
        ac = load_config_from_file(path)
        return _launch(ac, path, cfg)
    except ConfigError:
        raise
    except (ValueError, TypeError, KeyError, AttributeError, OSError, yaml.YAMLError) as e:
        # Accelerate's reader and the values in the file are the user's to fix.
        raise ConfigError(
            [f"--accelerate-config: cannot read {path} ({describe(e)}); write it with `accelerate config`"]
        ) from None


def _number(settings: dict, key: str, path: str, kind: type = int, low: float = 0, section: str = ""):
    """A number of the accelerate config file (None when absent or auto). Accelerate reads
    the file without checking its numbers: one that is not, stops here naming its key."""
    value = settings.get(key)
    if value in (None, "auto"):
        return None
    try:
        number = kind(value)
    except (TypeError, ValueError):
        number = None
    if isinstance(value, bool) or number is None or number != float(value) or number < low:
        whole = "a whole number" if kind is int else "a number"
        raise ConfigError(
            [f"--accelerate-config: {section}{key}: expected {whole} of at least {low:g} in {path}, got {value!r}"]
        )
    return number


def _launch(ac, path: str, cfg) -> Launch:
    settings = vars(ac)
    if settings.get("num_processes") == -1:  # Accelerate's "given on the launch command line"
        settings = settings | {"num_processes": None}
    launch = Launch(
        source=str(path),
        distributed_type=str(getattr(ac.distributed_type, "value", ac.distributed_type)),
        num_processes=_number(settings, "num_processes", path, low=1) or 1,
        num_machines=_number(settings, "num_machines", path, low=1) or 1,
        mixed_precision=str(getattr(ac.mixed_precision, "value", ac.mixed_precision) or "no"),
    )
    launch.settings = {k: v for k, v in ac.to_dict().items() if v not in (None, {}, "")}
    ds = ac.deepspeed_config or {}
    if ds:
        launch.zero_stage = _number(ds, "zero_stage", path, section="deepspeed_config.") or 0
        launch.offload_optimizer = ds.get("offload_optimizer_device", "none") not in ("none", None)
        launch.offload_params = ds.get("offload_param_device", "none") not in ("none", None)
        gas = _number(ds, "gradient_accumulation_steps", path, low=1, section="deepspeed_config.")
        if gas is not None and gas != cfg.train.grad_accum_steps:
            launch.conflicts.append(
                f"deepspeed_config.gradient_accumulation_steps={gas} in {path} but train.grad_accum_steps="
                f"{cfg.train.grad_accum_steps}: set one of them (llmtrain drives DeepSpeed's value from the recipe)"
            )
        clip = _number(ds, "gradient_clipping", path, float, section="deepspeed_config.")
        if clip is not None and clip != cfg.train.max_grad_norm:
            launch.conflicts.append(
                f"deepspeed_config.gradient_clipping={clip} in {path} but train.max_grad_norm={cfg.train.max_grad_norm}"
            )
    if ac.fsdp_config:
        launch.fsdp = True
    if launch.mixed_precision == "fp16" and cfg.model.dtype == "bfloat16":
        launch.conflicts.append(
            f"mixed_precision=fp16 in {path} but model.dtype=bfloat16: use bf16 autocast, or float32 weights with fp16"
        )
    return launch


def launch_device(launch: Launch) -> str:
    """The device type the launch trains on: CPU when its config or ACCELERATE_USE_CPU says
    so, a GPU when the config asks for several or this machine has one."""
    from accelerate.utils import parse_flag_from_env

    if (
        launch.settings.get("use_cpu")
        or launch.distributed_type == "MULTI_CPU"
        or parse_flag_from_env("ACCELERATE_USE_CPU")
    ):
        return "cpu"
    return "cuda" if torch.cuda.is_available() or launch.distributed_type == "MULTI_GPU" else "cpu"


def process_warning(launch: Launch) -> str | None:
    """Why the launch would not start, as one process group, the processes its config names
    (the recipe then stops: distributed/launch.py), with the launch that does; None when it
    would. accelerate launch runs a MULTI_CPU config without mpirun through its one-process
    launcher, which starts one process whatever num_processes says (ACCELERATE_USE_CPU
    changes nothing there); DDP on CPU is a MULTI_GPU config with use_cpu, whose processes
    form a group only with ACCELERATE_USE_CPU=1 (the launcher does not pass use_cpu on).
    DeepSpeed on CPU is the exception: it must run without it."""
    from accelerate.utils import parse_flag_from_env

    if launch.distributed_type == "MULTI_CPU":
        if launch.num_processes > 1 and not (launch.settings.get("mpirun_config") or {}).get("mpirun_hostfile"):
            return (
                f"distributed_type MULTI_CPU without mpirun starts ONE process on each machine, not the "
                f"{launch.num_processes} of num_processes (accelerate launch's one-process launcher), and the "
                "recipe stops; for DDP on CPU use distributed_type: MULTI_GPU with use_cpu: true (as "
                "accelerate_configs/cpu_ddp.yaml) and run `ACCELERATE_USE_CPU=1 accelerate launch --config_file ...`"
            )
        return None
    if (
        launch.settings.get("use_cpu")
        and launch.num_processes > 1
        and not launch.zero_stage
        and not parse_flag_from_env("ACCELERATE_USE_CPU")
    ):
        return (
            f"this config starts {launch.num_processes} CPU processes, but ACCELERATE_USE_CPU=1 is not "
            "set: without it they do not join one process group and the recipe stops; run "
            "`ACCELERATE_USE_CPU=1 accelerate launch ...`"
        )
    return None


def count_params(cfg, mcfg=None, zero3: bool = False) -> tuple[int, int, object, bool, int]:
    """(total, trainable, model config, whether the chunked loss can stand in for its
    output layer, how many weights model.quantization stores in 4 or 8 bits) from the model
    built on the meta device (no weights), LoRA adapters added as the recipe adds them:
    memory_estimate's arguments after the launch. `mcfg`: the model's config if already read;
    `zero3`: the launch is DeepSpeed ZeRO-3 (model.add_lora)."""
    from transformers import AutoConfig

    if mcfg is None:
        mcfg = AutoConfig.from_pretrained(cfg.model.name_or_path, **hub_kwargs(cfg.model))
    model = meta_model(cfg.model, mcfg, zero3)
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    quantized = quantized_params(model) if cfg.model.quantization != "none" else 0
    return total, trainable, mcfg, chunkable_head(model) is not None, quantized


def quantized_params(model) -> int:
    """The weights bitsandbytes quantizes: the frozen Linear layers', the output layer
    excepted (it keeps that one as it is)."""
    import torch

    head = model.get_output_embeddings()
    return sum(
        m.weight.numel()
        for m in model.modules()
        if type(m) is torch.nn.Linear and m is not head and not m.weight.requires_grad
    )


def memory_estimate(
    cfg, method, launch: Launch, total: int, trainable: int, mcfg, chunkable: bool, quantized: int = 0
) -> dict[str, float]:
    """Rough bytes per GPU. Weights in the dtype they load in (model.dtype; the `quantized`
    ones in half a byte, nf4/fp4, or one, int8, each); gradients and two AdamW moments in
    the trainable parameters' dtype; ZeRO/FSDP shard them over the processes. Activations
    use ~34 bytes x hidden per token per layer in 16-bit, twice that in float32 (weights in
    float32 without bf16/fp16 mixed precision); only the layer inputs with gradient
    checkpointing; plus fp32 logits and their gradient: for train.loss_chunk_logits logits
    at most where the model allows the chunked loss, else for every token; then what the
    method adds (its PlanFigures.memory: RL's generation cache, reference and reward models)."""
    width = load_dtype(cfg.model, mcfg).itemsize
    # Autocast computes in 16 bits; without it activations come in the weights' dtype.
    scale = (2 if launch.mixed_precision in ("bf16", "fp16") else width) / 2
    world = max(1, launch.num_processes)
    stage = 3 if launch.fsdp else launch.zero_stage
    bits = {"nf4": 0.5, "fp4": 0.5, "int8": 1.0}.get(cfg.model.quantization, width)
    weights = ((total - quantized) * width + quantized * bits) / (world if stage >= 3 else 1)
    grads = trainable * width / (world if stage >= 2 else 1)
    optim = 2 * trainable * width / (world if stage >= 1 else 1)
    if launch.offload_optimizer:
        optim = 0.0
    if launch.offload_params:
        weights = 0.0
    tokens = cfg.train.micro_batch_size * cfg.data.max_seq_len * method.plan.sequences(cfg)
    text = text_config(mcfg)  # a vision-language model's text layers
    hidden, layers = text.hidden_size, text.num_hidden_layers
    per_layer = tokens * hidden * (2 if cfg.model.gradient_checkpointing else 34) * scale
    activations = layers * per_layer + (tokens * hidden * 34 * scale if cfg.model.gradient_checkpointing else 0)
    logits = cfg.train.loss_chunk_logits
    chunk = max(1, logits // text.vocab_size) if chunkable and logits else 0
    if cfg.model.head != "score":  # logits over the vocabulary (a score head has one number per token)
        activations += 2 * (min(tokens, chunk) if chunk else tokens) * text.vocab_size * 4
    out = {"weights": weights, "gradients": grads, "optimizer state": optim, "activations": activations}
    return out | method.plan.memory(cfg, mcfg, total, width, tokens)


def human(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def plan(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="llmtrain plan", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--config",
        type=Path,
        default=None,
        help="YAML config (default: the recipe's demo, when no model or data of yours is named)",
    )
    parser.add_argument(
        "--accelerate-config",
        default=None,
        help="accelerate config file (default: the one `accelerate config` wrote, if any)",
    )
    recipe_option(parser, "the recipe the config is for")
    parser.add_argument("overrides", nargs="*", metavar="key.sub=value")
    args, unknown = parser.parse_known_intermixed_args(argv)  # options may come after overrides
    method = METHODS[args.recipe or recipe_named(args.config, args.overrides)]
    refuse_options(unknown, argv, parser, method.schema)  # --learning_rate 1e-5: train.lr=1e-5
    cfg = run_config(args.config, args.overrides, method, demo_config(method), sections())  # as the recipe reads it
    absolute_paths(cfg)
    launch = read_launch(args.accelerate_config, cfg)
    stand_ins = demo.resolve_demo_names(cfg, train=False)  # trains nothing: what needs training is stood in for
    check(cfg)

    mcfg = check_model(cfg.model, cfg.data.max_seq_len)
    tokenizer = load_tokenizer(cfg.model, cfg.data.chat_template_text(), is_vision(mcfg))
    check_vocab(cfg.model, mcfg, tokenizer)
    if method.check is not None:
        method.check(cfg, tokenizer)
    t, world = cfg.train, launch.num_processes
    kind = rows_kind(method.kind(cfg), tokenizer, cfg, mcfg)
    data_lines: list[str] = []
    if cfg.data.streaming:  # a sample from the start of the stream, as one process reads it unshuffled
        stream = StreamedRows(
            "data.train",
            tokenizer,
            dataclasses.replace(cfg.data, shuffle=False),
            t.seed,
            0,
            1,
            report=False,
        )
        ds = list(islice(stream.rows(), STREAM_SAMPLE))
        if not ds:
            raise DataError(
                f"data.train: no usable row in the first {stream.stats.rows} rows of the stream: "
                f"{stream.stats.summary('data.train')}; {stream.stats.fixes()}"
            )
        lengths, steps_per_epoch = [len(r["input_ids"]) for r in ds], None
        data_lines.append(f"streamed; the first rows read: {stream.stats.summary('data.train')}")
        data_lines += stream.source_lines()
        if cfg.data.names("eval"):  # its bad rows and missing files are found now, not at the first evaluation
            data_lines.append(
                kind.prepare("data.eval", cfg.data.names("eval"), tokenizer, cfg.data)[1].summary("data.eval")
            )
    else:
        ds, stats = kind.prepare("data.train", cfg.data.names(), tokenizer, cfg.data)
        ds, mix, _, data_lines = split_and_mix(cfg, ds, stats, tokenizer, kind.prepare, kind.unit)
        lengths = ds["length"]
        width = kind.width * cfg.data.max_seq_len
        pack = packer(kind.packed, width, "", "", lambda line: None, not cfg.data.shuffle)
        examples = training_set(ds, mix, pack if cfg.data.packing else None)
        sampler = EpochSampler(len(examples), t.seed, mix=getattr(examples, "mix", None))
        steps_per_epoch = method.plan.steps_per_epoch(cfg, len(sampler), world)
        if steps_per_epoch is None:
            steps_per_epoch = t.steps_per_epoch(len(sampler), world)
    counts = count_params(cfg, mcfg, launch.zero_stage == 3)
    total, trainable, mcfg, _, quantized = counts
    global_seqs = t.global_batch(world)
    mean_len = sum(lengths) / len(lengths)
    tokens_per_seq = method.plan.tokens(cfg, mean_len)
    if tokens_per_seq is None:
        tokens_per_seq = cfg.data.max_seq_len * kind.width if cfg.data.packing else mean_len
    items = kind.batched[cfg.data.packing]
    memory = memory_estimate(cfg, method, launch, *counts)
    if processor_of(tokenizer) is not None:  # a vision-language model: its vision tower's too
        images = images_per_micro_batch(cfg, method, ds, mean_len)
        memory["vision tower activations"] = vision_memory(cfg, launch, mcfg, processor_of(tokenizer), ds, images)

    print("== resolved config ==")
    print(to_yaml(cfg).rstrip())
    if stand_ins:
        print("\n== demo assets a run builds first ==")
        for line in stand_ins:
            print(f"  {line}")
    print(f"\n== launch ({launch.source}) ==")
    for key, value in sorted(launch.settings.items()):
        print(f"  {key}: {value}")
    print(
        f"  distributed type {launch.distributed_type}, {launch.num_machines} machine(s), "
        f"mixed precision {launch.mixed_precision}"
        + (f", DeepSpeed ZeRO-{launch.zero_stage}" if launch.zero_stage else "")
        + (", FSDP" if launch.fsdp else "")
    )
    for conflict in launch.conflicts:
        print(f"  CONFLICT: {conflict}")
    warning = process_warning(launch)
    if warning:
        print(f"  WARNING: {warning}")
    print("\n== batch ==")
    print(f"  world size: {world}")
    print(
        f"  global batch: {global_seqs} {items} = micro_batch_size {t.micro_batch_size} x grad_accum_steps "
        f"{t.grad_accum_steps} x {world} process(es), about {global_seqs * tokens_per_seq:,.0f} tokens"
        + (" (packed)" if cfg.data.packing else f" (mean {kind.unit[:-1]} {mean_len:.0f} tokens)")
    )
    for line in data_lines:
        print(f"  {line}")
    if processor_of(tokenizer) is not None:
        print(f"  {image_line(ds, mcfg, cfg.data.max_seq_len)}")
    if steps_per_epoch is None:
        print(f"  steps per pass: not known ahead (streamed); total steps: {t.max_steps}")
    else:
        print(f"  steps per epoch: {steps_per_epoch}; total steps: {t.total_steps(steps_per_epoch)}")
    sys.stdout.flush()  # before the warnings, on stderr, that the run would print at this point
    check_lengths(t, t.max_steps if steps_per_epoch is None else t.total_steps(steps_per_epoch))
    device = launch_device(launch)
    attention = attention_backend(cfg.model, mcfg, cfg.data.packing, torch.device(device))
    print(f"\n== attention ({'GPU' if device == 'cuda' else 'CPU'}) ==")
    for line in attention.lines(cfg.data.packing):
        print(f"  {line}")
    print("\n== memory per GPU (rough estimate) ==")
    print(
        f"  parameters: {total:,} ({trainable:,} trainable"
        + (f"; {quantized:,} stored as {cfg.model.quantization}" if quantized else "")
        + ")"
    )
    for key, n in memory.items():
        print(f"  {key}: {human(n)}")
    print(f"  total: {human(sum(memory.values()))}")
    if device != "cuda":
        print("  (on CPU a run logs its process's peak resident memory: Python, the libraries and the data on top)")
    given = (f" --config {args.config}" if args.config else "") + (
        f" --accelerate-config {args.accelerate_config}" if args.accelerate_config else ""
    )
    print(
        f"  before a long run, `llmtrain verify{given}` checks on this architecture, shrunk, that every layout "
        "takes the same update and that a resume continues the run exactly (docs/verify.md)"
    )
    for line in method.describe(cfg, ds[0], tokenizer):
        print(line)


def image_line(rows, mcfg, width: int) -> str:
    """What the images of a vision-language model's rows take: images per row, the image
    tokens among each row's tokens (a share of data.max_seq_len, and so of the activations
    the memory estimate counts per token), counted from the tokenized rows."""
    image_id = getattr(mcfg, "image_token_id", None) or getattr(mcfg, "image_token_index", None)
    sample = [rows[i] for i in range(min(len(rows), 1000))]  # the first rows, as the batch lines read them
    images = [len(r.get("images") or []) for r in sample]
    tokens = [r["input_ids"].count(image_id) if image_id is not None else 0 for r in sample]
    shown = [t for t, n in zip(tokens, images) if n]
    if not shown:
        return f"images: none in the first {len(sample)} rows"
    return (
        f"images: {sum(images)} in the first {len(sample)} rows ({len(shown)} rows hold any, at most {max(images)} "
        f"a row); image tokens per such row: mean {sum(shown) / len(shown):.0f}, at most {max(shown)} "
        f"({max(shown) / width:.0%} of data.max_seq_len)"
    )


def images_per_micro_batch(cfg, method, rows, mean_len: float) -> float:
    """The images one micro-batch shows, on average: its sequences (an answer of a pair
    shows its pair's images), the rows each sequence holds (packed: as many as fit), the
    images of a row (the first rows')."""
    sample = [rows[i] for i in range(min(len(rows), 1000))]
    per_row = sum(len(r.get("images") or []) for r in sample) / max(1, len(sample))
    rows_per_sequence = cfg.data.max_seq_len / max(1.0, mean_len) if cfg.data.packing else 1.0
    return cfg.train.micro_batch_size * method.plan.sequences(cfg) * rows_per_sequence * per_row


def vision_memory(cfg, launch: Launch, mcfg, processor, rows, images: float) -> float:
    """Rough bytes of the vision tower's activations for a micro-batch showing `images`
    images: the patches the image processor makes of the rows' first image, times the
    tower's width and the ~34 bytes per value of a layer the language model's estimate uses;
    every layer's when the tower trains (model.freeze_vision false), one layer's at a time
    when it is frozen (nothing is kept for a backward pass)."""
    first = next((r["images"][0] for r in (rows[i] for i in range(min(len(rows), 1000))) if r.get("images")), None)
    if first is None or not images:
        return 0.0
    vc = mcfg.vision_config
    pixels = processor.image_processor(images=[[decode(first, cfg.data.max_image_pixels)]], return_tensors="pt")
    patches = image_patches(pixels["pixel_values"], getattr(vc, "patch_size", 14))
    hidden = getattr(vc, "hidden_size", None) or getattr(vc, "embed_dim", 0)
    layers = getattr(vc, "num_hidden_layers", None) or getattr(vc, "depth", 1)
    width = load_dtype(cfg.model, mcfg).itemsize
    scale = (2 if launch.mixed_precision in ("bf16", "fp16") else width) / 2
    per_layer = images * patches * hidden * 34 * scale
    return per_layer * (1 if cfg.model.freeze_vision else layers)


def image_patches(pixel_values, patch: int) -> int:
    """The patches a vision tower sees of one image, from its image processor's pixel
    values: rows of flattened patches (Qwen-VL's), or pictures (crops) of patch x patch
    squares, [crops, 3, H, W] or [1, crops, 3, H, W]."""
    shape = tuple(pixel_values.shape)
    if len(shape) == 2:
        return shape[0]
    crops = shape[-4] if len(shape) >= 4 else 1
    return crops * (shape[-2] // patch) * (shape[-1] // patch)


def recipe_option(parser: argparse.ArgumentParser, what: str) -> None:
    """--recipe, for `llmtrain plan` and `llmtrain eval`: `what` it names, and how it is found
    when not given (`recipe_named`)."""
    parser.add_argument(
        "--recipe",
        choices=sorted(METHODS),
        default=None,
        help=f"{what} (default: the method whose own section ({', '.join(sections())}) the config or an override "
        f"sets a key of, else {DEFAULT})",
    )


def recipe_named(config: Path | None, overrides: list[str]) -> str:
    """The recipe a config is for: the method whose own section (dpo, grpo, reward, ...) its
    YAML (if one is given) has or an override sets a key of, else finetune (an unreadable
    file is load_config's to report)."""
    raw = {}
    with contextlib.suppress(OSError, ValueError, yaml.YAMLError):
        raw = yaml.load(read_own(Path(config), MAX_CONFIG_BYTES), Loader=BoundedLoader) if config else {}
    for method in METHODS.values():  # a method's own section names its recipe
        name = method.section
        if name and (
            any(o.startswith((f"{name}.", f"{name}=")) for o in overrides) or (isinstance(raw, dict) and name in raw)
        ):
            return method.name
    return DEFAULT


def usage() -> str:
    """`llmtrain --help`: plan's usage, and every method's recipe from the method table."""
    recipes = "".join(
        f"  accelerate launch recipes/{m.name}.py [--config F] [key.sub=value ...]\n      {m.description}\n"
        for m in METHODS.values()
    )
    return f"""usage: llmtrain plan [--config F] [--accelerate-config F] [--recipe {"|".join(METHODS)}]
                     [key.sub=value ...]

commands:
  plan   what a run would do, without training: the data (rows kept and dropped, one
         rendered row), the model, memory per device, the launch and its batch sizes
  eval   llmtrain eval MODEL [MODEL ...] --config F [--recipe R] [--output F.json]:
         the recipe's held-out measures of each model, side by side with the difference
  verify llmtrain verify --config F [--accelerate-config A] [--recipe R] [--output F.json]
                        [--device] [--mixed-precision P] [--full]:
         the same update on every layout, packed samples isolated, exact resume: checked on
         your architecture, shrunk, with your tokenizer and data, before a long run; on
         the CPU, or with --device on your GPUs in your precision (docs/verify.md)

training runs through the recipes (see README.md), one per method:
{recipes}  python recipes/finetune.py --prepare-only --config F     tokenize into the cache
  python -m llmtrain.demo score DIR                         score a model on the demo task
with no --config and no model or data named, the recipes run the offline demo."""
