"""`llmtrain verify`: the guarantees checked on the user's own model, data and launch config.

    llmtrain verify --config F [--recipe NAME] [--accelerate-config A] [--only CHECKS]
                    [--device] [--mixed-precision P] [--full] [--output report.json] [key=value ...]

The user's architecture is shrunk (`shrink`: the same model class and config, 2 layers of
width 64, the vocabulary kept for the user's tokenizer; sliding windows, experts and
absolute positions kept; a vision tower shrunk too, `shrink_tower`) and built with random
weights, or with --full taken as it is. The user's tokenizer and chat template come with
it, and the first rows of each training source are sampled (`sample`). With packing, the
method's examples are packed as a run packs them and each sample's outputs compared with
the sample alone (`packing`). The recipe then trains 3 steps of a global batch of 4 in
several layouts, each launched as a run is launched (`python -m llmtrain.recipe`, under
`accelerate launch` for several processes), on the CPU in float32 unless --device takes
the GPUs here in the user's precision (`Where`):

- reference: one process, the whole global batch in one micro-batch;
- accumulation: one process, 4 micro-batches of 1;
- 2 processes: data parallel (DDP over gloo on CPU), 2 micro-batches of 1 each;
- the user's backend (--accelerate-config: DeepSpeed ZeRO or FSDP2) against plain DDP;
- the same run twice, then resume: the reference killed after step 1's checkpoint and run
  again: the same steps exactly;
- resume on 2 processes: the same checkpoint continued on another process count.

Each check compares the steps' losses, gradient norms and the final weights with its
baseline; the worst difference against the check's tolerance (0 where the computation is
the same, float32 rounding where the order of a reduction differs, half precision's bounds
in bf16 or fp16) is the result. A table and, with --output, JSON; exit status 1 when a
check fails, with one line on what it means. What makes runs differ by design (dropout,
router jitter, sampled routing, expert capacity: `Findings`) is read from the config
before the runs and said with the failures it causes.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from itertools import islice
from pathlib import Path

from . import demo, safefs
from .cli import refuse_options, run_config
from .config.load import absolute_paths
from .config.validate import path_values
from .core.objective import model_inputs
from .data.batches import Collator
from .data.rows import KEPT
from .data.sources import load_source
from .errors import ConfigError, describe
from .methods import METHODS, demo_config, sections
from .model import (
    attention_backend,
    batch_dependent,
    check_model,
    hub_kwargs,
    load_error,
    load_model,
    load_tokenizer,
    pad_id,
    random_draws,
)
from .observe.metrics import METRICS_FILE, read_metrics
from .plan import read_launch, recipe_named, recipe_option
from .processor import is_vision, load_processor, processor_of, save_processor
from .vision import ImageCollator, rows_kind

STEPS = 3  # optimizer steps each layout trains
BATCH = 4  # the global batch: units (sequences, pairs, prompts) per step
ROWS = 256  # rows sampled from each training source (packed rows fill few sequences)
ADAM_EPS = 1e-4  # see `fixed`
MAX_LINKS = 10_000  # entries of a source's folder linked beside its sample
MAX_SEQ_LEN = 256  # data.max_seq_len at most: a shrunk model's run stays quick on a CPU
WIDTH, LAYERS, HEADS, KV_HEADS, HEAD_DIM = 64, 2, 4, 2, 16

# Tolerances: relative difference of each step's loss and gradient norm, and of the final
# weights (max abs difference over max abs weight).
EXACT = 0.0
FLOAT32 = {"loss": 1e-5, "grad_norm": 1e-4, "weights": 1e-5}
# Losses and gradient norms nearer zero are compared as if they were this. A GRPO loss sums
# signed terms of about 1 (advantages times ratios) to a total near 0, and carries their
# rounding: on 2 processes SmolLM3's differs by 1e-8 on a loss below 1e-3. A normalisation bug
# moves the loss by a share of itself, and the gradient norm and weights with it.
FLOOR = {"loss": 1e-2, "grad_norm": 1e-3}
HALF = {"loss": 1e-2, "grad_norm": 5e-2, "weights": 1e-2}  # bf16/fp16 autocast: 8 or 11 bits of mantissa


@dataclass
class Layout:
    """How one run is launched: processes, micro-batch size, accumulation."""

    name: str
    processes: int
    micro: int
    accum: int
    accelerate_config: Path | None = None  # the user's, for their backend
    precision: str = "no"  # mixed precision: the user's backend's, and its DDP baseline's
    distributed_type: str = "MULTI_GPU"  # the user's backend's: DEEPSPEED, FSDP

    def overrides(self) -> list[str]:
        return [f"train.micro_batch_size={self.micro}", f"train.grad_accum_steps={self.accum}"]


@dataclass
class Check:
    name: str
    worst: float  # the relative difference furthest beyond its tolerance (or nearest to it)
    tolerance: float  # that difference's tolerance (0: exact)
    seconds: float
    note: str = ""  # what a failure means, where known better than the check's own meaning
    where: str = ""  # which figure the worst difference is of
    skipped: bool = False  # not run here (the note says why)

    @property
    def passed(self) -> bool:
        return self.skipped or self.worst <= self.tolerance


def parse(argv: list[str]):
    parser = argparse.ArgumentParser(prog="llmtrain verify", description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=None, help="YAML config of the run to verify")
    recipe_option(parser, "the recipe to verify")
    parser.add_argument(
        "--accelerate-config", type=Path, default=None, help="your accelerate config (DeepSpeed, FSDP2) to check too"
    )
    parser.add_argument(
        "--device",
        action="store_true",
        help="run on your GPUs in your mixed precision (default: the CPU in float32)",
    )
    parser.add_argument(
        "--mixed-precision",
        choices=("no", "bf16", "fp16"),
        default=None,
        help="the runs' mixed precision (default: float32 on the CPU; with --device, your accelerate config's)",
    )
    parser.add_argument(
        "--full", action="store_true", help="your model's real weights, not its architecture shrunk (needs the memory)"
    )
    parser.add_argument("--output", type=Path, default=None, help="write the report as JSON to this file")
    parser.add_argument(
        "--only",
        default=",".join(CHECKS),
        help=f"the checks to run, comma-separated, of {', '.join(CHECKS)} (default: all)",
    )
    parser.add_argument("overrides", nargs="*", metavar="key.sub=value")
    args, unknown = parser.parse_known_intermixed_args(argv)
    return parser, args, unknown


def main(argv: list[str]) -> None:
    parser, args, unknown = parse(argv)
    method = METHODS[args.recipe or recipe_named(args.config, args.overrides)]
    refuse_options(unknown, argv, parser, method.schema)
    only = {c.strip() for c in args.only.split(",") if c.strip()}
    if not only or only - set(CHECKS):
        raise ConfigError([f"--only: {args.only!r}: name checks of {', '.join(CHECKS)}, comma-separated"])
    cfg = run_config(args.config, args.overrides, method, demo_config(method), sections())
    where = Where.chosen(args.device, args.mixed_precision, args.accelerate_config, cfg)
    absolute_paths(cfg)
    given = {key: value for key, value, _ in path_values(cfg)}
    demo.resolve_demo_names(cfg)
    # The demo's other assets (a teacher, a reference) by their paths: beside a model of the
    # user's (the shrunk one), a run takes no demo name.
    demos = [f"{k}={v}" for k, v, _ in path_values(cfg) if given.get(k, "").startswith("demo:") and "[" not in k]
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="llmtrain-verify-") as scratch:
        root = Path(scratch)
        what = "with its own weights" if args.full else "shrunk"
        print(f"llmtrain verify: the {method.name} recipe, on {cfg.model.name_or_path} {what}, {where}")
        config = check_model(cfg.model, runs_seq_len(cfg))  # as a run reads it: its revision, its checks
        model = Path(cfg.model.name_or_path) if args.full else shrink(cfg.model, config, root / "model")
        findings = Findings(random_draws(config) if method.keeps_dropout(cfg) else [], batch_dependent(config))
        for line in findings.lines():
            print(f"note: {line}")
        data = sample(cfg.data.names(), root / "data")
        base = [*args.overrides, *demos, *fixed(cfg, model, data), *method.verify(cfg, runs_seq_len(cfg))]
        names = {} if args.full else {str(model): f"{cfg.model.name_or_path} (shrunk)"}
        runner = Runner(method.name, args.config, base, root, where, names)
        checks = []
        if "packing" in only and cfg.data.packing:
            checks += [c for c in [packing(cfg, method, model, data, where)] if c is not None]
        checks += run_checks(runner, args.accelerate_config, cfg, only)
    explain(checks, findings)
    print(table(checks))
    failed = [c for c in checks if not c.passed]
    skipped = [c for c in checks if c.skipped]
    print(
        f"{len(checks) - len(failed) - len(skipped)} of {len(checks) - len(skipped)} checks passed in "
        f"{time.monotonic() - started:.0f} s"
        + ("" if not failed else f"; failed: {', '.join(c.name for c in failed)}")
        + ("" if not skipped else f"; skipped: {', '.join(c.name for c in skipped)}")
    )
    for check in failed + skipped:
        print(f"{check.name}: {check.note or meaning(check.name)}")
    if args.output is not None:
        got = report(checks, where, cfg.model.name_or_path, args.full)
        safefs.write_text(args.output, json.dumps(got, indent=2) + "\n")
        print(f"wrote {args.output}")
    if failed:
        sys.exit(1)


@dataclass
class Where:
    """Where the runs go and in what precision: the CPU in float32 by default, so that a
    laptop checks a cluster job before it is sent; with --device, the GPUs here in the
    user's mixed precision (--mixed-precision, else their accelerate config's, read as
    `accelerate launch` reads it)."""

    gpus: int = 0  # 0: the CPU, even on a machine with GPUs
    precision: str = "no"
    chosen_precision: bool = False  # --device or --mixed-precision: every run's, the backend's too

    @classmethod
    def chosen(cls, device: bool, precision: str | None, accelerate_config: Path | None, cfg) -> Where:
        if not device:
            return cls(0, precision or "no", precision is not None)
        gpus = gpu_count()
        if not gpus:
            raise ConfigError(["--device: no GPU is visible here; leave --device out to verify on the CPU"])
        if precision is None:
            launch = read_launch(None if accelerate_config is None else str(accelerate_config), cfg)
            precision = launch.mixed_precision if launch.mixed_precision in ("bf16", "fp16") else "no"
        return cls(gpus, precision, True)

    @property
    def half(self) -> bool:
        return self.precision in ("bf16", "fp16")

    @property
    def rounding(self) -> dict:
        """The tolerances where the order of a sum differs: float32's, or half precision's."""
        return HALF if self.half else FLOAT32

    def __str__(self) -> str:
        device = f"{self.gpus} GPU{'s' if self.gpus > 1 else ''}" if self.gpus else "the CPU"
        return f"on {device} in {self.precision if self.half else 'float32'}"


@dataclass
class Findings:
    """What in the model's config makes layouts differ by design, found before any run:
    random draws its runs keep (dropout, router jitter), and what nothing turns off."""

    random: list[str]
    batch: list[str]

    def lines(self) -> list[str]:
        out = []
        if self.random:
            out.append(f"the model draws at random in training ({', '.join(self.random)}); set model.dropout=none")
        out += [f"the update depends on the batch by design: {why}" for why in self.batch]
        return out


def explain(checks: list[Check], findings: Findings) -> None:
    """Each failed check's note: what the findings make of it, else nothing (its meaning)."""
    for check in checks:
        if check.passed or check.skipped:
            continue
        layout = not check.name.startswith(("the same run", "resume vs", "packed"))  # compares two layouts
        if layout and findings.batch:
            check.note = f"the update depends on the batch by design ({'; '.join(findings.batch)}): no layout can match"
        elif layout and findings.random:
            check.note = (
                f"dropout or router jitter is on ({', '.join(findings.random)}): each layout draws other masks; "
                "set model.dropout=none"
            )
        elif not check.tolerance and check.worst <= FLOAT32["loss"] and not check.note:
            check.note = (
                f"{meaning(check.name)}; or, the difference being float rounding, a kernel that is not deterministic "
                "every time: run verify again, and a repeat that differs tells"
            )


