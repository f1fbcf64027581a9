"""Model and tokenizer loading, LoRA, attention backend, compilation, and the output layer
the chunked loss (objective.TokenLoss) can stand in for; the check that a reference model
(dpo.reference, grpo.reference) reads the policy's token ids. `llmtrain plan` reads the
model through the same functions."""

from __future__ import annotations

import contextlib
import copy
import json
from pathlib import Path

import torch

from .attention import Attention, attends_both_ways, share_sdpa_masks, text_config
from .attention import choose as choose_attention
from .config import ModelConfig
from .errors import AttentionError, ModelError, describe, shown, warn
from .files import is_path
from .processor import check_processor, freeze_vision, is_vision, language_only, load_processor, unquantized

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "auto": "auto"}


def hub_kwargs(cfg: ModelConfig) -> dict:
    """What every from_pretrained call of the model, its config and tokenizer is given."""
    kw = {"trust_remote_code": cfg.trust_remote_code}
    if cfg.revision:
        kw["revision"] = cfg.revision
    return kw


def no_such_directory(name: str, key: str = "model.name_or_path") -> ModelError | None:
    """A name written as a path (./x, /x, ~/x, a/b/c) that is no directory: an error, rather
    than a hub lookup of a name the hub cannot hold."""
    if is_path(name) and not Path(name).expanduser().is_dir():
        return ModelError(
            f"{key}: no such directory: {name}; give a local model directory "
            "(with config.json) or a hub name like 'owner/model'"
        )
    return None


def load_error(what: str, name: str, e: Exception, key: str = "model.name_or_path", given=None) -> ModelError:
    """A failed from_pretrained, with what to do about it: a local directory's missing
    files named in the user's words (transformers' words for them point elsewhere, e.g.
    at sentencepiece for a missing tokenizer.json), else what to check. `key` names the
    setting that gave `name`; `given(path)` spells that setting with another path."""
    given = given or (lambda path: f"{key}={path}")
    local = Path(name).expanduser()
    if error := no_such_directory(name, key):
        return error
    if local.is_dir() and (local / "adapter_config.json").is_file() and not (local / "config.json").is_file():
        try:
            base = json.loads((local / "adapter_config.json").read_text())["base_model_name_or_path"]
        except (OSError, ValueError, KeyError, TypeError):
            base = "the model they were trained on"
        fix = (
            f"train from their base ({base}), or from a merged export (a LoRA run with export.merge_lora=true "
            "writes one)"
            if key == "model.name_or_path"
            else "give a merged model (a LoRA run with export.merge_lora=true writes one to final/; recipes/reward.py "
            "always does)"
        )
        return ModelError(f"{key}: {name} holds LoRA adapters only (adapter_config.json), not a model; {fix}")
    if "ignore_mismatched_sizes" in str(e):  # transformers' load report, printed above, lists the weights
        return ModelError(
            f"{key}: the weights in '{name}' do not have the shapes its config.json gives (transformers' "
            "load report above lists them); config.json and the weights must come from the same model"
        )
    if local.is_dir():
        if missing := _missing_files(local, what):
            final = local / "final"  # an llmtrain run's output_dir holds its model there
            fix = (
                f"it is a run's output_dir: give its model, {given(final)}"
                if final.is_dir()
                else "give a model directory as save_pretrained writes it (config.json, the weights, and the "
                "tokenizer's files)"
            )
            return ModelError(f"{key}: {name} has no {missing}; {fix}")
        hint = (
            "check its config.json (an architecture newer than this transformers needs an upgrade)"
            if what == "a model config"
            else "check the directory's files"
        )
    else:
        from huggingface_hub import constants

        hint = "it is no local directory, so it was looked up on the hub: check the name, " + (
            "and that the hub cache holds it (HF_HUB_OFFLINE is set)"
            if constants.HF_HUB_OFFLINE
            else "network access and, for a gated or private model, your login (hf auth login)"
        )
    return ModelError(f"{key}: could not load {what} from '{name}' ({describe(e)}); {hint}")


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".msgpack", ".h5", ".gguf")


def _missing_files(path: Path, what: str) -> str | None:
    """What `what` needs that the directory lacks: its config.json, any tokenizer file
    (tokenizer.json, or a vocabulary a slow tokenizer converts), or any weights file."""
    names = [f.name for f in path.iterdir() if f.is_file()]
    if what == "a model config" and "config.json" not in names:
        return "config.json"
    tokenizer = [
        n for n in names if n.startswith(("tokenizer.", "vocab.", "spiece.")) or n.endswith((".model", ".tiktoken"))
    ]
    if what == "a tokenizer" and not tokenizer:
        return "tokenizer files (tokenizer.json)"
    if what not in ("a model config", "a tokenizer") and not any(n.endswith(WEIGHT_SUFFIXES) for n in names):
        return "weights (model.safetensors)"
    return None


