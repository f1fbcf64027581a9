"""Preference tuning and reward models: method.py (the dpo and reward methods) and config.py
(their config trees); pairs.py (the three pair shapes, packing whole pairs, PairCollator),
loss.py (the DPO/IPO/SimPO/ORPO objective), unpaired.py (KTO's rows and their KL completions)
and kto.py (the KTO objective), reference.py (the reference log-probs, one distributed pass,
cached), reward_model.py (a reward model's score head and Bradley-Terry loss)."""
