"""Host overhead of one decode step, with the model's compute removed (issue 13, item 1).

For each level of running sequences (default 1, 64, 256, 1024), an engine on the default model's
config (SmolLM2-135M-Instruct: 30 layers, vocabulary 49,152) and its real tokenizer admits that
many requests (random 32-token prompts, greedy, ignore_eos), runs until every one decodes, and
times `--steps` pure-decode steps after `--warmup` more. Two backends, one engine each:

  null       benchmarks/host/null_backend.py: every op returns a preallocated output; the logits
             are a fixed array, so the numpy sampler, the detokenizer and the stop checks run
             for real. Its host times are the table's: what a step costs the host when the
             device costs nothing. "launches" counts its op calls.
  recording  benchmarks/host/recording.py: the cuda backend's ops and sampler (KernelBackend,
             bf16) over a stand-in for CuPy's RawModule that counts each kernel launch and the
             bytes of its arguments and runs nothing. numpy arrays stand in for device memory,
             so its host times leave out the cost of a real CuPy launch; its point is the
             launch count and argument bytes per step.
  recording-graphs  the same with the cuda backend's default decode graph sizes
             (runtime/decode_graphs.py): a pure decode step that fits one fills the static
             inputs and replays the graph, counted as one launch ("cudaGraphLaunch", as the
             driver's is); "launches" then times that fill and replay.

Each step's host time is split (benchmarks/host/step_phases.py) into schedule, input preparation
(sampling plan, block moves, attention metadata, step inputs), launches (the model's forward and
LM head: every op call), sampling, and postprocessing (detokenize, token bookkeeping and stop
checks, scheduler update, output objects, the rest); medians over the measured steps, in
microseconds (the total is the median of step totals, not the sum of the medians). "w/o
sampling": the median over steps of the step's total less its sampling, per sequence (issue 13
item 4's measure of the host's own time per sequence; the numpy sampler's is left out).

After each step the benchmark reads every output's `text`, as the server's I/O thread does, and
times that apart ("text read", microseconds per step, not part of the step; it includes the
detokenize timer's wrapper, once per token): the engine detokenizes a request without stop
strings only when its text is read (runtime/detokenizer.py DeferredText), so without `--stop`
that is where the detokenizer's time goes, and the step's "detokenize" is 0.

Usage: python benchmarks/bench_host_overhead.py [--levels 1,64,256,1024] [--steps 20]
           [--backends null,recording] [--json [PATH]] [--smoke]
`--json PATH` writes the results there (the table still goes to stdout); a bare `--json`
prints only the JSON on stdout (the table goes to stderr). `--smoke` (CI): levels 1 and 8,
3 steps, 2 layers.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import math
import os
import platform
import statistics
import sys
import time
from contextlib import contextmanager

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import JSON_TO_STDOUT, add_json_option, cpu_model, write_json  # noqa: E402
from host.null_backend import NullBackend  # noqa: E402
from host.recording import RecordingBackend, recording_ns_per_launch  # noqa: E402
from host.step_phases import PHASES, StepPhases, phases, wrapper_overhead_ns  # noqa: E402
from host.zero_weights import zero_weights  # noqa: E402
from sharegpt_mix import random_prompt_ids  # noqa: E402

from pagedrun.runtime.engine import core as engine_module  # noqa: E402
from pagedrun.runtime.engine_config import EngineConfig  # noqa: E402
from pagedrun.runtime.model_config import ModelConfig  # noqa: E402
from pagedrun.runtime.model_loader import resolve_model_dir  # noqa: E402
from pagedrun.runtime.sampling_params import SamplingParams  # noqa: E402
from pagedrun.runtime.tokenizer import Tokenizer  # noqa: E402

BACKENDS = ("null", "recording", "recording-graphs")
# recording-graphs: the decode graph sizes the cuda backend captures by default
# (KernelBackend.default_graph_sizes on a GPU runtime), capped at the level's max_num_seqs.
CUDA_GRAPH_SIZES = (1, 2, 4, *range(8, 513, 8))
DEFAULT_LEVELS = "1,64,256,1024"
SMOKE_LEVELS = (1, 8)
SMOKE_STEPS = 3
SMOKE_WARMUP = 1
# Smoke runs keep the default model's vocabulary and widths but only this many layers: the
# zero weights are copied and converted at start-up, a second per engine at 30 layers.
SMOKE_NUM_LAYERS = 2
BLOCK_SIZE = 16
# Token budget of a step: the engine's default, raised to the level so a decode step of every
# running sequence fits in one step.
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
# Streaming multiprocessors the recording backend's launch plans assume: an H200's.
H200_NUM_SMS = 132
# Extra decode tokens per request beyond warm-up and measured steps (slack, so no request
# finishes inside the measured window).
SLACK_TOKENS = 8
PROMPT_SEED = 0


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--levels", default=DEFAULT_LEVELS,
                        help="running sequences per decode step, comma-separated")
    parser.add_argument("--steps", type=int, default=20, help="measured decode steps per level")
    parser.add_argument("--warmup", type=int, default=3, help="decode steps before measuring")
    parser.add_argument("--backends", default=",".join(BACKENDS),
                        help=f"comma-separated, of {BACKENDS}")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--stop", action="append", default=None,
                        help="a stop string for every request (repeatable; default none)")
    parser.add_argument("--num-sms", type=int, default=H200_NUM_SMS,
                        help="recording: the multiprocessor count launch plans assume")
    parser.add_argument("--model", default=None,
                        help="an HF model directory for the config and tokenizer "
                             "(default: the default model)")
    parser.add_argument("--num-layers", type=int, default=None,
                        help="decoder layers (default: the model's); the vocabulary is kept")
    add_json_option(parser, bare_to_stdout=True)
    parser.add_argument("--smoke", action="store_true",
                        help=f"CI: levels {SMOKE_LEVELS}, {SMOKE_STEPS} steps, "
                             f"{SMOKE_WARMUP} warm-up, {SMOKE_NUM_LAYERS} layers")
    args = parser.parse_args(argv)
    args.levels = (list(SMOKE_LEVELS) if args.smoke
                   else [int(v) for v in args.levels.split(",") if v])
    if args.smoke:
        args.steps, args.warmup = SMOKE_STEPS, SMOKE_WARMUP
        args.num_layers = args.num_layers or SMOKE_NUM_LAYERS
    args.backends = [b for b in args.backends.split(",") if b]
    unknown = set(args.backends) - set(BACKENDS)
    if unknown or not args.backends:
        parser.error(f"--backends: choose from {BACKENDS}, got {args.backends}")
    if args.steps < 1 or args.warmup < 1 or min(args.levels, default=0) < 1:
        parser.error("--steps, --warmup and every level must be >= 1 (the first decode step "
                     "allocates the null backend's logits: it is always warm-up)")
    return args


@contextmanager
def _engine_backend(backend):
    """LLMEngine builds its backend with make_backend(device, dtype): hand it ours instead."""
    saved = engine_module.make_backend
    engine_module.make_backend = lambda device, dtype, **kw: backend
    try:
        yield
    finally:
        engine_module.make_backend = saved


def _max_tokens(args, level: int, max_num_batched_tokens: int) -> int:
    """Decode tokens per request: the first requests decode while later ones still prefill, so
    the ramp's steps count too."""
    ramp_steps = math.ceil(level * args.prompt_len / max_num_batched_tokens) + 1
    return ramp_steps + args.warmup + args.steps + SLACK_TOKENS


