#!/usr/bin/env bash
# Install epochfs on a compute node or a cache node (Debian/Ubuntu, as root):
#   bash deploy/install.sh [NAME]               # a GPU node's mount NAME (default: data -> /mnt/data)
#   bash deploy/install.sh --serve NAME         # a cache node of dataset NAME (epochfs serve)
#   bash deploy/install.sh --config-only [--serve] NAME   # only write its config (another instance)
#   ... --secrets DIR ...                        # also install the cluster's secrets made once in DIR
#                                                  (peer-token, redis-password: the same files on every node)
#   bash deploy/install.sh --render-units DIR   # only write the systemd units, with this install's paths, to DIR
#                                                  (`systemd-analyze verify DIR/*.service` before installing)
# It installs FUSE 3, a virtualenv in $EPOCHFS_PREFIX (/opt/epochfs), the commands $EPOCHFS_BINDIR/epochfs
# (/usr/local/bin) and /sbin/mount.epochfs (for /etc/fstab), the job's client ($EPOCHFS_PREFIX/client: the
# wheel, and python/ for PYTHONPATH), the systemd units, the instance's config ($EPOCHFS_ETC/NAME.toml,
# /etc/epochfs, or serve-NAME.toml for a cache node) and its cache directory. Each instance gets its own
# metrics port (9567 for the first, the next free one after that).
set -euo pipefail
config_only=0 serve=0 secrets="" units=""
prefix="${EPOCHFS_PREFIX:-/opt/epochfs}"
bindir="${EPOCHFS_BINDIR:-/usr/local/bin}"
while [ $# -gt 0 ]; do
  case "$1" in
    --render-units)
      [ $# -ge 2 ] || { echo "install.sh: --render-units DIR: give the directory to write the units to" >&2; exit 2; }
      units="$2"; shift 2 ;;
    --config-only) config_only=1; shift ;;
    --serve) serve=1; shift ;;
    --secrets)
      [ $# -ge 2 ] && [ -d "$2" ] || { echo "install.sh: --secrets DIR: give the directory the cluster's secrets were made in" >&2; exit 2; }
      secrets="$(cd "$2" && pwd)"; shift 2 ;;
    -*) echo "install.sh: unknown option $1 (--config-only, --serve, --secrets DIR, --render-units DIR)" >&2; exit 2 ;;
    *) break ;;
  esac
done
cd "$(dirname "$0")/.."
name="${1:-data}"
[[ "$name" =~ ^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$ ]] || { echo "install.sh: '$name' is not an instance name" >&2; exit 2; }
etc="${EPOCHFS_ETC:-/etc/epochfs}"
if [ "$serve" = 1 ]; then
  config="$etc/serve-$name.toml" template=deploy/epochfs-serve.example.toml unit="epochfs-serve@$name"
else
  config="$etc/$name.toml" template=deploy/epochfs.example.toml unit="epochfs@$name"
fi

# The systemd units with this install's paths (the files in deploy/systemd name the defaults).
render_units() {
  install -d -m 0755 "$1"
  local u
  for u in epochfs@.service epochfs-serve@.service; do
    sed -e "s#/usr/local/bin/epochfs#$bindir/epochfs#g; s#/etc/epochfs/#$etc/#g; s#/opt/epochfs/#$prefix/#g" \
      "deploy/systemd/$u" > "$1/$u"
    chmod 0644 "$1/$u"
  done
}

write_config() {
  install -d -m 0755 "$etc"
  if [ -e "$config" ]; then
    echo "install.sh: $config exists; left as it is"
    return
  fi
  local port=9567
  while grep -qs "^metrics_addr = \"127.0.0.1:$port\"" "$etc"/*.toml; do port=$((port + 1)); done
  sed -e "s#/mnt/data#/mnt/$name#; s#/var/cache/epochfs/data#/var/cache/epochfs/$name#" \
      -e "s#/var/cache/epochfs/serve-NAME#/var/cache/epochfs/serve-$name#" \
      -e "s#^\(\# \)\{0,1\}metrics_addr = \"127.0.0.1:9567\"#metrics_addr = \"127.0.0.1:$port\"#" \
    "$template" > "$config"
  chmod 0644 "$config"
  if [ "$serve" = 1 ]; then
    echo "install.sh: wrote $config (metrics on 127.0.0.1:$port) -- set source, meta, peer_listen (this machine's" \
         "address), the password and token files, cache_size and replicas before starting"
  else
    echo "install.sh: wrote $config (metrics on 127.0.0.1:$port) -- edit source and endpoint_url before starting"
  fi
}

# The cluster's secrets, made once and copied to every node: installed as root's, mode 0600. A node that
# already holds a different one is not overwritten (its peers would refuse one or the other): said, and
# left for the operator to remove.
install_secrets() {
  [ -n "$secrets" ] || return 0
  install -d -m 0755 "$etc"
  local found=0 f
  for f in peer-token redis-password; do
    [ -f "$secrets/$f" ] || continue
    found=1
    [ -s "$secrets/$f" ] || { echo "install.sh: $secrets/$f is empty" >&2; exit 1; }
    if [ -e "$etc/$f" ]; then
      if cmp -s "$secrets/$f" "$etc/$f"; then continue; fi
      echo "install.sh: $etc/$f exists and differs from $secrets/$f: this node holds another secret (the" \
           "cluster's members would refuse one or the other); remove $etc/$f if $secrets/$f is the cluster's" >&2
      exit 1
    fi
    install -m 0600 "$secrets/$f" "$etc/$f"
    echo "install.sh: installed $etc/$f (mode 0600)"
  done
  [ "$found" = 1 ] || { echo "install.sh: --secrets $secrets holds neither peer-token nor redis-password" >&2; exit 1; }
}

if [ -n "$units" ]; then
  render_units "$units"
  echo "install.sh: wrote the units to $units (verify: systemd-analyze verify $units/*.service)"
  exit 0
fi
if [ "$config_only" = 1 ]; then
  install_secrets
  write_config
  exit 0
fi
[ "$(id -u)" -eq 0 ] || { echo "install.sh: run as root" >&2; exit 1; }

DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
  fuse3 python3-venv >/dev/null
python3 -m venv "$prefix/venv"
"$prefix/venv/bin/pip" install -q --upgrade pip
"$prefix/venv/bin/pip" install -q .
install -m 0644 README.md "$prefix/README.md"
# The job's client: the wheel (pip install --no-deps it in a training image) and the same unpacked, for
# PYTHONPATH: it needs only Python's standard library.
rm -rf "$prefix/client"
"$prefix/venv/bin/pip" wheel -q --no-deps --wheel-dir "$prefix/client" .
"$prefix/venv/bin/pip" install -q --no-deps --no-index --target "$prefix/client/python" "$prefix"/client/epochfs-*.whl
chmod -R a+rX "$prefix/client"
install -d -m 0755 "$bindir"
ln -sf "$prefix/venv/bin/epochfs" "$bindir/epochfs"
ln -sf "$prefix/venv/bin/mount.epochfs" /sbin/mount.epochfs

install_secrets
write_config
install -d -m 0700 /var/cache/epochfs
if [ "$serve" = 1 ]; then
  install -d -m 0700 "/var/cache/epochfs/serve-$name"
else
  install -d -m 0700 "/var/cache/epochfs/$name"
  install -d -m 0755 "/mnt/$name"
fi
render_units /etc/systemd/system
if [ -d /run/systemd/system ]; then
  systemctl daemon-reload
  echo "install.sh: start with: systemctl enable --now $unit"
fi
