"""The engine: requests in, one `step()` at a time (schedule -> run -> postprocess), outputs out."""
from __future__ import annotations

import contextlib
import itertools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tsterm.config import EngineConfig, ModelConfig, SamplingParams
from tsterm.engine.batch import ScheduledBatch
from tsterm.engine.block_pool import BlockPool
from tsterm.engine.copy_audit import CopyAudit
from tsterm.engine.executor import ExecutorFactory, ExecutorSpec
from tsterm.engine.kv_manager import KVCacheManager
from tsterm.engine.model_runner import ModelRunner
from tsterm.engine.output_processor import SampleOutput
from tsterm.engine.sampler import PenaltyState, Sampler, SamplingRow, has_penalty, seeded_generator
from tsterm.engine.scheduler import Scheduler
from tsterm.engine.sequence import Sequence
from tsterm.engine.stats import EngineMetrics
from tsterm.errors import ModelLoadError, RequestError
from tsterm.model.arch import ARCHITECTURES
from tsterm.model.cache import num_state_slots
from tsterm.model.loader import ProgressFn
from tsterm.outputs import RequestOutput
from tsterm.tokenizer import Tokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class _Sample:
    """One of a request's n samples: its sequence and its streaming and sampling state."""

    index: int
    seq: Sequence
    out: SampleOutput  # detokenisation, stop strings, deltas
    generator: torch.Generator | None
    # the history its penalties read, on the device: built at its first sampling, then kept up to date by the
    # Sampler; None while not built, and for ever when the params have no penalty
    penalty: PenaltyState | None = None


@dataclass
class _Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    samples: list[_Sample] = field(default_factory=list)


