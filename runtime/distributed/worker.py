"""A tensor-parallel worker process: one rank's device, weight shard and KV cache, and its loop.

    python -m pagedrun.runtime.distributed.worker --master-addr HOST:PORT --rank R  < launch

The launch (auth.encode_launch: the group's secret, CURVE on/off) arrives on stdin, written by
whoever spawned the worker (executor.spawn_workers, from the driver or a headless node), so the
secret is on no command line and in no environment.

Life of a worker (the driver's side is executor.py; the messages are listed there):
  1. connect a DEALER to the driver's control ROUTER and authenticate (auth.py): hello (rank,
     pid, host, nonce; MAC under the secret), the driver's challenge (its nonce; its MAC proves
     it holds the secret), join (sealed with the session key derived from both nonces); from
     then on every message either way is sealed, and one that does not open is dropped;
  2. receive the plan (model as the user named it, resolved here: a directory, a .gguf (its
     converted cache on this node), or None (this node's default model); device, dtype, KV
     sizes, the communicator's address or the NCCL unique id);
  3. read only its shard from the safetensors files, build its communicator (its hello carries
     a MAC under the session key), its model (the registry's forward with a TensorParallel
     over that communicator) and a ModelRunner whose KV pools hold
     only its KV heads; report ready;
  4. loop: each step message -> `runner.execute` (the collectives inside keep the ranks in step;
     rank 0 gathers the logits); `shutdown` -> exit 0.
Every wait is bounded: the driver's connection dropping (its process died or its host went
silent past the ZMTP heartbeat) ends the worker with EXIT_DRIVER_LOST, and any exception is
reported to the driver as an `error` message before the worker exits with EXIT_ERROR. A driver
that refuses the worker (an `error` before the session: wrong rank, or the secret differs) or
that fails the challenge ends it with EXIT_ERROR.
"""
from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import logging
import os
import secrets
import signal
import socket
import sys
import time
from functools import partial

import msgpack
import zmq

from pagedrun.runtime.distributed import auth
from pagedrun.runtime.distributed.communicator import (POLL_INTERVAL_S, ConnectionWatch,
                                                       PeerLostError, recv_bounded,
                                                       set_heartbeats)
from pagedrun.runtime.distributed.pipeline import GroupLayout
from pagedrun.runtime.distributed.step_broadcast import STEP, decode_step

log = logging.getLogger("pagedrun.worker")

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_DRIVER_LOST = 3
DEFAULT_JOIN_TIMEOUT_S = 60.0


def parse_master_addr(addr: str) -> tuple[str, int]:
    """"HOST:PORT" (IPv6 as "[::1]:PORT") -> (host, port)."""
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"--master-addr must be HOST:PORT, got {addr!r}")
    return host.strip("[]"), int(port)


