#!/usr/bin/env bash
# Slurm Prolog (slurm.conf: Prolog=/etc/slurm/prolog.d/epochfs.sh, PrologFlags=Alloc): mount the
# datasets a job asks for on each node allocated to it, before the job starts.
#
# A job names them in its comment:   sbatch --comment "epochfs=imagenet,coco" train.sh
# Each NAME is an instance of the systemd unit epochfs@NAME (its config: /etc/epochfs/NAME.toml, made
# with `deploy/install.sh --config-only NAME`); it mounts at the config's mountpoint. The prolog starts
# the unit (it returns once the mount answers: Type=notify) and records the job's use of it, so the
# epilog unmounts only after the last job on the node that uses it ends, and only a mount the prolog
# started itself: one the administrator keeps running (systemctl enable --now epochfs@NAME) is theirs.
#
# What a job asks for never fails the prolog (a failed prolog drains the node, and a job's comment is
# anyone's): a name that is not one, a dataset the node does not have, or one the job may not ask for
# is skipped with the reason (in slurmd's log), and the job runs without it. Which datasets a job may
# ask for: /etc/epochfs/slurm-datasets, a line per dataset, `NAME` (any job) or `NAME USER @GROUP ...`
# (jobs of those users and groups); without that file, any dataset configured on the node. A dataset
# the job may have that does not mount fails the prolog: the node cannot serve it (journalctl -u
# epochfs@NAME), and Slurm requeues the job and drains the node.
set -euo pipefail
set -f  # no pathname expansion anywhere: a job's comment is anyone's, and this runs as root
etc="${EPOCHFS_ETC:-/etc/epochfs}"
run="${EPOCHFS_SLURM_RUN:-/run/epochfs/slurm}"
job="${SLURM_JOB_ID:?SLURM_JOB_ID is not set: run as the Slurm Prolog}"
[[ "$job" =~ ^[0-9_]+$ ]] || { echo "epochfs prolog: odd SLURM_JOB_ID '$job'" >&2; exit 1; }
user="${SLURM_JOB_USER-}"

comment="${SLURM_JOB_COMMENT-}"
if [ -z "$comment" ] && command -v scontrol >/dev/null; then
  comment="$(scontrol show job "$job" 2>/dev/null | sed -n 's/^ *Comment=\(.*\)$/\1/p' | head -n 1)" || comment=""
fi
comment="${comment:0:4096}"  # (a comment is the job's: bounded before anything reads it)
comment="${comment//$'\n'/ }"
names=()
# Split into words as data (read -a: no pathname expansion, no other expansion), then the epochfs= ones.
read -r -a words <<<"$comment" || true
for word in "${words[@]}"; do
  case "$word" in
    epochfs=*) IFS=, read -r -a more <<<"${word#epochfs=}" || true; names+=("${more[@]}") ;;
  esac
  [ "${#names[@]}" -le 64 ] || break  # (what is taken is bounded below; no more work for the rest)
done
[ "${#names[@]}" -gt 0 ] || exit 0  # the job asks for no dataset
[ "${#names[@]}" -le 32 ] || { echo "epochfs prolog: job $job asks for ${#names[@]} datasets; the first 32 are taken" >&2
                               names=("${names[@]:0:32}"); }

skip() { echo "epochfs prolog: job $job: $*; it runs without it" >&2; }

# Whether the job's user may ask for dataset $1 (the administrator's list, where there is one).
allowed() {
  local list="$etc/slurm-datasets" name="$1" entry who groups w whos
  [ -f "$list" ] || return 0
  groups=" $(id -Gn "$user" 2>/dev/null || true) "
  while read -r entry who || [ -n "$entry" ]; do
    [ "$entry" = "$name" ] || continue
    [ -n "$who" ] || return 0  # any job
    read -r -a whos <<<"$who" || true
    for w in "${whos[@]}"; do
      case "$w" in
        @*) [[ "$groups" == *" ${w#@} "* ]] && return 0 ;;
        *) [ -n "$user" ] && [ "$w" = "$user" ] && return 0 ;;
      esac
    done
  done < <(grep -v '^[[:space:]]*\(#\|$\)' "$list")
  return 1
}

install -d -m 0755 "$run"
for name in "${names[@]}"; do
  if ! [[ "$name" =~ ^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$ ]]; then
    skip "'${name:0:80}' is not a dataset name (letters, digits, _.-)"
    continue
  fi
  if [ ! -f "$etc/$name.toml" ]; then
    skip "dataset '$name' is not configured on this node ($etc/$name.toml)"
    continue
  fi
  if ! allowed "$name"; then
    skip "dataset '$name' is not one its user ${user:-?} may ask for ($etc/slurm-datasets)"
    continue
  fi
  (
    flock 9  # (two jobs starting on the node at once)
    install -d -m 0755 "$run/$name"
    if [ -z "$(find "$run/$name" -maxdepth 1 -name '[0-9]*' -print -quit)" ]; then
      # The first job on the node to use it: a mount already running is the administrator's, and stays.
      if systemctl is-active --quiet "epochfs@$name.service"; then
        rm -f "$run/$name/.started"
      else
        touch "$run/$name/.started"
      fi
    fi
    touch "$run/$name/$job"
    if ! systemctl start "epochfs@$name.service"; then
      rm -f "$run/$name/$job"
      [ -n "$(find "$run/$name" -maxdepth 1 -name '[0-9]*' -print -quit)" ] || rm -f "$run/$name/.started"
      echo "epochfs prolog: dataset '$name' did not mount for job $job (journalctl -u epochfs@$name)" >&2
      exit 1
    fi
  ) 9>"$run/$name.lock"
done
exit 0
