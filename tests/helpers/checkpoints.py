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
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM"),
    "minimax_m2": ("MiniMaxM2Config", "MiniMaxM2ForCausalLM"),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM"),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM"),
    "kimi_k2": ("DeepseekV3Config", "DeepseekV3ForCausalLM"),  # DeepSeek-V3's architecture; config.json says kimi_k2
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
    if model_type in ("mixtral", "olmoe", "minimax_m2", "gpt_oss"):  # these use intermediate_size for their experts
        kwargs["intermediate_size"] = kwargs.pop("moe_intermediate_size")
    if model_type in ("deepseek_v3", "kimi_k2"):  # MLA: transformers sizes its rotation tables by head_dim, the RoPE part
        kwargs["head_dim"] = kwargs.get("qk_rope_head_dim", 64)
    torch.manual_seed(seed)
    config = config_cls(**kwargs)
    config.eos_token_id = None  # the tokenizer's own files say which ids end a turn
    if model_type == "gpt_oss":
        config._attn_implementation = "eager"  # the reference's own sink softmax
    model = model_cls(config).eval().float()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # a selection bias (transformers starts it at zero) that changes which experts win
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.rand(buffer.shape, generator=gen) * 0.5)
        for name, param in model.named_parameters():  # gpt-oss: sinks and biases that matter (zero at init)
            if model_type == "gpt_oss" and name.endswith(("sinks", "_proj_bias", "_proj.bias", "router.bias")):
                param.copy_(torch.randn(param.shape, generator=gen) * (1.5 if name.endswith("sinks") else 0.3))
    model.save_pretrained(path, **save_kwargs)
    if model_type == "kimi_k2":  # as Moonshot ships it: DeepseekV3ForCausalLM under its own model_type
        config_file = path / "config.json"
        config_file.write_text(config_file.read_text().replace('"model_type": "deepseek_v3"', '"model_type": "kimi_k2"'))
    return path, model


# The hybrid families (Gated DeltaNet + gated attention): model_type -> (config class, model class)
HYBRID_CLASSES = {
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM"),
    "qwen3_5_moe_text": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM"),
    "qwen3_5_moe": ("Qwen3_5MoeConfig", "Qwen3_5MoeForConditionalGeneration"),  # multimodal: text_config + vision
}
HYBRID_BASE = dict(BASE, num_hidden_layers=4, num_experts=4, num_experts_per_tok=2, shared_expert_intermediate_size=40,
                   linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
                   linear_conv_kernel_dim=4, max_position_embeddings=256)
TINY_VISION = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32, patch_size=4,
                   num_position_embeddings=16)


def make_hybrid_checkpoint(path: Path, model_type: str, overrides: dict | None = None, seed: int = 0,
                           with_tokenizer: bool = True):
    """A tiny random hybrid checkpoint (+ tokenizer) saved by transformers; returns (path, the causal LM to compare
    with). The parameters transformers initialises to constants (the zero-centred norms, the gated norm, dt_bias) are
    randomised, so a wrong offset or a swapped norm cannot hide behind them. For `qwen3_5_moe` the whole multimodal
    model is saved (vision tower included) and its language model is the oracle."""
    import transformers

    from tests.helpers.tokenizers import make_tokenizer_dir, tokenizer_vocab_size

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    vocab_size = max(384, tokenizer_vocab_size(make_tokenizer_dir(path))) if with_tokenizer else 384
    config_cls, model_cls = (getattr(transformers, name) for name in HYBRID_CLASSES[model_type])
    text = dict(HYBRID_BASE, vocab_size=vocab_size, **(overrides or {}))
    torch.manual_seed(seed)
    if model_type == "qwen3_5_moe":
        config = config_cls(text_config=text, vision_config=TINY_VISION)
        config.text_config.eos_token_id = None
    else:
        config = config_cls(**text)
    config.eos_token_id = None  # the tokenizer's own files say which ids end a turn
    model = model_cls(config).eval().float()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("layernorm.weight", "norm.weight", "dt_bias")):
                param.copy_(torch.randn(param.shape, generator=gen) * 0.3 + (1.0 if name.endswith("dt_bias") else 0.0))
    model.save_pretrained(path)
    if model_type == "qwen3_5_moe":  # the oracle: the language model with the LM head, on text
        lm = transformers.Qwen3_5MoeForCausalLM(config.text_config).eval().float()
        state = {k.replace("model.language_model.", "model."): v for k, v in model.state_dict().items()
                 if not k.startswith("model.visual.")}
        lm.load_state_dict(state)
        model = lm
    return path, model


