"""The wire protocol: every message round-trips, and malformed input only ever raises ProtocolError."""

from __future__ import annotations

import dataclasses
import random
import re
import typing
from pathlib import Path

import msgpack
import numpy as np
import pytest

from qmigrate.wire import protocol as P
from qmigrate.wire import codec
from qmigrate.wire.protocol import Finish, ProtocolError, SeqSpec

PACKAGE_DIR = Path(P.__file__).resolve().parent.parent  # the whole qmigrate package


def spec(seq_id: int = 7, **overrides) -> SeqSpec:
    fields = dict(seq_id=seq_id, token_ids=P.pack_i32([1, 306, 376, 507]), prompt_len=3,
                  max_new_tokens=16, temperature=0.7, top_p=0.9, top_k=40, seed=1234,
                  stop_ids=[[13, 13], [2]], eos_ids=[2], kv_from="tcp://10.0.0.2:5601", transfer_id=9)
    return SeqSpec(**{**fields, **overrides})


# One example of every registered message, with every field set away from its default.
EXAMPLES = [
    P.Hello("worker", "w0", 1, {"max_seqs": 64, "device": "cuda:0", "link_gbps": 12.5, "fast": True}),
    P.Welcome(1, 0.5, 10.0),
    P.Reject("protocol version 2; router speaks 1"),
    P.Heartbeat("w0", 12, 3),
    P.WorkRequest(41, 64, 8192, 17),
    P.Lease(5, 41, 10.0, P.pack_i64([7, 8]), P.pack_i32([4, 11]), P.pack_i32([507, 99]),
            [spec(7), spec(8, kv_from="", transfer_id=0)], P.pack_i64([3]), 4),
    P.StepResult(5, P.pack_i64([7, 8]), P.pack_i32([2, 1]), P.pack_i32([10, 11, 12]),
                 P.pack_u8([0, 1]), 30, P.pack_i64([3])),
    P.Tokens(P.pack_i64([7, 8]), P.pack_i32([1, 8]), P.pack_i32([2, 1]), P.pack_i32([10, 11, 12]),
             P.pack_u8([0, 2])),
    P.Submit([spec(1), spec(2, stop_ids=[], eos_ids=[])], ["r1", "r2"], [["r0", "empty prompt"]], 3),
    P.SubmitAck(2, 4094),
    P.RequestMeta(7, "req-7", P.pack_i32([1, 306])),
    P.RequestError("req-8", "prompt is empty"),
    P.InputClosed(12),
    P.ShipKV(7, "tcp://10.0.0.3:5601", 9, 120),
    P.KVHeader(9, 7, 120, "bfloat16", [2, 2, 4, 120, 64]),
    P.Drain("w1"),
    P.DrainAck(True, "draining w1"),
    P.Exit("shutdown"),
    P.VramReport("node-a", [["GPU-1234", 0, 80 << 30, 10 << 30, 70 << 30, 35]]),
    P.FeedLines(["hello", '{"prompt": "x"}'], True),
    P.FeedAck(2, "ok"),
    P.StatsRequest(),
    P.Stats({"leases": 10, "queued": 3, "rate": 1.5, "name": "router"}),
    P.Revoke(5, P.pack_i64([7, 8])),
    P.Cancel(P.pack_i64([7, 8])),
    P.Replies(P.pack_i64([7, 8]), P.pack_u8([0, P.Finish.CANCELLED]), P.pack_i32([3, 9]), [" Hello", ""]),
    P.Revoke(5, P.pack_i64([7])),
    P.Resync(4242),
    P.Printed(P.pack_i64([7, 8])),
    P.Pulse("w0", 2500),
    P.FrontHello(3, 4242, "cannot serve HTTP on http://127.0.0.1:8000: address in use"),
    P.FrontStatus(2),
    P.FrontAdmit(P.pack_i64([7, 8]), True),
    P.MaskOpen("/models/tiny", False, 512, 5.0),
    P.MaskWarm('{"grammars": []}', P.pack_i32([2])),
    P.MaskSet(7, '{"grammars": []}', P.pack_i32([2]), P.pack_i32([17, 18])),
    P.MaskSetAck(True),
    P.MaskForget(7),
    P.MaskNote(P.pack_i64([7, 9]), P.pack_i64([3, 0]), P.pack_i32([17, 5])),
    P.MaskFill(P.pack_i64([7]), P.pack_i64([4]), 16, P.pack_i64([7]), P.pack_i64([3]), P.pack_i32([17])),
    P.MaskFill(P.pack_i64([7]), P.pack_i64([4]), 16, turn=1, job=(1 << 32) - 1),
    P.MaskShare("/proc/1/fd/3", 256, 1536),
]


