"""Handlers of the endpoints around generation: /v1/models, /health, /version, /tokenize,
/detokenize, /metrics, and the two generation routes' entry points.

Shapes follow vLLM's OpenAI server: /health is 200 with an empty body when the engine answers
PING with status ok (503 while it drains or when it does not answer); /version is
{"version"}; /tokenize takes {prompt, add_special_tokens} or {messages, add_generation_prompt,
continue_final_message, chat_template, chat_template_kwargs, tools} and answers {count,
max_model_len, tokens, token_strs}; /detokenize takes {tokens} and answers {prompt}.
"""
from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from pagedrun import __version__
from pagedrun.runtime.chat_options import ChatOptions, ChatOptionsError
from pagedrun.server.http.errors import ApiError, bad_request
from pagedrun.server.http.generation import read_json, serve_generation
from pagedrun.server.http.openai_models import (CHAT_OPTIONS, field_value, parse_chat,
                                                parse_completion, parse_messages)
from pagedrun.server.http.prometheus import CONTENT_TYPE
from pagedrun.server.http.tokenizer_work import engine_body_limit, run_tokenizer

OWNED_BY = "paged-run"


async def chat_completions(request: Request) -> Response:
    spec = parse_chat(await read_json(request))
    return await serve_generation(request, request.app.state.gateway, spec)


async def completions(request: Request) -> Response:
    spec = parse_completion(await read_json(request))
    return await serve_generation(request, request.app.state.gateway, spec)


async def _model_card(gateway) -> dict:
    info = await gateway.link.model_info()
    return {"id": await gateway.link.model_name(), "object": "model",
            "created": gateway.started_at, "owned_by": OWNED_BY, "root": info.get("model"),
            "parent": None, "max_model_len": info.get("max_model_len"),
            # Not OpenAI's: lets a load generator draw valid token-id prompts (paged-run bench).
            "vocab_size": info.get("vocab_size")}


async def list_models(request: Request) -> Response:
    card = await _model_card(request.app.state.gateway)
    return JSONResponse({"object": "list", "data": [card]})


async def retrieve_model(request: Request) -> Response:
    gateway = request.app.state.gateway
    await gateway.check_model(request.path_params["model"])
    return JSONResponse(await _model_card(gateway))


async def health(request: Request) -> Response:
    pong = await request.app.state.gateway.link.ping()
    if pong.get("status") != "ok":
        raise ApiError(503, f"the engine is {pong.get('status')}", code="shutting_down")
    return Response(status_code=200)


async def version(request: Request) -> Response:
    return JSONResponse({"version": __version__})


async def _tokenizer(gateway):
    await gateway.find_tokenizer()
    if gateway.local_tokenizer is None:
        raise ApiError(501, "this gateway has no tokenizer for the engine's model (start it "
                       "with --tokenizer MODEL)", code="no_tokenizer")
    return gateway.local_tokenizer


async def tokenize(request: Request) -> Response:
    gateway = request.app.state.gateway
    info = await gateway.link.model_info()
    body = await read_json(request, engine_limit=engine_body_limit(info))
    await gateway.check_model(field_value(body, "model", lambda v: isinstance(v, str), "a string"))
    tokenizer = await _tokenizer(gateway)
    return_strs = field_value(body, "return_token_strs", lambda v: isinstance(v, bool),
                              "a boolean")
    if body.get("messages") is not None:
        options = {name: field_value(body, name, check, what)
                   for name, check, what in CHAT_OPTIONS}
        options = {k: v for k, v in options.items() if v is not None}
        try:  # the checks and limits every entry point applies (runtime/chat_options.py)
            chat = ChatOptions(**options)
        except ChatOptionsError as exc:
            raise bad_request(str(exc), str(exc).split(":", 1)[0]) from None
        messages = parse_messages(body["messages"])
        try:
            ids = await run_tokenizer(tokenizer.apply_chat_template, messages, tokenize=True,
                                      **chat.template_kwargs())
        except ValueError as exc:  # the template refused (ChatTemplateError is a ValueError)
            raise bad_request(str(exc), "messages") from None
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise bad_request("prompt: must be a string (or give messages)", "prompt")
        add_special = field_value(body, "add_special_tokens",
                                  lambda v: isinstance(v, bool), "a boolean")
        ids = await run_tokenizer(tokenizer.encode, prompt,
                                  add_special_tokens=add_special is not False)
    ids = list(ids)
    token_strs = None
    if return_strs:
        token_strs = await run_tokenizer(lambda: [tokenizer.id_to_token(t) for t in ids])
    return JSONResponse({"count": len(ids), "max_model_len": info.get("max_model_len"),
                         "tokens": ids, "token_strs": token_strs})


async def detokenize(request: Request) -> Response:
    gateway = request.app.state.gateway
    body = await read_json(request, engine_limit=engine_body_limit(await gateway.link.model_info()))
    await gateway.check_model(field_value(body, "model", lambda v: isinstance(v, str), "a string"))
    tokens = body.get("tokens")
    if not (isinstance(tokens, list) and all(isinstance(t, int) and not isinstance(t, bool)
                                             for t in tokens)):
        raise bad_request("tokens: must be a list of token ids", "tokens")
    tokenizer = await _tokenizer(gateway)
    if any(not 0 <= t < tokenizer.vocab_size for t in tokens):
        raise bad_request(f"tokens: every id must lie in [0, {tokenizer.vocab_size})", "tokens")
    return JSONResponse({"prompt": await run_tokenizer(tokenizer.decode, tokens)})


async def metrics(request: Request) -> Response:
    gateway = request.app.state.gateway
    try:
        stats = await gateway.link.stats()
        name = await gateway.link.model_name()
    except ApiError:
        stats, name = None, gateway.link.served_model_name or ""
    return Response(gateway.exporter.render(stats, name), media_type=CONTENT_TYPE)
