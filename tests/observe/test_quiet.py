"""The third-party lines llmtrain drops (llmtrain.quiet) are gone once llmtrain is imported,
and only those: another line from the same logger still shows. Off a terminal, the
libraries' progress bars are off once a recipe or plan starts, unless the user's variable
says otherwise."""

import subprocess
import sys

import pytest

SHARED = """
import torch
{first}
from accelerate import PartialState
PartialState()
from accelerate.utils.other import clean_state_dict_for_safetensors
t = torch.zeros(3)
clean_state_dict_for_safetensors({{"embed": t, "lm_head": t}})
from accelerate.logging import get_logger
get_logger("accelerate.utils.other").warning("another warning")
"""


def output(code: str) -> str:
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout + proc.stderr


@pytest.mark.parametrize("first", ["import llmtrain", ""], ids=["with_llmtrain", "without"])
def test_the_tied_weight_line_of_every_checkpoint_is_dropped(first):
    out = output(SHARED.format(first=first))
    assert ("Removed shared tensor" in out) == (first == "")
    assert "another warning" in out


@pytest.mark.parametrize("first", ["import llmtrain", ""], ids=["with_llmtrain", "without"])
def test_deepspeeds_cpu_accelerator_line_is_dropped(first, monkeypatch):
    pytest.importorskip("deepspeed")
    import torch

    if torch.cuda.is_available():
        pytest.skip("DeepSpeed finds the GPU and says nothing")
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    out = output(f"{first}\nfrom deepspeed.accelerator import get_accelerator\nget_accelerator()")
    assert ("Setting accelerator to CPU" in out) == (first == "")


@pytest.mark.parametrize("first", ["import llmtrain", ""], ids=["with_llmtrain", "without"])
def test_transformers_warnings_about_its_renamed_checkpointing_are_dropped(first):
    """peft reads `is_gradient_checkpointing` on every get_peft_model: every LoRA run said so."""
    code = (
        f"{first}\nfrom transformers import LlamaConfig, LlamaForCausalLM\n"
        "m = LlamaForCausalLM(LlamaConfig(vocab_size=16, hidden_size=8, intermediate_size=8, num_hidden_layers=1, "
        "num_attention_heads=2, num_key_value_heads=2))\n"
        "m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={'use_reentrant': False})\n"
        "m.is_gradient_checkpointing\nimport warnings\nwarnings.warn('another warning', FutureWarning)"
    )
    out = output(code)
    assert ("is deprecated" in out) == (first == "")
    assert "another warning" in out


BARS = """
from llmtrain.observe.quiet import quiet_bars_off_terminal
quiet_bars_off_terminal()
import datasets
datasets.Dataset.from_dict({"a": list(range(10))}).map(lambda row: row, desc="tokenizing rows.jsonl")
from transformers.utils import logging
list(logging.tqdm(range(3), desc="Writing model shards"))
"""


def test_library_progress_bars_are_off_where_stderr_is_no_terminal():
    """In a log file each redraw of a bar is a frame of its own (datasets' map over a data
    set wrote hundreds). HF_DATASETS_DISABLE_PROGRESS_BARS=0 and HF_HUB_DISABLE_PROGRESS_BARS=0
    keep them (not run here: another interpreter start)."""
    out = output(BARS)
    assert "tokenizing rows.jsonl" not in out and "Writing model shards" not in out, out