def perturb_biases_and_norms(path: Path, seed: int = 7, std: float = 0.1) -> None:
    """transformers initialises biases, norm weights and a shared expert's gate to 0 / 1: add noise to them in the
    checkpoint's files, so that a kernel that skipped one would show."""
    from safetensors.torch import load_file, save_file

    gen = torch.Generator().manual_seed(seed)
    for file in path.glob("*.safetensors"):
        tensors = load_file(file)
        save_file({name: t + torch.randn(t.shape, generator=gen) * std
                   if name.endswith((".bias", "norm.weight", "shared_expert_gate.weight")) else t
                   for name, t in tensors.items()}, file)


def add_mtp_head(path: Path, seed: int = 0, std: float = 0.2) -> dict[str, torch.Tensor]:
    """Attach a random multi-token-prediction head to a checkpoint made above (as Qwen3-Next / Qwen3.5 ship one):
    `mtp.safetensors` with `mtp.fc` [H, 2H], the three norms (`pre_fc_norm_embedding`, `pre_fc_norm_hidden`, `norm`)
    and one decoder layer `mtp.layers.0.*` named and shaped like the model's first full-attention layer (attention
    and experts, the shared expert included), every tensor drawn afresh; config.json (a multimodal release's
    `text_config`) gets `mtp_num_hidden_layers: 1`. Returns the tensors written (the tests' reference reads them)."""
    import json

    from safetensors import safe_open
    from safetensors.torch import save_file

    path = Path(path)
    config_path = path / "config.json"
    raw = json.loads(config_path.read_text())
    text = raw.get("text_config") or raw
    prefix = "model.language_model.layers." if "text_config" in raw else "model.layers."
    layer_types = text.get("layer_types") or ["full_attention"] * text["num_hidden_layers"]
    source = f"{prefix}{layer_types.index('full_attention')}."
    zero_centred = text["model_type"].startswith(("qwen3_next", "qwen3_5"))
    H = text["hidden_size"]
    gen = torch.Generator().manual_seed(seed + 1000)

    def norm(size: int) -> torch.Tensor:
        return torch.randn(size, generator=gen) * 0.3 + (0.0 if zero_centred else 1.0)

    tensors = {"mtp.fc.weight": torch.randn(H, 2 * H, generator=gen) * std,
               "mtp.pre_fc_norm_embedding.weight": norm(H), "mtp.pre_fc_norm_hidden.weight": norm(H),
               "mtp.norm.weight": norm(H)}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(file, "pt") as f:
            for name in f.keys():
                if name.startswith(source):
                    shape = tuple(f.get_slice(name).get_shape())
                    new = "mtp.layers.0." + name[len(source):]
                    tensors[new] = norm(shape[0]) if name.endswith("norm.weight") else \
                        torch.randn(shape, generator=gen) * std
    save_file(tensors, str(path / "mtp.safetensors"))
    text["mtp_num_hidden_layers"] = 1
    config_path.write_text(json.dumps(raw, indent=2))
    return tensors


FP8_BLOCKS = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


def store_as_fp8(path: Path, quantization_config: dict | None = None) -> dict[str, torch.Tensor]:
    """Rewrite a checkpoint made by `make_checkpoint` as DeepSeek's / Moonshot's FP8 releases store it: every
    `*_proj` (and MLA's `kv_a_proj_with_mqa`) matrix as e4m3 values with a `_scale_inv` per 128 x 128 block, and
    `quantization_config` in config.json (default: DeepSeek-V3's). Returns the stored tensors."""
    import json

    from safetensors.torch import load_file, save_file
    from tsterm_kernels.quant import quantize_fp8

    tensors = load_file(path / "model.safetensors")
    for name in [n for n in tensors if n.endswith(("_proj.weight", "_proj_with_mqa.weight"))]:
        q = quantize_fp8(tensors[name])
        tensors[name], tensors[name + "_scale_inv"] = q.data, q.scale
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = FP8_BLOCKS if quantization_config is None else quantization_config
    (path / "config.json").write_text(json.dumps(config))
    return tensors
