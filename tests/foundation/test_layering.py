"""The import layering of the `pagedrun` package, enforced from the source files (issue 21).

The import graph is built without importing anything: `ast` over every .py file, and a small
line parser over pyx/*.pyx and pyx/*.pxd (Cython is not Python). Files map to module names
through ROOTS (pyproject.toml's wheel mapping, checked below). An edge A -> B means "A's source
names module B", whatever the form:

- module-level and function-level imports alike (a function-level import is a dependency that
  merely runs later), `import a.b.c` (edge to a.b.c), `from a.b import c` (edge to the
  submodule a.b.c when it is one, else to a.b, i.e. its __init__), relative imports resolved,
  `cimport`, `importlib.import_module("...")` / `__import__("...")` with a string literal, and
  the entries of lazy-import tables (a dict literal whose values are "pagedrun...." strings
  or ("pagedrun....", attr) tuples, like `_LAZY` in python/pagedrun/__init__.py);
  `from pagedrun import LLM` resolves through that table to pagedrun.runtime.llm.
- Excluded: imports under `if TYPE_CHECKING:` (they never run), and the implicit import of a
  module's ancestor packages (Python runs pagedrun/__init__ and pagedrun/runtime/__init__ before
  any of their submodules; that is not an edge unless the source names the package).

The rules, each its own test below; every failure names the importing file:line:

1. No import cycle among pagedrun modules (self-imports aside); the cycle path is printed.
2. pagedrun.pyx.* imports nothing of pagedrun.runtime or pagedrun.server.
3. The engine core (ENGINE_CORE and the whole engine package) never names cupy or a module
   under pagedrun.runtime.backends or pagedrun.runtime.kernels: devices are the backends'
   business. The one name it may use is the backends package itself (BACKEND_FACTORY:
   `make_backend`, which turns the configured device string into a Backend object); any
   backend module by name is a violation.
4. pagedrun.server.* imports of pagedrun only the engine's public API (SERVER_PUBLIC_API), its
   own modules, the client and its ancestor packages (`pagedrun.__version__`).
5. Layers (LAYERS, lowest first) only import their own layer or lower ones. Naming one's own
   ancestor package (`from pagedrun import __version__`) is exempt: it runs first anyway.
6. Models see only the LinearMethod object: pagedrun.runtime.models.* imports of
   pagedrun.runtime.quantization only the package itself (MODELS_QUANTIZATION_API), never a
   format module, and its source (code, strings, comments) names no weight format
   (WEIGHT_FORMAT_WORDS: gguf, awq, gptq, int8, Q4_K, ...).
7. Outside the device layers (backends, kernels), no code compares anything with a device name
   (DEVICE_NAMES): the engine, models and the distributed executor read the backend's declared
   capabilities, or ask the backends package (keeps_gguf_blocks, uses_gpu).

Plus bookkeeping that keeps the rules honest: every module has a layer, every pagedrun import
resolves to a module of the tree, and the builder itself is tested on planted violations.
"""
from __future__ import annotations

import ast
import functools
import re
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# Repository folder -> the import package it becomes (pyproject.toml's
# [tool.scikit-build.wheel.packages], plus pyx/, which CMake compiles into pagedrun/pyx).
ROOTS = {
    "python/pagedrun": "pagedrun",
    "runtime": "pagedrun.runtime",
    "server": "pagedrun.server",
    "pyx": "pagedrun.pyx",
}
SOURCE_SUFFIXES = (".py", ".pyx", ".pxd")

