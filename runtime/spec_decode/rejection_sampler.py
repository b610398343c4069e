"""Rejection sampling over a batch of speculating requests (numpy reference).

Per request b with k_b proposed tokens x_0 .. x_{k_b - 1} (the batch is padded to K = max k_b):
  target_weights [B, K + 1, vocab]: p_i, what the plain sampler would draw position i from
      (target_probs.verification_weights: logits processors and filters already applied)
  draft_weights  [B, K, vocab] or None: q_i, the draft's distribution that x_i was drawn from.
      None (n-gram): q_i is the point mass on x_i, vLLM's treatment of drafts without
      probabilities (vllm/v1/sample/rejection_sampler.py: draft probability 1 for the proposed
      token, and the recovered distribution is p with that token removed).
  draft_token_ids [B, K] int, num_draft_tokens [B] int (entries past k_b are ignored)
  greedy [B] bool, uniforms [B, K + 1] float64 in [0, 1) (`draw_spec_uniforms`)

The rule (Leviathan et al. 2023; Chen et al. 2023): for i = 0, 1, ..., accept x_i when
u_i * q_i(x_i) < p_i(x_i), that is with probability min(1, p_i(x_i) / q_i(x_i)); at the first
rejection, draw the correction from the residual max(0, p_i - q_i), normalized; when all k_b are
accepted, draw the bonus token from p_{k_b}. Each emitted token is then distributed as the plain
sampler would draw it after the tokens before it: P(emit t at i | reached i) =
min(p_i, q_i)(t) + (1 - sum min(p_i, q_i)) * residual_i(t) = p_i(t), position after position.
If the residual has no mass (p == q up to rounding, where a rejection has probability zero),
the correction is drawn from p.
Greedy rows: accept while the target's argmax equals x_i; the correction or bonus token is the
target's argmax; no uniform is used.

Randomness, in a fixed order so a seed always gives the same tokens: a sampled request draws
k_b + 1 uniforms whatever happens: u_0 .. u_{k_b - 1} decide the acceptances, u_{k_b} drives the
one inverse-CDF draw (correction or bonus). With k_b = 0 that is exactly the plain sampler's
one uniform and its draw over the same weights: same seed, same token, bit for bit.

Output: token_ids [B, K + 1] int32 (PLACEHOLDER_TOKEN_ID after the emitted ones) and
num_emitted [B] (accepted + 1, between 1 and k_b + 1).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..sampler import inverse_cdf
from ..sampling_params import SamplingParams
from .target_probs import normalize

# Fills token_ids past each request's emitted tokens (never a valid token id).
PLACEHOLDER_TOKEN_ID = -1


@dataclass
class RejectionOutput:
    token_ids: np.ndarray    # [B, K + 1] int32, PLACEHOLDER_TOKEN_ID past num_emitted
    num_emitted: np.ndarray  # [B] int32: accepted draft tokens + 1 (correction or bonus)

    @property
    def num_accepted(self) -> np.ndarray:
        return self.num_emitted - 1

    def emitted(self, b: int) -> np.ndarray:
        return self.token_ids[b, :self.num_emitted[b]]


def draw_spec_uniforms(engine_generator: np.random.Generator,
                       params: Sequence[SamplingParams],
                       generators: Sequence[np.random.Generator | None],
                       num_draft_tokens: Sequence[int]) -> np.ndarray:
    """[B, K + 1] float64 (K = max k_b): k_b + 1 uniforms per sampled request, none for greedy
    ones (zeros). As `sampler.draw_uniforms`: the engine's generator for unseeded requests, in
    request order, first; then each seeded request's own generator."""
    counts = np.asarray(num_draft_tokens, dtype=np.int64) + 1
    uniforms = np.zeros((len(params), int(counts.max(initial=1))))
    sampled = [b for b, p in enumerate(params) if not p.greedy]
    engine_rows = [b for b in sampled if generators[b] is None]
    drawn = engine_generator.random(int(counts[engine_rows].sum()))
    offset = 0
    for b in engine_rows:
        uniforms[b, :counts[b]] = drawn[offset:offset + counts[b]]
        offset += counts[b]
    for b in sampled:
        if generators[b] is not None:
            uniforms[b, :counts[b]] = generators[b].random(int(counts[b]))
    return uniforms


