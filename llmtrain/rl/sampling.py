"""Generation for online RL: completions sampled with Hugging Face `generate` (batched, with
the KV cache), each from a seed of its own.

Each completion's seed comes from (train.seed, pass, the prompt's place in the pass, the
completion's number in its group), and its tokens are drawn with its own generator
(`SeededSampling`). So a completion never depends on which process generated it, what
other prompts shared its batch, or where a resumed run restarted: the same global batch
of prompts gives the same completions on one process or eight. `generate` is kept for
what it does well (the cache, stopping, sharded models); only the draw is ours, because
its own sampling uses one generator for the whole batch.

`Generator` is the interface a faster backend (vLLM, colocated) would implement.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Protocol

import torch

from ..config import DataConfig
from ..data.rows import stop_ids
from ..distributed.backend import root_unsharded
from ..processor import SEQUENCE_INPUTS, blank_features, encodes_ahead, placeholder_ids, processor_of
from ..vision import image_inputs

MASK64 = (1 << 64) - 1


def sample_seed(seed: int, epoch: int, position: int, index: int) -> int:
    """A 63-bit seed for completion `index` of the prompt at `position` of pass `epoch`:
    SplitMix64 over the four numbers, so neighbouring samples get unrelated streams."""
    x = 0
    for part in (seed, epoch, position, index):
        x = (x ^ (part & MASK64)) * 0x9E3779B97F4A7C15 & MASK64
        x ^= x >> 30
        x = x * 0xBF58476D1CE4E5B9 & MASK64
        x ^= x >> 27
        x = x * 0x94D049BB133111EB & MASK64
        x ^= x >> 31
    return x >> 1


def filtered_logits(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Logits (float32) of the distribution sampled from: tempered, then cut to the top_k
    tokens and to the nucleus of top_p (always keeping the most likely token)."""
    logits = logits.float() / temperature
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        ordered, order = torch.sort(logits, dim=-1, descending=True)
        before = ordered.softmax(-1).cumsum(-1) - ordered.softmax(-1)  # probability mass ahead of each token
        drop = before >= top_p
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return logits


class SeededSampling:
    """A logits processor that samples each row's next token from its own generator and
    leaves only that token possible, for `generate` to pick greedily (do_sample=False).
    An inverse-CDF draw: one uniform number per row and token. `logps` keeps each step's
    log-probs of the drawn tokens under the distribution they were drawn from (the sampler's
    side of grpo.importance_correction)."""

    def __init__(self, seeds: list[int], temperature: float, top_k: int = 0, top_p: float = 1.0):
        self.generators = [torch.Generator().manual_seed(s) for s in seeds]
        self.temperature, self.top_k, self.top_p = temperature, top_k, top_p
        self.logps: list[torch.Tensor] = []  # [rows] per step

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        probs = filtered_logits(scores, self.temperature, self.top_k, self.top_p).softmax(-1)
        cdf = probs.cumsum(-1)
        u = torch.stack([torch.rand((), generator=g) for g in self.generators]).to(cdf.device)
        # 1 - u lies in (0, 1]: the point never sits at 0, where a token of probability 0 could be taken.
        token = torch.searchsorted(cdf, ((1 - u) * cdf[:, -1])[:, None]).clamp(max=cdf.shape[-1] - 1)
        self.logps.append(probs.gather(1, token).squeeze(1).log())
        return torch.full_like(scores, float("-inf")).scatter_(1, token, 0.0)


class Budget:
    """A logits processor that ends each row once it has its own number of new tokens (a
    turn's share of an episode's token budget, rl/episodes.py): its next token is forced to
    a stop token, which the caller cuts off (the turn is then cut, not ended). Run after the
    draw, so that each row's generator advances as without it; it saves the steps a row
    would take past its budget only to be cut."""

    def __init__(self, limits: list[int], stop: int, width: int):
        self.limits, self.stop, self.width = limits, stop, width

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        made = input_ids.shape[1] - self.width
        over = torch.tensor([made >= n for n in self.limits], device=scores.device)
        if not over.any():
            return scores
        forced = torch.full_like(scores, float("-inf"))
        forced[:, self.stop] = 0.0
        return torch.where(over[:, None], forced, scores)


@dataclass
class Completions:
    ids: list[list[int]]  # each completion's tokens, through its end-of-turn token if it ended
    ended: list[bool]  # False: cut at grpo.max_completion_length
    # Each token's log-prob under the distribution it was sampled from (tempered, top-k and
    # top-p applied), as a fast backend reports them; None for greedy completions.
    logps: list[list[float]] | None = None


