#!/usr/bin/env bash
# Nsight Compute on the selection's bin/count/table launch (choose_kernel on sm_90, else the
# three kernels) at B1 @ 8K and B8 @ 32K: headline metrics (ncu_summary.py) and, per SASS
# line, the warp-stall samples, the hottest first (ncu_hot_lines.py). After run_all.sh's build:
#   K25_EXTRA="bash bench/gpu/ncu_select.sh" bash bench/gpu/run_all.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/k25-out}
mkdir -p "$OUT"
K=${K25_NCU_KERNELS:-choose|bin_kernel|count_kernel|table_kernel}
for c in "1 8192" "8 32768"; do
  set -- $c
  r=$OUT/select_b$1
  ncu --clock-control none --set full --import-source no -k regex:"$K" --launch-skip 2 --launch-count 1 -f -o "$r" \
    python3 bench/gpu/profile_select.py --plain $1 $2 > /tmp/ncu.log 2>&1 || tail -5 /tmp/ncu.log
  ncu -i "$r.ncu-rep" --page details --csv > "$r.csv" 2>/dev/null
  echo "#### B$1 @ $2"
  python3 bench/gpu/ncu_summary.py "$r.csv" | grep -E "^==|Duration|Issue Slots|Warp Cycles|Eligible|Stall" | head -60
  ncu -i "$r.ncu-rep" --page source --csv --print-source sass > "${r}_sass.csv" 2>/dev/null
  python3 bench/gpu/ncu_hot_lines.py "${r}_sass.csv" 40
  rm -f "$r.ncu-rep" "$r.csv"  # the _sass.csv stays for a closer look
done
