"""The wire format: frame layout, message types, error codes, limits, encode/decode.

docs/protocol.md is the authoritative spec; this module is its executable form and the one place
both the server and the Python client take their constants from. A message is two ZeroMQ frames
(after the ROUTER's routing-id frame on the server side):

    frame 0: 2 bytes  [PROTOCOL_VERSION, message type]
    frame 1: msgpack map with string keys (never pickle)
"""
from __future__ import annotations

import enum
import ipaddress
import math
import reprlib
import secrets

import msgpack

from pagedrun.runtime.errors import (ERR_CAPACITY, ERR_DUPLICATE, ERR_EMPTY, ERR_INVALID,
                                     ERR_TOO_LONG)
from pagedrun.runtime.outputs import Logprob

PROTOCOL_VERSION = 1
# The revision of docs/protocol.md this code implements ("<version>.<minor>"). Minor revisions
# only add (optional request fields, reply fields, types, codes) and keep the version byte, so a
# client of any 1.x revision talks to a server of any other; PONG and MODEL_INFO_REPLY advertise
# it, for clients that want to know which reply fields to expect (1.1: prompt_logprobs; 1.2:
# server_id in replies, documented ranges enforced, heartbeats that follow lease_s; 1.3: vLLM's
# sampling fields and ranges, chat options, logprobs entries with rank and decoded_token,
# cumulative_logprob; 1.4: LoRA adapters -- GENERATE `lora_name`, LOAD_LORA / UNLOAD_LORA,
# MODEL_INFO_REPLY `lora_adapters`).
PROTOCOL_REVISION = "1.4"
HEADER_BYTES = 2

# Where a server listens and a client connects when told nothing else (docs/protocol.md:
# loopback only). The CLI's --host/--port defaults (serve, chat, bench) are these too.
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 5555
DEFAULT_ENDPOINT = f"tcp://{DEFAULT_HOST}:{DEFAULT_PORT}"

# Default limit on one message body. A 1 MiB body holds a prompt of ~100k tokens as msgpack ints,
# well past any max_model_len we serve on CPU; larger bodies are answered `message_too_large`.
DEFAULT_MAX_MESSAGE_BYTES = 1 << 20
# libzmq drops (disconnects) peers whose frames exceed ZMQ_MAXMSGSIZE without telling us; we set
# it this many times above the protocol limit so ordinary oversize gets a readable error reply and
# only abusive frames hit the hard cut.
HARD_LIMIT_FACTOR = 16

MAX_REQUEST_ID_CHARS = 128
MAX_CHAT_MESSAGES = 512
MAX_ROLE_CHARS = 32
CHAT_ROLES = ("system", "user", "assistant", "tool")

# msgpack decode limits: bound the work a hostile body can cause before validation sees it.
# (msgpack's own C unpacker stops at 1024 levels of nesting; MAX_NESTING_DEPTH is checked after
# decoding, without recursion.)
_UNPACK_LIMITS = dict(max_str_len=DEFAULT_MAX_MESSAGE_BYTES * HARD_LIMIT_FACTOR,
                      max_bin_len=DEFAULT_MAX_MESSAGE_BYTES * HARD_LIMIT_FACTOR,
                      max_array_len=1 << 20, max_map_len=1 << 12, max_ext_len=0)
# Deepest nesting of maps and arrays a request body may have (the body map is level 1). The
# deepest valid request is 3 levels (body -> messages -> one message; body -> sampling_params
# -> stop; 1.3: `tools` and `chat_template_kwargs` hold JSON-like values of their own, within
# the same bound); anything past this is `invalid_message`.
MAX_NESTING_DEPTH = 16
# How much of a body over max_message_bytes is read for its request_id (request_id_from_prefix):
# the map header, request_id (at most 128 characters) and a few small fields before it.
ID_PREFIX_BYTES = 1024
# Longest `message` of an ERROR reply; longer ones (a repr of a hostile value) are cut.
MAX_ERROR_MESSAGE_CHARS = 1000
# Characters of a client's value quoted in an error message (safe_repr).
MAX_QUOTED_VALUE_CHARS = 80
# A server instance id (random per server start) is this many hex characters (protocol 1.2).
SERVER_ID_HEX_CHARS = 16