def body_of(msg) -> list:
    return msgpack.unpackb(codec.encode(msg), raw=False)


def pack(body) -> bytes:
    return msgpack.packb(body, use_bin_type=True)


def assert_rejected(data: bytes) -> None:
    with pytest.raises(ProtocolError):
        codec.decode(data)


def bad_values(hint) -> list:
    """Values of the wrong type for a field of type `hint`."""
    origin = typing.get_origin(hint)
    if hint is typing.Any:
        return [{"nested": 1}, [1, 2]]
    if hint is SeqSpec:
        return [1, "spec", {"seq_id": 1}, [1.5, b"", 1, 1]]
    if hint is bool:
        return [1, 0, "true", None]
    if hint is int:
        return [True, 1.0, "1", None, b"\x01", [1], 1 << 63]
    if hint is float:
        return [True, "0.5", None, [0.5]]
    if hint is str:
        return [1, b"text", None, ["text"]]
    if hint is bytes:
        return ["text", 1, None, [1, 2]]
    if origin is list:
        (item,) = typing.get_args(hint)
        return [1, "list", {"a": 1}, None] + [[v] for v in bad_values(item)[:2]]
    if origin is dict:
        _, val = typing.get_args(hint)
        return [[1, 2], "map", 1, {1: 1}, {b"key": 1}] + [{"k": v} for v in bad_values(val)[:1]]
    raise AssertionError(f"no bad values for {hint}")


# --- round trips ------------------------------------------------------------------------

def test_examples_cover_every_registered_message():
    assert {type(m) for m in EXAMPLES} == set(P.MESSAGE_TYPES.values())
    assert set(P.MESSAGE_TYPES) == {int(t) for t in P.MsgType}
    assert all(int(cls.TYPE) == key for key, cls in P.MESSAGE_TYPES.items())


@pytest.mark.parametrize("msg", EXAMPLES, ids=lambda m: type(m).__name__)
def test_every_message_round_trips(msg):
    data = codec.encode(msg)
    assert isinstance(data, bytes)
    back = codec.decode(data)
    assert type(back) is type(msg)
    assert back == msg
    assert codec.encode(back) == data
    assert body_of(msg)[0] == int(msg.TYPE)


def test_lease_carries_specs_and_packed_arrays_intact():
    lease = codec.decode(codec.encode(EXAMPLES[5]))
    assert all(isinstance(s, SeqSpec) for s in lease.full)
    assert lease.full[0].ids.tolist() == [1, 306, 376, 507]
    assert lease.full[0].stop_ids == [[13, 13], [2]]
    assert P.unpack_i64(lease.seq_ids).tolist() == [7, 8]
    assert P.unpack_i32(lease.lengths).tolist() == [4, 11]
    assert P.unpack_i64(lease.drop_ids).tolist() == [3]


def test_int_is_accepted_for_a_float_field_and_becomes_a_float():
    msg = codec.decode(pack([int(P.MsgType.WELCOME), 1, 2, 10]))
    assert msg == P.Welcome(1, 2.0, 10.0)
    assert type(msg.heartbeat_interval_s) is float


def test_extreme_but_valid_integers_round_trip():
    big = P.WorkRequest((1 << 63) - 1, 1 << 20, 1 << 30, -1)
    assert codec.decode(codec.encode(big)) == big


