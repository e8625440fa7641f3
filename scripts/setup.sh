#!/usr/bin/env bash
# Set up a fresh machine: a virtual environment in .venv with tandem and its test extras.
# torch==2.13.0 is installed first: on the dev/CI machines it comes from local disk as a CPU
# build; a bare `torch` requirement would pull a multi-GB CUDA build instead.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/pip install --quiet --upgrade pip
.venv/bin/pip install --quiet torch==2.13.0
.venv/bin/pip install --quiet -e '.[test]'
