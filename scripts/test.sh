#!/usr/bin/env bash
# Run the test suite (real FUSE mounts against a local SeaweedFS S3 endpoint; needs root or
# a user allowed to use /dev/fuse). Extra arguments go to pytest, e.g. scripts/test.sh -k mount.
# scripts/test.sh --quick: the quick tier for the edit loop (every module's unit tests, one real mount).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
.venv/bin/ruff check src tests benchmarks scripts
exec .venv/bin/python -m pytest "$@"
