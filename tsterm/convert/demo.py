"""Random-weight Qwen3-MoE checkpoints that tsterm makes itself, without transformers or a model hub.

`ensure_demo_model("tiny")` backs the Quickstart (`tsterm run` before a real default model ships); the "bench"
preset is a memory-bound MoE for `tsterm bench`, and "bench-hybrid" its Qwen3.5-MoE-shaped twin (Gated DeltaNet
and gated attention layers 3:1, routed experts plus a gated shared expert) for `tsterm bench --profile
bench-hybrid`. The output is an ordinary HF model directory: config.json,
generation_config.json, safetensors weights with HF names, and a byte-level BPE tokenizer with a ChatML template.
Everything is deterministic: the same spec gives byte-identical files.
"""
from __future__ import annotations

import dataclasses
import json
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from tsterm.errors import ConfigError
from tsterm.paths import demo_model_dir, replace_dir

ProgressFn = Callable[[int, int, str], None]  # (bytes done, bytes total, what)

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # ids 0, 1, 2; skipped by decode
# Added but not special (as in Qwen3): decode keeps them, so reasoning and tool calls stay visible and parseable.
ADDED_TOKENS = ("<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
MARKER = "tsterm_demo.json"  # written last inside the temp dir: its presence means the checkpoint is complete
SHARD_BYTES = 500_000_000  # bigger checkpoints are split into shards of at most this many bytes
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class RandomMoESpec:
    """Shape and initialisation of a random Qwen3-MoE. `vocab_size` is the tokenizer's total vocabulary."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    max_position_embeddings: int = 4096
    dtype: str = "float32"
    seed: int = 0
    norm_topk_prob: bool = True
    init_std: float = 0.1  # HF's 0.02 makes random models repeat one token; 0.1 keeps tokens and routing varied
    rope_theta: float = 1_000_000.0

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise ConfigError(f"RandomMoESpec.dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")
        if self.vocab_size < 256 + len(SPECIAL_TOKENS) + len(ADDED_TOKENS):
            raise ConfigError(f"RandomMoESpec.vocab_size={self.vocab_size} cannot hold the 256 byte symbols "
                              "and the special tokens")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError("RandomMoESpec.num_attention_heads must be a multiple of num_key_value_heads")
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ConfigError(f"RandomMoESpec.num_experts_per_tok must be in [1, {self.num_experts}]")


@dataclass(frozen=True)
class RandomHybridSpec(RandomMoESpec):
    """A random Qwen3.5-MoE language model (`qwen3_5_moe_text`): every `full_attention_interval`-th layer is gated
    full attention (an output gate from q_proj, RoPE on the leading `partial_rotary_factor` of each head), the
    others Gated DeltaNet linear attention; every layer's MLP is routed experts plus a sigmoid-gated shared expert.
    Norm weights are zero-centred (stored as scale - 1), except the Gated DeltaNet output norm's."""

    shared_expert_intermediate_size: int = 512
    linear_num_key_heads: int = 8
    linear_num_value_heads: int = 16
    linear_key_head_dim: int = 64
    linear_value_head_dim: int = 64
    linear_conv_kernel_dim: int = 4
    full_attention_interval: int = 4
    partial_rotary_factor: float = 0.25

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ConfigError("RandomHybridSpec.linear_num_value_heads must be a multiple of linear_num_key_heads")
        if self.full_attention_interval < 1:
            raise ConfigError("RandomHybridSpec.full_attention_interval must be >= 1")

    @property
    def layer_types(self) -> list[str]:
        return ["full_attention" if (i + 1) % self.full_attention_interval == 0 else "linear_attention"
                for i in range(self.num_hidden_layers)]

    @property
    def linear_conv_channels(self) -> int:  # q, k and v go through the causal conv
        return 2 * self.linear_num_key_heads * self.linear_key_head_dim + \
            self.linear_num_value_heads * self.linear_value_head_dim


SPECS: dict[str, RandomMoESpec] = {
    # 4 x (12 KB attention + 8 x 3 x 64 x 64 experts) + 2 x 1024 x 64 embed/lm_head = 0.6 M params: 2.4 MB fp32
    "tiny": RandomMoESpec(vocab_size=1024, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
                          moe_intermediate_size=64),
    # Qwen3-30B-A3B's layout (32/4 heads, q/k norms, top-k softmax experts) scaled down to 8 layers, H 1024,
    # 16/4 heads of 64, 16 experts top-4, I 512, in float32: on these CPUs bfloat16 matmuls are compute-bound
    # (about half float32's bytes/s), so only float32 makes the model memory-bound, as a GPU model would be.
    #   attention per layer: q 1024x1024 + k, v 256x1024 + o 1024x1024 = 2.62 M params = 10.5 MB
    #   one expert: 3 x 1024 x 512 = 1.57 M params = 6.3 MB; router 16 x 1024 = 0.07 MB
    #   read per token: 8 x (10.5 + 4 x 6.3 + 0.07) MB + lm_head 1024 x 1024 (4.2 MB) = ~290 MB
    #   whole checkpoint: 8 x (10.5 + 16 x 6.3 + 0.07) MB + embed + lm_head (8.4 MB) = ~0.9 GB (2 shards)
    "bench": RandomMoESpec(vocab_size=1024, hidden_size=1024, num_hidden_layers=8, num_attention_heads=16,
                           num_key_value_heads=4, head_dim=64, num_experts=16, num_experts_per_tok=4,
                           moe_intermediate_size=512, max_position_embeddings=32768, dtype="float32"),
    # "bench" as a Qwen3.5-MoE hybrid: 8 layers, 6 Gated DeltaNet + 2 gated attention (layers 3 and 7), the same
    # H 1024 and experts (16 x I 512, top-4) plus a shared expert of I 512. Float32 for the reason given above.
    #   Gated DeltaNet per layer: in_proj_qkv 2048 x 1024 + z 1024 x 1024 + b, a 2 x 16 x 1024 + out 1024 x 1024
    #     = 4.23 M params = 16.9 MB; its state: 16 value heads x 64 x 64 float32 = 256 KB (+ 24 KB of conv)
    #   gated attention per layer: q (+ gate) 2048 x 1024 + k, v 256 x 1024 + o 1024 x 1024 = 3.67 M = 14.7 MB
    #   experts: 4 x 6.3 MB routed + 6.3 MB shared; router 0.07 MB
    #   read per token: 6 x 16.9 + 2 x 14.7 + 8 x (25.2 + 6.3 + 0.07) MB + lm_head 4.2 MB = ~388 MB
    #   whole checkpoint: 8 x (16 x 6.3 + 6.3) MB + mixers + embed + lm_head = ~1.0 GB (2 shards)
    "bench-hybrid": RandomHybridSpec(vocab_size=1024, hidden_size=1024, num_hidden_layers=8, num_attention_heads=16,
                                     num_key_value_heads=4, head_dim=64, num_experts=16, num_experts_per_tok=4,
                                     moe_intermediate_size=512, max_position_embeddings=32768, dtype="float32"),
}


def _tensor_plan(spec: RandomMoESpec) -> Iterator[tuple[str, tuple[int, ...]]]:
    """HF Qwen3-MoE tensor names and shapes, in the (fixed) order they are generated and written."""
    if isinstance(spec, RandomHybridSpec):
        yield from _hybrid_tensor_plan(spec)
        return
    H, D, I = spec.hidden_size, spec.head_dim, spec.moe_intermediate_size
    yield "model.embed_tokens.weight", (spec.vocab_size, H)
    for i in range(spec.num_hidden_layers):
        p = f"model.layers.{i}."
        yield p + "input_layernorm.weight", (H,)
        yield from _attention_plan(spec, p, query_width=spec.num_attention_heads * D)
        yield p + "post_attention_layernorm.weight", (H,)
        yield p + "mlp.gate.weight", (spec.num_experts, H)
        for e in range(spec.num_experts):
            yield p + f"mlp.experts.{e}.gate_proj.weight", (I, H)
            yield p + f"mlp.experts.{e}.up_proj.weight", (I, H)
            yield p + f"mlp.experts.{e}.down_proj.weight", (H, I)
    yield "model.norm.weight", (H,)
    yield "lm_head.weight", (spec.vocab_size, H)


def _attention_plan(spec: RandomMoESpec, p: str, query_width: int) -> Iterator[tuple[str, tuple[int, ...]]]:
    """A (Qwen3-style, q/k-normed) attention layer's tensors under prefix `p`; `query_width`: q_proj's rows."""
    H, D = spec.hidden_size, spec.head_dim
    yield p + "self_attn.q_proj.weight", (query_width, H)
    yield p + "self_attn.k_proj.weight", (spec.num_key_value_heads * D, H)
    yield p + "self_attn.v_proj.weight", (spec.num_key_value_heads * D, H)
    yield p + "self_attn.o_proj.weight", (H, spec.num_attention_heads * D)
    yield p + "self_attn.q_norm.weight", (D,)
    yield p + "self_attn.k_norm.weight", (D,)


def _hybrid_tensor_plan(spec: RandomHybridSpec) -> Iterator[tuple[str, tuple[int, ...]]]:
    """HF Qwen3.5-MoE (text) names and shapes; experts in transformers 5's stacked layout (`experts.gate_up_proj`
    [E, 2I, H], gate rows first, and `experts.down_proj` [E, H, I]), which tsterm's loader also reads."""
    H, D, I, E = spec.hidden_size, spec.head_dim, spec.moe_intermediate_size, spec.num_experts
    Hv, Dv = spec.linear_num_value_heads, spec.linear_value_head_dim
    yield "model.embed_tokens.weight", (spec.vocab_size, H)
    for i, kind in enumerate(spec.layer_types):
        p = f"model.layers.{i}."
        yield p + "input_layernorm.weight", (H,)
        if kind == "linear_attention":
            a = p + "linear_attn."
            yield a + "in_proj_qkv.weight", (spec.linear_conv_channels, H)
            yield a + "in_proj_z.weight", (Hv * Dv, H)
            yield a + "in_proj_b.weight", (Hv, H)
            yield a + "in_proj_a.weight", (Hv, H)
            yield a + "conv1d.weight", (spec.linear_conv_channels, 1, spec.linear_conv_kernel_dim)
            yield a + "dt_bias", (Hv,)
            yield a + "A_log", (Hv,)
            yield a + "norm.weight", (Dv,)
            yield a + "out_proj.weight", (H, Hv * Dv)
        else:
            yield from _attention_plan(spec, p, query_width=spec.num_attention_heads * 2 * D)  # per head: query, gate
        yield p + "post_attention_layernorm.weight", (H,)
        yield p + "mlp.gate.weight", (E, H)
        yield p + "mlp.experts.gate_up_proj", (E, 2 * I, H)
        yield p + "mlp.experts.down_proj", (E, H, I)
        S = spec.shared_expert_intermediate_size
        yield p + "mlp.shared_expert.gate_proj.weight", (S, H)
        yield p + "mlp.shared_expert.up_proj.weight", (S, H)
        yield p + "mlp.shared_expert.down_proj.weight", (H, S)
        yield p + "mlp.shared_expert_gate.weight", (1, H)
    yield "model.norm.weight", (H,)
    yield "lm_head.weight", (spec.vocab_size, H)


def _random_values(spec: RandomMoESpec, name: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    values = torch.randn(shape, generator=gen) * spec.init_std
    hybrid = isinstance(spec, RandomHybridSpec)
    if name.endswith("A_log"):  # decay rates exp(A_log) in [1, 16], as transformers initialises them
        return torch.log(1.0 + 15.0 * torch.rand(shape, generator=gen))
    if name.endswith("dt_bias"):
        return values + 1.0
    if len(shape) == 1 and (not hybrid or name.endswith("linear_attn.norm.weight")):
        values += 1.0  # RMSNorm weights: around 1, as trained models have them (zero-centred ones: around 0)
    return values


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def checkpoint_bytes(spec: RandomMoESpec) -> int:
    """Size of all weights on disk (and in memory at spec.dtype)."""
    return sum(_numel(shape) for _, shape in _tensor_plan(spec)) * _DTYPES[spec.dtype].itemsize


def bytes_read_per_token(spec: RandomMoESpec) -> int:
    """Weight bytes one decoded token reads: one embedding row, attention, norms, router, the top-k experts of
    every layer, and lm_head. The other experts stay untouched: that is what makes an MoE memory-cheap."""
    H, D, I = spec.hidden_size, spec.head_dim, spec.moe_intermediate_size
    if isinstance(spec, RandomHybridSpec):  # every tensor is read whole but the embedding (one row) and the experts
        skipped = ("embed_tokens.weight", "experts.gate_up_proj", "experts.down_proj")
        params = sum(_numel(shape) for name, shape in _tensor_plan(spec) if not name.endswith(skipped))
        params += H + spec.num_hidden_layers * spec.num_experts_per_tok * 3 * H * I
        return params * _DTYPES[spec.dtype].itemsize
    attention = (2 * spec.num_attention_heads + 2 * spec.num_key_value_heads) * D * H + 2 * D
    layer = attention + 2 * H + spec.num_experts * H + spec.num_experts_per_tok * 3 * H * I
    params = H + spec.num_hidden_layers * layer + H + spec.vocab_size * H
    return params * _DTYPES[spec.dtype].itemsize


def _shards(spec: RandomMoESpec) -> list[list[tuple[str, tuple[int, ...]]]]:
    itemsize = _DTYPES[spec.dtype].itemsize
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, shape in _tensor_plan(spec):
        nbytes = _numel(shape) * itemsize
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += nbytes
    return shards


def _write_weights(out: Path, spec: RandomMoESpec, progress: ProgressFn | None) -> None:
    # One generator drawn in plan order: the bytes depend only on the spec. Only one shard is in memory at a time.
    gen = torch.Generator().manual_seed(spec.seed)
    dtype, total, done = _DTYPES[spec.dtype], checkpoint_bytes(spec), 0
    shards = _shards(spec)
    names = ["model.safetensors"] if len(shards) == 1 else \
        [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))]
    weight_map = {}
    for file_name, plan in zip(names, shards):
        tensors = {}
        for name, shape in plan:
            tensors[name] = _random_values(spec, name, shape, gen).to(dtype)
            weight_map[name] = file_name
            done += tensors[name].numel() * dtype.itemsize
            if progress:
                progress(done, total, name)
        save_file(tensors, str(out / file_name), metadata={"format": "pt"})
        del tensors
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        write_json(out / "model.safetensors.index.json", index)


