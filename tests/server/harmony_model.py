"""A tiny gpt-oss checkpoint (tsterm's gpt_oss architecture, random weights) whose tokenizer speaks harmony (the
in-house gpt-oss family's: harmony's markers as special tokens, its chat template harmony's), served through a
scripted engine: each scripted reply (written as the model writes harmony, through its stop token `<|call|>` or
`<|return|>`) is computed by the real engine after the prompt, as if the model had generated it (so the prefix cache
holds its blocks and the next request's cache hit is the engine's own), then streamed one token at a time as the
engine streams (its text without the special tokens, its ids whole). Each request's prompt and params are recorded."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.helpers.checkpoints import make_checkpoint
from tests.helpers.reasoning_templates import FAMILIES, family_tokenizer
from tsterm.config import SamplingParams
from tsterm.outputs import CompletionOutput, RequestMetrics, RequestOutput

FAMILY = FAMILIES["gpt-oss"]
# two scripted replies of a harmony chat (analysis, then final), for the chat paths' tests
GREETING_REPLY = ("<|channel|>analysis<|message|>The user greets me; greet back.<|end|>"
                  "<|start|>assistant<|channel|>final<|message|>Hello there!<|return|>")
PRODUCT_REPLY = ("<|channel|>analysis<|message|>Seven times eight is 56.<|end|>"
                 "<|start|>assistant<|channel|>final<|message|>It is 56.<|return|>")


def make_harmony_checkpoint(path: Path) -> Path:
    backend = family_tokenizer(FAMILY)._backend
    vocab = backend.get_vocab_size(with_added_tokens=True)
    make_checkpoint(path, "gpt_oss", {"vocab_size": vocab, "max_position_embeddings": 4096, "hidden_size": 32,
                                      "num_hidden_layers": 2}, with_tokenizer=False)
    backend.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": FAMILY.stops[0],
                                                            "chat_template": FAMILY.template}))
    (path / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [backend.token_to_id(t) for t in FAMILY.stops]}))
    return path


class ScriptedEngine:
    """An AsyncEngine that answers with scripted replies (see the module docstring); everything else is the
    engine's."""

    def __init__(self, aengine: Any):
        self.aengine = aengine
        self.replies: list[str] = []
        self.prompts: list[list[int]] = []
        self.params: list[SamplingParams] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["aengine"], name)

    async def generate(self, prompt, params=None, request_id=None, **options):
        prompt = list(prompt)
        self.prompts.append(prompt)
        self.params.append(params)
        tokenizer = self.aengine.tokenizer
        ids = tokenizer.encode(self.replies.pop(0))
        assert ids[-1] in tokenizer.eos_token_ids, "a scripted reply ends with its stop token"
        final = None
        async for out in self.aengine.generate(prompt + ids[:-1], SamplingParams(temperature=0, max_tokens=1),
                                               request_id=request_id, **options):
            final = out
        if final is None or not final.finished:
            return
        cached = min(final.num_cached_tokens, len(prompt))
        metrics = RequestMetrics(arrival_time=0.0, first_token_time=0.001, num_prompt_tokens=len(prompt),
                                 num_cached_tokens=cached)
        shown = ""
        for n in range(1, len(ids) + 1):
            text = tokenizer.decode(ids[:n], skip_special_tokens=True)
            done = n == len(ids)
            yield RequestOutput(request_id, prompt, [CompletionOutput(
                0, ids[:n], text, "stop" if done else None, delta_text=text[len(shown):],
                stop_reason=ids[-1] if done else None)], cached, metrics, done)
            shown = text
