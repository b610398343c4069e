"""A small stand-in for runtime/engine.LLMEngine that follows docs/engine_api.md exactly.

Deterministic: the tokens of a request depend only on its own prompt ids and position (never on
what else is batched), so a test can compare a request served under load with the same request
served alone. `step_delay_s` makes it slow enough for aborts and disconnects to land mid-stream.
Blocks are accounted like a paged engine's (ceil(tokens / block_size) per running request) so
"every block free afterwards" is checkable through get_stats().

Logprobs have vLLM's shape ({token_id: Logprob(logprob, rank, decoded_token)} per position, the
sampled or prompt token first, then the top k) with made-up values that are exact in binary;
the sampled token's rank cycles 1, 2, 3 so it is sometimes inside the top k and sometimes not.
Chat messages render as "<role>content..." with the ChatOptions visible in the text
(`render_chat`), so a test can tell from the prompt token count which options arrived.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from types import SimpleNamespace

from pagedrun.runtime.chat_options import ChatOptions
from pagedrun.runtime.outputs import CompletionOutput, Logprob, RequestOutput, Usage
from pagedrun.runtime.sampling_params import MAX_LOGPROBS, SamplingParams

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


def decode_one(token_id: int) -> str:
    return ByteTokenizer().decode([token_id])


def alt_token(token_id: int, rank: int, alt_offset: int, j: int) -> int:
    """The made-up token of rank j (!= rank) at a position whose own token has rank `rank`:
    token_id + alt_offset + j, except where that wraps onto token_id itself (only with a top
    near the whole vocabulary): then the one value no other rank takes."""
    alt = (token_id + alt_offset + j) % VOCAB_SIZE
    return (token_id + alt_offset + rank) % VOCAB_SIZE if alt == token_id else alt


def _position(token_id: int, rank: int, num_top: int, base: float, alt_offset: int) -> dict:
    """{token_id: Logprob} of one position: `token_id` (of rank `rank`) first, then the top
    `num_top` (rank j has logprob base - (j - 1) / 2; the ranks other than token_id's are
    made-up tokens, alt_token)."""
    out = {token_id: Logprob(base - (rank - 1) / 2, rank, decode_one(token_id))}
    for j in range(1, num_top + 1):
        t = token_id if j == rank else alt_token(token_id, rank, alt_offset, j)
        out[t] = Logprob(base - (j - 1) / 2, j, decode_one(t))
    return out


def sampled_rank(position: int) -> int:
    """The rank the fake engine gives its sampled token at output position `position`."""
    return 1 + position % 3


def expected_logprobs(token_ids: list[int], num_top: int, start: int = 0) -> list[dict]:
    """The reference sample logprobs of output tokens `token_ids` (from output position
    `start`): the sampled token has rank sampled_rank(pos) and logprob -rank / 2."""
    return [_position(t, sampled_rank(start + i), num_top, -0.5, 100)
            for i, t in enumerate(token_ids)]


def expected_cumulative_logprob(num_tokens: int) -> float:
    return sum(-sampled_rank(p) / 2 for p in range(num_tokens))


def expected_prompt_logprobs(prompt_ids: list[int], num_top: int) -> list[dict | None]:
    """The reference prompt logprobs of the fake engine: None for token 0, then per prompt token
    i a position whose best logprob is -i/4 and where the prompt token has rank 1 + i % 3."""
    return [None] + [_position(t, 1 + i % 3, num_top, -i / 4, 50)
                     for i, t in enumerate(prompt_ids) if i > 0]


# The wire form (protocol 1.3) of the references above, written from their definition, not
# through the server's conversion: {token_id, logprob, top, rank, decoded_token,
# top_decoded_tokens} with `top` the k best as [token_id, logprob] pairs, best first.
def _wire_entry(t: int, rank: int, num_top: int, base: float, alt_offset: int) -> dict:
    top = [t if j == rank else alt_token(t, rank, alt_offset, j) for j in range(1, num_top + 1)]
    return {"token_id": t, "logprob": base - (rank - 1) / 2,
            "top": [[alt, base - j / 2] for j, alt in enumerate(top)],
            "rank": rank, "decoded_token": decode_one(t),
            "top_decoded_tokens": [decode_one(alt) for alt in top]}


def expected_logprobs_wire(token_ids: list[int], num_top: int, start: int = 0) -> list[dict]:
    return [_wire_entry(t, sampled_rank(start + i), num_top, -0.5, 100)
            for i, t in enumerate(token_ids)]


def expected_prompt_logprobs_wire(prompt_ids: list[int], num_top: int) -> list[dict | None]:
    return [None] + [_wire_entry(t, 1 + i % 3, num_top, -i / 4, 50)
                     for i, t in enumerate(prompt_ids) if i > 0]


def render_chat(messages: list[dict], options: ChatOptions | None) -> str:
    """The fake chat template: every option leaves a mark in the text."""
    options = options or ChatOptions()
    text = "".join(f"<{m['role']}>{m['content']}" for m in messages)
    if options.chat_template is not None:
        text = f"[{options.chat_template}]" + text
    if options.tools:
        text = f"<tools {len(options.tools)}>" + text
    for key in sorted(options.chat_template_kwargs):
        text += f"<{key}={options.chat_template_kwargs[key]}>"
    if options.continue_final_message:
        return text  # the last message stays open: generation continues it
    if options.add_generation_prompt:
        text += "<assistant>"
    return text


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
                 default_max_tokens: int = 16, max_logprobs: int = MAX_LOGPROBS) -> None:
        self.step_delay_s = step_delay_s
        self.config = SimpleNamespace(max_logprobs=max_logprobs)  # as EngineConfig
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
        # request id -> (finish reason, output tokens) of every request that ended: what tests
        # assert per request (an abort that came in time ends "abort", never "length").
        self.finished: dict[str, tuple[str, int]] = {}

    # --- the contract -------------------------------------------------------------------
    def add_request(self, request_id: str, *, prompt: str | None = None,
                    prompt_token_ids: list[int] | None = None, messages: list[dict] | None = None,
                    sampling_params: SamplingParams, arrival_time: float | None = None,
                    chat_options: ChatOptions | None = None) -> None:
        if request_id in self._requests:
            raise FakeRequestError("duplicate_request_id", f"{request_id} exists")
        if chat_options is not None and messages is None:
            raise FakeRequestError("invalid_request", "chat_options need messages")
        if messages is not None:
            prompt = render_chat(messages, chat_options)
        ids = list(prompt_token_ids) if prompt_token_ids is not None else self.tokenizer.encode(
            prompt or "")
        k = sampling_params.truncate_prompt_tokens
        if k is not None:
            ids = ids[-(self.max_model_len if k == -1 else k):]
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
        self.finished[request_id] = ("abort", len(req.out_ids))
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
                self.finished[req.request_id] = (reason, len(req.out_ids))
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
        logprobs = cumulative = None
        num_top = req.params.logprobs
        if num_top is not None:
            num_top = VOCAB_SIZE if num_top == -1 else num_top
            logprobs = expected_logprobs(new_ids, num_top, len(req.out_ids) - len(new_ids))
            cumulative = expected_cumulative_logprob(len(req.out_ids))
        comp = CompletionOutput(0, list(new_ids), self.tokenizer.decode(new_ids), logprobs,
                                cumulative, reason, None)
        prompt_logprobs = None
        if req.params.prompt_logprobs is not None and len(req.out_ids) == 1 and new_ids:
            # Like the engine: once, with the first delta after the whole prompt has run.
            num_top = req.params.prompt_logprobs
            prompt_logprobs = expected_prompt_logprobs(
                req.prompt_ids, VOCAB_SIZE if num_top == -1 else num_top)
        return RequestOutput(req.request_id, req.prompt_ids, [comp], finished=reason is not None,
                             usage=Usage(len(req.prompt_ids), 0, len(req.out_ids)),
                             prompt_logprobs=prompt_logprobs, arrival_time=req.arrival_time)