@pytest.mark.parametrize("body", [
    [P.MsgType.WORK_REQUEST, -1, 4, 4],                       # request numbers count up from 0
    [P.MsgType.WORK_REQUEST, 1, 0, 4],                        # a batch of no sequences
    [P.MsgType.WELCOME, 1, 0.0, 10.0],                        # heartbeats every 0 s
    [P.MsgType.LEASE, 1, 1, 10.0, b"", b"", b"", [], b"", 0],  # zero steps
    [P.MsgType.LEASE, 1, 1, 10.0, b"\xff" * 8, b"\x01\x00\x00\x00", b"\x01\x00\x00\x00"],  # seq id -1
    [P.MsgType.TOKENS, b"", b"", b"", b"\x01\x00\x00", b""],      # not whole int32 items
    [P.MsgType.REQUEST_META, 1, "r", b"\xff\xff\xff\xff"],        # token id -1
    [P.MsgType.SUBMIT, [[1, b"\x01\x00\x00\x00", 0, 4]]],        # empty prompt
    [P.MsgType.SUBMIT, [[1, b"\x01\x00\x00\x00", 1, 4, 0.5, 1.5]]],  # top_p past 1
    [P.MsgType.SUBMIT, [], [], [["r1"]]],                     # an error without its message
    [P.MsgType.HELLO, "worker", "w" * 300],                    # a name past its bound
    [P.MsgType.VRAM_REPORT, "n", [["GPU-1", 0, "80", 5, 7]]],  # a string where a number goes
    [P.MsgType.STEP_RESULT, 1, b"", b"", b"", b"", -2],         # free KV tokens below -1
    [P.MsgType.FRONT_HELLO, 128, 1],                             # a front index past bits 32-38
    [P.MsgType.FRONT_HELLO, 0, 1, "e" * 1025],                   # a reason past its bound
    [P.MsgType.FRONT_STATUS, -1],                                # a negative count
    [P.MsgType.FRONT_ADMIT, b"\xff" * 8, True],                  # seq id -1
])
def test_values_out_of_range_are_rejected_at_decode(body):
    assert_rejected(pack([int(body[0])] + body[1:]))


# --- forward compatibility --------------------------------------------------------------

@pytest.mark.parametrize("msg", EXAMPLES, ids=lambda m: type(m).__name__)
def test_extra_trailing_fields_are_accepted(msg):
    body = body_of(msg) + [123, "from a newer peer", [1, 2], {"x": 1}]
    assert codec.decode(pack(body)) == msg


def test_extra_trailing_fields_inside_a_spec_are_accepted():
    body = body_of(P.Submit([spec(1)]))
    body[1][0] += ["future field", 3.5]
    assert codec.decode(pack(body)) == P.Submit([spec(1)])


@pytest.mark.parametrize("msg", EXAMPLES, ids=lambda m: type(m).__name__)
def test_missing_trailing_defaulted_fields_get_defaults(msg):
    required = [name for name, _, has_default in msg._fields if not has_default]
    body = body_of(msg)[: 1 + len(required)]
    expected = type(msg)(**{name: getattr(msg, name) for name in required})
    assert codec.decode(pack(body)) == expected


def test_defaults_are_the_declared_ones():
    assert codec.decode(pack([int(P.MsgType.HELLO), "worker", "w0"])) == P.Hello(
        "worker", "w0", P.PROTOCOL_VERSION, {})
    lease = codec.decode(pack([int(P.MsgType.LEASE), 1, 2, 3.0, b"", b"", b""]))
    assert (lease.full, lease.drop_ids, lease.num_steps) == ([], b"", 1)
    body = body_of(P.Submit([spec(1)]))
    body[1][0] = body[1][0][:4]  # seq_id, token_ids, prompt_len, max_new_tokens
    (s,) = codec.decode(pack(body)).seqs
    assert (s.temperature, s.top_p, s.top_k, s.seed) == (0.0, 1.0, 0, -1)
    assert (s.stop_ids, s.eos_ids, s.kv_from, s.transfer_id) == ([], [], "", 0)


@pytest.mark.parametrize("msg", [m for m in EXAMPLES if any(not d for _, _, d in m._fields)],
                         ids=lambda m: type(m).__name__)
def test_missing_required_field_is_rejected(msg):
    required = sum(not d for _, _, d in msg._fields)
    assert_rejected(pack(body_of(msg)[:required]))  # one short (the type takes a slot)


def test_spec_missing_a_required_field_is_rejected():
    body = body_of(P.Submit([spec(1)]))
    body[1][0] = body[1][0][:3]
    assert_rejected(pack(body))


# --- malformed input --------------------------------------------------------------------

@pytest.mark.parametrize("msg", EXAMPLES, ids=lambda m: type(m).__name__)
def test_every_truncation_is_rejected(msg):
    data = codec.encode(msg)
    for n in range(len(data)):
        assert_rejected(data[:n])


@pytest.mark.parametrize("msg", EXAMPLES, ids=lambda m: type(m).__name__)
def test_trailing_bytes_after_a_message_are_rejected(msg):
    assert_rejected(codec.encode(msg) + b"\x00")


