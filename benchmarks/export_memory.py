"""The main process's memory while final/ is exported from a model sharded over processes:
llmtrain's shard-by-shard gather (`export.write_weights`) against Accelerate's
`get_state_dict` + `save_pretrained(max_shard_size=...)`, which is what
`accelerator.save_model` and the Hugging Face Trainer do.

    python benchmarks/export_memory.py                   # FSDP2, 2 CPU processes, 1.07 GB model, 200MB shards
    python benchmarks/export_memory.py --stage zero3     # DeepSpeed ZeRO-3 instead
    python benchmarks/export_memory.py --layers 24 --shard 500MB

Each export runs in its own `accelerate launch` of 2 processes (over gloo, on CPU), in the
order ours, peer, ours, peer. A worker builds a randomly initialised Llama in fp32 (seeded),
shards it with `accelerator.prepare`, then measures on the main process its resident set
(VmRSS) just before the export and its peak during it (VmHWM, reset first through
/proc/self/clear_refs). Reported: the increase, peak - before, against the model's size
and the shard size, the highest of the repeats; and the export's time. The two outputs are
checked to hold the same tensors.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
GIB = 2**30


def status(field: str) -> int:
    """A /proc/self/status memory field, in bytes."""
    text = Path("/proc/self/status").read_text()
    return int(re.search(rf"^{field}:\s+(\d+) kB", text, re.M).group(1)) * 1024


def worker(args) -> None:
    import torch
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs
    from transformers import LlamaConfig, LlamaForCausalLM

    from llmtrain.distributed.launch import fsdp_on_cpu, process_group_backend
    from llmtrain.output import export

    backend = process_group_backend()  # gloo for DeepSpeed on CPU, as the recipes use
    accelerator = Accelerator(kwargs_handlers=[InitProcessGroupKwargs(backend=backend)] if backend else [])
    if accelerator.num_processes != 2:
        sys.exit(f"the worker runs in {accelerator.num_processes} process(es), not a group of 2")
    if args.stage == "fsdp2":
        fsdp_on_cpu(accelerator)
    else:
        ds = accelerator.state.deepspeed_plugin.deepspeed_config
        ds.update(train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=1, train_batch_size=2)
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=args.hidden,
        intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64,
        num_key_value_heads=args.hidden // 64,
        vocab_size=args.vocab,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    largest = max(p.numel() * p.element_size() for p in model.parameters())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # DeepSpeed prepares a model with its optimizer
    model, optimizer = accelerator.prepare(model, optimizer)
    out = Path(args.out)
    accelerator.wait_for_everyone()
    export.release_freed_memory()  # what building and sharding the model freed is not counted as in use
    before = status("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    start = time.perf_counter()
    if args.worker == "ours":
        unwrapped = accelerator.unwrap_model(model)
        export.write_weights(accelerator, unwrapped, out, args.shard)
    else:
        state_dict = accelerator.get_state_dict(model)
        if accelerator.is_main_process:
            accelerator.unwrap_model(model).save_pretrained(out, state_dict=state_dict, max_shard_size=args.shard)
        del state_dict
    accelerator.wait_for_everyone()
    seconds = time.perf_counter() - start
    if accelerator.is_main_process:
        peak = status("VmHWM")
        result = {"model_bytes": size, "largest": largest, "before": before, "peak": peak, "seconds": seconds}
        print("RESULT " + json.dumps(result), flush=True)
    accelerator.end_training()


def launch(args, system: str, out: Path) -> dict:
    config = "fsdp2.yaml" if args.stage == "fsdp2" else "ds_zero3.yaml"
    command = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(ROOT / "accelerate_configs" / config),
        "--num_processes",
        "2",
        "--mixed_precision",
        "no",
        str(Path(__file__).resolve()),
        "--worker",
        system,
        "--out",
        str(out),
        *[f"--{k}={getattr(args, k)}" for k in ("stage", "hidden", "layers", "vocab", "shard")],
    ]
    env = dict(os.environ, ACCELERATE_USE_CPU="1") if args.stage == "fsdp2" else dict(os.environ)
    if args.stage != "fsdp2":
        env.pop("ACCELERATE_USE_CPU", None)  # DeepSpeed finds its CPU accelerator itself
    proc = subprocess.run(command, env=env, capture_output=True, text=True, cwd=ROOT)
    found = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not found:
        sys.exit(f"{system} failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return json.JSONDecoder().raw_decode(found[-1].removeprefix("RESULT "))[0]  # other output may follow on the line


def same_tensors(a: Path, b: Path) -> int:
    """How many tensors the two exports hold; exits if they differ."""
    import torch
    from safetensors.torch import load_file

    def load(directory: Path) -> dict:
        return {k: v for f in sorted(directory.glob("*.safetensors")) for k, v in load_file(f).items()}

    ours, theirs = load(a), load(b)
    if ours.keys() != theirs.keys() or any(not torch.equal(ours[k], theirs[k]) for k in ours):
        sys.exit(f"the exports in {a} and {b} differ")
    return len(ours)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stage", choices=["fsdp2", "zero3"], default="fsdp2")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--shard", default="200MB", help="max_shard_size")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--dir", default="/tmp/llmtrain-export-bench", help="where the exports are written")
    parser.add_argument("--worker", choices=["ours", "peer"], help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    import shutil

    results: dict[str, list[dict]] = {"ours": [], "peer": []}
    for _ in range(args.repeats):
        for system in results:
            out = Path(args.dir) / system
            shutil.rmtree(out, ignore_errors=True)
            results[system].append(launch(args, system, out))
    tensors = same_tensors(Path(args.dir) / "ours", Path(args.dir) / "peer")
    shards = len(list((Path(args.dir) / "ours").glob("*.safetensors")))
    size, largest = results["ours"][0]["model_bytes"], results["ours"][0]["largest"]
    print(
        f"\n`python benchmarks/export_memory.py --stage {args.stage} --hidden {args.hidden} --layers {args.layers} "
        f"--vocab {args.vocab} --shard {args.shard} --repeats {args.repeats}`; {platform.machine()}, "
        f"{os.cpu_count()} cores, 2 processes. Model {size / GIB:.2f} GiB (fp32, {tensors} tensors), "
        f"written as {shards} shards; largest weight {largest / GIB:.2f} GiB. The two exports hold the same "
        "tensors.\n"
    )
    print("| system | RSS before | peak during export | increase | increase / model size | time |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    names = {"ours": "llmtrain (write_weights)", "peer": "get_state_dict + save_pretrained"}
    for system, runs in results.items():
        worst = max(runs, key=lambda r: r["peak"] - r["before"])
        increase = worst["peak"] - worst["before"]
        print(
            f"| {names[system]} | {worst['before'] / GIB:.2f} GiB | {worst['peak'] / GIB:.2f} GiB | "
            f"{increase / GIB:.2f} GiB | {increase / size:.2f} | {min(r['seconds'] for r in runs):.1f} s |"
        )


if __name__ == "__main__":
    main()
