"""Engine benchmarks on the default model (SmolLM2-135M-Instruct), cpu backend.

Subcommands (`all` runs each in turn; `--json PATH` writes every number measured):
  kv-waste     fraction of allocated KV slots holding no token, averaged over the steps of a
               ShareGPT-shaped trace (see sharegpt_mix.py; 300 requests, Poisson arrivals), paged
               (block 16) vs a contiguous max_model_len reservation per running request. The
               real scheduler replays the trace with random tokens: allocation does not depend on
               the model, so no forward is run and the trace can be full size.
  continuous   continuous (iteration-level) vs static batching: the same 16 requests (the mix
               scaled to CPU size), the same engine and backend, the same KV memory; runs
               interleaved, best of (repeats - 1) each. Static:
               the memory holds B = kv_tokens / max_model_len max-length reservations, so
               batches of B requests run to completion one after another.
  batch1       batch-1 greedy decode: the paged engine vs the dense reference loop
               (ReferenceModel.greedy_generate), same prompt and token count, medians of runs.
  prefix       time to first token of a request sharing a 1,000-token prefix, cold (empty
               prefix cache) vs warm (the prefix cached by an earlier request).
  concurrency  output tokens/s with 1, 8 and 32 concurrent requests (32-token prompts,
               24 new tokens each; `--prompt-tokens` / `--new-tokens` change them, and the KV
               pool grows to fit levels x (prompt + new)); `--dtype` takes a comma list of
               float32, bfloat16 (the bf16-weight cpu backend), int8 (Q8_0 weights, int8
               activations: --quantization int8) and gguf (the model's own GGUF blocks,
               --quantization gguf), or
               `both` (float32,bfloat16), run interleaved, medians of `--repeats` - 2 runs
               (at least 1); `--levels 1,8,32,64`.

BLAS threads: `--blas-threads` (default 1) is set before numpy loads. On a shared 2-core
machine OpenBLAS's spinning threads collapse under contention (mid-size GEMMs measured 100x
slower with 2 threads while other processes ran), so one thread gives the stable number.

Usage: python benchmarks/bench_engine.py all --json /tmp/bench_engine.json
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import (  # noqa: E402
    add_json_option,
    cpu_kernels,
    load_average,
    run_benches,
    set_blas_threads,
    write_json,
)


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("bench", choices=["all", "kv-waste", "continuous", "batch1", "prefix",
                                          "concurrency"])
    add_json_option(parser, bare_to_stdout=False)
    parser.add_argument("--blas-threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats (medians)")
    parser.add_argument("--dtype", default="float32",
                        help="concurrency: comma list of float32, bfloat16, int8, gguf, default "
                             "(no flags); or both")
    parser.add_argument("--gemm-threads", type=int, default=None,
                        help="concurrency, bfloat16: threads of one GEMM (default: the backend's)")
    parser.add_argument("--cpu-isa", default="auto",
                        help="cap the compiled cpu kernels (EngineConfig.cpu_isa: auto, amx, "
                             "avx512, avx2, portable); the JSON names the paths that ran")
    parser.add_argument("--levels", default="1,8,32", help="concurrency: concurrent requests")
    parser.add_argument("--prompt-tokens", type=int, default=32, help="concurrency: prompt length")
    parser.add_argument("--new-tokens", type=int, default=24, help="concurrency: tokens generated")
    return parser.parse_args()


ARGS = _parse() if __name__ == "__main__" else None
if ARGS is not None:
    set_blas_threads(ARGS.blas_threads)

import numpy as np  # noqa: E402  (after the thread setting)

from sharegpt_mix import poisson_arrival_steps, random_prompt_ids, sharegpt_like_lengths  # noqa: E402

from pagedrun.runtime.sampling_params import SamplingParams  # noqa: E402

BLOCK_SIZE = 16
KV_WASTE_REQUESTS = 300
KV_WASTE_MAX_MODEL_LEN = 2048
KV_WASTE_POOL_BLOCKS = 4096  # 65,536 tokens: a few dozen ShareGPT requests at once
KV_WASTE_ARRIVALS_PER_STEP = 0.05
VOCAB_FOR_REPLAY = 49152


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def _llm(**kw):
    from pagedrun import LLM

    kw.setdefault("device", "cpu")
    if ARGS is not None:
        kw.setdefault("cpu_isa", ARGS.cpu_isa)
    return LLM(**kw)


# ----------------------------------------------------------------------------- kv waste

def bench_kv_waste() -> dict:
    from pagedrun.pyx.scheduler import Scheduler, SchedulerConfig

    prompt_lens, output_lens = sharegpt_like_lengths(KV_WASTE_REQUESTS, seed=0,
                                                     max_model_len=KV_WASTE_MAX_MODEL_LEN)
    arrivals = poisson_arrival_steps(KV_WASTE_REQUESTS, KV_WASTE_ARRIVALS_PER_STEP)
    sched = Scheduler(SchedulerConfig(num_gpu_blocks=KV_WASTE_POOL_BLOCKS, block_size=BLOCK_SIZE,
                                      max_num_seqs=256, max_num_batched_tokens=2048,
                                      max_model_len=KV_WASTE_MAX_MODEL_LEN,
                                      enable_prefix_caching=False))
    rng = np.random.default_rng(0)
    live: set[int] = set()
    next_req, step = 0, 0
    paged_fracs, contiguous_fracs = [], []
    sum_tokens = sum_paged_slots = sum_contig_slots = 0
    while next_req < KV_WASTE_REQUESTS or live:
        while next_req < KV_WASTE_REQUESTS and arrivals[next_req] <= step:
            prompt = np.asarray(random_prompt_ids(rng, int(prompt_lens[next_req]),
                                                  VOCAB_FOR_REPLAY), dtype=np.int32)
            sched.add_request(next_req, prompt, int(output_lens[next_req]))
            live.add(next_req)
            next_req += 1
        out = sched.schedule()
        sampled = rng.integers(100, VOCAB_FOR_REPLAY, out.num_reqs).astype(np.int32)
        for finished in sched.update_from_output(out, sampled, None):
            live.discard(int(finished))
        step += 1
        computed = [sched.get_num_computed_tokens(r) for r in live]
        tokens = sum(computed)
        stats = sched.get_stats()
        used_slots = (stats["num_total_blocks"] - stats["num_free_blocks"]) * BLOCK_SIZE
        reserved = sum(1 for c in computed if c > 0) * KV_WASTE_MAX_MODEL_LEN
        if used_slots:
            paged_fracs.append(1 - tokens / used_slots)
            contiguous_fracs.append(1 - tokens / reserved)
            sum_tokens += tokens
            sum_paged_slots += used_slots
            sum_contig_slots += reserved
    return {
        "requests": KV_WASTE_REQUESTS, "steps": step, "block_size": BLOCK_SIZE,
        "max_model_len": KV_WASTE_MAX_MODEL_LEN,
        "mean_prompt_tokens": float(prompt_lens.mean()),
        "mean_output_tokens": float(output_lens.mean()),
        "paged_waste_mean_over_steps": float(np.mean(paged_fracs)),
        "contiguous_waste_mean_over_steps": float(np.mean(contiguous_fracs)),
        "paged_waste_slot_weighted": 1 - sum_tokens / sum_paged_slots,
        "contiguous_waste_slot_weighted": 1 - sum_tokens / sum_contig_slots,
    }


# ----------------------------------------------------------------------------- continuous vs static

CB_REQUESTS = 16
CB_SCALE = 0.1
CB_MAX_MODEL_LEN = 256
CB_STATIC_BATCH = 4


def bench_continuous(repeats: int) -> dict:
    prompt_lens, output_lens = sharegpt_like_lengths(CB_REQUESTS, seed=1, scale=CB_SCALE,
                                                     max_model_len=CB_MAX_MODEL_LEN)
    num_blocks = CB_STATIC_BATCH * CB_MAX_MODEL_LEN // BLOCK_SIZE
    llm = _llm(max_model_len=CB_MAX_MODEL_LEN, num_kv_blocks=num_blocks,
               enable_prefix_caching=False)
    vocab = llm.engine.model_config.vocab_size
    rng = np.random.default_rng(1)
    prompts = [random_prompt_ids(rng, int(n), vocab) for n in prompt_lens]
    params = [_greedy(int(n)) for n in output_lens]
    total_out = int(output_lens.sum())
    llm.generate(prompts[:2], [_greedy(2)] * 2)  # warm-up

    continuous, static = [], []
    for _ in range(repeats):  # interleaved; best of each, since contention only slows a run
        start = time.perf_counter()
        llm.generate(prompts, params)
        continuous.append(time.perf_counter() - start)
        start = time.perf_counter()
        for i in range(0, CB_REQUESTS, CB_STATIC_BATCH):
            llm.generate(prompts[i:i + CB_STATIC_BATCH], params[i:i + CB_STATIC_BATCH])
        static.append(time.perf_counter() - start)
    continuous_s, static_s = min(continuous), min(static)
    return {
        "requests": CB_REQUESTS, "output_tokens": total_out,
        "mean_prompt_tokens": float(prompt_lens.mean()),
        "mean_output_tokens": float(output_lens.mean()),
        "max_output_tokens": int(output_lens.max()),
        "kv_blocks": num_blocks, "kv_tokens": num_blocks * BLOCK_SIZE,
        "static_batch_size": CB_STATIC_BATCH, "max_model_len": CB_MAX_MODEL_LEN,
        "continuous_tok_s": total_out / continuous_s, "static_tok_s": total_out / static_s,
        "continuous_over_static": static_s / continuous_s, "repeats": repeats,
    }


# ----------------------------------------------------------------------------- batch 1

B1_PROMPT = 32
B1_NEW = 48


def bench_batch1(repeats: int) -> dict:
    from pagedrun.runtime.default_model import default_model_dir
    from pagedrun.runtime.reference import ReferenceModel
    from pagedrun.runtime.weights import load_model_weights

    llm = _llm(max_model_len=512, num_kv_blocks=64)
    engine = llm.engine
    ref = ReferenceModel(engine.model_config,
                         load_model_weights(default_model_dir(), engine.model_config))
    prompt = random_prompt_ids(np.random.default_rng(2), B1_PROMPT, engine.model_config.vocab_size)
    llm.generate(prompt, _greedy(4))
    ref.greedy_generate(prompt, 4)
    paged, dense = [], []
    for _ in range(repeats):  # interleaved, so machine noise hits both alike
        start = time.perf_counter()
        paged_ids = llm.generate(prompt, _greedy(B1_NEW))[0].outputs[0].token_ids
        paged.append(time.perf_counter() - start)
        start = time.perf_counter()
        dense_ids = ref.greedy_generate(prompt, B1_NEW)
        dense.append(time.perf_counter() - start)
    paged_s, dense_s = float(np.median(paged)), float(np.median(dense))
    return {
        "prompt_tokens": B1_PROMPT, "new_tokens": B1_NEW, "repeats": repeats,
        "paged_tok_s": B1_NEW / paged_s, "dense_tok_s": B1_NEW / dense_s,
        "paged_overhead_pct": 100 * (paged_s / dense_s - 1),
        "same_tokens": paged_ids == dense_ids,
    }


# ----------------------------------------------------------------------------- prefix ttft

PREFIX_TOKENS = 1000
SUFFIX_TOKENS = 24


def bench_prefix(repeats: int) -> dict:
    llm = _llm(max_model_len=2048, num_kv_blocks=1024, max_num_batched_tokens=2048)
    vocab = llm.engine.model_config.vocab_size
    rng = np.random.default_rng(3)
    cold, warm, cached = [], [], []
    for _ in range(max(1, repeats - 1)):
        prefix = random_prompt_ids(rng, PREFIX_TOKENS, vocab)
        first = llm.generate(prefix + random_prompt_ids(rng, SUFFIX_TOKENS, vocab), _greedy(1))[0]
        second = llm.generate(prefix + random_prompt_ids(rng, SUFFIX_TOKENS, vocab), _greedy(1))[0]
        cold.append(first.time_to_first_token)
        warm.append(second.time_to_first_token)
        cached.append(second.usage.cached_prompt_tokens)
    cold_s, warm_s = float(np.median(cold)), float(np.median(warm))
    return {"prefix_tokens": PREFIX_TOKENS, "suffix_tokens": SUFFIX_TOKENS,
            "ttft_cold_s": cold_s, "ttft_warm_s": warm_s, "speedup": cold_s / warm_s,
            "cached_prompt_tokens": int(np.median(cached))}


# ----------------------------------------------------------------------------- concurrency

CONC_PROMPT = 32
CONC_NEW = 24


def _concurrency_run(llm, prompts, new_tokens: int) -> tuple[float, float]:
    """(output tok/s including prefill, decode-only tok/s) of one generate over `prompts`."""
    start = time.perf_counter()
    outs = llm.generate(prompts, _greedy(new_tokens))
    wall = time.perf_counter() - start
    # Decode-only rate: tokens after the first, over the time after the last first token.
    last_first = max(o.first_token_time for o in outs)
    end = max(o.finished_time for o in outs)
    num = len(prompts)
    return num * new_tokens / wall, num * (new_tokens - 1) / (end - last_first)


def read_bandwidth(threads: int, nbytes: int = 512 << 20) -> float:
    """Bytes/s `threads` threads read from memory (numpy sums of disjoint slices of an array
    far larger than the caches; numpy drops the GIL in the loop), median of 5."""
    import threading

    data = np.ones(nbytes // 4, np.float32)
    parts = np.array_split(data, threads)
    times = []
    for _ in range(5):
        workers = [threading.Thread(target=np.add.reduce, args=(part,)) for part in parts]
        start = time.perf_counter()
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        times.append(time.perf_counter() - start)
    return nbytes / float(np.median(times))


# --dtype arms -> LLM keywords.
CONC_ARMS = {"float32": {"dtype": "float32"}, "bfloat16": {"dtype": "bfloat16"},
             "int8": {"dtype": "bfloat16", "quantization": "int8"},
             # The default model's own Q4_1 / Q8_0 GGUF blocks (issue 16).
             "gguf": {"quantization": "gguf"},
             # No flags at all: what `paged-run serve` runs (dtype auto: the file's own blocks).
             "default": {}}


def concurrency_arms(text: str) -> tuple[str, ...]:
    arms = ("float32", "bfloat16") if text == "both" else tuple(text.split(","))
    unknown = [a for a in arms if a not in CONC_ARMS]
    if unknown:
        raise SystemExit(f"--dtype: unknown {unknown}; choose from {list(CONC_ARMS)} or both")
    return arms


def bench_concurrency(dtypes=("float32",), levels=(1, 8, 32), repeats: int = 1,
                      gemm_threads: int | None = None, prompt_tokens: int = CONC_PROMPT,
                      new_tokens: int = CONC_NEW) -> dict:
    """Each level runs every dtype in turn, `repeats` times interleaved (machine noise hits
    all alike); medians. Keys without a dtype suffix are float32's (the earlier tables').
    The KV pool holds every request of the largest level at once (no preemption)."""
    blocks_per_request = -(-(prompt_tokens + new_tokens) // BLOCK_SIZE) + 1
    num_kv_blocks = max(512, max(levels) * blocks_per_request + 64)
    max_model_len = max(512, prompt_tokens + new_tokens)
    llms = {}
    for dtype in dtypes:
        llms[dtype] = _llm(max_model_len=max_model_len, num_kv_blocks=num_kv_blocks,
                           enable_prefix_caching=False, **CONC_ARMS[dtype])
        if dtype != "float32" and gemm_threads is not None:
            llms[dtype].engine.backend.gemm_threads = gemm_threads
    vocab = next(iter(llms.values())).engine.model_config.vocab_size
    rng = np.random.default_rng(4)
    warm = random_prompt_ids(rng, 8, vocab)
    for llm in llms.values():
        llm.generate(warm, _greedy(2))
    result = {"prompt_tokens": prompt_tokens, "new_tokens": new_tokens, "repeats": repeats,
              "dtypes": list(dtypes), "num_kv_blocks": num_kv_blocks}
    if "bfloat16" in llms:
        result["bf16_gemm_threads"] = llms["bfloat16"].engine.backend.gemm_threads
    # Batch 1 is bound by the weight bytes a step reads: its roofline is the read bandwidth
    # of the GEMM's threads over those bytes.
    bandwidth = read_bandwidth(2)
    result["read_bandwidth_gb_s_2_threads"] = bandwidth / 1e9
    for dtype, llm in llms.items():
        backend = llm.engine.backend
        if hasattr(backend, "packed_weight_bytes"):
            result[f"weight_bytes_per_token_{dtype}"] = backend.packed_weight_bytes()
            result[f"roofline_tok_s_1_{dtype}"] = bandwidth / backend.packed_weight_bytes()
    for num in levels:
        prompts = [random_prompt_ids(rng, prompt_tokens, vocab) for _ in range(num)]
        runs = {dtype: [] for dtype in dtypes}
        for _ in range(repeats):
            for dtype, llm in llms.items():
                runs[dtype].append(_concurrency_run(llm, prompts, new_tokens))
        for dtype, values in runs.items():
            suffix = "" if dtype == "float32" else f"_{dtype}"
            result[f"tok_s_{num}{suffix}"] = float(np.median([v[0] for v in values]))
            result[f"decode_tok_s_{num}{suffix}"] = float(np.median([v[1] for v in values]))
        for dtype in dtypes:
            if num == 1 and f"roofline_tok_s_1_{dtype}" in result:
                result[f"decode_over_roofline_1_{dtype}"] = (
                    result[f"decode_tok_s_1{'' if dtype == 'float32' else '_' + dtype}"]
                    / result[f"roofline_tok_s_1_{dtype}"])
        if "float32" in dtypes and "bfloat16" in dtypes:
            result[f"bf16_over_fp32_{num}"] = (result[f"tok_s_{num}_bfloat16"]
                                               / result[f"tok_s_{num}"])
    return result


def main() -> int:
    args = ARGS
    benches = {
        "kv-waste": bench_kv_waste,
        "continuous": lambda: bench_continuous(max(1, args.repeats - 1)),
        "batch1": lambda: bench_batch1(args.repeats),
        "prefix": lambda: bench_prefix(args.repeats),
        "concurrency": lambda: bench_concurrency(
            concurrency_arms(args.dtype),
            tuple(int(v) for v in args.levels.split(",")), max(1, args.repeats - 2),
            args.gemm_threads, args.prompt_tokens, args.new_tokens),
    }
    names = list(benches) if args.bench == "all" else [args.bench]
    from pagedrun.runtime import cpu_isa

    cpu_isa.apply(args.cpu_isa)
    results = {"blas_threads": args.blas_threads, "load_average_at_start": load_average(),
               "cpu_kernels": cpu_kernels(args.cpu_isa)}
    print(results["cpu_kernels"], flush=True)
    run_benches(benches, names, results, echo=True)
    write_json(results, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
