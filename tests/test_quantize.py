"""--quantize end to end: the quantized model is deterministic across batching and --jit, and the
default model still knows the capital of France."""

import pytest

from helpers import error_line, jsonl, run_main, tiny_args

PROMPTS = "Hello, my dog is cute\nThe capital of France is\nA\nOnce upon a time there was a little dog who\n"


@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize("model_type", ["llama", "gpt2", "opt"])
def test_batch_equals_single_and_jit_equals_eager(tiny_models, model_type, mode):
    args = tiny_args(tiny_models, model_type, "--quantize", mode, "--temperature", "0", "--length", "10",
                     "--output_format", "jsonl", "--verbose")  # --verbose: the quantizing and tracing lines
    alone = run_main(args + ["--batch_size", "1"], stdin=PROMPTS)
    batched = run_main(args + ["--batch_size", "4"], stdin=PROMPTS)
    traced = run_main(args + ["--batch_size", "4", "--jit"], stdin=PROMPTS)
    assert alone.returncode == batched.returncode == traced.returncode == 0, traced.stderr.decode()[-2000:]
    assert "Quantized" in alone.stderr.decode() and "Traced the decode step" in traced.stderr.decode()
    assert jsonl(batched.stdout) == jsonl(alone.stdout)
    assert jsonl(traced.stdout) == jsonl(alone.stdout)


@pytest.mark.slow  # tens of seconds of CPU on the real model
@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_default_model_quantized_still_answers_paris(default_model, mode):
    cache_home, _, _ = default_model
    for jit in ([], ["--jit"]):
        result = run_main(["--prompt", "The capital of France is", "--temperature", "0", "--length", "4",
                          "--quantize", mode, *jit], cache_home=cache_home)
        assert result.returncode == 0, result.stderr.decode()[-2000:]
        assert result.stdout.decode().startswith("=== GENERATED SEQUENCE 1 ===\nThe capital of France is Paris")


def test_quantize_is_refused_with_device_map():
    result = run_main(["--quantize", "int8", "--device_map", "auto", "--prompt", "x"])
    assert result.returncode == 2 and "cannot be combined with --device_map" in error_line(result)


def test_quantize_is_refused_where_the_experts_hold_most_of_the_weights(tiny_models, tmp_path):
    """A mixture of experts keeps its experts as 3-D tensors, which --quantize does not store in 8 or 4 bits: where
    they hold most of the weights (Qwen3-30B-A3B: 95 %, gpt-oss-20b: 91 %), the flag is refused, not half done."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3MoeConfig

    tokenizer = AutoTokenizer.from_pretrained(tiny_models["qwen2"])
    config = Qwen3MoeConfig(vocab_size=len(tokenizer) + 64, hidden_size=64, intermediate_size=64,
                            moe_intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
                            max_position_embeddings=256)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    for mode in ("int8", "int4"):
        result = run_main(["--model_name_or_path", str(tmp_path), "--quantize", mode, "--prompt", "x", "--use_cpu"])
        assert result.returncode == 2, result.stderr.decode()[-2000:]
        assert f"--quantize {mode}: " in error_line(result) and "are its experts'" in error_line(result)
