#!/usr/bin/env bash
# The one script a GPU session runs on the device machine, from the repository's root, with the wheels of
# benchmarks/gpu_wheels.txt downloaded into .whl/ and the default model split into .model/ (docs/performance.md
# "On a GPU"). A call carries at most 64 MiB, so the work goes over two calls to one warm machine, each carrying a
# part of the model, the second straight after the first (what the first installed and built stays there):
#
#     run(command="bash benchmarks/gpu_check.sh --only tests", carry=[".whl",
#         ".model/SmolLM2-135M-Instruct.Q4_1.gguf.0"], timeout_s=300)
#     run(command="bash benchmarks/gpu_check.sh --only model,bench", carry=[".model/SmolLM2-135M-Instruct.Q4_1.gguf.1",
#         ".model/SmolLM2-135M-Instruct.Q4_1.gguf.sha256"], timeout_s=480)
#
# It exits with the first failed step's status (0: every step passed).
# Steps, each bounded by `timeout`, all of them within 9.5 minutes (the benchmark takes what the others left): the
# wheels installed into /tmp/site (--no-deps, PYTHONPATH; once a machine), the GPU and the versions, the native GGUF
# kernels built in the background (the GGUF tests and the benchmark's GGUF row wait for that build rather than
# starting their own), tests/test_cuda.py (-m cuda), the default model's checks where its parts are in .model/
# (benchmarks/default_model_gpu.py), where a decode step's time goes (benchmarks/gpu_step.py), then python -m
# benchmarks.gpu. --only takes some of tests, step, model, bench;
# PYTEST_K (a -k expression) some of the tests, BENCH_ARGS more arguments of the benchmark, *_SECONDS each step's
# time. What comes back in $OUT: env.log, kernels.log, pytest.log, step.log and .json, default_model.log and .json,
# gpu.log, gpu.json.
#
#     bash benchmarks/gpu_check.sh --quick --no-wheels     # here, without a GPU: the script's own check, on a GPU
#                                                          # the CPU plays (tests/virtual_cuda.py): the tests, and
#                                                          # the benchmark's tiny shapes
set -u
quick=0 wheels=1 only=tests,step,model,bench
usage() { echo "usage: bash benchmarks/gpu_check.sh [--quick] [--no-wheels] [--only tests,step,model,bench]" >&2; exit 2; }
while [ $# -gt 0 ]; do
    case "$1" in
        --quick) quick=1 ;;
        --no-wheels) wheels=0 ;;
        --only) [ $# -ge 2 ] || usage; only=$2; shift ;;
        *) usage ;;
    esac
    shift
done
for step in ${only//,/ }; do case "$step" in tests|step|model|bench) ;; *) usage ;; esac; done
wants() { case ",$only," in *",$1,"*) return 0 ;; *) return 1 ;; esac; }
start=$(date +%s)
OUT=${OUT:-$(mktemp -d /tmp/gpu_check.XXXXXX)}
PYTHON=${PYTHON:-python3}
PYTEST_SECONDS=${PYTEST_SECONDS:-210}
STEP_SECONDS=${STEP_SECONDS:-90}
MODEL_SECONDS=${MODEL_SECONDS:-100}
BENCH_SECONDS=${BENCH_SECONDS:-310}
BENCH_BUDGET=${BENCH_BUDGET:-270}
PYTEST_K=${PYTEST_K:-}  # a -k expression: some of the tests (a second try at those that failed)
BENCH_ARGS=${BENCH_ARGS:-}  # more arguments of benchmarks.gpu (--shapes ..., --no-gguf, ...)
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# One cache for every step: the GGUF header caches, and the kernels (TORCH_EXTENSIONS_DIR, which tests/conftest.py
# would otherwise derive from XDG_CACHE_HOME in a folder of its own).
export XDG_CACHE_HOME=${XDG_CACHE_HOME:-/tmp/rungen-cache}
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$XDG_CACHE_HOME/torch_extensions}
mkdir -p "$OUT" "$XDG_CACHE_HOME"
elapsed() { echo "$(( $(date +%s) - start )) s"; }

