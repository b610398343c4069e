"""Launch wrapper of cuda/rejection_sample.cu: speculative decoding's verification step on the
kernel backends, with the numpy reference's contract (runtime/spec_decode/rejection_sampler.py).

    module = load_module("rejection_sample.cu", backend="sim")   # or "cuda"
    out = rejection_sample(module, target_weights, draft_token_ids, num_draft_tokens,
                           draft_weights, greedy, uniforms)       # RejectionOutput

target_weights [B, K + 1, vocab] float32 (target_probs.verification_weights), draft_weights
[B, K, vocab] float32 or None (n-gram: the point mass on each proposed token), draft_token_ids
[B, K] int32, num_draft_tokens [B] int32, greedy [B] bool, uniforms [B, >= K + 1] float64
(rejection_sampler.draw_spec_uniforms). Arrays are numpy under the CPU harness and cupy on a
GPU (host arguments are copied to the device here).
"""
from __future__ import annotations

import numpy as np

from pagedrun.runtime.spec_decode.rejection_sampler import RejectionOutput

from .kernel_args import array_module, require, require_contiguous

REJECTION_THREADS = 256


def rejection_sample(module, target_weights, draft_token_ids, num_draft_tokens, draft_weights,
                     greedy, uniforms) -> RejectionOutput:
    """The batch's accepted and drawn tokens (RejectionOutput, host arrays)."""
    xp = array_module(target_weights)
    require(target_weights.ndim == 3 and np.dtype(target_weights.dtype) == np.float32,
            lambda: f"target_weights must be [B, K + 1, vocab] float32, got "
                    f"{target_weights.shape} {target_weights.dtype}")
    require_contiguous("target_weights", target_weights)
    num_reqs, positions, vocab = target_weights.shape
    max_draft = positions - 1
    require(vocab >= 1 and positions >= 1, "target_weights needs a vocabulary and a position")

    def device_array(name, x, dtype, shape):
        x = xp.ascontiguousarray(xp.asarray(x, dtype=dtype))
        require(x.shape == shape, lambda: f"{name} must be {shape}, got {x.shape}")
        return x

    draft = device_array("draft_token_ids", draft_token_ids, np.int32, (num_reqs, max_draft))
    num_draft = device_array("num_draft_tokens", num_draft_tokens, np.int32, (num_reqs,))
    greedy_flags = device_array("greedy", greedy, np.int32, (num_reqs,))
    u = xp.asarray(uniforms, dtype=np.float64)
    require(u.ndim == 2 and u.shape[0] == num_reqs and u.shape[1] >= positions,
            lambda: f"uniforms {u.shape}, need [{num_reqs}, >= {positions}]")
    u = xp.ascontiguousarray(u[:, :positions])
    # Counts index the draft rows in the kernel: always checked (a [B] read from a device).
    host_counts = num_draft if xp is np else num_draft.get()
    require(bool(((host_counts >= 0) & (host_counts <= max_draft)).all()),
            lambda: f"num_draft_tokens must be in [0, {max_draft}]")
    if isinstance(draft_token_ids, np.ndarray):  # host ids are checked; device ids trusted
        in_draft = np.arange(max_draft)[None, :] < host_counts[:, None]
        ids = np.asarray(draft_token_ids).reshape(num_reqs, max_draft)[in_draft]
        require(bool(((ids >= 0) & (ids < vocab)).all()), "draft_token_ids outside the vocabulary")
    if draft_weights is None:
        q = xp.empty((1,), dtype=np.float32)  # unused; CuPy launches take arrays, not None
    else:
        q = device_array("draft_weights", draft_weights, np.float32, (num_reqs, max_draft, vocab))
    token_ids = xp.empty((num_reqs, positions), dtype=np.int32)
    num_emitted = xp.empty((num_reqs,), dtype=np.int32)
    if num_reqs:
        module.get_function("rejection_sample")(
            (num_reqs,), (REJECTION_THREADS,),
            (token_ids, num_emitted, target_weights, q, draft, num_draft, greedy_flags, u,
             np.int32(max_draft), np.int32(vocab), np.int32(draft_weights is not None)))
    host = (lambda a: a) if xp is np else (lambda a: a.get())
    return RejectionOutput(host(token_ids), host(num_emitted))
