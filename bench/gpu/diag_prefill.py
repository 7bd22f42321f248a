"""Per-row accuracy of k25's paged prefill attention next to PyTorch SDPA, both against a
float64 reference, on a few prefill shapes (bf16, fp16). A kernel bug confined to a few
rows hides in a whole-tensor norm; this prints each kernel's worst and mean row error and
any row where k25 is more than 4x SDPA's worst.

    python3 bench/gpu/diag_prefill.py      (after building with CUDA, e.g. run_all.sh)
"""
import math, sys, torch
import torch.nn.functional as F
sys.path[:0] = ["tests/cuda", "tests/python"]
from k25 import _C
cu = _C.cuda_ops
def case(dtype, Hq, Hkv, D, bs, ctx, qlen, seed=0):
    g = torch.Generator().manual_seed(seed)
    L, layer = 2, 1
    nb = -(-ctx // bs) + 2
    kv = torch.full((nb * L * 2 * Hkv * bs * D,), float("nan"), device="cuda", dtype=dtype)
    pv = kv.view(-1, L, 2, Hkv, bs, D)
    table = torch.randperm(nb, generator=g)[: -(-ctx // bs)]
    k = torch.randn(ctx, Hkv, D, generator=g).to(dtype).cuda(); v = torch.randn(ctx, Hkv, D, generator=g).to(dtype).cuda()
    p = torch.arange(ctx); b = table[p // bs].cuda()
    pv[b, layer, 0, :, (p % bs).cuda()] = k; pv[b, layer, 1, :, (p % bs).cuda()] = v
    q = torch.randn(qlen, Hq, D, generator=g).to(dtype).cuda()
    buf = torch.zeros(qlen, (Hq + 2 * Hkv) * D, device="cuda", dtype=dtype); buf[:, :Hq * D] = q.reshape(qlen, -1)
    call = cu.AttentionCall(kv, (L, Hkv, D, bs), layer, torch.tensor([0, qlen], dtype=torch.int32), torch.tensor([ctx], dtype=torch.int32),
                            table[None].int(), Hq, 1 / math.sqrt(D), 0, 264, 0)
    out = call.run(buf).view(qlen, Hq, D).double()
    kk = k.double().repeat_interleave(Hq // Hkv, 1); vv = v.double().repeat_interleave(Hq // Hkv, 1)
    s = torch.einsum("nhd,chd->hnc", q.double(), kk) / math.sqrt(D)
    qpos = torch.arange(ctx - qlen, ctx, device="cuda")[:, None]; kpos = torch.arange(ctx, device="cuda")[None]
    s = s.masked_fill(~(kpos <= qpos)[None], float("-inf"))
    ref = torch.einsum("hnc,chd->nhd", torch.softmax(s, -1), vv)
    mask = (kpos <= qpos)
    sd = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1).repeat_interleave(Hq // Hkv, 0), v.transpose(0, 1).repeat_interleave(Hq // Hkv, 0), attn_mask=mask).transpose(0, 1).double()
    e_k = ((out - ref).abs().amax(-1) / ref.abs().amax(-1))  # [qlen, Hq]
    e_s = ((sd - ref).abs().amax(-1) / ref.abs().amax(-1))
    worst = torch.nonzero(e_k > 4 * e_s.max())
    print(f"{dtype} Hq{Hq} Hkv{Hkv} D{D} bs{bs} ctx{ctx} q{qlen}: k25 row err max {e_k.max():.2e} mean {e_k.mean():.2e} | sdpa max {e_s.max():.2e} mean {e_s.mean():.2e} | bad rows {len(worst)} {worst[:6].tolist()}", flush=True)
for dt in (torch.bfloat16, torch.float16):
    case(dt, 4, 2, 64, 16, 200, 200)
    case(dt, 4, 2, 64, 16, 232, 32)
    case(dt, 32, 8, 128, 16, 1000, 1000)
    case(dt, 8, 8, 128, 16, 300, 300)
    case(dt, 8, 1, 64, 16, 129, 129)
