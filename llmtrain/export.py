"""Export the trained model to final/ in the Hugging Face layout, and sample from it."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from .checkpoint import publish


def save_final(accelerator, model, tokenizer, output_dir: str, config_yaml: str, merge_lora: bool) -> Path:
    """final/: safetensors weights, config and tokenizer (with its chat template).

    LoRA runs write the adapter to final/, or with merge_lora the merged model to final/
    and the adapter to final/adapter/. Written beside and renamed into place."""
    final, tmp = Path(output_dir) / "final", Path(output_dir) / ".tmp-final"
    state_dict = accelerator.get_state_dict(model)  # gathers sharded weights; all ranks take part
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        unwrapped = accelerator.unwrap_model(model)
        is_lora = hasattr(unwrapped, "peft_config")
        if is_lora and merge_lora:
            unwrapped.save_pretrained(tmp / "adapter", state_dict=state_dict, safe_serialization=True)
            merged = _merged_copy(unwrapped)
            merged.save_pretrained(tmp, safe_serialization=True)
        else:
            unwrapped.save_pretrained(tmp, state_dict=state_dict, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        (tmp / "llmtrain_config.yaml").write_text(config_yaml)
        publish(tmp, final)
    accelerator.wait_for_everyone()
    return final


def _merged_copy(peft_model):
    """The base model with the LoRA update folded in, leaving the training model as it was."""
    import copy

    return copy.deepcopy(peft_model).merge_and_unload()


@torch.no_grad()
def sample(model, tokenizer, prompts: list[str], max_new_tokens: int, chat_template: str | None) -> list[str]:
    """Greedy answers to user messages, through the chat template when there is one."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    answers = []
    for prompt in prompts:
        if chat_template or tokenizer.chat_template:
            text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], chat_template=chat_template,
                                                 tokenize=False, add_generation_prompt=True)
            ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"].to(device)
        else:
            ids = tokenizer(prompt, return_tensors="pt")["input_ids"].to(device)
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, eos_token_id=tokenizer.eos_token_id,
                             pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None
                             else tokenizer.eos_token_id)
        answers.append(tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip())
    model.train(was_training)
    return answers
