"""What the chat screen does, apart from drawing it: one plain class per concern, each constructed with exactly what
it needs (the engine host, the session book, callbacks) and owning its state explicitly.

- `SessionBook` (sessions.py): the sessions, which one is shown, their files; new / fork / copy / export.
- `ContextBudget` (context.py): how full a chat's context is, the once-per-session warning, the way out of a full one.
- `ChatTurns` (turns.py): the chat replies being generated (one worker each) and what their end does to a session.
- `ApiConversations` (api.py): API clients' requests, matched to the conversations they continue.
- `AgentRuns` (agent.py): each agent session's loop, tools and running task; it renders through an `AgentView`.

The screen (tsterm.tui.screens.chat) composes the widgets, routes key bindings, slash commands and messages to these,
and renders what they return. None of them touches a widget, so their logic is tested without an app.
"""