class Generator(Protocol):
    max_new_tokens: int

    def generate(
        self,
        model,
        prompts: list[list[int]],
        seeds: list[int] | None,
        limits: list[int] | None = None,
        shown: list[dict] | None = None,
    ) -> Completions:
        """A completion per prompt: sampled from `seeds` (one per prompt), or greedy for None;
        at most max_new_tokens each, or `limits[i]` for prompt i (a completion longer than its
        limit may be returned: the caller cuts it). Sampled completions come with the log-prob
        of each token under the distribution it was drawn from (`Completions.logps`). A
        vision-language model's prompts come with `shown`: each prompt's images (as bytes)
        and the processor's per-token inputs (vision.IMAGE_COLUMNS)."""
        ...


class HFGenerator:
    """`generate` on the training model itself: under DDP the process's own copy; under
    ZeRO-3 and FSDP2 each forward gathers the sharded weights, and every process keeps
    stepping until all have finished (synced_gpus), since those forwards are collectives."""

    def __init__(
        self,
        tokenizer,
        max_new_tokens: int,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        synced=False,
        max_image_pixels=DataConfig.max_image_pixels,
    ):
        self.tokenizer, self.max_new_tokens, self.synced = tokenizer, max_new_tokens, synced
        self.max_image_pixels = max_image_pixels  # data.max_image_pixels, for a vision-language model's prompts
        self.temperature, self.top_k, self.top_p = temperature, top_k, top_p
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    def generate(
        self,
        model,
        prompts: list[list[int]],
        seeds: list[int] | None,
        limits: list[int] | None = None,
        shown: list[dict] | None = None,
    ) -> Completions:
        from transformers import GenerationConfig

        stops = stop_ids(getattr(model, "generation_config", None), self.tokenizer)
        width = max(len(p) for p in prompts)
        device = next(model.parameters()).device
        ids = torch.tensor([[self.pad_id] * (width - len(p)) + p for p in prompts], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
        images = {} if shown is None else self.images(model, prompts, shown, width, device)
        processor = processor_of(self.tokenizer)
        blank = self.synced and processor is not None and "pixel_values" not in images and encodes_ahead(model)
        # Every setting given, so none comes from the model's generation_config (a default
        # temperature or repetition penalty would sample from another distribution than
        # the one the loss's log-probs describe).
        new = self.max_new_tokens if not limits else min(self.max_new_tokens, max(limits) + 1)
        config = GenerationConfig(
            max_new_tokens=new,
            do_sample=False,
            num_beams=1,
            repetition_penalty=1.0,
            no_repeat_ngram_size=0,
            eos_token_id=stops,
            pad_token_id=self.pad_id,
            # A vision-language model's image placeholders are never sampled: they are not text.
            suppress_tokens=placeholder_ids(model.config) or None,
        )
        sampling = None if seeds is None else SeededSampling(seeds, self.temperature, self.top_k, self.top_p)
        processors = [] if sampling is None else [sampling]
        if limits and min(limits) < new:
            processors.append(Budget(limits, stops[0], width))
        from transformers import LogitsProcessorList

        was_training = model.training
        model.eval()
        try:
            with torch.no_grad(), root_unsharded(model):
                if blank:  # as the processes whose prompts hold images do: in step
                    blank_features(model, processor)
                out = model.generate(
                    input_ids=ids,
                    attention_mask=mask,
                    generation_config=config,
                    logits_processor=LogitsProcessorList(processors),
                    synced_gpus=self.synced,
                    **images,
                )
        finally:
            model.train(was_training)
        completions, ended = [], []
        for row in out[:, width:].tolist():
            end = next((i for i, t in enumerate(row) if t in stops), None)
            completions.append(row if end is None else row[: end + 1])
            ended.append(end is not None)
        logps = None
        if sampling is not None:
            drawn = torch.stack(sampling.logps, 1).float().cpu().tolist() if sampling.logps else [[]] * len(prompts)
            logps = [row[: len(c)] for row, c in zip(drawn, completions)]
        return Completions(completions, ended, logps)

    def images(self, model, prompts: list[list[int]], shown: list[dict], width: int, device) -> dict:
        """The model's image inputs for prompts padded on the left to `width` (their
        per-token inputs padded alike, with 0), their images in order: those its forward
        names (generate refuses others, such as Gemma 3's num_crops, which its forward
        takes among its **kwargs and ignores)."""

        rows = [
            {"input_ids": p, "images": s["images"]} | {k: [0] * (width - len(p)) + s[k] for k in SEQUENCE_INPUTS}
            for p, s in zip(prompts, shown)
        ]
        inputs = image_inputs(rows, width, processor_of(self.tokenizer), self.max_image_pixels)
        named = inspect.signature(model.forward).parameters
        return {k: v.to(device) for k, v in inputs.items() if k in named}
