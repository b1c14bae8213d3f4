"""A tensor-parallel worker's start with dummy weights, on the CPU (gloo): the seconds from
spawning the ranks to rank 0's engine built (every rank's shard made and the KV pool agreed,
worker/ranks.py's path), and the peak resident memory of rank 0 and of the largest follower.

The model is a Llama shape (hub/shapes.py's llama-3.1-8b config with the sizes below; the
defaults make 1.8 GB of float32 weights) with the built-in tiny model's tokenizer. Prints one
JSON line; --out also writes it there.

    python -m benchmarks.tp_dummy_start [--world 2] [--hidden 1024 --layers 24 ...] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import resource
import tempfile
import time
from pathlib import Path

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--out", default=None)
    a = parser.parse_args()

    from qmigrate.config import local_topology, parse_topology
    from qmigrate.hub.loading import ensure_default_model
    from qmigrate.hub.shapes import shape_config, write_shape
    from qmigrate.worker import ranks

    config = dict(shape_config("llama-3.1-8b"), hidden_size=a.hidden, intermediate_size=a.intermediate,
                  num_hidden_layers=a.layers, num_attention_heads=a.heads, num_key_value_heads=a.kv_heads,
                  vocab_size=a.vocab, max_position_embeddings=2048, rope_scaling=None)
    with tempfile.TemporaryDirectory(prefix="tp-dummy-start-") as tmp:
        shape = str(write_shape(config, ensure_default_model(), Path(tmp) / "shape"))
        data = local_topology(1, shape, ipc_dir=tmp).to_dict()
        data["model"].update(load_format="dummy", dtype=a.dtype)
        data["workers"][0].update(tensor_parallel_size=a.world, max_kv_tokens=2048, max_num_seqs=4)
        topo = parse_topology(data)
        torch.set_num_threads(1)
        before_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        t0 = time.monotonic()
        group = ranks.Ranks(topo, "w1", shape)
        engine = ranks.build_engine(topo, "w1", shape, group.tp)
        started_s = time.monotonic() - t0
        rank0_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        params = engine.shape.num_params
        group.stop(engine.runner)
        follower_kb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    dtype_bytes = torch.empty(0, dtype=getattr(torch, a.dtype)).element_size()
    res = {"world": a.world, "dtype": a.dtype, "params": params, "weights_gb": params * dtype_bytes / 1e9,
           "started_s": round(started_s, 2), "rank0_peak_rss_gb": round(rank0_kb / 1e6, 2),
           "rank0_peak_rss_before_start_gb": round(before_kb / 1e6, 2),
           "follower_peak_rss_gb": round(follower_kb / 1e6, 2)}
    print(json.dumps(res), flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=2) + "\n")


if __name__ == "__main__":
    main()
