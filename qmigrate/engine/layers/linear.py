"""A linear layer and how a tensor-parallel worker may split it.

`parallel` names the split: "column" (output features; q/k/v, gate/up), "row" (input
features; o, down, whose outputs are summed), "vocab" (the rows of the output head) or
"replicated". A fused projection records its `parts` (e.g. the q, k and v widths) so the
split can cut each part apart rather than the concatenation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

PARALLEL = ("column", "row", "vocab", "replicated")


@dataclass(slots=True)
class Linear:
    weight: torch.Tensor                  # [out, in]
    bias: torch.Tensor | None
    parallel: str
    parts: tuple[int, ...] = ()           # widths of fused projections along `out`

    def __post_init__(self):
        if self.parallel not in PARALLEL:
            raise ValueError(f"parallel must be one of {PARALLEL}, got {self.parallel!r}")
        if self.parts and sum(self.parts) != self.weight.shape[0]:
            raise ValueError(f"parts {self.parts} do not add up to {self.weight.shape[0]} outputs")

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

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
