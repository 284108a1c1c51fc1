"""The engine: requests in, one `step()` at a time (schedule -> run -> postprocess), outputs out.

The engine owns the requests (their samples, sampling state, detokenisers, stop checks) and the executor; the
scheduler owns the sequences' queues, blocks, state slots and pins. A step asks the scheduler for a batch, has the
executor compute it and the sampler draw from it, gives the batch back to the scheduler (`update_from_output`), and
appends the draws to their requests.
"""
from __future__ import annotations

import contextlib
import itertools
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from tsterm.config import EngineConfig, ModelConfig, SamplingParams
from tsterm.cpu import CpuFeatures, DtypeChoice, auto_dtype, quantized_linears
from tsterm.engine.admission import Limits, check_request, compile_structured
from tsterm.engine.batch import ScheduledBatch
from tsterm.engine.block_pool import BlockPool
from tsterm.engine.copy_audit import CopyAudit
from tsterm.engine.executor import ExecutorFactory, ExecutorSpec
from tsterm.engine.isolation import SamplingCheckpoint, isolate
from tsterm.engine.kv_manager import KVCacheManager, WindowBlocks
from tsterm.engine.kv_tier import engine_fingerprint, open_tiers
from tsterm.engine.model_runner import ModelRunner
from tsterm.engine.request import Request, Sample
from tsterm.engine.sampler import PenaltyState, Sampler, SamplingRow, has_penalty
from tsterm.engine.scheduler import Scheduler
from tsterm.engine.sequence import Sequence
from tsterm.engine.spec_decode import DraftSource, make_draft_source
from tsterm.engine.spec_decode.adaptive import DraftLength
from tsterm.engine.structured import GrammarCompiler
from tsterm.engine.stats import EngineMetrics
from tsterm.errors import ExecutorError, ModelLoadError, RequestError
from tsterm.model.arch import ARCHITECTURES
from tsterm.model.cache import num_state_slots
from tsterm.model.loader import ProgressFn
from tsterm.outputs import RequestOutput
from tsterm.tokenizer import Tokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
Draw = tuple[Sample, int, "dict | None"]  # a sample, the token it drew, its logprobs entry (params.logprobs set)
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PinResult:
    """What `Engine.pin` did. pin_id is None when nothing was pinned (no cached block, or the cap was full)."""

    pin_id: str | None
    num_blocks: int  # blocks pinned: the leading `num_blocks` of the cached prefix
    num_tokens: int  # tokens they hold: what the next request with this prefix gets from the cache at least
    num_cached_blocks: int  # full blocks of token_ids found in the cache (pinned or not)
    capped: bool  # max_pinned_fraction stopped it before the end of the cached prefix


def dtype_choice(name: str, device: torch.device, quantized: bool = False,
                 cpu: CpuFeatures | None = None) -> DtypeChoice:
    """An engine dtype option, and why. "auto": bfloat16 on a GPU; on the CPU bfloat16 where it pays (AMX-BF16 granted
    by the OS, a model of float linears: `quantized` says its linears are int8 / int4 / MXFP4 / fp16 blocks), else
    float32 (tsterm.cpu.cpu_auto_dtype; `cpu`: this machine's, detected, when not given)."""
    if name != "auto":
        return DtypeChoice(name, "as configured")
    return auto_dtype(device.type, quantized, cpu)


