"""Tiny random-weight vision-language models, built offline with `from_config`-style
constructors and saved with `save_pretrained` (model and processor), so tests load them
through the same from_pretrained path as a user's model:

    path = build("qwen2_5_vl", tmp / "qwen2_5_vl")

Families (FAMILIES): Qwen2.5-VL, Qwen3-VL, Gemma 3, Idefics3, SmolVLM (its processor needs the
num2words package), LLaVA and LLaVA-NeXT. Each has its own byte-level BPE tokenizer with the
family's special tokens named on it (`tokenizer.image_token`, ...), and a short Jinja chat
template that reproduces the family's real prompt format (the real ones cannot be downloaded
here): string or list-of-parts content, images where the family puts them, growing prefixes.

Image processors are the PIL-backend classes (saved under the plain class name, so a machine
with torchvision loads the torchvision backend). Without torchvision, the Qwen and SmolVLM
processors are built and saved without their video processor (llmtrain.vision.images_only),
as llmtrain.vision.load_processor loads them.

Sizes: text 2 layers of width 64 (4 heads, 2 kv heads), vision 2 layers of width 32; a small
image (<= 64 px) becomes SPECS[family]["image_tokens"] image tokens (4 to 36)."""

from __future__ import annotations

import io
import os
from pathlib import Path

from llmtrain.processor import images_only, save_processor

FAMILIES = ("qwen2_5_vl", "qwen3_vl", "gemma3", "idefics3", "smolvlm", "llava", "llava_next")

TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2)

CORPUS = [
    "what colour is this? red green blue yellow black white. The image shows a square.",
    "You are a helpful assistant. Describe the picture in one word.",
    "the quick brown fox jumps over the lazy dog 0123456789",
]

# --------------------------------------------------------------------------------------------
# chat templates (short re-creations of each family's real format)
# --------------------------------------------------------------------------------------------

# ChatML as Qwen2-VL / Qwen2.5-VL render it (default system prompt when none is given).
QWEN2_VL_TEMPLATE = (
    "{%- macro render(content) -%}"
    "{%- if content is string -%}{{ content }}"
    "{%- else -%}{%- for part in content -%}"
    "{%- if part['type'] == 'image' or 'image' in part or 'image_url' in part -%}"
    "{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif part['type'] == 'video' or 'video' in part -%}"
    "{{ '<|vision_start|><|video_pad|><|vision_end|>' }}"
    "{%- elif 'text' in part -%}{{ part['text'] }}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{%- endmacro -%}"
    "{%- for message in messages -%}"
    "{%- if loop.first and message['role'] != 'system' and default_system -%}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif -%}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['role'] == 'assistant' -%}"
    "{% generation %}{{ render(message['content']) + '<|im_end|>' }}{% endgeneration %}{{ '\\n' }}"
    "{%- else -%}{{ render(message['content']) + '<|im_end|>\\n' }}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)
# Qwen3-VL's instruct template: the same ChatML, no default system prompt.
QWEN2_VL_TEMPLATE_WITH_SYSTEM = "{%- set default_system = true -%}" + QWEN2_VL_TEMPLATE
QWEN3_VL_TEMPLATE = "{%- set default_system = false -%}" + QWEN2_VL_TEMPLATE

# Gemma 3: <bos>, turns <start_of_turn>user|model ... <end_of_turn>, a system prompt folded into
# the first user turn, text parts trimmed, an image part rendered as <start_of_image> (the
# processor expands it to \n\n<start_of_image><image_soft_token>*N<end_of_image>\n\n).
GEMMA3_TEMPLATE = (
    "{%- macro render(content) -%}"
    "{%- if content is string -%}{{ content | trim }}"
    "{%- else -%}{%- for part in content -%}"
    "{%- if part['type'] == 'image' -%}{{ '<start_of_image>' }}"
    "{%- elif part['type'] == 'text' -%}{{ part['text'] | trim }}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{%- endmacro -%}"
    "{{ bos_token }}"
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = render(messages[0]['content']) + '\\n\\n' -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else '') }}"
    "{%- if message['role'] == 'assistant' -%}"
    "{% generation %}{{ render(message['content']) + '<end_of_turn>' }}{% endgeneration %}{{ '\\n' }}"
    "{%- else -%}{{ render(message['content']) + '<end_of_turn>\\n' }}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}"
)

