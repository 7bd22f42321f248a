#!/usr/bin/env bash
# On the GPU machine: Nsight Compute of the decode kernel (the carried probe/decode_probe_base,
# bench/gpu/build_probe.sh) and of PyTorch SDPA's decode kernels (both GQA forms), at B1 and B8
# over 32K keys (GQA 32/8, d128, bf16). Headline metrics per kernel into $OUT/ncu_summary.txt
# (bench/gpu/ncu_summary.py), the details pages as CSV, k25's B1 SASS source page.
#   bash bench/gpu/ncu_decode.sh        (carry probe/decode_probe_base)
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/k25-out}
mkdir -p "$OUT"
N="ncu --clock-control none --set full"
for c in "1 32768" "8 32768"; do set -- $c; $N -k regex:decode -c 1 --launch-skip 5 -f -o $OUT/k25_b$1 probe/decode_probe_base $1 $2 1 > /tmp/n.log 2>&1; tail -2 /tmp/n.log; done
for B in 1 8; do $N -k regex:"flash|fmha|sdpa|attn" -c 4 --launch-skip 4 -f -o $OUT/sdpa_b$B python3 -c "
import torch,torch.nn.functional as F
B=$B
q=torch.randn(B,32,1,128,device='cuda',dtype=torch.bfloat16);k=torch.randn(B,8,32768,128,device='cuda',dtype=torch.bfloat16);v=torch.randn_like(k)
for _ in range(4): F.scaled_dot_product_attention(q.view(B,8,4,128),k,v)
for _ in range(4): F.scaled_dot_product_attention(q,k,v,enable_gqa=True)
torch.cuda.synchronize()" > /tmp/s.log 2>&1; tail -2 /tmp/s.log; done
for r in k25_b1 k25_b8 sdpa_b1 sdpa_b8; do [ -f $OUT/$r.ncu-rep ] || continue; ncu -i $OUT/$r.ncu-rep --page details --csv > $OUT/${r}.csv 2>&1; echo "#### $r"; python3 bench/gpu/ncu_summary.py $OUT/${r}.csv; done > $OUT/ncu_summary.txt 2>&1
ncu -i $OUT/k25_b1.ncu-rep --page source --csv --print-source sass > $OUT/k25_b1_source.csv 2>/dev/null
rm -f $OUT/*.ncu-rep; wc -l $OUT/ncu_summary.txt; grep -E "^==|Duration|DRAM Throughput|Achieved Occ" $OUT/ncu_summary.txt