def accepted(uniforms: np.ndarray, p_x: np.ndarray, q_x: np.ndarray | float) -> np.ndarray:
    """Accept x with probability min(1, p(x) / q(x)): u * q(x) < p(x), u uniform in [0, 1)
    (no division: q(x) = 0, a token the draft could not have drawn, is accepted iff p(x) > 0).
    All [B, K] float64."""
    return uniforms * q_x < p_x


def residual_weights(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """max(0, p - q) per row ([rows, vocab] float64, p and q normalized); rows without mass
    fall back to p (see the module docstring)."""
    residual = np.maximum(p - q, 0.0)
    empty = ~(residual > 0).any(axis=1)
    residual[empty] = p[empty]
    return residual


def rejection_sample(target_weights: np.ndarray, draft_token_ids: np.ndarray,
                     num_draft_tokens: np.ndarray, draft_weights: np.ndarray | None,
                     greedy: np.ndarray, uniforms: np.ndarray) -> RejectionOutput:
    """The batch's emitted tokens; argument shapes in the module docstring."""
    target_weights = np.asarray(target_weights)
    num_rows, num_positions, vocab_size = target_weights.shape
    k_max = num_positions - 1
    draft = np.asarray(draft_token_ids, dtype=np.int64).reshape(num_rows, k_max)
    num_draft = np.asarray(num_draft_tokens, dtype=np.int64)
    greedy = np.asarray(greedy, dtype=bool)
    uniforms = np.asarray(uniforms, dtype=np.float64)
    if num_draft.shape != (num_rows,) or (num_draft < 0).any() or (num_draft > k_max).any():
        raise ValueError(f"num_draft_tokens must be [{num_rows}] in [0, {k_max}]")
    if uniforms.shape[0] != num_rows or uniforms.shape[1] < k_max + 1:
        raise ValueError(f"uniforms {uniforms.shape}, need [{num_rows}, >= {k_max + 1}]")
    rows = np.arange(num_rows)
    in_draft = np.arange(k_max)[None, :] < num_draft[:, None]  # [B, K]
    proposed = np.where(in_draft, draft, 0)
    if ((proposed < 0) | (proposed >= vocab_size)).any():
        raise ValueError("draft_token_ids outside the vocabulary")
    p = normalize(target_weights)  # [B, K + 1, V]
    q = None if draft_weights is None else normalize(draft_weights)  # [B, K, V]

    p_x = np.take_along_axis(p[:, :k_max], proposed[..., None], axis=2)[..., 0]
    q_x = 1.0 if q is None else np.take_along_axis(q, proposed[..., None], axis=2)[..., 0]
    accept = np.where(greedy[:, None],
                      np.argmax(p[:, :k_max], axis=2) == proposed,
                      accepted(uniforms[:, :k_max], p_x, q_x)) & in_draft
    num_accepted = np.cumprod(accept, axis=1).sum(axis=1)  # leading accepts; [B] int

    final = np.zeros(num_rows, dtype=np.int64)
    final[greedy] = np.argmax(p[rows[greedy], num_accepted[greedy]], axis=1)
    rejected = ~greedy & (num_accepted < num_draft)
    bonus = ~greedy & ~rejected
    u_final = uniforms[rows, num_draft]
    if bonus.any():  # the plain sampler's draw over the same float32 weights
        final[bonus] = inverse_cdf(target_weights[rows[bonus], num_accepted[bonus]],
                                    u_final[bonus])
    if rejected.any():
        at = num_accepted[rejected]
        p_at = p[rows[rejected], at]
        if q is None:
            q_at = np.zeros_like(p_at)
            q_at[np.arange(at.size), proposed[rows[rejected], at]] = 1.0
        else:
            q_at = q[rows[rejected], at]
        final[rejected] = inverse_cdf(residual_weights(p_at, q_at), u_final[rejected])

    token_ids = np.full((num_rows, num_positions), PLACEHOLDER_TOKEN_ID, dtype=np.int32)
    keep = np.arange(num_positions)[None, :] < num_accepted[:, None]
    token_ids[:, :k_max][keep[:, :k_max]] = proposed[keep[:, :k_max]]
    token_ids[rows, num_accepted] = final
    return RejectionOutput(token_ids, (num_accepted + 1).astype(np.int32))
