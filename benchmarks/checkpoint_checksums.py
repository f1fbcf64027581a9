"""What the checkpoint checksums cost: a checkpoint of about 1 GB (model and AdamW
state) written through Accelerate, then its manifest (sizes and CRC-32 of every file)
computed as `checkpoint.save` does right after writing, then verified as a resume does
(`checkpoint.content_damage`), on one process.

    python benchmarks/checkpoint_checksums.py [--gib 1.0]
"""

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import torch
from accelerate import Accelerator

from llmtrain.output.checkpoint import STATE_FILE, content_damage, manifest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=1.0, help="checkpoint size (weights + 2 AdamW moments)")
    args = parser.parse_args()
    accelerator = Accelerator(cpu=True)
    width = int((args.gib * 2**30 / 12) ** 0.5)  # fp32 weights and two moments: 12 bytes a parameter
    model = torch.nn.Linear(width, width, bias=False)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, width)).sum().backward()
    optimizer.step()
    model, optimizer = accelerator.prepare(model, optimizer)
    out = Path(tempfile.mkdtemp(prefix="llmtrain-ckpt-"))
    try:
        start = time.perf_counter()
        accelerator.save_state(str(out))
        write = time.perf_counter() - start
        size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
        start = time.perf_counter()
        files = manifest(out)
        hashing = time.perf_counter() - start
        (out / STATE_FILE).write_text(json.dumps({"files": files}))
        start = time.perf_counter()
        assert content_damage(out) == []
        verify = time.perf_counter() - start
    finally:
        shutil.rmtree(out, ignore_errors=True)
    gib = size / 2**30
    print(
        f"checkpoint of {gib:.2f} GiB in {len(files)} files: save_state {write:.2f} s; checksums after writing "
        f"{hashing:.2f} s ({hashing / write:.0%} of the write, {gib / hashing:.2f} GiB/s); verifying before a "
        f"resume {verify:.2f} s"
    )


if __name__ == "__main__":
    main()
