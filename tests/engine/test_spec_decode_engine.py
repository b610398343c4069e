"""Speculative decoding through the engine (issue 17): runtime/spec_decode/speculator.py, the
scheduler's draft rows and the engine's verify / append path.

The oracle is greedy decoding without speculation (the dense reference's tokens, or the same
backend serving each request alone where bf16 rounding rules the reference out): verification
must never change a greedy token, however many drafts are accepted or rejected. A scripted
proposer makes both happen on purpose: it knows each prompt's true continuation and proposes
its next tokens, right for a random number of them and wrong after that (or all right, or all
wrong), so acceptance, rejection at every position, bonus tokens and block trimming all occur
in one run; the real n-gram proposer runs on repetitive prompts. The rejection sampler's
distribution is tested in test_rejection_sampler.py (chi-square, planted bugs).
"""
from __future__ import annotations

import logging

import numpy as np
import pytest

from engine_helpers import (PieceTokenizer, backend_of, greedy, make_engine, random_prompts,
                            reference_greedy, run_requests)
from pagedrun.runtime.sampling_params import SamplingParams
from pagedrun.runtime.spec_decode import speculator as speculator_module

K = 4
# disable_by_batch_size above any batch here: the cpu backends' default (4) would turn
# speculation off in the mixes these tests exist to check.
NGRAM = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": 3,
         "prompt_lookup_min": 1, "disable_by_batch_size": 64}


class ScriptedProposer:
    """Proposes a request's true continuation: `mode` "right" (every token), "wrong" (the first
    token already differs) or "mixed" (a random number right, then wrong); or a dict of one
    mode per prompt (tuple)."""

    def __init__(self, continuations: dict[tuple, list[int]], vocab: int, mode,
                 seed: int = 0) -> None:
        self.continuations = continuations
        self.vocab = vocab
        self.mode = mode
        self.rng = np.random.default_rng(seed)
        self.num_calls = 0
        self.max_k = K

    def _continuation(self, tokens: list[int]) -> tuple[list[int], int]:
        for prompt, cont in self.continuations.items():
            n = len(prompt)
            if tuple(tokens[:n]) == prompt and tokens[n:] == cont[:len(tokens) - n]:
                return cont, len(tokens) - n
        return [], -1  # the output left the reference: the test's comparison reports it

    def propose(self, token_ids, max_num_tokens):
        self.num_calls += 1
        out = []
        for tokens, cap in zip(token_ids, max_num_tokens):
            cont, pos = self._continuation([int(t) for t in tokens])
            if pos < 0:
                out.append(np.zeros(0, dtype=np.int32))
                continue
            mode = self.mode
            if isinstance(mode, dict):
                mode = next(m for p, m in mode.items() if tuple(tokens[:len(p)]) == p)
            k = int(self.rng.integers(1, self.max_k + 1))
            k = min(k, int(cap))
            right = {"right": k, "wrong": 0}.get(mode, int(self.rng.integers(0, k + 1)))
            draft = list(cont[pos:pos + right])
            while len(draft) < k:
                token = int(self.rng.integers(3, self.vocab))
                if len(draft) == right and token == cont[pos + right]:
                    continue  # the first wrong token must be wrong
                draft.append(token)
            out.append(np.array(draft, dtype=np.int32))
        return out


def script(engine, prompts: list[list[int]], max_tokens: int, model, mode,
           seed: int = 0) -> ScriptedProposer:
    continuations = {tuple(p): reference_greedy(model, p, max_tokens) for p in prompts}
    proposer = ScriptedProposer(continuations, model[0].vocab_size, mode, seed)
    engine.speculator.proposer = proposer
    return proposer


def run_greedy_checked(engine, model, prompts: list[list[int]], max_tokens: int,
                       arrivals=None) -> None:
    """Serve every prompt greedily (prompt i arriving at step arrivals[i], default 0) and
    check each completion against the reference's tokens."""
    arrivals = arrivals or [0] * len(prompts)
    totals = run_requests(engine, [(arrivals[i], f"p{i}", {"prompt_token_ids": p,
                                                           "sampling_params": greedy(max_tokens)})
                                   for i, p in enumerate(prompts)])
    for i, prompt in enumerate(prompts):
        assert totals[f"p{i}"].outputs[0].token_ids == reference_greedy(model, prompt,
                                                                        max_tokens), f"p{i}"


