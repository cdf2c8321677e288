"""The random-number state a window's replay restores, so a grad forward draws what its cached forward drew; the
`--seed` setting."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from naflexclip.settings import APPLY, OPTIMIZATION_SECTION, setting


@dataclass(frozen=True)
class Seed:
    """`--seed`, as `naflexclip train` and `naflexclip verify` take it (a setting, `naflexclip.settings`)."""

    seed: int = setting(0, rule=APPLY, section=OPTIMIZATION_SECTION, openclip=0,
                        help="seed of the random draws (initialisation, data order; verify's window and splits)")


class RngState:
    """The CPU and CUDA generator states before a microbatch's first forward, so that its
    grad forward draws the same dropout / drop-path / patch-dropout numbers (GradCache's RandContext).

    devices: where the forward may draw random numbers; `RngState.devices_of` gives the model's parameters'
    devices as well as the inputs' — a CUDA model fed CPU microbatches draws its dropout on the GPU.
    """

    def __init__(self, devices: Sequence[torch.device]) -> None:
        self.cuda_devices = sorted(
            {d.index if d.index is not None else torch.cuda.current_device() for d in devices if d.type == "cuda"}
        )
        self.cpu_state = torch.get_rng_state()
        self.cuda_states = [torch.cuda.get_rng_state(i) for i in self.cuda_devices]

    @staticmethod
    def devices_of(model: nn.Module, tensors: Sequence[torch.Tensor]) -> list[torch.device]:
        """Every device of the model's parameters and of the input tensors (CPU is always recorded)."""
        devices = {t.device for t in tensors} | {p.device for p in model.parameters()}
        return sorted(devices, key=str)

    @contextlib.contextmanager
    def replayed(self) -> Iterator[None]:
        """Run the block with the recorded state; the surrounding RNG stream is left untouched."""
        with torch.random.fork_rng(devices=self.cuda_devices, enabled=True):
            torch.set_rng_state(self.cpu_state)
            for index, state in zip(self.cuda_devices, self.cuda_states, strict=True):
                torch.cuda.set_rng_state(state, index)
            yield
