"""The C++ sampler (k25._C.Sampler) against independent numpy/torch references.

Documented semantics (cpp/engine/sampler.h/.cpp): penalties on the logits first
(repetition: HF/CTRL style over prompt + output, l > 0 ? l / p : l * p; presence and
frequency: OpenAI style over the output only, l -= presence + frequency * count), banned
ids to -inf, greedy (argmax, lowest id on ties) when temperature == 0 or top_k == 1,
otherwise logits / T, top-k, min-p (relative to the top probability), top-p (smallest
descending prefix whose mass >= top_p), then a draw from a counter-based uniform of
(seed, output index = len(tokens) - num_prompt_tokens). Logprobs are of the raw logits.

The references below are written from that description in float64; tests keep away
from decision boundaries (ties, cumulative masses equal to top_p) so float32 rounding in
the engine can not flip an outcome.
"""
import math

import numpy as np
import pytest
import torch

from k25 import _C, errors


# ---------------------------------------------------------------------------------------
# helpers and references

def make_params(**kw):
    p = _C.SamplingParams()
    for k, v in kw.items():
        setattr(p, k, v)
    return p


def ref_penalised(logits, tokens, num_prompt, rep=1.0, presence=0.0, frequency=0.0, banned=()):
    """Penalised logits, written from the documented semantics (float64)."""
    x = np.asarray(logits, dtype=np.float64).copy()
    if rep != 1.0:
        for t in set(tokens):                       # prompt AND output, once per distinct id
            x[t] = x[t] / rep if x[t] > 0 else x[t] * rep
    out = tokens[num_prompt:]
    if presence != 0.0 or frequency != 0.0:
        ids, counts = np.unique(np.asarray(out, dtype=np.int64), return_counts=True)
        for t, c in zip(ids, counts):               # output tokens only
            x[t] -= presence + frequency * c
    for t in banned:
        x[t] = -np.inf
    return x


def ref_distribution(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, banned=()):
    """The probability of each id under temperature + top-k + min-p + top-p (float64)."""
    z = np.asarray(logits, dtype=np.float64).copy()
    for t in banned:
        z[t] = -np.inf
    z = z / temperature
    V = len(z)
    order = np.lexsort((np.arange(V), -z))          # descending logit, lower id first on ties
    if top_k > 0:
        order = order[:top_k]
    w = np.exp(z[order] - z[order].max())           # the best candidate has weight 1
    if min_p > 0:
        w[w < min_p] = 0.0
    if top_p < 1.0:
        c = np.cumsum(w) / w.sum()
        keep = int(np.searchsorted(c, top_p, side="left")) + 1   # first prefix with mass >= top_p
        w[keep:] = 0.0
    probs = np.zeros(V)
    probs[order] = w / w.sum()
    return probs


def draw_many(logits, params, n, tokens=(), num_prompt=None, seed0=0, banned=()):
    s = _C.Sampler(len(logits))
    logits = np.asarray(logits, dtype=np.float32)
    tokens = list(tokens)
    num_prompt = len(tokens) if num_prompt is None else num_prompt
    banned = list(banned)
    return np.array([s.sample(logits, params, tokens, num_prompt, seed0 + i, banned)[0] for i in range(n)])


def midpoint_top_p(w, k):
    """A top_p for which the documented rule keeps exactly the k best of weights w
    (sorted descending), half way between the two cumulative masses around it."""
    c = np.cumsum(w) / np.sum(w)
    return float((c[k - 2] if k >= 2 else 0.0) + c[k - 1]) / 2.0


# ---------------------------------------------------------------------------------------
# greedy and penalties

