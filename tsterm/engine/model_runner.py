"""The single-process executor: owns the weights, the kernels and the cache pools; turns a batch into logits.

A step's inputs go through persistent buffers (`tsterm.engine.step_inputs`): written on the host, uploaded with
one asynchronous copy per dtype (pinned memory on CUDA), so a CUDA step queues its whole forward without waiting
for the device. The step's one wait is the sampler's read-back of the sampled token ids (`sampler._read_back`).
On CUDA with the Triton kernels, pure decode steps replay CUDA graphs (`tsterm.engine.cuda_graphs`).

Start-up, in order: load the weights (each linear weight quantized as it loads, `quantization`); on a device with
a memory probe (CUDA; `executor.memory_probe`), a profile run: one forward of the largest prefill chunk
(`max_num_batched_tokens` tokens, `max_num_seqs` rows sampled) over a throw-away cache, and the sampler over its
logits, measured on the device (`profile_memory`); then the cache, sized from what that left (`size_cache`); then the
model over it; then every decode graph shape captured (`DecodeGraphs.capture_all`), with progress. On the CPU there
is no profile run (the cache gets its default budget) and no graph.

Built with a `ParallelContext` (`tsterm.model.parallel`), a ModelRunner is one rank's shard: the weights, the KV
heads and the model of that rank. A multi-rank executor runs one per rank and feeds each the same `HostStep`
(`run_step`); the KV pool is sized to what fits on every rank (`agree_min`), so block ids mean the same everywhere.
"""
from __future__ import annotations

import logging

import torch
from tsterm_kernels import dispatch

from tsterm.config import MAX_LOGPROBS, SamplingParams, check_quantization
from tsterm.engine.batch import ScheduledBatch
from tsterm.engine.cpu_threads import CpuThreads
from tsterm.engine.cuda_graphs import DecodeGraphs, batch_buckets, capture_plan, context_widths, graph_memory_estimate
from tsterm.engine.executor import Executor, ExecutorSpec, MemoryProbe, MemoryProfile, gib, memory_probe, size_cache
from tsterm.engine.sampler import PenaltyState, Sampler, SamplingRow
from tsterm.engine.step_inputs import (
    DeviceBuffers,
    HostStaging,
    HostStep,
    StepInputs,
    StepLayout,
    step_inputs,
)
from tsterm.model.arch import ARCHITECTURES
from tsterm.errors import ConfigError
from tsterm.model.cache import ModelCache, PagedKVPool, num_state_slots, sliding_window, window_pool_blocks
from tsterm.model.cpu_kernels import choose as choose_cpu_kernels
from tsterm.model.decoder import DecoderModel
from tsterm.model.hybrid_loader import load_hybrid_weights
from tsterm.model.loader import load_weights
from tsterm.model.mla import allow_expanded_prefill
from tsterm.model.mtp import MtpHead, load_mtp_weights
from tsterm.model.parallel import ParallelContext, SingleRank
from tsterm.model.quant import allow_prefill_gemms

log = logging.getLogger(__name__)

def kernels_for(name: str, device: torch.device) -> str:
    """The kernel implementation an engine option names; "auto": Triton on CUDA, the torch twins elsewhere."""
    return name if name != "auto" else ("triton" if device.type == "cuda" else "torch")


