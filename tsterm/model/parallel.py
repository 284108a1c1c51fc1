"""The model's parallel seam: which shard of the weights a rank holds, and the collectives that join the shards.

A model instance is built for one rank of a `ParallelLayout` (tensor-parallel size x expert-parallel size; rank
r is tensor-parallel rank `r % tp` of expert-parallel group `r // tp`) and talks to the other ranks only through
its `ParallelContext`. The single-rank context (`SingleRank`) holds everything and reduces nothing, so the
one-process engine runs the same model code. The torch.distributed context lives in `tsterm.distributed`; this
module does not import torch.distributed.

How the shards are cut (every rank of the same tensor-parallel rank holds the same attention and dense shards):
- attention: query heads split over the tp ranks; KV heads split too, or, when there are fewer KV heads than
  tp ranks, each rank keeps the one KV head its query heads read (replicated). o_proj by columns; one
  all-reduce over the tp group. A gated attention layer's gate rows go with their query heads.
- linear attention (Gated DeltaNet): key heads and the value heads that read them split over the tp ranks, with
  their conv channels and their recurrent state (each rank's state slots hold its heads only); out_proj by
  columns; one all-reduce over the tp group.
- dense MLPs: gate/up by rows, down by columns of the intermediate dimension; one all-reduce over the tp group.
- routed experts: the experts split over the ep groups, each expert's intermediate dimension over the tp ranks
  of the group; the shared expert's intermediate dimension over all ranks. Every rank computes its pieces for all
  tokens (routing is replicated, on the device) and one all-reduce over all ranks sums them: the cheap choice
  at small batch. An all-to-all token dispatch would send each token only to its experts' ranks; not done yet.
- embedding and LM head: by vocabulary rows over the tp ranks; the embedding is all-reduced, the logits
  all-gathered.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from tsterm.config import ModelConfig
from tsterm.errors import ConfigError
from tsterm.model.arch import ARCHITECTURES, LINEAR_ATTENTION


def split(n: int, parts: int, index: int) -> tuple[int, int]:
    """(start, count) of part `index` when `n` items split evenly into `parts` (callers check divisibility)."""
    count = n // parts
    return index * count, count


@dataclass(frozen=True, slots=True)
class ParallelLayout:
    """Where one rank sits: tp_size x ep_size ranks, this one `rank`."""

    tp_size: int = 1
    ep_size: int = 1
    rank: int = 0

    @property
    def world_size(self) -> int:
        return self.tp_size * self.ep_size

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def ep_rank(self) -> int:
        return self.rank // self.tp_size

    def check(self, cfg: ModelConfig, model: str = "the model") -> None:
        """Refuse a layout this model cannot be cut into, naming the sizes and what would work."""
        tp, ep = self.tp_size, self.ep_size
        if tp == 1 and ep == 1:
            return
        hq, hkv = cfg.num_attention_heads, cfg.num_key_value_heads
        if hq % tp:
            raise ConfigError(f"tensor_parallel_size={tp}: {model} has {hq} attention heads, not a multiple of {tp}; "
                              f"use a tensor_parallel_size that divides {hq}")
        if hkv % tp and tp % hkv:
            raise ConfigError(f"tensor_parallel_size={tp}: {model} has {hkv} KV heads; the KV heads split only when "
                              f"the size divides {hkv} or is a multiple of it (then each rank keeps a copy of one)")
        if tp > 1 and ARCHITECTURES[cfg.model_type].qk_norm == "full":  # a q/k RMSNorm over every head
            raise ConfigError(f"tensor_parallel_size={tp}: {cfg.model_type} normalises q and k over all heads, which "
                              "tensor parallelism does not split yet; use expert_parallel_size instead")
        if LINEAR_ATTENTION in ARCHITECTURES[cfg.model_type].mixers and cfg.linear_num_key_heads % tp:
            raise ConfigError(f"tensor_parallel_size={tp}: {model} has {cfg.linear_num_key_heads} linear-attention "
                              f"key heads, not a multiple of {tp}; use a tensor_parallel_size that divides "
                              f"{cfg.linear_num_key_heads}")
        widths = {"intermediate_size": cfg.intermediate_size, "moe_intermediate_size": cfg.moe_intermediate_size}
        for name, width in widths.items():
            if width and width % tp:
                raise ConfigError(f"tensor_parallel_size={tp}: {model}'s {name} ({width}) is not a multiple of {tp}")
        if cfg.shared_expert_intermediate_size % self.world_size:
            raise ConfigError(f"{self.world_size} ranks: {model}'s shared_expert_intermediate_size "
                              f"({cfg.shared_expert_intermediate_size}) is not a multiple of {self.world_size}")
        if ep > 1 and cfg.num_experts == 0:
            raise ConfigError(f"expert_parallel_size={ep}: {model} is dense (no experts); use tensor_parallel_size")
        if cfg.num_experts % ep:
            raise ConfigError(f"expert_parallel_size={ep}: {model} has {cfg.num_experts} experts, not a multiple of "
                              f"{ep}; use a size that divides {cfg.num_experts}")

    def q_heads(self, cfg: ModelConfig) -> tuple[int, int]:
        """(first, count) of this rank's query heads."""
        return split(cfg.num_attention_heads, self.tp_size, self.tp_rank)

    def kv_heads(self, cfg: ModelConfig) -> tuple[int, int]:
        """(first, count) of the KV heads this rank keeps: its share, or the one its query heads read."""
        hkv = cfg.num_key_value_heads
        if hkv >= self.tp_size:
            return split(hkv, self.tp_size, self.tp_rank)
        first_q, _ = self.q_heads(cfg)
        return first_q // (cfg.num_attention_heads // hkv), 1

    def linear_heads(self, cfg: ModelConfig) -> tuple[int, int, int, int]:
        """(first, count) of this rank's linear-attention key heads, then of its value heads: the value heads
        that read those key heads (value head j reads key head j // (Hv / Hk))."""
        k_first, k_count = split(cfg.linear_num_key_heads, self.tp_size, self.tp_rank)
        return (k_first, k_count) + split(cfg.linear_num_value_heads, self.tp_size, self.tp_rank)

    def experts(self, num_experts: int) -> tuple[int, int]:
        """(first, count) of this rank's routed experts."""
        return split(num_experts, self.ep_size, self.ep_rank)

    def vocab(self, vocab_size: int) -> tuple[int, int, int]:
        """(first, count, rows per rank) of this rank's vocabulary rows; the last rank may hold fewer."""
        per_rank = -(-vocab_size // self.tp_size)
        first = min(self.tp_rank * per_rank, vocab_size)
        return first, min(per_rank, vocab_size - first), per_rank


class ParallelContext(ABC):
    """A rank's collectives, over the groups its `layout` names. Each call is made by every rank of the group, in
    the same order (the model's forward guarantees it); tensors are reduced in place."""

    layout: ParallelLayout

    @abstractmethod
    def all_reduce_tp(self, tensor: torch.Tensor) -> None:
        """Sum over this rank's tensor-parallel group."""

    @abstractmethod
    def all_reduce_all(self, tensor: torch.Tensor) -> None:
        """Sum over every rank (the experts' partial outputs)."""

    @abstractmethod
    def all_gather_tp(self, tensor: torch.Tensor) -> torch.Tensor:
        """[tp_size, *tensor.shape]: each tensor-parallel rank's tensor, in rank order."""

    @abstractmethod
    def agree_min(self, value: int) -> int:
        """The smallest `value` over every rank (the KV blocks that fit on all of them)."""


class SingleRank(ParallelContext):
    """One process holds every weight: nothing to reduce."""

    layout = ParallelLayout()

    def all_reduce_tp(self, tensor: torch.Tensor) -> None:
        pass

    def all_reduce_all(self, tensor: torch.Tensor) -> None:
        pass

    def all_gather_tp(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor[None]

    def agree_min(self, value: int) -> int:
        return value
