"""Mixtral: experts under `block_sparse_moe` named w1 (gate), w3 (up), w2 (down); top-k always renormalised."""
from tsterm.model.arch.spec import ArchSpec

SPEC = ArchSpec("mixtral", moe_prefix="block_sparse_moe", expert_names=("w1", "w3", "w2"))
