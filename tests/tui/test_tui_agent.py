"""Agent sessions in the TUI: a task runs the agent loop, tool calls show as collapsible blocks, approval asks through
a dialog, esc aborts, the dashboard shows a waiting session's pin, and agent sessions come back after a restart.

The app runs on the tiny real engine (tests/tui/conftest.py); where a test needs the model to call a tool, agent
sessions generate with the scripted model of tests/agent/scripted.py (the same tokenizer, fixed replies)."""
from __future__ import annotations

import json

from tests.agent.scripted import ScriptedBackend
from tests.tui.helpers import chat_screen, engine_stats, palette, say, text_of, wait_until
from tsterm.agent.loop import REFUSED
from tsterm.agent.tool_calls import CLOSE_TAG, OPEN_TAG
from tsterm.tui import TstermApp
from tsterm.tui.screens.dialogs import ApproveTool
from tsterm.tui.widgets.agent_log import ToolCallView
from tsterm.tui.widgets.chat_log import MessageView, ReplyView
from tsterm.tui.widgets.session_list import SessionList

SIZE = (120, 40)


def call(name: str, **arguments) -> str:
    return f"{OPEN_TAG}\n{json.dumps({'name': name, 'arguments': arguments})}\n{CLOSE_TAG}"


def agent_profile(make_profile, workspace, max_tokens: int = 12, **agent) -> str:
    workspace.mkdir(exist_ok=True)
    settings = {"workspace": str(workspace), **agent}
    return make_profile(max_tokens=max_tokens, agent=json.dumps(settings))  # YAML reads a JSON mapping


def script(app, replies: list[str], **kwargs) -> ScriptedBackend:
    backend = ScriptedBackend(app.host.tokenizer, replies, **kwargs)
    app.host.agent_backend = backend
    return backend


async def new_agent(pilot):
    screen = pilot.app.screen
    before = screen.current_id
    await pilot.press("ctrl+g")
    await wait_until(pilot, lambda: screen.current_id != before and screen.session.kind == "agent",
                     what="a new agent session")
    return screen.session


async def task_done(pilot, session, steps: int) -> None:
    screen = pilot.app.screen
    await wait_until(pilot, lambda: session.id not in screen.running_agents
                     and sum(m["role"] == "assistant" for m in session.messages) >= steps,
                     what=f"{steps} step(s) of {session.title!r}")


async def test_a_task_calls_the_calculator_and_shows_the_call_its_result_and_the_answer(make_profile, data_dir,
                                                                                          tmp_path):
    app = TstermApp(agent_profile(make_profile, tmp_path / "ws"))
    async with app.run_test(size=SIZE) as pilot:
        screen = await chat_screen(pilot)
        chat = screen.session
        backend = script(app, [f"Let me compute.\n{call('calculator', expression='6 * 7')}", "It is 42."])
        session = await new_agent(pilot)
        assert session.id != chat.id and "Agent session" in text_of(screen.query_one(".welcome"))
        option = screen.query_one(SessionList).get_option(session.id)
        chat_option = screen.query_one(SessionList).get_option(chat.id)
        assert "◆" in str(option.prompt) and "◆" not in str(chat_option.prompt)
        await say(pilot, "what is 6 * 7?", wait_turn=False)
        await task_done(pilot, session, 2)

        [block] = screen.query(ToolCallView)
        assert block.state.status == "done" and block.state.result == "42" and block.collapsed
        assert block.title.plain.startswith('✓ calculator {"expression": "6 * 7"} · done')
        assert "result:\n42" in text_of(block.body)
        replies = list(screen.query(ReplyView))
        assert [r.text for r in replies] == ["Let me compute.\n", "It is 42."]  # no raw <tool_call> text
        lines = [text_of(r.query_one(".turn-stats")) for r in replies]
        assert lines[0].startswith("step 1 · prompt ") and " · cached " in lines[0] and " · new " in lines[0]
        assert lines[1].startswith("step 2 · prompt ")
        assert session.messages[-1] == {"role": "assistant", "content": "It is 42."}
        assert session.messages[-2]["role"] == "tool" and session.messages[-2]["content"] == "42"
        assert len(backend.prompts) == 2 and f"agent:{session.id}" in backend.pins  # pinned while it waits
        assert screen.dashboard.query_one("#reuse-title").render().plain == "prefix reuse per step (this agent)"
        assert "step" in text_of(screen.dashboard.query_one("#reuse"))

        await say(pilot, "/new")  # a chat is still a chat: its messages go to the engine, not the agent
        assert screen.session.kind == "chat"


