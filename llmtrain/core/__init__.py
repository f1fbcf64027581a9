"""The training core, below the loop (llmtrain/train.py): method.py (what a method declares:
Method, Parts), source.py (Batches, the loop's data source; LoaderBatches for prepared data),
finetune.py (the finetune method), state.py (where a run stands, what a step's outcome is),
window.py (the per-step agreement across processes), step.py (one optimizer step),
objective.py (what a step minimises; router.py adds the MoE router loss), logps.py (the label
log-probs the preference and RL losses read), optim.py, spike.py and evaluate.py."""