@pytest.mark.parametrize("body", [
    7, "hello", b"\x05", None, 1.5, True, {"type": 5}, [], [None], ["5"], [5.0], [True, "w", "x"],
    [-1], [0], [999], [1 << 40],
], ids=repr)
def test_bodies_that_are_not_a_typed_list_are_rejected(body):
    assert_rejected(pack(body))


def test_non_msgpack_bytes_are_rejected():
    for data in (b"", b"\xc1", b"\xd4\x01\x02", b"\x92\x01", b"\x91\xa3\xff\xfe\xfd"):
        assert_rejected(data)


def _wrong_type_cases():
    for msg in EXAMPLES:
        for i, (name, hint, _) in enumerate(msg._fields):
            for j, bad in enumerate(bad_values(hint)):
                yield pytest.param(msg, i, bad, id=f"{type(msg).__name__}.{name}-{j}")


@pytest.mark.parametrize("msg, index, bad", list(_wrong_type_cases()))
def test_wrong_field_type_is_rejected(msg, index, bad):
    body = body_of(msg)
    body[1 + index] = bad
    assert_rejected(pack(body))


@pytest.mark.parametrize("index", range(len(SeqSpec._fields)), ids=lambda i: SeqSpec._fields[i][0])
def test_wrong_field_type_inside_a_spec_is_rejected(index):
    _, hint, _ = SeqSpec._fields[index]
    for bad in bad_values(hint):
        body = body_of(P.Submit([spec(1)]))
        body[1][0][index] = bad
        assert_rejected(pack(body))


def test_bool_and_int_are_not_interchangeable():
    assert_rejected(pack([int(P.MsgType.WORK_REQUEST), 1, True, 8192]))
    assert_rejected(pack([int(P.MsgType.DRAIN_ACK), 1, "ok"]))
    assert_rejected(pack([int(P.MsgType.FEED_LINES), ["x"], 0]))
    assert codec.decode(pack([int(P.MsgType.DRAIN_ACK), False, "no"])) == P.DrainAck(False, "no")


def test_nested_containers_where_scalars_are_expected_are_rejected():
    assert_rejected(codec.encode(P.Hello("worker", "w0", info={"gpu": {"uuid": "x"}})))
    assert_rejected(codec.encode(P.Hello("worker", "w0", info={"gpus": ["a", "b"]})))
    assert_rejected(codec.encode(P.Stats({"per_worker": {"w0": 1}})))
    assert_rejected(codec.encode(P.VramReport("n", [["GPU-1", {"free": 1}]])))
    assert_rejected(pack([int(P.MsgType.HEARTBEAT), {"name": "w0"}]))


def test_non_string_map_keys_are_rejected():
    assert_rejected(pack([int(P.MsgType.STATS), {1: 2}]))
    assert_rejected(pack([int(P.MsgType.STATS), {b"leases": 2}]))


def test_integers_beyond_int64_are_rejected():
    assert_rejected(pack([int(P.MsgType.INPUT_CLOSED), (1 << 64) - 1]))
    assert_rejected(pack([int(P.MsgType.INPUT_CLOSED), 1 << 63]))
    assert codec.decode(pack([int(P.MsgType.INPUT_CLOSED), (1 << 63) - 1])).num_requests == (1 << 63) - 1


def test_oversized_array_is_rejected():
    lines = [""] * (P.MAX_ARRAY_LEN + 1)
    assert_rejected(pack([int(P.MsgType.FEED_LINES), lines]))
    assert len(codec.decode(pack([int(P.MsgType.FEED_LINES), lines[:-1]])).lines) == P.MAX_ARRAY_LEN


def test_oversized_string_is_rejected():
    assert_rejected(pack([int(P.MsgType.REJECT), "x" * ((1 << 20) + 1)]))  # msgpack's own bound
    assert_rejected(pack([int(P.MsgType.REJECT), "x" * (P.MAX_STR + 1)]))  # any string field's
    assert codec.decode(pack([int(P.MsgType.REJECT), "x" * P.MAX_STR])).reason == "x" * P.MAX_STR


def test_oversized_map_is_rejected():
    assert_rejected(pack([int(P.MsgType.STATS), {f"k{i}": i for i in range(1025)}]))


