"""Agent sessions: tool-call parsers, tools and their sandbox, the agent loop."""