class MsgType(enum.IntEnum):
    # client -> server
    GENERATE = 0x01
    ABORT = 0x02
    PING = 0x03
    MODEL_INFO = 0x04
    STATS = 0x05
    LOAD_LORA = 0x06     # 1.4
    UNLOAD_LORA = 0x07   # 1.4
    # server -> client
    DELTA = 0x81
    FINAL = 0x82
    ABORTED = 0x83
    PONG = 0x84
    MODEL_INFO_REPLY = 0x85
    STATS_REPLY = 0x86
    LORA_REPLY = 0x87    # 1.4
    ERROR = 0xFF


CLIENT_TYPES = frozenset({MsgType.GENERATE, MsgType.ABORT, MsgType.PING, MsgType.MODEL_INFO,
                          MsgType.STATS, MsgType.LOAD_LORA, MsgType.UNLOAD_LORA})
# Longest adapter name (GENERATE `lora_name`, LOAD_LORA / UNLOAD_LORA) and adapter path.
MAX_LORA_NAME_CHARS = 128
MAX_LORA_PATH_CHARS = 4096


class ErrorCode(str, enum.Enum):
    INVALID_MESSAGE = "invalid_message"        # frames / msgpack unreadable
    UNSUPPORTED_VERSION = "unsupported_version"
    UNKNOWN_TYPE = "unknown_type"
    MESSAGE_TOO_LARGE = "message_too_large"
    # The engine's admission codes (RequestError.code) are the same strings, named once in
    # runtime/errors.py: the engine loop forwards them as they are.
    INVALID_REQUEST = ERR_INVALID              # a field has a wrong type / range / is unknown
    EMPTY_PROMPT = ERR_EMPTY
    PROMPT_TOO_LONG = ERR_TOO_LONG
    DUPLICATE_REQUEST_ID = ERR_DUPLICATE
    CAPACITY = ERR_CAPACITY                    # the request can never fit the KV cache
    OVERLOADED = "overloaded"                  # too many requests in flight; retry later
    SHUTTING_DOWN = "shutting_down"
    LEASE_EXPIRED = "lease_expired"
    INTERNAL_ERROR = "internal_error"


class ProtocolError(Exception):
    """A message cannot be served; becomes an ERROR reply with this code and message."""

    def __init__(self, code: ErrorCode, message: str, request_id: str | None = None) -> None:
        super().__init__(message)
        self.code = ErrorCode(code)
        self.message = message
        self.request_id = request_id