def assert_all_blocks_free(engine) -> None:
    stats = engine.get_stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    engine.schedulers[0].check_invariants()


def test_greedy_mix_equals_plain_greedy(tiny_model):
    """Random arrivals, chunked prefill (small budget: drafts get cut), preemption (small pool),
    shared prefixes (prefix hits), n = 2 and aborts, with drafts right and wrong at random:
    every completion equals greedy decoding without speculation and no block leaks."""
    rng = np.random.default_rng(17)
    max_tokens = 16
    shared = rng.integers(3, 300, 20).tolist()
    prompts = random_prompts(rng, 300, 8, 40, shared_prefix=shared)
    # On sim the steps without drafts replay decode graphs (runtime/decode_graphs.py); the
    # verifying steps run eagerly.
    graphs = {"cuda_graph_sizes": (1, 2, 4)} if backend_of(tiny_model).name == "sim" else {}
    engine = make_engine(tiny_model, block_size=16, num_kv_blocks=6,
                         max_num_batched_tokens=32, max_num_seqs=6,
                         speculative_config=NGRAM, **graphs)
    script(engine, prompts, max_tokens, tiny_model, "mixed", seed=3)
    requests = []
    for i, prompt in enumerate(prompts):
        # n = 2 needs sampling: a temperature this low draws the argmax (the tiny model's
        # logits are spread far apart), so both completions are the greedy one -- on the
        # exact backends: bf16 logits have near-ties where it draws another token, with or
        # without speculation.
        params = (SamplingParams(temperature=0.01, n=2, seed=i, max_tokens=max_tokens,
                                 ignore_eos=True)
                  if i % 4 == 1 and backend_of(tiny_model).exact_reference
                  else greedy(max_tokens))
        requests.append((int(rng.integers(0, 5)), f"r{i}",
                         {"prompt_token_ids": prompt, "sampling_params": params}))
    aborted = {"r3", "r6"}
    totals = {}
    from pagedrun.runtime.llm import _merge

    pending = sorted(requests, key=lambda r: r[0])
    step = 0
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][0] <= step:
            _, request_id, kwargs = pending.pop(0)
            engine.add_request(request_id, **kwargs)
        if step in (7, 12):
            engine.abort_request(sorted(aborted)[step == 12])
        for delta in engine.step():
            totals[delta.request_id] = _merge(totals.get(delta.request_id), delta)
        step += 1
        assert step < 2000
    for i, prompt in enumerate(prompts):
        if f"r{i}" in aborted:
            continue
        expected = reference_greedy(tiny_model, prompt, max_tokens)
        for completion in totals[f"r{i}"].outputs:
            assert completion.token_ids == expected, f"request r{i} completion {completion.index}"
    stats = engine.get_stats()
    assert stats["num_preemptions_total"] > 0
    assert stats["prefix_cache_hits"] > 0
    assert 0 < stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"]
    assert_all_blocks_free(engine)
    if graphs:
        assert sum(engine.runner.decode_graphs.replays.values()) > 0


def test_ngram_proposer_on_repetitive_prompts(tiny_cpu_model):
    """The real n-gram proposer: prompts that repeat a phrase (so lookups match) and a greedy
    random model (whose outputs fall into loops): tokens equal the reference, drafts accepted."""
    rng = np.random.default_rng(5)
    prompts = []
    for length in (3, 5, 7):
        phrase = rng.integers(3, 300, length).tolist()
        prompts.append((phrase * 6)[:2 + 5 * length])
    max_tokens = 40
    engine = make_engine(tiny_cpu_model, speculative_config=NGRAM)
    run_greedy_checked(engine, tiny_cpu_model, prompts, max_tokens)
    stats = engine.get_stats()
    assert stats["spec_decode_num_accepted_tokens"] > 0
    assert_all_blocks_free(engine)


