"""Who may call the server (tsterm/server/security.py): CORS for the configured origins only, the Host allow-list
(DNS rebinding), and cache isolation between clients (`cache_salt`, `server.cache_isolation: per_key`), driven with
the official clients where they expose the behaviour (raw httpx for preflights and Host names).
"""
from __future__ import annotations

import uuid

import anthropic
import httpx
import openai
import pytest

from tsterm.errors import ConfigError
from tsterm.server.app import create_app
from tsterm.server.state import ServerLimits, ServerState

from tests.server.conftest import MODEL

ORIGIN = "http://localhost:5173"
SDK_HEADERS = "authorization, content-type, x-stainless-os, x-stainless-retry-count, openai-beta"
ANTHROPIC_HEADERS = "x-api-key, anthropic-version, anthropic-dangerous-direct-browser-access, content-type"


def preflight(server, origin: str, path: str = "/v1/chat/completions", headers: str = SDK_HEADERS) -> httpx.Response:
    return httpx.options(f"{server.url}{path}", timeout=60, headers={
        "Origin": origin, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": headers})


def cors_headers(response: httpx.Response) -> dict[str, str]:
    return {k: v for k, v in response.headers.items() if k.lower().startswith("access-control-")}


def openai_client(server, key: str = "unused", **headers: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0, timeout=60, default_headers=headers)


def anthropic_client(server, key: str = "unused", **headers: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=key, max_retries=0, timeout=60, default_headers=headers)


# ---- CORS --------------------------------------------------------------------------------------------------------


def test_a_preflight_from_an_allowed_origin_gets_the_cors_headers(make_server):
    server = make_server(cors_origins=(ORIGIN,))
    response = preflight(server, ORIGIN)
    assert response.status_code == 200
    headers = cors_headers(response)
    assert headers["access-control-allow-origin"] == ORIGIN
    assert {"GET", "POST", "DELETE", "OPTIONS"} <= set(headers["access-control-allow-methods"].split(", "))
    allowed = set(headers["access-control-allow-headers"].lower().split(", "))
    assert {h.strip() for h in SDK_HEADERS.split(",")} <= allowed
    anthropic_preflight = preflight(server, ORIGIN, "/v1/messages", ANTHROPIC_HEADERS)
    assert anthropic_preflight.status_code == 200
    assert cors_headers(anthropic_preflight)["access-control-allow-origin"] == ORIGIN
    # the answer itself carries the origin too, or the page could not read it
    raw = openai_client(server, Origin=ORIGIN).chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=1)
    assert raw.headers["access-control-allow-origin"] == ORIGIN
    assert raw.parse().choices[0].message is not None


def test_another_origin_gets_no_cors_headers(make_server):
    server = make_server(cors_origins=(ORIGIN,))
    response = preflight(server, "http://attacker.example")
    assert response.status_code == 405 and not cors_headers(response)
    raw = openai_client(server, Origin="http://attacker.example").models.with_raw_response.list()
    assert not cors_headers(raw.http_response)


def test_no_origins_no_cors(server):
    response = preflight(server, ORIGIN)
    assert response.status_code == 405 and not cors_headers(response)


def state(llm, aengine, api_key: str | None = None, **limits) -> ServerState:
    return ServerState(engine=aengine, tokenizer=llm.tokenizer, model_name=MODEL, max_model_len=512, api_key=api_key,
                       limits=ServerLimits(**limits))


def test_any_origin_only_with_an_api_key(llm, aengine, make_server):
    with pytest.raises(ConfigError, match=r'server.cors_origins has "\*".*API key'):
        create_app(state(llm, aengine, cors_origins=("*",)))
    with pytest.raises(ConfigError, match="server.cors_origins: 'http://app.example/' is not an origin"):
        create_app(state(llm, aengine, "k", cors_origins=("http://app.example/",)))
    with pytest.raises(ConfigError, match="server.allowed_hosts: 'http://box.lan' is not a host name"):
        create_app(state(llm, aengine, allowed_hosts=("http://box.lan",)))
    server = make_server(api_key="k", cors_origins=("*",))
    response = preflight(server, "http://anywhere.example")
    assert response.status_code == 200 and cors_headers(response)["access-control-allow-origin"] == "*"


# ---- Host --------------------------------------------------------------------------------------------------------


def test_a_foreign_host_is_a_400_in_each_apis_shape(server):
    with pytest.raises(openai.BadRequestError) as caught:
        openai_client(server, Host="attacker.example:8000").models.list()
    assert "Host header 'attacker.example:8000' is not allowed" in caught.value.message
    assert "server.allowed_hosts" in caught.value.message
    assert caught.value.code == "host_not_allowed"
    with pytest.raises(anthropic.BadRequestError) as caught:
        anthropic_client(server, Host="attacker.example").messages.create(
            model=MODEL, max_tokens=1, messages=[{"role": "user", "content": "hi"}])
    assert caught.value.body["type"] == "error"
    assert caught.value.body["error"]["type"] == "invalid_request_error"
    assert "Host header 'attacker.example' is not allowed" in caught.value.body["error"]["message"]
    assert httpx.get(f"{server.url}/health", headers={"Host": "attacker.example"}).status_code == 400


@pytest.mark.parametrize("host", ["localhost", "localhost:9", "LOCALHOST.:80", "127.0.0.1", "127.8.9.10:8080",
                                  "[::1]:8000", "[::1]", "::1"])
def test_loopback_names_pass_with_any_port(server, host):
    assert httpx.get(f"{server.url}/health", headers={"Host": host}).status_code == 200


def test_allowed_hosts_and_the_bound_host_pass(make_server):
    server = make_server(allowed_hosts=("tsterm.lan",), bound_host="192.168.7.7")
    for host in ("tsterm.lan", "tsterm.lan:8000", "192.168.7.7:8000"):
        assert httpx.get(f"{server.url}/health", headers={"Host": host}).status_code == 200, host
    assert httpx.get(f"{server.url}/health", headers={"Host": "other.lan"}).status_code == 400
    everywhere = make_server(bound_host="0.0.0.0")
    assert httpx.get(f"{everywhere.url}/health", headers={"Host": "box.lan:8000"}).status_code == 400
    assert httpx.get(f"{everywhere.url}/health", headers={"Host": "0.0.0.0:8000"}).status_code == 200
    any_name = make_server(bound_host="0.0.0.0", allowed_hosts=("*",))
    assert httpx.get(f"{any_name.url}/health", headers={"Host": "box.lan:8000"}).status_code == 200


# ---- cache isolation ---------------------------------------------------------------------------------------------


def unique_messages() -> list[dict]:
    """A prompt no other prompt shares a block with: its own words from its first block on."""
    words = " ".join(uuid.uuid4().hex for _ in range(12))
    return [{"role": "user", "content": f"{words}: say the first of these words"}]


def cached(client: openai.OpenAI, messages: list[dict], stream: bool = False, **extra) -> int:
    """The prompt's cached tokens, as the official client reads them from `usage`."""
    if stream:
        chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1, stream=True,
                                                     stream_options={"include_usage": True}, extra_body=extra))
        usage = chunks[-1].usage
    else:
        usage = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1, extra_body=extra).usage
    return usage.prompt_tokens_details.cached_tokens


