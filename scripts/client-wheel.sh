#!/usr/bin/env bash
# The job's client as a wheel: epochfs.torch, epochfs.watch, epochfs.Client and the job's commands
# (`epochfs status|doctor|sync|prefetch|warmup|watch`) need nothing outside Python 3.11's standard
# library (epochfs.torch: PyTorch), so the wheel installs into any training image with --no-deps, from
# a file, with no package index:
#
#   bash scripts/client-wheel.sh            # -> dist/epochfs-<version>-py3-none-any.whl
#   pip install --no-deps dist/epochfs-<version>-py3-none-any.whl
#
# The daemon's commands (mount, serve, pack, fsck) need the node's packages: deploy/install.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-dist}
python=.venv/bin/python
[ -x "$python" ] || python=python3
mkdir -p "$out"
had_build=0
[ -e build ] && had_build=1
"$python" -m pip wheel -q --no-deps --wheel-dir "$out" . >/dev/null
[ "$had_build" = 1 ] || rm -rf build  # (setuptools' work directory, left in the checkout)
version=$(sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
wheel="$out/epochfs-$version-py3-none-any.whl"
[ -f "$wheel" ] || { echo "client-wheel.sh: no $wheel was built" >&2; exit 1; }
echo "$wheel"
echo "install it where the job runs: pip install --no-deps $wheel" >&2
