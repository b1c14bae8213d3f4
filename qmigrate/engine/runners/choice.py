"""The choice of runner for a model and device."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from qmigrate.engine.runners.hf import HFRunner
from qmigrate.engine.runners.protocol import Runner

if TYPE_CHECKING:
    from qmigrate.engine.config import EngineConfig

log = logging.getLogger(__name__)

def make_runner(model, cfg: EngineConfig, device: torch.device, tp=None,
                load_format: str = "auto") -> tuple[Runner, str]:
    """(runner, why it was chosen): the fast runner on a GPU for every family engine/models/
    defines, or when forced; the transformers runner otherwise (saying why). Tensor
    parallelism needs the fast runner: its model is sharded for this rank, the shards of
    the other ranks sent from rank 0 (scatter.py), or with load_format "dummy" each rank's
    made on its own device from the model's structure (dummy_shard.py)."""
    if tp is not None:
        from qmigrate.engine import models
        from qmigrate.engine.runners.graph import GraphRunner
        reason = models.unsupported(model, device) or ("runner 'hf' was asked for" if cfg.runner == "hf" else None)
        if reason is not None:
            raise ValueError(f"tensor parallelism needs the fast runner, which cannot run this model: {reason}")
        return GraphRunner(quantized(_shard(model, tp, load_format), cfg), max_batch=cfg.max_num_seqs,
                           max_tokens=cfg.max_num_batched_tokens, cuda_graphs=not cfg.enforce_eager,
                           shared_prefix_attention=cfg.shared_prefix_attention), \
            f"{models.family(model)} family, tensor parallel rank {tp.rank} of {tp.world}"
    needs_fast = fp8_settings(cfg)
    if cfg.runner == "hf":
        if needs_fast:
            raise ValueError(f"{needs_fast} needs the fast runner; runner 'hf' was asked for")
        return HFRunner(model, max_padding=cfg.max_padding), "forced by the runner setting"
    if cfg.runner == "auto" and device.type != "cuda" and not needs_fast:
        return HFRunner(model, max_padding=cfg.max_padding), "the fast runner is for GPUs"
    from qmigrate.engine import models
    from qmigrate.engine.runners.graph import GraphRunner
    reason = models.unsupported(model, device)
    if reason is None:
        why = "forced by the runner setting" if cfg.runner == "fast" else f"{models.family(model)} family on a GPU"
        return GraphRunner(quantized(models.build(model), cfg), max_batch=cfg.max_num_seqs, max_tokens=cfg.max_num_batched_tokens,
                           cuda_graphs=not cfg.enforce_eager,
                           shared_prefix_attention=cfg.shared_prefix_attention), why
    if cfg.runner == "fast":
        raise ValueError(f"runner 'fast' cannot run this model: {reason}")
    if needs_fast:
        raise ValueError(f"{needs_fast} needs the fast runner, which cannot run this model: {reason}")
    log.warning("the fast runner cannot run this model (%s): using the transformers runner", reason)
    return HFRunner(model, max_padding=cfg.max_padding), reason


def _shard(model, tp, load_format: str):
    """This rank's shard: made here (dummy weights), or cut from rank 0's checkpoint."""
    if load_format == "dummy":
        from qmigrate.engine.parallel.dummy_shard import dummy_shard
        return dummy_shard(model, tp)
    from qmigrate.engine import models
    from qmigrate.engine.parallel.scatter import scatter_shards
    return scatter_shards(models.build(model), tp)


def fp8_settings(cfg: EngineConfig) -> str:
    """The FP8 settings asked for, as words ("" when none): only the fast runner has them."""
    on = [f"quantization {cfg.quantization}" if cfg.quantization != "none" else "",
          f"kv_cache_dtype {cfg.kv_cache_dtype}" if cfg.kv_cache_dtype != "auto" else ""]
    return " and ".join(x for x in on if x)


def quantized(model, cfg: EngineConfig):
    """The built model (this rank's shard) with its projections in FP8 when the settings ask."""
    if cfg.quantization == "fp8":
        from qmigrate.engine.models.base import quantize_fp8
        done, left = quantize_fp8(model)
        log.info("quantization fp8: %d projections in e4m3%s", done,
                 f", {left} left unquantized (a dimension not a multiple of 16)" if left else "")
    return model
