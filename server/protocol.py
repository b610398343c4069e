"""The wire format: frame layout, message types, error codes, limits, encode/decode.

docs/protocol.md is the authoritative spec; this module is its executable form and the one place
both the server and the Python client take their constants from. A message is two ZeroMQ frames
(after the ROUTER's routing-id frame on the server side):

    frame 0: 2 bytes  [PROTOCOL_VERSION, message type]
    frame 1: msgpack map with string keys (never pickle)
"""
from __future__ import annotations

import enum
import math

import msgpack

PROTOCOL_VERSION = 1
# The revision of docs/protocol.md this code implements ("<version>.<minor>"). Minor revisions
# only add (optional request fields, reply fields, types, codes) and keep the version byte, so a
# client of any 1.x revision talks to a server of any other; PONG and MODEL_INFO_REPLY advertise
# it, for clients that want to know which reply fields to expect (1.1: prompt_logprobs).
PROTOCOL_REVISION = "1.1"
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
_UNPACK_LIMITS = dict(max_str_len=DEFAULT_MAX_MESSAGE_BYTES * HARD_LIMIT_FACTOR,
                      max_bin_len=DEFAULT_MAX_MESSAGE_BYTES * HARD_LIMIT_FACTOR,
                      max_array_len=1 << 20, max_map_len=1 << 12, max_ext_len=0)


class MsgType(enum.IntEnum):
    # client -> server
    GENERATE = 0x01
    ABORT = 0x02
    PING = 0x03
    MODEL_INFO = 0x04
    STATS = 0x05
    # server -> client
    DELTA = 0x81
    FINAL = 0x82
    ABORTED = 0x83
    PONG = 0x84
    MODEL_INFO_REPLY = 0x85
    STATS_REPLY = 0x86
    ERROR = 0xFF


CLIENT_TYPES = frozenset({MsgType.GENERATE, MsgType.ABORT, MsgType.PING, MsgType.MODEL_INFO,
                          MsgType.STATS})


class ErrorCode(str, enum.Enum):
    INVALID_MESSAGE = "invalid_message"        # frames / msgpack unreadable
    UNSUPPORTED_VERSION = "unsupported_version"
    UNKNOWN_TYPE = "unknown_type"
    MESSAGE_TOO_LARGE = "message_too_large"
    INVALID_REQUEST = "invalid_request"        # a field has a wrong type / range / is unknown
    EMPTY_PROMPT = "empty_prompt"
    PROMPT_TOO_LONG = "prompt_too_long"
    DUPLICATE_REQUEST_ID = "duplicate_request_id"
    CAPACITY = "capacity"                      # the request can never fit the KV cache
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
                            f"body is {len(body)} bytes; the limit is {max_message_bytes}")
    try:
        data = msgpack.unpackb(body, raw=False, strict_map_key=True, **_UNPACK_LIMITS)
    except Exception as exc:  # msgpack raises several unrelated types for bad input
        raise ProtocolError(ErrorCode.INVALID_MESSAGE,
                            f"body is not valid msgpack: {type(exc).__name__}") from None
    if not isinstance(data, dict):
        raise ProtocolError(ErrorCode.INVALID_MESSAGE,
                            f"body must be a msgpack map, got {type(data).__name__}")
    rid = data.get("request_id")
    rid = rid if isinstance(rid, str) else None
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
    return {"code": ErrorCode(code).value, "message": message, "request_id": request_id}


def is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_finite_number(v) -> bool:
    return (is_int(v) or isinstance(v, float)) and math.isfinite(v)
