"""Tests of llmtrain/data/: sources, rows, chat templates, packing, mixing, streaming, files."""
