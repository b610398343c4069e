"""One rank's place in a pipeline-parallel group: its stage's communicator and its activation
links (pipeline.py), set up in two rounds through the driver, and the part of a step it runs.

Set-up (executor.py drives it; the messages are listed there):
  1. `bind()`: what this rank listens on -- its link from the previous stage (stage > 0; the
     driver: the link from the last stage's tp rank 0, which brings the logits) and, for the
     first rank of a stage > 0 with tp_size > 1, its stage's CpuCommunicator. The addresses go to
     the driver (`bound`), which sends every rank the full list (`peers`).
  2. `connect(peers, ...)`: the link to the next stage (the last stage's tp rank 0: to the
     driver) and this stage's communicator (stage 0's is the driver's, as without pipelining;
     a stage > 0 group authenticates with keys derived from the group secret and the launch's
     nonce, pipeline.stage_comm_key; on cuda an NCCL communicator per stage from the plan's
     unique ids).

Activations: on cuda device to device, NCCL send/recv over a two-rank communicator per link
(the plan's `nccl_link_ids`, one per sending rank; the ZeroMQ link carries the header); on
cpu/sim through host memory over ZeroMQ.
"""
from __future__ import annotations

import ipaddress
import socket
import time

import zmq

from pagedrun.runtime.distributed.communicator import CpuCommunicator
from pagedrun.runtime.distributed.pipeline import (GroupLayout, LinkReceiver, LinkSender,
                                                   SoloCommunicator, link_key, receive_hidden,
                                                   send_hidden, send_logits, stage_comm_key)


def local_address_towards(host: str) -> str:
    """The IP of this node's interface that reaches `host` (loopback for a loopback host): what
    a rank binds so the other nodes' ranks can connect."""
    try:
        if ipaddress.ip_address(host).is_loopback:
            return host
    except ValueError:
        host = socket.gethostbyname(host)
        if ipaddress.ip_address(host).is_loopback:
            return host
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect((host, 9))  # UDP: no packet is sent, the route picks the interface
        return probe.getsockname()[0]


def make_link_comm(unique_id, rank: int, device_id: int):
    """The two-rank NCCL communicator of one link (the sender is rank 0)."""
    from pagedrun.runtime.distributed.nccl_communicator import NcclCommunicator

    return NcclCommunicator(rank, 2, unique_id, device_id=device_id)


def _tcp(host: str) -> str:
    return f"tcp://[{host}]:0" if ":" in host else f"tcp://{host}:0"


