"""Speculative decoding with the n-gram proposer on the default model (SmolLM2-135M-Instruct),
cpu backend: tokens/s with and without speculation, and how much of the drafting is accepted.

Two engines, identical but for `speculative_config` (vLLM's name; default {"method": "ngram",
"num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}), `--dtype
bfloat16` by default (the fast cpu path), prefix caching off (every run pays its prefill),
greedy chat requests (EOS honoured, max_tokens MAX_TOKENS). Workloads:
  copy   batch 1, one request at a time: the COPY_PROMPTS below ("repeat / fix the typos in /
         rename a variable in / replace a name in this passage"; passages of 100-125 words or
         14 lines of code), where the answer repeats the prompt and prompt lookup should find
         long matches (the 135M model paraphrases some of them: the acceptance says how much);
  free   batch 1: the FREE_PROMPTS (open questions), where it should find few; the policy in
         runtime/spec_decode/speculator.py pauses speculation when acceptance is low, so the
         target is spec >= 0.95x base;
  batch  BATCH_REQUESTS concurrent requests, copy and free prompts alternating (target: spec
         within 5% of base).
Runs are interleaved (base, spec, base, spec, ...; machine noise hits both alike), medians of
`--repeats`. Per run: output tok/s = generated tokens / wall time of the generate call
(time.perf_counter; prefill included); decode tok/s = tokens after each request's first /
time after its first token (batch 1: summed over the requests; batch: from the last first
token to the last finish, as bench_engine.py's concurrency); engine steps are counted by
wrapping engine.step, so tokens/step = generated tokens / steps (batch 1: decode tokens /
decode steps). From the engine's spec_decode counters (get_stats(), deltas per run):
acceptance rate = accepted / draft tokens, accepted per draft = accepted tokens / num_drafts
(rows that verified drafts; at batch 1 one per drafted step). Greedy outputs with and without
speculation are compared request by request (bf16 GEMMs at M = 1 + k may round differently
from M = 1, so a near tie can flip): a warning line is printed and the JSON says how many match.

`--quick`: 1 prompt of each kind, max_tokens 16, batch 4, 1 repeat (a CI smoke run, < 60 s).
`--profile copy|free|batch`: after the timed runs, one more spec run under cProfile (its top 15
cumulative entries printed and in the JSON). The speculation policy's state (acceptance
average, pause) lives in the engine and carries from one request to the next, as in serving.
BLAS threads: `--blas-threads` (default 1), set before numpy loads, as bench_engine.py.

Usage: python benchmarks/bench_spec_decode.py --json /tmp/bench_spec.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import (  # noqa: E402
    add_json_option,
    cpu_model,
    load_average,
    set_blas_threads,
    write_json,
)


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_json_option(parser, bare_to_stdout=False)
    parser.add_argument("--blas-threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats (medians)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--batch", type=int, default=32, help="requests of the batch workload")
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--disable-by-batch-size", type=int, default=None,
                        help="speculative_config's disable_by_batch_size (default: unset)")
    parser.add_argument("--workloads", default="copy,free,batch")
    parser.add_argument("--draft", choices=["self", "random"], default=None,
                        help="speculate with a draft model instead of n-grams: the default "
                             "model itself (every draft accepted in float32: an upper bound) "
                             "or a 2-layer random-weight model of the same vocabulary (a "
                             "lower bound)")
    parser.add_argument("--quick", action="store_true",
                        help="1 prompt of each kind, max_tokens 16, batch 4, 1 repeat")
    parser.add_argument("--profile", choices=["copy", "free", "batch"], default=None,
                        help="after the timed runs, cProfile one spec run of this workload "
                             "(top 15 cumulative entries printed)")
    return parser.parse_args()


ARGS = _parse() if __name__ == "__main__" else None
if ARGS is not None:
    set_blas_threads(ARGS.blas_threads)

from pagedrun.runtime.sampling_params import SamplingParams  # noqa: E402

# Room for the longest copy prompt (~250 tokens with the chat template) and its answer.
MAX_MODEL_LEN = 1024
BLOCK_SIZE = 16
QUICK_MAX_TOKENS = 16
QUICK_BATCH = 4

# Copy-heavy: the answer is (nearly) the passage in the prompt.
COPY_PROMPTS = [
    "Repeat the following passage exactly, word for word:\n\n"
    "The old harbour town wakes slowly. Long before dawn the fishing boats come back through the "
    "narrow channel, their decks stacked with crates of silver herring, and the gulls follow "
    "them in wide, noisy circles. By six the market hall is open. Traders in rubber boots shout "
    "prices across the wet stone floor, and the first customers, mostly restaurant cooks with "
    "folded lists in their pockets, walk from stall to stall without hurrying. At eight the "
    "bakery on the corner opens its shutters, and the smell of fresh bread drifts down to the "
    "water. Children run past on their way to school. By noon the market is empty again, the "
    "floor has been hosed clean, and the town settles into its quiet afternoon.",

    "Fix the typos in this passage and return the corrected passage only:\n\n"
    "Our team met on Tuesday to discus the plan for the next quater. We agreed that the new "
    "website should launch in Febuary, after the design review is finshed. Maria will write the "
    "content for the landing page, and Tom will handle the transalation into French and German. "
    "The budget for advertising stays the same as last year, but we will spend more of it on "
    "search ads and less on printed flyers. Everyone should send there comments on the draft "
    "schedule by Friday, so that we can make a final desicion at the next meeting. Please also "
    "check the shared calender and book the large conference room for the workshop in March.",

    "Rewrite this Python code with the variable x renamed to count. Return only the code.\n\n"
    "def summarize(records):\n"
    "    x = 0\n"
    "    totals = {}\n"
    "    for record in records:\n"
    "        if record.get(\"status\") != \"done\":\n"
    "            continue\n"
    "        x = x + 1\n"
    "        key = record[\"category\"]\n"
    "        totals[key] = totals.get(key, 0) + record[\"amount\"]\n"
    "    if x == 0:\n"
    "        return {\"count\": 0, \"average\": 0.0, \"totals\": totals}\n"
    "    average = sum(totals.values()) / x\n"
    "    print(\"processed\", x, \"records\")\n"
    "    return {\"count\": x, \"average\": average, \"totals\": totals}\n",

    "Rewrite this email, replacing the name Anna with Maria everywhere, and change nothing "
    "else:\n\n"
    "Hi everyone,\n\n"
    "Anna has joined the support team this week. Anna worked for four years at a logistics "
    "company, where she ran the customer help desk and trained new staff. This week Anna will "
    "shadow Peter on the morning shift, and from next Monday she will take her own tickets. If "
    "you have questions about the billing system, Anna is a good person to ask: she wrote the "
    "guide we use today. Please give Anna a warm welcome, and invite her to the team lunch on "
    "Thursday. Anna's desk is next to the window on the second floor.\n\n"
    "Best regards,\nLaura",
]

# Free-form: the answer shares little with the prompt.
FREE_PROMPTS = [
    "Write a short story about a lighthouse keeper.",
    "Explain how a refrigerator works to a ten-year-old.",
    "What are the pros and cons of working from home?",
    "Describe a day in the life of a medieval blacksmith.",
]


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens)


def _conversation(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


class CountedLLM:
    """An LLM whose engine counts its step() calls (the instance attribute shadows the
    method; LLM._run is the only caller here)."""

    def __init__(self, draft=None, **kw) -> None:
        """kw: LLM's keywords; draft: (config, weights) of an in-memory draft model (the
        speculative_config in kw then names method draft_model)."""
        from pagedrun import LLM

        if draft is None:
            self.llm = LLM(**kw)
        else:
            from pagedrun.runtime.engine import LLMEngine
            from pagedrun.runtime.engine_config import EngineConfig

            self.llm = LLM.from_engine(LLMEngine(EngineConfig(**kw), draft_model=draft))
        self.engine = self.llm.engine
        self.num_steps = 0
        inner = self.engine.step

        def step():
            self.num_steps += 1
            return inner()

        self.engine.step = step

    def spec_counters(self) -> tuple[int, int, int]:
        stats = self.engine.get_stats()
        return (stats.get("spec_decode_num_drafts", 0),
                stats.get("spec_decode_num_draft_tokens", 0),
                stats.get("spec_decode_num_accepted_tokens", 0))


def _run(engine: CountedLLM, conversations: list[list[dict]], max_tokens: int) -> dict:
    """One generate call over `conversations` (all concurrent): its times, steps, counters."""
    steps0, spec0 = engine.num_steps, engine.spec_counters()
    start = time.perf_counter()
    outs = engine.llm.chat(conversations, _greedy(max_tokens))
    wall = time.perf_counter() - start
    spec1 = engine.spec_counters()
    token_ids = [list(o.outputs[0].token_ids) for o in outs]
    num_tokens = sum(len(t) for t in token_ids)
    return {
        "wall_s": wall, "num_tokens": num_tokens, "num_steps": engine.num_steps - steps0,
        "num_reqs": len(outs),
        # Tokens after each request's first, over the time after the last first token.
        "decode_tokens": num_tokens - len(outs),
        "decode_s": (max(o.finished_time for o in outs)
                     - max(o.first_token_time for o in outs)),
        "drafts": spec1[0] - spec0[0], "draft_tokens": spec1[1] - spec0[1],
        "accepted_tokens": spec1[2] - spec0[2], "token_ids": token_ids,
    }


def _run_one_by_one(engine: CountedLLM, conversations, max_tokens: int) -> dict:
    """Batch 1: each conversation alone, the runs' sums (one generate per request)."""
    parts = [_run(engine, [c], max_tokens) for c in conversations]
    total = {key: sum(p[key] for p in parts) for key in parts[0] if key != "token_ids"}
    total["token_ids"] = [p["token_ids"][0] for p in parts]
    return total


