"""`tsterm serve`: OpenAI- and Anthropic-compatible HTTP APIs on the engine (FastAPI + uvicorn, pydantic bodies).

`app.create_app(state)` builds the ASGI app; `state.ServerState` is what every route shares (the AsyncEngine, the
tokenizer, the served model name, limits). `openai_api` and `anthropic_api` contribute APIRouters, sharing
`generation` (admission, prompt rendering and the history policy's plan, the reply parser, disconnect-aware
generation); `tool_choice` the grammar that holds a required call to the offered tools, `structured` a request's
`response_format` / `structured_outputs` checked before admission; `conversations` keeps recent API conversations with
their exact ids for their next request; `protocol` holds the OpenAI pydantic bodies, `errors` the error (OpenAI- or
Anthropic-shaped), `metrics` the per-app Prometheus registry, `serve` the `tsterm serve` command and
`BackgroundServer` (uvicorn on a thread). No Textual here: the TUI can start the same app.
"""
