"""Memory a GPU worker shares with its matchers' process (hub/mask_process.py): the process
writes a step's masks there, then a counter word, and the device waits for the word before it
copies the masks (engine/device_wait.py, engine/grammar.py). Neither the worker's thread nor
the socket carries the masks then; the socket answers only with the fill's trailer.

Layout: one page holding the word (the number of the last fill written), then two turns of
`rows` rows of `width` 32-bit words, used in turn as the worker's pinned buffers are: a
turn is written again only two fills later, after the device has copied it. The worker makes
it (an anonymous memory file) and the process maps it by its /proc path; it goes away with
the last of them.
"""

from __future__ import annotations

import mmap
import os

import numpy as np

HEADER_BYTES = 4096


class SharedMasks:
    def __init__(self, rows: int, width: int, fd: int | None = None) -> None:
        """A new region (fd None: made here) of two turns of rows x width words, or the one
        open on `fd`."""
        self.rows, self.width = rows, width
        self.size = HEADER_BYTES + 2 * rows * width * 4
        if fd is None:
            fd = os.memfd_create("qmigrate-masks")
            os.ftruncate(fd, self.size)
        self.fd = fd
        self.map = mmap.mmap(fd, self.size)
        whole = np.frombuffer(self.map, dtype=np.uint8)
        self.address = whole.ctypes.data
        self.word = whole[:4].view(np.uint32)
        self.turns = whole[HEADER_BYTES:].view(np.uint32).reshape(2, rows, width)

    @classmethod
    def attach(cls, path: str, rows: int, width: int) -> "SharedMasks":
        """The region another process made (`path`: its /proc path); OSError where it cannot."""
        fd = os.open(path, os.O_RDWR)
        region = cls(rows, width, fd)
        if os.fstat(fd).st_size < region.size:
            region.close()
            raise OSError(f"{path}: smaller than {rows} rows of {width} words")
        return region

    @property
    def path(self) -> str:
        return f"/proc/{os.getpid()}/fd/{self.fd}"

    def close(self) -> None:
        self.word = self.turns = None
        try:
            self.map.close()
        except BufferError:   # a view still held (a copy in flight): the map goes with the process
            pass
        os.close(self.fd)
