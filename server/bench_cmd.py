"""`paged-run bench`: a load generator against a running server.

Sends `--num-prompts` requests of random token ids (lengths drawn from `--input-len-mix`,
outputs forced to lengths from `--output-len-mix` with ignore_eos), either at a Poisson
`--request-rate` or with `--concurrency` in flight (or both), and reports throughput and
TTFT / TPOT / end-to-end latency percentiles measured at the client, as a table or `--json`.
Bounded: it stops at `--num-prompts` or `--max-duration-s`, whichever comes first.

`--backend zmq` (default) speaks the ZeroMQ protocol to `paged-run serve`; `--backend openai
--base-url URL` sends the same workload to any OpenAI-compatible server (our `paged-run http` or
`serve --http-port`, vLLM, SGLang, ...): streamed POST /v1/completions with token-id prompts,
`ignore_eos` (vLLM's extra field) and `stream_options.include_usage` (output tokens are the
usage's `completion_tokens`; TTFT is the first chunk with text), so one tool measures us and the
peers alike.
"""
from __future__ import annotations

import argparse
import sys

PERCENTILES = (50, 90, 99)
DEFAULT_INPUT_MIX = "32:0.5,128:0.3,512:0.2"
DEFAULT_OUTPUT_MIX = "16:0.5,64:0.4,128:0.1"
# Token ids below this are commonly special (BOS/EOS/pad) in Llama-family vocabularies.
FIRST_PLAIN_TOKEN_ID = 3
# An OpenAI-compatible peer does not say its vocabulary size (our gateway's model card does);
# every real vocabulary has at least this many ids.
DEFAULT_HTTP_VOCAB_SIZE = 1000
# Without a max_model_len from the server, prompts + outputs are kept under this.
DEFAULT_HTTP_MAX_MODEL_LEN = 2048


def add_parser(subparsers) -> argparse.ArgumentParser:
    from pagedrun.server.protocol import DEFAULT_HOST, DEFAULT_PORT

    p = subparsers.add_parser("bench", help="load-test a running server",
                              description=__doc__.split("\n\n")[1].replace("\n", " "))
    p.add_argument("--host", default=DEFAULT_HOST)
    p.add_argument("--port", type=int, default=DEFAULT_PORT)
    p.add_argument("--endpoint", default=None, help="full ZeroMQ endpoint (overrides host/port)")
    p.add_argument("--backend", choices=("zmq", "openai"), default="zmq",
                   help="zmq: the ZeroMQ protocol (default); openai: the OpenAI HTTP API at "
                   "--base-url")
    p.add_argument("--base-url", default=None, metavar="URL",
                   help="with --backend openai: the API root, e.g. http://127.0.0.1:8000/v1")
    p.add_argument("--model", default=None,
                   help="with --backend openai: the model name (default: the first of "
                   "GET /models)")
    p.add_argument("--api-key", default=None, help="with --backend openai: Bearer key")
    p.add_argument("--vocab-size", type=int, default=None,
                   help="prompt token ids are drawn below this (default: the engine's, from "
                   "MODEL_INFO or the model card's vocab_size; else "
                   f"{DEFAULT_HTTP_VOCAB_SIZE})")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests per second, Poisson arrivals (default: all at once)")
    p.add_argument("--concurrency", type=int, default=None,
                   help="most requests in flight (default: unbounded)")
    p.add_argument("--input-len-mix", default=DEFAULT_INPUT_MIX,
                   help=f"prompt lengths 'LEN:WEIGHT,...' (default {DEFAULT_INPUT_MIX})")
    p.add_argument("--output-len-mix", default=DEFAULT_OUTPUT_MIX,
                   help=f"output lengths 'LEN:WEIGHT,...' (default {DEFAULT_OUTPUT_MIX})")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-duration-s", type=float, default=600.0)
    p.add_argument("--timeout-s", type=float, default=300.0, help="per-reply client timeout")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=run)
    return p


def parse_mix(text: str) -> list[tuple[int, float]]:
    """'32:0.5,128:0.5' -> [(32, 0.5), (128, 0.5)]; weights need not sum to 1."""
    mix = []
    for part in text.split(","):
        length, _, weight = part.partition(":")
        mix.append((int(length), float(weight or 1.0)))
    if not mix or any(n < 1 or w <= 0 for n, w in mix):
        raise ValueError(f"bad length mix {text!r}: want LEN:WEIGHT pairs, LEN >= 1, WEIGHT > 0")
    return mix


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (numpy's default method), None for no values."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def make_workload(num_prompts: int, input_mix, output_mix, vocab_size: int, max_model_len: int,
                  seed: int) -> list[tuple[list[int], int]]:
    import random

    rng = random.Random(seed)
    lens_in, w_in = zip(*input_mix)
    lens_out, w_out = zip(*output_mix)
    work = []
    for _ in range(num_prompts):
        n_in = rng.choices(lens_in, w_in)[0]
        n_out = rng.choices(lens_out, w_out)[0]
        n_in = max(1, min(n_in, max_model_len - n_out))  # keep every request admissible
        work.append(([rng.randrange(FIRST_PLAIN_TOKEN_ID, vocab_size) for _ in range(n_in)],
                     n_out))
    return work


