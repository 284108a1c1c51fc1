"""Qwen3 (dense): per-head RMSNorm on q and k."""
from tsterm.model.arch import ArchSpec, register

SPEC = register(ArchSpec("qwen3", qk_norm="head"))
