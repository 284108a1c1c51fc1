"""The model's cache: one pool per kind of layer cache, allocated once, behind one interface.

A layer's token mixer decides what it keeps between steps. Full attention keeps every token's K/V in fixed-size
blocks of a paged pool (the block tables, prefix sharing and copy-on-write are the KV manager's bookkeeping; the
pool only holds the data). A recurrent mixer (linear attention, in the hybrid families) keeps one fixed-size
state per sequence instead: a pool of per-sequence state slots (`RecurrentStatePool`), addressed through the step's
`state_slots` input (`tsterm.engine.step_inputs`); the engine gives a sequence its slot when it is admitted and takes
it back when it is freed. Each pool is registered in POOLS under its mixer's name.

A model with both sliding-window and full attention layers (gpt-oss) may keep its sliding layers' K/V in a pool of
their own (`WINDOW_POOL`, `num_window_blocks` > 0): a `PagedKVPool` under block ids of its own, which the KV manager
hands out per sequence (`Sequence.window_table`) and takes back once they fall out of every later position's window.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch

from tsterm.config import ModelConfig
from tsterm.model.arch import FULL_ATTENTION, LINEAR_ATTENTION, MLA, LayerType
from tsterm.model.parallel import ParallelLayout


class CachePool(ABC):
    """Device memory for every layer of one mixer kind, allocated at construction and never resized.

    - `layers`: the model layer indices this pool serves, in layer order.
    - `layer(i)`: what model layer `i` reads and writes in place (views of the pool, never copies).
    - `copy_blocks(pairs)`: copy-on-write of forked partial KV blocks, `(src, dst)` block ids; returns the bytes
      copied (the only cache data ever copied, and counted). A pool that is not paged copies nothing.
    - `bytes_per_block(...)`: what one KV block of `block_size` tokens costs in this pool over `num_layers` layers,
      used to size the pool from a memory budget (0 for a pool whose size does not grow with context).
    - `bytes_per_slot(...)`: what one sequence's state slot costs over `num_layers` layers (0 for a paged pool); the
      slots are allocated up front, and their bytes come off the KV budget.

    A pool holds one rank's share (`layout`): the heads that rank computes, under the same block ids on every rank.
    """

    layers: tuple[int, ...]

    @abstractmethod
    def layer(self, index: int) -> Any: ...

    @abstractmethod
    def copy_blocks(self, pairs: list[tuple[int, int]]) -> int: ...

    @staticmethod
    @abstractmethod
    def bytes_per_block(cfg: ModelConfig, num_layers: int, block_size: int, dtype: torch.dtype,
                        layout: ParallelLayout) -> int: ...

    @staticmethod
    def bytes_per_slot(cfg: ModelConfig, num_layers: int, dtype: torch.dtype, layout: ParallelLayout) -> int:
        return 0

    def copy_slots(self, pairs: list[tuple[int, int]]) -> int:
        """Copy per-sequence states `(src, dst)` slot to slot (a snapshot resumed); returns the bytes copied."""
        return 0


class PagedKVPool(CachePool):
    """K and V of full-attention layers: `[L_attn, 2 (k, v), num_blocks, block_size, Hkv, D]`, zeroed once
    (Hkv: the rank's KV heads)."""

    def __init__(self, cfg: ModelConfig, layers: tuple[int, ...], num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device, layout: ParallelLayout, num_slots: int = 0):
        self.layers = layers
        self._index = {layer: i for i, layer in enumerate(layers)}
        _, num_kv_heads = layout.kv_heads(cfg)
        self.kv = torch.zeros((len(layers), 2, num_blocks, block_size, num_kv_heads, cfg.head_dim),
                              dtype=dtype, device=device)

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(k_cache, v_cache) of model layer `index`: [num_blocks, block_size, Hkv, D] views of the pool."""
        kv = self.kv[self._index[index]]
        return kv[0], kv[1]

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> int:
        for src, dst in pairs:
            self.kv[:, :, dst].copy_(self.kv[:, :, src])
        return len(pairs) * self.kv[:, :, 0].numel() * self.kv.element_size()

    @staticmethod
    def bytes_per_block(cfg: ModelConfig, num_layers: int, block_size: int, dtype: torch.dtype,
                        layout: ParallelLayout) -> int:
        _, num_kv_heads = layout.kv_heads(cfg)
        return 2 * num_layers * block_size * num_kv_heads * cfg.head_dim * dtype.itemsize


class RecurrentStatePool(CachePool):
    """Per-sequence states of Gated DeltaNet layers, one slot per live sequence, zeroed once (a sequence starting at
    position 0 clears its own slot): the conv's last K-1 inputs `[L_lin, num_slots, C, K-1]` in the model dtype and
    the delta rule's state `[L_lin, num_slots, Hv, dk, dv]` in float32 (it accumulates over the whole context);
    C and Hv of this rank's heads (`ParallelLayout.linear_heads`)."""

    def __init__(self, cfg: ModelConfig, layers: tuple[int, ...], num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device, layout: ParallelLayout, num_slots: int = 0):
        assert num_slots > 0, "a recurrent-state pool needs slots (one per sequence the engine may run at once)"
        self.layers = layers
        self._index = {layer: i for i, layer in enumerate(layers)}
        _, _, _, num_v_heads = layout.linear_heads(cfg)  # this rank's heads
        self.conv = torch.zeros((len(layers), num_slots, self._conv_channels(cfg, layout),
                                 cfg.linear_conv_kernel_dim - 1), dtype=dtype, device=device)
        self.recurrent = torch.zeros((len(layers), num_slots, num_v_heads, cfg.linear_key_head_dim,
                                      cfg.linear_value_head_dim), dtype=torch.float32, device=device)

    @staticmethod
    def _conv_channels(cfg: ModelConfig, layout: ParallelLayout) -> int:
        """The conv's channels on this rank: q and k of its key heads, v of its value heads."""
        _, num_k_heads, _, num_v_heads = layout.linear_heads(cfg)
        return 2 * num_k_heads * cfg.linear_key_head_dim + num_v_heads * cfg.linear_value_head_dim

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(conv_states [num_slots, C, K-1], recurrent_states [num_slots, Hv, dk, dv]) of model layer `index`: views."""
        i = self._index[index]
        return self.conv[i], self.recurrent[i]

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> int:
        return 0  # not paged: no block of KV lives here

    def copy_slots(self, pairs: list[tuple[int, int]]) -> int:
        for src, dst in pairs:
            if src != dst:
                self.conv[:, dst].copy_(self.conv[:, src])
                self.recurrent[:, dst].copy_(self.recurrent[:, src])
        per_slot = self.conv[:, 0].numel() * self.conv.element_size() + \
            self.recurrent[:, 0].numel() * self.recurrent.element_size()
        return sum(src != dst for src, dst in pairs) * per_slot

    @staticmethod
    def bytes_per_block(cfg: ModelConfig, num_layers: int, block_size: int, dtype: torch.dtype,
                        layout: ParallelLayout) -> int:
        return 0

    @staticmethod
    def bytes_per_slot(cfg: ModelConfig, num_layers: int, dtype: torch.dtype, layout: ParallelLayout) -> int:
        _, _, _, num_v_heads = layout.linear_heads(cfg)
        conv = RecurrentStatePool._conv_channels(cfg, layout) * (cfg.linear_conv_kernel_dim - 1) * dtype.itemsize
        recurrent = num_v_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * 4
        return num_layers * (conv + recurrent)


class MLALatentPool(CachePool):
    """Multi-head Latent Attention layers (`tsterm.model.mla`): per token only the normalised latent and the rotated
    RoPE key, `[L_mla, num_blocks, block_size, 1, kv_lora_rank + qk_rope_head_dim]`, zeroed once. Paged under the
    same block ids as a KV pool (prefix reuse, forks, eviction are the KV manager's, unchanged); the latent is every
    rank's (the heads are expanded from it), so a rank holds all of it."""

    def __init__(self, cfg: ModelConfig, layers: tuple[int, ...], num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device, layout: ParallelLayout, num_slots: int = 0):
        self.layers = layers
        self._index = {layer: i for i, layer in enumerate(layers)}
        self.latent = torch.zeros((len(layers), num_blocks, block_size, 1, cfg.kv_lora_rank + cfg.qk_rope_head_dim),
                                  dtype=dtype, device=device)

    def layer(self, index: int) -> torch.Tensor:
        """Model layer `index`'s [num_blocks, block_size, 1, kv_lora_rank + qk_rope_head_dim] view of the pool."""
        return self.latent[self._index[index]]

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> int:
        for src, dst in pairs:
            self.latent[:, dst].copy_(self.latent[:, src])
        return len(pairs) * self.latent[:, 0].numel() * self.latent.element_size()

    @staticmethod
    def bytes_per_block(cfg: ModelConfig, num_layers: int, block_size: int, dtype: torch.dtype,
                        layout: ParallelLayout) -> int:
        return num_layers * block_size * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * dtype.itemsize


# mixer name -> the pool that holds its layers' cache
POOLS: dict[str, type[CachePool]] = {FULL_ATTENTION: PagedKVPool, LINEAR_ATTENTION: RecurrentStatePool,
                                     MLA: MLALatentPool}


# the key, in `ModelCache.pools`, of the sliding-window layers' own pool (a `PagedKVPool` with its own block ids)
WINDOW_POOL = "sliding_window"


def sliding_window(layer_types: tuple[LayerType, ...]) -> int:
    """The window a window pool keeps for a model (the largest of its sliding layers'), when it has full attention
    layers with a window beside layers without one; else 0 (no window pool: every layer keeps every block)."""
    windows = [t.window for t in layer_types if t.mixer == FULL_ATTENTION and t.window]
    return max(windows) if windows and len(windows) < len(layer_types) else 0


def _layers_by_mixer(layer_types: tuple[LayerType, ...], window_pool: bool = False) -> dict[str, tuple[int, ...]]:
    """Model layers by the pool that keeps them: their mixer's, or `WINDOW_POOL` for sliding layers with one."""
    groups: dict[str, list[int]] = {}
    for i, layer_type in enumerate(layer_types):
        windowed = window_pool and layer_type.mixer == FULL_ATTENTION and layer_type.window
        groups.setdefault(WINDOW_POOL if windowed else layer_type.mixer, []).append(i)
    return {mixer: tuple(layers) for mixer, layers in groups.items()}


def _pool_class(key: str) -> type[CachePool]:
    return PagedKVPool if key == WINDOW_POOL else POOLS[key]


class ModelCache:
    """Every pool of one model instance, one per mixer kind present; `layer(i)` routes to the right pool."""

    def __init__(self, cfg: ModelConfig, layer_types: tuple[LayerType, ...], num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device, layout: ParallelLayout = ParallelLayout(),
                 num_state_slots: int = 0, num_window_blocks: int = 0):
        """num_state_slots: sequences a recurrent-state pool holds at once (`state_slots` the engine hands out).
        num_window_blocks: blocks of the sliding layers' own pool (`WINDOW_POOL`; 0: none, they share the others')."""
        assert not num_window_blocks or sliding_window(layer_types), "a window pool for a model without one"
        self.num_blocks, self.block_size, self.num_state_slots = num_blocks, block_size, num_state_slots
        self.num_window_blocks = num_window_blocks
        self.pools: dict[str, CachePool] = {
            key: _pool_class(key)(cfg, layers, num_window_blocks if key == WINDOW_POOL else num_blocks, block_size,
                                  dtype, device, layout, num_slots=num_state_slots)
            for key, layers in _layers_by_mixer(layer_types, num_window_blocks > 0).items()}
        self._pool_of = {layer: pool for pool in self.pools.values() for layer in pool.layers}
        window = self.pools.get(WINDOW_POOL)
        self.window_layers: tuple[int, ...] = window.layers if window is not None else ()

    def layer(self, index: int) -> Any:
        return self._pool_of[index].layer(index)

    def copy_blocks(self, pairs: list[tuple[int, int]], window_pairs: list[tuple[int, int]] = ()) -> int:
        """Copy-on-write of forked partial blocks in every pool (`window_pairs`: the window pool's, under its own
        ids); returns the bytes copied."""
        total = 0
        for key, pool in self.pools.items():
            todo = window_pairs if key == WINDOW_POOL else pairs
            if todo:
                total += pool.copy_blocks(list(todo))
        return total

    def copy_slots(self, pairs: list[tuple[int, int]]) -> int:
        """Copy per-sequence states slot to slot in every state pool (a snapshot resumed); returns the bytes copied."""
        return sum(pool.copy_slots(pairs) for pool in self.pools.values()) if pairs else 0

    @staticmethod
    def bytes_per_block(cfg: ModelConfig, layer_types: tuple[LayerType, ...], block_size: int,
                        dtype: torch.dtype, layout: ParallelLayout = ParallelLayout(), pools: str = "all") -> int:
        """Bytes one block of `block_size` tokens costs over every pool (what the KV budget is divided by), on the
        rank `layout` names. pools: "all"; "main": without the sliding layers (a window pool's model's main block);
        "window": the sliding layers' only (its window pool's block)."""
        groups = _layers_by_mixer(layer_types, pools != "all")
        return sum(_pool_class(key).bytes_per_block(cfg, len(layers), block_size, dtype, layout)
                   for key, layers in groups.items() if pools == "all" or (key == WINDOW_POOL) == (pools == "window"))

    @staticmethod
    def bytes_per_slot(cfg: ModelConfig, layer_types: tuple[LayerType, ...], dtype: torch.dtype,
                       layout: ParallelLayout = ParallelLayout()) -> int:
        """Bytes one sequence's state slot costs over every pool (0 for a model without recurrent layers)."""
        return sum(POOLS[mixer].bytes_per_slot(cfg, len(layers), dtype, layout)
                   for mixer, layers in _layers_by_mixer(layer_types).items())


def window_pool_blocks(window: int, block_size: int, max_num_seqs: int, max_num_batched_tokens: int,
                       num_speculative_tokens: int = 0) -> tuple[int, int]:
    """(least, auto): the window pool's block counts for a model whose sliding layers keep `window` positions, its
    reserved null block included. `least`: what one request alone needs at most (its window, the block its next
    token goes into and its drafts', and one step's prompt chunk on top): no request can wait for the window pool
    forever. `auto`, the default size: a window per sequence the scheduler may run at once and the chunk (what the
    running sequences hold), plus as much again for the prefix cache (a cached window per sequence: the next turns'
    prompts resume there). The executor takes at most one block more than the main pool has (a window table is never
    longer than its block table)."""
    per_seq = -(-(window + num_speculative_tokens) // block_size) + 1
    chunk = -(-max_num_batched_tokens // block_size)
    return 1 + per_seq + chunk, 1 + 2 * max_num_seqs * per_seq + chunk


def num_state_slots(layer_types: tuple[LayerType, ...], max_num_seqs: int, prefix_caching: bool,
                    num_speculative_tokens: int = 0) -> int:
    """State slots a model holds when some layer keeps a per-sequence state (linear attention), else 0. The executor
    sizes its pool and the engine numbers its slots by this; their bytes come off the KV budget (and the profile run's
    fit check counts them).

    What the sequences the scheduler may run at once (`max_num_seqs`, every sample of an n > 1 request included:
    admission refuses n > max_num_seqs) can hold at the same time, so that handing a slot out never fails:
    - one live state per running sequence;
    - with prefix caching, one snapshot slot per running sequence (its state at the last block boundary it computed),
      and one kept snapshot per running sequence that a resumed prefix is copied from: `use_snapshot` holds it until
      the step that copies it has run, and every running sequence may have been admitted in that one step;
    - with speculative decoding (`num_speculative_tokens` drafts a step at most), one slot per draft of every running
      sequence: a verify step keeps the state after each of its positions (the last token's in the sequence's own
      slot, each draft's in one of these), and the sequence keeps the one at its last accepted position by taking
      that slot (`KVCacheManager.accept_draft_states`), so rejected drafts cost no copy.
    Kept snapshots beyond those (finished turns' states for reuse) take the slots no live sequence holds."""
    if not any(layer_type.mixer == LINEAR_ATTENTION for layer_type in layer_types):
        return 0
    live = max_num_seqs
    snapshots = restores = max_num_seqs if prefix_caching else 0
    return live + snapshots + restores + max_num_seqs * num_speculative_tokens
