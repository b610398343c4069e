"""Every command, flag, import, test name and repository path README.md and docs/*.md cite
must exist (issue 37).

What counts as a claim:
- a command: any line of a fenced code block, and any inline `...` span, that starts one of our
  entry points -- `paged-run SUB` (also `python -m pagedrun`, `scripts/python -m pagedrun`,
  `.venv/bin/paged-run`), a `benchmarks/`, `scripts/`, `tests/` or `examples/` script (with or
  without `python` / `bash` in front), or `python -m pagedrun.<module>`. A code-block line may
  hold the command after a label ("node 0: paged-run serve ...") or in a comment; `\\` joins
  continued lines; `&&`, `|`, `;` and a `#` comment end it. Each flag it uses must be one of
  the entry point's own option strings, spelled in full (argparse would accept an abbreviation;
  a doc should not rely on it), and a literal value of a flag with choices must be a choice
  (`cpu|sim|cuda` is three). The parsers are built in-process for `paged-run`
  (server.cli.build_parser, one `SUB --help` rendered each) and in one child process for all
  the Python scripts (their `argparse` parser is captured at `parse_args`, before the script
  does any work); a shell script's flags must appear in its source. pytest's own flags are
  pytest's business and are not checked.
- a flag named in prose, away from its command ("`paged-run http` takes `--engine`"): it must
  be an option of some `paged-run` command or appear in the source of our scripts and test
  options (a looser net than the command check; other programs' flags are listed by name).
- an import a doc shows (`from pagedrun.client import Client`): module and names must exist.
- a test cited by name (`test_x`, `tests/y/test_z.py::test_x`): it must be defined there.
- a path: any `runtime/`, `cuda/`, `pyx/`, `server/`, `tests/`, `benchmarks/`, `scripts/`,
  `docs/`, `clients/`, `python/`, `examples/` or `.ci/` path in the text (brace lists and
  globs expanded, a path broken at a line end joined), and any bare file name with a source
  extension (`bench_gemm.py`), which must name some file of the repository.

A failure names the doc, the line and the claim. The test_planted_* tests feed a fake doc to
each check and show that every planted falsehood (bad flag, bad choice, unknown subcommand,
missing script option, missing path and file name, unknown import and test name) is reported,
and test_planted_doc_true_claims_pass that the true claims beside them are not.
"""
from __future__ import annotations

import argparse
import ast
import functools
import glob
import importlib.util
import io
import json
import re
import runpy
import shlex
import subprocess
import sys
from contextlib import redirect_stdout
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
# The top-level folders a cited path can start with (a path under any other prefix is not a
# claim about this repository: /etc/..., $XDG_CACHE_HOME/..., path/to/model.gguf).
REPO_DIRS = ("runtime", "cuda", "pyx", "server", "tests", "benchmarks", "scripts", "docs",
             "clients", "python", "examples", ".ci")
SOURCE_EXTS = ("py", "cu", "cuh", "pyx", "pxd", "h", "hpp", "cpp", "sh")
# Bare names with a source extension that are not files of ours, each for its reason.
FOREIGN_FILE_NAMES = {
    "llama.cpp": "the project",
    "pagedrun.pyx": "the import package of pyx/",
    "Python.h": "CPython's header",
    "math_constants.h": "the CUDA toolkit's header",
    "x.cu": "the docs' name for any kernel file",
}
# Flags the docs give to other programs than ours, each with that program.
FOREIGN_FLAGS = {"--head": "ray start", "--address": "ray start"}
SCRIPT_PARSER_TIMEOUT_S = 120

_NOT_PATH_START = r"(?<![\w/.$~-])"
_PATH_RE = re.compile(_NOT_PATH_START + r"((?:%s)/[\w./{}*,-]*)" % "|".join(
    re.escape(d) for d in REPO_DIRS))
_BARE_FILE_RE = re.compile(_NOT_PATH_START + r"([\w{},-]+\.(?:%s))(?![\w/])" % "|".join(
    SOURCE_EXTS))
_PAGED_RUN_RE = r"(?:(?:scripts/python|python3?|\.venv/bin/python)\s+-m\s+pagedrun(?![\w.])|" \
    r"(?:\.venv/bin/)?paged-run(?=\s|$))"
