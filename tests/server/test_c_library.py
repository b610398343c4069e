"""The C client library (clients/c): built with CMake into a temp dir, installed, and its test
program (clients/c/tests/test_client.c) built through pkg-config against the installed library,
then run against real servers: run_fake_server.py processes (streaming, abort, timeouts, a
killed-and-restarted server, a hung server, CURVE), an in-process server with a short lease, and
a tiny ROUTER here that answers garbage frames; the 1.2 request fields (chat options,
lora_name) and LOAD_LORA / UNLOAD_LORA against in-process servers (the fake engine, and the tiny
fixture model with LoRA on), each compared with what the Python client gets. A
-fsanitize=address,undefined build of the same program runs the API, abort, request_ext and
malformed-reply scenarios once more.

Timing bounds hold on a loaded machine (2 cores with the rest of the suite running): what
should happen "at once" gets FAST_S of scheduling slack, what a timer decides gets its timer +
FAST_S, and every timer it must be told apart from is set well above that. No step can block
for long: the interactive programs and the servers are read by threads, with timeouts."""
from __future__ import annotations

import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time

import msgpack
import pytest
import zmq
from fake_engine import (FakeEngine, expected_cumulative_logprob, expected_tokens,
                         sampled_rank)

from pagedrun.client import Client

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
LIB_SRC = os.path.join(REPO, "clients", "c")
TEST_SRC = os.path.join(LIB_SRC, "tests", "test_client.c")
BUILD_TIMEOUT_S = 240
RUN_TIMEOUT_S = 60
STEP_TIMEOUT_S = 30  # one interactive step (a line from the program, a server start)
# "at once": no timer involved, only scheduling delay on a loaded machine. Every timeout such a
# path must be told apart from (request timeouts, connect timeouts, ping timeouts, the fake
# server's token delay) is set well above it.
FAST_S = 2.5
RUN_FAKE_SERVER = os.path.join(REPO, "tests", "server", "run_fake_server.py")


def _run(cmd, **kw):
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S, **kw)
    assert proc.returncode == 0, f"{cmd}\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def _pkg_config(prefix, *args):
    env = dict(os.environ, PKG_CONFIG_PATH=os.path.join(prefix, "lib", "pkgconfig"))
    return _run(["pkg-config", *args, "pagedrun_client"], env=env).split()


@pytest.fixture(scope="module")
def c_lib(tmp_path_factory):
    """(prefix, test program) of an installed library."""
    for tool in ("cmake", "cc", "pkg-config"):
        if shutil.which(tool) is None:
            pytest.skip(f"no {tool} (scripts/install.sh installs the build deps)")
    tmp = tmp_path_factory.mktemp("c_lib")
    build, prefix = str(tmp / "build"), str(tmp / "prefix")
    _run(["cmake", "-S", LIB_SRC, "-B", build, "-DCMAKE_BUILD_TYPE=RelWithDebInfo",
          "-DCMAKE_INSTALL_LIBDIR=lib"])
    _run(["cmake", "--build", build])
    _run(["cmake", "--install", build, "--prefix", prefix])
    exe = str(tmp / "test_client")
    libdir = _pkg_config(prefix, "--variable=libdir")[0]
    _run(["cc", "-std=c99", "-O1", "-g", "-Wall", "-Wextra", "-Werror",
          *_pkg_config(prefix, "--cflags"), "-o", exe, TEST_SRC,
          *_pkg_config(prefix, "--libs"), f"-Wl,-rpath,{libdir}"])
    return prefix, exe


@pytest.fixture
def server_process(tmp_path):
    """server_process(*args) -> (Popen, endpoint): run_fake_server.py in a child process, killed
    after the test if still alive. Unlike conftest's fixture of the same name, waiting for its
    READY line is bounded, and its output is drained (a full pipe cannot stall it)."""
    procs = []

    def start(*args):
        log = open(tmp_path / f"server{len(procs)}.log", "w")
        proc = subprocess.Popen([sys.executable, RUN_FAKE_SERVER, *map(str, args)],
                                stdout=subprocess.PIPE, stderr=log, text=True)
        log.close()
        procs.append(proc)
        lines = _reader(proc.stdout)
        try:
            line = lines.get(timeout=STEP_TIMEOUT_S) or ""
        except queue.Empty:
            line = "(nothing)"
        if not line.startswith("READY "):
            proc.kill()
            proc.wait(10)
            raise RuntimeError(f"server did not start within {STEP_TIMEOUT_S} s: {line!r} "
                               f"{(tmp_path / f'server{len(procs) - 1}.log').read_text()[-2000:]}")
        return proc, line.split()[1]

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()  # SIGKILL ends a SIGSTOPped one too
        proc.wait(10)


def _reader(stream) -> queue.Queue:
    """A thread that puts each line of `stream` in the returned queue, then None at EOF."""
    lines: queue.Queue = queue.Queue()

    def pump():
        for line in stream:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    return lines