def fixed(cfg, model: Path, data: list[Path]) -> list[str]:
    """The overrides every verifying run takes: the shrunk model (a local directory, read
    without the user's hub revision) and the sampled rows, a short sequence length, no
    evaluation, a checkpoint after every step, quiet logs."""
    shrunk = str(model) != cfg.model.name_or_path
    return [
        f"model.name_or_path={model}",
        *(["model.revision="] if shrunk else []),
        f"data.train=[{', '.join(str(p) for p in data)}]",
        "data.eval=[]",
        "data.eval_fraction=0",
        f"data.max_seq_len={runs_seq_len(cfg)}",
        f"train.max_steps={STEPS}",
        # Adam divides each update by its gradient's scale: rounding in a gradient near zero
        # would move a weight by a whole step one way or the other. An epsilon above such
        # rounding keeps it a rounding in the weights too; every layout takes the same.
        f"train.adam_eps={ADAM_EPS}",
        "eval.every_steps=0",
        "eval.sample_prompts=[]",
        "eval.tasks=[]",
        "eval.lm_eval_tasks=[]",
        "checkpoint.every_steps=1",
        "checkpoint.keep_last=0",
        "log.tracker=none",
        "log.progress_bar=false",
        "log.every_steps=1",
    ]


def runs_seq_len(cfg) -> int:
    """data.max_seq_len of the runs: the user's, at most MAX_SEQ_LEN."""
    return min(cfg.data.max_seq_len, MAX_SEQ_LEN)


