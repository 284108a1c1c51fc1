"""Qwen3 (dense): per-head RMSNorm on q and k."""
from tsterm.model.arch.spec import ArchSpec

SPEC = ArchSpec("qwen3", qk_norm="head")
