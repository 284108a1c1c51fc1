"""Session bookkeeping without Textual: exact token-id reuse, miss detection, persistence, corrupt files."""
from __future__ import annotations

import json

import pytest

from tsterm.chat.plan import PromptPlan, first_divergence
from tsterm.chat.session import FORMAT_VERSION, Session, TurnStats
from tsterm.chat.store import SessionStore, default_data_dir


class Planner:
    """`session.plan(...)` as the TUI calls it: the chat template renders text, the tokenizer encodes what is new."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def render(self, messages: list[dict]) -> str:
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

    def ids(self, messages: list[dict]) -> list[int]:
        return self.tokenizer.encode(self.render(messages))

    def __call__(self, session: Session) -> PromptPlan:
        return session.plan(self.render, self.tokenizer)


def stats(plan: PromptPlan, generated: int) -> TurnStats:
    return TurnStats(len(plan.token_ids), 0, plan.kept_tokens, generated, plan.miss, plan.diverged_at)


def test_second_turn_prompt_is_previous_prompt_plus_generated_plus_tail(tokenizer):
    plan_of = Planner(tokenizer)
    im_end = tokenizer.token_to_id("<|im_end|>")
    session = Session(id="s")
    session.set_system_prompt("be brief")
    session.add_user("What is the weather in Paris today?")
    first = plan_of(session)
    assert not first.miss and first.kept_tokens == 0
    reply = "It is sunny, with a light breeze."
    generated = tokenizer.encode(reply) + [im_end]  # what an engine that stopped at EOS hands back
    session.record_reply(first, reply, generated, stats(first, len(generated)))
    assert session.token_ids == first.token_ids + generated

    session.add_user("And tomorrow?")
    second = plan_of(session)
    assert not second.miss
    assert second.kept_tokens == len(first.token_ids) + len(generated)
    assert second.token_ids[:second.kept_tokens] == first.token_ids + generated
    assert second.token_ids == plan_of.ids(session.messages)


def test_history_rewrite_is_a_miss_with_the_first_divergent_position(tokenizer):
    plan_of = Planner(tokenizer)
    session = Session(id="s")
    session.add_user("hello")
    first = plan_of(session)
    session.record_reply(first, "hi", tokenizer.encode("hi") + [tokenizer.token_to_id("<|im_end|>")],
                         stats(first, 2))
    kept = list(session.token_ids)
    session.set_system_prompt("you are terse")  # changes the start of the conversation
    session.add_user("again")
    plan = plan_of(session)
    assert plan.miss and plan.kept_tokens == plan.diverged_at == 1  # "<|im_start|>" still starts the conversation
    assert plan.diverged_at == first_divergence(kept, plan_of.ids(session.messages))
    assert plan.token_ids == plan_of.ids(session.messages)  # the rest is the rendering's own tokens


def test_fork_keeps_a_prefix_of_the_parent_ids():
    parent = Session(id="p", title="t", messages=[{"role": "user", "content": "a"}], token_ids=[1, 2, 3], model="m")
    child = parent.fork("c")
    assert child.token_ids == parent.token_ids and child.parent_id == "p" and child.model == "m"
    child.messages.append({"role": "user", "content": "b"})
    assert len(parent.messages) == 1  # a deep enough copy


def three_turns(tokenizer) -> Session:
    """A session with three real (tokenised, template-rendered) turns whose kept ids are all hits."""
    plan_of = Planner(tokenizer)
    im_end = tokenizer.token_to_id("<|im_end|>")
    session = Session(id="p", title="t", model="m")
    session.set_system_prompt("be brief")
    for question, answer in [("one?", "first."), ("two?", "second."), ("three?", "third.")]:
        session.add_user(question)
        plan = plan_of(session)
        generated = tokenizer.encode(answer) + [im_end]
        session.record_reply(plan, answer, generated, stats(plan, len(generated)))
    assert not session.num_misses
    return session


def test_fork_from_an_earlier_message_keeps_the_exact_ids_of_that_prefix(tokenizer):
    plan_of = Planner(tokenizer)
    parent = three_turns(tokenizer)
    assert [parent.number_of(i) for i in range(len(parent.messages))] == [None, 1, 2, 3, 4, 5, 6]
    assert parent.index_of(4) == 4 and parent.messages[4] == {"role": "assistant", "content": "second."}
    with pytest.raises(ValueError, match=r"no message #7 .*#1-#6"):
        parent.index_of(7)

    child = parent.fork("c", parent.index_of(4))  # after the second reply
    second = parent.turns[1]
    assert child.messages == parent.messages[:5] and child.parent_id == "p" and child.model == "m"
    assert child.token_ids == parent.token_ids[:second.prompt_tokens + second.generated_tokens]
    assert child.turns == parent.turns[:2] and child.turns[0] is not parent.turns[0]
    child.add_user("a different third?")
    plan = plan_of(child)  # the branch's next prompt starts with the parent's ids: its KV blocks are shared
    assert not plan.miss and plan.kept_tokens == len(child.token_ids)
    assert plan.token_ids[:plan.kept_tokens] == parent.token_ids[:plan.kept_tokens]

    at_question = parent.fork("q", parent.index_of(3))  # a user message: ids through the reply before it
    assert at_question.messages == parent.messages[:4] and at_question.turns == parent.turns[:1]
    first = parent.turns[0]
    assert at_question.token_ids == parent.token_ids[:first.prompt_tokens + first.generated_tokens]
    assert parent.fork("s", 0).token_ids == [] and parent.fork("s", 0).messages == parent.messages[:1]
    with pytest.raises(ValueError):
        parent.fork("x", len(parent.messages))


def test_fork_after_a_rerendered_history_lets_the_next_turn_render_it(tokenizer):
    parent = three_turns(tokenizer)
    parent.turns[2].kept_tokens = 0  # as if turn 3 had been a template miss: ids before it were re-rendered
    assert parent.fork("c", parent.index_of(4)).token_ids == []
    assert parent.fork("c", parent.index_of(6)).token_ids == parent.token_ids  # the whole session: as it is
    parent.token_ids = []  # dropped (another model)
    assert parent.ids_through_reply(1) == []


def test_reply_stats_align_with_the_latest_replies():
    """A session forked by an older tsterm has its parent's replies but only its own turns."""
    turn = TurnStats(30, 20, 25, 5)
    old_fork = Session(id="f", messages=[{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                                         {"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}],
                       token_ids=list(range(35)), turns=[turn])
    assert old_fork.reply_stats() == [None, turn]
    assert old_fork.ids_through_reply(1) == [] and old_fork.ids_through_reply(2) == list(range(35))
    assert old_fork.fork("g", 1).turns == [] and old_fork.fork("g", 3).turns == [turn]


def test_bind_model_drops_ids_from_another_model():
    s = Session(id="s", token_ids=[1, 2], model="a")
    assert not s.bind_model("a") and s.token_ids == [1, 2]
    assert s.bind_model("b") and s.token_ids == [] and s.model == "b"


def test_clear_keeps_the_system_prompt():
    s = Session(id="s", token_ids=[1])
    s.set_system_prompt("sys")
    s.add_user("x")
    s.clear()
    assert s.messages == [{"role": "system", "content": "sys"}] and s.token_ids == [] and s.turns == []


def test_store_round_trip_is_exact(tmp_path):
    store = SessionStore(tmp_path)
    s = Session(id="abc", title="t", messages=[{"role": "user", "content": "héllo"}], token_ids=[0, 5, 70000],
                turns=[TurnStats(10, 4, 0, 3, True, 7, 0.1, 0.01, "stop")], parent_id="p", model="m")
    store.save(s)
    assert [p.name for p in tmp_path.iterdir()] == ["abc.json"]  # no temporary file left behind
    loaded, errors = store.load_all()
    assert errors == [] and loaded == [s]


def test_a_file_written_by_the_tui_sessions_module_still_loads(tmp_path):
    """Sessions saved before the chat layer moved out of the TUI (same format, version 1) load unchanged."""
    (tmp_path / "old.json").write_text(json.dumps({
        "id": "old", "title": "hello", "messages": [{"role": "user", "content": "hello"},
                                                    {"role": "assistant", "content": "hi"}],
        "token_ids": [0, 5, 6, 1], "turns": [{"prompt_tokens": 3, "cached_tokens": 0, "kept_tokens": 0,
                                               "generated_tokens": 1, "miss": False, "diverged_at": None, "ttft": 0.2,
                                               "mean_itl": None, "finish_reason": "stop"}],
        "parent_id": None, "model": "/models/m", "created": 1.0, "updated": 2.0, "version": 1}))
    (loaded,), errors = SessionStore(tmp_path).load_all()
    assert errors == [] and loaded.token_ids == [0, 5, 6, 1] and loaded.turns == [TurnStats(3, 0, 0, 1, ttft=0.2,
                                                                                          finish_reason="stop")]
    assert loaded.to_dict()["version"] == FORMAT_VERSION == 2 and loaded.model == "/models/m"
    assert loaded.kind == "chat"  # files from before session kinds are chats
    assert loaded.kept_messages == 0 and not loaded.kept_intact()  # version 1 did not say which messages the ids are


def test_an_agent_session_keeps_its_kind_tool_messages_and_forks_as_an_agent(tmp_path):
    store = SessionStore(tmp_path)
    s = Session(id="ag", title="new agent", kind="agent")
    s.add_user("what is 6 * 7?")
    s.messages += [{"role": "assistant", "content": "<tool_call>\n{}\n</tool_call>"},
                   {"role": "tool", "content": "42", "name": "calculator", "tool_call_id": "call_1_0"}]
    assert s.title == "what is 6 * 7?"  # the first task names an agent session as a message names a chat
    store.save(s)
    (loaded,), errors = store.load_all()
    assert errors == [] and loaded == s and loaded.kind == "agent"
    assert loaded.fork("child").kind == "agent"


def test_corrupt_files_are_reported_and_moved_aside(tmp_path):
    store = SessionStore(tmp_path)
    store.save(Session(id="good"))
    (tmp_path / "broken.json").write_text('{"id": "broken", "messages": [')
    (tmp_path / "wrong.json").write_text(json.dumps({"id": "wrong", "token_ids": ["x"]}))
    (tmp_path / "binary.json").write_bytes(b"\xff\xfe\x00")
    loaded, errors = store.load_all()
    assert [s.id for s in loaded] == ["good"]
    assert len(errors) == 3
    assert any("broken.json" in e and "not valid JSON" in e and "line 1" in e for e in errors)
    assert any("wrong.json" in e and "token_ids" in e for e in errors)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "binary.json.corrupt", "broken.json.corrupt", "good.json", "wrong.json.corrupt"]
    (tmp_path / "broken.json").write_text("nope")  # broken again: a second quarantine does not clobber the first
    _, errors = store.load_all()
    assert len(errors) == 1 and len(list(tmp_path.glob("broken.json*.corrupt"))) == 2


def test_data_dir_from_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("TSTERM_DATA_DIR", str(tmp_path / "d"))
    assert default_data_dir() == tmp_path / "d" / "sessions"
    monkeypatch.delenv("TSTERM_DATA_DIR")
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "x"))
    assert default_data_dir() == tmp_path / "x" / "tsterm" / "sessions"


