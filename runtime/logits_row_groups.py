"""Which sampling rows share one processed logits row (issue 36: forks share the parent's row).

The n sequences of an n > 1 request sample their first token from one logits row (the engine's
`row_index`), with the request's params and prompt and an empty output: every step before the
draw (logits processors, temperature, min-p, top-k, top-p) gives all of them the same row. The
samplers process each group's row once and draw each member's token from it with the member's
own uniform, so their memory and work before the draw scale with the step's logits rows, not
with n x vocabulary (one request of 256 prompts x n = 256 took 14.8 GB when every sequence got
its own float32 copy of the row).

A group is rows that read the same logits row with the same params object, the same prompt
object and equal output ids: what the engine's siblings have. Rows that only look alike (equal
but separate params objects) stay apart: sharing is an optimisation, never a condition.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np


@dataclass(frozen=True)
class RowGroups:
    """logits_rows: [groups] int64, the logits row each group reads (ascending first use);
    first: [groups], one member row per group (its params, prompt and output ids stand for the
    group's); group_of: [rows] int64, the group of each sampling row; identity: every row is its
    own group and reads logits row i (the logits are used as they are, no gather)."""

    logits_rows: np.ndarray
    first: list[int]
    group_of: np.ndarray
    identity: bool

    @property
    def num_groups(self) -> int:
        return len(self.first)

    def members(self) -> list[list[int]]:
        """Per group, its sampling rows in row order."""
        out: list[list[int]] = [[] for _ in self.first]
        for row, group in enumerate(self.group_of.tolist()):
            out[group].append(row)
        return out

    def pick(self, per_row: Sequence) -> list:
        """The entries of a per-row list (params, prompts, outputs) for the groups."""
        return [per_row[i] for i in self.first]

    def groups_of(self, rows: Sequence[int]) -> list[int]:
        """The groups of `rows`, ascending, each once (e.g. the groups whose rows want logprobs)."""
        return sorted({int(self.group_of[i]) for i in rows})

    def per_row(self, per_group: dict, rows: Sequence[int]) -> dict:
        """{row: per_group[its group]} for `rows` (a group's value shared by its members)."""
        return {i: per_group[int(self.group_of[i])] for i in rows}


def group_rows(row_index: Sequence[int] | None, num_logits_rows: int,
               params: Sequence, prompt_token_ids: Sequence,
               output_token_ids: Sequence[Sequence[int]]) -> RowGroups:
    """The RowGroups of one sample call (module docstring). row_index: [rows], the logits row
    of each sampling row, or None (row i reads logits row i; then rows == num_logits_rows)."""
    num_rows = len(params)
    if row_index is None:
        if num_rows != num_logits_rows:
            raise ValueError(f"{num_logits_rows} logits rows but {num_rows} params "
                             "(and no row_index)")
        index = list(range(num_rows))
    else:
        index = [int(r) for r in row_index]
        if len(index) != num_rows:
            raise ValueError(f"row_index has {len(index)} entries for {num_rows} rows")
        bad = [r for r in index if not 0 <= r < num_logits_rows]
        if bad:
            raise IndexError(f"row_index {bad[0]} outside the {num_logits_rows} logits rows")
    first: list[int] = []
    logits_rows: list[int] = []
    group_of = np.empty(num_rows, dtype=np.int64)
    by_key: dict[tuple[int, int, int], list[int]] = {}  # candidate groups per key
    for row, logits_row in enumerate(index):
        key = (logits_row, id(params[row]), id(prompt_token_ids[row]))
        group = next((g for g in by_key.get(key, ())
                      if _same_ids(output_token_ids[first[g]], output_token_ids[row])), None)
        if group is None:
            group = len(first)
            first.append(row)
            logits_rows.append(logits_row)
            by_key.setdefault(key, []).append(group)
        group_of[row] = group
    identity = len(first) == num_rows == num_logits_rows and logits_rows == list(range(num_rows))
    return RowGroups(np.asarray(logits_rows, dtype=np.int64), first, group_of, identity)


def _same_ids(a: Sequence[int], b: Sequence[int]) -> bool:
    return a is b or (len(a) == len(b) and list(a) == list(b))


__all__ = ["RowGroups", "group_rows"]
