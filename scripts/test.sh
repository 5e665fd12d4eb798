#!/usr/bin/env bash
# Run the test suite (real FUSE mounts against a local SeaweedFS S3 endpoint; needs root or
# a user allowed to use /dev/fuse). Extra arguments go to pytest, e.g. scripts/test.sh -k mount.
# scripts/test.sh --quick: the quick tier for the edit loop (every module's unit tests, one real mount).
#
# The tests run in EPOCHFS_TEST_WORKERS processes (default 2; -n 0 on the command line runs them in this
# one), a test module per process at a time: the mounts wait on the kernel, the endpoint and their
# deadlines far more than they use the CPU. Tests that drop the page cache or count on it are marked
# page_cache and run one at a time (tests/helpers.py).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
.venv/bin/ruff check src tests benchmarks scripts
exec .venv/bin/python -m pytest -n "${EPOCHFS_TEST_WORKERS:-2}" --dist loadfile "$@"
