"""Ray actors as the worker ranks of a parallel group (vLLM's `--distributed-executor-backend
ray`): executor.start_workers calls spawn_ray_workers in place of spawn_workers.

This module owns the Ray side only: the connection to a cluster (made on the first call, never
at import; nothing else in paged-run imports ray), one placement group per group of ranks, one
actor per rank and the RayWorker handles the executor supervises like Popen objects (`pid`,
`poll()`, `wait(timeout)`, `kill()`, `release()`). What runs inside each actor is the same
`worker.run_worker` an "mp" worker process runs: it connects to the driver's control address,
authenticates and serves steps over ZeroMQ exactly as before; Ray only starts, places and kills
the processes. The driver (rank 0) stays outside Ray, in the engine's process.

Cluster: `ray_address` given -> `ray.init(address=ray_address)`; None -> the cluster running on
this node (RAY_ADDRESS, or the latest `ray start`) if there is one, else a local cluster started
here with one logical CPU per core (at least one per rank, so the ranks always fit). The process
holds one connection (ray.init is per process), shared by every group: the last group released
calls ray.shutdown() if this module initialised the connection (a cluster it started stops; one
it merely connected to keeps running); a connection the application made itself is left alone.

Placement: one bundle per rank ({"CPU": 1}, plus {"GPU": n} with num_gpus_per_rank n), PACK.
With a loopback control address (one node, the default) every bundle is pinned to this node
(Ray's `node:<ip>` resource); with a routable `master_addr` the bundles may land on any node of
the cluster (PP x TP across nodes; each actor then uses device 0 of the GPUs Ray gives it --
untested: no multi-node GPU cluster has run it). One node with GPUs: each
actor sees every GPU of the node (RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES) and uses device
rank % per_node, as an "mp" worker does: Ray does not know that the driver holds device 0, so
letting Ray pick would put rank 1 there too; an extra bundle reserves the driver's device(s) so
Ray hands them to nothing else.

The group secret travels as an argument of the actor's `run` call: inside the Ray cluster (the
task spec goes from this driver to the raylet and the actor's worker process over Ray's own
connections), on no command line and in no environment. A cluster shared with untrusted jobs is
therefore no place for a tensor-parallel group.
"""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import threading
import time

from pagedrun.runtime.errors import PagedRunError

log = logging.getLogger("pagedrun.tp.ray")

# poll() is called every engine step (and by the watchdog thread): asking Ray costs a round
# trip to the core worker, so an answer is reused for this long.
RAY_POLL_INTERVAL_S = 0.05
# What poll() returns for an actor that died without returning (killed, crashed, its node
# lost): Popen's code for SIGKILL, so logs read the same as for an "mp" worker.
EXIT_ACTOR_DIED = -signal.SIGKILL
# An actor method that raised (run_worker returns its codes; this is Ray's own failure).
EXIT_ACTOR_ERROR = 1
# Pins each bundle to this node: a sliver of the `node:<ip>` resource Ray gives every node.
NODE_PIN_AMOUNT = 0.001
# As `python -m pagedrun.runtime.distributed.worker`'s default --log-level.
WORKER_LOG_LEVEL = logging.WARNING


class RayNotInstalledError(PagedRunError):
    """distributed_executor_backend "ray" without Ray installed."""


class RayPlacementError(PagedRunError):
    """The cluster cannot place the group's ranks (not enough CPUs / GPUs on this node), or
    their actors did not start in time."""


def import_ray():
    try:
        import ray
    except ImportError as exc:
        raise RayNotInstalledError(
            "distributed_executor_backend 'ray' needs Ray, which is not installed: "
            "pip install paged-run[ray]  (or use distributed_executor_backend 'mp')") from exc
    return ray


class _RankActor:
    """One rank, in a Ray worker process (made a Ray actor class by _actor_class)."""

    def pid(self) -> int:
        return os.getpid()

    def run(self, master_addr: str, rank: int, local_rank: int, join_timeout_s: float,
            secret: bytes, curve: bool) -> int:
        # The actor's process is ours alone: configure its logging as worker.main does.
        logging.basicConfig(level=WORKER_LOG_LEVEL, force=True,
                            format=f"%(asctime)s rank{rank} %(levelname)s %(name)s: "
                                   f"%(message)s")
        from pagedrun.runtime.distributed.worker import run_worker

        started = time.monotonic()
        code = run_worker(master_addr, rank, local_rank, join_timeout_s, secret=secret,
                          curve=curve)
        logging.getLogger("pagedrun.worker").info("rank %d exits %d after %.1f s", rank, code,
                                                  time.monotonic() - started)
        return code


