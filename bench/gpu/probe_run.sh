#!/usr/bin/env bash
# On the GPU machine: times each carried probe binary (bench/gpu/build_probe.sh builds them
# on the CPU box into probe/) in two alternating rounds (prefill probes at each length L,
# decode probes at each case of K25_DECODE_CASES, "BxL" each), then PyTorch SDPA on the same
# shapes, and prints each variant's best median with its ratio to SDPA measured in the same
# call. K25_PROBE_NCU=<variant> also profiles that prefill variant and cuDNN's SDPA kernel
# under Nsight Compute: headline metrics printed, details and per-SASS-line stall pages (CSV)
# under $OUT.
#   bash bench/gpu/probe_run.sh [L ...]          (default 16384; carry probe/)
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/k25-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
lens=("$@")
[ ${#lens[@]} -eq 0 ] && lens=(16384)
nvidia-smi --query-gpu=name,clocks.sm,temperature.gpu,power.draw --format=csv,noheader
read -r -a cases <<< "${K25_DECODE_CASES:-8x32768 32x8192 1x32768}"
# decode_probe's table modes (its 4th argument: 0 the sequence's table for every KV head, 1
# per-head tables equal to it, 2 per-head tables each in its own shuffled order, a sparse
# step's access pattern), e.g. K25_TABLE_MODES="0 2".
read -r -a modes <<< "${K25_TABLE_MODES:-0}"
for round in 1 2; do
  for b in probe/prefill_probe_*; do
    [ -x "$b" ] || continue
    for L in "${lens[@]}"; do "$b" "$L" 10 2>&1 | tee -a "$OUT/probe.log"; done
  done
  for b in probe/decode_probe_*; do
    [ -x "$b" ] || continue
    for c in "${cases[@]}"; do
      for m in "${modes[@]}"; do "$b" "${c%x*}" "${c#*x}" 7 "$m" 2>&1 | tee -a "$OUT/probe.log"; done
    done
  done
done
if ls probe/prefill_probe_* >/dev/null 2>&1; then
  python3 bench/gpu/sdpa_ref.py "${lens[@]}" 2>&1 | grep -v Warn | tee -a "$OUT/probe.log"
fi
if ls probe/decode_probe_* >/dev/null 2>&1; then
  python3 bench/gpu/sdpa_ref.py --decode "${cases[@]}" 2>&1 | grep -v Warn | tee -a "$OUT/probe.log"
fi
python3 bench/gpu/sdpa_ref.py --summary "$OUT/probe.log"
v=${K25_PROBE_NCU:-}
if [ -n "$v" ]; then
  NCU="ncu --clock-control none --set full --import-source yes"
  $NCU -k regex:prefill_sm90 -c 1 -f -o "$OUT/k25" "probe/prefill_probe_$v" 16384 1 > /tmp/ncu_k25.log 2>&1
  tail -2 /tmp/ncu_k25.log
  $NCU -k regex:"fprop|fmha|flash|sdpa|attention" --launch-skip 1 -c 1 -f -o "$OUT/sdpa" \
    python3 bench/gpu/sdpa_ref.py --once 16384 > /tmp/ncu_sdpa.log 2>&1
  tail -2 /tmp/ncu_sdpa.log
  for r in k25 sdpa; do
    [ -f "$OUT/$r.ncu-rep" ] || continue
    ncu -i "$OUT/$r.ncu-rep" --page details --csv > "$OUT/${r}_details.csv" 2>&1
    python3 bench/gpu/ncu_summary.py "$OUT/${r}_details.csv"
  done
  ncu -i "$OUT/k25.ncu-rep" --page source --csv --print-source sass > "$OUT/k25_source.csv" 2> /tmp/k25_source.err
  rm -f "$OUT"/*.ncu-rep  # the CSV pages hold what is read back; the reports may pass the size limit
fi