def check_model(cfg: ModelConfig, max_seq_len: int, sample_tokens: int = 0):
    """Read the model's config (no weights) before any data or weights load, and return
    it: a bad model.name_or_path, or sequences longer than the model's positions without
    rope scaling (they would train on positions the model never learned; `sample_tokens`
    are generated after training), stop the run here."""
    from transformers import AutoConfig

    name = cfg.name_or_path
    if error := no_such_directory(name):
        raise error
    if cfg.revision and Path(name).expanduser().is_dir():
        raise ModelError(
            f"model.revision: {cfg.revision} selects a hub revision, but {name} is a local directory, read as it is; "
            "remove model.revision, or give the hub name"
        )
    _check_readable(Path(name).expanduser())
    try:
        mcfg = AutoConfig.from_pretrained(name, **hub_kwargs(cfg))
    except Exception as e:
        raise load_error("a model config", name, e) from None
    _check_head(cfg, mcfg)
    _check_dtype(cfg, mcfg)
    if cfg.lora.enabled:
        meta_model(cfg, mcfg)  # adds the adapters as training will, or says why it cannot
    limit = getattr(mcfg, "max_position_embeddings", None)
    if not isinstance(limit, int) or _rope_scaled(mcfg):
        return mcfg
    if sample_tokens > limit:
        raise ModelError(
            f"eval.sample_max_new_tokens: {sample_tokens} is above the {limit} positions of '{cfg.name_or_path}' "
            f"(max_position_embeddings); set eval.sample_max_new_tokens below {limit}"
        )
    if max_seq_len <= limit:
        return mcfg
    raise ModelError(
        f"data.max_seq_len: {max_seq_len} is above the {limit} positions of '{cfg.name_or_path}' "
        f"(max_position_embeddings, no rope scaling); set data.max_seq_len={limit} or less, or use "
        "a model configured for longer context"
    )


def _check_head(cfg: ModelConfig, mcfg) -> None:
    """A sequence classifier (a reward model's final/) has no language-model head: loaded as
    a causal LM, transformers would start one at random (tied embeddings hide it) and the
    run would train from it without a word beyond the load report."""
    saved = getattr(mcfg, "architectures", None) or []
    if cfg.head != "score" and saved and all(str(a).endswith("ForSequenceClassification") for a in saved):
        raise ModelError(
            f"model.name_or_path: {cfg.name_or_path} is a sequence classifier ({saved[0]}, such as a reward model), "
            "with no language-model head for this recipe to train; give a causal LM, such as the model it was "
            "trained from"
        )


def _check_readable(path: Path) -> None:
    """Every file of a local model directory opens for reading (transformers reports an
    unreadable weights file as missing)."""
    if not path.is_dir():
        return
    for f in sorted(path.rglob("*")):
        try:
            if f.is_file():
                f.open("rb").close()
        except OSError as e:
            raise ModelError(f"model.name_or_path: cannot read {f} ({e.strerror}); check its permissions") from None


def meta_model(cfg: ModelConfig, mcfg, zero3: bool = False):
    """The model as training will have it (dtype, a frozen vision tower, LoRA adapters), built on the meta device
    from its config: no weights, so its parameter counts and sizes cost nothing to read
    (`llmtrain plan`, and the free-space check before anything loads)."""
    model = _meta(cfg, mcfg, load_dtype(cfg, mcfg))
    if is_vision(mcfg) and cfg.freeze_vision:  # as load_model: the vision tower trains nothing
        freeze_vision(model)
    if not cfg.lora.enabled:
        return model
    # peft builds each adapter's layers on the CPU before moving them to the meta device,
    # drawing their initial weights from torch's generator: without a generator of their
    # own, a sizing pass would change the run's random draws (its adapters' initial weights).
    with torch.random.fork_rng(devices=[]):
        return add_lora(model, cfg, zero3=zero3)


def auto_class(cfg: ModelConfig, mcfg):
    """transformers' class for model.head: the causal LM (for a vision-language model, its
    image-text class), or the same body with a one-label sequence-classification head
    ('score', recipes/reward.py)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoModelForSequenceClassification

    if is_vision(mcfg):
        if cfg.head == "score":
            raise ModelError(
                f"model.name_or_path: '{cfg.name_or_path}' is a vision-language model; reward models "
                "(recipes/reward.py) are trained from text models only"
            )
        return AutoModelForImageTextToText
    return AutoModelForSequenceClassification if cfg.head == "score" else AutoModelForCausalLM


def head_kwargs(cfg: ModelConfig) -> dict:
    """What loading the model.head needs beyond the model's own config: one label."""
    return {"num_labels": 1} if cfg.head == "score" else {}


