#!/usr/bin/env bash
# Every GPU measurement in one run: a thin wrapper of benchmarks/gpu_checks.py, whose docstring says what each step
# measures and what it writes. From the repository root of any checkout:
#
#   bash benchmarks/gpu_checks.sh all                 # every step, <= 9.5 min on an H200; results in $OUT (./gpu_checks)
#   bash benchmarks/gpu_checks.sh loss tests          # some steps (`--list` names them, with their time limits)
#   bash benchmarks/gpu_checks.sh all --dry-run       # tiny sizes on the CPU
#
# Packages the GPU machine lacks come from .gpu_wheels/ when it is there (`python benchmarks/gpu_checks.py
# --fetch-wheels .gpu_wheels` where PyPI is reachable), else from PyPI.
set -u
cd "$(dirname "$0")/.."
exec "${PYTHON:-python3}" benchmarks/gpu_checks.py "$@"
