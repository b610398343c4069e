#!/usr/bin/env python3
"""End-to-end decode throughput of a Llama-3-8B-shaped random bf16 model on the kernel backend.

    python benchmarks/kernels/bench_model.py --device cuda                 # 32 layers, bf16
    python benchmarks/kernels/bench_model.py --device cuda --layers 8      # shorter build
    python benchmarks/kernels/bench_model.py --device sim                  # toy model, harness

For each concurrency (1, 32, 256 on a GPU) the engine gets that many requests at once, each a
random PROMPT_TOKENS-token prompt generating GEN_TOKENS tokens (ignore_eos, greedy), and the
table reports generated tokens/s over the wall time of the whole run (prefill included: the
engine's real step loop, scheduler and sampler in the timing), and the time per output token.
The weights are random (hidden 4096, 32/8 heads of 128, intermediate 14336, vocab 128256);
they are built on the host in float32 one matrix at a time and placed by the backend in bf16.
On the CPU harness the same script runs a 2-layer toy model (head_dim 64) at concurrency 1 and
4, so it cannot rot; its times measure the harness.

Decode graphs (runtime/decode_graphs.py) and asynchronous scheduling
(runtime/engine/async_stepper.py): `--graphs both` (the default) runs each concurrency eagerly,
with the captured graphs, then with the graphs and asynchronous scheduling, on the same engine
(graphs and the async stepper are set aside for the passes without them); `on` / `off` /
`async` one of them. On cuda the engine captures its default sizes (1, 2, 4, 8, ... up to 256
here), on the harness SIM_GRAPH_SIZES.

It is also the only benchmark that launches the small fused kernels, which have none of their
own (docs/kernels.md, "The four siblings"): rms_norm.cu, activation.cu, embedding.cu,
rotary_cache_write.cu and sampling.cu's sample_f32 (greedy rows); it sets no penalties, so
process_logits_f32 does not run, and it moves no KV blocks, so block_copy.cu does not either.
"""
from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from pagedrun.runtime.engine import LLMEngine
from pagedrun.runtime.engine_config import EngineConfig
from pagedrun.runtime.model_config import ModelConfig
from pagedrun.runtime.sampling_params import SamplingParams
from pagedrun.runtime.weights import LayerWeights, ModelWeights

LLAMA3_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                 num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8)
TOY = dict(vocab_size=512, hidden_size=128, intermediate_size=192, num_hidden_layers=2,
           num_attention_heads=2, num_key_value_heads=1)
GPU_CONCURRENCY = (1, 32, 256)
SIM_CONCURRENCY = (1, 4)
SIM_GRAPH_SIZES = (1, 4)
PROMPT_TOKENS = {"cuda": 128, "sim": 12}
GEN_TOKENS = {"cuda": 128, "sim": 4}


def model_config(shape: dict, layers: int | None) -> ModelConfig:
    data = {"architectures": ["LlamaForCausalLM"], "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
            "max_position_embeddings": 8192, "tie_word_embeddings": False, "eos_token_id": 2,
            "bos_token_id": 1, **shape}
    if layers:
        data["num_hidden_layers"] = layers
    return ModelConfig.from_dict(data)


def random_weights(config: ModelConfig, seed: int = 0) -> ModelWeights:
    rng = np.random.default_rng(seed)
    hidden, inter = config.hidden_size, config.intermediate_size

    def mat(rows: int, cols: int) -> np.ndarray:
        out = rng.standard_normal((rows, cols), dtype=np.float32)
        out *= np.float32(1.0 / np.sqrt(cols))
        return out

    def ones() -> np.ndarray:
        return np.ones(hidden, np.float32)

    layers = [LayerWeights(input_layernorm=ones(), q_proj=mat(config.q_size, hidden),
                           k_proj=mat(config.kv_size, hidden), v_proj=mat(config.kv_size, hidden),
                           o_proj=mat(hidden, config.q_size), q_bias=None, k_bias=None,
                           v_bias=None, o_bias=None, post_attention_layernorm=ones(),
                           gate_proj=mat(inter, hidden), up_proj=mat(inter, hidden),
                           down_proj=mat(hidden, inter))
              for _ in range(config.num_hidden_layers)]
    return ModelWeights(config=config, embed_tokens=mat(config.vocab_size, hidden), layers=layers,
                        norm=ones(), lm_head=mat(config.vocab_size, hidden))