def _meta(cfg: ModelConfig, mcfg, dtype: torch.dtype):
    if cfg.head == "score":
        mcfg = copy.copy(mcfg)
        mcfg.num_labels = 1
    try:
        with whole_models(), torch.device("meta"):
            return auto_class(cfg, mcfg).from_config(mcfg, dtype=dtype, trust_remote_code=cfg.trust_remote_code)
    except ModelError:
        raise
    except Exception as e:  # the user's config.json describes no model that can be built
        raise ModelError(
            f"model.name_or_path: cannot build a model from the config of '{cfg.name_or_path}' ({describe(e)}); "
            "check its config.json"
        ) from None


@contextlib.contextmanager
def whole_models():
    """A context in which transformers builds or loads an ordinary, whole model on this
    process. Under a ZeRO-3 launch it would otherwise partition the model across processes
    as it builds it (zero.Init), a collective the other ranks may never join, and which
    fails on the meta device."""
    from transformers.integrations import is_deepspeed_zero3_enabled

    # transformers' own process-wide ZeRO-3 flag, not distributed.topology.Topology.zero3:
    # it is what from_pretrained and from_config consult to partition, and what is switched
    # off here, so the check and the switch cannot disagree (nested, the inner one finds it
    # off); and the callers have no Accelerator at hand (`llmtrain plan` builds its meta
    # model with none at all). Otherwise the two agree: Accelerate's DeepSpeed plugin sets
    # the flag from its config's stage when the Accelerator selects it.
    if not is_deepspeed_zero3_enabled():
        yield
        return
    from accelerate.state import AcceleratorState
    from transformers.integrations import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()
    try:
        yield
    finally:
        AcceleratorState().deepspeed_plugin.set_deepspeed_weakref()


def load_dtype(cfg: ModelConfig, mcfg) -> torch.dtype:
    """The dtype the weights load in: model.dtype, or with auto the checkpoint's (float32
    when its config does not say)."""
    return DTYPES[cfg.dtype] if cfg.dtype != "auto" else _saved_dtype(mcfg) or torch.float32


def _saved_dtype(mcfg) -> torch.dtype | None:
    saved = getattr(mcfg, "dtype", None) or getattr(mcfg, "torch_dtype", None)
    if isinstance(saved, str):
        saved = getattr(torch, saved.replace("torch.", ""), None)
    return saved if isinstance(saved, torch.dtype) else None


def _check_dtype(cfg: ModelConfig, mcfg) -> None:
    """Refuse float16 weights that would be trained (not frozen under LoRA): AdamW's small
    updates vanish in fp16, and no loss scaler works on fp16 weights (torch's GradScaler
    refuses to unscale fp16 gradients)."""
    fp16 = cfg.dtype == "float16" or (cfg.dtype == "auto" and _saved_dtype(mcfg) == torch.float16)
    if fp16 and not cfg.lora.enabled:
        how = "model.dtype=auto takes the checkpoint's float16" if cfg.dtype == "auto" else "model.dtype=float16"
        raise ModelError(
            f"model.dtype: float16 weights cannot be fine-tuned with AdamW ({how}); keep float32 weights "
            "(model.dtype=float32) and launch with --mixed_precision fp16 or bf16, use bfloat16 weights, or "
            "train LoRA adapters (model.lora.enabled=true), which stay float32 on a float16 base"
        )


def _rope_scaled(mcfg) -> bool:
    for name in ("rope_scaling", "rope_parameters"):
        rope = getattr(mcfg, name, None)
        if isinstance(rope, dict) and rope.get("rope_type", rope.get("type", "default")) not in (None, "default"):
            return True
    return False


def attention_backend(cfg: ModelConfig, mcfg, packing: bool, device: torch.device) -> Attention:
    """model.attn_implementation resolved for this model, data and device (attention.choose).
    A causal LM head on layers that attend both ways is refused: next-token training would
    let every position see the token it is to predict."""
    cls = model_class(cfg, mcfg)
    if cfg.head != "score" and attends_both_ways(mcfg):
        raise AttentionError(
            f"model.name_or_path: {cls.__name__} attends both ways (use_bidirectional_attention), so next-token "
            "training would show each position the token it predicts; train a model with causal attention"
        )
    return choose_attention(cfg.attn_implementation, cls, mcfg, packing, device)


def model_class(cfg: ModelConfig, mcfg) -> type:
    """The class training will load, read from a model built on the meta device."""
    return type(_meta(cfg, mcfg, torch.float32))


