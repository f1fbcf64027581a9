"""What leaving out the padding mask saves: forward and backward of a model body on
right-padded batches, with and without their attention mask.

    python benchmarks/padding_mask.py                    # 6 layers x 384, fp32, CPU
    python benchmarks/padding_mask.py --workload gpu-1b  # Llama-3.2-1B shape, bf16, one GPU

llmtrain pads on the right and, for a transformers model loaded with SDPA, passes no
attention_mask for padded batches (attention.padding_needs_mask; objective.model_inputs):
causal attention alone keeps every real token from seeing the padding after it. Without a
mask, SDPA runs plain causal attention, skipping the blocks above the diagonal; with one it
computes every block and reads the mask (on CUDA torch picks the kernel for each: torch
2.11 on an H100 puts cuDNN's first). This times exactly that difference: the same batches,
the same weights, each pass with the mask and then without, alternated, after a warm-up.
The body alone (no LM head, no loss) is timed, since the mask changes only attention; the
output at real positions is compared so the two passes are known to compute the same thing.
"""

from __future__ import annotations

import argparse
import time

import torch

WORKLOADS = {
    "cpu": dict(hidden=384, layers=6, heads=6, kv=6, ffn=1536, vocab=261, seq=512, rows=8, dtype="float32"),
    "gpu-1b": dict(hidden=2048, layers=16, heads=32, kv=8, ffn=8192, vocab=128256, seq=2048, rows=8, dtype="bfloat16"),
}


def build(w: dict, device: torch.device) -> torch.nn.Module:
    from transformers import AutoModel, LlamaConfig

    config = LlamaConfig(
        hidden_size=w["hidden"],
        num_hidden_layers=w["layers"],
        num_attention_heads=w["heads"],
        num_key_value_heads=w["kv"],
        intermediate_size=w["ffn"],
        vocab_size=w["vocab"],
        max_position_embeddings=w["seq"],
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    return AutoModel.from_config(config, dtype=getattr(torch, w["dtype"])).to(device).train()


def batches(w: dict, n: int, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """n batches of rows of random lengths (a quarter to all of seq), right-padded to the
    longest row of each batch, as batches.Collator pads them."""
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        lengths = torch.randint(w["seq"] // 4, w["seq"] + 1, (w["rows"],), generator=g)
        width = int(lengths.max())
        ids = torch.randint(0, w["vocab"], (w["rows"], width), generator=g)
        mask = (torch.arange(width)[None, :] < lengths[:, None]).long()
        out.append((ids.mul(mask).to(device), mask.to(device)))
    return out


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def passes(model, data, with_mask: bool, device) -> tuple[float, list[torch.Tensor]]:
    """Seconds for forward and backward over every batch, and each batch's output at its real positions."""
    outs = []
    sync(device)
    start = time.perf_counter()
    for ids, mask in data:
        hidden = model(input_ids=ids, attention_mask=mask if with_mask else None, use_cache=False).last_hidden_state
        real = hidden[mask.bool()]
        real.float().square().mean().backward()
        outs.append(real.detach().float())
    sync(device)
    return time.perf_counter() - start, outs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", choices=sorted(WORKLOADS), default="cpu")
    p.add_argument("--batches", type=int, default=6)
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    w = WORKLOADS[a.workload]
    device = torch.device("cuda" if a.workload.startswith("gpu") else "cpu")
    model = build(w, device)
    data = batches(w, a.batches, device)
    tokens = sum(int(m.sum()) for _, m in data)
    padded = sum(m.numel() for _, m in data)
    passes(model, data[:2], True, device)  # warm-up: kernels, allocator
    passes(model, data[:2], False, device)
    times = {True: [], False: []}
    for _ in range(a.rounds):
        for with_mask in (True, False):
            model.zero_grad(set_to_none=True)
            seconds, outs = passes(model, data, with_mask, device)
            times[with_mask].append(seconds)
            if with_mask:
                reference = outs
            else:
                diff = max(float((x - y).abs().max()) for x, y in zip(outs, reference))
    peak = {}
    for with_mask in (True, False):
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
            model.zero_grad(set_to_none=True)
            passes(model, data, with_mask, device)
            peak[with_mask] = f"{torch.cuda.max_memory_allocated() / 2**30:.2f} GiB"
        else:
            peak[with_mask] = "n/a"
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    print(
        f"\n{a.workload} on {name}, torch {torch.__version__}: {a.batches} batches of {w['rows']} right-padded rows, "
        f"{tokens:,} real of {padded:,} positions, {w['dtype']}, {a.rounds} rounds alternated"
    )
    print("| attention mask | forward + backward, best | each round | peak memory |")
    print("| --- | ---: | ---: | ---: |")
    for with_mask in (True, False):
        each = ", ".join(f"{t * 1000:,.0f}" for t in times[with_mask])
        label = "given (llmtrain before 28bcc09)" if with_mask else "left out (llmtrain with SDPA)"
        print(f"| {label} | {min(times[with_mask]) * 1000:,.0f} ms | {each} ms | {peak[with_mask]} |")
    ratio = min(times[False]) / min(times[True])
    print(f"without / with: {ratio:.3f}; largest output difference at real positions {diff:.3g}")


if __name__ == "__main__":
    main()
