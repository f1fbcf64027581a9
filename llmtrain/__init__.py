"""llmtrain: fine-tune causal language models with Hugging Face Accelerate."""

from .observe.quiet import quiet_known_noise

__version__ = "0.1.0"

quiet_known_noise()  # before any library that logs them is imported
