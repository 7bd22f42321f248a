import os

import pytest
from hypothesis import settings

# Property tests draw the same examples on every run so that CI is reproducible; set
# K25_HYPOTHESIS=explore to search new random examples locally.
settings.register_profile("ci", derandomize=True, deadline=None)
settings.register_profile("explore", deadline=None)
settings.load_profile(os.environ.get("K25_HYPOTHESIS", "ci"))

from k25 import K25Config, K25Model


@pytest.fixture(scope="session")
def default_model():
    """The default model (SmolLM2-135M-Instruct GGUF), shared by the whole session."""
    m = K25Model(K25Config(num_threads=2, kv_cache_bytes=512 << 20))
    yield m
    m.close()
