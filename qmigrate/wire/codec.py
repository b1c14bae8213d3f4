"""Encoding and decoding of the messages that protocol.py names.

A message is one msgpack array, [type, field1, field2, ...]. Decoding is msgpack with hard
size limits, then a check of every field against its declared type, the ranges below, and
the message's own validate() for what one field cannot say. A failure is a ProtocolError.
"""

from __future__ import annotations

import functools
import math
import types
import typing

import msgpack

from qmigrate.wire.packed import unpack_array
from qmigrate.wire.registry import MESSAGE_TYPES
from qmigrate.wire.protocol import (
    MAX_ARRAY_LEN,
    MAX_CACHE_SALT,
    MAX_MESSAGE_BYTES,
    MAX_NEW_TOKENS,
    MAX_PENALTY,
    MAX_REPETITION_PENALTY,
    MAX_SEED,
    MIN_REPETITION_PENALTY,
    MAX_STR,
    MAX_TEMPERATURE,
    MAX_TOP_K,
    ProtocolError,
    SeqSpec,
)

def _to_wire(value):
    if isinstance(value, SeqSpec):
        return [_to_wire(getattr(value, name)) for name, _, _ in SeqSpec._fields]
    if isinstance(value, list):
        return [_to_wire(v) for v in value]
    return value


def encode(msg) -> bytes:
    body = [int(msg.TYPE)] + [_to_wire(getattr(msg, name)) for name, _, _ in msg._fields]
    return msgpack.packb(body, use_bin_type=True)


def check_wire(msg) -> None:
    """Raise ProtocolError unless `msg` encodes and its receiver would decode it: the one
    check of what may be sent, run by a sender on its own input (ingest on each request)."""
    try:
        data = encode(msg)
    except (OverflowError, UnicodeEncodeError, ValueError, TypeError) as exc:
        raise ProtocolError(f"{type(msg).__name__} cannot be encoded: {exc}") from None
    decode(data)


def decode(data: bytes):
    if len(data) > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"message of {len(data)} bytes exceeds {MAX_MESSAGE_BYTES}")
    try:
        body = msgpack.unpackb(
            data, raw=False, strict_map_key=True, max_bin_len=MAX_MESSAGE_BYTES,
            max_str_len=1 << 20, max_array_len=MAX_ARRAY_LEN, max_map_len=1024, max_ext_len=0,
        )
    except Exception as exc:  # msgpack raises several unrelated types
        raise ProtocolError(f"undecodable message: {exc}") from None
    if not isinstance(body, list) or not body or type(body[0]) is not int:
        raise ProtocolError("message is not [type, fields...]")
    cls = MESSAGE_TYPES.get(body[0])
    if cls is None:
        raise ProtocolError(f"unknown message type {body[0]}")
    try:
        return _build(cls, body[1:], cls.__name__)
    except ProtocolError as exc:
        exc.msg_type = cls.TYPE  # the receiver may answer a refused message of a known type
        raise


