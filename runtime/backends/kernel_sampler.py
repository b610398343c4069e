"""KernelSampler: runtime/sampler.py's Sampler on the sampling kernels (cuda/sampling.cu), the
sampler of the kernel backends (sim, cuda), which return it from `Backend.sampler`.

Same interface and same draws as the numpy Sampler: the uniforms come from
runtime.sampler.draw_uniforms, so a seed gives the same tokens on every backend; penalties and
the draw run on the kernels where the logits are (the harness's numpy arrays, or cupy arrays on
a GPU), and only token ids (plus the raw logprobs of the rows that asked) come back to the host.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from pagedrun.runtime.kernels.kernel_args import array_module
from pagedrun.runtime.kernels.sampling import apply_penalties, sample
from pagedrun.runtime.sampler import (SamplerOutput, check_sample_args, draw_uniforms,
                                      is_identity, log_softmax, sampled_logprobs)


class KernelSampler:
    """runtime.sampler.Sampler with penalties and sampling on the kernels (same draws)."""

    def __init__(self, module, eos_token_ids: Sequence[int] = (), seed: int = 0, xp=np) -> None:
        """module: the loaded sampling.cu module; xp: the array module the kernels run on
        (numpy: harness; cupy: GPU). Host logits are copied there; device logits are copied on
        the device."""
        self.module = module
        self.xp = xp
        self.eos_token_ids = [int(t) for t in eos_token_ids]
        self.generator = np.random.Generator(np.random.PCG64(seed))

    def draw_uniforms(self, params, generators) -> np.ndarray:
        """[rows] float64: the numpy Sampler's draws (runtime.sampler.draw_uniforms)."""
        return draw_uniforms(self.generator, params, generators)

    def sample(self, logits, params, generators, prompt_token_ids, output_token_ids,
               row_index: Sequence[int] | None = None) -> SamplerOutput:
        """Sampler.sample's contract; logits may be host (numpy) or device (xp) float32."""
        logits_xp = array_module(logits)
        if not is_identity(row_index, logits.shape[0]):
            logits = logits[logits_xp.asarray(np.asarray(row_index, dtype=np.int64))]
        check_sample_args(logits, params, generators, prompt_token_ids,
                                     output_token_ids)
        want_logprobs = [i for i, p in enumerate(params) if p.logprobs is not None]
        raw = None
        if want_logprobs:  # raw logprobs, before penalties (host: rows that asked only)
            rows = logits[logits_xp.asarray(want_logprobs)]
            raw = log_softmax(rows if logits_xp is np else rows.get())
        processed = self.xp.array(logits, dtype=np.float32)  # a copy: penalties work in place
        apply_penalties(self.module, processed, params, prompt_token_ids, output_token_ids,
                        self.eos_token_ids)
        tokens = sample(self.module, processed, params, self.draw_uniforms(params, generators))
        token_ids = np.asarray(tokens if self.xp is np else tokens.get(), dtype=np.int32)
        return SamplerOutput(token_ids, sampled_logprobs(raw, want_logprobs, token_ids, params))
