"""Agent sessions: tool-call parsers, tools and their sandbox, the agent loop. No Textual here."""
from tsterm.agent.tool_calls import Event, TextDelta, ToolCall, ToolCallParser

__all__ = ["Event", "TextDelta", "ToolCall", "ToolCallParser"]
