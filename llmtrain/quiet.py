"""Third-party log lines known to be harmless in llmtrain's runs, dropped at the logger that
emits them, and only those lines: they came on every process or every checkpoint and buried
the run's own lines. Anything else those libraries log still shows."""

from __future__ import annotations

import logging

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
    for name, text in KNOWN_HARMLESS.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, DropLine) and f.text == text for f in logger.filters):
            logger.addFilter(DropLine(text))