@pytest.mark.parametrize("kind", ["repetition", "presence", "frequency", "all"])
def test_greedy_equals_argmax_of_numpy_penalised_logits(kind):
    rng = np.random.default_rng({"repetition": 1, "presence": 2, "frequency": 3, "all": 4}[kind])
    V = 64
    s = _C.Sampler(V)
    changed = compared = 0
    for trial in range(300):
        logits = rng.normal(0, 2, V).astype(np.float32)
        if trial % 3 == 0:
            logits = -np.abs(logits) - 0.1   # all negative: the repetition penalty multiplies
        # Favour the current best ids in the history so penalties change the winner.
        top = np.argsort(-logits)[:6]
        pool = np.concatenate([top, rng.integers(0, V, 6)])
        tokens = [int(t) for t in rng.choice(pool, size=int(rng.integers(1, 14)))]
        num_prompt = int(rng.integers(0, len(tokens) + 1))
        kw = {}
        if kind in ("repetition", "all"):
            kw["rep"] = float(rng.choice([0.6, 1.3, 2.0, 3.5]))
        if kind in ("presence", "all"):
            kw["presence"] = float(rng.uniform(-2, 2))
        if kind in ("frequency", "all"):
            kw["frequency"] = float(rng.uniform(-2, 2))
        ref = ref_penalised(logits, tokens, num_prompt, **kw)
        srt = np.sort(ref)
        if srt[-1] - srt[-2] < 1e-3:
            continue  # a near tie: float32 rounding may pick either
        params = make_params(temperature=0.0, repetition_penalty=kw.get("rep", 1.0),
                             presence_penalty=kw.get("presence", 0.0),
                             frequency_penalty=kw.get("frequency", 0.0))
        tok, _, _ = s.sample(logits, params, tokens, num_prompt, trial)
        assert tok == int(np.argmax(ref)), (trial, kw, tokens, num_prompt)
        compared += 1
        changed += int(np.argmax(ref) != np.argmax(logits))
    assert compared > 250
    assert changed > 30  # the penalties really mattered in many trials


def test_penalty_scopes_prompt_vs_output():
    V = 8
    s = _C.Sampler(V)
    logits = np.array([0, 5.0, 4.0, 0, 0, 0, 0, 0], np.float32)
    # id 1 only in the prompt: presence/frequency must not touch it; repetition must.
    tokens, P = [1, 3], 2
    pres = make_params(temperature=0.0, presence_penalty=2.0, frequency_penalty=2.0)
    assert s.sample(logits, pres, tokens, P, 0)[0] == 1
    rep = make_params(temperature=0.0, repetition_penalty=1.5)    # 5/1.5 = 3.33 < 4
    assert s.sample(logits, rep, tokens, P, 0)[0] == 2
    # id 1 in the output twice: frequency counts occurrences (5 - 2*0.6 = 3.8 < 4) ...
    tokens, P = [3, 1, 1], 1
    assert s.sample(logits, make_params(temperature=0.0, frequency_penalty=0.6), tokens, P, 0)[0] == 2
    # ... presence does not (5 - 1.2 = 3.8 < 4, but 5 - 0.6 = 4.4 > 4)
    assert s.sample(logits, make_params(temperature=0.0, presence_penalty=0.6), tokens, P, 0)[0] == 1
    # repetition applies once per distinct id, not once per occurrence (5/1.2 = 4.17 > 4)
    assert s.sample(logits, make_params(temperature=0.0, repetition_penalty=1.2), tokens, P, 0)[0] == 1


def test_greedy_ties_pick_lowest_id_and_top_k_1_is_greedy():
    V = 10
    s = _C.Sampler(V)
    logits = np.zeros(V, np.float32)
    logits[[3, 7]] = 2.0
    assert s.sample(logits, make_params(temperature=0.0), [], 0, 1)[0] == 3
    rng = np.random.default_rng(5)
    logits = rng.normal(0, 1, V).astype(np.float32)
    best = int(np.argmax(logits))
    toks = {s.sample(logits, make_params(temperature=1.5, top_k=1), [], 0, seed)[0] for seed in range(200)}
    assert toks == {best}


