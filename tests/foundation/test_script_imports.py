"""The Python that the shell scripts carry inline (heredocs in scripts/*.sh and .ci/run) imports
only names that exist: such code is not seen by the layering test or by any import in the test
suite, and a renamed function once made install.sh fail at its very end (and with it CI's
tier 1)."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = sorted(ROOT.glob("scripts/*.sh")) + [ROOT / ".ci" / "run"]
IMPORT_LINE = re.compile(r"^\s*(from pagedrun[\w.]* import [\w, ]+|import pagedrun[\w.]*)\s*$")


def _inline_imports() -> list[tuple[str, str]]:
    found = []
    for script in SCRIPTS:
        for number, line in enumerate(script.read_text().splitlines(), 1):
            if IMPORT_LINE.match(line):
                found.append((f"{script.relative_to(ROOT)}:{number}", line.strip()))
    return found


def test_scripts_carry_imports_to_check() -> None:
    assert any("install.sh" in where for where, _ in _inline_imports())


def test_every_inline_import_resolves() -> None:
    imports = _inline_imports()
    code = "\n".join(stmt for _, stmt in imports)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            cwd="/")
    assert result.returncode == 0, (imports, result.stderr)
