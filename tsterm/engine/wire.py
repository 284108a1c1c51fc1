"""A step's RequestOutputs across a process boundary, as what changed since the request's previous output.

A RequestOutput names everything generated so far (its token ids, text and logprobs are Snapshots of append-only
sources, outputs.py). Pickled whole, each step would send O(output) and a request O(output^2). The core side
(`OutputEncoder`) sends only the tail of each source past what it sent before, plus the step's deltas and the
metrics' scalars; the front side (`OutputDecoder`) appends the tails to its own append-only copies and hands out
RequestOutputs that are again Snapshots of them: the same values, the same laziness, as in one process.
"""
from __future__ import annotations

import dataclasses
import pickle
from typing import Any

from tsterm.errors import EngineStepError
from tsterm.outputs import CompletionOutput, RequestMetrics, RequestOutput, Snapshot
from tsterm.tokenizer import AppendOnlyText

_SCALARS = tuple(f.name for f in dataclasses.fields(RequestMetrics) if f.name != "inter_token_latencies")


def portable(error: BaseException) -> BaseException:
    """`error` if it survives pickling (tsterm's errors do, their `param` too), else an EngineStepError with its
    type and message. Either way without its traceback and cause, which stay in the process that raised it."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:  # noqa: BLE001 - any exception type may refuse to pickle or to unpickle
        return EngineStepError(f"{type(error).__name__}: {error}")


def _tail(value: Any, sent: int) -> tuple[Any, int]:
    """What `value` (a Snapshot or a plain list / str) has past its first `sent` items, and its length."""
    if isinstance(value, Snapshot):
        return value.source[value.start + sent:value.end], len(value)
    return value[sent:], len(value)


class OutputEncoder:
    """The core's side: a step's outputs -> one picklable list, each field past what was sent before."""

    def __init__(self) -> None:
        # request id -> [itl sent, {sample index -> [token ids, text, logprobs] sent}]
        self._sent: dict[str, list[Any]] = {}

    def encode(self, outputs: list[RequestOutput]) -> list[tuple]:
        return [self._encode(out) for out in outputs]

    def forget(self, request_id: str) -> None:
        """The request was aborted: no more outputs of it will be encoded."""
        self._sent.pop(request_id, None)

    def _encode(self, out: RequestOutput) -> tuple:
        first = out.request_id not in self._sent
        state = self._sent.setdefault(out.request_id, [0, {}])
        metrics = out.metrics
        itl = metrics.inter_token_latencies
        new_itl, state[0] = itl[state[0]:], len(itl)
        samples = []
        for o in out.outputs:
            sent = state[1].setdefault(o.index, [0, 0, 0])
            tokens, sent[0] = _tail(o._token_ids, sent[0])
            text, sent[1] = _tail(o._text, sent[1])
            logprobs = None
            if o._logprobs is not None:
                logprobs, sent[2] = _tail(o._logprobs, sent[2])
            samples.append((o.index, list(tokens), str(text), logprobs, o.finish_reason, o.stop_reason, o.delta_text,
                            list(o.delta_token_ids)))
        if out.finished:
            del self._sent[out.request_id]
        error = None if out.error is None else portable(out.error)
        return (out.request_id, list(out.prompt_token_ids) if first else None, out.num_cached_tokens, out.finished,
                error, tuple(getattr(metrics, name) for name in _SCALARS), new_itl, samples)


class _Sample:
    __slots__ = ("token_ids", "text", "logprobs")

    def __init__(self) -> None:
        self.token_ids: list[int] = []
        self.text = AppendOnlyText()
        self.logprobs: list[dict] = []


class _Request:
    __slots__ = ("prompt_token_ids", "metrics", "samples")

    def __init__(self, prompt_token_ids: list[int]):
        self.prompt_token_ids = prompt_token_ids
        self.metrics = RequestMetrics()
        self.samples: dict[int, _Sample] = {}


class OutputDecoder:
    """The front's side: what an OutputEncoder sent -> RequestOutputs equal to the core's."""

    def __init__(self) -> None:
        self._requests: dict[str, _Request] = {}

    def __len__(self) -> int:
        return len(self._requests)

    def decode(self, encoded: tuple) -> RequestOutput:
        request_id, prompt, num_cached, finished, error, scalars, new_itl, samples = encoded
        req = self._requests.get(request_id)
        if req is None:
            req = self._requests[request_id] = _Request(prompt if prompt is not None else [])
        metrics = req.metrics
        for name, value in zip(_SCALARS, scalars):
            setattr(metrics, name, value)
        metrics.inter_token_latencies.extend(new_itl)
        completions = []
        for index, tokens, text, logprobs, finish_reason, stop_reason, delta_text, delta_token_ids in samples:
            sample = req.samples.get(index)
            if sample is None:
                sample = req.samples[index] = _Sample()
            sample.token_ids.extend(tokens)
            sample.text.append(text)
            if logprobs is not None:
                sample.logprobs.extend(logprobs)
            completions.append(CompletionOutput(
                index, Snapshot(sample.token_ids, 0, len(sample.token_ids)), Snapshot(sample.text, 0, len(sample.text)),
                finish_reason=finish_reason, stop_reason=stop_reason,
                logprobs=Snapshot(sample.logprobs, 0, len(sample.logprobs)) if logprobs is not None else None,
                delta_text=delta_text, delta_token_ids=delta_token_ids))
        if finished:
            del self._requests[request_id]
        return RequestOutput(request_id, req.prompt_token_ids, completions, num_cached, metrics, finished, error)

    def forget(self, request_id: str) -> None:
        """The request was aborted: its outputs end here."""
        self._requests.pop(request_id, None)
