"""Tests of llmtrain/data/: rows, prepared splits, chat templates, kinds, packing, mixing, streaming."""
