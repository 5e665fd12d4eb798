#!/usr/bin/env bash
# Set everything up and run the demo: a local S3 endpoint with a sample dataset, mounted with
# epochfs and read twice; prints what each pass cost the backend.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
exec .venv/bin/python scripts/demo.py "$@"