def test_banned_ids_never_sampled():
    V = 32
    rng = np.random.default_rng(6)
    logits = rng.normal(0, 1, V).astype(np.float32)
    order = np.argsort(-logits)
    banned = [int(order[0]), int(order[2]), 5 if 5 not in order[:3] else 6]
    s = _C.Sampler(V)
    # greedy falls to the best id that is not banned
    assert s.sample(logits, make_params(temperature=0.0), [], 0, 0, banned)[0] == int(order[1])
    draws = draw_many(logits, make_params(temperature=1.0), 3000, banned=banned)
    assert not set(draws.tolist()) & set(banned)
    ref = ref_distribution(logits, banned=banned)
    assert {i for i in range(V) if ref[i] * len(draws) >= 15} <= set(draws.tolist())


# ---------------------------------------------------------------------------------------
# which ids can be drawn: top-k, top-p, min-p and combinations

def _filter_cases():
    rng = np.random.default_rng(11)
    V = 40
    kinds = [("top_k",), ("top_p",), ("min_p",), ("top_k", "top_p"), ("min_p", "top_p"),
             ("top_k", "min_p", "top_p"), ("top_p",), ("min_p",)]
    cases = []
    for i, kind in enumerate(kinds):
        logits = rng.normal(0, 1.5, V).astype(np.float32)
        T = [1.0, 0.7, 1.6][i % 3]
        w = np.sort(np.exp((logits.astype(np.float64) - logits.max()) / T))[::-1]
        k = int(rng.integers(3, 9))
        kw = dict(temperature=T)
        ww = w
        if "top_k" in kind:
            kw["top_k"] = k + 4 if len(kind) > 1 else k
            ww = ww[:kw["top_k"]]
        if "min_p" in kind:
            m = min(int(rng.integers(4, 10)), len(ww) - 1)
            kw["min_p"] = float(math.sqrt(ww[m - 1] * ww[m]))   # keeps exactly m ids
            ww = ww[:m]
        if "top_p" in kind:
            kw["top_p"] = midpoint_top_p(ww, max(2, min(k, len(ww) - 1)))
        cases.append(pytest.param(logits, kw, id=f"{'+'.join(kind)}-T{T}"))
    return cases


@pytest.mark.parametrize("logits,kw", _filter_cases())
def test_drawn_ids_are_exactly_the_reference_allowed_set(logits, kw):
    ref = ref_distribution(logits, **kw)
    allowed = set(np.nonzero(ref)[0].tolist())
    assert 1 < len(allowed) < len(logits)   # the filter really filters
    n = 4000
    draws = draw_many(logits, make_params(**kw), n)
    seen = set(draws.tolist())
    assert seen <= allowed, sorted(seen - allowed)
    likely = {i for i in allowed if ref[i] * n >= 15}   # expected count >= 15: must appear
    assert likely <= seen, sorted(likely - seen)


def test_top_p_boundary_is_the_smallest_prefix_reaching_top_p():
    # Weights 4:2:1:1 (probabilities .5/.25/.125/.125). Cumulative .5, .75, .875, 1.
    logits = np.log(np.array([4.0, 2.0, 1.0, 1.0], np.float32)).astype(np.float32)
    for top_p, expect in [(0.3, {0}), (0.6, {0, 1}), (0.74, {0, 1}), (0.8, {0, 1, 2}), (0.95, {0, 1, 2, 3})]:
        seen = set(draw_many(logits, make_params(top_p=top_p), 800).tolist())
        assert seen == expect, (top_p, seen)


def test_min_p_is_relative_to_the_top_probability():
    # probs proportional to 1, .5, .2, .05: min_p = .3 keeps {0,1}, .1 keeps {0,1,2}
    logits = np.log(np.array([1.0, 0.5, 0.2, 0.05])).astype(np.float32)
    assert set(draw_many(logits, make_params(min_p=0.3), 800).tolist()) == {0, 1}
    assert set(draw_many(logits, make_params(min_p=0.1), 800).tolist()) == {0, 1, 2}
    # temperature acts before min-p: at T=2 the ratios are square-rooted (1, .71, .45, .22)
    assert set(draw_many(logits, make_params(min_p=0.3, temperature=2.0), 800).tolist()) == {0, 1, 2}


# ---------------------------------------------------------------------------------------
# frequencies

