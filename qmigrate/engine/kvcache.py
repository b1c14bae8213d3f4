"""A worker's KV store: one fixed slot per cached sequence, preallocated once.

Layout per layer: keys and values of shape [num_slots, num_kv_heads, max_len, head_dim].
A sequence's position p lives at [slot, :, p]. A step writes the new positions of every
row and hands attention a gathered [batch, heads, L, head_dim] view of the rows' slots,
so sequences of any mix of lengths share one forward pass and no cache is ever
reallocated when the batch changes.
"""

from __future__ import annotations

from collections import OrderedDict

import torch


class OutOfSlots(RuntimeError):
    pass


class SlotPool:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, num_slots: int,
                 max_len: int, dtype: torch.dtype, device: torch.device):
        shape = (num_slots, num_kv_heads, max_len, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.num_slots, self.max_len = num_slots, max_len
        self.dtype, self.device = dtype, device
        self.free = list(range(num_slots - 1, -1, -1))
        self.slot_of: OrderedDict[int, int] = OrderedDict()   # seq_id -> slot, LRU order
        self.length: dict[int, int] = {}                      # seq_id -> cached positions

    @property
    def num_free(self) -> int:
        return len(self.free)

    def cached_len(self, seq_id: int) -> int:
        return self.length.get(seq_id, -1)

    def allocate(self, seq_id: int, protect: set[int]) -> int:
        """A slot for seq_id, evicting the least recently used unprotected sequence if full."""
        if seq_id in self.slot_of:
            self.length[seq_id] = 0
            return self.slot_of[seq_id]
        if not self.free:
            victim = next((s for s in self.slot_of if s not in protect), None)
            if victim is None:
                raise OutOfSlots(f"all {self.num_slots} KV slots hold sequences of this batch")
            self.release(victim)
        slot = self.free.pop()
        self.slot_of[seq_id] = slot
        self.length[seq_id] = 0
        return slot

    def touch(self, seq_id: int) -> None:
        self.slot_of.move_to_end(seq_id)

    def release(self, seq_id: int) -> None:
        slot = self.slot_of.pop(seq_id, None)
        if slot is not None:
            self.free.append(slot)
            del self.length[seq_id]

    def truncate(self, seq_id: int, length: int) -> None:
        self.length[seq_id] = min(self.length[seq_id], length)

    def export(self, seq_id: int) -> torch.Tensor:
        """[num_layers, 2, heads, L, head_dim] on the CPU, contiguous, for shipping."""
        slot, n = self.slot_of[seq_id], self.length[seq_id]
        parts = [torch.stack((k[slot, :, :n], v[slot, :, :n])) for k, v in zip(self.keys, self.values)]
        return torch.stack(parts).to("cpu").contiguous()

    def load(self, seq_id: int, kv: torch.Tensor, protect: set[int]) -> None:
        n = kv.shape[3]
        if n > self.max_len:
            raise OutOfSlots(f"{n} positions do not fit a slot of {self.max_len}")
        slot = self.allocate(seq_id, protect)
        kv = kv.to(device=self.device, dtype=self.dtype)
        for layer, (k, v) in enumerate(zip(self.keys, self.values)):
            k[slot, :, :n] = kv[layer, 0]
            v[slot, :, :n] = kv[layer, 1]
        self.length[seq_id] = n


class BatchView:
    """The object handed to a transformers model as `past_key_values` for one forward.

    The model calls `update(k, v, layer)` once per layer with this step's keys and values
    ([batch, heads, new, head_dim], right-padded); we write the real ones into the rows'
    slots and return the gathered past+new keys and values for attention.
    """

    is_compileable = False

    def __init__(self, pool: SlotPool, slots: torch.Tensor, write_rows: torch.Tensor,
                 write_cols: torch.Tensor, write_slots: torch.Tensor, write_pos: torch.Tensor,
                 total_len: int, is_decode: bool = False):
        self.pool = pool
        self.slots = slots
        self.write_rows, self.write_cols = write_rows, write_cols
        self.write_slots, self.write_pos = write_slots, write_pos
        self.total_len = total_len
        self.is_decode = is_decode  # one new token per row: row i writes slots[i] at write_pos[i]

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        k_pool, v_pool = self.pool.keys[layer_idx], self.pool.values[layer_idx]
        if self.is_decode:
            k_new, v_new = key_states[:, :, 0], value_states[:, :, 0]          # [B, heads, dim]
        else:
            # [batch, heads, new, dim] -> [tokens, heads, dim] for the real (unpadded) tokens
            k_new = key_states.transpose(1, 2)[self.write_rows, self.write_cols]
            v_new = value_states.transpose(1, 2)[self.write_rows, self.write_cols]
        k_pool[self.write_slots, :, self.write_pos] = k_new.to(k_pool.dtype)
        v_pool[self.write_slots, :, self.write_pos] = v_new.to(v_pool.dtype)
        n = self.total_len
        # index_select over a length-n view copies only the live positions of each row
        return k_pool[:, :, :n].index_select(0, self.slots), v_pool[:, :, :n].index_select(0, self.slots)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.total_len
