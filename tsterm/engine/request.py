"""A request inside the engine: its n samples, each a sequence with its streaming and sampling state, and the
RequestOutput it hands back.

Every sample is made at admission (`Request.create`): the sequences, the detokenizers and the seeded generators, so
whatever a request's fields could make fail, fails before anything of it is registered. Only sample 0 is scheduled
at first; the others join it by reference to its blocks once its prompt is computed (`Engine._fork`).
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from tsterm.config import SEED_MAX, SamplingParams
from tsterm.engine.output_processor import SampleOutput
from tsterm.engine.sampler import PenaltyState, seeded_generator
from tsterm.engine.sequence import Sequence
from tsterm.engine.structured import Grammar
from tsterm.errors import RequestError
from tsterm.outputs import CompletionOutput, RequestOutput
from tsterm.tokenizer import Tokenizer


@dataclass
class Sample:
    """One of a request's n samples: its sequence and its streaming and sampling state."""

    index: int
    seq: Sequence
    out: SampleOutput  # detokenisation, stop strings, deltas
    generator: torch.Generator | None
    # the history its penalties read, on the device: built at its first sampling, then kept up to date by the
    # Sampler; None while not built, and for ever when the params have no penalty
    penalty: PenaltyState | None = None
    # its grammar's state (params.structured_outputs), advanced with each token it appends; None: free, and once the
    # sample has finished
    grammar: Grammar | None = None


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    samples: list[Sample] = field(default_factory=list)
    forked: bool = True  # samples 1..n-1 are scheduled too (False from admission until sample 0's prompt is computed)

    @classmethod
    def create(cls, request_id: str, prompt_ids: list[int], params: SamplingParams, tokenizer: Tokenizer,
               device: torch.device, seq_ids: Iterator[int], grammar: Grammar | None = None,
               cache_salt: str | None = None) -> Request:
        """All n samples; sample i draws from a generator seeded with (seed + i) mod 2**64. grammar: the compiled
        structured_outputs (admission.compile_structured), sample 0's; the others get copies of it. cache_salt: every
        sample's blocks are cached under it (a non-empty string; `KVCacheManager`), so they are shared only with
        prompts of the same salt; None: with every unsalted prompt, as always."""
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise RequestError(f"cache_salt must be a non-empty string, got {cache_salt!r}", param="cache_salt")
        req = cls(request_id, prompt_ids, params, forked=params.n == 1)
        for index in range(params.n):
            seq = Sequence(prompt_ids, params, request_id=request_id, seq_id=next(seq_ids))
            seq.cache_salt = cache_salt  # read by the KV manager (its blocks' hash chain starts from it)
            generator = None if params.seed is None else seeded_generator((params.seed + index) % (SEED_MAX + 1),
                                                                          device)
            req.samples.append(Sample(index, seq, SampleOutput(tokenizer, prompt_ids, params.stop), generator,
                                      grammar=None if grammar is None else grammar if index == 0 else grammar.fork()))
        return req

    @property
    def live(self) -> list[Sample]:
        """The samples the scheduler holds: sample 0 until the fork, then all."""
        return self.samples if self.forked else self.samples[:1]

    @property
    def finished(self) -> bool:
        return all(sample.seq.is_finished for sample in self.samples)

    def output(self) -> RequestOutput:
        completions = [sample.out.output(sample.index, sample.seq) for sample in self.samples]
        head = self.samples[0].seq
        return RequestOutput(self.request_id, self.prompt_token_ids, completions, head.num_cached_tokens, head.metrics,
                             finished=self.finished)

    def error_output(self, error: Exception) -> RequestOutput:
        """The final output of a request that failed: every sample ends with finish_reason "error", its text what was
        streamed of it (its detokenizer may be what failed), and `error` says why."""
        completions = [CompletionOutput(sample.index, sample.seq.output_token_ids, sample.out.text[:sample.out.streamed],
                                        finish_reason="error") for sample in self.samples]
        head = self.samples[0].seq
        return RequestOutput(self.request_id, self.prompt_token_ids, completions, head.num_cached_tokens, head.metrics,
                             finished=True, error=error)
