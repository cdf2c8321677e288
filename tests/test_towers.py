"""Tower memory and speed options: activation checkpointing and torch.compile keep the window exact;
compiled towers do not recompile per microbatch shape; the optimizer picks fused AdamW where it can."""

from __future__ import annotations

import functools
from pathlib import Path
from types import SimpleNamespace

import pytest
import timm.models.naflexvit
import torch
from torch._dynamo.utils import counters
from window_cases import failures, naflex_window

from naflexclip import accumulate_gradients, create_loss, create_model
from naflexclip.audit.gradient_audit import collect_gradients
from naflexclip.batch import split_batch
from naflexclip.cli import main
from naflexclip.parallel.process_group import init_distributed
from naflexclip.train.optim import adamw_implementation, create_optimizer, param_groups

STOCHASTIC = dict(drop_path_rate=0.3, proj_drop_rate=0.3, patch_drop_rate=0.25)


def _window_gradients(model: torch.nn.Module, microbatches: list[dict], method: str, seed: int) -> dict:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    accumulate_gradients(model, create_loss("clip"), microbatches, method=method, loss_scale="linear",
                         reference_batch_size=3)
    return collect_gradients(model)


@pytest.mark.parametrize("method", ["cache", "replay"])
def test_grad_checkpointing_keeps_the_window_exact_with_stochastic_layers(method, monkeypatch):
    torch.manual_seed(0)
    model = create_model("tiny", **STOCHASTIC).double().train()
    microbatches = split_batch(naflex_window(7, seed=3), [3, 1, 3])
    plain = _window_gradients(model, microbatches, method, seed=5)
    model.set_grad_checkpointing()
    assert model.visual.grad_checkpointing and model.text.transformer.grad_checkpointing
    _window_gradients(model, microbatches, method, seed=5)
    # cached forward, grad forward and the recomputation in backward drew the same dropout numbers
    assert failures(model, plain) == {}
    # teeth: a recomputation that does not restore the RNG state draws other masks and the gradient moves
    no_rng = functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=False, preserve_rng_state=False)
    monkeypatch.setattr(timm.models.naflexvit, "checkpoint", no_rng)
    _window_gradients(model, microbatches, method, seed=5)
    assert any(name.startswith("visual.blocks") for name in failures(model, plain))