def test_oversized_message_is_rejected_before_decoding():
    assert_rejected(b"\x00" * (P.MAX_MESSAGE_BYTES + 1))


def test_deep_nesting_is_rejected():
    assert_rejected(b"\x91" * 100_000 + b"\xc0")
    assert_rejected(pack([int(P.MsgType.STATS), {"k": [[[[1]]]]}]))


def test_ext_types_are_rejected():
    assert_rejected(pack([int(P.MsgType.REJECT), msgpack.ExtType(1, b"abc")]))
    ts = msgpack.packb([int(P.MsgType.REJECT), msgpack.Timestamp(1, 0)], datetime=False)
    assert_rejected(ts)


def test_invalid_utf8_string_is_rejected():
    assert_rejected(b"\x92\x03\xa2\xff\xfe")  # [REJECT, <str of two invalid bytes>]


def _mutate(rng: random.Random, data: bytes) -> bytes:
    buf = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(3)
        pos = rng.randrange(len(buf) + 1)
        if op == 0 and buf:
            buf[min(pos, len(buf) - 1)] = rng.randrange(256)
        elif op == 1:
            buf[pos:pos] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 3)))
        elif buf:
            del buf[pos:pos + rng.randint(1, 3)]
    return bytes(buf)


def test_fuzz_only_protocol_error_escapes():
    rng = random.Random(20240611)
    encoded = [codec.encode(m) for m in EXAMPLES]
    num_decoded = num_rejected = 0
    for i in range(2000):
        if i % 2:
            data = bytes(rng.randrange(256) for _ in range(rng.randint(0, 48)))
            if data and rng.random() < 0.5:  # make it look like a message more often
                data = bytes([0x90 | rng.randint(1, 15), rng.randint(1, 23)]) + data
        else:
            data = _mutate(rng, rng.choice(encoded))
        try:
            msg = codec.decode(data)
        except ProtocolError:
            num_rejected += 1
            continue
        num_decoded += 1
        assert type(msg) in P.MESSAGE_TYPES.values()
        again = codec.encode(msg)  # whatever decodes is well-typed enough to encode again
        assert codec.encode(codec.decode(again)) == again
    assert num_rejected > 1000 and num_decoded > 0


# --- packed arrays ----------------------------------------------------------------------

def test_packed_arrays_are_little_endian_and_round_trip():
    assert P.pack_i32([1, -2]) == b"\x01\x00\x00\x00\xfe\xff\xff\xff"
    assert P.pack_i64([1]) == b"\x01" + b"\x00" * 7
    assert P.pack_u8([0, 255]) == b"\x00\xff"
    ids = [0, 1, 1499, (1 << 31) - 1]
    assert P.unpack_ids(P.pack_i32(ids)).tolist() == ids
    assert P.unpack_i32(P.pack_i32([-5, 7])).tolist() == [-5, 7]
    assert P.unpack_i64(P.pack_i64([-(1 << 63), (1 << 63) - 1])).tolist() == [-(1 << 63), (1 << 63) - 1]
    assert P.unpack_u8(P.pack_u8([0, 4, 255])).tolist() == [0, 4, 255]
    assert P.pack_i32(np.array([3, 4], dtype=np.int64)) == P.pack_i32([3, 4])
    assert P.unpack_ids(b"").size == 0 and P.unpack_i64(b"").size == 0


@pytest.mark.parametrize("unpack, itemsize", [
    (P.unpack_ids, 4), (P.unpack_i32, 4), (P.unpack_i64, 8),
])
def test_unpack_rejects_partial_items(unpack, itemsize):
    for n in range(1, 3 * itemsize):
        if n % itemsize:
            with pytest.raises(ProtocolError):
                unpack(b"\x01" * n)
        else:
            assert unpack(b"\x01" * n).size == n // itemsize


def test_unpack_ids_rejects_negative_ids():
    with pytest.raises(ProtocolError):
        P.unpack_ids(P.pack_i32([5, -1, 7]))
    with pytest.raises(ProtocolError):
        P.unpack_ids(P.pack_i32([-(1 << 31)]))
    assert P.unpack_i32(P.pack_i32([5, -1])).tolist() == [5, -1]  # plain i32 may be negative


