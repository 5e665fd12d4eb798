#!/usr/bin/env bash
# Slurm Epilog (slurm.conf: Epilog=/etc/slurm/epilog.d/epochfs.sh): after a job, unmount each dataset
# the prolog mounted for it once no other job on the node uses it (the cache stays on disk, warm for
# the next mount). Only a mount the prolog started is stopped: one the administrator runs (started
# before any job asked for it) is never. EPOCHFS_SLURM_KEEP=1 (in slurm.conf's environment) keeps the
# prolog's mounts up too.
set -euo pipefail
run="${EPOCHFS_SLURM_RUN:-/run/epochfs/slurm}"
job="${SLURM_JOB_ID:?SLURM_JOB_ID is not set: run as the Slurm Epilog}"
[[ "$job" =~ ^[0-9_]+$ ]] || { echo "epochfs epilog: odd SLURM_JOB_ID '$job'" >&2; exit 1; }
[ -d "$run" ] || exit 0
status=0
for dir in "$run"/*/; do
  [ -e "$dir$job" ] || continue
  name="$(basename "$dir")"
  (
    flock 9
    rm -f "$dir$job"
    if [ -z "$(find "$dir" -maxdepth 1 -name '[0-9]*' -print -quit)" ] && [ -e "$dir.started" ] \
        && [ "${EPOCHFS_SLURM_KEEP:-0}" != 1 ]; then
      systemctl stop "epochfs@$name.service"  # unmounts once the readers are gone (the unit waits)
      rm -f "$dir.started"
    fi
  ) 9>"$run/$name.lock" || status=1
done
exit "$status"
