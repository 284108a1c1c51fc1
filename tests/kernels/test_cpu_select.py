"""The per-machine choice of CPU kernels (tsterm_kernels.cpu_select): the selection logic on fake CPUs and a fake
timer (an AVX2-only CPU, AVX-512 without AMX, AMX refused by the OS, aarch64 with and without its NEON build), its plan
file, the
override, and on this machine: every C build it runs against the float64 oracles and against each other, bit for
bit (the invariance promise holds whichever build a shape class gets)."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from tsterm_kernels import cpu_native, cpu_select, torch_ops
from tsterm_kernels.cpu_select import ENV, Choice, CpuInfo, ShapeClass
from tsterm_kernels.quant import quantize_int4, quantize_int8

from tests.kernels import oracles
from tests.kernels.conftest import isa_candidates

AVX2 = CpuInfo("x86_64", "AMD Ryzen 7 5800X", frozenset({"sse4_2", "avx", "avx2", "fma", "f16c"}))
ZEN4 = CpuInfo("x86_64", "AMD Ryzen 9 7950X", AVX2.flags | {"avx512f", "avx512bw", "avx512vl", "avx512_vnni",
                                                            "avx512_bf16"})
SPR_REFUSED = CpuInfo("x86_64", "Intel Xeon Platinum 8480+", ZEN4.flags | {"amx_tile", "amx_bf16", "amx_int8",
                                                                           "avx512_fp16"}, amx_allowed=False)
SPR = replace(SPR_REFUSED, amx_allowed=True)
ARM = CpuInfo("aarch64", "Apple M2", frozenset({"fp", "asimd", "asimddp", "bf16", "i8mm"}))
BUILDS = {"native": cpu_native.ISA_AVX512, "avx2": 0}  # what an AVX-512 CPU builds (tsterm_isa() bits)
NEON_BITS = cpu_native.ISA_NEON | cpu_native.ISA_DOTPROD  # what an aarch64 CPU with sdot builds

GEMM, EXPERTS, ATTENTION = ShapeClass("gemm", (576, 576)), ShapeClass("experts", (8, 512, 576, 2)), \
    ShapeClass("attention", (9, 3, 64))


class FakeTimer:
    """Seconds per (kind, candidate); counts the classes it timed."""

    def __init__(self, seconds: dict[tuple[str, str], float]):
        self.seconds, self.timed = seconds, []

    def __call__(self, shape, candidates):
        self.timed.append(shape.key)
        return {name: self.seconds[shape.kind, name] for name in candidates}


def _never(shape, candidates):
    raise AssertionError(f"{shape.key} was timed")


def test_the_candidates_follow_the_cpu_and_its_builds():
    assert cpu_select.available(AVX2, {"native": 0, "avx2": None}) == ("c-avx2", "torch")
    assert cpu_select.available(ZEN4, BUILDS) == ("c-avx512", "c-avx2", "torch")
    assert cpu_select.available(SPR_REFUSED, BUILDS) == ("c-avx512", "c-avx2", "torch")
    assert cpu_select.available(ZEN4, {"native": cpu_native.ISA_AVX512, "avx2": None}) == ("c-avx512", "torch")
    assert cpu_select.available(ZEN4, {"native": None, "avx2": None}) == ("torch",)  # no compiler
    assert cpu_select.available(ARM, {"native": None, "avx2": None}) == ("torch",)
    assert cpu_select.available(ARM, {"native": NEON_BITS}) == ("c-neon", "torch")
    assert cpu_select.available(replace(ARM, flags=AVX2.flags), {"native": 0}) == ("torch",)  # not a NEON build


def test_the_fastest_candidate_that_keeps_the_invariance_promise_wins_each_class():
    timer = FakeTimer({("gemm", "c-avx512"): 1.0, ("gemm", "c-avx2"): 2.0, ("gemm", "torch"): 0.5,
                       ("attention", "c-avx512"): 3.0, ("attention", "c-avx2"): 2.0, ("attention", "torch"): 4.0})
    candidates = cpu_select.available(ZEN4, BUILDS)
    gemm = cpu_select.choose(GEMM, candidates, timer)
    assert (gemm.candidate, gemm.how) == ("c-avx512", "measured")  # torch is faster, but not invariant
    assert gemm.seconds == {"c-avx512": 1.0, "c-avx2": 2.0, "torch": 0.5}  # every candidate timed and reported
    assert gemm.describe() == "gemm:576x576 c-avx512 (c-avx2 2x, torch 0.5x its time)"
    assert cpu_select.choose(ATTENTION, candidates, timer).candidate == "c-avx2"  # each class on its own
    assert cpu_select.choose(GEMM, candidates, timer, invariant=False).candidate == "torch"  # no promise to keep
    # an AVX2-only CPU: its one C build against torch
    only_avx2 = cpu_select.choose(GEMM, cpu_select.available(AVX2, {"native": 0}), timer)
    assert only_avx2.candidate == "c-avx2" and set(only_avx2.seconds) == {"c-avx2", "torch"}


def test_amx_refused_by_the_os_is_reported_and_chooses_as_without_amx():
    assert SPR.amx and not SPR_REFUSED.amx and not ZEN4.amx
    assert "AMX refused by the OS" in SPR_REFUSED.describe() and "AMX" not in ZEN4.describe()
    assert "AMX" in SPR.describe() and "refused" not in SPR.describe() and "AVX-512" in SPR.describe()
    timer = FakeTimer({("gemm", "c-avx512"): 1.0, ("gemm", "c-avx2"): 2.0, ("gemm", "torch"): 0.5})
    assert cpu_select.choose(GEMM, cpu_select.available(SPR_REFUSED, BUILDS), timer).candidate == "c-avx512"
    # the permission is part of what a stored plan depends on
    builds = {"native": "/k/a/lib.so", "avx2": "/k/b/lib.so"}
    assert cpu_select.plan_path(SPR, builds) != cpu_select.plan_path(SPR_REFUSED, builds)


def test_aarch64_runs_its_neon_build_and_torch_only_without_one():
    timer = FakeTimer({("gemm", "c-neon"): 1.0, ("gemm", "torch"): 0.5})
    choice = cpu_select.choose(GEMM, cpu_select.available(ARM, {"native": NEON_BITS}), timer)
    assert (choice.candidate, choice.how) == ("c-neon", "measured")  # torch is faster, but not invariant
    assert choice.seconds == {"c-neon": 1.0, "torch": 0.5}
    assert cpu_select.VARIANT_OF["c-neon"] == "native"  # the -mcpu=native build
    with pytest.raises(ValueError, match=f"{ENV} asks for c-avx2 .*have: c-neon, torch"):
        cpu_select.choose(GEMM, cpu_select.available(ARM, {"native": NEON_BITS}), _never, {"*": "c-avx2"})
    # no compiler (or TSTERM_NATIVE_KERNELS=0): torch alone, untimed
    choice = cpu_select.choose(GEMM, cpu_select.available(ARM, {"native": None}), _never)
    assert (choice.candidate, choice.how, dict(choice.seconds)) == ("torch", "only", {})
    assert "aarch64" in ARM.describe() and "asimd" in ARM.describe()


def test_the_override_forces_a_kernel_per_kind_or_for_all():
    assert cpu_select.parse_override("") == {}
    assert cpu_select.parse_override("torch") == {"*": "torch"}
    assert cpu_select.parse_override("gemm=torch, attention=c-avx2") == {"gemm": "torch", "attention": "c-avx2"}
    candidates = cpu_select.available(ZEN4, BUILDS)
    forced = cpu_select.choose(GEMM, candidates, _never, cpu_select.parse_override("experts=c-avx2,gemm=torch"))
    assert (forced.candidate, forced.how) == ("torch", "forced")
    assert cpu_select.choose(EXPERTS, candidates, _never, {"experts": "c-avx2", "*": "torch"}).candidate == "c-avx2"
    for bad, what in (("gemm=cuda", "unknown kernel 'cuda'"), ("tiles=torch", "unknown kind 'tiles'")):
        with pytest.raises(ValueError, match=f"{ENV}: {what}"):
            cpu_select.parse_override(bad)
    with pytest.raises(ValueError, match=f"{ENV} asks for c-avx2 .*have: torch"):
        cpu_select.choose(GEMM, ("torch",), _never, {"*": "c-avx2"})


def test_shape_classes_check_their_sizes():
    assert GEMM.key == "gemm:576x576" and EXPERTS.key == "experts:8x512x576x2"
    assert ShapeClass("gemm", (49152, 576)).rows == 16 and GEMM.rows == 256  # a vocabulary-sized head: few rows
    with pytest.raises(ValueError, match="gemm shape class needs 2 positive sizes"):
        ShapeClass("gemm", (576,))
    with pytest.raises(ValueError, match="kind must be one of"):
        ShapeClass("conv", (1, 2))


def test_the_plan_is_measured_once_stored_and_read_back(tmp_path):
    path = tmp_path / "choices.json"
    candidates = cpu_select.available(ZEN4, BUILDS)
    timer = FakeTimer({(k, c): t for k in ("gemm", "experts", "attention")
                       for c, t in (("c-avx512", 1.0), ("c-avx2", 1.5), ("torch", 0.8))})
    first = cpu_select.resolve([GEMM, ATTENTION, GEMM], ZEN4, candidates, timer, path)
    assert timer.timed == [GEMM.key, ATTENTION.key]  # once per class
    assert json.loads(path.read_text())["classes"][GEMM.key]["candidate"] == "c-avx512"
    again = cpu_select.resolve([GEMM, ATTENTION], ZEN4, candidates, _never, path)  # a later start: nothing timed
    assert again == first
    more = cpu_select.resolve([GEMM, EXPERTS], ZEN4, candidates, timer, path)  # a new class: only it is timed
    assert timer.timed[2:] == [EXPERTS.key] and more[GEMM.key] == first[GEMM.key]
    assert set(cpu_select.read_plan(path)) == {GEMM.key, ATTENTION.key, EXPERTS.key}
    # a plan made with other candidates (the AVX2 build gone) is measured again
    fewer = cpu_select.resolve([GEMM], ZEN4, ("c-avx512", "torch"), timer, path)
    assert timer.timed[3:] == [GEMM.key] and set(fewer[GEMM.key].seconds) == {"c-avx512", "torch"}
    # a forced choice is used but never stored
    forced = cpu_select.resolve([ATTENTION], ZEN4, candidates, _never, path, {"attention": "torch"})
    assert forced[ATTENTION.key].how == "forced" and cpu_select.read_plan(path)[ATTENTION.key].candidate == "c-avx512"
    # a run without the C kernels (torch the only candidate) decides nothing for a later run that has them
    lone = cpu_select.resolve([ShapeClass("gemm", (64, 64))], ZEN4, ("torch",), _never, path)
    assert lone["gemm:64x64"].how == "only" and "gemm:64x64" not in cpu_select.read_plan(path)
    path_only = tmp_path / "only.json"  # (and a file from before that stored one is measured again)
    path_only.write_text(json.dumps({"classes": {"gemm:64x64": {"candidate": "torch", "how": "only"}}}))
    assert cpu_select.resolve([ShapeClass("gemm", (64, 64))], ZEN4, candidates, timer,
                              path_only)["gemm:64x64"].candidate == "c-avx512"
    path.write_text("{not json")
    assert cpu_select.read_plan(path) == {}
    assert cpu_select.resolve([GEMM], ZEN4, candidates, timer, path)[GEMM.key].how == "measured"


def test_the_plan_file_is_named_by_the_cpu_the_builds_and_torch(monkeypatch, tmp_path):
    builds = {"native": "/k/a/lib.so", "avx2": "/k/b/lib.so"}
    path = cpu_select.plan_path(ZEN4, builds, tmp_path)
    assert path.parent == tmp_path and path.name.startswith("choices-")
    assert cpu_select.plan_path(AVX2, builds, tmp_path) != path
    assert cpu_select.plan_path(ZEN4, dict(builds, native="/k/c/lib.so"), tmp_path) != path  # sources changed
    monkeypatch.setattr(torch, "__version__", "9.9.9")
    assert cpu_select.plan_path(ZEN4, builds, tmp_path) != path


def test_this_machine_measures_its_classes_and_keeps_them_beside_the_libraries(monkeypatch, tmp_path):
    monkeypatch.setenv("TSTERM_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(ENV, raising=False)
    torch_ops._machine.cache_clear()
    try:
        cpu, candidates, path = torch_ops._machine()
        assert path.parent == tmp_path / "kernels"
        shapes = [ShapeClass("gemm", (64, 96)), ShapeClass("attention", (4, 2, 16)),
                  ShapeClass("experts", (4, 64, 32, 2))]
        plan = torch_ops.cpu_kernel_plan(shapes)
        for shape in shapes:
            choice = plan[shape.key]
            assert choice.how == "measured" and set(choice.seconds) == set(candidates)
            assert all(t > 0 for t in choice.seconds.values())
            assert choice.candidate in cpu_select.INVARIANT  # the C kernels exist here: the promise is kept
        assert set(cpu_select.read_plan(path)) == {s.key for s in shapes}
        assert "c-avx2" in candidates and ("c-avx512" in candidates) == cpu.avx512
    finally:
        torch_ops._machine.cache_clear()


@pytest.mark.parametrize("forced", ["torch", *isa_candidates()])
def test_a_shape_class_runs_one_kernel_for_every_row_count(monkeypatch, forced):
    """The choice is the class's, not the batch's: 1, 3, 8 and 100 rows of one linear run the same build (or torch),
    a decode's one row included."""
    monkeypatch.setenv(ENV, f"gemm={forced}")
    builds = {b.variant: b for b in (cpu_native.load(), cpu_native.load_variant("avx2")) if b is not None}
    calls = {name: 0 for name in builds}
    for name, build in builds.items():
        for fn in ("f32_matmul", "f32_gemm"):
            def spy(*args, _fn=getattr(build, fn), _name=name):
                calls[_name] += 1
                return _fn(*args)
            monkeypatch.setattr(build, fn, spy)
    gen = torch.Generator().manual_seed(4)
    w, x = torch.randn(72, 80, generator=gen), torch.randn(100, 80, generator=gen)
    for rows in (1, 3, 8, 100):
        torch.testing.assert_close(torch_ops.linear(x[:rows], w), F.linear(x[:rows], w), rtol=1e-5, atol=1e-5)
    want = {name: 0 for name in builds}
    if forced != "torch":
        want[cpu_select.VARIANT_OF[forced]] = 4
    assert calls == want


