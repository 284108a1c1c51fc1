#!/usr/bin/env bash
# One prepared GPU session (one call, under 10 minutes): the GPU tests (kernels compiled on the device, the CUDA
# decode path: no host syncs, graph replay = eager, greedy output = CPU reference; start-up: the profile run before the
# KV pool, every decode graph captured before the first request; the hybrid path with no host sync or host-to-device
# copy in its forward; NCCL process groups, TP over NCCL on 2+ GPUs), the kernel microbenchmarks (and the
# Gated DeltaNet ones: prefill time per chunk, decode), then
# batch-1 decode of a Qwen3-30B-A3B-shaped model, eager vs CUDA graphs, against its roofline, then one GPU vs
# tensor/expert parallel ranks where the machine has 2+ GPUs (it says so where it has one); a summary table prints last. Usage, from anywhere: bash scripts/gpu_check.sh
# Uses $PYTHON (default python3, the GPU machine's own interpreter, with its torch and triton), into which it installs
# this checkout in editable mode when it is not installed yet.
# Time: every phase runs under `timeout`, sized from one deadline ($GPU_CHECK_SECONDS, default 540) so that the
# whole script ends within it, each later phase keeping a reserve.
# Exit status: non-zero when the GPU tests or a benchmark fail.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
DEADLINE=${GPU_CHECK_SECONDS:-540}
unset TRITON_INTERPRET  # compiled kernels; the CPU suite's conftest would set it, hence --noconftest below
export PYTHONUNBUFFERED=1  # a phase killed at its time limit still shows what it printed

# An editable install of this checkout into the machine's own interpreter (offline: no dependencies, no build
# isolation; torch and triton are the machine's): `tsterm` and `tsterm_kernels` (the kernels/ directory) import as
# installed. The same step a developer takes: `pip install -e .`
if ! "$PYTHON" -c "import tsterm_kernels.dispatch, tsterm, sys; sys.exit(tsterm.__file__.startswith('$PWD/') == False)" 2>/dev/null; then
  if ! "$PYTHON" -m pip install -q --no-deps --no-build-isolation -e .; then
    # (an interpreter whose setuptools cannot build an editable wheel offline: reach kernels/ under its package name)
    echo "gpu_check: 'pip install -e .' failed; running from the checkout through a tsterm_kernels link instead"
    shim=$(mktemp -d) && ln -s "$PWD/kernels" "$shim/tsterm_kernels" && export PYTHONPATH="$shim"
  fi
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the tests' own helpers: `tests.kernels.cases`, `tests.helpers`

# seconds left for a phase: what remains of the deadline minus the reserve ($1) of the phases after it, >= 30
limit() { local left=$((DEADLINE - SECONDS - $1)); echo $((left < 30 ? 30 : left)); }

echo "== environment =="
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || echo "nvidia-smi: n/a"
"$PYTHON" -c "import sys, torch, triton; print('python', sys.version.split()[0], '| torch', torch.__version__, '| triton', triton.__version__, '| cuda', torch.cuda.is_available())"

GPU_TESTS=(tests/kernels/test_triton_gpu.py tests/kernels/test_triton_gated_delta_gpu.py tests/engine/test_decode_graphs_gpu.py
           tests/engine/test_startup_gpu.py tests/engine/test_hybrid_gpu.py tests/distributed/test_nccl_gpu.py
           tests/engine/test_core_process_gpu.py tests/kernels/test_moe_routing_gpu.py
           tests/engine/test_spec_decode_hybrid_gpu.py tests/model/test_mla_gpu.py tests/model/test_gpt_oss_gpu.py tests/kernels/test_triton_mla_gpu.py
           tests/engine/test_kv_host_gpu.py tests/model/test_gpt_oss_mxfp4_gpu.py tests/kernels/test_triton_clamped_moe_gpu.py)
