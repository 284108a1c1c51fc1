"""The history policy on each reasoning family's template (tests/helpers/reasoning_templates.py): an agent session
(user, a reply with reasoning and tool calls, tool results, a reply with reasoning and the answer, a follow-up user
message). Under `preserve` every turn keeps all the kept ids and adds exactly the new messages' text; under `template`
the plan is the template's own (plan.py), a miss where the template dropped the loop's first reasoning."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest

from tests.helpers.reasoning_templates import FAMILIES, Family, family_tokenizer
from tsterm.chat.history import (HISTORY_END, PRESERVE, TEMPLATE, Fallback, new_messages_text, plan_turn,
                                 strip_reasoning)
from tsterm.chat.plan import PromptPlan, plan_prompt
from tsterm.chat.session import Session, TurnStats
from tsterm.chat.store import SessionStore

TASK = "What is the weather in Paris and in Tokyo?"
FOLLOW_UP = "Thanks. And 7*8?"
CALLS = [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Tokyo"})]
RESULTS = ['{"sky": "sunny", "celsius": 21}', '{"sky": "rain", "celsius": 17}']

# The text each template renders for the new messages after the kept ids (which end with the model's stop token),
# written out by hand from the family's format: what `preserve` must append, token for token.
TOOL_RESULTS_TEXT = {
    "qwen3": "\n<|im_start|>user" + "".join(f"\n<tool_response>\n{r}\n</tool_response>" for r in RESULTS)
             + "<|im_end|>\n<|im_start|>assistant\n",
    "deepseek-r1": "<｜tool▁outputs▁begin｜>" + "".join(f"<｜tool▁output▁begin｜>{r}<｜tool▁output▁end｜>" for r in RESULTS)
                   + "<｜tool▁outputs▁end｜><｜Assistant｜><think>\n",
    "glm-4.5": "".join(f"\n<tool_response>\n{r}\n</tool_response>" for r in RESULTS) + "<|assistant|>",
    "minimax-m2": "\n]~b]tool" + "".join(f"\n<response>{r}</response>" for r in RESULTS) + "[e~[\n]~b]ai\n<think>\n",
}
TOOL_RESULTS_TEXT["qwen3-raw"] = TOOL_RESULTS_TEXT["qwen3"]
HARMONY_RESULT = ("<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>{}<|end|>"
                  "<|start|>assistant")
FOLLOW_UP_TEXT = {
    "qwen3": f"\n<|im_start|>user\n{FOLLOW_UP}<|im_end|>\n<|im_start|>assistant\n",
    "qwen3-raw": f"\n<|im_start|>user\n{FOLLOW_UP}<|im_end|>\n<|im_start|>assistant\n",
    "deepseek-r1": f"<｜User｜>{FOLLOW_UP}<｜Assistant｜><think>\n",
    "glm-4.5": f"\n{FOLLOW_UP}<|assistant|>",  # the kept ids end with <|user|>, the stop GLM writes after an answer
    # the kept ids end with <|return|>: history holds that as <|end|>, so the prompt has <|end|> in its place
    "gpt-oss": f"<|end|><|start|>user<|message|>{FOLLOW_UP}<|end|><|start|>assistant",
    "minimax-m2": f"\n]~b]user\n{FOLLOW_UP}[e~[\n]~b]ai\n<think>\n",
}
# Under `template`, a prompt differs from the kept ids this many ids after the start of the first reply whose
# reasoning the template dropped (the end of that reply's prompt): where its rendering stops matching.
TEMPLATE_DIVERGES = {
    "qwen3": 0, "qwen3-raw": 0,  # "<think>" was the reply's first id; the rendering has the content there
    "deepseek-r1": -2,  # inside the generation prompt: its "<think>\n" is not in a rendered reply
    "glm-4.5": 2,  # "\n<think>" is rendered too (empty), the reasoning is not
    "gpt-oss": 1,  # "<|channel|>" starts the tool call too; "analysis" is gone
    "minimax-m2": -2,  # the generation prompt's "<think>\n" is not in a rendered reply
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request) -> tuple[Family, object]:
    fam = FAMILIES[request.param]
    return fam, family_tokenizer(fam)


def renderer(tok, **kwargs):
    return lambda messages: tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kwargs)


def steps(fam: Family) -> list[tuple[str, str, list]]:
    """The agent's replies: (reasoning, content, calls). Harmony calls one tool per message (<|call|> stops it)."""
    calls = [CALLS] if fam.calls_per_message > 1 else [[c] for c in CALLS]
    return [(f"I need the weather of {len(c)} city: call the tool.", "", c) for c in calls] + \
        [("Both results are in; compare them.", "Paris is sunny (21 C), Tokyo rainy (17 C).", [])]


