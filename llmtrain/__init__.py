"""llmtrain: fine-tune causal language models with Hugging Face Accelerate.

Importing it shortens how long OpenMP's idle threads spin before they sleep
(GOMP_SPINCOUNT=3000, 3,000 pause instructions instead of libgomp's 300,000), in this
process and every process it starts, unless OMP_WAIT_POLICY or GOMP_SPINCOUNT is set already
(the user's choice wins). libgomp is PyTorch's OpenMP on Linux; by default each thread that
waits at the end of a parallel region spins for about 3 ms first, and on cores that other
processes share the spinning threads take the CPU from the one thread every region waits
for: a step of the SFT demo beside two busy processes took 2.4 s with libgomp's spin, 0.72
with the short one, at a cost where the cores are free (8% on the SFT demo's step, more
where generation wakes threads often: docs/speed.md, benchmarks/cpu_load.py). OpenMP reads
the variable when it is loaded, so this runs before torch is imported: the recipes and the
`llmtrain` command import llmtrain first. The threads and what they compute stay the same;
no number a run produces changes.
"""

import os

if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
    os.environ["GOMP_SPINCOUNT"] = "3000"

from .observe.quiet import quiet_known_noise  # noqa: E402 (after the variable, before any library)

__version__ = "0.1.0"

quiet_known_noise()  # before any library that logs them is imported