def load_tokenizer(cfg: ModelConfig, chat_template: str | None = None, vision: bool = False):
    """The model's (fast) tokenizer; `chat_template` (data.chat_template, resolved by
    DataConfig.chat_template_text) replaces its own, and is exported with the model. With
    `vision` (a vision-language model: vision.is_vision), the tokenizer of its processor,
    carrying the processor (vision.processor_of), whose chat template it renders with."""
    from transformers import AutoTokenizer

    processor = None
    try:
        if vision:
            processor = load_processor(cfg.name_or_path, **hub_kwargs(cfg))
            tok = getattr(processor, "tokenizer", None)
        else:
            tok = AutoTokenizer.from_pretrained(cfg.name_or_path, **hub_kwargs(cfg))
    except Exception as e:
        raise load_error("a processor" if vision else "a tokenizer", cfg.name_or_path, e) from None
    if vision:
        if tok is None:
            raise ModelError(f"model.name_or_path: the processor of '{cfg.name_or_path}' has no tokenizer")
        check_processor(processor, cfg.name_or_path)
        if chat_template:
            processor.chat_template = chat_template  # exported with the processor
        tok.chat_template = processor.chat_template or tok.chat_template  # what rows render with
        tok.processor = processor
    if not tok.is_fast:
        raise ModelError(
            f"model.name_or_path: '{cfg.name_or_path}' has no fast tokenizer; llmtrain needs one "
            "(character offsets locate assistant turns)"
        )
    if chat_template:
        tok.chat_template = chat_template
    return tok


def ids_past(tokenizer, vocab) -> str | None:
    """Which of the tokenizer's ids a model of `vocab` embeddings cannot take, or None.
    Counted are the ids that text and the chat template produce: the base vocabulary
    and the bos, eos, pad and unk tokens. Added tokens past the embeddings are allowed:
    some models ship tokens of another modality there (Gemma 3's image token is id
    262144 of a 262144-row text embedding), and chat text cannot spell a special token
    (data/rows.check_control_tokens)."""
    if not isinstance(vocab, int):
        return None
    if tokenizer.vocab_size > vocab:
        return f"a vocabulary of {tokenizer.vocab_size} tokens"
    special = {
        name: tid
        for name in ("bos_token", "eos_token", "pad_token", "unk_token")
        if (tid := getattr(tokenizer, f"{name}_id", None)) is not None and tid >= vocab
    }
    if special:
        return ", ".join(f"{name} at id {tid}" for name, tid in special.items())
    return None


def check_vocab(cfg: ModelConfig, mcfg, tokenizer) -> None:
    """Refuse a tokenizer whose ids the model does not embed (a tokenizer from another
    model): the first id past the embeddings would stop training mid-run with an index
    error (a device-side assert on a GPU). As dpo.reference's check, a larger vocabulary
    is accepted: models pad theirs."""
    vocab = getattr(text_config(mcfg), "vocab_size", None)
    if past := ids_past(tokenizer, vocab):
        raise ModelError(
            f"model.name_or_path: the tokenizer of '{cfg.name_or_path}' has {past}, but the model embeds only "
            f"{vocab} tokens (config.json vocab_size); use the tokenizer saved with this model"
        )


# What a model in each role usually is, for the errors of check_reference.
USUALLY = {
    "reference": "usually it is the model you fine-tune, before training",
    "teacher": "a larger model of the student's family, trained with the same tokenizer",
}


