"""Optional CURVE encryption + authentication (libzmq's), keys read from files.

The server's key pair is one zmq certificate file holding both keys (as written by
`zmq.auth.create_certificates`); allowed clients are the public
certificate files in one directory. libzmq asks the ZAP handler (pyzmq's ThreadAuthenticator)
about every new connection; a client whose key is not in the directory never completes the
handshake, so it gets no reply at all (documented in docs/protocol.md, "Security").
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator


@dataclass(frozen=True)
class CurveConfig:
    server_secret_key_file: str     # certificate with public-key and secret-key
    allowed_clients_dir: str        # directory of client public certificates (*.key)


def start_curve_server(ctx: zmq.Context, socket: zmq.Socket, cfg: CurveConfig):
    """Start the ZAP handler and make `socket` a CURVE server; returns the authenticator."""
    if not os.path.isdir(cfg.allowed_clients_dir):
        raise FileNotFoundError(f"{cfg.allowed_clients_dir}: allowed-clients directory missing")
    public, secret = zmq.auth.load_certificate(cfg.server_secret_key_file)
    if secret is None:
        raise ValueError(f"{cfg.server_secret_key_file}: has no secret-key")
    auth = ThreadAuthenticator(ctx)
    auth.start()
    auth.configure_curve(domain="*", location=cfg.allowed_clients_dir)
    socket.curve_secretkey = secret
    socket.curve_publickey = public
    socket.curve_server = True
    return auth


def apply_curve_client(socket: zmq.Socket, server_public_key_file: str,
                       client_secret_key_file: str) -> None:
    """Make a client socket a CURVE client of the server whose public certificate is given."""
    server_public, _ = zmq.auth.load_certificate(server_public_key_file)
    public, secret = zmq.auth.load_certificate(client_secret_key_file)
    if secret is None:
        raise ValueError(f"{client_secret_key_file}: has no secret-key")
    socket.curve_secretkey = secret
    socket.curve_publickey = public
    socket.curve_serverkey = server_public


def create_key_pair(directory: str, name: str) -> tuple[str, str]:
    """Write NAME.key (public) and NAME.key_secret into `directory`; returns both paths."""
    os.makedirs(directory, exist_ok=True)
    return zmq.auth.create_certificates(directory, name)
