"""`llmtrain eval`: a recipe's held-out measures on any model, and two models side by side.

    llmtrain eval MODEL [MODEL ...] --config F [--recipe NAME] [--output results.json] [key=value ...]

Each MODEL (a run's final/, a model directory, a LoRA adapter's directory, a hub name) is
measured as the recipe's own evaluation measures a run: on the config's held-out data
(data.eval, or data.eval_fraction of data.train), with the config's batch sizes, through the
method's data source and objective, so the figures are the ones a training run's evaluation
rows would show for that model (SFT's loss, and its perplexity; preference and reward
accuracy and margins; GRPO's reward and pass@k). A method with a reference model (DPO's)
measures against the config's model.name_or_path, the model a run would have started from.

The results are printed as a table (a column per model, then the difference of the last from
the first) and, with --output, written as JSON. Under `accelerate launch` every process
takes a share of the held-out data (plain data parallelism)."""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import tempfile
from dataclasses import dataclass
from pathlib import Path

from accelerate.utils import send_to_device
from safetensors.torch import load_file

from . import demo, safefs
from .cli import refuse_options, run_config
from .config.load import absolute_paths, check, load_config
from .data.build import build_datasets
from .distributed.backend import Backend
from .distributed.launch import main_first, setup_accelerator
from .distributed.topology import Topology
from .distributed.watchdog import Watchdog
from .errors import ConfigError, ModelError
from .files import read_own
from .methods import METHODS, demo_config, sections
from .model import attention_backend, check_model, check_vocab, load_model, load_tokenizer
from .output.checkpoint import STATE_FILE, check_pickles
from .plan import recipe_named, recipe_option
from .processor import is_vision, processor_of, vision_in_every_forward
from .rl.tasks import Tasks
from .vision import rows_kind


def parse(argv: list[str]):
    parser = argparse.ArgumentParser(prog="llmtrain eval", description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=None, help="YAML config (the run's, or one for the data)")
    recipe_option(parser, "the recipe whose measures to take")
    parser.add_argument("--output", type=Path, default=None, help="write the results as JSON to this file")
    parser.add_argument(
        "--lm-eval-only",
        action="store_true",
        help="run eval.lm_eval_tasks alone (as a run does on each checkpoint it writes)",
    )
    parser.add_argument("words", nargs="*", metavar="MODEL or key.sub=value")
    args, unknown = parser.parse_known_intermixed_args(argv)
    args.models = [w for w in args.words if "=" not in w]
    args.overrides = [w for w in args.words if "=" in w]
    return parser, args, unknown


def main(argv: list[str]) -> None:
    parser, args, unknown = parse(argv)
    method = METHODS[args.recipe or recipe_named(args.config, args.overrides)]
    refuse_options(unknown, argv, parser, method.schema)
    if not args.models:
        raise ConfigError(
            ["llmtrain eval: name the model(s) to measure, e.g. llmtrain eval runs/demo/final --config F"]
        )
    cfg = run_config(args.config, args.overrides, method, demo_config(method), sections())
    absolute_paths(cfg)
    if args.lm_eval_only and not cfg.eval.lm_eval_tasks:
        raise ConfigError(["eval.lm_eval_tasks: --lm-eval-only runs them; name at least one"])
    if not (cfg.data.names("eval") or cfg.data.eval_fraction or cfg.eval.tasks or cfg.eval.lm_eval_tasks):
        raise ConfigError(
            [
                "data.eval: llmtrain eval measures on held-out data; give data.eval (or data.eval_fraction), "
                "eval.tasks or eval.lm_eval_tasks"
            ]
        )
    accelerator = setup_accelerator(cfg)
    if Topology.of(accelerator).deepspeed or Topology.of(accelerator).fsdp:
        raise ConfigError(
            ["llmtrain eval: runs on one process or plain data parallelism (DDP); launch it without DeepSpeed or FSDP"]
        )
    with main_first(accelerator):
        demo.resolve_demo_names(cfg)
    base = cfg.model.name_or_path
    how = ""
    if not args.recipe:
        how = f" (the config's {method.section} section)" if method.section else " (no recipe's own section set)"
        how += "; --recipe names another"
    accelerator.print(f"llmtrain eval: the {method.name} recipe's measures{how}")
    results = {}
    with tempfile.TemporaryDirectory(prefix="llmtrain-eval-") as scratch:
        for i, name in enumerate(args.models):
            accelerator.print(f"measuring {name}")
            saved = checkpoint_model(name, method)
            adapter = None if saved else adapter_base(name)
            target = saved.name_or_path if saved else adapter[1] if adapter else name
            measured = model_config(cfg, method, target, base, Path(scratch) / str(i), trained=bool(adapter))
            if saved:
                measured.model = saved  # built as the run built it (LoRA too), then its weights loaded
            weights = Checkpoint(Path(name).expanduser(), measured.output_dir) if saved else None
            results[name] = {}
            if not args.lm_eval_only:
                results[name] = measure(
                    method, copy.deepcopy(measured), accelerator, adapter[0] if adapter else None, weights
                )
            if cfg.eval.lm_eval_tasks:
                results[name] |= lm_eval_figures(measured, adapter[0] if adapter else None, accelerator, weights)
    if accelerator.is_main_process:
        print(table(results))
        if args.output is not None:
            safefs.write_text(args.output, json.dumps(report(results), indent=2) + "\n")
            print(f"wrote {args.output}")
    accelerator.end_training()


