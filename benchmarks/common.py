"""What several benchmarks share: the CPU flags printed beside every figure, the tool's default model
loaded as the tool loads it, and a clock on the decoding steps. Run the benchmarks from the repository's
root as modules (`python -m benchmarks.NAME`), so that they import rungen as the tool does."""

import subprocess
import time

import torch
from transformers import LogitsProcessor

# The flags that decide CPU speed here: AVX2 only means bfloat16 and int8 matmuls are emulated.
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8")


def cpu_flags() -> str:
    """The CPU flags that decide speed, as 'avx2=yes avx512f=no ...' (printed beside every figure)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = set(f.read().split())
    except OSError:
        return "unknown"
    return " ".join(f"{flag}={'yes' if flag in flags else 'no'}" for flag in CPU_FLAGS)


def load_float32(model_name_or_path=None):
    """The tool's load() on the CPU in float32: the default model when no path is given (a GGUF file
    de-quantized, as --dequantize loads it)."""
    from rungen.loading import load

    return load(model_name_or_path, dtype="float32", device=torch.device("cpu"), dequantize=True)


def run_interleaved(modes, repeats: int, new_tokens: int) -> None:
    """One uncounted 8-token warm-up of every mode, then `repeats` rounds of every mode back to back, so that
    each round's runs share the machine's load (a mode's run(n) appends to tokens_per_s and ms_per_token)."""
    for mode in modes:
        mode.run(8)
        mode.tokens_per_s, mode.ms_per_token = [], []
    for _ in range(repeats):
        for mode in modes:
            mode.run(new_tokens)


class StepClock(LogitsProcessor):
    """Records the time of every decoding step (called once per generated token)."""

    def __init__(self):
        self.stamps = []

    def __call__(self, input_ids, scores):
        if scores.is_cuda and not self.stamps:  # the prompt's pass done on the GPU, not just launched
            torch.cuda.synchronize(scores.device)
        self.stamps.append(time.perf_counter())
        return scores


def has_llama_cpp(python):
    """Whether the interpreter `python` (the benchmark-only virtualenv's) can import llama_cpp."""
    try:
        return subprocess.run([python, "-c", "import llama_cpp"], capture_output=True).returncode == 0
    except OSError:  # no such interpreter
        return False


def command(main) -> None:
    """Runs `main` as a command: bad input (the tool's own errors, a file that is not there) is one line on stderr
    and exit 2, as the tool says it, not a traceback."""
    import sys

    from rungen.errors import RunGenerationError

    try:
        main()
    except (RunGenerationError, FileNotFoundError) as error:
        sys.exit(f"{sys.argv[0]}: error: {str(error).splitlines()[0] if str(error) else type(error).__name__}")


def at_least(least: int):
    """An argparse type: an integer of at least `least`."""
    import argparse

    def read(text):
        value = int(text)
        if value < least:
            raise argparse.ArgumentTypeError(f"must be at least {least}, got {value}")
        return value

    return read
