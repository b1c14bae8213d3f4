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
