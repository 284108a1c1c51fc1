"""`GET /metrics` with speculative decoding on: vLLM's four spec_decode families (its names, its `position` label),
scraped over HTTP from a server whose engine core runs in its own process, against what a draft source observed.

The oracle is the same requests run on an engine in this process whose draft source is wrapped by a recorder: each
verify's (drafted, accepted) as the source itself was told them, counted here. Greedy decoding and the draft sources
are deterministic, and both engines verify every draft whole (no draft length cut by measured step times), so the
core process drafts and accepts exactly the same; its counters cross the process boundary with the rest of its stats.
"""
from __future__ import annotations

import functools
import json
import random
from collections.abc import Sequence

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers.checkpoints import make_checkpoint
from tests.helpers.metrics import scrape
from tests.server.conftest import http
from tsterm import LLM, SamplingParams
from tsterm.engine.core_process import EngineCoreProcess
from tsterm.engine.spec_decode import DraftSource
from tsterm.launch import build_engine
from tsterm.server.app import create_app
from tsterm.server.serve import BackgroundServer, build_state

K = 4
OPTIONS = {"dtype": "float32", "device": "cpu", "block_size": 4, "num_kv_blocks": 256,
           "speculative_method": "suffix", "num_speculative_tokens": K}
MAX_TOKENS = 30


def whole_drafts(engine):
    """`engine`, verifying each proposed draft whole: what it drafts is then a function of the tokens alone."""
    engine.draft_length = None  # (the cost-aware cut, where the engine has one)
    return engine


def build(model_dir: str, progress):
    """The core process's engine (this module's function: the child unpickles it by the front's sys.path)."""
    return whole_drafts(build_engine(model_dir, OPTIONS, progress))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    path, _ = make_checkpoint(tmp_path_factory.mktemp("spec-metrics") / "m", "qwen3_moe",
                              dict(num_experts=4, num_experts_per_tok=2, num_hidden_layers=2))
    return str(path)


def prompts() -> list[list[int]]:
    """Prompts that repeat themselves (drafts from the prompt, some accepted) and one that does not."""
    rng = random.Random(11)
    bases = [[rng.randrange(8, 300) for _ in range(n)] for n in (9, 13, 7)]
    return [bases[0] * 4, bases[1], bases[2] * 5]


class Recorder(DraftSource):
    """A draft source's calls passed through, each verify's (drafted, accepted) kept as the engine reported it."""

    def __init__(self, inner: DraftSource):
        super().__init__(inner.num_tokens)
        self.inner, self.name, self.verifies = inner, inner.name, []

    def propose(self, seq_id: int, token_ids: Sequence[int], max_tokens: int) -> list[int]:
        return self.inner.propose(seq_id, token_ids, max_tokens)

    def observe(self, seq_id: int, num_drafted: int, num_accepted: int) -> None:
        self.verifies.append((num_drafted, num_accepted))
        self.inner.observe(seq_id, num_drafted, num_accepted)

    def release(self, seq_id: int, token_ids: Sequence[int], num_prompt_tokens: int) -> None:
        self.inner.release(seq_id, token_ids, num_prompt_tokens)


def expected_samples(verifies: list[tuple[int, int]]) -> dict[str, float]:
    values = {"tsterm:spec_decode_num_drafts_total": len(verifies),
              "tsterm:spec_decode_num_draft_tokens_total": sum(d for d, _ in verifies),
              "tsterm:spec_decode_num_accepted_tokens_total": sum(a for _, a in verifies)}
    for position in range(K):
        values[f'tsterm:spec_decode_num_accepted_tokens_per_pos_total{{position="{position}"}}'] = sum(
            a > position for _, a in verifies)
    return values


def test_a_scrape_of_a_speculating_core_process_counts_what_the_draft_source_saw(model_dir):
    # the oracle: the same requests, one after another, in this process
    llm = LLM(model_dir, **OPTIONS)
    recorder = whole_drafts(llm.engine).drafter = Recorder(llm.engine.drafter)
    replies = [list(llm.generate(p, SamplingParams(temperature=0, max_tokens=MAX_TOKENS))[0].token_ids)
               for p in prompts()]
    verifies = recorder.verifies
    # both outcomes were counted: a verify accepting all it drafted, one rejecting its first draft token
    assert any(a == d for d, a in verifies) and any(a == 0 for _, a in verifies)
    expected = expected_samples(verifies)

    core = EngineCoreProcess(functools.partial(build, model_dir))
    server = None
    try:
        server = BackgroundServer(create_app(build_state(core, "tiny"))).start()
        status, text = http("GET", f"{server.url}/metrics")
        assert status == 200
        before = {key: value for key, value in parse(text)[0].items() if key.startswith("tsterm:spec_decode")}
        # before any request: every position below K is shown, at 0
        assert before == {key: 0 for key in expected}
        for prompt, reply in zip(prompts(), replies):
            status, body = http("POST", f"{server.url}/v1/completions",
                                {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0})
            assert status == 200, body
            assert json.loads(body)["usage"]["completion_tokens"] == len(reply)
        status, text = http("GET", f"{server.url}/metrics")
        values, types = parse(text)
        assert {key: value for key, value in values.items() if key.startswith("tsterm:spec_decode")} == expected
        assert all(types[name] == "counter" for name in ("tsterm:spec_decode_num_drafts",
                                                         "tsterm:spec_decode_num_draft_tokens",
                                                         "tsterm:spec_decode_num_accepted_tokens",
                                                         "tsterm:spec_decode_num_accepted_tokens_per_pos"))
        # the core's stats say the same, per source too (the dashboard's and run --json's view)
        stats = core.stats()
        source = stats["spec_sources"]["suffix"]
        assert (source["num_drafts"], source["draft_tokens"], source["accepted_tokens"]) == (
            len(verifies), sum(d for d, _ in verifies), sum(a for _, a in verifies))
        assert source["drafted_per_pos"] == [sum(d > i for d, _ in verifies) for i in range(K)]
        assert source["accepted_per_pos"] == stats["spec_accepted_per_pos"] == [
            sum(a > i for _, a in verifies) for i in range(K)]
    finally:
        if server is not None:
            server.stop()
        core.shutdown()


def test_no_spec_decode_metrics_without_speculation(model_dir):
    """As vLLM: the families exist only where speculation is configured."""
    llm = LLM(model_dir, **dict(OPTIONS, speculative_method="off"))
    llm.generate(prompts()[0], SamplingParams(temperature=0, max_tokens=5))
    values = scrape(llm.engine)
    assert values["tsterm:generation_tokens_total"] == 5
    assert not [key for key in values if "spec_decode" in key]
    stats = llm.stats()
    assert stats["spec_method"] == "off" and stats["spec_num_tokens"] == 0 and stats["spec_sources"] == {}


def parse(text: str) -> tuple[dict[str, float], dict[str, str]]:
    """The samples of a /metrics text (keyed `name{label="value"}`) and each family's type."""
    values, types = {}, {}
    for family in text_string_to_metric_families(text):
        types[family.name] = family.type
        for sample in family.samples:
            labels = ",".join(f'{key}="{value}"' for key, value in sorted(sample.labels.items()))
            values[sample.name + (f"{{{labels}}}" if labels else "")] = sample.value
    return values, types