async def test_a_write_asks_first_deny_refuses_allow_writes(make_profile, data_dir, tmp_path):
    workspace = tmp_path / "ws"
    app = TstermApp(agent_profile(make_profile, workspace, allow_write=True))
    async with app.run_test(size=SIZE) as pilot:
        screen = await chat_screen(pilot)
        write = call("write_file", path="out.txt", content="hello")
        script(app, [write, "I was not allowed.", write, "Written."])
        session = await new_agent(pilot)

        await say(pilot, "write hello to out.txt", wait_turn=False)
        dialog = await wait_until(pilot, lambda: isinstance(app.screen, ApproveTool) and app.screen.query(
            "#approve-cwd") and app.screen, what="the approval dialog, composed")
        assert dialog.tool == "write_file" and dialog.arguments == {"path": "out.txt", "content": "hello"}
        assert str(workspace) in text_of(dialog.query_one("#approve-cwd"))
        assert '"content": "hello"' in text_of(dialog.query_one("#approve-args"))
        await wait_until(pilot, lambda: screen.query_one(ToolCallView).state.status == "waiting",
                         what="the call's block, waiting")  # mounted by a message that may follow the dialog
        await pilot.press("n")
        await task_done(pilot, session, 2)
        # with a write tool, the session says how its tools are confined (Workspace.describe)
        assert any(v.role == "notice" and v.text.startswith("sandbox: ") for v in screen.query(MessageView))
        block = screen.query(ToolCallView).last()
        assert block.state.status == "refused" and block.state.error == REFUSED
        assert "refused" in block.title.plain and not (workspace / "out.txt").exists()
        assert session.messages[-2]["content"] == f"error: {REFUSED}"

        await say(pilot, "please, write it", wait_turn=False)
        await wait_until(pilot, lambda: isinstance(app.screen, ApproveTool), what="the dialog again")
        await pilot.press("y")
        await task_done(pilot, session, 4)
        block = screen.query(ToolCallView).last()
        assert block.state.status == "done" and (workspace / "out.txt").read_text() == "hello"


async def test_auto_approve_never_asks(make_profile, data_dir, tmp_path):
    workspace = tmp_path / "ws"
    app = TstermApp(agent_profile(make_profile, workspace, allow_write=True), auto_approve=True)
    async with app.run_test(size=SIZE) as pilot:
        screen = await chat_screen(pilot)
        script(app, [call("write_file", path="a.txt", content="x"), "ok"])
        await say(pilot, "/agent named one")  # the slash command makes one too
        assert screen.session.kind == "agent" and screen.session.title == "named one"
        count = len(screen.sessions)
        await palette(pilot, "new agent session")  # and the palette
        await wait_until(pilot, lambda: len(screen.sessions) == count + 1, what="an agent session from the palette")
        session = screen.session
        assert session.kind == "agent" and session.title == "new agent"
        assert "without asking" in text_of(screen.query_one(".welcome"))
        await say(pilot, "write", wait_turn=False)
        await task_done(pilot, session, 2)
        assert (workspace / "a.txt").read_text() == "x" and not isinstance(app.screen, ApproveTool)


async def test_a_bad_agent_section_is_an_error_in_the_log_not_a_crash(make_profile, data_dir, tmp_path):
    app = TstermApp(make_profile(agent=json.dumps({"workspace": str(tmp_path / "missing")})))
    async with app.run_test(size=SIZE) as pilot:
        screen = await chat_screen(pilot)
        session = await new_agent(pilot)
        await say(pilot, "anything", wait_turn=False)
        error = await wait_until(pilot, lambda: session.id not in screen.running_agents
                                 and [v for v in screen.query(MessageView) if v.role == "error"], what="the error")
        assert "could not be set up" in error[0].text and "workspace" in error[0].text
        assert session.id not in screen.running_agents and not any(m["role"] == "user" for m in session.messages)


async def test_escape_aborts_a_running_task_and_the_session_stays_usable(make_profile, data_dir, tmp_path):
    app = TstermApp(agent_profile(make_profile, tmp_path / "ws"))
    async with app.run_test(size=SIZE) as pilot:
        screen = await chat_screen(pilot)
        backend = script(app, ["word " * 400, "Fine."], hold_after=20)  # held mid-reply until the abort
        session = await new_agent(pilot)
        await say(pilot, "talk for a long time", wait_turn=False)
        await wait_until(pilot, lambda: session.id in screen.agent_runs
                         and len(screen.agent_runs[session.id].text) > 10, what="some streamed text")
        await pilot.press("escape")
        await wait_until(pilot, lambda: session.id not in screen.running_agents, what="the abort")
        assert backend.aborted and not any(m["role"] == "assistant" for m in session.messages)
        assert "aborted" in text_of(screen.query(ReplyView).last().query_one(".role"))
        assert any(v.role == "notice" and v.text == "aborted" for v in screen.query(MessageView))

        await say(pilot, "then just say fine", wait_turn=False)
        await task_done(pilot, session, 1)
        assert session.messages[-1] == {"role": "assistant", "content": "Fine."}


