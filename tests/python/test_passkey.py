"""Pass-key retrieval (issue #5): a random 5-digit key planted at some depth of a 2.3K-3.3K
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

# Two documents, each asked at two lengths: (filler lines before the key line, contexts in
# tokens, at most). A prompt is its document cut after as much filler as its context holds,
# then the question, so the key sits at depths of about 0.09 and 0.13, then 0.67 and 0.87;
# every context is past sparsity_min_context = 2048. A document's two prompts share every token
# before the shorter one's question: with prefix caching each model prefills each document
# about once (~6.3K tokens rather than ~10.9K), which is most of this module's time on a CPU.
# Contexts up to 7K and more depths: bench/cpu_passkey.py.
DOCS = [(12, (3300, 2300)), (82, (3000, 2300))]
MAX_NEW_TOKENS = 8


def passkey_prompt(tokenizer, before, context, key):
    """FILLER `before` times, the key line, FILLER as often as `context` tokens allow, QUESTION."""
    def ids_of(after):
        parts = [FILLER] * before + [NEEDLE.format(key=key)] + [FILLER] * after
        return tokenizer.encode(" ".join(parts) + QUESTION)
    base = len(ids_of(0))
    per = len(ids_of(1)) - base
    after = (context - base) // per
    return ids_of(after), before / (before + after)


def make_model(**kw):
    return K25Model(K25Config(num_threads=2, kv_cache_bytes=512 << 20, enable_prefix_caching=True, **kw))


def answers(model, prompts):
    before = model.stats()["prefix_cache_hits"]
    out = [model.generate([ids], max_new_tokens=MAX_NEW_TOKENS, temperature=0.0)[0].text for ids in prompts]
    # Each document's second (shorter) prompt found nearly all of itself in the first one's blocks.
    assert model.stats()["prefix_cache_hits"] - before >= 0.9 * sum(len(ids) for ids in prompts[1::2])
    return out


def retrieved(answer, key):
    return answer.strip().startswith(key)


@pytest.fixture(scope="module")
def cases(default_model):
    rng = random.Random(5)
    keys, prompts, depths = [], [], []
    for before, contexts in DOCS:
        key = str(rng.randint(10000, 99999))
        for ctx in contexts:
            ids, depth = passkey_prompt(default_model.tokenizer, before, ctx, key)
            assert 2048 < ctx - 40 <= len(ids) <= ctx
            keys.append(key)
            prompts.append(ids)
            depths.append(depth)
    assert min(depths) < 0.2 and max(depths) > 0.75  # near the start and near the end
    return keys, prompts


@pytest.fixture(scope="module")
def dense_answers(cases):
    m = make_model()
    try:
        return answers(m, cases[1])
    finally:
        m.close()


def test_dense_model_retrieves_the_pass_key(cases, dense_answers):
    keys, _ = cases
    hits = [retrieved(a, k) for a, k in zip(dense_answers, keys)]
    assert sum(hits) / len(hits) >= 0.9, list(zip(keys, dense_answers))


@pytest.mark.parametrize("cap", [0.6, 0.8])
def test_sparse_decode_gives_the_dense_answers(cap, cases, dense_answers):
    keys, prompts = cases
    m = make_model(enable_dynamic_sparsity=True, max_sparsity_ratio=cap)
    try:
        sparse = answers(m, prompts)
        ratio = m.get_current_sparsity_ratio()
    finally:
        m.close()
    # The decode steps after the first token did go sparse, within the cap.
    assert 0.1 <= ratio <= cap + 1e-9, ratio
    assert sparse == dense_answers, list(zip(keys, dense_answers, sparse))