if [ "$wheels" = 1 ]; then
    if [ -f /tmp/site/.gpu_check_installed ]; then  # an earlier call on this machine installed them
        export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
    elif ls .whl/*.whl >/dev/null 2>&1; then
        timeout -k 5 90 "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target /tmp/site .whl/*.whl || { echo "installing .whl/ failed"; exit 1; }
        ls .whl >/tmp/site/.gpu_check_installed
        export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
    else
        echo "no .whl/*.whl (carry .whl): the image's packages as they are; tests needing others skip or fail"
    fi
fi

{
    echo "== $(date -u) gpu_check.sh: quick=$quick wheels=$wheels"
    nvidia-smi -L 2>&1 || echo "no nvidia-smi"
    timeout -k 5 60 "$PYTHON" - <<'EOF' 2>&1
import importlib, platform, sys
import torch
print(f"Python {platform.python_version()}, torch {torch.__version__}, CUDA available {torch.cuda.is_available()}",
      f"({torch.cuda.get_device_name(0)})" if torch.cuda.is_available() else "")
for name in ("transformers", "tokenizers", "huggingface_hub", "accelerate", "gguf", "fastapi", "uvicorn", "httpx",
             "openai", "jsonschema", "xgrammar", "pydantic", "hypothesis", "triton"):
    try:
        module = importlib.import_module(name)
        print(f"{name} {getattr(module, '__version__', '?')} ({module.__file__.split('/site-packages/')[0]})")
    except Exception as error:
        print(f"{name}: not importable ({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''})")
EOF
    echo "== $(elapsed)"
} 2>&1 | tee "$OUT/env.log"

# The native kernels (one C++ file: about a minute) built while the first tests run; build_kernels' lock makes the
# GGUF tests wait for this build rather than start their own.
( timeout -k 5 150 "$PYTHON" -c '
import time
from rungen.gguf import kernel_cache_dir, native_kernels
start = time.perf_counter()
print(f"native kernels: {native_kernels()} in {time.perf_counter() - start:.0f} s ({kernel_cache_dir()})")
' >"$OUT/kernels.log" 2>&1 ) &
kernels=$!

set -o pipefail
# Each test named as it ends (a run cut short still says which passed), and none past 90 s where pytest-timeout is.
pytest_more=()
if "$PYTHON" -c "import pytest_timeout" 2>/dev/null; then pytest_more=(--timeout=90); fi
failed=0  # the first failed step's status is the script's
if wants tests; then
    echo "== pytest -m cuda tests/test_cuda.py (at most $PYTEST_SECONDS s)"
    if [ -n "$PYTEST_K" ]; then pytest_more+=(-k "$PYTEST_K"); fi
    timeout -k 10 "$PYTEST_SECONDS" "$PYTHON" -m pytest -v -rfE -p no:cacheprovider ${pytest_more[@]+"${pytest_more[@]}"} \
        -m cuda tests/test_cuda.py 2>&1 | tee "$OUT/pytest.log"
    status=$?
    failed=$status
    echo "== pytest exit status $status ($(elapsed))" | tee -a "$OUT/pytest.log"
fi
wait "$kernels"
cat "$OUT/kernels.log"

# A benchmark's module run for at most SECONDS into LOG; with --quick, its tiny shapes, on a GPU the CPU plays where
# there is none (tests/virtual_cuda.py: the benchmark's server row's own process then runs on the CPU).
run_module() {  # LABEL SECONDS LOG ARGUMENTS...
    local label=$1 seconds=$2 log=$3
    shift 3
    local command=("$@")
    if [ "$quick" = 1 ] && ! "$PYTHON" -c "import sys, torch; sys.exit(not torch.cuda.is_available())"; then
        command=(tests/virtual_cuda.py "${command[@]}" --quick)
    elif [ "$quick" = 1 ]; then
        command+=(--quick)
    fi
    echo "== python ${command[*]} (at most $seconds s)"
    timeout -k 10 "$seconds" "$PYTHON" "${command[@]}" 2>&1 | tee "$log"
    local status=$?
    [ "$failed" = 0 ] && failed=$status
    echo "== $label exit status $status ($(elapsed))" | tee -a "$log"
}

if wants step; then
    run_module "decode step" "$STEP_SECONDS" "$OUT/step.log" -m benchmarks.gpu_step --json "$OUT/step.json"
fi

if ! wants model; then
    :
elif ls .model/*.gguf.1 >/dev/null 2>&1; then
    echo "== python -m benchmarks.default_model_gpu --check .model (at most $MODEL_SECONDS s)"
    timeout -k 10 "$MODEL_SECONDS" "$PYTHON" -m benchmarks.default_model_gpu --check .model \
        --json "$OUT/default_model.json" 2>&1 | tee "$OUT/default_model.log"
    status=$?
    [ "$failed" = 0 ] && failed=$status
    echo "== default model exit status $status ($(elapsed))" | tee -a "$OUT/default_model.log"
else
    echo "== no .model/ parts: the default model's checks left out (docs/performance.md: carried over two calls)"
fi
wants bench || { echo "== done in $(elapsed), exit status $failed; files in $OUT: $(ls "$OUT" | tr '\n' ' ')"; exit "$failed"; }

# The benchmark takes what is left of 570 s (the call's 600 less a margin), at most BENCH_SECONDS.
left=$(( 570 - $(date +%s) + start ))
if [ "$left" -lt "$BENCH_SECONDS" ]; then BENCH_SECONDS=$left BENCH_BUDGET=$(( left - 40 )); fi
if [ "$BENCH_BUDGET" -lt 30 ]; then echo "== $BENCH_BUDGET s left: no benchmark"; exit "$failed"; fi
# shellcheck disable=SC2086  # BENCH_ARGS: several arguments
run_module benchmark "$BENCH_SECONDS" "$OUT/gpu.log" -m benchmarks.gpu --json "$OUT/gpu.json" --budget "$BENCH_BUDGET" \
    $BENCH_ARGS
echo "== done in $(elapsed), exit status $failed; files in $OUT: $(ls "$OUT" | tr '\n' ' ')"
exit "$failed"
