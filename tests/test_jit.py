"""--jit: the traced decode step gives the eager model's tokens, and really serves the decode steps."""

import io
import sys

import pytest

import run_generation
import rungen.jit
from helpers import jsonl, run_main, tiny_args

JIT_TYPES = ["gpt2", "llama", "opt", "bloom", "gptj"]
PROMPTS = "Hello, my dog is cute\nThe capital of France is\nA\n"
CASES = {
    "padded batch": ["--batch_size", "3"],
    "beam search": ["--num_beams", "3", "--num_return_sequences", "2"],
    "repetition penalty": ["--repetition_penalty", "1.3", "--batch_size", "2"],
}


def generate(monkeypatch, args, jit):
    """main() on PROMPTS through stdin; returns (sequences, decode steps the graph served or None)."""
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(PROMPTS.encode())))
    served = {}
    original = rungen.jit.enable_jit

    def spy(model, tokenizer):
        seconds = original(model, tokenizer)
        served["forward"] = model.forward
        return seconds

    monkeypatch.setattr(rungen.jit, "enable_jit", spy)
    sequences = run_generation.main(args + (["--jit"] if jit else []))
    return sequences, getattr(served.get("forward"), "graph_steps", None)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("model_type", JIT_TYPES)
def test_jit_gives_the_eager_greedy_tokens(tiny_models, model_type, case, monkeypatch, capsys):
    args = tiny_args(tiny_models, model_type, "--temperature", "0", "--length", "12", *CASES[case])
    eager, _ = generate(monkeypatch, args, jit=False)
    traced, steps = generate(monkeypatch, args, jit=True)
    assert traced == eager
    assert steps and steps >= 11  # every step after the prompt's went through the graph


@pytest.mark.parametrize("model_type", ["gpt2", "llama"])
def test_jit_sampling_draws_the_same_sequences(tiny_models, model_type, monkeypatch, capsys):
    args = tiny_args(tiny_models, model_type, "--num_return_sequences", "2", "--k", "20", "--seed", "3")
    eager, _ = generate(monkeypatch, args, jit=False)
    traced, steps = generate(monkeypatch, args, jit=True)
    assert traced == eager and steps


@pytest.mark.slow  # tens of seconds of CPU on the real model
def test_jit_on_the_default_model(default_model):
    cache_home, _, _ = default_model
    for case in ("padded batch", "beam search"):
        # --jit traces float models: the GGUF file de-quantized.
        args = ["--dequantize", "--temperature", "0", "--length", "16", "--output_format", "jsonl", *CASES[case]]
        eager = run_main(args, stdin=PROMPTS, cache_home=cache_home)
        traced = run_main(args + ["--jit", "--verbose"], stdin=PROMPTS, cache_home=cache_home)  # the tracing line
        assert eager.returncode == traced.returncode == 0, traced.stderr.decode()[-2000:]
        assert jsonl(traced.stdout) == jsonl(eager.stdout)
        stderr = traced.stderr.decode()
        assert stderr.count("Traced the decode step in") == 1  # once per run, timed


def test_an_untraceable_type_warns_once_and_generates_the_same_text(tiny_models):
    args = tiny_args(tiny_models, "xlnet", "--temperature", "0", "--length", "6", "--prompt", "Hello, my dog")
    eager, traced = run_main(args), run_main(args + ["--jit"])
    assert traced.returncode == 0 and traced.stdout == eager.stdout
    warnings = [line for line in traced.stderr.decode().splitlines() if "--jit" in line]
    assert len(warnings) == 1 and "generating without JIT" in warnings[0]


def test_tracing_leaves_stderr_to_the_figures(tiny_models):
    """The tracer reads every attribute of the model's modules; transformers' properties that warn of what a decode
    step never uses (no loss_type in the config) stay quiet: stderr is the run's figures line."""
    import logging

    logging.Logger.warning_once.cache_clear()  # transformers says each warning once a process
    result = run_main(tiny_args(tiny_models, "llama", "--length", "4", "--prompt", "Hello", "--jit"))
    assert result.returncode == 0
    [figures] = result.stderr.decode().splitlines()
    assert figures.startswith("Generated 4 tokens in ")
