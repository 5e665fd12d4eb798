#!/usr/bin/env bash
# Regenerate deploy/epochfs.example.toml from the mount options (epochfs.daemon.config.Config's fields).
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/python -c 'from epochfs.cli.options import example_config; print(example_config(), end="")' \
  > deploy/epochfs.example.toml