@dataclass(frozen=True)
class PinResult:
    """What `Engine.pin` did. pin_id is None when nothing was pinned (no cached block, or the cap was full)."""

    pin_id: str | None
    num_blocks: int  # blocks pinned: the leading `num_blocks` of the cached prefix
    num_tokens: int  # tokens they hold: what the next request with this prefix gets from the cache at least
    num_cached_blocks: int  # full blocks of token_ids found in the cache (pinned or not)
    capped: bool  # max_pinned_fraction stopped it before the end of the cached prefix


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """An engine dtype option; "auto": float32 on the CPU, bfloat16 elsewhere."""
    return DTYPES[name] if name != "auto" else (torch.float32 if device.type == "cpu" else torch.bfloat16)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ModelLoadError(f"device {name!r} requested but CUDA is not available on this machine (use --device cpu)")
        index = torch.device(name).index or 0
        if index >= torch.cuda.device_count():
            raise ModelLoadError(f"device {name!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return torch.device(name)


class Engine:
    def __init__(self, config: EngineConfig, progress: ProgressFn | None = None,
                 executor: ExecutorFactory = ModelRunner, clock: Callable[[], float] = time.monotonic):
        """executor: builds the executor that runs the model (the launcher's choice; default: one process).
        clock: seconds, for pin expiry (tests pass a fake one)."""
        self.config = config
        self.clock = clock
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        model_dir = Path(config.model)
        if not model_dir.is_dir():
            what = "is a file, not a model directory" if model_dir.exists() else "does not exist"
            raise ModelLoadError(f"model directory {config.model!r} {what}")
        self.model_config = cfg = ModelConfig.from_dir(model_dir)
        self.tokenizer = Tokenizer.from_dir(model_dir)
        if self.tokenizer.vocab_size > cfg.vocab_size:
            raise ModelLoadError(f"{model_dir}: tokenizer.json has {self.tokenizer.vocab_size} tokens but the "
                                 f"embedding (config.json vocab_size) has only {cfg.vocab_size} rows")
        self.executor = executor(ExecutorSpec(config, cfg, model_dir, self.dtype, self.device, progress))
        self.max_model_len = self.executor.max_model_len
        self.eos_token_ids = set(self.tokenizer.eos_token_ids) | set(cfg.eos_token_ids)
        num_blocks = self.executor.num_blocks
        # A hybrid model's linear-attention layers keep one state per running sequence, in slots its executor holds
        # (`num_state_slots`); with prefix caching, snapshots of it at block boundaries let a cached prefix resume.
        self.num_state_slots = num_state_slots(ARCHITECTURES[cfg.model_type].layer_types(cfg), config.max_num_seqs,
                                               config.enable_prefix_caching)
        pool = BlockPool(num_blocks, config.block_size, fingerprint=f"{model_dir.resolve()}:{self.dtype}",
                         enable_prefix_caching=config.enable_prefix_caching,
                         max_pinned_blocks=int(config.max_pinned_fraction * num_blocks),
                         num_state_slots=self.num_state_slots)
        self.kv = KVCacheManager(pool, snapshot_interval=config.state_snapshot_interval)
        self.scheduler = Scheduler(config, self.kv)
        self.sampler = Sampler(seed=config.seed)
        self.requests: dict[str, _Request] = {}
        self._samples: dict[int, _Sample] = {}  # seq_id -> its sample (live requests only)
        self._next_id = 0
        self._next_pin_id = 0
        self.num_pins_dropped = 0  # pins released early because nothing else could run (see `_schedule`)
        self._seq_ids = itertools.count()  # the engine's own: no sequence numbering is shared between engines
        self.num_steps = 0
        self.num_generated_tokens = 0
        self.num_prefill_tokens = 0
        self.metrics = EngineMetrics()
        self.audit: CopyAudit | None = None  # off by default: `enable_copy_audit`

    # ---------------------------------------------------------------------------------------------------------
    # requests

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        params = params or SamplingParams()
        prompt_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not prompt_ids:
            raise RequestError("the prompt is empty")
        vocab = self.model_config.vocab_size
        bad = [t for t in prompt_ids if type(t) is not int or not 0 <= t < vocab]  # noqa: E721 (bool is no id)
        if bad:
            raise RequestError(f"prompt token id {bad[0]!r} is outside the vocabulary [0, {vocab}) of integer ids")
        if len(prompt_ids) >= self.max_model_len:
            raise RequestError(f"the prompt has {len(prompt_ids)} tokens but the context holds {self.max_model_len} "
                               "(prompt + at least one generated token); shorten it or raise max_model_len / the KV budget")
        if params.n > self.config.max_num_seqs:
            raise RequestError(f"n={params.n} samples run at once, but the engine runs at most max_num_seqs="
                               f"{self.config.max_num_seqs} sequences; lower n or raise max_num_seqs")
        if request_id is None:
            request_id, self._next_id = f"req-{self._next_id}", self._next_id + 1
        if request_id in self.requests:
            raise RequestError(f"request id {request_id!r} is already in use")
        seq = Sequence(prompt_ids, params, request_id=request_id, seq_id=next(self._seq_ids))
        req = _Request(request_id, prompt_ids, params)
        self._add_sample(req, seq)
        self.requests[request_id] = req
        self.scheduler.add(seq)
        return request_id

    def _add_sample(self, req: _Request, seq: Sequence, penalty: PenaltyState | None = None) -> None:
        index = len(req.samples)
        generator = None if req.params.seed is None else seeded_generator(req.params.seed + index, self.device)
        sample = _Sample(index, seq, SampleOutput(self.tokenizer, req.prompt_token_ids, req.params.stop), generator,
                         penalty)
        req.samples.append(sample)
        self._samples[seq.seq_id] = sample

    def abort(self, request_id: str) -> bool:
        """Stop a request now and free its blocks. Returns False if it is unknown or already finished."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return False
        for seq in self._forget(req):
            if not seq.is_finished:
                self.scheduler.finish(seq, "abort")
                self.metrics.on_finished(seq.metrics, "abort")
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---------------------------------------------------------------------------------------------------------
    # pins: a session waiting on its tools (or its user) keeps its prefix in the cache

    def pin(self, token_ids: list[int], ttl_s: float = 300.0, key: str | None = None) -> PinResult:
        """Keep the cached full blocks of the longest cached prefix of `token_ids` (typically a finished request's
        prompt + generated ids) out of eviction for `ttl_s` seconds, or until `unpin`. A pin under an existing
        `key` (say, a session id) replaces that pin. Pinned blocks count against `max_pinned_fraction` of the pool;
        a pin that would pass it pins the leading blocks that fit (`capped`). Running requests share pinned blocks
        as usual. When no request could run otherwise, the engine drops pins early (`pins_dropped` in stats)."""
        if not (isinstance(ttl_s, (int, float)) and math.isfinite(ttl_s) and ttl_s > 0):
            raise RequestError(f"pin ttl_s must be a positive number of seconds, got {ttl_s!r}")
        now = self.clock()
        self.kv.pool.expire_pins(now)
        if key is None:
            key, self._next_pin_id = f"pin-{self._next_pin_id}", self._next_pin_id + 1
        cached = self.kv.cached_prefix_blocks(list(token_ids))
        num_pinned = self.kv.pool.pin(key, cached, now + ttl_s)
        return PinResult(key if num_pinned else None, num_pinned, num_pinned * self.config.block_size, len(cached),
                         capped=num_pinned < len(cached))

    def unpin(self, pin_id: str) -> bool:
        """Release a pin (its blocks become evictable unless something else holds them). False if it is unknown or
        already expired."""
        self.kv.pool.expire_pins(self.clock())
        return self.kv.pool.unpin(pin_id)

    # ---------------------------------------------------------------------------------------------------------
    # the step

    def step(self) -> list[RequestOutput]:
        batch = self._schedule()
        if batch is None:
            return []
        generated_before = self.num_generated_tokens
        with self.audit.step(self.num_steps) if self.audit else contextlib.nullcontext(False) as audited:
            if batch.cow_copies:
                self.executor.copy_blocks(batch.cow_copies)
            logits = self.executor.execute(batch)
            outputs = self._postprocess(batch, logits)
        if audited:
            self.audit.audited_tokens += self.num_generated_tokens - generated_before
        return outputs

    def _schedule(self) -> ScheduledBatch | None:
        """The scheduler's batch, after expiring pins. If pins hold blocks that the waiting requests need and nothing
        runs, nothing ever would (not before the pins expire): pins then yield to traffic, all of them."""
        pool = self.kv.pool
        pool.expire_pins(self.clock())
        batch = self.scheduler.schedule()
        if batch is None and self.scheduler.waiting and not self.scheduler.running and pool.pins():
            for key in pool.pins():
                pool.unpin(key)
                self.num_pins_dropped += 1
            batch = self.scheduler.schedule()
        return batch

    def enable_copy_audit(self, every_n_steps: int = 1) -> CopyAudit:
        """Count copy bytes and host syncs of every Nth step from now on (see `tsterm.engine.copy_audit`)."""
        self.audit = CopyAudit(every_n_steps)
        return self.audit

    def _postprocess(self, batch: ScheduledBatch, logits: torch.Tensor) -> list[RequestOutput]:
        now = time.time()
        sampling: list[Sequence] = []
        prefill_tokens = 0
        for seq, n, sample in zip(batch.seqs, batch.num_new, batch.sample_mask()):
            seq.num_computed_tokens += n
            self.kv.commit(seq)
            self.kv.keep_interval_snapshot(seq)
            self.kv.state_copied(seq)
            if seq.num_output_tokens == 0:
                prefill_tokens += n
            if sample:
                sampling.append(seq)
        self.num_prefill_tokens += prefill_tokens
        for seq in sampling:  # a sequence's first sampling reads its ids once, into its penalty state
            sample = self._samples[seq.seq_id]
            if sample.penalty is None and has_penalty(seq.params):
                sample.penalty = PenaltyState.from_ids(seq.params, seq.prompt_token_ids, seq.output_token_ids,
                                                       logits.shape[1], logits.device)
        logits, sampling = self._fork_new_samples(logits, sampling)
        samples = [self._samples[seq.seq_id] for seq in sampling]
        rows = [SamplingRow(sample.seq.params, sample.penalty, sample.generator) for sample in samples]
        result = self.sampler(logits, rows) if sampling else None
        touched: dict[str, _Request] = {}
        for i, seq in enumerate(sampling):
            token = result.token_ids[i]
            seq.token_ids.append(token)
            if result.logprobs[i] is not None:
                seq.logprobs.append(result.logprobs[i])
            m = seq.metrics
            if m.first_token_time is None:
                m.first_token_time = now
            else:
                m.inter_token_latencies.append(now - m.last_token_time)
                self.metrics.on_token_latency(now - m.last_token_time)
            m.last_token_time = now
            m.num_generated_tokens += 1
            self.num_generated_tokens += 1
            req = self.requests[seq.request_id]
            self._check_stop(seq, token, self._samples[seq.seq_id].out.add(token))
            touched[req.request_id] = req
        self.num_steps += 1
        self.metrics.on_step(prefill_tokens, len(sampling), now)
        outputs = [self._output(req) for req in touched.values()]
        for out in outputs:
            if out.finished:
                self._forget(self.requests.pop(out.request_id))
        return outputs

    def _fork_new_samples(self, logits: torch.Tensor, sampling: list[Sequence]) -> tuple[torch.Tensor, list[Sequence]]:
        """n > 1: when a prompt's prefill completes, fork it into n sequences sharing every KV block."""
        extra_rows: list[int] = []
        state_copies: list[tuple[int, int]] = []
        for row, seq in enumerate(list(sampling)):
            req = self.requests[seq.request_id]
            if seq.num_output_tokens or req.params.n == 1 or len(req.samples) > 1:
                continue
            for index in range(1, req.params.n):
                child = Sequence(seq.token_ids, seq.params, request_id=seq.request_id, seq_id=next(self._seq_ids))
                child.metrics.arrival_time = seq.metrics.arrival_time
                child.metrics.first_scheduled_time = seq.metrics.first_scheduled_time
                child.num_cached_tokens = child.metrics.num_cached_tokens = seq.num_cached_tokens
                state_copies.extend(self.kv.fork(seq, child))
                child.status = seq.status
                self.scheduler.running.append(child)
                parent_penalty = self._samples[seq.seq_id].penalty
                self._add_sample(req, child, None if parent_penalty is None else parent_penalty.clone())
                sampling.append(child)
                extra_rows.append(row)
        if state_copies:  # now, not at the children's first step: the parent may advance before they run
            self.executor.copy_states(state_copies)
        if extra_rows:
            logits = torch.cat([logits, logits[torch.tensor(extra_rows, device=logits.device)]])
        return logits, sampling

    def _forget(self, req: _Request) -> list[Sequence]:
        for sample in req.samples:
            self._samples.pop(sample.seq.seq_id, None)
        return [sample.seq for sample in req.samples]

    def _check_stop(self, seq: Sequence, token: int, stop_string: str | None) -> None:
        params = seq.params
        if stop_string is not None:
            return self._finish(seq, "stop")
        if token in params.stop_token_ids:
            self._samples[seq.seq_id].out.stop_reason = token
            return self._finish(seq, "stop")
        if not params.ignore_eos and token in self.eos_token_ids:
            return self._finish(seq, "stop")
        if seq.num_output_tokens >= params.max_tokens or len(seq) >= self.max_model_len:
            return self._finish(seq, "length")

    def _finish(self, seq: Sequence, reason: str) -> None:
        self._samples[seq.seq_id].out.flush()  # release any held-back partial character
        self.scheduler.finish(seq, reason)
        self.metrics.on_finished(seq.metrics, reason)

    def _output(self, req: _Request) -> RequestOutput:
        completions = [sample.out.output(sample.index, sample.seq) for sample in req.samples]
        head = req.samples[0].seq
        return RequestOutput(req.request_id, req.prompt_token_ids, completions, head.num_cached_tokens, head.metrics,
                             finished=all(sample.seq.is_finished for sample in req.samples))

    # ---------------------------------------------------------------------------------------------------------
    # stats

    def stats(self) -> dict[str, int | float]:
        self.kv.pool.expire_pins(self.clock())  # an idle engine shows an expired pin as gone
        s = dict(self.kv.stats())
        s["pins_dropped"] = self.num_pins_dropped
        s.update(
            running=len(self.scheduler.running), waiting=len(self.scheduler.waiting),
            preemptions=self.scheduler.num_preemptions, steps=self.num_steps,
            generated_tokens=self.num_generated_tokens, prefill_tokens=self.num_prefill_tokens,
            block_size=self.config.block_size, kv_bytes_per_block=self.executor.kv_bytes_per_block,
            state_bytes=self.executor.state_bytes,
        )
        s.update(self.executor.counters())
        # The other side of the copy ledger: KV taken by reference. A design that deep-copies the prefix each
        # turn would have moved exactly these bytes.
        s["kv_reused_bytes"] = s["prefix_hit_tokens"] * s["kv_bytes_per_block"] // self.config.block_size
        return s

    def expert_load(self) -> list[list[int]]:
        """Tokens routed to each expert, per MoE layer, since start (one host read for all layers)."""
        return self.executor.expert_load()

    def rank_stats(self) -> list[dict[str, int]] | None:
        """Expert tokens and resident memory per rank of a multi-rank executor (None in one process)."""
        return self.executor.rank_stats()

    def shutdown(self) -> None:
        """Release the executor (its workers, device memory); the engine is unusable after."""
        self.executor.shutdown()

    def prometheus(self) -> str:
        return self.metrics.prometheus(self.stats())
