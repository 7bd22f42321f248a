#!/usr/bin/env bash
# Builds bench/gpu/prefill_probe.cu on this (CPU) machine with nvcc, one binary per
# variant, into probe/ (ignored; carry it to the GPU machine). No torch needed.
#   bash bench/gpu/build_probe.sh [name:"-DFLAG ..."] ...     (no argument: the base build)
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p probe
variants=("$@")
[ ${#variants[@]} -eq 0 ] && variants=("base:")
pids=()
for v in "${variants[@]}"; do
  name=${v%%:*}
  flags=${v#*:}
  # shellcheck disable=SC2086
  nvcc -O3 --use_fast_math -lineinfo -std=c++17 -gencode arch=compute_90a,code=sm_90a \
    -Icuda -Icpp -Icpp/include -Xcompiler -static-libstdc++ -DK25_PROBE_VARIANT="\"$name\"" $flags \
    -o "probe/prefill_probe_$name" bench/gpu/prefill_probe.cu cuda/prefill_attention.cu \
    cuda/prefill_attention_sm90.cu cpp/ops/attention_plan.cpp &
  pids+=($!)
done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=1; done
ls -la probe
exit $rc
