#!/usr/bin/env bash
# Mutation checks on the GPU machine, after run_all.sh has built the tree: each patch of
# bench/gpu/mutations/ named here is applied, the extension rebuilt (incrementally), the
# tests that should catch it run, and the patch reverted. A mutation that passes is reported.
#   bash bench/gpu/mutation_check.sh "pytest args" name [name ...]
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/k25-out}
args=$1
shift
for name in "$@"; do
  p=bench/gpu/mutations/$name.patch
  git apply "$p" 2>/dev/null || patch -s -p1 < "$p" || { echo "mutation $name: does not apply"; continue; }
  K25_CUDA=on K25_BUILD_JOBS=$(nproc) K25_CUDA_ARCHS=90a \
    python3 -m pip install --no-build-isolation --no-deps -e . > "$OUT/mutation_build.log" 2>&1
  b=$?
  # shellcheck disable=SC2086
  python3 -m pytest -q -p no:cacheprovider $args > "$OUT/mutation_$name.log" 2>&1
  t=$?
  git apply -R "$p" 2>/dev/null || patch -s -R -p1 < "$p"
  if [ $b -ne 0 ]; then echo "mutation $name: build failed"; elif [ $t -eq 0 ]; then
    echo "mutation $name: NOT caught (tests passed)"; else
    echo "mutation $name: caught"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/mutation_$name.log" | tail -6; fi
done
# Back to the tree as it is.
K25_CUDA=on K25_BUILD_JOBS=$(nproc) K25_CUDA_ARCHS=90a \
  python3 -m pip install --no-build-isolation --no-deps -e . > "$OUT/mutation_build.log" 2>&1
