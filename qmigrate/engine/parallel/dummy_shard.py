"""A tensor-parallel rank's shard of a model with dummy weights (`load_format: dummy`), made on
the rank's own device: no rank holds the whole model, and no weight travels between ranks.

Every rank builds the transformers model on the meta device (hub/loading.py's
model_structure), makes what lies outside the decoder layers (embeddings, final norm, output
head, rotary frequencies) on its device, then each decoder layer in turn: the layer's
tensors made there (hub/dummy.py's materialize: the model's own initialisation, then the
matrices filled by their names), built into the fast runner's layer, cut into this rank's
shard (parallel.sharding.shard_model), and dropped back to the meta device before the
next. The device then holds at most one whole layer beside the shard, and since a dummy
weight's values depend only on its name, each shard is the slice of the model that
load_model(..., load_format="dummy") makes on a device of the same type.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from qmigrate.engine.parallel.sharding import TensorParallel, shard_model
from qmigrate.hub.dummy import materialize


def dummy_shard(model, tp: TensorParallel, seed: int = 0):
    """This rank's shard (a DecoderModel on tp.device) of `model`, a transformers model on the
    meta device, with the dummy weights load_model's dummy format gives it. `model` is left
    on the meta device."""
    from qmigrate.engine import models
    base = model.model
    layers = base.layers
    base.layers = torch.nn.ModuleList()   # everything but the layers first
    try:
        materialize(model, model, tp.device, seed)
    finally:
        base.layers = layers
    if getattr(model.config, "tie_word_embeddings", False):   # made apart above: tied again
        model.get_output_embeddings().weight = model.get_input_embeddings().weight
    try:
        stream = models.decoder_layers(model)   # the rotary tables, once, on the device
        return shard_model(models.build(model, layers=[]), tp, layers=_layers_made(model, stream, tp.device, seed))
    finally:
        model.to("meta")
        if tp.device.type == "cuda":   # the whole layers and ends made: not held, not to be counted as held
            torch.cuda.empty_cache()


def _layers_made(model, stream: Iterator, device: torch.device, seed: int) -> Iterator:
    """The fast runner's layers of `model`, each made on `device` just before it is handed out
    and its module dropped back to the meta device once the next is asked for."""
    for module in model.model.layers:
        materialize(model, module, device, seed)
        yield next(stream)
        module.to("meta")
