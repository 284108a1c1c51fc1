"""Quantize-on-load: each linear weight is quantized as the loader stores it, so the float model never exists whole
(on a GPU: never on the device whole); the result is the same as quantizing a model loaded whole."""
from __future__ import annotations

import pytest
import torch
from tsterm_kernels.quant import QuantizedWeight

from tests.helpers.checkpoints import make_checkpoint, make_hybrid_checkpoint
from tsterm.config import ModelConfig
from tsterm.errors import ConfigError
from tsterm.model import loader, quant
from tsterm.model.hybrid_loader import load_hybrid_weights
from tsterm.model.loader import load_weights
from tsterm.model.quant import QuantizeOnLoad, quantize_weights


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    # per-expert tensors, stacked at load: the largest float matrices the loader makes
    path, _ = make_checkpoint(tmp_path_factory.mktemp("qload") / "m", "qwen3_moe",
                              {"num_experts": 4, "num_experts_per_tok": 2, "num_hidden_layers": 3,
                               "hidden_size": 64, "moe_intermediate_size": 64, "tie_word_embeddings": False})
    return path


def is_linear_source(name: str) -> bool:
    """A checkpoint tensor that ends up in a matrix `linear` multiplies by (what quantization applies to)."""
    return name.endswith(("_proj.weight", "lm_head.weight"))


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantized_on_load_equals_quantized_after(checkpoint, mode):
    cfg = ModelConfig.from_dir(checkpoint)
    cpu = torch.device("cpu")
    on_load = load_weights(checkpoint, cfg, torch.float32, cpu, quantization=mode)
    after = quantize_weights(load_weights(checkpoint, cfg, torch.float32, cpu), mode)
    assert type(on_load) is dict and on_load.keys() == after.keys()
    quantized = [name for name, w in on_load.items() if isinstance(w, QuantizedWeight)]
    assert len(quantized) == 3 * 4 + 1  # qkv, o_proj, w13, w2 of each layer, and the head
    for name, weight in on_load.items():
        other = after[name]
        if isinstance(weight, QuantizedWeight):
            assert weight.kind == other.kind == mode
            assert torch.equal(weight.data, other.data) and torch.equal(weight.scale, other.scale), name
        else:
            assert torch.equal(weight, other), name


def test_a_hybrid_quantized_on_load_equals_quantized_after(tmp_path):
    """The hybrids' loader (Gated DeltaNet + gated attention) quantizes as it loads too."""
    path, _ = make_hybrid_checkpoint(tmp_path / "h", "qwen3_next", {})
    cfg = ModelConfig.from_dir(path)
    cpu = torch.device("cpu")
    on_load = load_hybrid_weights(path, cfg, torch.float32, cpu, quantization="int8")
    after = quantize_weights(load_hybrid_weights(path, cfg, torch.float32, cpu), "int8")
    assert type(on_load) is dict and on_load.keys() == after.keys()
    assert any(isinstance(w, QuantizedWeight) for w in on_load.values())
    for name, weight in on_load.items():
        other = after[name]
        assert type(weight) is type(other), name
        if isinstance(weight, QuantizedWeight):
            assert torch.equal(weight.data, other.data) and torch.equal(weight.scale, other.scale), name
        else:
            assert torch.equal(weight, other), name


def test_the_float_linear_weights_held_at_once_are_one_matrix(checkpoint, monkeypatch):
    """Count, over the load, the elements of linear weights read from the checkpoint and not yet quantized: at most
    the largest single matrix (a layer's stacked experts, its fused q/k/v), never the model."""
    cfg = ModelConfig.from_dir(checkpoint)
    pending, high_water, largest, total = [0], [0], [0], [0]
    mark_used, quantize = loader.WeightSource._mark_used, quant.quantize

    def counted_read(self, name):
        if name in self.unused and is_linear_source(name):
            pending[0] += self.where[name].tensor(name).numel()
            high_water[0] = max(high_water[0], pending[0])
        return mark_used(self, name)

    def counted_quantize(weight, mode):
        pending[0] -= weight.numel()
        largest[0] = max(largest[0], weight.numel())
        total[0] += weight.numel()
        return quantize(weight, mode)

    monkeypatch.setattr(loader.WeightSource, "_mark_used", counted_read)
    monkeypatch.setattr(quant, "quantize", counted_quantize)
    load_weights(checkpoint, cfg, torch.float32, torch.device("cpu"), quantization="int8")
    assert pending[0] == 0  # every linear element read was quantized
    assert high_water[0] <= largest[0] < total[0] // 4, (high_water[0], largest[0], total[0])


def test_quantize_on_load_checks_the_mode_first():
    with pytest.raises(ConfigError, match="fp8 has no CPU kernel"):
        QuantizeOnLoad("fp8", torch.device("cpu"), torch.float32)
    with pytest.raises(ConfigError, match="quantization must be one of"):
        QuantizeOnLoad("int3", torch.device("cpu"), torch.float32)


def test_a_tied_head_gets_its_own_quantized_copy():
    sink = QuantizeOnLoad("int8", torch.device("cpu"), torch.float32)
    embed = torch.randn(96, 64)
    sink["embed"] = embed
    sink["lm_head"] = sink["embed"]
    sink["layers.0.input_norm"] = torch.ones(64)
    weights = sink.finish()
    assert isinstance(weights["lm_head"], QuantizedWeight) and torch.equal(weights["embed"], embed)
    assert weights["embed"].data_ptr() != embed.data_ptr()  # on the CPU the floats left are owning copies
    assert type(weights) is dict
