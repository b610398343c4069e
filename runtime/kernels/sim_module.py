"""SimModule: runs the exact cuda/*.cu sources on the CPU, with the surface of cupy.RawModule.

Owns the host build of kernel sources (g++ -std=c++20 with -DPAGEDRUN_SIM, see
cuda/sim/sim.cuh and docs/kernels.md), its content-hash cache, and the launch path:

    mod = SimModule(code='#include "paged_attention.cu"', options=("-DHEAD_DIM=128",))
    fn = mod.get_function("paged_attention_decode_bf16_d128_g1")
    fn(grid, block, (q, k_cache, np.int32(n)), shared_mem=nbytes)

Arguments mirror a CuPy launch: numpy arrays stand for device pointers (C-contiguous; the
kernel reads and writes them in place) and scalars must be numpy scalars of the parameter's
exact dtype (np.int32 for `int`, np.float32 for `float`, ...). A struct parameter taken by
value (a TMA descriptor) is a numpy void scalar or, as CuPy passes it, a size-1 numpy array of
a record dtype of the struct's size. A wrong count or dtype raises
TypeError before anything runs. A kernel-side error (deadlock, mask violation, misaligned
ldmatrix, shared-memory overflow, ...) raises SimKernelError naming kernel, block and thread.

The order in which blocks and threads run is a Schedule: index order by default, or
Schedule.random(seed) -- process-wide with set_schedule, or fn(..., schedule=s) for one
launch -- to expose races that index order hides (cuda/sim/runtime.cpp, "Schedules").

Builds are cached in runtime/paths.sim_cache_dir() ($XDG_CACHE_HOME/pagedrun/sim, default
~/.cache/pagedrun/sim), keyed by the hash of the preprocessed source, the flags and the
compiler. If the process runs under AddressSanitizer or ThreadSanitizer (libasan / libtsan
preloaded, as scripts/ci_sanitizers.sh does), modules are built with the matching -fsanitize
flags, so the same tests exercise the sanitizers without any switch in the code under test.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import hashlib
import os
import re
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import ClassVar, Iterable, Literal, Sequence

import numpy as np

from pagedrun.runtime.paths import sim_cache_dir

CUDA_DIR = Path(__file__).resolve().parents[2] / "cuda"
SIM_DIR = CUDA_DIR / "sim"
CXX = "g++"

_BASE_FLAGS = ("-std=c++20", "-fPIC", "-DPAGEDRUN_SIM", "-fvisibility=hidden",
               "-Wno-attributes", "-Wno-unknown-pragmas")
# Per sanitizer mode: optimisation/sanitizer flags for kernel code, and the define that turns
# on the matching fiber hooks in cuda/sim/runtime.cpp (which itself is never instrumented).
# -g1: line tables only, all a report's file:line frames need; full -g made each module's
# build ~1.5x slower (paged_attention_decode.cu under ASan + UBSan: 13.6 s -> 8.9 s, TSan
# 4.9 s -> 3.9 s on Zen 3), paid for ~22 modules per pass in CI.
_MODE_FLAGS = {
    "plain": (("-O2",), ()),
    "asan": (("-O1", "-g1", "-fno-omit-frame-pointer", "-fsanitize=address,undefined",
              "-fno-sanitize-recover=all"), ("-DPAGEDRUN_SIM_ASAN",)),
    "tsan": (("-O1", "-g1", "-fsanitize=thread"), ("-DPAGEDRUN_SIM_TSAN",)),
}
_BOUNDS_RE = re.compile(r"PAGEDRUN_BOUNDS_BEGIN(.*?)PAGEDRUN_BOUNDS_END", re.S)
_KERNEL_RE = re.compile(
    r'extern\s+"C"\s+PAGEDRUN_KERNEL_MARK\s+((?:\w+\s+)*?)void\s+((?:\w+\s+)*?)(\w+)\s*\(')
_BOUNDS_TOKEN = re.compile(r"PAGEDRUN_BOUNDS_(\d+)")
# NVRTC options with no meaning for the host build; accepted so call sites stay identical.
_IGNORED_OPTION_PREFIXES = ("--std", "-std", "--use_fast_math", "-use_fast_math", "-lineinfo",
                            "--generate-line-info", "-arch", "--gpu-architecture",
                            "-default-device", "--fmad", "-fmad", "-G", "-dopt")
_ERR_LEN = 8192
# One launch at a time in the process: static shared memory and the fault handler that turns
# a segfault in kernel code into SimKernelError are process-wide.
_LAUNCH_LOCK = threading.Lock()
# Dynamic shared memory a launch may use without opting in: above it, CUDA requires the
# kernel attribute max_dynamic_shared_size_bytes (CuPy: fn.max_dynamic_shared_size_bytes = n).
DEFAULT_DYNAMIC_SMEM_LIMIT = 48 * 1024


class SimKernelError(RuntimeError):
    """A kernel failed under the harness; the message names kernel, block and thread."""


class SimBuildError(RuntimeError):
    """g++ rejected the kernel source; the message carries the compiler's output."""


