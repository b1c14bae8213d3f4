"""A wide sweep of the FP8 weight-read kernel's tilings on the Llama-3.1-8B shape's four
projections, beyond the candidates the engine tunes (engine/fp8_plan.py): the fp16
tensor-core form (`f16`) at 1, 16 and 64 rows over block sizes, split-K and stages. For each
shape and row count: bf16 (cuBLAS) against the fastest tiling of all and the fastest without
`f16`, then the six fastest; last, the sums over a layer.

Run: `python -m benchmarks.fp8_sweep` (CUDA, compute capability 9.0; a minute on an H200).
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

from qmigrate.engine import fp8
from qmigrate.engine.fp8_plan import CANDIDATES, MAX_ERROR, W8
from qmigrate.engine.fp8_tune import tiling_error, time_us

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
COPIES = 8
ROWS = (1, 16, 64)


def candidates() -> dict[int, list]:
    cands = {m: list(CANDIDATES[m]) for m in ROWS}
    for bn, bk, sk, st in itertools.product((32, 64, 128), (128, 256), (1, 2, 4), (3, 4)):
        for m in (1, 16):
            how = W8(bn, bk, sk, 8 if bn == 128 else 4, st, swap=True, f16=True)
            if how not in cands[m]:
                cands[m].append(how)
    for bn, bk, sk, swap in itertools.product((64, 128), (64, 128), (1, 2), (True, False)):
        cands[64].append(W8(bn, bk, sk, 8 if bn == 128 else 4, 3, swap=swap, f16=True))
    return cands


def main() -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    cands = candidates()
    sums = {m: [0.0, 0.0, 0.0] for m in ROWS}      # bf16, fastest, fastest without f16
    for name, (n, k) in SHAPES.items():
        bf16 = [(torch.randn(n, k, device="cuda", generator=g) * 0.02).to(torch.bfloat16) for _ in range(COPIES)]
        quant = [fp8.quantize_rows(w) for w in bf16]
        for m in ROWS:
            x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
            base = time_us(lambda w, s: F.linear(x, w), [(w, None) for w in bf16])
            rows = []
            for how in cands[m]:
                try:
                    if how is not None and tiling_error(x, *quant[0], how) > MAX_ERROR:
                        print(f"  {name} at {m} rows: {how} is off the reference")
                        continue
                    rows.append((time_us(lambda w, s: fp8.product(x, w, s, None, how), quant), str(how or "scaled_mm")))
                except Exception as exc:   # noqa: BLE001 -- a tiling this GPU cannot take
                    print(f"  {name} at {m} rows: {how}: {str(exc).splitlines()[0][:100]}")
            rows.sort()
            plain = min(r for r in rows if " f16" not in r[1])
            print(f"{name} m={m}: bf16 {base:.1f} us ({n * k * 2 / base / 1e3:.0f} GB/s); "
                  f"fastest {rows[0][1]} {rows[0][0]:.1f} us ({n * k / rows[0][0] / 1e3:.0f} GB/s); "
                  f"without f16 {plain[1]} {plain[0]:.1f} us", flush=True)
            for us, how in rows[:6]:
                print(f"    {how:40s} {us:7.1f}")
            for i, us in enumerate((base, rows[0][0], plain[0])):
                sums[m][i] += us
    for m, (base, best, plain) in sums.items():
        print(f"layer at {m} rows: bf16 {base:.1f} us, fp8 fastest {best:.1f} ({base / best:.2f}x), "
              f"without f16 {plain:.1f} ({base / plain:.2f}x)")


if __name__ == "__main__":
    main()
