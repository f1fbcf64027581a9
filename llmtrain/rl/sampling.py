"""Generation for online RL: completions sampled with Hugging Face `generate` (batched, with
the KV cache), each from a seed of its own.

Each completion's seed comes from (train.seed, pass, the prompt's place in the pass, the
completion's number in its group), and its tokens are drawn with its own generator
(`SeededSampling`). So a completion never depends on which process generated it, what
other prompts shared its batch, or where a resumed run restarted: the same global batch
of prompts gives the same completions on one process or eight. `generate` is kept for
what it does well (the cache, stopping, sharded models); only the draw is ours, because
its own sampling uses one generator for the whole batch.

The cache given to `generate` is ours where it can be (`reserved_cache`): written in place
rather than copied at every step, continued by a multi-turn episode's next turn
(`HFGenerator.multi_turn`), and filled once for prompts that repeat (`HFGenerator.shared`).
Each gives the tokens a fresh call gives (tests/rl/test_sampling.py).

`Generator` is the interface a faster backend (vLLM, colocated) would implement.
"""

from __future__ import annotations

import inspect
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol

import torch
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer
from transformers.generation import GenerationMixin

from ..config import DataConfig
from ..data.rows import stop_ids
from ..distributed.backend import root_unsharded
from ..processor import SEQUENCE_INPUTS, blank_features, encodes_ahead, placeholder_ids, processor_of
from ..vision import image_inputs

MASK64 = (1 << 64) - 1
# generate's keyword for a cache it is given: `cache` since transformers 5.x renamed `past_key_values`
CACHE_ARGUMENT = (
    "cache"
    if "cache" in inspect.signature(GenerationMixin.prepare_inputs_for_generation).parameters
    else "past_key_values"
)


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
    logits = logits.float() / temperature if temperature != 1 else logits.float()
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

    BLOCK = 32  # uniform numbers drawn per row at a time

    def __init__(self, seeds: list[int], temperature: float, top_k: int = 0, top_p: float = 1.0):
        self.generators = [torch.Generator().manual_seed(s) for s in seeds]
        self.temperature, self.top_k, self.top_p = temperature, top_k, top_p
        self.logps: list[torch.Tensor] = []  # [rows] per step
        self.uniforms, self.step = torch.empty(len(seeds), 0), 0

    def draw(self, device) -> torch.Tensor:
        """Each row's next uniform number. Drawn BLOCK at a time per row: a generator's
        numbers are the same drawn one at a time or n at once, and a row per decode step
        would be one tiny call per row per token."""
        if self.step == self.uniforms.shape[1]:
            more = torch.stack([torch.rand(self.BLOCK, generator=g) for g in self.generators])
            self.uniforms = torch.cat([self.uniforms, more], 1)
        self.step += 1
        return self.uniforms[:, self.step - 1].to(device)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        probs = filtered_logits(scores, self.temperature, self.top_k, self.top_p).softmax(-1)
        cdf = probs.cumsum(-1)
        u = self.draw(cdf.device)
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


class ReservedLayer(DynamicLayer):
    """A full-attention layer of a generation's KV cache that takes its storage once, for
    `capacity` positions, writes each step's keys and values into it and attends to the part
    filled so far (a view): the same tensors as transformers' DynamicLayer, which
    concatenates them instead, copying the whole cache at every decode step and every layer
    (a quarter of a small model's decode step at 200 positions; on a GPU, as many bytes per
    step as the weights for long completions). Written here because transformers has no
    growing cache without that copy: its StaticCache attends to every reserved position.
    Past the capacity (or after a beam reorder or a batch selection made new tensors) the
    storage is taken again, twice as large."""

    def __init__(self, capacity: int):
        super().__init__()
        self.capacity, self.storage = capacity, None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = self.get_seq_length()
        end = n + key_states.shape[-2]
        if not self.holds(key_states, end):
            k, v = self.keys, self.values
            size = max(end, self.capacity, 2 * n)
            self.storage = tuple(s.new_empty((*s.shape[:-2], size, s.shape[-1])) for s in (key_states, value_states))
            if n:
                self.storage[0][..., :n, :].copy_(k)
                self.storage[1][..., :n, :].copy_(v)
        keys, values = self.storage
        keys[..., n:end, :].copy_(key_states)
        values[..., n:end, :].copy_(value_states)
        self.keys, self.values = keys[..., :end, :], values[..., :end, :]
        return self.keys, self.values

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        self.storage = None  # the selected rows are new tensors: the old storage goes now, not at the next write

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        self.storage = None

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        self.storage = None

    def holds(self, key_states: torch.Tensor, end: int) -> bool:
        """Whether the storage still backs `keys` and has room up to `end`."""
        if self.storage is None:
            return False
        keys = self.storage[0]
        return (
            keys.shape[-2] >= end
            and keys.shape[:-2] == key_states.shape[:-2]
            and (self.keys.numel() == 0 or self.keys.data_ptr() == keys.data_ptr())
        )