def test_continued_by_finds_an_api_conversation_by_its_last_prompt():
    """An API client sends its whole history every turn: a prompt that starts with the session's last prompt and
    goes on is its next turn; the same prompt again (a retry), a shorter one or another history is not."""
    session = Session(id="api", kind="api")
    assert session.continued_by([1, 2, 3]) == 0  # no turn yet: nothing to continue
    session.token_ids = [1, 2, 3, 4, 9, 9]  # prompt [1, 2, 3, 4] + its reply [9, 9]
    session.turns.append(TurnStats(prompt_tokens=4, cached_tokens=0, kept_tokens=0, generated_tokens=2))
    assert session.continued_by([1, 2, 3, 4, 9, 9, 5]) == 4
    assert session.continued_by([1, 2, 3, 4, 8, 5]) == 4  # the client re-rendered the reply: still this conversation
    assert session.continued_by([1, 2, 3, 4]) == 0  # the same prompt again
    assert session.continued_by([1, 2, 3]) == 0
    assert session.continued_by([1, 2, 7, 4, 9, 9, 5]) == 0  # another history


def test_drop_oldest_and_carry_over_keep_the_system_prompt_and_whole_exchanges():
    session = Session(id="s", title="long")
    session.set_system_prompt("sys")
    for i in range(3):
        session.add_user(f"q{i}")
        session.messages.append({"role": "assistant", "content": f"a{i}"})
    session.messages.insert(4, {"role": "tool", "content": "t1"})  # an exchange can hold more than two messages
    session.token_ids = [1, 2, 3]
    assert session.exchanges() == [(1, 3), (3, 6), (6, 8)]
    child = session.carry_over("c", 1)
    assert [m["content"] for m in child.messages] == ["sys", "q2", "a2"]
    assert child.parent_id == "s" and child.title == "long (continued)" and child.token_ids == []
    assert [m["content"] for m in session.carry_over("d", 0).messages] == ["sys"]
    assert session.drop_oldest(2) == 5 and [m["content"] for m in session.messages] == ["sys", "q2", "a2"]
    assert session.token_ids == []  # the conversation starts differently now: rendered afresh
    with pytest.raises(ValueError, match="cannot drop 2"):
        session.drop_oldest(2)