def check_reference(name: str, key: str, cfg: ModelConfig, tokenizer, role: str = "reference") -> None:
    """A reference model `name` (the config key `key`: dpo.reference, grpo.reference; or with
    role="teacher", distill.teacher) must read the policy's token ids (the model of `cfg`,
    with `tokenizer`) as the policy does, or every log-ratio compares two different texts.
    Checked from the reference's config and tokenizer (no weights) before any data or
    weights load: its vocabulary must hold
    every id of the policy's tokenizer (a smaller one ends in an index error mid-pass),
    and, where the reference directory has a tokenizer, that tokenizer must map tokens
    to the same ids (a larger vocabulary is accepted only as padding of the same one). A
    vision-language policy's reference is of its family (the same model_type): it reads
    the rows' images through the same image tokens."""
    from transformers import AutoConfig, AutoTokenizer

    if not name:
        return
    kw = {"trust_remote_code": cfg.trust_remote_code}
    if error := no_such_directory(name, key):  # a path, not a hub name: the hub's name rules would answer
        raise error
    try:
        rcfg = AutoConfig.from_pretrained(name, **kw)
    except Exception as e:
        raise ModelError(f"{key}: could not load a model config from '{name}' ({describe(e)})") from None
    policy = AutoConfig.from_pretrained(cfg.name_or_path, **hub_kwargs(cfg))
    if is_vision(policy) and rcfg.model_type != policy.model_type:
        raise ModelError(
            f"{key}: '{name}' is a {rcfg.model_type} model, but the policy is a vision-language model "
            f"({policy.model_type}) whose rows may show images; the {role} must be a {policy.model_type} model too, "
            "which reads them through the same image tokens"
        )
    ref_vocab = getattr(text_config(rcfg), "vocab_size", None)
    if past := ids_past(tokenizer, ref_vocab):
        raise ModelError(
            f"{key}: '{name}' embeds {ref_vocab} tokens, but the policy's tokenizer has {past}; "
            f"the {role} must be a model with the policy's tokenizer ({USUALLY[role]})"
        )
    try:
        ref_tok = AutoTokenizer.from_pretrained(name, **kw)
    except Exception:  # a weights-only directory: nothing more to compare
        ref_tok = None
    if ref_tok is not None:
        mine, theirs = tokenizer.get_vocab(), ref_tok.get_vocab()
        differ = sorted(t for t in mine.keys() | theirs.keys() if mine.get(t) != theirs.get(t))
        if differ:
            example = ", ".join(repr(t) for t in differ[:3])
            raise ModelError(
                f"{key}: the tokenizer of '{name}' maps {len(differ)} tokens differently from the policy's "
                f"(e.g. {example}); the {role} must share the policy's tokenizer ({USUALLY[role]})"
            )
        return
    policy_vocab = text_config(policy).vocab_size
    if ref_vocab != policy_vocab:
        raise ModelError(
            f"{key}: '{name}' has a vocabulary of {ref_vocab} tokens and no tokenizer to show it is the "
            f"policy's ({policy_vocab} tokens); save the policy's tokenizer with the {role} model "
            f"(tokenizer.save_pretrained) or use a {role} with the policy's vocabulary"
        )


def pad_id(tokenizer) -> int:
    """Padding never reaches the loss, so a tokenizer without a pad token pads with EOS."""
    for tid in (tokenizer.pad_token_id, tokenizer.eos_token_id, 0):
        if tid is not None:
            return tid


def quantization_kwargs(cfg: ModelConfig, keep: list[str] | None = None) -> dict:
    """from_pretrained's arguments for model.quantization: bitsandbytes' config, and the
    process's own device, where the weights are quantized as they load (a quantized model
    cannot be moved afterwards). `keep`: the modules left unquantized, where not
    transformers' own choice (a vision-language model's vision tower and projector:
    processor.unquantized)."""
    if cfg.quantization == "none":
        return {}
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        raise ModelError(
            f'model.quantization={cfg.quantization} needs bitsandbytes: pip install -e ".[qlora]" '
            "(or set model.quantization=none)"
        ) from None
    from accelerate import PartialState
    from transformers import BitsAndBytesConfig

    compute = DTYPES[cfg.dtype] if cfg.dtype != "auto" else torch.bfloat16
    if cfg.quantization == "int8":
        quant = BitsAndBytesConfig(load_in_8bit=True, llm_int8_skip_modules=keep)
    else:
        quant = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type=cfg.quantization,
            bnb_4bit_compute_dtype=compute,
            llm_int8_skip_modules=keep,
        )
    return {"quantization_config": quant, "device_map": {"": PartialState().device}}


def keep_4bit_trainable_on_cpu(model) -> None:
    """Turns off bitsandbytes' CPU inference path on every 4-bit layer. On CPUs with
    AVX512-BF16 (0.50), a 4-bit layer run in eval mode without grad repacks its weight,
    for good, into a layout only `gemv_4bit` reads: that kernel has no backward, so the
    training steps after the first evaluation back-propagate through nothing and LoRA
    gradients come out wrong without an error, and it asserts on widths that are not
    multiples of its 32-row tiles (an intermediate size of 340). The plain dequantizing
    path trains and evaluates every width alike; evaluation on such CPUs is slower."""
    import bitsandbytes as bnb

    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            module.support_avx512bf16_for_cpu = False


def is_quantized(model) -> bool:
    return bool(getattr(model, "is_quantized", False))


def reference_config(cfg: ModelConfig, name: str = "") -> ModelConfig:
    """The model settings of a frozen reference model: `name` (a hub name or directory), or
    with none the policy's own starting weights; never LoRA-adapted or checkpointed (it
    takes no gradient)."""
    from dataclasses import replace

    return replace(
        cfg,
        name_or_path=name or cfg.name_or_path,
        revision="" if name else cfg.revision,
        gradient_checkpointing=False,
        lora=replace(cfg.lora, enabled=False),
    )


def load_frozen(cfg: ModelConfig, name: str = "", device=None):
    """A frozen model beside the trained one (a reference, a distillation teacher): `name`'s
    weights, or with none the trained model's starting ones (reference_config), whole on this
    process (whole_models: a ZeRO-3 launch would partition it as it loads), without gradients,
    in eval mode, on `device` where given."""
    with whole_models():
        model = load_model(reference_config(cfg, name))
    model.requires_grad_(False).eval()
    return model if device is None else model.to(device)