# Lowest first. "x.*" means every module strictly below package x; other entries are exact
# module names. A module may import its own layer and those listed before it.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    # Cython hot loops: block pool, KV cache manager, scheduler, the cpu GEMM.
    ("pyx", ("pagedrun.pyx", "pagedrun.pyx.*")),
    # Device-free engine foundation: config, requests, sampling, text, weights, model files.
    ("foundation", (
        "pagedrun.runtime",
        "pagedrun.runtime.errors",
        "pagedrun.runtime.paths",
        "pagedrun.runtime.engine_config",
        "pagedrun.runtime.model_config",
        "pagedrun.runtime.sampling_params",
        "pagedrun.runtime.chat_options",
        "pagedrun.runtime.prompt_inputs",
        "pagedrun.runtime.outputs",
        "pagedrun.runtime.stop_checker",
        "pagedrun.runtime.admission",
        "pagedrun.runtime.architectures",
        # The registry's vocabulary (Architecture, tensor maps) and per-family entries.
        "pagedrun.runtime.families",
        "pagedrun.runtime.families.*",
        # Speculative decoding's device-free parts: config, n-gram proposer, rejection sampler.
        "pagedrun.runtime.spec_decode",
        "pagedrun.runtime.spec_decode.*",
        # LoRA's device-free parts: request, config, PEFT loader, adapter cache, numpy ops.
        "pagedrun.runtime.lora",
        "pagedrun.runtime.lora.*",
        "pagedrun.runtime.request",
        "pagedrun.runtime.sampler",
        "pagedrun.runtime.logits_row_groups",
        "pagedrun.runtime.tokenizer",
        "pagedrun.runtime.detokenizer",
        "pagedrun.runtime.weights",
        "pagedrun.runtime.reference",
        "pagedrun.runtime.gguf_convert",
        "pagedrun.runtime.gguf_index",
        # Weight quantization's method registry and its format modules (device-free: the
        # backends pack what a method hands them).
        "pagedrun.runtime.quantization",
        "pagedrun.runtime.quantization.*",
        "pagedrun.runtime.default_model",
        "pagedrun.runtime.model_loader",
        "pagedrun.runtime.rope",
        "pagedrun.runtime.kv_capacity",
        "pagedrun.runtime.cpu_isa",
    )),
    # Kernel launch wrappers and the module loader (cupy RawModule or the CPU harness).
    ("kernels", ("pagedrun.runtime.kernels", "pagedrun.runtime.kernels.*")),
    # The device seam: one ops object per device, and the factory.
    ("backends", ("pagedrun.runtime.backends", "pagedrun.runtime.backends.*")),
    # Model forwards, written against an injected `ops` (a backend), never importing one.
    ("models", ("pagedrun.runtime.models", "pagedrun.runtime.models.*")),
    ("model_runner", ("pagedrun.runtime.model_runner", "pagedrun.runtime.decode_graphs")),
    ("distributed", ("pagedrun.runtime.distributed", "pagedrun.runtime.distributed.*")),
    # The engine and the public modules beside it (`paged-run env`'s device report).
    ("engine", ("pagedrun.runtime.engine", "pagedrun.runtime.engine.*",
                "pagedrun.runtime.llm",
                "pagedrun.runtime.device_report")),
    ("server", ("pagedrun.server", "pagedrun.server.*")),
    # The package root: lazy top-level names, `python -m pagedrun`, the client re-export.
    ("root", ("pagedrun", "pagedrun.__main__", "pagedrun.client")),
)

# Rule 3: these (and every module of the engine package) never name cupy or anything under
# backends / kernels.
ENGINE_CORE = (
    "pagedrun.runtime.engine",
    "pagedrun.pyx.scheduler",
    "pagedrun.runtime.request",
    "pagedrun.runtime.sampling_params",
    "pagedrun.runtime.sampler",
    "pagedrun.runtime.logits_row_groups",
    "pagedrun.runtime.stop_checker",
    "pagedrun.runtime.outputs",
)
DEVICE_MODULES = ("cupy", "cupyx", "pagedrun.runtime.backends", "pagedrun.runtime.kernels")
BACKEND_FACTORY = "pagedrun.runtime.backends"  # the package's __init__: make_backend only
ENGINE_PACKAGE = "pagedrun.runtime.engine"

# Rule 7: outside the device layers, no code compares anything with a device name: what a
# device can do is its backend's declared capabilities (backends/base.py BackendCapabilities),
# or, before a backend exists, a question the backends package answers (keeps_gguf_blocks,
# uses_gpu). Config validation may list the names; only comparisons are branches.
DEVICE_NAMES = frozenset({"cpu", "sim", "cuda"})
DEVICE_LAYERS = ("pagedrun.runtime.backends", "pagedrun.runtime.kernels")

# Rule 6: what a model may import of the quantization package, and the words that name a
# weight format (a registered method's name must be one of them: checked below). Letters and
# digits may not touch a match ("uint8" is not "int8"); "_" may ("gguf_blocks" is "gguf").
MODELS = "pagedrun.runtime.models"
QUANTIZATION = "pagedrun.runtime.quantization"
MODELS_QUANTIZATION_API = (QUANTIZATION,)
WEIGHT_FORMAT_WORDS = re.compile(
    r"(?<![A-Za-z0-9])(gguf|ggml|awq|gptq|int4|int8|i4z|w4a16|w8a16|q[2-8]_[01k]|iq[1-4]_\w+"
    r"|tq[12]_0)(?![A-Za-z0-9])", re.IGNORECASE)

# Rule 4: what pagedrun.server may import from the rest of the package.
SERVER_PUBLIC_API = (
    # The engine and what its API takes and returns.
    "pagedrun.runtime.engine",
    "pagedrun.runtime.engine_config",
    # LoRA's public face: the request, the config and the files an adapter directory holds.
    "pagedrun.runtime.lora",
    "pagedrun.runtime.llm",
    "pagedrun.runtime.sampling_params",
    "pagedrun.runtime.chat_options",
    "pagedrun.runtime.outputs",
    "pagedrun.runtime.errors",
    # Text in and out: `generate` applies the chat template and streams text.
    "pagedrun.runtime.tokenizer",
    "pagedrun.runtime.detokenizer",
    # Model files: what a --model means (`generate`, `serve`), `convert`, and `env`'s paths.
    "pagedrun.runtime.model_config",
    "pagedrun.runtime.model_loader",
    "pagedrun.runtime.default_model",
    "pagedrun.runtime.gguf_convert",
    "pagedrun.runtime.paths",
    # `env`: what the machine offers the device backends (versions, GPUs, prebuilt fatbins).
    "pagedrun.runtime.device_report",
    # `serve --node-rank R`: the headless entry of a tensor-parallel node (its workers only).
    "pagedrun.runtime.distributed.node",
    # The client (pagedrun.client re-exports pagedrun.server.client).
    "pagedrun.client",
)


