#!/usr/bin/env bash
# MLPerf Storage's engine, DLIO (dlio-benchmark 2.0.0), in a virtualenv of its own beside the project's
# (benchmarks/dlio/dlio.py runs it). dlio-benchmark declares GPU-only dependencies (DALI for CUDA,
# torchaudio, torchvision) and TensorFlow that its PyTorch npz workloads never import: it is installed
# without its dependencies, with the ones it imports by name. PyTorch (CPU) and numpy come from the
# project's virtualenv (a .pth file points there: one copy, the versions pyproject.toml pins); MPI from
# the mpich wheel. Optional: the test suite does not need it.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(dirname "$(dirname "$here")")"
venv="$(dirname "$here")/work/.venv-dlio"
[ -x "$root/.venv/bin/python" ] || { echo "dlio-setup: run EPOCHFS_TORCH=1 bash scripts/bootstrap.sh first" >&2; exit 1; }
"$root/.venv/bin/python" -c 'import torch' 2>/dev/null || {
  echo "dlio-setup: the project's virtualenv has no PyTorch (DLIO's workloads read through it): run" \
       "EPOCHFS_TORCH=1 bash scripts/bootstrap.sh first (a few minutes, a few GB)" >&2; exit 1; }
base="$("$root/.venv/bin/python" -c 'import sys; print(sys.base_prefix)')"
"$base/bin/python3" -m venv "$venv"
site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
"$root/.venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' > "$site/epochfs-venv.pth"
# Its imports first, then DLIO itself without its declared dependencies: installed the other way round,
# pip's resolver checked the later installs against DLIO's declarations and printed every GPU package
# it declares and this does not install as an ERROR, though nothing failed.
"$venv/bin/pip" install -q "mpi4py==4.1.2" "mpich==5.0.2" "hydra-core==1.3.8" "omegaconf==2.3.1" "h5py==3.16.0" \
    "pandas==3.1.1" "pydftracer==1.0.2" "psutil==7.2.2" "pillow==13.0.0"
"$venv/bin/pip" install -q --no-deps "dlio-benchmark==2.0.0"
"$venv/bin/python" -c 'import torch, mpi4py, hydra, dlio_benchmark; print("dlio-setup: DLIO", dlio_benchmark.__file__)'