# --- the user's architecture, shrunk ------------------------------------------------------

# Size settings of the config classes users bring, and what they become.
SIZES = {
    "hidden_size": WIDTH,
    "n_embd": WIDTH,
    "d_model": WIDTH,
    "intermediate_size": 2 * WIDTH,
    "n_inner": 2 * WIDTH,
    "moe_intermediate_size": WIDTH,
    "shared_expert_intermediate_size": WIDTH,
    "num_hidden_layers": LAYERS,
    "n_layer": LAYERS,
    "num_attention_heads": HEADS,
    "n_head": HEADS,
    "head_dim": HEAD_DIM,
    "num_local_experts": 4,
    "num_experts": 4,
    "n_routed_experts": 4,
}


def shrink(model_cfg, config, out: Path) -> Path:
    """The user's model (model_cfg.name_or_path, whose config is `config`) rebuilt small in
    `out` with random weights, its tokenizer (and a vision-language model's processor)
    beside it."""
    import torch
    from transformers import (
        AutoModelForCausalLM,
        AutoModelForImageTextToText,
        AutoTokenizer,
    )

    name, remote = model_cfg.name_or_path, model_cfg.trust_remote_code
    config = copy.deepcopy(config)
    try:
        tokenizer = AutoTokenizer.from_pretrained(name, **hub_kwargs(model_cfg))
    except Exception as e:  # a model without a tokenizer
        raise load_error("a tokenizer", name, e) from None
    text = getattr(config, "text_config", None) or config
    widths = [getattr(text, k) for k in ("hidden_size", "n_embd", "d_model") if isinstance(getattr(text, k, None), int)]
    width = widths[0] if widths else 0  # the language model's, before shrinking
    for key, value in SIZES.items():
        if isinstance(getattr(text, key, None), int):
            setattr(text, key, value)
    if isinstance(getattr(text, "num_key_value_heads", None), int):
        text.num_key_value_heads = min(text.num_key_value_heads, KV_HEADS) or KV_HEADS
    for key in ("num_experts_per_tok", "moe_topk"):
        if isinstance(getattr(text, key, None), int):
            setattr(text, key, min(getattr(text, key), 2))
    if isinstance(getattr(text, "layer_types", None), list):  # sliding and full layers: one of each kept
        kinds = list(dict.fromkeys(text.layer_types))
        text.layer_types = (kinds * LAYERS)[:LAYERS]
    if getattr(text, "query_pre_attn_scalar", None):
        text.query_pre_attn_scalar = HEAD_DIM
    vision = is_vision(config)
    auto = AutoModelForImageTextToText if vision else AutoModelForCausalLM
    whole = copy.deepcopy(config)  # the vision tower as it is, should the shrunk one not build
    if vision and getattr(config, "vision_config", None) is not None:
        shrink_tower(config, width)
    torch.manual_seed(0)  # the same shrunk model at every verify
    try:
        model = auto.from_config(config, trust_remote_code=remote)
    except Exception as e:  # a tower whose sizes hang together in ways shrink_tower does not know
        print(f"note: the vision tower is kept whole: shrunk, it does not build ({describe(e)})")
        torch.manual_seed(0)
        model = auto.from_config(whole, trust_remote_code=remote)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    if vision:  # its processor too: how images become tokens
        save_processor(load_processor(name, **hub_kwargs(model_cfg)), out)
    return out


