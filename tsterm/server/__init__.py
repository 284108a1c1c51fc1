"""`tsterm serve`: OpenAI- and Anthropic-compatible HTTP APIs on the engine (FastAPI + uvicorn, pydantic bodies).

`app.create_app(state)` builds the ASGI app; `state.ServerState` is what every route shares (the AsyncEngine, the
tokenizer, the served model name, limits). `openai_api` and `anthropic_api` each contribute an APIRouter.
No Textual here: the TUI starts the same app.
"""
