"""AdapterCache: which adapters sit in the max_loras device slots and the max_cpu_loras host
cache, and which running requests hold them. Pure bookkeeping, no device and no scheduler:

    cache = AdapterCache(LoRAConfig(max_loras=2, max_cpu_loras=4), load=loader)
    slot = cache.acquire(request.lora_request)   # int: runs in that slot; None: must wait
    ...
    cache.release(request.lora_request.lora_int_id)   # finished, aborted or preempted
    for write in cache.take_slot_writes():            # before the step runs: fill the slots
        stack.write_slot(write.slot, write.adapter)

Rules:
- A slot is pinned while any request holding its adapter runs (pin count per adapter: one per
  acquire, minus one per release). Pinned slots are never evicted.
- acquire of a resident adapter pins it and returns its slot. Otherwise it takes a free slot,
  or evicts the least recently used unpinned adapter (used = acquired or released); when every
  slot is pinned it returns None and changes nothing: the request waits (scheduler-visible, not
  a failure) and asks again on a later step, after some release.
- A newly placed adapter is queued as a SlotWrite; the owner of the device weights applies the
  writes before the next step (only the last write of a slot is kept).
- Host cache: `load(lora_request)` results for up to max_cpu_loras adapters, evicting the least
  recently used one that is not in a slot (max_cpu_loras >= max_loras guarantees one exists when
  a slot is being filled). `add` loads an adapter ahead of use (server start, a load message)
  and keeps it when there is room; `remove` forgets one, refused while it is pinned.
- An adapter's identity is lora_int_id; reusing an id with another name or path is an error.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

from pagedrun.runtime.lora.errors import LoRAConfigError, LoRAInUseError
from pagedrun.runtime.lora.lora_config import LoRAConfig
from pagedrun.runtime.lora.lora_request import LoRARequest


@dataclass(frozen=True)
class SlotWrite:
    """Device slot `slot` must hold this adapter before the next step runs."""

    slot: int
    lora_request: LoRARequest
    adapter: object   # the host cache's `load` result (None when the cache has no loader)


class AdapterCache:
    def __init__(self, config: LoRAConfig,
                 load: Callable[[LoRARequest], object] | None = None) -> None:
        self.config = config
        self._load = load
        self._slots: list[int | None] = [None] * config.max_loras   # slot -> lora_int_id
        self._slot_of: dict[int, int] = {}
        self._pins: dict[int, int] = {}
        self._recent: OrderedDict[int, None] = OrderedDict()   # resident ids, LRU first
        self._host: OrderedDict[int, object] = OrderedDict()   # host cache, LRU first
        self._known: dict[int, LoRARequest] = {}
        self._writes: dict[int, SlotWrite] = {}

    # -- queries ---------------------------------------------------------------------------
    def slot_of(self, lora_int_id: int) -> int | None:
        return self._slot_of.get(lora_int_id)

    def pin_count(self, lora_int_id: int) -> int:
        return self._pins.get(lora_int_id, 0)

    def resident_ids(self) -> list[int | None]:
        """lora_int_id per slot (None: free)."""
        return list(self._slots)

    def lru_order(self) -> list[int]:
        """Resident adapters, least recently used first."""
        return list(self._recent)

    def host_ids(self) -> list[int]:
        """Adapters in the host cache, least recently used first."""
        return list(self._host)

    def known(self) -> list[LoRARequest]:
        """Every adapter added or acquired and not removed (model info lists these)."""
        return list(self._known.values())

    def can_acquire(self, lora_request: LoRARequest) -> bool:
        """Whether acquire would succeed now (no side effects)."""
        return (lora_request.lora_int_id in self._slot_of or None in self._slots
                or self._victim() is not None)

    # -- changes ---------------------------------------------------------------------------
    def add(self, lora_request: LoRARequest) -> None:
        """Register and load an adapter ahead of use (errors surface now, not at a request)."""
        new = self._register(lora_request)
        if lora_request.lora_int_id not in self._host:
            adapter = self._loaded(lora_request, new)
            if self._make_host_room():
                self._host[lora_request.lora_int_id] = adapter

    def acquire(self, lora_request: LoRARequest) -> int | None:
        """The slot this request runs its adapter in (pinned until release), or None: wait."""
        new = self._register(lora_request)
        lora_id = lora_request.lora_int_id
        slot = self._slot_of.get(lora_id)
        if slot is None:
            if None not in self._slots and self._victim() is None:
                return None
            # Load before evicting anything: a failed load leaves the cache as it was.
            adapter = (self._host[lora_id] if lora_id in self._host
                       else self._loaded(lora_request, new))
            slot = self._slots.index(None) if None in self._slots else self._evict(self._victim())
            if lora_id not in self._host:
                if not self._make_host_room():  # unreachable while max_cpu_loras >= max_loras
                    raise AssertionError("host cache full of resident adapters")
                self._host[lora_id] = adapter
            self._slots[slot] = lora_id
            self._slot_of[lora_id] = slot
            self._writes[slot] = SlotWrite(slot, lora_request, adapter)
        self._pins[lora_id] = self._pins.get(lora_id, 0) + 1
        self._touch(lora_id)
        return slot

    def release(self, lora_int_id: int) -> None:
        """One running request of this adapter stopped (finished, aborted, preempted)."""
        if self._pins.get(lora_int_id, 0) < 1:
            raise ValueError(f"release of adapter {lora_int_id}, which no request holds")
        self._pins[lora_int_id] -= 1
        if not self._pins[lora_int_id]:
            del self._pins[lora_int_id]
        self._touch(lora_int_id)

    def remove(self, lora_int_id: int) -> None:
        """Forget an adapter (frees its slot and host entry); refused while requests hold it."""
        if lora_int_id not in self._known:
            raise KeyError(f"no adapter with lora_int_id {lora_int_id}")
        if self.pin_count(lora_int_id):
            raise LoRAInUseError(f"adapter {self._known[lora_int_id].lora_name!r} "
                                 f"(lora_int_id {lora_int_id}) is in use by "
                                 f"{self.pin_count(lora_int_id)} running request(s)")
        if lora_int_id in self._slot_of:
            self._evict(lora_int_id)
        self._host.pop(lora_int_id, None)
        del self._known[lora_int_id]

    def take_slot_writes(self) -> list[SlotWrite]:
        """The slot writes queued since the last call, by slot; the caller applies them."""
        writes = [self._writes[slot] for slot in sorted(self._writes)]
        self._writes.clear()
        return writes

    # -- internals -------------------------------------------------------------------------
    def _register(self, lora_request: LoRARequest) -> bool:
        """Record the adapter; True when it was not known before."""
        known = self._known.get(lora_request.lora_int_id)
        if known is not None and known != lora_request:
            raise LoRAConfigError(
                f"lora_int_id {lora_request.lora_int_id} is adapter {known.lora_name!r} at "
                f"{known.lora_path!r}, not {lora_request.lora_name!r} at "
                f"{lora_request.lora_path!r}")
        self._known[lora_request.lora_int_id] = lora_request
        return known is None

    def _loaded(self, lora_request: LoRARequest, new: bool) -> object:
        """`load(lora_request)`; an adapter that fails to load is not kept as known."""
        if self._load is None:
            return None
        try:
            return self._load(lora_request)
        except Exception:
            if new:
                del self._known[lora_request.lora_int_id]
            raise

    def _touch(self, lora_id: int) -> None:
        if lora_id in self._slot_of:
            self._recent[lora_id] = None
            self._recent.move_to_end(lora_id)
        if lora_id in self._host:
            self._host.move_to_end(lora_id)

    def _victim(self) -> int | None:
        """The least recently used resident adapter no running request holds."""
        return next((i for i in self._recent if not self._pins.get(i)), None)

    def _evict(self, lora_id: int) -> int:
        slot = self._slot_of.pop(lora_id)
        self._slots[slot] = None
        self._recent.pop(lora_id, None)
        self._writes.pop(slot, None)
        return slot

    def _make_host_room(self) -> bool:
        """Evict host entries (LRU, not in a slot) until one more fits; False if none can go."""
        while len(self._host) >= self.config.max_cpu_loras:
            victim = next((i for i in self._host if i not in self._slot_of), None)
            if victim is None:
                return False
            del self._host[victim]
        return True