echo; echo "== GPU tests: kernels in bf16 at real sizes, the CUDA decode path, start-up (profile run, graphs captured at start), the hybrid path without host syncs, NCCL groups, the engine core process on the device, sigmoid / grouped routing, hybrid speculation, MLA, gpt-oss sinks and MXFP4 experts, the KV host tier (${GPU_TESTS[*]}) =="
test_log=$(mktemp)
timeout "$(limit 230)" "$PYTHON" -m pytest --noconftest -q -rs -p no:cacheprovider "${GPU_TESTS[@]}" 2>&1 | tee "$test_log"
tests_rc=${PIPESTATUS[0]}
tests_line=$(grep -E "passed|failed|error|skipped" "$test_log" | tail -n 1)

echo; echo "== kernel microbenchmarks =="
kernel_summary=$(mktemp)
timeout "$(limit 150)" "$PYTHON" benchmarks/gpu_kernels.py --summary-file "$kernel_summary"
kernel_rc=$?

echo; echo "== Gated DeltaNet kernels: varlen chunked prefill and decode, against the twins on the device =="
gated_summary=$(mktemp)
timeout "$(limit 110)" "$PYTHON" benchmarks/gpu_gated_delta.py --summary-file "$gated_summary"
gated_rc=$?

echo; echo "== batch-1 decode: Qwen3-30B-A3B shape, eager vs CUDA graphs =="
decode_summary=$(mktemp)
timeout "$(limit 20)" "$PYTHON" benchmarks/gpu_decode.py --summary-file "$decode_summary"
decode_rc=$?

echo; echo "== one GPU vs tensor/expert parallel (2+ GPUs) =="
parallel_summary=$(mktemp)
timeout "$(limit 0)" "$PYTHON" benchmarks/gpu_parallel.py --summary-file "$parallel_summary"
parallel_rc=$?

status() { [ "$1" = 0 ] && echo ok || { [ "$1" = 124 ] && echo "TIMEOUT" || echo FAILED; }; }
echo; echo "================================ summary ================================"
printf '%-26s rc=%-3s %s\n' "GPU tests" "$tests_rc" "${tests_line:-no result (timeout?)}"
printf '%-26s rc=%-3s %s\n' "kernel microbenchmarks" "$kernel_rc" "$(status "$kernel_rc")"
printf '%-26s rc=%-3s %s\n' "gated delta kernels" "$gated_rc" "$(status "$gated_rc")"
printf '%-26s rc=%-3s %s\n' "decode benchmark" "$decode_rc" "$(status "$decode_rc")"
printf '%-26s rc=%-3s %s\n' "parallel comparison" "$parallel_rc" "$(status "$parallel_rc")"
printf '%-26s %ss of %ss\n' "wall time" "$SECONDS" "$DEADLINE"
[ -s "$kernel_summary" ] && { echo; cat "$kernel_summary"; }
[ -s "$gated_summary" ] && { echo; cat "$gated_summary"; }
[ -s "$decode_summary" ] && { echo; cat "$decode_summary"; }
[ -s "$parallel_summary" ] && { echo; cat "$parallel_summary"; }
if [ -n "${OUT:-}" ] && [ -d "$OUT" ]; then
  cp "$test_log" "$OUT/gpu_tests.log"
  [ -s "$kernel_summary" ] && cp "$kernel_summary" "$OUT/gpu_bench_summary.txt"
  [ -s "$gated_summary" ] && cp "$gated_summary" "$OUT/gpu_gated_delta_summary.txt"
  [ -s "$decode_summary" ] && cp "$decode_summary" "$OUT/gpu_decode_summary.txt"
  [ -s "$parallel_summary" ] && cp "$parallel_summary" "$OUT/gpu_parallel_summary.txt"
fi
[ "$tests_rc" = 0 ] && [ "$kernel_rc" = 0 ] && [ "$gated_rc" = 0 ] && [ "$decode_rc" = 0 ] && [ "$parallel_rc" = 0 ]
