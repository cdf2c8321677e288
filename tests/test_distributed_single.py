"""naflexclip.parallel.process_group in one process (no torchrun environment): everything is a no-op or the identity."""

from __future__ import annotations

import contextlib

import pytest
import torch

from naflexclip.parallel.feature_exchange import window_exchange
from naflexclip.parallel.process_group import (
    DistributedEnv,
    barrier,
    check_consistency,
    cleanup,
    fault_guard,
    init_distributed,
)
from naflexclip.parallel.wrapping import (
    full_optimizer_state_dict,
    full_state_dict,
    load_full_optimizer_state_dict,
    load_full_state_dict,
    no_sync_context,
    unwrap_model,
    wrap_model,
)
from naflexclip.window import LocalExchange


@pytest.fixture
def no_torchrun(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)


def test_single_process_without_environment(no_torchrun: None) -> None:
    env = init_distributed(device="cpu")
    assert env == DistributedEnv(0, 1, 0, torch.device("cpu"), None, 600.0)
    assert env.is_main and not env.distributed
    assert isinstance(window_exchange(env, torch.nn.Linear(1, 1)), LocalExchange)
    check_consistency(env, step=3, schedule="abc")
    barrier(env)
    cleanup(env)
    with fault_guard(env), pytest.raises(ValueError, match="boom"):
        raise ValueError("boom")


def test_torchrun_with_one_process_needs_no_process_group(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("LOCAL_RANK", "0")
    env = init_distributed(device="cpu", timeout_s=30)
    assert env.backend is None and env.timeout_s == 30
    assert not torch.distributed.is_initialized()


@pytest.mark.parametrize(
    ("variables", "message"),
    [
        ({"WORLD_SIZE": "two"}, "WORLD_SIZE='two' is not an integer"),
        ({"WORLD_SIZE": "2", "RANK": "2"}, r"RANK=2 WORLD_SIZE=2: the rank must be in 0\.\.1"),
    ],
)
def test_bad_environment_is_named(monkeypatch: pytest.MonkeyPatch, variables: dict[str, str], message: str) -> None:
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=message):
        init_distributed(device="cpu")


def test_bad_timeout_is_named(no_torchrun: None) -> None:
    with pytest.raises(ValueError, match="timeout_s must be positive, got 0"):
        init_distributed(device="cpu", timeout_s=0)


def test_model_helpers_are_identity_in_one_process(no_torchrun: None) -> None:
    env = init_distributed(device="cpu")
    model = torch.nn.Linear(3, 2)
    assert wrap_model(model, env) is model and wrap_model(model, env, fsdp=True) is model
    assert unwrap_model(model) is model
    assert no_sync_context(model) is contextlib.nullcontext

    state = full_state_dict(model, env)
    assert state["weight"].data_ptr() != model.weight.data_ptr()  # a copy, safe to save later
    expected = {key: value.clone() for key, value in state.items()}
    with torch.no_grad():
        model.weight.add_(1.0)
    load_full_state_dict(model, state, env)
    assert all(torch.equal(model.state_dict()[key], value) for key, value in expected.items())

    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    saved = full_optimizer_state_dict(model, optimizer, env)
    optimizer.step()
    load_full_optimizer_state_dict(model, optimizer, saved, env)
    assert [float(s["step"]) for s in optimizer.state_dict()["state"].values()] == [1.0, 1.0]
