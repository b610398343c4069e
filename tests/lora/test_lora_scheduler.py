"""The scheduler's adapter admission (max_loras): a waiting request whose adapter is not running
while max_loras others are is skipped -- it stays waiting, later requests still go -- and the
active-adapter counts follow every way into and out of `running` (admit, finish, abort, preempt,
fork). Expected states are spelled out by hand; invariants are checked after every step."""
from __future__ import annotations

import numpy as np
import pytest

from pagedrun.pyx.scheduler import Scheduler, SchedulerConfig


def make(max_loras=1, **kw):
    kw.setdefault("num_gpu_blocks", 64)
    return Scheduler(SchedulerConfig(block_size=4, max_num_batched_tokens=64, check_invariants=True,
                                     max_loras=max_loras, **kw))


def step(s, finish=()):
    """One step: every row samples token 7; rows of `finish` ids stop. Returns the output."""
    out = s.schedule()
    ids = out.req_ids.tolist()
    s.update_from_output(out, np.full(out.num_reqs, 7, np.int32),
                         np.array([i in finish for i in ids], bool))
    return out


def test_skipped_adapter_waits_and_later_requests_go():
    s = make(max_loras=1)
    s.add_request(1, [3, 4, 5], 10, lora_id=11)
    s.add_request(2, [3, 4, 6], 10, lora_id=12)   # another adapter: must wait
    s.add_request(3, [3, 4, 7], 10)               # the base model: goes past it
    s.add_request(4, [3, 4, 8], 10, lora_id=11)   # the running adapter: goes too
    out = step(s)
    assert out.req_ids.tolist() == [1, 3, 4]
    assert out.lora_ids.tolist() == [11, 0, 11]
    assert s.get_request_status(2) == "waiting"
    assert sorted(s.get_active_lora_ids()) == [11]
    step(s, finish={1})
    assert s.get_request_status(2) == "waiting"   # request 4 still holds adapter 11
    step(s, finish={4})
    assert s.get_active_lora_ids() == []
    out = step(s)
    assert out.req_ids.tolist() == [3, 2] and out.lora_ids.tolist() == [0, 12]
    assert s.get_active_lora_ids() == [12]


def test_abort_and_preempt_release_the_adapter():
    s = make(max_loras=1)
    s.add_request(1, [3, 4, 5], 20, lora_id=5)
    s.add_request(2, [3, 4, 5], 20, lora_id=6)
    step(s)
    assert s.get_active_lora_ids() == [5]
    assert s.abort_request(1)
    assert s.get_active_lora_ids() == []
    step(s)
    assert s.get_active_lora_ids() == [6]

    # 4 blocks of 4 tokens: the base request 3 runs first, the adapter request 4 (admitted
    # last) is the preemption victim once both outgrow the pool.
    s = make(max_loras=1, num_gpu_blocks=4)
    s.add_request(3, [3, 4, 5, 6], 8)
    step(s)
    s.add_request(4, [3, 4, 5, 6], 8, lora_id=5)
    for _ in range(8):
        out = step(s)
        if len(out.preempted_ids):
            break
    assert out.preempted_ids.tolist() == [4]
    assert s.get_request_status(4) == "waiting" and s.get_active_lora_ids() == []


def test_fork_counts_the_child():
    s = make(max_loras=2)
    s.add_request(1, [3, 4, 5], 20, lora_id=9)
    step(s)
    s.fork_request(1, 2)
    assert s.get_active_lora_ids() == [9]
    s.abort_request(1)
    assert s.get_active_lora_ids() == [9]   # the child still holds it
    s.abort_request(2)
    assert s.get_active_lora_ids() == []


def test_refusals():
    with pytest.raises(ValueError, match="max_loras"):
        SchedulerConfig(num_gpu_blocks=4, max_loras=-1)
    s = make(max_loras=0)
    with pytest.raises(ValueError, match="max_loras > 0"):
        s.add_request(1, [3], 4, lora_id=2)
    with pytest.raises(ValueError, match="lora_id"):
        make().add_request(1, [3], 4, lora_id=-1)