def test_all_right_drafts_take_fewer_steps(tiny_cpu_model):
    """Drafts that are all right are all accepted (plus a bonus token each step): K + 1 tokens
    per step, so the request needs about 1/(K + 1) of the steps, with the same tokens."""
    prompt = list(range(10, 30))
    max_tokens = 31
    engine = make_engine(tiny_cpu_model, speculative_config=NGRAM)
    proposer = script(engine, [prompt], max_tokens, tiny_cpu_model, "right")
    proposer.rng = np.random.default_rng(0)
    proposer_k = K
    engine.speculator.proposer.propose = _fixed_k(proposer, proposer_k)
    engine.add_request("a", prompt_token_ids=prompt, sampling_params=greedy(max_tokens))
    tokens, steps = [], 0
    while engine.has_unfinished_requests():
        for delta in engine.step():
            tokens += delta.outputs[0].token_ids
        steps += 1
    assert tokens == reference_greedy(tiny_cpu_model, prompt, max_tokens)
    # 1 prefill step (first token), then K + 1 tokens per step; the last step's drafts are cut
    # to what max_tokens leaves.
    assert steps == 1 + -(-(max_tokens - 1) // (K + 1))
    stats = engine.get_stats()
    assert stats["spec_decode_num_accepted_tokens"] == stats["spec_decode_num_draft_tokens"]
    assert_all_blocks_free(engine)


def _fixed_k(proposer: ScriptedProposer, k: int):
    """proposer.propose with every proposal of exactly min(k, cap) right tokens."""
    def propose(token_ids, max_num_tokens):
        out = []
        for tokens, cap in zip(token_ids, max_num_tokens):
            cont, pos = proposer._continuation([int(t) for t in tokens])
            out.append(np.array(cont[pos:pos + min(k, int(cap))] if pos >= 0 else [],
                                dtype=np.int32))
        return out
    return propose


def test_stops_inside_accepted_drafts_are_not_overshot(tiny_cpu_model):
    """A stop token id, a stop string and max_tokens that fall inside a step's accepted drafts
    end the output exactly where decoding without speculation ends it (same tokens, text,
    finish and stop reasons)."""
    tokenizer = PieceTokenizer(seed=2)
    prompt = list(range(40, 60))
    cont = reference_greedy(tiny_cpu_model, prompt, 30)
    stop_text = tokenizer.decode(cont[7:9])
    cases = {
        "stop_id": SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=[cont[6]]),
        "stop_str": SamplingParams(temperature=0.0, max_tokens=30, stop=[stop_text]),
        "stop_str_kept": SamplingParams(temperature=0.0, max_tokens=30, stop=[stop_text],
                                        include_stop_str_in_output=True),
        "max_tokens": SamplingParams(temperature=0.0, max_tokens=7),
        "min_tokens": SamplingParams(temperature=0.0, max_tokens=30, min_tokens=9,
                                     stop_token_ids=[cont[2], cont[11]]),
    }
    outputs = {}
    for spec in (False, True):
        engine = make_engine(tiny_cpu_model, tokenizer=tokenizer,
                             speculative_config=NGRAM if spec else None)
        if spec:
            proposer = script(engine, [prompt], 30, tiny_cpu_model, "right")
            engine.speculator.proposer.propose = _fixed_k(proposer, K)
        totals = run_requests(engine, [(0, name, {"prompt_token_ids": prompt,
                                                  "sampling_params": params})
                                       for name, params in cases.items()])
        outputs[spec] = {name: totals[name].outputs[0] for name in cases}
        assert_all_blocks_free(engine)
    for name in cases:
        plain, spec = outputs[False][name], outputs[True][name]
        assert (spec.token_ids, spec.text, spec.finish_reason, spec.stop_reason) == (
            plain.token_ids, plain.text, plain.finish_reason, plain.stop_reason), name
    assert outputs[True]["stop_id"].finish_reason == "stop"


