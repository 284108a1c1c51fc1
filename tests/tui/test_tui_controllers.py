"""The chat screen's controllers (tsterm.tui.controllers) without an app: what a turn's end, a full context, an API
client's request and an agent task whose tools cannot be built do to the sessions. A character tokenizer stands in
for the model's (one id per character), so token counts are lengths of text."""
from __future__ import annotations

import asyncio
from dataclasses import replace
from types import SimpleNamespace

import pytest

from tsterm.chat.session import Session, TurnStats
from tsterm.chat.store import SessionStore
from tsterm.profiles import AgentSettings
from tsterm.server.state import RequestInfo
from tsterm.tui.controllers.agent import AgentRuns
from tsterm.tui.controllers.api import ApiConversations
from tsterm.tui.controllers.context import WARN_AT, ContextBudget, TooLong
from tsterm.tui.controllers.sessions import ExportFailed, NothingToExport, SessionBook
from tsterm.tui.controllers.turns import ChatTurns, DoesNotFit
from tsterm.tui.messages import ApiTurnFinished, ApiTurnStarted, TurnFinished, TurnProgress


class CharTokenizer:
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return "".join(map(chr, ids))


def render(messages: list[dict]) -> str:
    return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"


class Worker:
    """What ChatTurns / AgentRuns get back from `run_worker`: the work it was given, and whether it was cancelled."""

    def __init__(self, work, name: str, group: str):
        self.work, self.name, self.group, self.cancelled = work, name, group, False

    def cancel(self) -> None:
        self.cancelled = True


def make_host(max_model_len: int = 4096, max_tokens: int = 16, **extra) -> SimpleNamespace:
    def stream_turn(session_id, plan, request_id, post):  # the work a turn's worker would run
        return ("stream", session_id, request_id)

    return SimpleNamespace(info=SimpleNamespace(max_model_len=max_model_len),
                           sampling=SimpleNamespace(max_tokens=max_tokens), tokenizer=CharTokenizer(), render=render,
                           model_key="/models/tiny", system_prompt="be brief", model_name="tiny",
                           stream_turn=stream_turn, thinking_history="preserve", stop_ids=frozenset(), **extra)


def make_book(tmp_path, host) -> tuple[SessionBook, list[str]]:
    errors: list[str] = []
    return SessionBook(host, SessionStore(tmp_path / "sessions"), errors.append), errors


def chat_turns(tmp_path, **host_options):
    host = make_host(**host_options)
    book, _ = make_book(tmp_path, host)
    session = book.new_chat()
    book.add(session)
    book.current_id = session.id
    turns = ChatTurns(host, book, ContextBudget(host), Worker, post=lambda message: None)
    return turns, book, session


def test_a_failed_turn_leaves_the_session_as_before_and_the_end_of_a_superseded_turn_changes_nothing(tmp_path):
    turns, book, session = chat_turns(tmp_path)
    before = list(session.messages)
    plan = turns.prepare(session, "hello")
    state = turns.start(session, plan)
    assert state.worker.work == ("stream", session.id, state.request_id) and state.worker.group == "turns"

    stats = TurnStats(len(plan.token_ids), 0, 0, 2, finish_reason="stop")
    assert turns.finish(TurnFinished(session.id, "an earlier request", plan, "ok", [1, 2], stats)) is None
    assert turns.progress(TurnProgress(session.id, "an earlier request", "ok", [1, 2], 0)) is None
    assert session.id in turns.turns and state.text == "" and session.messages[-1]["content"] == "hello"

    ended = turns.finish(TurnFinished(session.id, state.request_id, plan, "", [], None, "RuntimeError: boom"))
    assert ended.session is session and ended.failed
    assert session.messages == before and not session.turns and session.id not in turns.turns


