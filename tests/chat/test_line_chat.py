"""Line mode (`tsterm chat --plain`): slash commands are handled, never sent to the model; the reply is all that
reaches stdout; a stopped reply keeps its partial text; the chat is saved in the TUI's store with its exact ids."""
from __future__ import annotations

import io
from pathlib import Path

import pytest

from tsterm import LLM, SamplingParams
from tsterm.chat.store import SessionStore
from tsterm.chat.line_chat import LineChat

AGENT_DEMO = Path(__file__).resolve().parents[2] / "tsterm" / "models" / "agent_demo"


@pytest.fixture(scope="module")
def llm():
    llm = LLM(str(AGENT_DEMO), device="cpu")
    yield llm
    llm.engine.shutdown()


def chat(llm, text: str, store=None, **params) -> tuple[LineChat, str, str]:
    stdin, stdout, stderr = io.StringIO(text), io.StringIO(), io.StringIO()
    line = LineChat(llm, SamplingParams(temperature=0, max_tokens=12, **params), "be brief", store, stdin, stdout,
                    stderr, interactive=False)
    assert line.run() == 0
    return line, stdout.getvalue(), stderr.getvalue()


def test_commands_are_not_sent_and_the_chat_is_saved_with_its_ids(llm, tmp_path):
    store = SessionStore(tmp_path / "sessions")
    line, out, err = chat(llm, "/system you are terse\nWhat is 2 + 2?\n/help\n\n/nonsense\n//slash\n/bye\nignored\n",
                          store)
    session = line.session
    assert [m["content"] for m in session.messages if m["role"] == "user"] == ["What is 2 + 2?", "/slash"]
    assert session.system_prompt == "you are terse" and len(session.turns) == 2
    assert out.count("\n") == 2 and "/help" not in out and "commands:" not in out  # stdout: the two replies only
    assert "commands:" in err and "unknown command /nonsense" in err and "[cached " in err
    assert session.turns[1].cached_tokens > 0  # the second turn reused the first one's prefix
    [saved], errors = store.load_all()
    assert not errors and saved.id == session.id and saved.token_ids == session.token_ids
    assert saved.model == str(AGENT_DEMO.resolve())  # the TUI binds it to the same model: ids kept


def test_new_starts_another_saved_chat(llm, tmp_path):
    store = SessionStore(tmp_path / "sessions")
    line, _, err = chat(llm, "hello\n/new\nhi again\n", store)
    sessions, _ = store.load_all()
    assert len(sessions) == 2 and "(new chat)" in err
    assert [m["content"] for m in line.session.messages if m["role"] == "user"] == ["hi again"]


def test_a_stopped_reply_keeps_its_partial_text_and_the_chat_goes_on(llm, monkeypatch):
    stdin, stdout, stderr = io.StringIO("Count to fifty.\nhi\n"), io.StringIO(), io.StringIO()
    line = LineChat(llm, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), None, None, stdin, stdout,
                    stderr, interactive=False)
    step, steps = llm.engine.step, []

    def counting_step():  # ctrl+c after the 5th step (the signal handler calls stop())
        steps.append(1)
        if len(steps) == 5:
            line.stop()
        return step()

    monkeypatch.setattr(llm.engine, "step", counting_step)
    line.turn("Count to fifty.")
    first = line.session.turns[0]
    assert first.finish_reason == "abort" and 0 < first.generated_tokens < 40
    assert "(stopped)" in stderr.getvalue() and llm.engine.stats()["running"] == 0
    line.turn("hi")
    assert line.session.turns[1].finish_reason == "length" and len(line.session.turns) == 2


def test_a_reply_the_engine_fails_on_is_reported_and_the_chat_goes_on(llm, monkeypatch):
    stdin, stdout, stderr = io.StringIO(), io.StringIO(), io.StringIO()
    line = LineChat(llm, SamplingParams(temperature=0, max_tokens=8), None, None, stdin, stdout, stderr,
                    interactive=False)
    execute, fail = llm.engine.executor.execute, [True]

    def faulty(batch):  # the engine isolates the failure to this reply's request and serves on
        if fail:
            fail.pop()
            raise RuntimeError("kernel exploded")
        return execute(batch)

    monkeypatch.setattr(llm.engine.executor, "execute", faulty)
    line.turn("What is 2 + 2?")
    assert "tsterm: error: the engine failed on this reply (RuntimeError: kernel exploded)" in stderr.getvalue()
    assert not line.session.messages and not line.session.turns  # the chat is as it was
    line.turn("What is 2 + 2?")
    assert len(line.session.turns) == 1 and llm.engine.stats()["used"] == 0


