"""Tests of llmtrain/output/: the run directory, checkpoints, the export."""