@pytest.fixture(params=isa_candidates())
def build(request) -> cpu_native.NativeKernels:
    """Each C build this CPU runs, its kernels called directly."""
    kernels = cpu_native.load_variant(cpu_select.VARIANT_OF[request.param])
    assert kernels is not None and kernels.isa_name.startswith(request.param.removeprefix("c-"))
    return kernels


@pytest.mark.parametrize("rows,out_f,in_f", [(5, 40, 24), (9, 33, 513), (300, 1030, 300), (17, 64, 256),
                                              (400, 70, 800)])
def test_every_build_runs_the_gemm_like_a_float64_matmul(build, rows, out_f, in_f):
    """The GEMM of each build (the AVX-512 tile: pairs of 16-output panels, 8 rows; tails of outputs, rows and the
    256-input blocks; a pass of rows over 1 MB of x, which goes block by block over the outputs, and one under,
    which takes each pair's blocks in turn), float32 and on int8 / int4 panels, against float64."""
    gen = torch.Generator().manual_seed(rows + out_f)
    x = torch.randn(rows, in_f + 3, generator=gen)[:, :in_f]
    w = torch.randn(out_f, in_f, generator=gen)
    got = cpu_native.f32_gemm(build, x, w)
    torch.testing.assert_close(got.double(), oracles.linear(x, w), rtol=1e-5, atol=1e-5 * in_f ** 0.5)
    small, head = torch.empty(3, out_f), x[:3].contiguous()
    build.f32_matmul(head.data_ptr(), 3, in_f, w.data_ptr(), out_f, small.data_ptr())
    assert torch.equal(small, got[:3])  # the few-row kernel: the GEMM's bits
    if in_f % 32 == 0:
        for quantize, kind in ((quantize_int8, 1), (quantize_int4, 2)):
            q = quantize(w)
            y = torch.empty(rows, out_f)
            build.q_gemm(x.data_ptr(), x.stride(0), rows, in_f, kind, q.data.data_ptr(), q.scale.data_ptr(), out_f,
                         y.data_ptr())
            torch.testing.assert_close(y.double(), oracles.linear(x, oracles.dequantize(q).float()), rtol=1e-5,
                                       atol=1e-5 * in_f ** 0.5)


