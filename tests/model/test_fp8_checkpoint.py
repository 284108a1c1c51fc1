"""Fine-grained FP8 checkpoints as Qwen publishes them (`quantization_config.quant_method: fp8`,
`weight_block_size`, an e4m3 `weight` and a float32 `weight_scale_inv` per block of each linear layer): tsterm reads
them, dequantizing block by block as it loads. The reference is transformers running the same checkpoint's
dequantized weights (fp8 value x its block's scale, the format's definition): greedy tokens and last logits equal.
A shard's rows and columns (tensor parallelism) read only their own blocks and equal the full tensor's slice."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tsterm import LLM, SamplingParams
from tsterm.config import ModelConfig
from tsterm.errors import ModelLoadError
from tsterm.model.loader import WeightSource

from tests.helpers.checkpoints import make_checkpoint

BLOCK = (16, 16)  # the tiny shapes (24, 32, 48 wide) leave partial blocks at the edges


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def fp8_blocks(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 weight, float32 scale per block) with each block's largest magnitude at e4m3's maximum."""
    out_f, in_f = weight.shape
    rows, cols = -(-out_f // block[0]), -(-in_f // block[1])
    scale = torch.empty(rows, cols)
    for i in range(rows):
        for j in range(cols):
            tile = weight[i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]]
            scale[i, j] = tile.abs().max().clamp_min(1e-12) / torch.finfo(torch.float8_e4m3fn).max
    expanded = scale.repeat_interleave(block[0], 0)[:out_f].repeat_interleave(block[1], 1)[:, :in_f]
    return (weight / expanded).to(torch.float8_e4m3fn), scale


def dequantized(fp8: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    out_f, in_f = fp8.shape
    return fp8.float() * scale.repeat_interleave(block[0], 0)[:out_f].repeat_interleave(block[1], 1)[:, :in_f]


def to_fp8_checkpoint(path, reference_path) -> None:
    """Rewrite a saved checkpoint the way Qwen's FP8 releases are: every projection of attention and the experts in
    e4m3 with its block scales; embedding, LM head, norms and router as they were. `reference_path` gets the same
    checkpoint with the dequantized values in float32 (what transformers loads as the reference)."""
    tensors = load_file(path / "model.safetensors")
    reference = dict(tensors)
    for name in [n for n in tensors if n.endswith("_proj.weight")]:
        fp8, scale = fp8_blocks(tensors[name].float(), BLOCK)
        tensors[name], tensors[name + "_scale_inv"] = fp8, scale
        reference[name] = dequantized(fp8, scale, BLOCK)
    reference_path.mkdir()
    shutil.copy(path / "config.json", reference_path / "config.json")
    save_file(reference, reference_path / "model.safetensors", metadata={"format": "pt"})
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": list(BLOCK)}
    (path / "config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module")
def fp8_model(tmp_path_factory):
    import transformers

    root = tmp_path_factory.mktemp("fp8")
    path, _ = make_checkpoint(root / "m", "qwen3_moe", {"num_experts": 4, "num_experts_per_tok": 2,
                                                        "num_hidden_layers": 2, "intermediate_size": 48})
    to_fp8_checkpoint(path, root / "dequantized")
    return path, transformers.AutoModelForCausalLM.from_pretrained(root / "dequantized", dtype=torch.float32).eval()


def test_an_fp8_checkpoint_runs_as_its_dequantized_weights(fp8_model):
    path, model = fp8_model
    llm = LLM(str(path), dtype="float32", device="cpu", num_kv_blocks=64, block_size=4)
    prompt = [5, 17, 99, 3, 250, 41, 7]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=0))[0]
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(24):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
        reference = torch.log_softmax(model(torch.tensor([ids[:-1]])).logits[0, len(prompt) - 1:].float(), -1)
    assert out.token_ids == ids[len(prompt):]
    expected = reference.gather(1, torch.tensor(out.token_ids)[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor([lp["logprob"] for lp in out.outputs[0].logprobs]), expected,
                               atol=1e-4, rtol=1e-4)


def test_a_shard_reads_its_own_blocks(fp8_model):
    path, _ = fp8_model
    cfg = ModelConfig.from_dir(path)
    assert cfg.fp8_block_size == BLOCK
    src = WeightSource([path / "model.safetensors"], torch.float32, torch.device("cpu"), None, cfg.fp8_block_size)
    name = "model.layers.0.mlp.experts.1.down_proj.weight"  # [32, 24]: a partial block of columns
    tensors = load_file(path / "model.safetensors")
    full = dequantized(tensors[name], tensors[name + "_scale_inv"], BLOCK)
    assert torch.equal(src.get(name, (32, 24)), full)
    assert torch.equal(src.get(name, (32, 24), rows=(8, 16)), full[8:24])  # rows across a block edge
    assert torch.equal(src.get(name, (32, 24), cols=(12, 12)), full[:, 12:])
    assert torch.equal(src.get(name, (32, 24), rows=(17, 5), cols=(3, 14)), full[17:22, 3:17])


def test_other_quantization_methods_and_bad_scales_are_refused(fp8_model, tmp_path):
    path, _ = fp8_model
    config = json.loads((path / "config.json").read_text())
    for qc, message in (({"quant_method": "awq", "bits": 4}, r"quant_method 'awq' is not supported"),
                        ({"quant_method": "fp8", "weight_block_size": [128]}, r"weight_block_size must be two")):
        bad = dict(config, quantization_config=qc)
        with pytest.raises(ModelLoadError, match=message):
            ModelConfig.from_dict(bad)
    src = WeightSource([path / "model.safetensors"], torch.float32, torch.device("cpu"), None, (8, 8))
    with pytest.raises(ModelLoadError, match=r"_scale_inv' has shape \[2, 2\]; blocks of \[8, 8\] .* need \[4, 3\]"):
        src.get("model.layers.0.mlp.experts.1.down_proj.weight", (32, 24))
