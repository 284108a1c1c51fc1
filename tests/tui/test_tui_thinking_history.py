"""The thinking-history policy in the workstation (issue 40): the profile's `thinking_history` plans the chat and
agent sessions' turns, and each reply's reuse line (and the dashboard) says which policy applied and, when
`preserve` fell back, why.

The model is a tiny random Qwen3-MoE whose tokenizer carries the in-house Qwen3 thinking template
(tests/helpers/reasoning_templates.py), which drops the `<think>` of replies before the last user message. The first
reply of a session is scripted on the engine (EngineScript: computed by the engine as if generated, through its
stop token, so the prefix cache and num_cached_tokens are the engine's own); later replies are the model's. Under
`preserve` the next turn's prompt is every id of the first turn and only the new message's text: the engine serves it
from the cache and no miss shows. Under `template` the first reply is re-rendered without its reasoning: a miss
there, shown on the reply's line."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.agent.scripted import EngineScript
from tests.helpers.checkpoints import make_checkpoint
from tests.helpers.reasoning_templates import FAMILIES, family_tokenizer
from tests.tui.helpers import chat_screen, say, text_of, turns_done, wait_until
from tsterm.chat.history import PRESERVE, TEMPLATE
from tsterm.chat.session import TurnStats
from tsterm.tui import TstermApp
from tsterm.tui.widgets.chat_log import policy_summary, short_reason, turn_summary

SIZE = (200, 60)  # the dashboard is open
BLOCK = 4
FAMILY = FAMILIES["qwen3"]
FIRST_REPLY = FAMILY.reply("The user greets me: greet back, briefly.", "Hello! How can I help?", [])[1]
FOLLOW_UP = "Thanks. And 7*8?"


@pytest.fixture(scope="module")
def thinking_model(tmp_path_factory) -> Path:
    """A tiny random Qwen3-MoE with the family's tokenizer files: tokenizer.json, the chat template and its stops."""
    tok = family_tokenizer(FAMILY)
    path, _ = make_checkpoint(tmp_path_factory.mktemp("tui-thinking") / "qwen3-thinking", "qwen3_moe",
                              dict(vocab_size=tok.vocab_size, max_position_embeddings=2048, num_experts=4,
                                   num_experts_per_tok=2, num_hidden_layers=2), with_tokenizer=False)
    tok._backend.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": FAMILY.stops[0],
                                                            "chat_template": FAMILY.template}))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": list(tok.eos_token_ids)}))
    return path


def thinking_profile(tmp_path: Path, model: Path, policy: str, **extra) -> str:
    lines = [f"model: {model}", "device: cpu", "dtype: float32", f"block_size: {BLOCK}", "num_kv_blocks: 512",
             f"thinking_history: {policy}", "sampling:", "  temperature: 0", "  max_tokens: 6"]
    lines += [f"{k}: {v}" for k, v in extra.items()]
    path = tmp_path / f"thinking-{policy}.yaml"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


class ScriptedEngine(EngineScript):
    """The host's engine with its first reply scripted, then the model's own; everything else (the dashboard's
    polls, the server's metrics) goes to the AsyncEngine it wraps."""

    def __getattr__(self, name: str):
        return getattr(self.engine, name)


def block_aligned(n: int) -> int:
    return n // BLOCK * BLOCK


def reply_lines(screen) -> list[str]:
    """The reuse lines under the replies in the log (live ones, and those of a session shown from its history)."""
    return [text for line in screen.chat_log.query(".turn-stats") if (text := text_of(line))]