def run(fam: Family, tok, policy: str, render=None, generated_of=None, held=None) -> tuple[Session, list[PromptPlan]]:
    """The agent session up to the follow-up question (not yet planned). Each step is planned under `policy`, its
    reply is what the family's model generates (its ids through the stop token), tool messages answer its calls.
    `held` collects the kept ids each step was planned from."""
    render = render or renderer(tok)
    session = Session(id=f"{fam.name}-{policy}", kind="agent")
    session.set_system_prompt("You are a careful agent.")
    session.add_user(TASK)
    plans, results = [], iter(RESULTS)
    for reasoning, content, calls in steps(fam):
        if held is not None:
            held.append(list(session.token_ids))
        plan = session.plan(render, tok, policy)
        plans.append(plan)
        message, text = fam.reply(reasoning, content, calls)
        generated = tok.encode(text) if generated_of is None else generated_of(tok, text)
        session.record_reply(plan, "", generated, TurnStats.from_plan(plan, 0, len(generated)), message=message)
        for name, _ in calls:
            session.messages.append({"role": "tool", "content": next(results), "name": name,
                                     "tool_call_id": f"call_{len(session.messages)}"})
    session.add_user(FOLLOW_UP)
    return session, plans


def test_preserve_keeps_every_kept_id_and_adds_exactly_the_new_messages(family):
    fam, tok = family
    render = renderer(tok)
    held = []
    session, plans = run(fam, tok, PRESERVE, held=held)
    # every step of the tool loop: the previous step's ids (its prompt and reply), then exactly the tool results' text
    for i, plan in enumerate(plans[1:], 1):
        assert plan.policy_applied == PRESERVE and plan.fallback_reason is None and not plan.miss
        assert plan.kept_tokens == len(held[i]) > len(plans[i - 1].token_ids)
        assert plan.token_ids[:plan.kept_tokens] == held[i]
        expected = TOOL_RESULTS_TEXT.get(fam.name) or HARMONY_RESULT.format(RESULTS[i - 1])
        assert plan.token_ids[plan.kept_tokens:] == tok.encode(expected)
    kept = list(session.token_ids)
    plan = session.plan(render, tok, PRESERVE)
    assert plan.policy_applied == PRESERVE and plan.fallback_reason is None and not plan.miss
    assert plan.diverged_at is None
    if fam.name == "gpt-oss":  # every id but the stop: the final answer's <|return|> is history as <|end|>
        assert tok.decode(kept[-1:], skip_special_tokens=False) == "<|return|>" in HISTORY_END
        assert plan.kept_tokens == len(kept) - 1
    else:
        assert plan.kept_tokens == len(kept)  # 100%: the loop's reasoning stays where the engine computed it
    assert plan.token_ids[:plan.kept_tokens] == kept[:plan.kept_tokens]
    assert plan.token_ids[plan.kept_tokens:] == tok.encode(FOLLOW_UP_TEXT[fam.name])


def test_template_is_the_templates_own_rendering_with_a_miss_at_the_loops_first_reasoning(family):
    fam, tok = family
    render = renderer(tok)
    session, plans = run(fam, tok, TEMPLATE)
    for plan in plans:
        assert plan.policy_applied == TEMPLATE and plan.fallback_reason is None
    offset = TEMPLATE_DIVERGES[fam.name]
    r1 = fam.name == "deepseek-r1"
    # within the loop, only DeepSeek-R1 drops the reasoning of the replies before (every earlier reply): each step
    # computes the previous reply again
    assert [p.miss for p in plans[1:]] == [r1] * (len(plans) - 1)
    if r1:
        assert [p.diverged_at for p in plans[1:]] == [len(p.token_ids) + offset for p in plans[:-1]]
    kept = list(session.token_ids)
    plan = session.plan(render, tok, TEMPLATE)
    assert plan == replace(plan_prompt(kept, render(session.messages), tok), context=plan.context)  # today's plan
    assert tok.decode(plan.token_ids, skip_special_tokens=False) == render(session.messages)
    # the first reply that still holds its reasoning: the loop's first, or for R1 the last (the others were re-rendered)
    first = plans[-1 if r1 else 0]
    assert plan.miss and plan.diverged_at == plan.kept_tokens == len(first.token_ids) + offset
    if not r1:
        assert plan.kept_tokens < 0.5 * len(kept)  # the whole loop is computed again
    same = session.plan(render, tok, PRESERVE)
    assert same.kept_tokens >= len(kept) - 1 > plan.kept_tokens  # what `preserve` keeps of the same session


