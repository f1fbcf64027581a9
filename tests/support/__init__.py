"""What the tests share besides fixtures (those are in tests/conftest.py): runs.py launches
recipes and reads their run directories, data.py holds shared rows and datasets, links.py a
planted link's target, accelerate_config.py answers `accelerate config`'s questionnaire;
architectures.py builds the tiny model zoo. Scripts the tests start by path: forkserver.py
(the suite's commands, forked from one process that imported the stack), arch_runs.py and
error_runs.py (many runs or error cases in one process), slurm_cluster.py (a local two-node
Slurm cluster)."""