def zmq_tcp(host: str, port: int) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def build_rank(plan: dict, rank: int, comm, ops=None):
    """This rank's ModelRunner over its shard (rank 0 too: executor.py calls this in-process,
    with the engine's backend as `ops`)."""
    from pagedrun.runtime.backends import make_backend
    from pagedrun.runtime.distributed.sharding import load_shard, rank_config, shard_spec
    from pagedrun.runtime.distributed.tensor_parallel import TensorParallel
    from pagedrun.runtime.model_config import ModelConfig
    from pagedrun.runtime.model_loader import resolve_model_dir
    from pagedrun.runtime.model_runner import ModelRunner
    from pagedrun.runtime.models.registry import build_model

    model_dir = resolve_model_dir(plan["model"])
    config = ModelConfig.from_model_dir(model_dir)
    layout = GroupLayout(plan["tp_size"], plan.get("pp_size", 1))
    stage = layout.stage(rank)
    # A pipeline stage holds layers [start, end); without pipelining, all of them.
    start, end = plan.get("stage_layers", [[0, config.num_hidden_layers]])[stage]
    spec = shard_spec(config, plan["tp_size"], layout.tp_rank(rank))
    if ops is None:
        ops = make_backend(plan["device"], plan["dtype"], device_id=plan["local_rank"],
                           quantization=plan.get("quantization"),
                           kv_cache_dtype=plan.get("kv_cache_dtype", "auto"))
    if hasattr(comm, "use_stream") and ops.capabilities.compute_stream:
        comm.use_stream(ops.stream)  # NCCL on the compute stream
    local_config = dataclasses.replace(rank_config(config, spec), num_hidden_layers=end - start)
    weights = load_shard(model_dir, config, spec, layers=range(start, end), embed=stage == 0,
                         head=layout.is_last(rank))
    model = build_model(local_config, weights, ops, plan["max_model_len"], first_layer=start,
                        tp=TensorParallel(spec, comm, ops))
    lora_config = load_adapter = None
    if plan.get("lora") is not None:  # adapters: this rank's shard of each, from the full config
        from pagedrun.runtime.lora.lora_config import LoRAConfig
        from pagedrun.runtime.lora.peft_loader import load_peft_adapter

        lora_config = LoRAConfig(**plan["lora"])
        load_adapter = partial(load_peft_adapter, config=config,
                               max_lora_rank=lora_config.max_lora_rank, shard=spec,
                               layer_range=range(start, end))
    runner = ModelRunner(local_config, None, block_size=plan["block_size"],
                         max_model_len=plan["max_model_len"], ops=ops, model=model,
                         # rank 0 samples: where its backend's sampler reads them
                         logits_on_device=rank == 0 and ops.logits_on_device,
                         lora_config=lora_config, load_adapter=load_adapter)
    # One set of pools per virtual engine (pipeline.py): as many as stages.
    runner.allocate_kv_cache(plan["num_gpu_blocks"], plan["num_cpu_blocks"], layout.pp_size)
    if plan.get("graph_sizes"):
        # Every rank captures the same sizes in the same order: the collectives of the warm-up
        # and capture forwards pair up across ranks (runtime/decode_graphs.py).
        why_not = runner.capture_decode_graphs(plan["graph_sizes"])
        if why_not is not None and rank == 0:
            log.info("decode graphs: off (%s); every step runs eagerly", why_not)
    return runner


def make_communicator(plan: dict, rank: int, context: zmq.Context, auth_key: bytes | None = None,
                      curve_secret: bytes | None = None):
    if plan.get("nccl_unique_id") is not None:
        from pagedrun.runtime.distributed.nccl_communicator import NcclCommunicator

        return NcclCommunicator(rank, plan["tp_size"], plan["nccl_unique_id"],
                                device_id=plan["local_rank"])
    from pagedrun.runtime.distributed.communicator import CpuCommunicator

    return CpuCommunicator(rank, plan["tp_size"], connect=plan["comm_address"],
                           timeout_s=plan["collective_timeout_s"], context=context,
                           auth_key=auth_key, curve_secret=curve_secret)


class Refused(Exception):
    """The driver refused this worker, or failed to prove it holds the secret."""


def _text(frames) -> str:
    return frames[1].bytes.decode(errors="replace") if len(frames) > 1 else "(no reason)"


def _join(control, secret: bytes, rank: int, master_addr: str, timeout_s: float
          ) -> auth.Channel:
    """hello -> challenge -> join (auth.py); the session's Channel."""
    nonce = secrets.token_bytes(auth.NONCE_BYTES)
    hello = [b"hello", msgpack.packb({"rank": rank, "pid": os.getpid(),
                                      "host": socket.gethostname(), "nonce": nonce})]
    control.send_multipart([*hello, auth.mac(secret, b"hello", hello)])
    # No watch here: before the driver answers, "disconnected" only means "not up yet".
    frames = recv_bounded(control, None, timeout_s, f"rank {rank}: the driver at {master_addr}")
    kind = frames[0].bytes
    if kind == b"error":  # before the session nothing can be verified; refusing is harmless
        raise Refused(f"the driver refused it: {_text(frames)}")
    try:
        if kind != b"challenge" or len(frames) != 3:
            raise auth.AuthError(f"{kind!r} instead of a challenge")
        auth.check_mac(secret, b"challenge" + nonce, frames[:2], frames[2])
        driver_nonce = msgpack.unpackb(frames[1].bytes)["nonce"]
    except (auth.AuthError, ValueError, KeyError, TypeError) as exc:
        raise Refused(f"the driver at {master_addr} failed authentication ({exc}): is its "
                      f"tensor-parallel secret this node's?") from None
    channel = auth.Channel(auth.session_key(secret, rank, nonce, driver_nonce),
                           outgoing=auth.WORKER_TO_DRIVER, incoming=auth.DRIVER_TO_WORKER)
    control.send_multipart(channel.seal([b"join", msgpack.packb({"rank": rank})]))
    return channel