# -- the graph --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Edge:
    src: str     # importing module
    dst: str     # imported module (a pagedrun module, or an external dotted name)
    path: str    # repository-relative file of the import
    line: int
    kind: str    # "module-level" | "function-level" | "import_module" | "lazy table"

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"

    def __str__(self) -> str:
        return f"{self.where}: {self.src} imports {self.dst} ({self.kind})"


@dataclass
class Graph:
    modules: dict[str, str] = field(default_factory=dict)    # module -> one of its files
    packages: set[str] = field(default_factory=set)          # modules that are an __init__
    edges: list[Edge] = field(default_factory=list)
    unresolved: list[Edge] = field(default_factory=list)     # pagedrun names with no module

    def internal_edges(self) -> list[Edge]:
        return [e for e in self.edges if e.dst in self.modules]


def is_pagedrun(name: str) -> bool:
    return name == "pagedrun" or name.startswith("pagedrun.")


def is_under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def module_of(relpath: str) -> tuple[str, bool] | None:
    """(module name, is a package __init__) of a repository-relative source path, or None."""
    for folder, package in ROOTS.items():
        if not relpath.startswith(folder + "/"):
            continue
        rest = relpath[len(folder) + 1:]
        stem, dot, suffix = rest.rpartition(".")
        if not dot or "." + suffix not in SOURCE_SUFFIXES:
            return None
        parts = stem.split("/")
        is_package = parts[-1] == "__init__"
        if is_package:
            parts = parts[:-1]
        return ".".join([package, *parts]), is_package
    return None


def relative_base(module: str, is_package: bool, level: int, name: str | None) -> str:
    """The absolute module of `from <level dots><name> import ...` written in `module`."""
    parts = module.split(".") if is_package else module.split(".")[:-1]
    if level > 1:
        parts = parts[: len(parts) - (level - 1)]
    return ".".join(parts + ([name] if name else []))


# A raw import as written: (line, kind, base, names). names is None for `import base`, else
# the names of `from base import names` (a name may be "*").
RawImport = tuple[int, str, str, "tuple[str, ...] | None"]
# A lazy-import table entry: (line, module, attr or None, key).
LazyEntry = tuple[int, str, "str | None", "str | None"]

_DYNAMIC_IMPORTERS = {"import_module", "__import__"}


def _is_type_checking(test: ast.expr) -> bool:
    return ((isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
            or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"))


def _lazy_value(value: ast.expr) -> tuple[str, str | None] | None:
    """("pagedrun.x", attr) of a lazy-table value: "pagedrun.x" or ("pagedrun.x", "attr")."""
    if isinstance(value, ast.Constant) and isinstance(value.value, str):
        return (value.value, None) if is_pagedrun(value.value) else None
    if isinstance(value, (ast.Tuple, ast.List)) and value.elts:
        first = value.elts[0]
        if isinstance(first, ast.Constant) and isinstance(first.value, str) \
                and is_pagedrun(first.value):
            second = value.elts[1] if len(value.elts) > 1 else None
            attr = second.value if isinstance(second, ast.Constant) \
                and isinstance(second.value, str) else None
            return first.value, attr
    return None


def parse_python(source: str, module: str, is_package: bool, relpath: str
                 ) -> tuple[list[RawImport], list[LazyEntry]]:
    tree = ast.parse(source, filename=relpath)
    imports: list[RawImport] = []
    lazy: list[LazyEntry] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        kind = "function-level" if in_function else "module-level"
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:   # the body only runs under a type checker
                visit(child, in_function)
            return
        if isinstance(node, ast.Import):
            for alias in node.names:
                imports.append((node.lineno, kind, alias.name, None))
        elif isinstance(node, ast.ImportFrom):
            base = (relative_base(module, is_package, node.level, node.module)
                    if node.level else node.module or "")
            imports.append((node.lineno, kind, base, tuple(a.name for a in node.names)))
        elif isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else \
                func.id if isinstance(func, ast.Name) else None
            if name in _DYNAMIC_IMPORTERS and node.args \
                    and isinstance(node.args[0], ast.Constant) \
                    and isinstance(node.args[0].value, str):
                target = node.args[0].value
                if target.startswith("."):   # import_module(".x", package=__package__)
                    level = len(target) - len(target.lstrip("."))
                    target = relative_base(module, is_package, level,
                                           target.lstrip(".") or None)
                imports.append((node.lineno, "import_module", target, None))
        elif isinstance(node, ast.Dict):
            for key, value in zip(node.keys, node.values):
                entry = _lazy_value(value)
                if entry is not None:
                    key_name = key.value if isinstance(key, ast.Constant) \
                        and isinstance(key.value, str) else None
                    lazy.append((value.lineno, entry[0], entry[1], key_name))
        nested = in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                  ast.Lambda))
        for child in ast.iter_child_nodes(node):
            visit(child, nested)

    visit(tree, False)
    return imports, lazy