_actor_classes: dict = {}


def _actor_class(ray):
    """ray.remote(_RankActor), made once per process (Ray is imported only here)."""
    if "rank" not in _actor_classes:
        _actor_classes["rank"] = ray.remote(_RankActor)
    return _actor_classes["rank"]


class _Connection:
    """This process's use of Ray, shared by every group (ray.init is per process)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.users = 0  # groups not fully released
        self.ours = False  # we called ray.init: the last release calls ray.shutdown

    def acquire(self, ray, ray_address: str | None, num_ranks: int) -> None:
        with self.lock:
            if self.users == 0:
                self.ours = not ray.is_initialized()
                if self.ours:
                    self._init(ray, ray_address, num_ranks)
            self.users += 1

    def _init(self, ray, ray_address: str | None, num_ranks: int) -> None:
        if ray_address is not None:
            ray.init(address=ray_address, log_to_driver=True)
            log.info("ray: connected to the cluster at %s", ray_address)
            return
        try:  # "auto": a running cluster only (None would start one, without our limits)
            ray.init(address="auto", log_to_driver=True)
            log.info("ray: connected to the cluster running on this node")
        except ConnectionError:
            num_cpus = max(os.cpu_count() or 1, num_ranks)
            started = time.monotonic()
            ray.init(address="local", num_cpus=num_cpus, include_dashboard=False,
                     log_to_driver=True)
            log.info("ray: started a local cluster (%d CPUs) in %.1f s", num_cpus,
                     time.monotonic() - started)

    def release(self, ray) -> None:
        with self.lock:
            self.users -= 1
            if self.users == 0 and self.ours:
                self.ours = False
                ray.shutdown()  # stops a cluster we started; disconnects from one we joined


_connection = _Connection()


class _RayGroup:
    """What the ranks of one spawn_ray_workers call share: the placement group, released with
    the connection once every rank's handle has been released."""

    def __init__(self, ray, placement_group) -> None:
        self.ray = ray
        self.placement_group = placement_group
        self.workers: list[RayWorker] = []
        self.released = False

    def release(self) -> None:
        if self.released or any(not w.released for w in self.workers):
            return
        self.released = True  # every actor is killed by now (RayWorker.release)
        try:
            self.ray.util.remove_placement_group(self.placement_group)
        finally:
            _connection.release(self.ray)


class RayWorker:
    """A rank's actor, handled like a subprocess.Popen by the executor."""

    def __init__(self, group: _RayGroup, rank: int, actor, pid: int, run_ref) -> None:
        self.group = group
        self.rank = rank
        self.actor = actor
        self.pid = pid
        self._ref = run_ref  # the ObjectRef of run(): ready when run_worker returned or died
        self.returncode: int | None = None
        self.killed = False
        self.released = False
        self._lock = threading.Lock()  # poll() is called by the engine and the watchdog thread
        self._polled_at = float("-inf")

    def poll(self) -> int | None:
        """None while the rank runs; its exit code once run_worker returned; EXIT_ACTOR_DIED
        once the actor died. Asks Ray at most every RAY_POLL_INTERVAL_S."""
        if self.returncode is not None:
            return self.returncode
        now = time.monotonic()
        if now - self._polled_at < RAY_POLL_INTERVAL_S:
            return None
        with self._lock:
            self._polled_at = now
            if self.returncode is None:
                ready, _ = self.group.ray.wait([self._ref], timeout=0)
                if ready:
                    self._collect()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """The exit code, waiting up to timeout seconds (None: forever); raises
        subprocess.TimeoutExpired like Popen.wait."""
        if self.returncode is None:
            ready, _ = self.group.ray.wait([self._ref], timeout=timeout)
            if not ready:
                raise subprocess.TimeoutExpired(f"ray actor of rank {self.rank}", timeout)
            with self._lock:
                if self.returncode is None:
                    self._collect()
        return self.returncode

    def _collect(self) -> None:
        ray = self.group.ray
        try:
            self.returncode = int(ray.get(self._ref))
        except ray.exceptions.RayTaskError as exc:  # run() raised inside the actor
            log.error("rank %d's actor failed: %s", self.rank, exc)
            self.returncode = EXIT_ACTOR_ERROR
        except ray.exceptions.RayError:  # the actor died: killed, crashed, its node lost
            self.returncode = EXIT_ACTOR_DIED

    def kill(self) -> None:
        """Kill the actor (its process; it outlives a run that returned); it is not
        restarted. Idempotent."""
        if self.killed or self.released:
            return
        self.killed = True
        self.group.ray.kill(self.actor, no_restart=True)

    def release(self) -> None:
        """Kill the actor if it still runs; once every rank of the group is released, remove
        the placement group and drop the Ray connection (ray.shutdown if it is ours).
        Idempotent; poll() and wait() answer from memory afterwards."""
        if self.released:
            return
        self.kill()
        if self.returncode is None:
            self.returncode = EXIT_ACTOR_DIED  # killed: Ray may be shut down by the next line
        self.released = True
        self.group.release()


