"""The table of docs/bench/cost.sh's runs: per round, each run's output tok/s against the
plain run of its round, and the mixed run's plain-call TPOT p50 against the plain run's.

    python docs/bench/cost_table.py OUT_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

KINDS = ("schema", "open", "lp5", "mix")


def main() -> None:
    out = Path(sys.argv[1])
    rounds = sorted(int(p.stem.split("-")[1]) for p in out.glob("plain-*.json"))
    print(f"{'round':>5} {'plain tok/s':>12} " + " ".join(f"{k + ' x':>14}" for k in KINDS)
          + f" {'TPOT p50 plain / mix-plain ms':>31}")
    for r in rounds:
        runs = {}
        for kind in ("plain",) + KINDS:
            path = out / f"{kind}-{r}.json"
            runs[kind] = json.loads(path.read_text())["runs"][0] if path.exists() else None
        plain = runs["plain"]
        cells = []
        for kind in KINDS:
            run = runs[kind]
            cells.append(f"{'-':>14}" if run is None or not plain['output_tok_per_s'] else
                         f"{run['output_tok_per_s']:7,.0f} {run['output_tok_per_s'] / plain['output_tok_per_s']:5.2f}x")
        mix = runs["mix"]
        tpot = "-" if mix is None or not plain['tpot_ms'].get('p50') or 'plain' not in mix else (f"{plain['tpot_ms']['p50']:.2f} / {mix['plain']['tpot_ms']['p50']:.2f} "
                                        f"({mix['plain']['tpot_ms']['p50'] / plain['tpot_ms']['p50']:.2f}x)")
        print(f"{r:>5} {plain['output_tok_per_s']:12,.0f} " + " ".join(cells) + f" {tpot:>31}")


if __name__ == "__main__":
    main()
