"""A synthetic request-length mix shaped like ShareGPT conversations (no data set needed).

Distribution (written down so every benchmark that uses it is reproducible):
- prompt length: lognormal, mean 161 tokens, sigma 1.0 (median ~98), clipped to [4, 1024];
- output length: lognormal, mean 338 tokens, sigma 0.8 (median ~245), clipped to [4, 1024];
- prompt + output <= max_model_len (the output is shortened when it would not fit).
The means are the ShareGPT averages the vLLM paper reports (161 in, 338 out); the lognormal
shape gives the long tail of real traces: most requests are short, a few are very long.
Arrivals: Poisson with a given mean number of requests per engine step.

`scale` shrinks both lengths (the CPU backend cannot run a full-size trace in a few minutes);
the shape of the distribution is kept.
"""
from __future__ import annotations

import math

import numpy as np

PROMPT_MEAN_TOKENS = 161
PROMPT_SIGMA = 1.0
OUTPUT_MEAN_TOKENS = 338
OUTPUT_SIGMA = 0.8
MIN_TOKENS = 4
MAX_PROMPT_TOKENS = 1024
MAX_OUTPUT_TOKENS = 1024


def _lognormal(rng: np.random.Generator, mean: float, sigma: float, n: int) -> np.ndarray:
    mu = math.log(mean) - sigma * sigma / 2  # so that the lognormal's mean is `mean`
    return rng.lognormal(mu, sigma, n)


def sharegpt_like_lengths(num_requests: int, seed: int = 0, scale: float = 1.0,
                          max_model_len: int = 2048) -> tuple[np.ndarray, np.ndarray]:
    """(prompt_lens, output_lens), each [num_requests] int64."""
    rng = np.random.default_rng(seed)
    prompt = np.clip(_lognormal(rng, PROMPT_MEAN_TOKENS, PROMPT_SIGMA, num_requests) * scale,
                     MIN_TOKENS, MAX_PROMPT_TOKENS * scale).astype(np.int64)
    output = np.clip(_lognormal(rng, OUTPUT_MEAN_TOKENS, OUTPUT_SIGMA, num_requests) * scale,
                     MIN_TOKENS, MAX_OUTPUT_TOKENS * scale).astype(np.int64)
    prompt = np.minimum(prompt, max_model_len - 1)
    output = np.maximum(1, np.minimum(output, max_model_len - prompt))
    return prompt, output


def poisson_arrival_steps(num_requests: int, requests_per_step: float, seed: int = 0) -> np.ndarray:
    """Engine step at which each request arrives, [num_requests] int64, non-decreasing."""
    rng = np.random.default_rng(seed + 1)
    gaps = rng.exponential(1.0 / requests_per_step, num_requests)
    return np.floor(np.cumsum(gaps)).astype(np.int64)


def random_prompt_ids(rng: np.random.Generator, length: int, vocab_size: int) -> list[int]:
    """Token ids for a prompt; the low ids (special tokens in most vocabularies) are avoided."""
    first_plain_id = min(100, vocab_size // 2)
    return rng.integers(first_plain_id, vocab_size, length).tolist()