def sanitizer_mode() -> str:
    """'asan', 'tsan' or 'plain', from the sanitizer runtime loaded into this process."""
    proc = ctypes.CDLL(None)
    for symbol, mode in (("__asan_init", "asan"), ("__tsan_init", "tsan")):
        if hasattr(proc, symbol):
            return mode
    return "plain"


def cache_dir() -> Path:
    """The harness's build cache (runtime/paths.sim_cache_dir), created if missing."""
    path = sim_cache_dir()
    path.mkdir(parents=True, exist_ok=True)
    return path


def _host_options(options: Iterable[str]) -> list[str]:
    out = []
    for opt in options:
        if opt.startswith(("-D", "-U", "-I")):
            out.append(opt)
        elif opt.startswith(_IGNORED_OPTION_PREFIXES):
            continue
        else:
            raise ValueError(f"option {opt!r} has no host equivalent under the CPU harness")
    return out


def _first_argument(expr: str) -> str:
    """'a, f(b, c)' -> 'a' (top-level comma split)."""
    depth = 0
    for i, ch in enumerate(expr):
        depth += ch in "([{<"
        depth -= ch in ")]}>"
        if ch == "," and depth == 0:
            return expr[:i].strip()
    return expr.strip()


def scan_kernels(preprocessed: str) -> dict[str, str | None]:
    """extern "C" kernels of a scan-mode preprocessed text -> their __launch_bounds__ max
    threads expression (None without bounds)."""
    bounds: list[str] = []

    def token(m: re.Match) -> str:
        bounds.append(_first_argument(" ".join(m.group(1).split())))
        return f" PAGEDRUN_BOUNDS_{len(bounds) - 1} "

    text = _BOUNDS_RE.sub(token, preprocessed)
    kernels: dict[str, str | None] = {}
    for m in _KERNEL_RE.finditer(text):
        b = _BOUNDS_TOKEN.search(m.group(1) + " " + m.group(2))
        kernels.setdefault(m.group(3), bounds[int(b.group(1))] if b else None)
    return kernels


def _run(cmd: Sequence[str]) -> str:
    proc = subprocess.run(list(cmd), capture_output=True, text=True)
    if proc.returncode != 0:
        raise SimBuildError(f"{' '.join(cmd)}\n{proc.stderr}")
    return proc.stdout


def _sha(*parts: str | bytes) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(part.encode() if isinstance(part, str) else part)
        h.update(b"\0")
    return h.hexdigest()[:24]


def _atomic_build(target: Path, build) -> None:
    """Runs build(tmp_path) and renames the result into place (safe for parallel tests)."""
    if target.exists():
        return
    fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=target.suffix)
    os.close(fd)
    try:
        build(tmp)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@functools.lru_cache(maxsize=None)
def _compiler_id() -> str:
    """First line of `g++ --version` (part of every build key); one subprocess per process."""
    return _run([CXX, "--version"]).splitlines()[0]


def _runtime_object(mode: str) -> Path:
    """cuda/sim/runtime.cpp compiled once per sanitizer mode (never instrumented itself)."""
    _, defines = _MODE_FLAGS[mode]
    srcs = [SIM_DIR / "runtime.cpp", SIM_DIR / "runtime_api.h"]
    flags = ["-std=c++20", "-O2", "-fPIC", "-fvisibility=hidden", *defines]
    key = _sha(_compiler_id(), " ".join(flags), *(p.read_bytes() for p in srcs))
    target = cache_dir() / f"runtime-{mode}-{key}.o"
    _atomic_build(target, lambda tmp: _run(
        [CXX, *flags, "-c", str(SIM_DIR / "runtime.cpp"), "-o", tmp]))
    return target


