"""Shared fixtures: the tiny model built offline, and a runner for real `qmigrate` processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    from qmigrate.engine.models import build_tiny_model
    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny")


@dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str

    def records(self) -> list[dict]:
        return [json.loads(line) for line in self.stdout.splitlines() if line.strip()]

    def finals(self) -> dict[str, dict]:
        return {r["id"]: r for r in self.records() if r.get("done")}


def run_qmigrate(*args: str, stdin: str = "", timeout: float = 180, env: dict | None = None) -> Run:
    """Run the real CLI in a child process and wait for it (no process is left behind)."""
    proc = subprocess.Popen([sys.executable, "-m", "qmigrate", *args], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **(env or {})}, start_new_session=True)
    try:
        out, err = proc.communicate(stdin, timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, err = proc.communicate()
        pytest.fail(f"qmigrate {' '.join(args)} hung for {timeout} s\nstderr:\n{err[-3000:]}")
    return Run(proc.returncode, out, err)


@pytest.fixture
def qmigrate():
    return run_qmigrate
