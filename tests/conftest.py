"""Suite-wide test setup: one torch thread per test process, GPU tests skipped without CUDA, a small dense probe."""

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


@pytest.fixture(autouse=True)
def small_dense_probe(monkeypatch: pytest.MonkeyPatch) -> None:
    """Evaluations on the built-in data fit the dense probe on 12 train and 6 validation scenes, not PROBE_SCENES'
    128 and 64: no run in these tests measures the probe's quality (tests/test_dense_probe.py does, on its own
    features), and the full-size probe was a third of a tiny run's evaluation time. A process a test starts keeps the
    full size unless its start script shrinks it too (test_launchers, test_train_torchrun, ...)."""
    from naflexclip.evaluation import dense_probe as probe

    monkeypatch.setitem(probe.PROBE_SCENES, "train", 12)
    monkeypatch.setitem(probe.PROBE_SCENES, "val", 6)
