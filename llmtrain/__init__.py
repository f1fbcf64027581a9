"""llmtrain: fine-tune causal language models with Hugging Face Accelerate."""

__version__ = "0.1.0"
