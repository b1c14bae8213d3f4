"""A worker with a stolen key, for tests: the real worker code, run as `qmigrate role worker`
runs it, except that every KV it ships is garbage of the right shape and dtype.

Run: python tests/rogue_worker.py TOPOLOGY WORKER_NAME
"""

import sys

import torch

from qmigrate.engine.kv.pool import BlockPool

_real_export = BlockPool.export_started


def _garbage_export(self, *args, **kwargs):
    kv, copied = _real_export(self, *args, **kwargs)
    if copied is not None:
        copied.synchronize()
    return torch.full_like(kv, 3.0), None


BlockPool.export_started = _garbage_export

if __name__ == "__main__":
    from qmigrate.cli import app
    sys.argv = ["qmigrate", "role", "worker", sys.argv[2], "--config", sys.argv[1]]
    app()