@dataclasses.dataclass(frozen=True)
class Schedule:
    """The order in which the harness runs blocks and threads (cuda/sim/runtime.cpp,
    "Schedules").

    Schedule.INDEX (the default): blocks in grid order, threads in index order between
    rendezvous -- deterministic, and blind to races that order fixes. Schedule.random(seed):
    block order and every switch point drawn from the seed, as a GPU's schedulers are free to;
    the same seed replays the same launches. A process-wide schedule (set_schedule) applies
    to every launch; fn(..., schedule=s) overrides it for one launch.
    """

    kind: Literal["index", "random"] = "index"
    seed: int = 0

    INDEX: ClassVar["Schedule"]

    def __post_init__(self) -> None:
        if self.kind == "index" and self.seed != 0:
            raise ValueError(f"the index-order schedule takes no seed, got {self.seed}")
        if self.kind == "random" and not 0 < self.seed < 2 ** 64:
            raise ValueError(f"a random schedule's seed must be in [1, 2**64), got {self.seed}")
        if self.kind not in ("index", "random"):
            raise ValueError(f"schedule kind must be 'index' or 'random', got {self.kind!r}")

    @classmethod
    def random(cls, seed: int | None = None) -> "Schedule":
        """A shuffled schedule; seed None draws a fresh one (read it back from .seed)."""
        while seed is None or seed == 0:
            seed = int.from_bytes(os.urandom(8), "little")
        return cls("random", int(seed))

    @classmethod
    def from_seed(cls, seed: int) -> "Schedule":
        """0 -> INDEX, anything else -> random(seed): the runtime's own encoding."""
        return cls.INDEX if int(seed) == 0 else cls.random(int(seed))

    def __str__(self) -> str:
        return "index order" if self.kind == "index" else f"random schedule, seed {self.seed}"


Schedule.INDEX = Schedule()

_schedule = Schedule.INDEX
_schedule_epoch = 0  # bumped by set_schedule: modules re-apply it, restarting their count


def set_schedule(schedule: Schedule) -> None:
    """Runs every later launch under `schedule`, each module's launches counted afresh from
    here, so a test that sets a seed replays exactly whatever ran before it."""
    global _schedule, _schedule_epoch
    if not isinstance(schedule, Schedule):
        raise TypeError(f"expected a Schedule, got {type(schedule).__name__}")
    _schedule = schedule
    _schedule_epoch += 1


def current_schedule() -> Schedule:
    return _schedule


def set_schedule_seed(seed: int) -> None:
    """set_schedule(Schedule.from_seed(seed)): 0 is index order."""
    if not 0 <= int(seed) < 2 ** 64:
        raise ValueError(f"schedule seed must be in [0, 2**64), got {seed}")
    set_schedule(Schedule.from_seed(seed))


def schedule_seed() -> int:
    return _schedule.seed