@pytest.fixture(scope="module")
def smollm2(default_profile, default_model_dir):
    llm = LLM(str(default_model_dir), **default_profile.engine_options())
    yield llm
    llm.engine.shutdown()


THINKING_OFF = "<think>\n\n</think>\n\n"


@pytest.mark.parametrize("policy", ["preserve", "template"])
def test_a_generation_prompt_the_history_does_not_keep_costs_a_miss_only_under_template(smollm2, default_profile,
                                                                                        monkeypatch, policy):
    """Qwen3's template with thinking off opens every reply with an empty think block, which it does not write back
    into the history: under `template` every next turn re-renders the last reply without it (a miss there), under
    `preserve` the turn continues from every id the engine computed. SmolLM2's own template, given that prefix."""
    tok = smollm2.tokenizer
    template = tok.chat_templates["default"]
    thinking_off = template.replace("{{ '<|im_start|>assistant\n' }}{% endif %}",
                                    "{{ '<|im_start|>assistant\n" + THINKING_OFF + "' }}{% endif %}")
    assert thinking_off != template
    monkeypatch.setattr(tok, "chat_templates", {**tok.chat_templates, "default": thinking_off})
    stdin, stdout, stderr = io.StringIO("What is the capital of France?\nAnd of Italy?\n"), io.StringIO(), io.StringIO()
    params = default_profile.sampling_params(temperature=0, max_tokens=48)
    system = f"You are a helpful assistant. ({policy})"  # each case its own prefix: nothing cached by the other
    line = LineChat(smollm2, params, system, None, stdin, stdout, stderr, interactive=False, history_policy=policy)
    assert line.run() == 0
    first, second = line.session.turns
    assert first.finish_reason == "stop"  # the reply ended on the model's stop token: `preserve` can apply
    previous = first.prompt_tokens + first.generated_tokens
    assert (second.policy_applied, second.fallback_reason) == (policy, None)
    if policy == "preserve":
        assert not second.miss and second.kept_tokens == previous
        assert second.cached_tokens == previous - 1  # every id the engine computed (the last reply's stop is not)
        assert "computed again" not in stderr.getvalue()
    else:
        assert second.miss and second.diverged_at == first.prompt_tokens - len(tok.encode(THINKING_OFF))
        assert second.cached_tokens <= second.diverged_at
        assert f"differently from token {second.diverged_at} on" in stderr.getvalue()


def test_a_reply_cut_at_max_tokens_falls_back_and_a_miss_says_why(smollm2, default_profile, monkeypatch):
    """A reply cut by max_tokens does not end with the stop token: `preserve` cannot tell where the template ends it,
    the turn is the template's, and the status line of its miss says why."""
    tok = smollm2.tokenizer
    template = tok.chat_templates["default"]
    thinking_off = template.replace("{{ '<|im_start|>assistant\n' }}{% endif %}",
                                    "{{ '<|im_start|>assistant\n" + THINKING_OFF + "' }}{% endif %}")
    monkeypatch.setattr(tok, "chat_templates", {**tok.chat_templates, "default": thinking_off})
    stdin, stdout, stderr = io.StringIO("What is the capital of France?\nAnd of Italy?\n"), io.StringIO(), io.StringIO()
    line = LineChat(smollm2, default_profile.sampling_params(temperature=0, max_tokens=3), None, None, stdin, stdout,
                    stderr, interactive=False)
    assert line.run() == 0
    first, second = line.session.turns
    assert first.finish_reason == "length" and second.policy_applied == "template" and second.miss
    why = "the last reply did not end with a stop token (cut by max_tokens or a stop string)"
    assert second.fallback_reason == why and f"; preserve could not apply: {why}]" in stderr.getvalue()
