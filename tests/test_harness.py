"""The test harness itself: run_main gives what a real process gives, and the load memo hands out copies."""

import re

import pytest

from helpers import run_cli, run_main, tiny_args

# What differs from one run to the next: timing figures, and transformers' progress bar of loading weights
# (redrawn with \r; absent when the model came from the memo).
VARYING = re.compile(rb"in \d+\.\d+ s \(\d+\.\d+ tokens/s\)|\r[^\n]*\n")


@pytest.mark.slow
@pytest.mark.parametrize("case", ["generates", "bad input", "a failing prompt"])
def test_in_process_run_gives_what_a_process_gives(tiny_models, case):
    args, stdin = {
        "generates": (tiny_args(tiny_models, "ctrl", "--length", "5", "--output_format", "jsonl"), "Hello\nWorld\n"),
        "bad input": (tiny_args(tiny_models, "gpt2", "--chat", "--prompt", "Hi"), None),
        "a failing prompt": (tiny_args(tiny_models, "gpt2", "--length", "3"), b"Hi\n\xff\n"),
    }[case]
    real, in_process = run_cli(args, stdin=stdin), run_main(args, stdin=stdin)
    assert (in_process.returncode, in_process.stdout) == (real.returncode, real.stdout)
    assert VARYING.sub(b"", in_process.stderr) == VARYING.sub(b"", real.stderr)
    assert b"Traceback" not in real.stderr
    assert real.stderr.count(b"run_generation.py: error: ") == (case != "generates")


def test_the_memo_loads_a_model_once_and_hands_out_copies(tiny_models, load_memo):
    args = tiny_args(tiny_models, "llama", "--prompt", "Hello", "--length", "4", "--temperature", "0")
    plain = run_main(args)
    run_main(args + ["--jit"])  # --jit loads transformers' own model class (own_model=False): a key of its own
    misses = load_memo.misses
    traced = run_main(args + ["--jit", "--verbose"])  # --verbose: the loading detail, tracing's line among it
    again = run_main(args)
    assert plain.returncode == traced.returncode == again.returncode == 0, again.stderr.decode()
    assert load_memo.misses == misses  # both from the memo
    assert b"Traced the decode step" in traced.stderr and b"Traced" not in again.stderr
    assert again.stdout == plain.stdout == traced.stdout
    # --jit patched the forward of its own copy only: the memo's models keep their class's forward.
    models = [loaded.model for loaded in load_memo.loaded.values() if loaded.model_type == "llama"]
    assert models and all("forward" not in vars(model) for model in models)
    # An argument of the loader is part of the key (--quantize is one: it quantizes while loading).
    run_main(args + ["--dtype", "float32"])
    assert load_memo.misses == misses + 1
    # So is the tool's environment (RUN_GENERATION_GPU_INT4 chooses what a GPU load keeps).
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RUN_GENERATION_GPU_INT4", "triton")
        assert run_main(args).stdout == plain.stdout
    assert load_memo.misses == misses + 2
    run_main(args)
    assert load_memo.misses == misses + 2
