#!/usr/bin/env bash
# The shard loaders packed.py compares with, in a virtualenv of their own: Mosaic Streaming 0.13 pins
# xxhash<4 (epochfs pins 4.1) and pulls every cloud SDK; it is installed without them (it imports them
# only for their clouds), with the libraries it does import.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
venv="$(dirname "$here")/work/.venv-loaders"
python3 -m venv "$venv"
"$venv/bin/pip" install -q "torch==2.13.0" "numpy==2.1.3" "xxhash==3.8.2" "zstd==1.5.7.2" "python-snappy==0.7.3" \
    "brotli==1.2.1" "tqdm==4.70.1" "catalogue==2.0.10" "boto3==1.44.8" "PyYAML==6.0.4" "braceexpand==0.1.7" \
    "pillow==13.0.0" "transformers==4.57.6"
"$venv/bin/pip" install -q --no-deps "mosaicml-streaming==0.13.0" "webdataset==1.0.2"
"$venv/bin/python" "$here/loaders.py" check
