"""`llmtrain verify`: the guarantees checked on the user's own model, data and launch config.

    llmtrain verify --config F [--recipe NAME] [--accelerate-config A] [--output report.json] [key=value ...]

The user's architecture is shrunk (`shrink`: the same model class and config, 2 layers of
width 64, the vocabulary kept for the user's tokenizer; sliding windows, experts and
absolute positions kept) and built with random weights. The user's tokenizer and chat
template come with it, and the first rows of each training source are sampled (`sample`).
The recipe then trains 3 steps of a global batch of 4 in several layouts, each launched
as a run is launched (`python -m llmtrain.recipe`, under `accelerate launch` for several
processes):

- reference: one process, the whole global batch in one micro-batch;
- accumulation: one process, 4 micro-batches of 1;
- 2 processes: data parallel (DDP over gloo on CPU), 2 micro-batches of 1 each;
- the user's backend (--accelerate-config: DeepSpeed ZeRO or FSDP2) against plain DDP;
- resume: the reference killed after step 1's checkpoint and run again: the same steps
  exactly;
- resume on 2 processes: the same checkpoint continued on another process count.

Each check compares the steps' losses, gradient norms and the final weights with its
baseline; the worst difference against the check's tolerance (0 where the computation is
the same, float32 rounding where the order of a reduction differs) is the result. A table
and, with --output, JSON; exit status 1 when a check fails, with one line on what it
means. What makes runs differ by design (dropout) is said with the failure.
"""

from __future__ import annotations

import argparse
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
from .data.build import ROWS as SFT_ROWS
from .data.packing import PackedDataset
from .data.rows import KEPT, process_row
from .data.sources import load_source
from .errors import ConfigError, ModelError
from .methods import METHODS, demo_config, sections
from .model import attention_backend, check_model, load_model, load_tokenizer
from .observe.metrics import METRICS_FILE, read_metrics
from .plan import read_launch, recipe_named, recipe_option
from .processor import is_vision

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
FLOOR = 1e-3  # losses and gradient norms nearer zero are compared as if they were this
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

    @property
    def passed(self) -> bool:
        return self.worst <= self.tolerance


def parse(argv: list[str]):
    parser = argparse.ArgumentParser(prog="llmtrain verify", description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=None, help="YAML config of the run to verify")
    recipe_option(parser, "the recipe to verify")
    parser.add_argument(
        "--accelerate-config", type=Path, default=None, help="your accelerate config (DeepSpeed, FSDP2) to check too"
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
    absolute_paths(cfg)
    given = {key: value for key, value, _ in path_values(cfg)}
    demo.resolve_demo_names(cfg)
    # The demo's other assets (a teacher, a reference) by their paths: beside a model of the
    # user's (the shrunk one), a run takes no demo name.
    demos = [f"{k}={v}" for k, v, _ in path_values(cfg) if given.get(k, "").startswith("demo:") and "[" not in k]
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="llmtrain-verify-") as scratch:
        root = Path(scratch)
        print(f"llmtrain verify: the {method.name} recipe, on {cfg.model.name_or_path} shrunk")
        model, dropout = shrink(cfg.model, root / "model")
        dropout = dropout if cfg.model.dropout == "model" else ""  # model.dropout=none turns it off
        data = sample(cfg.data.names(), root / "data")
        base = [*args.overrides, *demos, *fixed(cfg, model, data), *method.verify(cfg)]
        runner = Runner(method.name, args.config, base, root)
        checks = []
        if "packing" in only and cfg.data.packing and method.kind(cfg) is SFT_ROWS:
            checks += [c for c in [packing(cfg, model, data)] if c is not None]
        checks += run_checks(runner, args.accelerate_config, cfg, only)
    for check in checks:
        if not check.passed and dropout:
            check.note = f"dropout is on ({dropout}): each layout draws other masks; set model.dropout=none"
        elif not check.passed and not check.tolerance and check.worst <= FLOAT32["loss"] and not check.note:
            check.note = (
                f"{meaning(check.name)}; or, the difference being float rounding, a kernel that is not deterministic "
                "every time: run verify again, and a repeat that differs tells"
            )
    print(table(checks))
    failed = [c for c in checks if not c.passed]
    print(
        f"{len(checks) - len(failed)} of {len(checks)} checks passed in {time.monotonic() - started:.0f} s"
        + ("" if not failed else f"; failed: {', '.join(c.name for c in failed)}")
    )
    for check in failed:
        print(f"{check.name}: {check.note or meaning(check.name)}")
    if args.output is not None:
        safefs.write_text(args.output, json.dumps(report(checks), indent=2) + "\n")
        print(f"wrote {args.output}")
    if failed:
        sys.exit(1)