def test_a_reply_cut_by_quitting_is_kept_as_aborted_and_a_finished_one_is_saved(tmp_path):
    turns, book, session = chat_turns(tmp_path)
    plan = turns.prepare(session, "hello")
    state = turns.start(session, plan)
    turns.progress(TurnProgress(session.id, state.request_id, "hal", [7, 8, 9], 4))
    turns.keep_cut_replies()
    assert not turns.turns and session.messages[-1] == {"role": "assistant", "content": "hal"}
    assert session.token_ids == plan.token_ids + [7, 8, 9]
    cut = session.turns[-1]
    assert (cut.finish_reason, cut.generated_tokens, cut.cached_tokens) == ("abort", 3, 4)

    plan = turns.prepare(session, "again")
    state = turns.start(session, plan)
    stats = TurnStats(len(plan.token_ids), 8, plan.kept_tokens, 2, finish_reason="stop")
    ended = turns.finish(TurnFinished(session.id, state.request_id, plan, "ok", [1, 2], stats))
    assert ended.session is session and not ended.failed
    [saved] = book.store.load_all()[0]
    assert saved.messages[-1] == {"role": "assistant", "content": "ok"} and saved.turns[-1].cached_tokens == 8


def test_a_message_that_does_not_fit_leaves_the_history_and_the_way_out_drops_the_fewest_exchanges(tmp_path):
    turns, book, session = chat_turns(tmp_path, max_model_len=300, max_tokens=16)
    budget = turns.budget
    for n in range(3):
        session.messages += [{"role": "user", "content": f"question {n} " + "q" * 30},
                             {"role": "assistant", "content": f"answer {n} " + "a" * 30}]
    before = list(session.messages)
    text = "m" * 120
    with pytest.raises(DoesNotFit) as refused:
        turns.prepare(session, text)
    assert session.messages == before
    assert refused.value.prompt_tokens == len(render([*before, {"role": "user", "content": text}]))

    way = budget.way_out(session, text, refused.value.prompt_tokens)
    system, user = session.messages[:1], [{"role": "user", "content": text}]
    assert budget.fits(budget.prompt_tokens(system + session.messages[1 + 2 * way.drop:] + user))
    assert not budget.fits(budget.prompt_tokens(system + session.messages[1 + 2 * (way.drop - 1):] + user))
    assert way.keep == 3 - way.drop and f"first {way.drop} exchange(s)" in way.drop_text
    assert f"computes {way.after} tokens" in way.new_text and "holds 300" in way.summary

    with pytest.raises(TooLong, match="too long for this model's context"):
        budget.way_out(session, "m" * 400, 1000)


def test_the_context_warning_comes_once_per_session_past_the_threshold(tmp_path):
    budget = ContextBudget(make_host(max_model_len=100))
    session, other = Session(id="a", title="one"), Session(id="b", title="two")
    session.token_ids = [0] * (int(WARN_AT * 100) - 1)
    assert budget.filling(session) is None
    session.token_ids.append(0)
    assert "one uses 80% of the context (80 of 100 tokens)" in budget.filling(session)
    session.token_ids.append(0)
    assert budget.filling(session) is None
    other.token_ids = [0] * 95
    assert "95%" in budget.filling(other)


def api_request(request_id: str, prompt_ids: list[int], text: str = "") -> tuple[ApiTurnStarted, ApiTurnFinished]:
    info = RequestInfo(request_id, "chat.completions", prompt_ids)
    messages = [{"role": "user", "content": f"tell me about {request_id}"}]
    out = SimpleNamespace(outputs=[SimpleNamespace(finish_reason="stop")], num_cached_tokens=0,
                          metrics=SimpleNamespace(ttft=0.01, mean_itl=0.02))
    return (ApiTurnStarted(info, messages),
            ApiTurnFinished(info, messages, text, [90, 91], out if text else None))


