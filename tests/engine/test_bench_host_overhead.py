"""benchmarks/bench_host_overhead.py must keep running: its `--smoke --json` run (levels 1 and 8,
3 measured steps, the default model's config cut to 2 layers) runs here in a subprocess (the
benchmark patches engine methods and a kernel-planning constant while it runs), and its JSON is
checked for structure and sane counts. No timing is asserted."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_host_overhead.py"
SMOKE_LEVELS = [1, 8]
SMOKE_STEPS = 3
SMOKE_NUM_LAYERS = 2
BACKENDS = ["null", "recording", "recording-graphs"]
PHASES = {"schedule", "input_prep", "launches", "sampling", "postprocess", "detokenize",
          "stop_checks", "scheduler_update", "output_objects", "other", "total"}
POINTER_BYTES = 8


@pytest.fixture(scope="module")
def smoke() -> dict:
    from pagedrun.runtime.errors import ModelLoadError
    from pagedrun.runtime.model_loader import resolve_model_dir

    try:
        resolve_model_dir(None, progress=False)  # the benchmark reads its config + tokenizer
    except ModelLoadError as exc:  # the default model package is not installed
        pytest.skip(str(exc))
    proc = subprocess.run([sys.executable, str(BENCH), "--smoke", "--json"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "| seqs | backend |" in proc.stderr  # the table goes to stderr under a bare --json
    return json.loads(proc.stdout)


def _runs(result: dict, backend: str) -> list[dict]:
    return [r for r in result["runs"] if r["backend"] == backend]


def test_header_names_the_machine_and_the_setup(smoke):
    assert smoke["cpu"] and smoke["num_cpus"] >= 1
    assert len(smoke["load_average_start"]) == 3 and len(smoke["load_average_end"]) == 3
    assert smoke["levels"] == SMOKE_LEVELS and smoke["backends"] == BACKENDS
    assert smoke["steps"] == SMOKE_STEPS and smoke["num_hidden_layers"] == SMOKE_NUM_LAYERS
    assert smoke["vocab_size"] == 49152  # the default model's vocabulary: sampling's cost
    assert "--smoke" in smoke["command"]


def test_every_level_and_backend_completed_its_steps_with_every_phase(smoke):
    seen = sorted((r["num_seqs"], r["backend"]) for r in smoke["runs"])
    assert seen == sorted((n, b) for n in SMOKE_LEVELS for b in BACKENDS)
    for run in smoke["runs"]:
        assert run["steps_measured"] == SMOKE_STEPS
        assert set(run["median_us"]) == PHASES
        # Exclusive phases come from nested timers: none can be negative, none exceeds the step.
        assert all(0 <= v <= run["median_us"]["total"] for v in run["median_us"].values())
        assert run["median_us"]["total"] > 0
        assert run["total_us_per_seq"] == pytest.approx(run["median_us"]["total"]
                                                        / run["num_seqs"])
        assert 0 < run["host_us_per_seq_without_sampling"] <= run["total_us_per_seq"]


def test_null_backend_op_calls_do_not_depend_on_the_batch(smoke):
    calls = {r["num_seqs"]: r["op_calls_per_step"] for r in _runs(smoke, "null")}
    # At least one op per layer; the forward's op sequence is the same at every batch size.
    assert min(calls.values()) >= SMOKE_NUM_LAYERS
    assert len(set(calls.values())) == 1


def test_recording_backend_counts_launches_and_argument_bytes(smoke):
    for run in _runs(smoke, "recording"):
        launches = run["kernel_launches_per_step"]
        by_kernel = run["launches_by_kernel"]
        assert launches >= SMOKE_NUM_LAYERS
        assert sum(by_kernel.values()) == launches
        assert by_kernel["sample_f32"] == 1  # one sampling launch per step, whatever the batch
        # Every layer writes its K/V once and attends once.
        assert sum(v for k, v in by_kernel.items() if k.startswith("rotary_cache_write")) \
            == SMOKE_NUM_LAYERS
        assert sum(v for k, v in by_kernel.items()
                   if k.startswith("paged_attention_decode_") and "merge" not in k) \
            == SMOKE_NUM_LAYERS
        # Every kernel takes at least one device pointer.
        assert run["kernel_arg_bytes_per_step"] >= POINTER_BYTES * launches


def test_decode_graphs_make_a_step_one_launch_and_the_sampler(smoke):
    """With the cuda backend's default graph sizes, a decode step of 1 or 8 sequences issues
    one graph launch and the sampling kernel, where the eager step issues every op's."""
    eager = {r["num_seqs"]: r["kernel_launches_per_step"] for r in _runs(smoke, "recording")}
    for run in _runs(smoke, "recording-graphs"):
        assert run["launches_by_kernel"] == {"cudaGraphLaunch": 1, "sample_f32": 1}
        assert run["kernel_launches_per_step"] == 2 < eager[run["num_seqs"]]
