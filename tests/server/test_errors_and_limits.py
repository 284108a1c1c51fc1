"""Bad inputs get an OpenAI-style 4xx and the server keeps serving; API keys, the bind check, the body and in-flight
limits; a client that leaves mid-request frees its blocks; concurrent streams equal their solo runs."""
from __future__ import annotations

import json
import socket
import threading

import openai
import pytest

from tests.server.conftest import AGENT_DEMO, MODEL, http, wait_blocks_free
from tsterm.agent.tools import Calculator
from tsterm.cli import main
from tsterm.errors import ConfigError
from tsterm.server.serve import check_bind

GOOD = {"model": MODEL, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 3, "temperature": 0}


@pytest.mark.parametrize("body, status, fragment", [
    ('{"model": "agent-demo", "messages": [', 400, "not valid JSON"),
    ({**GOOD, "temperature": "hot"}, 400, "temperature"),
    ({**GOOD, "top_p": 5}, 400, "top_p"),
    ({**GOOD, "max_tokens": 0}, 400, "max_tokens"),
    ({**GOOD, "messages": []}, 400, "messages"),
    ({**GOOD, "messages": [{"role": "wizard", "content": "hi"}]}, 400, "role"),
    ({**GOOD, "stop": [""]}, 400, "stop strings must be non-empty"),
    ({**GOOD, "stop": [f"s{i}" for i in range(17)]}, 400, "17 stop strings; this server takes at most 16"),
    ({**GOOD, "stop": "x" * 257}, 400, "a stop string has 257 characters"),
    ({**GOOD, "model": "gpt-4"}, 404, "does not exist"),
    ({**GOOD, "n": 9}, 400, "at most 8"),
    ({**GOOD, "messages": [{"role": "user", "content": "word " * 3000}]}, 400, "context"),
    ({**GOOD, "tools": [Calculator().spec()], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     400, "not among the tools"),
    ({**GOOD, "top_logprobs": 2}, 400, "logprobs"),
])
def test_bad_chat_inputs_are_4xx_and_the_server_keeps_serving(server, body, status, fragment):
    code, text = http("POST", f"{server.url}/v1/chat/completions", body)
    error = json.loads(text)["error"]
    assert code == status and fragment in error["message"]
    assert set(error) == {"message", "type", "param", "code"}
    code, text = http("POST", f"{server.url}/v1/chat/completions", GOOD)
    assert code == 200 and json.loads(text)["choices"][0]["message"]["role"] == "assistant"


@pytest.mark.parametrize("body, fragment", [
    ({"model": MODEL, "prompt": [1, 99999]}, "outside the vocabulary"),
    ({"model": MODEL, "prompt": "hi", "echo": True}, "echo"),
    ({"model": MODEL, "prompt": ["a", "b"]}, "one prompt"),
    ({"model": MODEL, "prompt": "hi", "logprobs": 21}, "logprobs"),
])
def test_bad_completion_inputs(server, body, fragment):
    code, text = http("POST", f"{server.url}/v1/completions", body)
    assert code == 400 and fragment in json.loads(text)["error"]["message"]


def test_unknown_route_is_an_openai_style_404(server):
    code, text = http("GET", f"{server.url}/v1/nothing")
    assert code == 404 and "message" in json.loads(text)["error"]


def test_api_key(make_server):
    server = make_server(api_key="s3cret-key")
    wrong = openai.OpenAI(base_url=f"{server.url}/v1", api_key="guess", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.chat.completions.create(**GOOD)
    code, _ = http("GET", f"{server.url}/metrics")
    assert code == 401
    right = openai.OpenAI(base_url=f"{server.url}/v1", api_key="s3cret-key", max_retries=0)
    assert right.chat.completions.create(**GOOD).choices[0].message.role == "assistant"
    assert [m.id for m in right.models.list()] == [MODEL]


def test_non_loopback_bind_needs_a_key(capsys, monkeypatch):
    monkeypatch.delenv("TSTERM_API_KEY", raising=False)
    assert main(["serve", "--model", str(AGENT_DEMO), "--host", "0.0.0.0", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "API key" in err and "0.0.0.0" in err
    with pytest.raises(ConfigError):
        check_bind("192.168.1.5", None)
    check_bind("127.0.0.1", None)
    check_bind("::1", None)
    check_bind("0.0.0.0", "a-key")


def test_a_busy_port_is_one_error_line_before_the_model_loads(capsys, monkeypatch):
    """The README's exit codes hold: 1, not uvicorn's own 3, and the model is not loaded for nothing."""
    monkeypatch.setattr("tsterm.launch.llm_from_args", lambda *a, **k: pytest.fail("a busy port must not load"))
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["serve", "--profile", "agent-demo", "--port", str(port), "--device", "cpu"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"tsterm: error: cannot listen on 127.0.0.1:{port}: ") and err.count("\n") == 1, err
    assert "in use" in err and "--port" in err


def test_body_size_limit(make_server):
    server = make_server(max_body_bytes=2000)
    code, text = http("POST", f"{server.url}/v1/chat/completions",
                      {**GOOD, "messages": [{"role": "user", "content": "x" * 5000}]})
    assert code == 413 and json.loads(text)["error"]["message"]
    assert http("POST", f"{server.url}/v1/chat/completions", GOOD)[0] == 200
    code, text = http("POST", f"{server.url}/v1/messages", {"model": "agent-demo", "max_tokens": 4,
                                                          "messages": [{"role": "user", "content": "x" * 5000}]})
    assert code == 413 and json.loads(text) == {"type": "error", "error": {
        "type": "request_too_large", "message": "the request body has 5087 bytes; this server takes at most 2000"}}
    # counted under the route the body was sent to (no route is matched before a body is refused by its length)
    for endpoint in ("/v1/chat/completions", "/v1/messages"):
        assert _metric(server, "tsterm:server_requests", endpoint=endpoint, status="413") == 1
    assert _metric(server, "tsterm:server_requests", endpoint="unmatched") == 0


def _long_stream(client, **extra):
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Tell me a story"}],
                                          max_tokens=800, temperature=0, stream=True,
                                          extra_body={"ignore_eos": True}, **extra)


def test_in_flight_limit_is_a_429(make_server, aengine):
    server = make_server(max_queued_requests=1)
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
    stream = _long_stream(client)
    next(iter(stream))
    with pytest.raises(openai.RateLimitError) as err:
        client.chat.completions.create(**GOOD)
    assert "limit of 1 requests in flight" in err.value.body["message"]
    stream.close()
    server.served.wait("/v1/chat/completions", 2)  # the refused one, and the stream: its place given back
    assert http("POST", f"{server.url}/v1/chat/completions", GOOD)[0] == 200
    assert wait_blocks_free(aengine)["used"] == 0


def _aborted(llm) -> int:
    return llm.engine.metrics.requests_finished.get("abort", 0)


def test_disconnect_mid_stream_frees_the_blocks(client, llm, aengine):
    before = _aborted(llm)
    stream = _long_stream(client)
    chunks = iter(stream)
    for _ in range(5):
        next(chunks)
    assert aengine.stats()["used"] > 0
    stream.close()
    assert wait_blocks_free(aengine)["used"] == 0
    assert _aborted(llm) == before + 1


class FirstOutput:
    """A server observer that is told of each output: `seen` is set once a request is generating in the engine."""

    def __init__(self):
        self.seen = threading.Event()

    def started(self, info):
        pass

    def progress(self, info, output):
        self.seen.set()

    def finished(self, info, output, error):
        pass


def test_disconnect_while_waiting_for_a_whole_completion(make_server, llm, aengine):
    server, before = make_server(), _aborted(llm)
    server.state.observer = watch = FirstOutput()
    body = json.dumps({**GOOD, "max_tokens": 800, "ignore_eos": True}).encode()
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        watch.seen.wait()  # hang up once it is generating
    assert wait_blocks_free(aengine)["used"] == 0
    assert _aborted(llm) == before + 1


def test_concurrent_greedy_streams_equal_their_solo_runs(client, aengine):
    prompts = [f"Question {i}: what is {i} + {i}?" for i in range(8)]

    def run(prompt: str) -> str:
        stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                                max_tokens=24, temperature=0, stream=True)
        return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

    solo = [run(p) for p in prompts]
    results: dict[int, str] = {}
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, run(prompts[i]))) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [results.get(i) for i in range(8)] == solo
    assert wait_blocks_free(aengine)["used"] == 0


