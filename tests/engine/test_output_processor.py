"""The output processor: stop strings, deltas and snapshots, and work per step that does not grow with the context.

Work is counted, not timed: ids handed to the tokenizer's decode, characters handed to the stop-string search, and
bytes allocated (tracemalloc: any copy of the context, of the text or of the id list shows up as an allocation).
"""
from __future__ import annotations

import statistics
import tracemalloc

import pytest

from tsterm import LLM, SamplingParams
from tsterm.convert.demo import SPECS, make_random_moe
from tsterm.engine import output_processor
from tsterm.engine.output_processor import SampleOutput
from tsterm.engine.sequence import Sequence, SequenceStatus
from tsterm.tokenizer import Tokenizer

from tests.helpers.tokenizers import make_tokenizer_dir

TEXT = ("Un café? 日本語のテキスト 🙂👍🚀 naïve Ελληνικά. The quick brown fox jumps over the lazy dog while "
        "the cat watches from the window. Tokens per second and memory bandwidth are the numbers that matter.\n")
NEVER = ["<<never seen>>", "\u2603\u2603"]  # stop strings that do not occur: the stream runs on, searched each step


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return Tokenizer.from_dir(make_tokenizer_dir(tmp_path_factory.mktemp("tok")))


def stream_ids(tokenizer, n: int) -> list[int]:
    ids = tokenizer.encode(TEXT)
    return [ids[i % len(ids)] for i in range(n)]


class Generation:
    """Drives one SampleOutput the way the engine does: append the id (and its logprob), detokenise, stream."""

    def __init__(self, tokenizer, prompt_ids: list[int], params: SamplingParams):
        self.seq = Sequence(prompt_ids, params)
        self.out = SampleOutput(tokenizer, prompt_ids, params.stop)

    def step(self, token_id: int):
        self.seq.token_ids.append(token_id)
        self.seq.logprobs.append({"token_id": token_id, "logprob": -1.0, "top": []})
        if self.out.add(token_id) is not None:
            self.finish("stop")
        return self.out.output(0, self.seq)

    def finish(self, reason: str) -> None:
        self.seq.status, self.seq.finish_reason = SequenceStatus.FINISHED, reason
        self.out.flush()


class WorkCounter:
    """Per step: ids decoded, characters searched for stop strings, peak bytes allocated."""

    def __init__(self, tokenizer, monkeypatch):
        self.decoded = self.searched = 0
        decode, find_stop = tokenizer.decode, output_processor.find_stop

        def counting_decode(ids, **kwargs):
            self.decoded += len(ids)
            return decode(ids, **kwargs)

        def counting_find_stop(text, stops, start):
            self.searched += len(text)
            return find_stop(text, stops, start)

        monkeypatch.setattr(tokenizer, "decode", counting_decode)
        monkeypatch.setattr(output_processor, "find_stop", counting_find_stop)

    def measure(self, gen: Generation, token_ids: list[int]) -> dict[str, list[int]]:
        work: dict[str, list[int]] = {"decoded": [], "searched": [], "allocated": []}
        tracemalloc.start()
        try:
            for token_id in token_ids:
                self.decoded = self.searched = 0
                tracemalloc.reset_peak()
                before = tracemalloc.get_traced_memory()[0]
                gen.step(token_id)
                work["allocated"].append(tracemalloc.get_traced_memory()[1] - before)
                work["decoded"].append(self.decoded)
                work["searched"].append(self.searched)
        finally:
            tracemalloc.stop()
        return work


def run_to(tokenizer, prompt_len: int, output_len: int) -> Generation:
    gen = Generation(tokenizer, stream_ids(tokenizer, prompt_len),
                     SamplingParams(stop=NEVER, logprobs=1, max_tokens=1_000_000))
    for token_id in stream_ids(tokenizer, output_len):
        gen.step(token_id)
    return gen