# A script is a command claim with an interpreter in front or an argument after it; a bare
# script name is a path claim only.
_SCRIPT_PATH = r"(?:%s)/[\w/.-]+\.(?:py|sh)" % "|".join(("benchmarks", "scripts", "tests",
                                                          "examples"))
_SCRIPT_RE = r"(?:(?:python3?|scripts/python|bash)\s+%s(?=\s|$)|%s[ \t]+(?=[\w\"'-]))" % (
    _SCRIPT_PATH, _SCRIPT_PATH)
_MODULE_RE = r"(?:python3?|scripts/python)\s+-m\s+(?:pagedrun\.[\w.]+|pytest)"
_COMMAND_RE = re.compile(_NOT_PATH_START + "(%s|%s|%s)" % (_MODULE_RE, _PAGED_RUN_RE,
                                                          _SCRIPT_RE))
# Shell operators end a command; "(" starts a doc's aside after it ("(headless, node.py)").
_COMMAND_END_TOKENS = {"&&", "||", "|", ";", ">", ">>", "<", "&", "("}
_PLACEHOLDER_RE = re.compile(r"^[A-Z][A-Z0-9_.:]*$|\.\.\.|[<>\[\]{}$]|^path/|^\w+=")


@dataclass(frozen=True)
class Claim:
    doc: str
    line: int
    text: str

    def where(self) -> str:
        return f"{self.doc}:{self.line}: {self.text!r}"


# ---------------------------------------------------------------------------------- extraction

def _code_block_lines(lines: list[str]) -> list[tuple[int, str]]:
    """(line number, text) of every code-block line, `\\`-continued lines joined."""
    out, in_block, pending = [], False, None
    for number, line in enumerate(lines, 1):
        if line.lstrip().startswith("```"):
            in_block = not in_block
            continue
        if not in_block:
            continue
        if pending is not None:
            pending = (pending[0], pending[1] + " " + line.strip())
        else:
            pending = (number, line)
        if pending[1].rstrip().endswith("\\"):
            pending = (pending[0], pending[1].rstrip()[:-1].rstrip())
            continue
        out.append(pending)
        pending = None
    return out


def _inline_spans(lines: list[str]) -> list[tuple[int, str]]:
    out, in_block = [], False
    for number, line in enumerate(lines, 1):
        if line.lstrip().startswith("```"):
            in_block = not in_block
            continue
        if not in_block:
            out += [(number, span) for span in re.findall(r"`([^`]+)`", line)]
    return out


def _command_text(text: str) -> str:
    """The command from its start to the end of its inline span (_tokens ends it at a shell
    operator or comment)."""
    return text.split("`", 1)[0].strip()


def extract_commands(doc: str, text: str) -> list[Claim]:
    lines = text.splitlines()
    claims = []
    for number, line in _code_block_lines(lines):
        for match in _COMMAND_RE.finditer(line):
            claims.append(Claim(doc, number, _command_text(line[match.start():])))
    for number, span in _inline_spans(lines):
        # An inline span is a command only when it starts with one (after VAR=value prefixes).
        body = re.sub(r"^(?:[A-Z_]+=\S*\s+)+", "", span.strip())
        match = _COMMAND_RE.match(body)
        if match:
            claims.append(Claim(doc, number, _command_text(body)))
    return claims


def _expand(path: str) -> list[str]:
    brace = re.search(r"\{([^{}]*)\}", path)
    if not brace:
        return [path]
    return [p for alt in brace.group(1).split(",")
            for p in _expand(path[:brace.start()] + alt + path[brace.end():])]


def extract_paths(doc: str, text: str) -> list[Claim]:
    lines = text.splitlines()
    claims = []
    for number, line in enumerate(lines, 1):
        for match in _PATH_RE.finditer(line):
            path = match.group(1)
            # "runtime/" at the end of a line, its file on the next one: one path.
            if match.end() == len(line.rstrip()) and path.endswith("/") and number < len(lines):
                follow = re.match(r"\s*([\w./{}*,-]+)", lines[number])
                if follow and not follow.group(1).startswith(REPO_DIRS):
                    path += follow.group(1)
            claims.append(Claim(doc, number, path.rstrip(".,")))
        # Bare names outside those paths (a brace list's members are the path's business).
        bare_line = _PATH_RE.sub(lambda m: " " * len(m.group(0)), line)
        for match in _BARE_FILE_RE.finditer(bare_line):
            claims.append(Claim(doc, number, match.group(1)))
    return claims


