#!/usr/bin/env bash
# Device check (benchmarks/device_check.py): the trainer on this host's accelerator,
# deferred vs per-microbatch gradient reduction, written to benchmarks/results/device_check.md.
# On CPU with --cpu (or when JAX finds no accelerator). Runs from a copy of the tree with
# nothing installed and no network: packages/*/src go on PYTHONPATH; PYTHON picks the interpreter.
set -euo pipefail
cd "$(dirname "$0")/.."
src=$(printf '%s:' "$PWD"/packages/*/src)
export PYTHONPATH="${src}${PYTHONPATH:-}"
exec "${PYTHON:-python3}" benchmarks/device_check.py "$@"