def _spans_nodes(master_addr: str) -> bool:
    """Whether the ranks may run on other nodes: only when the driver's control address is
    one they can reach (not loopback)."""
    import ipaddress

    from pagedrun.runtime.distributed.worker import parse_master_addr

    host = parse_master_addr(master_addr)[0]
    try:
        return not ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host != "localhost"


def _bundles(ray, ranks: range, per_node: int, num_gpus_per_rank: float,
             spread: bool = False) -> list[dict]:
    """One bundle per rank; pinned to this node unless `spread` (then Ray places them on any
    node, PACK filling one node first). With GPUs, a bundle pinned here reserves the driver's
    device(s)."""
    pin = {f"node:{ray.util.get_node_ip_address()}": NODE_PIN_AMOUNT}
    rank_bundle = {"CPU": 1, **({} if spread else pin)}
    if num_gpus_per_rank:
        rank_bundle["GPU"] = num_gpus_per_rank
    bundles = [dict(rank_bundle) for _ in ranks]
    if num_gpus_per_rank:  # the driver's device(s): local ranks below ours run outside Ray
        bundles += [{"GPU": num_gpus_per_rank, **pin} for _ in range(ranks.start % per_node)]
    return bundles


def spawn_ray_workers(master_addr: str, ranks: range, per_node: int, join_timeout_s: float,
                      secret: bytes, curve: bool = False, *, ray_address: str | None = None,
                      num_gpus_per_rank: float = 0) -> dict[int, RayWorker]:
    """One Ray actor per rank running worker.run_worker (see the module docstring); rank ->
    its RayWorker. Placing the group and starting the actors are each bounded by
    join_timeout_s (RayPlacementError). On any failure nothing is left: the actors are killed,
    the placement group removed, the connection dropped.

    num_gpus_per_rank: 0 on the CPU; on cuda the GPUs each rank's device takes (1)."""
    ranks = range(ranks.start, ranks.stop)
    if not ranks:
        return {}
    ray = import_ray()
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    _connection.acquire(ray, ray_address, len(ranks))
    group = None
    actors = []
    try:
        spread = _spans_nodes(master_addr)
        bundles = _bundles(ray, ranks, per_node, num_gpus_per_rank, spread)
        pg = placement_group(bundles, strategy="PACK")
        group = _RayGroup(ray, pg)
        ready, _ = ray.wait([pg.ready()], timeout=join_timeout_s)
        if not ready:
            raise RayPlacementError(
                f"ray: the cluster could not place ranks {list(ranks)} on this node within "
                f"{join_timeout_s:g} s: bundles {bundles}, available resources "
                f"{ray.available_resources()}")
        options = {"num_cpus": 1, "num_gpus": num_gpus_per_rank, "max_restarts": 0}
        if num_gpus_per_rank and not spread:
            # One node: device rank % per_node of all the node's GPUs, as with "mp". Spread
            # over nodes: Ray's CUDA_VISIBLE_DEVICES, device 0 of what each actor sees.
            options["runtime_env"] = {
                "env_vars": {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}}
        rank_actor = _actor_class(ray)
        for index, _ in enumerate(ranks):
            strategy = PlacementGroupSchedulingStrategy(placement_group=pg,
                                                        placement_group_bundle_index=index)
            actors.append(rank_actor.options(scheduling_strategy=strategy, **options).remote())
        try:
            pids = ray.get([a.pid.remote() for a in actors], timeout=join_timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise RayPlacementError(f"ray: the actors of ranks {list(ranks)} did not start "
                                    f"within {join_timeout_s:g} s") from None
        workers = {}
        for rank, actor, pid in zip(ranks, actors, pids):
            local_rank = 0 if spread else rank % per_node
            run_ref = actor.run.remote(master_addr, rank, local_rank, join_timeout_s, secret,
                                       curve)
            workers[rank] = RayWorker(group, rank, actor, pid, run_ref)
        group.workers = list(workers.values())
        log.info("ray: ranks %s in actors (pids %s)", list(ranks), pids)
        return workers
    except BaseException:
        for actor in actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # already dead; cleaning up, the first error is what matters
                pass
        try:
            if group is not None:
                ray.util.remove_placement_group(group.placement_group)
        finally:
            _connection.release(ray)
        raise
