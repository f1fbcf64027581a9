"""Recipes launched as users launch them (python, accelerate launch with the shipped configs,
Slurm): one process against many, every backend, resume after a kill. Every test marked slow
is here, in a file named for what it exercises (test_rundir.py launches against a run
directory, tests/output/test_rundir.py tests the module alone)."""