def load_model(cfg: ModelConfig, zero3: bool = False):
    """The model from cfg.name_or_path as training takes it (dtype, attention, quantized,
    checkpointed, LoRA adapters); `zero3`: the run is under DeepSpeed ZeRO-3 (`add_lora`)."""
    from transformers import AutoConfig

    try:
        mcfg = AutoConfig.from_pretrained(cfg.name_or_path, **hub_kwargs(cfg))
        keep = unquantized(_meta(cfg, mcfg, torch.float32)) if is_vision(mcfg) and cfg.quantization != "none" else None
        quantized = quantization_kwargs(cfg, keep)
        model = auto_class(cfg, mcfg).from_pretrained(
            cfg.name_or_path,
            dtype=DTYPES[cfg.dtype],
            attn_implementation=cfg.attn_implementation,
            **hub_kwargs(cfg),
            **head_kwargs(cfg),
            **quantized,
        )
    except ModelError:
        raise
    except Exception as e:
        what = "a sequence-classification (reward) model" if cfg.head == "score" else "a causal LM"
        raise load_error(what, cfg.name_or_path, e) from None
    model.config.use_cache = False
    if is_vision(mcfg) and cfg.freeze_vision:
        freeze_vision(model)
    if model.config._attn_implementation == "sdpa":
        share_sdpa_masks()  # one float copy of a boolean mask for all layers, not one each
    if is_quantized(model) and model.device.type == "cpu":  # 8-bit layers have no such path: left as they are
        keep_4bit_trainable_on_cpu(model)
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return add_lora(model, cfg, warn, zero3) if cfg.lora.enabled else model


def add_lora(model, cfg: ModelConfig, report=None, zero3: bool = False):
    """The model with peft LoRA adapters per model.lora (also on the meta-device model of
    `llmtrain plan`, which counts what they train). `report` gets a line when the
    experts of a mixture-of-experts model are left without adapters (`lora_targets`;
    `zero3`: the run is under DeepSpeed ZeRO-3)."""
    from peft import LoraConfig, get_peft_model

    lora = cfg.lora
    exclude = SCORE_HEADS if cfg.head == "score" else ()
    modules, parameters, skipped = lora_targets(model, lora, exclude=exclude, zero3=zero3)
    if lora.projector and not is_vision(model.config):
        raise ModelError(f"model.lora.projector: '{cfg.name_or_path}' is a text model, with no projector; set it false")
    if is_vision(model.config) and cfg.freeze_vision and not isinstance(modules, str):
        modules = language_only(model, _linear_modules(model), modules, lora.projector)
    if skipped and report is not None:
        why = (
            "under DeepSpeed ZeRO-3 peft's adapters on fused expert weights neither train as on one process nor "
            "save; use ZeRO-2 or FSDP2 to adapt them too"
            if zero3
            else "peft adapts fused expert weights only without dropout; set model.lora.dropout=0 to adapt them too"
        )
        report(f"model.lora: the experts' weights ({', '.join(skipped)}) get no adapters: {why}")
    adapters = LoraConfig(
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=modules,
        target_parameters=parameters or None,
        # SEQ_CLS: peft trains and saves the new score head whole beside the adapters
        task_type="SEQ_CLS" if cfg.head == "score" else "CAUSAL_LM",
    )
    linear = _linear_names(model, head=True)  # read now: peft changes the model in place before it may fail
    if is_quantized(model):
        # QLoRA: layer norms and embeddings in fp32, inputs that require grad, and
        # checkpointing set up the way peft's k-bit training expects.
        from peft import prepare_model_for_kbit_training

        model = prepare_model_for_kbit_training(
            model,
            use_gradient_checkpointing=cfg.gradient_checkpointing,
            gradient_checkpointing_kwargs={"use_reentrant": False},
        )
    elif cfg.gradient_checkpointing:
        model.enable_input_require_grads()  # checkpointed blocks need an input that requires grad
    try:
        return get_peft_model(model, adapters)
    except ValueError as e:  # peft: no module matches target_modules (or a module it cannot adapt)
        given = lora.target_modules
        if isinstance(given, str) and given in linear:  # peft reads a string as a pattern for whole names
            raise ModelError(
                f"model.lora.target_modules: {shown(given)} is one name given as a string, which peft reads as a "
                f"regular expression over whole module names; give a list: model.lora.target_modules=[{given}]"
            ) from None
        raise ModelError(
            f"model.lora.target_modules: {shown(given)} cannot be adapted ({describe(e)}); the model's "
            f"linear layers are named {', '.join(linear)}; or use all-linear"
        ) from None


