"""Third-party log lines (and warnings) known to be harmless in llmtrain's runs, dropped at the logger that
emits them, and only those lines: they came on every process or every checkpoint and buried
the run's own lines. Anything else those libraries log still shows.

Off a terminal (a log file, a pipe, a Slurm job's output) the libraries' progress bars are
turned off too (`quiet_bars_off_terminal`): each redraw is a frame written into the log."""

from __future__ import annotations

import logging
import os
import sys
import warnings

KNOWN_HARMLESS = {
    # DeepSpeed, on each process of a machine without a GPU: its CPU accelerator is what
    # llmtrain runs DeepSpeed on there (README, "DeepSpeed on CPU").
    "DeepSpeed": "Setting accelerator to CPU. If you have GPU",
    # Accelerate's save_state for a model whose output layer is its input embedding: the
    # second name of the tied weight is left out of the file and tied again on load (every
    # resume test reloads such checkpoints to bit-identical weights).
    "accelerate.utils.other": "Removed shared tensor {",
    # bitsandbytes, at import (peft imports it in every run, quantized or not), on CPUs with
    # AVX512-BF16: it looks for an optional kernel package from the hub, which llmtrain
    # never downloads, and uses its own CPU kernels instead.
    "bitsandbytes.backends.cpu.ops": "Failed to load CPU gemm_4bit_forward from kernels-community",
}


# Python warnings known to be harmless, dropped by the start of their text. transformers 5
# renamed gradient checkpointing to activation checkpointing and warns on the old names,
# which peft still reads on every get_peft_model (is_gradient_checkpointing) and calls in
# prepare_model_for_kbit_training; llmtrain calls the old name too, which transformers
# 4.56 (the oldest it supports) has alone. Every LoRA run printed them, in words meant for
# those libraries' authors.
KNOWN_HARMLESS_WARNINGS = (r"`(is_)?gradient_checkpointing(_enable)?` is deprecated",)


class DropLine(logging.Filter):
    """Drops the records whose message holds `text` (Accelerate puts '[RANK n] ' first)."""

    def __init__(self, text: str):
        super().__init__()
        self.text = text

    def filter(self, record: logging.LogRecord) -> bool:
        return self.text not in record.getMessage()


def quiet_known_noise() -> None:
    """Install the filters (once; the loggers need not exist yet: a library that creates
    its logger later gets the same object, filters included)."""
    for text in KNOWN_HARMLESS_WARNINGS:
        warnings.filterwarnings("ignore", message=text, category=FutureWarning)
    for name, text in KNOWN_HARMLESS.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, DropLine) and f.text == text for f in logger.filters):
            logger.addFilter(DropLine(text))


def quiet_bars_off_terminal() -> None:
    """Where stderr is no terminal, turn off the libraries' progress bars: datasets' (reading,
    tokenizing, filtering), transformers' (loading and saving weights) and the hub's
    (downloads). In a log each redraw is a frame of its own, hundreds per data set; llmtrain's
    own lines say what each stage did (rows kept and dropped, steps), and its training bar
    becomes a line now and then (observe/console.progress). A variable the user set decides
    instead: HF_DATASETS_DISABLE_PROGRESS_BARS=0, HF_HUB_DISABLE_PROGRESS_BARS=0 keep them.
    Called by the recipes and `llmtrain plan` at start (not at import: a notebook, whose
    stderr is no terminal either, draws its bars as widgets)."""
    if sys.stderr.isatty():
        return
    # A library not loaded yet reads its variable when it loads (and a child process, the
    # demo's SFT build, inherits it); one loaded already is told directly. Importing them
    # here instead would add a second or more to every command that stops early.
    if "HF_DATASETS_DISABLE_PROGRESS_BARS" not in os.environ:
        if "datasets" in sys.modules:
            sys.modules["datasets"].disable_progress_bars()
        else:
            os.environ["HF_DATASETS_DISABLE_PROGRESS_BARS"] = "1"
    if "HF_HUB_DISABLE_PROGRESS_BARS" not in os.environ:
        if "transformers" in sys.modules or "huggingface_hub" in sys.modules:
            from huggingface_hub.utils import disable_progress_bars

            disable_progress_bars()
            if "transformers" in sys.modules:
                from transformers.utils import logging as transformers_logging

                transformers_logging.disable_progress_bar()
        else:
            os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"  # transformers' bars follow the hub's
