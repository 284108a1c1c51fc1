"""Tiny GGUF files written the way llama.cpp's converter writes them, from a tiny transformers model.

`write_gguf(path, model)` stores the model's weights under llama.cpp names and layout: q/k rows permuted for the
`llama` arch (interleaved rope pairs), experts as `ffn_{gate,up,down}_exps [E, out, in]`, the qwen2moe shared-expert
gate squeezed to a vector. The tokenizer is byte-level: the 256 byte symbols, a few merges and control tokens.
Tensors are quantized with gguf-py's own quantizers (Q8_0, Q4_0, Q4_1, Q5_x, BF16; `quantize=`, or
`quantize_linear` for every linear weight); gguf-py has none for k-quants: Q4_K / Q5_K / Q6_K get this module's own
(`quantize_kquant`), the other k-quants random blocks.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

# transformers model_type -> llama.cpp general.architecture (Mixtral is a llama with experts there)
GGUF_ARCH = {"llama": "llama", "mixtral": "llama", "qwen3": "qwen3", "qwen3_moe": "qwen3moe",
             "qwen2_moe": "qwen2moe"}
CONTROL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
MERGES = ("Ġ t", "h e", "Ġt he", "i n", "Ġ a", "e r", "o n", "Ġ s")
CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")

LEAF_NAMES = {
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias", "self_attn.o_proj.bias": "attn_output.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight", "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.experts.down_proj": "ffn_down_exps.weight", "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
    "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
}


def byte_symbols() -> list[str]:
    """The 256 printable stand-ins byte-level BPE uses for raw bytes, in byte order."""
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    symbols, shift = {}, 0
    for b in range(256):
        if b in keep:
            symbols[b] = chr(b)
        else:
            symbols[b] = chr(256 + shift)
            shift += 1
    return [symbols[b] for b in range(256)]


def tiny_vocab(vocab_size: int) -> tuple[list[str], list[int]]:
    """Control tokens first (ids 0..2), then bytes, merge results, and reserved control tokens up to the size."""
    tokens = list(CONTROL_TOKENS) + byte_symbols()
    tokens += [m.replace(" ", "") for m in MERGES]
    types = [3] * len(CONTROL_TOKENS) + [1] * (len(tokens) - len(CONTROL_TOKENS))
    for i in range(vocab_size - len(tokens)):
        tokens.append(f"<|reserved_{i}|>")
        types.append(3)
    assert len(tokens) == vocab_size, (len(tokens), vocab_size)
    return tokens, types


SPM_PIECES = ("\u2581", "t", "h", "e", "a", "s", "n", "i", "o", "r", "\u2581t", "he", "\u2581the", "in", "\u2581a",
              "er", "on", "\u2581s", "\u2581th", "ea", "\u2581sea")


def tiny_sentencepiece_vocab(vocab_size: int) -> tuple[list[str], list[int], list[float]]:
    """Llama-2 style: <unk> <s> </s>, the 256 <0xNN> byte-fallback tokens, scored pieces, a user-defined token."""
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *SPM_PIECES, "<think>"]
    types = [2, 3, 3, *[6] * 256, *[1] * len(SPM_PIECES), 4]
    scores = [0.0] * 259 + [-float(i) for i in range(len(SPM_PIECES))] + [0.0]
    scores[259 + SPM_PIECES.index("\u2581sea")] = 5.0  # a late piece that outranks earlier ones
    for i in range(vocab_size - len(tokens)):
        tokens.append(f"<ctrl_{i}>")
        types.append(3)
        scores.append(0.0)
    assert len(tokens) == vocab_size, (len(tokens), vocab_size)
    return tokens, types, scores


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's q/k row order for its `llama` arch: each head's two rope halves interleaved pairwise."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_tensors(model, arch: str) -> dict[str, np.ndarray]:
    """The model's weights under llama.cpp names (float32 numpy, [out, in] like the file's reversed dims)."""
    cfg = model.config
    out: dict[str, np.ndarray] = {}
    for name, tensor in model.state_dict().items():
        w = tensor.detach().float().numpy().copy()
        if name == "model.embed_tokens.weight":
            out["token_embd.weight"] = w
        elif name == "model.norm.weight":
            out["output_norm.weight"] = w
        elif name == "lm_head.weight":
            if not cfg.tie_word_embeddings:
                out["output.weight"] = w
        else:
            layer, leaf = name.removeprefix("model.layers.").split(".", 1)
            if leaf == "mlp.experts.gate_up_proj":  # [E, 2I, H] -> two [E, I, H]
                half = w.shape[1] // 2
                out[f"blk.{layer}.ffn_gate_exps.weight"] = w[:, :half]
                out[f"blk.{layer}.ffn_up_exps.weight"] = w[:, half:]
                continue
            if arch == "llama" and leaf.startswith(("self_attn.q_proj", "self_attn.k_proj")):
                heads = cfg.num_attention_heads if "q_proj" in leaf else cfg.num_key_value_heads
                w = llama_cpp_permute(w, heads)
            if leaf == "mlp.shared_expert_gate.weight":
                w = w.reshape(-1)
            out[f"blk.{layer}.{LEAF_NAMES[leaf]}"] = w
    return out


# llama.cpp leaf names of the weights a model multiplies by (what a native import keeps as blocks)
LINEAR_GGUF_LEAVES = ("attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight", "ffn_gate.weight",
                      "ffn_up.weight", "ffn_down.weight", "ffn_gate_exps.weight", "ffn_up_exps.weight",
                      "ffn_down_exps.weight", "ffn_gate_shexp.weight", "ffn_up_shexp.weight", "ffn_down_shexp.weight")


def quantize_linear(model, qtype, head: bool = True, **overrides) -> dict[str, object]:
    """A `quantize=` map for `write_gguf`: every linear weight of `model` (and the output / tied embedding when
    `head`) as `qtype`, then `overrides` (GGUF name -> type) on top."""
    arch = GGUF_ARCH[model.config.model_type]
    names = [n for n in gguf_tensors(model, arch)
             if n.endswith(LINEAR_GGUF_LEAVES) or (head and n in ("output.weight", "token_embd.weight"))]
    return {**{n: qtype for n in names}, **overrides}


def write_gguf(path: Path, model, quantize: dict[str, object] | None = None, chat_template: str | None = CHATML,
               tensors: dict[str, np.ndarray] | None = None, arch: str | None = None, metadata=None,
               tokenizer: str = "gpt2") -> Path:
    """Writes `model` as a GGUF at `path`. `quantize` maps tensor names to a GGMLQuantizationType to store them in;
    `tokenizer` is "gpt2" (byte-level BPE with merges) or "llama" (SentencePiece scores, no merges)."""
    import gguf

    cfg = model.config
    arch = arch or GGUF_ARCH[cfg.model_type]
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name("tiny-test-model")
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_rope_dimension_count(head_dim)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_vocab_size(cfg.vocab_size)
    experts = getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", None)
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(cfg.num_experts_per_tok)
        writer.add_expert_feed_forward_length(getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size)
        if getattr(cfg, "shared_expert_intermediate_size", 0):
            writer.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    if tokenizer == "gpt2":
        tokens, types = tiny_vocab(cfg.vocab_size)
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("qwen2")
        writer.add_token_merges(list(MERGES))
        writer.add_pad_token_id(0)
        writer.add_add_bos_token(False)
    else:
        tokens, types, scores = tiny_sentencepiece_vocab(cfg.vocab_size)
        writer.add_tokenizer_model("llama")
        writer.add_token_scores(scores)
        writer.add_unk_token_id(0)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    if chat_template:
        writer.add_chat_template(chat_template)
    for key, value in (metadata or {}).items():  # raw extra keys, e.g. {"{arch}.rope.scaling.type": "linear"}
        key = key.format(arch=arch)
        if isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        else:
            writer.add_uint32(key, value)
    for i, (name, w) in enumerate((tensors if tensors is not None else gguf_tensors(model, arch)).items()):
        qtype = (quantize or {}).get(name)
        if qtype is None:
            writer.add_tensor(name, np.ascontiguousarray(w))
            continue
        try:
            blocks = gguf.quants.quantize(np.ascontiguousarray(w, dtype=np.float32), qtype)
        except NotImplementedError:  # gguf-py cannot quantize k-quants: ours, or random blocks of that type
            blocks = quantize_kquant(w, qtype) if qtype.name in KQUANT_BYTES else random_blocks(w.shape, qtype, seed=i)
        writer.add_tensor(name, blocks, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(path)


# k-quant blocks: (byte offset, value) of their float16 super-block scales; the rest of a block is free bits
KQUANT_SCALES = {"Q4_K": ((0, 2e-4), (2, 2e-4)), "Q5_K": ((0, 1e-4), (2, 1e-4)), "Q6_K": ((-2, 5e-5),),
                 "Q2_K": ((-4, 1e-3), (-2, 1e-3)), "Q3_K": ((-2, 1e-3),)}


def random_blocks(shape: tuple[int, ...], qtype, seed: int = 0) -> np.ndarray:
    """Random bytes of a quantized tensor with small, finite scales, so they dequantize to weights of ~0.1."""
    import gguf

    block_elems, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    rows, cols = int(np.prod(shape[:-1])), shape[-1]
    raw = np.random.default_rng(seed).integers(0, 256, (rows, cols // block_elems, block_bytes), dtype=np.uint8)
    for offset, value in KQUANT_SCALES[qtype.name]:
        raw[..., offset:offset + 2 or None] = np.frombuffer(np.float16(value).tobytes(), np.uint8)
    return raw.reshape(*shape[:-1], cols // block_elems * block_bytes)


KQUANT_BYTES = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}  # bytes per super-block of 256 weights


def _f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).astype(np.float32)


def _inverse(step: np.ndarray) -> np.ndarray:
    return np.divide(1.0, step, out=np.zeros_like(step), where=step != 0)


def quantize_kquant(w: np.ndarray, qtype) -> np.ndarray:
    """Float weights [..., I] (I a multiple of 256) as Q4_K / Q5_K / Q6_K bytes [..., I / 256 * bytes per block]. A
    plain fit (not llama.cpp's error-minimising search, so a little less accurate, but the same format and the
    same kind of values): Q4_K / Q5_K each sub-block of 32 from its min (<= 0) to its max, Q6_K each 16 by its
    max |w|; those scales rounded to 6 / 8 bits against the super-block's float16 d (and dmin)."""
    name = getattr(qtype, "name", qtype)
    x = np.asarray(w, dtype=np.float32).reshape(-1, 256)
    if name == "Q6_K":
        out = _q6_k(x)
    else:
        levels = 15 if name == "Q4_K" else 31
        sub = x.reshape(-1, 8, 32)
        low, high = np.minimum(sub.min(-1), 0), sub.max(-1)
        scale, minus = (high - low) / levels, -low  # w ~ q scale - minus, q in [0, levels]
        d, dmin = _f16(scale.max(-1, keepdims=True) / 63), _f16(minus.max(-1, keepdims=True) / 63)
        sc = np.clip(np.round(scale * _inverse(d)), 0, 63).astype(np.uint8)  # [n, 8]
        mn = np.clip(np.round(minus * _inverse(dmin)), 0, 63).astype(np.uint8)
        step = d * sc
        q = np.clip(np.round((sub + (dmin * mn)[..., None]) * _inverse(step)[..., None]), 0, levels).astype(np.uint8)
        packed = np.concatenate([(sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6), (mn[:, :4] & 63) | ((mn[:, 4:] >> 4) << 6),
                                 (sc[:, 4:] & 15) | ((mn[:, 4:] & 15) << 4)], axis=-1)  # [n, 12]
        low4 = q & 15
        qs = (low4[:, 0::2] | (low4[:, 1::2] << 4)).reshape(-1, 128)  # byte 32 g + i: sub-blocks 2 g, 2 g + 1
        head = [d.astype(np.float16).view(np.uint8), dmin.astype(np.float16).view(np.uint8), packed]
        if name == "Q5_K":  # bit s of byte i: bit 4 of sub-block s's input i
            head.append(sum(((q[:, s] >> 4) & 1) << s for s in range(8)).astype(np.uint8))
        out = np.concatenate([*head, qs], axis=-1)
    assert out.shape[-1] == KQUANT_BYTES[name]
    return out.reshape(*np.shape(w)[:-1], -1)