def _int8_rows(build, x, q) -> torch.Tensor:
    """quantized_linear's C call (csrc/gemv.c: x's rows rounded to int8 blocks, the integer dot products) by `build`."""
    y = torch.empty(x.shape[0], q.dims[0])
    fn = build.q8_matmul if q.kind == "int8" else build.q4_matmul
    assert fn(x.data_ptr(), x.shape[0], x.shape[1], q.data.data_ptr(), q.scale.data_ptr(), q.dims[0], y.data_ptr()) == 0
    return y


@pytest.mark.parametrize("quantize", [quantize_int8, quantize_int4], ids=["int8", "int4"])
@pytest.mark.parametrize("rows", [1, 4, 16])
def test_every_build_runs_the_int8_row_matmuls_like_the_oracle(build, quantize, rows):
    """The integer dot products of each build (VNNI's vpdpbusd where the build has it, else maddubs + madd), with
    the largest codes either side (127 against 127: the int16 bound maddubs must not reach)."""
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(72, 256, generator=gen)
    w[:, ::32] = 50.0  # each block's largest weight: a code of 127
    q = quantize(w)
    x = torch.randn(rows, 256, generator=gen) * 3
    x[:, 1::32] = -20.0  # each block's largest input, negative: a code of -127
    got = _int8_rows(build, x, q)
    want = oracles.int8_rows_matmul(x, q)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=2e-6 * want.abs().max().item())


