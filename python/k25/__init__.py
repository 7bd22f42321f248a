"""k25: an embeddable single-node LLM inference engine.

    from k25 import K25Config, K25Model
    model = K25Model(K25Config())            # the default model, smollm2-135m-instruct
    print(model.generate(["Hello"], max_new_tokens=32, temperature=0.0)[0].text)
"""
# k25._C links libtorch (and libtorch_python for the tensor bindings): torch's own
# Python module must initialise first, or a CUDA build crashes when torch is imported later.
import torch as _torch  # noqa: F401

from . import errors
from .config import DEFAULT_MODEL, K25Config
from .model import GenerationOutput, K25Model, StreamEvent, TokenLogprob

__all__ = ["K25Config", "K25Model", "GenerationOutput", "StreamEvent", "TokenLogprob", "DEFAULT_MODEL", "errors"]
__version__ = "0.1.0"