class Interactive:
    """A test program that the test talks to through stdin / stdout, every step bounded: its
    stdout and stderr are read by threads, so a program that stops talking (or dies) fails the
    test with what it printed instead of blocking it."""

    def __init__(self, *args):
        self.proc = subprocess.Popen(list(map(str, args)), stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.out: list[str] = []
        self._lines = _reader(self.proc.stdout)
        self._err: list[str] = []
        self._err_thread = threading.Thread(target=lambda: self._err.extend(self.proc.stderr),
                                            daemon=True)
        self._err_thread.start()
        self._eof = False

    def transcript(self) -> str:
        return "".join(self.out) + "".join(self._err)

    def _next(self, timeout: float) -> str | None:
        """The next stdout line, None at EOF; fails after `timeout` s."""
        if self._eof:
            return None
        try:
            line = self._lines.get(timeout=max(0.01, timeout))
        except queue.Empty:
            raise AssertionError(f"no line within {timeout:.1f} s:\n{self.transcript()}") \
                from None
        if line is None:
            self._eof = True
            return None
        self.out.append(line)
        return line

    def readline(self, timeout: float = STEP_TIMEOUT_S) -> str:
        line = self._next(timeout)
        if line is None:
            self.proc.wait(10)
            raise AssertionError(f"the program ended early (status {self.proc.returncode}):\n"
                                 f"{self.transcript()}")
        return line.strip()

    def read_until(self, marker: str, timeout: float = STEP_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while self.readline(deadline - time.monotonic()) != marker:
            pass

    def send(self, line: str) -> None:
        try:
            self.proc.stdin.write(line + "\n")
            self.proc.stdin.flush()
        except OSError as exc:  # BrokenPipeError: it exited
            self.proc.wait(10)
            raise AssertionError(f"the program ended early ({exc!r}, status "
                                 f"{self.proc.returncode}):\n{self.transcript()}") from None

    def finish(self, timeout: float = RUN_TIMEOUT_S) -> dict:
        """Reads the rest until it exits (all within `timeout` s); its "KEY value" lines. Fails
        unless it exited 0 with DONE failures=0."""
        deadline = time.monotonic() + timeout
        while self._next(deadline - time.monotonic()) is not None:
            pass
        self.proc.wait(max(0.01, deadline - time.monotonic()))
        self._err_thread.join(10)
        assert self.proc.returncode == 0 and "DONE failures=0" in "".join(self.out), \
            self.transcript()
        return _lines("".join(self.out))

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def _lines(out: str) -> dict:
    return dict(line.split(" ", 1) if " " in line else (line, "") for line in out.splitlines())


def run_c(exe, *args, check=True, env=None):
    proc = subprocess.run([exe, *map(str, args)], capture_output=True, text=True,
                          timeout=RUN_TIMEOUT_S, env=env)
    if check:
        assert proc.returncode == 0 and "DONE failures=0" in proc.stdout, \
            proc.stdout + proc.stderr
    return _lines(proc.stdout), proc


def _ints(s: str) -> list[int]:
    return [int(t) for t in s.split()]


# --- build and install ---------------------------------------------------------------------
def test_install_layout(c_lib):
    prefix, _ = c_lib
    lib = os.path.join(prefix, "lib")
    assert os.path.isfile(os.path.join(prefix, "include", "pagedrun_client.h"))
    assert os.path.isfile(os.path.join(lib, "libpagedrun_client.a"))
    assert os.path.islink(os.path.join(lib, "libpagedrun_client.so"))
    assert _pkg_config(prefix, "--modversion") == ["1.2.0"]  # 1.2: protocol 1.4
    if shutil.which("nm"):  # only the API is exported
        syms = _run(["nm", "-D", "--defined-only", os.path.join(lib, "libpagedrun_client.so")])
        names = [ln.split()[-1] for ln in syms.splitlines() if " T " in ln]
        assert names and all(n.startswith("pagedrun_") for n in names), names


def test_static_link(c_lib, tmp_path):
    """The static library links on its own (with libzmq and msgpack-c)."""
    prefix, _ = c_lib
    deps = (subprocess.run(["pkg-config", "--libs", "libzmq", "msgpack-c"], capture_output=True,
                           text=True).stdout.split()
            or _run(["pkg-config", "--libs", "libzmq", "msgpack"]).split())
    exe = str(tmp_path / "test_client_static")
    _run(["cc", "-std=c99", "-O1", *_pkg_config(prefix, "--cflags"), "-o", exe, TEST_SRC,
          os.path.join(prefix, "lib", "libpagedrun_client.a"), *deps])
    out, _ = run_c(exe, "tcp://127.0.0.1:1", "down")
    assert out["CONNECT"].split()[0] == "server_unavailable"


# --- against run_fake_server.py ------------------------------------------------------------
@pytest.mark.parametrize("transport", ["tcp", "ipc"])
def test_api_stream_generate_concurrency_errors(c_lib, server_process, tmp_path, transport):
    _, exe = c_lib
    ep0 = "tcp://127.0.0.1:0" if transport == "tcp" else f"ipc://{tmp_path}/s.sock"
    _, ep = server_process(ep0, "--step-delay-s", "0.002")
    prompt, max_tokens = "Bonjour from C", 9
    out, _ = run_c(exe, ep, "api", prompt, max_tokens)
    want = expected_tokens(list(prompt.encode()), max_tokens)
    info = dict(kv.split("=", 1) for kv in out["INFO"].split())
    assert info["model"] == "fake-byte-model" and info["max_model_len"] == "256"
    assert float(info["lease"]) == 30.0 and info["revision"] == "1.4"
    assert len(info["server_id"]) == 16
    assert _ints(out["STREAM_TOKENS"]) == want and out["STREAM_TEXT"] == bytes(want).decode()
    assert out["STREAM_FINISH"] == "length" and out["STREAM_DELTAS"] == str(max_tokens)
    assert out["STREAM_USAGE"] == f"{len(prompt)} {max_tokens}"
    assert out["STREAM_LOGPROBS"] == f"{len(prompt)} {max_tokens}"  # prompt entries, tokens
    # 1.3: rank / n_top / the best top entry of each sampled token (logprobs 1): the fake
    # engine's sampled token has rank 1, 2, 3, 1, ...; the best is itself at rank 1, else its
    # made-up token + 101
    ranks = [sampled_rank(p) for p in range(max_tokens)]
    assert out["STREAM_RANKS"].split() == [
        f"{r}/1/{t if r == 1 else (t + 101) % 512}" for r, t in zip(ranks, want)]
    assert out["STREAM_DECODED"] == bytes(want).decode()
    assert out["STREAM_PROMPT_RANKS"].split() == ["-"] + [str(1 + i % 3)
                                                         for i in range(1, len(prompt))]
    assert [float(v) for v in out["STREAM_CUMS"].split()] == [
        expected_cumulative_logprob(n) for n in range(1, max_tokens + 1)]
    assert out["GEN_CUM"].split() == ["1", f"{expected_cumulative_logprob(max_tokens):g}"]
    assert _ints(out["GEN_TOKENS"]) == want and out["GEN_TEXT"] == bytes(want).decode()
    assert out["GEN_FINISH"] == "length"
    for i, p in enumerate(["alpha", "bravo charlie", "delta echo foxtrot", "g"]):
        assert _ints(out[f"CONC_{i}"]) == expected_tokens(list(p.encode()), 7)
    assert _ints(out["IDS_TOKENS"]) == expected_tokens([72, 105, 33], 5)
    assert len(_ints(out["CHAT_TOKENS"])) == 5
    assert out["EXTRA_FINISH"] == "length 4"
    assert out["ERR_INVALID"].startswith("invalid_request [invalid_request] ")
    assert "temperature" in out["ERR_INVALID"]
    assert out["ERR_EMPTY"] == "empty_prompt" and out["ERR_TOO_LONG"] == "prompt_too_long"
    assert out["PONG"] == "status=ok lease=30 rtt_ok=1"
    assert out["NAMES"] == "capacity timeout server_unavailable malformed_reply connection"


def test_abort(c_lib, server_process):
    _, exe = c_lib
    # 200 tokens take 6 s: every abort lands mid-stream, even with the client held up for a while
    _, ep = server_process("tcp://127.0.0.1:0", "--step-delay-s", "0.03")
    out, _ = run_c(exe, ep, "abort", "please stop")
    assert out["ABORT_ID"] == "found=1 finish=abort finals=1 deltas_lt_200=1"
    assert out["ABORT_RETURN"] == "finish=abort finals=1"
    assert out["ABORT_CALL"] == "finish=abort finals=1"
    assert out["ABORT_UNKNOWN"] == "found=0"


def test_timeout_and_deadline(c_lib, server_process):
    """A 0.3 s per-frame timeout and a 0.5 s deadline (scenario_timeout) against a server whose
    first token takes 5 s: each ends at its own bound (+ slack), long before any reply."""
    _, exe = c_lib
    step_s = 5.0
    _, ep = server_process("tcp://127.0.0.1:0", "--step-delay-s", step_s)
    out, _ = run_c(exe, ep, "timeout")
    status, elapsed, errors = out["TIMEOUT"].split()
    assert status == "timeout" and 0.25 <= float(elapsed) < 0.3 + FAST_S < step_s, out
    assert errors == "errors=1"
    status, elapsed = out["DEADLINE"].split()
    assert status == "timeout" and 0.45 <= float(elapsed) < 0.5 + FAST_S < step_s, out


# 200 tokens at 0.05 s: the stream is still going when the test acts on STREAMING
STREAM_STEP_S = 0.05
RESTART_PING_TIMEOUT_S = 3.0  # above FAST_S: a lost connection is told apart from a PING


def test_server_killed_then_restarted(c_lib, server_process):
    """SIGKILL mid-stream: server_unavailable at once (the connection drops); while nothing
    listens a new request fails within ping_timeout_s; once a new server is up on the same
    endpoint the same client works again (and after an explicit reconnect)."""
    _, exe = c_lib
    pto = RESTART_PING_TIMEOUT_S
    proc, ep = server_process("tcp://127.0.0.1:0", "--step-delay-s", STREAM_STEP_S)
    c = Interactive(exe, ep, "restart", "restart me", pto)
    try:
        # printed once the library returned: the kill is seen by the next wait, not before
        assert c.readline() == "STREAMING", c.transcript()
        proc.kill()
        proc.wait(10)
        c.send("killed")
        c.read_until("DOWN_READY")
        server_process(ep, "--step-delay-s", "0.001")  # same endpoint
        c.send("restarted")
        out = c.finish()
    finally:
        c.close()
    status, elapsed = out["LOST"].split()  # the C side checked it ended in that wait
    assert status == "server_unavailable" and float(elapsed) < FAST_S, out
    assert "lost" in out["LOST_MESSAGE"], out  # the connection drop, not a PING
    status, elapsed = out["WHILE_DOWN"].split()
    assert status == "server_unavailable" and float(elapsed) < pto + FAST_S, out
    assert out["AFTER"] == "ok 3 length", out
    first, second, changed = out["INSTANCES"].split()
    assert len(first) == 16 and len(second) == 16 and changed == "changed=1", out
    assert out["RECONNECTED"] == "ok 3", out


def test_hung_server_detected_by_ping(c_lib, server_process):
    """SIGSTOP: the connection stays up, so only the PINGs tell (heartbeat 0.5 s, ping timeout
    1.5 s): server_unavailable within heartbeat + ping timeout (+ slack), not the 30 s timeout."""
    _, exe = c_lib
    hb, pto = 0.5, 1.5
    proc, ep = server_process("tcp://127.0.0.1:0", "--step-delay-s", STREAM_STEP_S)
    c = Interactive(exe, ep, "hung", "hang on", hb, pto)
    try:
        assert c.readline() == "STREAMING", c.transcript()
        proc.send_signal(signal.SIGSTOP)
        c.send("stopped")
        out = c.finish()
    finally:
        proc.send_signal(signal.SIGCONT)
        c.close()
    status, elapsed = out["HUNG"].split()
    assert status == "server_unavailable" and float(elapsed) < hb + pto + FAST_S, out
    assert "PING" in out["HUNG_MESSAGE"], out


def test_no_server(c_lib):
    _, exe = c_lib
    pto, connect_timeout = 0.5, 0.8
    out, _ = run_c(exe, "tcp://127.0.0.1:1", "down", pto, connect_timeout)
    status, elapsed = out["CONNECT"].split()  # the C side checked >= connect_timeout_s
    assert status == "server_unavailable" and float(elapsed) < connect_timeout + FAST_S, out
    status, elapsed = out["GENERATE"].split()  # the PING, not the 60 s request timeout
    assert status == "server_unavailable" and float(elapsed) < pto + FAST_S, out
    assert out["BAD_ENDPOINT"] == "connection"


def _curve_keys(tmp_path):
    import zmq.auth

    from pagedrun.server.auth import create_key_pair
    server_pub, server_secret = create_key_pair(str(tmp_path / "server"), "server")
    _, alice_secret = create_key_pair(str(tmp_path / "pairs"), "alice")
    os.makedirs(tmp_path / "allowed")
    os.replace(tmp_path / "pairs" / "alice.key", tmp_path / "allowed" / "alice.key")
    _, mallory_secret = create_key_pair(str(tmp_path / "stranger"), "mallory")
    spub, _ = zmq.auth.load_certificate(server_pub)
    return (server_secret, str(tmp_path / "allowed"), spub.decode(),
            [k.decode() for k in zmq.auth.load_certificate(alice_secret)],
            [k.decode() for k in zmq.auth.load_certificate(mallory_secret)])


def test_curve(c_lib, server_process, tmp_path):
    if not zmq.has("curve"):
        pytest.skip("libzmq without CURVE")
    _, exe = c_lib
    secret, allowed, spub, alice, mallory = _curve_keys(tmp_path)
    _, ep = server_process("tcp://127.0.0.1:0", "--curve-secret-key", secret,
                           "--curve-allowed-clients", allowed)
    out, _ = run_c(exe, ep, "curve", spub, *alice)
    assert out["CURVE_CONNECT"].split()[0] == "ok" and out["CURVE_GENERATE"] == "ok 16"
    # a key the server does not allow: the handshake fails, reported as `connection` at once
    # (not after the scenario's 10 s connect timeout)
    out, _ = run_c(exe, ep, "curve", spub, *mallory)
    status, elapsed = out["CURVE_CONNECT"].split()
    assert status == "connection" and float(elapsed) < FAST_S, out
    assert "CURVE" in out["CURVE_MESSAGE"]


# --- lease ---------------------------------------------------------------------------------
def test_lease_kept_alive_by_heartbeats(c_lib, start_server):
    """A 1 s lease and a non-streamed generation of ~3 s (no DELTA frames): the C client
    learns the lease at connect and PINGs at lease/3, so the request completes; a raw client
    that stays silent loses the same request to `lease_expired`."""
    _, exe = c_lib
    _, ep = start_server(FakeEngine(step_delay_s=0.1), lease_s=1.0)
    out, _ = run_c(exe, ep, "lease", "keep me alive", 30, 0)
    assert out["LEASE"] == "1"
    status, n, elapsed = out["RESULT"].split()
    assert status == "ok" and n == "30" and float(elapsed) > 2.0, out
    # control: the same request without heartbeats
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    try:
        s.connect(ep)
        s.send_multipart([bytes([1, 0x01]), msgpack.packb(
            {"request_id": "silent", "prompt": "keep me alive", "stream": False,
             "sampling_params": {"max_tokens": 30}})])
        assert s.poll(10_000)
        header, body = s.recv_multipart()
        assert header[1] == 0xFF and msgpack.unpackb(body)["code"] == "lease_expired"
    finally:
        s.close(0)
        ctx.term()


# --- library 1.2: pagedrun_request_ext (chat options, lora_name), LoRA adapters -----------
CHAT_MESSAGES = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hel"}]
# scenario_ext's chat requests (max_tokens 4): its key -> the Python client's chat keywords
CHAT_CASES = {
    "CHAT_DEFAULT": {}, "CHAT_EXT_UNSET": {},
    "CHAT_NO_GEN_PROMPT": {"add_generation_prompt": False},
    "CHAT_TEMPLATE": {"chat_template": "{{ messages }} custom", "add_generation_prompt": True},
    "CHAT_TOOLS_KWARGS": {"tools": [{"name": "f"}], "chat_template_kwargs": {"lang": "fr"}},
    "CHAT_CONTINUE": {"continue_final_message": True, "add_generation_prompt": False},
    "EXT_BIG_ZERO": {"add_generation_prompt": False},
}


def _expected(completion) -> list[str]:
    """A scenario line's value: status, usage.prompt_tokens, token ids."""
    return ["ok", str(completion.usage["prompt_tokens"]), *map(str, completion.token_ids)]


def test_request_ext_chat_options_and_lora_name(c_lib, start_server):
    """The fake engine renders every chat option into the prompt, so the prompt token count
    and the tokens (a function of the prompt) show each option reached the server, exactly as
    the Python client sends it. lora_name reaches a server without LoRA (its refusal)."""
    _, exe = c_lib
    _, ep = start_server(FakeEngine())
    out, _ = run_c(exe, ep, "ext")
    assert out["EXT_INFO"] == "enable_lora=0"
    with Client(ep, timeout_s=10) as client:
        for key, chat in CHAT_CASES.items():
            want = client.generate(messages=CHAT_MESSAGES, sampling_params={"max_tokens": 4},
                                   **chat)
            assert out[key].split() == _expected(want), key
        small = client.generate("plain prompt", sampling_params={"max_tokens": 4})
    assert out["EXT_SMALL"].split() == _expected(small)  # chat_template past struct_size
    counts = {out[k].split()[1] for k in ("CHAT_DEFAULT", "CHAT_NO_GEN_PROMPT",
                                          "CHAT_TEMPLATE", "CHAT_TOOLS_KWARGS")}
    assert len(counts) == 4  # each option changed the prompt
    assert out["CHAT_STREAM"].split() == out["CHAT_TEMPLATE"].split()[1:]
    assert out["CHAT_BOTH"].split() == ["invalid_request", "-1"]
    assert out["CHAT_BOTH_MESSAGE"] == ("[invalid_request] continue_final_message and "
                                        "add_generation_prompt cannot both be True.")
    assert out["LORA_OFF"].split() == ["invalid_request", "-1"]
    assert out["LORA_OFF_MESSAGE"].startswith("[invalid_request] lora_name: LoRA is not enabled")
    assert out["LOAD_OFF"] == "invalid_request -1" and out["UNLOAD_OFF"] == "invalid_request -1"
    assert "LoRA is not enabled" in out["LOAD_OFF_MESSAGE"]
    assert out["ARG_CHAT_WITHOUT_MESSAGES"].startswith("add_generation_prompt is a chat option")
    assert "add_generation_prompt" in out["ARG_BOOL"] and "tools_msgpack" in out["ARG_TOOLS"]
    assert "at most 64" in out["ARG_KWARGS"] and "lora_name" in out["ARG_LORA_EMPTY"]
    assert "struct_size" in out["ARG_SIZE0"] and "struct_size" in out["ARG_SIZE_BIG"]


def _write_peft_adapter(path, config) -> str:
    """tests/lora/lora_helpers.write_peft_adapter (registered by tests/conftest.py: tests/lora
    is not on sys.path here): a random rank-8 adapter strong enough to change greedy tokens."""
    from pagedrun_tests_lora_helpers import write_peft_adapter

    return str(write_peft_adapter(path, config, rank=8, seed=1))


def test_lora_load_generate_unload(c_lib, start_server, tmp_path):
    """LOAD_LORA / GENERATE with lora_name / UNLOAD_LORA from C against the tiny fixture model
    with LoRA on: the adapter's tokens are the Python client's under the same adapter (and
    differ from the base model's); the server's refusals come back with their messages."""
    from test_real_engine import tiny_engine
    _, exe = c_lib
    engine = tiny_engine(enable_lora=True, max_loras=2)
    adapter = _write_peft_adapter(tmp_path / "adapter", engine.model_config)
    _, ep = start_server(engine, runtime_lora_root=str(tmp_path))  # --lora-root tmp_path
    out, _ = run_c(exe, ep, "lora", adapter)
    assert out["LORA_INFO"] == "enable_lora=1"
    first, again = out["LOADED"].split()
    assert first == again and int(first) >= 1  # loading the same name and path again
    params = {"max_tokens": 5, "temperature": 0.0, "ignore_eos": True}
    prompt = [5, 9, 17, 33, 2, 8]
    with Client(ep, timeout_s=30) as client:
        assert client.model_info()["lora_adapters"] == []  # the C side unloaded it
        client.load_lora("py-adapter", adapter)
        lora = client.generate(prompt_token_ids=prompt, sampling_params=params,
                               lora_name="py-adapter")
        base = client.generate(prompt_token_ids=prompt, sampling_params=params)
    assert out["LORA_GEN"].split() == _expected(lora)
    assert out["BASE_GEN"].split() == _expected(base) != _expected(lora)
    assert out["LORA_STREAM"].split() == list(map(str, lora.token_ids))
    assert out["LORA_UNKNOWN"].split() == ["invalid_request", "-1"]
    assert out["LORA_UNKNOWN_MESSAGE"] == ("[invalid_request] lora_name: unknown adapter 'nope' "
                                           "(loaded: 'c-adapter')")
    assert out["LOAD_OTHER_PATH"] == "invalid_request"
    assert "another path" in out["LOAD_OTHER_PATH_MESSAGE"]
    assert out["LOAD_BAD_DIR"] == "invalid_request" and out["UNLOADED"] == "1"
    assert out["LORA_AFTER_UNLOAD"].split() == ["invalid_request", "-1"]
    assert "unknown adapter 'c-adapter'" in out["LORA_AFTER_UNLOAD_MESSAGE"]
    assert out["UNLOAD_AGAIN"] == "invalid_request"


# --- malformed replies ---------------------------------------------------------------------
SID = "00112233aabbccdd"


def _deep(n):
    v = 0
    for _ in range(n):
        v = [v]
    return v


# A protocol 1.3 logprobs entry (docs/protocol.md, "Logprobs").
LP13 = {"token_id": 65, "logprob": -0.5, "top": [[65, -0.5]], "rank": 1, "decoded_token": "A",
        "top_decoded_tokens": ["A"]}


def _garbage(variant: str, rid: str) -> list[list[bytes]]:
    """The frames the garbage server answers to GENERATE `rid` (= the variant's name)."""
    P = msgpack.packb
    h = lambda t: bytes([1, t])  # noqa: E731
    delta = {"request_id": rid, "index": 0, "token_ids": [65], "text": "A", "server_id": SID}
    final = {"request_id": rid, "finish_reason": "length", "stop_reason": None,
             "outputs": [{"index": 0, "finish_reason": "length", "stop_reason": None}],
             "usage": {"prompt_tokens": 1, "cached_prompt_tokens": 0, "completion_tokens": 1},
             "metrics": {"time_to_first_token_s": 0.1, "time_per_output_token_s": None,
                         "e2e_latency_s": 0.1}, "server_id": SID}
    return {
        "one_frame": [[h(0x81)]],
        "three_frames": [[h(0x81), P(delta), b"x"]],
        "bad_version": [[bytes([2, 0x81]), P(delta)]],
        "long_header": [[bytes([1, 0x81, 0]), P(delta)]],
        "empty_header": [[b"", P(delta)]],
        "not_msgpack": [[h(0x81), b"\xc1"]],
        "empty_body": [[h(0x81), b""]],
        "not_map": [[h(0x81), P([1, 2, 3])]],
        "trailing": [[h(0x81), P(delta) + b"\x00"]],
        "truncated": [[h(0x81), P(delta)[:-3]]],
        "deep_nesting": [[h(0x81), P({"request_id": rid, "x": _deep(500)})]],
        "huge_array": [[h(0x81), b"\x81\xa1x\xdd\xff\xff\xff\xff"]],
        "huge_map": [[h(0x81), b"\xdf\xff\xff\xff\xff"]],
        "huge_str": [[h(0x81), b"\x81\xa1x\xdb\xff\xff\xff\xf0abc"]],
        "delta_text_int": [[h(0x81), P({**delta, "text": 5})]],
        "delta_text_missing": [[h(0x81), P({k: v for k, v in delta.items() if k != "text"})]],
        "delta_ids_str": [[h(0x81), P({**delta, "token_ids": "abc"})]],
        "delta_ids_float": [[h(0x81), P({**delta, "token_ids": [1.5]})]],
        "delta_ids_negative": [[h(0x81), P({**delta, "token_ids": [-1]})]],
        "delta_text_bin": [[h(0x81), P({**delta, "text": b"A"}, use_bin_type=True)]],
        "delta_logprobs_bad": [[h(0x81), P({**delta, "logprobs": [{"token_id": "x"}]})]],
        "delta_prompt_logprobs_bad": [[h(0x81), P({**delta, "prompt_logprobs": [None, 3]})]],
        # 1.3 fields of the wrong type
        "delta_rank_str": [[h(0x81), P({**delta, "logprobs": [{**LP13, "rank": "1"}]})]],
        "delta_decoded_int": [[h(0x81), P({**delta, "logprobs": [{**LP13,
                                                                  "decoded_token": 65}]})]],
        "delta_top_decoded_int": [[h(0x81), P({**delta, "logprobs": [{
            **LP13, "top_decoded_tokens": [65]}]})]],
        "delta_top_decoded_short": [[h(0x81), P({**delta, "logprobs": [{
            **LP13, "top_decoded_tokens": []}]})]],
        "delta_top_decoded_map": [[h(0x81), P({**delta, "logprobs": [{
            **LP13, "top_decoded_tokens": {"a": 1}}]})]],
        "delta_top_short": [[h(0x81), P({**delta, "logprobs": [{**LP13, "top": [[65]]}]})]],
        "delta_cum_str": [[h(0x81), P({**delta, "cumulative_logprob": "x"})]],
        "final_cum_str": [[h(0x82), P({**final, "outputs": [
            {**final["outputs"][0], "cumulative_logprob": "x"}]})]],
        "final_reason_int": [[h(0x82), P({**final, "finish_reason": 3})]],
        "final_usage_str": [[h(0x82), P({**final, "usage": "x"})]],
        "final_metrics_bad": [[h(0x82), P({**final, "metrics": {"e2e_latency_s": "x"}})]],
        "final_outputs_bad": [[h(0x82), P({**final, "outputs": [1]})]],
        "error_code_int": [[h(0xFF), P({"code": 7, "message": "x", "request_id": rid})]],
        "rid_int": [[h(0x81), P({**delta, "request_id": 42})]],
        "server_id_int": [[h(0x81), P({**delta, "server_id": 5})]],
        "lease_str": [[h(0x81), P({**delta, "lease_s": "soon"})]],
        "ext_type": [[h(0x81), P({**delta, "text": msgpack.ExtType(1, b"A")})]],
        # well-formed: the client keeps working after all of the above
        "ok": [[h(0x81), P(delta)], [h(0x82), P(final)]],
        # 1.3 entries, a 1.2 entry, nil rank / decoded tokens, and a top entry of a later
        # revision (3 elements) are all read
        "logprobs_13": [[h(0x81), P({**delta, "cumulative_logprob": -0.5, "logprobs": [
            {**LP13, "top": [[65, -0.5], [66, -1.0], [67, -2.0, "later"]],
             "top_decoded_tokens": ["A", None, "C"]},
            {"token_id": 66, "logprob": -1.0, "rank": None, "decoded_token": None,
             "top": [], "top_decoded_tokens": None},
            {"token_id": 67, "logprob": -1.0, "top": [[67, -1.0]]}]})], [h(0x82), P(final)]],
        "stale_then_ok": [[h(0x81), P({**delta, "request_id": "gone"})], [h(0x81), P(delta)],
                          [h(0x82), P(final)]],
        "unknown_type": [[h(0x87), P({"request_id": rid})], [h(0x82), P(final)]],
        "unknown_error_code": [[h(0xFF), P({"code": "brand_new", "message": "?",
                                            "request_id": rid, "server_id": SID})]],
        "error_nil_rid": [[h(0xFF), P({"code": "invalid_message", "message": "?",
                                       "request_id": None, "server_id": SID})]],
    }[variant]


MALFORMED = ["one_frame", "three_frames", "bad_version", "long_header", "empty_header",
             "not_msgpack", "empty_body", "not_map", "trailing", "truncated", "deep_nesting",
             "huge_array", "huge_map", "huge_str", "delta_text_int", "delta_text_missing",
             "delta_ids_str", "delta_ids_float", "delta_ids_negative", "delta_text_bin",
             "delta_logprobs_bad", "delta_prompt_logprobs_bad", "delta_rank_str",
             "delta_decoded_int", "delta_top_decoded_int", "delta_top_decoded_short",
             "delta_top_decoded_map", "delta_top_short", "delta_cum_str", "final_cum_str",
             "final_reason_int",
             "final_usage_str", "final_metrics_bad", "final_outputs_bad", "error_code_int",
             "rid_int", "server_id_int", "lease_str", "ext_type"]
WELL_FORMED = {"ok": "ok", "logprobs_13": "ok", "stale_then_ok": "ok", "unknown_type": "ok",
               "unknown_error_code": "server_error", "error_nil_rid": "invalid_message"}


@pytest.fixture
def garbage_server():
    """A ROUTER that answers MODEL_INFO and PING properly, each GENERATE with the frames of
    the variant named by its request id, LOAD_LORA with a malformed LORA_REPLY and UNLOAD_LORA
    with a good one."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    stop = threading.Event()

    def serve():
        while not stop.is_set():
            if not sock.poll(50):
                continue
            ident, *frames = sock.recv_multipart()
            kind, body = frames[0][1], msgpack.unpackb(frames[1])
            rid = body.get("request_id")
            if kind == 0x04:
                replies = [[bytes([1, 0x85]), msgpack.packb(
                    {"request_id": rid, "model": "garbage", "max_model_len": 64,
                     "vocab_size": 256, "server": {"protocol_revision": "1.2", "lease_s": 30.0,
                                                   "max_message_bytes": 1 << 20},
                     "server_id": SID})]]
            elif kind == 0x03:
                replies = [[bytes([1, 0x84]), msgpack.packb(
                    {"request_id": rid, "status": "ok", "lease_s": 30.0, "server_time": 0.0,
                     "num_requests_in_flight": 0, "server_id": SID})]]
            elif kind == 0x01:
                replies = _garbage(rid, rid)
            elif kind == 0x06:  # LOAD_LORA: a LORA_REPLY whose lora_int_id is not an int
                replies = [[bytes([1, 0x87]), msgpack.packb(
                    {"request_id": rid, "lora_name": body["lora_name"], "lora_int_id": "7",
                     "loaded": True, "server_id": SID})]]
            elif kind == 0x07:  # UNLOAD_LORA: well-formed
                replies = [[bytes([1, 0x87]), msgpack.packb(
                    {"request_id": rid, "lora_name": body["lora_name"], "lora_int_id": 7,
                     "loaded": False, "server_id": SID})]]
            else:  # ABORT after a malformed reply: ignored
                replies = []
            for r in replies:
                sock.send_multipart([ident, *r])

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    yield f"tcp://127.0.0.1:{port}"
    stop.set()
    t.join(5)
    sock.close(0)
    ctx.term()


def _check_variants(stdout: str) -> None:
    got = {}
    for line in stdout.splitlines():
        if line.startswith("VARIANT "):
            _, name, status, elapsed = line.split()
            got[name] = status
            assert float(elapsed) < FAST_S, line  # never the 10 s timeout
    want = {**{v: "malformed_reply" for v in MALFORMED}, **WELL_FORMED}
    assert got == want
    out = _lines(stdout)
    assert out["LORA_REPLY_BAD"] == "malformed_reply" and out["LORA_REPLY_OK"] == "ok 1"


def test_malformed_replies(c_lib, garbage_server):
    _, exe = c_lib
    _, proc = run_c(exe, garbage_server, "malformed", *MALFORMED, *WELL_FORMED)
    _check_variants(proc.stdout)


# --- sanitizers ----------------------------------------------------------------------------
def test_asan_ubsan_build(server_process, garbage_server, tmp_path):
    """The library and the test program built with -fsanitize=address,undefined: the API and
    the malformed-reply scenarios run clean (no leak, no UB, no overflow)."""
    if shutil.which("cc") is None or shutil.which("pkg-config") is None:
        pytest.skip("no C compiler / pkg-config")
    deps = (subprocess.run(["pkg-config", "--cflags", "--libs", "libzmq", "msgpack-c"],
                           capture_output=True, text=True).stdout.split()
            or _run(["pkg-config", "--cflags", "--libs", "libzmq", "msgpack"]).split())
    exe = str(tmp_path / "test_client_asan")
    try:
        _run(["cc", "-std=c99", "-O1", "-g", "-fno-omit-frame-pointer",
              "-fsanitize=address,undefined", "-fno-sanitize-recover=undefined",
              "-I", os.path.join(LIB_SRC, "include"), "-o", exe,
              os.path.join(LIB_SRC, "src", "pagedrun_client.c"), TEST_SRC, *deps])
    except AssertionError as exc:
        if "sanitize" in str(exc) or "asan" in str(exc):
            pytest.skip(f"no sanitizer runtime: {exc}")
        raise
    env = dict(os.environ, ASAN_OPTIONS="detect_leaks=1:abort_on_error=0:exitcode=86",
               UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:exitcode=87")
    env.pop("LD_PRELOAD", None)
    probe = subprocess.run([exe, "tcp://127.0.0.1:1", "down"], capture_output=True, text=True,
                           timeout=RUN_TIMEOUT_S, env=env)
    if "LeakSanitizer has encountered a fatal error" in probe.stderr:  # e.g. under ptrace
        env["ASAN_OPTIONS"] = env["ASAN_OPTIONS"].replace("detect_leaks=1", "detect_leaks=0")
    _, ep = server_process("tcp://127.0.0.1:0", "--step-delay-s", "0.002")
    for args in (["api", "Bonjour", 5], ["abort", "stop it"], ["ext"]):
        _, proc = run_c(exe, ep, *args, env=env)
        assert "Sanitizer" not in proc.stderr and "runtime error" not in proc.stderr, proc.stderr
    _, proc = run_c(exe, garbage_server, "malformed", *MALFORMED, *WELL_FORMED, env=env)
    assert "Sanitizer" not in proc.stderr and "runtime error" not in proc.stderr, proc.stderr
    _check_variants(proc.stdout)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
