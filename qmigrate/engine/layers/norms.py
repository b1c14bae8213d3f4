"""RMSNorm as Llama computes it (through the fused kernels) and Gemma's variant (scale by
1 + weight, everything in fp32)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qmigrate.engine.kernels import fused


@dataclass(slots=True)
class RMSNorm:
    weight: torch.Tensor
    eps: float
    offset: bool = False      # Gemma: x * (1 + weight), computed in fp32

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not self.offset:
            return fused.rms_norm(x, self.weight, self.eps)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + x), residual + x): a decoder layer's residual add and next norm."""
        if not self.offset:
            return fused.add_rms_norm(x, residual, self.weight, self.eps)
        residual = residual + x
        return self(residual), residual

    @classmethod
    def of(cls, module) -> "RMSNorm":
        eps = getattr(module, "variance_epsilon", None)
        if eps is None:
            eps = module.eps
        return cls(module.weight.detach(), float(eps), offset=type(module).__name__.startswith("Gemma"))
