#!/usr/bin/env bash
# Builds the torch-free kernel probes on this (CPU) machine with nvcc, one binary per probe
# and variant, into probe/ (ignored; carry it to the GPU machine, bench/gpu/probe_run.sh runs
# every binary there). A variant is name:"-DFLAG ..." or name@a.patch,b.patch:"-DFLAG ...":
# the patches (bench/gpu/variants/, against the tree's root) are applied to a copy of cuda/
# and cpp/, so an experiment is carried as a reviewable diff without touching the kernels on
# main until it has won. No argument: the base build of both probes.
#   bash bench/gpu/build_probe.sh [prefill|decode] [name[@patches]:"-DFLAG ..."] ...
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p probe
which=(prefill decode)
case "${1:-}" in prefill|decode) which=("$1"); shift ;; esac
variants=("$@")
[ ${#variants[@]} -eq 0 ] && variants=("base:")
declare -A sources=(
  [prefill]="cuda/prefill_attention.cu cuda/prefill_attention_sm90.cu cpp/ops/attention_plan.cpp"
  [decode]="cuda/decode_attention.cu cuda/launch.cu cuda/rope_kv.cu"
)
root=$(pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
pids=()
for v in "${variants[@]}"; do
  spec=${v%%:*}
  flags=${v#*:}
  name=${spec%%@*}
  src=$root
  if [ "$spec" != "$name" ]; then  # patched sources in a copy of the tree's kernels
    src=$tmp/$name
    mkdir -p "$src"
    cp -r cuda cpp bench "$src/"
    IFS=, read -r -a patches <<< "${spec#*@}"
    for pf in "${patches[@]}"; do
      patch -s -d "$src" -p1 < "bench/gpu/variants/$pf" || { echo "patch $pf failed" >&2; exit 1; }
    done
  fi
  for p in "${which[@]}"; do
    # shellcheck disable=SC2086
    (cd "$src" && nvcc -O3 --use_fast_math -lineinfo -std=c++17 -gencode arch=compute_90a,code=sm_90a \
      -Icuda -Icpp -Icpp/include -Xcompiler -static-libstdc++ -DK25_PROBE_VARIANT="\"$name\"" $flags \
      -o "$root/probe/${p}_probe_$name" "bench/gpu/${p}_probe.cu" ${sources[$p]}) &
    pids+=($!)
  done
done
rc=0
for pid in "${pids[@]}"; do wait "$pid" || rc=1; done
ls -la probe
exit $rc
