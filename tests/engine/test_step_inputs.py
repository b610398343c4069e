"""Once per step on the kernel backends: the step metadata is uploaded once (not once per
layer), and the logits reach the kernel sampler without a host round trip
(runtime/backends/step_inputs.py, ModelRunner's logits_on_device). Run on the sim backend,
whose code is the cuda backend's."""
from __future__ import annotations

import numpy as np

from engine_helpers import (greedy, make_engine, random_prompts, random_weights, run_requests,
                            tiny_config)
from pagedrun.runtime.sampling_params import SamplingParams


def _sim_model(num_layers: int):
    config = tiny_config(hidden_size=128, num_attention_heads=2, num_key_value_heads=1,
                         intermediate_size=160, num_hidden_layers=num_layers)
    return config, random_weights(config, seed=7)


def _int_uploads_per_step(num_layers: int, prompts) -> list[int]:
    """int32 arrays the sim backend places on its device, per engine step."""
    engine = make_engine(_sim_model(num_layers), device="sim", num_kv_blocks=48, block_size=16,
                         max_num_batched_tokens=40)
    backend = engine.backend
    place = backend.device
    counts = []

    def counting_device(host):
        if np.dtype(np.asarray(host).dtype).kind in "iu":
            counts[-1] += 1
        return place(host)

    backend.device = counting_device  # instance attribute: every op's upload goes through it
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", prompt_token_ids=p, sampling_params=greedy(4))
    while engine.has_unfinished_requests():
        counts.append(0)
        engine.step()
    return counts


def test_step_metadata_uploads_do_not_grow_with_layers():
    """Mixed decode + chunked-prefill steps: the same int32 uploads per step for 1 and 3 layers
    (per-layer uploads would add several per extra layer)."""
    rng = np.random.default_rng(3)
    prompts = random_prompts(rng, tiny_config().vocab_size, 3, 50)
    one, three = _int_uploads_per_step(1, prompts), _int_uploads_per_step(3, prompts)
    assert len(one) == len(three) and len(one) > 2
    assert one == three
    assert max(one) > 0  # the counter sees the uploads at all


def test_sim_logits_reach_the_kernel_sampler_without_host_copies():
    """No to_host on the sampling path (prompt logprobs still come to the host)."""
    model = _sim_model(2)
    engine = make_engine(model, device="sim", num_kv_blocks=48, block_size=16)
    assert engine.runner.logits_on_device
    calls = []
    to_host = engine.backend.to_host
    engine.backend.to_host = lambda x: calls.append(x.shape) or to_host(x)
    seen = []
    sample = engine.sampler.sample

    def recording_sample(logits, *args, **kwargs):
        seen.append(logits)
        return sample(logits, *args, **kwargs)

    engine.sampler.sample = recording_sample
    rng = np.random.default_rng(4)
    prompts = random_prompts(rng, model[0].vocab_size, 2, 30)
    outs = run_requests(engine, [
        (0, "greedy", dict(prompt_token_ids=prompts[0], sampling_params=greedy(5))),
        (0, "n2", dict(prompt_token_ids=prompts[1], sampling_params=SamplingParams(
            n=2, temperature=0.8, max_tokens=5, ignore_eos=True, seed=1, logprobs=2)))])
    assert calls == []
    assert seen and all(isinstance(x, np.ndarray) and x.dtype == np.float32 for x in seen)
    assert len(outs["n2"].outputs) == 2
    assert all(len(o.logprobs) == 5 for o in outs["n2"].outputs)
    # Prompt logprobs are host work: those rows still come back.
    engine.add_request("p", prompt_token_ids=prompts[0],
                       sampling_params=greedy(2, prompt_logprobs=1))
    while engine.has_unfinished_requests():
        engine.step()
    assert calls


def test_sim_greedy_tokens_equal_cpu():
    """The once-per-step inputs give the numpy backend's tokens (decode + prefill mixes)."""
    model = _sim_model(2)
    rng = np.random.default_rng(9)
    prompts = random_prompts(rng, model[0].vocab_size, 4, 45)
    got = {}
    for dev in ("cpu", "sim"):
        engine = make_engine(model, device=dev, num_kv_blocks=48, block_size=16,
                             max_num_batched_tokens=40)
        outs = run_requests(engine, [(i, f"r{i}", dict(prompt_token_ids=p,
                                                       sampling_params=greedy(6)))
                                     for i, p in enumerate(prompts)])
        got[dev] = {k: v.outputs[0].token_ids for k, v in outs.items()}
    assert got["sim"] == got["cpu"]
