"""AdapterCache: slots, pins, LRU eviction of unpinned adapters, waiting (None), the host
cache's own LRU, slot writes, add / remove. Expected states are spelled out by hand."""
from __future__ import annotations

import pytest

from pagedrun.runtime.lora import LoRAConfig, LoRARequest
from pagedrun.runtime.lora.adapter_cache import AdapterCache
from pagedrun.runtime.lora.errors import LoRAConfigError, LoRAInUseError


def req(i: int) -> LoRARequest:
    return LoRARequest(f"a{i}", i, f"/adapters/a{i}")


class Loader:
    """Counts loads; `fail` ids raise like a broken adapter directory would."""

    def __init__(self, fail=()):
        self.loads: list[int] = []
        self.fail = set(fail)

    def __call__(self, request: LoRARequest):
        if request.lora_int_id in self.fail:
            raise ValueError(f"cannot load {request.lora_name}")
        self.loads.append(request.lora_int_id)
        return f"weights of {request.lora_name}"


def make(max_loras=2, max_cpu_loras=None, fail=()):
    loader = Loader(fail)
    return AdapterCache(LoRAConfig(max_loras=max_loras, max_lora_rank=8,
                                   max_cpu_loras=max_cpu_loras), loader), loader


def test_free_slots_first_then_resident_hits_pin_again():
    cache, loader = make()
    assert cache.acquire(req(1)) == 0
    assert cache.acquire(req(2)) == 1
    assert cache.acquire(req(1)) == 0       # resident: same slot, no load, one more pin
    assert cache.pin_count(1) == 2 and cache.pin_count(2) == 1
    assert loader.loads == [1, 2]
    assert cache.resident_ids() == [1, 2]
    writes = cache.take_slot_writes()
    assert [(w.slot, w.lora_request.lora_int_id, w.adapter) for w in writes] == [
        (0, 1, "weights of a1"), (1, 2, "weights of a2")]
    assert cache.take_slot_writes() == []   # drained


def test_all_slots_pinned_means_wait_and_nothing_changes():
    cache, loader = make()
    cache.acquire(req(1))
    cache.acquire(req(2))
    cache.take_slot_writes()
    assert not cache.can_acquire(req(3))
    assert cache.acquire(req(3)) is None
    assert cache.resident_ids() == [1, 2] and loader.loads == [1, 2]
    assert cache.take_slot_writes() == []
    cache.release(2)
    assert cache.can_acquire(req(3))
    assert cache.acquire(req(3)) == 1       # 2 was the only unpinned one
    assert cache.resident_ids() == [1, 3]
    assert [(w.slot, w.lora_request.lora_int_id) for w in cache.take_slot_writes()] == [(1, 3)]


def test_lru_evicts_the_least_recently_used_unpinned_adapter():
    cache, _ = make(max_loras=3, max_cpu_loras=3)
    for i in (1, 2, 3):
        cache.acquire(req(i))
    for i in (2, 1, 3):      # released in this order: LRU is now 2, 1, 3
        cache.release(i)
    assert cache.lru_order() == [2, 1, 3]
    cache.acquire(req(1))    # a hit refreshes 1 (and pins it)
    assert cache.lru_order() == [2, 3, 1]
    assert cache.acquire(req(4)) == 1   # evicts 2 (slot 1)
    assert cache.acquire(req(5)) == 2   # evicts 3 (slot 2); 1 is pinned
    assert cache.resident_ids() == [1, 4, 5]
    assert cache.slot_of(2) is None and cache.slot_of(3) is None


def test_pinned_lru_adapter_is_skipped():
    cache, _ = make()
    cache.acquire(req(1))   # oldest, stays pinned
    cache.acquire(req(2))
    cache.release(2)
    assert cache.acquire(req(3)) == 1
    assert cache.resident_ids() == [1, 3]


def test_host_cache_keeps_max_cpu_loras_and_evicts_non_resident_lru():
    cache, loader = make(max_loras=1, max_cpu_loras=2)
    cache.acquire(req(1))
    cache.release(1)
    cache.acquire(req(2))   # evicts 1 from the slot; host keeps 1 and 2
    cache.release(2)
    assert cache.host_ids() == [1, 2]
    cache.acquire(req(1))   # host hit: no new load
    assert loader.loads == [1, 2]
    cache.release(1)
    cache.acquire(req(3))   # host full: evicts 2 (LRU and not resident), 1 stays
    assert cache.host_ids() == [1, 3]
    cache.release(3)
    cache.acquire(req(2))   # 2 must be loaded again
    assert loader.loads == [1, 2, 3, 2]


def test_equal_slot_and_host_capacity_still_fills_a_slot():
    cache, loader = make(max_loras=2, max_cpu_loras=2)
    for i in (1, 2):
        cache.acquire(req(i))
        cache.release(i)
    assert cache.acquire(req(3)) == 0       # slot victim 1 is also the host victim
    assert cache.host_ids() == [2, 3] and loader.loads == [1, 2, 3]


def test_only_the_last_write_of_a_slot_is_kept():
    cache, _ = make(max_loras=1)
    cache.acquire(req(1))
    cache.release(1)
    cache.acquire(req(2))   # before anyone applied slot 0's write of adapter 1
    writes = cache.take_slot_writes()
    assert [(w.slot, w.lora_request.lora_int_id) for w in writes] == [(0, 2)]


def test_release_without_acquire_is_an_error():
    cache, _ = make()
    with pytest.raises(ValueError, match="which no request holds"):
        cache.release(1)
    cache.acquire(req(1))
    cache.release(1)
    with pytest.raises(ValueError):
        cache.release(1)


def test_remove_refused_while_in_use_allowed_when_idle():
    cache, _ = make()
    cache.acquire(req(1))
    with pytest.raises(LoRAInUseError, match=r"'a1' \(lora_int_id 1\) is in use by 1"):
        cache.remove(1)
    cache.release(1)
    cache.remove(1)
    assert cache.slot_of(1) is None and cache.host_ids() == [] and cache.known() == []
    assert cache.resident_ids() == [None, None]
    assert cache.take_slot_writes() == []    # the queued write of a removed adapter is dropped
    with pytest.raises(KeyError):
        cache.remove(1)


def test_add_loads_ahead_and_lists_the_adapter():
    cache, loader = make(max_loras=1, max_cpu_loras=2)
    cache.add(req(7))
    assert loader.loads == [7] and cache.host_ids() == [7] and cache.resident_ids() == [None]
    assert [r.lora_name for r in cache.known()] == ["a7"]
    cache.acquire(req(7))
    assert loader.loads == [7]               # served from the host cache


def test_failed_load_changes_nothing():
    cache, _ = make(max_loras=1, fail={2})
    cache.acquire(req(1))
    cache.release(1)
    with pytest.raises(ValueError, match="cannot load a2"):
        cache.acquire(req(2))
    assert cache.resident_ids() == [1] and [r.lora_int_id for r in cache.known()] == [1]
    with pytest.raises(ValueError):
        cache.add(req(2))
    assert [r.lora_int_id for r in cache.known()] == [1]


def test_an_id_names_one_adapter():
    cache, _ = make()
    cache.acquire(req(1))
    with pytest.raises(LoRAConfigError, match="lora_int_id 1 is adapter 'a1'"):
        cache.acquire(LoRARequest("other", 1, "/elsewhere"))


def test_without_a_loader_writes_carry_the_request_only():
    cache = AdapterCache(LoRAConfig(max_loras=1))
    assert cache.acquire(req(4)) == 0
    (write,) = cache.take_slot_writes()
    assert write.adapter is None and write.lora_request == req(4)