# A vision tower's sizes, and what they become (its own width: half the language model's).
TOWER = {
    "hidden_size": WIDTH // 2,
    "embed_dim": WIDTH // 2,
    "projection_dim": WIDTH // 2,
    "intermediate_size": WIDTH,
    "num_attention_heads": 2,
    "num_heads": 2,
    "head_dim": WIDTH // 4,
}
TOWER_LAYERS = ("num_hidden_layers", "depth")


def shrink_tower(config, text_width: int) -> None:
    """A vision-language config's vision tower shrunk in place, to LAYERS layers of width
    WIDTH // 2, the rest kept: its image and patch sizes (so each image takes the same
    tokens), and enough layers for those the model reads features of (vision_feature_layer,
    Qwen3-VL's deepstack_visual_indexes). A size that equals the language model's width
    before shrinking (Qwen2-VL's hidden_size), or out_hidden_size (Qwen2.5-VL's, Qwen3-VL's), is
    the width the tower hands to the language model: it becomes the shrunk width."""
    tower = config.vision_config
    layers = LAYERS
    read = getattr(config, "vision_feature_layer", None)
    for index in read if isinstance(read, list) else [read] if isinstance(read, int) else []:
        layers = max(layers, index if index >= 0 else -index - 1)  # hidden_states: the embeddings, then each layer
    deep = getattr(tower, "deepstack_visual_indexes", None)
    if isinstance(deep, list) and deep:
        layers = max(layers, max(deep) + 1)
    for key, value in list(vars(tower).items()):
        if not isinstance(value, int) or isinstance(value, bool):
            continue
        if key == "out_hidden_size" or (key == "hidden_size" and value == text_width):  # into the language model
            setattr(tower, key, WIDTH)
        elif key in TOWER:
            setattr(tower, key, TOWER[key])
        elif key in TOWER_LAYERS:
            setattr(tower, key, layers)
    if isinstance(getattr(tower, "fullatt_block_indexes", None), list):  # Qwen2.5-VL: window and full blocks
        tower.fullatt_block_indexes = [layers - 1]