# ---------------------------------------------------------------------------------- checking

@dataclass
class ParserInfo:
    """One argparse parser: its exact option strings and each option's choices."""
    options: set[str]
    choices: dict[str, list[str]]
    takes_value: set[str]
    subcommands: dict[str, "ParserInfo"]
    help_ok: bool = True
    # Per positional argument: (its choices or None, how many words it takes: -1 = any);
    # None when the parser was read from the source and its positionals are unknown.
    positionals: list[tuple[list[str] | None, int]] | None = None


def parser_info(parser: argparse.ArgumentParser) -> ParserInfo:
    info = ParserInfo(set(), {}, set(), {}, positionals=[])
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            info.subcommands = {name: parser_info(sub) for name, sub in action.choices.items()}
            continue
        if not action.option_strings:
            count = {None: 1, "?": 1}.get(action.nargs, action.nargs)
            info.positionals.append(([str(c) for c in action.choices] if action.choices else
                                     None, count if isinstance(count, int) else -1))
            continue
        for option in action.option_strings:
            info.options.add(option)
            if action.nargs != 0:
                info.takes_value.add(option)
            if action.choices is not None:
                info.choices[option] = [str(c) for c in action.choices]
    return info


@functools.cache   # one parser and one round of --help per test session
def paged_run_info() -> ParserInfo:
    from pagedrun.server.cli import build_parser

    parser = build_parser()
    info = parser_info(parser)
    # Render each subcommand's --help the way a user gets it (a broken help string fails here).
    for name in info.subcommands:
        out = io.StringIO()
        with redirect_stdout(out), pytest.raises(SystemExit) as exit_info:
            parser.parse_args([name, "--help"])
        info.subcommands[name].help_ok = exit_info.value.code == 0 and name in out.getvalue()
    return info