def test_per_key_isolation_shares_blocks_within_a_key_only(make_server):
    """Two servers with their own API keys on one engine (as `tsterm serve` and the TUI's would be on one host)."""
    first_key, second_key = f"a-{uuid.uuid4().hex}", f"b-{uuid.uuid4().hex}"
    first = openai_client(make_server(api_key=first_key, cache_isolation="per_key"), first_key)
    second = openai_client(make_server(api_key=second_key, cache_isolation="per_key"), second_key)
    messages = unique_messages()
    assert cached(first, messages) == 0
    assert cached(second, messages) == 0  # the same prompt: nothing of the other key's
    assert cached(first, messages) > 0  # its own key's blocks
    streamed = unique_messages()
    assert cached(second, streamed, stream=True) == 0
    assert cached(second, streamed) > 0  # the streamed request was salted with its key too
    assert cached(first, streamed, stream=True) == 0


def test_per_key_on_a_keyless_server_keeps_clients_off_the_unsalted_cache(server, make_server):
    """Keyless, every client shares one salt: they reuse each other's blocks, never the local user's (unsalted)."""
    messages = unique_messages()
    plain = openai_client(server)
    cached(plain, messages)
    assert cached(plain, messages) > 0
    isolated = openai_client(make_server(cache_isolation="per_key"))
    assert cached(isolated, messages) == 0
    assert cached(isolated, messages) > 0


def test_a_requests_own_cache_salt(server):
    client = openai_client(server)
    messages = unique_messages()
    salt = uuid.uuid4().hex
    assert cached(client, messages, cache_salt=salt) == 0
    assert cached(client, messages, cache_salt=f"other-{salt}") == 0
    assert cached(client, messages, cache_salt=salt) > 0
    text = f"{' '.join(uuid.uuid4().hex for _ in range(12))}: repeat after me"
    completions = [client.completions.create(model=MODEL, prompt=text, max_tokens=1, extra_body={"cache_salt": s})
                   for s in (salt, "x" + salt, salt)]
    assert [c.usage.prompt_tokens_details.cached_tokens > 0 for c in completions] == [False, False, True]
    messages = unique_messages()
    claude = anthropic_client(server)
    usages = [claude.messages.create(model=MODEL, max_tokens=1, messages=messages, extra_body={"cache_salt": s}).usage
              for s in (salt, "x" + salt, salt)]
    assert [(u.cache_read_input_tokens or 0) > 0 for u in usages] == [False, False, True]
    text = f"{' '.join(uuid.uuid4().hex for _ in range(12))}: repeat after me"
    responses = [client.responses.create(model=MODEL, input=text, max_output_tokens=1, store=False,
                                         extra_body={"cache_salt": s}) for s in (salt, "x" + salt, salt)]
    assert [r.usage.input_tokens_details.cached_tokens > 0 for r in responses] == [False, False, True]


@pytest.mark.parametrize("salt", ["", 7])
def test_a_cache_salt_that_is_not_a_non_empty_string_is_a_400(server, salt):
    with pytest.raises(openai.BadRequestError) as caught:
        openai_client(server).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                      max_tokens=1, extra_body={"cache_salt": salt})
    assert "cache_salt" in caught.value.message
