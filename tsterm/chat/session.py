"""A chat session: messages plus the exact token ids the engine saw and produced (persisted by store.py).

The prompt of turn k+1 is the kept ids (turn k's prompt + its generated ids) followed by the tokens of the text
the new messages add to the rendered conversation (plan.py, which also detects and reports a template miss). Under the
`preserve` history policy (history.py) the new text is that of the messages after the `kept_messages` the kept ids
stand for, so a template that drops earlier reasoning changes nothing the engine computed.
"""
from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from tsterm.chat.history import PRESERVE, TEMPLATE, check_policy, kept_digest, plan_turn, render_context
from tsterm.chat.plan import PromptPlan, TextCodec

# 2 added `kept_messages`, `kept_digest` and `kept_context` (which messages the kept ids stand for, rendered in which
# template context), and the turns' `policy_applied` / `fallback_reason`. A file of version 1 loads with
# kept_messages = 0: its next turn is planned as the template renders it, and tracked from then on. Readers ignore
# keys they do not know, so an older tsterm still reads a version 2 file (it drops the new keys).
FORMAT_VERSION = 2
TRACE_FORMAT = "tsterm-agent-trace"  # a session's token counts per turn, replayed by `tsterm bench --trace FILE`
TRACE_VERSION = 1
Render = Callable[[list[dict]], str]  # messages -> prompt text (chat template + generation prompt)


class SessionFileError(ValueError):
    """A session file that cannot be read back (not JSON, or not a session)."""


UNTITLED = ("new chat", "new agent")  # titles the first user message replaces


def title_from(text: str) -> str:
    """A session's title from its first user message: its first 40 characters on one line."""
    return " ".join(text.split())[:40]


def new_session_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(3)


@dataclass
class TurnStats:
    """What one turn cost and reused. `cached_tokens` is the engine's num_cached_tokens (prefix-cache hits)."""

    prompt_tokens: int
    cached_tokens: int
    kept_tokens: int
    generated_tokens: int
    miss: bool = False
    diverged_at: int | None = None
    ttft: float | None = None
    mean_itl: float | None = None
    finish_reason: str | None = None
    policy_applied: str | None = None  # the history policy that planned the turn (None: recorded before policies)
    fallback_reason: str | None = None  # why a `preserve` turn was planned as `template`

    @classmethod
    def from_plan(cls, plan: PromptPlan, cached_tokens: int, generated_tokens: int, **timing: Any) -> TurnStats:
        """A turn's stats from its plan (prompt, kept, miss, policy) and what the engine reported."""
        return cls(len(plan.token_ids), cached_tokens, plan.kept_tokens, generated_tokens, plan.miss, plan.diverged_at,
                   policy_applied=plan.policy_applied, fallback_reason=plan.fallback_reason, **timing)

    @property
    def new_tokens(self) -> int:
        """Prompt tokens the engine had to prefill."""
        return self.prompt_tokens - self.cached_tokens


