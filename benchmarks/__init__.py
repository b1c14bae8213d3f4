"""Developer probes and micro-benchmarks, apart from the product: run each from the repository
root as `python -m benchmarks.NAME` (or `python benchmarks/NAME.py` for the kernel timers).
What users run is `qmigrate bench` (qmigrate/bench/)."""

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def module_command(module: str, *args: str) -> tuple[list[str], dict[str, str]]:
    """(argv, environment) that run `python -m benchmarks.<module>` from anywhere: the
    repository root goes on the child's PYTHONPATH."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return [sys.executable, "-m", f"benchmarks.{module}", *args], {**os.environ, "PYTHONPATH": path}
