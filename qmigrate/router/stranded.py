"""One line, not silence, when requests wait and no worker can take them: said once after
STRANDED_NOTICE_S of it, and again only after a worker came and went."""

from __future__ import annotations

STRANDED_NOTICE_S = 5.0  # requests waiting this long with no worker get one line on stderr


class StrandedNotice:
    def __init__(self) -> None:
        self.since: float | None = None   # when requests began to wait with no worker up
        self.told = False

    def check(self, num_waiting: int, any_worker_up: bool, any_worker: bool, now: float) -> str | None:
        """The line to say now, or None."""
        if not num_waiting or any_worker_up:
            self.since, self.told = None, False
            return None
        if self.since is None:
            self.since = now
        elif not self.told and now - self.since >= STRANDED_NOTICE_S:
            self.told = True
            why = "every worker has left" if any_worker else "no worker has joined"
            return f"{num_waiting} requests are waiting and {why}; they run when a worker joins"
        return None
