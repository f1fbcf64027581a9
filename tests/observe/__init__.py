"""Tests of llmtrain/observe/: throughput, the profiler, quiet imports."""
