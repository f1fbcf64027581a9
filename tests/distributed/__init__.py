"""Tests of llmtrain/distributed/: launch checks, backends, stop signals, the watchdog."""
