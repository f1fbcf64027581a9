"""Watching a run: metrics.py (metrics.jsonl, trackers, the loss plot),
throughput.py (tokens/s, FLOPs, MFU), profiler.py (torch.profiler steps) and quiet.py
(library noise silenced at import)."""
