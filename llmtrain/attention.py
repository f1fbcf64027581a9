"""Attention: the backend a run uses, the model's attention pattern, and the masks of
packed batches.

A model's config declares, per layer, full causal attention, a sliding window
(Mistral, Gemma 2/3, gpt-oss, Cohere 2) or chunks (Llama 4). A packed sequence must get
exactly that pattern inside each sample and nothing across samples, or packed training
computes an attention inference never uses.

`packed_mask` builds, for each layer type the config declares (`layer_types`), the mask
with transformers' own builders (masking_utils: the model's window and chunk sizes, the
backend's form: boolean for SDPA, additive for eager, a BlockMask for FlexAttention, none
for the flash kernels, which find the samples in position_ids). Given position_ids that
restart at 0 for each sample and no padding mask, those builders keep every pair within a
sample and count window and chunk positions from the sample's start. The model gets the
mask (one layer type) or the mapping layer type -> mask (several), which transformers'
models with mixed layers take as prepared. This is done by llmtrain rather than left to
the model, because not every model passes position_ids to its mask builders (gpt-oss does
not), and a model that builds no mask from them would let samples see each other.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
import weakref
from dataclasses import dataclass

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.weak import WeakIdKeyDictionary

from .errors import AttentionError, shown

FULL, SLIDING, CHUNKED = "full_attention", "sliding_attention", "chunked_attention"


def text_config(mcfg):
    """The config of a model's text layers: a multimodal config's text part, else the config."""
    return mcfg.get_text_config() if hasattr(mcfg, "get_text_config") else mcfg


def attends_both_ways(mcfg) -> bool:
    """Whether the config makes the text layers attend to later tokens too (Gemma's
    use_bidirectional_attention, True or 'all'; 'vision' is both ways among image tokens only)."""
    return getattr(text_config(mcfg), "use_bidirectional_attention", None) in (True, "all")


def layer_types(mcfg) -> list[str]:
    """The attention of each layer as the model's config declares it, in transformers'
    names (full_attention, sliding_attention, chunked_attention, or a model's own)."""
    text = text_config(mcfg)
    n = getattr(text, "num_hidden_layers", None) or getattr(text, "n_layer", None) or 0
    declared = getattr(text, "layer_types", None)
    if declared:
        return list(declared)
    # Mistral, Mixtral, Phi-3, Starcoder2: one window for every layer when it is set.
    if getattr(text, "sliding_window", None) and getattr(text, "use_sliding_window", True) is not False:
        return [SLIDING] * n
    if getattr(text, "attention_chunk_size", None):
        return [CHUNKED] * n
    return [FULL] * n


def describe_pattern(mcfg) -> str:
    """e.g. 'sliding window of 128 tokens on 12 layers, full on 12'."""
    text = text_config(mcfg)
    types = layer_types(mcfg)
    names = {
        FULL: "full causal",
        SLIDING: f"sliding window of {getattr(text, 'sliding_window', None)} tokens",
        CHUNKED: f"chunks of {getattr(text, 'attention_chunk_size', None)} tokens",
    }
    counts = {t: types.count(t) for t in dict.fromkeys(types)}
    if len(counts) == 1:
        return f"{names.get(types[0], types[0])} on all {len(types)} layers"
    return ", ".join(f"{names.get(t, t)} on {n} layer{'s' * (n > 1)}" for t, n in counts.items())


def packed_mask(config, position_ids: torch.Tensor, dtype: torch.dtype, blocks: torch.Tensor | None = None):
    """The attention mask of a packed batch for a model with this config (see the module's
    docstring): one mask, None (the backend needs none, or no row holds two samples), or
    {layer type: mask} for a model with several layer types. `blocks`: for a model whose
    tokens of one image attend to each other both ways (Gemma 3), each position's image
    block (-1 for text; processor.image_blocks), which transformers' builders add to the
    causal pattern within each sample."""
    from transformers.masking_utils import (
        create_causal_mask,
        create_chunked_causal_mask,
        create_sliding_window_causal_mask,
    )

    builders = {
        FULL: create_causal_mask,
        SLIDING: create_sliding_window_causal_mask,
        CHUNKED: create_chunked_causal_mask,
    }
    B, L = position_ids.shape
    embeds = torch.empty(B, L, 0, dtype=dtype, device=position_ids.device)  # the builders read its shape and dtype
    extra = {} if blocks is None else {"block_sequence_ids": blocks}
    types = dict.fromkeys(layer_types(config))
    text = text_config(config)  # a vision-language model's text layers, whose window the builders read
    masks = {t: builders[t](text, embeds, None, None, position_ids, **extra) for t in types}
    return next(iter(masks.values())) if len(masks) == 1 else masks


def padding_needs_mask(model) -> bool:
    """Whether a right-padded batch must give `model` its padding mask (attention_mask).

    Not for a transformers model loaded with SDPA. Right padding puts every row's padding
    after its last token, so causal attention alone already keeps every real token from
    seeing padding; padding positions see real tokens, but nothing is trained on their
    outputs. Without a padding mask transformers runs SDPA as plain causal attention
    (is_causal; its own mask still for sliding windows and chunks), where a padding mask
    makes it build a dense [batch, 1, length, length] mask per layer type and run attention
    over every key: on CPU the fused kernel then skips no block above the diagonal, on CUDA
    the flash kernel cannot take the mask at all. The logits at real positions are the same
    to the bit and gradients differ only by float rounding (tests/test_attention.py). Kept for
    other backends: the flash kernels unpad with it, FlexAttention skips padded blocks, and
    a model's own code (trust_remote_code) may not make attention without a mask causal, nor
    does a model whose attention looks both ways (Gemma's use_bidirectional_attention: a
    layer with is_causal False). Written here because transformers cannot assume right
    padding: it builds the mask for any padding it is given."""
    inner = transformers_model(model)
    # FSDP2 swaps the class for a subclass of its own (torch.distributed's): look past it.
    cls = next(c for c in type(inner).__mro__ if not c.__module__.startswith("torch."))
    native = cls.__module__.startswith("transformers.")
    return not (native and inner.config._attn_implementation == "sdpa" and attends_causally(inner))


# transformers model -> whether no layer of it attends both ways (a scan of every module:
# about 2 ms for an 80-layer model, so made once per model rather than per micro-batch)
_CAUSAL = weakref.WeakKeyDictionary()


def attends_causally(model) -> bool:
    if model not in _CAUSAL:
        _CAUSAL[model] = all(getattr(m, "is_causal", True) is not False for m in model.modules())
    return _CAUSAL[model]


# boolean mask -> {dtype: the float mask torch's SDPA would make of it}, while the mask lives
# (keyed by identity: a tensor's == compares values)
_FLOAT_MASKS = WeakIdKeyDictionary()


def share_sdpa_masks() -> None:
    """Have transformers' SDPA attention make a boolean mask's float form once per mask,
    rather than once per layer, in training.

    Written here because neither library does it: torch's scaled_dot_product_attention turns
    a boolean attn_mask into a float one (0 where allowed, -inf elsewhere, in the query's
    dtype) on every call, transformers calls it once per layer with the same mask, and in
    training autograd keeps each layer's copy for the backward pass. A model of L layers so
    holds L float copies of a [batch, 1, length, length] mask: 4 MiB a layer on the CPU SFT
    benchmark, 64 MiB a layer for 8 padded rows of 2048 tokens in bf16. Made here the way
    torch makes it, one copy serves every layer, and the numbers are the same to the bit
    (tests/test_attention.py). Only under autograd (a no-grad pass frees each copy at once),
    outside torch.compile (which traces the layers itself), and not for a mask combined with a
    position bias (transformers builds that one per layer), nor where torch may pick cuDNN's
    kernel (converts_like_torch). The same function keeps cuDNN's kernel out of training
    calls with a mask on CUDA, in compiled blocks too (masked_training_kernels: its backward
    can return NaN there).
    Registered once, process-wide, under transformers' own "sdpa" name, so configs and
    exported models are unchanged."""
    from transformers import AttentionInterface

    if not getattr(AttentionInterface._global_mapping.get("sdpa"), "shares_masks", False):
        AttentionInterface.register("sdpa", _sdpa_sharing_masks)


def _sdpa_sharing_masks(module, query, key, value, attention_mask, *args, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    training = isinstance(attention_mask, torch.Tensor) and torch.is_grad_enabled()
    # Also while torch.compile traces a block: dynamo records the kernel choice in the graph,
    # and the backward it builds is the chosen kernel's.
    kernels = masked_training_kernels(query.device.type) if training else None
    with sdpa_kernel(kernels) if kernels else contextlib.nullcontext():
        if (
            training
            and not torch.compiler.is_compiling()
            and attention_mask.dtype == torch.bool
            and not args
            and kwargs.get("position_bias") is None
            and converts_like_torch(query.device.type)
        ):
            # The dtype SDPA computes in: autocast's where it is on (it casts the inputs to it,
            # and leaves a mask already in it as it is), else the query's.
            device = query.device.type
            dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else query.dtype
            attention_mask = float_mask(attention_mask, dtype)
        return sdpa_attention_forward(module, query, key, value, attention_mask, *args, **kwargs)


def masked_training_kernels(device_type: str) -> list[SDPBackend] | None:
    """The SDPA kernels a training call with a mask may take: on CUDA, those enabled but
    cuDNN's; None where that changes nothing (another device, cuDNN's already off, or no other
    kernel on, which is the user's choice to keep).

    cuDNN's attention backward returns NaN gradients for the query when it is given a mask
    and the length is 64 past a multiple of 128, wherever a row's scores are all very
    negative (pytorch/pytorch#196678, reported for torch 2.11 to 2.13 on H100 and H200, where
    torch puts that kernel first; TRL's DPO and KTO went NaN on it, huggingface/trl#7181).
    Without a mask cuDNN's kernel is clean, so padded batches (no mask with SDPA,
    padding_needs_mask) keep it; masked calls (sliding windows, packed rows under SDPA) take
    the memory-efficient kernel, which also lets them share one float mask
    (converts_like_torch). Written here because torch chooses the kernel per call and has no
    switch for masked calls alone."""
    if device_type != "cuda" or not torch.backends.cuda.cudnn_sdp_enabled():
        return None
    enabled = (
        (SDPBackend.FLASH_ATTENTION, torch.backends.cuda.flash_sdp_enabled()),
        (SDPBackend.EFFICIENT_ATTENTION, torch.backends.cuda.mem_efficient_sdp_enabled()),
        (SDPBackend.MATH, torch.backends.cuda.math_sdp_enabled()),
    )
    return [kernel for kernel, on in enabled if on] or None


_sdpa_sharing_masks.shares_masks = True


def converts_like_torch(device_type: str) -> bool:
    """Whether torch's SDPA would turn a boolean mask into 0/-inf, as `float_mask` does. It
    does for every kernel but cuDNN's, which it fills with -65504 instead. Inside a masked
    training call cuDNN's kernel is off (masked_training_kernels), so this holds there but
    where the user left cuDNN's kernel alone on; then masks are left to torch."""
    return device_type != "cuda" or not torch.backends.cuda.cudnn_sdp_enabled()


def float_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`mask` (True: may attend) as the additive float mask torch's SDPA makes of it, made
    once per mask, dtype and version of the mask (a mask changed in place is made anew)
    while `mask` lives.

    Its rows start at multiples of 8 elements (a view of a buffer whose last dimension is
    rounded up): CUDA's memory-efficient kernel copies any mask whose strides are not
    multiples of 8 into such a buffer on every call, which would make a copy per layer again
    for 7 lengths in 8."""
    made = _FLOAT_MASKS.setdefault(mask, {})
    key = (dtype, mask._version)
    if key not in made:
        made.clear()  # an older version's copy is of no further use
        *outer, length = mask.shape
        buffer = torch.zeros(*outer, -(-length // 8) * 8, dtype=dtype, device=mask.device)
        made[key] = buffer[..., :length].masked_fill_(~mask, float("-inf"))
    return made[key]


def takes_mask_mapping(model_class: type) -> bool:
    """Whether the model takes {layer type: mask} as its attention_mask, as transformers'
    models with mixed layer types do (they test `isinstance(attention_mask, dict)`): read
    from the source of the module that defines the model (transformers has no flag for it)."""
    try:
        return "attention_mask, dict)" in inspect.getsource(sys.modules[model_class.__module__])
    except (KeyError, OSError, TypeError):
        return False


def transformers_model(model):
    """The transformers model inside `model` (DDP, DeepSpeed, peft wrap it; FSDP2 changes
    its class in place): the first PreTrainedModel in module order."""
    from transformers import PreTrainedModel

    return next(m for m in model.modules() if isinstance(m, PreTrainedModel))


@dataclass(frozen=True)
class Attention:
    """What a run's attention will be: `name` (model.attn_implementation resolved), why,
    and the layers' pattern."""

    name: str
    reason: str
    pattern: str

    def lines(self, packing: bool) -> list[str]:
        out = [f"backend: {self.name} ({self.reason})", f"pattern: {self.pattern}"]
        if packing:
            out.append("packed: each sample gets that pattern from its own first token, and sees no other sample")
        return out


# Why transformers refuses SDPA for these models: their attention does what SDPA cannot.
_NO_SDPA_BECAUSE = {"gemma2": "soft-capped attention scores", "gpt_oss": "attention sinks"}


def choose(requested: str, model_class: type, mcfg, packing: bool, device: torch.device) -> Attention:
    """model.attn_implementation resolved for this model and device, with the reason.
    'auto' takes FlexAttention for packed batches on a GPU (block-sparse masks that skip
    what no sample reaches), SDPA where the model supports it, else FlexAttention on a GPU
    and eager on CPU (PyTorch has no FlexAttention backward on CPU). A backend the model
    does not support is refused here, naming the ones it does."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    arch = model_class.__name__
    sdpa = bool(getattr(model_class, "_supports_sdpa", False))
    flex = bool(getattr(model_class, "_supports_flex_attn", False))
    supported = ["eager", *(["sdpa"] if sdpa else []), *(["flex_attention"] if flex else [])]
    known = ["auto", "eager", *ALL_ATTENTION_FUNCTIONS.valid_keys()]
    if requested not in known and "/" not in requested:  # 'owner/repo' names a kernel on the hub
        raise AttentionError(
            f"model.attn_implementation: unknown backend {shown(requested)}; use one of {', '.join(known)} "
            "(or a hub kernel as 'owner/repo')"
        )
    gpu = device.type == "cuda"
    if requested == "auto":
        if packing and gpu and flex:
            name, reason = (
                "flex_attention",
                "auto: packed batches on a GPU; block-sparse masks skip what no sample sees",
            )
        elif sdpa:
            name, reason = (
                "sdpa",
                "auto: PyTorch's fused attention"
                + ("; FlexAttention has no backward on CPU" if packing and flex and not gpu else ""),
            )
        else:
            why = _NO_SDPA_BECAUSE.get(getattr(mcfg, "model_type", ""))
            because = f"{arch} does not support SDPA" + (f" ({why})" if why else "")
            name, reason = ("flex_attention", f"auto: {because}") if gpu and flex else ("eager", f"auto: {because}")
            if name == "eager" and flex:
                reason += "; FlexAttention has no backward on CPU"
    else:
        name, reason = requested, "model.attn_implementation"
        base = name.split("|")[-1]
        if base in ("sdpa", "flex_attention") and base not in supported:
            raise AttentionError(
                f"model.attn_implementation: {arch} does not support {name}; use auto or one of {', '.join(supported)}"
            )
        if base.startswith("flash_attention") and not gpu:
            raise AttentionError(
                f"model.attn_implementation: {base} runs on CUDA GPUs only, and this run is on CPU; use auto, "
                + " or ".join(s for s in supported if s != "flex_attention")
            )
        if base == "flex_attention" and not gpu:
            raise AttentionError(
                "model.attn_implementation: flex_attention cannot train on CPU (PyTorch has no "
                "FlexAttention backward there); use auto, " + " or ".join(s for s in supported if s != "flex_attention")
            )
    if packing:
        _check_packable(model_class, mcfg)
    return Attention(name, reason, describe_pattern(mcfg))


def _check_packable(model_class: type, mcfg) -> None:
    arch = model_class.__name__
    if "position_ids" not in inspect.signature(model_class.forward).parameters:
        raise AttentionError(
            f"data.packing: {arch} takes no position_ids, so packed samples cannot start their positions at 0; "
            "set data.packing=false"
        )
    if attends_both_ways(mcfg):
        raise AttentionError(
            f"data.packing: {arch} attends both ways (use_bidirectional_attention), and packed samples get "
            "causal masks; set data.packing=false"
        )
    types = set(layer_types(mcfg))
    if unknown := sorted(types - {FULL, SLIDING, CHUNKED}):
        raise AttentionError(
            f"data.packing: {arch} has {', '.join(unknown)} layers, which llmtrain cannot keep within packed "
            "samples; set data.packing=false"
        )
    if len(types) > 1 and not takes_mask_mapping(model_class):
        raise AttentionError(
            f"data.packing: {arch} mixes layer types ({describe_pattern(mcfg)}) but takes no mask per type, so "
            "packed samples cannot get each layer's own mask; set data.packing=false"
        )
