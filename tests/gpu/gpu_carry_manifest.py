"""The GPU check's carry manifest: what scripts/prepare_gpu_carry.sh built, and from which tree.

The leased GPU machine installs paged-run from a wheel built on the CPU box (.gpu_carry/), but
runs the tests of the working tree that travels with the call. If the two differ -- a kernel
edited after the wheel was built -- every failure there is a puzzle, so the manifest records a
sha256 per package input and both sides compare:

    python tests/gpu/gpu_carry_manifest.py write .gpu_carry/carry.json --wheel W ... --note K=V
    python tests/gpu/gpu_carry_manifest.py check .gpu_carry/carry.json   # exit 1 when stale

Package inputs: what the wheel is built from (cuda/, runtime/, server/, python/pagedrun/, pyx/,
CMakeLists.txt, pyproject.toml) less what git ignores there (caches, built modules, fatbins of
an in-tree build): the same walk on the CPU box and on the device, where no .git travels.
Standard library only: it runs under the device's Python before anything is installed.
"""
from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
INPUT_DIRS = ("cuda", "runtime", "server", "python/pagedrun", "pyx")
INPUT_FILES = ("CMakeLists.txt", "pyproject.toml")
# Ignored by .gitignore inside the input folders, so they do not travel (or differ by machine).
SKIP_DIR_NAMES = {"__pycache__", "prebuilt", "build"}
SKIP_SUFFIXES = (".pyc", ".so")
# How many differing paths a failed check prints before it summarizes.
MAX_LISTED = 20


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def input_files(root: Path = ROOT) -> list[str]:
    """The package inputs under `root`, as sorted posix paths relative to it."""
    found = [name for name in INPUT_FILES if (root / name).is_file()]
    for top in INPUT_DIRS:
        for path in (root / top).rglob("*"):
            rel = path.relative_to(root)
            if (not path.is_file() or path.name.endswith(SKIP_SUFFIXES)
                    or SKIP_DIR_NAMES.intersection(rel.parts[:-1])):
                continue
            found.append(rel.as_posix())
    return sorted(found)


def fingerprint(root: Path = ROOT) -> dict[str, str]:
    return {rel: _sha256(root / rel) for rel in input_files(root)}


def tree_digest(files: dict[str, str]) -> str:
    """One sha256 over the per-file hashes: the short name of a tree state."""
    h = hashlib.sha256()
    for rel, digest in sorted(files.items()):
        h.update(f"{rel}\0{digest}\n".encode())
    return h.hexdigest()


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""


def write(out: Path, wheels: list[Path], notes: dict[str, str], root: Path = ROOT) -> dict:
    files = fingerprint(root)
    manifest = {
        "created_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M"),
        "commit": _git("rev-parse", "HEAD") or "unknown",
        # Uncommitted edits are built into the wheel too: the record says so.
        "dirty": bool(_git("status", "--porcelain", "--untracked-files=no")),
        "tree_sha256": tree_digest(files),
        "wheels": {w.name: _sha256(w) for w in wheels},
        "notes": notes,
        "files": files,
    }
    out.write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def stale_paths(manifest: dict, root: Path = ROOT) -> list[str]:
    """Package inputs that differ between the manifest and the tree at `root`, each with why."""
    recorded, current = manifest["files"], fingerprint(root)
    problems = [f"changed since the carry was built: {rel}"
                for rel in sorted(recorded.keys() & current.keys())
                if recorded[rel] != current[rel]]
    problems += [f"missing from this tree: {rel}"
                 for rel in sorted(recorded.keys() - current.keys())]
    problems += [f"not in the carry (new file): {rel}"
                 for rel in sorted(current.keys() - recorded.keys())]
    return problems


def check(path: Path, root: Path = ROOT) -> int:
    manifest = json.loads(path.read_text())
    problems = stale_paths(manifest, root)
    for rel, digest in manifest.get("wheels", {}).items():
        wheel = path.parent / rel
        if not wheel.is_file():
            problems.append(f"wheel missing: {wheel}")
        elif _sha256(wheel) != digest:
            problems.append(f"wheel differs from the one recorded: {wheel}")
    dirty = " (+ uncommitted edits)" if manifest["dirty"] else ""
    print(f"carry: commit {manifest['commit'][:12]}{dirty}, "
          f"built {manifest['created_utc']} UTC, tree {manifest['tree_sha256'][:12]}, "
          f"{len(manifest['files'])} package inputs")
    for key, value in manifest.get("notes", {}).items():
        print(f"carry: {key}: {value}")
    if not problems:
        print("carry: matches this tree")
        return 0
    for line in problems[:MAX_LISTED]:
        print(f"carry STALE: {line}")
    if len(problems) > MAX_LISTED:
        print(f"carry STALE: ... and {len(problems) - MAX_LISTED} more")
    print("carry: rebuild it on the CPU box (bash scripts/prepare_gpu_carry.sh) before the call")
    return 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("write", help="record the tree and the wheels")
    w.add_argument("out", type=Path)
    w.add_argument("--wheel", type=Path, action="append", default=[])
    w.add_argument("--note", action="append", default=[], metavar="KEY=VALUE")
    c = sub.add_parser("check", help="exit 1 when the tree or a wheel differs from the record")
    c.add_argument("manifest", type=Path)
    for p in (w, c):
        p.add_argument("--root", type=Path, default=ROOT, help="the tree (default: this repo)")
    args = ap.parse_args(argv)
    if args.cmd == "write":
        notes = dict(n.split("=", 1) for n in args.note)
        manifest = write(args.out, args.wheel, notes, args.root)
        print(f"carry: wrote {args.out} (tree {manifest['tree_sha256'][:12]}, "
              f"{len(manifest['files'])} package inputs)")
        return 0
    return check(args.manifest, args.root)


if __name__ == "__main__":
    sys.exit(main())
