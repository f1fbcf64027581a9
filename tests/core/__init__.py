"""Tests of llmtrain/core/: the step, the per-step agreement, objectives, the optimizer, skips."""