class SimFunction:
    """One kernel of a SimModule; call as fn(grid, block, args, shared_mem=0), optionally
    with schedule=Schedule.random(seed) for this launch alone."""

    def __init__(self, module: "SimModule", name: str):
        self.module = module
        self.name = name
        lib = module._lib
        self._launch = getattr(lib, f"pagedrun_launch_{name}")
        self._launch.restype = ctypes.c_int
        self._launch.argtypes = [ctypes.POINTER(ctypes.c_uint), ctypes.POINTER(ctypes.c_uint),
                                 ctypes.c_size_t, ctypes.POINTER(ctypes.c_void_p),
                                 ctypes.c_char_p, ctypes.c_size_t]
        sig = getattr(lib, f"pagedrun_signature_{name}")
        sig.restype = ctypes.c_char_p
        text = sig().decode()
        self.param_codes: tuple[str, ...] = tuple(text.split(",")) if text else ()
        # Same attribute as cupy.RawKernel: set it before launching with > 48 KiB.
        self.max_dynamic_shared_size_bytes = 0
        bound = getattr(lib, f"pagedrun_max_threads_{name}")
        bound.restype = ctypes.c_uint
        # __launch_bounds__ max threads per block (0: none); the GPU refuses bigger blocks.
        self.launch_bounds_max_threads = int(bound())

    def __call__(self, grid, block, args, shared_mem: int = 0, stream=None,
                 schedule: Schedule | None = None):
        del stream  # one host thread runs everything; kept for the CuPy signature
        grid3 = _dims(grid, "grid")
        block3 = _dims(block, "block")
        args = tuple(args)
        if len(args) != len(self.param_codes):
            raise TypeError(f"kernel {self.name} takes {len(self.param_codes)} arguments "
                            f"({','.join(self.param_codes)}), got {len(args)}")
        threads = block3[0] * block3[1] * block3[2]
        if 0 < self.launch_bounds_max_threads < threads:
            raise SimKernelError(
                f"kernel {self.name}: block of {threads} threads exceeds its "
                f"__launch_bounds__ of {self.launch_bounds_max_threads} (the GPU refuses "
                f"the launch)")
        limit = max(DEFAULT_DYNAMIC_SMEM_LIMIT, int(self.max_dynamic_shared_size_bytes))
        if shared_mem > limit:
            raise SimKernelError(
                f"kernel {self.name}: {shared_mem} bytes of dynamic shared memory need "
                f"fn.max_dynamic_shared_size_bytes = {shared_mem} before the launch (the GPU "
                f"refuses more than {DEFAULT_DYNAMIC_SMEM_LIMIT} bytes without it)")
        holders = []  # keep every ctypes value (and array) alive across the launch
        ptrs = (ctypes.c_void_p * max(len(args), 1))()
        for i, (code, value) in enumerate(zip(self.param_codes, args)):
            holder = _marshal(self.name, i, code, value)
            holders.append((value, holder))
            ptrs[i] = ctypes.cast(ctypes.pointer(holder), ctypes.c_void_p)
        err = ctypes.create_string_buffer(_ERR_LEN)
        with _LAUNCH_LOCK:
            self.module.apply_schedule(schedule)
            rc = self._launch((ctypes.c_uint * 3)(*grid3), (ctypes.c_uint * 3)(*block3),
                              int(shared_mem), ptrs, err, _ERR_LEN)
        if rc != 0:
            raise SimKernelError(err.value.decode(errors="replace"))


def _dims(value, what: str) -> tuple[int, int, int]:
    dims = (value,) if isinstance(value, (int, np.integer)) else tuple(value)
    if not 1 <= len(dims) <= 3 or any(int(d) < 1 for d in dims):
        raise ValueError(f"{what} must be 1 to 3 positive integers, got {value!r}")
    return tuple(int(d) for d in dims) + (1,) * (3 - len(dims))


def _marshal(kernel: str, index: int, code: str, value):
    where = f"kernel {kernel} argument {index}"
    if code == "p":
        if value is None:
            return ctypes.c_void_p(0)
        if not isinstance(value, np.ndarray):
            raise TypeError(f"{where} is a pointer: pass a numpy array, got {type(value).__name__}")
        if not value.flags.c_contiguous:
            raise TypeError(f"{where}: array must be C-contiguous")
        return ctypes.c_void_p(value.ctypes.data)
    if code.startswith("V") and isinstance(value, np.ndarray) and value.size == 1:
        value = value.reshape(())[()]  # CuPy's by-value struct: a size-1 array
    if not isinstance(value, np.generic):
        raise TypeError(f"{where} expects a numpy scalar of type code {code}, got "
                        f"{type(value).__name__} (wrap it, e.g. np.int32(x))")
    dt = value.dtype
    if code == "bf2":
        ok = dt == np.uint16  # bf16 scalars travel as their raw bits
    elif code.startswith("V"):
        ok = dt.kind == "V" and dt.itemsize == int(code[1:])
    else:
        ok = f"{dt.kind}{dt.itemsize}" == code and dt.kind in "biuf"
    if not ok:
        raise TypeError(f"{where} expects type code {code}, got numpy {dt}")
    raw = value.tobytes()
    if code.startswith("V"):
        return _aligned_copy(raw)
    return (ctypes.c_char * len(raw)).from_buffer_copy(raw)