@dataclass
class Session:
    id: str
    title: str = "new chat"
    messages: list[dict] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)  # exact ids: last prompt + its generated ids
    turns: list[TurnStats] = field(default_factory=list)
    parent_id: str | None = None
    model: str | None = None  # the ids are only meaningful for the model (tokenizer) that made them
    created: float = field(default_factory=time.time)
    updated: float = field(default_factory=time.time)
    # "chat" | "agent" (an agent session: its history holds tool calls and tool messages) | "api" (a conversation an
    # API client holds with `tsterm serve` in the workstation: its history is the client's, shown, not typed into)
    kind: str = "chat"
    # how many leading messages `token_ids` stand for (through the reply they end with), and a digest of both as they
    # were recorded: the `preserve` policy appends the messages after them, and applies only while the digest holds
    kept_messages: int = 0
    kept_digest: str = ""
    kept_context: str = ""  # history.render_context of the turn that made the kept ids

    # ---- conversation
    @property
    def system_prompt(self) -> str | None:
        if self.messages and self.messages[0].get("role") == "system":
            return self.messages[0]["content"]
        return None

    def set_system_prompt(self, text: str | None) -> None:
        """Changing the system prompt rewrites the start of the conversation: the next turn is a miss at ~0."""
        if self.system_prompt is not None:
            self.messages.pop(0)
        if text:
            self.messages.insert(0, {"role": "system", "content": text})
        self.touch()

    def add_user(self, text: str) -> None:
        """Add a user message; the first one names an untitled session."""
        self.messages.append({"role": "user", "content": text})
        if self.title in UNTITLED:
            self.title = title_from(text) or self.title
        self.touch()

    def plan(self, render: Render, tokenizer: TextCodec, policy: str = TEMPLATE,
             stop_ids: Collection[int] | None = None) -> PromptPlan:
        """This turn's prompt under the history `policy` (history.py): `template`, the kept ids + the tokens of the
        text `render` adds (a miss is reported, not fatal); `preserve`, the kept ids + the tokens of the messages
        after `kept_messages`, falling back to `template` (the plan says why) when that cannot apply. `stop_ids`: the
        ids that end a reply (default: the tokenizer's eos ids)."""
        check_policy(policy)
        context = render_context(render)
        why = None
        if policy == PRESERVE and self.token_ids:
            if not self.kept_messages:
                why = "the session does not know which messages its kept ids stand for"
            elif not self.kept_intact():
                why = "the kept ids or the messages they stand for changed since they were recorded"
            elif self.kept_context != context:
                why = "the template renders another context (tools, system block) than the kept ids were made with"
        if why is not None:
            plan = replace(plan_turn(self.token_ids, self.messages, render, tokenizer, TEMPLATE), fallback_reason=why)
        else:
            plan = plan_turn(self.token_ids, self.messages, render, tokenizer, policy, self.kept_messages, stop_ids)
        return replace(plan, context=context)

    def record_reply(self, plan: PromptPlan, text: str, generated_ids: list[int], stats: TurnStats,
                     message: dict | None = None) -> None:
        """The reply to `plan`: `message` (default: an assistant message holding `text`) joins the conversation, and
        the kept ids become the plan's ids + the generated ids, standing for every message through it."""
        self.messages.append(message if message is not None else {"role": "assistant", "content": text})
        self.keep(list(plan.token_ids) + list(generated_ids), len(self.messages), plan.context)
        self.turns.append(stats)
        self.touch()

    def keep(self, token_ids: Sequence[int], covered: int, context: str = "") -> None:
        """Set the kept ids: the exact ids the engine holds for `messages[:covered]` (a conversation through a reply
        and that reply's generated ids), rendered in the template `context` (PromptPlan.context)."""
        if not 0 <= covered <= len(self.messages):
            raise ValueError(f"kept ids cannot stand for {covered} messages: the session has {len(self.messages)}")
        self.token_ids = list(token_ids)
        self.kept_messages = covered if self.token_ids else 0
        self.kept_digest = kept_digest(self.messages[:self.kept_messages], self.token_ids) if self.kept_messages \
            else ""
        self.kept_context = context if self.kept_messages else ""

    def kept_intact(self) -> bool:
        """The kept ids and the messages they stand for are as `keep` recorded them (False when it never did)."""
        return 0 < self.kept_messages <= len(self.messages) and \
            self.kept_digest == kept_digest(self.messages[:self.kept_messages], self.token_ids)

    def drop_last_user(self) -> None:
        """Undo `add_user` after a refused or failed turn, so the session is as it was: a title taken from the
        dropped message goes with it."""
        if self.messages and self.messages[-1].get("role") == "user":
            dropped = self.messages.pop()
            named = self.title == title_from(dropped["content"])
            if named and not any(m.get("role") == "user" for m in self.messages):
                self.title = "new agent" if self.kind == "agent" else "new chat"
            self.touch()

    def clear(self) -> None:
        """Forget the conversation, keeping the system prompt."""
        system = self.system_prompt
        self.messages, self.turns = [], []
        self.keep([], 0)
        self.set_system_prompt(system)

    # ---- numbering: what the chat log shows next to each message (a leading system prompt has no number)
    def number_of(self, index: int) -> int | None:
        first = 1 if self.system_prompt is not None else 0
        return None if index < first else index - first + 1

    def index_of(self, number: int) -> int:
        """messages index of message `number`; ValueError naming the valid range when there is no such message."""
        first = 1 if self.system_prompt is not None else 0
        count = len(self.messages) - first
        if not 1 <= number <= count:
            raise ValueError(f"no message #{number} in this session (it has "
                             + (f"messages #1-#{count})" if count else "no messages yet)"))
        return number - 1 + first

    def reply_stats(self) -> list[TurnStats | None]:
        """One entry per assistant message. `turns` belong to the latest replies (a session forked by an older
        tsterm holds its parent's replies without their stats): align from the end."""
        replies = sum(m.get("role") == "assistant" for m in self.messages)
        turns = self.turns[-replies:] if replies else []
        return [None] * (replies - len(turns)) + list(turns)

    def ids_through_reply(self, replies: int) -> list[int]:
        """The exact ids the engine held right after assistant reply number `replies` (1-based), if they are still
        the start of `token_ids`: every later turn kept them verbatim. [] when unknown (a later turn re-rendered
        the history, or the ids were dropped): the next turn then renders it, and the prefix cache still serves
        whatever blocks that rendering shares with the parent."""
        stats = self.reply_stats()
        if not 0 < replies <= len(stats) or stats[replies - 1] is None:
            return []
        turn = stats[replies - 1]
        end = turn.prompt_tokens + turn.generated_tokens
        later = self.turns[len(self.turns) - (len(stats) - replies):]
        if len(self.token_ids) < end or any(t.kept_tokens < end for t in later):
            return []
        return self.token_ids[:end]

    def fork(self, new_id: str | None = None, upto: int | None = None) -> Session:
        """A branch holding `messages[:upto + 1]` (default: all). Its kept ids are the exact ids of that prefix
        (through the last reply it contains), so its next turn takes the parent's KV blocks by reference. The
        replies' turn stats come along; the ids are never re-rendered here."""
        end = len(self.messages) if upto is None else upto + 1
        if not 0 < end <= len(self.messages):
            raise ValueError(f"cannot fork at message index {upto}: the session has {len(self.messages)}")
        messages = [dict(m) for m in self.messages[:end]]
        replies = sum(m["role"] == "assistant" for m in messages)
        kept = list(self.token_ids) if end == len(self.messages) else self.ids_through_reply(replies)
        turns = [replace(t) for t in self.reply_stats()[:replies] if t is not None]
        child = Session(id=new_id or new_session_id(), title=f"{self.title} (fork)", messages=messages,
                        turns=turns, parent_id=self.id, model=self.model, kind=self.kind)
        if end == len(self.messages):  # the parent's ids as they are; their messages are known if they were recorded
            covered = self.kept_messages if self.kept_intact() else 0
        else:  # the ids through the last reply of the branch
            covered = max((i + 1 for i, m in enumerate(messages) if m["role"] == "assistant"), default=0)
        # covered 0: ids without their messages (`preserve` falls back, `template` works)
        child.keep(kept, covered, self.kept_context)
        return child

    # ---- a conversation that outgrows the context
    def exchanges(self) -> list[tuple[int, int]]:
        """(start, end) message index ranges of the exchanges after the system prompt: a user message and what
        answers it (replies, tool messages) up to the next user message."""
        starts = [i for i, m in enumerate(self.messages) if m["role"] == "user"]
        return [(s, e) for s, e in zip(starts, [*starts[1:], len(self.messages)])]

    def drop_oldest(self, count: int) -> int:
        """Forget the `count` oldest exchanges (the system prompt stays): the conversation now starts elsewhere, so
        the kept ids are dropped and the next turn computes the whole prompt again (once). Returns messages removed."""
        exchanges = self.exchanges()
        if not 0 < count <= len(exchanges):
            raise ValueError(f"cannot drop {count} exchange(s): the session has {len(exchanges)}")
        start, end = exchanges[0][0], exchanges[count - 1][1]
        del self.messages[start:end]
        self.keep([], 0)
        self.touch()
        return end - start

    def carry_over(self, new_id: str, keep: int) -> Session:
        """A new chat holding the system prompt and the last `keep` exchanges, for a conversation that no longer
        fits its context; this one stays as it is. Its history is rendered afresh (no kept ids)."""
        exchanges = self.exchanges()
        kept = [dict(m) for s, e in exchanges[len(exchanges) - keep:] for m in self.messages[s:e]] if keep else []
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt is not None else []
        return Session(id=new_id, title=f"{self.title} (continued)", messages=system + kept, parent_id=self.id,
                       model=self.model, kind=self.kind)

    def continued_by(self, prompt_ids: Sequence[int]) -> int:
        """How many leading ids of `prompt_ids` are this session's last prompt, when the prompt is a later turn of
        it (the last prompt, then more): an API client sends the whole history every turn, and this is how its
        next request finds its conversation. 0 when it is not a continuation."""
        if not self.turns:
            return 0
        last = self.turns[-1].prompt_tokens
        if not 0 < last < len(prompt_ids) or len(self.token_ids) < last:
            return 0
        return last if list(prompt_ids[:last]) == self.token_ids[:last] else 0

    def bind_model(self, model: str) -> bool:
        """Ids made by another model are meaningless here: drop them (the next turn re-renders). True if dropped."""
        if self.model == model:
            return False
        dropped = bool(self.token_ids)
        self.model = model
        self.keep([], 0)
        return dropped

    def touch(self) -> None:
        self.updated = time.time()

    @property
    def num_misses(self) -> int:
        return sum(t.miss for t in self.turns)

    def trace(self, model: str | None = None, tool_latency_s: list[list[float]] | None = None) -> dict[str, Any]:
        """This session's shape for `tsterm bench --trace`: per turn (agent step) the prompt, kept, cached and
        generated token counts, and the seconds its tools took (`tool_latency_s[i]` for turn i, when known).
        No text and no token ids: a trace can be shared."""
        latencies = tool_latency_s or []
        steps = [{"prompt_tokens": t.prompt_tokens, "kept_tokens": t.kept_tokens, "cached_tokens": t.cached_tokens,
                  "generated_tokens": t.generated_tokens,
                  "tool_latency_s": [round(x, 6) for x in latencies[i]] if i < len(latencies) else []}
                 for i, t in enumerate(self.turns)]
        return {"format": TRACE_FORMAT, "version": TRACE_VERSION, "model": model, "steps": steps}

    # ---- serialisation
    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["version"] = FORMAT_VERSION
        return d

    @classmethod
    def from_dict(cls, d: Any) -> Session:
        if not isinstance(d, dict):
            raise SessionFileError("the top level is not an object")
        if not isinstance(d.get("id"), str) or not d["id"]:
            raise SessionFileError("missing or invalid 'id'")
        messages = d.get("messages", [])
        if not isinstance(messages, list) or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in messages):
            raise SessionFileError("'messages' must be a list of {role, content} objects with string values")
        token_ids = d.get("token_ids", [])
        if not isinstance(token_ids, list) or not all(type(t) is int and t >= 0 for t in token_ids):
            raise SessionFileError("'token_ids' must be a list of non-negative integers")
        kept_messages, digest, context = d.get("kept_messages", 0), d.get("kept_digest", ""), d.get("kept_context", "")
        if type(kept_messages) is not int or not 0 <= kept_messages <= len(messages) or \
                not isinstance(digest, str) or not isinstance(context, str):
            raise SessionFileError("'kept_messages' must be a message count, 'kept_digest' and 'kept_context' strings")
        known = {f.name for f in fields(TurnStats)}
        try:
            turns = [TurnStats(**{k: v for k, v in t.items() if k in known}) for t in d.get("turns", [])]
        except (TypeError, AttributeError) as e:
            raise SessionFileError(f"bad 'turns' entry ({e})") from None
        return cls(id=d["id"], title=str(d.get("title", "chat")), messages=messages, token_ids=token_ids,
                   turns=turns, parent_id=d.get("parent_id"), model=d.get("model"),
                   created=float(d.get("created", 0.0)), updated=float(d.get("updated", 0.0)),
                   kind=str(d.get("kind") or "chat"), kept_messages=kept_messages, kept_digest=digest,
                   kept_context=context)

    def to_markdown(self) -> str:
        lines = [f"# {self.title}", ""]
        for m in self.messages:
            lines += [f"## {m['role']}", "", m["content"], ""]
        return "\n".join(lines)
