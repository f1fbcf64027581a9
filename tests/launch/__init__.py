"""Recipes launched as users launch them (python, accelerate launch with the shipped configs,
Slurm): one process against many, every backend, resume after a kill."""