def new_server_id() -> str:
    """A fresh server instance id: random per server start, so a client can tell a restart."""
    return secrets.token_hex(SERVER_ID_HEX_CHARS // 2)


_REPR = reprlib.Repr()
_REPR.maxlevel = 3
_REPR.maxstring = _REPR.maxother = _REPR.maxlong = MAX_QUOTED_VALUE_CHARS // 2
for _name in ("maxlist", "maxdict", "maxtuple", "maxset", "maxfrozenset", "maxdeque",
              "maxarray"):
    setattr(_REPR, _name, 6)


def safe_repr(value) -> str:
    """A short repr of a client's value for an error message; never raises, never recurses
    deeper than a few levels, never longer than MAX_QUOTED_VALUE_CHARS."""
    try:
        text = _REPR.repr(value)
    except Exception:  # noqa: BLE001 -- a hostile value: say what it is, not what it holds
        try:
            text = f"<{type(value).__name__}>"
        except Exception:  # noqa: BLE001
            text = "<value>"
    if len(text) > MAX_QUOTED_VALUE_CHARS:
        text = text[:MAX_QUOTED_VALUE_CHARS - 3] + "..."
    return text


def valid_request_id(value) -> str | None:
    """`value` if it is a request id the server may echo back (a str of 1..128 chars)."""
    if isinstance(value, str) and 1 <= len(value) <= MAX_REQUEST_ID_CHARS:
        return value
    return None


def request_id_from_prefix(prefix: bytes) -> str | None:
    """The request_id of a body too large to decode, read from its first bytes only, so the
    refusal reaches the caller that waits on that id (clients match replies by id). Found when
    the key precedes any value that outruns `prefix`: our clients (Python, C, the gateway) send
    request_id first. Bounded by len(prefix) whatever the bytes hold; None when not found."""
    unpacker = msgpack.Unpacker(raw=False, strict_map_key=True,
                                max_buffer_size=max(len(prefix), 1))
    unpacker.feed(prefix)
    try:
        for _ in range(unpacker.read_map_header()):
            if unpacker.unpack() == "request_id":
                return valid_request_id(unpacker.unpack())
            unpacker.skip()
    except Exception:  # noqa: BLE001 -- out of data, not a map, too deep: no id to echo
        return None
    return None


def check_structure(data, max_depth: int = MAX_NESTING_DEPTH) -> None:
    """Every map key a string and at most `max_depth` levels of maps/arrays, anywhere in a
    decoded body; iterative (no recursion, so no depth can overflow a stack), and it stops at
    the first level past the limit, so a deep body costs no more than a shallow one."""
    stack = [(data, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > max_depth:
            raise ProtocolError(ErrorCode.INVALID_MESSAGE,
                                f"body nests maps/arrays deeper than {max_depth} levels")
        if type(value) is dict:
            for key, item in value.items():
                if type(key) is not str:
                    raise ProtocolError(ErrorCode.INVALID_MESSAGE,
                                        "map keys must be strings, found a "
                                        f"{type(key).__name__} key")
                if type(item) is dict or type(item) is list:
                    stack.append((item, depth + 1))
        else:  # list
            for item in value:
                if type(item) is dict or type(item) is list:
                    stack.append((item, depth + 1))


def is_loopback_endpoint(endpoint: str) -> bool:
    """Whether a ZeroMQ endpoint only listens locally: ipc/inproc, or tcp on 127.0.0.0/8, ::1,
    'localhost' or the loopback interface 'lo'. '*', 0.0.0.0, ::, other addresses, hostnames
    and interface names are not."""
    scheme, sep, rest = endpoint.partition("://")
    if not sep:
        return False
    if scheme in ("ipc", "inproc"):
        return True
    if scheme != "tcp":
        return False
    host = rest.rsplit(":", 1)[0] if ":" in rest else rest
    host = host.split(";")[-1]  # tcp://source;dest form
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if host in ("localhost", "lo"):
        return True
    try:
        return ipaddress.ip_address(host.split("%")[0]).is_loopback
    except ValueError:
        return False


def encode(msg_type: MsgType, body: dict) -> list[bytes]:
    """The two frames of one message (without a routing id)."""
    return [bytes((PROTOCOL_VERSION, int(msg_type))), msgpack.packb(body, use_bin_type=True)]


def decode(frames: list[bytes], max_message_bytes: int) -> tuple[MsgType, dict]:
    """Parse the frames of one client message; raise ProtocolError for anything malformed."""
    if len(frames) != 2:
        raise ProtocolError(ErrorCode.INVALID_MESSAGE,
                            f"expected 2 frames (header, body), got {len(frames)}")
    header, body = frames
    if len(header) != HEADER_BYTES:
        raise ProtocolError(ErrorCode.INVALID_MESSAGE,
                            f"header frame must be {HEADER_BYTES} bytes, got {len(header)}")
    if header[0] != PROTOCOL_VERSION:
        raise ProtocolError(ErrorCode.UNSUPPORTED_VERSION,
                            f"protocol version {header[0]} not supported (this server speaks "
                            f"{PROTOCOL_VERSION})")
    if len(body) > max_message_bytes:
        raise ProtocolError(ErrorCode.MESSAGE_TOO_LARGE,
                            f"body is {len(body)} bytes; the limit is {max_message_bytes}",
                            request_id_from_prefix(body[:ID_PREFIX_BYTES]))
    try:
        data = msgpack.unpackb(body, raw=False, strict_map_key=True, **_UNPACK_LIMITS)
    except Exception as exc:  # msgpack raises several unrelated types for bad input
        what = type(exc).__name__
        if isinstance(exc, ValueError) and "map key" in str(exc):
            what = "map keys must be strings"
        elif what == "StackError":
            what = "nested too deeply"
        raise ProtocolError(ErrorCode.INVALID_MESSAGE,
                            f"body is not valid msgpack: {what}") from None
    if not isinstance(data, dict):
        raise ProtocolError(ErrorCode.INVALID_MESSAGE,
                            f"body must be a msgpack map, got {type(data).__name__}")
    rid = valid_request_id(data.get("request_id"))
    try:
        check_structure(data)
    except ProtocolError as exc:
        exc.request_id = rid
        raise
    try:
        msg_type = MsgType(header[1])
    except ValueError:
        raise ProtocolError(ErrorCode.UNKNOWN_TYPE, f"unknown message type 0x{header[1]:02x}",
                            rid) from None
    if msg_type not in CLIENT_TYPES:
        raise ProtocolError(ErrorCode.UNKNOWN_TYPE,
                            f"message type 0x{header[1]:02x} is a server reply", rid)
    return msg_type, data


def decode_reply(frames: list[bytes]) -> tuple[MsgType, dict]:
    """Parse a server reply (client side); trusted peer, so only shape checks."""
    if len(frames) != 2 or len(frames[0]) != HEADER_BYTES or frames[0][0] != PROTOCOL_VERSION:
        raise ValueError("malformed reply from server")
    return MsgType(frames[0][1]), msgpack.unpackb(frames[1], raw=False, strict_map_key=False)


def error_body(code: ErrorCode, message: str, request_id: str | None) -> dict:
    """The fixed shape of an ERROR body; total: any message is cut to MAX_ERROR_MESSAGE_CHARS
    (and made valid UTF-8), a request id that is not a valid one becomes nil."""
    try:
        code = ErrorCode(code).value
    except Exception:  # noqa: BLE001
        code = ErrorCode.INTERNAL_ERROR.value
    if not isinstance(message, str):
        message = safe_repr(message)
    if len(message) > MAX_ERROR_MESSAGE_CHARS:
        message = message[:MAX_ERROR_MESSAGE_CHARS - 3] + "..."
    message = message.encode("utf-8", "replace").decode("utf-8")
    return {"code": code, "message": message, "request_id": valid_request_id(request_id)}


def is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_finite_number(v) -> bool:
    return (is_int(v) or isinstance(v, float)) and math.isfinite(v)


# --- logprobs entries (1.3) ----------------------------------------------------------------
def _rank_order(item) -> float:
    rank = item[1].rank
    return float("inf") if rank is None else rank


def position_to_wire(position: dict, num_top: int) -> dict:
    """One position of the engine's logprobs -- {token_id: Logprob}, the sampled (or prompt)
    token first, then the top `num_top` (vLLM's shape: num_top or num_top + 1 entries, as that
    token is or is not among them) -- as the wire's entry (docs/protocol.md, "Logprobs"):
    {token_id, logprob, top: [[token_id, logprob]], rank, decoded_token, top_decoded_tokens}.
    `top` holds the num_top best, best first, so its i-th pair has rank i + 1 (it keeps the
    1.1 pair shape: 1.3 only adds fields)."""
    items = list(position.items())
    token_id, own = items[0]
    if len(items) == num_top + 1:  # the sampled token is not among the top: all the rest are
        top = items[1:]
    else:  # it is (or the engine sent fewer: a vocabulary smaller than num_top)
        top = sorted(items, key=_rank_order)[:num_top]
    return {"token_id": int(token_id), "logprob": float(own.logprob),
            "top": [[int(t), float(lp.logprob)] for t, lp in top],
            "rank": None if own.rank is None else int(own.rank),
            "decoded_token": own.decoded_token,
            "top_decoded_tokens": [lp.decoded_token for _, lp in top]}


def position_from_wire(entry: dict) -> dict[int, Logprob]:
    """A wire logprobs entry back in vLLM's shape: {token_id: Logprob(logprob, rank,
    decoded_token)}, the entry's own token first, then the `top` ones not already there (the
    i-th of `top` has rank i + 1). From a 1.0-1.2 server (no rank, no decoded tokens) the own
    token's rank is known only when it is in `top`; decoded tokens are None."""
    token_id = int(entry["token_id"])
    out = {token_id: Logprob(float(entry["logprob"]), entry.get("rank"),
                             entry.get("decoded_token"))}
    top = entry.get("top") or ()
    decoded = entry.get("top_decoded_tokens") or [None] * len(top)
    for i, (alt, text) in enumerate(zip(top, decoded)):
        alt_id = int(alt[0])
        if alt_id == token_id:
            if out[token_id].rank is None:
                out[token_id].rank = i + 1
            continue
        out[alt_id] = Logprob(float(alt[1]), i + 1, text)
    return out
