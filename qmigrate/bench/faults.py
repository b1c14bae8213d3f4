"""Faults injected into a benchmark's pipeline run (`qmigrate bench --faults`).

They measure how long a sequence takes to move once the router has decided it must: worker 1
is drained at 20% of the workload's tokens, worker 2 is killed (SIGKILL) at 40%, and worker 3
is reported short of memory at 60% (its GPU falls to 1 MiB free in the VRAM reports the router
reads). Load balancing moves sequences as a consequence. The router records, per cause, the
time from the decision (the drain, the death being noticed, the low report, the revoke for
load) to the sequence's first lease on another worker; the run prints the median and maximum.

A killed worker is noticed after `router.heartbeat_timeout_s` of silence: that detection time
comes before the delay measured here."""

from __future__ import annotations

import os
import signal
import sys
import time

import zmq

from qmigrate.wire import protocol as P
from qmigrate.wire import transport

DRAIN_AT, KILL_AT, MEMORY_AT = 0.2, 0.4, 0.6
REPORT_EVERY_S = 0.05  # PUB drops what is sent before the router's SUB has connected: repeat
SHORT_FREE_BYTES = 1 << 20  # what another process leaves free on the short worker's GPU


class Faults:
    def __init__(self, topo, children, devices: list[str]):
        if len(topo.workers) < 4:
            raise ValueError("--faults needs at least 4 workers: one drained, one killed, one short of memory "
                             "and one to take their work")
        self.drained, self.killed, self.short = (w.name for w in topo.workers[:3])
        self.router = topo.endpoint("router").connect
        self.pids = {c.name: c.proc.pid for c in children if c.role == "worker"}
        self.uuid = self._uuid(devices, 2)
        self.telemetry = transport.socket(zmq.PUB, connect=topo.endpoint("telemetry").connect)
        self.done: set[str] = set()
        self.reported_at = 0.0

    @staticmethod
    def _uuid(devices: list[str], index: int) -> str | None:
        """The id the worker's VRAM is reported under; None when it shares its GPU (a low report
        would then stop every worker on it)."""
        device = devices[index]
        if device == "cpu":
            return f"CPU-w{index + 1}"  # workers are w1, w2, ... (see bench.pipeline.run_pipeline)
        if devices.count(device) > 1:
            return None
        from qmigrate.monitor.vram import torch_device_uuid
        return torch_device_uuid(int(device.partition(":")[2] or 0))

    def __call__(self, fraction: float) -> None:
        if fraction >= DRAIN_AT and "drain" not in self.done:
            self.done.add("drain")
            reply = transport.request(self.router, P.Drain(self.drained), timeout_s=5.0, expect=P.DrainAck)
            print(f"  fault at {fraction:.0%} of the tokens: {reply.message}", file=sys.stderr)
        if fraction >= KILL_AT and "kill" not in self.done:
            self.done.add("kill")
            os.kill(self.pids[self.killed], signal.SIGKILL)
            print(f"  fault at {fraction:.0%} of the tokens: worker {self.killed} killed", file=sys.stderr)
        if fraction >= MEMORY_AT and self.uuid is not None:
            if "memory" not in self.done:
                self.done.add("memory")
                print(f"  fault at {fraction:.0%} of the tokens: worker {self.short} reported at "
                      f"{SHORT_FREE_BYTES >> 20} MiB free (another process took the rest)", file=sys.stderr)
            now = time.monotonic()
            if now - self.reported_at >= REPORT_EVERY_S:
                total = 80 << 30
                free = SHORT_FREE_BYTES
                transport.send(self.telemetry, P.VramReport("bench", [[self.uuid, 2, total, total - free, free, 0]]))
                self.reported_at = now

    def close(self) -> None:
        if self.uuid is None:
            print(f"  no memory fault: {self.short} shares its GPU with another worker", file=sys.stderr)
        self.telemetry.close(linger=0)
