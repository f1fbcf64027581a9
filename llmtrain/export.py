"""Export the trained model to final/ in the Hugging Face layout, and sample from it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from accelerate.utils import DistributedType

from .checkpoint import STATE_FILE, CheckpointError, complete_checkpoints, publish, write_failed
from .model import is_quantized, whole_models


def save_final(accelerator, model, tokenizer, output_dir: str, config_yaml: str, merge_lora: bool, state: dict) -> Path:
    """final/: safetensors weights, config and tokenizer (with its chat template), the
    run's config (llmtrain_config.yaml) and the TrainState it was exported at
    (train_state.json, which marks the run finished).

    LoRA runs write the adapter to final/, or with merge_lora the merged model to final/
    and the adapter to final/adapter/. Written beside and renamed into place."""
    final, tmp = Path(output_dir) / "final", Path(output_dir) / ".tmp-final"
    state_dict = accelerator.get_state_dict(model)  # gathers sharded weights; all ranks take part
    if accelerator.is_main_process:
        try:
            _write(accelerator, model, tokenizer, state_dict, tmp, config_yaml, merge_lora, state)
        except Exception as e:
            if not write_failed(e):
                raise
            shutil.rmtree(tmp, ignore_errors=True)
            found = complete_checkpoints(output_dir)
            kept = "no checkpoint was written (checkpoint.every_steps=0)"
            if found:
                kept = f"the newest checkpoint, {found[-1][1]}, is intact: free space and run the same command again"
            raise CheckpointError(f"export: writing {tmp} failed ({write_failed(e)}); {kept}") from None
        publish(tmp, final)
    accelerator.wait_for_everyone()
    return final


def _write(accelerator, model, tokenizer, state_dict, tmp: Path, config_yaml: str, merge_lora: bool, state: dict):
    """Everything final/ holds, into `tmp` (main process)."""
    shutil.rmtree(tmp, ignore_errors=True)
    unwrapped = accelerator.unwrap_model(model)
    drop_tied_copies(unwrapped, state_dict)
    is_lora = hasattr(unwrapped, "peft_config")
    if is_lora and merge_lora:
        unwrapped.save_pretrained(tmp / "adapter", state_dict=state_dict, safe_serialization=True)
        # A sharded or quantized training copy cannot be merged in place: the base weights
        # are loaded again, whole and in their own dtype, with the adapter folded in.
        merged = (
            _merged_from_adapter(accelerator, unwrapped, tmp / "adapter")
            if is_sharded(accelerator) or is_quantized(unwrapped)
            else _merged_copy(unwrapped)
        )
        merged.save_pretrained(tmp, safe_serialization=True)
    else:
        unwrapped.save_pretrained(tmp, state_dict=state_dict, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    (tmp / "llmtrain_config.yaml").write_text(config_yaml)
    (tmp / STATE_FILE).write_text(json.dumps(state, indent=2))


def drop_tied_copies(model, state_dict: dict) -> None:
    """Remove the second name of each tied weight (lm_head of a model whose output layer
    is its input embedding). A gathered state dict holds separate copies, which would be
    saved twice; transformers ties them again on load."""
    first: dict[int, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first:
            state_dict.pop(name, None)
        else:
            first[id(param)] = name


def is_sharded(accelerator) -> bool:
    """Whether each process holds only a shard of the weights (ZeRO-3 or FSDP)."""
    kind = accelerator.distributed_type
    return kind == DistributedType.FSDP or (
        kind == DistributedType.DEEPSPEED and accelerator.state.deepspeed_plugin.zero_stage == 3
    )


def model_for_sampling(accelerator, model, final: Path):
    """The trained model on the main process: the in-memory one, or, when it is sharded
    across processes (generation on one rank would wait for the others forever), the
    exported final/ loaded back."""
    if not is_sharded(accelerator):
        return accelerator.unwrap_model(model)
    from transformers import AutoModelForCausalLM

    with whole_models():
        return AutoModelForCausalLM.from_pretrained(final).to(accelerator.device)


def _merged_from_adapter(accelerator, peft_model, adapter_dir: Path):
    """Merged model when the training copy is only a shard: the base weights loaded again
    with the adapter just saved folded in."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    with whole_models():
        base = AutoModelForCausalLM.from_pretrained(peft_model.peft_config["default"].base_model_name_or_path)
        return PeftModel.from_pretrained(base, adapter_dir).merge_and_unload()


def _merged_copy(peft_model):
    """The base model with the LoRA update folded in, leaving the training model as it was."""
    import copy

    return copy.deepcopy(peft_model).merge_and_unload()


@torch.no_grad()
def sample(model, tokenizer, prompts: list[str], max_new_tokens: int, chat_template: str | None) -> list[str]:
    """Greedy answers to user messages, through the chat template when there is one.
    Runs on one process with a whole model: generate must not wait on the other ranks."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    answers = []
    for prompt in prompts:
        if chat_template or tokenizer.chat_template:
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}],
                chat_template=chat_template,
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
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
        )
        answers.append(tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True).strip())
    model.train(was_training)
    return answers