def model_config(cfg, method, model: str, base: str, scratch: Path, trained: bool = False):
    """The config for measuring `model`: the run's, with the model named in place of
    model.name_or_path (a demo: name resolved), no LoRA (the model is measured as it is),
    the reference of a method that has one (its section's `reference`) the config's own
    model where the config names none and `model` is another (or `trained` weights go on
    it), and a scratch output_dir (a preference run's reference log-probs are kept there,
    never in the run's own)."""
    out = copy.deepcopy(cfg)
    out.model.name_or_path = model
    out.model.lora.enabled = False
    out.output_dir = str(scratch)
    if model != base or trained:
        refer_to(out, method, base)
    demo.resolve_demo_names(out)
    return out


def refer_to(cfg, method, base: str) -> None:
    """A method with a reference model (its section's `reference`, DPO's) measures against
    `base` where the config names none: the model measured is not the one the run started
    from, which the method would take by default."""
    holder = getattr(cfg, method.section, None) if method.section else None
    if holder is not None and hasattr(holder, "reference") and not holder.reference:
        holder.reference = base


def checkpoint_model(name: str, method):
    """The model section of the run a checkpoint directory (checkpoints/step-N: its
    config.yaml, train_state.json and the weights Accelerate saved) belongs to, or None for
    another directory. A QLoRA run's checkpoint is refused in one line."""
    local = Path(name).expanduser()
    if not ((local / STATE_FILE).is_file() and (local / "config.yaml").is_file()) or (local / "config.json").exists():
        return None
    try:
        saved = load_config(local / "config.yaml", [], method.schema, sections())
    except ConfigError as e:
        raise ModelError(f"llmtrain eval: {name}/config.yaml cannot be read as a {method.name} run's ({e})") from None
    if saved.model.quantization != "none":
        raise ModelError(f"llmtrain eval: {name} is a QLoRA checkpoint; measure the run's final/ instead")
    return saved.model


def adapter_base(name: str) -> tuple[str, str] | None:
    """(the directory, its base model) for a directory of LoRA adapters only (a LoRA run's
    final/), else None."""
    local = Path(name).expanduser()
    if not ((local / "adapter_config.json").is_file() and not (local / "config.json").is_file()):
        return None
    try:
        base = json.loads(read_own(local / "adapter_config.json", 1 << 20))["base_model_name_or_path"]
    except (OSError, ValueError, KeyError, TypeError):
        base = None
    if not isinstance(base, str) or not base:
        raise ModelError(f"llmtrain eval: {name}/adapter_config.json names no base model (base_model_name_or_path)")
    return str(local), base


