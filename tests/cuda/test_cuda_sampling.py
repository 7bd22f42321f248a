"""The device sampler (cuda/sample.cu) against the host sampler on the same logits.

The host sampler is itself checked against float64 references of every rule in
tests/python/test_sampler.py; the device one follows the same rules step for step, so on
identical logits it must give the same token, logprob and top logprobs, and a row's
result must not depend on the rows sampled with it.
"""
import math

import numpy as np
import pytest
import torch

from k25 import _C

cu = getattr(_C, "cuda_ops", None)


def params(**kw):
    p = _C.SamplingParams()
    for k, v in kw.items():
        setattr(p, k, v)
    return p


def random_logits(g, V, kind):
    x = torch.randn(V, generator=g) * float(torch.empty(1).uniform_(1.0, 8.0, generator=g))
    if kind == "ties":  # coarse values: long runs of equal logits, ranked by id
        x = (x * 2).round() / 2
    elif kind == "peaked":
        x[int(torch.randint(V, (1,), generator=g))] += 25.0
    elif kind == "masked":  # most of the vocabulary at -inf
        x[torch.rand(V, generator=g) < 0.97] = -math.inf
        x[0] = 0.5
    return x.float()


CASES = [
    dict(temperature=0.0),
    dict(temperature=1.0),
    dict(temperature=0.7, top_k=40),
    dict(temperature=1.3, top_p=0.9),
    dict(temperature=1.0, top_p=0.5, top_k=200),
    dict(temperature=0.9, min_p=0.05),
    dict(temperature=1.1, top_k=1),
    dict(temperature=2.0, top_k=5000, top_p=0.95, min_p=0.01),
    dict(temperature=1.0, repetition_penalty=1.3),
    dict(temperature=0.8, presence_penalty=0.7, frequency_penalty=0.4),
    dict(temperature=0.0, repetition_penalty=0.8, frequency_penalty=-0.5),
    dict(temperature=1.0, logprobs=0),
    dict(temperature=0.6, top_p=0.8, logprobs=5),
    dict(temperature=0.0, logprobs=20),
]


def make_rows(V, n, seed):
    g = torch.Generator().manual_seed(seed)
    kinds = ["normal", "ties", "peaked", "masked"]
    logits, rows = [], []
    for i in range(n):
        kind = kinds[i % len(kinds)]
        x = random_logits(g, V, kind)
        kw = dict(CASES[i % len(CASES)])
        p = params(**kw)
        prompt = torch.randint(V, (int(torch.randint(0, 50, (1,), generator=g)),), generator=g).tolist()
        out = torch.randint(min(V, 30), (int(torch.randint(0, 20, (1,), generator=g)),), generator=g).tolist()
        banned = [] if kind == "masked" or i % 3 else torch.randint(V, (3,), generator=g).tolist()
        rows.append((p, i, 1000 + i * 7919, prompt + out, len(prompt), banned))
        logits.append(x)
    return torch.stack(logits), rows


def host_results(logits, rows):
    s = _C.Sampler(logits.shape[1])
    res = []
    for p, r, seed, tokens, num_prompt, banned in rows:
        res.append(s.sample(logits[r].numpy(), p, tokens, num_prompt, seed, banned))
    return res


def assert_same(dev, host, rows, logits):
    mismatches = []
    for i, ((dt, dlp, dtop), (ht, hlp, htop)) in enumerate(zip(dev, host)):
        p = rows[i][0]
        if dt != ht:
            mismatches.append((i, dt, ht))
            continue
        if p.logprobs >= 0:
            assert dlp == pytest.approx(hlp, abs=2e-5, rel=1e-5), (i, dlp, hlp)
            assert [t for t, _ in dtop] == [t for t, _ in htop], i
            np.testing.assert_allclose([v for _, v in dtop], [v for _, v in htop], rtol=1e-5, atol=2e-5)
        else:
            assert dtop == []
    assert not mismatches, f"device vs host tokens differ at (row, device, host): {mismatches}"


@pytest.mark.parametrize("V", [1000, 49152, 128256])
def test_device_sampler_gives_the_host_samplers_results(V):
    logits, rows = make_rows(V, 56, seed=V)
    host = host_results(logits, rows)
    dev = cu.sample(logits.cuda(), rows)
    assert_same(dev, host, rows, logits)
    # The draws really are random draws: across the sampled rows several ids come out.
    assert len({t for t, _, _ in dev}) > 10


def test_many_seeds_on_one_row_match_the_host_and_cover_the_nucleus():
    # 400 draws of one distribution, each its own seed: token for token as on the host.
    V = 32000
    g = torch.Generator().manual_seed(5)
    x = torch.randn(V, generator=g) * 3
    logits = x.float().repeat(400, 1)
    p = params(temperature=0.9, top_p=0.95, top_k=100)
    rows = [(p, i, i, [], 0, []) for i in range(400)]
    dev = cu.sample(logits.cuda(), rows)
    host = host_results(logits, rows)
    assert [d[0] for d in dev] == [h[0] for h in host]
    assert len({d[0] for d in dev}) > 20


def test_a_rows_result_does_not_depend_on_its_batch():
    V = 49152
    logits, rows = make_rows(V, 24, seed=11)
    together = cu.sample(logits.clone().cuda(), rows)
    for i in (0, 5, 23):
        p, _, seed, tokens, num_prompt, banned = rows[i]
        alone = cu.sample(logits[i:i + 1].clone().cuda(), [(p, 0, seed, tokens, num_prompt, banned)])
        assert alone[0] == together[i]
    # Reversed row order: same results per row.
    rev = cu.sample(logits.clone().cuda(), rows[::-1])
    assert rev[::-1] == together


def test_bad_rows_are_rejected_before_the_kernel():
    logits = torch.zeros(2, 100, device="cuda")
    with pytest.raises(Exception, match="token out of range"):
        cu.sample(logits, [(params(temperature=1.0), 0, 0, [100], 0, [])])
    with pytest.raises(Exception, match="sample row out of range"):
        cu.sample(logits, [(params(temperature=1.0), 2, 0, [], 0, [])])
    with pytest.raises(Exception, match="top_p"):
        cu.sample(logits, [(params(top_p=0.0), 0, 0, [], 0, [])])


def test_all_masked_row_fails_alone():
    logits = torch.randn(3, 500, device="cuda")
    logits[1] = -math.inf
    out = cu.sample(logits, [(params(temperature=1.0), r, r, [], 0, []) for r in range(3)])
    assert out[1][0] == -1
    assert out[0][0] >= 0 and out[2][0] >= 0