# Idefics3 (and SmolVLM, which prefixes <|im_start|>): "User:<image>text<end_of_utterance>\n"
# ("User: text" when the content does not start with an image), "Assistant: answer".
_IDEFICS3_BODY = (
    "{%- for message in messages -%}"
    "{%- set content = message['content'] -%}"
    "{%- if content is string -%}"
    "{%- set body = ' ' + content -%}"
    "{%- else -%}"
    "{%- set ns = namespace(body=('' if content and content[0]['type'] == 'image' else ' ')) -%}"
    "{%- for part in content -%}"
    "{%- if part['type'] == 'text' -%}{%- set ns.body = ns.body + part['text'] -%}"
    "{%- elif part['type'] == 'image' -%}{%- set ns.body = ns.body + '<image>' -%}"
    "{%- elif part['type'] == 'video' -%}{%- set ns.body = ns.body + '<video>' -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- set body = ns.body -%}"
    "{%- endif -%}"
    "{{ (message['role'] | capitalize) + ':' }}"
    "{%- if message['role'] == 'assistant' -%}"
    "{% generation %}{{ body + '<end_of_utterance>' }}{% endgeneration %}{{ '\\n' }}"
    "{%- else -%}{{ body + '<end_of_utterance>\\n' }}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ 'Assistant:' }}{%- endif -%}"
)
IDEFICS3_TEMPLATE = "{{ '<|begin_of_text|>' }}" + _IDEFICS3_BODY
SMOLVLM_TEMPLATE = "{{ '<|im_start|>' }}" + _IDEFICS3_BODY

# LLaVA 1.5 / LLaVA-NeXT (vicuna): "USER: <image>\ntext ASSISTANT: answer</s>"; images come
# first in a turn (as llava-hf's template renders them), a system prompt is prepended as text.
LLAVA_TEMPLATE = (
    "{%- macro render(content) -%}"
    "{%- if content is string -%}{{ content }}"
    "{%- else -%}"
    "{%- for part in content if part['type'] == 'image' -%}{{ '<image>\\n' }}{%- endfor -%}"
    "{%- for part in content if part['type'] == 'text' -%}"
    "{{ (' ' if not loop.first else '') + part['text'] }}{%- endfor -%}"
    "{%- endif -%}"
    "{%- endmacro -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}{{ render(message['content']) + ' ' }}"
    "{%- elif message['role'] == 'user' -%}{{ 'USER: ' + render(message['content']) + ' ' }}"
    "{%- else -%}{{ 'ASSISTANT: ' }}"
    "{% generation %}{{ render(message['content']) + eos_token }}{% endgeneration %}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ 'ASSISTANT:' }}{%- endif -%}"
)

# --------------------------------------------------------------------------------------------
# tokenizers
# --------------------------------------------------------------------------------------------

