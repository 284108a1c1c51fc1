"""Llama (dense): optional biases on q/k/v/o (`attention_bias`), llama3 rope scaling."""
from tsterm.model.arch.spec import ArchSpec

SPEC = ArchSpec("llama", o_bias_from_config=True)
