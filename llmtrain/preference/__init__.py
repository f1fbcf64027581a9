"""Preference tuning: pairs.py (the three pair shapes, packing whole pairs,
PairCollator), loss.py (the DPO/IPO/SimPO objective) and reference.py (the reference
log-probs, one distributed pass, cached)."""