def _tokens(command: str) -> list[str]:
    lexer = shlex.shlex(command, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    try:
        tokens = list(lexer)
    except ValueError:   # an unbalanced quote in a doc's shorthand: split on blanks
        tokens = command.split()
    for index, token in enumerate(tokens):
        if token in _COMMAND_END_TOKENS:
            return tokens[:index]
    return tokens


def _check_args(claim: Claim, name: str, info: ParserInfo, args: list[str]) -> list[str]:
    problems = []
    if info.subcommands:
        words = [a for a in args if not a.startswith("-")]
        sub = words[0] if words else None
        if sub is None or _PLACEHOLDER_RE.search(sub):
            return problems
        if sub not in info.subcommands:
            return [f"{claim.where()}: `{name}` has no subcommand {sub!r} "
                    f"(it has {sorted(info.subcommands)})"]
        args = args[args.index(sub) + 1:]
        name, info = f"{name} {sub}", info.subcommands[sub]
        if not info.help_ok:
            problems.append(f"{claim.where()}: `{name} --help` failed")
    words, skip_next = [], False
    for index, arg in enumerate(args):
        if skip_next:
            skip_next = False
            continue
        if not arg.startswith("-") or arg in ("-", "--"):
            if arg != "...":
                words.append(arg)
            continue
        flag, _, inline_value = arg.partition("=")
        if flag not in info.options:
            problems.append(f"{claim.where()}: `{name}` has no option {flag}")
            continue
        skip_next = flag in info.takes_value and not inline_value
        value = inline_value or (args[index + 1] if index + 1 < len(args) else "")
        if flag in info.choices and value and not _PLACEHOLDER_RE.search(value):
            bad = [v for v in value.split("|") if v not in info.choices[flag]]
            if bad:
                problems.append(f"{claim.where()}: `{name} {flag}` has no choice "
                                f"{', '.join(bad)} (choices {info.choices[flag]})")
    if info.positionals is not None:
        problems += _check_positionals(claim, name, info.positionals, words)
    return problems


def _check_positionals(claim: Claim, name: str, positionals, words: list[str]) -> list[str]:
    problems, index = [], 0
    for choices, count in positionals:
        if count == -1:
            return problems   # takes the rest
        for word in words[index:index + count]:
            if choices and not _PLACEHOLDER_RE.search(word) and word not in choices:
                problems.append(f"{claim.where()}: `{name}` takes no {word!r} (choices "
                                f"{choices})")
        index += count
    if len(words) > index:
        problems.append(f"{claim.where()}: `{name}` takes {index} positional argument(s), "
                        f"not {words}")
    return problems


@functools.cache   # the planted-doc tests ask for the same scripts again
def _script_infos(scripts: frozenset[str]) -> dict[str, ParserInfo | str]:
    """Each Python script's parser, captured in one child process (this file's __main__)."""
    if not scripts:
        return {}
    result = subprocess.run([sys.executable, __file__, *sorted(scripts)], capture_output=True,
                            text=True, timeout=SCRIPT_PARSER_TIMEOUT_S, cwd=REPO)
    assert result.returncode == 0, result.stderr
    raw = json.loads(result.stdout.strip().splitlines()[-1])

    def revive(d):
        return ParserInfo(set(d["options"]), d["choices"], set(d["takes_value"]),
                          {k: revive(v) for k, v in d["subcommands"].items()}, d["help_ok"],
                          d["positionals"])

    return {k: v if isinstance(v, str) else revive(v) for k, v in raw.items()}


def check_commands(claims: list[Claim], repo: Path = REPO) -> list[str]:
    problems = []
    parsed = []
    for claim in claims:
        tokens = [t.strip("[]") for t in _tokens(claim.text)]
        tokens = [t for t in tokens if t]
        if tokens[0] in ("python", "python3", "bash", "scripts/python", ".venv/bin/python"):
            tokens = tokens[1:]
        if tokens[0] == "-m":
            module, args = tokens[1], tokens[2:]
            if module == "pagedrun":
                parsed.append((claim, "paged-run", args))
            elif module != "pytest" and importlib.util.find_spec(module) is None:
                problems.append(f"{claim.where()}: no module {module}")
            continue
        if tokens[0].endswith("paged-run"):
            parsed.append((claim, "paged-run", tokens[1:]))
            continue
        script = tokens[0]
        if not (repo / script).is_file():
            problems.append(f"{claim.where()}: no script {script}")
            continue
        parsed.append((claim, script, tokens[1:]))
    infos: dict[str, ParserInfo | str] = {}
    if any(name == "paged-run" for _, name, _ in parsed):
        infos["paged-run"] = paged_run_info()
    infos.update(_script_infos(frozenset(name for _, name, _ in parsed if name.endswith(".py"))))
    for claim, name, args in parsed:
        if name.endswith(".sh") or infos.get(name) == "no argparse":
            source = (repo / name).read_text()
            problems += [f"{claim.where()}: {name} never mentions {arg}" for arg in args
                         if arg.startswith("--") and arg.partition("=")[0] not in source]
            continue
        info = infos[name]
        if isinstance(info, str):
            problems.append(f"{claim.where()}: {name}: {info}")
            continue
        problems += _check_args(claim, name, info, args)
    return problems


@functools.cache
def _repo_files(repo: Path) -> tuple[Path, ...]:
    """The repository's files (tracked and new, not ignored); without git (an unpacked sdist)
    every file outside build outputs and hidden folders but .ci."""
    try:
        listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"],
                                cwd=repo, capture_output=True, text=True)
    except FileNotFoundError:   # no git on this machine
        listed = subprocess.CompletedProcess([], 1, "", "")
    if listed.returncode == 0 and listed.stdout:
        return tuple(repo / p for p in listed.stdout.splitlines() if (repo / p).is_file())
    skipped = ("build",)
    return tuple(p for p in repo.rglob("*") if p.is_file() and not any(
        part in skipped or (part.startswith(".") and part != ".ci")
        for part in p.relative_to(repo).parts[:-1]))


def _repo_file_names(repo: Path) -> set[str]:
    return {p.name for p in _repo_files(repo)}


