"""A vision-language model as a model: whether a config is one (`is_vision`), its processor
loaded and saved (`load_processor`, `save_processor`; without torchvision too), carried by its
tokenizer (`processor_of`), checked for the inputs llmtrain passes to its forward
(MODEL_INPUTS), and its vision tower frozen (`freeze_vision`, `language_only` for LoRA).
Rows and batches of images are llmtrain.vision's; this module sits below the data pipeline,
beside llmtrain.model, which uses it."""

from __future__ import annotations

import contextlib
import inspect
from pathlib import Path

import torch

from .errors import ModelError

# The processor's per-token outputs a model's forward reads beside input_ids.
SEQUENCE_INPUTS = ("token_type_ids", "mm_token_type_ids")
# Every input a batch may carry to the model besides the text's (objective.model_inputs):
# the per-token ones and what image processors return.
MODEL_INPUTS = (
    *SEQUENCE_INPUTS,
    "pixel_values",
    "pixel_attention_mask",
    "image_grid_thw",
    "image_sizes",
    "num_crops",
)


def is_vision(mcfg) -> bool:
    """Whether a model config describes a vision-language model (one with a vision tower)."""
    return getattr(mcfg, "vision_config", None) is not None


def placeholder_ids(mcfg) -> list[int]:
    """The token ids a vision-language model's forward reads as places for image (or video)
    features, which a sampled completion must never hold: the forward would find more
    places than features and fail (rl/sampling.HFGenerator suppresses them)."""
    keys = ("image_token_id", "image_token_index", "video_token_id", "video_token_index")
    return sorted({i for i in (getattr(mcfg, k, None) for k in keys) if isinstance(i, int) and i >= 0})


def processor_of(tokenizer):
    """The processor a vision-language model's tokenizer carries (module docstring), or None."""
    return getattr(tokenizer, "processor", None)


def load_processor(name: str, **kwargs):
    """AutoProcessor.from_pretrained(name), or where that fails for want of torchvision on a
    processor that holds a video processor (Qwen2.5-VL's, Qwen3-VL's, SmolVLM's), the same
    processor without it: images and text work as with it, and llmtrain trains no video.

    Written here because transformers builds, checks and loads a processor's video
    processor with torchvision even when only images are given, and a CPU machine often
    has none (PyPI's torchvision wheels are built for CUDA's torch). The processor's class
    is loaded with its video processor left out of its attributes, for this call alone."""
    from transformers import AutoProcessor
    from transformers.utils import is_torchvision_available

    try:
        return AutoProcessor.from_pretrained(name, **kwargs)
    except Exception as e:
        if is_torchvision_available() or "video" not in str(e).lower():
            raise
    import json

    import transformers
    from transformers.utils import cached_file

    config = json.loads(Path(cached_file(name, "processor_config.json", **kwargs)).read_text())
    cls = getattr(transformers, config.get("processor_class", ""), None)
    if not isinstance(cls, type) or "video_processor" not in cls.get_attributes():
        raise ModelError(f"model.name_or_path: the processor of '{name}' needs torchvision; pip install torchvision")
    with images_only(cls):
        processor = cls.from_pretrained(name, video_processor=None, **kwargs)
    processor.video_processor = None
    return processor


def save_processor(processor, directory) -> None:
    """processor.save_pretrained(directory), also for one loaded without its video
    processor (`load_processor`), which is saved without it."""
    cls = type(processor)
    if getattr(processor, "video_processor", False) is None and "video_processor" in cls.get_attributes():
        with images_only(cls):
            processor.save_pretrained(directory)
    else:
        processor.save_pretrained(directory)


@contextlib.contextmanager
def images_only(cls):
    """Inside, processor class `cls` has no video processor among its attributes, and
    transformers' check of a processor's parts lets a missing one be (`load_processor`)."""
    from unittest import mock

    from transformers.processing_utils import ProcessorMixin

    check = ProcessorMixin.check_argument_for_proper_class
    attributes = [a for a in cls.get_attributes() if a != "video_processor"]
    with (
        mock.patch.object(ProcessorMixin, "check_argument_for_proper_class", lambda s, n, a: a and check(s, n, a)),
        mock.patch.object(cls, "get_attributes", classmethod(lambda c: list(attributes))),
    ):
        yield


def language_model(model):
    """(its name, the module): the language model inside a vision-language model, which
    transformers' image-text classes return from get_decoder()."""
    decoder = model.get_decoder()
    name = next((n for n, m in model.named_modules() if m is decoder), None)
    if name is None or decoder is model:
        raise ModelError(f"model.name_or_path: cannot find the language model inside {type(model).__name__}")
    return name, decoder


def freeze_vision(model) -> None:
    """model.freeze_vision: every weight but the language model's and the output layer's
    (the vision tower and the projector into the language model) takes no gradient."""
    _, decoder = language_model(model)
    head = model.get_output_embeddings()
    kept = {id(p) for p in decoder.parameters()} | {id(p) for p in (head.parameters() if head is not None else ())}
    for p in model.parameters():
        if id(p) not in kept:
            p.requires_grad_(False)


