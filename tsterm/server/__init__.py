"""`tsterm serve`: OpenAI- and Anthropic-compatible HTTP APIs on the engine (FastAPI + uvicorn, pydantic bodies).

`app.create_app(state)` builds the ASGI app; `state.ServerState` is what every route shares (the AsyncEngine, the
tokenizer, the served model name, limits). `openai_api` contributes an APIRouter (an Anthropic one is to follow);
`protocol` holds the pydantic bodies, `errors` the OpenAI-style error, `metrics` the per-app Prometheus registry,
`serve` the `tsterm serve` command and `BackgroundServer` (uvicorn on a thread). No Textual here: the TUI can
start the same app.
"""