def write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def model_config_dict(spec: RandomMoESpec, eos_id: int, bos_id: int) -> dict:
    if isinstance(spec, RandomHybridSpec):
        return hybrid_config_dict(spec, eos_id, bos_id)
    # Both spellings where transformers versions differ (num_experts / num_local_experts, rope_theta /
    # rope_parameters), so any transformers 4.5x/5.x and tsterm read the same model.
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        **_shared_config(spec, eos_id, bos_id),
        "intermediate_size": spec.num_experts_per_tok * spec.moe_intermediate_size,  # dense width: unused
        "rope_theta": spec.rope_theta,
        "rope_scaling": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": spec.rope_theta},
        "use_sliding_window": False,
        "sliding_window": None,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    }


def hybrid_config_dict(spec: RandomHybridSpec, eos_id: int, bos_id: int) -> dict:
    """config.json of a `qwen3_5_moe_text` model as transformers 5 writes it (`rope_parameters`), plus the
    explicit `layer_types`."""
    return {
        "architectures": ["Qwen3_5MoeForCausalLM"],
        "model_type": "qwen3_5_moe_text",
        **_shared_config(spec, eos_id, bos_id),
        "rope_parameters": {"rope_type": "default", "rope_theta": spec.rope_theta,
                            "partial_rotary_factor": spec.partial_rotary_factor},
        "layer_types": spec.layer_types,
        "full_attention_interval": spec.full_attention_interval,
        "linear_num_key_heads": spec.linear_num_key_heads,
        "linear_num_value_heads": spec.linear_num_value_heads,
        "linear_key_head_dim": spec.linear_key_head_dim,
        "linear_value_head_dim": spec.linear_value_head_dim,
        "linear_conv_kernel_dim": spec.linear_conv_kernel_dim,
        "shared_expert_intermediate_size": spec.shared_expert_intermediate_size,
    }


