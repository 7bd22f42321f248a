"""A request gives the same tokens alone and inside a mixed batch.

The batched run mixes prompt lengths from a few tokens to ~700, splits prompts into
chunks that share each step's token budget with decodes, and has a KV pool too small
for everyone at once, so the scheduler preempts (and later recomputes) requests.
"""
import pytest

from k25 import K25Config, K25Model

from oracles import long_text

NEW_TOKENS = 24


def make_prompts(model):
    tok = model.tokenizer
    text = long_text()
    return [
        tok.encode_chat([{"role": "user", "content": "Name a colour."}]),
        tok.encode("The quick brown fox"),
        tok.encode(text[3000:12000])[:700],
        tok.encode_chat([{"role": "user", "content": "Write a Python function that reverses a string."}]),
        tok.encode(text[20000:26000])[:300],
        tok.encode("1, 2, 3, 4,"),
    ]


@pytest.mark.parametrize("sampling", [
    dict(temperature=0.0),
    dict(temperature=0.9, top_p=0.95, seed=1234),  # seeded draws are batch invariant too
])
def test_same_tokens_alone_and_in_a_preempting_chunked_batch(sampling):
    solo_model = K25Model(K25Config(num_threads=2, kv_cache_bytes=128 << 20))
    prompts = make_prompts(solo_model)
    solo = [solo_model.generate([p], max_new_tokens=NEW_TOKENS, ignore_eos=True, **sampling)[0].token_ids
            for p in prompts]
    solo_model.close()

    # Room for the longest request plus a little: not for all six at once.
    per_block = solo_model.kv_block_bytes
    block_size = 16
    longest = max(len(p) for p in prompts) + NEW_TOKENS
    blocks = -(-longest // block_size) + 6
    batch_model = K25Model(K25Config(num_threads=2, kv_cache_bytes=blocks * per_block, block_size=block_size,
                                     prefill_chunk_size=64, max_num_batched_tokens=96, max_batch_size=4))
    try:
        outs = batch_model.generate(prompts, max_new_tokens=NEW_TOKENS, ignore_eos=True, **sampling)
        stats = batch_model.stats()
    finally:
        batch_model.close()
    for i, (alone, together) in enumerate(zip(solo, outs)):
        assert together.token_ids == alone, f"prompt {i} differs in the batch"
    assert stats["preemptions"] > 0, "the pool was meant to force preemption"
    assert sum(o.num_preemptions for o in outs) == stats["preemptions"]
    assert stats["blocks_used"] == 0
