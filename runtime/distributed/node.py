"""A headless node of a multi-node tensor-parallel group: `paged-run serve --node-rank R` (R > 0).

It runs no engine and no server: it spawns this node's ranks (tp/nnodes worker processes, one
per local device) that join node 0's rendezvous at --master-addr, and supervises them. It exits
0 when they all exit 0 (the driver said shutdown), and 1 as soon as one fails (the others are
killed: a group missing a rank cannot continue, and node 0 sees the loss and fails its
requests). SIGINT / SIGTERM kill the workers and exit. No worker outlives it.

The group's shared secret comes from `secret_file` (`paged-run serve --tp-secret-file FILE`, the
same content on every node; auth.py). Without one the node refuses to start: node 0 could not
tell its workers from any other process that reaches the control address. The node hands the
secret to its workers on their stdin.
"""
from __future__ import annotations

import logging
import signal
import time

from pagedrun.runtime.distributed.auth import TensorParallelSecretError, read_secret_file
from pagedrun.runtime.distributed.executor import kill_workers, ranks_of_node, spawn_workers
from pagedrun.runtime.distributed.worker import DEFAULT_JOIN_TIMEOUT_S, parse_master_addr

log = logging.getLogger("pagedrun.node")

SUPERVISE_INTERVAL_S = 0.1


def run_node(master_addr: str, tp_size: int, nnodes: int, node_rank: int,
             join_timeout_s: float = DEFAULT_JOIN_TIMEOUT_S, *, secret_file: str | None = None,
             curve: bool = False) -> int:
    """secret_file: the group's shared secret (required: TensorParallelSecretError without);
    curve: as node 0's (`--tp-curve` on every node or on none)."""
    parse_master_addr(master_addr)  # a malformed address fails here, not in every worker
    ranks = ranks_of_node(tp_size, nnodes, node_rank)
    if secret_file is None:
        raise TensorParallelSecretError(
            "a headless tensor-parallel node needs the group's shared secret: "
            "--tp-secret-file FILE, the same file as node 0's (write one with `python -m "
            "pagedrun.runtime.distributed.auth FILE`)")
    secret = read_secret_file(secret_file)
    stop = []
    previous = {s: signal.signal(s, lambda signum, frame: stop.append(signum))
                for s in (signal.SIGINT, signal.SIGTERM)}
    procs = spawn_workers(master_addr, ranks, len(ranks), join_timeout_s, secret, curve)
    log.info("node %d: ranks %s joining %s (pids %s)", node_rank, list(ranks), master_addr,
             [p.pid for p in procs.values()])
    try:
        while not stop:
            codes = {rank: p.poll() for rank, p in procs.items()}
            failed = {r: c for r, c in codes.items() if c not in (None, 0)}
            if failed:
                log.error("node %d: rank(s) %s exited with %s; stopping this node", node_rank,
                          list(failed), list(failed.values()))
                return 1
            if all(c == 0 for c in codes.values()):
                return 0
            time.sleep(SUPERVISE_INTERVAL_S)
        log.info("node %d: signal %s, stopping workers", node_rank, stop[0])
        return 0
    finally:
        kill_workers(procs)
        for s, handler in previous.items():
            signal.signal(s, handler)