# Ranges checked at decode, so no handler ever sees a number it cannot use.
_I64 = (0, (1 << 63) - 1)
_RANGES: dict[str, dict[str, tuple]] = {
    "SeqSpec": {"seq_id": _I64, "prompt_len": (1, MAX_ARRAY_LEN), "max_new_tokens": (1, MAX_NEW_TOKENS),
                "temperature": (0.0, MAX_TEMPERATURE), "top_p": (0.0, 1.0), "top_k": (0, MAX_TOP_K),
                "seed": (-1, MAX_SEED), "presence_penalty": (-MAX_PENALTY, MAX_PENALTY),
                "frequency_penalty": (-MAX_PENALTY, MAX_PENALTY), "min_p": (0.0, 1.0),
                "repetition_penalty": (MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY),
                "transfer_id": _I64, "resend_from": (-1, MAX_ARRAY_LEN)},
    "Hello": {"version": (0, 1 << 16)},
    "Welcome": {"version": (0, 1 << 16), "heartbeat_interval_s": (1e-3, 3600.0), "lease_timeout_s": (1e-3, 86400.0)},
    "Heartbeat": {"num_cached_seqs": _I64, "free_kv_tokens": (-1, _I64[1]), "busy_ms": _I64, "idle_ms": _I64,
                  "held_bytes": (-1, _I64[1]), "num_kv_imported": _I64},
    "Pulse": {"loop_age_ms": _I64},
    "WorkRequest": {"request_no": _I64, "max_seqs": (1, 1 << 20), "max_tokens": (1, 1 << 30),
                    "free_kv_tokens": (-1, _I64[1])},
    "Lease": {"lease_id": _I64, "request_no": _I64, "timeout_s": (1e-3, 86400.0), "num_steps": (1, 1 << 16)},
    "StepResult": {"lease_id": _I64, "free_kv_tokens": (-1, _I64[1])},
    "Submit": {"num_requests": (-1, _I64[1])},
    "SubmitAck": {"num_accepted": _I64, "num_free": _I64},
    "RequestMeta": {"seq_id": _I64},
    "RequestError": {"seq_id": (-1, _I64[1])},
    "InputClosed": {"num_requests": _I64},
    "ShipKV": {"seq_id": _I64, "transfer_id": _I64, "num_tokens": (0, MAX_ARRAY_LEN)},
    "KVHeader": {"transfer_id": _I64, "seq_id": _I64, "num_tokens": (0, MAX_ARRAY_LEN)},
    "FeedAck": {"num_accepted": _I64},
    "Revoke": {"lease_id": _I64},
    "Resync": {"pid": (0, 1 << 32)},
    "FrontHello": {"index": (0, 127), "pid": (0, 1 << 32)},
    "FrontStatus": {"num_serving": (0, 1 << 31)},
}
# Packed arrays by field name: item type, and whether items must be >= 0 (ids).
_ARRAYS = {"seq_ids": ("<i8", True), "drop_ids": ("<i8", True), "evicted_ids": ("<i8", True),
           "lease_ids": ("<i8", True), "token_ids": ("<i4", True), "prompt_ids": ("<i4", True),
           "tokens": ("<i4", True), "counts": ("<i4", True), "start": ("<i4", True),
           "lengths": ("<i4", False), "last_tokens": ("<i4", False), "status": ("u1", False),
           "finish": ("u1", False), "routes": ("u1", False),
           "error_ids": ("<i8", False)}
_NAMES = {"name": 256, "role": 64, "node": 256, "kv_from": 512, "dest": 512, "worker": 256, "dtype": 32,
          "cache_salt": MAX_CACHE_SALT, "error": 1024}


def _build(cls, values: list, where: str):
    kwargs = {}
    for i, (name, check, bounds, array, max_len, has_default) in enumerate(_plan(cls)):
        if i >= len(values):
            if not has_default:
                raise ProtocolError(f"{where}: missing field {name!r}")
            continue
        value = kwargs[name] = check(values[i], where, name)
        if bounds is not None and not bounds[0] <= value <= bounds[1]:
            raise ProtocolError(f"{where}.{name}: {value!r} outside [{bounds[0]}, {bounds[1]}]")
        if array is not None:
            items = unpack_array(value, array[0], f"{where}.{name}")
            if array[1] and items.size and items.min() < 0:
                raise ProtocolError(f"{where}.{name}: negative id")
        if max_len is not None and len(value) > max_len:
            raise ProtocolError(f"{where}.{name}: longer than {max_len} characters")
    msg = cls(**kwargs)
    if hasattr(cls, "validate"):
        try:
            msg.validate()  # what one field's type cannot say: shapes, agreement between fields
        except ProtocolError as exc:
            text = str(exc)
            raise ProtocolError(text if text.startswith(cls.__name__) else f"{where}: {text}") from None
    return msg


