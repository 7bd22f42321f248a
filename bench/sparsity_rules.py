"""Block-selection rules for dynamic sparsity, compared in PyTorch on the default model: which
rule keeps the blocks that matter, and how many bytes per block it must read. Diagnostic, not a
benchmark: it runs transformers (float32) with its attention replaced, not the engine.

    python bench/sparsity_rules.py [--context 4096] [--docs 3] [--decoded 128] [--cap 0.6]
                                   [--rules dense,oracle,estimate8,quest,...] [--fixed]
                                   [--calib self|other|code] [--reselect N] [--lag] [--prune-stats] [--layers a:b]

Each window of the pydoc text is run teacher-forced: the first context - decoded positions in
one dense pass, then the last `decoded` one token per step with the rule's selection in every
layer (the engine's rule otherwise: sink block, 16 recent blocks, the mass target 0.95 sizing,
skipped fraction clamped to [0.1, cap], every KV head keeping the same count). The dense rule
runs the same per-step path, so agreement and perplexity compare like with like. Rules:
  dense       every block
  oracle      exact block masses (reads every key)
  estimateR   the CPU default: each query head's R largest |q| channels exact, the block's
              centre on the rest (docs/sparsity.md)
  gestimateR  the same with one channel set per KV head (the R largest of the GQA group's summed
              |q|): what a channel-major key copy would let one warp read per KV head
  quest       Quest bound ranks, the centre estimate sizes (the CUDA rule)
  questq8     the same from min/max rounded outward to int8 codes, one scale per block and head
  centre      the centre estimate q.(min + max)/2 + log n ranks and sizes (summary reads only)
  gaussP      the centre plus P/100 (no P: 100) of the variance term: each channel taken as
              uniform on [min, max] and independent, log E[sum_t exp(q.k_t)] = centre + log n
              + var/2 with var = sum_d q_d^2 (max_d - min_d)^2 / 12 (summary reads only)
  momentsP    gaussP's estimate from the block's true per-channel mean and variance (a summary
              of min / max's size could hold them instead): q.mean + log n + P/100 var/2
  mixP        ranks by the centre plus P/100 of the bound's spread term (mix100 = quest), the
              centre sizes
  questx      the Quest bound ranks, exact block masses size (which half of the rule errs)
  oraclex     exact block masses rank, the centre estimate sizes
  staticR     R channels per (layer, KV head), fixed from the prefix's statistics (|q_d| times
              the keys' spread), exact; the centre on the rest
  pcaR        keys projected on the prefix's top R principal directions per (layer, KV head)
              (Loki-style); scores q.mean + (U^T q).z
  keysqB      exact block masses from a B-bit copy of every key channel, each code relative to
              its block's per-channel [min, max] (the summary's own range, KIVI-style
              per-channel codes): what a channel-complete low-bit key copy would rank with
  skeysqB     the same relative to the 4-bit-coded summary's range (min / max rounded outward
              to codes of one scale per block and head, as CUDA stores them)
  pkeysR      skeys (with its qB suffix: the codes' bits) on R of the channels, the centre of the
              block's range on the rest: the channels in groups of 16 as CUDA's codes_score_kernel
              takes them a k-step (c = 64m + 16t + 8x + 2nh + {0, 1, 4, 5}, t = 0..3), the R / 16
              groups with the most summed |q| over the KV head's query group (a kernel could skip
              the other k-steps: fewer codes converted and multiplied)
  rkeysR      pkeysR with the groups weighed by summed |q| times the channel's mean range over
              the blocks (what a per-head range statistic, kept beside the summaries, would give)
  ckeysR      pkeysR with the groups weighed by summed |q| times the channel's key standard
              deviation over the prefix (per layer and KV head, fixed: a calibration)
  vkeysqB     skeysqB with one code step a block for every channel, shaped by a per-(layer, KV
              head) channel profile rho_d: step_d = s_j rho_d / (2^B - 1), s_j the smallest
              scale that covers the block's every range (max_d (max_d - min_d) / rho_d); rho from
              the prefix (--calib: the mean per-channel range of its blocks). Then the codes'
              product is q.lo_j + s_j / (2^B - 1) sum_d (q_d rho_d) c_td: the matrix it multiplies
              the codes with is the same for every block (a kernel builds it once)
  ukeysqB     vkeys with rho_d = 1 (one range a block for all channels; no calibration)
  lkeys       one bit a key and channel (above the block's channel mean or not), each side read
              back as the mean of its keys: two levels a channel instead of min / max
  slkeys      the same with the two levels as 4-bit codes of one scale a block and head
  *qB         a suffix: the stored values rounded to B-bit codes, one scale per block and head
              (questqB, gaussPqB, mixPqB: min/max rounded outward; estimateRqB: the keys the
              chosen channels are read from, as a low-bit copy would hold them; momentsPqB: the
              mean as signed codes, the variance as unsigned ones)
"""
import argparse
import copy
import math
import re
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "python"))