def measure(
    method, cfg, accelerator, adapter: str | None = None, weights: Checkpoint | None = None
) -> dict[str, float]:
    """The method's evaluation of cfg.model.name_or_path (with the LoRA `adapter` directory
    merged into it, its tokenizer the adapter's; or with the checkpoint's `weights` loaded
    into the model cfg.model builds, LoRA merged) on cfg's held-out data, as a run's
    evaluation row would show it at step 0 (its figures; the reward functions are told step
    0), plus what the method derives from them (SFT's perplexity)."""
    mcfg = check_model(cfg.model, cfg.data.max_seq_len)
    cfg.model.attn_implementation = attention_backend(cfg.model, mcfg, cfg.data.packing, accelerator.device).name
    check(cfg)
    own = dataclasses.replace(cfg.model, name_or_path=adapter) if adapter else cfg.model  # the run saved its tokenizer
    tokenizer = load_tokenizer(own, cfg.data.chat_template_text(), is_vision(mcfg))
    check_vocab(cfg.model, mcfg, tokenizer)
    if method.check is not None:
        method.check(cfg, tokenizer)
    kind = rows_kind(method.kind(cfg), tokenizer, cfg, mcfg)
    train_set, eval_set = build_datasets(cfg, accelerator, tokenizer, kind)
    tasks = Tasks.load(cfg, accelerator, tokenizer)
    model = load_model(cfg.model)
    if weights is not None:
        load_weights(model, weights.state(), weights.path)
        if hasattr(model, "peft_config"):
            model = model.merge_and_unload()
        cfg.model.lora.enabled = False  # measured as a whole model from here on
        refer_to(cfg, method, cfg.model.name_or_path)  # the run's start, not these weights
    if adapter:
        from peft import PeftModel  # its import takes seconds: only for adapters (llmtrain --help stays quick)

        model = PeftModel.from_pretrained(model, adapter).merge_and_unload()
    if accelerator.num_processes > 1 and processor_of(tokenizer) is not None:
        vision_in_every_forward(model, processor_of(tokenizer))
    parts = method.parts(cfg, accelerator, model, tokenizer, train_set, eval_set)
    backend = Backend(accelerator, cfg.train.grad_accum_steps)
    with Watchdog(cfg.train.hang_timeout_s, accelerator.process_index, accelerator.num_processes) as watchdog:
        prepared = accelerator.prepare(backend.place(model))
        data = parts.source(prepared, backend, watchdog.beat)
        if parts.after_prepare is not None:
            empty = send_to_device(data.empty_batch(), accelerator.device)
            parts.after_prepare(prepared, accelerator, empty, watchdog.beat, None)
        figures = data.evaluate(0) if data.evaluates else {}
        if tasks is not None:
            tasks.bind(prepared, False, watchdog.beat)
            figures |= tasks.evaluate(0)
    return figures | method.derived(figures)


def lm_eval_figures(cfg, adapter: str | None, accelerator, weights: Checkpoint | None = None) -> dict[str, float]:
    """eval.lm_eval_tasks on cfg.model.name_or_path (with the LoRA `adapter` on it; or the
    model cfg.model builds with a checkpoint's `weights` loaded, LoRA merged) through
    lm-eval's Python API and its Hugging Face backend, as `lm_eval --model hf` runs them:
    each task's metrics as '<task>/<metric>' ('<task>/<metric>,<filter>' for a filter other
    than none); standard errors left out. Under several processes lm-eval splits the
    requests itself (a checkpoint's model, built here, is evaluated by the main process);
    the main process gets the figures."""
    import lm_eval  # seconds to import, and an extra: only when tasks are asked for
    from lm_eval.tasks import TaskManager

    e = cfg.eval
    manager = TaskManager(include_path=e.lm_eval_include or None)
    unknown = [t for t in e.lm_eval_tasks if t not in manager.all_tasks]
    if unknown:
        where = f" or in {e.lm_eval_include}" if e.lm_eval_include else " (give your own with eval.lm_eval_include)"
        raise ConfigError([f"eval.lm_eval_tasks: no task {', '.join(unknown)} in lm-eval{where}"])
    args = {"pretrained": cfg.model.name_or_path, "dtype": cfg.model.dtype}
    if cfg.model.trust_remote_code:
        args["trust_remote_code"] = True
    if adapter:
        args["peft"] = adapter
    model = "hf"
    if weights is not None:  # lm-eval takes a model object whole, on one process
        if not accelerator.is_main_process:
            accelerator.wait_for_everyone()
            return {}
        from lm_eval.models.huggingface import HFLM

        built = load_model(cfg.model)  # as its run built it (LoRA too), then its weights
        load_weights(built, weights.state(), weights.path)
        built = built.merge_and_unload() if hasattr(built, "peft_config") else built
        tokenizer = load_tokenizer(cfg.model, cfg.data.chat_template_text(), False)
        batch = e.micro_batch_size or cfg.train.micro_batch_size
        model, args = HFLM(pretrained=built.eval(), tokenizer=tokenizer, batch_size=batch), None
    results = lm_eval.simple_evaluate(
        model=model,
        model_args=args,
        tasks=list(e.lm_eval_tasks),
        task_manager=manager,
        device=str(accelerator.device),
        batch_size=e.micro_batch_size or cfg.train.micro_batch_size,
        limit=e.lm_eval_limit or None,
        log_samples=False,
    )
    if weights is not None:
        accelerator.wait_for_everyone()
    out: dict[str, float] = {}
    for task, figures in (results or {}).get("results", {}).items():
        for key, value in figures.items():
            metric, _, kept = key.partition(",")
            if not kept or metric.endswith("_stderr") or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            out[f"{task}/{metric}" + ("" if kept == "none" else f",{kept}")] = float(value)
    return out


