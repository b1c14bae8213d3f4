"""KV shipments on the wire: `Worker.send_kv` on one side, `Worker.receive_kv` on the other,
over real ZeroMQ sockets (no model: the receiving core only files what arrived)."""

from __future__ import annotations

import time

import pytest
import torch
import zmq

from qmigrate.wire import protocol as P
from qmigrate.wire import codec
from qmigrate.wire import transport
from qmigrate.worker.core import WorkerCore
from qmigrate.worker.loop import Worker

SHAPE = (2, 2, 5, 3, 4)  # [layers, k/v, tokens, kv heads, head dim]


@pytest.fixture
def pair(ipc_dir):
    """(sender, receiver, the receiver's KV endpoint): the two halves of two workers."""
    endpoint = f"ipc://{ipc_dir}/kv.sock"
    sender = Worker.__new__(Worker)
    sender.peers = {}
    receiver = Worker.__new__(Worker)
    receiver.kv_in = transport.socket(zmq.PULL, bind=endpoint, max_bytes=transport.KV_MAX_MESSAGE_BYTES, hwm=64)
    receiver.core = WorkerCore(engine=None)
    yield sender, receiver, endpoint
    for sock in sender.peers.values():
        sock.close(linger=0)
    receiver.kv_in.close(linger=0)


def _receive(receiver: Worker, transfer_ids: set[int], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not transfer_ids <= set(receiver.core.transfers):
        assert time.monotonic() < deadline, f"only {sorted(receiver.core.transfers)} arrived"
        receiver.kv_in.poll(50)
        receiver.receive_kv()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_shipped_kv_arrives_whole(pair, dtype):
    sender, receiver, endpoint = pair
    kv = torch.randn(SHAPE).to(dtype)
    sender.send_kv(P.ShipKV(7, endpoint, 41, SHAPE[2]), kv)
    _receive(receiver, {41})
    got = receiver.core.transfers[41]
    assert got.seq_id == 7 and got.kv.dtype == dtype and torch.equal(got.kv, kv)


def test_nothing_to_ship_arrives_as_no_kv(pair):
    """An owner that no longer holds the KV says so: the receiver recomputes at once."""
    sender, receiver, endpoint = pair
    sender.send_kv(P.ShipKV(7, endpoint, 42, SHAPE[2]), None)
    _receive(receiver, {42})
    assert receiver.core.transfers[42].kv is None


def test_malformed_shipments_are_dropped_and_the_next_one_arrives(pair):
    sender, receiver, endpoint = pair
    kv = torch.randn(SHAPE)
    sender.send_kv(P.ShipKV(7, endpoint, 43, SHAPE[2]), kv)   # opens the sender's socket to the peer
    sock = sender.peers[endpoint]
    short = P.KVHeader(44, 8, SHAPE[2], "float32", list(SHAPE))
    sock.send_multipart([codec.encode(short), kv.numpy().tobytes()[:-4]])           # a byte count that does not fit
    sock.send_multipart([codec.encode(P.KVHeader(45, 9, SHAPE[2], "int8", list(SHAPE))), b"\0" * 240])  # no such KV dtype
    sock.send_multipart([codec.encode(P.Drain("w1")), b""])                          # not a KV header
    sock.send_multipart([b"\xc1garbage"])                                        # not msgpack, one frame
    sender.send_kv(P.ShipKV(10, endpoint, 46, SHAPE[2]), kv)
    _receive(receiver, {43, 44, 45, 46})
    transfers = receiver.core.transfers
    assert torch.equal(transfers[43].kv, kv) and torch.equal(transfers[46].kv, kv)
    assert transfers[44].kv is None and transfers[45].kv is None   # filed as "no KV": recomputed
    assert set(transfers) == {43, 44, 45, 46}


_SEND_AND_LEAVE = """
import os, sys
import zmq
from qmigrate.wire import transport
sock = transport.socket(zmq.PUSH, connect=sys.argv[1])
sock.send(b"kv" * 50_000)
sock.close(linger=2000)
transport.end()
os._exit(0)   # as a role forked from its zygote ends
"""


def test_a_process_that_ships_and_leaves_at_once_delivers_the_shipment(ipc_dir):
    """A drained worker ships its last sequences' KV, to a peer it may never have sent to,
    and leaves at once (Worker.close). A process ending without `transport.end` took the
    message along unsent, every time: its socket had not even connected yet."""
    import subprocess
    import sys
    address = f"ipc://{ipc_dir}/kv-in.sock"
    sink = transport.socket(zmq.PULL, bind=address)
    try:
        for _ in range(3):
            subprocess.run([sys.executable, "-c", _SEND_AND_LEAVE, address], check=True, timeout=60)
            assert sink.poll(5000), "the shipment was lost when its sender ended"
            assert sink.recv() == b"kv" * 50_000
    finally:
        sink.close(linger=0)