def reserved_cache(model, length: int):
    """The cache `generate` makes for `model` (a DynamicCache on its text config), with its
    full-attention layers ReservedLayers of `length` positions; None where generate would make
    another kind (a recurrent or linear-attention layer, an encoder-decoder, a model that
    brings its own), which it then makes itself."""
    from transformers import DynamicCache

    config = model.config
    # transformers' own test of whether a model takes its default cache (no public one)
    default = getattr(model, "_supports_default_dynamic_cache", None)
    if config.is_encoder_decoder or default is None or not default():
        return None
    cache = DynamicCache(config=config.get_text_config(decoder=True))
    if not cache.layers or any(type(layer) not in (DynamicLayer, DynamicSlidingWindowLayer) for layer in cache.layers):
        return None
    cache.layers = [ReservedLayer(length) if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache


@dataclass
class Kept:
    """A generation's KV cache, kept for a call that continues its rows (HFGenerator.multi_turn)."""

    cache: object
    rows: list[list[int]]  # each row's tokens: its prompt, then its completion through its end
    mask: torch.Tensor  # [rows, the cache's columns]: 1 where a column holds the row's own token


@dataclass
class Continued:
    """A call's inputs continuing a Kept cache: `ids` and `mask` span the cached columns, then
    each prompt's tokens the cache lacks, aligned right (the columns before them masked out)."""

    cache: object
    ids: torch.Tensor
    mask: torch.Tensor


def reusable(cache) -> bool:
    """Whether a filled cache can be continued by a later call: every layer a ReservedLayer
    (full attention: columns masked out between turns are never attended, where a sliding
    window would count them)."""
    return cache is not None and all(isinstance(layer, ReservedLayer) for layer in cache.layers)


def kept_rows(cache, prompts: list[list[int]], completions: list[list[int]], mask: torch.Tensor) -> Kept:
    """What a later call needs to continue `cache` after a call on `prompts` (its columns
    masked by `mask`) that drew `completions`. The cache holds the prompts' columns, then
    every step but the last: a completion's tokens up to its end, then, for a row that ended
    before the others, stand-ins (masked out here)."""
    width, cached = mask.shape[1], cache.get_seq_length()
    drawn = torch.arange(cached - width)[None, :] < torch.tensor([len(c) for c in completions])[:, None]
    return Kept(cache, [p + c for p, c in zip(prompts, completions)], torch.cat([mask, drawn.long()], 1))


def left_padded(rows: list[list[int]], pad_id: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, attention mask) of token rows padded on the left to the longest, as generation
    takes a batch."""
    width = max(len(r) for r in rows)
    ids = torch.tensor([[pad_id] * (width - len(r)) + r for r in rows], device=device)
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=device)
    return ids, mask


def continued(kept: Kept, prompts: list[list[int]], pad_id: int) -> Continued | None:
    """Inputs continuing `kept` for `prompts`, each of which must extend one of its rows
    (its tokens, then more); None otherwise. The cache is cut to those rows, in order."""
    index = {tuple(row): i for i, row in enumerate(kept.rows)}
    lengths = sorted({len(row) for row in kept.rows}, reverse=True)
    picks = []
    for p in prompts:
        j = next((index[tuple(p[:n])] for n in lengths if n < len(p) and tuple(p[:n]) in index), None)
        if j is None:
            return None
        picks.append(j)
    held = kept.mask[picks]
    rest = [p[n:] for p, n in zip(prompts, held.sum(1).tolist())]  # the tokens not in the cache
    rest_ids, rest_mask = left_padded(rest, pad_id)
    ids = torch.cat([torch.full(held.shape, pad_id, dtype=rest_ids.dtype), rest_ids], 1)
    mask = torch.cat([held, rest_mask], 1)
    kept.cache.batch_select_indices(torch.tensor(picks))
    return Continued(kept.cache, ids, mask)


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
        self._stops = None  # ((the generation config, its end tokens), the stop tokens)
        self.keeping, self.kept = False, None  # inside multi_turn(): the last call's KV cache (Kept)

    @contextmanager
    def multi_turn(self):
        """Inside, each call keeps its KV cache for the next, whose prompts may extend its rows
        (the next turns of multi-turn episodes): their tokens so far are not run again, only
        what follows them (a tool's result and the template's tokens). A call whose prompts
        do not all extend kept rows starts afresh. The cache is let go on leaving. Not under
        ZeRO-3 or FSDP2, nor for a vision-language model (`continues`), nor where a layer's
        window slides (masked-out columns between turns would count against its window)."""
        self.keeping = True
        try:
            yield
        finally:
            self.keeping, self.kept = False, None

    def generate(
        self,
        model,
        prompts: list[list[int]],
        seeds: list[int] | None,
        limits: list[int] | None = None,
        shown: list[dict] | None = None,
    ) -> Completions:
        from transformers import GenerationConfig

        stops = self.stops(model)
        device = next(model.parameters()).device
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
        from transformers import LogitsProcessorList

        was_training = model.training
        model.eval()
        try:
            # Inference mode where the weights are the process's own: no autograd bookkeeping on
            # any tensor, a few percent of a small model's decode step. Not where the forwards
            # gather sharded weights, which the next training step reuses.
            with torch.no_grad() if self.synced else torch.inference_mode(), root_unsharded(model):
                continues = self.continues(shown)
                ids, mask, cache = self.inputs(model, prompts, continues, new, device)
                width = ids.shape[1]
                images = {} if shown is None else self.images(model, prompts, shown, width, device)
                processor = processor_of(self.tokenizer)
                if self.synced and processor is not None and "pixel_values" not in images and encodes_ahead(model):
                    blank_features(model, processor)  # as the processes whose prompts hold images do: in step
                processors = [] if sampling is None else [sampling]
                if limits and min(limits) < new:
                    processors.append(Budget(limits, stops[0], width))
                out = model.generate(
                    input_ids=ids,
                    attention_mask=mask,
                    generation_config=config,
                    logits_processor=LogitsProcessorList(processors),
                    synced_gpus=self.synced,
                    **images,
                    **({CACHE_ARGUMENT: cache} if cache is not None else {}),
                )
        finally:
            model.train(was_training)
        completions, ended = [], []
        for row in out[:, width:].tolist():
            end = next((i for i, t in enumerate(row) if t in stops), None)
            completions.append(row if end is None else row[: end + 1])
            ended.append(end is not None)
        if self.keeping and continues and reusable(cache):
            self.kept = kept_rows(cache, prompts, completions, mask.cpu())
        logps = None
        if sampling is not None:
            drawn = torch.stack(sampling.logps, 1).float().cpu().tolist() if sampling.logps else [[]] * len(prompts)
            logps = [row[: len(c)] for row, c in zip(drawn, completions)]
        return Completions(completions, ended, logps)

    def continues(self, shown) -> bool:
        """Whether a call may continue a cache: a text model's text prompts, on the process's
        own weights. Not a vision-language model's, even for text: some place positions by a
        state their first forward sets (Qwen-VL's rope deltas)."""
        return shown is None and not self.synced and processor_of(self.tokenizer) is None

    def inputs(self, model, prompts: list[list[int]], continues: bool, new: int, device):
        """(ids, mask, cache) to generate up to `new` tokens after `prompts`: each prompt
        left-padded, with a fresh cache; or, where the call `continues` a cache, only the
        tokens a cache lacks: the kept one's (`multi_turn`) where each prompt extends a row of
        it, else, where prompts repeat, one filled once per distinct prompt (`shared`)."""
        kept, self.kept = self.kept, None  # a kept cache serves the next call only
        if continues:
            go_on = continued(kept, prompts, self.pad_id) if kept is not None else None
            if go_on is None and (shared := self.shared(model, prompts, new, device)) is not None:
                go_on = continued(shared, prompts, self.pad_id)
            if go_on is not None:
                for layer in go_on.cache.layers:
                    layer.capacity = go_on.ids.shape[1] + new
                return go_on.ids.to(device), go_on.mask.to(device), go_on.cache
        ids, mask = left_padded(prompts, self.pad_id, device)
        return ids, mask, reserved_cache(model, ids.shape[1] + new)

    def shared(self, model, prompts: list[list[int]], new: int, device) -> Kept | None:
        """Where prompts repeat (a GRPO group's completions share theirs), each distinct prompt
        but its last token run once into a cache, which each prompt then continues with its last
        token: a group's prompt is run once, not once per completion. None where no prompt
        repeats, or the cache could not be continued (`reusable`)."""
        from transformers import GenerationConfig

        distinct = [list(p) for p in dict.fromkeys(map(tuple, prompts))]
        if len(distinct) == len(prompts) or min(len(p) for p in distinct) < 2:
            return None
        heads = [p[:-1] for p in distinct]
        ids, mask = left_padded(heads, self.pad_id, device)
        cache = reserved_cache(model, ids.shape[1] + 1 + new)
        if not reusable(cache):
            return None
        # generate for its prefill (positions and masks as it makes them); its one token is dropped
        once = GenerationConfig(max_new_tokens=1, do_sample=False, num_beams=1, pad_token_id=self.pad_id)
        model.generate(input_ids=ids, attention_mask=mask, generation_config=once, **{CACHE_ARGUMENT: cache})
        return kept_rows(cache, heads, [[] for _ in heads], mask.cpu())

    def stops(self, model) -> list[int]:
        """The tokens that end a completion (data.rows.stop_ids; found by rendering a chat,
        so kept while the model's generation config and its end tokens stay the same)."""
        config = getattr(model, "generation_config", None)
        found = getattr(config, "eos_token_id", None)
        key = (id(config), tuple(found) if isinstance(found, list) else found)
        if self._stops is None or self._stops[0] != key:
            self._stops = (key, stop_ids(config, self.tokenizer))
        return self._stops[1]

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