def _linear_modules(model) -> dict[str, torch.nn.Module]:
    """The model's linear layers by whole name (nn.Linear, GPT-2's Conv1D, their quantized forms)."""
    from transformers.pytorch_utils import Conv1D

    return {n: m for n, m in model.named_modules() if isinstance(m, (torch.nn.Linear, Conv1D))}


def _linear_names(model, head: bool = False) -> list[str]:
    """The last names of the model's linear layers (nn.Linear, GPT-2's Conv1D and their
    quantized forms), with its output layer or without, and never a mixture-of-experts
    router's (`router_names`)."""
    from transformers.pytorch_utils import Conv1D

    head = None if head else model.get_output_embeddings()
    routers = router_names(model)
    return sorted(
        {
            n.rsplit(".", 1)[-1]
            for n, m in model.named_modules()
            if isinstance(m, (torch.nn.Linear, Conv1D)) and m is not head
        }
        - routers
    )


def router_names(model) -> set[str]:
    """The last names of a mixture-of-experts model's routers: the modules transformers
    records router logits from (`_can_record_outputs` of the model, or of the inner model
    for some, such as Llama 4's). Some routers are nn.Linear subclasses that return a tuple
    (PhiMoE's, Llama 4's), which a LoRA layer cannot wrap; and adapting any router shifts
    which experts see which tokens."""
    from transformers import PreTrainedModel

    recorders = [router_recorder(m) for m in model.modules() if isinstance(m, PreTrainedModel)]
    targets = tuple({r.target_class for r in recorders if r is not None})
    if not targets:
        return set()
    return {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, targets)}


def router_recorder(model):
    """Where transformers takes a model's router logits from (the OutputRecorder of its
    `_can_record_outputs`, whose target_class is the router module's class), or None for a
    model (a PreTrainedModel) that records none."""
    recorder = (getattr(model, "_can_record_outputs", None) or {}).get("router_logits")
    return recorder if isinstance(getattr(recorder, "target_class", None), type) else None


# The sequence-classification heads transformers gives causal LMs (GPT-2's and Llama's
# alike): trained whole, never adapted.
SCORE_HEADS = ("score",)


def lora_targets(model, lora, exclude=(), zero3: bool = False) -> tuple[str | list[str], list[str], list[str]]:
    """(target_modules, target_parameters, expert weights left out) for peft. A list of
    names is used as given. 'all-linear' is resolved here rather than by peft: peft turns
    it, on Mixtral- and Qwen-MoE-shaped models, into the router and the fused expert
    weights as well, which its parameter wrapper adapts only without dropout (and the
    router is better left alone: adapting it shifts which experts see which tokens). So
    'all-linear' is every linear layer but the output layer (attention, dense MLPs, shared
    experts), plus the fused expert weights (3-D parameters such as experts.gate_up_proj)
    when model.lora.dropout is 0; with dropout, or under DeepSpeed ZeRO-3 (`zero3`: there
    peft's parameter adapters trained otherwise than on one process and were not saved,
    checked with peft 0.21 on a tiny Mixtral), they are left out, and named."""
    if lora.target_modules != "all-linear":
        return lora.target_modules, [], []
    experts = sorted(
        {
            f"{name.rsplit('.', 1)[-1]}.{p}"
            for name, module in model.named_modules()
            if not isinstance(module, torch.nn.modules.conv._ConvNd)  # a convolution's (C, 1, K) is no expert bank
            for p, weight in module.named_parameters(recurse=False)
            if len(getattr(weight, "ds_shape", weight.shape)) == 3  # ZeRO-3 partitions it flat
        }
    )
    linear = [n for n in _linear_names(model) if n not in exclude]
    left_out = bool(lora.dropout) or zero3
    return linear, ([] if left_out else experts), (experts if left_out else [])


