#!/usr/bin/env bash
# The lint tier: ruff with the rule set in pyproject.toml ([tool.ruff]). Installs the pinned
# ruff when this interpreter lacks it (or has another version), then checks the tree.
#   bash scripts/lint.sh            # check (what CI runs)
#   bash scripts/lint.sh --fix      # extra arguments go to `ruff check`
set -euo pipefail
cd "$(dirname "$0")/.."

RUFF_VERSION="0.17.6"

# The interpreter: the one scripts/install.sh installed paged-run into (scripts/python), else
# the one install.sh would pick first ($PYTHON or python3). ruff needs nothing of paged-run,
# so linting a checkout that was never installed works too.
if [ -x scripts/python ] && scripts/python -c "" 2>/dev/null; then
  PY=scripts/python
else
  PY="${PYTHON:-python3}"
fi

installed="$("$PY" -m ruff --version 2>/dev/null || true)"
if [ "$installed" != "ruff $RUFF_VERSION" ]; then
  "$PY" -m pip install -q --disable-pip-version-check "ruff==$RUFF_VERSION"
fi

# No cache: the whole tree takes well under a second, and nothing is left in the checkout.
exec "$PY" -m ruff check --no-cache "$@"
