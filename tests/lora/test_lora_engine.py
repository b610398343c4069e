"""The engine serving adapters: greedy tokens with an adapter equal the dense reference over
the merged weights (W + scale * B @ A), for batches mixing several adapters and the base model,
under chunked prefill, preemption, n > 1 and more adapters than device slots; adapter requests
wait (never fail) for a slot; the prefix cache never shares blocks across adapters; adapters
cannot be removed while requests use them; every block returns to the pool.

Tiny random models (tests/engine/engine_helpers.py) on the numpy and sim backends, random PEFT
adapters written per session (lora_helpers.py)."""
from __future__ import annotations

import numpy as np
import pytest

from engine_helpers import ENGINE_BACKENDS, EngineModel, greedy, make_engine, random_weights, \
    run_requests, tiny_config
from lora_helpers import merged_greedy, write_peft_adapter

from pagedrun.runtime.errors import ERR_INVALID, RequestError
from pagedrun.runtime.lora import LoRARequest
from pagedrun.runtime.lora.errors import LoRAInUseError
from pagedrun.runtime.sampling_params import SamplingParams

VOCAB = 384


@pytest.fixture(scope="module", params=["cpu", "sim"])
def lora_setup(request, tmp_path_factory):
    """(model, [three LoRARequests]): rank 8 on every projection, rank 16 on q/v/down with
    rsLoRA, rank 4 on the MLP only."""
    spec = ENGINE_BACKENDS[request.param]
    config = tiny_config(**spec.model_overrides)
    model = EngineModel(config, random_weights(config, seed=3), spec)
    root = tmp_path_factory.mktemp(f"adapters-{request.param}")
    shapes = [dict(rank=8), dict(rank=16, targets=("q_proj", "v_proj", "down_proj"),
                                 use_rslora=True, alpha=8),
              dict(rank=4, targets=("gate_proj", "up_proj", "down_proj"))]
    loras = [LoRARequest(f"ad{i}", i + 1, str(write_peft_adapter(root / f"ad{i}", config,
                                                                   seed=10 + i, **kw)))
             for i, kw in enumerate(shapes)]
    return model, loras


def lora_engine(model, **kw):
    kw.setdefault("enable_lora", True)
    kw.setdefault("max_loras", 2)
    kw.setdefault("max_cpu_loras", 3)
    return make_engine(model, **kw)


def check_outputs(model, engine, requests, outputs):
    for _, request_id, kwargs in requests:
        out = outputs[request_id]
        params = kwargs["sampling_params"]
        want = merged_greedy(model, kwargs.get("lora_request"), kwargs["prompt_token_ids"],
                             params.max_tokens)
        assert out.finished and out.error is None, request_id
        assert len(out.outputs) == params.n
        for completion in out.outputs:
            assert completion.token_ids == want, request_id
    stats = engine.get_stats()
    assert stats["num_requests_running"] == stats["num_requests_waiting"] == 0
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


def mixed_requests(loras, seed: int, num: int = 10):
    rng = np.random.default_rng(seed)
    shared = rng.integers(3, VOCAB, 20).tolist()
    requests = []
    for i in range(num):
        lora = [None, *loras][i % (len(loras) + 1)]
        prompt = (shared if i % 3 == 0 else []) + rng.integers(
            3, VOCAB, int(rng.integers(1, 30))).tolist()
        max_tokens = int(rng.integers(2, 7))
        params = (SamplingParams(temperature=1.0, top_k=1, n=2, seed=i, max_tokens=max_tokens,
                                 ignore_eos=True) if i % 4 == 1 else greedy(max_tokens))
        kwargs = dict(prompt_token_ids=prompt, sampling_params=params)
        if lora is not None:
            kwargs["lora_request"] = lora
        requests.append((int(rng.integers(0, 4)), f"r{i}", kwargs))
    return requests


