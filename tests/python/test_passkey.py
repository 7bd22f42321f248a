"""Pass-key retrieval (issue #5): a random 5-digit key planted at some depth of a 2.5K-4.5K
token context, asked for at the end. The default model retrieves it densely, and dynamic
block sparsity (decode steps of sequences past sparsity_min_context) must give the same
answers at the default cap and at 0.8. Format and wider grid: docs/sparsity.md "Retrieval",
bench/cpu_passkey.py."""
import random

import pytest

from k25 import K25Config, K25Model

pytestmark = pytest.mark.slow

# Same format as bench/cpu_passkey.py. The key line avoids "... is the pass key" and the prompt
# asks with nothing but "The pass key is": the model otherwise tends to continue that phrase
# from a question or a restatement instead of from the key line.
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NEEDLE = "The pass key is {key}. Remember it. The pass key is {key}."
QUESTION = " The pass key is"

# (context tokens, depth of the key line); every context is past sparsity_min_context = 2048.
GRID = [(2500, 0.2), (3200, 0.8), (3900, 0.5), (4500, 0.1)]
MAX_NEW_TOKENS = 8


def passkey_prompt(tokenizer, context, depth, key):
    def ids_of(before, after):
        parts = [FILLER] * before + [NEEDLE.format(key=key)] + [FILLER] * after
        return tokenizer.encode(" ".join(parts) + QUESTION)
    base = len(ids_of(0, 0))
    per = len(ids_of(1, 0)) - base
    n = (context - base) // per
    before = round(depth * n)
    return ids_of(before, n - before)


def answers(model, prompts):
    return [model.generate([ids], max_new_tokens=MAX_NEW_TOKENS, temperature=0.0)[0].text for ids in prompts]


def retrieved(answer, key):
    return answer.strip().startswith(key)


@pytest.fixture(scope="module")
def cases(default_model):
    rng = random.Random(5)
    keys = [str(rng.randint(10000, 99999)) for _ in GRID]
    prompts = [passkey_prompt(default_model.tokenizer, ctx, depth, key) for (ctx, depth), key in zip(GRID, keys)]
    for (ctx, _), ids in zip(GRID, prompts):
        assert 2048 < ctx - 40 <= len(ids) <= ctx
    return keys, prompts


@pytest.fixture(scope="module")
def dense_answers(default_model, cases):
    return answers(default_model, cases[1])


def test_dense_model_retrieves_the_pass_key(cases, dense_answers):
    keys, _ = cases
    hits = [retrieved(a, k) for a, k in zip(dense_answers, keys)]
    assert sum(hits) / len(hits) >= 0.9, list(zip(keys, dense_answers))


@pytest.mark.parametrize("cap", [0.6, 0.8])
def test_sparse_decode_gives_the_dense_answers(cap, cases, dense_answers):
    keys, prompts = cases
    m = K25Model(K25Config(num_threads=2, kv_cache_bytes=512 << 20, enable_dynamic_sparsity=True,
                           max_sparsity_ratio=cap))
    try:
        sparse = answers(m, prompts)
        ratio = m.get_current_sparsity_ratio()
    finally:
        m.close()
    # The decode steps after the first token did go sparse, within the cap.
    assert 0.1 <= ratio <= cap + 1e-9, ratio
    assert sparse == dense_answers, list(zip(keys, dense_answers, sparse))
