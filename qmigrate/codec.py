"""Encoding and decoding of the messages in protocol.py.

A message is one msgpack array, [type, field1, field2, ...]. Decoding is msgpack with hard
size limits, then a check of every field against its declared type, the ranges below, and
the message's own validate() for what one field cannot say. A failure is a ProtocolError.
"""

from __future__ import annotations

import math
import types
import typing

import msgpack

from .protocol import (_BY_TYPE, MAX_ARRAY_LEN, MAX_MESSAGE_BYTES, MAX_STR, ProtocolError, SeqSpec,
                       _unpack)

def _to_wire(value):
    if isinstance(value, SeqSpec):
        return [_to_wire(getattr(value, name)) for name, _, _ in SeqSpec._fields]
    if isinstance(value, list):
        return [_to_wire(v) for v in value]
    return value


def encode(msg) -> bytes:
    body = [int(msg.TYPE)] + [_to_wire(getattr(msg, name)) for name, _, _ in msg._fields]
    return msgpack.packb(body, use_bin_type=True)


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
    cls = _BY_TYPE.get(body[0])
    if cls is None:
        raise ProtocolError(f"unknown message type {body[0]}")
    return _build(cls, body[1:], cls.__name__)


# Ranges checked at decode, so no handler ever sees a number it cannot use.
_I64 = (0, (1 << 63) - 1)
_RANGES: dict[str, dict[str, tuple]] = {
    "SeqSpec": {"seq_id": _I64, "prompt_len": (1, MAX_ARRAY_LEN), "max_new_tokens": (1, 1 << 30),
                "temperature": (0.0, 1e4), "top_p": (0.0, 1.0), "top_k": (0, 1 << 30), "seed": (-1, _I64[1]),
                "transfer_id": _I64, "resend_from": (-1, MAX_ARRAY_LEN)},
    "Hello": {"version": (0, 1 << 16)},
    "Welcome": {"version": (0, 1 << 16), "heartbeat_interval_s": (1e-3, 3600.0), "lease_timeout_s": (1e-3, 86400.0)},
    "Heartbeat": {"num_cached_seqs": _I64, "free_kv_tokens": (-1, _I64[1]), "busy_ms": _I64, "idle_ms": _I64},
    "WorkRequest": {"request_no": _I64, "max_seqs": (1, 1 << 20), "max_tokens": (1, 1 << 30),
                    "free_kv_tokens": (-1, _I64[1])},
    "Lease": {"lease_id": _I64, "request_no": _I64, "timeout_s": (1e-3, 86400.0), "num_steps": (1, 1 << 16)},
    "StepResult": {"lease_id": _I64, "free_kv_tokens": (-1, _I64[1])},
    "Submit": {"num_requests": (-1, _I64[1])},
    "SubmitAck": {"num_accepted": _I64, "num_free": _I64},
    "RequestMeta": {"seq_id": _I64},
    "InputClosed": {"num_requests": _I64},
    "ShipKV": {"seq_id": _I64, "transfer_id": _I64, "num_tokens": (0, MAX_ARRAY_LEN)},
    "KVHeader": {"transfer_id": _I64, "seq_id": _I64, "num_tokens": (0, MAX_ARRAY_LEN)},
    "FeedAck": {"num_accepted": _I64},
    "Revoke": {"lease_id": _I64},
    "Resync": {"pid": (0, 1 << 32)},
}
# Packed arrays by field name: item type, and whether items must be >= 0 (ids).
_ARRAYS = {"seq_ids": ("<i8", True), "drop_ids": ("<i8", True), "evicted_ids": ("<i8", True),
           "lease_ids": ("<i8", True), "token_ids": ("<i4", True), "prompt_ids": ("<i4", True),
           "tokens": ("<i4", True), "counts": ("<i4", True), "start": ("<i4", True),
           "lengths": ("<i4", False), "last_tokens": ("<i4", False), "status": ("u1", False),
           "finish": ("u1", False), "routes": ("u1", False)}
_NAMES = {"name": 256, "role": 64, "node": 256, "kv_from": 512, "dest": 512, "worker": 256, "dtype": 32}


def _build(cls, values: list, where: str):
    kwargs = {}
    ranges = _RANGES.get(cls.__name__, {})
    for i, (name, hint, has_default) in enumerate(cls._fields):
        if i >= len(values):
            if not has_default:
                raise ProtocolError(f"{where}: missing field {name!r}")
            continue
        value = kwargs[name] = _check(values[i], hint, f"{where}.{name}")
        if name in ranges and not ranges[name][0] <= value <= ranges[name][1]:
            raise ProtocolError(f"{where}.{name}: {value!r} outside [{ranges[name][0]}, {ranges[name][1]}]")
        if hint is bytes and name in _ARRAYS:
            dtype, is_id = _ARRAYS[name]
            array = _unpack(value, dtype, f"{where}.{name}")
            if is_id and array.size and array.min() < 0:
                raise ProtocolError(f"{where}.{name}: negative id")
        if hint is str and len(value) > _NAMES.get(name, MAX_STR):
            raise ProtocolError(f"{where}.{name}: longer than {_NAMES[name]} characters")
    msg = cls(**kwargs)
    if hasattr(cls, "validate"):
        try:
            msg.validate()  # what one field's type cannot say: shapes, agreement between fields
        except ProtocolError as exc:
            text = str(exc)
            raise ProtocolError(text if text.startswith(cls.__name__) else f"{where}: {text}") from None
    return msg


def _check(value, hint, where: str):
    origin = typing.get_origin(hint)
    if hint is typing.Any:
        if isinstance(value, (dict, list)):
            raise ProtocolError(f"{where}: nested value where a scalar is expected")
        if isinstance(value, str) and len(value) > MAX_STR:
            raise ProtocolError(f"{where}: string longer than {MAX_STR} characters")
        if isinstance(value, float) and not math.isfinite(value):
            raise ProtocolError(f"{where}: {value} where a finite number is expected")
        return value
    if hint is SeqSpec:
        if not isinstance(value, list):
            raise ProtocolError(f"{where}: expected a sequence spec")
        return _build(SeqSpec, value, where)
    if hint is float:
        if type(value) not in (int, float) or not math.isfinite(value):
            raise ProtocolError(f"{where}: expected a finite number")
        return float(value)
    if hint in (int, str, bytes, bool):
        if type(value) is not hint:
            raise ProtocolError(f"{where}: expected {hint.__name__}, got {type(value).__name__}")
        if hint is int and not -(1 << 63) <= value < (1 << 63):
            raise ProtocolError(f"{where}: integer out of range")
        if hint is str and len(value) > MAX_STR:
            raise ProtocolError(f"{where}: string longer than {MAX_STR} characters")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise ProtocolError(f"{where}: expected a list")
        (item,) = typing.get_args(hint)
        return [_check(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ProtocolError(f"{where}: expected a map")
        key_t, val_t = typing.get_args(hint)
        return {_check(k, key_t, where): _check(v, val_t, f"{where}[{k}]") for k, v in value.items()}
    if origin in (typing.Union, types.UnionType):
        raise ProtocolError(f"{where}: unions are not supported on the wire")
    raise ProtocolError(f"{where}: unsupported field type {hint}")
