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


def unpack_array(data: bytes, dtype: str, what: str) -> np.ndarray:
    itemsize = np.dtype(dtype).itemsize
    if len(data) % itemsize:
        raise ProtocolError(f"{what}: {len(data)} bytes is not a whole number of {dtype} items")
    return np.frombuffer(data, dtype=dtype)


def unpack_ids(data: bytes, what: str = "ids") -> np.ndarray:
    ids = unpack_array(data, "<i4", what)
    if ids.size and (ids.min() < 0):
        raise ProtocolError(f"{what}: negative token id")
    return ids


def unpack_i32(data: bytes, what: str = "i32") -> np.ndarray:
    return unpack_array(data, "<i4", what)


def unpack_i64(data: bytes, what: str = "i64") -> np.ndarray:
    return unpack_array(data, "<i8", what)


def unpack_u8(data: bytes, what: str = "u8") -> np.ndarray:
    return unpack_array(data, "u1", what)


def unpack_f32(data: bytes, what: str = "f32") -> np.ndarray:
    return unpack_array(data, "<f4", what)


# Logprobs (Tokens, Replies): per token a row of values (its logprob[, rank], then its
# alternatives') and a row of the alternatives' ids. In memory a token's are a reference
# (values [n, extra + k], ids [n, k], row) into the arrays of the step or message they came
# in, so that packing takes whole arrays' rows at once, never a token at a time.
def pack_logprob_refs(refs: list, extra: int) -> tuple[int, bytes, bytes]:
    """(width, values, ids) of refs [(values, ids, row) or None], padded to the widest
    (values NaN, ids -1; None: a token without logprobs)."""
    n, blocks = len(refs), {}
    for i, ref in enumerate(refs):
        if ref is not None:
            block = blocks.get(id(ref[0]))
            if block is None:
                block = blocks[id(ref[0])] = (ref[0], ref[1], [], [])
            block[2].append(i)
            block[3].append(ref[2])
    width = max((b[1].shape[1] for b in blocks.values()), default=0)
    if len(blocks) == 1 and len(block[2]) == n and block[1].shape[1] == width:
        return width, block[0][block[3]].astype("<f4", copy=False).tobytes(), \
            block[1][block[3]].astype("<i4", copy=False).tobytes()
    values = np.full((n, extra + width), np.nan, dtype="<f4")
    ids = np.full((n, width), -1, dtype="<i4")
    for v, t, at, rows in blocks.values():
        values[at, :v.shape[1]] = v[rows]
        ids[at, :t.shape[1]] = t[rows]
    return width, values.tobytes(), ids.tobytes()


LOGPROB_FLOOR = -9999.0   # a logprob of minus infinity (a token the controls forbid) as output writes it, as vLLM's


def logprob_text(v: float) -> str:
    """A logprob's JSON number (v not NaN): the 9 significant digits of a float32 (the values
    are float32; more digits would only spell out its widening to a double), and minus infinity
    (or anything below the floor) as LOGPROB_FLOOR. A third of the time `repr` takes."""
    if v >= LOGPROB_FLOOR:
        s = "%.9g" % v
        return s if "." in s or "e" in s else s + ".0"
    return "-9999.0"


def logprob_value(v) -> float | None:
    """A logprob as output holds it: the number logprob_text writes (None for NaN: none)."""
    v = float(v)
    return None if v != v else float(logprob_text(v))


def unpack_logprob_block(values: bytes, ids: bytes, num: int, width: int, extra: int) -> tuple[np.ndarray, np.ndarray]:
    """values [num, extra + width] and ids [num, width] (sizes were checked at decode)."""
    return (np.frombuffer(values, dtype="<f4").reshape(num, extra + width),
            np.frombuffer(ids, dtype="<i4").reshape(num, width))


def logprob_rows(msg, kept, keep: np.ndarray):
    """A Tokens `kept` (the rows `keep`, a boolean mask, of `msg`) with those rows' logprobs."""
    fields = {}
    if msg.lp_width >= 0:
        per_token = np.repeat(keep, unpack_i32(msg.counts))
        k = msg.lp_width
        fields.update(lp_width=k, lp_values=unpack_f32(msg.lp_values).reshape(-1, 1 + k)[per_token].tobytes(),
                      lp_top_ids=unpack_i32(msg.lp_top_ids).reshape(-1, k)[per_token].tobytes())
    return dataclasses.replace(kept, **fields, **_prompt_rows(msg, keep)) if fields or msg.prompt_width >= 0 else kept


def _prompt_rows(msg, keep: np.ndarray) -> dict:
    if msg.prompt_width < 0:
        return {}
    counts, k = unpack_i32(msg.prompt_counts), msg.prompt_width
    per_position = np.repeat(keep, counts)
    return dict(prompt_counts=pack_i32(counts[keep]), prompt_width=k,
                prompt_values=unpack_f32(msg.prompt_values).reshape(-1, 2 + k)[per_position].tobytes(),
                prompt_top_ids=unpack_i32(msg.prompt_top_ids).reshape(-1, k)[per_position].tobytes())


def replies_rows(msg, kept, keep: np.ndarray):
    """A Replies `kept` (the rows `keep`, a boolean mask, of `msg`) with those rows' logprobs
    and token ids."""
    fields = {}
    if msg.id_counts:
        counts = unpack_i32(msg.id_counts)
        fields.update(id_counts=pack_i32(counts[keep]),
                      token_ids=unpack_i32(msg.token_ids)[np.repeat(keep, counts)].tobytes())
    if msg.lp_width >= 0:
        counts, k = unpack_i32(msg.lp_counts), msg.lp_width
        per_token = np.repeat(keep, counts)
        fields.update(lp_counts=pack_i32(counts[keep]), lp_width=k,
                      lp_token_ids=unpack_i32(msg.lp_token_ids)[per_token].tobytes(),
                      lp_values=unpack_f32(msg.lp_values).reshape(-1, 1 + k)[per_token].tobytes(),
                      lp_top_ids=unpack_i32(msg.lp_top_ids).reshape(-1, k)[per_token].tobytes())
    return dataclasses.replace(kept, **fields, **_prompt_rows(msg, keep))


def replies_with_ids(msg, ids):
    """A Replies with its rows' token ids: ids[i] those of row i (None: none)."""
    flat = [t for row in ids if row for t in row]
    return dataclasses.replace(msg, id_counts=pack_i32([len(row) if row else 0 for row in ids]),
                               token_ids=pack_i32(flat))


def replies_with_logprobs(msg, lps, prompts):
    """A Replies with its rows' logprobs: lps[i] the (id, reference or None) of row i's tokens
    (None: none), prompts[i] its prompt's (values, ids) arrays (None: none)."""
    tokens = [e for row in lps if row is not None for e in row]
    width, values, ids = pack_logprob_refs([e[1] for e in tokens], 1)
    fields = dict(lp_counts=pack_i32([0 if row is None else len(row) for row in lps]),
                  lp_token_ids=pack_i32([e[0] for e in tokens]), lp_width=width, lp_values=values, lp_top_ids=ids)
    if any(p is not None for p in prompts):
        refs = [(p[0], p[1], k) for p in prompts if p is not None for k in range(len(p[0]))]
        width, values, ids = pack_logprob_refs(refs, 2)
        fields.update(prompt_counts=pack_i32([0 if p is None else len(p[0]) for p in prompts]), prompt_width=width,
                      prompt_values=values, prompt_top_ids=ids)
    return dataclasses.replace(msg, **fields)