def unquantized(model) -> list[str]:
    """The modules of a vision-language model that QLoRA leaves unquantized: the vision
    tower and the projector (every part of the multimodal body but the language model, so
    that image features keep their precision) and the output layer, which transformers
    keeps whole on its own but not once a list is given."""
    parts = [n for n, _ in vision_parts(model)]  # whole names: matched
    head = next((n for n, m in model.named_modules() if m is model.get_output_embeddings()), None)  # from the start
    return [*parts, *([head] if head else [])]


def vision_parts(model) -> list[tuple[str, object]]:
    """(whole name, module) of every part of a vision-language model's multimodal body but
    its language model: the vision tower and the projector."""
    name, decoder = language_model(model)
    prefix = name.rsplit(".", 1)[0] + "." if "." in name else ""
    body = model.get_submodule(prefix[:-1]) if prefix else model
    return [(prefix + n, child) for n, child in body.named_children() if child is not decoder]


def trains_vision(model) -> bool:
    """Whether a vision-language model's vision tower or projector has weights that train
    (model.freeze_vision=false); False for a text model."""
    if not is_vision(model.config):
        return False
    return any(p.requires_grad for _, part in vision_parts(model) for p in part.parameters())


# The names transformers gives the projector of a vision-language model, the layers that
# carry image features into the language model: LLaVA's and Gemma 3's, Idefics3's and
# SmolVLM's, Qwen-VL's (inside its vision tower; Qwen3-VL's deepstack mergers feed deeper
# layers of the language model).
PROJECTORS = ("multi_modal_projector", "connector", "merger", "deepstack_merger_list")


def language_only(model, linear: dict, names: list[str], projector: bool = False) -> list[str]:
    """LoRA's target modules (last names) as the whole names of the `linear` layers (by
    whole name) inside the language model that bear them: with the vision tower frozen, its
    layers of the same names (q_proj, ...) must get no adapters either. With `projector`
    (model.lora.projector), also every linear layer of the projector (PROJECTORS)."""
    prefix, _ = language_model(model)
    wanted = set(names)
    chosen = [n for n in linear if n.startswith(prefix + ".") and n.rsplit(".", 1)[-1] in wanted]
    if not projector:
        return chosen
    projecting = [n for n in linear if set(n.split(".")) & set(PROJECTORS)]
    if not projecting:
        raise ModelError(
            f"model.lora.projector: {type(model).__name__} has no projector of linear layers for LoRA to adapt (none "
            f"named {', '.join(PROJECTORS)}); set it false, or train the projector whole with model.freeze_vision=false"
        )
    return chosen + projecting


def check_processor(processor, name: str) -> None:
    """Refuse a processor llmtrain cannot batch images with: one whose image processor is
    missing, or returns an input not in MODEL_INPUTS (which objective.model_inputs would not
    pass to the model)."""
    from PIL import Image

    image_processor = getattr(processor, "image_processor", None)
    if image_processor is None:
        raise ModelError(f"model.name_or_path: the processor of '{name}' has no image processor")
    out = image_processor(images=[[Image.new("RGB", (32, 32))]], return_tensors="pt")
    unknown = sorted(set(out) - set(MODEL_INPUTS))
    if unknown:
        raise ModelError(
            f"model.name_or_path: the image processor of '{name}' returns {', '.join(unknown)}, which llmtrain does "
            "not pass to the model yet; this vision-language model is not supported"
        )


def image_blocks(token_type_ids: torch.Tensor) -> torch.Tensor:
    """Each position's image block, numbered along the row, or -1 for text: the runs of
    token_type_ids 1 (an image's tokens, which a Gemma 3 model lets attend to each other both
    ways). What transformers' Gemma 3 computes from them inside its forward, which a packed
    batch's prepared mask (attention.packed_mask) skips: written here for that mask."""
    image = token_type_ids == 1
    starts = image & ~torch.nn.functional.pad(image, (1, 0))[:, :-1]
    return torch.where(image, starts.cumsum(1) - 1, -1)