def test_work_per_step_does_not_grow_with_context_or_output(tokenizer, monkeypatch):
    counter = WorkCounter(tokenizer, monkeypatch)
    period = len(tokenizer.encode(TEXT))
    measured = stream_ids(tokenizer, period * 3)[:64]  # the same ids, at the same phase of the text, in both runs
    short = counter.measure(run_to(tokenizer, 8, period), measured)
    long_gen = run_to(tokenizer, 100_000, period * 400)
    kept = long_gen.step(measured[0])  # a snapshot taken now and read only after more steps
    long = counter.measure(long_gen, measured[1:])
    short = {k: v[1:] for k, v in short.items()}
    print(f"\nper step, median (max) at {8 + period} vs {100_000 + period * 401} tokens of context:")
    for kind in short:
        print(f"  {kind:9s} {statistics.median(short[kind]):7.0f} ({max(short[kind]):6d})"
              f"   {statistics.median(long[kind]):7.0f} ({max(long[kind]):6d})")
    assert long["decoded"] == short["decoded"] and max(long["decoded"]) <= 16
    assert long["searched"] == short["searched"]
    # a copy of the output ids alone would be 400 * period * 8 bytes per step; allow a few small objects
    assert statistics.median(long["allocated"]) <= statistics.median(short["allocated"]) + 512
    # the snapshot still reads as of its own step, though 63 tokens were appended since
    ids = long_gen.seq.token_ids
    n = period * 400 + 1
    assert kept.token_ids == ids[100_000:100_000 + n] and len(kept.logprobs) == n
    assert kept.text == tokenizer.decode(ids[100_000:100_000 + n])[:len(kept.text)]
    assert len(kept.text) >= len(tokenizer.decode(ids[100_000:100_000 + n])) - 2 * max(map(len, NEVER))


@pytest.mark.parametrize("stop_at", [0, 5, 37, 80])
def test_stop_string_cuts_the_text_and_deltas_add_up(tokenizer, stop_at):
    ids = tokenizer.encode(TEXT)
    full = tokenizer.decode(ids)
    stop = full[stop_at:stop_at + 7]  # starts and ends anywhere: spans the text of several tokens
    gen = Generation(tokenizer, [5, 6, 7], SamplingParams(stop=["unseen stop", stop], max_tokens=len(ids)))
    outputs = []
    for token_id in ids:
        outputs.append(gen.step(token_id))
        if gen.seq.is_finished:
            break
    final = outputs[-1]
    assert final.finish_reason == "stop" and final.stop_reason == stop
    assert final.text == full[:full.index(stop)]
    streamed = ""
    for out in outputs:
        streamed += out.delta_text
        assert out.text == streamed  # each snapshot is exactly what was streamed up to it
        assert stop not in out.text
    assert [t for out in outputs for t in out.delta_token_ids] == final.token_ids == gen.seq.token_ids[3:]


def test_text_is_released_whole_characters_at_a_time_and_flush_completes_it(tokenizer):
    ids = tokenizer.encode(TEXT)
    gen = Generation(tokenizer, [5], SamplingParams(max_tokens=len(ids)))
    outputs = [gen.step(token_id) for token_id in ids[:-1]]
    gen.seq.token_ids.append(ids[-1])
    gen.out.add(ids[-1])
    gen.finish("length")
    outputs.append(gen.out.output(0, gen.seq))
    assert not any("\ufffd" in out.delta_text for out in outputs)
    assert "".join(out.delta_text for out in outputs) == outputs[-1].text == tokenizer.decode(ids)
    assert outputs[-1].stop_reason is None and outputs[-1].logprobs is None


# ---- the engine: a decode step's postprocess allocates the same at 16 and at 3000 tokens of context ----------------

@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_random_moe(tmp_path_factory.mktemp("demo") / "tiny", SPECS["tiny"])


def postprocess_allocations(llm: LLM, prompt_len: int, monkeypatch) -> list[int]:
    engine, allocated, before = llm.engine, [], []
    sample, postprocess = engine._sample, engine._postprocess

    def sampling(*args):  # a step's postprocess begins with its sampling (right after the forward)
        tracemalloc.reset_peak()
        before.append(tracemalloc.get_traced_memory()[0])
        return sample(*args)

    def measured(*args):
        outputs = postprocess(*args)
        allocated.append(tracemalloc.get_traced_memory()[1] - before[-1])
        return outputs

    monkeypatch.setattr(engine, "_sample", sampling)
    monkeypatch.setattr(engine, "_postprocess", measured)
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=1, max_tokens=12, ignore_eos=True, stop=NEVER)
    tracemalloc.start()
    try:
        out = llm.generate([10 + i % 1000 for i in range(prompt_len)], params)[0]
    finally:
        tracemalloc.stop()
    assert len(out.token_ids) == 12
    return allocated[-10:]  # decode steps only


def test_engine_postprocess_allocates_independently_of_context(tiny_dir, monkeypatch):
    llm = LLM(str(tiny_dir), dtype="float32", device="cpu", block_size=16, num_kv_blocks=256)
    short = postprocess_allocations(llm, 16, monkeypatch)
    long = postprocess_allocations(llm, 3000, monkeypatch)
    print(f"\npostprocess bytes per decode step: {short} at 16 tokens, {long} at 3000")
    # slicing the 3000 prompt ids for the sampler alone would allocate 24 KB per step
    assert statistics.median(long) <= statistics.median(short) + 2048