def test_a_chunked_body_past_the_limit_is_a_413(make_server):
    server = make_server(max_body_bytes=2000)
    body = json.dumps({**GOOD, "messages": [{"role": "user", "content": "x" * 5000}]}).encode()

    def chunks():
        for i in range(0, len(body), 1000):
            yield body[i:i + 1000]

    import urllib.error
    import urllib.request
    request = urllib.request.Request(f"{server.url}/v1/chat/completions", data=chunks(), method="POST",
                                     headers={"Content-Type": "application/json", "Transfer-Encoding": "chunked"})
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(request, timeout=30)
    assert err.value.code == 413 and "limit" in json.loads(err.value.read())["error"]["message"]
    assert _metric(server, "tsterm:server_requests", endpoint="/v1/chat/completions", status="413") == 1


def _metric(server, name: str, **labels) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for family in text_string_to_metric_families(http("GET", f"{server.url}/metrics")[1]):
        for sample in family.samples:
            if sample.name in (name, f"{name}_total") and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


def test_mixed_load_with_a_third_disconnecting(make_server, llm, aengine):
    server = make_server()
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=60)
    aborted_before = _aborted(llm)
    outcomes: list[str] = []

    def worker(w: int) -> None:
        for i in range(3):
            if (w * 3 + i) % 3 == 0:  # leave mid-stream
                stream = _long_stream(client)
                chunks = iter(stream)
                next(chunks), next(chunks)
                stream.close()
                outcomes.append("left")
            else:
                stream = client.chat.completions.create(model=MODEL, max_tokens=8, temperature=0, stream=True,
                                                        messages=[{"role": "user", "content": f"Say {w} {i}"}])
                chunks = list(stream)
                outcomes.append("done" if chunks[-1].choices[0].finish_reason else "broken")

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(outcomes) == ["done"] * 16 + ["left"] * 8
    assert wait_blocks_free(aengine)["used"] == 0
    assert _aborted(llm) == aborted_before + 8
    expected = {("tsterm:server_client_disconnects", ()): 8, ("tsterm:server_requests_in_flight", ()): 0,
                ("tsterm:server_requests", (("endpoint", "/v1/chat/completions"),)): 24}
    server.served.wait("/v1/chat/completions", 24)  # a response's bookkeeping ends just after its request's abort
    assert {key: _metric(server, key[0], **dict(key[1])) for key in expected} == expected
    assert http("POST", f"{server.url}/v1/chat/completions", GOOD)[0] == 200