def sample(names: list[str], out: Path) -> list[Path]:
    """The first ROWS rows of each training source, as JSON lines in a folder of `out` of
    its own. Beside them, links to what the source's folder holds (a bounded number), so
    that the paths its rows give relative to it (images) still lead to the files."""
    files = []
    for i, name in enumerate(names):
        src = load_source(name, "data.train", streaming=True)
        rows = [dict(src.parse(row)) for row in islice(src.dataset, ROWS)]
        folder = out / f"source-{i}"
        folder.mkdir(parents=True)
        path = folder / "rows.jsonl"
        if src.root is not None:
            for entry in islice(src.root.iterdir(), MAX_LINKS):
                if entry.name != path.name:
                    (folder / entry.name).symlink_to(entry)
        path.write_text("".join(json.dumps(row, default=str) + "\n" for row in rows))
        files.append(path)
    return files


# --- packing --------------------------------------------------------------------------------

PACKS = 8  # packed sequences checked, sample by sample


def packing(cfg, method, model_dir: Path, data: list[Path], where: Where) -> Check | None:
    """The packed vs unpacked check, on this process: the sampled rows made into the
    method's examples (SFT rows, preference pairs, rows with images) and packed as a run
    packs them (data.max_seq_len capped); the model's logits over each of the first PACKS
    packed sequences against those of each of its samples alone, both collated as a run
    collates them, with the attention backend a run takes. Every sample must see only
    itself. None where the method's examples are not packed."""
    import datasets
    import pyarrow as pa
    import torch

    started = time.monotonic()
    data_cfg = dataclasses.replace(cfg.data, max_seq_len=runs_seq_len(cfg))
    model_cfg = dataclasses.replace(cfg.model, name_or_path=str(model_dir), lora=dataclasses.replace(cfg.model.lora))
    model_cfg.lora.enabled = False  # the base's attention is what packing must isolate
    model_cfg.head = "lm"  # the body's output is compared, whatever head reads it (a reward model's score)
    # In float32 and unquantized, whatever the run's weights: isolation is a matter of masks
    # and positions, which float32 shows down to its rounding (bf16 weights would hide a leak
    # below theirs); --device computes in the runs' precision, and is held to its bounds.
    model_cfg.dtype, model_cfg.quantization = "float32", "none"
    mcfg = check_model(model_cfg, data_cfg.max_seq_len)
    device = torch.device("cuda" if where.gpus else "cpu")
    model_cfg.attn_implementation = attention_backend(model_cfg, mcfg, True, device).name
    tokenizer = load_tokenizer(model_cfg, data_cfg.chat_template_text(), is_vision(mcfg))
    kind = rows_kind(method.kind(cfg), tokenizer, dataclasses.replace(cfg, data=data_cfg), mcfg)
    if kind.packed is None:
        return None
    sources = [load_source(str(path), "data.train", streaming=True) for path in data]
    rows = [src.parse(row) for src in sources for row in src.dataset]  # a row knows its folder (images)
    examples = [e for e in (kind.process(r, tokenizer, data_cfg) for r in rows) if e["status"] in KEPT]
    for i, example in enumerate(examples):
        example.pop("status")
        if kind.index:
            example[kind.index] = i
    width = kind.width * data_cfg.max_seq_len
    packed = kind.packed(datasets.Dataset(pa.Table.from_pylist(examples), fingerprint="llmtrain-verify"), width)
    pad = pad_id(tokenizer)
    processor = processor_of(tokenizer)
    collate = ImageCollator(pad, processor, data_cfg.max_image_pixels, width) if processor else Collator(pad, width)
    model = load_model(model_cfg).to(device).eval()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(where.precision)
    worst, where_worst = 0.0, "every sample"

    def states(batch: dict) -> torch.Tensor:
        """The last layer's output at each token: what a language model's head or a reward
        model's reads."""
        batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
        with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            return model(**model_inputs(model, batch), output_hidden_states=True).hidden_states[-1][0].float()

    with torch.no_grad():
        for j in range(min(len(packed), PACKS)):
            together, start = states(collate([packed[j]])), 0
            for d, doc in enumerate(packed.documents(j)):
                alone = states(collate([doc]))
                n = len(doc["input_ids"])
                diff = float((together[start : start + n] - alone[:n]).abs().max() / alone.abs().max())
                if diff > worst:
                    worst, where_worst = diff, f"sample {d} of pack {j}"
                start += n
    tolerance = where.rounding["loss"]
    return Check("packed vs each sample alone", worst, tolerance, time.monotonic() - started, where=where_worst)


