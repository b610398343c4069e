"""tests/distributed/gpu_tp_check.py (the run_all.sh step that runs NCCL at TP=1 on a GPU)
rehearsed on the CPU backends, so the script cannot rot between GPU sessions."""
from __future__ import annotations

import pytest

import gpu_tp_check


@pytest.mark.parametrize("device", ["cpu", "sim"])
def test_gpu_tp_check_on_cpu_backends(device, capsys):
    assert gpu_tp_check.main(["--device", device]) == 0
    assert "gpu_tp_check: OK" in capsys.readouterr().out
