"""Suite-wide test setup: one torch thread per test process, GPU tests skipped without CUDA."""

import os

import pytest
import torch

# pytest-xdist runs one worker per core: a second intra-op thread per worker only oversubscribes
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