def _new_record(prompt_ids: list[int]) -> dict:
    return {"prompt_tokens": len(prompt_ids), "output_tokens": 0, "ttft_s": None,
            "error": None}


def _zmq_requester(client):
    """One request over ZeroMQ: fills `rec` (output tokens, TTFT) as the stream arrives."""
    import time

    from pagedrun.server.client import ServerError

    async def one(prompt_ids, max_tokens, rec, t0):
        try:
            s = await client.stream(prompt_token_ids=prompt_ids, sampling_params={
                "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True})
            async with s:
                async for d in s:
                    if rec["ttft_s"] is None and d.token_ids:
                        rec["ttft_s"] = time.perf_counter() - t0
                    rec["output_tokens"] += len(d.token_ids)
        except (ServerError, TimeoutError) as exc:
            rec["error"] = getattr(exc, "code", type(exc).__name__)

    return one


def _openai_requester(http, base_url: str, model: str):
    """One request over the OpenAI API: a streamed /completions with token-id prompt."""
    import json
    import time

    import httpx

    url = base_url.rstrip("/") + "/completions"

    async def one(prompt_ids, max_tokens, rec, t0):
        body = {"model": model, "prompt": prompt_ids, "max_tokens": max_tokens,
                "temperature": 0.0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        chunks_with_text = 0
        try:
            async with http.stream("POST", url, json=body) as r:
                if r.status_code != 200:
                    await r.aread()
                    rec["error"] = f"http_{r.status_code}"
                    return
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[len("data: "):])
                    if "error" in event:
                        rec["error"] = str(event["error"].get("code") or "error")
                        return
                    if any(c.get("text") for c in event.get("choices") or ()):
                        chunks_with_text += 1
                        if rec["ttft_s"] is None:
                            rec["ttft_s"] = time.perf_counter() - t0
                    if event.get("usage"):
                        rec["output_tokens"] = int(event["usage"]["completion_tokens"])
            if not rec["output_tokens"]:  # a peer without include_usage: one token a chunk
                rec["output_tokens"] = chunks_with_text
        except (httpx.HTTPError, ValueError) as exc:
            rec["error"] = type(exc).__name__

    return one


async def _run_load(requester, work, args) -> tuple[list[dict], float]:
    import asyncio
    import random
    import time

    rng = random.Random(args.seed + 1)
    limit = asyncio.Semaphore(args.concurrency or len(work) or 1)
    progress = None
    if not args.no_progress:
        from tqdm import tqdm
        progress = tqdm(total=len(work), desc="bench", unit="req", file=sys.stderr)
    records: list[dict] = []
    started = time.perf_counter()
    deadline = started + args.max_duration_s

    async def one(prompt_ids, max_tokens):
        async with limit:
            if time.perf_counter() > deadline:
                return
            t0 = time.perf_counter()
            rec = _new_record(prompt_ids)
            await requester(prompt_ids, max_tokens, rec, t0)
            rec["e2e_s"] = time.perf_counter() - t0
            records.append(rec)
            if progress is not None:
                progress.update(1)

    tasks = []
    for prompt_ids, max_tokens in work:
        tasks.append(asyncio.create_task(one(prompt_ids, max_tokens)))
        if args.request_rate != float("inf"):
            await asyncio.sleep(rng.expovariate(args.request_rate))
        if time.perf_counter() > deadline:
            break
    remaining = max(0.0, deadline - time.perf_counter())
    done, pending = await asyncio.wait(tasks, timeout=remaining) if tasks else (set(), set())
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    if progress is not None:
        progress.close()
    return records, time.perf_counter() - started


def summarize(records: list[dict], duration_s: float, args) -> dict:
    ok = [r for r in records if r["error"] is None]
    ttft = [r["ttft_s"] for r in ok if r["ttft_s"] is not None]
    tpot = [(r["e2e_s"] - r["ttft_s"]) / (r["output_tokens"] - 1)
            for r in ok if r["ttft_s"] is not None and r["output_tokens"] > 1]
    e2e = [r["e2e_s"] for r in ok]
    out_tokens = sum(r["output_tokens"] for r in ok)
    in_tokens = sum(r["prompt_tokens"] for r in ok)
    report = {
        "num_prompts": args.num_prompts, "completed": len(ok),
        "failed": len(records) - len(ok),
        "errors": sorted({r["error"] for r in records if r["error"]}),
        "request_rate": None if args.request_rate == float("inf") else args.request_rate,
        "concurrency": args.concurrency, "duration_s": duration_s,
        "request_throughput_per_s": len(ok) / duration_s if duration_s else 0.0,
        "output_token_throughput_per_s": out_tokens / duration_s if duration_s else 0.0,
        "total_token_throughput_per_s":
            (in_tokens + out_tokens) / duration_s if duration_s else 0.0,
        "input_tokens": in_tokens, "output_tokens": out_tokens,
    }
    for name, values in (("ttft", ttft), ("tpot", tpot), ("e2e", e2e)):
        for q in PERCENTILES:
            v = percentile(values, q)
            report[f"{name}_p{q}_ms"] = None if v is None else v * 1000
    return report


def format_table(report: dict) -> str:
    def ms(v):
        return "-" if v is None else f"{v:.1f}"

    errors = f": {', '.join(report['errors'])}" if report["errors"] else ""
    lines = [
        f"completed {report['completed']}/{report['num_prompts']} "
        f"(failed {report['failed']}{errors}) in {report['duration_s']:.2f} s",
        f"throughput: {report['request_throughput_per_s']:.2f} req/s, "
        f"{report['output_token_throughput_per_s']:.1f} output tok/s, "
        f"{report['total_token_throughput_per_s']:.1f} total tok/s",
        f"{'metric':<10}{'p50 ms':>12}{'p90 ms':>12}{'p99 ms':>12}",
    ]
    for name in ("ttft", "tpot", "e2e"):
        lines.append(f"{name.upper():<10}" + "".join(
            f"{ms(report[f'{name}_p{q}_ms']):>12}" for q in PERCENTILES))
    return "\n".join(lines)


async def _zmq_load(endpoint: str, work, args):
    from pagedrun.server.client import AsyncClient

    async with AsyncClient(endpoint, timeout_s=args.timeout_s) as client:
        return await _run_load(_zmq_requester(client), work, args)


async def _openai_load(work, args, model: str):
    import httpx

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=args.concurrency or len(work) or 1,
                          max_keepalive_connections=args.concurrency or len(work) or 1)
    async with httpx.AsyncClient(headers=headers, limits=limits,
                                 timeout=httpx.Timeout(args.timeout_s)) as http:
        return await _run_load(_openai_requester(http, args.base_url, model), work, args)


def openai_model_card(base_url: str, api_key: str | None, timeout_s: float) -> dict:
    """The first model of GET {base_url}/models (ours adds vocab_size to it)."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    r = httpx.get(base_url.rstrip("/") + "/models", headers=headers, timeout=timeout_s)
    r.raise_for_status()
    return r.json()["data"][0]


def run(args) -> int:
    import asyncio
    import json

    from pagedrun.server.serve_cmd import endpoint_from_args

    try:
        input_mix, output_mix = parse_mix(args.input_len_mix), parse_mix(args.output_len_mix)
    except ValueError as exc:
        print(f"paged-run bench: error: {exc}", file=sys.stderr)
        return 2
    if args.backend == "openai":
        if not args.base_url:
            print("paged-run bench: error: --backend openai needs --base-url URL",
                  file=sys.stderr)
            return 2
        card = openai_model_card(args.base_url, args.api_key, min(args.timeout_s, 30.0))
        model = args.model or card["id"]
        vocab_size = args.vocab_size or card.get("vocab_size") or DEFAULT_HTTP_VOCAB_SIZE
        max_model_len = card.get("max_model_len") or DEFAULT_HTTP_MAX_MODEL_LEN
    else:
        from pagedrun.server.client import Client

        endpoint = endpoint_from_args(args)
        with Client(endpoint, timeout_s=min(args.timeout_s, 30.0)) as c:
            info = c.model_info()
        model = info.get("model")
        vocab_size = args.vocab_size or int(info["vocab_size"])
        max_model_len = int(info["max_model_len"])
    work = make_workload(args.num_prompts, input_mix, output_mix, int(vocab_size),
                         int(max_model_len), args.seed)
    if args.backend == "openai":
        records, duration_s = asyncio.run(_openai_load(work, args, model))
    else:
        records, duration_s = asyncio.run(_zmq_load(endpoint, work, args))
    report = summarize(records, duration_s, args)
    report["model"] = model
    report["backend"] = args.backend
    print(json.dumps(report, indent=2) if args.json else format_table(report))
    return 0 if report["failed"] == 0 else 1