def test_mixed_adapters_match_merged_reference(lora_setup):
    """Base + three adapters over two slots, a 16-token budget (chunked prefill), n = 2 rows
    (top_k=1 makes every sample the argmax) and a pool small enough to preempt."""
    model, loras = lora_setup
    # On sim the steps without an adapter row replay decode graphs (runtime/decode_graphs.py).
    graphs = {"cuda_graph_sizes": (1, 2, 4)} if model.backend.name == "sim" else {}
    engine = lora_engine(model, block_size=16, num_kv_blocks=4, max_model_len=64,
                         max_num_batched_tokens=16, max_num_seqs=6, **graphs)
    # The sim backend runs every kernel on the CPU harness (~0.1 s a step): fewer requests.
    requests = mixed_requests(loras, seed=1, num=7 if model.backend.name == "cpu" else 5)
    check_outputs(model, engine, requests, run_requests(engine, requests))
    assert engine.get_stats()["num_preemptions_total"] > 0
    # The adapters matter: each changes some request's tokens from the base model's.
    for lora in loras:
        assert any(merged_greedy(model, lora, k["prompt_token_ids"], 6)
                   != merged_greedy(model, None, k["prompt_token_ids"], 6)
                   for _, _, k in requests)
    assert any(r.lora_int_id in engine.list_loras() for r in loras)
    if graphs:
        assert sum(engine.runner.decode_graphs.replays.values()) > 0


def drive(engine, requests):
    """Add every request now, step to the end; (outputs by id, (running, waiting) per step)."""
    from pagedrun.runtime.llm import _merge

    for _, request_id, kwargs in requests:
        engine.add_request(request_id, **kwargs)
    totals, counts = {}, []
    while engine.has_unfinished_requests():
        for delta in engine.step():
            totals[delta.request_id] = _merge(totals.get(delta.request_id), delta)
        stats = engine.get_stats()
        counts.append((stats["num_requests_running"], stats["num_requests_waiting"]))
    return totals, counts


def test_one_slot_second_adapter_waits(lora_setup):
    """max_loras=1: the second adapter's request waits (scheduler-visible) while the first
    adapter's runs, the base request runs alongside; then it runs, and both are right."""
    model, loras = lora_setup
    engine = lora_engine(model, max_loras=1, num_kv_blocks=64)
    rng = np.random.default_rng(2)
    requests = [(0, name, dict(prompt_token_ids=rng.integers(3, VOCAB, 9).tolist(),
                               sampling_params=greedy(n), **extra))
                for name, n, extra in (("a", 4, {"lora_request": loras[0]}),
                                       ("b", 3, {"lora_request": loras[1]}), ("base", 6, {}))]
    outputs, counts = drive(engine, requests)
    assert counts[0] == (2, 1)          # a and base run, b waits
    assert (1, 0) in counts             # after a finished, b runs next to base
    check_outputs(model, engine, requests, outputs)


def test_prefix_cache_isolated_per_adapter(lora_setup):
    """The same prompt under adapter A, then B, then the base model: no prefix hits across
    them; A again hits its own blocks. Tokens stay right throughout."""
    model, loras = lora_setup
    engine = lora_engine(model, block_size=16, num_kv_blocks=64)
    prompt = np.random.default_rng(3).integers(3, VOCAB, 33).tolist()
    hits = []
    for i, lora in enumerate((loras[0], loras[1], None, loras[0])):
        kwargs = dict(prompt_token_ids=prompt, sampling_params=greedy(3))
        if lora is not None:
            kwargs["lora_request"] = lora
        before = engine.get_stats()["prefix_cache_hits"]
        requests = [(0, f"p{i}", kwargs)]
        check_outputs(model, engine, requests, run_requests(engine, requests))
        hits.append(engine.get_stats()["prefix_cache_hits"] - before)
    assert hits == [0, 0, 0, 32]


def test_remove_refused_while_in_use(lora_setup):
    model, loras = lora_setup
    engine = lora_engine(model, max_loras=1, num_kv_blocks=64)
    engine.add_lora(loras[2])
    engine.add_request("a", prompt_token_ids=[5, 6, 7], sampling_params=greedy(3),
                       lora_request=loras[0])
    engine.add_request("w", prompt_token_ids=[5, 6, 8], sampling_params=greedy(2),
                       lora_request=loras[1])
    engine.step()
    for lora in loras[:2]:  # one running, one waiting: both in use
        with pytest.raises(LoRAInUseError, match=lora.lora_name):
            engine.remove_lora(lora.lora_int_id)
    assert engine.remove_lora(loras[2].lora_int_id) is True   # idle: removed
    assert engine.remove_lora(99) is False
    run_requests(engine, [])
    assert engine.remove_lora(loras[0].lora_int_id) is True
    assert engine.list_loras() == {loras[1].lora_int_id}
    info = engine.model_info()
    assert info["enable_lora"] and info["lora_adapters"] == [{"name": "ad1", "id": 2}]
    stats = engine.get_stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


