"""What a newcomer hit in the first hour (issue 38): the dashboard's session counts follow every session and reply; an
agent session on a model whose chat template cannot show tools says so and names the profiles whose templates do; a
tool call handed back to an API client is drawn as handed back, also after a restart; a message refused as too long
does not name the session; a fork keeps the "(aborted)" label of the reply it copies."""
from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import openai

import tsterm
from tests.helpers.tokenizers import TEMPLATES
from tests.tui.helpers import chat_screen, say, text_of, turns_done, wait_until
from tsterm.agent.tools import Calculator
from tsterm.tui import TstermApp
from tsterm.tui.widgets.agent_log import ToolCallView
from tsterm.tui.widgets.chat_log import MessageView
from tsterm.tui.widgets.prompt_input import PromptInput
from tsterm.tui.widgets.session_list import SessionList

SIZE = (160, 45)  # wide: the dashboard is open
AGENT_DEMO = Path(tsterm.__file__).parent / "models" / "agent_demo"


def counts(screen) -> str:
    return text_of(screen.dashboard.query_one("#session-counts")).splitlines()[0]


async def test_the_session_counts_follow_the_sessions_and_their_replies(make_profile, data_dir):
    app = TstermApp(make_profile(max_tokens=1500))
    async with app.run_test(size=SIZE) as pilot:
        screen = await chat_screen(pilot)
        first = screen.session
        assert counts(screen) == "1 local · 0 api · 0 generating"
        await pilot.press("ctrl+n")
        await pilot.press("ctrl+g")  # an agent session is local too
        await wait_until(pilot, lambda: len(screen.sessions) == 3, what="three sessions")
        assert counts(screen) == "3 local · 0 api · 0 generating"
        await screen.show_session(first.id)
        await say(pilot, "write a long story")
        await wait_until(pilot, lambda: first.id in screen.turns and screen.turns[first.id].text, what="streaming")
        assert counts(screen) == "3 local · 0 api · 1 generating"
        screen.action_abort()
        await turns_done(pilot, first, 1)
        assert counts(screen) == "3 local · 0 api · 0 generating"
        await screen.delete(first.id)
        assert counts(screen) == "2 local · 0 api · 0 generating"


async def test_an_agent_session_says_when_the_template_cannot_show_tools(make_profile, tiny_checkpoint, tmp_path,
                                                                        data_dir):
    no_tools = tmp_path / "no-tools-model"  # the same tiny model, with Qwen3's template less its tools section
    shutil.copytree(tiny_checkpoint, no_tools)
    (no_tools / "chat_template.jinja").write_text(TEMPLATES["qwen3"])
    profile = tmp_path / "no-tools.yaml"
    profile.write_text(f"model: {no_tools}\ndevice: cpu\ndtype: float32\nblock_size: 4\nnum_kv_blocks: 256\n")
    app = TstermApp(str(profile))
    async with app.run_test(size=SIZE) as pilot:
        screen = await chat_screen(pilot)
        await pilot.press("ctrl+g")
        welcome = await wait_until(pilot, lambda: screen.session.kind == "agent"
                                   and text_of(screen.query_one(".welcome")), what="the agent welcome")
        assert "chat template does not show it the tools (calculator, read_file, list_dir, grep)" in welcome
        names = welcome.split("Profiles whose templates show tools: ", 1)[1].split(";")[0].split(", ")
        assert "agent-demo" in names and "default" not in names  # SmolLM2's template drops them too
    app = TstermApp(make_profile())  # a template with a tools section: the plain welcome
    async with app.run_test(size=SIZE) as pilot:
        screen = await chat_screen(pilot)
        await pilot.press("ctrl+g")
        welcome = await wait_until(pilot, lambda: screen.session.kind == "agent"
                                   and text_of(screen.query_one(".welcome")), what="the agent welcome")
        assert welcome.startswith("Agent session: type a task") and "does not show" not in welcome


async def test_a_tool_call_handed_back_to_an_api_client_is_drawn_so_after_a_restart(tmp_path, data_dir):
    profile = tmp_path / "agent.yaml"
    profile.write_text(f"model: {AGENT_DEMO}\ndevice: cpu\ndtype: float32\nblock_size: 16\nsampling:\n"
                       "  temperature: 0\n")

    def handed_back(screen, session) -> ToolCallView:
        [view] = screen.query(ToolCallView)
        assert screen.current_id == session.id and view.state.status == "handed"
        assert view.title.plain == '↩ calculator {"expression": "37 * 12"} · handed back', view.title.plain
        assert "handed back to the API client" in str(view.body.render())
        return view

    app = TstermApp(str(profile), serve={"port": 0})
    async with app.run_test(size=SIZE) as pilot:
        screen = await chat_screen(pilot)
        server = await wait_until(pilot, lambda: app.api_server, what="the API server")
        client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0)
        reply = await asyncio.to_thread(client.chat.completions.create, model=server.model_name, temperature=0,
                                        messages=[{"role": "user", "content": "What is 37 * 12?"}],
                                        tools=[Calculator().spec()])
        assert reply.choices[0].finish_reason == "tool_calls"  # the client runs the tool, not the workstation
        session = await wait_until(pilot, lambda: next((s for s in screen.sessions.values() if s.kind == "api"
                                                        and s.turns and not screen.api_busy), None), what="the turn")
        await screen.show_session(session.id)
        handed_back(screen, session)
    app = TstermApp(str(profile))  # reopened: drawn from the saved session
    async with app.run_test(size=SIZE) as pilot:
        screen = await chat_screen(pilot)
        await screen.show_session(session.id)
        handed_back(screen, session)


async def test_a_message_refused_as_too_long_does_not_name_the_session(make_profile, data_dir):
    app = TstermApp(make_profile(max_tokens=12, max_model_len=64))
    async with app.run_test(size=SIZE) as pilot:
        screen = await chat_screen(pilot)
        session = screen.session
        prompt = screen.query_one(PromptInput)
        prompt.value = " ".join(["word"] * 200)
        await prompt.action_submit()  # refused: it stays in the prompt
        await wait_until(pilot, lambda: "too long" in screen.chat_log.query(MessageView).last().text,
                         what="the refusal")
        assert session.title == "new chat" and "new chat" in str(screen.query_one(SessionList).get_option(
            session.id).prompt)
        prompt.value = ""
        await say(pilot, "hello")  # the first message that is sent names it
        assert session.title == "hello"


async def test_a_fork_keeps_the_aborted_label_of_the_reply_it_copies(make_profile, data_dir):
    app = TstermApp(make_profile(max_tokens=1500))
    async with app.run_test(size=SIZE) as pilot:
        screen = await chat_screen(pilot)
        parent = screen.session
        await say(pilot, "write a long story")
        await wait_until(pilot, lambda: parent.id in screen.turns and screen.turns[parent.id].text, what="streaming")
        screen.action_abort()
        await turns_done(pilot, parent, 1)

        def label() -> str:
            return text_of(screen.query(".-assistant .role").last())
        assert label().startswith("assistant (aborted)")
        await pilot.press("ctrl+b")
        await wait_until(pilot, lambda: screen.session.parent_id == parent.id, what="the fork")
        assert label().startswith("assistant (aborted)")
        await screen.show_session(parent.id)  # and the parent, drawn again
        assert label().startswith("assistant (aborted)")
