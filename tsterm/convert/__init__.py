"""Turning checkpoints into model directories tsterm loads: GGUF import (reader, architecture maps, K-quant
repacking, tokenizer), and the random demo checkpoints the tests and benchmarks build."""