def test_abort_releases_adapter(lora_setup):
    """Aborting the only request of an adapter frees its slot for a waiting adapter."""
    model, loras = lora_setup
    engine = lora_engine(model, max_loras=1, num_kv_blocks=64)
    engine.add_request("a", prompt_token_ids=[5, 6, 7], sampling_params=greedy(50),
                       lora_request=loras[0])
    engine.add_request("b", prompt_token_ids=[9, 8, 7], sampling_params=greedy(3),
                       lora_request=loras[1])
    engine.step()
    assert engine.abort_request("a")
    outputs = run_requests(engine, [])
    assert outputs["a"].outputs[0].finish_reason == "abort"
    assert outputs["b"].outputs[0].token_ids[-1:] == merged_greedy(
        model, loras[1], [9, 8, 7], 3)[-1:]
    stats = engine.get_stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


def test_refusals(lora_setup, tmp_path):
    model, loras = lora_setup
    plain = make_engine(model, num_kv_blocks=16)
    with pytest.raises(RequestError, match="LoRA is not enabled") as exc:
        plain.add_request("x", prompt_token_ids=[5], lora_request=loras[0])
    assert exc.value.code == ERR_INVALID
    engine = lora_engine(model, num_kv_blocks=16)
    with pytest.raises(RequestError, match="no such LoRA adapter directory"):
        engine.add_request("x", prompt_token_ids=[5],
                           lora_request=LoRARequest("gone", 7, str(tmp_path / "gone")))
    with pytest.raises(RequestError, match="lora_int_id 1"):  # id 1 is another adapter
        engine.add_request("y", prompt_token_ids=[5], lora_request=loras[0])
        engine.add_request("z", prompt_token_ids=[5],
                           lora_request=LoRARequest("other", 1, loras[1].lora_path))
    assert engine.list_loras() == {1}
    outputs = run_requests(engine, [])   # the engine goes on
    assert outputs["y"].finished and "z" not in outputs


def test_llm_generate_takes_one_adapter_per_prompt(lora_setup):
    from pagedrun.runtime.llm import LLM

    model, loras = lora_setup
    llm = LLM.from_engine(lora_engine(model, num_kv_blocks=64))
    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13]]
    per_prompt = [loras[0], None, loras[2]]
    outputs = llm.generate(prompts, greedy(4), lora_request=per_prompt)
    for prompt, lora, out in zip(prompts, per_prompt, outputs):
        assert out.outputs[0].token_ids == merged_greedy(model, lora, prompt, 4)
    every = llm.generate(prompts[:2], greedy(4), lora_request=loras[1])
    assert [o.outputs[0].token_ids for o in every] == [
        merged_greedy(model, loras[1], p, 4) for p in prompts[:2]]
    with pytest.raises(ValueError, match="2 prompts but 1 lora_requests"):
        llm.generate(prompts[:2], greedy(4), lora_request=[loras[0]])


def test_cpu_bf16_batched_equals_alone(lora_setup):
    """bf16 GEMMs (LoRA stays float32 numpy): a mixed, chunked batch gives each request the
    tokens it gets served alone on the same backend (the bf16 oracle of the engine tests)."""
    model, loras = lora_setup
    if model.backend.name != "cpu":
        pytest.skip("the bf16 cpu backend runs the cpu-shaped model")
    kw = dict(dtype="bfloat16", num_kv_blocks=64)
    requests = mixed_requests(loras, seed=4, num=5)
    batched = run_requests(lora_engine(model, max_num_batched_tokens=16, **kw), requests)
    for _, request_id, kwargs in requests:
        alone = run_requests(lora_engine(model, enable_prefix_caching=False, **kw),
                             [(0, "solo", kwargs)])["solo"]
        assert [c.token_ids for c in batched[request_id].outputs] == [
            c.token_ids for c in alone.outputs], request_id
