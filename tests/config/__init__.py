"""Tests of llmtrain/config/: loading, overrides, checks, bounds on config files."""
