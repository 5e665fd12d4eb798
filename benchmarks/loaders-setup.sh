#!/usr/bin/env bash
# The shard loaders packed.py compares with, in a virtualenv of their own: Mosaic Streaming 0.13 pins
# xxhash<4 (epochfs pins 4.1) and pulls every cloud SDK; it is installed without them (it imports them
# only for their clouds), with the libraries it does import.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
venv="$here/work/.venv-loaders"
python3 -m venv "$venv"
"$venv/bin/pip" install -q "torch==2.13.0" "numpy<2.2" "xxhash<4" zstd python-snappy brotli tqdm catalogue \
    boto3 pyyaml braceexpand pillow "transformers<5"
"$venv/bin/pip" install -q --no-deps "mosaicml-streaming==0.13.0" "webdataset==1.0.2"
(cd "$here" && "$venv/bin/python" -c "import loaders; loaders._without_torchvision(); import streaming, webdataset; print('loaders ready')")
