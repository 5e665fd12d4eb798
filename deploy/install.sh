#!/usr/bin/env bash
# Install epochfs on a compute node (Debian/Ubuntu, as root):
#   bash deploy/install.sh [NAME]        # NAME of the instance (default: data -> /mnt/data)
#   bash deploy/install.sh --config-only NAME   # only write /etc/epochfs/NAME.toml (another mount)
# It installs FUSE 3, a virtualenv in /opt/epochfs, the commands /usr/local/bin/epochfs and
# /sbin/mount.epochfs (for /etc/fstab), the systemd unit, an instance config and the cache directory.
# Each instance gets its own metrics port (9567 for the first, the next free one after that).
set -euo pipefail
cd "$(dirname "$0")/.."
config_only=0
if [ "${1:-}" = "--config-only" ]; then
  config_only=1
  shift
fi
name="${1:-data}"
etc="${EPOCHFS_ETC:-/etc/epochfs}"

write_config() {
  install -d -m 0755 "$etc"
  if [ -e "$etc/$name.toml" ]; then
    echo "install.sh: $etc/$name.toml exists; left as it is"
    return
  fi
  local port=9567
  while grep -qs "^metrics_addr = \"127.0.0.1:$port\"" "$etc"/*.toml; do port=$((port + 1)); done
  sed -e "s#/mnt/data#/mnt/$name#; s#/var/cache/epochfs/data#/var/cache/epochfs/$name#" \
      -e "s#^\# metrics_addr = \"127.0.0.1:9567\"#metrics_addr = \"127.0.0.1:$port\"#" \
    deploy/epochfs.example.toml > "$etc/$name.toml"
  chmod 0644 "$etc/$name.toml"
  echo "install.sh: wrote $etc/$name.toml (metrics on 127.0.0.1:$port) -- edit source and endpoint_url before starting"
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
install -d -m 0700 /var/cache/epochfs "/var/cache/epochfs/$name"
install -d -m 0755 "/mnt/$name"
install -m 0644 deploy/systemd/epochfs@.service /etc/systemd/system/epochfs@.service
if [ -d /run/systemd/system ]; then
  systemctl daemon-reload
  echo "install.sh: start with: systemctl enable --now epochfs@$name"
fi
