#!/usr/bin/env bash
# Install epochfs on a compute node (Debian/Ubuntu, as root):
#   bash deploy/install.sh [NAME]        # NAME of the first instance (default: data -> /mnt/data)
# It installs FUSE 3, a virtualenv in /opt/epochfs, the commands /usr/local/bin/epochfs and
# /sbin/mount.epochfs (for /etc/fstab), the systemd unit, an example config and the cache directory.
set -euo pipefail
cd "$(dirname "$0")/.."
name="${1:-data}"
[ "$(id -u)" -eq 0 ] || { echo "install.sh: run as root" >&2; exit 1; }

DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
  fuse3 libfuse3-dev pkg-config gcc python3-venv python3-dev >/dev/null
python3 -m venv /opt/epochfs/venv
/opt/epochfs/venv/bin/pip install -q --upgrade pip
/opt/epochfs/venv/bin/pip install -q .
install -m 0644 README.md /opt/epochfs/README.md
ln -sf /opt/epochfs/venv/bin/epochfs /usr/local/bin/epochfs
ln -sf /opt/epochfs/venv/bin/mount.epochfs /sbin/mount.epochfs

install -d -m 0755 /etc/epochfs
if [ ! -e "/etc/epochfs/$name.toml" ]; then
  sed -e "s#/mnt/data#/mnt/$name#; s#/var/cache/epochfs/data#/var/cache/epochfs/$name#" \
    deploy/epochfs.example.toml > "/etc/epochfs/$name.toml"
  chmod 0644 "/etc/epochfs/$name.toml"
  echo "install.sh: wrote /etc/epochfs/$name.toml -- edit source and endpoint_url before starting"
fi
install -d -m 0700 /var/cache/epochfs "/var/cache/epochfs/$name"
install -d -m 0755 "/mnt/$name"
install -m 0644 deploy/systemd/epochfs@.service /etc/systemd/system/epochfs@.service
if [ -d /run/systemd/system ]; then
  systemctl daemon-reload
  echo "install.sh: start with: systemctl enable --now epochfs@$name"
fi
