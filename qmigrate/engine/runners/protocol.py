"""The runner protocol: what the engine asks of a forward pass."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from qmigrate.engine.batch import StepBatch
    from qmigrate.engine.kv.pool import BlockPool


class Runner(Protocol):
    """What the engine asks of a runner.

    forward(batch, feed) returns float32 logits [B, V] of each row's last token; `feed` =
    (rows, src, tokens) says the input of row rows[k] (a decode row) is tokens[src[k]], a
    tensor on the device that the previous step sampled: only a runner with can_feed takes
    one (the engine gives the others the ids on the host). attach() hands it the KV pool
    (None: drop it); with capture it may capture CUDA graphs over the pool. eager_sizes()
    lists the padded token counts of steps it runs eagerly, for the warm-up to run once."""

    name: str
    can_feed: bool

    def attach(self, pool: BlockPool | None, capture: bool = True) -> None: ...

    def forward(self, batch: StepBatch, feed=None) -> torch.Tensor: ...

    def eager_sizes(self) -> list[int]: ...
