"""The float64 oracles (tests/kernels/oracles.py) stay independent of what they judge, and agree with torch's and
transformers' own implementations of the same maths."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.kernels import oracles

ROOT = Path(__file__).resolve().parents[2]
ORACLES = Path(oracles.__file__)


def imported_names(path: Path) -> set[str]:
    """Every module an import statement in `path` names (module level or in a function), and every string passed to
    importlib.import_module / __import__."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            names.add("." * node.level + (node.module or ""))
            names.update(f"{node.module}.{alias.name}" for alias in node.names if node.module)
        elif (isinstance(node, ast.Call) and ast.unparse(node.func) in ("importlib.import_module", "import_module",
                                                                         "__import__")
              and node.args and isinstance(node.args[0], ast.Constant)):
            names.add(str(node.args[0].value))
    return names


def test_no_production_module_imports_the_oracles():
    sources = sorted((ROOT / "tsterm").rglob("*.py")) + sorted((ROOT / "kernels").rglob("*.py"))
    assert len(sources) > 50
    offenders = {str(path.relative_to(ROOT)): sorted(name for name in imported_names(path)
                                                     if name.split(".")[0] == "tests" or "oracles" in name)
                 for path in sources}
    assert {path: names for path, names in offenders.items() if names} == {}


def test_the_oracles_import_nothing_of_tsterm():
    assert imported_names(ORACLES) <= {"__future__", "__future__.annotations", "torch", "torch.nn.functional"}


def test_the_import_check_sees_an_import_of_the_oracles(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    from tests.kernels.oracles import linear\n    import importlib\n"
                     "    importlib.import_module('tests.kernels.oracles')\n")
    assert {"tests.kernels.oracles", "tests.kernels.oracles.linear"} <= imported_names(probe)


@pytest.mark.parametrize("num_q, n", [(1, 9), (5, 5), (4, 11)])
def test_attention_is_torchs_scaled_dot_product_attention(num_q, n):
    gen = torch.Generator().manual_seed(num_q * n)
    q = torch.randn(num_q, 6, 8, generator=gen, dtype=torch.float64)
    k, v = torch.randn(n, 2, 8, generator=gen, dtype=torch.float64), torch.randn(n, 2, 8, generator=gen,
                                                                                 dtype=torch.float64)
    visible = torch.arange(n)[None, :] <= torch.arange(n - num_q, n)[:, None]  # [nq, n]
    want = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1).repeat_interleave(3, 0),
                                          v.transpose(0, 1).repeat_interleave(3, 0), attn_mask=visible, scale=0.3)
    torch.testing.assert_close(oracles.attention(q, k, v, 0.3), want.transpose(0, 1))


def test_rms_norm_is_torchs():
    gen = torch.Generator().manual_seed(0)
    x, residual, weight = (torch.randn(5, 24, generator=gen), torch.randn(5, 24, generator=gen),
                           torch.rand(24, generator=gen))
    out, new_residual = oracles.rms_norm(x, weight, 1e-6, residual)
    assert torch.equal(new_residual, x + residual)
    torch.testing.assert_close(out, F.rms_norm((x + residual).double(), (24,), weight.double(), 1e-6))


def test_moe_route_takes_the_largest_probabilities():
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0]])
    weights, ids = oracles.moe_route(logits, 2, renormalize=False)
    probs = torch.softmax(logits.double(), -1)[0]
    assert ids.tolist() == [[1, 2]]
    torch.testing.assert_close(weights[0], probs[[1, 2]])
    renormalized, _ = oracles.moe_route(logits, 2, renormalize=True)
    torch.testing.assert_close(renormalized[0], probs[[1, 2]] / probs[[1, 2]].sum())


@pytest.mark.parametrize("kind", ["int8", "int4", "fp8"])
def test_dequantize_reads_the_stored_bytes_as_the_quantized_weight_does(kind):
    """Two independent readings of the formats: the oracle's (exact, in float64) and QuantizedWeight.dequantize
    (float32: fp8's value x scale rounded once)."""
    from tsterm_kernels import quant

    quantize = {"int8": quant.quantize_int8, "int4": quant.quantize_int4, "fp8": quant.quantize_fp8}[kind]
    weight = quantize(torch.randn(3, 131 if kind == "fp8" else 40, 160, generator=torch.Generator().manual_seed(1)))
    assert torch.equal(oracles.dequantize(weight).float(), weight.dequantize())


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_int8_rows_matmul_is_the_matmul_of_the_rounded_rows(kind):
    from tsterm_kernels import quant

    gen = torch.Generator().manual_seed(2)
    weight = (quant.quantize_int8 if kind == "int8" else quant.quantize_int4)(torch.randn(24, 64, generator=gen))
    x = torch.randn(3, 64, generator=gen)
    blocks = x.view(3, 2, 32)
    step = blocks.abs().amax(-1, keepdim=True) / 127
    rounded = (torch.round(blocks / step) * step).view(3, 64)  # x as int8 codes times their block's step
    torch.testing.assert_close(oracles.int8_rows_matmul(x, weight), oracles.linear(rounded, oracles.dequantize(weight)),
                               rtol=1e-6, atol=1e-6)


def test_causal_conv_is_a_padded_depthwise_conv():
    gen = torch.Generator().manual_seed(3)
    x, weight = torch.randn(7, 5, generator=gen), torch.randn(5, 4, generator=gen)
    out, last = oracles.causal_conv(x, weight, torch.zeros(5, 3))
    want = F.silu(F.conv1d(F.pad(x.t()[None].double(), (3, 0)), weight.double()[:, None], groups=5))[0].t()
    torch.testing.assert_close(out, want)
    assert torch.equal(last, x[-3:].t())


def test_gated_delta_rule_is_transformers_recurrent_rule():
    hf = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    gen = torch.Generator().manual_seed(4)
    n, hk, hv, dk, dv = 6, 1, 2, 8, 4
    q, k = torch.randn(n, hk, dk, generator=gen), torch.randn(n, hk, dk, generator=gen)
    v = torch.randn(n, hv, dv, generator=gen)
    g, beta = -torch.rand(n, hv, generator=gen), torch.rand(n, hv, generator=gen)
    state = torch.randn(hv, dk, dv, generator=gen)
    want_o, want_s = hf.torch_recurrent_gated_delta_rule(  # in float32, its key heads repeated over the values'
        q[None], k[None], v[None], g[None], beta[None], initial_state=state[None], output_final_state=True,
        use_qk_l2norm_in_kernel=True)
    o, s = oracles.gated_delta_rule(q, k, v, g, beta, state)
    torch.testing.assert_close(o, want_o[0].double(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(s, want_s[0].double(), rtol=1e-5, atol=1e-6)
