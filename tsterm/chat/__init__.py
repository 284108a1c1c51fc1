"""The chat layer: sessions keep the exact token ids the engine saw and produced, plan each turn's prompt from
them, report where a re-rendered history diverged, and persist to disk. No Textual here: the TUI, the plain CLI
chat, and next the agent loop and the server share it."""
from tsterm.chat.history import POLICIES, PRESERVE, TEMPLATE, plan_turn, strip_reasoning
from tsterm.chat.plan import PromptPlan, first_divergence, plan_prompt
from tsterm.chat.session import Session, SessionFileError, TurnStats, new_session_id
from tsterm.chat.store import SessionStore, atomic_write, default_data_dir

__all__ = ["POLICIES", "PRESERVE", "PromptPlan", "Session", "SessionFileError", "SessionStore", "TEMPLATE", "TurnStats",
           "atomic_write", "default_data_dir", "first_divergence", "new_session_id", "plan_prompt", "plan_turn",
           "strip_reasoning"]
