#!/usr/bin/env bash
# Trains the small GPT twice, in separate processes -- with PyTorch's own CUDA
# allocator, then with libwasmem_capi.so as a CUDAPluggableAllocator -- and
# checks that the losses are bitwise equal step for step. Prints a table and
# a summary; results, logs, the wasmem trace and summary.json go to --out
# (default: a new temporary directory).
#
#   examples/pytorch/run.sh [--out DIR] [--steps N] [--policy SPEC] [--lib PATH] [--rtol X] [--no-swap]
#
# Python: $PYTHON, else /opt/torch/.venv/bin/python3, else python3.
# Exit status: 0 the losses match; 1 they differ; 2 a run failed;
# 3 no PyTorch, no CUDA, or no libwasmem_capi.so.
set -u
HERE=$(cd "$(dirname "$0")" && pwd)
PY=${PYTHON:-}
if [ -z "$PY" ]; then
    if [ -x /opt/torch/.venv/bin/python3 ]; then PY=/opt/torch/.venv/bin/python3; else PY=python3; fi
fi
exec "$PY" "$HERE/train.py" --compare "$@"
