"""The prompt plan on real tokenizers: the kept ids are never re-tokenised, only the text the new messages add is
encoded; a template that changes earlier text is a miss that keeps every id before the change (DESIGN.md rule 7)."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.helpers.tokenizers import QWEN3_TEMPLATE
from tsterm.chat.plan import PromptPlan, first_divergence, plan_prompt
from tsterm.chat.session import Session, TurnStats
from tsterm.tokenizer import Tokenizer

CHAT = [{"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Un café, s'il vous plaît 🙂 — and print(add(2, 3))?"},
        {"role": "assistant", "content": "日本語: 東京。 Emoji 🚀🎉 and code:\n    return a + b"},
        {"role": "user", "content": "  spaces  and\ttabs\n\n"}]


def render(tokenizer, messages: list[dict]) -> str:
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def split_encoding(tokenizer, text: str) -> list[int]:
    """The same text as other ids: each character encoded alone, as a model may well generate it."""
    return [i for c in text for i in tokenizer.encode(c)]


def record(session: Session, plan: PromptPlan, text: str, generated: list[int]) -> None:
    session.record_reply(plan, text, generated, TurnStats(len(plan.token_ids), 0, plan.kept_tokens, len(generated),
                                                          plan.miss, plan.diverged_at))


@pytest.fixture(params=["trained", "smollm2"])
def any_tokenizer(request):
    return request.getfixturevalue("tokenizer" if request.param == "trained" else "smollm2_tokenizer")


def test_first_divergence():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 9, 3]) == 1
    assert first_divergence([1, 2], [1, 2, 3]) == 2
    assert first_divergence([1, 2, 3], [1, 2]) == 2


def test_decoding_ids_gives_back_the_rendered_text_special_tokens_included(any_tokenizer):
    """What the plan relies on: for byte-level BPE, decode(encode(text)) is the text, <|im_end|> and all."""
    text = render(any_tokenizer, CHAT)
    assert "<|im_end|>" in text and any_tokenizer.decode(any_tokenizer.encode(text), skip_special_tokens=False) == text
    im_end = any_tokenizer.token_to_id("<|im_end|>")
    generated = split_encoding(any_tokenizer, "Sure 🙂") + [im_end]
    assert any_tokenizer.decode(generated, skip_special_tokens=False) == "Sure 🙂<|im_end|>"


def test_first_turn_is_the_rendering_and_the_next_appends_only_the_new_text(any_tokenizer):
    first = plan_prompt([], render(any_tokenizer, CHAT[:2]), any_tokenizer)
    assert first == PromptPlan(any_tokenizer.encode(render(any_tokenizer, CHAT[:2])), 0)
    kept = first.token_ids + any_tokenizer.encode(CHAT[2]["content"]) + [any_tokenizer.token_to_id("<|im_end|>")]
    text = render(any_tokenizer, CHAT)
    plan = plan_prompt(kept, text, any_tokenizer)
    tail = text[len(any_tokenizer.decode(kept, skip_special_tokens=False)):]
    assert tail.startswith("\n<|im_start|>user\n")
    assert plan == PromptPlan(kept + any_tokenizer.encode(tail), len(kept))


def test_generated_ids_that_retokenise_differently_are_kept(any_tokenizer):
    """The bug this plan fixes: comparing kept ids with a fresh tokenisation of the whole history missed here."""
    tok = any_tokenizer
    session = Session(id="s")
    session.set_system_prompt(CHAT[0]["content"])
    session.add_user(CHAT[1]["content"])
    first = session.plan(lambda m: render(tok, m), tok)
    reply = CHAT[2]["content"]
    generated = split_encoding(tok, reply) + [tok.token_to_id("<|im_end|>")]
    assert generated[:-1] != tok.encode(reply)  # same text, other ids
    record(session, first, reply, generated)
    kept = list(session.token_ids)
    session.add_user(CHAT[3]["content"])
    text = render(tok, session.messages)

    plan = session.plan(lambda m: render(tok, m), tok)
    assert not plan.miss and plan.diverged_at is None and plan.kept_tokens == len(kept)
    assert plan.token_ids[:len(kept)] == kept and tok.decode(plan.token_ids, skip_special_tokens=False) == text
    old = tok.encode(text)  # what the previous plan compared the kept ids with
    assert len(first.token_ids) <= first_divergence(kept, old) < len(kept)  # it would have missed in the reply


def test_a_template_that_drops_earlier_thinking_is_a_miss_that_keeps_the_ids_before_it(qwen3_tokenizer):
    tok = qwen3_tokenizer
    im_end = tok.token_to_id("<|im_end|>")
    session = Session(id="s")
    session.set_system_prompt("be brief")
    plans = []
    for question, reasoning, answer in [("What is 2+2?", "simple arithmetic", "4"),
                                        ("And 3+3?", "the same again", "6"),
                                        ("Thanks", "", "You're welcome.")]:
        session.add_user(question)
        kept = list(session.token_ids)
        plan = session.plan(lambda m: render(tok, m), tok)
        assert tok.decode(plan.token_ids, skip_special_tokens=False) == render(tok, session.messages)
        plans.append(plan)
        if len(plans) > 1:
            # the reply before this question lost its <think> block: the text differs right after
            # "<|im_start|>assistant\n", the generation prompt that ended the previous turn's prompt
            previous = plans[-2]
            assert plan.miss and plan.diverged_at == plan.kept_tokens == len(previous.token_ids)
            assert plan.token_ids[:plan.kept_tokens] == kept[:plan.kept_tokens] == previous.token_ids
        text = f"<think>\n{reasoning}\n</think>\n\n{answer}" if reasoning else answer
        record(session, plan, text, tok.encode(text) + [im_end])
    assert session.num_misses == 2
    # a reply without reasoning renders as it was generated: the next turn keeps every id
    session.add_user("Bye")
    kept = list(session.token_ids)
    plan = session.plan(lambda m: render(tok, m), tok)
    assert not plan.miss and plan.kept_tokens == len(kept) and plan.token_ids[:len(kept)] == kept


def thinking_chat(tok, policy: str) -> tuple[Session, list[PromptPlan], list[list[int]]]:
    """Three questions answered with reasoning, each turn planned under `policy`: (session, plans, kept ids of each)."""
    im_end = tok.token_to_id("<|im_end|>")
    session = Session(id="s")
    session.set_system_prompt("be brief")
    plans, held = [], []
    for question, reasoning, answer in [("What is 2+2?", "simple arithmetic", "4"),
                                        ("And 3+3?", "the same again 🙂", "6"),
                                        ("Thanks", "nothing to compute", "You're welcome.")]:
        session.add_user(question)
        held.append(list(session.token_ids))
        plan = session.plan(lambda m: render(tok, m), tok, policy)
        plans.append(plan)
        text = f"<think>\n{reasoning}\n</think>\n\n{answer}"
        record(session, plan, text, split_encoding(tok, text) + [im_end])
    return session, plans, held


@pytest.fixture(params=["trained", "smollm2"])
def any_qwen3_tokenizer(request, tokenizer_dir):
    """Qwen3's thinking template on the trained vocabulary and on SmolLM2's."""
    if request.param == "trained":
        return request.getfixturevalue("qwen3_tokenizer")
    tok = Tokenizer.from_dir(request.getfixturevalue("default_model_dir"))
    tok.chat_templates = {"default": QWEN3_TEMPLATE}
    return tok


def test_preserve_keeps_the_earlier_thinking_and_appends_only_the_new_question(any_qwen3_tokenizer):
    """The same chat as above under `preserve`: no turn misses, each keeps every id the engine holds (the replies'
    <think> blocks included) and adds exactly the new user message and the generation prompt."""
    tok = any_qwen3_tokenizer
    session, plans, held = thinking_chat(tok, "preserve")
    for question, plan, kept in zip(["And 3+3?", "Thanks"], plans[1:], held[1:]):
        assert plan.policy_applied == "preserve" and plan.fallback_reason is None and not plan.miss
        assert plan.kept_tokens == len(kept) and plan.token_ids[:len(kept)] == kept
        assert plan.token_ids[len(kept):] == tok.encode(f"\n<|im_start|>user\n{question}<|im_end|>\n"
                                                        "<|im_start|>assistant\n")
    assert session.num_misses == 0 and session.kept_messages == len(session.messages) == 7
    # under `template` the same replies miss at every turn
    assert sum(p.miss for p in thinking_chat(tok, "template")[1]) == 2


def test_a_cut_inside_a_character_keeps_the_ids_up_to_it(tokenizer):
    """A reply cut by max_tokens in the middle of a character: its text ends in U+FFFD. If the rendering then
    shows another character there, the ids through the last whole character are kept."""
    tok = tokenizer
    prompt = tok.encode(render(tok, CHAT[:2]))
    kept = prompt + tok.encode("hi ") + byte_tokens(tok, "🙂".encode())[:3]
    assert tok.decode(kept, skip_special_tokens=False).endswith("hi \ufffd")
    same = tok.decode(kept, skip_special_tokens=False) + "<|im_end|>\n"  # the engine's own text for the cut reply
    assert plan_prompt(kept, same, tok) == PromptPlan(kept + tok.encode("<|im_end|>\n"), len(kept))

    other = tok.decode(prompt, skip_special_tokens=False) + "hi 🙃<|im_end|>\n"  # 🙃 shares 🙂's first 3 bytes
    plan = plan_prompt(kept, other, tok)
    assert tok.decode(plan.token_ids, skip_special_tokens=False) == other
    assert plan.kept_tokens >= len(prompt) + len(tok.encode("hi "))
    assert plan.token_ids[:plan.kept_tokens] == kept[:plan.kept_tokens]
    assert plan.miss == (plan.kept_tokens < len(kept))


def byte_tokens(tokenizer, data: bytes) -> list[int]:
    """One id per byte: byte-level BPE's 256 base symbols are GPT-2's printable stand-ins for the bytes."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return [tokenizer.token_to_id(chr(b) if b in printable else chr(256 + others.index(b))) for b in data]