def _shared_config(spec: RandomMoESpec, eos_id: int, bos_id: int) -> dict:
    """The config.json fields the MoE and hybrid demo models write alike."""
    return {
        "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden_size,
        "num_hidden_layers": spec.num_hidden_layers,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_key_value_heads,
        "head_dim": spec.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": spec.max_position_embeddings,
        "rms_norm_eps": 1e-6,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "num_experts": spec.num_experts,
        "num_experts_per_tok": spec.num_experts_per_tok,
        "moe_intermediate_size": spec.moe_intermediate_size,
        "norm_topk_prob": spec.norm_topk_prob,
        "output_router_logits": False,
        "router_aux_loss_coef": 0.001,
        "initializer_range": spec.init_std,
        "use_cache": True,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "dtype": spec.dtype,
    }


# ---- tokenizer
# A few KB of plain prose written for this module; the BPE merges it yields make random output look like words.
CORPUS = """\
The river came down from the hills in the early spring, cold and loud, and the people of the valley went out to \
watch it. Children threw small sticks from the old stone bridge and ran to the other side to see which one would \
come out first. The baker said the water was higher than last year, and the miller said it was the same as always.
In the evening the wind turned to the west and the clouds broke apart. A long line of light lay along the edge of \
the world, yellow at first and then red, and the birds went quiet one after another. Somebody lit a lamp in the \
window of the schoolhouse, and a dog barked twice at nothing in particular.
Good tools are simple to hold and hard to misuse. A carpenter keeps her chisels sharp because a dull edge slips, \
and a slipping edge is how people get hurt. She tells her students to measure twice and cut once, to read the \
grain of the wood before they plan the joint, and to clean the bench before they go home.
Questions are the start of most useful work. What are we trying to do? Why does it matter? Who will use it, and \
what will they need to know? When the answers are written down in plain words, the work often becomes smaller \
than it first looked, and the parts that are truly difficult become easier to see.
A computer program is a list of instructions that a machine follows exactly. The machine does not guess what you \
meant. If the instructions say to add two numbers and print the result, it adds them and prints the result, even \
when the numbers are wrong. Reading a program slowly, line by line, is still one of the best ways to find a mistake.
Language models read text as a sequence of tokens. Each token is a short piece of a word, a whole word, or a mark \
such as a comma or a full stop. The model looks at the tokens so far and gives a score to every token it knows; the \
next token is chosen from those scores, added to the sequence, and the process repeats until the answer is done.
A mixture of experts replaces one large layer with many smaller ones. For every token a small router picks a few \
experts, and only those experts do any work. The model can therefore hold a great deal of knowledge while each \
step reads only a small part of its weights, which is why such models can be fast on ordinary hardware.
Memory is the real limit when a model writes one token at a time. Every step must read the weights it uses from \
memory, and the time that takes is set by the bandwidth of the memory, not by the speed of the arithmetic. \
Counting the bytes read for each token, and dividing by the time, tells you how close you are to that limit.
The market opened at nine. Farmers brought apples, pears, potatoes, onions, cheese, eggs and honey, and set them \
out on long wooden tables. An old man sold knives and scissors, and sharpened them while you waited. By noon most \
of the bread was gone, and the children were allowed to spend their coins on sweets.
She wrote to her brother every week. She told him about the weather, the garden, the neighbours and the books she \
was reading, and she asked him about his work in the city. His letters were shorter, but he always answered her \
questions, and at the end he always wrote that he would visit in the summer.
Please be careful with that box; there are glasses inside. Put it on the table by the door, and I will unpack it \
after lunch. Thank you for your help. Would you like a cup of tea, or would you rather have coffee? There is also \
cold water in the kitchen, and some fresh bread if you are hungry.
The weather today will be mostly sunny with a light breeze from the north. Temperatures will reach about twenty \
degrees in the afternoon and fall to ten degrees at night. Tomorrow there is a chance of rain in the morning, \
clearing by the evening. The weekend should be warm and dry across most of the country.
To make a simple soup, cut two onions, three carrots and a few potatoes into small pieces. Warm some oil in a large \
pot, cook the onions until they are soft, then add the other vegetables and enough water to cover them. Let it \
simmer for half an hour, add salt and pepper, and serve it hot with bread.
Numbers appear everywhere: 1, 2, 3, 10, 42, 100, 365, 1024, 2048 and 3.14. A meeting at 10:30, a page number, a \
year such as 1999 or 2025, a price of 4.50, a score of 7 to 3. Lists have first, second and third items, and a \
table has rows and columns that line up.
I think the answer is yes, but let me check before I say so. First, the request asks for three things. Second, \
two of them are already done. Third, the last one needs a tool: I will call it, read the result, and then reply \
with a short summary that explains what I found and what is still unknown.
"""

