#!/usr/bin/env bash
# The GPU checks in one command, for a lent GPU machine that has torch, accelerate,
# transformers and peft but no network: the GPU tests, the padding-mask timing, then the DPO
# and SFT benchmarks at a size that fits a short lease. Wheels for what it lacks come from
# `bash ../shared/gpu/fetch-wheels.sh` (into .whl/, carried along). Logs and result tables
# go to $OUT (default ./gpu-out); copy the tables into benchmarks/RESULTS.md by hand.
#   bash benchmarks/gpu_session.sh [pytest args...]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=$PWD:/tmp/site
fi
nvidia-smi -L | tee "$OUT/device.txt"
python3 -c "import torch, transformers, accelerate, peft, datasets, trl; print('torch', torch.__version__, 'transformers', transformers.__version__, 'accelerate', accelerate.__version__, 'peft', peft.__version__, 'trl', trl.__version__)" | tee -a "$OUT/device.txt"
# The GPU tests, several at a time where pytest-xdist is there (they are small; the machine
# has cores to spare: 171 s with six on an H100), each with a limit so the summary prints.
parallel=(); python3 -c "import xdist" 2>/dev/null && parallel=(-n "${WORKERS:-6}")
timeout "${TEST_S:-240}" python3 -m pytest -m gpu -q -p no:cacheprovider "${parallel[@]}" --timeout=200 --tb=short \
  -rfEs --durations=20 "$@" 2>&1 | tee "$OUT/gpu_tests.log"
timeout "${MASK_S:-90}" python3 benchmarks/padding_mask.py --workload gpu-1b 2>&1 | tee "$OUT/padding_mask.log"
# DPO before SFT: SFT's packed run compiles FlexAttention kernels first (about 30 s).
# DPO_SYSTEMS=... and SFT_S=0 fit the checks to a shorter lease.
timeout "${DPO_S:-130}" python3 benchmarks/dpo_vs_trl.py --workload gpu-1b --rows "${DPO_ROWS:-160}" --repeats 1 \
  --systems ${DPO_SYSTEMS:-llmtrain trl-default trl-best} --results "$OUT/RESULTS-gpu.md" 2>&1 | tee "$OUT/dpo_bench.log"
[ "${SFT_S:-170}" -gt 0 ] && timeout "${SFT_S:-170}" python3 benchmarks/sft_vs_trl.py --workload gpu-125m \
  --rows "${SFT_ROWS:-2000}" --repeats 1 --results "$OUT/RESULTS-gpu.md" 2>&1 | tee "$OUT/sft_bench.log"
