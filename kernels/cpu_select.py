"""Which CPU kernel runs each shape class of a model, chosen by measuring the candidates on this machine once.

tsterm's C kernels (`cpu_native`, csrc/) were tuned on AVX2 cores, where they beat torch's MKL GEMM and flash
attention; on other CPUs (AVX-512, AMX, ARM) the fastest path differs, so it is measured, not assumed. A *shape
class* is one kind of op at one set of weight / head sizes, independent of the row count: "gemm" (a float32
linear, dims (out, in)), "experts" (a float32 stack of SwiGLU experts, dims (experts, 2 * inter, hidden, top_k)),
"attention" (causal prefill attention, dims (query heads, KV heads, head size)), "bf16" (a bfloat16 linear: a model run
with dtype bfloat16 on the CPU, dims (out, in); its routed experts' matrices are such linears too), "bf16-attention"
(the attention of a bfloat16 KV pool, prefill and decode alike, dims as "attention"'s). The *candidates*:

- "c-avx512": the C kernels built with -march=native on a CPU with AVX-512F (csrc/gemm.c's 512-bit tile);
- "c-avx2": the same sources built without AVX-512 (-mno-avx512f): what an AVX2-only CPU runs;
- "c-neon": the same sources built on aarch64 (-mcpu=native): NEON, with sdot where the CPU has the dotprod extension;
- "torch": torch's own path (MKL / oneDNN GEMM, the flash attention kernel, the experts' op loop);
- for "bf16" only: "c-amx", csrc/bf16.c on AMX tiles (where the CPU has AMX-BF16 and the OS grants the tile state),
  and "c-bf16", the same file's AVX512-BF16 code (vdpbf16ps) where the build has it, else its plain float32 code.
  The two round differently (each keeps its own bits for every row count); a class runs one of them.
- for "bf16-attention" only: "c-amx", csrc/attention.c's AMX arithmetic (q and P rounded to bfloat16, both products
  on AMX tiles, float32 sums), and "c-bf16", the pool widened to float32 as it is read and the float32 arithmetic of
  the "attention" class's kernel (the same bits as on the pool converted to float32).

Invariance (README "Same answer whatever the cache or the batch"): the C variants compute every output in the
same order (the same bits, tests/kernels run each variant), so choosing between them keeps the promise. torch's
path does not keep it (MKL's blocking depends on the row count), so the engine picks among the C variants wherever
they exist and reports what torch measured beside them; torch runs where no C kernel is built (no
compiler, `TSTERM_NATIVE_KERNELS=0`) or where `TSTERM_CPU_KERNELS` forces it. A class's choice is made once, for all
row counts: the op never switches arithmetic with the batch.

The measurement: each candidate runs the class at a representative size (`ShapeClass.rows`) for a few tens of
milliseconds (the minimum of repeated runs), a few hundred milliseconds for a model, on one thread (`choose`; timed
by that thread's CPU clock where the timer uses `measure`), so that other processes sharing the cores cannot decide
it (see `measure`). The choices are kept in a JSON
file next to the built libraries (`cpu_native.cache_dir()`), named by a hash of what they depend on (the CPU's
model, flags and AMX permission, the libraries' builds, torch's version); a later start reads them back.

`TSTERM_CPU_ISA=avx2` (cpu_native.isa_limit) restricts all of it to AVX2: the CPU is described without its AVX-512,
AVX-VNNI and AMX flags (`CpuInfo.restricted`) and the C kernels load their avx2 build, so the candidates are "c-avx2"
and "torch" (and "c-bf16" in its plain float32 code): an AVX-512 machine measured as an AVX2-only one would run.

`TSTERM_CPU_KERNELS` forces a choice: a candidate name for every class ("torch", "c-avx2"), or per kind
("gemm=torch,attention=c-avx2"); a name this machine does not have is an error naming the variable.
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tsterm_kernels import cpu_native

from tsterm.cpu import amx_granted, read_cpuinfo

ENV = "TSTERM_CPU_KERNELS"
KINDS = ("gemm", "experts", "attention", "bf16", "bf16-attention")
CANDIDATES = ("c-avx512", "c-avx2", "c-neon", "torch", "c-amx", "c-bf16")
# the candidates that keep the invariance promise (a row's bits whatever the rows beside it)
INVARIANT = frozenset({"c-avx512", "c-avx2", "c-neon", "c-amx", "c-bf16"})
BF16_CANDIDATES = ("c-amx", "c-bf16", "torch")  # a "bf16" class's; the float32 kinds' are the others
BF16_ATTENTION_CANDIDATES = ("c-amx", "c-bf16")  # a "bf16-attention" class's
BF16_ISA = {"c-amx": 2}  # candidate -> csrc/bf16.c's isa argument ("c-bf16": the build's best of 1 and 0)
VARIANT_OF = {"c-avx512": "native", "c-avx2": "avx2", "c-neon": "native"}  # candidate -> cpu_native.VARIANTS build
FORMAT = 1  # of the JSON file

@dataclass(frozen=True)
class CpuInfo:
    """What the CPU reports (/proc/cpuinfo's model name and flags) and what the OS allows (AMX)."""

    machine: str  # platform.machine(): "x86_64", "aarch64"
    model: str
    flags: frozenset[str]
    amx_allowed: bool = False  # the OS granted the AMX tile state (only asked where the CPU reports AMX)
    limit: str = "native"  # cpu_native.ISA_ENV's limit applied to `flags` (`restricted`)

    @classmethod
    def detect(cls) -> CpuInfo:
        model, flags = read_cpuinfo()
        limit = cpu_native.isa_limit()
        return cls(platform.machine(), model, flags, amx_granted(flags, limit)).restricted(limit)

    def restricted(self, limit: str) -> CpuInfo:
        """This CPU as TSTERM_CPU_ISA=`limit` presents it: "avx2" drops every AVX-512, AVX-VNNI and AMX flag (what
        cpu_native's avx2 build leaves out), "native" keeps it as it is."""
        if limit == "native":
            return self
        if limit != "avx2" or not self.x86:
            raise ValueError(f"{cpu_native.ISA_ENV}={limit}: only 'avx2' restricts, on x86-64 ({self.machine} here)")
        flags = frozenset(f for f in self.flags if not f.startswith(("avx512", "amx", "avx_vnni")))
        return CpuInfo(self.machine, self.model, flags, False, limit)

    @property
    def x86(self) -> bool:
        return self.machine in ("x86_64", "AMD64")

    @property
    def arm(self) -> bool:
        """A 64-bit ARM CPU (NEON is part of the architecture there)."""
        return self.machine in cpu_native.ARM_MACHINES

    @property
    def avx2(self) -> bool:
        return self.x86 and {"avx2", "fma", "f16c"} <= self.flags

    @property
    def avx512(self) -> bool:
        return self.avx2 and "avx512f" in self.flags

    @property
    def amx(self) -> bool:
        """AMX usable: the CPU has bf16 tiles and the OS allows them."""
        return "amx_bf16" in self.flags and self.amx_allowed

    def describe(self) -> str:
        """One line: the model and the vector extensions the kernels care about."""
        if not self.x86:
            simd = [f for f in ("asimd", "asimddp", "sve", "sve2", "bf16", "i8mm") if f in self.flags]
            return f"{self.model} ({self.machine}{': ' + ', '.join(simd) if simd else ''})"
        parts = ["AVX-512" if self.avx512 else "AVX2" if self.avx2 else "no AVX2"]
        parts += [name for flag, name in (("avx512_vnni", "VNNI"), ("avx512_bf16", "AVX512-BF16"),
                                          ("avx512_fp16", "AVX512-FP16")) if flag in self.flags]
        if "amx_tile" in self.flags:
            parts.append("AMX" if self.amx_allowed else "AMX refused by the OS")
        if self.limit != "native":
            parts.append(f"limited by {cpu_native.ISA_ENV}={self.limit}")
        return f"{self.model} ({self.machine}: {', '.join(parts)})"

    def fingerprint(self) -> str:
        return f"{self.machine}|{self.model}|{' '.join(sorted(self.flags))}|amx={self.amx_allowed}|{self.limit}"


@dataclass(frozen=True)
class ShapeClass:
    """One op at one size, for any number of rows (see the module doc for `kind` and `dims`)."""

    kind: str
    dims: tuple[int, ...]

    def __post_init__(self):
        want = {"gemm": 2, "experts": 4, "attention": 3, "bf16": 2, "bf16-attention": 3}
        if self.kind not in want:
            raise ValueError(f"shape class kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if len(self.dims) != want[self.kind] or not all(isinstance(d, int) and d > 0 for d in self.dims):
            raise ValueError(f"{self.kind} shape class needs {want[self.kind]} positive sizes, got {self.dims!r}")

    @property
    def key(self) -> str:
        return f"{self.kind}:{'x'.join(map(str, self.dims))}"

    @property
    def rows(self) -> int:
        """The row count the candidates are timed at: a prefill chunk's worth, fewer where a call would take long
        (about 0.2 GFLOP a call for a GEMM: a vocabulary-sized LM head runs 16 rows)."""
        if self.kind in ("gemm", "bf16"):
            out_f, in_f = self.dims
            return max(16, min(256, int(1e8 // (out_f * in_f)) // 16 * 16))
        if self.kind == "experts":
            return 216  # an extend's chunk of tokens, spread over the experts by top-k
        return 512  # causal prefill attention: new tokens of one sequence


@dataclass(frozen=True)
class Choice:
    """A shape class's candidate and why: "measured" (seconds: each candidate's time, the fastest eligible chosen),
    "forced" (TSTERM_CPU_KERNELS), "only" (a single candidate, not timed)."""

    shape: ShapeClass
    candidate: str
    how: str
    seconds: Mapping[str, float] = field(default_factory=dict)

    def describe(self) -> str:
        text = f"{self.shape.key} {self.candidate}"
        if self.how != "measured":
            return f"{text} ({self.how})"
        mine = self.seconds[self.candidate]  # each other candidate's time as a multiple of the chosen one's
        others = ", ".join(f"{name} {t / mine:.3g}x" for name, t in self.seconds.items() if name != self.candidate)
        return f"{text} ({others or 'alone'} its time)"

    def as_json(self) -> dict:
        return {"candidate": self.candidate, "how": self.how, "seconds": dict(self.seconds)}


def available(cpu: CpuInfo, builds: Mapping[str, int | None]) -> tuple[str, ...]:
    """The candidates this machine has: `builds` maps a cpu_native variant to its tsterm_isa() bits, or None where
    that build is absent (not built, not loadable). A C variant counts only where the CPU runs its code."""
    have = []
    native = builds.get("native")
    if cpu.avx512 and native is not None and native & cpu_native.ISA_AVX512:
        have.append("c-avx512")
    if cpu.avx2 and native is not None:
        # the avx2 build, or a native build that is AVX2 code (an AVX2-only CPU builds nothing else)
        if not native & cpu_native.ISA_AVX512 or builds.get("avx2") is not None:
            have.append("c-avx2")
    if cpu.arm and native is not None and native & cpu_native.ISA_NEON:
        have.append("c-neon")
    have.append("torch")
    return tuple(have)


def parse_override(text: str | None) -> dict[str, str]:
    """TSTERM_CPU_KERNELS -> {kind or "*": candidate}; ValueError naming the variable for anything else."""
    if not text:
        return {}
    out = {}
    for part in text.split(","):
        kind, eq, name = part.strip().rpartition("=")
        kind = kind.strip() if eq else "*"
        name = name.strip()
        if kind != "*" and kind not in KINDS:
            raise ValueError(f"{ENV}: unknown kind {kind!r} in {text!r} (kinds: {', '.join(KINDS)})")
        if name not in CANDIDATES:
            raise ValueError(f"{ENV}: unknown kernel {name!r} in {text!r} (have: {', '.join(CANDIDATES)})")
        if kind != "*" and name not in kind_candidates(kind):
            raise ValueError(f"{ENV}: {name} is no {kind} kernel in {text!r} (have: {', '.join(kind_candidates(kind))})")
        out[kind] = name
    return out


def kind_candidates(kind: str) -> tuple[str, ...]:
    """The candidates that exist for a kind at all (BF16_CANDIDATES for "bf16", BF16_ATTENTION_CANDIDATES for
    "bf16-attention", the float32 ones for the others)."""
    if kind == "bf16-attention":
        return BF16_ATTENTION_CANDIDATES
    return BF16_CANDIDATES if kind == "bf16" else tuple(c for c in CANDIDATES if c not in BF16_CANDIDATES[:-1])


def bf16_available(cpu: CpuInfo, bits: int | None) -> tuple[str, ...]:
    """A "bf16" class's candidates on this machine: `bits` is the native build's tsterm_bf16_isa() (2: AMX code built
    and the tile state granted), None where the C kernels are absent."""
    have = []
    if bits is not None and cpu.amx and bits & 2:
        have.append("c-amx")
    if bits is not None and cpu.x86:
        have.append("c-bf16")
    return (*have, "torch")


def bf16_attention_available(cpu: CpuInfo, bits: int | None) -> tuple[str, ...]:
    """A "bf16-attention" class's candidates: "c-amx" where bf16.c's AMX code is built and granted (`bits` as for
    bf16_available), and always "c-bf16" (the widened float32 path, whichever kernel the "attention" class runs)."""
    return ("c-amx", "c-bf16") if bits is not None and cpu.amx and bits & 2 else ("c-bf16",)


def _forced(kind: str, override: Mapping[str, str] | None) -> str | None:
    """The candidate `override` forces on a kind: its own entry, else the "*" one where it names a kernel of the kind
    (TSTERM_CPU_KERNELS=c-avx2 forces the float32 classes and leaves the bfloat16 ones to their measurement)."""
    override = override or {}
    if kind in override:
        return override[kind]
    forced = override.get("*")
    return forced if forced in kind_candidates(kind) else None


# (class, candidates) -> each candidate's seconds for one call at class.rows rows (timed interleaved)
Timer = Callable[[ShapeClass, tuple[str, ...]], Mapping[str, float]]


@contextmanager
def one_thread():
    """torch's (and so the C kernels') thread count set to 1 inside, restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def measure(runs: Mapping[str, Callable[[], object]], seconds_per_candidate: float, max_rounds: int = 64,
            clock: Callable[[], float] = time.thread_time) -> dict[str, float]:
    """Each candidate's seconds for one call of its `runs` entry: one warm call each, then rounds that call every
    candidate once in turn (a load that changes meanwhile slows them alike), at least 3 and at most `max_rounds`,
    until each had about `seconds_per_candidate`; each one's fastest call counts. Timed by `clock`, the calling
    thread's CPU time, on one thread (`one_thread`).

    Why not the wall clock on every core: on a machine that other processes share, a kernel on two threads waits at
    each of its barriers for the thread that lost its core (a time slice), so the wall time of a call measures the
    neighbours. On the 2-core machine of issue 34, busy with other jobs (load 5-7), the bench model's classes timed
    that way took 10-80x a quiet run's time, and the plans kept in its kernel cache chose the AVX2 build over the
    AVX-512 one for a GEMM or the experts (1.3-1.45x slower there when quiet) in 5 of 12 builds. One thread's CPU
    clock leaves out the time the thread waited for its core: the same classes, timed so under that load, came
    within a few percent of each other from run to run and ranked the builds as a quiet machine does. The C builds
    differ in their instruction set, not their threading, so their ranking on one thread is their ranking on
    several."""
    best = dict.fromkeys(runs, float("inf"))
    with one_thread():
        for run in runs.values():
            run()  # warm: first touch of the outputs, the thread pool
        spent = 0.0
        for i in range(max_rounds):
            for name, run in runs.items():
                t0 = clock()
                run()
                took = clock() - t0
                best[name] = min(best[name], took)
                spent += took
            if i >= 2 and spent > seconds_per_candidate * len(runs):
                break
    return best


def choose(shape: ShapeClass, candidates: Iterable[str], timer: Timer, override: Mapping[str, str] | None = None,
           invariant: bool = True) -> Choice:
    """The candidate for one shape class: the forced one (`override`, from parse_override), else the fastest by
    `timer` among the eligible ones, that is the invariant ones where any exist (`invariant`), else all. Every
    candidate is timed (what torch measured is reported beside the C kernels' figures), on one thread (`measure`)."""
    candidates = tuple(candidates)
    forced = _forced(shape.kind, override)
    if forced is not None:
        if forced not in candidates:
            raise ValueError(f"{ENV} asks for {forced} ({shape.key}), which this machine does not have "
                             f"(have: {', '.join(candidates)})")
        return Choice(shape, forced, "forced")
    if len(candidates) == 1:
        return Choice(shape, candidates[0], "only")
    with one_thread():  # (not every core: see `measure`)
        timed = timer(shape, candidates)
    seconds = {name: float(timed[name]) for name in candidates}
    eligible = [name for name in candidates if name in INVARIANT] if invariant else []
    best = min(eligible or candidates, key=lambda name: seconds[name])
    return Choice(shape, best, "measured", seconds)


def plan_path(cpu: CpuInfo, builds: Mapping[str, str | None], root: Path | None = None) -> Path:
    """Where this machine's choices live: next to the built libraries, named by what they depend on (the CPU, the
    builds' paths, which hash their sources and flags, and torch's version)."""
    digest = hashlib.sha256("\n".join((cpu.fingerprint(), *(f"{k}={v}" for k, v in sorted(builds.items())),
                                       torch.__version__, str(FORMAT))).encode()).hexdigest()[:16]
    return (root or cpu_native.cache_dir()) / f"choices-{digest}.json"


def read_plan(path: Path) -> dict[str, Choice]:
    """The choices stored at `path` (measured ones only: a forced choice is never stored); {} when absent or
    unreadable (a later measurement rewrites it)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    out = {}
    for key, entry in (data.get("classes") or {}).items() if isinstance(data, dict) else ():
        try:
            kind, dims = key.split(":")
            shape = ShapeClass(kind, tuple(int(d) for d in dims.split("x")))
            if entry["candidate"] in CANDIDATES and entry["how"] in ("measured", "only"):
                out[key] = Choice(shape, entry["candidate"], entry["how"],
                                  {str(k): float(v) for k, v in entry.get("seconds", {}).items()})
        except (ValueError, KeyError, TypeError, AttributeError):
            continue
    return out


def write_plan(path: Path, cpu: CpuInfo, choices: Iterable[Choice]) -> None:
    """Merge `choices` into the file (re-read first: another process may have added classes), atomically."""
    merged = {key: c.as_json() for key, c in read_plan(path).items()}
    # (neither a forced choice nor a lone candidate is a measurement: a run without the C kernels, where torch is the
    # only candidate, must not decide for a later one that has them)
    merged.update({c.shape.key: c.as_json() for c in choices if c.how == "measured"})
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".json", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump({"format": FORMAT, "cpu": cpu.describe(), "torch": torch.__version__, "classes": merged}, f,
                      indent=1, sort_keys=True)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def resolve(shapes: Iterable[ShapeClass], cpu: CpuInfo, candidates: Iterable[str], timer: Timer,
            path: Path | None, override: Mapping[str, str] | None = None) -> dict[str, Choice]:
    """Every class's choice: forced ones from `override`, stored ones from `path`, the rest measured now (and
    stored when `path` is given). A stored choice whose candidate is no longer available is measured again."""
    candidates = tuple(candidates)
    stored = read_plan(path) if path is not None else {}
    out, fresh = {}, []
    for shape in dict.fromkeys(shapes):
        choice = stored.get(shape.key)
        forced = _forced(shape.kind, override)
        if forced is not None or choice is None or choice.candidate not in candidates or (
                choice.how == "measured" and set(choice.seconds) != set(candidates)) or (
                choice.how == "only" and candidates != (choice.candidate,)):
            choice = choose(shape, candidates, timer, override)
            if choice.how != "forced":
                fresh.append(choice)
        out[shape.key] = choice
    if fresh and path is not None:
        try:
            write_plan(path, cpu, fresh)
        except OSError:
            pass  # a read-only cache: measured again next start
    return out


def describe(choices: Mapping[str, Choice]) -> str:
    """The plan in one line for the engine's start report."""
    return "; ".join(c.describe() for c in choices.values()) or "no float32 shape class to choose for"