def test_spec_ids_are_validated():
    assert spec(token_ids=P.pack_i32([1, 2, 3])).ids.tolist() == [1, 2, 3]
    with pytest.raises(ProtocolError):
        spec(token_ids=P.pack_i32([1, -2])).ids
    with pytest.raises(ProtocolError):
        spec(token_ids=b"\x01\x02\x03").ids


@pytest.mark.parametrize("bad", [
    P.MaskFill(P.pack_i64([7]), P.pack_i64([4]), 16, turn=2, job=1),
    P.MaskFill(P.pack_i64([7]), P.pack_i64([4]), 16, turn=0, job=1 << 32),
    P.MaskShare("/proc/1/fd/3", 0, 1536),
    P.MaskShare("/proc/1/fd/3", 256, 1 << 21),
])
def test_a_mask_fill_or_share_out_of_range_is_refused_at_decode(bad):
    with pytest.raises(ProtocolError, match="out of range"):
        codec.decode(codec.encode(bad))


def test_messages_are_immutable():
    with pytest.raises(dataclasses.FrozenInstanceError):
        P.Drain("w0").worker = "w1"


def test_finish_codes():
    assert [f.is_finished for f in Finish] == [False, True, True, True, False, True, True]
    assert [f.reason for f in Finish] == ["", "eos", "length", "stop", "", "error", "cancelled"]
    assert [f.openai_reason for f in Finish] == [None, "stop", "length", "stop", None, None, None]
    assert all(Finish.from_reason(f.reason) is f for f in Finish if f.is_finished)
    assert Finish.from_reason("no such reason") is Finish.ERROR


def test_seq_spec_validity():
    ok = P.SeqSpec(1, P.pack_i32([5, 6]), 2, 1)
    assert ok.is_valid
    for bad in (dataclasses.replace(ok, prompt_len=0), dataclasses.replace(ok, prompt_len=3),
                dataclasses.replace(ok, max_new_tokens=0), dataclasses.replace(ok, token_ids=b"")):
        assert not bad.is_valid


def test_finish_codes_allowed_per_message():
    step = P.StepResult(1, P.pack_i64([1]), P.pack_i32([0]), b"", P.pack_u8([Finish.CANCELLED]))
    tokens = P.Tokens(P.pack_i64([1]), P.pack_i32([0]), P.pack_i32([0]), b"", P.pack_u8([7]))
    replies = P.Replies(P.pack_i64([1]), P.pack_u8([Finish.NEED_IDS]), P.pack_i32([0]), [""])
    for msg in (step, tokens, replies):  # CANCELLED comes only from the detokenizer, NEED_IDS only from a worker
        with pytest.raises(P.ProtocolError):
            codec.decode(codec.encode(msg))


# --- data, never code -------------------------------------------------------------------

FORBIDDEN = re.compile(r"pickle|marshal|(?<![\w.])(eval|exec)\s*\(|(send|recv)_pyobj|__import__")


def test_no_code_execution_on_the_wire():
    sources = sorted(PACKAGE_DIR.rglob("*.py"))
    assert len(sources) > 10
    hits = [f"{path.relative_to(PACKAGE_DIR.parent)}:{no}: {line.strip()}"
            for path in sources
            for no, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
            if FORBIDDEN.search(line)]
    assert hits == []


def test_forbidden_pattern_catches_what_it_should():
    assert FORBIDDEN.search("import pickle") and FORBIDDEN.search("x = eval(text)")
    assert FORBIDDEN.search("sock.recv_pyobj()") and FORBIDDEN.search("exec (code)")
    assert not FORBIDDEN.search("model = model.to(dev).eval()")


def test_a_submit_is_bounded_by_prompts_and_by_ids_and_never_empty():
    small = [P.SeqSpec(i + 1, P.pack_i32([5] * 100), 100, 8) for i in range(1000)]
    assert P.submit_count(small) == P.SUBMIT_MAX_SEQS
    assert P.submit_count(small[:3]) == 3
    assert P.submit_count([]) == 0
    big = P.SeqSpec(1, P.pack_i32([5] * (P.SUBMIT_MAX_IDS - 50)), 10, 8)
    assert P.submit_count([big, small[0]]) == 1            # the next would pass the ids bound
    assert P.submit_count(small[:1] + [big]) == 1
    huge = P.SeqSpec(1, P.pack_i32([5] * (P.SUBMIT_MAX_IDS + 1)), 10, 8)
    assert P.submit_count([huge, small[0]]) == 1           # one alone always goes
