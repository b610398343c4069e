"""LoRAPins: multi-LoRA as the engine composes it -- which live requests name which adapter,
and which adapters hold a device slot at each step.

The scheduler admits at most max_loras distinct adapters into `running` (a request whose
adapter finds no slot waits). After each schedule() the engine asks `step_slots`: it pins
exactly the schedulers' active adapters in the AdapterCache (so a slot always exists), has the
runner fill newly placed slots, and returns each row's slot for the forward. An adapter
request's blocks are hashed under the salt LORA_SALT_BIT | lora_int_id (`cache_salt`), so the
prefix cache never shares KV across adapters or with the base model.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from pagedrun.runtime.errors import ERR_INVALID, PagedRunError, RequestError, describe_fault
from pagedrun.runtime.lora.adapter_cache import AdapterCache
from pagedrun.runtime.lora.errors import LoRAInUseError
from pagedrun.runtime.lora.lora_request import LoRARequest

# Prefix-cache salt of an adapter's requests: this bit | lora_int_id. The high bit keeps them
# apart from the prompt-logprobs salts (1, 2, ...) and from the base model's 0.
LORA_SALT_BIT = 1 << 63


def cache_salt(lora_int_id: int) -> int:
    return LORA_SALT_BIT | lora_int_id


class LoRAPins:
    def __init__(self, adapters: AdapterCache, schedulers: Sequence,
                 apply_slot_writes: Callable[[list], None]) -> None:
        """`schedulers`: the engine's (one per virtual engine; read for their active adapters,
        the list itself may have its entries replaced by a reset); `apply_slot_writes(writes)`:
        the runner's, filling device slots."""
        self.adapters = adapters
        self._schedulers = schedulers
        self._apply_slot_writes = apply_slot_writes
        self._pinned: set[int] = set()          # adapters pinned for the schedulers' running
        self._users: dict[int, int] = {}        # lora_int_id -> live requests naming it
        self._by_request: dict[str, LoRARequest] = {}

    # ------------------------------------------------------------------ registry (vLLM's API)
    def add(self, lora_request: LoRARequest) -> bool:
        """Register and load an adapter ahead of use. RequestError (ERR_INVALID) names why an
        adapter cannot be served."""
        if not isinstance(lora_request, LoRARequest):
            raise RequestError(ERR_INVALID, "lora_request must be a LoRARequest")
        try:
            self.adapters.add(lora_request)
        except (ValueError, PagedRunError) as exc:
            raise RequestError(ERR_INVALID, str(exc)) from None
        return True

    def remove(self, lora_int_id: int) -> bool:
        """Forget an adapter (frees its slot and host copy); False if it is not known.
        Refused (LoRAInUseError) while a live request -- running or waiting -- names it."""
        if self._users.get(lora_int_id):
            name = next((r.lora_name for r in self.adapters.known()
                         if r.lora_int_id == lora_int_id), str(lora_int_id))
            raise LoRAInUseError(f"adapter {name!r} (lora_int_id {lora_int_id}) is in use by "
                                 f"{self._users[lora_int_id]} live request(s)")
        self._sync()  # unpin what the schedulers no longer run (e.g. after a reset)
        try:
            self.adapters.remove(lora_int_id)
        except KeyError:
            return False
        return True

    def known(self) -> list[LoRARequest]:
        """Every adapter added (or used) and not removed, by lora_int_id."""
        return sorted(self.adapters.known(), key=lambda r: r.lora_int_id)

    # ------------------------------------------------------------------ requests
    def admit(self, request_id: str, lora_request: LoRARequest) -> int:
        """A new request names `lora_request`: loaded (and checked) now if it is not known,
        so a bad adapter fails admission rather than mid-flight. Returns its lora_int_id."""
        known = {r.lora_int_id: r for r in self.known()}
        if known.get(getattr(lora_request, "lora_int_id", None)) != lora_request:
            self.add(lora_request)  # loaded now, or a conflicting id refused
        return lora_request.lora_int_id

    def track(self, request_id: str, lora_request: LoRARequest) -> None:
        """The admitted request holds its adapter until `release`."""
        lora_id = lora_request.lora_int_id
        self._by_request[request_id] = lora_request
        self._users[lora_id] = self._users.get(lora_id, 0) + 1

    def release(self, request_id: str) -> None:
        lora_request = self._by_request.pop(request_id, None)
        if lora_request is None:
            return
        lora_id = lora_request.lora_int_id
        self._users[lora_id] -= 1
        if not self._users[lora_id]:
            del self._users[lora_id]

    # ------------------------------------------------------------------ each step
    def _sync(self) -> list[tuple[int, str]]:
        """Pin exactly the adapters the schedulers' running requests hold: unpin the others
        first, then pin the new ones, resident ones before those needing a slot (the
        scheduler keeps them within max_loras, so every pin finds a slot). Returns (id, why)
        of the adapters that failed to load (their requests must fail)."""
        cache = self.adapters
        active = {i for scheduler in self._schedulers for i in scheduler.get_active_lora_ids()}
        for lora_id in self._pinned - active:
            cache.release(lora_id)
        self._pinned &= active
        known = {r.lora_int_id: r for r in cache.known()}
        known.update((r.lora_int_id, r) for r in self._by_request.values())
        broken = []
        for lora_id in sorted(active - self._pinned, key=lambda i: cache.slot_of(i) is None):
            try:
                slot = cache.acquire(known[lora_id])
            except Exception as exc:  # noqa: BLE001 -- this adapter's requests fail
                broken.append((lora_id, describe_fault(f"loading adapter {lora_id}", exc)))
                continue
            if slot is None:  # the scheduler's max_loras rule makes this unreachable
                raise AssertionError(f"no device slot for adapter {lora_id}")
            self._pinned.add(lora_id)
        return broken

    def step_slots(self, out, failed: dict[str, str],
                   request_id_of: Callable[[int], str]) -> np.ndarray | None:
        """Each row of SchedulerOutput `out`: its adapter slot (-1: none), with the slots
        filled on the runner; None when no row has an adapter (then the step is exactly the
        base model's). Rows of an adapter that failed to load fail their request in
        `failed` (`request_id_of(seq_id)` names it)."""
        broken = self._sync()
        writes = self.adapters.take_slot_writes()
        if writes:
            self._apply_slot_writes(writes)
        lora_ids = out.lora_ids
        if not lora_ids.any():
            return None
        slots = np.full(out.num_reqs, -1, np.int32)
        for lora_id in np.unique(lora_ids[lora_ids > 0]).tolist():
            slot = self.adapters.slot_of(lora_id)
            if slot is not None:
                slots[lora_ids == lora_id] = slot
        for lora_id, message in broken:
            for row in np.flatnonzero(lora_ids == lora_id):
                failed.setdefault(request_id_of(int(out.req_ids[row])), message)
        return slots
