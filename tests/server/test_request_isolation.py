"""Over HTTP, a request can only hurt itself: every out-of-range field is a 400 naming it (OpenAI's and Anthropic's
error shapes) before anything is queued; a request the engine fails on is a 500 (or an error event) for that client
only, while a request sharing its steps finishes exactly as it does alone; a client that leaves in the middle of an
n = 2 fork frees every block; and the next requests are served as usual."""
from __future__ import annotations

import json

import openai
import pytest

from tests.server.conftest import MODEL, http, wait_blocks_free

MARKER = "ZQX"  # a prompt holding this text makes the injected fault raise
HELLO = [{"role": "user", "content": "Hello"}]


def chat(client, **overrides):
    return client.chat.completions.create(**{**dict(model=MODEL, messages=HELLO, max_tokens=4, temperature=0),
                                             **overrides})


def served_normally(client, aengine) -> None:
    out = chat(client, max_tokens=3)
    assert out.choices[0].finish_reason in ("stop", "length")
    stats = wait_blocks_free(aengine)
    assert stats["used"] == 0 and stats["running"] == 0


# ---- admission: a 400 naming the field, nothing queued ----------------------------------------------------------

@pytest.mark.parametrize("overrides, param, fragment", [
    (dict(seed=2**64, n=2, temperature=0.8), "seed", "[0, 2**64 - 1]"),
    (dict(seed=-1), "seed", "[0, 2**64 - 1]"),
    (dict(extra_body={"top_k": -5}), None, "top_k"),
    (dict(extra_body={"min_p": 1.5}), None, "min_p"),
    (dict(extra_body={"repetition_penalty": 0}), None, "repetition_penalty"),
    (dict(stop=["", "x"]), "stop", "non-empty"),
    (dict(max_tokens=5000), "max_tokens", "max_tokens must be in [1, "),
    (dict(max_completion_tokens=5000), "max_completion_tokens", "max_completion_tokens must be in [1, "),
    (dict(temperature=1e-9), "temperature", "0 (greedy) or in [1e-06"),
], ids=lambda value: str(value)[:40])
def test_an_out_of_range_field_is_a_400_naming_it_and_the_next_request_is_served(client, aengine, overrides, param,
                                                                                 fragment):
    before = aengine.stats()["prefix_query_tokens"]
    with pytest.raises(openai.BadRequestError) as info:
        chat(client, **overrides)
    assert info.value.status_code == 400 and fragment in info.value.body["message"]
    if param is not None:
        assert info.value.body["param"] == param
    assert aengine.stats()["prefix_query_tokens"] == before  # nothing of it reached the engine's queue
    served_normally(client, aengine)


def test_the_largest_seed_with_two_samples_is_served(client, aengine):
    """The request that used to stop the engine thread (a child sample's seed past 2**64 - 1)."""
    out = chat(client, seed=2**64 - 1, n=2, temperature=0.8, max_tokens=5)
    assert [c.index for c in out.choices] == [0, 1]
    chunks = list(chat(client, seed=2**64 - 1, n=2, temperature=0.8, max_tokens=5, stream=True))
    assert {c.choices[0].index for c in chunks if c.choices} == {0, 1}
    served_normally(client, aengine)


def test_completion_and_anthropic_fields_out_of_range_are_400s_in_their_shapes(server, aengine):
    code, text = http("POST", f"{server.url}/v1/completions", {"model": MODEL, "prompt": [5, 6], "seed": 2**70})
    assert code == 400 and json.loads(text)["error"]["param"] == "seed"
    code, text = http("POST", f"{server.url}/v1/completions", {"model": MODEL, "prompt": [5] * 10, "max_tokens": 1015})
    error = json.loads(text)["error"]
    assert code == 400 and error["code"] == "context_length_exceeded" and "must be in [1, 1014]" in error["message"]
    body = {"model": MODEL, "max_tokens": 5000, "messages": HELLO}
    code, text = http("POST", f"{server.url}/v1/messages", body)
    reply = json.loads(text)
    assert code == 400 and reply["type"] == "error" and reply["error"]["type"] == "invalid_request_error"
    assert "max_tokens must be in [1, " in reply["error"]["message"]
    code, text = http("POST", f"{server.url}/v1/messages", {**body, "max_tokens": 4, "temperature": float("1e-9")})
    assert code == 400 and "temperature" in json.loads(text)["error"]["message"]
    assert wait_blocks_free(aengine)["used"] == 0


