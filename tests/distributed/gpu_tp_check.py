"""The tensor-parallel path at TP=1 on one device, against the plain ModelRunner, step by step.

    python tests/distributed/gpu_tp_check.py --device cuda   # tests/gpu/run_all.sh: NCCL
    python tests/distributed/gpu_tp_check.py --device cpu    # CpuCommunicator (CI rehearsal)

On cuda this runs everything tensor parallelism adds, with NCCL as the communicator: the NCCL
unique id created by rank 0 and passed through the plan, `NcclCommunicator` (a 1-rank
communicator; allReduce / allGather on the compute stream), sharded loading from safetensors,
ShardedLlamaModel's masked embedding and logits gather, TensorParallelExecutor.execute. First
the communicator alone (all-reduce of bf16 / fp32 equals its input at one rank; gather is
[x]), then a tiny model's greedy decode through both runners: the logits must be identical
(one rank: the collectives move no values, so any difference is a bug in the path).
Exit 0 and "gpu_tp_check: OK" when everything matched.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from tp_helpers import write_model_dir  # noqa: E402

from pagedrun.pyx.scheduler import Scheduler, SchedulerConfig  # noqa: E402
from pagedrun.runtime.backends import make_backend  # noqa: E402
from pagedrun.runtime.distributed.executor import TensorParallelExecutor  # noqa: E402
from pagedrun.runtime.model_config import ModelConfig  # noqa: E402
from pagedrun.runtime.model_runner import ModelRunner  # noqa: E402
from pagedrun.runtime.weights import load_model_weights  # noqa: E402

BLOCK_SIZE = 16
NUM_BLOCKS = 64
MAX_MODEL_LEN = 256
PROMPT_LENS = (1, 19, 40)
MAX_TOKENS = 6


def check_nccl_communicator() -> None:
    import cupy

    from pagedrun.runtime.distributed.nccl_communicator import NcclCommunicator

    comm = NcclCommunicator(0, 1, NcclCommunicator.make_unique_id())
    for dtype in (np.float32, np.uint16):
        x = cupy.asarray(np.random.default_rng(0).integers(0, 1 << 14, (5, 37)).astype(dtype))
        want = x.copy()
        got = comm.all_reduce(x)
        assert bool((got == want).all()), f"all_reduce at one rank changed {dtype} values"
        parts = comm.gather(want)
        assert len(parts) == 1 and bool((parts[0] == want).all())
    cupy.cuda.get_current_stream().synchronize()
    comm.close()
    print("gpu_tp_check: NCCL communicator OK")


def run(device: str) -> None:
    if device == "cuda":
        check_nccl_communicator()
    with tempfile.TemporaryDirectory() as tmp:
        # head_dim 64: served by the attention kernels of the sim / cuda backends.
        model_dir = write_model_dir(os.path.join(tmp, "m"), hidden_size=128,
                                    num_attention_heads=2, num_key_value_heads=2)
        config = ModelConfig.from_model_dir(model_dir)
        ops = make_backend(device, "auto")
        plain = ModelRunner(config, load_model_weights(model_dir, config), block_size=BLOCK_SIZE,
                            num_gpu_blocks=NUM_BLOCKS, num_cpu_blocks=0,
                            max_model_len=MAX_MODEL_LEN, ops=ops)
        tp = TensorParallelExecutor(model_dir, config, tp_size=1, device=device, dtype="auto",
                                    block_size=BLOCK_SIZE, max_model_len=MAX_MODEL_LEN,
                                    num_gpu_blocks=NUM_BLOCKS, num_cpu_blocks=0, ops=ops)
        try:
            scheduler = Scheduler(SchedulerConfig(
                num_gpu_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, max_num_seqs=8,
                max_num_batched_tokens=32, max_model_len=MAX_MODEL_LEN,
                enable_prefix_caching=True, num_cpu_blocks=0, preemption_mode="recompute",
                check_invariants=True))
            rng = np.random.default_rng(3)
            for i, n in enumerate(PROMPT_LENS):
                scheduler.add_request(i + 1, rng.integers(3, config.vocab_size, n,
                                                          dtype=np.int32), MAX_TOKENS)
            steps = 0
            while scheduler.has_unfinished_requests():
                out = scheduler.schedule()
                want, got = plain.execute(out), tp.execute(out)
                assert np.array_equal(want.sample_rows, got.sample_rows)
                assert got.logits.shape == want.logits.shape, (got.logits.shape,
                                                               want.logits.shape)
                diff = float(np.abs(got.logits - want.logits).max()) if want.logits.size else 0.0
                assert diff == 0.0, f"step {steps}: logits differ by {diff}"
                tokens = np.zeros(out.num_reqs, np.int32)
                tokens[want.sample_rows] = want.logits.argmax(axis=1)
                scheduler.update_from_output(out, tokens)
                steps += 1
        finally:
            tp.close()
    print(f"gpu_tp_check: TP=1 path ({'NCCL' if device == 'cuda' else 'CpuCommunicator'}) "
          f"matches ModelRunner over {steps} steps on {device}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", choices=("cuda", "sim", "cpu"))
    args = p.parse_args(argv)
    run(args.device)
    print("gpu_tp_check: OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