def run(engine: LLMEngine, concurrency: int, prompt_tokens: int, gen_tokens: int,
        rng) -> tuple[float, int]:
    params = SamplingParams(temperature=0.0, max_tokens=gen_tokens, ignore_eos=True)
    for i in range(concurrency):
        prompt = rng.integers(3, engine.model_config.vocab_size, prompt_tokens).tolist()
        engine.add_request(f"c{concurrency}-{i}", prompt_token_ids=prompt, sampling_params=params)
    start = time.perf_counter()
    generated = 0
    while engine.has_unfinished_requests():
        for delta in engine.step():
            generated += sum(len(c.token_ids) for c in delta.outputs)
    return time.perf_counter() - start, generated


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cuda", "sim"), default="cuda")
    ap.add_argument("--layers", type=int, default=None, help="override the layer count")
    ap.add_argument("--graphs", choices=("both", "on", "off", "async"), default="both",
                    help="eager, graphs, graphs + async scheduling per concurrency (both), or "
                         "one of them")
    args = ap.parse_args(argv)
    gpu = args.device == "cuda"
    config = model_config(LLAMA3_8B if gpu else TOY, args.layers)
    concurrency = GPU_CONCURRENCY if gpu else SIM_CONCURRENCY
    prompt_tokens, gen_tokens = PROMPT_TOKENS[args.device], GEN_TOKENS[args.device]
    built = time.perf_counter()
    weights = random_weights(config)
    engine = LLMEngine(EngineConfig(
        device=args.device, dtype="bfloat16", max_num_seqs=max(concurrency),
        max_num_batched_tokens=max(2048, prompt_tokens), max_model_len=prompt_tokens + gen_tokens,
        num_kv_blocks=None if gpu else 64, enable_prefix_caching=False,
        enforce_eager=args.graphs == "off", cuda_graph_sizes=None if gpu else SIM_GRAPH_SIZES,
        async_scheduling=args.graphs in ("both", "async")),
        model_config=config, weights=weights)
    del weights
    info = engine.model_info()
    graphs = engine.runner.decode_graphs
    # The engine's stepper (AsyncStepper when async scheduling is on) and the synchronous one
    # beside it, swapped per pass.
    stepper = engine.stepper
    sync_stepper = getattr(stepper, "sync", stepper)
    print(f"# bench_model on {args.device}: {config.num_hidden_layers} layers, hidden "
          f"{config.hidden_size}, vocab {config.vocab_size}, bf16; KV capacity "
          f"{info['kv_capacity_tokens']} tokens; built in {time.perf_counter() - built:.1f} s")
    if graphs is not None:
        print(f"# decode graphs: sizes {','.join(map(str, graphs.sizes))} captured in "
              f"{graphs.capture_seconds:.2f} s, {graphs.memory_bytes() / 2**20:.1f} MiB")
    print(f"# prompt {prompt_tokens} tokens, {gen_tokens} generated per request (greedy)")
    print(f"{'concurrency':>11} {'mode':>6} {'seconds':>8} {'tokens':>7} {'tokens/s':>9} "
          f"{'ms/token/seq':>12} {'replays':>7}")
    # (graphs, async) per pass: "off" eager, "on" graphs, "async" graphs + async scheduling.
    passes = {"off": (False, False), "on": (True, False), "async": (True, True)}
    modes = {"both": ("off", "on", "async")}.get(args.graphs, (args.graphs,))
    rng = np.random.default_rng(1)
    engine.stepper = sync_stepper
    run(engine, 1, prompt_tokens, 2, rng)  # warm-up: module loads / NVRTC, weight placement
    for c in concurrency:
        for mode in modes:
            graphed, asynchronous = passes[mode]
            # A pass without graphs sets them aside: the same engine, weights and pools.
            engine.runner.decode_graphs = graphs if graphed else None
            engine.stepper = stepper if asynchronous else sync_stepper
            before = sum(graphs.replays.values()) if graphs is not None else 0
            seconds, generated = run(engine, c, prompt_tokens, gen_tokens, rng)
            assert generated == c * gen_tokens, (generated, c * gen_tokens)
            replays = sum(graphs.replays.values()) - before if graphs is not None else 0
            if graphed and graphs is not None:
                assert replays > 0, "no decode step replayed a graph"
            print(f"{c:>11} {mode:>6} {seconds:>8.2f} {generated:>7} "
                  f"{generated / seconds:>9.1f} {1e3 * seconds / gen_tokens:>12.2f} "
                  f"{replays:>7}")
    engine.runner.decode_graphs, engine.stepper = graphs, stepper
    return 0


if __name__ == "__main__":
    sys.exit(main())
