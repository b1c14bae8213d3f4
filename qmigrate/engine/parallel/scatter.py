"""A tensor-parallel worker's weights at startup: rank 0 alone holds the checkpoint.

Rank 0 cuts every other rank's shard from its model on the CPU (parallel.sharding.shard_model with
that rank's number), one rank at a time, and sends it over the host (gloo) group; then it
cuts its own. The other ranks build the same model without weights (transformers' modules
on the meta device, hub/loading.py's load_structure), cut it the same way into empty
tensors on their devices, and receive the values. Host memory is then about one checkpoint
(on rank 0) plus one shard, where every rank loading the checkpoint needed N of them.

Both sides list a shard's tensors in the same order (`shard_tensors`: the model's layers,
field by field, each tensor once, so the rotary tables the layers share stay shared and
travel once). Before the values, rank 0 sends its list of (dtype, shape) and the follower
answers whether it matches its own: a difference (the ranks built different models) stops
both with the first tensor that differs, rather than filling wrong shapes or waiting.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from qmigrate.engine.parallel.sharding import LayoutError, TensorParallel, shard_model

CHUNK_BYTES = 64 << 20   # the most a send or a receive's staging buffer holds
MAX_DIMS = 4
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32,
          torch.int16, torch.int8, torch.uint8, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2)


def scatter_shards(model, tp: TensorParallel):
    """This rank's shard of a DecoderModel. On rank 0, `model` holds the checkpoint and every
    other rank's shard is sent from it first; on the others only its structure is read (its
    tensors may be on the meta device) and the shard's values come from rank 0."""
    if tp.world == 1:
        return shard_model(model, tp)
    if tp.is_leader:
        for rank in range(1, tp.world):
            send_shard(shard_model(model, TensorParallel(rank, tp.world, "cpu")), rank, tp)
        return shard_model(model, tp)
    shard = shard_model(model, tp, fill=False)
    receive_shard(shard, tp)
    return shard


def shard_tensors(model) -> list[torch.Tensor]:
    """Every tensor of a DecoderModel's shard, in a fixed order, each once (by identity)."""
    out, seen = [], set()

    def walk(obj):
        if obj is None or isinstance(obj, (int, float, str, bool, TensorParallel)):
            return
        if isinstance(obj, torch.Tensor):
            if id(obj) not in seen:
                seen.add(id(obj))
                out.append(obj)
        elif isinstance(obj, (list, tuple)):
            for item in obj:
                walk(item)
        elif dataclasses.is_dataclass(obj):
            for field in dataclasses.fields(obj):
                walk(getattr(obj, field.name))
        else:
            raise LayoutError(f"cannot list the tensors of a {type(obj).__name__}")

    for name in ("embed", "layers", "norm", "lm_head", "embed_scale"):
        walk(getattr(model, name))
    return out


def manifest(tensors: list[torch.Tensor]) -> torch.Tensor:
    """[n, 2 + MAX_DIMS] int64: each tensor's dtype (its index in DTYPES), dims, shape."""
    rows = torch.full((len(tensors), 2 + MAX_DIMS), -1, dtype=torch.int64)
    for i, t in enumerate(tensors):
        if t.dim() > MAX_DIMS or t.dtype not in DTYPES:
            raise LayoutError(f"a shard's tensor of dtype {t.dtype} and shape {tuple(t.shape)} cannot be sent")
        rows[i, 0], rows[i, 1] = DTYPES.index(t.dtype), t.dim()
        rows[i, 2:2 + t.dim()] = torch.tensor(t.shape, dtype=torch.int64)
    return rows


def first_difference(sent: torch.Tensor, expected: torch.Tensor) -> int:
    """The index of the first tensor whose dtype or shape differs, or -1 when none does
    (a shorter list differs where it ends)."""
    n = min(len(sent), len(expected))
    differs = (sent[:n] != expected[:n]).any(dim=1).nonzero()
    if len(differs):
        return int(differs[0])
    return -1 if len(sent) == len(expected) else n


def describe(row: torch.Tensor | None) -> str:
    if row is None or int(row[0]) < 0:
        return "no tensor"
    dtype, dims = DTYPES[int(row[0])], int(row[1])
    return f"{str(dtype).removeprefix('torch.')} {list(row[2:2 + dims].tolist())}"


def mismatch(rank: int, index: int, num_sent: int, num_expected: int, sent_row, expected_row) -> LayoutError:
    return LayoutError(f"tensor-parallel startup: rank 0 sends rank {rank} a shard of {num_sent} tensors, "
                       f"rank {rank} expects {num_expected}; tensor {index} is {describe(sent_row)} from rank 0, "
                       f"{describe(expected_row)} on rank {rank} (the ranks built different models)")


def _row(rows: torch.Tensor, index: int) -> torch.Tensor | None:
    return rows[index] if index < len(rows) else None


def send_shard(shard, rank: int, tp: TensorParallel) -> None:
    """Rank 0: rank `rank`'s shard (CPU tensors), after its list of shapes is agreed."""
    tensors = shard_tensors(shard)
    rows = manifest(tensors)
    dist.send(torch.tensor([len(rows)], dtype=torch.int64), rank, group=tp.host)
    dist.send(rows, rank, group=tp.host)
    reply = torch.empty(2 + rows.shape[1], dtype=torch.int64)   # index, count, the follower's row
    dist.recv(reply, rank, group=tp.host)
    index, num_expected = int(reply[0]), int(reply[1])
    if index >= 0:
        raise mismatch(rank, index, len(rows), num_expected, _row(rows, index), reply[2:])
    for t in tensors:
        flat = _bytes(t)
        for lo in range(0, flat.numel(), CHUNK_BYTES):
            dist.send(flat[lo:lo + CHUNK_BYTES], rank, group=tp.host)


def receive_shard(shard, tp: TensorParallel) -> None:
    """A follower: fill its shard's tensors (new, on its device) with what rank 0 sends."""
    tensors = shard_tensors(shard)
    expected = manifest(tensors)
    count = torch.empty(1, dtype=torch.int64)
    dist.recv(count, 0, group=tp.host)
    sent = torch.empty((int(count), expected.shape[1]), dtype=torch.int64)
    dist.recv(sent, 0, group=tp.host)
    index = first_difference(sent, expected)
    reply = torch.full((2 + expected.shape[1],), -1, dtype=torch.int64)
    reply[0], reply[1] = index, len(expected)
    if 0 <= index < len(expected):
        reply[2:] = expected[index]
    dist.send(reply, 0, group=tp.host)
    if index >= 0:
        raise mismatch(tp.rank, index, len(sent), len(expected), _row(sent, index), _row(expected, index))
    staging = None
    for t in tensors:
        flat = _bytes(t)
        for lo in range(0, flat.numel(), CHUNK_BYTES):
            part = flat[lo:lo + CHUNK_BYTES]
            if part.device.type == "cpu":
                dist.recv(part, 0, group=tp.host)
                continue
            if staging is None:
                staging = torch.empty(CHUNK_BYTES, dtype=torch.uint8)
            buf = staging[:part.numel()]
            dist.recv(buf, 0, group=tp.host)
            part.copy_(buf)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes, as a flat uint8 view (gloo moves any dtype as bytes)."""
    if not t.is_contiguous():
        raise LayoutError(f"a shard's tensor of shape {tuple(t.shape)} is not contiguous")
    return t.detach().reshape(-1).view(torch.uint8)