@functools.lru_cache(maxsize=None)
def _plan(cls) -> tuple:
    """Per field of cls, in wire order: its name, the checker of its type, its range, its
    packed-array layout, its longest string, and whether it has a default. Built once per
    message type, so decoding looks nothing up per field and formats no text unless it fails."""
    ranges = _RANGES.get(cls.__name__, {})
    return tuple((name, _checker(hint), ranges.get(name), _ARRAYS.get(name) if hint is bytes else None,
                  _NAMES.get(name) if hint is str else None, has_default)
                 for name, hint, has_default in cls._fields)


# A checker takes (value, where, name), returns the value as the message holds it, and raises
# ProtocolError naming f"{where}.{name}" when the value is not of its type.

def _check_any(value, where: str, name: str):
    if isinstance(value, (dict, list)):
        raise ProtocolError(f"{where}.{name}: nested value where a scalar is expected")
    if isinstance(value, str) and len(value) > MAX_STR:
        raise ProtocolError(f"{where}.{name}: string longer than {MAX_STR} characters")
    if isinstance(value, float) and not math.isfinite(value):
        raise ProtocolError(f"{where}.{name}: {value} where a finite number is expected")
    return value


def _check_float(value, where: str, name: str):
    if type(value) not in (int, float) or not math.isfinite(value):
        raise ProtocolError(f"{where}.{name}: expected a finite number")
    return float(value)


def _check_int(value, where: str, name: str):
    if type(value) is not int:
        raise ProtocolError(f"{where}.{name}: expected int, got {type(value).__name__}")
    if not -(1 << 63) <= value < (1 << 63):
        raise ProtocolError(f"{where}.{name}: integer out of range")
    return value


def _check_str(value, where: str, name: str):
    if type(value) is not str:
        raise ProtocolError(f"{where}.{name}: expected str, got {type(value).__name__}")
    if len(value) > MAX_STR:
        raise ProtocolError(f"{where}.{name}: string longer than {MAX_STR} characters")
    return value


def _exactly(hint):
    def check(value, where: str, name: str):
        if type(value) is not hint:
            raise ProtocolError(f"{where}.{name}: expected {hint.__name__}, got {type(value).__name__}")
        return value
    return check


def _check_spec(value, where: str, name: str):
    if not isinstance(value, list):
        raise ProtocolError(f"{where}.{name}: expected a sequence spec")
    return _build(SeqSpec, value, f"{where}.{name}")


def _list_of(item):
    def check(value, where: str, name: str):
        if not isinstance(value, list):
            raise ProtocolError(f"{where}.{name}: expected a list")
        return [item(v, where, f"{name}[{i}]") for i, v in enumerate(value)]
    return check


def _list_of_ints(value, where: str, name: str):
    if not isinstance(value, list):
        raise ProtocolError(f"{where}.{name}: expected a list")
    if not all(type(v) is int and -(1 << 63) <= v < (1 << 63) for v in value):
        for i, v in enumerate(value):
            _check_int(v, where, f"{name}[{i}]")
    return value


def _dict_of(key, val):
    def check(value, where: str, name: str):
        if not isinstance(value, dict):
            raise ProtocolError(f"{where}.{name}: expected a map")
        return {key(k, where, name): val(v, where, f"{name}[{k}]") for k, v in value.items()}
    return check


def _unsupported(why: str):
    def check(value, where: str, name: str):
        raise ProtocolError(f"{where}.{name}: {why}")
    return check


def _checker(hint):
    origin = typing.get_origin(hint)
    if hint is typing.Any:
        return _check_any
    if hint is SeqSpec:
        return _check_spec
    if hint is float:
        return _check_float
    if hint is int:
        return _check_int
    if hint is str:
        return _check_str
    if hint in (bytes, bool):
        return _exactly(hint)
    if origin is list:
        (item,) = typing.get_args(hint)
        return _list_of_ints if item is int else _list_of(_checker(item))
    if origin is dict:
        return _dict_of(*(_checker(t) for t in typing.get_args(hint)))
    if origin in (typing.Union, types.UnionType):
        return _unsupported("unions are not supported on the wire")
    return _unsupported(f"unsupported field type {hint}")
