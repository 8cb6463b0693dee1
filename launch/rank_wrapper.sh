#!/bin/bash
# Runs one trainer rank (under srun, or under torchrun --no-python) and records its exit code, so the
# job script can say which rank failed and why: srun alone reports 143 for the whole step once
# --kill-on-bad-exit has terminated the other ranks, hiding the failing rank's own code.
#   usage: rank_wrapper.sh RC_DIR COMMAND [ARGS...]
set -u
rc_dir=$1
shift
# torch.distributed's env:// variables; torchrun sets them itself, srun only has SLURM_*.
export RANK=${RANK:-$SLURM_PROCID}
export WORLD_SIZE=${WORLD_SIZE:-$SLURM_NTASKS}
export LOCAL_RANK=${LOCAL_RANK:-$SLURM_LOCALID}
export LOCAL_WORLD_SIZE=${LOCAL_WORLD_SIZE:-${SLURM_NTASKS_PER_NODE:-1}}
# SLURM signals every process of the step, the rank included. A no-op trap keeps this wrapper alive
# until the rank has exited (bash runs it only after the foreground child returns), and, unlike an
# ignored signal, is not inherited by the rank, whose own SIGTERM handler writes the checkpoint.
trap 'true' TERM INT
"$@"
rc=$?
# "exit-code end-time": the job script blames the rank that failed first, not the ones whose
# collectives broke because of it. The time is bash's own clock, read before anything else runs:
# a `date` subprocess here costs milliseconds, which under load can let a peer whose collective broke
# because of this rank (it sees the closed socket at this rank's exit) record an earlier time.
ts=$EPOCHREALTIME
mkdir -p "$rc_dir" && echo "$rc $ts" >"$rc_dir/rank-$RANK"
exit "$rc"