def test_required_tool_choice_in_a_stream_ends_with_an_error_event(client):
    with pytest.raises(openai.APIError, match="tool_choice required"):
        list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello"}],
                                            tools=[Calculator().spec()], tool_choice="required", temperature=0,
                                            max_tokens=4, stream=True))


def test_a_bug_is_a_500_in_the_api_shape_and_the_server_serves_on(make_server, llm, monkeypatch):
    server = make_server()

    def broken(*args, **kwargs):
        raise RuntimeError("template engine exploded")

    with monkeypatch.context() as patch:
        patch.setattr(llm.tokenizer, "apply_chat_template", broken)
        code, text = http("POST", f"{server.url}/v1/chat/completions", GOOD)
        assert code == 500 and json.loads(text)["error"]["message"] == (
            "internal server error (RuntimeError): template engine exploded")
        code, text = http("POST", f"{server.url}/v1/messages", {"model": "agent-demo", "max_tokens": 4,
                                                              "messages": [{"role": "user", "content": "hi"}]})
        assert code == 500 and json.loads(text)["type"] == "error"
    assert http("POST", f"{server.url}/v1/chat/completions", GOOD)[0] == 200


def test_a_failed_engine_step_is_a_500_and_a_stream_error_event_not_a_disconnect(make_server, llm, aengine,
                                                                               monkeypatch):
    server = make_server()
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
    step, fail = llm.engine.step, []

    def failing_step():
        if fail:
            fail.pop()
            raise RuntimeError("device lost")
        return step()

    monkeypatch.setattr(llm.engine, "step", failing_step)
    fail.append(1)
    code, text = http("POST", f"{server.url}/v1/chat/completions", GOOD)
    assert code == 500 and json.loads(text)["error"]["code"] == "engine_error"
    assert "RuntimeError: device lost" in json.loads(text)["error"]["message"]
    fail.append(1)
    with pytest.raises(openai.APIError, match="device lost"):
        list(client.chat.completions.create(**GOOD, stream=True))
    assert _metric(server, "tsterm:server_client_disconnects") == 0
    assert wait_blocks_free(aengine)["used"] == 0
    assert http("POST", f"{server.url}/v1/chat/completions", GOOD)[0] == 200