SEGMENTS = st.one_of(st.sampled_from(["<|im_start|>", "<|im_end|>", "<think>", "\n"]),
                     st.text(alphabet="ab cé日🙂\n", min_size=1, max_size=8))


@settings(max_examples=100, deadline=None)
@given(pieces=st.lists(SEGMENTS, min_size=1, max_size=12), cut=st.integers(0, 200),
       added=st.text(alphabet="ab c🙃<>|\n", max_size=10), data=st.data())
def test_plan_invariants(tokenizer, pieces, cut, added, data):
    """Kept ids as some tokenisation of a text, rendered = a prefix of that text + anything: the prompt always
    decodes to the rendering, keeps a prefix of the kept ids, and keeps every id whose text the rendering still
    starts with."""
    tok = tokenizer
    kept, ends, length = [], [], 0  # ends[i]: length of the text of kept[:i + 1] where a piece ends, else None
    for piece in pieces:  # a piece is encoded alone, or character by character: both decode to the piece
        ids = [i for c in piece for i in tok.encode(c)] if data.draw(st.booleans()) else tok.encode(piece)
        length += len(piece)
        kept += ids
        ends += [None] * (len(ids) - 1) + [length]
    text = "".join(pieces)
    rendered = text[:cut] + added
    plan = plan_prompt(kept, rendered, tok)

    assert tok.decode(plan.token_ids, skip_special_tokens=False) == rendered
    assert plan.token_ids[:plan.kept_tokens] == kept[:plan.kept_tokens]
    assert plan.miss == (plan.kept_tokens < len(kept)) and plan.diverged_at == (plan.kept_tokens if plan.miss else None)
    if rendered.startswith(text):
        assert not plan.miss and plan.token_ids[:len(kept)] == kept
    still_kept = max((i + 1 for i, end in enumerate(ends) if end is not None and rendered.startswith(text[:end])),
                     default=0)
    assert plan.kept_tokens >= still_kept
