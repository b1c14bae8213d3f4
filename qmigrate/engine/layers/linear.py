"""A linear layer and how a tensor-parallel worker may split it.

`parallel` names the split: "column" (output features; q/k/v, gate/up), "row" (input
features; o, down, whose outputs are summed), "vocab" (the rows of the output head) or
"replicated". A fused projection records its `parts` (e.g. the q, k and v widths) so the
split can cut each part apart rather than the concatenation.

`quantize_fp8` turns the weight into e4m3 with one scale per output row (engine/fp8.py); the
layer then multiplies on the FP8 tensor cores, its input quantized per token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from qmigrate.engine import fp8

PARALLEL = ("column", "row", "vocab", "replicated")


@dataclass(slots=True)
class Linear:
    weight: torch.Tensor                  # [out, in]
    bias: torch.Tensor | None
    parallel: str
    parts: tuple[int, ...] = ()           # widths of fused projections along `out`
    scale: torch.Tensor | None = None     # [out, 1] fp32 when the weight is e4m3 (quantize_fp8)

    def __post_init__(self):
        if self.parallel not in PARALLEL:
            raise ValueError(f"parallel must be one of {PARALLEL}, got {self.parallel!r}")
        if self.parts and sum(self.parts) != self.weight.shape[0]:
            raise ValueError(f"parts {self.parts} do not add up to {self.weight.shape[0]} outputs")

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.product(x)

    def product(self, x: torch.Tensor) -> torch.Tensor:
        """x @ weight.T + bias, in FP8 when the weight is."""
        if self.scale is None:
            return F.linear(x, self.weight, self.bias)
        return fp8.matmul(x, self.weight, self.scale, self.bias)

    def quantize_fp8(self) -> bool:
        """Replace the weight by its e4m3 rows and their scales; False (left as it is) when the
        FP8 matmul cannot take its shape."""
        if self.scale is not None:
            return True
        if not fp8.can_quantize(self.weight):
            return False
        self.weight, self.scale = fp8.quantize_rows(self.weight)
        return True

    @classmethod
    def of(cls, *modules, parallel: str, parts: tuple[int, ...] | None = None) -> "Linear":
        """One layer from transformers Linear modules, fused along the output when several."""
        weights = [m.weight.detach() for m in modules]
        weight = weights[0] if len(weights) == 1 else torch.cat(weights)
        biases = [m.bias for m in modules]
        if all(b is None for b in biases):
            bias = None
        else:
            bias = torch.cat([b.detach() if b is not None else w.new_zeros(w.shape[0])
                              for w, b in zip(weights, biases)])
        if parts is None:
            parts = tuple(w.shape[0] for w in weights) if len(weights) > 1 else ()
        return cls(weight, bias, parallel, tuple(parts))
