#!/usr/bin/env bash
# Slurm Prolog (slurm.conf: Prolog=/etc/slurm/prolog.d/epochfs.sh, PrologFlags=Alloc): mount the
# datasets a job asks for on each node allocated to it, before the job starts.
#
# A job names them in its comment:   sbatch --comment "epochfs=imagenet,coco" train.sh
# Each NAME is an instance of the systemd unit epochfs@NAME (its config: /etc/epochfs/NAME.toml, made
# with `deploy/install.sh --config-only NAME`); it mounts at the config's mountpoint. The prolog starts
# the unit (it returns once the mount answers: Type=notify) and records the job's use of it, so the
# epilog unmounts only after the last job on the node that uses it ends. A dataset that cannot be
# mounted fails the prolog: Slurm requeues the job and drains the node, with the reason in the log
# (journalctl -u epochfs@NAME).
set -euo pipefail
etc="${EPOCHFS_ETC:-/etc/epochfs}"
run="${EPOCHFS_SLURM_RUN:-/run/epochfs/slurm}"
job="${SLURM_JOB_ID:?SLURM_JOB_ID is not set: run as the Slurm Prolog}"
[[ "$job" =~ ^[0-9_]+$ ]] || { echo "epochfs prolog: odd SLURM_JOB_ID '$job'" >&2; exit 1; }

comment="${SLURM_JOB_COMMENT-}"
if [ -z "$comment" ] && command -v scontrol >/dev/null; then
  comment="$(scontrol show job "$job" 2>/dev/null | sed -n 's/^ *Comment=\(.*\)$/\1/p' | head -n 1)"
fi
names=()
for word in $comment; do
  case "$word" in
    epochfs=*) IFS=, read -r -a more <<<"${word#epochfs=}"; names+=("${more[@]}") ;;
  esac
done
[ "${#names[@]}" -gt 0 ] || exit 0  # the job asks for no dataset

install -d -m 0755 "$run"
for name in "${names[@]}"; do
  if ! [[ "$name" =~ ^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$ ]]; then
    echo "epochfs prolog: job $job asks for '$name', not a dataset name (letters, digits, _.-)" >&2
    exit 1
  fi
  if [ ! -f "$etc/$name.toml" ]; then
    echo "epochfs prolog: job $job asks for dataset '$name', which this node does not have ($etc/$name.toml)" >&2
    exit 1
  fi
  (
    flock 9  # (two jobs starting on the node at once)
    install -d -m 0755 "$run/$name"
    touch "$run/$name/$job"
    if ! systemctl start "epochfs@$name.service"; then
      rm -f "$run/$name/$job"
      echo "epochfs prolog: dataset '$name' did not mount for job $job (journalctl -u epochfs@$name)" >&2
      exit 1
    fi
  ) 9>"$run/$name.lock"
done
