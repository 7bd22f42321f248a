#!/usr/bin/env bash
# On the GPU machine: every carried decode probe (probe/decode_probe_*, built here by
# bench/gpu/build_probe.sh) at each case of K25_DECODE_CASES ("BxL") with each table mode of
# K25_TABLE_MODES (decode_probe.cu's 4th argument: 0 the sequence's table for every KV head,
# 1 per-head tables equal to it, 2 per-head tables each in its own shuffled order: a sparse
# step's access pattern), two alternating rounds, then PyTorch SDPA on the same shapes and
# each variant's best median over SDPA's.
#   K25_DECODE_CASES="8x32768 1x32768" K25_TABLE_MODES="0 2" bash bench/gpu/probe_tables.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/k25-out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,temperature.gpu,power.draw --format=csv,noheader | tee -a "$OUT/probe.log"
read -r -a cases <<< "${K25_DECODE_CASES:-8x32768 32x8192 1x32768 8x131072}"
read -r -a modes <<< "${K25_TABLE_MODES:-0 2}"
for round in 1 2; do
  for b in probe/decode_probe_*; do
    [ -x "$b" ] || continue
    for c in "${cases[@]}"; do
      for m in "${modes[@]}"; do "$b" "${c%x*}" "${c#*x}" 7 "$m" 2>&1 | tee -a "$OUT/probe.log"; done
    done
  done
done
python3 bench/gpu/sdpa_ref.py --decode "${cases[@]}" 2>&1 | grep -v Warn | tee -a "$OUT/probe.log"
python3 bench/gpu/sdpa_ref.py --summary "$OUT/probe.log"
