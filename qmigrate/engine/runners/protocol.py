"""The runner protocol: what the engine asks of a forward pass and of its KV pool's moves."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

if TYPE_CHECKING:
    from qmigrate.engine.batch import StepBatch
    from qmigrate.engine.kv.pool import BlockPool


@runtime_checkable
class Runner(Protocol):
    """What the engine asks of a runner (the graph runner, the transformers runner, or rank 0
    of a tensor-parallel group, which also sends every step and KV move to its other ranks).

    forward(batch, feed) returns float32 logits [B, V] of each row's last token; `feed` =
    (rows, src, tokens) says the input of row rows[k] (a decode row) is tokens[src[k]], a
    tensor on the device that the previous step sampled: only a runner with can_feed takes
    one (the engine gives the others the ids on the host). attach() hands it the KV pool
    (None: drop it); with capture it may capture CUDA graphs over the pool. eager_sizes()
    lists the padded token counts of steps it runs eagerly, for the warm-up to run once.

    export_kv(seq_id, num_tokens, start) is the KV of the sequence's positions [start,
    num_tokens) (all it holds by default) as [layers, 2, tokens, kv_heads, head_dim] on the
    CPU, every KV head of the model, and a CUDA event after which the tensor holds it (None:
    it holds it now). import_kv places such KV of positions [start, start + tokens) for
    seq_id, evicting sequences outside `protect` for room; False when there is none. `ids`
    (the sequence's ids up to there) and `salt` let the pool cache its full blocks."""

    name: str
    can_feed: bool

    def attach(self, pool: BlockPool | None, capture: bool = True) -> None: ...

    def forward(self, batch: StepBatch, feed=None) -> torch.Tensor: ...

    def eager_sizes(self) -> list[int]: ...

    def export_kv(self, seq_id: int, num_tokens: int | None = None,
                  start: int = 0) -> tuple[torch.Tensor, object]: ...

    def import_kv(self, seq_id: int, kv: torch.Tensor, protect=frozenset(), start: int = 0) -> bool: ...
