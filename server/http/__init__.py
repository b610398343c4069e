"""The OpenAI-compatible HTTP gateway (docs/http.md): Starlette + uvicorn in front of the ZeroMQ
protocol.

The gateway reaches the engine only through `pagedrun.server.client.AsyncClient` (ZeroMQ,
docs/protocol.md), so one or several gateways can front one `paged-run serve`. One job per
module:

    app.py             the Starlette application: routes, error handlers, middleware, lifespan
    engine_link.py     the gateway's ZeroMQ client: MODEL_INFO cache, STATS, PING, GENERATE
    openai_models.py   request bodies -> what a GENERATE needs (field types, OpenAI -> vLLM names)
    generation.py      one HTTP request's GENERATEs: open, first frame, merge, abort on disconnect
    chat_format.py     chat.completion / chat.completion.chunk bodies
    completion_format.py  text_completion bodies (echo included)
    logprobs.py        engine logprobs -> OpenAI's chat and completions logprobs shapes
    responses.py       shapes shared by both formats: ids, usage, timestamps
    sse.py             Server-Sent Events framing and the response that aborts on disconnect
    errors.py          OpenAI's error body and the HTTP status of every failure
    auth.py            the optional Bearer API key
    prometheus.py      /metrics: the engine's STATS reply as Prometheus text (`paged_run:`)
    tokenizer_source.py  the local tokenizer behind /tokenize and /detokenize
    routes.py          the handlers of the small endpoints (models, health, version, tokenize)
    gateway_cmd.py     `paged-run http` and the uvicorn runner `serve --http-port` uses
"""
