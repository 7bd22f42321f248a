import pytest

from k25 import K25Config, K25Model


@pytest.fixture(scope="session")
def default_model():
    """The default model (SmolLM2-135M-Instruct GGUF), shared by the whole session."""
    m = K25Model(K25Config(num_threads=2, kv_cache_bytes=512 << 20))
    yield m
    m.close()