def test_an_api_request_joins_the_idle_conversation_it_continues_and_never_a_busy_one(tmp_path):
    host = make_host()
    book, _ = make_book(tmp_path, host)
    api = ApiConversations(host, book)
    first_start, first_end = api_request("paris", [1, 2, 3], "a city")
    session = api.started(first_start)
    assert session.kind == "api" and session.title == "tell me about paris" and api.busy == {session.id}
    same, stats = api.finished(first_end)
    assert same is session and not api.busy and session.token_ids == [1, 2, 3, 90, 91]
    assert (stats.prompt_tokens, stats.kept_tokens, stats.miss) == (3, 0, False)
    # the ids are the kept ids of the messages through the reply (a fork continues them under the policy); the
    # server said it planned nothing (a first request, rendered as sent)
    assert session.kept_messages == 2 and session.kept_intact() and stats.policy_applied is None

    more_start, _ = api_request("more", [1, 2, 3, 90, 91, 4])  # the client's next turn: the same conversation
    assert api.started(more_start) is session and api.busy == {session.id}
    again_start, _ = api_request("again", [1, 2, 3, 90, 91, 5])  # the same history while that one generates
    other = api.started(again_start)
    assert other is not session and set(book.sessions) == {session.id, other.id}

    more_end = api_request("more", [1, 2, 3, 90, 91, 4], "and more")[1]
    more_end.info = replace(more_end.info, history_policy="template",
                            history_fallback="the last reply did not end with a stop",
                            history_context="<tools: calculator>")
    _, more_stats = api.finished(more_end)  # the turn line shows what the server applied, and why
    assert (more_stats.policy_applied, more_stats.fallback_reason) == ("template", "the last reply did not end with "
                                                                                   "a stop")
    assert more_stats.kept_tokens == 5 and not more_stats.miss
    # the ids are kept with the context the server rendered them in (the client's tools), not the host template's own
    assert session.kept_context == "<tools: calculator>"

    cut_start, cut_end = api_request("cut", [7, 8])  # ended before any output: no turn, the history is shown
    cut = api.started(cut_start)
    assert api.finished(cut_end) == (cut, None) and not cut.turns and cut.messages == cut_end.messages


def test_the_book_forks_with_free_titles_copies_answers_and_never_ends_empty(tmp_path):
    host = make_host()
    book, errors = make_book(tmp_path, host)
    parent = book.new_chat("trip")
    parent.kind = "api"
    parent.messages += [{"role": "user", "content": "why?"}, {"role": "assistant", "content": "<think>hm</think>so."}]
    book.add(parent)
    book.current_id = parent.id
    first, second = book.fork(None), book.fork(1)
    assert (first.title, second.title) == ("trip (fork)", "trip (fork 2)")
    assert first.kind == second.kind == "chat" and second.parent_id == parent.id  # the client's stays the client's
    assert book.copy_text(None) == (2, "so.") and book.copy_text(1) == (1, "why?")

    with pytest.raises(NothingToExport):
        book.export("trace", "", trace=lambda: {})
    blocked = tmp_path / "a file"
    blocked.write_text("")
    with pytest.raises(ExportFailed, match="could not export to .*a file"):
        book.export("md", str(blocked / "out.md"), trace=lambda: {})

    for session_id in list(book.sessions):
        book.delete(session_id)
    [left] = book.sessions.values()
    assert left.kind == "chat" and left.system_prompt == "be brief" and not errors
    assert [s.id for s in book.store.load_all()[0]] == [left.id]


async def test_agent_tools_that_cannot_be_set_up_are_reported_and_the_history_is_as_before(tmp_path):
    host = make_host(agent=AgentSettings(command_tools=[{"name": "lint"}]))  # checked in full when built
    book, _ = make_book(tmp_path, host)
    session = book.new_agent()
    book.add(session)
    before = list(session.messages)

    class View:
        def __init__(self):
            self.reports, self.ended = [], []

        async def report(self, session, text, error):
            self.reports.append((session.id, text, error))

        async def task_ended(self, session):
            self.ended.append(session.id)

    def run_worker(work, name, group):
        return asyncio.ensure_future(work)

    view = View()
    agents = AgentRuns(host, book, view, run_worker, workspace=str(tmp_path))
    assert not agents.abort(session.id)  # no task: nothing to stop
    run = agents.start(session, "add 2 and 2")
    assert agents.running == {session.id}
    await run.worker
    assert view.reports == [(session.id, "the agent's tools could not be set up: agent.command_tools[0] 'lint': "
                                         "'argv' must be a non-empty list of strings, got None", True)]
    assert view.ended == [session.id] and not agents.running and run.agent is None and run.toolset is None
    assert session.messages == before and book.store.load_all()[0][0].messages == before
