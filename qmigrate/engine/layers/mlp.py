"""Gated MLPs: SwiGLU (SiLU) and GeGLU (tanh GELU), gate and up fused into one matmul."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from qmigrate.engine.kernels import fused
from qmigrate.engine.layers.linear import Linear

ACTIVATIONS = ("silu", "gelu_pytorch_tanh", "gelu_tanh")


@dataclass(slots=True)
class GatedMLP:
    gate_up: Linear          # [2I, H]: gate rows, then up rows
    down: Linear
    act: str = "silu"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(act_and_mul(self.gate_up(x), self.act))

    @classmethod
    def of(cls, module, act: str) -> "GatedMLP":
        if act not in ACTIVATIONS:
            raise ValueError(f"activation {act!r} is not one of {ACTIVATIONS}")
        if hasattr(module, "gate_up_proj"):
            gate_up = Linear.of(module.gate_up_proj, parallel="column")
            half = gate_up.weight.shape[0] // 2
            gate_up.parts = (half, half)
        else:
            gate_up = Linear.of(module.gate_proj, module.up_proj, parallel="column")
        return cls(gate_up, Linear.of(module.down_proj, parallel="row"), act)


def act_and_mul(gate_up: torch.Tensor, act: str) -> torch.Tensor:
    """[T, 2I] = [gate | up] -> act(gate) * up [T, I]."""
    if act == "silu":
        return fused.silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up
