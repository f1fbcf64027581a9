"""Export the trained model to final/ in the Hugging Face layout, and sample from it."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import torch

from .. import safefs
from ..data.rows import end_of_turn_ids, stop_ids
from ..distributed.topology import Topology
from ..model import auto_class, head_kwargs, hub_kwargs, is_quantized, whole_models
from ..processor import processor_of, save_processor
from . import card
from .checkpoint import STATE_FILE, WriteFailed, complete_checkpoints, publish, write_failed


def save_final(
    accelerator, model, tokenizer, output_dir: str, config_yaml: str, export, state: dict, base=None, facts=None
) -> Path:
    """final/: safetensors weights (shards of at most export.max_shard_size with an index
    when bigger), config and tokenizer (with its chat template), the run's config
    (llmtrain_config.yaml) and the TrainState it was exported at (train_state.json, which
    marks the run finished). Every process calls it.

    LoRA runs write the adapter to final/, or with export.merge_lora the merged model to
    final/ and the adapter to final/adapter/; `base` (the run's ModelConfig) says how the
    base weights were loaded, for a merge that must load them again. With `facts` (the
    main process's card.CardFacts) the model card, README.md, and its loss curve. Written beside and
    renamed into place; a failed write (a full disk) is one WriteFailed on every
    process."""
    final, tmp = Path(output_dir) / "final", Path(output_dir) / ".tmp-final"
    error = None
    if accelerator.is_main_process:
        try:
            safefs.fresh_dir(tmp)  # leftovers removed: save_pretrained writes into a directory made here
        except OSError as e:  # a full disk already: every process hears of it before any gather
            error = write_failed(e)
    error = main_process_error(accelerator, error)
    if error is None:
        try:
            unwrapped = accelerator.unwrap_model(model)
            error = _write(accelerator, unwrapped, tokenizer, tmp, config_yaml, export, state, base)
            if error is None and facts is not None:
                card.write(tmp, facts, output_dir, local_paths(output_dir, base))
        except Exception as e:
            if not write_failed(e):
                raise
            error = write_failed(e)
        error = main_process_error(accelerator, error)
    if error:
        if accelerator.is_main_process:
            safefs.rmtree(tmp)
        found = complete_checkpoints(output_dir)
        kept = "no checkpoint holds the run (checkpoint.every_steps, checkpoint.every_minutes)"
        if found:
            kept = f"the newest checkpoint, {found[-1][1]}, is intact: free space and run the same command again"
        raise WriteFailed(f"export: writing {tmp} failed ({error}); {kept}", error, Path(output_dir))
    if accelerator.is_main_process:
        publish(tmp, final)
    accelerator.wait_for_everyone()
    return final


def local_paths(output_dir: str, base) -> list[str]:
    """Folders a public file (the model card) must not name: the run's, its base model's
    (when local), the home directory and the working directory."""
    found = [str(Path(output_dir).resolve()), str(Path.home()), os.getcwd()]
    if base is not None and Path(base.name_or_path).expanduser().exists():
        found.append(str(Path(base.name_or_path).expanduser().resolve().parent))
    return [p for p in found if p not in ("/", "")]


def _write(accelerator, model, tokenizer, tmp: Path, config_yaml: str, export, state: dict, base) -> str | None:
    """Everything final/ holds, into `tmp`; the main process writes. Returns what failed
    when writing a weight shard failed. Past the gathers, nothing here is a collective, so
    a write that raises on the main process cannot leave the others waiting in one."""
    main, topology = accelerator.is_main_process, Topology.of(accelerator)
    whole = topology.sharded or topology.half_engine  # written weight by weight, gathered (and from float32 masters)
    list_end_of_turn(model, tokenizer)
    merge = export.merge_lora is True  # "auto" is resolved by the recipe's Config; alone it is the adapter
    if hasattr(model, "peft_config"):
        # The adapter is small: when the model is sharded only its trainable weights are
        # gathered (peft's save keeps the adapter's names from them), not the base's.
        adapter = gathered_trainable(model, main) if whole else None
        for config in model.peft_config.values():  # a local base by its absolute path: final/ loads from anywhere
            if config.base_model_name_or_path and (local := Path(config.base_model_name_or_path).expanduser()).is_dir():
                config.base_model_name_or_path = str(local.resolve())
        if main:
            model.save_pretrained(tmp / "adapter" if merge else tmp, state_dict=adapter)
            # peft writes a model card of its own, naming the base by its local path: final/
            # has llmtrain's (card.write); the adapter's folder needs none.
            (tmp / "adapter" / "README.md").unlink(missing_ok=True)
        if main and merge:
            # A sharded, half-precision (DeepSpeed's) or quantized training copy cannot be
            # merged in place: the base weights are loaded again, whole and in their own
            # dtype, with the adapter folded in.
            merged = (
                _merged_from_adapter(model, tmp / "adapter", base)
                if whole or is_quantized(model)
                else _merged_copy(model)
            )
            list_end_of_turn(merged, tokenizer)  # loaded again: its base's own generation config
            merged.save_pretrained(tmp, max_shard_size=export.shard_bytes())
    elif whole:
        error = write_weights(accelerator, model, tmp, export.shard_bytes())
        if error:
            return error
        if main:
            write_model_config(model, tmp, torch.float32 if topology.half_engine else model.dtype)
    elif main:
        model.save_pretrained(tmp, max_shard_size=export.shard_bytes())
    if main:
        with_cache(tmp / "config.json", base)
        if processor_of(tokenizer) is not None:  # a vision-language model: its processor, which holds the tokenizer
            save_processor(processor_of(tokenizer), tmp)
        else:
            tokenizer.save_pretrained(tmp)
        (tmp / "llmtrain_config.yaml").write_text(config_yaml)
        (tmp / STATE_FILE).write_text(json.dumps(state, indent=2))
    return None


def with_cache(config_json: Path, base) -> None:
    """Training turns the model's key-value cache off (model.load_model); final/ keeps the
    base's own setting (on, for nearly every model), with which a forward pass for
    inference returns its cache."""
    if not config_json.is_file():  # an adapter alone: its base's config stands
        return
    from transformers import AutoConfig

    wanted = True  # inference's default, where the base cannot be read again here
    if base is not None:
        with contextlib.suppress(Exception):
            wanted = getattr(AutoConfig.from_pretrained(base.name_or_path, **hub_kwargs(base)), "use_cache", True)
    config = json.loads(config_json.read_text())
    if config.get("use_cache") != wanted:
        config["use_cache"] = wanted
        config_json.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def main_process_error(accelerator, error: str | None) -> str | None:
    """The main process's `error` (what failed, or None), on every process."""
    from accelerate.utils import broadcast_object_list

    return broadcast_object_list([error])[0]


def write_weights(accelerator, model, directory: Path, max_shard_size: int) -> str | None:
    """The model's weights into `directory` as save_pretrained lays them out
    (model.safetensors, or model-0000k-of-0000n.safetensors with
    model.safetensors.index.json), from a model sharded over the processes, which all call
    this. Returns what failed if a write failed, else None.

    Written here because save_pretrained and Accelerate's get_state_dict/save_model gather
    the whole state dict onto the main process before writing the first shard, which
    needs CPU memory for the whole model there. Here the shards are planned from the
    weights' shapes alone (the Hub's own split), then each shard is gathered weight by
    weight, written and freed: the main process holds one shard at a time."""
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file
    from transformers.core_model_loading import revert_weight_conversion
    from transformers.utils import SAFE_WEIGHTS_INDEX_NAME

    main = accelerator.is_main_process
    weights = saved_weights(model)
    shapes = {name: torch.empty(full_shape(t), dtype=t.dtype, device="meta") for name, t in weights.items()}
    plan = split_torch_state_dict_into_shards(shapes, max_shard_size=max_shard_size)
    weight_map = {}
    for filename, names in plan.filename_to_tensors.items():
        shard = {name: gathered(weights[name], main) for name in names}
        error = None
        if main:
            try:
                # As save_pretrained does: names and layouts as the checkpoint had them
                # (a no-op for most models), one shard at a time as for offloaded models.
                shard = revert_weight_conversion(model, shard)
                directory.mkdir(parents=True, exist_ok=True)
                save_file(shard, directory / filename, metadata={"format": "pt"})
                weight_map.update(dict.fromkeys(shard, filename))
            except Exception as e:
                if not write_failed(e):
                    raise
                error = write_failed(e)
        del shard
        release_freed_memory()
        if error := main_process_error(accelerator, error):
            return error
    if main and plan.is_sharded:
        params = {name for name, _ in model.named_parameters(remove_duplicate=False)}
        total = sum(shapes[name].numel() for name in shapes if name in params)
        index = {"metadata": {"total_parameters": total, **plan.metadata}, "weight_map": weight_map}
        (directory / SAFE_WEIGHTS_INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return None


def release_freed_memory() -> None:
    """Give the memory of the shard just written back to the system. glibc's allocator
    keeps freed blocks below its mmap threshold (which rises to 32 MB as big blocks are
    freed) for reuse, so gathering weight after weight of varied sizes would otherwise
    leave every process's resident set growing shard after shard (measured on CPU under
    ZeRO-3, gathering each weight of a 1 GB model once: +0.3 to +0.5 GB kept, none with
    this). Where the C library is not glibc there is nothing to call."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def saved_weights(model) -> dict:
    """The tensors save_pretrained writes, by name, as this process holds them (a shard
    under FSDP2 or ZeRO-3): the state dict's entries, as parameters and buffers, less the
    second name of tied weights and the keys the model says not to save."""
    # state_dict() first: FSDP2's hook on it registers the sharded parameters again where
    # a forward without backward (the last evaluation) left the root's gathered ones.
    state = model.state_dict()
    held = dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers(remove_duplicate=False))
    weights = {name: held.get(name, tensor) for name, tensor in state.items()}
    drop_tied_copies(model, weights)
    for name in getattr(model, "_keys_to_ignore_on_save", None) or []:
        weights.pop(name, None)
    return weights


def full_shape(tensor) -> tuple:
    """The shape of the whole tensor this process may hold a shard of."""
    return tuple(getattr(tensor, "ds_shape", tensor.shape))  # ZeRO-3 keeps it in ds_shape


def gathered(tensor, main: bool):
    """The whole of `tensor` on CPU on the main process, None on the others. A collective
    for a shard (FSDP2's DTensor, a ZeRO-3 parameter) and for a DeepSpeed weight with a
    float32 master: every process calls it. DeepSpeed trains in bf16/fp16 on half-precision
    weights, and its optimizer keeps the float32 masters that were trained: those are
    written (as one process's, DDP's or FSDP2's float32 weights are)."""
    from torch.distributed.tensor import DTensor

    if hasattr(tensor, "ds_id") or hasattr(tensor, "_hp_mapping"):  # a DeepSpeed-managed weight
        from deepspeed.utils import safe_get_full_fp32_param

        master = safe_get_full_fp32_param(tensor)  # None for a frozen weight, which has none
        if master is not None:
            return master.detach().to("cpu", copy=True) if main else None
    if isinstance(tensor, DTensor):
        tensor = tensor.full_tensor()
    elif hasattr(tensor, "ds_id"):
        import deepspeed

        with deepspeed.zero.GatheredParameters([tensor]):  # partitioned again on leaving
            return tensor.data.to("cpu", copy=True) if main else None
    return tensor.detach().cpu() if main else None


def gathered_trainable(model, main: bool) -> dict | None:
    """The trainable weights (a LoRA adapter) gathered whole on the main process."""
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    weights = {name: gathered(t, main) for name, t in saved_weights(model).items() if name in trainable}
    return weights if main else None


def write_model_config(model, directory: Path, dtype: torch.dtype) -> None:
    """config.json and generation_config.json as save_pretrained writes them beside the
    weights (called without it, since it would gather the whole state dict); `dtype`: the
    weights' as written."""
    config = model.config
    config.architectures = [type(model).__name__.removeprefix("FSDP")]  # FSDP2 subclasses the model
    config.dtype = str(dtype).removeprefix("torch.")
    config.save_pretrained(directory)
    if model.can_generate():
        model.generation_config.save_pretrained(directory)


def drop_tied_copies(model, state_dict: dict) -> None:
    """Remove the second name of each tied weight (lm_head of a model whose output layer
    is its input embedding), which would be saved twice; transformers ties them again on
    load."""
    first: dict[int, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first:
            state_dict.pop(name, None)
        else:
            first[id(param)] = name


def model_for_sampling(accelerator, model, final: Path, base):
    """The trained model on the main process: the in-memory one, or, when it is sharded
    across processes (generation on one rank would wait for the others forever), the
    exported final/ loaded back (an adapter onto the base loaded as training loaded it)."""
    if not Topology.of(accelerator).sharded:
        return accelerator.unwrap_model(model)
    from transformers import AutoConfig

    with whole_models():
        if (final / "adapter_config.json").is_file():
            from peft import PeftModel

            return PeftModel.from_pretrained(_base_again(base), final).to(accelerator.device)
        kw = {"trust_remote_code": base.trust_remote_code}  # final/ holds the model's code, if it has its own
        cls = auto_class(base, AutoConfig.from_pretrained(final, **kw))
        return cls.from_pretrained(final, **kw).to(accelerator.device)


def _base_again(base):
    """The base model's weights loaded again, whole, from where and as training loaded them
    (model.revision, model.trust_remote_code), in their own saved dtype and unquantized."""
    from transformers import AutoConfig

    cls = auto_class(base, AutoConfig.from_pretrained(base.name_or_path, **hub_kwargs(base)))
    return cls.from_pretrained(base.name_or_path, **hub_kwargs(base), **head_kwargs(base))


def _merged_from_adapter(peft_model, adapter_dir: Path, base):
    """Merged model when the training copy is only a shard, or quantized: the base weights
    loaded again with the adapter just saved folded in."""
    from peft import PeftModel

    with whole_models():
        merged = _merge(PeftModel.from_pretrained(_base_again(base), adapter_dir))
    merged.config.pad_token_id = peft_model.config.pad_token_id  # set for training (a reward model pools by it)
    return merged


def _merged_copy(peft_model):
    """The base model with the LoRA update folded in, leaving the training model as it was."""
    import copy

    return _merge(copy.deepcopy(peft_model))


def _merge(peft_model):
    """peft's merge_and_unload, after giving each adapted layer a weight of its own where it
    shares one (tied input and output embeddings: Qwen, Gemma, Llama 3.2 and others). peft
    folds the update into the shared tensor, so an adapter on lm_head would change the input
    embeddings too, and one on embed_tokens the output layer. Untied, the merged model keeps
    both weights, and its config says so, so loading it does not tie them again."""
    from peft.tuners.lora import LoraLayer

    base = peft_model.get_base_model()
    ends = (base.get_input_embeddings(), base.get_output_embeddings())
    # Only the embeddings' tie: other sharing (a block used twice) is the model's own.
    tied = ends[0].weight if None not in ends and ends[0].weight is ends[1].weight else None
    untied = False
    for module in peft_model.modules():
        if tied is not None and isinstance(module, LoraLayer) and getattr(module.base_layer, "weight", None) is tied:
            module.base_layer.weight = torch.nn.Parameter(tied.detach().clone(), requires_grad=False)
            untied = True
    merged = peft_model.merge_and_unload()
    if untied:
        for config in {id(c): c for c in (merged.config, merged.config.get_text_config())}.values():
            config.tie_word_embeddings = False
    return merged


@torch.no_grad()
def sample(model, tokenizer, prompts: list[str], max_new_tokens: int) -> list[str]:
    """Greedy answers to user messages, through the chat template when there is one.
    Runs on one process with a whole model: generate must not wait on the other ranks."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    answers = []
    for prompt in prompts:
        if tokenizer.chat_template:
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}],
                tokenize=False,
                add_generation_prompt=True,
            )
            ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"].to(device)
        else:
            ids = tokenizer(prompt, return_tensors="pt")["input_ids"].to(device)
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            synced_gpus=False,
            eos_token_id=stop_ids(model.generation_config, tokenizer),
            pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
        )
        answers.append(tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True).strip())
    model.train(was_training)
    return answers


def list_end_of_turn(model, tokenizer) -> None:
    """Add the chat template's end of turn to the generation config final/ is saved with
    (beside its end of sequence), so that `generate` on it stops after one answer, as
    TRL does when it gives a model a template."""
    config = getattr(model, "generation_config", None)
    if config is None:
        return
    eos = config.eos_token_id
    listed = [i for i in (eos if isinstance(eos, (list, tuple)) else [eos]) if i is not None]
    missing = [i for i in end_of_turn_ids(tokenizer) if i not in listed]
    if missing:
        config.eos_token_id = [*listed, *missing]