@dataclass
class Checkpoint:
    """A checkpoint directory being measured, its weights gathered once (`state`), on first
    use: the held-out measures and lm-eval both load them."""

    path: Path
    scratch: str  # where a sharded run's weights are merged
    gathered: dict | None = None

    def state(self) -> dict:
        if self.gathered is None:
            self.gathered = checkpoint_weights(self.path, self.scratch)
        return self.gathered


def checkpoint_weights(path: Path, scratch: str) -> dict:
    """A checkpoint's whole weights: model.safetensors as a run of one process or DDP saved
    it, or gathered on this process from a sharded run's shards: DeepSpeed ZeRO's float32
    masters (as its final/ exports them; its files' pickles checked first, as a resume checks
    them), or FSDP2's distributed checkpoint, merged into `scratch` (no process group
    needed)."""
    if (path / "model.safetensors").is_file():
        return load_file(path / "model.safetensors")
    if (path / "latest").is_file():  # DeepSpeed's own folder
        try:
            from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
        except ImportError:
            raise ModelError(
                f"llmtrain eval: {path} holds DeepSpeed's shards, which need DeepSpeed to gather; "
                'pip install -e ".[deepspeed]"'
            ) from None
        check_pickles(path, "llmtrain eval", "Measure only checkpoints you trust")
        return get_fp32_state_dict_from_zero_checkpoint(str(path))
    shards = sorted(path.glob("pytorch_model_fsdp_*"))
    if shards:
        from accelerate.utils import merge_fsdp_weights

        merged = Path(scratch) / "merged"
        merged.mkdir(parents=True, exist_ok=True)
        merge_fsdp_weights(str(shards[0]), str(merged), safe_serialization=True)
        return load_file(merged / "model.safetensors")
    raise ModelError(f"llmtrain eval: {path} holds no weights llmtrain saved (model.safetensors, or a sharded run's)")


def load_weights(model, state: dict, path: Path) -> None:
    """A checkpoint's saved weights (of the checkpoint `path`) into the model its run's
    config builds: every weight found, and none missing but those tied to one that is (an
    output layer tied to the embedding is saved once)."""
    found = model.load_state_dict(state, strict=False)
    named = dict(model.named_parameters(remove_duplicate=False))
    loaded = {id(named[k]) for k in state if k in named}
    missing = [k for k in found.missing_keys if k not in named or id(named[k]) not in loaded]
    if missing or found.unexpected_keys:
        raise ModelError(
            f"llmtrain eval: {path} does not fit the model its run's config.yaml builds "
            f"(missing {missing[:3]}, unexpected {found.unexpected_keys[:3]})"
        )


def table(results: dict[str, dict[str, float]]) -> str:
    """The figures, a column per model, and with two or more the last minus the first."""
    names = list(results)
    keys = list(dict.fromkeys(k for figures in results.values() for k in figures))
    columns = [column(n) for n in names]
    header = ["", *columns] + (["difference"] if len(names) > 1 else [])
    rows = [header]
    for key in keys:
        values = [results[n].get(key) for n in names]
        row = [key] + [f"{v:.4f}" if v is not None else "-" for v in values]
        if len(names) > 1:
            first, last = values[0], values[-1]
            row.append(f"{last - first:+.4f}" if first is not None and last is not None else "-")
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    return "\n".join(
        "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows
    )


def column(name: str) -> str:
    """A model's column heading: a directory by its name, with its parent's for a run's
    final/ or checkpoint (runs/a/final: a/final); a hub name as it is."""
    path = Path(name.rstrip("/"))
    if not path.is_dir():
        return name
    return f"{path.parent.name}/{path.name}" if path.name == "final" or path.name.startswith("step-") else path.name


def report(results: dict[str, dict[str, float]]) -> dict:
    """The JSON written with --output: each model's figures, and the difference of the last
    model's from the first's where both have a figure."""
    out: dict = {"models": results}
    names = list(results)
    if len(names) > 1:
        first, last = results[names[0]], results[names[-1]]
        out["difference"] = {k: last[k] - first[k] for k in last if k in first}
    return out
