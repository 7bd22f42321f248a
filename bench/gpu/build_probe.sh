#!/usr/bin/env bash
# Builds the torch-free kernel probes on this (CPU) machine with nvcc, one binary per probe
# and variant, into probe/ (ignored; carry it to the GPU machine, bench/gpu/probe_run.sh runs
# every binary there). A variant is name:"-DFLAG ..." (compile-time switches in the kernel
# sources under test); no argument: the base build of both probes.
#   bash bench/gpu/build_probe.sh [prefill|decode] [name:"-DFLAG ..."] ...
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p probe
which=(prefill decode)
case "${1:-}" in prefill|decode) which=("$1"); shift ;; esac
variants=("$@")
[ ${#variants[@]} -eq 0 ] && variants=("base:")
declare -A sources=(
  [prefill]="cuda/prefill_attention.cu cuda/prefill_attention_sm90.cu cpp/ops/attention_plan.cpp"
  [decode]="cuda/decode_attention.cu cuda/launch.cu"
)
pids=()
for p in "${which[@]}"; do
  for v in "${variants[@]}"; do
    name=${v%%:*}
    flags=${v#*:}
    # shellcheck disable=SC2086
    nvcc -O3 --use_fast_math -lineinfo -std=c++17 -gencode arch=compute_90a,code=sm_90a \
      -Icuda -Icpp -Icpp/include -Xcompiler -static-libstdc++ -DK25_PROBE_VARIANT="\"$name\"" $flags \
      -o "probe/${p}_probe_$name" "bench/gpu/${p}_probe.cu" ${sources[$p]} &
    pids+=($!)
  done
done
rc=0
for pid in "${pids[@]}"; do wait "$pid" || rc=1; done
ls -la probe
exit $rc