CHAT_TEMPLATE = """\
{%- macro text(content) -%}
    {%- if content is string -%}{{ content }}
    {%- elif content is iterable and content is not mapping -%}
        {%- for part in content if part.type == 'text' -%}{{ part.text }}{%- endfor -%}
    {%- endif -%}
{%- endmacro -%}
{%- set has_system = messages and messages[0].role == 'system' -%}
{%- if tools -%}
    {{- '<|im_start|>system\\n' -}}
    {%- if has_system -%}{{- text(messages[0].content) + '\\n\\n' -}}{%- endif -%}
    {{- '# Tools\\n\\nThese functions are available, one JSON schema per line inside <tools></tools>:\\n<tools>' -}}
    {%- for tool in tools -%}{{- '\\n' + (tool | tojson) -}}{%- endfor -%}
    {{- '\\n</tools>\\n\\nTo call a function, answer with its name and JSON arguments in tool_call tags:\\n' -}}
    {{- '<tool_call>\\n{"name": "function name", "arguments": {"argument": "value"}}\\n</tool_call><|im_end|>\\n' -}}
{%- elif has_system -%}
    {{- '<|im_start|>system\\n' + text(messages[0].content) + '<|im_end|>\\n' -}}
{%- endif -%}
{%- for message in messages -%}
    {%- if message.role == 'system' -%}
        {%- if not loop.first -%}{{- raise_exception('only the first message may have the system role') -}}{%- endif -%}
    {%- elif message.role == 'user' -%}
        {{- '<|im_start|>user\\n' + text(message.content) + '<|im_end|>\\n' -}}
    {%- elif message.role == 'assistant' -%}
        {{- '<|im_start|>assistant\\n' -}}
        {%- if message.reasoning_content -%}
            {{- '<think>\\n' + message.reasoning_content | trim + '\\n</think>\\n\\n' -}}
        {%- endif -%}
        {{- text(message.content) -}}
        {%- for call in message.tool_calls or [] -%}
            {%- set fn = call.function if call.function is defined else call -%}
            {%- set args = fn.arguments if fn.arguments is string else (fn.arguments | tojson) -%}
            {%- if not loop.first or message.content -%}{{- '\\n' -}}{%- endif -%}
            {{- '<tool_call>\\n{"name": "' + fn.name + '", "arguments": ' + args + '}\\n</tool_call>' -}}
        {%- endfor -%}
        {{- '<|im_end|>\\n' -}}
    {%- elif message.role == 'tool' -%}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}
        {{- '\\n<tool_response>\\n' + text(message.content) + '\\n</tool_response>' -}}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}{{- '<|im_end|>\\n' -}}{%- endif -%}
    {%- else -%}
        {{- raise_exception('unknown message role: ' + message.role) -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|im_start|>assistant\\n' -}}
    {%- if enable_thinking is defined and not enable_thinking -%}{{- '<think>\\n\\n</think>\\n\\n' -}}{%- endif -%}
{%- endif -%}
"""


