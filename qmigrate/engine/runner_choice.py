"""The runner protocol (what the engine asks of a forward pass) and the choice of runner
for a model and device."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Protocol

import torch

from .hf_runner import HFRunner
from .kvcache import BlockPool

if TYPE_CHECKING:
    from .batch import StepBatch
    from .runner import EngineConfig

log = logging.getLogger(__name__)

RUNNERS = ("auto", "fast", "hf")


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


def make_runner(model, cfg: EngineConfig, device: torch.device, tp=None) -> tuple[Runner, str]:
    """(runner, why it was chosen): the fast runner on a GPU for every family engine/models/
    defines, or when forced; the transformers runner otherwise (saying why). Tensor
    parallelism needs the fast runner: its model is sharded for this rank, the shards of
    the other ranks sent from rank 0 (scatter.py)."""
    if tp is not None:
        from . import models
        from .graph_runner import GraphRunner
        from .scatter import scatter_shards
        reason = models.unsupported(model, device) or ("runner 'hf' was asked for" if cfg.runner == "hf" else None)
        if reason is not None:
            raise ValueError(f"tensor parallelism needs the fast runner, which cannot run this model: {reason}")
        return GraphRunner(scatter_shards(models.build(model), tp), max_batch=cfg.max_batch,
                           max_tokens=cfg.max_batch_tokens, cuda_graphs=cfg.cuda_graphs,
                           shared_prefix_attention=cfg.shared_prefix_attention), \
            f"{models.family(model)} family, tensor parallel rank {tp.rank} of {tp.world}"
    if cfg.runner == "hf":
        return HFRunner(model, max_padding=cfg.max_padding), "forced by the runner setting"
    if cfg.runner == "auto" and device.type != "cuda":
        return HFRunner(model, max_padding=cfg.max_padding), "the fast runner is for GPUs"
    from . import models
    from .graph_runner import GraphRunner
    reason = models.unsupported(model, device)
    if reason is None:
        why = "forced by the runner setting" if cfg.runner == "fast" else f"{models.family(model)} family on a GPU"
        return GraphRunner(models.build(model), max_batch=cfg.max_batch, max_tokens=cfg.max_batch_tokens,
                           cuda_graphs=cfg.cuda_graphs, shared_prefix_attention=cfg.shared_prefix_attention), why
    if cfg.runner == "fast":
        raise ValueError(f"runner 'fast' cannot run this model: {reason}")
    log.warning("the fast runner cannot run this model (%s): using the transformers runner", reason)
    return HFRunner(model, max_padding=cfg.max_padding), reason