def compile_blocks(model) -> int:
    """torch.compile every transformer block in place (regional compilation). The blocks
    share one compiled graph, so it compiles once whatever the depth; parameter names,
    checkpoints and wrappers (DDP, FSDP) are unaffected. Returns the number of blocks."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    blocks = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    if not blocks:
        raise ModelError(
            f"train.compile: found no transformer blocks in {type(model).__name__} to compile; set train.compile=false"
        )
    for block in blocks:
        block.compile()
    return len(blocks)


# Architectures whose forward returns lm_head's output untouched (no soft-capping or
# scaling after it), checked against their transformers source: the chunked loss stands in
# for their lm_head. Others get whole logits.
PLAIN_HEADS = {
    "llama",
    "mistral",
    "mixtral",
    "qwen2",
    "qwen2_moe",
    "qwen3",
    "qwen3_moe",
    "phi",
    "phi3",
    "gemma",
    "olmo",
    "olmo2",
    "smollm3",
    "starcoder2",
    "gpt_neox",
}


def chunkable_head(model) -> torch.nn.Linear | None:
    """The model's output layer if the chunked loss can stand in for it: a plain Linear
    (not a LoRA-adapted one) of an architecture in PLAIN_HEADS. Found once, before
    accelerator.prepare, by the objective (objective.TokenLoss.for_model)."""
    from accelerate.utils import extract_model_from_parallel

    base = extract_model_from_parallel(model)
    head = base.get_output_embeddings()
    if type(head) is not torch.nn.Linear or getattr(base.config, "model_type", None) not in PLAIN_HEADS:
        return None
    return head


# Mixture-of-experts routers that jitter their inputs in training, by the module attribute
# holding the amount and the config key setting it: Mixtral's and MiniMax's blocks
# (router_jitter_noise), PhiMoE's router and block (input_jitter_noise), DBRX's router
# (moe_jitter_eps, None for none). Each draws new noise at every forward, as dropout does.
JITTER = {
    "jitter_noise": "router_jitter_noise",
    "input_jitter_noise": "input_jitter_noise",
    "moe_jitter_eps": "moe_jitter_eps",
}
# Models whose update depends on the batch whatever their settings, and why.
SAMPLED_ROUTES = {"phimoe": "PhiMoE's routers sample their experts in training (sparsemixer)"}


def disable_dropout(model) -> None:
    """Turn off the model's own random draws in training, its dropout and its routers'
    jitter (not LoRA's dropout, model.lora.dropout): always for the preference, reward and
    GRPO recipes (a preference loss compares the policy's log-probs with the reference's,
    which must agree at the start; TRL does the same), and for SFT and distillation with
    model.dropout=none (any batch layout then gives the same update)."""
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Dropout) and "lora_" not in name:
            module.p = 0.0
        if isinstance(getattr(module, "attention_dropout", None), float):  # attention modules keep a rate
            module.attention_dropout = 0.0
        for attr in JITTER:
            if isinstance(getattr(module, attr, None), float):
                setattr(module, attr, None if attr == "moe_jitter_eps" else 0.0)


def random_draws(config) -> list[str]:
    """What a model's config draws at random in training, as `config.key=value`: its dropout
    rates and its routers' jitter, in the config and the configs it holds (a vision tower's,
    DBRX's ffn_config), all of which disable_dropout turns off."""
    from transformers import PretrainedConfig

    found = []

    def walk(cfg, prefix: str) -> None:
        jitter = set(JITTER.values()) - ({"router_jitter_noise"} if cfg.model_type in SAMPLED_ROUTES else set())
        for key, value in sorted(vars(cfg).items()):
            if isinstance(value, PretrainedConfig):
                walk(value, f"{prefix}{key}.")
            dropout = ("dropout" in key or key.endswith("_pdrop")) and not key.startswith("summary_")
            if (dropout or key in jitter) and isinstance(value, float) and value > 0:
                found.append(f"config.{prefix}{key}={value}")

    walk(config, "")
    return found


def batch_dependent(config) -> list[str]:
    """What makes a model's update depend on how its batch is split whatever llmtrain does:
    routers that sample their experts (SAMPLED_ROUTES), and experts with a capacity, which
    drop the tokens routed to them past it (a remote-code model's capacity_factor, say)."""
    found = [why for kind, why in SAMPLED_ROUTES.items() if text_config(config).model_type == kind]
    for key, value in sorted(vars(text_config(config)).items()):
        if "capacity" in key and isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
            found.append(f"config.{key}={value}: experts drop the tokens routed to them past their capacity")
    return found


def saved_weights_bytes(path: str) -> float:
    """The bytes of a local model directory's weight files (its safetensors where it has
    any), about what it takes loaded in the dtype it was saved in; 0 for a hub name."""
    local = Path(path).expanduser()
    if not local.is_dir():
        return 0.0
    files = [f for f in local.iterdir() if f.is_file() and f.name.endswith(WEIGHT_SUFFIXES)]
    safetensors = [f for f in files if f.suffix == ".safetensors"]
    return float(sum(f.stat().st_size for f in safetensors or files))


def kv_cache_bytes(mcfg, width: int, tokens: int) -> float:
    """Generation's KV cache: keys and values per layer for `tokens` tokens of `width` bytes."""
    mcfg = text_config(mcfg)  # a vision-language model's text layers
    heads = getattr(mcfg, "num_key_value_heads", None) or mcfg.num_attention_heads
    head_dim = getattr(mcfg, "head_dim", None) or mcfg.hidden_size // mcfg.num_attention_heads
    return float(2 * mcfg.num_hidden_layers * heads * head_dim * width * tokens)