# ---- a request the engine fails on ------------------------------------------------------------------------------

class Fault:
    armed = False  # hold a request one token from its end until a marked one has arrived
    arrived: list  # the marked requests the engine has seen


@pytest.fixture
def faulty_engine(llm, monkeypatch) -> Fault:
    """The executor raises on any step that computes a request whose prompt holds MARKER. Once armed, a running
    request one token from its end is held (the engine thread sleeps until its next command) until such a request
    has arrived, so that the two share the step that fails."""
    engine = llm.engine
    marker = set(engine.tokenizer.encode(MARKER, add_special_tokens=False)) - set(
        engine.tokenizer.apply_chat_template(HELLO, add_generation_prompt=True, tokenize=True))
    assert marker, f"{MARKER!r} has no token of its own"
    marked = lambda seq: bool(marker & set(seq.prompt_token_ids))  # noqa: E731
    execute, has_unfinished, fault = engine.executor.execute, engine.has_unfinished, Fault()
    fault.arrived = arrived = []

    def faulty(batch):
        if any(marked(seq) for seq in batch.seqs):
            raise RuntimeError("kernel exploded on the marked prompt")
        return execute(batch)

    def held_until_the_marked_one_arrives():
        arrived.extend(r for r in engine.requests.values() if marked(r.samples[0].seq))
        near_end = any(s.seq.num_output_tokens == s.seq.params.max_tokens - 1 for r in engine.requests.values()
                       for s in r.live if not s.seq.is_finished)
        return has_unfinished() and (bool(arrived) or not near_end or not fault.armed)

    monkeypatch.setattr(engine.executor, "execute", faulty)
    monkeypatch.setattr(engine, "has_unfinished", held_until_the_marked_one_arrives)
    return fault


def test_a_request_the_engine_fails_on_is_a_500_and_its_neighbour_finishes_as_alone(client, server, aengine,
                                                                                     faulty_engine):
    long = dict(max_tokens=24, extra_body={"ignore_eos": True})
    alone = chat(client, **long).choices[0].message.content
    faulty_engine.armed = True
    stream = chat(client, stream=True, **long)
    pieces = [next(iter(stream)).choices[0].delta.content or ""]  # it runs: now send the one that fails
    marked = [{"role": "user", "content": f"Hello {MARKER}"}]
    code, text = http("POST", f"{server.url}/v1/chat/completions",
                      {"model": MODEL, "messages": marked, "max_tokens": 4, "temperature": 0})
    error = json.loads(text)["error"]
    assert code == 500 and error["code"] == "engine_error" and "kernel exploded on the marked prompt" in error["message"]
    pieces += [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert faulty_engine.arrived and "".join(pieces) == alone  # it shared the failed step, and was not disturbed
    code, text = http("POST", f"{server.url}/v1/messages",
                      {"model": MODEL, "max_tokens": 4, "messages": marked, "stream": True})
    assert code == 200 and "event: error" in text and "kernel exploded" in text and '"api_error"' in text
    assert chat(client, **long).choices[0].message.content == alone
    served_normally(client, aengine)


def test_a_client_that_leaves_in_the_middle_of_a_fork_frees_every_block(client, llm, aengine):
    params = dict(n=2, temperature=0.9, seed=3, max_tokens=400, stream=True, extra_body={"ignore_eos": True})
    alone = [c.message.content for c in chat(client, **{**params, "stream": False, "max_tokens": 6}).choices]
    chunks = chat(client, **params)
    seen = set()
    for chunk in chunks:  # both samples are streaming: the fork has happened
        seen.update(c.index for c in chunk.choices if c.delta.content)
        if seen == {0, 1}:
            break
    chunks.close()
    stats = wait_blocks_free(aengine)
    assert stats["used"] == 0 and not llm.engine.requests
    again = chat(client, **{**params, "stream": False, "max_tokens": 6})
    assert [c.message.content for c in again.choices] == alone
    served_normally(client, aengine)
