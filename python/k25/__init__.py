"""k25: an embeddable single-node LLM inference engine.

    from k25 import K25Config, K25Model
    model = K25Model(K25Config())            # the default model, smollm2-135m-instruct
    print(model.generate(["Hello"], max_new_tokens=32, temperature=0.0)[0].text)
"""
from . import errors
from .config import DEFAULT_MODEL, K25Config
from .model import GenerationOutput, K25Model, TokenLogprob

__all__ = ["K25Config", "K25Model", "GenerationOutput", "TokenLogprob", "DEFAULT_MODEL", "errors"]
__version__ = "0.1.0"
