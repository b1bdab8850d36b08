"""Every model type of the original script generates with the special tokens its published checkpoint really has
(openai-gpt and CTRL: only <unk>, no pad, no EOS), alone and batched, in-process through the tool's entry point."""

import shutil

import pytest
from transformers import AutoTokenizer

from helpers import SEED_TYPES, error_line, jsonl, run_main, tiny_args

PROMPTS = ["Hello, my dog is cute", "The capital of France is", "A", "Once upon a time there was a little dog who"]


@pytest.mark.parametrize("model_type", SEED_TYPES)
def test_a_batch_gives_each_prompt_its_own_greedy_text(tiny_models, model_type):
    args = tiny_args(tiny_models, model_type, "--temperature", "0", "--length", "10", "--output_format", "jsonl")
    alone = run_main(args + ["--batch_size", "1"], stdin="\n".join(PROMPTS))
    batched = run_main(args + ["--batch_size", "4"], stdin="\n".join(PROMPTS))
    assert alone.returncode == batched.returncode == 0, batched.stderr.decode()[-2000:]
    assert jsonl(batched.stdout) == jsonl(alone.stdout)
    tokenizer = AutoTokenizer.from_pretrained(tiny_models[model_type])
    specials = [token for token in tokenizer.all_special_tokens if token]
    for record in jsonl(batched.stdout):
        # The fixtures never generate special tokens, so every sequence runs to --length...
        assert record["finish_reason"] == "length" and record["num_generated_tokens"] == 10
        # ...and whatever was used to pad a shorter prompt in the batch is never printed.
        assert not any(token in record["generated_text"] for token in specials), record


@pytest.mark.parametrize("model_type", ["openai-gpt", "ctrl"])
def test_a_model_without_eos_or_pad_runs_to_length(tiny_models, model_type):
    tokenizer = AutoTokenizer.from_pretrained(tiny_models[model_type])
    assert tokenizer.eos_token is None and tokenizer.pad_token is None  # as published
    args = tiny_args(tiny_models, model_type, "--length", "7", "--output_format", "jsonl",
                     "--num_return_sequences", "2", "--batch_size", "2")
    result = run_main(args, stdin="\n".join(PROMPTS[:2]))
    assert result.returncode == 0, result.stderr.decode()[-2000:]
    records = jsonl(result.stdout)
    assert len(records) == 4
    assert all(r["finish_reason"] == "length" and r["num_generated_tokens"] == 7 for r in records)
    assert not any("<unk>" in r["text"] for r in records)


def test_a_token_outside_the_models_embedding_is_one_line(tiny_models, tmp_path):
    checkpoint = shutil.copytree(tiny_models["gpt2"], tmp_path / "gpt2")
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    tokenizer.add_tokens(["zzqx"])  # a tokenizer grown without resizing the model's embedding
    tokenizer.save_pretrained(checkpoint)
    result = run_main(["--model_name_or_path", str(checkpoint), "--prompt", "Hello zzqx"])
    assert result.returncode == 2 and result.stdout == b""
    assert "token 'zzqx' (id " in error_line(result)
    assert "is outside the model's vocabulary" in error_line(result)
    piped = run_main(["--model_name_or_path", str(checkpoint), "--output_format", "jsonl"],
                     stdin="Hello\nHello zzqx\n")
    assert piped.returncode == 1
    good, bad = jsonl(piped.stdout)
    assert good["finish_reason"] == "length" and "is outside the model's vocabulary" in bad["error"]
