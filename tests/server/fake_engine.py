"""A small stand-in for runtime/engine.LLMEngine that follows docs/engine_api.md exactly.

Deterministic: the tokens of a request depend only on its own prompt ids and position (never on
what else is batched), so a test can compare a request served under load with the same request
served alone. `step_delay_s` makes it slow enough for aborts and disconnects to land mid-stream.
Blocks are accounted like a paged engine's (ceil(tokens / block_size) per running request) so
"every block free afterwards" is checkable through get_stats().
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from pagedrun.runtime.outputs import CompletionOutput, Logprob, RequestOutput, Usage
from pagedrun.runtime.sampling_params import SamplingParams

FIRST_PRINTABLE = 32
NUM_PRINTABLE = 95  # ASCII 32..126: every generated token decodes to one printable character
EOS_TOKEN_ID = 0
VOCAB_SIZE = 512


class FakeRequestError(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class ByteTokenizer:
    """Token id = byte value (0..255); ids above 255 decode to nothing."""

    vocab_size = VOCAB_SIZE
    eos_token_id = EOS_TOKEN_ID

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(t for t in ids if t < 256).decode("utf-8", errors="replace")


def expected_tokens(prompt_ids: list[int], max_tokens: int) -> list[int]:
    """The reference: what the fake engine generates for this prompt (greedy, alone or not)."""
    seed = sum((i + 1) * t for i, t in enumerate(prompt_ids)) % 9973
    return [FIRST_PRINTABLE + (seed * 31 + pos * 7 + pos * pos) % NUM_PRINTABLE
            for pos in range(max_tokens)]


def expected_prompt_logprobs(prompt_ids: list[int], num_top: int) -> list[Logprob | None]:
    """The reference prompt logprobs of the fake engine: None for token 0, then per prompt token
    a logprob of -i/4 (exact in binary) and `num_top` made-up alternatives, best first."""
    return [None] + [Logprob(t, -i / 4, {(t + j) % VOCAB_SIZE: -i / 4 - j for j in range(num_top)})
                     for i, t in enumerate(prompt_ids) if i > 0]


@dataclass
class _Req:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival_time: float
    out_ids: list[int] = field(default_factory=list)
    finished_reason: str | None = None
    running: bool = False


class FakeEngine:
    def __init__(self, *, step_delay_s: float = 0.0, max_model_len: int = 256,
                 block_size: int = 16, num_kv_blocks: int = 1024, max_num_seqs: int = 64,
                 default_max_tokens: int = 16) -> None:
        self.step_delay_s = step_delay_s
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.num_kv_blocks = num_kv_blocks
        self.max_num_seqs = max_num_seqs
        self.tokenizer = ByteTokenizer()
        self._requests: dict[str, _Req] = {}
        self._pending_final: list[RequestOutput] = []
        self.num_steps = 0
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0

    # --- the contract -------------------------------------------------------------------
    def add_request(self, request_id: str, *, prompt: str | None = None,
                    prompt_token_ids: list[int] | None = None, messages: list[dict] | None = None,
                    sampling_params: SamplingParams, arrival_time: float | None = None) -> None:
        if request_id in self._requests:
            raise FakeRequestError("duplicate_request_id", f"{request_id} exists")
        if messages is not None:
            prompt = "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"
        ids = list(prompt_token_ids) if prompt_token_ids is not None else self.tokenizer.encode(
            prompt or "")
        if not ids:
            raise FakeRequestError("empty_prompt", "prompt is empty")
        if len(ids) > self.max_model_len:
            raise FakeRequestError("prompt_too_long", f"{len(ids)} > {self.max_model_len}")
        if self._blocks_for(self.max_model_len) > self.num_kv_blocks:
            raise FakeRequestError("capacity", "cannot fit")
        self._requests[request_id] = _Req(request_id, ids, sampling_params,
                                          arrival_time or time.monotonic())

    def abort_request(self, request_id: str) -> bool:
        req = self._requests.pop(request_id, None)
        if req is None:
            return False
        self._pending_final.append(self._output(req, [], "abort"))
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests) or bool(self._pending_final)

    def step(self) -> list[RequestOutput]:
        if self.step_delay_s:
            time.sleep(self.step_delay_s)
        self.num_steps += 1
        outputs, self._pending_final = self._pending_final, []
        self._admit()
        for req in [r for r in self._requests.values() if r.running]:
            limit = min(req.params.max_tokens or self.max_model_len,
                        max(1, self.max_model_len - len(req.prompt_ids)))
            if not req.out_ids:
                self.prompt_tokens_total += len(req.prompt_ids)
            tok = expected_tokens(req.prompt_ids, len(req.out_ids) + 1)[-1]
            req.out_ids.append(tok)
            self.generation_tokens_total += 1
            reason = None
            if tok in req.params.stop_token_ids:
                reason = "stop"
            elif len(req.out_ids) >= limit:
                reason = "length"
            outputs.append(self._output(req, [tok], reason))
            if reason:
                del self._requests[req.request_id]
        return outputs

    def get_stats(self) -> dict:
        running = [r for r in self._requests.values() if r.running]
        used = self._used_blocks()
        return {
            "num_requests_running": len(running),
            "num_requests_waiting": len(self._requests) - len(running),
            "kv_cache_usage_perc": used / self.num_kv_blocks,
            "prefix_cache_queries": self.prompt_tokens_total,
            "prefix_cache_hits": 0,
            "num_preemptions_total": 0,
            "num_free_blocks": self.num_kv_blocks - used,
            "num_total_blocks": self.num_kv_blocks,
            "prompt_tokens_total": self.prompt_tokens_total,
            "generation_tokens_total": self.generation_tokens_total,
        }

    def model_info(self) -> dict:
        return {
            "model": "fake-byte-model", "max_model_len": self.max_model_len,
            "block_size": self.block_size, "num_kv_blocks": self.num_kv_blocks,
            "kv_capacity_tokens": self.num_kv_blocks * self.block_size,
            "max_concurrency_at_max_len":
                self.num_kv_blocks // self._blocks_for(self.max_model_len),
            "vocab_size": VOCAB_SIZE, "eos_token_ids": [EOS_TOKEN_ID], "device": "cpu",
            "dtype": "float32",
        }

    # --- internals ----------------------------------------------------------------------
    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _used_blocks(self) -> int:
        return sum(self._blocks_for(len(r.prompt_ids) + len(r.out_ids) + 1)
                   for r in self._requests.values() if r.running)

    def _admit(self) -> None:
        running = sum(r.running for r in self._requests.values())
        for req in self._requests.values():
            if req.running:
                continue
            need = self._blocks_for(len(req.prompt_ids) + 1)
            if running >= self.max_num_seqs or \
                    self._used_blocks() + need > self.num_kv_blocks:
                break
            req.running = True
            running += 1

    def _output(self, req: _Req, new_ids: list[int], reason: str | None) -> RequestOutput:
        logprobs = None
        if req.params.logprobs is not None:
            logprobs = [Logprob(t, -0.5, {t: -0.5}) for t in new_ids]
        comp = CompletionOutput(0, list(new_ids), self.tokenizer.decode(new_ids), logprobs,
                                reason, None)
        prompt_logprobs = None
        if req.params.prompt_logprobs is not None and len(req.out_ids) == 1 and new_ids:
            # Like the engine: once, with the first delta after the whole prompt has run.
            prompt_logprobs = expected_prompt_logprobs(req.prompt_ids, req.params.prompt_logprobs)
        return RequestOutput(req.request_id, req.prompt_ids, [comp], finished=reason is not None,
                             usage=Usage(len(req.prompt_ids), 0, len(req.out_ids)),
                             prompt_logprobs=prompt_logprobs, arrival_time=req.arrival_time)
