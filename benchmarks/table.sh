#!/usr/bin/env bash
# The GGUF speed table of docs/kernels.md in one run: every file of the list (the arguments, or the default list
# below), the tool against
#   1. llama.cpp's llama-bench built for this CPU (tg and pp) and ik_llama.cpp's llama-bench (pp),
#   2. the tool's AVX2 code paths (--isa avx2, torch's ops too) against llama.cpp's llama-bench built without
#      AVX-512 (tg and pp): on an AVX-512 machine a proxy for an AVX2 one (same cores and memory), not one.
# Markdown tables on stdout, each under a line with the CPU flags, kernel path and references; progress on
# stderr. Run from the repository's root with the tool's virtualenv active, on an otherwise idle machine:
#
#   benchmarks/table.sh [FILE ...] > table.md
#
# Settings (environment): LLAMA_BENCH, LLAMA_BENCH_AVX2, IK_LLAMA_BENCH (the three binaries: without LLAMA_BENCH
# nothing runs, without another its part is left out with a line on stderr), IK_ARGS (more ik_llama.cpp
# arguments, e.g. "-rtr 1"), GGUF_DIR (where the default list's files are: benchmarks.gguf_files --write),
# REPEATS (paired rounds a file, 2), THREADS (2), PYTHON (python).
#
# Time: a paired round of a file costs its tool tg128 + pp512, llama-bench's tg128 + pp512 (plus a full-size pp512
# warm-up), ik_llama.cpp's pp512 and a few process starts; the default list at REPEATS=2 is estimated at about
# 21 minutes on 2 idle Zen 4 cores (docs/kernels.md, "The whole table").
set -euo pipefail

PYTHON=${PYTHON:-python}
VENDOR=${LLAMA_CPP:-/work/llamacpp/llama_cpp_python-0.3.36/vendor/llama.cpp}
LLAMA_BENCH=${LLAMA_BENCH:-$VENDOR/build/bin/llama-bench}
LLAMA_BENCH_AVX2=${LLAMA_BENCH_AVX2:-$VENDOR/build-avx2/bin/llama-bench}
IK_LLAMA_BENCH=${IK_LLAMA_BENCH:-/work/ikllama/build/bin/llama-bench}
IK_ARGS=${IK_ARGS:-}
GGUF_DIR=${GGUF_DIR:-/work/gguf}
REPEATS=${REPEATS:-2}
THREADS=${THREADS:-2}
export HF_HUB_OFFLINE=1

if [ $# -gt 0 ]; then
    files=("$@")
else
    default=$("$PYTHON" -c "from rungen.loading import default_model_file; print(default_model_file())")
    files=("$default")
    for name in default-Q4_K_M llama-Q4_0 llama-Q4_K_M qwen3-Q4_K_M qwen2-Q4_K_M gemma3-Q4_K_M gemma2-Q4_K_M phi3-Q4_K_M; do
        files+=("$GGUF_DIR/$name.gguf")
    done
fi
for file in "${files[@]}"; do
    if [ ! -f "$file" ]; then
        echo "$file: no such file (write the synthetic ones with python -m benchmarks.gguf_files --write DIR)" >&2
        exit 2
    fi
done
if [ ! -x "$LLAMA_BENCH" ]; then
    echo "$LLAMA_BENCH: not an executable file (set LLAMA_BENCH)" >&2
    exit 2
fi

common=(--repeats "$REPEATS" --threads "$THREADS" --model "${files[@]}")

echo "## Native code paths"
echo ""
ik=()
if [ -x "$IK_LLAMA_BENCH" ]; then
    ik=(--ik-llama-bench "$IK_LLAMA_BENCH" --ik-tests pp --ik-args "$IK_ARGS")
else
    echo "no ik_llama.cpp column: $IK_LLAMA_BENCH is not an executable file (set IK_LLAMA_BENCH)" >&2
fi
"$PYTHON" -m benchmarks.gguf_files --llama-bench "$LLAMA_BENCH" "${ik[@]}" "${common[@]}"

echo ""
echo "## AVX2 code paths on this CPU (the tool's --isa avx2, llama.cpp built without AVX-512)"
echo ""
if [ -x "$LLAMA_BENCH_AVX2" ]; then
    ATEN_CPU_CAPABILITY=avx2 "$PYTHON" -m benchmarks.gguf_files --isa avx2 --llama-bench "$LLAMA_BENCH_AVX2" \
        "${common[@]}"
else
    echo "no AVX2 table: $LLAMA_BENCH_AVX2 is not an executable file (set LLAMA_BENCH_AVX2)" >&2
fi
