"""VRAM monitor: polls NVML on this node and publishes per-GPU memory to the router."""

from __future__ import annotations

import logging
import sys
import time

import zmq

from qmigrate.wire import protocol as P
from qmigrate.wire import transport
from qmigrate.monitor.vram import NvmlUnavailable, VramPoller

log = logging.getLogger("qmigrate.monitor")


def run(topo, name: str) -> int:
    try:
        poller = VramPoller()
    except NvmlUnavailable as exc:
        print(f"vram monitor {name}: NVML unavailable ({exc}); running without VRAM telemetry",
              file=sys.stderr)
        return 0
    pub = transport.socket(zmq.PUB, connect=topo.endpoint("telemetry").connect, hwm=16)
    interval = topo.monitor.interval_s
    try:
        while True:
            gpus = [[g.uuid, g.index, g.total, g.used, g.free, g.util_percent] for g in poller.poll()]
            transport.send(pub, P.VramReport(name, gpus), flags=zmq.NOBLOCK)
            time.sleep(interval)
    finally:
        poller.close()
