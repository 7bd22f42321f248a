#!/usr/bin/env bash
# Same-call A/B of kernel variant patches (bench/gpu/variants/) against the tree, on one machine
# and one build of everything else. After run_all.sh's build:
#   K25_SKIP_TESTS=1 K25_EXTRA="bash bench/gpu/ab_variant.sh bench/gpu/variants/X.patch [Y.patch ...]" \
#     bash bench/gpu/run_all.sh
# Runs the benchmark on the tree, then for each patch: apply, rebuild, run the benchmark, revert;
# the tree is rebuilt as it was at the end. A patch that does not apply or build is reported and
# skipped. K25_AB_BENCH (a shell command) replaces the default benchmark: sparse_attention_bench,
# then profile_select's per-kernel times alone (K25_PDL=0). K25_AB_TESTS (pytest paths) also runs
# those tests with each patch. K25_AB_BUILD replaces the rebuild command.
set -uo pipefail
cd "$(dirname "$0")/../.."
BENCH=${K25_AB_BENCH:-"python3 bench/gpu/sparse_attention_bench.py; K25_PDL=0 python3 bench/gpu/profile_select.py --brief"}
BUILD=${K25_AB_BUILD:-"K25_CUDA=on K25_BUILD_JOBS=$(nproc) K25_CUDA_ARCHS=90a python3 -m pip install -q --no-build-isolation --no-deps -e ."}
rebuild() {
  local t0=$(date +%s)
  if ! bash -c "$BUILD" > /tmp/ab_build.log 2>&1; then
    grep -E "error" /tmp/ab_build.log | head -20
    return 1
  fi
  echo "(rebuilt in $(( $(date +%s) - t0 )) s)"
}
echo "=== tree ($(git rev-parse --short HEAD 2>/dev/null || echo ?))"
bash -c "$BENCH"
for p in "$@"; do
  echo "=== $p"
  if ! patch -p1 --dry-run -s < "$p" > /dev/null; then
    echo "does not apply: skipped"
    continue
  fi
  patch -p1 -s < "$p"
  if rebuild; then
    [ -n "${K25_AB_TESTS:-}" ] && python3 -m pytest -q -x -p no:cacheprovider ${K25_AB_TESTS} 2>&1 | tail -3
    bash -c "$BENCH"
  else
    echo "build failed: skipped"
  fi
  patch -p1 -R -s < "$p"
done
if [ $# -gt 0 ]; then
  echo "=== tree again"
  rebuild || echo "the tree's rebuild failed"
fi
