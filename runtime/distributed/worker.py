"""A tensor-parallel worker process: one rank's device, weight shard and KV cache, and its loop.

    python -m pagedrun.runtime.distributed.worker --master-addr HOST:PORT --rank R

Life of a worker (the driver's side is executor.py; the messages are listed there):
  1. connect a DEALER to the driver's control ROUTER and say hello (rank, pid, host);
  2. receive the plan (model as the user named it, resolved here: a directory, a .gguf (its
     converted cache on this node), or None (this node's default model); device, dtype, KV
     sizes, the communicator's address or the NCCL unique id);
  3. read only its shard from the safetensors files, build its communicator, its
     ShardedLlamaModel and a ModelRunner whose KV pools hold only its KV heads; report ready;
  4. loop: each step message -> `runner.execute` (the collectives inside keep the ranks in step;
     rank 0 gathers the logits); `shutdown` -> exit 0.
Every wait is bounded: the driver's connection dropping (its process died or its host went
silent past the ZMTP heartbeat) ends the worker with EXIT_DRIVER_LOST, and any exception is
reported to the driver as an `error` message before the worker exits with EXIT_ERROR.
"""
from __future__ import annotations

import argparse
import faulthandler
import logging
import os
import signal
import socket
import sys
import time

import msgpack
import zmq

from pagedrun.runtime.distributed.communicator import (POLL_INTERVAL_S, ConnectionWatch,
                                                       PeerLostError, recv_bounded,
                                                       set_heartbeats)
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
    from pagedrun.runtime.distributed.sharded_model import ShardedLlamaModel
    from pagedrun.runtime.distributed.sharding import load_shard, rank_config, shard_spec
    from pagedrun.runtime.model_config import ModelConfig
    from pagedrun.runtime.model_loader import resolve_model_dir
    from pagedrun.runtime.model_runner import ModelRunner

    model_dir = resolve_model_dir(plan["model"])
    config = ModelConfig.from_model_dir(model_dir)
    spec = shard_spec(config, plan["tp_size"], rank)
    if ops is None:
        ops = make_backend(plan["device"], plan["dtype"], device_id=plan["local_rank"])
    if hasattr(comm, "use_stream") and hasattr(ops, "stream"):
        comm.use_stream(ops.stream)  # NCCL on the compute stream
    local_config = rank_config(config, spec)
    weights = load_shard(model_dir, config, spec)
    model = ShardedLlamaModel(local_config, weights, ops, plan["max_model_len"], spec, comm)
    return ModelRunner(local_config, None, block_size=plan["block_size"],
                       num_gpu_blocks=plan["num_gpu_blocks"],
                       num_cpu_blocks=plan["num_cpu_blocks"],
                       max_model_len=plan["max_model_len"], ops=ops, model=model,
                       # rank 0 samples: where its backend's sampler reads them
                       logits_on_device=rank == 0 and ops.logits_on_device)


def make_communicator(plan: dict, rank: int, context: zmq.Context):
    if plan.get("nccl_unique_id") is not None:
        from pagedrun.runtime.distributed.nccl_communicator import NcclCommunicator

        return NcclCommunicator(rank, plan["tp_size"], plan["nccl_unique_id"],
                                device_id=plan["local_rank"])
    from pagedrun.runtime.distributed.communicator import CpuCommunicator

    return CpuCommunicator(rank, plan["tp_size"], connect=plan["comm_address"],
                           timeout_s=plan["collective_timeout_s"], context=context)


def run_worker(master_addr: str, rank: int, local_rank: int,
               join_timeout_s: float = DEFAULT_JOIN_TIMEOUT_S) -> int:
    ctx = zmq.Context()
    control = ctx.socket(zmq.DEALER)
    set_heartbeats(control)
    control.setsockopt(zmq.IDENTITY, f"rank{rank}".encode())
    watch = ConnectionWatch(control)
    control.connect(zmq_tcp(*parse_master_addr(master_addr)))
    comm = None
    try:
        control.send_multipart([b"hello", msgpack.packb(
            {"rank": rank, "pid": os.getpid(), "host": socket.gethostname()})])
        # No watch here: before the driver answers, "disconnected" only means "not up yet".
        frames = recv_bounded(control, None, join_timeout_s,
                              f"rank {rank}: the driver at {master_addr}")
        if frames[0].bytes == b"error":
            log.error("rank %d: the driver refused it: %s", rank, frames[1].bytes.decode())
            return EXIT_ERROR
        plan = msgpack.unpackb(frames[1].bytes)
        plan["local_rank"] = local_rank
        comm = make_communicator(plan, rank, ctx)
        runner = build_rank(plan, rank, comm)
        control.send_multipart([b"ready", msgpack.packb({"rank": rank})])
        return _serve_steps(control, watch, runner, rank)
    except PeerLostError as exc:
        log.error("rank %d: %s; exiting", rank, exc)
        return EXIT_DRIVER_LOST
    except Exception as exc:  # reported to the driver, which fails the engine
        log.exception("rank %d failed", rank)
        try:
            control.send_multipart([b"error", msgpack.packb(
                {"rank": rank, "message": f"{type(exc).__name__}: {exc}"})], zmq.NOBLOCK)
        except zmq.ZMQError:
            pass
        return EXIT_ERROR
    finally:
        if comm is not None:
            comm.close()
        watch.close()
        control.close(linger=500)  # let a last error message leave
        ctx.term()


def _serve_steps(control, watch: ConnectionWatch, runner, rank: int) -> int:
    expected_seq = 1
    while True:
        if not control.poll(int(POLL_INTERVAL_S * 1000)):
            if watch.check():
                log.error("rank %d: the driver's connection dropped; exiting", rank)
                return EXIT_DRIVER_LOST
            continue
        frames = control.recv_multipart(copy=False)
        kind = frames[0].bytes
        if kind == b"shutdown":
            return EXIT_OK
        if kind != STEP:
            raise RuntimeError(f"rank {rank}: unexpected control message {kind!r}")
        step = decode_step(frames)
        if step.seq != expected_seq:
            raise RuntimeError(f"rank {rank}: step {step.seq} arrived, expected {expected_seq}")
        expected_seq += 1
        runner.execute(step, step.prompt_logit_rows)


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
    started = time.monotonic()
    code = run_worker(args.master_addr, args.rank, args.local_rank, args.join_timeout)
    log.info("rank %d exits %d after %.1f s", args.rank, code, time.monotonic() - started)
    return code


if __name__ == "__main__":
    sys.exit(main())