def _first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _summarize(runs: dict[str, list[dict]], batch1: bool) -> dict:
    out = {}
    for name, samples in runs.items():
        out[f"{name}_tok_s"] = statistics.median(s["num_tokens"] / s["wall_s"] for s in samples)
        out[f"{name}_decode_tok_s"] = statistics.median(
            s["decode_tokens"] / s["decode_s"] for s in samples)
        # Batch 1 excludes each request's prefill step (it emits the first token).
        steps = [s["num_steps"] - (s["num_reqs"] if batch1 else 0) for s in samples]
        tokens = [s["decode_tokens"] if batch1 else s["num_tokens"] for s in samples]
        out[f"{name}_tokens_per_step"] = sum(tokens) / sum(steps)
        out[f"{name}_steps_per_run"] = statistics.median(s["num_steps"] for s in samples)
        out[f"{name}_tokens_per_run"] = statistics.median(s["num_tokens"] for s in samples)
        out[f"{name}_tok_s_runs"] = [s["num_tokens"] / s["wall_s"] for s in samples]
    out["ratio_tok_s"] = out["spec_tok_s"] / out["base_tok_s"]
    out["ratio_decode_tok_s"] = out["spec_decode_tok_s"] / out["base_decode_tok_s"]
    spec = runs["spec"]
    drafts = sum(s["drafts"] for s in spec)
    draft_tokens = sum(s["draft_tokens"] for s in spec)
    accepted = sum(s["accepted_tokens"] for s in spec)
    out.update(
        spec_decode_num_drafts=drafts, spec_decode_num_draft_tokens=draft_tokens,
        spec_decode_num_accepted_tokens=accepted,
        acceptance_rate=accepted / draft_tokens if draft_tokens else None,
        mean_accepted_per_draft=accepted / drafts if drafts else None)
    if batch1:  # one row, so one draft per drafted step: the share of decode steps drafting
        decode_steps = sum(s["num_steps"] - s["num_reqs"] for s in spec)
        out["drafted_step_share"] = drafts / decode_steps if decode_steps else None
    # Greedy: every repeat of one engine gives the same tokens; compare repeat by repeat.
    num_match = num_total = 0
    first_diffs = []
    for base_run, spec_run in zip(runs["base"], runs["spec"]):
        for a, b in zip(base_run["token_ids"], spec_run["token_ids"]):
            num_total += 1
            diff = _first_difference(a, b)
            if diff is None:
                num_match += 1
            else:
                first_diffs.append(diff)
    out.update(outputs_matching=num_match, outputs_compared=num_total,
               outputs_first_difference_at=first_diffs)
    return out


