"""Message types and the registry the codec decodes by: `@message(type)` makes a class a
frozen, slotted dataclass, gives it its type and its fields in wire order, and records it."""

from __future__ import annotations

import dataclasses
import enum
import typing
from dataclasses import dataclass

class MsgType(enum.IntEnum):
    HELLO = 1
    WELCOME = 2
    REJECT = 3
    HEARTBEAT = 4
    WORK_REQUEST = 5
    LEASE = 6
    STEP_RESULT = 7
    TOKENS = 8
    SUBMIT = 9
    SUBMIT_ACK = 10
    REQUEST_META = 11
    REQUEST_ERROR = 12
    INPUT_CLOSED = 13
    SHIP_KV = 14
    KV_HEADER = 15
    DRAIN = 16
    DRAIN_ACK = 17
    EXIT = 18
    VRAM_REPORT = 19
    FEED_LINES = 20
    FEED_ACK = 21
    STATS_REQUEST = 22
    STATS = 23
    REVOKE = 24
    CANCEL = 30
    REPLIES = 31
    RESYNC = 35
    PRINTED = 36
    PULSE = 37
    FRONT_HELLO = 38
    FRONT_STATUS = 39
    FRONT_ADMIT = 40
    MASK_OPEN = 41
    MASK_WARM = 42
    MASK_SET = 43
    MASK_SET_ACK = 44
    MASK_FORGET = 45
    MASK_NOTE = 46
    MASK_FILL = 47
    MASK_SHARE = 48


MESSAGE_TYPES: dict[int, type] = {}   # message type -> its class


def message(msg_type: MsgType):
    def register(cls):
        cls = dataclass(frozen=True, slots=True)(cls)
        cls.TYPE = msg_type
        cls._fields = field_table(cls)
        MESSAGE_TYPES[int(msg_type)] = cls
        return cls
    return register


def field_table(cls) -> tuple:
    """(name, type, has a default) per field, in wire order."""
    hints = typing.get_type_hints(cls)
    return tuple((f.name, hints[f.name], f.default is not dataclasses.MISSING
                  or f.default_factory is not dataclasses.MISSING) for f in dataclasses.fields(cls))
