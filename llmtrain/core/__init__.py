"""The training core, below the loop (llmtrain/train.py): state.py (where a run
stands, what a step's outcome is), window.py (the per-step agreement across processes),
step.py (one optimizer step), objective.py (what a step minimises; router.py adds the
MoE router loss), optim.py, spike.py and evaluate.py."""
