"""The cpu kernels' instruction-set cap (runtime/cpu_isa.py, EngineConfig.cpu_isa, --cpu-isa):
what "auto" resolves to in each compiled module under each level, the process ceiling the test
suite's --cpu-isa sets, the config and CLI plumbing, and that an AVX2-only CPU runs the AVX2
paths (not the portable reference) with no flag."""
from __future__ import annotations

import pytest

from pagedrun.runtime import cpu_isa
from pagedrun.runtime.engine_config import CPU_ISAS, EngineConfig, EngineConfigError

pytest.importorskip("pagedrun.pyx.cpu_gemm")

from pagedrun.pyx import cpu_gemm, cpu_ops  # noqa: E402


@pytest.fixture
def restore_cap():
    before = cpu_isa._ceiling
    yield
    cpu_isa.set_ceiling(before)


def _best(paths, allowed):
    return next(p for p in paths if p in allowed)


@pytest.mark.parametrize("level", CPU_ISAS)
def test_each_level_caps_every_module(level, restore_cap):
    cpu_isa.set_ceiling("auto")
    assert cpu_isa.apply(level) == level
    got = cpu_isa.paths()
    allowed = {"auto": None, "amx": None,
               "avx512": {"avx512bf16", "avx512vnni", "avx512", "avx2", "portable"},
               "avx2": {"avx2", "portable"}, "portable": {"portable"}}[level]
    if allowed is None:  # no cap: the fastest each module's CPU runs
        assert got == {"gemm": cpu_gemm.available_paths()[0],
                       "gguf": cpu_gemm.available_gguf_paths()[0],
                       "ops": cpu_ops.available_paths()[0]}
    else:
        assert got == {"gemm": _best(cpu_gemm.available_paths(), allowed),
                       "gguf": _best(cpu_gemm.available_gguf_paths(), allowed),
                       "ops": _best(cpu_ops.available_paths(), allowed)}
    assert f"GGUF GEMM {got['gguf']}" in cpu_isa.describe(level)


def test_an_avx2_cpu_runs_the_avx2_paths_without_a_flag(restore_cap):
    """On an AVX2-only CPU (Zen 2/3) "auto" is AVX2 everywhere; on a bigger CPU, capping at
    avx2 gives the same paths. Either way no x86-64 CPU with AVX2 gets the portable loops."""
    cpu_isa.set_ceiling("auto")
    if not (cpu_gemm.has_avx2_fma() and cpu_ops.has_avx2()):
        assert cpu_isa.detected_isa() == "portable"
        return
    level = cpu_isa.detected_isa()
    cpu_isa.apply("auto" if level == "avx2" else "avx2")
    assert cpu_isa.paths() == {"gemm": "avx2", "gguf": "avx2", "ops": "avx2"}


def test_the_ceiling_bounds_every_later_apply(restore_cap):
    cpu_isa.set_ceiling("portable")
    assert cpu_isa.apply("auto") == "portable"
    assert cpu_isa.paths() == {"gemm": "portable", "gguf": "portable", "ops": "portable"}
    assert "capped at portable" in cpu_isa.describe()
    cpu_isa.set_ceiling("avx2")
    assert cpu_isa.apply("portable") == "portable"  # a lower level still wins
    assert cpu_isa.apply("amx") == "avx2"
    assert cpu_isa.lower("auto", "avx512") == "avx512"
    with pytest.raises(ValueError, match="cpu_isa"):
        cpu_isa.apply("sse2")


def test_forced_paths_ignore_the_cap(restore_cap):
    import numpy as np

    cpu_isa.set_ceiling("portable")
    x = np.ones((2, 64), np.float32)
    packed = cpu_gemm.PackedWeight(np.ones((16, 64), np.float32))
    for path in cpu_gemm.available_paths():  # still runnable by name
        np.testing.assert_allclose(cpu_gemm.gemm_bf16(x, packed, path=path), 64.0)


def test_config_and_cli(restore_cap):
    assert EngineConfig().cpu_isa == "auto"
    with pytest.raises(EngineConfigError, match="cpu_isa"):
        EngineConfig(cpu_isa="avx1024")
    from pagedrun.server.cli import build_parser
    from pagedrun.server.serve_cmd import engine_config_from_args

    parser = build_parser()
    args = parser.parse_args(["serve", "--cpu-isa", "avx2"])
    assert engine_config_from_args(args).cpu_isa == "avx2"
    args = parser.parse_args(["generate", "hi", "--cpu-isa", "portable"])
    assert args.cpu_isa == "portable"
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--cpu-isa", "sse2"])


def test_make_backend_applies_the_engine_level(restore_cap):
    from pagedrun.runtime.backends.factory import make_backend

    cpu_isa.set_ceiling("auto")
    make_backend("cpu", "bfloat16", cpu_isa="portable")
    assert cpu_isa.paths()["gemm"] == "portable"
    make_backend("cpu", "bfloat16")
    assert cpu_isa.paths()["gemm"] == cpu_gemm.available_paths()[0]
