"""The server tells an observer (the workstation) about every generation request: what was asked (messages or
prompt text, the prompt ids), each output as it streams, and how it ended, including a client that left."""
from __future__ import annotations

import threading

import openai
import pytest

from tsterm.server.app import create_app
from tsterm.server.serve import BackgroundServer, build_state
from tests.server.conftest import MODEL, wait_blocks_free


class Recorder:
    def __init__(self):
        self.events: list[tuple] = []
        self.lock = threading.Lock()
        self.ended = threading.Event()

    def started(self, info):
        with self.lock:
            self.events.append(("started", info))

    def progress(self, info, output):
        with self.lock:
            self.events.append(("progress", info.request_id, output.outputs[0].text))

    def finished(self, info, output, error):
        with self.lock:
            self.events.append(("finished", info.request_id, output, error))
        self.ended.set()

    def of(self, kind):
        with self.lock:
            return [e for e in self.events if e[0] == kind]


@pytest.fixture
def observed(llm, aengine):
    recorder = Recorder()
    state = build_state(aengine, MODEL)
    state.observer = recorder
    server = BackgroundServer(create_app(state)).start()
    yield server, recorder
    server.stop()


def test_observer_sees_each_request_from_start_to_end(observed, llm):
    server, recorder = observed
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 6*7?"}]
    reply = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=24)
    (started,) = recorder.of("started")
    info = started[1]
    assert info.api == "chat.completions" and info.n == 1
    assert [m["content"] for m in info.messages] == ["You are terse.", "What is 6*7?"]
    assert info.prompt_ids == llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    (finished,) = recorder.of("finished")
    assert finished[1] == info.request_id == reply.id and finished[3] is None
    assert finished[2].finished and finished[2].outputs[0].text == reply.choices[0].message.content
    progress = recorder.of("progress")
    assert progress and progress[-1][2] == reply.choices[0].message.content  # cumulative text, last = the reply

    stream = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=0,
                                       stream=True)
    text = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
    info = recorder.of("started")[-1][1]
    assert info.api == "completions" and info.prompt == "Once upon a time" and info.messages is None
    assert recorder.of("finished")[-1][2].outputs[0].text == text


def test_observer_is_told_when_a_client_leaves(observed, aengine):
    server, recorder = observed
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Count."}],
                                            max_tokens=400, temperature=0, stream=True,
                                            extra_body={"ignore_eos": True})
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.close()
    recorder.ended.wait()  # the server notices the hang-up and ends the request
    (finished,) = recorder.of("finished")
    assert finished[3] is not None and "client left" in finished[3]
    assert finished[2] is None or not finished[2].finished
    assert wait_blocks_free(aengine)["used"] == 0