_TRIPLE_QUOTED = re.compile(r'("""|\'\'\')(.*?)\1', re.DOTALL)
_FROM_LINE = re.compile(r"^(\s*)from\s+([.\w]+)\s+c?import\s+(.*)$")
_IMPORT_LINE = re.compile(r"^(\s*)c?import\s+(.*)$")
_DYNAMIC_CALL = re.compile(r"""(?:import_module|__import__)\(\s*["']([.\w]+)["']""")


def parse_cython(source: str, module: str, is_package: bool) -> list[RawImport]:
    """Imports and cimports of a .pyx/.pxd file, by lines (indented ones count as function-level;
    docstrings and comments are blanked first, keeping line numbers)."""
    source = _TRIPLE_QUOTED.sub(lambda m: "\n" * m.group(0).count("\n"), source)
    lines = source.splitlines()
    imports: list[RawImport] = []
    i = 0
    while i < len(lines):
        lineno = i + 1
        text = lines[i].split("#", 1)[0].rstrip()
        i += 1
        # Join continuation lines: a trailing backslash or an unclosed parenthesis.
        while i < len(lines) and (text.endswith("\\") or text.count("(") > text.count(")")):
            text = text.rstrip("\\") + " " + lines[i].split("#", 1)[0].strip()
            i += 1
        for match in _DYNAMIC_CALL.finditer(text):
            imports.append((lineno, "import_module", match.group(1), None))
        from_match = _FROM_LINE.match(text)
        import_match = None if from_match else _IMPORT_LINE.match(text)
        if from_match:
            indent, base, names_text = from_match.groups()
            if base.startswith("."):
                level = len(base) - len(base.lstrip("."))
                base = relative_base(module, is_package, level, base.lstrip(".") or None)
            names = tuple(part.split()[0] for part in names_text.replace("(", " ")
                          .replace(")", " ").split(",") if part.strip())
            imports.append((lineno, "function-level" if indent else "module-level", base, names))
        elif import_match:
            indent, names_text = import_match.groups()
            for part in names_text.split(","):
                if part.strip():
                    imports.append((lineno, "function-level" if indent else "module-level",
                                    part.split()[0], None))
    return imports


def build_graph(files: dict[str, str]) -> Graph:
    """The import graph of `files` (repository-relative path -> source)."""
    graph = Graph()
    parsed: list[tuple[str, str, list[RawImport], list[LazyEntry]]] = []
    for relpath in sorted(files):
        named = module_of(relpath)
        if named is None:
            continue
        module, is_package = named
        graph.modules.setdefault(module, relpath)
        if is_package:
            graph.packages.add(module)
        if relpath.endswith(".py"):
            imports, lazy = parse_python(files[relpath], module, is_package, relpath)
        else:
            imports, lazy = parse_cython(files[relpath], module, is_package), []
        parsed.append((relpath, module, imports, lazy))

    # Lazy tables by package: key -> module, so `from pagedrun import LLM` means its module.
    lazy_names: dict[str, dict[str, str]] = {}
    for _, module, _, lazy in parsed:
        for _, target, _, key in lazy:
            if key is not None:
                lazy_names.setdefault(module, {})[key] = target

    def add(src: str, dst: str, relpath: str, line: int, kind: str) -> None:
        edge = Edge(src, dst, relpath, line, kind)
        if is_pagedrun(dst) and dst not in graph.modules:
            graph.unresolved.append(edge)
        else:
            graph.edges.append(edge)

    for relpath, module, imports, lazy in parsed:
        for line, kind, base, names in imports:
            if names is None:
                add(module, base, relpath, line, kind)
                continue
            needs_base = False
            for name in names:
                if f"{base}.{name}" in graph.modules:
                    add(module, f"{base}.{name}", relpath, line, kind)
                elif name in lazy_names.get(base, {}):
                    add(module, lazy_names[base][name], relpath, line, kind)
                else:
                    needs_base = True
            if needs_base:
                add(module, base, relpath, line, kind)
        for line, target, _, _ in lazy:
            add(module, target, relpath, line, "lazy table")
    return graph


def read_tree(root: Path) -> dict[str, str]:
    files = {}
    for folder in ROOTS:
        for path in sorted((root / folder).rglob("*")):
            if path.suffix in SOURCE_SUFFIXES and path.is_file() \
                    and "__pycache__" not in path.parts:
                files[path.relative_to(root).as_posix()] = path.read_text(encoding="utf-8")
    return files


# -- the rules --------------------------------------------------------------------------------