# Per family: the named special tokens (bos/eos/pad/unk and model-specific names the processors
# read), then unnamed extra special tokens, all added as special tokens.
_QWEN_TOKENS = dict(
    named=dict(
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        image_token="<|image_pad|>",
        video_token="<|video_pad|>",
        vision_start_token="<|vision_start|>",
        vision_end_token="<|vision_end|>",
    ),
    extra=["<|im_start|>"],
)
# Idefics3's and SmolVLM's tokens around an image, and those naming an image's tiles.
_IDEFICS_IMAGE = dict(
    fake_image_token="<fake_token_around_image>",
    global_image_token="<global-img>",
    end_of_utterance_token="<end_of_utterance>",
)
_TILES = [f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)]
TOKENS = {
    "qwen2_5_vl": _QWEN_TOKENS,
    "qwen3_vl": _QWEN_TOKENS,
    "gemma3": dict(
        named=dict(
            pad_token="<pad>",
            eos_token="<eos>",
            bos_token="<bos>",
            unk_token="<unk>",
            boi_token="<start_of_image>",
            eoi_token="<end_of_image>",
            image_token="<image_soft_token>",
        ),
        extra=["<start_of_turn>", "<end_of_turn>"],
    ),
    "idefics3": dict(
        named=dict(
            bos_token="<|begin_of_text|>",
            eos_token="<end_of_utterance>",
            pad_token="<|finetune_right_pad_id|>",
            image_token="<image>",
            **_IDEFICS_IMAGE,
        ),
        extra=["<|end_of_text|>", *_TILES],
    ),
    "smolvlm": dict(
        named=dict(
            bos_token="<|im_start|>",
            eos_token="<end_of_utterance>",
            pad_token="<|im_end|>",
            image_token="<image>",
            video_token="<video>",
            **_IDEFICS_IMAGE,
        ),
        extra=["<|endoftext|>", *_TILES],
    ),
    "llava": dict(
        named=dict(bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>", image_token="<image>"),
        extra=[],
    ),
}
TOKENS["llava_next"] = TOKENS["llava"]

_STANDARD = ("bos_token", "eos_token", "unk_token", "pad_token")


def build_tokenizer(family: str, chat_template: str, vocab_size: int = 320):
    """A byte-level BPE tokenizer (256 byte tokens, the family's special tokens, a few merges
    learnt from CORPUS) with the family's special tokens named as attributes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    spec = TOKENS[family]
    specials = list(dict.fromkeys(list(spec["named"].values()) + spec["extra"]))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=max(vocab_size, 256 + len(specials)),
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    named = dict(spec["named"])
    standard = {k: named.pop(k) for k in _STANDARD if k in named}
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        extra_special_tokens=named,  # a dict: tokenizer.image_token, tokenizer.image_token_id, ...
        chat_template=chat_template,
        model_max_length=4096,
        **standard,
    )


# --------------------------------------------------------------------------------------------
# models + processors
# --------------------------------------------------------------------------------------------

# image_tokens: image tokens one small image (32x32 or 48x48) becomes with these settings.
SPECS = {
    "qwen2_5_vl": dict(image_tokens=4),  # 56x56 (patch 14, merge 2): 4x4 patches -> 2x2 tokens
    "qwen3_vl": dict(image_tokens=4),  # 64x64 (patch 16, merge 2)
    "gemma3": dict(image_tokens=4),  # 32x32, patch 8 -> 4x4 patches, avg-pooled to 2x2
    "idefics3": dict(image_tokens=4),  # 32x32, patch 8 -> 16 patches, pixel shuffle 2 -> 4
    "smolvlm": dict(image_tokens=4),
    "llava": dict(image_tokens=16),  # 32x32 CLIP, patch 8 -> 16 patches (CLS dropped)
    "llava_next": dict(image_tokens=None),  # anyres: depends on the image's size (see check)
}


# --------------------------------------------------------------------------------------------
# processors with a video processor, where torchvision is missing (llmtrain.vision.load_processor)
# --------------------------------------------------------------------------------------------


def _has_torchvision() -> bool:
    from transformers.utils import is_torchvision_available

    return is_torchvision_available()


def _qwen_video_processor(patch_size: int, qwen3: bool = False):
    if not _has_torchvision():
        return None
    from transformers import Qwen2VLVideoProcessor, Qwen3VLVideoProcessor

    factor = patch_size * 2
    cls = Qwen3VLVideoProcessor if qwen3 else Qwen2VLVideoProcessor
    return cls(
        size={"shortest_edge": (2 * factor) ** 2, "longest_edge": 4 * (4 * factor) ** 2},
        patch_size=patch_size,
        temporal_patch_size=2,
        merge_size=2,
    )


def _qwen_image_processor(patch_size: int, merge_size: int = 2):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    factor = patch_size * merge_size
    # smart_resize rounds each side to a multiple of `factor` and keeps the area within
    # [shortest_edge, longest_edge] pixels: any small image becomes 2x2 factor-blocks (4 tokens),
    # an image up to 4x4 blocks (16 tokens).
    return Qwen2VLImageProcessorPil(
        size={"shortest_edge": (2 * factor) ** 2, "longest_edge": (4 * factor) ** 2},
        patch_size=patch_size,
        temporal_patch_size=2,
        merge_size=merge_size,
    )


def _qwen2_5_vl(tok):
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2_5_VLProcessor

    head_dim = TEXT["hidden_size"] // TEXT["num_attention_heads"]  # 16 -> mrope over 8 frequencies
    config = Qwen2_5_VLConfig(
        text_config=dict(
            **TEXT,
            vocab_size=len(tok),
            max_position_embeddings=4096,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[2, 3, 3]),
            bos_token_id=None,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
        ),
        vision_config=dict(
            depth=2,
            hidden_size=32,
            intermediate_size=64,
            num_heads=2,
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
            window_size=56,
            fullatt_block_indexes=[1],
            out_hidden_size=TEXT["hidden_size"],
        ),
        image_token_id=tok.image_token_id,
        video_token_id=tok.video_token_id,
        vision_start_token_id=tok.vision_start_token_id,
        vision_end_token_id=tok.vision_end_token_id,
    )
    assert head_dim // 2 == sum(config.text_config.rope_parameters["mrope_section"])
    with images_only(Qwen2_5_VLProcessor):
        processor = Qwen2_5_VLProcessor(
            image_processor=_qwen_image_processor(14), tokenizer=tok, video_processor=_qwen_video_processor(14)
        )
    return Qwen2_5_VLForConditionalGeneration(config), processor


def _qwen3_vl(tok):
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration, Qwen3VLProcessor

    config = Qwen3VLConfig(
        text_config=dict(
            **TEXT,
            head_dim=16,
            vocab_size=len(tok),
            max_position_embeddings=4096,
            rope_parameters=dict(
                rope_type="default", rope_theta=10000.0, mrope_section=[2, 3, 3], mrope_interleaved=True
            ),
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
        ),
        vision_config=dict(
            depth=2,
            hidden_size=32,
            intermediate_size=64,
            num_heads=2,
            patch_size=16,
            spatial_merge_size=2,
            temporal_patch_size=2,
            num_position_embeddings=16,  # a 4x4 learnt grid, interpolated to the image's grid
            deepstack_visual_indexes=[0],
            out_hidden_size=TEXT["hidden_size"],
        ),
        image_token_id=tok.image_token_id,
        video_token_id=tok.video_token_id,
        vision_start_token_id=tok.vision_start_token_id,
        vision_end_token_id=tok.vision_end_token_id,
    )
    with images_only(Qwen3VLProcessor):
        processor = Qwen3VLProcessor(
            image_processor=_qwen_image_processor(16),
            tokenizer=tok,
            video_processor=_qwen_video_processor(16, qwen3=True),
        )
    return Qwen3VLForConditionalGeneration(config), processor


def _gemma3(tok):
    import torch
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3Processor
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    image_size, patch_size, mm_tokens = 32, 8, SPECS["gemma3"]["image_tokens"]
    config = Gemma3Config(
        text_config=dict(
            **TEXT,
            head_dim=16,
            query_pre_attn_scalar=16,
            vocab_size=len(tok),
            max_position_embeddings=4096,
            sliding_window=16,
            layer_types=["sliding_attention", "full_attention"],
            bos_token_id=tok.bos_token_id,
            eos_token_id=[tok.eos_token_id, tok.convert_tokens_to_ids("<end_of_turn>")],
            pad_token_id=tok.pad_token_id,
        ),
        vision_config=dict(
            model_type="siglip_vision_model",
            **VISION,
            image_size=image_size,
            patch_size=patch_size,
            vision_use_head=False,
        ),
        mm_tokens_per_image=mm_tokens,
        boi_token_index=tok.boi_token_id,
        eoi_token_index=tok.eoi_token_id,
        image_token_index=tok.image_token_id,
    )
    image_processor = Gemma3ImageProcessorPil(size={"height": image_size, "width": image_size}, do_pan_and_scan=False)
    processor = Gemma3Processor(image_processor=image_processor, tokenizer=tok, image_seq_length=mm_tokens)
    model = Gemma3ForConditionalGeneration(config)
    # The projector's weight starts as zeros (a parameter made with torch.zeros, which
    # _init_weights leaves alone): images would be all-zero embeddings and the vision tower would
    # get no gradient. Give it random values as the other families' projectors have.
    torch.nn.init.normal_(model.model.multi_modal_projector.mm_input_projection_weight, std=0.02)
    return model, processor


def _idefics3(tok, family="idefics3"):
    import transformers as T

    image_size, patch_size, scale = 32, 8, 2
    image_seq_len = (image_size // patch_size) ** 2 // scale**2
    prefix = "SmolVLM" if family == "smolvlm" else "Idefics3"
    Config = getattr(T, f"{prefix}Config")
    Model = getattr(T, f"{prefix}ForConditionalGeneration")
    Processor = getattr(T, f"{prefix}Processor")
    if family == "smolvlm":
        from transformers.models.smolvlm.image_processing_pil_smolvlm import SmolVLMImageProcessorPil as ImageProc
    else:
        from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil as ImageProc
    config = Config(
        text_config=dict(
            model_type="llama",
            **TEXT,
            vocab_size=len(tok),
            max_position_embeddings=4096,
            bos_token_id=tok.bos_token_id,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
        ),
        vision_config=dict(**VISION, image_size=image_size, patch_size=patch_size),
        scale_factor=scale,
        image_token_id=tok.image_token_id,
        pad_token_id=tok.pad_token_id,
    )
    image_processor = ImageProc(
        do_image_splitting=False,
        size={"longest_edge": image_size},
        max_image_size={"longest_edge": image_size},
    )
    if family == "smolvlm":
        video_processor = None
        if _has_torchvision():
            from transformers import SmolVLMVideoProcessor

            video_processor = SmolVLMVideoProcessor(
                size={"longest_edge": image_size}, max_image_size={"longest_edge": image_size}
            )
        with images_only(Processor):
            processor = Processor(
                image_processor=image_processor,
                tokenizer=tok,
                video_processor=video_processor,
                image_seq_len=image_seq_len,
            )
    else:
        processor = Processor(image_processor=image_processor, tokenizer=tok, image_seq_len=image_seq_len)
    return Model(config), processor


def _llava(tok, family="llava"):
    import transformers as T
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil
    from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil

    image_size, patch_size = 32, 8
    text = dict(
        model_type="llama",
        **TEXT,
        vocab_size=len(tok),
        max_position_embeddings=4096,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    vision = dict(
        model_type="clip_vision_model", **VISION, image_size=image_size, patch_size=patch_size, projection_dim=32
    )
    common = dict(
        text_config=text,
        vision_config=vision,
        image_token_index=tok.image_token_id,
        vision_feature_select_strategy="default",  # drop CLS
        vision_feature_layer=-2,
        image_seq_length=(image_size // patch_size) ** 2,
    )
    proc_kwargs = dict(patch_size=patch_size, vision_feature_select_strategy="default", num_additional_image_tokens=1)
    size = dict(size={"shortest_edge": image_size}, crop_size={"height": image_size, "width": image_size})
    if family == "llava":
        config = T.LlavaConfig(**common)
        processor = T.LlavaProcessor(image_processor=CLIPImageProcessorPil(**size), tokenizer=tok, **proc_kwargs)
        return T.LlavaForConditionalGeneration(config), processor
    pinpoints = [[image_size, image_size], [image_size, 2 * image_size], [2 * image_size, image_size]]
    config = T.LlavaNextConfig(**common, image_grid_pinpoints=pinpoints)
    image_processor = LlavaNextImageProcessorPil(**size, image_grid_pinpoints=pinpoints)
    processor = T.LlavaNextProcessor(image_processor=image_processor, tokenizer=tok, **proc_kwargs)
    return T.LlavaNextForConditionalGeneration(config), processor


TEMPLATES = {
    "qwen2_5_vl": QWEN2_VL_TEMPLATE_WITH_SYSTEM,
    "qwen3_vl": QWEN3_VL_TEMPLATE,
    "gemma3": GEMMA3_TEMPLATE,
    "idefics3": IDEFICS3_TEMPLATE,
    "smolvlm": SMOLVLM_TEMPLATE,
    "llava": LLAVA_TEMPLATE,
    "llava_next": LLAVA_TEMPLATE,
}
_BUILDERS = {
    "qwen2_5_vl": _qwen2_5_vl,
    "qwen3_vl": _qwen3_vl,
    "gemma3": _gemma3,
    "idefics3": _idefics3,
    "smolvlm": lambda tok: _idefics3(tok, "smolvlm"),
    "llava": _llava,
    "llava_next": lambda tok: _llava(tok, "llava_next"),
}


def build_model_and_processor(family: str, seed: int = 0):
    """(model, processor) in memory, random weights (seeded)."""
    import torch

    if family not in _BUILDERS:
        raise ValueError(f"unknown family {family!r}; one of {FAMILIES}")
    tok = build_tokenizer(family, TEMPLATES[family])
    torch.manual_seed(seed)
    model, processor = _BUILDERS[family](tok)
    processor.chat_template = TEMPLATES[family]
    if not _has_torchvision() and "video_processor" in type(processor).get_attributes():
        processor.video_processor = None
    model.generation_config.eos_token_id = model.config.get_text_config().eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    if tok.bos_token_id is not None:
        model.generation_config.bos_token_id = tok.bos_token_id
    return model, processor


def build(family: str, out_dir: str | os.PathLike, seed: int = 0) -> Path:
    """Build one family's tiny model and processor and save both (save_pretrained) to out_dir."""
    out = Path(out_dir)
    model, processor = build_model_and_processor(family, seed)
    model.save_pretrained(out)
    save_processor(processor, out)
    return out


def build_all(root: str | os.PathLike, families=FAMILIES) -> dict[str, Path]:
    return {family: build(family, Path(root) / family) for family in families}


if __name__ == "__main__":
    import sys

    root = sys.argv[1] if len(sys.argv) > 1 else "tiny-vlms"
    for family in sys.argv[2:] or FAMILIES:
        print(family, build(family, Path(root) / family))


# --- what tests of these models share -----------------------------------------------------


def png(path, size=(16, 16), colour=(255, 0, 0)) -> bytes:
    """A PNG of one colour, written to `path` unless None; its bytes."""
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", size, colour).save(out, format="PNG")
    if path is not None:
        path.write_bytes(out.getvalue())
    return out.getvalue()


def loaded(path, **kw):
    """(the ModelConfig, the tokenizer carrying its processor) of a built model, as a run loads them."""
    from llmtrain.config import ModelConfig
    from llmtrain.model import check_model, load_tokenizer
    from llmtrain.processor import is_vision

    cfg = ModelConfig(name_or_path=str(path), attn_implementation="sdpa", **kw)
    mcfg = check_model(cfg, 256)
    assert is_vision(mcfg)
    return cfg, load_tokenizer(cfg, vision=True)


# The colours of the tests' pictures, by name.
COLOURS = {"red": (220, 30, 30), "green": (30, 200, 60), "blue": (40, 60, 230)}


def pictures(root: Path) -> Path:
    """root, holding a 40x32 picture of each of COLOURS, named <colour>.png."""
    for name, colour in COLOURS.items():
        png(root / f"{name}.png", size=(40, 32), colour=colour)
    return root
