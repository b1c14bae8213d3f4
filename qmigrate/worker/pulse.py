"""A worker's pulse: a thread that tells the router this process is alive while its loop runs
a step, however long the step takes.

The loop's own heartbeats go between steps (they name the leases it holds, and so renew
them); a step longer than `heartbeat_timeout_s` (a long prompt on a loaded CPU, a first step
that compiles, a host thread blocked on the device) would silence them and get a live worker
declared lost. The pulse goes every heartbeat interval from this thread, on a DEALER socket of
its own (a ZeroMQ socket belongs to one thread), and says how long ago the loop last came
between two steps. A killed or stopped process sends no pulse, so the router still finds it
dead after `heartbeat_timeout_s`; a loop stuck in one step is the router's to judge from the
pulse's age (`Scheduler.pulse`), and its leases expire as before, since a pulse renews none.
"""

from __future__ import annotations

import logging
import threading
import time

import zmq

from qmigrate.wire import protocol as P
from qmigrate.wire import transport

log = logging.getLogger("qmigrate.worker")


class Pulse:
    def __init__(self, router_addr: str, name: str, interval_s: float):
        self.router_addr, self.name = router_addr, name
        self.interval_s = interval_s   # the loop updates it from each Welcome
        self.turned_at = time.monotonic()
        self.stopping = threading.Event()
        self.thread: threading.Thread | None = None

    def turned(self) -> None:
        """The loop is between two steps (called from the loop's thread)."""
        self.turned_at = time.monotonic()

    def start(self) -> None:
        if self.thread is None:
            self.thread = threading.Thread(target=self.run, name=f"pulse-{self.name}", daemon=True)
            self.thread.start()

    def stop(self) -> None:
        self.stopping.set()
        if self.thread is not None:
            self.thread.join(5.0)

    def run(self) -> None:
        # Made here, used only here. No identity: the router tells it from the worker's own
        # socket by that, and the message names the worker. Few queued: a stale pulse is worthless.
        sock = transport.socket(zmq.DEALER, connect=self.router_addr, hwm=4)
        try:
            while not self.stopping.wait(self.interval_s):
                age_ms = int(max(0.0, time.monotonic() - self.turned_at) * 1000)
                transport.send(sock, P.Pulse(self.name, age_ms))
        except zmq.ZMQError as exc:   # the context is closing under it: the process is ending
            log.warning("worker %s: pulse stopped: %s", self.name, exc)
        finally:
            sock.close(linger=0)
