"""The gateway's one connection to the engine server: a ZeroMQ `AsyncClient` (docs/protocol.md).

Every route reaches the engine through here, and only through the protocol: GENERATE (one per
prompt), ABORT (the client's stream does it when closed early), PING (/health), MODEL_INFO
(/v1/models, the served name, max_model_len; cached per engine instance: a restarted engine
has a new `server_id` and is asked again), STATS (/metrics). So a gateway can run on another
machine than the engine, and several gateways can front one engine.

The short control calls (MODEL_INFO, STATS, PING) get their own bound, `control_timeout_s`; a
GENERATE's frames get the client's `timeout_s`, which must cover the longest prefill.
"""
from __future__ import annotations

import asyncio

from pagedrun.server.client import AsyncClient, RequestTimeout, ServerError
from pagedrun.server.http.errors import ApiError

# MODEL_INFO / STATS / PING: an engine that does not answer within this is reported down.
DEFAULT_CONTROL_TIMEOUT_S = 5.0
# Per reply frame of a GENERATE: a CPU prefill of a long prompt on a big model can take minutes.
DEFAULT_GENERATE_TIMEOUT_S = 600.0


class EngineLink:
    def __init__(self, endpoint: str, *, timeout_s: float = DEFAULT_GENERATE_TIMEOUT_S,
                 control_timeout_s: float = DEFAULT_CONTROL_TIMEOUT_S,
                 served_model_name: str | None = None,
                 server_public_key_file: str | None = None,
                 client_secret_key_file: str | None = None) -> None:
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self.control_timeout_s = control_timeout_s
        self.served_model_name = served_model_name
        self._keys = dict(server_public_key_file=server_public_key_file,
                          client_secret_key_file=client_secret_key_file)
        self.client: AsyncClient | None = None
        self._info: dict | None = None
        self._info_server_id: str | None = None

    async def start(self) -> None:
        """Open the client (in the running event loop: zmq.asyncio sockets belong to one)."""
        self.client = AsyncClient(self.endpoint, timeout_s=self.timeout_s, **self._keys)

    async def close(self) -> None:
        if self.client is not None:
            await self.client.close()
            self.client = None

    async def _control(self, call):
        try:
            return await asyncio.wait_for(call(), self.control_timeout_s)
        except (asyncio.TimeoutError, RequestTimeout):
            raise ApiError(503, f"the engine at {self.endpoint} did not answer within "
                           f"{self.control_timeout_s:g} s", code="server_unavailable") from None
        except ServerError as exc:
            raise ApiError(503, f"the engine at {self.endpoint} is unavailable: {exc.message}",
                           code=exc.code) from None

    async def model_info(self) -> dict:
        """MODEL_INFO_REPLY, cached until the engine's instance id changes."""
        if self._info is None or self.client.server_id != self._info_server_id:
            info = await self._control(self.client.model_info)
            self._info, self._info_server_id = info, info.get("server_id")
        return self._info

    async def model_name(self) -> str:
        """The name clients use in `model`: --served-model-name, else the engine's model."""
        if self.served_model_name:
            return self.served_model_name
        return str((await self.model_info()).get("model"))

    async def stats(self) -> dict:
        return await self._control(self.client.stats)

    async def ping(self) -> dict:
        return await self._control(self.client.ping)

    async def stream(self, request_id: str, prompt, spec):
        """Send one GENERATE (stream on) for `prompt` (a PromptInput) with the spec's sampling
        parameters and chat options; the returned AsyncStream aborts it when closed early."""
        return await self.client.stream(
            prompt.text, prompt_token_ids=prompt.token_ids, messages=prompt.messages,
            sampling_params=spec.sampling_params, request_id=request_id,
            **(spec.chat_options if prompt.messages is not None else {}))