def _chi2_p(counts, probs):
    """Pearson chi-square goodness-of-fit p-value (upper regularised gamma, via torch)."""
    keep = probs > 0
    assert counts[~keep].sum() == 0
    exp = probs[keep] * counts.sum()
    chi2 = float(np.sum((counts[keep] - exp) ** 2 / exp))
    df = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64),
                                         torch.tensor(chi2 / 2.0, dtype=torch.float64)))


def _ks_uniform_ok(u):
    """Kolmogorov-Smirnov test of u against U(0, 1) at about the 0.1% level."""
    u = np.sort(np.asarray(u, dtype=np.float64))
    n = len(u)
    d = max(np.max(np.arange(1, n + 1) / n - u), np.max(u - np.arange(n) / n))
    return d < 1.95 / math.sqrt(n)


@pytest.mark.parametrize("kw", [
    dict(temperature=1.0),
    dict(temperature=0.6),
    dict(temperature=1.8, top_k=6),
    dict(temperature=0.8, top_p=None),     # filled in below: a mid-gap top_p
    dict(temperature=1.3, min_p=None, top_k=10),
], ids=["T1", "T0.6", "T1.8-k6", "T0.8-p", "T1.3-k10-minp"])
def test_frequencies_match_reference_distribution(kw):
    rng = np.random.default_rng(21)
    V = 12
    logits = rng.normal(0, 1.0, V).astype(np.float32)
    kw = dict(kw)
    T = kw["temperature"]
    w = np.sort(np.exp((logits.astype(np.float64) - logits.max()) / T))[::-1]
    if "top_p" in kw:
        kw["top_p"] = midpoint_top_p(w, 5)
    if "min_p" in kw:
        kw["min_p"] = float(math.sqrt(w[6] * w[7]))   # keeps 7
    n = 12000
    draws = draw_many(logits, make_params(**kw), n, seed0=1000)
    counts = np.bincount(draws, minlength=V)
    ref = ref_distribution(logits, **kw)
    assert _chi2_p(counts, ref) > 1e-4
    # Power: the same counts decisively reject plausible bugs.
    wrong = []
    if T != 1.0:
        wrong.append(ref_distribution(logits, **{**kw, "temperature": 1.0}))    # T ignored
    if kw.get("top_p") is not None:
        wrong.append(ref_distribution(logits, **{**kw, "top_p": midpoint_top_p(w, 4)}))  # one fewer
        wrong.append(ref_distribution(logits, **{**kw, "top_p": midpoint_top_p(w, 6)}))  # one more
    for alt in wrong:
        if np.any((counts > 0) & (alt == 0)):
            continue  # support differs: already impossible under alt
        assert _chi2_p(counts, alt) < 1e-6


def test_uniform_draw_stream_per_seed_and_position():
    # With flat logits the drawn id is floor(u * V), so the draws show the uniform stream.
    V = 1000
    s = _C.Sampler(V)
    flat = np.zeros(V, np.float32)
    p = make_params(temperature=1.0)

    def at(seed, pos, prompt_len=3):
        toks = [7] * (prompt_len + pos)
        return s.sample(flat, p, toks, prompt_len, seed)[0]

    # same seed, same output index -> same token, whatever the prompt length or ids
    for seed in (0, 1, 12345, 2 ** 63 + 5):
        for pos in (0, 1, 9):
            a = at(seed, pos)
            assert at(seed, pos) == a
            assert at(seed, pos, prompt_len=11) == a
            assert s.sample(flat, p, [1, 2, 3] + [4] * pos, 3, seed)[0] == a
    # a seed's stream over positions differs between positions and between seeds
    stream1 = [at(1, i) for i in range(300)]
    stream2 = [at(2, i) for i in range(300)]
    assert len(set(stream1)) > 200
    assert sum(a == b for a, b in zip(stream1, stream2)) < 10
    # and is uniform, over positions and over seeds
    assert _ks_uniform_ok((np.array(stream1) + 0.5) / V)
    over_seeds = [at(seed, 0) for seed in range(300)]
    assert _ks_uniform_ok((np.array(over_seeds) + 0.5) / V)
    assert not _ks_uniform_ok((np.array(over_seeds) + 0.5) / V / 2)   # the check has power


