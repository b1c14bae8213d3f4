"""How many CPU threads a worker process (or a tensor-parallel rank) gives torch."""

from __future__ import annotations

import os

import torch


def share_cpu_threads(topo, cfg) -> None:
    """Split the node's cores between its CPU workers; a GPU worker needs only a few for
    host-side work, and a full-width thread pool per process just fights the others."""
    cores = os.cpu_count() or 1
    if cfg.device == "cpu":
        peers = sum(w.tensor_parallel_size for w in topo.workers if w.node == cfg.node and w.device == "cpu")
        torch.set_num_threads(max(1, cores // max(1, peers)))
    else:
        torch.set_num_threads(min(4, cores))