@pytest.mark.parametrize("policy", [PRESERVE, TEMPLATE])
async def test_a_chat_keeps_every_id_of_a_thinking_reply_under_preserve_and_misses_under_template(
        thinking_model, data_dir, tmp_path, policy):
    app = TstermApp(thinking_profile(tmp_path, thinking_model, policy))
    async with app.run_test(size=SIZE) as pilot:
        screen = await chat_screen(pilot)
        assert app.host.thinking_history == policy  # the profile's key, resolved on the host
        script = ScriptedEngine(app.host.async_engine, [FIRST_REPLY])
        app.host.async_engine = script
        session = screen.session
        await say(pilot, "hello")
        await turns_done(pilot, session, 1)
        kept = list(session.token_ids)
        assert "<think>" in session.messages[-1]["content"] and kept[-1] in app.host.stop_ids
        first = session.turns[0]
        assert (first.policy_applied, first.fallback_reason) == (policy, None)

        await say(pilot, FOLLOW_UP)
        await turns_done(pilot, session, 2)
        second, prompt = session.turns[1], script.prompts[1]
        line = await wait_until(pilot, lambda: len(reply_lines(screen)) == 2 and reply_lines(screen)[1],
                                what="the second reply's line")
        reuse = text_of(screen.dashboard.query_one("#reuse"))
        print(f"{policy}: kept {len(kept)} ids; turn 2: {line!r}")
        assert second.fallback_reason is None and f"policy {policy}" in line and f"last policy {policy}" in reuse
        if policy == PRESERVE:
            # every kept id, then the new message's text: served from the cache, no miss shown
            assert not second.miss and second.kept_tokens == len(kept) and prompt[:len(kept)] == kept
            assert second.cached_tokens >= block_aligned(len(kept) - 1)
            assert "less reuse" not in line and "0 miss(es)" in reuse
        else:
            # the template wrote the first reply without its <think>: the prompt leaves the kept ids at that reply
            assert second.miss and second.diverged_at == second.kept_tokens == first.prompt_tokens
            assert second.cached_tokens <= block_aligned(second.diverged_at) < block_aligned(len(kept) - 1)
            assert f"less reuse: history rewritten from token {second.diverged_at}" in line
            assert f"miss@{second.diverged_at}" in reuse and "1 miss(es)" in reuse
            return

        # the model's own reply ran into max_tokens (no stop token at the end of the kept ids): the next turn cannot
        # append to them, falls back to the template's rendering, and its line says why
        assert second.finish_reason == "length"
        await say(pilot, "and 9*9?")
        await turns_done(pilot, session, 3)
        third = session.turns[2]
        line = await wait_until(pilot, lambda: len(reply_lines(screen)) == 3 and reply_lines(screen)[2],
                                what="the third reply's line")
        assert third.policy_applied == TEMPLATE and "did not end with a stop token" in third.fallback_reason
        assert "policy template (preserve fell back: last reply cut short)" in line
        assert "last policy template (preserve fell back: last reply cut short)" in text_of(
            screen.dashboard.query_one("#reuse"))


@pytest.mark.parametrize("policy", [PRESERVE, TEMPLATE])
async def test_an_agent_sessions_follow_up_is_planned_with_the_profiles_policy(thinking_model, data_dir, tmp_path,
                                                                               policy):
    workspace = tmp_path / "ws"
    workspace.mkdir()
    app = TstermApp(thinking_profile(tmp_path, thinking_model, policy,
                                     agent=json.dumps({"workspace": str(workspace), "tools": ["calculator"]})))
    async with app.run_test(size=SIZE) as pilot:
        screen = await chat_screen(pilot)
        script = EngineScript(app.host.async_engine, [FIRST_REPLY])
        app.host.agent_backend = script
        await pilot.press("ctrl+g")
        session = await wait_until(pilot, lambda: screen.session.kind == "agent" and screen.session,
                                   what="a new agent session")
        for n, task in enumerate(["hello", FOLLOW_UP], 1):
            await say(pilot, task, wait_turn=False)
            await wait_until(pilot, lambda n=n: session.id not in screen.running_agents and len(session.turns) >= n,
                             what=f"task {n}")
        assert screen.agent_runs[session.id].agent.history_policy == policy
        first, second = session.turns[:2]
        line = await wait_until(pilot, lambda: len(reply_lines(screen)) >= 2 and reply_lines(screen)[1],
                                what="the follow-up's step line")
        kept = first.prompt_tokens + first.generated_tokens
        assert line.startswith("step 2 · ") and f" · policy {policy}" in line and second.fallback_reason is None
        if policy == PRESERVE:
            assert not second.miss and second.kept_tokens == kept and "less reuse" not in line
            assert second.cached_tokens >= block_aligned(kept - 1)
        else:
            assert second.miss and second.diverged_at == first.prompt_tokens and "less reuse" in line