class StagePipe:
    """Rank `rank`'s communicator and links. plan: the executor's plan (tp_size, pp_size,
    group_nonce, collective_timeout_s); secret: the group secret; bind_ip: local_address_towards
    the driver."""

    def __init__(self, plan: dict, rank: int, context: zmq.Context, secret: bytes,
                 curve: bool, bind_ip: str) -> None:
        self.layout = GroupLayout(plan["tp_size"], plan["pp_size"])
        self.rank = rank
        self.stage = self.layout.stage(rank)
        self.tp_rank = self.layout.tp_rank(rank)
        self.is_last = self.layout.is_last(rank)
        self._ctx, self._secret, self._bind_ip = context, secret, bind_ip
        self._curve_secret = secret if curve else None
        self._nonce = plan["group_nonce"]
        self._timeout_s = plan["collective_timeout_s"]
        self._plan = plan
        self.link_in: LinkReceiver | None = None
        self.link_out: LinkSender | None = None
        self.comm = None

    @property
    def _sender_rank(self) -> int | None:
        """Who sends to this rank's link: the previous stage's same tp rank; for the driver the
        last stage's tp rank 0; None for the rest of stage 0."""
        if self.stage > 0:
            return self.layout.rank(self.stage - 1, self.tp_rank)
        if self.rank == 0:
            return self.layout.rank(self.layout.pp_size - 1, 0)
        return None

    def bind(self) -> dict:
        """Round 1: listen; the addresses for the driver's `peers` list."""
        sender = self._sender_rank
        if sender is not None:
            self.link_in = LinkReceiver(self._ctx, _tcp(self._bind_ip),
                                        link_key(self._secret, self._nonce, sender, self.rank),
                                        sender, self._timeout_s, self._curve_secret)
        comm_address = None
        tp_size = self.layout.tp_size
        if self.stage > 0 and tp_size > 1 and self.tp_rank == 0 and not self._nccl:
            peer_keys = {t: stage_comm_key(self._secret, self._nonce, self.rank + t)
                         for t in range(1, tp_size)}
            self.comm = CpuCommunicator(0, tp_size, bind=_tcp(self._bind_ip),
                                        timeout_s=self._timeout_s, context=self._ctx,
                                        peer_keys=peer_keys, curve_secret=self._curve_secret)
            comm_address = self.comm.address
        return {"link": None if self.link_in is None else self.link_in.address,
                "comm": comm_address}

    @property
    def _nccl(self) -> bool:
        return self._plan.get("nccl_unique_ids") is not None

    def connect(self, peers: dict, stage0_comm=None, device_id: int = 0,
                rendezvous_timeout_s: float = 60.0):
        """Round 2: connect the outgoing link and this stage's communicator. peers: {"links":
        [address per rank or None], "comms": [address per stage or None]}. stage0_comm: stage
        0's communicator where this rank builds it the pre-pipelining way (a callable)."""
        layout = self.layout
        if not self.is_last:
            target = layout.rank(self.stage + 1, self.tp_rank)
        else:
            target = 0 if self.tp_rank == 0 else None
        if target is not None:
            self.link_out = LinkSender(self._ctx, peers["links"][target],
                                       link_key(self._secret, self._nonce, self.rank, target),
                                       self._curve_secret)
        tp_size = layout.tp_size
        if tp_size == 1:
            self.comm = SoloCommunicator()
        elif self._nccl:
            from pagedrun.runtime.distributed.nccl_communicator import NcclCommunicator

            self.comm = NcclCommunicator(self.tp_rank, tp_size,
                                         self._plan["nccl_unique_ids"][self.stage],
                                         device_id=device_id)
        elif self.stage == 0:
            self.comm = stage0_comm()
        elif self.tp_rank == 0:
            self.comm.wait_for_peers(rendezvous_timeout_s)
        else:
            self.comm = CpuCommunicator(
                self.tp_rank, tp_size, connect=peers["comms"][self.stage],
                timeout_s=self._timeout_s, context=self._ctx,
                auth_key=stage_comm_key(self._secret, self._nonce, self.rank),
                curve_secret=self._curve_secret)
        link_ids = self._plan.get("nccl_link_ids")
        if link_ids is not None:
            # In this order on every rank (incoming, then outgoing): each init blocks until its
            # peer joins, and stage s's outgoing pair is stage s + 1's incoming one.
            if self.stage > 0:
                self.link_in.nccl = make_link_comm(
                    link_ids[layout.rank(self.stage - 1, self.tp_rank)], 1, device_id)
            if not self.is_last:
                self.link_out.nccl = make_link_comm(link_ids[self.rank], 0, device_id)
        return self.comm

    def run_step(self, runner, step) -> None:
        """A worker's part of one step: the previous stage's activations (stage > 0), this
        stage's layers, then the activations on to the next stage, or (last stage) the logits
        to the driver (tp rank 0; the others' slices were gathered to it)."""
        hidden, times = None, []
        if self.stage > 0:
            hidden, times = receive_hidden(self.link_in, runner.ops,
                                           f"rank {self.rank}: step {step.seq}'s activations")
        start = time.monotonic()
        hidden = runner.forward(step, hidden, step.virtual_engine, step.row_lora_slots)
        if not self.is_last:
            send_hidden(self.link_out, hidden, times + [[self.stage, start, time.monotonic()]])
            return
        output = runner.output(step, hidden, step.prompt_logit_rows)
        if self.link_out is not None:
            send_logits(self.link_out, output, times + [[self.stage, start, time.monotonic()]])

    def use_stream(self, ops) -> None:
        """NCCL links on the backend's compute stream (as the collectives, worker.build_rank)."""
        for link in (self.link_in, self.link_out):
            if link is not None and link.nccl is not None and ops.capabilities.compute_stream:
                link.nccl.use_stream(ops.stream)

    def close(self) -> None:
        for part in (self.link_in, self.link_out):
            if part is not None:
                if part.nccl is not None:
                    part.nccl.close()
                part.close()