def _recv_sealed(control, watch, channel: auth.Channel, timeout_s: float, what: str,
                 dropped: auth.DropLog, session_started: bool = True) -> list:
    """The next message that opens under the session (dropping the rest), bounded."""
    deadline = time.monotonic() + timeout_s
    while True:
        frames = recv_bounded(control, watch, max(0.0, deadline - time.monotonic()), what)
        try:
            return channel.open(frames)
        except auth.AuthError as exc:
            if not session_started and frames[0].bytes == b"error":  # join refused
                raise Refused(f"the driver refused it: {_text(frames)}") from None
            dropped("from the driver", str(exc))


def run_worker(master_addr: str, rank: int, local_rank: int,
               join_timeout_s: float = DEFAULT_JOIN_TIMEOUT_S, *, secret: bytes,
               curve: bool = False) -> int:
    ctx = zmq.Context()
    control = ctx.socket(zmq.DEALER)
    set_heartbeats(control)
    if curve:
        auth.apply_curve_client(control, secret)
    watch = ConnectionWatch(control)
    control.connect(zmq_tcp(*parse_master_addr(master_addr)))
    dropped = auth.DropLog(log, f"rank {rank}")
    comm = channel = pipe = None
    try:
        try:
            channel = _join(control, secret, rank, master_addr, join_timeout_s)
            # The plan comes once every rank has joined: no watch yet either.
            frames = _recv_sealed(control, None, channel, join_timeout_s,
                                  f"rank {rank}: the plan from {master_addr}", dropped,
                                  session_started=False)
        except Refused as exc:
            log.error("rank %d: %s", rank, exc)
            return EXIT_ERROR
        if frames[0].bytes != b"plan":
            raise RuntimeError(f"rank {rank}: {frames[0].bytes!r} instead of the plan")
        plan = msgpack.unpackb(frames[1].bytes)
        plan["local_rank"] = local_rank
        stage0_comm = partial(make_communicator, plan, rank, ctx, auth_key=channel.key,
                              curve_secret=secret if curve else None)
        if plan.get("pp_size", 1) > 1:
            pipe, peers = _pipeline_setup(control, channel, plan, rank, ctx, secret, curve,
                                          master_addr, join_timeout_s, dropped)
            comm = pipe.connect(peers, stage0_comm, device_id=local_rank,
                                rendezvous_timeout_s=join_timeout_s)
        else:
            comm = stage0_comm()
        runner = build_rank(plan, rank, comm)
        if pipe is not None:
            pipe.use_stream(runner.ops)
        control.send_multipart(channel.seal([b"ready", msgpack.packb({"rank": rank})]))
        return _serve_steps(control, watch, channel, runner, rank, dropped, pipe)
    except PeerLostError as exc:
        log.error("rank %d: %s; exiting", rank, exc)
        return EXIT_DRIVER_LOST
    except Exception as exc:  # reported to the driver, which fails the engine
        log.exception("rank %d failed", rank)
        if channel is not None:  # the driver drops an unsealed error
            try:
                control.send_multipart(channel.seal([b"error", msgpack.packb(
                    {"rank": rank, "message": f"{type(exc).__name__}: {exc}"})]), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
        return EXIT_ERROR
    finally:
        if comm is not None:
            comm.close()
        if pipe is not None:
            pipe.close()
        watch.close()
        control.close(linger=500)  # let a last error message leave
        ctx.term()


def _pipeline_setup(control, channel: auth.Channel, plan: dict, rank: int, ctx, secret: bytes,
                    curve: bool, master_addr: str, timeout_s: float, dropped: auth.DropLog):
    """Pipeline parallelism's two set-up rounds (stage_pipe.py): bind, tell the driver the
    addresses (`bound`), wait for everyone's (`peers`). Returns the StagePipe and the peers."""
    from pagedrun.runtime.distributed.stage_pipe import StagePipe, local_address_towards

    pipe = StagePipe(plan, rank, ctx, secret, curve,
                     local_address_towards(parse_master_addr(master_addr)[0]))
    addresses = pipe.bind()
    control.send_multipart(channel.seal([b"bound", msgpack.packb({"rank": rank,
                                                                  **addresses})]))
    frames = _recv_sealed(control, None, channel, timeout_s,
                          f"rank {rank}: the pipeline's addresses from {master_addr}", dropped)
    if frames[0].bytes != b"peers":
        raise RuntimeError(f"rank {rank}: {frames[0].bytes!r} instead of the peers' addresses")
    return pipe, msgpack.unpackb(frames[1].bytes)


def _serve_steps(control, watch: ConnectionWatch, channel: auth.Channel, runner, rank: int,
                 dropped: auth.DropLog, pipe=None) -> int:
    expected_seq = 1
    while True:
        if not control.poll(int(POLL_INTERVAL_S * 1000)):
            if watch.check():
                log.error("rank %d: the driver's connection dropped; exiting", rank)
                return EXIT_DRIVER_LOST
            continue
        try:
            frames = channel.open(control.recv_multipart(copy=False))
        except auth.AuthError as exc:
            dropped("from the driver", str(exc))
            continue
        kind = frames[0].bytes
        if kind == b"shutdown":
            return EXIT_OK
        if kind != STEP:
            raise RuntimeError(f"rank {rank}: unexpected control message {kind!r}")
        step = decode_step(frames)
        if step.seq != expected_seq:
            raise RuntimeError(f"rank {rank}: step {step.seq} arrived, expected {expected_seq}")
        expected_seq += 1
        if step.lora_writes:
            runner.apply_lora_writes(lora_slot_writes(runner, step.lora_writes))
        if pipe is not None:
            pipe.run_step(runner, step)
        else:
            runner.execute(step, step.prompt_logit_rows, step.row_lora_slots)


def lora_slot_writes(runner, lora_writes: list) -> list:
    """The step header's [slot, name, id, path] entries as SlotWrites of this rank's shards
    (each loaded from lora_path here: the driver's host cache is not shared)."""
    from pagedrun.runtime.lora.adapter_cache import SlotWrite
    from pagedrun.runtime.lora.lora_request import LoRARequest

    writes = []
    for slot, name, lora_int_id, path in lora_writes:
        request = LoRARequest(name, lora_int_id, path)
        writes.append(SlotWrite(slot, request, runner.load_adapter(request)))
    return writes


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m pagedrun.runtime.distributed.worker")
    p.add_argument("--master-addr", required=True, help="the driver's control HOST:PORT")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--local-rank", type=int, default=0, help="device index on this node")
    p.add_argument("--join-timeout", type=float, default=DEFAULT_JOIN_TIMEOUT_S)
    p.add_argument("--log-level", default="WARNING")
    args = p.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format=f"%(asctime)s rank{args.rank} %(levelname)s %(name)s: %(message)s")
    faulthandler.register(signal.SIGUSR1)  # `kill -USR1 PID` prints a stuck worker's stacks
    try:
        secret, curve = auth.read_launch(sys.stdin.buffer)
    except auth.TensorParallelSecretError as exc:
        log.error("rank %d: %s", args.rank, exc)
        return EXIT_ERROR
    started = time.monotonic()
    code = run_worker(args.master_addr, args.rank, args.local_rank, args.join_timeout,
                      secret=secret, curve=curve)
    log.info("rank %d exits %d after %.1f s", args.rank, code, time.monotonic() - started)
    return code


if __name__ == "__main__":
    sys.exit(main())