def _saved_activation_bytes(model: torch.nn.Module, batch: dict) -> int:
    """Bytes autograd keeps for backward in one grad forward, weights excluded (a checkpointed block keeps
    only its input)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}  # a tensor saved by several ops (or as views) is kept once

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(**batch)
    return sum(storages.values())


def test_grad_checkpointing_keeps_fewer_activations():
    model = create_model("tiny").train()
    batch = naflex_window(16, dtype=torch.float32)
    plain = _saved_activation_bytes(model, batch)
    model.set_grad_checkpointing()
    assert _saved_activation_bytes(model, batch) < 0.5 * plain
    model.set_grad_checkpointing(False)
    assert _saved_activation_bytes(model, batch) == plain


def test_verify_passes_with_grad_checkpointing(capsys):
    assert main(["verify", "--grad-checkpointing", "--splits", "1", "--accum-freq", "3", "--batch-size", "2"]) == 0
    out = capsys.readouterr().out
    assert "grad checkpointing" in out and "PASS" in out


def _num_graphs() -> int:
    return counters["stats"]["unique_graphs"]


@pytest.mark.slow
def test_compiled_towers_do_not_recompile_per_microbatch_shape():
    # the token-budget schedule changes rows and padded length every microbatch: with dynamic shapes the
    # graphs of the first window (no-grad and grad, per compiled function) serve every later window
    windows = [split_batch(naflex_window(n, seed=n, dtype=torch.float32), sizes)
               for n, sizes in ((8, [3, 5]), (11, [4, 7]), (13, [5, 2, 6]))]

    def graphs_per_window(dynamic: bool) -> list[int]:
        torch._dynamo.reset()
        counters.clear()
        torch.manual_seed(0)
        model = create_model("tiny").train()
        model.compile_towers(dynamic=dynamic, backend="eager")  # guards, not kernels, decide recompiles
        seen = []
        for microbatches in windows if dynamic else windows[:2]:
            accumulate_gradients(model, create_loss("clip"), microbatches)
            seen.append(_num_graphs())
        return seen

    dynamic = graphs_per_window(True)
    assert dynamic[0] > 0 and dynamic[-1] == dynamic[0], dynamic
    # teeth: static shapes compile again for new shapes
    static = graphs_per_window(False)
    assert static[-1] > static[0], static
    torch._dynamo.reset()


@pytest.mark.slow
def test_compiled_towers_match_eager_within_float32_tolerance():
    # inductor (C++ code generation on CPU): forward and backward of both towers, one uneven window
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = create_model("tiny").train()
    microbatches = split_batch(naflex_window(9, seed=4, dtype=torch.float32), [4, 5])
    eager = _window_gradients(model, microbatches, "cache", seed=1)
    model.compile_towers()
    compiled = _window_gradients(model, microbatches, "cache", seed=1)
    assert failures(model, eager) == {}
    assert set(compiled) == set(eager) and _num_graphs() > 0
    torch._dynamo.reset()


def test_train_applies_grad_checkpointing_and_torchcompile(tmp_path: Path):
    from test_train_loop import tiny_config

    from naflexclip.train.loop import Trainer

    trainer = Trainer(tiny_config(tmp_path, grad_checkpointing=True, torchcompile=True), init_distributed("cpu"))
    module = trainer.module
    assert module.visual.grad_checkpointing and module.text.transformer.grad_checkpointing
    compiled = [m for m in module.modules() if getattr(m, "_compiled_call_impl", None) is not None]
    assert module.text in compiled and all(block in compiled for block in module.visual.blocks)
    # parameter names unchanged: checkpoints of compiled and eager runs are interchangeable
    assert set(module.state_dict()) == set(create_model("tiny").state_dict())


def test_train_flags_reach_the_config(monkeypatch, tmp_path: Path):
    import naflexclip.train.loop as loop

    seen = {}
    monkeypatch.setattr(loop, "train", lambda cfg: seen.setdefault("cfg", cfg))
    assert main(["train", "--model", "tiny", "--grad-checkpointing", "--torchcompile", "--logs", str(tmp_path)]) == 0
    assert seen["cfg"].grad_checkpointing and seen["cfg"].torchcompile


def test_adamw_is_fused_on_cuda_and_cpu_and_foreach_elsewhere():
    def fake(device: str) -> SimpleNamespace:
        return SimpleNamespace(device=torch.device(device), is_floating_point=lambda: True)

    assert adamw_implementation([fake("cuda:0"), fake("cuda:1")]) == {"fused": True}
    assert adamw_implementation([torch.nn.Parameter(torch.zeros(2))]) == {"fused": True}
    assert adamw_implementation([fake("cuda:0"), fake("meta")]) == {"foreach": True}
    assert adamw_implementation([]) == {"foreach": True}
    optimizer = create_optimizer(create_model("tiny"), lr=1e-3, weight_decay=0.1, betas=(0.9, 0.98), eps=1e-6)
    assert optimizer.defaults["fused"] and not optimizer.defaults["foreach"]


def test_fused_adamw_steps_like_the_per_parameter_loop():
    torch.manual_seed(0)
    models = [create_model("tiny").double() for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    fused = create_optimizer(models[0], lr=1e-2, weight_decay=0.1, betas=(0.9, 0.98), eps=1e-6)
    loop = torch.optim.AdamW(param_groups(models[1], 0.1), lr=1e-2, betas=(0.9, 0.98), eps=1e-6, foreach=False)
    for _ in range(3):
        grads = {name: torch.randn_like(p) for name, p in models[0].named_parameters()}
        for model, optimizer in zip(models, (fused, loop), strict=True):
            for name, p in model.named_parameters():
                p.grad = grads[name].clone()
            optimizer.step()
    for (name, a), b in zip(models[0].named_parameters(), models[1].parameters(), strict=True):
        assert torch.allclose(a, b, rtol=1e-12, atol=1e-14), name

