"""Pipeline parallelism and the Ray executor on cpu: throughput PP=1 vs PP=2, the activation
link alone, and the per-step cost of the step broadcast with mp vs Ray workers.

Sections (`all`, the default, runs each in turn):
  throughput  the default model (SmolLM2-135M-Instruct, 30 layers, hidden 576), 32 concurrent
              greedy requests (32-token prompts, 24 new tokens, ignore_eos), PP=1 vs PP=2 ("mp"
              workers: stage 1 is a worker process), both engines built once and run
              interleaved `--repeats` times; medians of output tok/s and wall time. From PP=2's
              `engine.runner.step_times` (pipeline.py's `times`: [stage, start, end] of each
              stage's compute per step, time.monotonic() in every process of the node): the
              median compute per step of each stage, the median gap from stage s's end to stage
              s+1's start of the same step (serialize + ZeroMQ + receive copy + waiting for
              stage s+1 to finish its previous batch), and the stages' utilisation: sum of
              stage busy time / (P x wall); the bubble is 1 minus it.
  link        LinkSender -> LinkReceiver (pipeline.py) over tcp loopback in one process: one
              step's activations, x and residual [tokens, 576] float32 each, for 1, 32, 256
              and 2048 tokens; per message: send, recv, the writable copies receive_hidden makes
              (numpy: xp.array). Median round time and MB/s of the two arrays' bytes.
  broadcast   a tiny random Llama (tests/distributed/tp_helpers.write_model_dir: hidden 64, 2
              layers), TP=2, 8 sequences decoding: median engine.step() time with "mp" workers
              vs Ray actors (a local cluster: ray.init(address="local", num_cpus=4)), TP=1 as
              the floor; and the executor's `_broadcast` (encode + MAC + send to every worker)
              timed through a wrapper.

The CPU count matters here: on a 2-vCPU machine PP=2 puts two processes on 2 cores, and the
bf16 backend's GEMM uses 2 threads in each, so the stages compete for the cores they overlap
on; the numbers say what pipelining costs and overlaps there, not what it gains on two devices.
BLAS threads: `--blas-threads` (default 1, as bench_engine.py) is set before numpy loads and
inherited by the workers.

Usage: python benchmarks/bench_pipeline.py [all|throughput|link|broadcast] [--dtype bfloat16]
       [--repeats 3] [--json [PATH]]   (--json alone: JSON on stdout instead of the tables)
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import (  # noqa: E402
    JSON_TO_STDOUT,
    add_json_option,
    cpu_model,
    load_average,
    run_benches,
    set_blas_threads,
    write_json,
)


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("bench", nargs="?", default="all",
                        choices=["all", "throughput", "link", "broadcast"])
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"],
                        help="throughput: the cpu backend's weights")
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats (medians)")
    parser.add_argument("--blas-threads", type=int, default=1)
    add_json_option(parser, bare_to_stdout=True, help="write the results to PATH (no tables "
                                                       "with a bare --json)")
    return parser.parse_args()


ARGS = _parse() if __name__ == "__main__" else None
if ARGS is not None:
    set_blas_threads(ARGS.blas_threads)

import numpy as np  # noqa: E402  (after the thread setting)

from pagedrun.runtime.engine import LLMEngine  # noqa: E402
from pagedrun.runtime.engine_config import EngineConfig  # noqa: E402
from pagedrun.runtime.sampling_params import SamplingParams  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))

TP_NUM_REQUESTS = 32
TP_PROMPT = 32
TP_NEW = 24
HIDDEN = 576  # the default model's hidden size
LINK_TOKENS = (1, 32, 256, 2048)
LINK_BUDGET_S = 1.0  # per size: as many messages as fit, at least LINK_MIN_MESSAGES
LINK_MIN_MESSAGES = 20
LINK_WARMUP = 5
BC_SEQS = 8
BC_PROMPT = 8
BC_STEPS = 100  # timed steps per repeat and executor
BC_WARMUP = 10


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def _median(values) -> float:
    return float(statistics.median(values)) if values else float("nan")


def _run_requests(engine: LLMEngine, prompts: list[list[int]], max_tokens: int,
                  tag: str) -> tuple[float, list[float]]:
    """(wall seconds, each engine.step()'s seconds) to run every prompt to completion
    together."""
    params = _greedy(max_tokens)
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", prompt_token_ids=prompt, sampling_params=params)
    steps = []
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - t0)
    return time.perf_counter() - start, steps


# ----------------------------------------------------------------------------- throughput

def stage_figures(step_times, pp_size: int, wall_s: float) -> dict:
    """Per stage compute, stage-to-stage gaps and utilisation from one run's step_times."""
    compute = {s: [] for s in range(pp_size)}
    gaps = {s: [] for s in range(pp_size - 1)}
    for _, times in step_times:
        by_stage = {int(stage): (start, end) for stage, start, end in times}
        for stage, (start, end) in by_stage.items():
            compute[stage].append(end - start)
        for stage in gaps:
            if stage in by_stage and stage + 1 in by_stage:
                gaps[stage].append(by_stage[stage + 1][0] - by_stage[stage][1])
    busy = sum(sum(v) for v in compute.values())
    utilisation = busy / (pp_size * wall_s)
    return {"steps": len(step_times),
            "stage_compute_ms": [1e3 * _median(compute[s]) for s in range(pp_size)],
            "stage_busy_s": [float(sum(compute[s])) for s in range(pp_size)],
            "handover_gap_ms": [1e3 * _median(gaps[s]) for s in range(pp_size - 1)],
            "utilisation": utilisation, "bubble": 1.0 - utilisation}


def bench_throughput(dtype: str, repeats: int) -> dict:
    engines = {}
    for pp in (1, 2):
        engines[pp] = LLMEngine(EngineConfig(
            model=None, device="cpu", dtype=dtype, max_model_len=512, num_kv_blocks=512,
            enable_prefix_caching=False, pipeline_parallel_size=pp,
            distributed_executor_backend="mp"))
    try:
        vocab = engines[1].model_config.vocab_size
        rng = np.random.default_rng(4)
        prompts = [rng.integers(3, vocab, TP_PROMPT).tolist() for _ in range(TP_NUM_REQUESTS)]
        for pp, engine in engines.items():  # warm up: both stages, every code path once
            _run_requests(engine, prompts[:4], 2, f"warm{pp}")
        runs: dict[int, list] = {1: [], 2: []}
        stage_runs = []
        for r in range(repeats):
            for pp, engine in engines.items():
                if pp > 1:
                    engine.runner.step_times.clear()
                wall, steps = _run_requests(engine, prompts, TP_NEW, f"r{r}pp{pp}")
                runs[pp].append((wall, steps))
                if pp > 1:
                    stage_runs.append(stage_figures(list(engine.runner.step_times), pp, wall))
        gemm_threads = getattr(engines[1].backend, "gemm_threads", None)
    finally:
        for engine in engines.values():
            engine.close()
    tokens = TP_NUM_REQUESTS * TP_NEW
    result = {"dtype": dtype, "requests": TP_NUM_REQUESTS, "prompt_tokens": TP_PROMPT,
              "new_tokens": TP_NEW, "repeats": repeats, "gemm_threads": gemm_threads}
    for pp, values in runs.items():
        walls = [w for w, _ in values]
        result[f"pp{pp}"] = {"wall_s": _median(walls), "tok_s": tokens / _median(walls),
                             "tok_s_runs": [tokens / w for w in walls],
                             "engine_steps": int(_median([len(s) for _, s in values])),
                             "step_ms": 1e3 * _median([t for _, s in values for t in s])}
    # Each figure: the median over the runs of its per-run value.
    result["pp2"]["stages"] = {
        "stage_compute_ms": [_median([s["stage_compute_ms"][i] for s in stage_runs])
                             for i in range(2)],
        "handover_gap_ms": [_median([s["handover_gap_ms"][0] for s in stage_runs])],
        "stage_busy_s": [_median([s["stage_busy_s"][i] for s in stage_runs]) for i in range(2)],
        "utilisation": _median([s["utilisation"] for s in stage_runs]),
        "bubble": _median([s["bubble"] for s in stage_runs]),
        "steps_per_run": int(_median([s["steps"] for s in stage_runs]))}
    result["pp2_over_pp1"] = result["pp2"]["tok_s"] / result["pp1"]["tok_s"]
    return result


# ----------------------------------------------------------------------------- link

def bench_link() -> dict:
    import zmq

    from pagedrun.runtime.distributed.pipeline import LinkReceiver, LinkSender, link_key

    ctx = zmq.Context()
    key = link_key(b"k" * 32, b"n" * 16, 0, 1)
    receiver = LinkReceiver(ctx, "tcp://127.0.0.1:0", key, sender_rank=0, timeout_s=30.0)
    sender = LinkSender(ctx, receiver.address, key)
    results = {}
    try:
        rng = np.random.default_rng(0)
        for tokens in LINK_TOKENS:
            x = rng.standard_normal((tokens, HIDDEN), dtype=np.float32)
            residual = rng.standard_normal((tokens, HIDDEN), dtype=np.float32)
            times: list[float] = []
            i, budget_end = 0, None
            while True:
                t0 = time.perf_counter()
                # Sends queue on the DEALER; the receive in the same thread waits for ZeroMQ's
                # I/O thread to carry the frames over loopback.
                sender.send([x, residual], times=[[0, 0.0, 0.0]])
                _, arrays = receiver.recv("bench")
                copies = [np.array(a) for a in arrays]  # receive_hidden's writable copies
                t1 = time.perf_counter()
                assert copies[0].shape == (tokens, HIDDEN)
                i += 1
                if i <= LINK_WARMUP:
                    continue
                if budget_end is None:
                    budget_end = t1 + LINK_BUDGET_S
                times.append(t1 - t0)
                if t1 > budget_end and len(times) >= LINK_MIN_MESSAGES:
                    break
            nbytes = x.nbytes + residual.nbytes
            round_s = _median(times)
            results[str(tokens)] = {"bytes": nbytes, "messages": len(times),
                                    "round_us": 1e6 * round_s, "mb_s": nbytes / round_s / 1e6}
    finally:
        sender.close()
        receiver.close()
        ctx.term()
    return {"hidden": HIDDEN, "dtype": "float32", "transport": "tcp loopback",
            "tokens": results}


# ----------------------------------------------------------------------------- broadcast

def _timed_steps(engine: LLMEngine, num: int) -> list[float]:
    times = []
    for _ in range(num):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    return times


def _wrap_broadcast(engine: LLMEngine, sink: list) -> None:
    """Time the executor's `_broadcast` (encode, MAC, a send per worker) of every step."""
    inner = engine.runner._broadcast

    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            sink.append(time.perf_counter() - t0)

    engine.runner._broadcast = timed


def bench_broadcast(repeats: int) -> dict:
    import ray

    sys.path.insert(0, os.path.join(HERE, "..", "tests", "distributed"))
    from tp_helpers import write_model_dir

    tmp = tempfile.mkdtemp(prefix="bench_pipeline_")
    model_dir = write_model_dir(os.path.join(tmp, "m"))
    vocab = 389  # tp_helpers.tiny_config_dict's
    t0 = time.perf_counter()
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    ray_init_s = time.perf_counter() - t0
    arms = {"tp1": (1, "mp"), "mp": (2, "mp"), "ray": (2, "ray")}
    engines, broadcast_s, start_s = {}, {}, {}
    try:
        for name, (tp, backend) in arms.items():
            t0 = time.perf_counter()
            engines[name] = LLMEngine(EngineConfig(
                model=model_dir, device="cpu", tensor_parallel_size=tp,
                distributed_executor_backend=backend, num_kv_blocks=512, max_model_len=512,
                max_num_seqs=BC_SEQS, enable_prefix_caching=False))
            start_s[name] = time.perf_counter() - t0
            broadcast_s[name] = []
            if tp > 1:
                _wrap_broadcast(engines[name], broadcast_s[name])
        rng = np.random.default_rng(1)
        max_tokens = BC_WARMUP + repeats * BC_STEPS + 8
        for name, engine in engines.items():
            params = _greedy(max_tokens)
            for i in range(BC_SEQS):
                engine.add_request(f"{name}-{i}", prompt_token_ids=rng.integers(
                    3, vocab, BC_PROMPT).tolist(), sampling_params=params)
            for _ in range(BC_WARMUP):  # the prefill and the first decode steps
                engine.step()
            broadcast_s[name].clear()
        step_s = {name: [] for name in engines}
        for _ in range(repeats):  # interleaved: machine noise hits all alike
            for name, engine in engines.items():
                step_s[name].extend(_timed_steps(engine, BC_STEPS))
    finally:
        for engine in engines.values():
            engine.close()
        ray.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)
    result = {"model": "tp_helpers tiny Llama (hidden 64, 2 layers, vocab 389)",
              "decoding_seqs": BC_SEQS, "timed_steps": repeats * BC_STEPS,
              "ray_init_s": ray_init_s}
    for name in engines:
        result[name] = {"step_us": 1e6 * _median(step_s[name]),
                        "step_p90_us": 1e6 * float(np.percentile(step_s[name], 90)),
                        "engine_start_s": start_s[name]}
        if broadcast_s[name]:
            result[name]["broadcast_us"] = 1e6 * _median(broadcast_s[name])
    return result