async def test_the_dashboard_shows_a_waiting_agent_sessions_pinned_blocks(make_profile, data_dir, tmp_path):
    """On the real engine: after its answer the session waits on the user with its blocks pinned; deleting it
    releases the pin."""
    app = TstermApp(agent_profile(make_profile, tmp_path / "ws", max_tokens=8, max_steps=2))
    async with app.run_test(size=SIZE) as pilot:
        screen = await chat_screen(pilot)
        session = await new_agent(pilot)
        await say(pilot, "hello engine", wait_turn=False)
        await task_done(pilot, session, 1)
        stats = await engine_stats(app)
        assert stats["pins"] == 1 and stats["pinned_blocks"] > 0
        screen.action_toggle_dashboard() if "-dashboard" not in screen.classes else None
        counts = screen.dashboard.query_one("#kv-counts")
        await wait_until(pilot, lambda: f"pinned {stats['pinned_blocks']} blocks, 1 pin(s)" in text_of(counts),
                         what="the pinned blocks on the dashboard")
        assert "step" in text_of(screen.dashboard.query_one("#reuse"))

        await screen.delete(session.id)  # the pin goes with the session
        stats = await engine_stats(app)
        assert stats["pins"] == 0 and stats["pinned_blocks"] == 0
        await wait_until(pilot, lambda: "pinned 0 blocks, 0 pin(s)" in text_of(counts), what="the pin released")


async def test_an_agent_session_comes_back_after_a_restart(make_profile, data_dir, tmp_path):
    profile = agent_profile(make_profile, tmp_path / "ws")
    app = TstermApp(profile)
    async with app.run_test(size=SIZE) as pilot:
        await chat_screen(pilot)
        script(app, [call("calculator", expression="2 + 2"), "Four."])
        session = await new_agent(pilot)
        await say(pilot, "2 + 2?", wait_turn=False)
        await task_done(pilot, session, 2)
        saved = list(session.messages)

    app = TstermApp(profile)
    async with app.run_test(size=SIZE) as pilot:
        screen = await chat_screen(pilot)
        assert screen.current_id == session.id  # the most recently touched session
        restored = screen.session
        assert restored.kind == "agent" and restored.messages == saved
        assert "◆" in str(screen.query_one(SessionList).get_option(session.id).prompt)
        [block] = screen.query(ToolCallView)  # rebuilt from the saved call and its tool message
        assert block.state.status == "done" and block.state.result == "4" and block.state.name == "calculator"
        assert [v.role for v in screen.query(MessageView)] == ["system", "user", "assistant"]
        assert OPEN_TAG not in "".join(v.text for v in screen.query(MessageView))
        assert text_of(screen.query(".step-line").first()).startswith("step 1 · prompt ")

        backend = script(app, ["Still four."])  # a further task continues the restored history
        await say(pilot, "and again?", wait_turn=False)
        await task_done(pilot, restored, 3)
        assert restored.messages[-1]["content"] == "Still four." and len(backend.prompts) == 1
        assert restored.turns[-1].kept_tokens > 0  # the saved exact ids were kept


async def test_quitting_releases_the_pin_and_closes_the_tools(make_profile, data_dir, tmp_path):
    app = TstermApp(agent_profile(make_profile, tmp_path / "ws"))
    closed = []
    async with app.run_test(size=SIZE) as pilot:
        screen = await chat_screen(pilot)
        backend = script(app, ["Hello."])
        session = await new_agent(pilot)
        await say(pilot, "say hello", wait_turn=False)
        await task_done(pilot, session, 1)
        toolset = screen.agent_runs[session.id].toolset
        close = toolset.close
        toolset.close = lambda: (closed.append(True), close())  # MCP servers would stop here
        assert backend.pins and not backend.unpinned
    assert backend.unpinned == [f"agent:{session.id}"] and closed == [True]