def _path_exists(repo: Path, path: str) -> bool:
    path = path.rstrip("/")
    if glob.glob(str(repo / path)):
        return True
    # A compiled module named without its extension (pyx/cpu_gemm), or a module's attribute
    # (runtime/paths.nvrtc_cache_dir).
    if re.search(r"\.(?:%s|md|json|txt|toml|cfg)$" % "|".join(SOURCE_EXTS), path):
        return False
    stem = re.sub(r"\.\w+$", "", path)
    return bool(glob.glob(str(repo / stem) + ".*"))


def check_paths(claims: list[Claim], repo: Path = REPO) -> list[str]:
    problems = []
    names = None
    for claim in claims:
        for path in _expand(claim.text):
            if "/" not in path:
                if names is None:
                    names = _repo_file_names(repo)
                if path not in names and path not in FOREIGN_FILE_NAMES:
                    problems.append(f"{claim.where()}: no file named {path} in the repository")
            elif not _path_exists(repo, path):
                problems.append(f"{claim.where()}: no path {path}")
    return problems


def check_prose_flags(docs: dict[str, str], repo: Path = REPO) -> list[str]:
    """A flag written anywhere in the prose ("`paged-run http` takes `--engine`") must be an
    option of some `paged-run` command or appear in the source of one of our scripts or test
    options: a looser net than check_commands, for flags named away from their command."""
    info = paged_run_info()
    known = set(info.options).union(*(sub.options for sub in info.subcommands.values()))
    this_file = Path(__file__).resolve()   # its planted flags must not vouch for themselves
    sources = "\n".join(p.read_text(errors="replace") for p in _repo_files(repo)
                        if (p.suffix in (".py", ".sh", ".txt") or p == repo / ".ci" / "run")
                        and p.resolve() != this_file)
    problems = []
    for doc, text in docs.items():
        for number, line in enumerate(text.splitlines(), 1):
            for flag in re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", line):
                if flag not in known and flag not in FOREIGN_FLAGS and flag not in sources:
                    problems.append(f"{doc}:{number}: {flag!r}: no option of paged-run, none "
                                    "of our scripts' sources mentions it")
    return problems


_IMPORT_RE = re.compile(r"from (pagedrun(?:\.\w+)*) import ([\w, ]+)")


def check_imports(docs: dict[str, str]) -> list[str]:
    """Every `from pagedrun... import a, b` a doc shows must import (module and names)."""
    problems = []
    for doc, text in docs.items():
        for number, line in enumerate(text.splitlines(), 1):
            for module_name, names in _IMPORT_RE.findall(line):
                try:
                    module = importlib.import_module(module_name)
                except ImportError as exc:
                    problems.append(f"{doc}:{number}: import {module_name} fails: {exc}")
                    continue
                problems += [f"{doc}:{number}: {module_name} has no {name}"
                             for name in re.findall(r"\w+", names) if not hasattr(module, name)]
    return problems


def check_test_names(docs: dict[str, str], repo: Path = REPO) -> list[str]:
    """A test the docs cite by name (`test_length_is_checked_before_eos`, or a node id
    `tests/x/test_y.py::test_z`) must be defined: in that file for a node id, else anywhere."""
    this_file = Path(__file__).resolve()
    by_file = {p: p.read_text() for p in (repo / "tests").rglob("*.py") if p.resolve() != this_file}
    defined = set(re.findall(r"def (test_\w+)", "\n".join(by_file.values())))
    problems = []
    for doc, text in docs.items():
        for number, line in enumerate(text.splitlines(), 1):
            for path, name in re.findall(r"(?:([\w/.-]+\.py)::)?(?<![\w/.])(test_\w+)(?![\w.])",
                                         line):
                source = by_file.get(repo / path) if path else None
                if path and source is not None and f"def {name}(" not in source:
                    problems.append(f"{doc}:{number}: no test {name} in {path}")
                elif name not in defined:
                    problems.append(f"{doc}:{number}: no test named {name} under tests/")
    return problems


# ---------------------------------------------------------------------------------- tests

def _all(extract) -> list[Claim]:
    return [c for doc in DOCS for c in extract(str(doc.relative_to(REPO)), doc.read_text())]


def test_doc_commands_exist():
    claims = _all(extract_commands)
    problems = check_commands(claims)
    assert not problems, f"{len(problems)} doc command claim(s) false:\n" + "\n".join(problems)


