"""Arrays on the wire: token ids as packed little-endian int32, sequence ids as int64, codes
as uint8. Unpacking checks the length (and that token ids are not negative) and raises
`ProtocolError`; it never copies. `protocol` re-exports every name here."""

from __future__ import annotations

import numpy as np


class ProtocolError(ValueError):
    """Data from a peer that is not a well-formed message; the role logs it and goes on.
    `msg_type` is the message's type when that much of it was readable (else None)."""

    msg_type = None


def pack_i32(values) -> bytes:
    return np.ascontiguousarray(values, dtype="<i4").tobytes()


def pack_i64(values) -> bytes:
    return np.ascontiguousarray(values, dtype="<i8").tobytes()


def pack_u8(values) -> bytes:
    return np.ascontiguousarray(values, dtype="u1").tobytes()


def pack_f32(values) -> bytes:
    return np.ascontiguousarray(values, dtype="<f4").tobytes()


def _unpack(data: bytes, dtype: str, what: str) -> np.ndarray:
    itemsize = np.dtype(dtype).itemsize
    if len(data) % itemsize:
        raise ProtocolError(f"{what}: {len(data)} bytes is not a whole number of {dtype} items")
    return np.frombuffer(data, dtype=dtype)


def unpack_ids(data: bytes, what: str = "ids") -> np.ndarray:
    ids = _unpack(data, "<i4", what)
    if ids.size and (ids.min() < 0):
        raise ProtocolError(f"{what}: negative token id")
    return ids


def unpack_i32(data: bytes, what: str = "i32") -> np.ndarray:
    return _unpack(data, "<i4", what)


def unpack_i64(data: bytes, what: str = "i64") -> np.ndarray:
    return _unpack(data, "<i8", what)


def unpack_u8(data: bytes, what: str = "u8") -> np.ndarray:
    return _unpack(data, "u1", what)


def unpack_f32(data: bytes, what: str = "f32") -> np.ndarray:
    return _unpack(data, "<f4", what)


# Logprob rows (Tokens, Replies): per token its values (logprob[, rank], the alternatives') and ids
def pack_logprob_rows(entries: list, width: int, extra: int) -> tuple[bytes, bytes]:
    """(values, ids) arrays of entries [(values [extra + k], ids [k]) or None], each padded
    to `width` alternatives (values NaN, ids -1; None: a token without logprobs)."""
    n = len(entries)
    if n and all(e is not None and len(e[1]) == width and len(e[0]) == extra + width for e in entries):
        return (np.stack([e[0] for e in entries]).astype("<f4", copy=False).tobytes(),
                np.stack([e[1] for e in entries]).astype("<i4", copy=False).tobytes())
    values = np.full((n, extra + width), np.nan, dtype="<f4")
    ids = np.full((n, width), -1, dtype="<i4")
    for i, entry in enumerate(entries):
        if entry is not None:
            v, t = entry
            values[i, :len(v)] = v[:extra + width]
            ids[i, :len(t)] = t[:width]
    return values.tobytes(), ids.tobytes()


def unpack_logprob_rows(values: bytes, ids: bytes, num: int, width: int, extra: int) -> list:
    """The entries `pack_logprob_rows` packed (sizes were checked at decode)."""
    if num == 0:
        return []
    v = np.frombuffer(values, dtype="<f4").reshape(num, extra + width)
    t = np.frombuffer(ids, dtype="<i4").reshape(num, width)
    return [(v[i], t[i]) for i in range(num)]
