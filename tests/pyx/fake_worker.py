"""A model-free worker for scheduler tests: executes a SchedulerOutput on a fake KV cache.

The fake "KV" of the token at position p is a hash of the sequence's token ids [0, p], so a
block holds the right KV only if it was written for exactly that prefix. After the step's
swap / copy ops and writes, every row's context is read back through its block table and
compared with the prefix hashes of the request's tokens (from an independent computation).
This catches wrong prefix hits, a missed or misdirected copy-on-write, lost swaps, slots shared
between requests and off-by-one positions.
"""
import numpy as np

UNWRITTEN = -1
_MOD = (1 << 61) - 1
_BASE = 1_000_003


def prefix_hashes(token_ids):
    """int64 [n]: hash of token_ids[:p + 1] for every p."""
    out = np.empty(len(token_ids), dtype=np.int64)
    h = 7
    for p, t in enumerate(token_ids.tolist()):
        h = (h * _BASE + t + 1) % _MOD
        out[p] = h
    return out


class FakeWorker:
    def __init__(self, num_gpu_blocks: int, num_cpu_blocks: int, block_size: int):
        self.block_size = block_size
        self.gpu = np.full(num_gpu_blocks * block_size, UNWRITTEN, dtype=np.int64)
        self.cpu = np.full(max(num_cpu_blocks, 1) * block_size, UNWRITTEN, dtype=np.int64)

    def _block(self, arr, b):
        return arr[b * self.block_size:(b + 1) * self.block_size]

    def execute(self, sched, out) -> None:
        """Run `out` (ops, then writes) and assert every row reads exactly its own prefix."""
        bs = self.block_size
        for g, c in out.swap_out.tolist():
            self._block(self.cpu, c)[:] = self._block(self.gpu, g)
        for c, g in out.swap_in.tolist():
            self._block(self.gpu, g)[:] = self._block(self.cpu, c)
        for src, dst in out.block_copies.tolist():
            self._block(self.gpu, dst)[:] = self._block(self.gpu, src)
        qsl = out.query_start_loc
        assert qsl[0] == 0 and qsl[-1] == out.num_batched_tokens == len(out.input_token_ids)
        rows = []
        for k in range(out.num_reqs):
            rid = int(out.req_ids[k])
            tokens = sched.get_token_ids(rid)
            start = int(out.num_computed_tokens_before[k])
            ctx = int(out.context_lens[k])
            a, b = int(qsl[k]), int(qsl[k + 1])
            assert b - a == out.query_lens[k] == ctx - start >= 1
            assert ctx <= len(tokens)
            assert bool(out.sample_mask[k]) == (ctx == len(tokens))
            assert np.array_equal(out.input_token_ids[a:b], tokens[start:ctx]), rid
            assert np.array_equal(out.positions[a:b], np.arange(start, ctx)), rid
            expected = prefix_hashes(tokens[:ctx])
            self.gpu[out.slot_mapping[a:b]] = expected[start:ctx]
            rows.append((k, rid, ctx, expected))
        for k, rid, ctx, expected in rows:
            pos = np.arange(ctx)
            slots = out.block_tables[k][pos // bs] * bs + pos % bs
            got = self.gpu[slots]
            bad = np.flatnonzero(got != expected)
            assert len(bad) == 0, (f"request {rid}: KV wrong at positions {bad[:8].tolist()} "
                                   f"(context {ctx}, step {out.step_id})")
