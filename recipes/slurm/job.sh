#!/bin/bash
# The body of the llmtrain sbatch templates (single_node.sbatch, multi_node.sbatch source
# it). sbatch starts in the submit directory: submit from the repository root. Arguments
# go to recipes/finetune.py; a first argument naming a recipe script runs that one instead
# (sbatch recipes/slurm/single_node.sbatch recipes/dpo.py --config ...).
#
# Set before sbatch (or with --export=ALL,NAME=value):
#   LLMTRAIN_PROCS_PER_NODE  processes per node (default: the GPUs Slurm gave the node)
#   LLMTRAIN_MAX_RESTARTS    times a node restarts its workers after a rank dies (default 0);
#                            they continue from the newest complete checkpoint
#   LLMTRAIN_MIXED_PRECISION bf16 (default), fp16 or no
#   ACCELERATE_USE_CPU=1     CPU processes over gloo instead of GPUs

set -uo pipefail
recipe=recipes/finetune.py
if [[ "${1:-}" == *.py ]]; then recipe=$1; shift; fi
if [ ! -f "$recipe" ]; then
  echo "llmtrain: error: $recipe: no such recipe script here; give recipes/<name>.py as the first argument" \
    "(or none, for recipes/finetune.py) and submit from the repository root" >&2
  exit 2
fi
# Every start (a requeue, a worker restart) runs the same command and continues from the
# newest complete checkpoint in output_dir: checkpoint.resume as the config file and the
# command line set it, auto by default; a checkpoint given to start from is kept, and its run
# continues from its own newest one. The recipe, which reads both, decides: --restartable
# refuses checkpoint.resume=none, which a restart could not keep.
# A preemption warning before training starts has nothing to checkpoint, but must not kill
# this shell (bash's default for USR1): the job is requeued once the step running ends.
preempted=0
trap 'preempted=1; echo "llmtrain: preemption warning before training; requeueing job $SLURM_JOB_ID"' USR1

# Slurm 22.05 to 23.02 do not pass sbatch's --cpus-per-task on to srun's steps, whose tasks
# would then get one CPU each for data loading and the CPU side of training.
if [ -n "${SLURM_CPUS_PER_TASK:-}" ]; then export SRUN_CPUS_PER_TASK="$SLURM_CPUS_PER_TASK"; fi

# The head node, and its address as Slurm itself knows it (node names need not resolve).
head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
head_addr=$(scontrol show node "$head_node" | grep -oP 'NodeAddr=\K\S+')
port=$((20000 + SLURM_JOB_ID % 20000))
echo "llmtrain: job $SLURM_JOB_ID, start $((${SLURM_RESTART_COUNT:-0} + 1)), $SLURM_JOB_NUM_NODES node(s), head $head_node at $head_addr:$port"

# 1. Tokenize once, on one node, into the datasets cache that every node reads.
srun --nodes=1 --ntasks=1 --nodelist="$head_node" python "$recipe" --prepare-only --restartable "$@" || exit $?
if [ "$preempted" = 1 ]; then
  scontrol requeue "$SLURM_JOB_ID"
  exit 0
fi

# 2. Train: one `accelerate launch` per node. The machine rank and the process count are
#    read inside each task (the single quotes keep this shell from expanding them).
#    The launcher ignores SIGUSR1, so only the training processes act on it: they agree on
#    a step, write a complete checkpoint and exit 0.
# After a rank dies, torchrun's c10d rendezvous restarts every node's workers, but it counts
# the restart only on the failed node; workers that share the agents' store key it by that
# count and would wait for each other forever. A store of their own per round avoids that.
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
on_preempt() {
  preempted=1
  echo "llmtrain: preemption warning; asking the training processes to checkpoint"
  scancel --signal=USR1 "$SLURM_JOB_ID"  # every process of the job's steps, not this shell
}
trap on_preempt USR1
srun --kill-on-bad-exit=1 bash -c '
  procs=${LLMTRAIN_PROCS_PER_NODE:-${SLURM_GPUS_ON_NODE:-1}}
  trap "" USR1
  exec accelerate launch --multi_gpu --same_network --num_machines "$SLURM_NNODES" \
    --machine_rank "$SLURM_NODEID" --num_processes $((SLURM_NNODES * procs)) \
    --main_process_ip "$0" --main_process_port "$1" --rdzv_backend c10d \
    --max_restarts "${LLMTRAIN_MAX_RESTARTS:-0}" --mixed_precision "${LLMTRAIN_MIXED_PRECISION:-bf16}" \
    --dynamo_backend no "${@:2}"
' "$head_addr" "$port" "$recipe" --restartable "$@" &
train=$!
wait "$train"; status=$?
while kill -0 "$train" 2>/dev/null; do wait "$train"; status=$?; done  # the trap cut the wait short
if [ "$preempted" = 1 ]; then
  echo "llmtrain: checkpoint complete; requeueing job $SLURM_JOB_ID to continue"
  scontrol requeue "$SLURM_JOB_ID"
  exit 0
fi
exit "$status"
