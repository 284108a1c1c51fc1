#!/usr/bin/env bash
# One prepared GPU session (one call, well under 8 minutes): the kernel tests compiled on the device, then the
# kernel microbenchmarks; a summary table prints last. Usage, from anywhere: bash scripts/gpu_check.sh
# Works without installing anything: uses $PYTHON (default python3, the GPU machine's own interpreter) and, when
# tsterm_kernels is not installed, reaches the kernels/ directory through a symlink on PYTHONPATH.
# Exit status: non-zero when the GPU tests or the benchmarks fail.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
unset TRITON_INTERPRET  # compiled kernels; the CPU suite's conftest would set it, hence --noconftest below

if ! "$PYTHON" -c "import tsterm_kernels" 2>/dev/null; then
  shim=$(mktemp -d)
  ln -s "$PWD/kernels" "$shim/tsterm_kernels"
  export PYTHONPATH="$shim:$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # `tests.kernels.cases`

echo "== environment =="
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || echo "nvidia-smi: n/a"
"$PYTHON" -c "import sys, torch, triton; print('python', sys.version.split()[0], '| torch', torch.__version__, '| triton', triton.__version__, '| cuda', torch.cuda.is_available())"

echo; echo "== GPU kernel tests (bf16, real sizes) =="
test_log=$(mktemp)
timeout 270 "$PYTHON" -m pytest --noconftest -q -rs -p no:cacheprovider tests/kernels/test_triton_gpu.py 2>&1 | tee "$test_log"
tests_rc=${PIPESTATUS[0]}
tests_line=$(grep -E "passed|failed|error|skipped" "$test_log" | tail -n 1)

echo; echo "== kernel microbenchmarks =="
summary=$(mktemp)
timeout 180 "$PYTHON" benchmarks/gpu_kernels.py --summary-file "$summary"
bench_rc=$?

echo; echo "================================ summary ================================"
printf '%-26s rc=%-3s %s\n' "GPU kernel tests" "$tests_rc" "${tests_line:-no result (timeout?)}"
printf '%-26s rc=%-3s %s\n' "kernel microbenchmarks" "$bench_rc" "$( [ "$bench_rc" = 0 ] && echo ok || echo FAILED)"
[ -s "$summary" ] && cat "$summary"
if [ -n "${OUT:-}" ] && [ -d "$OUT" ]; then cp "$test_log" "$OUT/gpu_tests.log"; [ -s "$summary" ] && cp "$summary" "$OUT/gpu_bench_summary.txt"; fi
[ "$tests_rc" = 0 ] && [ "$bench_rc" = 0 ]