@pytest.mark.parametrize("policy", [PRESERVE, TEMPLATE])
async def test_an_api_conversations_turn_line_shows_the_policy_the_server_applied(thinking_model, data_dir, tmp_path,
                                                                                   policy):
    import asyncio

    import openai

    app = TstermApp(thinking_profile(tmp_path, thinking_model, policy, server=json.dumps({"max_conversations": 3})))
    async with app.run_test(size=SIZE) as pilot:
        screen = await chat_screen(pilot)
        script = ScriptedEngine(app.host.async_engine, [FIRST_REPLY])
        app.host.async_engine = script  # what the server (started now, on the host's engine) generates with
        app.start_api_server(0)
        server = await wait_until(pilot, lambda: app.api_server, what="the API server")
        # the profile's policy and conversation bounds are the workstation server's
        assert (server.state.history_policy, server.state.limits.max_conversations) == (policy, 3)
        api = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=60)
        messages = [{"role": "user", "content": "hello"}]
        first = await asyncio.to_thread(api.chat.completions.create, model=server.model_name, messages=messages,
                                        max_tokens=6, temperature=0)
        [session] = await wait_until(pilot, lambda: not screen.api_busy and [
            s for s in screen.sessions.values() if s.kind == "api" and s.turns], what="the API session")
        held = list(session.token_ids)
        assert held[-1] in app.host.stop_ids and session.kept_messages == len(session.messages) == 2
        assert session.turns[0].policy_applied is None  # a first request continues nothing: rendered as sent
        # the client keeps the answer, not the reasoning, and asks again: the server finds its conversation
        messages += [{"role": "assistant", "content": first.choices[0].message.content},
                     {"role": "user", "content": FOLLOW_UP}]
        await asyncio.to_thread(api.chat.completions.create, model=server.model_name, messages=messages,
                                max_tokens=6, temperature=0)
        await wait_until(pilot, lambda: len(session.turns) == 2 and not screen.api_busy, what="turn 2")
        second = session.turns[1]
        await screen.show_session(session.id)
        line = await wait_until(pilot, lambda: len(reply_lines(screen)) == 2 and reply_lines(screen)[1],
                                what="the second reply's line")
        print(f"{policy}: held {len(held)}; turn 2: {line!r}")
        assert (second.policy_applied, second.fallback_reason) == (policy, None) and f"policy {policy}" in line
        if policy == PRESERVE:  # the stored ids, reasoning included, then the new message
            assert not second.miss and second.kept_tokens == len(held) and "less reuse" not in line
            assert second.cached_tokens >= block_aligned(len(held) - 1)
        else:
            assert second.miss and second.diverged_at < len(held) and "less reuse" in line


def test_the_reuse_line_names_the_policy_and_a_fallbacks_reason_in_a_few_words():
    plain = TurnStats(100, 96, 96, 5, finish_reason="stop", policy_applied=PRESERVE)
    assert turn_summary(plain) == "prompt 100 · cached 96 · new 4 · gen 5 · policy preserve"
    assert policy_summary(TurnStats(1, 0, 0, 1)) is None  # a turn recorded before policies says nothing
    why = "the kept ids or the messages they stand for changed since they were recorded"
    fell = TurnStats(120, 40, 41, 5, miss=True, diverged_at=41, finish_reason="stop", policy_applied=TEMPLATE,
                     fallback_reason=why)
    assert turn_summary(fell) == ("prompt 120 · cached 40 · new 80 · gen 5 · policy template (preserve fell back: "
                                  "history edited) · less reuse: history rewritten from token 41")
    unknown = "a reason no table knows, and longer than the line has room for"
    assert short_reason(unknown) == unknown[:39].rstrip() + "…" and len(short_reason(unknown)) == 40
