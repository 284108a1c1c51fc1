"""Tiny random HF checkpoints made by transformers itself (float32, `save_pretrained`): the real-loading fixture."""
from __future__ import annotations

from pathlib import Path

import torch

BASE = dict(hidden_size=32, intermediate_size=48, moe_intermediate_size=24, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
            rms_norm_eps=1e-6, initializer_range=0.2)

CLASSES = {
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
}


def make_checkpoint(path: Path, model_type: str, overrides: dict | None = None, seed: int = 0,
                    with_tokenizer: bool = True, **save_kwargs):
    """Writes config.json + safetensors (+ tokenizer files) to `path`; returns (path, the transformers model)."""
    import transformers

    from tests.helpers.tokenizers import make_tokenizer_dir, tokenizer_vocab_size

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    vocab_size = 384
    if with_tokenizer:
        tokenizer_vocab = tokenizer_vocab_size(make_tokenizer_dir(path))
        vocab_size = max(vocab_size, tokenizer_vocab)
    config_cls, model_cls = (getattr(transformers, name) for name in CLASSES[model_type])
    kwargs = dict(BASE, **{"vocab_size": vocab_size, **(overrides or {})})  # overrides may widen the vocab
    if model_type in ("mixtral", "olmoe"):  # these use intermediate_size for their experts
        kwargs["intermediate_size"] = kwargs.pop("moe_intermediate_size")
    torch.manual_seed(seed)
    config = config_cls(**kwargs)
    config.eos_token_id = None  # the tokenizer's own files say which ids end a turn
    model = model_cls(config).eval().float()
    model.save_pretrained(path, **save_kwargs)
    return path, model