# --- the runs -----------------------------------------------------------------------------


class Runner:
    """Launches the recipe as a user does, in `root`/<name>, and reads what a run wrote."""

    def __init__(
        self,
        recipe: str,
        config: Path | None,
        overrides: list[str],
        root: Path,
        where: Where,
        names: dict | None = None,
    ):
        self.recipe, self.config, self.overrides, self.root, self.where = recipe, config, overrides, root, where
        self.names = names or {}  # scratch path -> what the user knows it as (their model, shrunk)

    def run(self, layout: Layout, out: Path, extra: list[str] = ()) -> float:
        """Train `layout` into `out`; returns the seconds it took."""
        args = (["--config", str(self.config)] if self.config else []) + self.overrides
        args += [*layout.overrides(), f"output_dir={out}", *extra]
        command = [sys.executable, "-m", "llmtrain.recipe", self.recipe, *args]
        env = dict(os.environ, ACCELERATE_MIXED_PRECISION=layout.precision)
        if not self.where.gpus:
            env["CUDA_VISIBLE_DEVICES"] = ""  # the CPU, even where there are GPUs
        if layout.processes > 1 or layout.accelerate_config:
            flags = ["--num_processes", str(layout.processes), "--main_process_port", str(free_port())]
            flags += ["--mixed_precision", layout.precision]
            if layout.accelerate_config is not None:
                flags = ["--config_file", str(layout.accelerate_config), *flags]
            else:
                flags = ["--multi_gpu", *flags]
            command = [sys.executable, "-m", "accelerate.commands.launch", *flags, "-m", "llmtrain.recipe"]
            command += [self.recipe, *args]
            if layout.distributed_type != "DEEPSPEED" and not self.where.gpus:
                env["ACCELERATE_USE_CPU"] = "1"  # DDP and FSDP2 over gloo; DeepSpeed picks its CPU accelerator
        started = time.monotonic()
        proc = subprocess.run(command, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            said = [line.removeprefix("error: ") for line in proc.stderr.splitlines() if line.startswith("error:")]
            line = said[-1] if said else proc.stderr[-2000:]
            for path, name in self.names.items():  # the run's line names the scratch copy
                line = line.replace(path, name)
            raise ConfigError([f"llmtrain verify: the {layout.name} run failed: {line}"])
        return time.monotonic() - started


def gpu_count() -> int:
    import torch

    return torch.cuda.device_count()


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# The checks by the names --only takes.
CHECKS = ("packing", "accumulation", "processes", "backend", "resume", "resume-processes")


def run_checks(runner: Runner, accelerate_config: Path | None, cfg, only: set[str]) -> list[Check]:
    """The checks of `only` (all of CHECKS; `backend` where an accelerate config is given),
    each run in its layout and compared with its baseline: at float32's rounding, or half
    precision's where the runs take it (Where). On one GPU the checks of 2 processes are
    skipped, saying so."""
    root, where = runner.root, runner.where
    if not only - {"packing"}:  # no check that trains
        return []
    one = Layout("reference", 1, BATCH, 1, precision=where.precision)
    two = Layout("2 processes", 2, BATCH // 2, 1, precision=where.precision)
    took = {"reference": runner.run(one, root / "reference")}
    rounding, alone = where.rounding, where.gpus == 1  # one GPU: no second process

    def ran(layout: Layout, out: Path, extra: list[str] = ()) -> Path:
        took[out.name] = runner.run(layout, out, extra)
        return out

    def skipped(name: str) -> Check:
        note = "1 GPU here, and 2 processes need 2: leave --device out to check this on the CPU"
        return Check(name, 0.0, 0.0, 0.0, note, skipped=True)

    checks = []
    if "accumulation" in only:
        out = ran(Layout("accumulation", 1, 1, BATCH, precision=where.precision), root / "accumulation")
        checks.append(compare("accumulation vs one micro-batch", out, root / "reference", rounding, took[out.name]))
    if only & {"processes", "backend"} and not alone:
        ran(two, root / "2 processes")
    if "processes" in only:
        name = "2 processes vs one micro-batch"
        out = root / "2 processes"
        checks.append(skipped(name) if alone else compare(name, out, root / "reference", rounding, took[out.name]))
    if "backend" in only and accelerate_config is not None:
        launch = read_launch(str(accelerate_config), cfg)  # read with bounds, as llmtrain plan reads it
        precision = where.precision if where.chosen_precision else launch.mixed_precision
        precision = precision if precision in ("bf16", "fp16") else "no"
        name = f"your backend vs DDP{'' if precision == 'no' else f' ({precision})'}"
        if alone:
            checks.append(skipped(name))
        else:
            backend = Layout("your backend", 2, BATCH // 2, 1, accelerate_config, precision, launch.distributed_type)
            out = ran(backend, root / "backend")
            baseline, tolerance = root / "2 processes", rounding
            if precision != where.precision:  # DDP in the backend's precision, and that precision's bounds
                baseline = ran(dataclasses.replace(two, precision=precision), root / f"ddp-{precision}")
                tolerance = HALF if precision != "no" else FLOAT32
            checks.append(compare(name, out, baseline, tolerance, took[out.name]))
    exact = dict.fromkeys(FLOAT32, EXACT)
    if "resume" in only:  # the same run again: exact, unless the model's kernels are not deterministic
        out = ran(one, root / "repeat")
        repeat = compare("the same run twice", out, root / "reference", exact, took[out.name])
        if not repeat.passed:
            repeat.note = (
                "the model's kernels are not deterministic (some mixture-of-experts kernels on CPU, atomic "
                "additions on GPUs): two identical runs differ, so no resume can be exact; resume is held to "
                "rounding instead"
            )
            exact = rounding
        checks.append(repeat)
    for key, name, layout, tolerance in (
        ("resume", "resume", one, exact),
        ("resume-processes", "resume on 2 processes", two, rounding),
    ):
        if key not in only:
            continue
        if alone and layout.processes > 1:
            checks.append(skipped(f"{name} vs uninterrupted"))
            continue
        rewound(root / "reference", root / name, step=1)
        out = ran(layout, root / name, ["checkpoint.resume=auto"])
        checks.append(compare(f"{name} vs uninterrupted", out, root / "reference", tolerance, took[out.name]))
    return checks


def rewound(run: Path, out: Path, step: int) -> None:
    """`out`: what `run` leaves when killed right after its checkpoint of `step`."""
    shutil.copytree(run, out, symlinks=True)
    shutil.rmtree(out / "final")
    for path in (out / "checkpoints").glob("step-*"):
        if int(path.name.split("-")[1]) > step:
            shutil.rmtree(path)


def compare(name: str, got: Path, want: Path, tolerance: dict, seconds: float) -> Check:
    """Each step's loss and gradient norm and the final weights of run `got` against run
    `want`, each relative difference against its tolerance: the check's result is the
    difference furthest beyond (or nearest to) its own."""
    rows, base = train_rows(got), train_rows(want)
    if [r["step"] for r in rows] != [r["step"] for r in base]:
        return Check(name, math.inf, tolerance["loss"], seconds, "the runs took different steps")
    if not any(r.get("grad_norm") for r in base):  # equal, and proving nothing
        note = "the runs trained nothing (every gradient 0), so nothing was compared; look at the loss and data"
        return Check(name, math.inf, tolerance["loss"], seconds, note, "gradients")
    found = []
    for a, b in zip(rows, base):
        for key in ("loss", "grad_norm"):
            found.append((relative(a.get(key), b.get(key), FLOOR[key]), tolerance[key], f"{key} at step {b['step']}"))
    found.append((weights_difference(got / "final", want / "final"), tolerance["weights"], "final weights"))

    def beyond(item) -> float:
        diff, tol, _ = item
        return diff / tol if tol else (math.inf if diff > 0 else 0.0)

    diff, tol, where = max(found, key=beyond)
    return Check(name, diff, tol, seconds, where=where if diff else "every figure")


def relative(a, b, floor: float) -> float:
    """|a - b| relative to b, or to `floor` for a figure nearer zero (FLOOR)."""
    if not isinstance(a, (int, float)) or not isinstance(b, (int, float)):
        return math.inf
    return abs(a - b) / max(abs(b), floor)


def train_rows(out: Path) -> list[dict]:
    return [row for row in read_metrics(out / METRICS_FILE) if "loss" in row]


def weights_difference(got: Path, want: Path) -> float:
    """max |a - b| / max |b| over every weight two final/ directories hold."""
    from safetensors.torch import load_file

    def weights(folder: Path) -> dict:
        out = {}
        for f in sorted(folder.rglob("*.safetensors")):
            out |= {f"{f.relative_to(folder)}:{k}": v for k, v in load_file(f).items()}
        return out

    a, b = weights(got), weights(want)
    if a.keys() != b.keys():
        return math.inf
    diff = max((float((a[k].float() - b[k].float()).abs().max()) for k in b), default=0.0)
    scale = max((float(b[k].float().abs().max()) for k in b), default=1.0)
    return diff / max(scale, 1e-12)


# --- the report ---------------------------------------------------------------------------

MEANINGS = {
    "packed": "a packed sample sees the others (a mask or positions that do not isolate it in this "
    "architecture's attention), its positions do not restart at 0, or its images' features land on another's tokens",
    "accumulation": "gradient accumulation changes the update: a loss averaged per micro-batch rather than over the "
    "global batch, or a layer whose output depends on the batch (batch norm)",
    "2 processes": "the number of processes changes the update: a loss or advantage normalised per process, data "
    "that differ between processes, or a layer that depends on the batch",
    "your backend": "your distributed backend computes another update than plain DDP: check its precision settings "
    "and that every process runs every forward",
    "resume on 2 processes": "a resumed run on another process count reads other rows or restores another state",
    "resume": "a resumed run does not continue the run it resumes: some state (data position, random state, "
    "optimizer) is not saved or restored",
    "the same run twice": "two identical runs differ: something in the run is not deterministic",
}


def meaning(name: str) -> str:
    return next(text for key, text in MEANINGS.items() if name.startswith(key))


def table(checks: list[Check]) -> str:
    rows = [["check", "worst difference", "of", "tolerance", "result", "seconds"]]
    for c in checks:
        if c.skipped:
            rows.append([c.name, "", "", "", "skipped", ""])
            continue
        tolerance = f"{c.tolerance:.0e}" if c.tolerance else "exact"
        rows.append([c.name, f"{c.worst:.2e}", c.where, tolerance, "pass" if c.passed else "FAIL", f"{c.seconds:.1f}"])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in rows)


def report(checks: list[Check], where: Where, model: str, full: bool) -> dict:
    return {
        "passed": all(c.passed for c in checks),
        "model": model,
        "weights": "full" if full else "shrunk",
        "checks": [dataclasses.asdict(c) | {"passed": c.passed} for c in checks],
        "steps": STEPS,
        "global_batch": BATCH,
        "device": "cpu" if not where.gpus else f"{where.gpus} gpu",
        "mixed_precision": where.precision,
    }
