"""The projections of a decode step in bf16 and in FP8, each path timed alone on the GPU:
Llama-3.1-8B's four matmuls of a layer (q/k/v, o, gate/up, down) at several row counts.

Paths: `bf16` (F.linear), `fp8` (engine/fp8.py's matmul as the engine calls it: the
weight-read kernel up to SMALL_M rows, torch._scaled_mm past it), `rowwise` (per-token
quantization and torch._scaled_mm with rowwise scales, at every row count), `tensorwise`
(one scale per tensor, torch._scaled_mm through cuBLAS) and `w8` (the weight-read kernel at
every row count, however slow past a few rows). Prints microseconds per layer and each path's speedup over bf16.

Run: `python -m benchmarks.fp8_gemm [--rows 1,16,32,64,128,256]` (CUDA, compute capability 9.0).
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from qmigrate.engine import fp8

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


def _time_us(fn, reps: int = 50) -> float:
    for _ in range(5):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps * 1000


def paths(x, w, wq, ws, wq_t, ws_t):
    one = torch.ones(1, device=x.device)

    def rowwise():
        xq, xs = fp8.quantize_rows(x)
        return torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws.view(1, -1), out_dtype=x.dtype)

    def tensorwise():
        xs = (x.abs().amax().float() / fp8.MAX).clamp(min=fp8.MIN_SCALE)
        xq = (x / xs).clamp(-fp8.MAX, fp8.MAX).to(fp8.DTYPE)
        return torch._scaled_mm(xq, wq_t.t(), scale_a=xs, scale_b=ws_t * one, out_dtype=x.dtype)

    return {"bf16": lambda: F.linear(x, w), "fp8": lambda: fp8.matmul(x, wq, ws),
            "rowwise": rowwise, "tensorwise": tensorwise,
            "w8": lambda: fp8._few_rows(x, wq, ws, None)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,16,32,64,128,256")
    args = parser.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    g = torch.Generator(device="cuda").manual_seed(0)
    weights = {}
    for name, (n, k) in SHAPES.items():
        w = (torch.randn(n, k, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
        wq, ws = fp8.quantize_rows(w)
        ws_t = (w.abs().amax().float() / fp8.MAX).reshape(())
        wq_t = (w.float() / ws_t).clamp(-fp8.MAX, fp8.MAX).to(fp8.DTYPE)
        weights[name] = (w, wq, ws, wq_t, ws_t)
    names = list(paths(torch.zeros(1, 16, device="cuda", dtype=torch.bfloat16), *weights["o"]))
    print(f"{'rows':>5} " + " ".join(f"{p:>11}" for p in names) + "   (us per layer: qkv + o + gate_up + down)")
    for m in rows:
        total = dict.fromkeys(names, 0.0)
        for name, (n, k) in SHAPES.items():
            x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
            for p, fn in paths(x, *weights[name]).items():
                try:
                    total[p] += _time_us(fn)
                except Exception as exc:   # noqa: BLE001 -- a path this torch or GPU lacks, or too large a tile
                    total[p] = float("nan")
                    print(f"{p} at {m} rows: {str(exc).splitlines()[0][:100]}")
        base = total["bf16"]
        print(f"{m:5d} " + " ".join(f"{total[p]:7.1f} {base / total[p]:3.1f}x" for p in names))


if __name__ == "__main__":
    main()
