"""What a step costs: FLOPs, model FLOPs utilisation (MFU) and peak memory.

FLOPs of a step are counted per document (a packed sequence holds several):

    sum over documents of  s * (6 * N  +  12 * L * d * s)

for a document of s tokens, N parameters doing matrix work per token (all parameters but
the input embedding; a tied LM head counts), L layers and hidden size d. 6N is the forward
and backward matmuls; 12*L*d*s is attention's scores and weighted sum, counted over the
document's own length, as the document mask only lets it attend within itself. The chunked
loss (train.loss_chunk_logits) runs the output layer only at trained positions, so its
parameters count 6 FLOPs per trained token instead of per token. MFU is those
FLOPs over step time x number of devices x the device's dense bf16 peak. LoRA runs use
the same formula (no weight gradients for frozen weights, so it reads high).
"""

from __future__ import annotations

import resource
import sys

import torch

from ..attention import text_config

# Dense (no sparsity) bf16 tensor-core peak per device, FLOP/s, from the vendors' data sheets.
PEAK_BF16 = {
    "H200": 989e12,
    "H100 NVL": 835e12,
    "H100 PCIe": 756e12,
    "H100": 989e12,
    "A100": 312e12,
    "L40S": 362e12,
    "L4": 121e12,
    "A10G": 70e12,
    "A10": 125e12,
    "RTX 4090": 165e12,
}


def device_peak_flops(device: torch.device) -> float | None:
    """The device's dense bf16 peak, or None where it is not known (CPUs, unlisted GPUs)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, peak in PEAK_BF16.items():  # longer names first where they overlap (H100 NVL before H100)
        if key in name:
            return peak
    return None


def matmul_params(model) -> int:
    """Parameters doing matrix work per token (see the module docstring) of an unwrapped model."""
    total = sum(full_numel(p) for p in model.parameters())
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    tied = head is not None and head.weight is emb.weight
    return total if tied else total - full_numel(emb.weight)


def full_numel(p) -> int:
    return getattr(p, "ds_numel", p.numel())  # a ZeRO-3 partitioned parameter keeps its full size here


def document_sizes(batch: dict) -> tuple[int, int]:
    """(sum of document lengths, sum of squared lengths) over the real tokens of a batch."""
    if "doc_ids" in batch:
        lengths = [torch.unique(row[row >= 0], return_counts=True)[1] for row in batch["doc_ids"]]
        lengths = torch.cat(lengths)
    else:
        lengths = batch["attention_mask"].sum(1)
    return int(lengths.sum()), int((lengths * lengths).sum())


def step_flops(
    tokens: int, squares: int, n_params: int, layers: int, hidden: int, head_params: int = 0, head_tokens: int = 0
) -> float:
    """FLOPs of a step (see the module docstring). When the chunked loss runs the output
    layer only at trained positions, its `head_params` count for those `head_tokens` alone."""
    return 6.0 * (n_params - head_params) * tokens + 6.0 * head_params * head_tokens + 12.0 * layers * hidden * squares


def peak_memory_gib(device: torch.device) -> float:
    """Peak GPU memory allocated by torch, or on CPU the process's peak resident size."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kib / 2**20 if sys.platform != "darwin" else kib / 2**30


class StepMeter:
    """Throughput figures of a step, for the metrics row and the progress bar. Built once
    from the unwrapped model (before prepare) and the objective: its `unit`, and its
    `head`, the output layer when it runs only at the counted tokens (the chunked loss)."""

    def __init__(self, model, device: torch.device, world: int, unit: str = "tokens", head=None):
        self.device, self.world, self.unit = device, world, unit
        self.n_params, self.peak = matmul_params(model), device_peak_flops(device)
        self.head_params = full_numel(head.weight) if head is not None else 0
        text = text_config(model.config)  # a vision-language model's text layers
        self.layers, self.hidden = text.num_hidden_layers, text.hidden_size

    def figures(self, window, result) -> dict:
        """The step's seconds (`step_s`, from drawing its batches, which for an RL run
        includes generating them, to the update); per second of it: counted units
        (`<unit>_per_s`, e.g. tokens_per_s), input tokens; the data-wait share, peak memory,
        and MFU where the peak is known."""
        seconds = result.seconds
        out = {
            "step_s": seconds,
            f"{self.unit}_per_s": result.count / seconds,
            "input_tokens_per_s": window.input_tokens / seconds,
            "data_wait": window.data_wait / seconds,
            "peak_mem_gib": peak_memory_gib(self.device),
        }
        if self.peak is not None:
            flops = step_flops(
                window.input_tokens,
                window.squared_lengths,
                self.n_params,
                self.layers,
                self.hidden,
                self.head_params,
                result.count,
            )
            out["mfu"] = flops / (seconds * self.world * self.peak)
        return out