def layer_of(module: str) -> int | None:
    for index, (_, patterns) in enumerate(LAYERS):
        for pattern in patterns:
            if pattern.endswith(".*"):
                if module.startswith(pattern[:-1]):
                    return index
            elif module == pattern:
                return index
    return None


def ancestors(module: str) -> set[str]:
    parts = module.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts))}


def find_cycles(graph: Graph) -> list[str]:
    """One shortest cycle through each module of every strongly connected component."""
    adjacency: dict[str, dict[str, Edge]] = {m: {} for m in graph.modules}
    for edge in graph.internal_edges():
        if edge.src != edge.dst:
            adjacency[edge.src].setdefault(edge.dst, edge)   # the first such import

    # Tarjan's strongly connected components (iterative).
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    for start in sorted(adjacency):
        if start in index:
            continue
        work = [(start, iter(sorted(adjacency[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(adjacency[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(sorted(component))

    messages = []
    for component in sorted(components):
        members = set(component)
        seen: set[tuple[str, ...]] = set()
        for start in component:
            # Shortest path start -> ... -> start inside the component (breadth first).
            previous: dict[str, str] = {}
            queue = deque([start])
            found = False
            while queue and not found:
                node = queue.popleft()
                for child in sorted(adjacency[node]):
                    if child not in members:
                        continue
                    if child == start:
                        previous[start] = node
                        found = True
                        break
                    if child not in previous:
                        previous[child] = node
                        queue.append(child)
            path = [start]
            node = previous[start]
            while node != start:
                path.append(node)
                node = previous[node]
            path.reverse()
            # Rotate to start at its smallest module so the same cycle prints once.
            pivot = path.index(min(path))
            path = path[pivot:] + path[:pivot]
            if tuple(path) in seen:
                continue
            seen.add(tuple(path))
            hops = [adjacency[a][b] for a, b in zip(path, path[1:] + path[:1])]
            messages.append("import cycle " + " -> ".join(path + path[:1]) + ":\n"
                            + "\n".join(f"    {hop}" for hop in hops))
    return messages


def pyx_violations(graph: Graph) -> list[str]:
    return [f"{e}: pagedrun.pyx must not import pagedrun.runtime or pagedrun.server"
            for e in graph.internal_edges()
            if is_under(e.src, "pagedrun.pyx")
            and (is_under(e.dst, "pagedrun.runtime") or is_under(e.dst, "pagedrun.server"))]


def engine_core_violations(graph: Graph) -> list[str]:
    return [f"{e}: the engine core ({e.src}) must not name cupy, backends or kernels; "
            "ask the backend object instead"
            for e in graph.edges
            if (e.src in ENGINE_CORE or is_under(e.src, ENGINE_PACKAGE))
            and e.dst != BACKEND_FACTORY
            and any(is_under(e.dst, d) for d in DEVICE_MODULES)]


def server_violations(graph: Graph) -> list[str]:
    out = []
    for e in graph.internal_edges():
        if not is_under(e.src, "pagedrun.server"):
            continue
        if is_under(e.dst, "pagedrun.server") or e.dst in SERVER_PUBLIC_API \
                or e.dst in ancestors(e.src):
            continue
        out.append(f"{e}: pagedrun.server may only use the engine's public API "
                   "(SERVER_PUBLIC_API in tests/foundation/test_layering.py)")
    return out


def layer_violations(graph: Graph) -> list[str]:
    out = []
    for e in graph.internal_edges():
        src_layer, dst_layer = layer_of(e.src), layer_of(e.dst)
        if src_layer is None or dst_layer is None or e.dst in ancestors(e.src):
            continue
        if dst_layer > src_layer:
            out.append(f"{e}: layer {LAYERS[src_layer][0]!r} must not import the higher "
                       f"layer {LAYERS[dst_layer][0]!r}")
    return out


def models_quantization_violations(graph: Graph) -> list[str]:
    return [f"{e}: a model sees only the LinearMethod object; import {QUANTIZATION} "
            "(the package), not a format module"
            for e in graph.internal_edges()
            if is_under(e.src, MODELS) and is_under(e.dst, QUANTIZATION)
            and e.dst not in MODELS_QUANTIZATION_API]


def device_string_comparisons(files: dict[str, str]) -> list[str]:
    """Rule 7, over the sources: every comparison with a device name (==, !=, in, not in;
    against a name or a tuple / list / set holding one) outside the device layers."""
    import ast

    out = []
    for relpath, source in sorted(files.items()):
        named = module_of(relpath)
        if (named is None or not relpath.endswith(".py")
                or any(is_under(named[0], layer) for layer in DEVICE_LAYERS)):
            continue
        for node in ast.walk(ast.parse(source)):
            if not isinstance(node, ast.Compare):
                continue
            for operand in (node.left, *node.comparators):
                items = (operand.elts if isinstance(operand, (ast.Tuple, ast.List, ast.Set))
                         else [operand])
                names = [i.value for i in items
                         if isinstance(i, ast.Constant) and i.value in DEVICE_NAMES]
                if names:
                    out.append(f"{relpath}:{node.lineno}: {named[0]} compares with the device "
                               f"name {names[0]!r}; ask the backend's capabilities "
                               "(BackendCapabilities) or the backends package")
                    break
    return out


def model_format_names(files: dict[str, str]) -> list[str]:
    """Rule 6's second half, over the sources: every weight-format word in a model file."""
    out = []
    for relpath, source in sorted(files.items()):
        named = module_of(relpath)
        if named is None or not is_under(named[0], MODELS):
            continue
        for number, text in enumerate(source.splitlines(), start=1):
            for match in WEIGHT_FORMAT_WORDS.finditer(text):
                out.append(f"{relpath}:{number}: names the weight format {match.group(0)!r}; "
                           "a model sees only the LinearMethod object (runtime/quantization/)")
    return out


def unassigned_modules(graph: Graph) -> list[str]:
    return [f"{graph.modules[m]}: module {m} has no layer; add it to LAYERS in "
            "tests/foundation/test_layering.py" for m in sorted(graph.modules)
            if layer_of(m) is None]


def unresolved_imports(graph: Graph) -> list[str]:
    return [f"{e}: no such module in the tree" for e in graph.unresolved]


RULES = {
    "cycles": find_cycles,
    "pyx": pyx_violations,
    "engine_core": engine_core_violations,
    "server": server_violations,
    "layers": layer_violations,
    "models_quantization": models_quantization_violations,
    "unassigned": unassigned_modules,
    "unresolved": unresolved_imports,
}


@functools.lru_cache(maxsize=1)
def real_graph() -> Graph:
    return build_graph(read_tree(REPO))


def _assert_none(rule: str) -> None:
    violations = RULES[rule](real_graph())
    if violations:
        pytest.fail(f"{len(violations)} violation(s):\n" + "\n".join(violations),
                    pytrace=False)


# -- the real tree ----------------------------------------------------------------------------


def test_the_graph_covers_the_package() -> None:
    graph = real_graph()
    assert len(graph.modules) >= 40, sorted(graph.modules)
    assert len(graph.internal_edges()) >= 100
    for folder, package in ROOTS.items():
        assert (REPO / folder).is_dir(), folder
        assert package in graph.modules, f"{folder}/__init__.py missing"


def test_roots_match_pyproject() -> None:
    tomllib = pytest.importorskip("tomllib")
    with open(REPO / "pyproject.toml", "rb") as f:
        wheel = tomllib.load(f)["tool"]["scikit-build"]["wheel"]["packages"]
    mapped = {folder: package.replace("/", ".") for package, folder in wheel.items()}
    python_folders = {f: p for f, p in mapped.items()
                      if any((REPO / f).glob("**/*.py"))}
    assert python_folders == {f: p for f, p in ROOTS.items() if f in python_folders}
    assert set(python_folders) | {"pyx"} == set(ROOTS)


def test_every_module_has_a_layer() -> None:
    _assert_none("unassigned")


def test_every_pagedrun_import_resolves() -> None:
    _assert_none("unresolved")


def test_no_import_cycles() -> None:
    _assert_none("cycles")


def test_pyx_imports_nothing_of_runtime_or_server() -> None:
    _assert_none("pyx")


def test_engine_core_names_no_device_module() -> None:
    _assert_none("engine_core")


def test_server_uses_only_the_public_api() -> None:
    _assert_none("server")


def test_layers_only_import_downwards() -> None:
    _assert_none("layers")


def test_models_see_only_the_linear_method() -> None:
    _assert_none("models_quantization")
    named = model_format_names(read_tree(REPO))
    if named:
        pytest.fail(f"{len(named)} violation(s):\n" + "\n".join(named), pytrace=False)


def test_no_device_name_comparisons_outside_the_device_layers() -> None:
    found = device_string_comparisons(read_tree(REPO))
    if found:
        pytest.fail(f"{len(found)} violation(s):\n" + "\n".join(found), pytrace=False)


def test_planted_device_name_comparisons_are_caught() -> None:
    files = read_tree(REPO)
    assert device_string_comparisons(files) == []
    # In the engine (a plain comparison), the executor (a tuple) and the server (reversed);
    # the same comparison inside a backend module is the device layer's own business.
    engine_line = _append(files, "runtime/engine/core.py",
                          "\n\ndef _planted(config):\n    return config.device == 'cuda'\n") + 3
    executor_line = _append(files, "runtime/distributed/executor.py",
                            "\nuses_gpu = DEVICE in ('auto', 'cuda')\n") + 1
    server_line = _append(files, "server/serve_cmd.py", "\nif 'cpu' != args.device: pass\n") + 1
    _append(files, "runtime/backends/factory.py", "\nIS_CPU = DEVICE == 'cpu'\n")
    _append(files, "runtime/engine_config.py", "\nNAMES = ('cpu', 'sim', 'cuda')\n")  # a list
    found = device_string_comparisons(files)
    assert [v.split(": ")[0] for v in found] == [
        f"runtime/distributed/executor.py:{executor_line}",
        f"runtime/engine/core.py:{engine_line}",
        f"server/serve_cmd.py:{server_line}"], found
    assert "'cuda'" in found[1] and "'cpu'" in found[2], found


def test_every_quantization_method_name_is_a_format_word() -> None:
    # A method registered under a name the word list misses could be named in a model freely.
    from pagedrun.runtime.quantization import method_names

    names = [n for n in method_names() if n != "none"]
    assert len(names) >= 4, names
    assert [n for n in names if not WEIGHT_FORMAT_WORDS.fullmatch(n)] == []


def test_planted_model_format_names_are_caught() -> None:
    files = read_tree(REPO)
    baseline = build_graph(files)
    assert model_format_names(files) == []
    # A model importing a format module (function-level), and naming formats in code and prose.
    import_line = _append(files, "runtime/models/moe.py",
                          "\n\ndef _planted():\n"
                          "    from pagedrun.runtime.quantization.gguf_blocks import GGUF\n"
                          "    from pagedrun.runtime.quantization import get_method\n") + 3
    _append(files, "runtime/models/registry.py",
            "# keeps Q4_K blocks\nis_awq = quantization == 'AWQ'\nx = np.uint8(0)\n")
    graph = build_graph(files)
    imports = _new(graph, "models_quantization", baseline)
    assert len(imports) == 1, imports
    assert (f"runtime/models/moe.py:{import_line}: pagedrun.runtime.models.moe imports "
            "pagedrun.runtime.quantization.gguf_blocks (function-level)") in imports[0]
    named = model_format_names(files)
    words = sorted(v.split("'")[1].lower() for v in named)
    # GGUF in the planted import, Q4_K and AWQ (the identifier and the string) in registry.py;
    # uint8 is no format.
    assert words == ["awq", "awq", "gguf", "gguf", "q4_k"], named
    assert any(v.startswith(f"runtime/models/moe.py:{import_line}:") for v in named), named


# -- the checker itself -----------------------------------------------------------------------


def _append(files: dict[str, str], relpath: str, text: str) -> int:
    """Appends `text` to a file of `files`; returns the line number of its first line."""
    source = files[relpath]
    if not source.endswith("\n"):
        source += "\n"
    files[relpath] = source + text
    return source.count("\n") + 1


def _new(graph: Graph, rule: str, baseline: Graph) -> list[str]:
    before = set(RULES[rule](baseline))
    return [v for v in RULES[rule](graph) if v not in before]


def test_planted_violations_are_caught() -> None:
    files = read_tree(REPO)
    baseline = build_graph(files)
    # A cycle inside one layer (paths <-> default_model), written as a relative,
    # function-level import so it trips nothing but the cycle rule.
    cycle_line = _append(files, "runtime/paths.py",
                         "\n\ndef _planted():\n    from . import default_model\n") + 3
    # pyx -> runtime, a relative import inside a cdef function of a .pyx file.
    pyx_line = _append(files, "pyx/scheduler.pyx",
                       "\ncdef _planted():\n    from ..runtime import request\n") + 2
    # engine -> cupy, function-level; and engine -> kernels through importlib.
    cupy_line = _append(files, "runtime/engine/core.py",
                        "\n\ndef _planted():\n    import cupy\n"
                        "    import importlib\n"
                        "    importlib.import_module('pagedrun.runtime.kernels.gemm')\n") + 3
    # server -> backends.
    server_line = _append(files, "server/serve_cmd.py",
                          "\n\ndef _planted():\n"
                          "    from pagedrun.runtime.backends.numpy_backend import NumpyBackend\n"
                          ) + 3
    # pyx -> runtime through the package root's lazy table (`LLM` is pagedrun.runtime.llm).
    lazy_line = _append(files, "pyx/block_pool.pyx", "from pagedrun import LLM\n")
    # Under TYPE_CHECKING: never runs, never flagged.
    _append(files, "runtime/request.py",
            "\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import cupy\n")
    graph = build_graph(files)

    # (The lazy pyx import closes a cycle too: block_pool -> llm -> engine -> scheduler.)
    cycles = [c for c in _new(graph, "cycles", baseline) if "runtime/paths.py" in c]
    assert len(cycles) == 1, cycles
    assert "pagedrun.runtime.default_model -> pagedrun.runtime.paths -> " \
        "pagedrun.runtime.default_model" in cycles[0], cycles
    assert f"runtime/paths.py:{cycle_line}:" in cycles[0], cycles

    pyx = _new(graph, "pyx", baseline)
    assert any(f"pyx/scheduler.pyx:{pyx_line}: pagedrun.pyx.scheduler imports "
               "pagedrun.runtime.request (function-level)" in v for v in pyx), pyx
    assert any(f"pyx/block_pool.pyx:{lazy_line}: pagedrun.pyx.block_pool imports "
               "pagedrun.runtime.llm (module-level)" in v for v in pyx), pyx

    core = _new(graph, "engine_core", baseline)
    assert any(f"runtime/engine/core.py:{cupy_line}: pagedrun.runtime.engine.core imports cupy "
               "(function-level)" in v for v in core), core
    assert any(f"runtime/engine/core.py:{cupy_line + 2}: pagedrun.runtime.engine.core imports "
               "pagedrun.runtime.kernels.gemm (import_module)" in v for v in core), core
    assert not any("runtime/request.py" in v for v in core), core

    server = _new(graph, "server", baseline)
    assert any(f"server/serve_cmd.py:{server_line}: pagedrun.server.serve_cmd imports "
               "pagedrun.runtime.backends.numpy_backend" in v for v in server), server

    layers = _new(graph, "layers", baseline)
    assert any(f"pyx/scheduler.pyx:{pyx_line}:" in v for v in layers), layers
    assert not any("runtime/paths.py" in v for v in layers), layers


def test_builder_on_synthetic_sources() -> None:
    files = {
        "python/pagedrun/__init__.py": "_LAZY = {'LLM': ('pagedrun.runtime.llm', 'LLM')}\n",
        "runtime/__init__.py": "",
        "runtime/llm.py": "from .engine import LLMEngine\n",
        "runtime/engine.py": (
            "from __future__ import annotations\n"
            "import typing\n"
            "if typing.TYPE_CHECKING:\n"
            "    from pagedrun.runtime.backends import base\n"
            "from pagedrun.runtime import errors, llm as _llm\n"   # 5: two submodules
            "from pagedrun.runtime.errors import PagedRunError\n"
            "class A:\n"
            "    def f(self):\n"
            "        return lambda: __import__('cupy')\n"            # 9
            "from pagedrun.runtime.nonexistent import x\n"            # 10: unresolved
        ),
        "runtime/errors.py": "PagedRunError = Exception\n",
        "runtime/backends/__init__.py": "from .base import make_backend\n",
        "runtime/backends/base.py": "from ..engine import X\n",   # backends -> engine
        "pyx/__init__.py": "",
        "pyx/scheduler.pyx": (
            '"""Docs: from pagedrun.runtime import engine is only prose."""\n'
            "from libc.stdint cimport int32_t\n"
            "from pagedrun.pyx.block_pool cimport (BlockPool,\n"
            "    NO_BLOCK)  # joined\n"
            "import numpy as np, os\n"
            "def f():\n"
            "    import pagedrun.runtime.errors as e  # 7\n"
        ),
        "pyx/block_pool.pxd": "cdef class BlockPool:\n    pass\n",
    }
    graph = build_graph(files)
    edges = {(e.src, e.dst, e.line, e.kind) for e in graph.edges}
    assert ("pagedrun", "pagedrun.runtime.llm", 1, "lazy table") in edges
    assert ("pagedrun.runtime.llm", "pagedrun.runtime.engine", 1, "module-level") in edges
    assert ("pagedrun.runtime.engine", "pagedrun.runtime.errors", 5, "module-level") in edges
    assert ("pagedrun.runtime.engine", "pagedrun.runtime.llm", 5, "module-level") in edges
    assert ("pagedrun.runtime.engine", "pagedrun.runtime.errors", 6, "module-level") in edges
    assert ("pagedrun.runtime.engine", "cupy", 9, "import_module") in edges
    assert not any(e.dst == "pagedrun.runtime.backends" for e in graph.edges
                   if e.src == "pagedrun.runtime.engine")
    backends = "pagedrun.runtime.backends"
    assert (backends, f"{backends}.base", 1, "module-level") in edges
    assert (f"{backends}.base", "pagedrun.runtime.engine", 1, "module-level") in edges
    assert ("pagedrun.pyx.scheduler", "pagedrun.pyx.block_pool", 3, "module-level") in edges
    assert ("pagedrun.pyx.scheduler", "numpy", 5, "module-level") in edges
    assert ("pagedrun.pyx.scheduler", "os", 5, "module-level") in edges
    assert ("pagedrun.pyx.scheduler", "pagedrun.runtime.errors", 7, "function-level") in edges
    assert not any(e.line == 1 for e in graph.edges if e.src == "pagedrun.pyx.scheduler")
    assert [(e.src, e.dst, e.line) for e in graph.unresolved] == [
        ("pagedrun.runtime.engine", "pagedrun.runtime.nonexistent", 10)]

    cycles = find_cycles(graph)
    assert cycles and "pagedrun.runtime.engine -> pagedrun.runtime.llm -> " \
        "pagedrun.runtime.engine" in cycles[0], cycles
    assert any("runtime/engine.py:9" in v for v in engine_core_violations(graph))
    assert any("runtime/backends/base.py:1" in v and "'backends'" in v
               for v in layer_violations(graph))
    assert any("pyx/scheduler.pyx:7" in v for v in pyx_violations(graph))
