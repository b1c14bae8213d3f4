"""Arrays on the wire: token ids as packed little-endian int32, sequence ids as int64, codes
as uint8, logprobs as float32. Unpacking checks the length (and that token ids are not
negative) and raises `ProtocolError`; it never copies. `protocol` re-exports every name here."""

from __future__ import annotations

import dataclasses

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


def logprob_rows(msg, kept, keep: np.ndarray):
    """A Tokens `kept` (the rows `keep`, a boolean mask, of `msg`) with those rows' logprobs."""
    fields = {}
    if msg.lp_width >= 0:
        per_token = np.repeat(keep, unpack_i32(msg.counts))
        k = msg.lp_width
        fields.update(lp_width=k, lp_values=unpack_f32(msg.lp_values).reshape(-1, 1 + k)[per_token].tobytes(),
                      lp_top_ids=unpack_i32(msg.lp_top_ids).reshape(-1, k)[per_token].tobytes())
    if msg.prompt_width >= 0:
        counts, k = unpack_i32(msg.prompt_counts), msg.prompt_width
        per_position = np.repeat(keep, counts)
        fields.update(prompt_counts=pack_i32(counts[keep]), prompt_width=k,
                      prompt_values=unpack_f32(msg.prompt_values).reshape(-1, 2 + k)[per_position].tobytes(),
                      prompt_top_ids=unpack_i32(msg.prompt_top_ids).reshape(-1, k)[per_position].tobytes())
    return dataclasses.replace(kept, **fields) if fields else kept


def replies_with_logprobs(msg, lps, prompts):
    """A Replies with its rows' logprobs: lps[i] the (id, values, top ids) of row i's tokens
    (None: none), prompts[i] its prompt's (values, top ids) (None: none)."""
    tokens = [e for row in lps if row is not None for e in row]
    fields = dict(lp_counts=pack_i32([0 if row is None else len(row) for row in lps]),
                  lp_token_ids=pack_i32([e[0] for e in tokens]))
    entries = [None if e[1] is None else (e[1], e[2]) for e in tokens]
    width = max((len(e[1]) for e in entries if e is not None), default=0)
    fields["lp_width"] = width
    fields["lp_values"], fields["lp_top_ids"] = pack_logprob_rows(entries, width, 1)
    if any(p is not None for p in prompts):
        positions = [e for p in prompts if p is not None for e in p]
        width = max(len(e[1]) for e in positions) if positions else 0
        values, ids = pack_logprob_rows(positions, width, 2)
        fields.update(prompt_counts=pack_i32([0 if p is None else len(p) for p in prompts]), prompt_width=width,
                      prompt_values=values, prompt_top_ids=ids)
    return dataclasses.replace(msg, **fields)