def packed_positions(model, batch: dict):
    """The (4, batch, length) position ids of a packed batch for a model that positions image
    tokens in three dimensions (Qwen-VL's, which read mm_token_type_ids): row 0 the text
    positions restarting at 0 for each packed sample (`batch["position_ids"]`, which the
    packed mask is built from), rows 1-3 each sample's own multimodal positions, as the
    model's get_rope_index computes them for the sample alone (with its images' grids, in
    order). Padding keeps its text positions. transformers reads such a 4-row tensor as
    packed positions; computed here, sample by sample, because its own computation spans the
    whole row."""
    inner = model.model  # the Qwen*VLModel, which holds get_rope_index
    ids, types, docs, text = batch["input_ids"], batch["mm_token_type_ids"], batch["doc_ids"], batch["position_ids"]
    grids, used = batch.get("image_grid_thw"), 0
    rope = text[None].expand(3, -1, -1).clone()
    for b in range(ids.shape[0]):
        for d in docs[b].unique().tolist():
            if d < 0:
                continue
            where = (docs[b] == d).nonzero().squeeze(1)
            s, e = int(where[0]), int(where[-1]) + 1
            kinds = types[b, s:e]
            images = int(((kinds == 1) & (torch.nn.functional.pad(kinds, (1, 0))[:-1] != 1)).sum())  # image runs
            grid = grids[used : used + images] if images else None
            used += images
            pos, _ = inner.get_rope_index(ids[b : b + 1, s:e], kinds[None], image_grid_thw=grid)
            rope[:, b, s:e] = pos[:, 0].to(rope.dtype)
    return torch.cat([text[None], rope], 0)


def vision_in_every_forward(model, processor) -> None:
    """Make every forward pass of a vision-language model run its vision tower and
    projector, also on a batch without images: there on a blank image, where a batch with
    images runs them (after the token embeddings, before the language model's layers), its
    features added to the logits times 0 (the numbers unchanged; nan and inf taken out
    first). Each process thus runs the same layers in the same order, which is what ZeRO-3
    and FSDP2 record and prefetch by.

    For runs of several processes. Under ZeRO-3 and FSDP2 each layer's weights are gathered
    from every process as the layer runs, so all processes must run the same layers in the
    same order: a process whose micro-batch holds no image (text rows, an empty batch at the
    end of the data) would skip the vision tower while another runs it, and the job fails
    on mismatched collectives or hangs. With the vision tower trained (model.freeze_vision
    false), DDP likewise needs its weights in every process's graph. Peers meet the same
    need with a fake image in text-only batches; done here on the model, as hooks, so every
    forward (training, evaluation, reference passes) has it without the batches changing.

    The language model starting without the vision tower having run since it last started
    is what marks a pass without images. transformers' generate encodes a prompt's images
    before its first forward pass (`blank_features` does the same for prompts without, in
    rl/sampling.HFGenerator), and a step that continues a generation (its cache filled)
    reads no image on any process: neither runs the blank image."""
    blank = blank_inputs(processor)
    state: dict = {"seen": False, "features": None}

    def seen(module, args):
        state["seen"] = True

    def decoding(module, args, kwargs):  # the language model starts
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        continuing = cache is not None and hasattr(cache, "get_seq_length") and cache.get_seq_length() > 0
        if not state["seen"] and not continuing:
            device = next(t.device for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor))
            state["features"] = _every_tensor(model.get_image_features(**{k: v.to(device) for k, v in blank.items()}))
        state["seen"] = False

    def after(module, args, kwargs, output):
        features, state["features"] = state["features"], None
        if features is not None:
            zero = features.float().sum().nan_to_num(0.0, 0.0, 0.0) * 0
            output.logits = output.logits + zero.to(output.logits.dtype)
        return output

    for _, part in vision_parts(model):
        part.register_forward_pre_hook(seen)
    language_model(model)[1].register_forward_pre_hook(decoding, with_kwargs=True)
    model.register_forward_hook(after, with_kwargs=True)


def blank_inputs(processor) -> dict:
    """The image processor's inputs for one blank 32x32 image (vision_in_every_forward)."""
    from PIL import Image

    blank = processor.image_processor(images=[[Image.new("RGB", (32, 32))]], return_tensors="pt")
    return {k: v for k, v in blank.items() if k in MODEL_INPUTS}


def blank_features(model, processor) -> None:
    """Run the vision tower and projector on a blank image, as transformers' generate
    encodes a prompt's images before generating: what a process whose prompts hold none
    does before generate, beside processes whose prompts do (vision_in_every_forward)."""
    device = next(model.parameters()).device
    with torch.no_grad():
        model.get_image_features(**{k: v.to(device) for k, v in blank_inputs(processor).items()})


def _every_tensor(value):
    """The sum of every floating-point tensor in a model output (nested in tuples, lists
    and dicts), as one scalar: all of it in the graph."""
    total, stack = None, [value]
    while stack:
        v = stack.pop()
        if isinstance(v, torch.Tensor):
            if v.is_floating_point():
                s = v.float().sum()
                total = s if total is None else total + s
        elif isinstance(v, dict):
            stack.extend(v.values())
        elif isinstance(v, (list, tuple)):
            stack.extend(v)
    return total if total is not None else torch.zeros(())


def encodes_ahead(model) -> bool:
    """Whether transformers' generate encodes the prompts' images before its first forward
    pass (a model whose forward takes them encoded, as mm_encoder_outputs)."""
    return "mm_encoder_outputs" in inspect.signature(model.forward).parameters