def test_prefix_cache_holds_only_verified_tokens(tiny_cpu_model):
    """Every draft rejected: the rejected positions' KV was written into the blocks. A later
    request whose prompt is the first one's prompt + output hits the prefix cache, and its
    tokens still equal the reference: no cached block held a rejected draft's KV."""
    rng = np.random.default_rng(9)
    prompt = rng.integers(3, 300, 21).tolist()
    engine = make_engine(tiny_cpu_model, block_size=16, speculative_config=NGRAM)
    script(engine, [prompt], 27, tiny_cpu_model, "wrong", seed=1)
    first = run_requests(engine, [(0, "a", {"prompt_token_ids": prompt,
                                            "sampling_params": greedy(27)})])
    follow = prompt + first["a"].outputs[0].token_ids
    script(engine, [follow], 12, tiny_cpu_model, "mixed", seed=2)
    second = run_requests(engine, [(0, "b", {"prompt_token_ids": follow,
                                             "sampling_params": greedy(12)})])
    assert second["b"].usage.cached_prompt_tokens >= 32
    assert second["b"].outputs[0].token_ids == reference_greedy(tiny_cpu_model, follow, 12)
    assert engine.get_stats()["spec_decode_num_accepted_tokens"] < engine.get_stats()[
        "spec_decode_num_draft_tokens"]
    assert_all_blocks_free(engine)


def test_logprobs_are_the_targets(tiny_cpu_model):
    """Logprobs of tokens that came from accepted drafts equal those of plain decoding."""
    prompt = list(range(100, 117))
    params = SamplingParams(temperature=0.0, max_tokens=14, logprobs=3)
    results = {}
    for spec in (False, True):
        engine = make_engine(tiny_cpu_model, speculative_config=NGRAM if spec else None)
        if spec:
            proposer = script(engine, [prompt], 14, tiny_cpu_model, "mixed", seed=4)
            del proposer
        totals = run_requests(engine, [(0, "a", {"prompt_token_ids": prompt,
                                                 "sampling_params": params})])
        results[spec] = totals["a"].outputs[0]
    plain, spec = results[False], results[True]
    assert spec.token_ids == plain.token_ids
    assert spec.cumulative_logprob == pytest.approx(plain.cumulative_logprob, abs=1e-3)
    for a, b in zip(plain.logprobs, spec.logprobs):
        assert list(a) == list(b)  # the same tokens, sampled first, then the top 3
        for token in a:
            assert b[token].logprob == pytest.approx(a[token].logprob, abs=1e-4)
            assert b[token].rank == a[token].rank


def test_seeded_sampling_is_reproducible(tiny_cpu_model):
    """Sampled requests with filters and penalties run through verification; the same seeds
    give the same tokens run after run."""
    prompts = [list(range(5, 25)), list(range(60, 71))]
    params = [SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=11, max_tokens=20),
              SamplingParams(temperature=1.2, min_p=0.05, repetition_penalty=1.3, seed=12,
                             max_tokens=20)]
    runs = []
    for _ in range(2):
        engine = make_engine(tiny_cpu_model, speculative_config=NGRAM)
        continuations = {tuple(p): reference_greedy(tiny_cpu_model, p, 20) for p in prompts}
        engine.speculator.proposer = _HistoryProposer(continuations)
        totals = run_requests(engine, [(0, f"s{i}", {"prompt_token_ids": p,
                                                     "sampling_params": params[i]})
                                       for i, p in enumerate(prompts)])
        runs.append([totals[f"s{i}"].outputs[0].token_ids for i in range(2)])
        assert engine.get_stats()["spec_decode_num_draft_tokens"] > 0
        assert_all_blocks_free(engine)
    assert runs[0] == runs[1]
    assert all(len(tokens) == 20 for tokens in runs[0])


class _HistoryProposer:
    """Proposes the request's own last tokens again (a deterministic guess for sampled runs,
    whose continuations no reference knows)."""

    def __init__(self, continuations) -> None:
        del continuations

    def propose(self, token_ids, max_num_tokens):
        return [np.asarray(t[-min(K, int(cap)):] if cap > 0 else t[:0], dtype=np.int32)
                for t, cap in zip(token_ids, max_num_tokens)]


