#!/usr/bin/env bash
# The README's first command: start `paged-run serve` with the default model (SmolLM2-135M;
# --device auto: the GPU when CuPy sees one, else numpy on the CPU) in the background, wait
# until it answers PING, ask it a question through the Python client (pagedrun.client), print
# the answer, and stop the server with SIGTERM (it drains and exits 0). It runs the interpreter
# that scripts/install.sh installed into (scripts/python), and prints the server's startup
# summary, whose first line names the device it serves on.
#   bash scripts/demo.sh                       # asks "What is the capital of France?"
#   bash scripts/demo.sh "Why is the sky blue?" [PORT]
set -euo pipefail
cd "$(dirname "$0")/.."

QUESTION="${1:-What is the capital of France?}"
PORT="${2:-5555}"
ENDPOINT="tcp://127.0.0.1:${PORT}"
PY=scripts/python   # the interpreter install.sh installed into (see scripts/install.sh)
READY_TIMEOUT_S=300
LOG="$(mktemp -t paged-run-demo.XXXXXX.log)"

# `python -m pagedrun` is the `paged-run` CLI (no PATH shim needed).
"$PY" -m pagedrun serve --port "$PORT" --max-model-len 2048 >"$LOG" 2>&1 &
SERVER_PID=$!
cleanup() { if kill -0 "$SERVER_PID" 2>/dev/null; then kill -KILL "$SERVER_PID"; fi; }
trap cleanup EXIT

"$PY" - "$ENDPOINT" "$READY_TIMEOUT_S" "$SERVER_PID" <<'PYEOF'
import os, sys, time
from pagedrun.client import Client, RequestTimeout
endpoint, timeout_s, pid = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
deadline = time.monotonic() + timeout_s
while True:
    try:
        os.kill(pid, 0)
    except OSError:
        sys.exit("paged-run serve exited before it was ready")
    try:
        with Client(endpoint, timeout_s=1.0) as c:
            c.ping()
            break
    except RequestTimeout:
        if time.monotonic() > deadline:
            sys.exit(f"paged-run serve not ready after {timeout_s} s")
PYEOF
# The startup summary: "paged-run serve: model ... on DEVICE (DTYPE)", KV cache, endpoint. The
# server prints it from a thread once bound, so it may trail the first PING answer a little.
for _ in $(seq 50); do grep -q '^paged-run serve:' "$LOG" && break; sleep 0.1; done
if ! grep -A3 '^paged-run serve:' "$LOG"; then
  echo "demo: the server printed no startup summary (so no device line); its log so far:" >&2
  cat "$LOG" >&2
fi

"$PY" - "$ENDPOINT" "$QUESTION" <<'PYEOF'
import sys
from pagedrun.client import Client
endpoint, question = sys.argv[1], sys.argv[2]
with Client(endpoint, timeout_s=600) as c:
    out = c.generate(messages=[{"role": "user", "content": question}],
                     sampling_params={"max_tokens": 64, "temperature": 0})
print(f"Q: {question}")
print(f"A: {out.text.strip()}")
m = out.metrics
print(f"({out.usage['completion_tokens']} tokens, time to first token "
      f"{m['time_to_first_token_s']:.2f} s, {out.finish_reason})", file=sys.stderr)
PYEOF

kill -TERM "$SERVER_PID"
wait "$SERVER_PID"
