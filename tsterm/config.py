"""Validated configuration dataclasses: sampling, engine, and the model's own HF config.json."""
from __future__ import annotations

import dataclasses
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tsterm.errors import ConfigError, ModelLoadError


def _check(cond: bool, msg: str, param: str | None = None) -> None:
    if not cond:
        raise ConfigError(msg, param=param)


SEED_MAX = 2**64 - 1  # a torch.Generator's seed is an unsigned 64-bit integer
MIN_TEMPERATURE = 1e-6  # below it (and above 0), logits / temperature overflow float32 for ordinary logits
MAX_LOGPROBS = 20
LOGIT_BIAS_BOUND = 100.0  # logit_bias values lie in [-100, 100], and at most 300 of them (OpenAI's bounds)
MAX_LOGIT_BIAS = 300


SPECULATIVE_METHODS = ("off", "ngram", "suffix", "mtp")  # (tsterm.engine.spec_decode builds each)


@dataclass(slots=True)
class StructuredOutputs:
    """Constrain a reply to a grammar (vLLM's `structured_outputs` / `guided_decoding`): exactly one of
    `json` (a JSON schema: a dict or its JSON text), `json_object` (any JSON object), `regex`, `choice` (one of these
    strings, exactly) or `grammar` (Lark, or llama.cpp's GBNF, as llguidance reads them).

    The engine masks, at each step, every token that cannot continue the grammar (tsterm/engine/structured.py); the
    eos token only where the grammar accepts, and a reply that reaches the grammar's end finishes with "stop". Whether
    the grammar compiles is checked when the engine admits the request (a RequestError naming the field).
    `disable_any_whitespace`: JSON (json, json_object) with the separators `, ` and `: ` and no other whitespace, so
    a small model cannot spend its max_tokens on newlines (default: any JSON whitespace, as vLLM)."""

    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        self.validate()

    @property
    def kind(self) -> str:
        """The one field that is set: json, json_object, regex, choice or grammar."""
        return next(name for name in STRUCTURED_KINDS if getattr(self, name) not in (None, False))

    def validate(self) -> None:
        name = "structured_outputs"
        kinds = [k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False)]
        _check(len(kinds) == 1, f"{name} must set exactly one of {', '.join(STRUCTURED_KINDS)}; "
               f"got {', '.join(kinds) or 'none'}", name)
        _check(isinstance(self.json, (dict, str, type(None))),
               f"{name}.json must be a JSON schema (an object, or its JSON text), got {type(self.json).__name__}",
               f"{name}.json")
        _check(isinstance(self.json_object, bool), f"{name}.json_object must be true or false, got "
               f"{self.json_object!r}", f"{name}.json_object")
        for field_name in ("regex", "grammar"):
            value = getattr(self, field_name)
            _check(value is None or (isinstance(value, str) and value != ""),
                   f"{name}.{field_name} must be a non-empty string, got {value!r}", f"{name}.{field_name}")
        if self.choice is not None:
            _check(isinstance(self.choice, (list, tuple)) and len(self.choice) > 0
                   and all(isinstance(c, str) and c for c in self.choice),
                   f"{name}.choice must be a non-empty list of non-empty strings, got {self.choice!r}",
                   f"{name}.choice")
            self.choice = list(self.choice)
        _check(isinstance(self.disable_any_whitespace, bool), f"{name}.disable_any_whitespace must be true or false, "
               f"got {self.disable_any_whitespace!r}", f"{name}.disable_any_whitespace")


STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(slots=True)
class SamplingParams:
    """Per-request sampling. `temperature=0` is greedy; every field is checked in `__post_init__` (and again by
    `validate()` when the engine admits a request, in case a field was changed since)."""

    temperature: float = 1.0
    top_k: int = 0  # 0 or -1: off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None  # sample i of n draws from a generator seeded with (seed + i) mod 2**64
    max_tokens: int = 256
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # top-n logprobs per generated token (0: only the sampled token's)
    n: int = 1
    # constrain the reply to a JSON schema, a regex, a choice or a grammar (a dict of StructuredOutputs' fields is
    # taken too); None: free
    structured_outputs: StructuredOutputs | None = None
    # token id -> a bias added to its logit before the penalties, temperature and truncation (-100 bans the token,
    # +100 all but forces it; the grammar's mask still wins); at most MAX_LOGIT_BIAS ids; None or {}: none
    logit_bias: dict[int, float] | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Normalise (numbers to float, one stop string to a list) and check every field: a ConfigError (a
        ValueError) names the first bad one, its value and the range it must be in."""
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value),
                   f"{name} must be a finite number, got {value!r}", name)
            setattr(self, name, float(value))
        for name in ("top_k", "max_tokens", "n"):
            value = getattr(self, name)
            _check(_is_int(value), f"{name} must be an integer, got {value!r}", name)
        _check(self.temperature == 0 or self.temperature >= MIN_TEMPERATURE,
               f"temperature must be 0 (greedy) or in [{MIN_TEMPERATURE:g}, inf), got {self.temperature}",
               "temperature")
        _check(self.top_k >= -1, f"top_k must be -1 or 0 (off) or a positive integer, got {self.top_k}", "top_k")
        _check(0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}", "top_p")
        _check(0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}", "min_p")
        _check(self.repetition_penalty > 0, f"repetition_penalty must be in (0, inf), got {self.repetition_penalty}",
               "repetition_penalty")
        _check(-2.0 <= self.presence_penalty <= 2.0,
               f"presence_penalty must be in [-2, 2], got {self.presence_penalty}", "presence_penalty")
        _check(-2.0 <= self.frequency_penalty <= 2.0,
               f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}", "frequency_penalty")
        _check(self.max_tokens >= 1, f"max_tokens must be a positive integer, got {self.max_tokens}", "max_tokens")
        _check(self.n >= 1, f"n must be a positive integer, got {self.n}", "n")
        _check(self.seed is None or (_is_int(self.seed) and 0 <= self.seed <= SEED_MAX),
               f"seed must be None or an integer in [0, 2**64 - 1], got {self.seed!r}", "seed")
        _check(self.logprobs is None or (_is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS),
               f"logprobs must be None or an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}", "logprobs")
        _check(isinstance(self.ignore_eos, bool), f"ignore_eos must be true or false, got {self.ignore_eos!r}",
               "ignore_eos")
        _check(isinstance(self.stop, (str, list, tuple)), f"stop must be a string or a list of strings, got {self.stop!r}",
               "stop")
        self.stop = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        _check(all(isinstance(s, str) for s in self.stop), f"stop must hold strings only, got {self.stop!r}", "stop")
        _check(all(self.stop), f"stop strings must be non-empty: {self.stop!r}", "stop")
        _check(isinstance(self.stop_token_ids, (list, tuple)),
               f"stop_token_ids must be a list of token ids, got {self.stop_token_ids!r}", "stop_token_ids")
        self.stop_token_ids = list(self.stop_token_ids)
        _check(all(_is_int(t) and t >= 0 for t in self.stop_token_ids),
               f"stop_token_ids must be non-negative integers: {self.stop_token_ids}", "stop_token_ids")
        so = self.structured_outputs
        if isinstance(so, dict):
            unknown = sorted(set(so) - {f.name for f in dataclasses.fields(StructuredOutputs)})
            _check(not unknown, f"structured_outputs has no field {unknown[0] if unknown else ''!r}; it takes "
                   f"{', '.join(STRUCTURED_KINDS)}, disable_any_whitespace", "structured_outputs")
            self.structured_outputs = so = StructuredOutputs(**so)
        _check(so is None or isinstance(so, StructuredOutputs),
               f"structured_outputs must be None, a StructuredOutputs or a dict of its fields, got {so!r}",
               "structured_outputs")
        if so is not None:
            so.validate()
        self._validate_logit_bias()

    def _validate_logit_bias(self) -> None:
        bias = self.logit_bias
        if bias is None:
            return
        _check(isinstance(bias, dict), f"logit_bias must be None or a dict of token id -> bias, got {bias!r}",
               "logit_bias")
        _check(len(bias) <= MAX_LOGIT_BIAS, f"logit_bias has {len(bias)} entries; at most {MAX_LOGIT_BIAS} are taken",
               "logit_bias")
        for token, value in bias.items():
            _check(_is_int(token) and token >= 0, f"logit_bias keys must be token ids (non-negative integers), got "
                   f"{token!r}", "logit_bias")
            _check(isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
                   and -LOGIT_BIAS_BOUND <= value <= LOGIT_BIAS_BOUND,
                   f"logit_bias[{token}] must be a number in [-{LOGIT_BIAS_BOUND:g}, {LOGIT_BIAS_BOUND:g}], got "
                   f"{value!r}", "logit_bias")
        self.logit_bias = {token: float(value) for token, value in bias.items()}

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(slots=True)
class EngineConfig:
    """What the engine is asked to be: model, dtype, device and KV-cache geometry."""

    model: str
    dtype: str = "auto"  # auto: bfloat16 on CUDA; on the CPU bfloat16 where AMX-BF16 pays, else float32 (tsterm.cpu)
    device: str = "auto"  # auto: cuda if available else cpu
    block_size: int = 16
    kv_cache_memory: int | None = None  # bytes for the KV pool; None: kv_cache_fraction of free device memory
    # CUDA only: the share of the memory free after the weights that the engine may use: the KV pool gets what is left
    # of it once the profile run's working memory (largest step, sampler, CUDA graphs) is taken off
    kv_cache_fraction: float = 0.5
    num_kv_blocks: int | None = None  # exact pool size (overrides the memory budget); tests use it
    # a model with sliding-window and full attention layers (gpt-oss): blocks of the sliding layers' own pool, whose
    # blocks go back once out of every running sequence's window (kept in the prefix cache); None: sized by the rule
    # in `tsterm.model.cache.window_pool_blocks`; 0: no window pool (the sliding layers keep every block)
    window_kv_blocks: int | None = None
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048  # per-step token budget (chunked prefill)
    enable_prefix_caching: bool = True
    # hybrid models with prefix caching: besides each turn's end, keep a sequence's recurrent state at the last
    # multiple of this many tokens (rounded down to whole blocks; 0: only at turn ends) in each prompt chunk, so
    # prompts that share only part of a prefix (one system prompt, different tasks) resume from it; such snapshots
    # only take state slots that are free
    state_snapshot_interval: int = 512
    seed: int = 0
    kernels: str = "auto"  # auto: Triton on CUDA, the torch twins on the CPU; or force "torch" / "triton"
    # weight-only quantization of the linear layers at load (tsterm.model.quant): none, fp16 (CPU only), int8 or
    # int4 (blocks of 32 inputs), or fp8 (blocks of 128 x 128; GPU only: no CPU kernel reads it)
    quantization: str = "none"
    cuda_graphs: bool = True  # replay decode steps as CUDA graphs (CUDA with the Triton kernels; ignored elsewhere)
    # a request's tokens and logprobs do not depend on the cache, the batch, the chunking or the thread count (README
    # "Same answer whatever the cache or the batch"); false lets a quantized model's prefill of many rows take the
    # float32 GEMM (faster on some CPUs, but then a prompt's answer depends on how it was cut)
    deterministic: bool = True
    max_pinned_fraction: float = 0.5  # share of the KV blocks that pins (Engine.pin) may hold; 0 disables pinning
    # ranks = tensor_parallel_size x expert_parallel_size; rank 0 is the engine's process, the others are workers it
    # starts (tsterm.distributed). Attention and dense MLPs split over the tp ranks, routed experts over the ep groups.
    tensor_parallel_size: int = 1
    expert_parallel_size: int = 1
    # a worker that does not answer a step (or its start) within this many seconds is reported as failed
    distributed_timeout_s: float = 60.0
    # speculative decoding (tsterm.engine.spec_decode): a request (without a grammar) verifies up to
    # num_speculative_tokens drafted tokens a step and keeps what the model agrees with (greedy: the same tokens,
    # sampled: the same distribution, in fewer steps); off, ngram (prompt lookup) or suffix (the request's own tokens
    # and recent outputs, adaptive). Not for hybrid (Gated DeltaNet) models yet.
    speculative_method: str = "off"
    num_speculative_tokens: int = 4
    # the KV cache's disk tier (tsterm.engine.kv_store): {path: DIR, max_bytes: N}; blocks registered for the prefix
    # cache are written through to DIR (default: <cache dir>/kv), at most max_bytes (default 8 GiB, least recently used
    # deleted first), and a prompt whose blocks are there reads them back instead of computing them, after a restart
    # too. None: no disk tier. Not for several ranks yet.
    kv_disk: dict[str, Any] | None = None
    # the KV cache's host tier (tsterm.engine.kv_host): bytes of host memory (pinned on a GPU) that keep the prefix
    # cache's blocks copied out of the pool, least recently used evicted first (to kv_disk when it is set and does not
    # hold them); a prompt whose blocks are there copies them back instead of computing them. On the CPU the pool is
    # host memory already: this is a RAM cache under a smaller pool. 0: none.
    kv_host_bytes: int = 0

    def __post_init__(self) -> None:
        _check(self.dtype in ("auto", "float32", "bfloat16", "float16"),
               f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        _check(isinstance(self.device, str) and re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device) is not None,
               f"device must be auto, cpu or cuda[:N], got {self.device!r}")
        _check(isinstance(self.block_size, int) and 1 <= self.block_size <= 1024,
               f"block_size must be in [1, 1024], got {self.block_size}")
        _check(self.kv_cache_memory is None or self.kv_cache_memory > 0,
               f"kv_cache_memory must be positive bytes, got {self.kv_cache_memory}")
        _check(0.0 < self.kv_cache_fraction <= 0.95, f"kv_cache_fraction must be in (0, 0.95], got {self.kv_cache_fraction}")
        _check(self.num_kv_blocks is None or self.num_kv_blocks >= 2,
               f"num_kv_blocks must be >= 2, got {self.num_kv_blocks}")
        _check(self.window_kv_blocks is None or (_is_int(self.window_kv_blocks) and self.window_kv_blocks >= 0),
               f"window_kv_blocks must be blocks >= 0 (0: no window pool), got {self.window_kv_blocks!r}",
               "window_kv_blocks")
        _check(self.max_model_len is None or self.max_model_len >= 2,
               f"max_model_len must be >= 2, got {self.max_model_len}")
        _check(self.kernels in ("auto", "torch", "triton"), f"kernels must be auto, torch or triton, got {self.kernels!r}")
        _check(self.quantization in ("none", "fp16", "int8", "int4", "fp8"),
               f"quantization must be none, fp16, int8 or int4 (CPU), or int8, int4 or fp8 (GPU), got "
               f"{self.quantization!r}")
        _check(not (self.quantization == "fp8" and self.device == "cpu"),
               "quantization: fp8 runs on a GPU only (no CPU kernel reads fp8 weights); on the CPU use int8 or int4")
        _check(not (self.quantization == "fp16" and self.device.startswith("cuda")),
               "quantization: fp16 runs on the CPU only (fbgemm's packed matrices); on a GPU use int8, int4 or fp8")
        _check(isinstance(self.cuda_graphs, bool), f"cuda_graphs must be true or false, got {self.cuda_graphs!r}")
        _check(isinstance(self.deterministic, bool), f"deterministic must be true or false, got {self.deterministic!r}")
        _check(isinstance(self.max_pinned_fraction, (int, float)) and not isinstance(self.max_pinned_fraction, bool)
               and 0.0 <= self.max_pinned_fraction <= 1.0,
               f"max_pinned_fraction must be in [0, 1], got {self.max_pinned_fraction!r}")
        _check(self.max_num_seqs >= 1, f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        for name in ("tensor_parallel_size", "expert_parallel_size"):
            value = getattr(self, name)
            _check(isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= 1024,
                   f"{name} must be an integer in [1, 1024], got {value!r}")
        _check(isinstance(self.distributed_timeout_s, (int, float)) and not isinstance(self.distributed_timeout_s, bool)
               and 0 < self.distributed_timeout_s <= 86400,
               f"distributed_timeout_s must be seconds in (0, 86400], got {self.distributed_timeout_s!r}")
        _check(isinstance(self.state_snapshot_interval, int) and not isinstance(self.state_snapshot_interval, bool)
               and self.state_snapshot_interval >= 0,
               f"state_snapshot_interval must be tokens >= 0 (0: off), got {self.state_snapshot_interval!r}")
        _check(self.max_num_batched_tokens >= 1,
               f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        _check(self.speculative_method in SPECULATIVE_METHODS,
               f"speculative_method must be off, ngram or suffix (or mtp: a checkpoint's MTP head), got "
               f"{self.speculative_method!r}",
               "speculative_method")
        _check(self.speculative_method != "mtp" or self.tensor_parallel_size == self.expert_parallel_size == 1,
               "speculative_method mtp runs the MTP head in one process: it needs tensor_parallel_size and "
               "expert_parallel_size 1", "speculative_method")
        _check(isinstance(self.num_speculative_tokens, int) and not isinstance(self.num_speculative_tokens, bool)
               and 1 <= self.num_speculative_tokens <= 64,
               f"num_speculative_tokens must be an integer in [1, 64], got {self.num_speculative_tokens!r}",
               "num_speculative_tokens")
        if self.kv_disk is not None:
            self.kv_disk = _kv_disk(self.kv_disk)
            _check(self.enable_prefix_caching, "kv_disk needs enable_prefix_caching: the disk tier keeps the prefix "
                   "cache's blocks", "kv_disk")
        _check(_is_int(self.kv_host_bytes) and self.kv_host_bytes >= 0,
               f"kv_host_bytes must be a non-negative integer of bytes (0: no host tier), got {self.kv_host_bytes!r}",
               "kv_host_bytes")
        _check(not self.kv_host_bytes or self.enable_prefix_caching, "kv_host_bytes needs enable_prefix_caching: the "
               "host tier keeps the prefix cache's blocks", "kv_host_bytes")

    @classmethod
    def from_options(cls, model: str, **options: Any) -> "EngineConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - names)
        if unknown:
            import difflib
            hints = [difflib.get_close_matches(k, names, n=1) for k in unknown]
            detail = ", ".join(f"{k!r}" + (f" (did you mean {h[0]!r}?)" if h else "") for k, h in zip(unknown, hints))
            raise ConfigError(f"unknown engine option {detail}")
        return cls(model=model, **options)


KV_DISK_DEFAULT_MAX_BYTES = 8 << 30


def _kv_disk(value: Any) -> dict[str, Any]:
    """The `kv_disk` option checked, with its defaults: {"path": str | None (the cache dir's kv/), "max_bytes": int}."""
    _check(isinstance(value, dict), f"kv_disk must be a mapping {{path: DIR, max_bytes: N}}, got {value!r}", "kv_disk")
    unknown = sorted(set(value) - {"path", "max_bytes"})
    _check(not unknown, f"kv_disk: unknown key(s) {', '.join(map(repr, unknown))} (it takes path and max_bytes)",
           "kv_disk")
    path = value.get("path")
    _check(path is None or (isinstance(path, str) and path.strip() != ""),
           f"kv_disk.path must be a directory path (a string), got {path!r}", "kv_disk.path")
    max_bytes = value.get("max_bytes", KV_DISK_DEFAULT_MAX_BYTES)
    _check(_is_int(max_bytes) and max_bytes > 0, f"kv_disk.max_bytes must be a positive integer of bytes, got "
           f"{max_bytes!r}", "kv_disk.max_bytes")
    return {"path": path, "max_bytes": max_bytes}


# --------------------------------------------------------------------------------------------------
# The model's config.json

# "dynamic" (NTK) is not implemented in tsterm.model.rope, so it is refused here, not at the first forward.
SUPPORTED_ROPE_TYPES = ("default", "linear", "yarn", "llama3")


@dataclass(frozen=True, slots=True)
class RopeConfig:
    theta: float
    rope_type: str = "default"
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    attention_factor: float | None = None  # yarn
    truncate: bool = True  # yarn: the correction range's ends rounded to whole dims (gpt-oss: false)
    mscale: float | None = None  # DeepSeek's yarn: cos/sin scaled by mscale(factor, mscale) / mscale(factor, all_dim)
    mscale_all_dim: float | None = None  # ... and MLA's softmax scale by mscale(factor, mscale_all_dim) squared
    partial_rotary_factor: float = 1.0


@dataclass(frozen=True)
class ModelConfig:
    """The fields of an HF config.json that the engine uses, both spellings of the ones that vary."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int  # dense MLP width (dense layers and dense models)
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    num_experts: int = 0  # 0: dense model
    num_experts_per_tok: int = 1
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    shared_expert_intermediate_size: int = 0
    clip_qkv: float | None = None
    # GLM-4.5 / MiniMax-M2 / DeepSeek-V3 routing (`tsterm_kernels.routing`): "softmax" or "sigmoid" scores, the
    # experts in `n_group` groups of which the best `topk_group` stay candidates, weights times routed_scaling_factor
    scoring_func: str = "softmax"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    first_k_dense_replace: int = 0  # the first layers are dense MLPs (GLM-4.5, DeepSeek-V3)
    use_qk_norm: bool = True  # GLM-4.5: whether the family's per-head q/k norm is there
    # gpt-oss: the window of its "sliding_attention" layers (0: none) and its experts' clamped SwiGLU
    sliding_window: int = 0
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    layer_types: tuple[str, ...] = ()  # config.json `layer_types` (what each layer's token mixer is); () = all full
    # Gated DeltaNet (the linear-attention layers of the hybrid families); 0 when the model has none
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 0
    # Multi-head Latent Attention (DeepSeek-V3, `tsterm.model.mla`); 0 when the model has none. head_dim is then
    # qk_rope_head_dim (the width RoPE rotates); q_lora_rank 0: q_proj straight from the hidden state
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = True  # MLA's RoPE dims stored as interleaved pairs (DeepSeek's layout)
    hidden_act: str = "silu"
    eos_token_ids: tuple[int, ...] = ()
    # a fine-grained FP8 checkpoint (quantization_config.quant_method "fp8"): the [rows, cols] blocks each
    # `weight_scale_inv` value covers; (0, 0): one scale per tensor; None: not an FP8 checkpoint
    fp8_block_size: tuple[int, int] | None = None
    # the checkpoint's own quantization_config.quant_method ("fp8", "gguf_blocks": a GGUF imported with its Q8_0 /
    # Q4_x / K-quant linear weights kept as blocks, see tsterm.convert.gguf); None: float weights
    quant_method: str | None = None
    source: str = "config.json"

    @property
    def rotary_dim(self) -> int:
        """How many leading dims of each head RoPE rotates (all of them unless `partial_rotary_factor` < 1)."""
        return int(self.head_dim * self.rope.partial_rotary_factor)

    def is_moe_layer(self, layer: int) -> bool:
        if self.num_experts == 0 or layer in self.mlp_only_layers or layer < self.first_k_dense_replace:
            return False
        return (layer + 1) % self.decoder_sparse_step == 0

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "ModelConfig":
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ModelLoadError(f"{model_dir}: no config.json (expected an HF-format model directory)")
        return cls.from_dict(read_config_json(path), source=str(path))

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config.json") -> "ModelConfig":
        from tsterm.model.arch import ARCHITECTURES

        model_type = raw.get("model_type")
        if model_type is None:
            raise ModelLoadError(f"{source}: no `model_type` field (supported: {', '.join(sorted(ARCHITECTURES))})")
        if not isinstance(model_type, str) or model_type not in ARCHITECTURES:
            raise ModelLoadError(f"{source}: model_type {model_type!r} is not supported "
                                 f"(supported: {', '.join(sorted(ARCHITECTURES))})")

        spec = ARCHITECTURES[model_type]
        quant_method, fp8_block_size = _parse_quantization(raw.get("quantization_config"), source)
        if spec.text_config:  # a multimodal release: its language model is described by the nested text_config
            text = raw.get("text_config")
            if not isinstance(text, dict):
                raise ModelLoadError(f"{source}: model_type {model_type!r} needs a `text_config` object (the language "
                                     f"model's config), got {text!r}")
            raw = {"tie_word_embeddings": raw.get("tie_word_embeddings"), "eos_token_id": raw.get("eos_token_id"),
                   **text, "model_type": model_type}
            source = f"{source} (text_config)"

        def get(key: str, default: Any = None, *alts: str, convert: Any = int, required: bool = False) -> Any:
            """The first non-null of key/alts, converted; a wrong type or missing field names the key."""
            for k in (key, *alts):
                if raw.get(k) is not None:
                    value = raw[k]
                    try:
                        if convert is int and (isinstance(value, bool) or int(value) != value):
                            raise ValueError
                        return convert(value)
                    except (TypeError, ValueError):
                        raise ModelLoadError(f"{source}: field {k!r} has invalid value {value!r}") from None
            if required:
                raise ModelLoadError(f"{source}: missing field {key!r}")
            return default

        if raw.get("hidden_act", "silu") not in ("silu", "swish"):
            raise ModelLoadError(f"{source}: hidden_act {raw['hidden_act']!r} is not supported (only silu)")
        hidden = get("hidden_size", required=True)
        heads = get("num_attention_heads", required=True)
        kv_heads = get("num_key_value_heads", heads)
        for key, value in (("hidden_size", hidden), ("num_attention_heads", heads), ("num_key_value_heads", kv_heads)):
            if value < 1:
                raise ModelLoadError(f"{source}: {key} must be positive, got {value}")
        if heads % kv_heads:
            raise ModelLoadError(f"{source}: num_attention_heads ({heads}) is not a multiple of "
                                 f"num_key_value_heads ({kv_heads})")
        head_dim = get("head_dim") or hidden // heads
        if spec.mla:  # MLA: the rotated width is the RoPE part of each head
            head_dim = get("qk_rope_head_dim", required=True)
        num_experts = get("num_experts") or get("num_local_experts") or get("n_routed_experts", 0)
        top_k = get("num_experts_per_tok", 1)
        if num_experts and not 1 <= top_k <= num_experts:
            raise ModelLoadError(f"{source}: num_experts_per_tok ({top_k}) must be in [1, num_experts={num_experts}]")
        layer_types = raw.get("layer_types")
        if layer_types is None and spec.full_attention_interval:  # the hybrids' HF default: every interval-th layer
            interval = get("full_attention_interval", spec.full_attention_interval)
            if interval < 1:
                raise ModelLoadError(f"{source}: full_attention_interval must be positive, got {interval}")
            layer_types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                           for i in range(get("num_hidden_layers", required=True))]
        if layer_types is not None:
            layers = get("num_hidden_layers", required=True)
            if not (isinstance(layer_types, list) and len(layer_types) == layers
                    and all(isinstance(t, str) for t in layer_types)):
                raise ModelLoadError(f"{source}: field 'layer_types' must be a list of {layers} strings (one per "
                                     f"layer), got {layer_types!r}")
            for i, kind in enumerate(layer_types):
                if kind not in spec.mixers:
                    raise ModelLoadError(f"{source}: layer {i} is {kind!r}, which {model_type} does not support "
                                         f"(supported layer types: {', '.join(spec.mixers)})")
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in eos_ids):
            raise ModelLoadError(f"{source}: field 'eos_token_id' has invalid value {eos!r}")
        config = cls(
            model_type=model_type,
            vocab_size=get("vocab_size", required=True),
            hidden_size=hidden,
            num_hidden_layers=get("num_hidden_layers", required=True),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            intermediate_size=get("intermediate_size", 0),
            rms_norm_eps=get("rms_norm_eps", 1e-6, convert=float),
            rope=_parse_rope(raw if raw.get("rotary_dim") is None else  # MiniMax-M2 names its rotated width
                             {**raw, "partial_rotary_factor": get("rotary_dim") / head_dim}, head_dim, source,
                             spec.partial_rotary),
            max_position_embeddings=get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=bool(raw.get("attention_bias", False)),
            num_experts=num_experts,
            num_experts_per_tok=top_k,
            moe_intermediate_size=get("moe_intermediate_size") or get("intermediate_size", 0),
            norm_topk_prob=bool(raw.get("norm_topk_prob", ARCHITECTURES[model_type].norm_topk_prob_default)),
            decoder_sparse_step=get("decoder_sparse_step", 1) or 1,
            mlp_only_layers=tuple(raw.get("mlp_only_layers") or ()),
            shared_expert_intermediate_size=get("shared_expert_intermediate_size", 0) or (  # GLM, DeepSeek: n of
                get("n_shared_experts", 0) * (get("moe_intermediate_size") or get("intermediate_size", 0))),
            clip_qkv=get("clip_qkv", convert=float),
            scoring_func=get("scoring_func", spec.scoring_func, convert=str),
            n_group=get("n_group", 1) or 1,
            topk_group=get("topk_group", 1) or 1,
            routed_scaling_factor=get("routed_scaling_factor", 1.0, convert=float),
            first_k_dense_replace=get("first_k_dense_replace", 0),
            use_qk_norm=bool(raw.get("use_qk_norm", True)),
            sliding_window=get("sliding_window", 0) or 0,
            swiglu_alpha=get("swiglu_alpha", 1.702, convert=float),
            swiglu_limit=get("swiglu_limit", 7.0, convert=float),
            layer_types=tuple(layer_types or ()),
            linear_num_key_heads=get("linear_num_key_heads", 0),
            linear_num_value_heads=get("linear_num_value_heads", 0),
            linear_key_head_dim=get("linear_key_head_dim", 0),
            linear_value_head_dim=get("linear_value_head_dim", 0),
            linear_conv_kernel_dim=get("linear_conv_kernel_dim", 0),
            **({} if not spec.mla else dict(
                q_lora_rank=get("q_lora_rank", 0), kv_lora_rank=get("kv_lora_rank", required=True),
                qk_nope_head_dim=get("qk_nope_head_dim", required=True), qk_rope_head_dim=head_dim,
                v_head_dim=get("v_head_dim", required=True), rope_interleave=bool(raw.get("rope_interleave", True)))),
            eos_token_ids=eos_ids,
            fp8_block_size=fp8_block_size,
            quant_method=quant_method,
            source=source,
        )
        for key in ("vocab_size", "num_hidden_layers", "head_dim", "max_position_embeddings"):
            if getattr(config, key) < 1:
                raise ModelLoadError(f"{source}: {key} must be positive, got {getattr(config, key)}")
        if "linear_attention" in config.layer_types:
            for key in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                        "linear_value_head_dim", "linear_conv_kernel_dim"):
                if getattr(config, key) < 1:
                    raise ModelLoadError(f"{source}: linear-attention layers need a positive {key}, got "
                                         f"{getattr(config, key)}")
            if config.linear_num_value_heads % config.linear_num_key_heads:
                raise ModelLoadError(f"{source}: linear_num_value_heads ({config.linear_num_value_heads}) is not a "
                                     f"multiple of linear_num_key_heads ({config.linear_num_key_heads})")
        if spec.mla:
            for key in ("kv_lora_rank", "qk_nope_head_dim", "v_head_dim"):
                if getattr(config, key) < 1:
                    raise ModelLoadError(f"{source}: MLA needs a positive {key}, got {getattr(config, key)}")
            if config.q_lora_rank < 0:
                raise ModelLoadError(f"{source}: q_lora_rank must be positive or null, got {config.q_lora_rank}")
        if config.scoring_func not in ("softmax", "sigmoid"):
            raise ModelLoadError(f"{source}: scoring_func {config.scoring_func!r} is not supported (softmax or sigmoid)")
        if config.num_experts and (config.n_group < 1 or config.num_experts % config.n_group
                                   or not 1 <= config.topk_group <= config.n_group
                                   or (config.n_group > 1 and config.num_experts // config.n_group < 2)):
            raise ModelLoadError(f"{source}: n_group ({config.n_group}) must split the {config.num_experts} experts "
                                 f"into groups of at least 2, and topk_group ({config.topk_group}) be in "
                                 f"[1, n_group]")
        kept_experts = config.topk_group * (config.num_experts // config.n_group)
        if config.num_experts and config.num_experts_per_tok > kept_experts:
            raise ModelLoadError(f"{source}: num_experts_per_tok ({config.num_experts_per_tok}) is more than the "
                                 f"experts of the topk_group={config.topk_group} groups kept")
        if not config.routed_scaling_factor > 0:
            raise ModelLoadError(f"{source}: routed_scaling_factor must be positive, got "
                                 f"{config.routed_scaling_factor}")
        if "sliding_attention" in config.layer_types and config.sliding_window < 1:
            raise ModelLoadError(f"{source}: sliding_attention layers need a positive sliding_window, got "
                                 f"{config.sliding_window}")
        if not (config.swiglu_limit > 0 and config.swiglu_alpha > 0):
            raise ModelLoadError(f"{source}: swiglu_limit and swiglu_alpha must be positive, got "
                                 f"{config.swiglu_limit}, {config.swiglu_alpha}")
        if config.rotary_dim < 2 or config.rotary_dim % 2:
            raise ModelLoadError(f"{source}: partial_rotary_factor {config.rope.partial_rotary_factor} leaves "
                                 f"{config.rotary_dim} rotated dims of head_dim {head_dim} (needs an even number >= 2)")
        return config


def _parse_quantization(qc: Any, source: str) -> tuple[str | None, tuple[int, int] | None]:
    """(quant_method, FP8 block size) of a checkpoint's `quantization_config` (see ModelConfig.quant_method and
    fp8_block_size); any other quantization method is refused by name."""
    if qc is None:
        return None, None
    method = qc.get("quant_method") if isinstance(qc, dict) else None
    if method == "gguf_blocks":  # tsterm.convert.gguf's native import: 32-input blocks, read by the loader
        if qc.get("block_size", 32) != 32:
            raise ModelLoadError(f"{source}: quantization_config.block_size must be 32 for gguf_blocks, got "
                                 f"{qc.get('block_size')!r}")
        return method, None
    if method == "mxfp4":  # gpt-oss: its experts as MXFP4 `_blocks` / `_scales`, kept so by the loader (csrc/mxfp4.c)
        return method, None
    if method != "fp8":
        raise ModelLoadError(f"{source}: quantization_config.quant_method {method!r} is not supported (tsterm loads "
                             "fine-grained FP8 checkpoints, quant_method \"fp8\", GGUF imports, \"gguf_blocks\", "
                             "and unquantized ones; for int8 / int4 weights load the float checkpoint with "
                             "quantization: int8 or int4)")
    block = qc.get("weight_block_size")
    if block is None:
        return method, (0, 0)
    if not (isinstance(block, list) and len(block) == 2
            and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise ModelLoadError(f"{source}: quantization_config.weight_block_size must be two positive integers, "
                             f"got {block!r}")
    return method, (block[0], block[1])


def check_quantization(quantization: str, cfg: ModelConfig) -> None:
    """Refuse quantize-on-load (EngineConfig.quantization) of a model whose weights come quantized already."""
    if quantization != "none" and cfg.quant_method == "gguf_blocks":
        raise ConfigError(f"{cfg.source}: this model's linear weights are already quantized (GGUF blocks, "
                          f"quantization_config.quant_method gguf_blocks), so quantization: {quantization} cannot "
                          "apply; use quantization: none, or import the GGUF with --dequantize to quantize "
                          "the float weights on load")


def _parse_rope(raw: dict[str, Any], head_dim: int, source: str, allow_partial: bool = False) -> RopeConfig:
    """allow_partial: the family rotates only the leading `partial_rotary_factor` share of each head."""
    # transformers 5 writes `rope_parameters` (with rope_theta inside); older configs use `rope_theta` +
    # `rope_scaling`. Read both.
    params: dict[str, Any] = {}
    for key in ("rope_scaling", "rope_parameters"):
        value = raw.get(key) or {}
        if not isinstance(value, dict):
            raise ModelLoadError(f"{source}: field {key!r} must be an object, got {value!r}")
        params.update(value)
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(f"{source}: rope type {rope_type!r} is not supported "
                             f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})")

    def num(key: str, default: float | None, *fallbacks: dict[str, Any]) -> float | None:
        for where in (params, *fallbacks):
            if where.get(key) is not None:
                value = where[key]
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                    raise ModelLoadError(f"{source}: rope field {key!r} has invalid value {value!r}")
                return float(value)
        return default

    partial = num("partial_rotary_factor", 1.0, raw)
    if partial != 1.0 and not (allow_partial and 0.0 < partial < 1.0):
        raise ModelLoadError(f"{source}: partial_rotary_factor {partial} is not supported "
                             f"({'in (0, 1]' if allow_partial else 'only 1.0'})")
    theta, factor = num("rope_theta", 10000.0, raw), num("factor", 1.0)
    if theta <= 0 or factor <= 0:
        raise ModelLoadError(f"{source}: rope_theta and the rope factor must be positive (got {theta}, {factor})")
    original_max = num("original_max_position_embeddings", None)
    rope = RopeConfig(
        theta=theta,
        rope_type=rope_type,
        factor=factor,
        original_max_position_embeddings=None if original_max is None else int(original_max),
        low_freq_factor=num("low_freq_factor", 1.0),
        high_freq_factor=num("high_freq_factor", 4.0),
        beta_fast=num("beta_fast", 32.0),
        beta_slow=num("beta_slow", 1.0),
        attention_factor=num("attention_factor", None),
        truncate=bool(params.get("truncate", True)),
        mscale=num("mscale", None),
        mscale_all_dim=num("mscale_all_dim", None),
        partial_rotary_factor=partial,
    )
    if rope_type == "llama3" and rope.high_freq_factor == rope.low_freq_factor:
        raise ModelLoadError(f"{source}: llama3 rope needs high_freq_factor != low_freq_factor "
                             f"(both are {rope.low_freq_factor})")
    return rope


def read_config_json(path: Path) -> dict[str, Any]:
    """A config.json as a dict; ModelLoadError naming the file when it is not a JSON object."""
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{path}: invalid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{path}: expected a JSON object, got {type(raw).__name__}")
    return raw


# generation_config.json key -> SamplingParams field: the sampling a model's authors recommend, which transformers
# and vLLM start from (`do_sample` is not read: tsterm samples whenever temperature > 0, as vLLM does)
GENERATION_CONFIG_SAMPLING = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                              "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def generation_defaults(model_dir: str | Path) -> dict[str, Any]:
    """The SamplingParams fields a model directory's generation_config.json sets ({} without the file); a value
    SamplingParams refuses is a ModelLoadError naming the file."""
    path = Path(model_dir) / "generation_config.json"
    if not path.is_file():
        return {}
    raw = read_config_json(path)
    defaults = {field_name: raw[key] for key, field_name in GENERATION_CONFIG_SAMPLING.items()
                if raw.get(key) is not None}
    try:
        SamplingParams(**defaults)
    except ConfigError as e:
        raise ModelLoadError(f"{path}: {e}") from None
    return defaults