def test_policy_batch_size_and_low_acceptance(tiny_cpu_model, caplog):
    """disable_by_batch_size: no drafts while that many decodes run; a proposer that is
    always wrong pauses a sequence's speculation after MIN_STEPS_BEFORE_PAUSE verified steps
    (logged) while another sequence whose drafts are right keeps speculating."""
    prompts = [list(range(10 + i, 30 + i)) for i in range(3)]
    engine = make_engine(tiny_cpu_model, speculative_config={**NGRAM,
                                                            "disable_by_batch_size": 3})
    script(engine, prompts, 10, tiny_cpu_model, "right")
    run_requests(engine, [(0, f"b{i}", {"prompt_token_ids": p, "sampling_params": greedy(10)})
                          for i, p in enumerate(prompts)])
    assert engine.get_stats()["spec_decode_num_draft_tokens"] == 0
    # Unset, the cpu backend's default applies (4 decodes: off; 3: on).
    unset = {k: v for k, v in NGRAM.items() if k != "disable_by_batch_size"}
    drafted = []
    for num in (4, 3):
        more = [list(range(40 + i, 60 + i)) for i in range(num)]
        engine = make_engine(tiny_cpu_model, speculative_config=unset)
        script(engine, more, 10, tiny_cpu_model, "right")
        run_requests(engine, [(0, f"c{i}", {"prompt_token_ids": p,
                                            "sampling_params": greedy(10)})
                              for i, p in enumerate(more)])
        drafted.append(engine.get_stats()["spec_decode_num_draft_tokens"])
    assert drafted[0] == 0 < drafted[1]

    caplog.set_level(logging.INFO, logger="pagedrun.engine")
    engine = make_engine(tiny_cpu_model, speculative_config=NGRAM)
    proposer = script(engine, prompts[:2], 60, tiny_cpu_model,
                      {tuple(prompts[0]): "wrong", tuple(prompts[1]): "right"})
    proposer.max_k = 1  # one draft per step: right or wrong
    totals = run_requests(engine, [(0, "w", {"prompt_token_ids": prompts[0],
                                             "sampling_params": greedy(60)}),
                                   (0, "r", {"prompt_token_ids": prompts[1],
                                             "sampling_params": greedy(60)})])
    for name, prompt in (("w", prompts[0]), ("r", prompts[1])):
        assert totals[name].outputs[0].token_ids == reference_greedy(tiny_cpu_model, prompt, 60)
    stats = engine.get_stats()
    # The right one: a draft every step, all accepted (59 tokens after the first, 2 a step);
    # the wrong one: MIN_STEPS_BEFORE_PAUSE rejected drafts, then paused for the rest.
    assert stats["spec_decode_num_accepted_tokens"] == 59 // 2
    assert stats["spec_decode_num_drafts"] == (speculator_module.MIN_STEPS_BEFORE_PAUSE
                                              + 59 // 2)
    assert any("speculative decoding paused for sequence" in r.getMessage()
               for r in caplog.records)


DRAFT = {"method": "draft_model", "model": "in-memory", "num_speculative_tokens": K,
         "disable_by_batch_size": 64}


def draft_engine(model, draft, **config):
    """An engine over the tiny model whose speculative draft is `draft` ((config, weights))."""
    from pagedrun.runtime.engine import LLMEngine
    from pagedrun.runtime.engine_config import EngineConfig

    config.setdefault("device", "cpu")
    config.setdefault("check_invariants", True)
    return LLMEngine(EngineConfig(speculative_config=DRAFT, **config), model_config=model[0],
                     weights=model[1], draft_model=draft)


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_draft_model_equal_to_target_accepts_every_draft(tiny_cpu_model, preemption_mode):
    """The target as its own draft: every draft is accepted, so the draft's KV (indexed by the
    target's block tables) was right at every position through chunked prefill, prefix hits,
    preemption (recompute or swap) and copy-on-write -- a stale or missing draft KV entry
    would make the draft guess differently from the target."""
    rng = np.random.default_rng(23)
    max_tokens = 20
    shared = rng.integers(3, 300, 20).tolist()
    prompts = random_prompts(rng, 300, 6, 36, shared_prefix=shared)
    engine = draft_engine(tiny_cpu_model, tiny_cpu_model, block_size=16, num_kv_blocks=6,
                          max_num_batched_tokens=24, max_num_seqs=4,
                          preemption_mode=preemption_mode, swap_space_bytes=1 << 22)
    run_greedy_checked(engine, tiny_cpu_model, prompts, max_tokens,
                       arrivals=[i // 2 for i in range(len(prompts))])
    stats = engine.get_stats()
    assert stats["num_preemptions_total"] > 0 and stats["prefix_cache_hits"] > 0
    assert stats["spec_decode_num_draft_tokens"] > 0
    assert stats["spec_decode_num_accepted_tokens"] == stats["spec_decode_num_draft_tokens"]
    assert_all_blocks_free(engine)


def test_small_random_draft_model(tiny_cpu_model):
    """A different, one-layer random draft: greedy tokens equal the reference, sampled seeded
    requests run through q-weighted verification reproducibly, every block is freed, and a
    block costs both models' KV bytes."""
    from engine_helpers import random_weights, tiny_config

    draft_config = tiny_config(num_hidden_layers=1, num_attention_heads=2,
                               num_key_value_heads=1)
    draft = (draft_config, random_weights(draft_config, seed=7))
    prompts = [list(range(10, 30)), list(range(50, 57))]
    requests = [(0, "g", {"prompt_token_ids": prompts[0], "sampling_params": greedy(24)}),
                (1, "s", {"prompt_token_ids": prompts[1],
                          "sampling_params": SamplingParams(temperature=0.9, top_p=0.8,
                                                            seed=5, max_tokens=24,
                                                            ignore_eos=True)})]
    runs = []
    for _ in range(2):
        engine = draft_engine(tiny_cpu_model, draft)
        totals = run_requests(engine, requests)
        assert totals["g"].outputs[0].token_ids == reference_greedy(tiny_cpu_model, prompts[0],
                                                                    24)
        runs.append(totals["s"].outputs[0].token_ids)
        stats = engine.get_stats()
        assert stats["spec_decode_num_draft_tokens"] > stats["spec_decode_num_accepted_tokens"]
        assert_all_blocks_free(engine)
    assert runs[0] == runs[1] and len(runs[0]) == 24
    assert engine.bytes_per_block == (engine.runner.kv_bytes_per_block()
                                      + engine.draft_runner.kv_bytes_per_block())


def test_draft_model_refusals(tiny_cpu_model):
    from pagedrun.runtime.errors import PagedRunError
    from engine_helpers import random_weights, tiny_config

    other = tiny_config(vocab_size=200)
    with pytest.raises(PagedRunError, match="vocabulary"):
        draft_engine(tiny_cpu_model, (other, random_weights(other)))
    with pytest.raises(PagedRunError, match="no such model"):
        make_engine(tiny_cpu_model, speculative_config={**DRAFT, "model": "/nonexistent"})


def test_sim_verification_kernel_equals_numpy():
    """On the sim backend verification runs cuda/rejection_sample.cu: every step's result,
    sampled rows with filters included, equals the numpy reference on the same inputs."""
    from engine_helpers import ENGINE_BACKENDS, EngineModel, random_weights, tiny_config
    from pagedrun.runtime.spec_decode.rejection_sampler import rejection_sample

    backend = ENGINE_BACKENDS["sim"]
    config = tiny_config(**backend.model_overrides)
    model = EngineModel(config, random_weights(config), backend)
    engine = make_engine(model, speculative_config=NGRAM)
    kernel = engine.speculator.rejection_kernel
    assert kernel is not None
    calls = []

    def checked(*args):
        got = kernel(*args)
        want = rejection_sample(*args)
        np.testing.assert_array_equal(got.token_ids, want.token_ids)
        np.testing.assert_array_equal(got.num_emitted, want.num_emitted)
        calls.append(int(np.sum(want.num_emitted)))
        return got

    engine.speculator.rejection_kernel = checked
    engine.speculator.proposer = _HistoryProposer(None)
    prompts = [list(range(5, 25)), list(range(60, 71)), list(range(80, 90))]
    params = [SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=11, max_tokens=12),
              SamplingParams(temperature=1.2, min_p=0.05, seed=12, max_tokens=12),
              greedy(12)]
    run_requests(engine, [(0, f"s{i}", {"prompt_token_ids": p, "sampling_params": params[i]})
                          for i, p in enumerate(prompts)])
    assert len(calls) >= 3
    assert_all_blocks_free(engine)
