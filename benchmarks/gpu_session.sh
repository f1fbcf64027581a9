#!/usr/bin/env bash
# The GPU checks in one command, for a lent GPU machine that has torch, accelerate,
# transformers and peft but no network: the GPU tests, the padding-mask timing, then the
# benchmarks against TRL at a size that fits a short lease. Wheels for what it lacks come from
# `bash ../shared/gpu/fetch-wheels.sh` (into .whl/, carried along); a copy of the demo models
# (LLMTRAIN_CACHE=$PWD/.gpu-cache, which git ignores) saves their building there. Logs and
# result tables go to $OUT (default ./gpu-out); copy the tables into benchmarks/RESULTS.md by hand.
#   bash benchmarks/gpu_session.sh [pytest args...]
# Each part has a time limit in seconds, and 0 leaves it out: TEST_S, MASK_S, DPO_S, SFT_S,
# GRPO_S, DISTILL_S, AGENTS_S (e.g. TEST_S=0 MASK_S=0 for the benchmarks alone).
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

part() {  # part NAME SECONDS COMMAND...: runs the command under its limit into $OUT/NAME.log
  local name=$1 seconds=$2; shift 2
  [ "$seconds" -gt 0 ] || return 0
  echo "== $name (at most $seconds s)"
  timeout "$seconds" "$@" 2>&1 | tee "$OUT/$name.log"
}
# The GPU tests, several at a time where pytest-xdist is there (they are small; the machine
# has cores to spare: 171 s with six on an H100 before the other recipes' tests came; with
# them, more than 330 s with eight on an H200), each with a limit so the summary prints, and
# each test's result on its own line as it ends, so a run cut short still says which passed.
parallel=(); python3 -c "import xdist" 2>/dev/null && parallel=(-n "${WORKERS:-8}")
part gpu_tests "${TEST_S:-420}" python3 -m pytest -m gpu -v -p no:cacheprovider "${parallel[@]}" --timeout=240 \
  --tb=short -rfEs --durations=20 "$@"
part padding_mask "${MASK_S:-90}" python3 benchmarks/padding_mask.py --workload gpu-1b
# DPO before SFT: SFT's packed run compiles FlexAttention kernels first (about 30 s).
part dpo_bench "${DPO_S:-130}" python3 benchmarks/dpo_vs_trl.py --workload gpu-1b --rows "${DPO_ROWS:-160}" --repeats 1 \
  --systems ${DPO_SYSTEMS:-llmtrain trl-default trl-best} --results "$OUT/RESULTS-gpu.md"
part sft_bench "${SFT_S:-170}" python3 benchmarks/sft_vs_trl.py --workload gpu-125m --rows "${SFT_ROWS:-2000}" --repeats 1 \
  --results "$OUT/RESULTS-gpu.md"
for rl in grpo distill agents; do
  limit=${rl^^}_S
  part "${rl}_bench" "${!limit:-150}" python3 "benchmarks/${rl}_vs_trl.py" --workload gpu --repeats 1 \
    --results "$OUT/RESULTS-gpu.md"
done
