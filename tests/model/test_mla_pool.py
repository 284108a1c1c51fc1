"""Stateful property test of the MLA latent pool under the KV manager's bookkeeping: random interleavings of
admission with shared prefixes (and partial blocks taken over), prefill chunks, decode appends, commit, fork (its
copy-on-write run on the pool itself), free, next turns and eviction pressure, as in tests/engine/test_block_pool.py,
but over the real pool tensor (`MLALatentPool`, two layers). Each write puts, in the token's slot of every layer, a
row that encodes the token's whole context and the layer; the copies the manager asks for are `ModelCache.copy_blocks`.
Every live sequence must read, through its block table as the expanded form reads it (`mla.context_rows`), its own
context's rows at every computed position, in every layer."""
from __future__ import annotations

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from tsterm.config import ModelConfig, SamplingParams
from tsterm.engine.block_pool import BlockPool, NoFreeBlocksError
from tsterm.engine.kv_manager import KVCacheManager
from tsterm.engine.sequence import Sequence
from tsterm.model.arch import MLA, LayerType
from tsterm.model.cache import MLALatentPool, ModelCache
from tsterm.model.mla import context_rows
from tsterm_kernels.metadata import contiguous_runs

MAX_LIVE = 5
MAX_LEN = 20
LAYERS = 2
tokens = st.lists(st.integers(0, 2), max_size=6)  # a tiny vocabulary: prefixes are shared often
CFG = ModelConfig.from_dict(dict(model_type="deepseek_v3", vocab_size=8, hidden_size=8, num_hidden_layers=LAYERS,
                                 num_attention_heads=2, n_routed_experts=4, num_experts_per_tok=2,
                                 moe_intermediate_size=4, kv_lora_rank=3, qk_nope_head_dim=2, qk_rope_head_dim=2,
                                 v_head_dim=2))


class LatentPoolMachine(RuleBasedStateMachine):
    @initialize(block_size=st.integers(1, 4), num_blocks=st.integers(2, 12), caching=st.sampled_from((True, True, False)))
    def setup(self, block_size, num_blocks, caching):
        self.B = block_size
        self.pool = BlockPool(num_blocks, block_size, fingerprint="m", enable_prefix_caching=caching)
        self.kv = KVCacheManager(self.pool)
        self.cache = ModelCache(CFG, (LayerType(MLA, "moe"),) * LAYERS, num_blocks, block_size, torch.float32,
                                torch.device("cpu"))
        assert isinstance(self.cache.pools[MLA], MLALatentPool)
        self.codes: dict[tuple[int, ...], int] = {}  # a context -> its number (exact in float32)
        self.live: list[Sequence] = []
        self.history: list[list[int]] = []

    def _row(self, context: tuple[int, ...], layer: int) -> torch.Tensor:
        code = self.codes.setdefault(context, len(self.codes) + 1)
        width = CFG.kv_lora_rank + CFG.qk_rope_head_dim
        return torch.arange(width, dtype=torch.float32) + 1000.0 * code + 100.0 * layer

    def _pick(self, i: int) -> Sequence:
        return self.live[i % len(self.live)]

    def _compute(self, seq: Sequence, n: int, commit: bool) -> None:
        """allocate_slots + what the model runner does (the pools' copy-on-write, each layer's latent write)."""
        start = seq.num_computed_tokens
        try:
            copies = self.kv.allocate_slots(seq, n)
        except NoFreeBlocksError:
            return
        self.cache.copy_blocks(copies)
        slots = self.kv.slot_mapping(seq, start, start + n)
        for layer in range(LAYERS):
            flat = self.cache.layer(layer).view(-1, CFG.kv_lora_rank + CFG.qk_rope_head_dim)
            for p, slot in zip(range(start, start + n), slots):
                flat[slot] = self._row(tuple(seq.token_ids[:p + 1]), layer)
        seq.num_computed_tokens += n
        if commit:
            self.kv.commit(seq)

    def _admit(self, seq: Sequence) -> None:
        self.kv.match_prefix(seq)
        self.live.append(seq)

    @precondition(lambda self: len(self.live) < MAX_LIVE)
    @rule(data=st.data(), tail=tokens, prefill=st.booleans())
    def new_sequence(self, data, tail, prefill):
        prompt = []
        sources = self.history + [s.token_ids for s in self.live]
        if sources and data.draw(st.booleans()):
            base = data.draw(st.sampled_from(sources))
            prompt = list(base[:data.draw(st.integers(0, len(base)))])
        seq = Sequence((prompt + tail)[:MAX_LEN] or [0], SamplingParams())
        self._admit(seq)
        if prefill:
            self._compute(seq, seq.num_uncomputed_tokens, commit=True)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 99), n=st.integers(1, 6), token=st.integers(0, 2), commit=st.booleans())
    def step(self, i, n, token, commit):
        seq = self._pick(i)
        if seq.num_uncomputed_tokens == 0:
            if len(seq) >= MAX_LEN:
                return
            seq.token_ids.append(token)
        self._compute(seq, min(n, seq.num_uncomputed_tokens), commit)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 99))
    def commit(self, i):
        self.kv.commit(self._pick(i))

    @precondition(lambda self: self.live and len(self.live) < MAX_LIVE)
    @rule(i=st.integers(0, 99), token=st.integers(0, 2), write=st.sampled_from(("child", "parent", "both", "none")))
    def fork(self, i, token, write):
        """n > 1 sampling: the child shares every block; the first token either writes into a shared partial block
        (copied on write first)."""
        parent = self._pick(i)
        child = Sequence(list(parent.token_ids), SamplingParams())
        assert self.kv.fork(parent, child) == []  # no state slots: the latent blocks are shared, copied on write
        self.live.append(child)
        for seq in {"child": (child,), "parent": (parent,), "both": (parent, child), "none": ()}[write]:
            if seq.num_uncomputed_tokens == 0 and len(seq) < MAX_LEN:
                seq.token_ids.append(token)
            if seq.num_uncomputed_tokens:
                self._compute(seq, 1, commit=False)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 99))
    def free(self, i):
        seq = self._pick(i)
        self.kv.free(seq)
        self.live.remove(seq)
        self.history = (self.history + [list(seq.token_ids)])[-8:]

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 99), tail=tokens)
    def next_turn(self, i, tail):
        seq = self._pick(i)
        self.free(i)
        turn = Sequence((seq.token_ids + tail + [0])[:MAX_LEN], SamplingParams())
        self._admit(turn)
        self._compute(turn, turn.num_uncomputed_tokens, commit=True)

    @rule(n=st.integers(1, 12))
    def eviction_pressure(self, n):
        """Someone takes blocks (evicting cached ones LRU), scribbles on them, and gives them back."""
        taken = [self.pool.allocate() for _ in range(min(n, self.pool.num_free))]
        for block_id in taken:
            self.cache.pools[MLA].latent[:, block_id] = -1.0
            self.pool.release(block_id)

    @invariant()
    def sequences_read_their_own_context(self):
        for seq in getattr(self, "live", []):
            n = seq.num_computed_tokens
            if not n:
                continue
            runs = contiguous_runs(seq.block_table, -(-n // self.B))
            for layer in range(LAYERS):
                rows = context_rows(self.cache.layer(layer), runs, n)
                want = torch.stack([self._row(tuple(seq.token_ids[:p + 1]), layer) for p in range(n)])
                assert torch.equal(rows, want), f"{seq}: layer {layer} reads another context"


TestLatentPool = LatentPoolMachine.TestCase
TestLatentPool.settings = settings(max_examples=120, stateful_step_count=40, deadline=None,
                                   suppress_health_check=[HealthCheck.too_slow])