# ----------------------------------------------------------------------------- report

def print_tables(results: dict) -> None:
    print(f"# {results['cpu']}, {results['cpus']} CPUs, load average at start "
          f"{results['load_average_at_start']:.2f}")
    if "throughput" in results:
        r = results["throughput"]
        p1, p2, st = r["pp1"], r["pp2"], r["pp2"]["stages"]
        print(f"\nthroughput: default model {r['dtype']} (GEMM threads {r['gemm_threads']}), "
              f"{r['requests']} requests x {r['prompt_tokens']} prompt + {r['new_tokens']} new, "
              f"median of {r['repeats']}")
        print(f"{'':<6}{'tok/s':>8}{'wall s':>8}{'steps':>7}{'step ms':>9}  runs tok/s")
        for name, p in (("PP=1", p1), ("PP=2", p2)):
            print(f"{name:<6}{p['tok_s']:>8.1f}{p['wall_s']:>8.2f}{p['engine_steps']:>7}"
                  f"{p['step_ms']:>9.1f}  "
                  + " ".join(f"{v:.1f}" for v in p["tok_s_runs"]))
        print(f"PP=2 / PP=1: {r['pp2_over_pp1']:.2f}x")
        print(f"PP=2 per step ({st['steps_per_run']} per run): stage 0 compute "
              f"{st['stage_compute_ms'][0]:.2f} ms, stage 1 compute {st['stage_compute_ms'][1]:.2f}"
              f" ms, hand-over gap 0->1 {st['handover_gap_ms'][0]:.2f} ms; busy "
              f"{st['stage_busy_s'][0]:.2f} + {st['stage_busy_s'][1]:.2f} s; utilisation "
              f"{st['utilisation']:.2f} (bubble {st['bubble']:.2f})")
    if "link" in results:
        r = results["link"]
        print(f"\nlink: LinkSender -> LinkReceiver, {r['transport']}, x + residual "
              f"[tokens, {r['hidden']}] {r['dtype']}, one process, median")
        print(f"{'tokens':>7}{'bytes':>11}{'round us':>10}{'MB/s':>9}{'msgs':>7}")
        for tokens, v in r["tokens"].items():
            print(f"{tokens:>7}{v['bytes']:>11}{v['round_us']:>10.1f}{v['mb_s']:>9.0f}"
                  f"{v['messages']:>7}")
    if "broadcast" in results:
        r = results["broadcast"]
        print(f"\nbroadcast: {r['model']}, {r['decoding_seqs']} sequences decoding, "
              f"{r['timed_steps']} steps each (interleaved), ray.init {r['ray_init_s']:.1f} s")
        print(f"{'':<8}{'step us':>9}{'p90 us':>9}{'_broadcast us':>15}{'start s':>9}")
        for name in ("tp1", "mp", "ray"):
            v = r[name]
            bc = f"{v['broadcast_us']:.1f}" if "broadcast_us" in v else "-"
            label = {"tp1": "TP=1", "mp": "TP=2 mp", "ray": "TP=2 ray"}[name]
            print(f"{label:<8}{v['step_us']:>9.0f}{v['step_p90_us']:>9.0f}{bc:>15}"
                  f"{v['engine_start_s']:>9.1f}")


def main() -> int:
    args = ARGS
    benches = {"throughput": lambda: bench_throughput(args.dtype, args.repeats),
               "link": bench_link,
               "broadcast": lambda: bench_broadcast(args.repeats)}
    names = list(benches) if args.bench == "all" else [args.bench]
    results = {"cpu": cpu_model(), "cpus": os.cpu_count(), "blas_threads": args.blas_threads,
               "load_average_at_start": load_average()}
    run_benches(benches, names, results, echo=False)
    if args.json != JSON_TO_STDOUT:
        print_tables(results)
    write_json(results, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
