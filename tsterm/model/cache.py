"""The model's cache: one pool per kind of layer cache, allocated once, behind one interface.

A layer's token mixer decides what it keeps between steps. Full attention keeps every token's K/V in fixed-size
blocks of a paged pool (the block tables, prefix sharing and copy-on-write are the KV manager's bookkeeping; the
pool only holds the data). A recurrent mixer (linear attention, in the hybrid families) keeps one fixed-size
state per sequence instead: it will get a pool of per-sequence state slots, addressed through the step's
`state_slots` input (`tsterm.engine.step_inputs`), registered here in POOLS under its mixer's name.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch

from tsterm.config import ModelConfig
from tsterm.model.arch import FULL_ATTENTION, LayerType
from tsterm.model.parallel import ParallelLayout


class CachePool(ABC):
    """Device memory for every layer of one mixer kind, allocated at construction and never resized.

    - `layers`: the model layer indices this pool serves, in layer order.
    - `layer(i)`: what model layer `i` reads and writes in place (views of the pool, never copies).
    - `copy_blocks(pairs)`: copy-on-write of forked partial KV blocks, `(src, dst)` block ids; returns the bytes
      copied (the only cache data ever copied, and counted). A pool that is not paged copies nothing.
    - `bytes_per_block(...)`: what one KV block of `block_size` tokens costs in this pool over `num_layers` layers,
      used to size the pool from a memory budget (0 for a pool whose size does not grow with context).

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


class PagedKVPool(CachePool):
    """K and V of full-attention layers: `[L_attn, 2 (k, v), num_blocks, block_size, Hkv, D]`, zeroed once
    (Hkv: the rank's KV heads)."""

    def __init__(self, cfg: ModelConfig, layers: tuple[int, ...], num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device, layout: ParallelLayout):
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


# mixer name -> the pool that holds its layers' cache
POOLS: dict[str, type[CachePool]] = {FULL_ATTENTION: PagedKVPool}


def _layers_by_mixer(layer_types: tuple[LayerType, ...]) -> dict[str, tuple[int, ...]]:
    groups: dict[str, list[int]] = {}
    for i, layer_type in enumerate(layer_types):
        groups.setdefault(layer_type.mixer, []).append(i)
    return {mixer: tuple(layers) for mixer, layers in groups.items()}


class ModelCache:
    """Every pool of one model instance, one per mixer kind present; `layer(i)` routes to the right pool."""

    def __init__(self, cfg: ModelConfig, layer_types: tuple[LayerType, ...], num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device, layout: ParallelLayout = ParallelLayout()):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.pools: dict[str, CachePool] = {
            mixer: POOLS[mixer](cfg, layers, num_blocks, block_size, dtype, device, layout)
            for mixer, layers in _layers_by_mixer(layer_types).items()}
        self._pool_of = {layer: pool for pool in self.pools.values() for layer in pool.layers}

    def layer(self, index: int) -> Any:
        return self._pool_of[index].layer(index)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> int:
        """Copy-on-write of forked partial blocks in every pool; returns the bytes copied."""
        return sum(pool.copy_blocks(pairs) for pool in self.pools.values()) if pairs else 0

    @staticmethod
    def bytes_per_block(cfg: ModelConfig, layer_types: tuple[LayerType, ...], block_size: int,
                        dtype: torch.dtype, layout: ParallelLayout = ParallelLayout()) -> int:
        """Bytes one block of `block_size` tokens costs over every pool (what the KV budget is divided by), on the
        rank `layout` names."""
        return sum(POOLS[mixer].bytes_per_block(cfg, len(layers), block_size, dtype, layout)
                   for mixer, layers in _layers_by_mixer(layer_types).items())