def test_glm_keeps_every_reasoning_when_clear_thinking_is_false():
    """GLM's own switch: with clear_thinking=false the template renders the history as the model made it, so the
    template's plan keeps everything too (and `preserve` gives the same ids)."""
    fam = FAMILIES["glm-4.5"]
    tok = family_tokenizer(fam)
    render = renderer(tok, clear_thinking=False)
    session, _ = run(fam, tok, TEMPLATE, render)
    template, preserve = session.plan(render, tok, TEMPLATE), session.plan(render, tok, PRESERVE)
    assert not template.miss and template.kept_tokens == len(session.token_ids)
    assert preserve.token_ids == template.token_ids and preserve.policy_applied == PRESERVE


def test_several_tool_calls_in_one_reply_from_raw_text_and_from_structured_calls():
    """tsterm's agent keeps the raw reply (tags in the content); an API client sends structured tool_calls: the same
    ids either way."""
    plans = {}
    for name in ("qwen3", "qwen3-raw"):
        fam = FAMILIES[name]
        tok = family_tokenizer(fam)
        session, _ = run(fam, tok, PRESERVE)
        plans[name] = session.plan(renderer(tok), tok, PRESERVE).token_ids
        reply = session.messages[2]
        assert (reply["content"].count("<tool_call>"), len(reply.get("tool_calls", []))) == \
            ((2, 0) if name == "qwen3-raw" else (0, 2))
    assert plans["qwen3"] == plans["qwen3-raw"]


def cut(tok, text: str) -> list[int]:
    """A reply cut by max_tokens: its ids stop before the stop token."""
    return tok.encode(text)[:-3]


def test_a_reply_cut_at_max_tokens_falls_back_to_the_template_and_says_why(family):
    fam, tok = family
    render = renderer(tok)
    session, _ = run(fam, tok, PRESERVE, generated_of=lambda t, text: cut(t, text))
    plan = session.plan(render, tok, PRESERVE)
    assert plan.policy_applied == TEMPLATE
    assert plan.fallback_reason == "the last reply did not end with a stop token (cut by max_tokens or a stop string)"
    assert plan == replace(plan_prompt(session.token_ids, render(session.messages), tok),
                           fallback_reason=plan.fallback_reason, context=plan.context)


def test_changed_history_or_unknown_coverage_falls_back(tokenizer_for_qwen3, tmp_path):
    fam, tok = tokenizer_for_qwen3
    render = renderer(tok)
    session, _ = run(fam, tok, PRESERVE)
    assert session.kept_intact() and session.kept_messages == len(session.messages) - 1

    store = SessionStore(tmp_path)  # the coverage is saved with the session
    store.save(session)
    (loaded,), errors = store.load_all()
    assert errors == [] and loaded == session and loaded.plan(render, tok, PRESERVE).fallback_reason is None

    edited = session.fork("edited")
    edited.messages[1] = {"role": "user", "content": "What is the weather in Rome?"}  # a covered message changed
    plan = edited.plan(render, tok, PRESERVE)
    assert plan.policy_applied == TEMPLATE and plan.miss
    assert plan.fallback_reason == "the kept ids or the messages they stand for changed since they were recorded"
    assert tok.decode(plan.token_ids, skip_special_tokens=False) == render(edited.messages)

    old = Session.from_dict({k: v for k, v in session.to_dict().items() if k not in ("kept_messages", "kept_digest")})
    plan = old.plan(render, tok, PRESERVE)  # a version 1 file: the ids' messages are unknown
    assert plan.fallback_reason == "the session does not know which messages its kept ids stand for"
    assert plan.policy_applied == TEMPLATE and plan.miss  # the template's own plan; its reply is tracked again

    system = session.fork("system")
    system.set_system_prompt("You are terse.")
    assert system.plan(render, tok, PRESERVE).fallback_reason.startswith("the kept ids or the messages")

    # the agent's tool list changed: the kept ids hold the old one, so the turn renders the new one (a miss there)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    def with_tools(messages):
        return tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True)

    plan = session.plan(with_tools, tok, PRESERVE)
    assert plan.policy_applied == TEMPLATE and plan.miss and plan.fallback_reason == (
        "the template renders another context (tools, system block) than the kept ids were made with")
    assert tok.decode(plan.token_ids, skip_special_tokens=False) == with_tools(session.messages)
    # a switch that changes only the generation prompt is no change of context
    switched = lambda messages: render(messages) + "<think>\n\n</think>\n\n"  # noqa: E731
    plan = session.plan(switched, tok, PRESERVE)
    assert plan.policy_applied == PRESERVE and plan.token_ids[plan.kept_tokens:] == tok.encode(
        FOLLOW_UP_TEXT["qwen3"] + "<think>\n\n</think>\n\n")


