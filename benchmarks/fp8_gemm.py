"""The projections of a decode step in bf16 and in FP8, each path timed alone on the GPU:
Llama-3.1-8B's four matmuls of a layer (q/k/v, o, gate/up, down) at several row counts.

First the engine's own tuning (engine/fp8_tune.py) runs on COPIES weights of each shape and
its table is printed: every candidate tiling of the weight-read kernel, and per-token
quantization with torch._scaled_mm at 64 rows, in microseconds a call. Then, per row count,
the paths: `bf16` (F.linear, cuBLAS), `fp8` (engine/fp8.py's matmul as the engine calls it,
with the tuned choice) and `rowwise` (per-token quantization and torch._scaled_mm at every
row count). Each path runs in a CUDA graph over the COPIES weights of a shape (several
hundred MB, past the L2 cache), so launch overhead stays out; microseconds per layer (the
four projections), each path's speedup over bf16, and the weight bytes a layer's fp8 path
reads over its time.

Run: `python -m benchmarks.fp8_gemm [--rows 1,2,4,8,16,32,64,128,256]` (CUDA, compute capability 9.0).
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from qmigrate.engine import fp8, fp8_plan, fp8_tune
from qmigrate.engine.fp8_tune import time_us

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
COPIES = 8


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,2,4,8,16,32,64,128,256")
    args = parser.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    g = torch.Generator(device="cuda").manual_seed(0)
    bf16, quant = {}, {}
    for name, (n, k) in SHAPES.items():
        bf16[name] = [((torch.randn(n, k, device="cuda", generator=g) * 0.02).to(torch.bfloat16), None)
                      for _ in range(COPIES)]
        quant[name] = [fp8.quantize_rows(w) for w, _ in bf16[name]]
    report = []
    fp8_plan.forget()
    fp8_tune.tune({SHAPES[name]: ws for name, ws in quant.items()}, torch.bfloat16, report)
    print("tuning (us a call, graph over the copies): bucket rows, weight [n, k], candidate")
    for b, n, k, cand, us in report:
        mark = " <" if fp8_plan.choice(b, n, k) == _parse(cand) else ""
        print(f"  {b:3d} [{n:5d},{k:5d}] {cand:32s} {us:8.1f}{mark}")
    paths = ("bf16", "fp8", "rowwise")
    print(f"{'rows':>5} " + " ".join(f"{p:>13}" for p in paths) + "  fp8 GB/s   (us a layer: qkv + o + gate_up + down)")
    layer_bytes = sum(n * k for n, k in SHAPES.values())
    for m in rows:
        total = dict.fromkeys(paths, 0.0)
        for name, (n, k) in SHAPES.items():
            x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
            calls = {"bf16": (lambda w, s: F.linear(x, w), bf16[name]),
                     "fp8": (lambda w, s: fp8.matmul(x, w, s), quant[name]),
                     "rowwise": (lambda w, s: fp8.product(x, w, s, None, fp8_plan.SCALED_MM), quant[name])}
            for p, (call, weights) in calls.items():
                try:
                    total[p] += time_us(call, weights)
                except Exception as exc:   # noqa: BLE001 -- a path this torch or GPU lacks
                    total[p] = float("nan")
                    print(f"{p} at {m} rows of {name}: {str(exc).splitlines()[0][:100]}")
        base = total["bf16"]
        print(f"{m:5d} " + " ".join(f"{total[p]:8.1f} {base / total[p]:3.1f}x" for p in paths)
              + f"  {layer_bytes / total['fp8'] / 1e3:8.0f}")


def _parse(text: str):
    return next((c for cands in fp8_plan.CANDIDATES.values() for c in cands if str(c or "scaled_mm") == text), None)


if __name__ == "__main__":
    main()