def test_doc_paths_exist():
    problems = check_paths(_all(extract_paths))
    assert not problems, f"{len(problems)} doc path claim(s) false:\n" + "\n".join(problems)


def test_doc_prose_flags_exist():
    docs = {str(doc.relative_to(REPO)): doc.read_text() for doc in DOCS}
    problems = check_prose_flags(docs)
    assert not problems, f"{len(problems)} doc flag claim(s) false:\n" + "\n".join(problems)


def test_doc_test_names_exist():
    docs = {str(doc.relative_to(REPO)): doc.read_text() for doc in DOCS}
    problems = check_test_names(docs)
    assert not problems, f"{len(problems)} doc test-name claim(s) false:\n" + "\n".join(problems)


def test_doc_imports_work():
    docs = {str(doc.relative_to(REPO)): doc.read_text() for doc in DOCS}
    assert sum(len(_IMPORT_RE.findall(t)) for t in docs.values()) >= 10   # the net sees them
    problems = check_imports(docs)
    assert not problems, f"{len(problems)} doc import claim(s) false:\n" + "\n".join(problems)


def test_planted_imports_are_reported():
    planted = "from pagedrun.client import Client, Clinet\nfrom pagedrun.no_such import X\n"
    problems = check_imports({"doc.md": planted})
    assert problems[0] == "doc.md:1: pagedrun.client has no Clinet"
    assert problems[1].startswith("doc.md:2: import pagedrun.no_such fails") and len(problems) == 2


def test_planted_test_names_are_reported():
    planted = ("held by `test_no_such_rule`, and by "
               "`tests/engine/test_sim_backend.py::test_length_is_checked_before_eos`\n")
    assert check_test_names({"doc.md": planted}) == [
        "doc.md:1: no test named test_no_such_rule under tests/",
        "doc.md:1: no test test_length_is_checked_before_eos in tests/engine/test_sim_backend.py",
    ]


def test_planted_prose_flag_is_reported():
    problems = check_prose_flags({"doc.md": "`paged-run http` takes `--engine`, `--enjin`.\n"})
    assert problems == ["doc.md:1: '--enjin': no option of paged-run, none of our scripts' "
                        "sources mentions it"]


def test_extraction_finds_the_readme_commands():
    # The extractor must see the README's own usage block, or the tests above prove nothing.
    texts = {c.text for c in _all(extract_commands) if c.doc == "README.md"}
    for expected in ("bash scripts/demo.sh", "paged-run chat", "paged-run env",
                     "paged-run convert MODEL.gguf OUT_DIR",
                     'paged-run generate "What is the capital of France?"'):
        assert any(t.startswith(expected) for t in texts), (expected, sorted(texts))
    assert any(t.startswith("paged-run serve [MODEL] --port 5555") for t in texts)


PLANTED_DOC = """# A planted doc
Run `paged-run serve --model M --port 5555` first.

```bash
node 0:  paged-run serve M --device gpu \\
    --tensor-parallel-size 2
paged-run frobnicate --fast
python benchmarks/bench_scheduler.py --no-such-flag   # tail
bash scripts/install.sh --editable --nope
```
The engine lives in runtime/no_such_engine.py and cuda/paged_attention_{decode,nope}.cu;
see benchmarks/kernels/bench_nothing.py, and runtime/
engine_config.py is real, as are `runtime/kernels/gemm.py` and bench_gemm.py, not nope_gemm.cu.
"""


@pytest.mark.parametrize("planted,kind", [
    ("doc.md:2: 'paged-run serve --model M --port 5555': `paged-run serve` has no option "
     "--model", "command"),
    ("doc.md:5: 'paged-run serve M --device gpu --tensor-parallel-size 2': `paged-run serve "
     "--device` has no choice gpu", "command"),
    ("doc.md:7: 'paged-run frobnicate --fast': `paged-run` has no subcommand 'frobnicate'",
     "command"),
    ("doc.md:8: 'python benchmarks/bench_scheduler.py --no-such-flag   # tail': "
     "`benchmarks/bench_scheduler.py` has no option --no-such-flag", "command"),
    ("doc.md:9: 'bash scripts/install.sh --editable --nope': scripts/install.sh never "
     "mentions --nope", "command"),
    ("doc.md:11: 'runtime/no_such_engine.py': no path runtime/no_such_engine.py", "path"),
    ("doc.md:11: 'cuda/paged_attention_{decode,nope}.cu': no path cuda/paged_attention_nope.cu",
     "path"),
    ("doc.md:12: 'benchmarks/kernels/bench_nothing.py': no path", "path"),
    ("doc.md:13: 'nope_gemm.cu': no file named nope_gemm.cu", "path"),
])
def test_planted_false_claims_are_reported(planted, kind):
    if kind == "command":
        problems = check_commands(extract_commands("doc.md", PLANTED_DOC))
    else:
        problems = check_paths(extract_paths("doc.md", PLANTED_DOC))
    assert any(p.startswith(planted) for p in problems), "\n".join(problems)


