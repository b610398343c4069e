"""KernelSampler: runtime/sampler.py's Sampler on the sampling kernels (cuda/sampling.cu), the
sampler of the kernel backends (sim, cuda), which return it from `Backend.sampler`.

Same interface and same draws as the numpy Sampler: the uniforms come from
runtime.sampler.draw_uniforms, so a seed gives the same tokens on every backend; the logits
processors and the draw run on the kernels where the logits are (the harness's numpy arrays, or
cupy arrays on a GPU), and only token ids come back to the host, plus, for the rows that asked
for logprobs, their raw rows (raw modes) or their kernel-processed rows (processed modes: the
sampler's steps 6-9 then run on the host with runtime.sampler.filter_rows, for those rows only).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from pagedrun.runtime.kernels.kernel_args import array_module
from pagedrun.runtime.kernels.sampling import process_lists, process_logits, sample
from pagedrun.runtime.logits_row_groups import group_rows
from pagedrun.runtime.sampler import (SamplerOutput, check_logprobs_mode, check_sample_args,
                                      draw_uniforms, filter_rows, gather_logprobs,
                                      logprob_rows, raw_values)

from .device_runtime import HostReady


class DeferredSample:
    """Sampled token ids still on the device: `device` [rows] int32 (the backend's array),
    `read()` the SamplerOutput (host ids, no logprobs).

    `pending` is the device runtime's download_async of them (runtime/backends/
    device_runtime.py): on a GPU a copy to page-locked memory right behind the sampling kernel,
    so `read()` waits for that copy only, not for the work queued after it (the next step's
    forward, asynchronous scheduling); a plain .get() would synchronize the whole stream."""

    def __init__(self, device, pending) -> None:
        self.device = device
        self._pending = pending

    def read(self) -> SamplerOutput:
        token_ids = np.array(self._pending.read(), dtype=np.int32)
        return SamplerOutput(token_ids, [None] * token_ids.shape[0])


class KernelSampler:
    """runtime.sampler.Sampler with the logits processors and sampling on the kernels."""

    def __init__(self, module, eos_token_ids: Sequence[int] = (), seed: int = 0, xp=np,
                 logprobs_mode: str = "raw_logprobs", download_async=HostReady) -> None:
        """module: the loaded sampling.cu module; xp: the array module the kernels run on
        (numpy: harness; cupy: GPU). Host logits are copied there; device logits are copied on
        the device. download_async: the device runtime's (deferred reads of the token ids)."""
        self.module = module
        self.xp = xp
        self.download_async = download_async
        self.eos_token_ids = [int(t) for t in eos_token_ids]
        self.generator = np.random.Generator(np.random.PCG64(seed))
        self.logprobs_mode = check_logprobs_mode(logprobs_mode)

    def draw_uniforms(self, params, generators) -> np.ndarray:
        """[rows] float64: the numpy Sampler's draws (runtime.sampler.draw_uniforms)."""
        return draw_uniforms(self.generator, params, generators)

    def sample(self, logits, params, generators, prompt_token_ids, output_token_ids,
               row_index: Sequence[int] | None = None, defer_read: bool = False):
        """Sampler.sample's contract; logits may be host (numpy) or device (xp) float32.
        defer_read: when no row wants logprobs, return a DeferredSample (the token ids left
        on the device, read back by its `read()`) instead of a SamplerOutput: asynchronous
        scheduling launches the next step before it reads these."""
        logits_xp = array_module(logits)
        check_sample_args(len(params), params, generators, prompt_token_ids, output_token_ids)
        # The n siblings of a first token are one group: processed once, one row per group
        # (runtime/logits_row_groups.py), each member drawn from it by sample_f32's row map.
        groups = group_rows(row_index, logits.shape[0], params, prompt_token_ids,
                            output_token_ids)
        if not groups.identity:
            logits = logits[logits_xp.asarray(groups.logits_rows)]  # [groups, vocab]
        group_params = groups.pick(params)
        group_prompts, group_outputs = groups.pick(prompt_token_ids), groups.pick(output_token_ids)
        want = logprob_rows(params)
        want_groups = groups.groups_of(want)
        raw_mode = self.logprobs_mode.startswith("raw")
        group_values = raw_values(self._host_rows(logits, want_groups) if raw_mode and want
                                  else None, want_groups, self.logprobs_mode)
        lists = process_lists(group_params, group_prompts, group_outputs, self.eos_token_ids,
                              logits.shape[1])
        if lists is None and (raw_mode or not want):
            # Nothing to process and no processed rows to report: sample_f32 only reads the
            # logits, so it samples them where they are (no [rows, vocab] copy per step).
            processed = self.xp.ascontiguousarray(self.xp.asarray(logits, dtype=np.float32))
        else:
            processed = self.xp.array(logits, dtype=np.float32)  # a copy: processed in place
            process_logits(self.module, processed, group_params, group_prompts, group_outputs,
                           self.eos_token_ids, lists=lists)
        tokens = sample(self.module, processed, params, self.draw_uniforms(params, generators),
                        logits_rows=None if groups.identity else groups.group_of)
        if defer_read and not want:
            return DeferredSample(tokens, self.download_async(tokens))
        token_ids = np.asarray(tokens if self.xp is np else tokens.get(), dtype=np.int32)
        if want and not raw_mode:
            self._processed_values(group_values, self._host_rows(processed, want_groups),
                                   want_groups, group_params)
        values = groups.per_row(group_values, want)
        return SamplerOutput(token_ids, gather_logprobs(values, token_ids, params,
                                                        self.logprobs_mode))

    @staticmethod
    def _host_rows(logits, rows: list[int]) -> np.ndarray:
        """logits[rows] as a host float32 array."""
        picked = logits[array_module(logits).asarray(rows)]
        return np.asarray(picked if isinstance(picked, np.ndarray) else picked.get(),
                          dtype=np.float32)

    @staticmethod
    def _processed_values(values: dict, processed_rows: np.ndarray, want: list[int],
                          params) -> None:
        """values[row] = the processed logits (runtime/sampler.py step 11) of each wanted row,
        from its kernel-processed (steps 1-4) host copy processed_rows [len(want), vocab]."""
        sampled = [j for j, i in enumerate(want) if not params[i].greedy]
        for j, i in enumerate(want):
            values[i] = processed_rows[j]
        if sampled:
            final, _ = filter_rows(processed_rows[sampled], [params[want[j]] for j in sampled])
            for k, j in enumerate(sampled):
                values[want[j]] = final[k]