def train_tokenizer(vocab_size: int, texts: Iterable[str] | None = None, min_frequency: int = 1) -> Tokenizer:
    """Byte-level BPE on `texts` (default: CORPUS) with exactly `vocab_size` tokens (deterministic: same size,
    same merges): special tokens at ids 0-2, added tokens last.

    Should the texts run out of merges, the rest is filled with `<|reserved_N|>` special tokens, as real
    vocabularies pad theirs."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - len(ADDED_TOKENS), special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), min_frequency=min_frequency,
                                  show_progress=False)
    tok.train_from_iterator(CORPUS.splitlines() if texts is None else texts, trainer)
    missing = vocab_size - len(ADDED_TOKENS) - tok.get_vocab_size(with_added_tokens=True)
    tok.add_special_tokens([f"<|reserved_{i}|>" for i in range(missing)])
    tok.add_tokens(list(ADDED_TOKENS))
    return tok


def _write_tokenizer(out: Path, spec: RandomMoESpec) -> tuple[int, int]:
    """Writes tokenizer.json, tokenizer_config.json; returns the ids of <|im_end|> (eos) and <|endoftext|>."""
    tok = train_tokenizer(spec.vocab_size)
    tok.save(str(out / "tokenizer.json"))
    write_json(out / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "model_max_length": spec.max_position_embeddings,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    })
    return tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")


# ---- checkpoints
def make_random_moe(out_dir: str | Path, spec: RandomMoESpec, progress: ProgressFn | None = None) -> Path:
    """Writes a complete HF Qwen3-MoE (or, for a RandomHybridSpec, Qwen3.5-MoE) directory at `out_dir` (replacing a model that is there) and returns it.

    Everything is built in a temp dir next to `out_dir` and renamed into place, so a crash never leaves a
    half-written checkpoint behind. `progress(done, total, what)` counts weight bytes."""
    out_dir = Path(out_dir).expanduser().absolute()
    replaceable = out_dir.is_dir() and (not any(out_dir.iterdir()) or (out_dir / "config.json").is_file())
    if out_dir.exists() and not replaceable:  # never move aside (and delete) a directory of other files
        raise ConfigError(f"{out_dir} exists and is not a model directory; choose a new or empty directory")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".tmp", dir=out_dir.parent))
    try:
        eos_id, endoftext_id = _write_tokenizer(tmp, spec)
        write_json(tmp / "config.json", model_config_dict(spec, eos_id, endoftext_id))
        write_json(tmp / "generation_config.json", {"bos_token_id": endoftext_id, "pad_token_id": endoftext_id,
                                                     "eos_token_id": [eos_id, endoftext_id]})
        _write_weights(tmp, spec, progress)
        write_json(tmp / MARKER, {"spec": dataclasses.asdict(spec)})
        replace_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def is_complete(model_dir: Path, spec: RandomMoESpec) -> bool:
    """A directory made by make_random_moe for this exact spec (an older preset's model is rebuilt)."""
    try:
        marker = json.loads((model_dir / MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return marker.get("spec") == dataclasses.asdict(spec) and (model_dir / "config.json").is_file()


def ensure_demo_model(name: str = "tiny", cache_dir: str | Path | None = None,
                      progress: ProgressFn | None = None) -> Path:
    """`<cache_dir>/models/demo-<name>` (default: `default_cache_dir()`), generated once, on first use."""
    if name not in SPECS:
        raise ConfigError(f"unknown demo model {name!r} (choose one of: {', '.join(SPECS)})")
    spec = SPECS[name]
    model_dir = demo_model_dir(name, cache_dir)
    if not is_complete(model_dir, spec):
        make_random_moe(model_dir, spec, progress)
    return model_dir
