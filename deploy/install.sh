#!/usr/bin/env bash
# Install epochfs on a compute node or a cache node (Debian/Ubuntu, as root):
#   bash deploy/install.sh [NAME]               # a GPU node's mount NAME (default: data -> /mnt/data)
#   bash deploy/install.sh --serve NAME         # a cache node of dataset NAME (epochfs serve)
#   bash deploy/install.sh --config-only [--serve] NAME   # only write its config (another instance)
# It installs FUSE 3, a virtualenv in /opt/epochfs, the commands /usr/local/bin/epochfs and
# /sbin/mount.epochfs (for /etc/fstab), the systemd units, the instance's config (/etc/epochfs/NAME.toml,
# or serve-NAME.toml for a cache node) and its cache directory. Each instance gets its own metrics port
# (9567 for the first, the next free one after that).
set -euo pipefail
cd "$(dirname "$0")/.."
config_only=0 serve=0
while [ $# -gt 0 ]; do
  case "$1" in
    --config-only) config_only=1; shift ;;
    --serve) serve=1; shift ;;
    -*) echo "install.sh: unknown option $1 (--config-only, --serve)" >&2; exit 2 ;;
    *) break ;;
  esac
done
name="${1:-data}"
[[ "$name" =~ ^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$ ]] || { echo "install.sh: '$name' is not an instance name" >&2; exit 2; }
etc="${EPOCHFS_ETC:-/etc/epochfs}"
if [ "$serve" = 1 ]; then
  config="$etc/serve-$name.toml" template=deploy/epochfs-serve.example.toml unit="epochfs-serve@$name"
else
  config="$etc/$name.toml" template=deploy/epochfs.example.toml unit="epochfs@$name"
fi

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

if [ "$config_only" = 1 ]; then
  write_config
  exit 0
fi
[ "$(id -u)" -eq 0 ] || { echo "install.sh: run as root" >&2; exit 1; }

DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
  fuse3 python3-venv >/dev/null
python3 -m venv /opt/epochfs/venv
/opt/epochfs/venv/bin/pip install -q --upgrade pip
/opt/epochfs/venv/bin/pip install -q .
install -m 0644 README.md /opt/epochfs/README.md
ln -sf /opt/epochfs/venv/bin/epochfs /usr/local/bin/epochfs
ln -sf /opt/epochfs/venv/bin/mount.epochfs /sbin/mount.epochfs

write_config
install -d -m 0700 /var/cache/epochfs
if [ "$serve" = 1 ]; then
  install -d -m 0700 "/var/cache/epochfs/serve-$name"
else
  install -d -m 0700 "/var/cache/epochfs/$name"
  install -d -m 0755 "/mnt/$name"
fi
install -m 0644 deploy/systemd/epochfs@.service /etc/systemd/system/epochfs@.service
install -m 0644 deploy/systemd/epochfs-serve@.service /etc/systemd/system/epochfs-serve@.service
if [ -d /run/systemd/system ]; then
  systemctl daemon-reload
  echo "install.sh: start with: systemctl enable --now $unit"
fi