def test_planted_doc_true_claims_pass():
    # Exactly the planted falsehoods: the true claims next to them are not reported.
    commands = check_commands(extract_commands("doc.md", PLANTED_DOC))
    paths = check_paths(extract_paths("doc.md", PLANTED_DOC))
    assert len(commands) == 5, "\n".join(commands)
    assert len(paths) == 4, "\n".join(paths)


# ---------------------------------------------------------------------------------- child

class _Captured(Exception):
    pass


def _dump_script_parsers(scripts: list[str]) -> dict:
    """Run each script as __main__ up to its parse_args and describe the parser it built."""
    def to_dict(info: ParserInfo) -> dict:
        return {"options": sorted(info.options), "choices": info.choices,
                "takes_value": sorted(info.takes_value), "help_ok": info.help_ok,
                "positionals": info.positionals,
                "subcommands": {k: to_dict(v) for k, v in info.subcommands.items()}}

    def capture(self, *args, **kwargs):
        raise _Captured(self)

    argparse.ArgumentParser.parse_args = capture
    argparse.ArgumentParser.parse_known_args = capture
    base_modules, base_path = set(sys.modules), list(sys.path)
    out = {}
    for script in scripts:
        path = REPO / script
        if "ArgumentParser" not in path.read_text():
            out[script] = "no argparse"   # the caller checks its flags against its source
            continue
        sys.argv = [str(path), "--help"]
        sys.path[:] = [str(path.parent), *base_path]
        # A sibling helper module of one folder must not serve the next folder's script.
        for name in set(sys.modules) - base_modules:
            if getattr(sys.modules[name], "__file__", None) and str(
                    sys.modules[name].__file__).startswith(str(REPO / "benchmarks")):
                del sys.modules[name]
        try:
            runpy.run_path(str(path), run_name="__main__")
            out[script] = "ran to its end without calling parse_args"
        except _Captured as captured:
            parser = captured.args[0]
            info = parser_info(parser)
            info.help_ok = bool(parser.format_help())
            out[script] = to_dict(info)
        except BaseException as exc:  # noqa: BLE001 - reported per script, not fatal
            # It cannot run here (needs a GPU, or a module mid-move): read its parser's
            # literal option strings from the source instead.
            static = _static_parser_info(path)
            out[script] = (f"failed before parsing its arguments: {exc!r}" if static is None
                           else to_dict(static))
    return out


def _static_parser_info(path: Path) -> ParserInfo | None:
    """The union of a script's literal add_argument options and add_parser names (no run)."""
    tree = ast.parse(path.read_text())
    info, found, subcommands = ParserInfo(set(), {}, set(), {}), False, []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        literals = [a.value for a in node.args
                    if isinstance(a, ast.Constant) and isinstance(a.value, str)]
        if node.func.attr == "ArgumentParser":
            found = True
        elif node.func.attr == "add_parser" and literals:
            subcommands.append(literals[0])
        elif node.func.attr == "add_argument":
            found = True
            options = [lit for lit in literals if lit.startswith("-")]
            info.options.update(options)
            info.takes_value.update(options)   # unknown from the source: assume it does
    # Which subcommand owns which option is not read: every subcommand gets them all.
    info.subcommands = {name: ParserInfo(info.options, {}, info.takes_value, {})
                        for name in subcommands}
    return info if found else None


if __name__ == "__main__":
    print(json.dumps(_dump_script_parsers(sys.argv[1:])))