# The strictest alignment a by-value struct of ours has (TmaDescriptor, like CUtensorMap: 64).
# The launch thunk (cuda/sim/launch.cuh) reads each parameter through a pointer to its type, so
# a struct's bytes must sit at its alignment (UBSan reports it otherwise); ctypes only
# promises 16.
STRUCT_PARAM_ALIGN = 64


def _aligned_copy(raw: bytes):
    store = np.zeros(len(raw) + STRUCT_PARAM_ALIGN, np.uint8)
    start = -store.ctypes.data % STRUCT_PARAM_ALIGN
    holder = (ctypes.c_char * len(raw)).from_buffer(store, start)  # keeps `store` alive
    ctypes.memmove(holder, raw, len(raw))
    return holder


class SimModule:
    """cupy.RawModule look-alike: compiles `code` for the CPU harness and loads it."""

    def __init__(self, code: str, options: Sequence[str] = (), name_expressions=None, *,
                 include_dirs: Sequence[Path | str] = (CUDA_DIR,)):
        self.code = code
        self.options = tuple(options)
        self.mode = sanitizer_mode()
        opt_flags, defines = _MODE_FLAGS[self.mode]
        includes = [f"-I{Path(d).resolve()}" for d in include_dirs]
        cflags = [*_BASE_FLAGS, *includes, *_host_options(self.options)]
        cdir = cache_dir()
        src = cdir / f"src-{_sha(code)}.cu"
        _atomic_build(src, lambda tmp: Path(tmp).write_text(code))
        scanned = _run([CXX, *cflags, "-DPAGEDRUN_SIM_SCAN", "-E", "-x", "c++", str(src)])
        self.launch_bounds = scan_kernels(scanned)
        self.kernel_names: tuple[str, ...] = tuple(self.launch_bounds)
        for expr in name_expressions or ():
            if expr not in self.kernel_names:
                raise ValueError(f"name expression {expr!r}: the harness launches only "
                                 f"extern \"C\" kernels; found {self.kernel_names}")
        runtime_obj = _runtime_object(self.mode)
        flags = [*cflags, *opt_flags, *defines]
        key = _sha(_compiler_id(), " ".join(flags), scanned, runtime_obj.name)
        self.path = cdir / f"module-{self.mode}-{key}.so"

        def build(tmp: str) -> None:
            thunk = Path(tmp).with_suffix(".cpp")
            exports = "\n".join(
                f"PAGEDRUN_SIM_EXPORT_KERNEL({k}, {bound or 0})"
                for k, bound in self.launch_bounds.items())
            thunk.write_text(f'#include "{src}"\n#include "sim/launch.cuh"\n{exports}\n')
            try:
                _run([CXX, *flags, "-shared", str(thunk), str(runtime_obj), "-o", tmp])
            finally:
                thunk.unlink()

        _atomic_build(self.path, build)
        self._lib = ctypes.CDLL(str(self.path))
        self._functions: dict[str, SimFunction] = {}
        self._set_schedule_seed = self._lib.pagedrun_sim_set_schedule_seed
        self._set_schedule_seed.argtypes = [ctypes.c_ulonglong]
        self._set_schedule_seed.restype = None
        self._schedule_epoch = 0  # the set_schedule this module's runtime copy follows

    def apply_schedule(self, override: Schedule | None = None) -> None:
        """Brings this module's runtime copy to the process-wide schedule (set_schedule), or
        to `override` for one launch (counted from its first launch, so it replays alone)."""
        if override is not None:
            self._set_schedule_seed(override.seed)
            self._schedule_epoch = -1  # the next plain launch re-applies the process's
        elif self._schedule_epoch != _schedule_epoch:
            self._set_schedule_seed(_schedule.seed)
            self._schedule_epoch = _schedule_epoch

    def get_function(self, name: str) -> SimFunction:
        if name not in self._functions:
            if name not in self.kernel_names:
                raise AttributeError(f"no extern \"C\" kernel {name!r} in module "
                                     f"(has {', '.join(self.kernel_names) or 'none'})")
            self._functions[name] = SimFunction(self, name)
        return self._functions[name]