async def test_switching_away_and_back_mid_task_shows_the_task_as_it_runs(make_profile, data_dir, tmp_path):
    app = TstermApp(agent_profile(make_profile, tmp_path / "ws"))
    async with app.run_test(size=SIZE) as pilot:
        screen = await chat_screen(pilot)
        chat = screen.session
        backend = script(app, ["word " * 60 + call("calculator", expression="1 + 1"), "Two."], hold_after=30)
        session = await new_agent(pilot)
        await say(pilot, "count", wait_turn=False)
        run = await wait_until(pilot, lambda: screen.agent_runs.get(session.id), what="the run")
        await wait_until(pilot, lambda: len(run.text) > 20, what="some streamed text")
        await screen.show_session(chat.id)  # the task goes on out of sight (held after 30 tokens)
        assert screen.agent_reply is None and not screen.query(ToolCallView)
        await screen.show_session(session.id)
        assert session.id in screen.running_agents and run.phase == "generating"
        await wait_until(pilot, lambda: screen.agent_reply and "word word" in screen.agent_reply.text,
                         what="the step being generated, shown again")
        backend.release()
        await task_done(pilot, session, 2)
        [block] = screen.query(ToolCallView)
        assert block.state.status == "done" and block.state.result == "2"
        assert screen.query(ReplyView).last().text == "Two." and len(backend.prompts) == 2


async def test_quitting_while_a_tool_waits_for_approval_writes_nothing_and_keeps_the_history(make_profile, data_dir,
                                                                                              tmp_path):
    workspace = tmp_path / "ws"
    app = TstermApp(agent_profile(make_profile, workspace, allow_write=True))
    async with app.run_test(size=SIZE) as pilot:
        await chat_screen(pilot)
        backend = script(app, [call("write_file", path="late.txt", content="x")])
        session = await new_agent(pilot)
        await say(pilot, "write late", wait_turn=False)
        await wait_until(pilot, lambda: isinstance(app.screen, ApproveTool), what="the approval dialog")
    assert not (workspace / "late.txt").exists() and backend.unpinned == [f"agent:{session.id}"]
    [saved] = [s for s in app.store.load_all()[0] if s.id == session.id]
    assert saved.messages[-1]["role"] == "tool" and saved.messages[-1]["content"].startswith("error: ")


async def test_escape_while_the_tools_start_stops_the_task_and_closes_them_once_started(make_profile, data_dir,
                                                                                        tmp_path, monkeypatch):
    import threading

    from tsterm.tui.controllers import agent as agent_screen

    started, release, closed = threading.Event(), threading.Event(), threading.Event()
    build = agent_screen.build_toolset

    def slow_build(*args, **kwargs):  # MCP servers starting: they are up once the test has seen the task stop
        started.set()
        toolset = build(*args, **kwargs)
        release.wait(600)  # (a guard against a hang only: the test sets it)
        toolset.close = closed.set
        return toolset

    monkeypatch.setattr(agent_screen, "build_toolset", slow_build)
    app = TstermApp(agent_profile(make_profile, tmp_path / "ws"))
    async with app.run_test(size=SIZE) as pilot:
        screen = await chat_screen(pilot)
        backend = script(app, ["never asked"])
        session = await new_agent(pilot)
        await say(pilot, "start", wait_turn=False)
        await wait_until(pilot, started.is_set, what="the tools starting")
        await pilot.press("escape")
        await wait_until(pilot, lambda: session.id not in screen.running_agents, what="the task stopped")
        release.set()  # the tools finish starting only now, after the task stopped
        await wait_until(pilot, closed.is_set, what="the tools closed once built")
        assert backend.prompts == [] and screen.agent_runs[session.id].agent is None


def test_the_step_line_says_what_a_template_miss_cost():
    from tsterm.chat.session import TurnStats
    from tsterm.tui.widgets.agent_log import split_reply, status_of_tool_message, step_summary

    plain = step_summary(2, TurnStats(100, 96, 96, 5, finish_reason="stop"))
    assert plain == "step 2 · prompt 100 · cached 96 · new 4 · gen 5"
    miss = step_summary(3, TurnStats(120, 40, 41, 5, miss=True, diverged_at=41, finish_reason="length"), 64)
    assert miss == ("step 3 · prompt 120 · cached 40 · new 80 · gen 5 · length · less reuse: the chat template wrote "
                    "the history differently from token 41 on, so reuse stopped there and 64 tokens the "
                    "model had already seen were computed again")
    assert split_reply(f"ok {call('grep', pattern='x')}") == ("ok ", [("grep", {"pattern": "x"}, None)])
    assert status_of_tool_message(f"error: {REFUSED}") == ("refused", REFUSED, "")
    assert status_of_tool_message("error: grep: bad\npartial") == ("error", "grep: bad", "partial")
