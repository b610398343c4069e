"""Every cache path comes from runtime/paths.py: the CPU kernel harness's build cache follows
the same XDG rule as the converted-model cache."""
from __future__ import annotations

from pathlib import Path

from pagedrun.runtime import paths
from pagedrun.runtime.kernels import sim_module


def test_sim_cache_lives_under_the_cache_root(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert paths.sim_cache_dir() == tmp_path / "pagedrun" / "sim"
    assert sim_module.cache_dir() == paths.sim_cache_dir()
    assert (tmp_path / "pagedrun" / "sim").is_dir()  # the harness creates it on use


def test_relative_xdg_cache_home_is_ignored_everywhere(monkeypatch, tmp_path):
    home = tmp_path / "home"
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/ignored")
    root = Path.home() / ".cache" / "pagedrun"
    assert paths.cache_root() == root
    assert paths.models_cache_dir() == root / "models"
    assert sim_module.cache_dir() == root / "sim"
