"""The messages between a GPU worker and the process that keeps its structured output's
matchers (hub/mask_process.py): a local socket pair, parent and child, decoded like every other wire.

Token ids travel packed as int32, sequence ids and token indices as int64. Only `MaskSet`,
`MaskShare` and `MaskFill` are answered: the first two with `MaskSetAck`, a fill with one raw
frame, the step's masks (rows of 32-bit words, one bit a token) followed by a trailer, or the
trailer alone when the masks went to the shared region (hub/mask_process.py)."""

from __future__ import annotations

from qmigrate.wire.packed import ProtocolError, unpack_i32, unpack_i64
from qmigrate.wire.registry import MsgType, message


@message(MsgType.MASK_OPEN)
class MaskOpen:
    """The first message: whose tokenizer the matchers' grammars compile against."""

    tokenizer_path: str
    trust_remote_code: bool
    vocab_size: int
    timeout_s: float


@message(MsgType.MASK_WARM)
class MaskWarm:
    """Compile this grammar now, on the process's pool: a sequence of it is coming."""

    grammar: str
    eos_ids: bytes            # int32


@message(MsgType.MASK_SET)
class MaskSet:
    """A sequence's matcher at its grammar's start, then its generated ids replayed."""

    seq_id: int
    grammar: str
    eos_ids: bytes            # int32
    generated: bytes          # int32

    def validate(self) -> None:
        unpack_i32(self.eos_ids, "MaskSet.eos_ids")
        unpack_i32(self.generated, "MaskSet.generated")


@message(MsgType.MASK_SET_ACK)
class MaskSetAck:
    ok: bool                  # False: the ids do not follow the grammar, or it does not compile


@message(MsgType.MASK_FORGET)
class MaskForget:
    seq_id: int


@message(MsgType.MASK_NOTE)
class MaskNote:
    """The tokens a step sampled for its constrained rows: seq_ids[k]'s generated token
    index[k] is tokens[k]."""

    seq_ids: bytes            # int64
    index: bytes              # int64
    tokens: bytes             # int32

    def validate(self) -> None:
        _same_rows((self.seq_ids, self.index), self.tokens, "MaskNote")


@message(MsgType.MASK_FILL)
class MaskFill:
    """The masks of seq_ids[k] at generated token index[k], rows of `width` words, after the
    matchers take the tokens `noted_*` (as `MaskNote`; empty: none)."""

    seq_ids: bytes            # int64
    index: bytes              # int64
    width: int
    noted_seq_ids: bytes = b""    # int64
    noted_index: bytes = b""      # int64
    noted_tokens: bytes = b""     # int32
    turn: int = -1            # >= 0: written to that turn of the shared region (`MaskShare`), then its word
    job: int = 0              # ... set to this (the answer is then the trailer alone)

    def validate(self) -> None:
        _same_rows((self.seq_ids, self.index), b"", "MaskFill", tokens=False)
        _same_rows((self.noted_seq_ids, self.noted_index), self.noted_tokens, "MaskFill.noted")
        if not 0 < self.width <= 1 << 20:
            raise ProtocolError("MaskFill.width: out of range")
        if self.turn not in (-1, 0, 1) or not 0 <= self.job < 1 << 32:
            raise ProtocolError("MaskFill.turn or job: out of range")


@message(MsgType.MASK_SHARE)
class MaskShare:
    """Write the masks of fills that name a turn into the worker's shared region
    (hub/mask_shared.py) at `path`; answered with `MaskSetAck` (False: it could not be mapped)."""

    path: str
    rows: int
    width: int

    def validate(self) -> None:
        if not (0 < self.rows <= 1 << 16 and 0 < self.width <= 1 << 20):
            raise ProtocolError("MaskShare.rows or width: out of range")


def _same_rows(int64s: tuple[bytes, bytes], int32s: bytes, what: str, tokens: bool = True) -> None:
    sizes = {len(unpack_i64(a, what)) for a in int64s}
    if tokens:
        sizes.add(len(unpack_i32(int32s, what)))
    if len(sizes) > 1:
        raise ProtocolError(f"{what}: rows of different lengths")