def resolve_dtype(name: str, device: torch.device, quantized: bool = False,
                  cpu: CpuFeatures | None = None) -> torch.dtype:
    """`dtype_choice`'s dtype."""
    return DTYPES[dtype_choice(name, device, quantized, cpu).dtype]


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
        model_dir = Path(config.model)
        if not model_dir.is_dir():
            what = "is a file, not a model directory" if model_dir.exists() else "does not exist"
            raise ModelLoadError(f"model directory {config.model!r} {what}")
        self.model_config = cfg = ModelConfig.from_dir(model_dir)
        self.dtype_choice = dtype_choice(config.dtype, self.device,
                                         quantized_linears(config.quantization, cfg.quant_method))  # (and why)
        self.dtype = DTYPES[self.dtype_choice.dtype]
        self.tokenizer = Tokenizer.from_dir(model_dir)
        if self.tokenizer.vocab_size > cfg.vocab_size:
            raise ModelLoadError(f"{model_dir}: tokenizer.json has {self.tokenizer.vocab_size} tokens but the "
                                 f"embedding (config.json vocab_size) has only {cfg.vocab_size} rows")
        self.executor = executor(ExecutorSpec(config, cfg, model_dir, self.dtype, self.device, progress))
        self.max_model_len = self.executor.max_model_len
        self.eos_token_ids = set(self.tokenizer.eos_token_ids) | set(cfg.eos_token_ids)
        num_blocks = self.executor.num_blocks
        # A hybrid model's linear-attention layers keep one state per running sequence, in slots its executor holds
        # (`num_state_slots`); with prefix caching, snapshots of it at block boundaries let a cached prefix resume;
        # with speculative decoding, a verify step keeps the state after each draft in a slot of its own.
        speculative = config.num_speculative_tokens if config.speculative_method != "off" else 0
        self.num_state_slots = num_state_slots(ARCHITECTURES[cfg.model_type].layer_types(cfg), config.max_num_seqs,
                                               config.enable_prefix_caching, speculative)
        fingerprint = engine_fingerprint(config, model_dir, cfg, self.dtype, self.device, self.executor)
        pool = BlockPool(num_blocks, config.block_size, fingerprint=fingerprint,
                         enable_prefix_caching=config.enable_prefix_caching,
                         max_pinned_blocks=int(config.max_pinned_fraction * num_blocks),
                         num_state_slots=self.num_state_slots)
        try:  # (`tsterm.engine.kv_tier`; with several ranks, each opens its own)
            tier = None if config.kv_disk is None and not config.kv_host_bytes else open_tiers(
                config.kv_disk, fingerprint, self.executor, pool.root_hash, block_size=config.block_size,
                model=str(model_dir), num_state_slots=self.num_state_slots, host_bytes=config.kv_host_bytes,
                ledger=lambda kind, nbytes: self.audit.record_copy("kv_tier", kind, nbytes) if self.audit else None)
        except BaseException:  # (refused: the executor's ranks and device memory go now, not at garbage collection)
            self.executor.shutdown()
            raise
        window = None  # the sliding layers' own pool (gpt-oss), when the executor keeps one: `WindowBlocks`
        if getattr(self.executor, "num_window_blocks", 0):
            num_window = self.executor.num_window_blocks
            window = WindowBlocks(BlockPool(num_window, config.block_size, fingerprint=fingerprint,
                                            enable_prefix_caching=config.enable_prefix_caching,
                                            max_pinned_blocks=int(config.max_pinned_fraction * num_window)),
                                  self.executor.window)
        self.kv = KVCacheManager(pool, snapshot_interval=config.state_snapshot_interval, tier=tier, window=window)
        # speculative decoding: the draft source (None: off); a step verifies what it drafts (`_accept`)
        self.drafter: DraftSource | None = None
        if config.speculative_method != "off":
            self.drafter = make_draft_source(config.speculative_method, config.num_speculative_tokens)
        # how many of its drafts a sequence verifies: the length that pays, from measured step times (`adaptive`)
        self.draft_length: DraftLength | None = DraftLength() if self.drafter is not None else None
        # a draft source that reads the target's hidden states (MTP) gets each step the executor ran whole
        self._hidden_drafter = self.drafter if getattr(self.drafter, "wants_hidden", False) else None
        if self._hidden_drafter is not None:  # (its chain goes as far as the measured draft length makes worth it)
            self._hidden_drafter.chain_length = self._chain_length
        self.scheduler = Scheduler(config, self.kv, lambda: self.clock(),  # (the engine's clock, even if replaced)
                                   proposer=self._propose if self.drafter is not None else None,
                                   copy_states=self.executor.copy_states)
        self.limits = Limits(cfg.vocab_size, self.max_model_len, config.max_num_seqs)
        # structured outputs: the engine's llguidance tokenizer (built on the first constrained request) and pool
        self.grammars = GrammarCompiler(self.tokenizer, cfg.vocab_size, sorted(self.eos_token_ids))
        self.sampler = Sampler(seed=config.seed, grammars=self.grammars)
        self.requests: dict[str, Request] = {}
        self._samples: dict[int, Sample] = {}  # seq_id -> its sample (live requests only, from their admission)
        self._next_id = 0
        self._next_pin_id = 0
        self._seq_ids = itertools.count()  # the engine's own: no sequence numbering is shared between engines
        self.num_steps = 0
        self.num_generated_tokens = 0
        self.metrics = EngineMetrics(spec_method=config.speculative_method,
                                     num_speculative_tokens=config.num_speculative_tokens)
        self.audit: CopyAudit | None = None  # off by default: `enable_copy_audit`

    # ---------------------------------------------------------------------------------------------------------
    # requests

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, *, strict_max_tokens: bool = False,
                    cache_salt: str | None = None) -> str:
        """Queue a request. Every field is checked first (`admission.check_request`: a RequestError naming the bad
        one), and all its samples are made before anything of it is registered. strict_max_tokens: a max_tokens past
        the context's room is an error rather than a cap. cache_salt: its prompt shares cached blocks only with
        prompts of the same salt (`Request.create`)."""
        params = params or SamplingParams()
        prompt_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        check_request(prompt_ids, params, self.limits, strict_max_tokens)
        grammar = compile_structured(params, self.grammars)
        if request_id is None:
            request_id, self._next_id = f"req-{self._next_id}", self._next_id + 1
        if request_id in self.requests:
            raise RequestError(f"request id {request_id!r} is already in use", param="request_id")
        req = Request.create(request_id, prompt_ids, params, self.tokenizer, self.device, self._seq_ids, grammar,
                             cache_salt)
        self.requests[request_id] = req
        for sample in req.samples:
            self._samples[sample.seq.seq_id] = sample
        self.scheduler.add(req.samples[0].seq)
        return request_id

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
        self.kv.expire_pins(now)
        if key is None:
            key, self._next_pin_id = f"pin-{self._next_pin_id}", self._next_pin_id + 1
        num_pinned, num_cached = self.kv.pin(key, token_ids, now + ttl_s)
        return PinResult(key if num_pinned else None, num_pinned, num_pinned * self.config.block_size, num_cached,
                         capped=num_pinned < num_cached)

    def unpin(self, pin_id: str) -> bool:
        """Release a pin (its blocks become evictable unless something else holds them). False if it is unknown or
        already expired."""
        self.kv.expire_pins(self.clock())
        return self.kv.unpin(pin_id)

    # ---------------------------------------------------------------------------------------------------------
    # the step

    def step(self) -> list[RequestOutput]:
        started = time.perf_counter()
        batch = self.scheduler.schedule()
        if batch is None:
            return []
        generated_before = self.num_generated_tokens
        with self.audit.step(self.num_steps) if self.audit else contextlib.nullcontext(False) as audited:
            scheduled = batch
            batch, draws, failures = self._run(batch)
            whole = batch is scheduled and not failures
            outputs = self._postprocess(batch, draws, failures)
            if self._hidden_drafter is not None:  # MTP: its KV caught up over this step, the next drafts made
                if whole:
                    self._hidden_drafter.after_step(batch, self.executor)
                else:
                    self._hidden_drafter.forget_step(scheduled)
        if audited:
            self.audit.audited_tokens += self.num_generated_tokens - generated_before
        if self.draft_length is not None and whole and all(  # (a decode step: what a verify's cost is measured on)
                n == 1 + len(batch.draft_ids(i)) for i, n in enumerate(batch.num_new)):
            self.draft_length.observe_step(batch.num_tokens, time.perf_counter() - started)
        return outputs

    def enable_copy_audit(self, every_n_steps: int = 1) -> CopyAudit:
        """Count copy bytes and host syncs of every Nth step from now on (see `tsterm.engine.copy_audit`)."""
        self.audit = CopyAudit(every_n_steps)
        return self.audit

    # ---- run: compute and sample the batch; a request it fails on fails alone ----------------------------------

    def _run(self, batch: ScheduledBatch) -> tuple[ScheduledBatch, list[Draw], dict[str, Exception]]:
        """The part of the batch that ran, its draws, and the requests that failed (request id -> error)."""
        try:
            return batch, self._attempt(batch), {}
        except ExecutorError:
            raise
        except Exception as error:  # noqa: BLE001 - whose it is, `isolate` finds out
            log.debug("a step failed; isolating the requests it fails on", exc_info=True)
            return self._recover(batch, error)

    def _attempt(self, batch: ScheduledBatch) -> list[Draw]:
        """Copy-on-write, forward, sampling. A failure leaves the sampling state as it was, so the part runs again
        the same (the KV it wrote is rewritten with the same values; a hybrid's states are not: `_recover`)."""
        samples, rows = self._sampling_rows(batch)
        checkpoint = SamplingCheckpoint(self._generators(samples), samples)
        try:
            if batch.cow_copies:
                self.executor.copy_blocks(batch.cow_copies)
            logits = self.executor.execute(batch)  # [S, V]: one row per sequence that samples (a verify: per position)
            drafts = batch.drafts_by_seq()
            states: dict[int, list[PenaltyState]] = {}  # a verify's penalised rows: each position's history
            rewinds: dict[int, list[torch.Tensor]] = {}  # a verify's seeded rows: its generator after each draw
            return self._accept(drafts, self._sample(logits, samples, rows, drafts, states, rewinds), states,
                                rewinds)
        except BaseException:
            checkpoint.restore()
            raise

    def _recover(self, batch: ScheduledBatch, error: Exception) -> tuple[ScheduledBatch, list[Draw],
                                                                          dict[str, Exception]]:
        """The batch failed with `error`: run parts of it by request (`isolate`) to find the requests that fail on
        their own, and keep the draws of the parts that ran. A hybrid model's failed forward may have advanced the
        recurrent states of every sequence in it, and a part run again would advance them twice: there the parts
        only find the culprits, and the others are recomputed from their cached prefix (preempted) instead."""
        by_request: dict[str, list[Sequence]] = {}
        for seq in batch.seqs:
            by_request.setdefault(seq.request_id, []).append(seq)
        samples, _ = self._sampling_rows(batch)
        checkpoint = SamplingCheckpoint(self._generators(samples), samples)
        found = isolate(list(by_request.values()),
                        lambda part: self._attempt(batch.select([seq for group in part for seq in group])), error)
        failures = {group[0].request_id: e for group, e in found.failed}
        if self.num_state_slots:
            checkpoint.restore()
            self.scheduler.preempt([seq for seq in batch.seqs if seq.request_id not in failures])
            return batch.select([]), [], failures
        ran = [seq for part, _ in found.done for group in part for seq in group]
        return batch.select(ran), [draw for _, draws in found.done for draw in draws], failures

    def _sampling_rows(self, batch: ScheduledBatch) -> tuple[list[Sample], list[int]]:
        """The samples that draw a token this step and the logits row each reads: those whose prompt or decode the
        batch completes, in batch order, then the other samples of a request whose first prompt just completed (they
        fork from it and read its row)."""
        samples = [self._samples[seq.seq_id] for seq, num_rows in zip(batch.seqs, batch.sample_rows())
                   for _ in range(num_rows)]  # (a verify step's sequence: one row per position, consecutive)
        rows = list(range(len(samples)))
        for row, sample in enumerate(list(samples)):
            req = self.requests[sample.seq.request_id]
            if not req.forked:
                samples += req.samples[1:]
                rows += [row] * (len(req.samples) - 1)
        return samples, rows

    def _generators(self, samples: list[Sample]) -> list[torch.Generator]:
        """The generators sampling `samples` draws from: their own, and the Sampler's shared one for the unseeded."""
        own = [sample.generator for sample in samples if sample.generator is not None]
        shared = any(sample.generator is None and not sample.seq.params.greedy for sample in samples)
        return own + [self.sampler.shared_generator(self.device)] if shared else own

    def _sample(self, logits: torch.Tensor, samples: list[Sample], rows: list[int],
                drafts: dict[int, list[int]] | None = None,
                states: dict[int, list[PenaltyState]] | None = None,
                rewinds: dict[int, list[torch.Tensor]] | None = None) -> list[Draw]:
        """Draw each sample's token (a verify's: one per position). A verifying sample with penalties reads, at
        position j, its history plus its first j drafts: a copy of its state each (`states`, for `_accept`), so the
        penalties see what decoding those tokens one step each would have seen. A verifying sample with its own
        generator draws its positions in order, one [V] draw each, as decoding them one step each would; its
        generator's state after each draw goes to `rewinds` (for `_accept`)."""
        if not samples:
            return []
        for sample in samples:  # a sequence's first sampling reads its ids once, into its penalty state
            seq = sample.seq
            if sample.penalty is None and has_penalty(seq.params):
                sample.penalty = PenaltyState.from_ids(seq.params, seq.prompt_token_ids, seq.output_token_ids,
                                                       logits.shape[1], logits.device)
        if len(rows) > logits.shape[0]:  # a fork's samples read their first sample's row
            logits = logits[torch.tensor(rows, device=logits.device)]  # [S + forked, V]
        penalties = [s.penalty for s in samples]
        for i, s in enumerate(samples):
            draft = drafts.get(s.seq.seq_id) if drafts else None
            if draft and s.penalty is not None and (i == 0 or samples[i - 1] is not s):  # the first of its rows
                states[s.seq.seq_id] = penalties[i:i + len(draft) + 1] = [
                    _with_tokens(s.penalty, draft[:j], logits.device) for j in range(len(draft) + 1)]
        rewound = {s.seq.seq_id for s in samples if s.generator is not None and drafts and drafts.get(s.seq.seq_id)}
        result = self.sampler(logits, [SamplingRow(s.seq.params, penalty, s.generator, s.grammar,
                                                   keep_generator_state=s.seq.seq_id in rewound)
                                       for s, penalty in zip(samples, penalties)])
        for row, state in result.generator_states.items() if rewinds is not None else ():
            rewinds.setdefault(samples[row].seq.seq_id, []).append(state)
        return list(zip(samples, result.token_ids, result.logprobs))

    # ---- speculative decoding: drafts in, the verified run out ----------------------------------------------------

    def _propose(self, seq: Sequence, max_tokens: int) -> list[int]:
        """The draft ids `seq` verifies next step (the scheduler's proposer), at most `max_tokens`. None for a request
        with a grammar: its matcher's state at each position depends on the tokens before it, which one verify step
        does not advance (it decodes without drafts; penalties are replayed: `_sample`). Its run (the drafts and the
        target's token after them) never passes its max_tokens or the end of the context."""
        sample = self._samples.get(seq.seq_id)
        params = seq.params
        if sample is None or sample.grammar is not None or params.structured_outputs is not None:
            return []
        room = min(max_tokens, min(params.max_tokens - seq.num_output_tokens, self.max_model_len - len(seq)) - 1)
        if room < 1:
            return []
        draft = self.drafter.propose(seq.seq_id, seq.token_ids, room)
        if self.draft_length is None:
            return draft
        return self.draft_length.choose(seq.seq_id, seq.token_ids, draft, len(self.scheduler.running))

    def _chain_length(self, seq_id: int) -> int:
        """How many drafts a model draft source (MTP) should make for `seq_id` for its next step."""
        k = self.config.num_speculative_tokens
        if self.draft_length is None:
            return k
        return self.draft_length.best_length(seq_id, k, len(self.scheduler.running))

    def _accept(self, drafts: dict[int, list[int]], draws: list[Draw],
                states: dict[int, list[PenaltyState]], rewinds: dict[int, list[torch.Tensor]]) -> list[Draw]:
        """Verification: a sequence that verified drafts d1..dk drew the target's tokens t0..tk at their k + 1
        positions (the sampler, each row as a row of its own: its temperature, truncation, bias and generator); it
        keeps the longest run with t_i == d_(i+1), then the target's token after it (the one at the first mismatch,
        or the bonus tk after all k): t0..ta, a = the drafts accepted. The draws of the other sequences pass through.

        Greedy, this is "the target's argmax equals the draft". Sampled, it is the speculative-sampling rule exactly,
        for drafts that are one token per position (the draft sources are deterministic: q(d) = 1): the rule accepts d
        with probability min(1, p(d) / q(d)) = p(d), which is the chance that t ~ p equals d, and on a rejection draws
        from the residual max(0, p - q), normalised, which is p without d: the law of t given t != d. So each
        emitted token has the target's distribution given the tokens before it. A seeded request's generator draws
        one row per verified position, in order, then is set back to its state after the last row it keeps
        (`rewinds`): each kept token is drawn with the state decoding it alone would have had, so a seeded request's
        output is the same with or without speculation, whatever the drafts.

        A penalised sample's state becomes that of the row it stopped at (`_sample`: its history, the drafts it
        accepted, then, recorded by the sampler, the row's own token): exactly the tokens it appends."""
        if not drafts:
            return draws
        kept: list[Draw] = []
        i = 0
        while i < len(draws):
            draft = drafts.get(draws[i][0].seq.seq_id)
            if draft is None:
                kept.append(draws[i])
                i += 1
                continue
            group = draws[i:i + len(draft) + 1]
            accepted = 0
            while accepted < len(draft) and group[accepted][1] == draft[accepted]:
                accepted += 1
            kept.extend(group[:accepted + 1])
            if group[0][0].seq.seq_id in states:
                group[0][0].penalty = states[group[0][0].seq.seq_id][accepted]
            if group[0][0].seq.seq_id in rewinds:  # (as if it had drawn only the rows it keeps)
                group[0][0].generator.set_state(rewinds[group[0][0].seq.seq_id][accepted])
            i += len(draft) + 1
        return kept

    # ---- postprocess: bookkeeping, stop checks, outputs ----------------------------------------------------------

    def _postprocess(self, batch: ScheduledBatch, draws: list[Draw],
                     failures: dict[str, Exception]) -> list[RequestOutput]:
        """Commit what the batch computed, append the draws, and hand out outputs. A request whose fork, detokenizer
        or output fails here fails alone (into `failures`); every failed request gets its final error output."""
        now = time.time()
        prefill_tokens = self.scheduler.update_from_output(batch)
        verified = {seq_id: len(drafts) for seq_id, drafts in batch.drafts_by_seq().items()}
        generated_before = self.num_generated_tokens
        touched: dict[str, Request] = {}
        i = 0
        while i < len(draws):  # each sample's draws are consecutive: one, or a verify step's accepted run + 1
            sample, end = draws[i][0], i + 1
            while end < len(draws) and draws[end][0] is sample:
                end += 1
            run, i = draws[i:end], end
            req = self.requests[sample.seq.request_id]
            if req.request_id in failures:
                continue
            try:
                if not req.forked:
                    self._fork(req)
                self._append_run(sample, run, verified.get(sample.seq.seq_id), now)
                touched[req.request_id] = req
            except Exception as e:  # noqa: BLE001 - the request's own failure
                failures[req.request_id] = e
        self.num_steps += 1
        self.metrics.on_step(prefill_tokens, self.num_generated_tokens - generated_before, now)
        outputs = []
        for req in touched.values():
            try:
                if req.request_id not in failures:
                    outputs.append(req.output())
            except Exception as e:  # noqa: BLE001
                failures[req.request_id] = e
        outputs += [self._fail(self.requests[request_id], error) for request_id, error in failures.items()]
        for out in outputs:
            if out.finished:
                self._forget(self.requests.pop(out.request_id))
        return outputs

    def _append_run(self, sample: Sample, run: list[Draw], num_drafted: int | None, now: float) -> None:
        """Append a sample's draws of this step in order, each stop-checked: one token, or after a verify of
        `num_drafted` drafts its accepted ones and the target's next. A stop inside the run ends the sample there
        (the rest is dropped). The accepted drafts' KV becomes the sequence's (`Scheduler.accept_drafts`) before the
        last token is appended, unless the sample finished on one of them (its blocks are freed then)."""
        seq = sample.seq
        if num_drafted is not None:
            num_accepted = len(run) - 1
            self.metrics.on_verify(self.drafter.name, num_drafted, num_accepted)  # (per source and position)
            self.drafter.observe(seq.seq_id, num_drafted, num_accepted)
        for index, (_, token, logprob) in enumerate(run):
            if seq.is_finished:
                return
            if num_drafted is not None and index == len(run) - 1:
                self.scheduler.accept_drafts(seq, len(run) - 1)
            self._append(sample, token, logprob, now)

    def _fork(self, req: Request) -> None:
        """Sample 0 of `req` has computed its prompt: samples 1..n-1 join it (`Scheduler.fork`: every KV block by
        reference, a hybrid's state copied now; all or nothing)."""
        parent, children = req.samples[0].seq, [sample.seq for sample in req.samples[1:]]
        for child in children:
            child.metrics.arrival_time = parent.metrics.arrival_time
            child.metrics.first_scheduled_time = parent.metrics.first_scheduled_time
            child.num_cached_tokens = child.metrics.num_cached_tokens = parent.num_cached_tokens
        self.scheduler.fork(parent, children, self.executor.copy_states)
        req.forked = True

    def _append(self, sample: Sample, token: int, logprob: dict | None, now: float) -> None:
        seq = sample.seq
        seq.token_ids.append(token)
        if logprob is not None:
            seq.logprobs.append(logprob)
        m = seq.metrics
        if m.first_token_time is None:
            m.first_token_time = now
        else:
            m.inter_token_latencies.append(now - m.last_token_time)
            self.metrics.on_token_latency(now - m.last_token_time)
        m.last_token_time = now
        m.num_generated_tokens += 1
        self.num_generated_tokens += 1
        if sample.grammar is not None:
            sample.grammar.accept(token)  # (the mask allowed only tokens it takes)
        self._check_stop(seq, token, sample.out.add(token))

    def _fail(self, req: Request, error: Exception) -> RequestOutput:
        """End `req` with finish_reason "error": its blocks and state slots are freed (a partly filled block is not
        kept for the prefix cache: the failed step may have left it half copied)."""
        for sample in req.live:
            seq = sample.seq
            if not seq.is_finished:
                self.scheduler.finish(seq, "error")
                self.metrics.on_finished(seq.metrics, "error")
        return req.error_output(error)

    def _forget(self, req: Request) -> list[Sequence]:
        """Drop `req`'s samples; returns the sequences the scheduler holds."""
        for sample in req.samples:
            self._samples.pop(sample.seq.seq_id, None)
            if self.drafter is not None:  # (a finished output joins a suffix source's global index)
                seq = sample.seq
                self.drafter.release(seq.seq_id, seq.token_ids, seq.num_prompt_tokens)
                if self.draft_length is not None:
                    self.draft_length.release(seq.seq_id)
        return [sample.seq for sample in req.live]

    def _check_stop(self, seq: Sequence, token: int, stop_string: str | None) -> None:
        params = seq.params
        if stop_string is not None:
            return self._finish(seq, "stop")
        if token in params.stop_token_ids:
            self._samples[seq.seq_id].out.stop_reason = token
            return self._finish(seq, "stop")
        if not params.ignore_eos and token in self.eos_token_ids:
            return self._finish(seq, "stop")
        grammar = self._samples[seq.seq_id].grammar
        if grammar is not None and grammar.done:  # the structured output is complete: nothing may follow
            return self._finish(seq, "stop")
        if seq.num_output_tokens >= params.max_tokens or len(seq) >= self.max_model_len:
            return self._finish(seq, "length")

    def _finish(self, seq: Sequence, reason: str) -> None:
        sample = self._samples[seq.seq_id]
        sample.out.flush()  # release any held-back partial character
        sample.grammar = None  # its matcher is done with
        self.scheduler.finish(seq, reason)
        self.metrics.on_finished(seq.metrics, reason)

    # ---------------------------------------------------------------------------------------------------------
    # stats

    def stats(self) -> dict[str, int | float]:
        self.kv.expire_pins(self.clock())  # an idle engine shows an expired pin as gone
        s = dict(self.kv.stats())
        s["pins_dropped"] = self.scheduler.num_pins_dropped
        s.update(
            running=len(self.scheduler.running), waiting=len(self.scheduler.waiting),
            preemptions=self.scheduler.num_preemptions, steps=self.num_steps,
            generated_tokens=self.num_generated_tokens, prefill_tokens=self.scheduler.num_prefill_tokens,
            block_size=self.config.block_size, kv_bytes_per_block=self.executor.kv_bytes_per_block,
            window_bytes_per_block=getattr(self.executor, "window_bytes_per_block", 0),
            state_bytes=self.executor.state_bytes,
        )
        s.update(self.metrics.spec.stats())  # spec_num_drafts, spec_draft_tokens, ..., spec_sources (stats.py)
        s.update(self.executor.counters())
        # The other side of the copy ledger: KV taken by reference. A design that deep-copies the prefix each
        # turn would have moved exactly these bytes.
        # (The tokens read back from the disk tier were copied, not referenced: `kv_disk_read_bytes`.)
        s["kv_reused_bytes"] = ((s["prefix_hit_tokens"] - s["kv_tier_hit_tokens"]) * s["kv_bytes_per_block"]
                                // self.config.block_size)
        # (with a window pool, the main pool's blocks hold the full layers only: the sliding layers' blocks taken)
        s["kv_reused_bytes"] += s.get("window_hit_blocks", 0) * s["window_bytes_per_block"]
        return s

    def expert_load(self) -> list[list[int]]:
        """Tokens routed to each expert, per MoE layer, since start (one host read for all layers)."""
        return self.executor.expert_load()

    def rank_stats(self) -> list[dict[str, int]] | None:
        """Expert tokens and resident memory per rank of a multi-rank executor (None in one process)."""
        return self.executor.rank_stats()

    def shutdown(self) -> None:
        """Release the executor (its workers, device memory); the engine is unusable after. The disk tier's queued
        writes are finished first."""
        if self.kv.tier is not None:
            self.kv.tier.close()
        self.executor.shutdown()


def _with_tokens(state: PenaltyState, token_ids: list[int], device: torch.device) -> PenaltyState:
    """A copy of a penalty state with `token_ids` appended to the history it counts."""
    copy = state.clone()
    if token_ids:
        ids = torch.tensor(token_ids, dtype=torch.long).to(device, non_blocking=True)
        if copy.seen is not None:
            copy.seen.index_fill_(0, ids, True)
        if copy.counts is not None:
            copy.counts.index_add_(0, ids, torch.ones(ids.shape, device=device))
    return copy