class ModelRunner(Executor):
    """The single-process executor: the weights, the cache pools and the model on one device (or one rank's shard
    of them, with `par`)."""

    def __init__(self, spec: ExecutorSpec, par: ParallelContext | None = None):
        config, cfg = spec.config, spec.model_config
        check_quantization(config.quantization, cfg)  # before the load: a quantized checkpoint takes none
        self.par = par = par if par is not None else SingleRank()
        self.cfg, self.block_size, self.device, self.dtype = cfg, config.block_size, spec.device, spec.dtype
        # The kernels are this executor's own (no process-wide binding), chosen before the long weight load.
        self.ops = dispatch.load(kernels_for(config.kernels, spec.device))
        self.kernels = self.ops.name
        layout = par.layout
        layer_types = ARCHITECTURES[cfg.model_type].layer_types(cfg)
        # state slots for the sequences the scheduler may run at once (and their snapshots, with prefix caching),
        # allocated up front and taken off the KV budget
        speculative = config.num_speculative_tokens if config.speculative_method != "off" else 0
        self.num_state_slots = num_state_slots(layer_types, config.max_num_seqs, config.enable_prefix_caching,
                                               speculative)
        recurrent = self.num_state_slots > 0
        if recurrent and speculative and layout.world_size > 1:  # (before the long weight load)
            raise ConfigError("speculative decoding on a hybrid model runs in one process: a verify step's per-"
                              "position state slots (HostStep.verify_slots) do not travel to the other ranks yet; "
                              "use speculative_method off with several ranks", param="speculative_method")
        # each linear weight quantized as it loads: the float model is never whole on the device
        load = load_hybrid_weights if recurrent else load_weights
        weights = load(spec.model_dir, cfg, spec.dtype, spec.device, spec.progress, layout,
                       quantization=config.quantization)
        if not config.deterministic:  # a quantized prefill may take the float GEMM (README "Same answer ...")
            allow_prefill_gemms(weights)
        # speculative_method mtp: the checkpoint's MTP head (`tsterm.model.mtp`); its attention's KV is one more
        # layer under the same block ids, plus `mtp_scratch_per_seq` scratch blocks per sequence for drafted
        # positions past a sequence's blocks. With it, each step keeps its final hidden states for the drafter.
        self.mtp: MtpHead | None = None
        self.hidden_states: torch.Tensor | None = None  # [T, H] of the last step (kept only with an MTP head)
        mtp_weights = None
        if config.speculative_method == "mtp":
            if layout.world_size > 1:
                raise ConfigError("speculative_method mtp runs in one process; use another method with several "
                                  "ranks", param="speculative_method")
            mtp_weights = load_mtp_weights(spec.model_dir, cfg, spec.dtype, spec.device)
        self.mtp_scratch_per_seq = -(-config.num_speculative_tokens // self.block_size) if mtp_weights else 0
        mtp_block_bytes = PagedKVPool.bytes_per_block(cfg, 1, self.block_size, spec.dtype, layout) if mtp_weights else 0
        # sliding and full attention layers (gpt-oss): the sliding layers' K/V in a window pool of their own, whose
        # blocks go back once out of every later position's window (`tsterm.engine.kv_manager.WindowBlocks`)
        self.window = self._window_pool(config, layer_types, layout.world_size, mtp_weights is not None, recurrent)
        self.num_window_blocks = 0  # blocks of the window pool, its null block included (0: none)
        # this rank's bytes; every rank holds as many KV heads, so all ranks together cost world_size times this
        pools = "main" if self.window else "all"
        self.kv_bytes_per_block = ModelCache.bytes_per_block(cfg, layer_types, self.block_size, spec.dtype, layout,
                                                             pools=pools)
        self.kv_bytes_per_block += mtp_block_bytes
        self.window_bytes_per_block = ModelCache.bytes_per_block(
            cfg, layer_types, self.block_size, spec.dtype, layout, pools="window") if self.window else 0
        self.state_bytes_per_slot = ModelCache.bytes_per_slot(cfg, layer_types, spec.dtype, layout)
        self.state_bytes = self.num_state_slots * self.state_bytes_per_slot
        self.cow_bytes = 0
        self.state_copy_bytes = 0  # recurrent states copied into a slot (a cached prefix resumed, a sample forked)
        self.state_snapshot_bytes = 0  # recurrent states the model kept in snapshot slots (at block boundaries)
        self.staging = HostStaging(self.device)
        self.buffers = DeviceBuffers(self.staging)
        self.graph_steps = 0  # steps replayed from a CUDA graph
        self.eager_steps = 0
        # Decode steps replay CUDA graphs on CUDA with the Triton ops (the torch twins read host lists per step).
        # (Not with several ranks yet: a graph would have to capture the collectives too. Nor for linear-attention
        # layers yet: their step's recurrent plan, `tsterm_kernels.metadata.RecurrentPlan`, changes shape from step to
        # step (decode rows that keep a state, 1-token prompts); a graph needs a fixed-shape plan. Nor for attention
        # sinks and sliding windows (gpt-oss): those layers run torch's attention, which reads host lists per step.)
        torch_attention = ARCHITECTURES[cfg.model_type].attention_sinks or any(t.window for t in layer_types)
        use_graphs = (config.cuda_graphs and self.device.type == "cuda" and self.kernels == "triton"
                      and layout.world_size == 1 and not recurrent and mtp_weights is None and not torch_attention)
        memory = memory_probe(spec)
        self.memory_profile = None  # measured before the cache exists: the cache gets what the largest step leaves
        if memory is not None:
            if spec.progress is not None:  # (a status line: the loading screen shows it as it is)
                tokens = min(config.max_num_batched_tokens, config.max_model_len or cfg.max_position_embeddings)
                spec.progress(0, 0, f"measuring memory: a forward of {tokens} tokens")
            self.memory_profile = self.profile_memory(memory, config, layer_types, weights, use_graphs)
        num_scratch = config.max_num_seqs * self.mtp_scratch_per_seq
        self.num_blocks, self.max_model_len = size_cache(spec, self.kv_bytes_per_block + self.window_bytes_per_block,
                                                         agree=par.agree_min,
                                                         reserved_bytes=self.state_bytes + num_scratch * mtp_block_bytes,
                                                         profile=self.memory_profile)
        if self.window:
            self._split_window_pool(spec, speculative)
        self.cache = ModelCache(cfg, layer_types, self.num_blocks, self.block_size, spec.dtype, spec.device, layout,
                                num_state_slots=self.num_state_slots, num_window_blocks=self.num_window_blocks)
        self.model = DecoderModel(cfg, weights, self.cache, self.max_model_len, self.ops, par)
        if not config.deterministic:  # MLA may expand long prompt chunks (another arithmetic than decode's)
            allow_expanded_prefill(self.model)
        # each float32 shape class's CPU kernel: measured on this machine once (kept in the kernel cache), logged
        self.cpu_kernels = (choose_cpu_kernels(self.model)
                            if self.device.type == "cpu" and self.kernels == "torch" else None)
        if mtp_weights is not None:
            self.mtp = MtpHead(cfg, mtp_weights, self.model, PagedKVPool(
                cfg, (0,), self.num_blocks + num_scratch, self.block_size, spec.dtype, spec.device, layout))
        self.moe_layers = [mlp for *_, mlp in self.model.layers if mlp.router is not None]  # their expert_load
        # a verify step's positions as one-token rows (see `host_step`) where the decode kernels are a path of their
        # own, faster than the extend's layer by layer: the CPU's one-call layer stack (one rank only: a multi-rank
        # model has none, and the distributed executor's block-table deltas count one table per sequence)
        self.verify_as_decode_rows = self.model.stack is not None
        self.max_blocks_per_seq = -(-self.max_model_len // self.block_size)
        if self.memory_profile is not None:
            log.info("KV cache: %d blocks of %d tokens (%s); %s", self.num_blocks, self.block_size,
                     gib(self.num_blocks * self.kv_bytes_per_block), self.memory_profile.describe())
        self.graphs = DecodeGraphs(self, config.max_num_seqs) if use_graphs else None
        self.graph_bytes = 0  # device memory the start-up captures took (measured; 0 without graphs)
        if self.graphs is not None:  # every decode shape now: no request pays for a capture or a compile
            before = memory.free_bytes() if memory is not None else 0
            self.graphs.capture_all(spec.progress)
            if memory is not None:
                self.graph_bytes = max(before - memory.free_bytes(), 0)
                log.info("captured %d CUDA graphs of decode steps in %s (%s held for them)",
                         len(self.graphs.graphs), gib(self.graph_bytes), gib(self.memory_profile.graph_bytes))
        # one process on the CPU: its threads follow the cores other processes leave free (a rank's are its own)
        self.cpu_threads = CpuThreads() if self.device.type == "cpu" and layout.world_size == 1 else None

    @staticmethod
    def _window_pool(config, layer_types, world_size: int, mtp: bool, recurrent: bool) -> int:
        """The window the sliding layers' own pool keeps (0: no window pool). Off, with one log line, where it is not
        mirrored: several ranks (the workers' step protocol carries no window tables), an MTP head, a KV tier,
        recurrent state (no family has both)."""
        window = sliding_window(layer_types)
        if not window or config.window_kv_blocks == 0:
            return 0
        reason = ("several ranks" if world_size > 1 else "speculative_method mtp" if mtp
                  else "recurrent-state layers" if recurrent
                  else "a KV tier (kv_disk / kv_host_bytes)" if config.kv_disk is not None or config.kv_host_bytes
                  else None)
        if reason is not None:
            log.info("sliding-window pool off with %s: the sliding layers keep every block", reason)
            return 0
        return window

    def _split_window_pool(self, spec: ExecutorSpec, speculative: int) -> None:
        """Size the window pool (`window_kv_blocks`, or `window_pool_blocks`'s auto rule) and the main pool beside it.
        `size_cache` counted each block at both pools' bytes (`num_blocks` of each): a budget is split so that both
        pools together take what that took, the main pool the rest after the window pool; an explicit
        `num_kv_blocks` is the main pool's. The window pool never gets fewer blocks than one request alone needs."""
        config, B = spec.config, self.block_size
        least, auto = window_pool_blocks(self.window, B, config.max_num_seqs, config.max_num_batched_tokens,
                                         speculative)
        explicit = config.window_kv_blocks
        if explicit is not None and explicit < least:
            raise ConfigError(f"window_kv_blocks {explicit} is too small: one request alone needs {least} window "
                              f"blocks (a window of {self.window} tokens, its next token's block and a prompt chunk "
                              f"of max_num_batched_tokens {config.max_num_batched_tokens}, in blocks of {B}, and "
                              "the reserved null block)", param="window_kv_blocks")
        both = self.num_blocks
        num_window = explicit if explicit is not None else min(auto, both + 1)
        if config.num_kv_blocks is None:  # a budget: the main pool takes what the window pool leaves of it
            main_bytes, window_bytes = self.kv_bytes_per_block, self.window_bytes_per_block
            self.num_blocks = max(2, (both * (main_bytes + window_bytes) - num_window * window_bytes) // main_bytes)
        self.num_window_blocks = num_window
        self.max_model_len = min(config.max_model_len or spec.model_config.max_position_embeddings,
                                 self.num_blocks * B)
        log.info("sliding-window pool: %d blocks of %d tokens for a window of %d (%s) beside %d main blocks (%s)",
                 num_window - 1, B, self.window, gib(num_window * self.window_bytes_per_block), self.num_blocks,
                 gib(self.num_blocks * self.kv_bytes_per_block))

    def profile_memory(self, memory: MemoryProbe, config, layer_types, weights, use_graphs: bool) -> MemoryProfile:
        """Measure the largest step before the cache exists: one forward of a full prefill chunk (one sequence of
        `max_num_batched_tokens` - `max_num_seqs` + 1 tokens, and `max_num_seqs` - 1 one-token rows beside it, every
        row sampled) over a throw-away cache that holds just that step, then the sampler over its logits with every
        stage on (penalties, top-k / top-p, min-p, logprobs). `step_bytes`: the peak allocated over what was
        allocated before the step; `model_bytes`: what the model allocates besides its cache (rotary tables for the
        longest context). Run by every rank of a multi-rank executor (its collectives included)."""
        cfg, block = self.cfg, self.block_size
        tokens = min(config.max_num_batched_tokens, config.max_model_len or cfg.max_position_embeddings)
        rows = min(config.max_num_seqs, tokens)
        first = tokens - (rows - 1)  # the long chunk, then rows - 1 single tokens
        first_blocks = -(-first // block)
        step = HostStep()
        for i, n in enumerate([first] + [1] * (rows - 1)):
            table = list(range(first_blocks)) if i == 0 else [first_blocks + i - 1]
            step.input_ids.extend([0] * n)
            step.positions.extend(range(n))
            step.slot_mapping.extend(table[p // block] * block + p % block for p in range(n))
            step.query_start_loc.append(step.query_start_loc[-1] + n)
            step.seq_lens.append(n)
            step.block_tables.append(table)
            step.state_slots.append(i if self.num_state_slots else -1)
        step.sample_rows = [end - 1 for end in step.query_start_loc[1:]]
        memory.release_cached()
        free = memory.free_bytes()
        before = memory.allocated_bytes()
        num_blocks, num_slots = first_blocks + rows - 1, rows if self.num_state_slots else 0
        if self.window:  # (the window pool as big as the other: the step's blocks under the same ids in both)
            step.window_slot_mapping = list(step.slot_mapping)
            step.window_block_tables = [list(table) for table in step.block_tables]
        cache = ModelCache(cfg, layer_types, num_blocks, block, self.dtype, self.device, self.par.layout,
                           num_state_slots=num_slots, num_window_blocks=num_blocks if self.window else 0)
        # a model as the real one will be (its rotary tables for the longest context): what it allocates besides the
        # cache is allocated again by the real model
        longest = config.max_model_len or cfg.max_position_embeddings
        self.cache, self.model = cache, DecoderModel(cfg, weights, cache, longest, self.ops, self.par)
        if not config.deterministic:  # (the real model's forms: an expanded chunk's memory measured)
            allow_expanded_prefill(self.model)
        baseline = memory.allocated_bytes()
        cache_bytes = (num_blocks * (self.kv_bytes_per_block + self.window_bytes_per_block)
                       + num_slots * self.state_bytes_per_slot)
        model_bytes = max(baseline - before - cache_bytes, 0)
        memory.reset_peak()
        try:
            logits = self.run_step(step)
            params = SamplingParams(temperature=0.8, top_k=max(cfg.vocab_size // 2, 1), top_p=0.9, min_p=0.01,
                                    repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=0.5,
                                    logprobs=MAX_LOGPROBS)
            Sampler(seed=config.seed)(logits, [
                SamplingRow(params, PenaltyState.from_ids(params, [0], [0], cfg.vocab_size, self.device))
                for _ in range(rows)])
            del logits
            step_bytes = max(memory.peak_bytes() - baseline, 0)
        finally:
            del self.cache, self.model, cache
            self.eager_steps = 0
        memory.release_cached()
        graph_bytes = 0
        if use_graphs:
            plan = capture_plan(batch_buckets(config.max_num_seqs), context_widths(block, -(-longest // block)))
            graph_bytes = graph_memory_estimate(plan, cfg.vocab_size, step_bytes, tokens)
        return MemoryProfile(free, step_bytes, graph_bytes, model_bytes, tokens, rows)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write of forked partial blocks: the only KV data ever copied, and counted."""
        self.cow_bytes += self.cache.copy_blocks(pairs)
        if self.mtp is not None:
            self.cow_bytes += self.mtp.kv_pool.copy_blocks(pairs)

    def copy_states(self, pairs: list[tuple[int, int]]) -> None:
        self.state_copy_bytes += self.cache.copy_slots(pairs)

    def expert_load(self) -> list[list[int]]:
        if not self.moe_layers:
            return []
        return torch.stack([mlp.expert_load for mlp in self.moe_layers]).tolist()  # one host read for all layers

    def counters(self) -> dict[str, int]:
        threads = {} if self.cpu_threads is None else {"cpu_threads": self.cpu_threads.threads}
        return {**threads, "cow_bytes": self.cow_bytes, "state_copy_bytes": self.state_copy_bytes,
                "state_snapshot_bytes": self.state_snapshot_bytes,
                "graph_steps": self.graph_steps, "eager_steps": self.eager_steps}

    def host_step(self, batch: ScheduledBatch) -> HostStep:
        """The batch as host lists. A sequence that verifies drafts (speculative decoding) samples a row at each of
        its positions: fed as one extend (its last token and its drafts, causal among them), or, with
        `verify_as_decode_rows`, as that many one-token rows over its block table, row j attending to the context up
        to its own position (all rows' KV is stored before any row attends, as in every step): the same arithmetic as
        decoding those tokens one step each, which the decode kernels (the CPU's one-call layer stack, the decode
        attention) run."""
        step = HostStep()
        B = self.block_size
        sample_rows = batch.sample_rows()  # per sequence: 0, 1, or 1 + its drafts
        for i, (seq, n, slot_mapping) in enumerate(zip(batch.seqs, batch.num_new, batch.slot_mappings)):
            start = seq.num_computed_tokens
            input_ids = batch.input_ids(i)  # (a verify step: its last token, then its drafts)
            if batch.draft_ids(i) and self.verify_as_decode_rows and not self.num_state_slots:
                for j in range(n):
                    step.input_ids.append(input_ids[j])
                    step.positions.append(start + j)
                    step.slot_mapping.append(slot_mapping[j])
                    step.query_start_loc.append(step.query_start_loc[-1] + 1)
                    step.seq_lens.append(start + j + 1)
                    step.block_tables.append(seq.block_table[:-(-(start + j + 1) // B)])
                    step.state_slots.append(seq.state_slot)
                    step.sample_rows.append(len(step.input_ids) - 1)
                    if self.window:
                        step.window_block_tables.append(seq.window_table[:-(-(start + j + 1) // B)])
                if self.window:
                    self._window_rows(step, seq, start, n)
                continue
            step.input_ids.extend(input_ids)
            step.positions.extend(range(start, start + n))
            step.slot_mapping.extend(slot_mapping)
            step.query_start_loc.append(step.query_start_loc[-1] + n)
            step.seq_lens.append(start + n)
            step.block_tables.append(seq.block_table[:-(-(start + n) // B)])
            step.state_slots.append(seq.state_slot)
            # one row per sampling sequence, its last; a verify step's: one per position, its drafts' included
            step.sample_rows.extend(range(len(step.input_ids) - sample_rows[i], len(step.input_ids)))
            if self.window:
                step.window_block_tables.append(seq.window_table[:-(-(start + n) // B)])
                self._window_rows(step, seq, start, n)
        if self.num_state_slots:
            step.snapshot_slots = [seq.snapshot_slot for seq in batch.seqs]
            step.snapshot_positions = list(batch.snapshots)
            step.state_copies = list(batch.state_copies)
            if batch.num_draft_tokens:  # a hybrid's verify: the state after each of its positions kept in a slot
                step.verify_slots = self._verify_slots(batch)
        return step

    def _window_rows(self, step: HostStep, seq, start: int, n: int) -> None:
        """The window pool's slots of `seq`'s new positions [start, start + n), and its pending copy-on-write pairs."""
        B, table = self.block_size, seq.window_table
        step.window_slot_mapping.extend(table[p // B] * B + p % B for p in range(start, start + n))
        step.window_copies.extend(seq.window_copies)

    @staticmethod
    def _verify_slots(batch: ScheduledBatch) -> list[int]:
        """Per row of the step: for the rows of a hybrid's verify sequence, the slot that keeps the state after that
        row (its last token's: its own slot, updated in place; each draft's: the draft slot the scheduler took for
        it, `KVCacheManager.take_draft_state_slots`), so that the engine keeps the state at the last accepted draft
        by taking its slot, and a rejected one leaves nothing behind (`accept_draft_states`); -1 for other rows."""
        slots: list[int] = []
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new)):
            drafts = batch.draft_ids(i)
            if drafts:
                assert n == 1 + len(drafts) == 1 + len(batch.draft_slots[i]), (seq, n, batch.draft_slots[i])
                slots += [seq.state_slot] + batch.draft_slots[i]
            else:
                slots += [-1] * n
        return slots

    def prepare(self, batch: ScheduledBatch) -> StepInputs:
        """The step's inputs in the eager device buffers, uploaded without waiting for the device."""
        return self.prepare_step(self.host_step(batch))

    def prepare_step(self, step: HostStep) -> StepInputs:
        layout = StepLayout(len(step.input_ids), len(step.seq_lens), step.table_width, len(step.sample_rows),
                            window=self.window > 0)
        self.staging.write(layout, step)
        i64, i32 = self.buffers.reserve(layout)
        self.staging.upload(layout, i64, i32)
        return step_inputs(layout, i64, i32, step, self.block_size)

    def execute(self, batch: ScheduledBatch) -> torch.Tensor:
        if self.cpu_threads is not None:
            self.cpu_threads.before_step()
        graph = self.graphs.for_batch(batch) if self.graphs is not None else None
        if graph is not None:
            self.graph_steps += 1
            return graph.replay(batch)
        return self.run_step(self.host_step(batch))

    def run_step(self, step: HostStep, logits: bool = True) -> torch.Tensor | None:
        """Run one step described by host lists (what a multi-rank executor hands every rank). `logits`: compute
        them (a rank whose logits nobody reads passes False, and gets None)."""
        self.eager_steps += 1
        inputs = self.prepare_step(step)
        if step.window_copies:  # before the forward: copy-on-write of the window pool's shared partial blocks
            self.cow_bytes += self.cache.copy_blocks([], step.window_copies)
        if step.state_copies:  # before the forward: a resumed prefix's state, from its snapshot
            self.copy_states([tuple(pair) for pair in step.state_copies])
        snapshots = list(zip(step.snapshot_slots, step.snapshot_positions)) if any(step.snapshot_positions) else None
        if snapshots:  # each one a whole state copied by the layers (GatedDeltaNet._keep)
            self.state_snapshot_bytes += sum(1 for _, position in snapshots if position) * self.state_bytes_per_slot
        with self.model.step_context(inputs.meta, state_slots=inputs.state_slots, snapshots=snapshots):
            hidden = self.model.forward(inputs.input_ids, inputs.positions)  # [T, H]
        if self.mtp is not None:
            self.hidden_states = hidden
        if not logits:
            return None
        if inputs.sample_rows.numel() == 0:
            return torch.empty((0, self.cfg.vocab_size), device=self.device)
        return self.model.logits(hidden.index_select(0, inputs.sample_rows))  # [S, V]

    def mtp_forward(self, step: HostStep, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One forward of the MTP head (`tsterm.model.mtp`) over the rows `step` describes, `hidden` [T, H] the hidden
        state before each row: its final hidden states at `step.sample_rows` [S, H] and their logits [S, V]."""
        inputs = self.prepare_step(step)
        with self.model.step_context(inputs.meta):
            out = self.mtp.forward(inputs.input_ids, inputs.positions, hidden)  # [T, H]
        rows = out.index_select(0, inputs.sample_rows)
        return rows, self.model.logits(rows)