def test_the_builds_give_the_same_bits():
    """The AVX-512 and AVX2 builds sum every output in one order (the float32 GEMM, the int8 rows' integer dot
    products): a shape class may take either without changing a single bit (on a CPU without AVX-512 there is one
    build: nothing to compare)."""
    builds = [cpu_native.load_variant(cpu_select.VARIANT_OF[name]) for name in isa_candidates()]
    gen = torch.Generator().manual_seed(7)
    x, w = torch.randn(203, 608, generator=gen), torch.randn(330, 608, generator=gen)
    outs = [cpu_native.f32_gemm(b, x, w) for b in builds]
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    x2, w2 = torch.randn(400, 800, generator=gen), torch.randn(70, 800, generator=gen)  # both loop orders
    outs = [cpu_native.f32_gemm(b, x2, w2) for b in builds]
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    for q in (quantize_int8(w), quantize_int4(w)):
        outs = [_int8_rows(b, x[:9], q) for b in builds]
        assert all(torch.equal(outs[0], o) for o in outs[1:])
    assert len(builds) == 2 or not CpuInfo.detect().avx512
    if len(builds) == 2:  # what each build runs: the native one AVX-512 (and VNNI where the CPU has it), the other not
        assert builds[0].isa_bits & cpu_native.ISA_AVX512 and builds[1].isa_bits == 0
        assert bool(builds[0].isa_bits & cpu_native.ISA_VNNI) == ("avx512_vnni" in CpuInfo.detect().flags)


def test_choice_describes_a_forced_and_an_only_choice():
    assert Choice(GEMM, "torch", "forced").describe() == "gemm:576x576 torch (forced)"
    assert Choice(GEMM, "torch", "only").describe() == "gemm:576x576 torch (only)"
