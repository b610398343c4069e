"""Load on loopback: 200 concurrent streaming clients (AsyncClient), a fifth abort mid-stream,
a tenth vanish without a word (socket closed). Every other request must complete with exactly
the tokens it gets alone, and afterwards the engine must report every KV block free."""
from __future__ import annotations

import asyncio
import random
import time
from collections import Counter

from fake_engine import FakeEngine, expected_tokens

from pagedrun.client import AsyncClient, Client

NUM_CLIENTS = 200
TEST_BUDGET_S = 60.0
# Requests that are cut short ask for this many tokens: at the fake engine's >= 2 ms a step,
# running out takes >= 6 s, so an abort or a vanished client that the server acts on at all
# promptly ends the request "abort" (at 400 tokens, a loaded 2-core box let a few run out
# before their ABORT was read).
LONG_MAX_TOKENS = 3000
MAX_MODEL_LEN = 4096
# Enough KV blocks for every request at its longest: the fake engine does not preempt.
NUM_KV_BLOCKS = 48 * (MAX_MODEL_LEN // 16)


async def _one(endpoint: str, i: int, role: str, rng: random.Random) -> tuple[str, object]:
    prompt = "".join(rng.choice("abcdefghij klmnop") for _ in range(rng.randint(1, 40)))
    # Requests that will be cut short are long, so the cut always lands mid-stream.
    max_tokens = rng.randint(5, 40) if role == "complete" else LONG_MAX_TOKENS
    client = AsyncClient(endpoint, timeout_s=30, heartbeat_s=1.0)
    try:
        stream = await client.stream(prompt, sampling_params={"max_tokens": max_tokens,
                                                              "temperature": 0.0})
        got = []
        stop_after = rng.randint(1, 3)
        async for delta in stream:
            got.extend(delta.token_ids)
            if role == "abort" and len(got) >= stop_after:
                await stream.aclose()
                return role, None
            if role == "vanish" and len(got) >= stop_after:
                return role, None  # finally: socket closed, no ABORT sent
        assert stream.result.finish_reason == "length"
        return role, (got, expected_tokens(list(prompt.encode()), max_tokens))
    finally:
        await client.close()


async def _run_all(endpoint: str) -> list:
    rng = random.Random(1234)
    roles = ["abort"] * (NUM_CLIENTS // 5) + ["vanish"] * (NUM_CLIENTS // 10)
    roles += ["complete"] * (NUM_CLIENTS - len(roles))
    rng.shuffle(roles)
    tasks = [_one(endpoint, i, role, random.Random(i)) for i, role in enumerate(roles)]
    return await asyncio.wait_for(asyncio.gather(*tasks), TEST_BUDGET_S)


def test_200_streaming_clients_with_aborts_and_vanishing(start_server):
    engine = FakeEngine(step_delay_s=0.002, max_num_seqs=48, num_kv_blocks=NUM_KV_BLOCKS,
                        max_model_len=MAX_MODEL_LEN)
    _, endpoint = start_server(engine, lease_s=5.0)
    results = asyncio.run(_run_all(endpoint))
    completed = [r for role, r in results if role == "complete"]
    assert len(completed) == NUM_CLIENTS - NUM_CLIENTS // 5 - NUM_CLIENTS // 10
    for got, want in completed:
        assert got == want
    # Aborted and vanished requests are released within a few steps: poll, bounded.
    with Client(endpoint, timeout_s=10) as c:
        deadline = time.monotonic() + 20
        while True:
            stats = c.stats()
            g = stats["gauges"]
            if g["server_requests_in_flight"] == 0 and \
                    g["num_free_blocks"] == g["num_total_blocks"] or time.monotonic() > deadline:
                break
            time.sleep(0.05)
    assert g["server_requests_in_flight"] == 0
    assert g["num_requests_running"] == 0 and g["num_requests_waiting"] == 0
    assert g["num_free_blocks"] == g["num_total_blocks"] == NUM_KV_BLOCKS
    assert g["kv_cache_usage_perc"] == 0
    counters = stats["counters"]
    assert counters["request_success_total"] == len(completed), counters
    assert counters["request_abort_total"] == NUM_CLIENTS // 5 + NUM_CLIENTS // 10
    # Every vanished client is noticed; an aborting client that closed its socket right after
    # its ABORT can be noticed as gone before the ABORT is read (a race, still aborted once).
    assert NUM_CLIENTS // 10 <= counters["clients_lost_total"] <= \
        NUM_CLIENTS // 10 + NUM_CLIENTS // 5
    # Cut short, not run out: every aborted and vanished request ended "abort", each of the
    # others "length" with its own max_tokens; the counters add up to what the engine made.
    reasons = Counter(reason for reason, _ in engine.finished.values())
    assert reasons == {"length": len(completed), "abort": NUM_CLIENTS // 5 + NUM_CLIENTS // 10}
    assert sum(n for _, n in engine.finished.values()) == counters["generation_tokens_total"]
    assert sum(n for reason, n in engine.finished.values() if reason == "length") == \
        sum(len(w) for _, w in completed)