def _q6_k(x: np.ndarray) -> np.ndarray:
    """Super-blocks [n, 256] -> Q6_K [n, 210] {uint8 ql[128], qh[64]; int8 scales[16]; float16 d}: w = d sc (q - 32)
    per 16 weights."""
    sub = x.reshape(-1, 16, 16)
    scale = np.abs(sub).max(-1) / 31  # [n, 16]
    d = _f16(scale.max(-1, keepdims=True) / 127)
    sc = np.clip(np.round(scale * _inverse(d)), -128, 127).astype(np.int8)
    step = d * sc
    u = (np.clip(np.round(sub * _inverse(step)[..., None]), -32, 31) + 32).astype(np.uint8).reshape(-1, 2, 128)
    # weight h 128 + r: its low 4 bits in ql byte h 64 + r % 64 (nibble r // 64), its top 2 in qh byte h 32 + r % 32
    # (bits 2 (r // 32) and up)
    ql = (u[..., :64] & 15) | ((u[..., 64:] & 15) << 4)  # [n, 2, 64]
    qh = sum(((u[..., 32 * k:32 * k + 32] >> 4) & 3) << (2 * k) for k in range(4)).astype(np.uint8)  # [n, 2, 32]
    return np.concatenate([ql.reshape(-1, 128), qh.reshape(-1, 64), sc.view(np.uint8),
                           d.astype(np.float16).view(np.uint8)], axis=-1)


def tiny_model(model_type: str, seed: int = 0, **overrides):
    """A tiny random transformers model (float32, eval) whose shapes every GGUF quant type can block."""
    import transformers

    from tests.helpers.checkpoints import CLASSES

    config_cls, model_cls = (getattr(transformers, n) for n in CLASSES[model_type])
    kwargs = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-6,
                  vocab_size=320, initializer_range=0.2,
                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    kwargs.update(overrides)
    torch.manual_seed(seed)
    config = config_cls(**kwargs)
    config.eos_token_id = None
    return model_cls(config).eval().float()
