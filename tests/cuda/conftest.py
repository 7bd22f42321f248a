"""tests/cuda: run on a machine with an NVIDIA GPU and a CUDA build of k25; skipped elsewhere."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "python"))

from k25 import _C  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if _C.cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA build of k25 and an NVIDIA GPU")
    for item in items:
        if "tests/cuda" in str(item.fspath):
            item.add_marker(skip)