@pytest.fixture(scope="module")
def tokenizer_for_qwen3():
    return FAMILIES["qwen3"], family_tokenizer(FAMILIES["qwen3"])


def test_fork_keeps_the_coverage_of_its_ids(tokenizer_for_qwen3):
    fam, tok = tokenizer_for_qwen3
    session, _ = run(fam, tok, PRESERVE)
    whole = session.fork("whole")
    assert whole.kept_messages == session.kept_messages and whole.kept_intact()
    first = session.fork("first", 3)  # through the first reply (system, user, reply)
    assert first.kept_messages == 3 and first.kept_intact()
    assert first.token_ids == session.token_ids[:len(first.token_ids)]
    first.add_user("Never mind.")
    plan = first.plan(renderer(tok), tok, PRESERVE)
    assert plan.policy_applied == PRESERVE and plan.kept_tokens == len(first.token_ids)


def test_the_end_marker_must_come_before_the_first_new_message():
    """A template that does not end a reply with the stop token's text: the first one after the reply is inside the
    new user message, and taking the text after it would lose that message. The boundary check refuses."""
    fam = FAMILIES["qwen3"]
    tok = family_tokenizer(fam)
    template = fam.template.replace("{{- '<|im_end|>\\n' }}\n    {%- elif m.role == 'tool' %}",
                                    "{{- '\\n' }}\n    {%- elif m.role == 'tool' %}")
    assert template != fam.template
    tok.chat_templates = {"default": template}
    render = renderer(tok)
    messages = [{"role": "user", "content": TASK}, {"role": "assistant", "content": "Sunny."},
                {"role": "user", "content": FOLLOW_UP}]
    kept = tok.encode(render(messages[:1])) + tok.encode("Sunny.<|im_end|>")
    with pytest.raises(Fallback, match="comes after the first new message's content"):
        new_messages_text(kept, messages[:2], messages[2:], render, tok, tok.eos_token_ids)
    plan = plan_turn(kept, messages, render, tok, PRESERVE, covered=2)
    assert plan.policy_applied == TEMPLATE and plan.fallback_reason.endswith("the first new message's content")


def test_strip_reasoning():
    message = {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nanswer", "reasoning_content": "hmm",
               "thinking": "hmm", "tool_calls": []}
    assert strip_reasoning(message) == {"role": "assistant", "content": "answer", "tool_calls": []}
    assert strip_reasoning({"role": "user", "content": "a </think> b"}) == {"role": "user", "content": "a </think> b"}
    assert message["reasoning_content"] == "hmm"  # not changed in place


def test_unknown_policy_is_refused_with_the_choices(tokenizer_for_qwen3):
    _, tok = tokenizer_for_qwen3
    with pytest.raises(ValueError, match="preserve, template.*'keep'"):
        Session(id="s").plan(renderer(tok), tok, "keep")


def test_turn_stats_from_a_plan_carry_the_policy():
    plan = PromptPlan([1, 2, 3], 2, policy_applied=TEMPLATE, fallback_reason="why")
    stats = TurnStats.from_plan(plan, 1, 4, ttft=0.5, finish_reason="stop")
    assert stats == TurnStats(3, 1, 2, 4, False, None, 0.5, finish_reason="stop", policy_applied=TEMPLATE,
                              fallback_reason="why")
    assert json.loads(json.dumps(Session(id="s", turns=[stats]).to_dict()))["turns"][0]["fallback_reason"] == "why"
