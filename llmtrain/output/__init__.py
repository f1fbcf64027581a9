"""Everything a run writes under output_dir: rundir.py (taking the directory, where a
run starts), checkpoint.py (a checkpoint's life) and export.py (final/), all through
llmtrain/safefs.py (no write through a link llmtrain did not make)."""
