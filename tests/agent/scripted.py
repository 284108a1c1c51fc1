"""A scripted model for agent-loop tests: each request streams the next fixed reply, one token at a time, as the
engine's RequestOutputs would. It keeps what a prefix cache would hold (every finished prompt + reply, whole blocks)
and reports `num_cached_tokens` from it, records pins, and honours abort. With `hold_after`, a reply stops after that
many tokens until `release()` or an abort: a test sees it mid-stream for as long as it needs, whatever the machine."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass

from tsterm.outputs import RequestMetrics
from tsterm.outputs import CompletionOutput, RequestOutput


@dataclass
class Pin:
    token_ids: list[int]
    ttl_s: float


class ScriptedBackend:
    def __init__(self, tokenizer, replies: list[str], *, block_size: int = 16, token_delay_s: float = 0.0,
                 hold_after: int | None = None):
        self.tokenizer = tokenizer
        self.replies = list(replies)
        self.block_size = block_size
        self.token_delay_s = token_delay_s
        self.hold_after = hold_after
        self.released = asyncio.Event()
        self.prompts: list[list[int]] = []
        self.finished: list[list[int]] = []  # prompt + generated ids of every finished request (the "cache")
        self.pins: dict[str, Pin] = {}
        self.unpinned: list[str] = []
        self.aborted: list[str] = []
        self._live: set[str] = set()

    def _cached(self, prompt: list[int]) -> int:
        best = 0
        for ids in self.finished:
            n = 0
            while n < min(len(ids), len(prompt)) and ids[n] == prompt[n]:
                n += 1
            best = max(best, n)
        best = min(best, len(prompt) - 1)  # the last prompt token is always computed (it yields the logits)
        return best // self.block_size * self.block_size

    async def generate(self, prompt, params=None, request_id=None):
        if not self.replies:
            raise AssertionError("the scripted model has no reply left for this request")
        prompt = list(prompt)
        self.prompts.append(prompt)
        reply = self.replies.pop(0)
        ids = self.tokenizer.encode(reply, add_special_tokens=False) + [self.tokenizer.eos_token_ids[0]]
        cached = self._cached(prompt)
        self._live.add(request_id)
        metrics = RequestMetrics(arrival_time=0.0, first_token_time=0.001, num_prompt_tokens=len(prompt),
                                 num_cached_tokens=cached)
        shown = ""
        for n in range(1, len(ids) + 1):
            await asyncio.sleep(self.token_delay_s)
            if self.hold_after is not None and n > self.hold_after:
                await self.released.wait()
            if request_id not in self._live:  # aborted: the stream ends without a final output
                return
            text = self.tokenizer.decode(ids[:n], skip_special_tokens=True)
            done = n == len(ids)
            yield RequestOutput(request_id, prompt, [CompletionOutput(
                0, ids[:n], text, "stop" if done else None, delta_text=text[len(shown):])], cached, metrics, done)
            shown = text
        self._live.discard(request_id)
        self.finished.append(prompt + ids)

    def release(self) -> None:
        """Let every held reply go on (and the later ones run through)."""
        self.released.set()

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)
        self._live.discard(request_id)
        self.released.set()  # a held reply wakes to end

    def pin(self, token_ids, ttl_s=300.0, key=None):
        self.pins[key] = Pin(list(token_ids), ttl_s)
        return type("PinResult", (), {"pin_id": key})()

    def unpin(self, pin_id: str) -> bool:
        self.unpinned.append(pin_id)
        return self.pins.pop(pin_id, None) is not None


class EngineScript:
    """A scripted model on a real engine. Each scripted reply (the text the model generates, through its stop token)
    is computed by the engine as if the model had generated it: its ids, less the stop (a generated stop is never fed
    back), follow the prompt in a request that samples one token, which is dropped. So the prefix cache holds exactly
    the blocks a generated reply leaves, and `num_cached_tokens` is the engine's own. Once the script is done, requests
    go to the engine as they are: the model's own replies. Wraps an AsyncEngine (`shutdown` too)."""

    def __init__(self, engine, replies: list[str]):
        self.engine = engine
        self.tokenizer = engine.engine.tokenizer
        self.replies = list(replies)
        self.prompts: list[list[int]] = []
        self.outputs: list[RequestOutput] = []  # the final output of every request, scripted or not

    @property
    def eos_token_ids(self):
        return self.engine.engine.eos_token_ids

    async def generate(self, prompt, params=None, request_id=None):
        prompt = list(prompt)
        self.prompts.append(prompt)
        if not self.replies:
            async for out in self.engine.generate(prompt, params, request_id=request_id):
                if out.finished:
                    self.outputs.append(out)
                yield out
            return
        ids = self.tokenizer.encode(self.replies.pop(0))
        if ids[-1] not in self.eos_token_ids:
            raise AssertionError("a scripted reply ends with the model's stop token")
        from tsterm.config import SamplingParams

        final = None
        async for out in self.engine.generate(prompt + ids[:-1], SamplingParams(temperature=0, max_tokens=1),
                                              request_id=request_id):
            final = out
        if final is None or not final.finished:  # aborted
            return
        cached = min(final.num_cached_tokens, len(prompt))
        metrics = RequestMetrics(arrival_time=0.0, first_token_time=0.001, num_prompt_tokens=len(prompt),
                                 num_cached_tokens=cached)
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        out = RequestOutput(request_id, prompt, [CompletionOutput(0, ids, text, "stop", delta_text=text)], cached,
                            metrics, True)
        self.outputs.append(out)
        yield out

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)

    def pin(self, token_ids, ttl_s=300.0, key=None):
        return self.engine.pin(token_ids, ttl_s, key)

    def unpin(self, pin_id: str) -> bool:
        return self.engine.unpin(pin_id)

    def shutdown(self) -> None:
        self.engine.shutdown()