def run_level(args, kind: str, level: int, config: ModelConfig, weights, tokenizer) -> dict:
    """One engine on `kind`'s backend with `level` running sequences: the measured steps'
    phase medians (microseconds) and launch counts."""
    budget = max(DEFAULT_MAX_NUM_BATCHED_TOKENS, level)
    max_tokens = _max_tokens(args, level, budget)
    max_model_len = BLOCK_SIZE * math.ceil((args.prompt_len + max_tokens + 1) / BLOCK_SIZE)
    if kind == "null":
        backend = NullBackend(config.vocab_size)
    else:
        backend = RecordingBackend("bfloat16", config.vocab_size, num_sms=args.num_sms,
                                   max_rows=max(level, 1))
    engine_config = EngineConfig(
        device="cpu", block_size=BLOCK_SIZE, max_model_len=max_model_len, max_num_seqs=level,
        max_num_batched_tokens=budget, enable_prefix_caching=False,
        num_kv_blocks=level * (max_model_len // BLOCK_SIZE) + 1,
        cuda_graph_sizes=CUDA_GRAPH_SIZES if kind == "recording-graphs" else None)
    with _engine_backend(backend):
        engine = engine_module.LLMEngine(engine_config, model_config=config, weights=weights,
                                         tokenizer=tokenizer)
    try:
        params = SamplingParams(temperature=args.temperature, max_tokens=max_tokens,
                                ignore_eos=True, stop=args.stop)
        rng = np.random.default_rng(PROMPT_SEED)
        for i in range(level):
            engine.add_request(f"r{i}", prompt_token_ids=random_prompt_ids(
                rng, args.prompt_len, config.vocab_size), sampling_params=params)
        clock = StepPhases(engine, _launch_counter(backend)).install()
        try:
            decode_steps = _run_decode_steps(engine, clock, level, args.warmup + args.steps,
                                             max_steps=max_tokens + 2)
        finally:
            clock.uninstall()
    finally:
        engine.close()
        if isinstance(backend, RecordingBackend):
            backend.close()
    return _summarize(kind, level, decode_steps[args.warmup:])


def _launch_counter(backend):
    """on_step_end for StepPhases: this step's op calls (null) or kernel launches (recording)."""
    if isinstance(backend, NullBackend):
        last = [backend.num_op_calls]

        def op_calls() -> dict:
            count, last[0] = backend.num_op_calls - last[0], backend.num_op_calls
            return {"op_calls": count}
        return op_calls

    def launches() -> dict:
        num, arg_bytes, by_kernel = backend.launches.take()
        return {"kernel_launches": num, "kernel_arg_bytes": arg_bytes,
                "by_kernel": dict(by_kernel)}
    return launches


def _run_decode_steps(engine, clock: StepPhases, level: int, wanted: int,
                      max_steps: int) -> list[dict]:
    """Steps the engine until `wanted` pure-decode steps of all `level` sequences ran (every
    row one token); returns their records."""
    decode = []
    for _ in range(max_steps):
        outputs = engine.step()
        record = clock.steps[-1]
        start = time.perf_counter_ns()
        for output in outputs:  # what the server's I/O thread reads of each output
            for completion in output.outputs:
                completion.text
        record["text_read_ns"] = time.perf_counter_ns() - start
        if record["num_reqs"] == level and record["num_batched_tokens"] == level:
            decode.append(record)
            if len(decode) == wanted:
                return decode
    raise RuntimeError(f"{level} sequences: only {len(decode)} of {wanted} pure-decode steps "
                       f"in {max_steps} steps")


def _median(values) -> float:
    return float(statistics.median(values))


def _summarize(kind: str, level: int, steps: list[dict]) -> dict:
    per_step = [phases(s["raw"]) for s in steps]
    median_us = {p: _median(s[p] for s in per_step) / 1e3 for p in PHASES}
    result = {"backend": kind, "num_seqs": level, "steps_measured": len(steps),
              "median_us": median_us, "total_us_per_seq": median_us["total"] / level,
              # Item 4's measure: the host's time per sequence with the sampler's left out (the
              # median of each step's total less its sampling).
              "host_us_per_seq_without_sampling": _median(
                  s["total"] - s["sampling"] for s in per_step) / 1e3 / level,
              "text_read_us": _median(s["text_read_ns"] for s in steps) / 1e3}
    if kind == "null":
        result["op_calls_per_step"] = _median(s["op_calls"] for s in steps)
    else:
        result["kernel_launches_per_step"] = _median(s["kernel_launches"] for s in steps)
        result["kernel_arg_bytes_per_step"] = _median(s["kernel_arg_bytes"] for s in steps)
        names = sorted({k for s in steps for k in s["by_kernel"]})
        result["launches_by_kernel"] = {k: _median(s["by_kernel"].get(k, 0) for s in steps)
                                        for k in names}
    return result


def _load(model: str | None, num_layers: int | None) -> tuple[ModelConfig, object, Tokenizer,
                                                              str]:
    model_dir = resolve_model_dir(model, progress=False)
    config = ModelConfig.from_model_dir(model_dir)
    if num_layers is not None:
        config = dataclasses.replace(config, num_hidden_layers=num_layers)
    return config, zero_weights(config), Tokenizer.from_dir(model_dir), model_dir


def _table(results: dict) -> str:
    cols = ("schedule", "input_prep", "launches", "sampling", "postprocess", "detokenize",
            "stop_checks", "scheduler_update", "output_objects", "other", "total")
    head = ("| seqs | backend | " + " | ".join(cols)
            + " | us/seq | w/o sampling | launches/step | arg bytes/step | text read |")
    lines = [f"CPU: {results['cpu']}; load average {results['load_average_start']} at start, "
             f"{results['load_average_end']} at end; median microseconds per decode step",
             head, "|" + "---|" * (head.count("|") - 1)]
    for run in results["runs"]:
        m = run["median_us"]
        launches = run.get("kernel_launches_per_step", run.get("op_calls_per_step"))
        unit = "" if run["backend"].startswith("recording") else " ops"
        arg_bytes = run.get("kernel_arg_bytes_per_step")
        lines.append(f"| {run['num_seqs']} | {run['backend']} | "
                     + " | ".join(f"{m[c]:.0f}" for c in cols)
                     + f" | {run['total_us_per_seq']:.1f}"
                     + f" | {run['host_us_per_seq_without_sampling']:.1f} | {launches:.0f}{unit} | "
                     + ("-" if arg_bytes is None else f"{arg_bytes:.0f}")
                     + f" | {run['text_read_us']:.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    config, weights, tokenizer, model_dir = _load(args.model, args.num_layers)
    results = {
        "benchmark": "host_overhead", "issue": 13,
        "date": datetime.date.today().isoformat(),
        "cpu": cpu_model(), "num_cpus": os.cpu_count(), "python": platform.python_version(),
        "numpy": np.__version__,
        "load_average_start": [round(v, 2) for v in os.getloadavg()],
        "command": " ".join(["python", "benchmarks/bench_host_overhead.py",
                             *(sys.argv[1:] if argv is None else argv)]),
        "model": os.path.basename(os.path.normpath(model_dir)),
        "vocab_size": config.vocab_size, "num_hidden_layers": config.num_hidden_layers,
        "prompt_len": args.prompt_len, "steps": args.steps, "warmup": args.warmup,
        "temperature": args.temperature, "stop": args.stop, "recording_num_sms": args.num_sms,
        "levels": args.levels, "backends": args.backends, "phases": list(PHASES),
        "wrapper_overhead_ns": wrapper_overhead_ns(),
        "recording_ns_per_launch": recording_ns_per_launch(),
        "runs": [],
    }
    for level in args.levels:
        for kind in args.backends:
            results["runs"].append(run_level(args, kind, level, config, weights, tokenizer))
            gc.collect()  # one engine's pools and copied weights at a time
    results["load_average_end"] = [round(v, 2) for v in os.getloadavg()]
    table = _table(results)
    # Under a bare --json, stdout carries the JSON alone: the table goes to stderr.
    print(table, file=sys.stderr if args.json == JSON_TO_STDOUT else sys.stdout)
    write_json(results, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
