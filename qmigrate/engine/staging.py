"""A step's small host arrays, copied to the GPU from page-locked memory.

A copy from ordinary (pageable) memory goes through the driver's staging buffer: the call
itself copies, and it waits when that buffer is still held by copies queued behind the step
on the device. A step makes a dozen such copies (ids, positions, slots, lengths, block table,
sampling parameters), and at small batches their host time was most of a step's launch.
Copied from page-locked memory, each is only queued.

The memory is a ring of slots. Every step writes its arrays into one slot
(`next_step` moves on and records an event behind the copies of the slot it leaves), so a
slot is written again only once the copies from it have run: with four slots and at most
two steps in flight that wait is already over. An array that does not fit its slot's room
is copied from memory of its own, as before.
"""

from __future__ import annotations

import numpy as np
import torch

ALIGN = 64


class Stage:
    """Page-locked host memory for the copies of the step being built (CUDA); elsewhere
    `put` only wraps the array."""

    def __init__(self, device: torch.device, slot_bytes: int = 4 << 20, num_slots: int = 4):
        self.device = torch.device(device)
        self.is_pinned = self.device.type == "cuda"
        self.slot_bytes, self.num_slots = slot_bytes, num_slots
        self.slots: list[torch.Tensor] = []    # allocated at the first put
        self.events: list[object] = [None] * num_slots
        self.slot = self.used = 0
        self.num_overflows = 0                 # arrays that did not fit their slot

    def next_step(self) -> None:
        """The arrays put from now on belong to a new step."""
        if not self.is_pinned or not self.slots:
            return
        event = self.events[self.slot] = torch.cuda.Event()
        event.record()
        self.slot = (self.slot + 1) % self.num_slots
        if (old := self.events[self.slot]) is not None:
            old.synchronize()
        self.used = 0

    def put(self, a) -> torch.Tensor:
        """A CPU tensor holding `a`'s values, page-locked where the device is a GPU."""
        a = np.ascontiguousarray(a)
        if not self.is_pinned:
            return torch.from_numpy(a)
        size = -(-a.nbytes // ALIGN) * ALIGN
        if self.used + size > self.slot_bytes or a.dtype.hasobject:
            self.num_overflows += 1
            return torch.from_numpy(a).pin_memory()
        if not self.slots:
            self.slots = [torch.empty(self.slot_bytes, dtype=torch.uint8, pin_memory=True)
                          for _ in range(self.num_slots)]
        raw = self.slots[self.slot].numpy()[self.used:self.used + a.nbytes]
        self.used += size
        view = raw.view(a.dtype).reshape(a.shape)
        view[...] = a
        return torch.from_numpy(view)

    def to_device(self, a, device=None) -> torch.Tensor:
        """`a` on the device, queued without the host waiting."""
        return self.put(a).to(device or self.device, non_blocking=True)