BS, SINK, RECENT, MASS, MIN_CTX = 16, 1, 16, 0.95, 2048


def qn(x, dims, bits=8):
    """x rounded to signed `bits`-bit codes with one scale per slice over `dims` (nearest)."""
    s = x.abs().amax(dim=dims, keepdim=True).clamp_min(1e-12) / (2 ** (bits - 1) - 1)
    return torch.round(x / s) * s


SUBSET_CODES = ("pkeys", "rkeys", "ckeys")  # skeys on a subset of the channels (the docstring)
# Key codes in the summary's 4-bit range, rounded outward (skeys and its variants).
SUMMARY_CODES = ("skeys", "vkeys", "ukeys", *SUBSET_CODES)


def kstep_groups(D):
    """The channels of each k-step of codes_score_kernel, [D / 16, 16]: k-step 4m + 2x + nh takes
    64m + 16t + 8x + 2nh + {0, 1, 4, 5} for t = 0..3."""
    out = []
    for ks in range(D // 16):
        m, x, nh = ks // 4, (ks // 2) % 2, ks % 2
        out.append([64 * m + 16 * t + 8 * x + 2 * nh + o for t in range(4) for o in (0, 1, 4, 5)])
    return torch.tensor(out)


def block_min_max(kb, valid):
    """Per-channel min and max of each block's valid keys: kb [Hkv, nb, BS, D] -> [Hkv, nb, D] each."""
    kv = torch.where(valid[None, :, :, None], kb, torch.nan)
    return kv.nan_to_num(float("inf")).amin(2), kv.nan_to_num(float("-inf")).amax(2)


def quest_bound(q, mn, mx, scale):
    """sum_d max(q_d mn_d, q_d mx_d), scaled: q [Hkv, G, D] -> [Hkv, G, nb]."""
    qh = q[:, :, None]
    return torch.maximum(qh * mn[:, None], qh * mx[:, None]).sum(-1) * scale


class Rule:
    def __init__(self, name):
        self.name = name
        m = re.fullmatch(r"(dense|oracle|questx|oraclex|quest|centre|gauss|moments|mix|estimate|gestimate|static|pca|keys|skeys|vkeys|ukeys|pkeys|rkeys|ckeys|lkeys|slkeys)(\d*)(?:q(\d+))?", name)
        if not m:
            raise SystemExit(f"unknown rule {name}")
        self.kind, self.r, self.quant = m.group(1), int(m.group(2) or 0), int(m.group(3) or 0)
        self.calib = {}  # layer -> per KV head statistics from the prefix
        self.kept = self.total = 0
        self.reuse = {}  # layer -> (keep mask, its length, steps it has served)

    def calibrate(self, layer, q, k):
        """q [Hq, P, D], k [Hkv, P, D] of the prefix, after RoPE."""
        Hkv, G = k.shape[0], q.shape[0] // k.shape[0]
        if self.kind == "ckeys":
            self.calib[layer] = k.std(1)  # [Hkv, D]
        elif self.kind == "vkeys":  # the mean per-channel range of the prefix's blocks
            P = k.shape[1] // BS * BS
            kb = k[:, :P].reshape(Hkv, P // BS, BS, -1)
            self.calib[layer] = (kb.amax(2) - kb.amin(2)).mean(1).clamp_min(1e-6)  # [Hkv, D]
        elif self.kind == "static":
            imp = q.abs().mean(1).view(Hkv, G, -1).sum(1) * k.std(1)  # [Hkv, D]
            self.calib[layer] = imp.topk(self.r, dim=-1).indices
        elif self.kind == "pca":
            mu = k.mean(1, keepdim=True)
            c = (k - mu).double()
            cov = c.transpose(1, 2) @ c
            _, vec = torch.linalg.eigh(cov)  # ascending
            self.calib[layer] = (mu[:, 0].float(), vec[:, :, -self.r:].float())

    def scores(self, layer, q, kb, valid, scale):
        """q [Hkv, G, D], kb [Hkv, nb, BS, D], valid [nb, BS]: (rank, log-mass) per [Hkv, G, nb]."""
        neg = torch.tensor(float("-inf"))
        vmask = valid[None, None]
        cnt = valid.sum(-1).float().log()[None, None]  # log token count per block, [1, 1, nb]
        mn, mx = block_min_max(kb, valid)
        if self.kind in ("oracle", "keys", *SUMMARY_CODES, "lkeys", "slkeys", "estimate", "gestimate", "static",
                         "pca"):
            if self.kind == "oracle":
                s = torch.einsum("hgd,hjtd->hgjt", q, kb) * scale
            elif self.kind in ("keys", *SUMMARY_CODES):
                levels = 2 ** self.quant - 1
                if self.kind in SUMMARY_CODES:  # the summary's 4-bit range, rounded outward
                    sc = torch.maximum(mn.abs(), mx.abs()).amax(-1, keepdim=True).clamp_min(1e-12) / 7
                    mn, mx = torch.floor(mn / sc) * sc, torch.ceil(mx / sc) * sc
                rng = mx - mn
                if self.kind in ("vkeys", "ukeys"):  # one step scale a block, times the channel profile
                    rho = self.calib[layer][:, None] if self.kind == "vkeys" else torch.ones_like(rng)
                    rng = (rng / rho).amax(-1, keepdim=True) * rho
                lo, step = mn[:, :, None], (rng / levels).clamp_min(1e-12)[:, :, None]
                kq = lo + torch.round((kb - lo) / step).clamp(0, levels) * step
                if self.kind in SUBSET_CODES:  # codes on R channels (k-step groups), the centre elsewhere
                    groups = kstep_groups(q.shape[-1])  # [D / 16, 16]
                    w = q.abs().sum(1)  # [Hkv, D]
                    if self.kind == "rkeys":
                        w = w * (mx - mn).mean(1)
                    elif self.kind == "ckeys":
                        w = w * self.calib[layer]
                    top = w[:, groups].sum(-1).topk(self.r // 16, -1).indices  # [Hkv, R / 16]
                    chosen = torch.zeros(q.shape[0], q.shape[-1], dtype=torch.bool)
                    chosen.scatter_(-1, groups[top].flatten(1), True)
                    kq = torch.where(chosen[:, None, None], kq, ((mn + mx) / 2)[:, :, None])
                s = torch.einsum("hgd,hjtd->hgjt", q, torch.where(valid[None, :, :, None], kq, 0.0)) * scale
            elif self.kind in ("lkeys", "slkeys"):
                # One bit a key and channel: above the block's channel mean or not; each side read back
                # as the mean of its keys (two levels a channel, stored instead of min / max).
                vm = valid[None, :, :, None]
                mean = (kb * vm).sum(2, keepdim=True) / valid.sum(-1).clamp_min(1)[None, :, None, None]
                up, dn = (kb > mean) & vm, ~(kb > mean) & vm
                hi = (kb * up).sum(2, keepdim=True) / up.sum(2, keepdim=True).clamp_min(1)
                lo = (kb * dn).sum(2, keepdim=True) / dn.sum(2, keepdim=True).clamp_min(1)
                hi = torch.where(up.sum(2, keepdim=True) > 0, hi, lo)
                if self.kind == "slkeys":  # the levels as 4-bit codes of one scale a block and head, to nearest
                    sc = torch.maximum(lo.abs(), hi.abs()).amax(-1, keepdim=True).clamp_min(1e-12) / 7
                    lo, hi = torch.round(lo / sc) * sc, torch.round(hi / sc) * sc
                kq = torch.where(up, hi, lo)
                s = torch.einsum("hgd,hjtd->hgjt", q, torch.where(vm, kq, 0.0)) * scale
            elif self.kind == "pca":
                mu, U = self.calib[layer]
                z = torch.einsum("hjtd,hdr->hjtr", kb - mu[:, None, None], U)
                if self.quant:
                    z = qn(z, (2, 3), self.quant)
                s = (torch.einsum("hgd,hd->hg", q, mu)[:, :, None, None]
                     + torch.einsum("hgd,hdr,hjtr->hgjt", q, U, z)) * scale
            else:
                cen = (mn + mx) / 2
                if self.kind in ("estimate", "gestimate"):
                    if self.kind == "estimate":
                        chosen = torch.zeros_like(q, dtype=torch.bool).scatter_(-1, q.abs().topk(self.r, -1).indices, True)
                    else:  # one channel set per KV head: the R largest of the group's summed |q|
                        idx = q.abs().sum(1).topk(self.r, -1).indices  # [Hkv, R]
                        chosen = torch.zeros(q.shape[0], q.shape[-1], dtype=torch.bool).scatter_(-1, idx, True)
                        chosen = chosen[:, None].expand_as(q)
                    if self.quant:  # the keys as a B-bit copy (one scale per block and KV head), e.g. channel-major
                        kb = qn(kb, (2, 3), self.quant)
                else:
                    idx = self.calib[layer]
                    chosen = torch.zeros(q.shape[0], q.shape[-1], dtype=torch.bool).scatter_(-1, idx, True)[:, None]
                    chosen = chosen.expand_as(q)
                    if self.quant:
                        kb = kb.clone()
                        for h in range(kb.shape[0]):
                            kb[h][..., idx[h]] = qn(kb[h][..., idx[h]], (1, 2), self.quant)
                qc = torch.where(chosen, q, 0.0)
                qo = q - qc
                s = (torch.einsum("hgd,hjtd->hgjt", qc, kb) + torch.einsum("hgd,hjd->hgj", qo, cen)[..., None]) * scale
            s = torch.where(vmask, s, neg)
            e = torch.logsumexp(s, -1)
            return e, e
        if self.kind == "moments":  # per-channel mean and variance of the block's keys instead of min / max
            kv = torch.where(valid[None, :, :, None], kb, 0.0)
            n = valid.sum(-1).clamp_min(1)[None, :, None].float()
            mu = kv.sum(2) / n
            var = (torch.where(valid[None, :, :, None], kb - mu[:, :, None], 0.0) ** 2).sum(2) / n
            if self.quant:  # mean as signed codes, variance as unsigned ones, one scale each per block and head
                mu = qn(mu, (2,), self.quant)
                vs = var.amax(-1, keepdim=True).clamp_min(1e-12) / (2 ** self.quant - 1)
                var = torch.round(var / vs) * vs
            e = (torch.einsum("hgd,hjd->hgj", q, mu) * scale + cnt
                 + (self.r or 100) / 100 * torch.einsum("hgd,hjd->hgj", q * q, var) * scale * scale / 2)
            return e, e
        # Quest bound
        if self.quant:
            sc = torch.maximum(mn.abs(), mx.abs()).amax(-1, keepdim=True).clamp_min(1e-12) / (2 ** (self.quant - 1) - 1)
            mn, mx = torch.floor(mn / sc) * sc, torch.ceil(mx / sc) * sc
        ub = quest_bound(q, mn, mx, scale)
        cen = torch.einsum("hgd,hjd->hgj", q, (mn + mx) / 2) * scale
        if self.kind in ("questx", "oraclex"):  # one side of the rule exact: questx sizes, oraclex ranks
            ex = torch.logsumexp(torch.where(vmask, torch.einsum("hgd,hjtd->hgjt", q, kb) * scale, neg), -1)
            return (ub, ex) if self.kind == "questx" else (ex, cen + cnt)
        if self.kind == "centre":
            return cen + cnt, cen + cnt
        if self.kind == "gauss":  # log E[sum exp(q.k)] with each channel uniform on [min, max], independent
            var = torch.einsum("hgd,hjd->hgj", q * q, (mx - mn) ** 2 / 12) * scale * scale
            e = cen + cnt + (self.r or 100) / 100 * var / 2
            return e, e
        if self.kind == "mix":  # the centre plus a fraction of the bound's spread term
            return cen + self.r / 100 * (ub - cen), cen + cnt
        return ub, cen + cnt

    def prune_stats(self, q, kb, valid, scale, e, rank, others, best):
        """How many blocks the Quest bound could rule out before their estimate is computed:
        e_j <= ub_j + log n_j, so a block whose bound (relative to each query head's best
        estimate, maxed over the group) is below the lowest kept score needs no estimate;
        and the mass such blocks could have, from their bounds, against the estimated total.
        e: the estimate's per-query-head log-masses [Hkv, G, nb]."""
        ub = quest_bound(q, *block_min_max(kb, valid), scale) + valid.sum(-1).float().log()
        rel_ub = (ub - e.amax(-1, keepdim=True)).amax(1)  # [Hkv, nb]
        theta = rank[:, others].gather(1, best).amin(1, keepdim=True)
        prunable = (rel_ub[:, others] < theta)
        est_mass = torch.exp((e - e.amax(-1, keepdim=True)).double()).sum(-1)  # [Hkv, G]
        tail = torch.where(prunable[:, None], torch.exp((ub - e.amax(-1, keepdim=True))[:, :, others].double()), 0.0).sum(-1)
        st = self.__dict__.setdefault("pstats", [0, 0, 0.0, 0])
        st[0] += int(prunable.sum())
        st[1] += prunable.numel()
        st[2] += float((tail / est_mass).max())
        st[3] += 1

    def select(self, layer, q, k, scale, cap):
        """q [Hq, D], k [Hkv, L, D]: bool keep mask [Hkv, L]. With --reselect N a selection
        serves N steps: in between, the keys written since are kept besides it."""
        Hkv, L, D = k.shape
        if STATE["lag"]:
            # Each step's selection is made from the step before's query and keys (what a selection
            # run beside that step's MLP, for the next step, sees); the keys written since are kept.
            prev = self.reuse.get(layer)
            self.reuse[layer] = (q, k)
            if prev is None or prev[1].shape[1] <= MIN_CTX:
                mask = self._select(layer, q, k, scale, cap)[0]
            else:
                old = self._select(layer, prev[0], prev[1], scale, cap)[0]
                mask = torch.cat([old, torch.ones(Hkv, L - old.shape[1], dtype=torch.bool)], 1)
            return mask
        old = self.reuse.get(layer)
        if old is not None and old[2] < STATE["reselect"]:
            mask = torch.cat([old[3], torch.ones(Hkv, L - old[1], dtype=torch.bool)], 1)
            self.reuse[layer] = (old[0], old[1], old[2] + 1, old[3])
            self.kept += int(mask.sum()) / BS
            self.total += Hkv * L / BS
            return mask
        mask, wider = self._select(layer, q, k, scale, cap)
        self.reuse[layer] = (mask, L, 1, wider)
        return mask

    def _select(self, layer, q, k, scale, cap):
        Hkv, L, D = k.shape
        G = q.shape[0] // Hkv
        nb = (L + BS - 1) // BS
        kb = torch.nn.functional.pad(k, (0, 0, 0, nb * BS - L)).view(Hkv, nb, BS, D)
        valid = (torch.arange(nb * BS) < L).view(nb, BS)
        head_rank, head_est = self.scores(layer, q.view(Hkv, G, D), kb, valid, scale)
        comb = lambda x: (x - x.amax(-1, keepdim=True)).amax(1)  # relative to each head's best, max over group
        rank, est = comb(head_rank), comb(head_est)
        mand = torch.zeros(nb, dtype=torch.bool)
        mand[:SINK] = True
        mand[max(0, nb - RECENT):] = True
        n_mand = int(mand.sum())
        need = n_mand
        for h in range(Hkv):
            m = torch.exp(est[h].double() - est[h].max())
            total, covered = float(m.sum()), float(m[mand].sum())
            others = torch.nonzero(~mand)[:, 0]
            order = others[torch.argsort(est[h][others], descending=True, stable=True)]
            cum = covered + torch.cumsum(m[order], 0)
            n = int(torch.searchsorted(cum, torch.tensor(MASS * total, dtype=torch.float64))) + 1
            need = max(need, n_mand + min(n, len(order)))
        keep_min = math.ceil(nb * (1 - cap) - 1e-9)
        keep_max = math.floor(nb * 0.9 + 1e-9)
        keep = max(n_mand, min(max(need, keep_min), keep_max))
        if STATE["fixed"]:
            keep = max(n_mand, keep_min)
        self.kept += keep * Hkv
        self.total += nb * Hkv
        mask = mand[None].repeat(Hkv, 1)
        others = torch.nonzero(~mand)[:, 0]
        # --reuse-margin: the steps that reuse this selection also keep the next-ranked blocks
        # (a fraction of all blocks), chosen now by this step's scores.
        extra = min(len(others) - (keep - n_mand), math.ceil(nb * STATE["margin"] - 1e-9)) if STATE["reselect"] > 1 else 0
        wider = mask.clone()
        if keep + extra > n_mand:
            ranked = rank[:, others].topk(keep + extra - n_mand, dim=-1).indices
            best = ranked[:, :keep - n_mand]
            if keep > n_mand:
                if STATE["prune"] and self.kind == "estimate":
                    self.prune_stats(q.view(Hkv, G, D), kb, valid, scale, head_est, rank, others, best)
                mask[torch.arange(Hkv)[:, None], others[best]] = True
            wider[torch.arange(Hkv)[:, None], others[ranked]] = True
        return mask.repeat_interleave(BS, 1)[:, :L], wider.repeat_interleave(BS, 1)[:, :L]


STATE = {"rule": None, "cap": 0.6, "calibrating": [], "fixed": False, "reselect": 1, "margin": 0.0, "lag": False, "prune": False, "layers": (0, 1 << 30)}


def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kw):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    rule, layer = STATE["rule"], module.layer_idx
    if query.shape[2] > 1:
        for r in STATE["calibrating"]:
            r.calibrate(layer, query[0], key[0])
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kw)
    q, k, v = query[0, :, 0], key[0], value[0]  # [Hq, D], [Hkv, L, D]
    Hkv, L, _ = k.shape
    G = q.shape[0] // Hkv
    s = torch.einsum("hgd,hld->hgl", q.view(Hkv, G, -1), k) * scaling
    if rule.kind != "dense" and L > MIN_CTX and STATE["layers"][0] <= layer < STATE["layers"][1]:
        keep = rule.select(layer, q, k, scaling, STATE["cap"])
        s = s.masked_fill(~keep[:, None], float("-inf"))
    p = torch.softmax(s.float(), -1)
    out = torch.einsum("hgl,hld->hgd", p, v).reshape(1, 1, Hkv * G, -1)
    return out, None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--docs", type=int, default=3)
    ap.add_argument("--decoded", type=int, default=128)
    ap.add_argument("--cap", type=float, default=0.6)
    ap.add_argument("--rules", default="dense,oracle,estimate8,quest,questq8,static8,static16,pca8,pca16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prune-stats", action="store_true", help="channel estimate: how many blocks the bound rules out")
    ap.add_argument("--reselect", type=int, default=1, help="a selection serves this many steps")
    ap.add_argument("--reuse-margin", type=float, default=0.0,
                    help="with --reselect N > 1: the reusing steps also keep this fraction of the blocks more, the "
                         "next-ranked by the selecting step's scores")
    ap.add_argument("--lag", action="store_true", help="each step selects from the step before's query and keys")
    ap.add_argument("--layers", default="0:", help="a:b, the layers that select (the others attend densely; Quest leaves its first two dense: 2:)")
    ap.add_argument("--fixed", action="store_true", help="keep the cap's count (ranking alone compared)")
    ap.add_argument("--calib", default="self", choices=["self", "other", "code"],
                    help="static/pca statistics from each window's prefix, or once from other text: "
                         "other, the last 2,048 tokens of the pydoc text (outside the windows); code, "
                         "2,048 tokens of Python source (the stdlib's argparse module)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AttentionInterface, AutoTokenizer
    from oracles import default_gguf, load_hf_gguf, long_text, memoised_gguf_parsing
    AttentionInterface.register("k25rules", attention)
    model = load_hf_gguf()
    model.config._attn_implementation = "k25rules"
    for mod in model.modules():
        if hasattr(mod, "config") and hasattr(mod.config, "_attn_implementation"):
            mod.config._attn_implementation = "k25rules"
    path = default_gguf()
    with memoised_gguf_parsing():
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    ids = tok(long_text())["input_ids"]
    ctx, n = args.context, args.decoded
    stride = (len(ids) - ctx) // max(1, args.docs)
    rules = [Rule(r) for r in args.rules.split(",")]
    STATE["cap"], STATE["fixed"], STATE["reselect"] = args.cap, args.fixed, args.reselect
    STATE["margin"] = args.reuse_margin
    STATE["lag"] = args.lag
    STATE["prune"] = args.prune_stats
    a, b = args.layers.split(":")
    STATE["layers"] = (int(a or 0), int(b) if b else 1 << 30)
    calibrated = [r for r in rules if r.kind in ("static", "pca", "ckeys", "vkeys")]
    if args.calib != "self":
        assert 2 * stride + ctx <= len(ids) - 2048
        if args.calib == "code":
            import argparse as src
            import inspect
            cal = tok(inspect.getsource(src))["input_ids"][:2048]
        else:
            cal = ids[-2048:]
        with torch.no_grad():
            STATE["calibrating"] = calibrated
            model(torch.tensor([cal]), use_cache=False)
            STATE["calibrating"] = []
    logits = {r.name: [] for r in rules}
    windows = []
    for w in range(args.docs):
        win = ids[w * stride:w * stride + ctx]
        windows.append(win)
        with torch.no_grad():
            STATE["rule"], STATE["calibrating"] = None, calibrated if args.calib == "self" else []
            t0 = time.time()
            pre = model(torch.tensor([win[:ctx - n]]), use_cache=True)
            STATE["calibrating"] = []
            t_pre = time.time() - t0
            for r in rules:
                STATE["rule"] = r
                r.reuse = {}
                cache = copy.deepcopy(pre.past_key_values)
                out = []
                for i in range(ctx - n, ctx - 1):  # feeds token i, predicts token i + 1
                    o = model(torch.tensor([[win[i]]]), past_key_values=cache, use_cache=True)
                    out.append(o.logits[0, -1].double())
                    cache = o.past_key_values
                logits[r.name].append(torch.stack(out))
        print(f"window {w}: prefix {t_pre:.1f} s", flush=True)
    tgt = torch.tensor([win[ctx - n + 1:] for win in windows])
    base = torch.cat(logits[rules[0].name]) if rules[0].kind == "dense" else None
    nll = lambda lg: -(torch.log_softmax(lg, -1).gather(1, tgt.reshape(-1, 1))[:, 0])
    for r in rules:
        lg = torch.cat(logits[r.name])
        row = f"{r.name:>10}: ppl {math.exp(nll(lg).mean()):.4f}"
        if base is not None:
            row += (f"  ({100 * (math.exp(nll(lg).mean() - nll(base).mean()) - 1):+.2f}% of dense)"
                    f"  top-1 agreement {(lg.argmax(1) == base.argmax(1)).double().mean():.4f}")
        if r.total:
            row += f"  sparsity {1 - r.kept / r.total:.3f}"
        if getattr(r, "pstats", None):
            p = r.pstats
            row += f"  prunable {p[0] / p[1]:.3f} of others, their bound mass {p[2] / p[3]:.3f} of the total (mean worst head)"
        print(row, flush=True)


if __name__ == "__main__":
    main()
