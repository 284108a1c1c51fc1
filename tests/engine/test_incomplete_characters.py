"""A reply cut inside a multi-byte character (byte-level BPE splits characters across tokens): streamed text holds the
character back until it is whole, and a reply that ends inside one (max_tokens) drops its bytes instead of ending in
U+FFFD. Checked on the output processor with the byte-level test tokenizer, and on a real engine (agent-demo on the
CPU, whose vocabulary writes a CJK character as three byte tokens) forced by a grammar to write such characters."""
from __future__ import annotations

from pathlib import Path

import pytest

from tsterm import LLM, SamplingParams
from tsterm.config import StructuredOutputs
from tsterm.engine.output_processor import SampleOutput
from tsterm.engine.sequence import Sequence, SequenceStatus
from tsterm.tokenizer import Tokenizer

from tests.helpers.tokenizers import make_tokenizer_dir

AGENT_DEMO = Path(__file__).resolve().parents[2] / "tsterm" / "models" / "agent_demo"
TEXT = "Un café? 日本語のテキスト 🙂👍🚀 naïve Ελληνικά"
FORCED = "日本語🙂"  # three characters of three bytes and one of four, each one byte token per byte in agent-demo


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return Tokenizer.from_dir(make_tokenizer_dir(tmp_path_factory.mktemp("tok")))


def whole(text: str) -> str:
    """What a cut reply's text must be: the decoded ids up to their last whole character."""
    return text.rstrip("\ufffd")


def test_the_output_processor_drops_an_incomplete_last_character(tokenizer):
    ids = tokenizer.encode(TEXT)
    cuts = [n for n in range(1, len(ids) + 1) if tokenizer.decode(ids[:n]).endswith("\ufffd")]
    assert len(cuts) > 5  # the test tokenizer does split characters across tokens
    for n in [*cuts, len(ids)]:
        seq = Sequence([1, 2, 3], SamplingParams(max_tokens=n))
        out = SampleOutput(tokenizer, [1, 2, 3])
        deltas = []
        for i, token_id in enumerate(ids[:n]):
            seq.token_ids.append(token_id)
            out.add(token_id)
            if i == n - 1:  # cut by max_tokens after this id
                seq.status, seq.finish_reason = SequenceStatus.FINISHED, "length"
                out.flush()
            deltas.append(out.output(0, seq))
        texts = [o.delta_text for o in deltas]
        assert not any("\ufffd" in t for t in texts), (n, texts)
        final = deltas[-1]
        assert str(final.text) == "".join(texts) == whole(tokenizer.decode(ids[:n])), n
        assert len(final.token_ids) == n  # the ids are all there; only their text stops at a whole character


@pytest.fixture(scope="module")
def llm():
    llm = LLM(str(AGENT_DEMO), device="cpu")
    yield llm
    llm.engine.shutdown()


def test_a_reply_cut_inside_a_character_on_a_real_engine(llm):
    forced = llm.tokenizer.encode(FORCED)
    assert len(forced) == len(FORCED.encode())  # one token per byte: every cut but three is inside a character
    prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": "Write some Japanese."}], tokenize=True)
    seen_cut = 0
    for max_tokens in range(1, len(forced) + 1):
        streamed = []
        params = SamplingParams(temperature=0, max_tokens=max_tokens, structured_outputs=StructuredOutputs(
            regex=FORCED))
        (out,) = llm.generate(prompt, params, on_output=lambda o: streamed.append(o.outputs[0].delta_text))
        (o,) = out.outputs
        decoded = llm.tokenizer.decode(o.token_ids)
        seen_cut += decoded.endswith("\ufffd")
        assert len(o.token_ids) == max_tokens
        assert o.finish_reason == ("length" if max_tokens < len(forced) else "stop")  # the grammar ends at its end
        assert "\ufffd" not in o.text and not any("\ufffd" in d for d in streamed), (max_tokens, o.text, streamed)
        assert o.text == "".join(streamed) == whole(decoded) and FORCED.startswith(o.text)
    assert seen_cut == len(forced) - len(FORCED)  # every cut inside a character was tried
