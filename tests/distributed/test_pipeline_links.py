"""The activation links between pipeline stages (pipeline.py, stage_pipe.py), in one process:
- only the sender that proves the link key is heard (a stranger that connects first is dropped);
- messages arrive whole and in order, with each stage's compute times; one out of order fails;
- a sender that goes away ends the receiver's wait with PeerLostError, not a hang;
- on cuda the arrays go through the link's NCCL pair (a fake pair here: the ZeroMQ message carries
  the header only) and come out as the sender's arrays;
- a stage rank sets up its NCCL pairs incoming first, then outgoing (each init blocks until the
  peer joins; this order cannot deadlock along the chain)."""
from __future__ import annotations

import queue

import numpy as np
import pytest
import zmq

from pagedrun.runtime.distributed import stage_pipe
from pagedrun.runtime.distributed.communicator import PeerLostError
from pagedrun.runtime.distributed.pipeline import (LinkReceiver, LinkSender, link_key,
                                                   receive_hidden, send_hidden)
from pagedrun.runtime.distributed.stage_pipe import StagePipe

SECRET = b"s" * 32
NONCE = b"n" * 16
TIMEOUT_S = 5.0


class _Numpy:
    xp = np


@pytest.fixture
def link():
    ctx = zmq.Context()
    key = link_key(SECRET, NONCE, 0, 1)
    receiver = LinkReceiver(ctx, "tcp://127.0.0.1:0", key, 0, TIMEOUT_S)
    sender = LinkSender(ctx, receiver.address, key)
    yield ctx, receiver, sender
    sender.close()
    receiver.close()
    ctx.term()


def test_hidden_states_arrive_in_order_with_times(link):
    _, receiver, sender = link
    rng = np.random.default_rng(0)
    sent = []
    for tokens in (1, 17, 0, 111):
        hidden = None if tokens == 0 else (
            rng.standard_normal((tokens, 96)).astype(np.float32),
            rng.integers(0, 2**16, (tokens, 96), dtype=np.uint16))  # bf16 bits travel as bits
        send_hidden(sender, hidden, [[0, 1.0, 2.0 + tokens]])
        sent.append(hidden)
    for hidden in sent:
        got, times = receive_hidden(receiver, _Numpy, "test")
        assert times == [[0, 1.0, 2.0 + (0 if hidden is None else hidden[0].shape[0])]]
        if hidden is None:
            assert got is None
            continue
        for a, b in zip(got, hidden):
            assert a.dtype == b.dtype and np.array_equal(a, b)
            a[0, 0] = 0  # writable copies: the ops may update them in place


def test_a_stranger_is_not_heard():
    """A stranger connects and says hello (with another launch's key) before the real sender
    exists: its hello and its message are dropped, the real sender's are taken."""
    ctx = zmq.Context()
    key = link_key(SECRET, NONCE, 0, 1)
    receiver = LinkReceiver(ctx, "tcp://127.0.0.1:0", key, 0, 0.5)
    stranger = ctx.socket(zmq.DEALER)
    stranger.connect(receiver.address)
    stranger.send_multipart([b"hello", link_key(SECRET, b"x" * 16, 0, 1)])
    stranger.send_multipart([b"\x81\xa3seq\x01", b""])
    try:
        with pytest.raises(PeerLostError, match="within"):  # heard nothing it accepts
            receiver.recv("test")
        sender = LinkSender(ctx, receiver.address, key)
        send_hidden(sender, (np.ones((2, 4), np.float32),) * 2, [])
        got, _ = receive_hidden(receiver, _Numpy, "test")
        assert np.array_equal(got[0], np.ones((2, 4), np.float32))
        sender.close()
    finally:
        stranger.close(linger=0)
        receiver.close()
        ctx.term()


def test_out_of_order_message_fails(link):
    _, receiver, sender = link
    sender.seq = 5  # the next message claims step 6; the receiver expects 1
    send_hidden(sender, None, [])
    with pytest.raises(RuntimeError, match="expected 1"):
        receiver.recv("test")


def test_sender_gone_ends_the_wait(link):
    _, receiver, sender = link
    send_hidden(sender, None, [])
    receiver.recv("test")  # the sender is authenticated and watched now
    sender.sock.close(linger=0)
    with pytest.raises(PeerLostError, match="dropped"):
        receiver.recv("waiting for step 2")


class FakeNcclPair:
    """Two ends of a two-rank NCCL communicator: send/recv as NcclCommunicator's, in memory."""

    def __init__(self) -> None:
        self.queue: queue.Queue = queue.Queue()
        self.sent = 0

    def send(self, x, peer: int) -> None:
        assert peer == 1
        self.sent += 1
        self.queue.put(np.array(x))

    def recv(self, shape, dtype, peer: int):
        assert peer == 0
        x = self.queue.get(timeout=TIMEOUT_S)
        assert x.shape == tuple(shape) and x.dtype == dtype
        return x


def test_nccl_link_carries_the_arrays(link):
    _, receiver, sender = link
    pair = FakeNcclPair()
    sender.nccl = receiver.nccl = pair
    frames = []
    send_multipart = sender.sock.send_multipart
    sender.sock.send_multipart = lambda msg, **kw: (frames.append(len(msg)),
                                                    send_multipart(msg, **kw))
    x = np.arange(17 * 8, dtype=np.float32).reshape(17, 8)
    send_hidden(sender, (x, x + 1), [[0, 0.0, 1.0]])
    got, times = receive_hidden(receiver, _Numpy, "test")
    assert pair.sent == 2 and frames == [1]  # the header alone went over ZeroMQ
    assert np.array_equal(got[0], x) and np.array_equal(got[1], x + 1)
    assert times == [[0, 0.0, 1.0]]
    send_hidden(sender, None, [])  # no tokens: nothing for NCCL to carry
    assert receive_hidden(receiver, _Numpy, "test")[0] is None and pair.sent == 2


def test_stage_sets_up_nccl_links_incoming_first(monkeypatch):
    """Rank 1 of a 3-stage, TP = 1 group: pairs (link of rank 0, as rank 1), then (its own
    link, as rank 0)."""
    made = []
    monkeypatch.setattr(stage_pipe, "make_link_comm",
                        lambda uid, rank, device_id: made.append((uid, rank)) or object())
    ctx = zmq.Context()
    plan = {"tp_size": 1, "pp_size": 3, "group_nonce": NONCE, "collective_timeout_s": 5.0,
            "nccl_link_ids": [[1], [2], None]}
    pipe = StagePipe(plan, 1, ctx, SECRET, False, "127.0.0.1")
    downstream = LinkReceiver(ctx, "tcp://127.0.0.1:0", link_key(SECRET, NONCE, 1, 2), 1, 5.0)
    try:
        addresses = pipe.bind()
        assert addresses["link"] is not None and addresses["comm"] is None
        pipe.connect({"links": [None, addresses["link"], downstream.address],
                      "comms": [None, None, None]})
        assert made == [([1], 1), ([2], 0)]
    finally:
        pipe.link_in.nccl = pipe.link_out.nccl = None
        pipe.close()
        downstream.close()
        ctx.term()
