"""Distillation (recipes/distill.py): a student learns a frozen teacher's distribution.

config.py (the distill section and its tree) -> loss.py (the divergences per token:
generalized JSD over the vocabulary, GKD's; the sampled-token reverse KL of on-policy
distillation) -> onpolicy.py (the rows whose answers the student samples itself, seeded per
row) -> method.py (the method: the teacher, checked and loaded; the objective; the source).
"""