# ---------------------------------------------------------------------------------------
# logprobs

@pytest.mark.parametrize("n", [0, 1, 5, 20])
def test_logprobs_are_raw_log_softmax_with_sorted_top_n(n):
    rng = np.random.default_rng(31 + n)
    V = 500
    s = _C.Sampler(V)
    ref_checked = 0
    for trial in range(20):
        logits = (rng.normal(0, 3, V)).astype(np.float32)
        tokens = [int(t) for t in np.argsort(-logits)[:3]] + [1, 2]
        params = make_params(temperature=[0.0, 0.7, 1.4][trial % 3], top_k=[0, 50][trial % 2],
                             repetition_penalty=1.7, presence_penalty=0.5, logprobs=n)
        tok, lp, top = s.sample(logits, params, tokens, 2, trial, [int(np.argmax(logits))])
        ref = torch.log_softmax(torch.from_numpy(logits).double(), -1).numpy()
        assert lp == pytest.approx(ref[tok], abs=1e-4)
        assert len(top) == n
        if n:
            ids = [t for t, _ in top]
            vals = np.array([v for _, v in top])
            assert np.all(np.diff(vals) <= 0)
            assert ids == np.argsort(-ref, kind="stable")[:n].tolist()
            np.testing.assert_allclose(vals, ref[ids], atol=1e-4)
            ref_checked += 1
    assert ref_checked == (20 if n else 0)


def test_no_logprobs_when_not_asked():
    s = _C.Sampler(16)
    tok, lp, top = s.sample(np.arange(16, dtype=np.float32), make_params(temperature=0.0), [], 0, 0)
    assert tok == 15 and top == []


# ---------------------------------------------------------------------------------------
# validation

@pytest.mark.parametrize("field,value", [
    ("temperature", -0.1), ("temperature", float("nan")), ("temperature", float("inf")),
    ("top_p", 0.0), ("top_p", 1.0001), ("top_p", -0.5), ("top_p", float("nan")),
    ("top_k", -1),
    ("min_p", -0.01), ("min_p", 1.01), ("min_p", float("nan")),
    ("repetition_penalty", 0.0), ("repetition_penalty", -1.0), ("repetition_penalty", float("inf")),
    ("presence_penalty", 2.5), ("presence_penalty", -2.5), ("frequency_penalty", 2.01),
    ("frequency_penalty", float("nan")),
    ("logprobs", 21), ("logprobs", -2),
    ("max_new_tokens", -1), ("min_new_tokens", -1),
    ("stop_token_ids", [3, 100]), ("stop_token_ids", [-1]), ("stop", ["ok", ""]),
])
def test_invalid_params_raise_invalid_argument(field, value):
    V = 100
    s = _C.Sampler(V)
    logits = np.zeros(V, np.float32)
    p = make_params(**{field: value})
    with pytest.raises(errors.InvalidArgumentError):
        s.sample(logits, p, [], 0, 0)
    with pytest.raises(errors.InvalidArgumentError):
        _C.validate_sampling_params(p, V)


@pytest.mark.parametrize("field,value", [
    ("temperature", 0.0), ("top_p", 1.0), ("top_p", 1e-6), ("top_k", 0), ("top_k", 1000),
    ("min_p", 0.0), ("min_p", 1.0), ("repetition_penalty", 1e-3), ("presence_penalty", -2.0),
    ("frequency_penalty", 2.0), ("logprobs", 20), ("logprobs", -1), ("stop_token_ids", [0, 99]),
])
def test_boundary_params_are_accepted(field, value):
    V = 100
    s = _C.Sampler(V)
    logits = np.linspace(0, 1, V).astype(np.float32)
    tok, _, _ = s.sample(logits, make_params(**{field: value}), [], 0, 0)
    assert 0 <= tok < V