def fixed(cfg, model: Path, data: list[Path]) -> list[str]:
    """The overrides every verifying run takes: the shrunk model and the sampled rows, a
    short sequence length, no evaluation, a checkpoint after every step, quiet logs."""
    return [
        f"model.name_or_path={model}",
        f"data.train=[{', '.join(str(p) for p in data)}]",
        "data.eval=[]",
        "data.eval_fraction=0",
        f"data.max_seq_len={min(cfg.data.max_seq_len, MAX_SEQ_LEN)}",
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


def shrink(model_cfg, out: Path) -> tuple[Path, str]:
    """The user's model (model_cfg.name_or_path) rebuilt small in `out` with random weights,
    its tokenizer beside it; and the dropout its config leaves on ('' for none)."""
    import torch
    from transformers import (
        AutoConfig,
        AutoModelForCausalLM,
        AutoModelForImageTextToText,
        AutoProcessor,
        AutoTokenizer,
    )

    name = model_cfg.name_or_path
    try:
        config = AutoConfig.from_pretrained(name, trust_remote_code=model_cfg.trust_remote_code)
        tokenizer = AutoTokenizer.from_pretrained(name, trust_remote_code=model_cfg.trust_remote_code)
    except Exception as e:  # a name that is no model
        raise ModelError(f"model.name_or_path: {name} cannot be read as a model config and tokenizer ({e})") from None
    text = getattr(config, "text_config", None) or config
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
    dropout = ", ".join(
        f"config.{k}={v}"
        for k, v in sorted(vars(text).items())
        if ("dropout" in k or k.endswith("_pdrop")) and not k.startswith("summary_") and isinstance(v, float) and v > 0
    )
    torch.manual_seed(0)  # the same shrunk model at every verify
    vision = is_vision(config)  # its language model shrunk; its vision tower kept whole
    auto = AutoModelForImageTextToText if vision else AutoModelForCausalLM
    model = auto.from_config(config, trust_remote_code=model_cfg.trust_remote_code)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    if vision:  # its processor too: how images become tokens
        AutoProcessor.from_pretrained(name, trust_remote_code=model_cfg.trust_remote_code).save_pretrained(out)
    return out, dropout


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


def packing(cfg, model_dir: Path, data: list[Path]) -> Check | None:
    """The packed vs unpacked check, on this process: the sampled rows tokenized and packed
    as a run packs them (data.max_seq_len capped), the shrunk model's logits over each of
    the first PACKS packed sequences against those of each sample run alone, with the
    attention backend a run would take. Every sample must see only itself. None for a
    vision-language model's rows (not checked here yet)."""
    import datasets
    import pyarrow as pa
    import torch

    started = time.monotonic()
    data_cfg = dataclasses.replace(cfg.data, max_seq_len=min(cfg.data.max_seq_len, MAX_SEQ_LEN))
    model_cfg = dataclasses.replace(cfg.model, name_or_path=str(model_dir), lora=dataclasses.replace(cfg.model.lora))
    model_cfg.lora.enabled = False  # the base's attention is what packing must isolate
    mcfg = check_model(model_cfg, data_cfg.max_seq_len)
    if is_vision(mcfg):
        return None
    model_cfg.attn_implementation = attention_backend(model_cfg, mcfg, True, torch.device("cpu")).name
    tokenizer = load_tokenizer(model_cfg, data_cfg.chat_template_text(), is_vision(mcfg))
    rows = [json.loads(line) for path in data for line in path.read_text().splitlines() if line]
    examples = [e for e in (process_row(r, data_cfg.format, tokenizer, data_cfg) for r in rows) if e["status"] in KEPT]
    keys = ("input_ids", "labels", "length", "n_trained")
    table = pa.Table.from_pylist([{k: e[k] for k in keys} for e in examples])
    packed = PackedDataset(datasets.Dataset(table, fingerprint="llmtrain-verify"), capacity=data_cfg.max_seq_len)
    model = load_model(model_cfg).eval()
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    worst, where = 0.0, "every sample"
    with torch.no_grad():
        for j in range(min(len(packed), PACKS)):
            batch = Collator(pad, pack_width=data_cfg.max_seq_len)([packed[j]])
            logits = model(**model_inputs(model, batch)).logits[0].float()
            start = 0
            for i in packed.bins[j]:
                ids = torch.tensor([examples[i]["input_ids"]])
                alone = model(input_ids=ids).logits[0].float()
                diff = float((logits[start : start + ids.shape[1]] - alone).abs().max() / alone.abs().max())
                if diff > worst:
                    worst, where = diff, f"sample {i} in pack {j}"
                start += ids.shape[1]
    return Check("packed vs each sample alone", worst, FLOAT32["loss"], time.monotonic() - started, where=where)


# --- the runs -----------------------------------------------------------------------------


class Runner:
    """Launches the recipe as a user does, in `root`/<name>, and reads what a run wrote."""

    def __init__(self, recipe: str, config: Path | None, overrides: list[str], root: Path):
        self.recipe, self.config, self.overrides, self.root = recipe, config, overrides, root

    def run(self, layout: Layout, out: Path, extra: list[str] = ()) -> float:
        """Train `layout` into `out`; returns the seconds it took."""
        args = (["--config", str(self.config)] if self.config else []) + self.overrides
        args += [*layout.overrides(), f"output_dir={out}", *extra]
        command = [sys.executable, "-m", "llmtrain.recipe", self.recipe, *args]
        env = dict(os.environ)
        if layout.processes > 1 or layout.accelerate_config:
            flags = ["--num_processes", str(layout.processes), "--main_process_port", str(free_port())]
            flags += ["--mixed_precision", layout.precision]
            if layout.accelerate_config is not None:
                flags = ["--config_file", str(layout.accelerate_config), *flags]
            else:
                flags = ["--multi_gpu", *flags]
            command = [sys.executable, "-m", "accelerate.commands.launch", *flags, "-m", "llmtrain.recipe"]
            command += [self.recipe, *args]
            if layout.distributed_type != "DEEPSPEED" and not on_gpu():
                env["ACCELERATE_USE_CPU"] = "1"  # DDP and FSDP2 over gloo; DeepSpeed picks its CPU accelerator
        started = time.monotonic()
        proc = subprocess.run(command, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            said = [line.removeprefix("error: ") for line in proc.stderr.splitlines() if line.startswith("error:")]
            raise ConfigError(
                [f"llmtrain verify: the {layout.name} run failed: " + (said[-1] if said else proc.stderr[-2000:])]
            )
        return time.monotonic() - started


def on_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# The checks by the names --only takes.
CHECKS = ("packing", "accumulation", "processes", "backend", "resume", "resume-processes")


def run_checks(runner: Runner, accelerate_config: Path | None, cfg, only: set[str]) -> list[Check]:
    """The checks of `only` (all of CHECKS; `backend` where an accelerate config is given),
    each run in its layout and compared with its baseline."""
    root = runner.root
    if not only - {"packing"}:  # no check that trains
        return []
    one = Layout("reference", 1, BATCH, 1)
    two = Layout("2 processes", 2, BATCH // 2, 1)
    took = {"reference": runner.run(one, root / "reference")}

    def ran(layout: Layout, out: Path, extra: list[str] = ()) -> Path:
        took[out.name] = runner.run(layout, out, extra)
        return out

    checks = []
    if "accumulation" in only:
        out = ran(Layout("accumulation", 1, 1, BATCH), root / "accumulation")
        checks.append(compare("accumulation vs one micro-batch", out, root / "reference", FLOAT32, took[out.name]))
    if only & {"processes", "backend"}:
        ran(two, root / "2 processes")
    if "processes" in only:
        out = root / "2 processes"
        checks.append(compare("2 processes vs one micro-batch", out, root / "reference", FLOAT32, took[out.name]))
    if "backend" in only and accelerate_config is not None:
        launch = read_launch(str(accelerate_config), cfg)  # read with bounds, as llmtrain plan reads it
        precision = launch.mixed_precision if launch.mixed_precision in ("bf16", "fp16") else "no"
        backend = Layout("your backend", 2, BATCH // 2, 1, accelerate_config, precision, launch.distributed_type)
        out = ran(backend, root / "backend")
        baseline, tolerance = root / "2 processes", FLOAT32
        if precision != "no":  # DDP in the same precision, and that precision's bounds
            baseline, tolerance = ran(dataclasses.replace(two, precision=precision), root / f"ddp-{precision}"), HALF
        name = f"your backend vs DDP{'' if precision == 'no' else f' ({precision})'}"
        checks.append(compare(name, out, baseline, tolerance, took[out.name]))
    exact = dict.fromkeys(FLOAT32, EXACT)
    if "resume" in only:  # the same run again: exact, unless the model's kernels are not deterministic
        out = ran(one, root / "repeat")
        repeat = compare("the same run twice", out, root / "reference", exact, took[out.name])
        if not repeat.passed:
            repeat.note = (
                "the model's kernels are not deterministic (some mixture-of-experts kernels on CPU, atomic "
                "additions on GPUs): two identical runs differ, so no resume can be exact; resume is held to float "
                "rounding instead"
            )
            exact = FLOAT32
        checks.append(repeat)
    for key, name, layout, tolerance in (
        ("resume", "resume", one, exact),
        ("resume-processes", "resume on 2 processes", two, FLOAT32),
    ):
        if key in only:
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
            found.append((relative(a.get(key), b.get(key)), tolerance[key], f"{key} at step {b['step']}"))
    found.append((weights_difference(got / "final", want / "final"), tolerance["weights"], "final weights"))

    def beyond(item) -> float:
        diff, tol, _ = item
        return diff / tol if tol else (math.inf if diff > 0 else 0.0)

    diff, tol, where = max(found, key=beyond)
    return Check(name, diff, tol, seconds, where=where if diff else "every figure")


def relative(a, b) -> float:
    """|a - b| relative to b, or to FLOOR for a figure nearer zero (a GRPO loss, whose
    advantages average to zero, can be 1e-5 with its rounding at 1e-9)."""
    if not isinstance(a, (int, float)) or not isinstance(b, (int, float)):
        return math.inf
    return abs(a - b) / max(abs(b), FLOOR)


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
    "architecture's attention), or its positions do not restart at 0",
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
        tolerance = f"{c.tolerance:.0e}" if c.tolerance else "exact"
        rows.append([c.name, f"{c.worst:.2e}", c.where, tolerance, "pass" if c.passed else "FAIL", f"{c.seconds:.1f}"])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in rows)


def report(checks: list[Check]) -> dict:
    return {
        "passed": all(c.passed for c in checks),
        "checks": [dataclasses.asdict(c) | {"passed": c.passed} for c in checks],
        "steps": STEPS,
        "global_batch": BATCH,
    }
