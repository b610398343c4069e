"""Prebuilt fatbins: the manifest check and the fatbin-or-NVRTC choice
(runtime/kernels/prebuilt.py), the cuda loader's use of both and the NVRTC code string's source
hash (runtime/kernels/loader.py, against a cupy stand-in), and the CMake build of a fatbin with
its manifest (slow; skipped without nvcc and cmake)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest

from pagedrun.runtime.kernels import loader, prebuilt

REPO = Path(__file__).resolve().parents[2]
NVCC_FLAGS = ["-std=c++17", "-O3"]


def _fake_install(tmp_path: Path, cubins=("sm_80", "sm_90a"), ptx=("compute_90",)):
    """A copy of cuda/ (sources and headers) with a manifest and a dummy fatbin for each .cu,
    as the build would install them (the selection never reads the fatbin's bytes)."""
    cuda_dir = tmp_path / "cuda"
    shutil.copytree(prebuilt.CUDA_DIR, cuda_dir, ignore=shutil.ignore_patterns("prebuilt"))
    out = cuda_dir / "prebuilt"
    out.mkdir()
    for cu in sorted(cuda_dir.glob("*.cu")):
        prebuilt.fatbin_path(cu.name, out).write_bytes(b"fatbin")
        info = {"source": cu.name, "source_sha256": prebuilt.source_sha256(cu.name, cuda_dir),
                "nvcc_version": "13.0.88", "cubins": list(cubins), "ptx": list(ptx),
                "options": [], "nvcc_flags": NVCC_FLAGS}
        prebuilt.manifest_path(cu.name, out).write_text(json.dumps(info))
    return cuda_dir, out


@pytest.mark.parametrize("arch, device, ok", [
    ("sm_80", 80, True), ("sm_80", 86, True), ("sm_80", 89, True), ("sm_80", 90, False),
    ("sm_80", 75, False), ("sm_90a", 90, True), ("sm_90a", 100, False), ("sm_90a", 89, False),
    ("sm_90", 90, True), ("compute_90", 90, True), ("compute_90", 120, True),
    ("compute_90", 89, False), ("compute_80", 86, True),
])
def test_covers(arch, device, ok):
    assert prebuilt.covers(arch, device) is ok


def test_covers_rejects_garbage():
    with pytest.raises(ValueError):
        prebuilt.covers("gfx90a", 90)


@pytest.mark.parametrize("device", [80, 86, 90, 100])
def test_matching_fatbin_is_selected(tmp_path, device):
    cuda_dir, out = _fake_install(tmp_path)
    for cu in sorted(cuda_dir.glob("*.cu")):
        kind, where = prebuilt.select_module_source(cu.name, device, out, (), cuda_dir)
        assert (kind, where) == ("prebuilt", prebuilt.fatbin_path(cu.name, out))


def test_uncovered_device_falls_back(tmp_path):
    cuda_dir, out = _fake_install(tmp_path, ptx=())
    kind, why = prebuilt.select_module_source("gemm.cu", 100, out, (), cuda_dir)
    assert kind == "nvrtc" and "sm_100" in why
    kind, why = prebuilt.select_module_source("gemm.cu", 75, out, (), cuda_dir)
    assert kind == "nvrtc" and "sm_75" in why


def test_stale_fatbin_is_rejected(tmp_path):
    cuda_dir, out = _fake_install(tmp_path)
    assert prebuilt.select_module_source("rms_norm.cu", 90, out, (), cuda_dir)[0] == "prebuilt"
    src = cuda_dir / "rms_norm.cu"
    src.write_text(src.read_text() + "\n// edited after the build\n")
    kind, why = prebuilt.select_module_source("rms_norm.cu", 90, out, (), cuda_dir)
    assert kind == "nvrtc" and "stale" in why
    # Another source that does not change stays prebuilt...
    assert prebuilt.select_module_source("gemm.cu", 90, out, (), cuda_dir)[0] == "prebuilt"
    # ...until a header every kernel includes changes.
    header = cuda_dir / "common.cuh"
    header.write_text(header.read_text() + "\n// edited header\n")
    kind, why = prebuilt.select_module_source("gemm.cu", 90, out, (), cuda_dir)
    assert kind == "nvrtc" and "stale" in why


def test_missing_or_broken_manifest_falls_back(tmp_path):
    cuda_dir, out = _fake_install(tmp_path)
    prebuilt.manifest_path("embedding.cu", out).unlink()
    kind, why = prebuilt.select_module_source("embedding.cu", 90, out, (), cuda_dir)
    assert kind == "nvrtc" and "no prebuilt" in why
    prebuilt.manifest_path("sampling.cu", out).write_text("{not json")
    kind, why = prebuilt.select_module_source("sampling.cu", 90, out, (), cuda_dir)
    assert kind == "nvrtc" and "unreadable" in why
    prebuilt.fatbin_path("activation.cu", out).unlink()
    assert prebuilt.select_module_source("activation.cu", 90, out, (), cuda_dir)[0] == "nvrtc"
    kind, why = prebuilt.select_module_source("gemm.cu", 90, tmp_path / "absent", (), cuda_dir)
    assert kind == "nvrtc"


def test_manifest_of_another_source_is_rejected(tmp_path):
    cuda_dir, out = _fake_install(tmp_path)
    shutil.copy(prebuilt.manifest_path("gemm.cu", out), prebuilt.manifest_path("rms_norm.cu", out))
    kind, why = prebuilt.select_module_source("rms_norm.cu", 90, out, (), cuda_dir)
    assert kind == "nvrtc" and "gemm.cu" in why


def test_extra_options_need_nvrtc(tmp_path):
    cuda_dir, out = _fake_install(tmp_path)
    kind, why = prebuilt.select_module_source("gemm.cu", 90, out, ("-DHEAD_DIM=64",), cuda_dir)
    assert kind == "nvrtc" and "options" in why


def test_summary(tmp_path):
    cuda_dir, out = _fake_install(tmp_path)
    n = len(list(cuda_dir.glob("*.cu")))
    assert prebuilt.prebuilt_summary(out, cuda_dir).startswith(f"{n}/{n} sources")
    assert prebuilt.prebuilt_summary(tmp_path / "absent", cuda_dir).startswith("none")


def test_nvrtc_code_hash_follows_every_source(tmp_path):
    """CuPy's disk cache keys on the code string: it must change with any included file and
    stay put otherwise (a restart must hit the cache)."""
    cuda_dir = tmp_path / "cuda"
    shutil.copytree(loader.CUDA_DIR, cuda_dir, ignore=shutil.ignore_patterns("prebuilt"))
    first = loader.sources_digest(cuda_dir)
    assert loader.sources_digest(cuda_dir) == first
    (cuda_dir / "prebuilt").mkdir()
    (cuda_dir / "prebuilt" / "gemm.fatbin").write_bytes(b"x")  # build outputs do not count
    assert loader.sources_digest(cuda_dir) == first
    ptx = cuda_dir / "ptx.cuh"
    ptx.write_text(ptx.read_text() + "\n")
    assert loader.sources_digest(cuda_dir) != first


def _nvcc() -> str | None:
    for candidate in (shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"):
        if candidate and Path(candidate).is_file():
            return candidate
    return None


def _build_env() -> dict:
    """The environment for cmake/nvcc subprocesses: without a sanitizer runtime that the
    sanitizer CI tier preloads into Python (it is not meant for the compilers, and breaks them)."""
    return {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD",)}


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, **kw)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc


@pytest.mark.slow
@pytest.mark.skipif(_nvcc() is None or shutil.which("cmake") is None,
                    reason="needs nvcc and cmake")
def test_cmake_builds_fatbin_with_manifest(tmp_path):
    """The CMake option forced ON: one fatbin target builds and installs with a manifest the
    loader accepts for the installed source; the installed file is a real fatbin."""
    build = tmp_path / "build"
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    _run(["cmake", "-S", str(REPO), "-B", str(build), *generator,
          f"-DPython_EXECUTABLE={sys.executable}", "-DPAGEDRUN_BUILD_FATBINS=ON",
          "-DPAGEDRUN_FATBIN_CUBINS=sm_80", "-DPAGEDRUN_FATBIN_PTX=compute_90"], env=_build_env())
    _run(["cmake", "--build", str(build), "--target", "pagedrun_fatbin_activation"],
         env=_build_env())
    fatbin = build / "prebuilt" / "activation.fatbin"
    manifest = build / "prebuilt" / "activation.json"
    assert fatbin.stat().st_size > 0
    info = json.loads(manifest.read_text())
    assert info["cubins"] == ["sm_80"] and info["ptx"] == ["compute_90"]
    assert info["source_sha256"] == prebuilt.source_sha256("activation.cu")
    # A fatbin starts with its magic number 0xBA55ED50 (little-endian).
    assert fatbin.read_bytes()[:4] == bytes.fromhex("50ed55ba")
    out = build / "prebuilt"
    assert prebuilt.select_module_source("activation.cu", 86, out)[0] == "prebuilt"
    assert prebuilt.select_module_source("activation.cu", 120, out)[0] == "prebuilt"  # PTX
    assert prebuilt.select_module_source("activation.cu", 75, out)[0] == "nvrtc"


def _nvcc_dirs() -> list[str]:
    """Every folder CMake could find this machine's nvcc in."""
    dirs = {"/usr/local/cuda/bin"}
    nvcc = _nvcc()
    if nvcc:
        dirs.update({str(Path(nvcc).parent), str(Path(nvcc).resolve().parent)})
    return sorted(dirs)


@pytest.mark.parametrize("mode", ["AUTO", "ON", "OFF"])
def test_cmake_without_nvcc_configures(tmp_path, mode):
    """Without nvcc (hidden from PATH, CUDA_HOME and the default location) the configure never
    fails, whatever the option says: the wheel simply has no fatbins."""
    if shutil.which("cmake") is None:
        pytest.skip("needs cmake")
    build = tmp_path / "build"
    env = {k: v for k, v in _build_env().items() if k not in ("CUDA_HOME", "CUDA_PATH")}
    env["PATH"] = "/usr/bin:/bin"
    if Path("/usr/bin/nvcc").exists():
        pytest.skip("nvcc in /usr/bin cannot be hidden")
    proc = subprocess.run(["cmake", "-S", str(REPO), "-B", str(build),
                           f"-DPython_EXECUTABLE={sys.executable}",
                           f"-DCMAKE_IGNORE_PATH={';'.join(_nvcc_dirs())}",
                           f"-DPAGEDRUN_BUILD_FATBINS={mode}"],
                          capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr
    assert "Prebuilt fatbins with" not in proc.stdout
    if mode == "ON":
        assert "nvcc was not found" in proc.stderr


@pytest.fixture
def fake_cupy(monkeypatch):
    """A cupy stand-in recording how RawModules are made (device of compute capability 90)."""
    made = []

    class RawModule:
        def __init__(self, **kwargs):
            self.kwargs = kwargs
            made.append(kwargs)

        def get_function(self, name):
            # Fake kernel names: "<source stem>__<anything>".
            if "path" in self.kwargs and Path(self.kwargs["path"]).stem != name.split("__")[0]:
                raise RuntimeError("CUDA_ERROR_NOT_FOUND")
            return (self.kwargs.get("path"), name)

    class Device:
        compute_capability = "90"

    cupy = types.SimpleNamespace(RawModule=RawModule, cuda=types.SimpleNamespace(Device=Device))
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    return made


def test_cuda_loader_uses_fatbins_then_nvrtc(tmp_path, monkeypatch, fake_cupy):
    cuda_dir, out = _fake_install(tmp_path)
    monkeypatch.setattr(loader, "CUDA_DIR", cuda_dir)
    monkeypatch.setattr(prebuilt, "PREBUILT_DIR", out)
    single = loader.load_module("rms_norm.cu", backend="cuda")
    assert fake_cupy[-1] == {"path": str(out / "rms_norm.fatbin")}
    pair = loader.load_module(["gemm.cu", "gemm_skinny.cu"], backend="cuda")
    assert [m["path"] for m in fake_cupy[-2:]] == [str(out / "gemm.fatbin"),
                                                  str(out / "gemm_skinny.fatbin")]
    # Each kernel comes from the fatbin that has it.
    assert pair.get_function("gemm_skinny__x")[0] == str(out / "gemm_skinny.fatbin")
    assert pair.get_function("gemm__x")[0] == str(out / "gemm.fatbin")
    with pytest.raises(AttributeError):
        pair.get_function("nowhere")
    assert single.get_function("rms_norm__x")[1] == "rms_norm__x"
    # One stale source in a module: the whole translation unit goes through NVRTC, and its code
    # carries the sources' hash (CuPy's disk cache keys on the code string). (An sm_80 device:
    # on sm_90 the loader runs NVRTC itself, next test.)
    sys.modules["cupy"].cuda.Device.compute_capability = "80"
    src = cuda_dir / "gemm_skinny.cu"
    src.write_text(src.read_text() + "\n// edited\n")
    loader.load_module(["gemm.cu", "gemm_skinny.cu"], backend="cuda")
    code = fake_cupy[-1]["code"]
    assert loader.sources_digest(cuda_dir) in code
    assert '#include "gemm.cu"' in code and '#include "gemm_skinny.cu"' in code
    assert "--std=c++17" in fake_cupy[-1]["options"]
    # Extra options have no fatbin either.
    loader.load_module("rms_norm.cu", backend="cuda", options=("-DX=1",))
    assert "code" in fake_cupy[-1] and "-DX=1" in fake_cupy[-1]["options"]


def test_cuda_loader_builds_sm90a_cubins_itself(tmp_path, monkeypatch, fake_cupy):
    """On compute capability 9.0 the NVRTC fallback targets sm_90a (CuPy's RawModule would
    build sm_90, where the wgmma GEMM is a trap): one compile per code, then the disk cache."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    compiles = []

    def compile_program(prog, options):
        compiles.append(list(options))
        if "-DBROKEN" in options:
            raise RuntimeError("NVRTC_ERROR_COMPILATION")

    nvrtc = types.SimpleNamespace(
        getVersion=lambda: (13, 0), createProgram=lambda src, name, h, i: 7,
        compileProgram=compile_program, getCUBIN=lambda prog: b"cubin bytes",
        getProgramLog=lambda prog: "error: planted", destroyProgram=lambda prog: None)
    monkeypatch.setitem(sys.modules, "cupy_backends.cuda.libs",
                        types.SimpleNamespace(nvrtc=nvrtc))
    monkeypatch.setitem(sys.modules, "cupy_backends.cuda.libs.nvrtc", nvrtc)
    monkeypatch.setattr(prebuilt, "PREBUILT_DIR", tmp_path / "no_fatbins")
    for _ in range(2):
        loader.load_module("rms_norm.cu", backend="cuda")
        path = Path(fake_cupy[-1]["path"])
        assert path.parent == tmp_path / "cache" / "pagedrun" / "nvrtc"
        assert path.read_bytes() == b"cubin bytes"
    assert len(compiles) == 1 and "--gpu-architecture=sm_90a" in compiles[0]
    assert "--std=c++17" in compiles[0]
    with pytest.raises(RuntimeError, match="planted"):
        loader.load_module("rms_norm.cu", backend="cuda", options=("-DBROKEN",))
    # name_expressions need CuPy's own NVRTC path (it maps the lowered names).
    loader.load_module("rms_norm.cu", backend="cuda", name_expressions=["f<1>"])
    assert fake_cupy[-1]["name_expressions"] == ["f<1>"]


def test_installed_package_has_current_fatbins():
    """A non-editable install built where nvcc exists (CI) ships a current fatbin + manifest
    for every kernel source; the source tree (editable installs) has none to check."""
    if (prebuilt.CUDA_DIR.parent / "pyproject.toml").is_file():
        pytest.skip("running from the source tree (editable install): no installed fatbins")
    if _nvcc() is None:
        pytest.skip("built without nvcc: the wheel has no fatbins")
    for cu in sorted(prebuilt.CUDA_DIR.glob("*.cu")):
        kind, where = prebuilt.select_module_source(cu.name, 90)
        assert kind == "prebuilt", where