def bench_workload(engines: dict[str, CountedLLM], conversations, max_tokens: int,
                   repeats: int, batch1: bool) -> dict:
    runs: dict[str, list[dict]] = {name: [] for name in engines}
    for _ in range(repeats):  # interleaved, so machine noise hits both alike
        for name, engine in engines.items():
            if batch1:
                runs[name].append(_run_one_by_one(engine, conversations, max_tokens))
            else:
                runs[name].append(_run(engine, conversations, max_tokens))
    result = _summarize(runs, batch1)
    result.update(num_requests=len(conversations), max_tokens=max_tokens, repeats=repeats)
    return result


def profile_spec_run(engine: CountedLLM, conversations, max_tokens: int, batch1: bool,
                     num_entries: int = 15) -> str:
    """cProfile of one spec run: the top `num_entries` cumulative entries, as text."""
    import cProfile
    import io
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    if batch1:
        _run_one_by_one(engine, conversations, max_tokens)
    else:
        _run(engine, conversations, max_tokens)
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(num_entries)
    return text.getvalue()


def _table(results: dict) -> str:
    lines = ["| workload | base tok/s (decode) | spec tok/s (decode) | spec / base (decode) "
             "| acceptance | accepted / draft | tokens / step base, spec | greedy outputs equal |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, r in results["workloads"].items():
        acc = "-" if r["acceptance_rate"] is None else f"{r['acceptance_rate']:.1%}"
        per = "-" if r["mean_accepted_per_draft"] is None else (
            f"{r['mean_accepted_per_draft']:.2f}")
        lines.append(
            f"| {name} ({r['num_requests']} req.) | {r['base_tok_s']:.1f} "
            f"({r['base_decode_tok_s']:.1f}) | {r['spec_tok_s']:.1f} "
            f"({r['spec_decode_tok_s']:.1f}) | {r['ratio_tok_s']:.2f}x "
            f"({r['ratio_decode_tok_s']:.2f}x) | {acc} | {per} | "
            f"{r['base_tokens_per_step']:.2f}, {r['spec_tokens_per_step']:.2f} | "
            f"{r['outputs_matching']} / {r['outputs_compared']} |")
    return "\n".join(lines)


def _draft_model(kind: str):
    """(ModelConfig, ModelWeights) of the draft: the default model, or a random 2-layer model
    (hidden 128) with its vocabulary, scaled like the tests' tiny models."""
    import numpy as np

    from pagedrun.runtime.model_config import ModelConfig
    from pagedrun.runtime.model_loader import load_model
    from pagedrun.runtime.weights import LayerWeights, ModelWeights

    target_config, weights, _ = load_model(None)
    if kind == "self":
        return target_config, weights
    config = ModelConfig.from_dict({
        "architectures": ["LlamaForCausalLM"], "vocab_size": target_config.vocab_size,
        "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
        "num_attention_heads": 2, "num_key_value_heads": 1, "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0, "max_position_embeddings": MAX_MODEL_LEN,
        "tie_word_embeddings": False, "eos_token_id": target_config.eos_token_ids[0]})
    rng = np.random.default_rng(0)

    def mat(rows, cols):
        return (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)

    hidden, inter = config.hidden_size, config.intermediate_size
    layers = [LayerWeights(
        input_layernorm=np.ones(hidden, np.float32), q_proj=mat(config.q_size, hidden),
        k_proj=mat(config.kv_size, hidden), v_proj=mat(config.kv_size, hidden),
        o_proj=mat(hidden, config.q_size), q_bias=None, k_bias=None, v_bias=None, o_bias=None,
        post_attention_layernorm=np.ones(hidden, np.float32), gate_proj=mat(inter, hidden),
        up_proj=mat(inter, hidden), down_proj=mat(hidden, inter))
        for _ in range(config.num_hidden_layers)]
    embed = rng.standard_normal((config.vocab_size, hidden)).astype(np.float32)
    return config, ModelWeights(config=config, embed_tokens=embed, layers=layers,
                                norm=np.ones(hidden, np.float32),
                                lm_head=4.0 * mat(config.vocab_size, hidden))


def main() -> int:
    args = ARGS
    if args.quick:
        args.max_tokens, args.batch, args.repeats = QUICK_MAX_TOKENS, QUICK_BATCH, 1
    copy_prompts = COPY_PROMPTS[:1] if args.quick else COPY_PROMPTS
    free_prompts = FREE_PROMPTS[:1] if args.quick else FREE_PROMPTS
    mixed = [p for pair in zip(COPY_PROMPTS, FREE_PROMPTS) for p in pair]
    workloads = {
        "copy": ([_conversation(p) for p in copy_prompts], True),
        "free": ([_conversation(p) for p in free_prompts], True),
        "batch": ([_conversation(mixed[i % len(mixed)]) for i in range(args.batch)], False),
    }
    chosen = [w for w in args.workloads.split(",") if w]
    unknown = sorted(set(chosen) - set(workloads))
    if unknown:
        sys.exit(f"bench_spec_decode: unknown workload(s) {unknown}; known: {list(workloads)}")

    spec_config = {"method": "ngram", "num_speculative_tokens": args.num_speculative_tokens,
                   "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    draft = None
    if args.draft is not None:
        spec_config = {"method": "draft_model", "model": f"<{args.draft}>",
                       "num_speculative_tokens": args.num_speculative_tokens}
        draft = _draft_model(args.draft)
    if args.disable_by_batch_size is not None:
        spec_config["disable_by_batch_size"] = args.disable_by_batch_size
    # Enough KV for the batch at full length: no preemption in either engine.
    num_kv_blocks = max(args.batch, 1) * MAX_MODEL_LEN // BLOCK_SIZE // 2
    common = dict(device="cpu", dtype=args.dtype, max_model_len=MAX_MODEL_LEN,
                  num_kv_blocks=num_kv_blocks, enable_prefix_caching=False,
                  max_num_seqs=max(args.batch, 1))
    engines = {"base": CountedLLM(**common),
               "spec": CountedLLM(draft=draft, **common, speculative_config=spec_config)}
    for engine in engines.values():  # warm-up: kernels, allocator, tokenizer, chat template
        _run(engine, [_conversation(FREE_PROMPTS[0])], 4)

    results = {
        "cpu": cpu_model(), "dtype": args.dtype, "blas_threads": args.blas_threads,
        "speculative_config": spec_config, "quick": args.quick,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "load_average_at_start": load_average(), "workloads": {},
    }
    for name in chosen:
        conversations, batch1 = workloads[name]
        start = time.perf_counter()
        result = bench_workload(engines, conversations, args.max_tokens, args.repeats, batch1)
        result["bench_wall_s"] = time.perf_counter() - start
        results["workloads"][name] = result
        print(json.dumps({name: result}), flush=True)
        if result["outputs_matching"] != result["outputs_compared"]:
            print(f"WARNING: {name}: greedy outputs differ with speculation: "
                  f"{result['outputs_matching']} of {result['outputs_compared']} requests match "
                  f"(first differing token at {result['outputs_first_difference_at']})",
                  flush=True)
    results["load_average_at_end"] = load_average()
    if args.profile is not None:
        conversations, batch1 = workloads[args.profile]
        results["profile"] = profile_spec_run(engines["spec"], conversations, args.max_tokens,
                                              batch1)
        print(results["profile"], flush=True)
    print(f"\nCPU: {results['cpu']}; dtype {args.dtype}; load average "
          f"{results['load_average_at_start']:.2f} -> {results['load_average_at_end']:.2f}")
    print(_table(results))
    write_json(results, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
