"""Prompts piped through stdin: batched, machine-readable, in order, and nothing lost."""

import json
import signal
import subprocess
import sys

import pytest

from helpers import SCRIPT, blocks, cli_env, error_line, jsonl, merge_short_of_memory, run_main, tiny_args

PROMPTS = ["Hello, my dog is cute", "The capital of France is", "A", "Once upon a time there was a little dog who"]


def test_each_line_is_a_prompt_and_text_output_keeps_input_order(tiny_models):
    stdin = "\n".join(PROMPTS[:2]) + "\n\n   \n" + "\n".join(PROMPTS[2:]) + "\n"  # blank lines are skipped
    result = run_main(tiny_args(tiny_models, "gpt2", "--temperature", "0", "--length", "5"), stdin=stdin)
    assert result.returncode == 0, result.stderr.decode()
    out = blocks(result.stdout)
    assert list(out) == [f"=== PROMPT {i}, GENERATED SEQUENCE 1 ===" for i in range(1, 5)]
    for prompt, text in zip(PROMPTS, out.values()):
        assert text.startswith(prompt)


def test_an_empty_pipe_generates_nothing_and_says_so(tiny_models):
    for stdin in ("", "\n   \n\n"):
        result = run_main(tiny_args(tiny_models, "gpt2", "--output_format", "jsonl"), stdin=stdin)
        assert result.returncode == 0 and result.stdout == b""
        assert result.stderr.decode().splitlines() == ["No prompts on stdin: nothing to generate."]


def test_whole_stdin_is_one_prompt(tiny_models):
    stdin = "First line of a letter.\nSecond line of it,"
    result = run_main(tiny_args(tiny_models, "gpt2", "--whole_stdin", "--output_format", "jsonl"), stdin=stdin)
    assert result.returncode == 0, result.stderr.decode()
    [record] = jsonl(result.stdout)
    assert record["prompt"] == stdin and record["text"] == stdin + record["generated_text"]


def test_jsonl_in_and_out(tiny_models):
    lines = [json.dumps({"prompt": p, "id": f"q{i}", "meta": {"n": i}}) for i, p in enumerate(PROMPTS)]
    args = tiny_args(tiny_models, "llama", "--input_format", "jsonl", "--output_format", "jsonl",
                     "--num_return_sequences", "2", "--length", "6")
    result = run_main(args, stdin="\n".join(lines))
    assert result.returncode == 0, result.stderr.decode()
    records = jsonl(result.stdout)
    assert [(r["prompt_index"], r["sequence_index"]) for r in records] == [(i, s) for i in range(4) for s in (0, 1)]
    for record in records:
        i = record["prompt_index"]
        assert record["prompt"] == PROMPTS[i] and record["id"] == f"q{i}" and record["meta"] == {"n": i}
        assert record["text"] == record["prompt"] + record["generated_text"]
        assert record["finish_reason"] in ("length", "eos")
        assert 0 < record["num_generated_tokens"] <= 6 and record["num_prompt_tokens"] > 0
        if record["finish_reason"] == "length":
            assert record["num_generated_tokens"] == 6
    # A piped batch's stderr: one line of figures for the whole batch, as a single prompt's.
    [figures] = result.stderr.decode().splitlines()
    assert figures.startswith(f"Generated {sum(record['num_generated_tokens'] for record in records)} tokens in ")


def test_default_model_batch_equals_single(default_model):
    cache_home, _, _ = default_model
    args = ["--temperature", "0", "--length", "12", "--output_format", "jsonl"]
    stdin = "\n".join(PROMPTS)
    alone = run_main(args + ["--batch_size", "1"], stdin=stdin, cache_home=cache_home)
    batched = run_main(args + ["--batch_size", "4"], stdin=stdin, cache_home=cache_home)
    assert alone.returncode == batched.returncode == 0, batched.stderr.decode()
    assert jsonl(batched.stdout) == jsonl(alone.stdout)


def test_finish_reasons(tiny_models):
    args = tiny_args(tiny_models, "gpt2", "--temperature", "0", "--length", "15", "--output_format", "jsonl")
    [free] = jsonl(run_main(args, stdin=PROMPTS[0]).stdout)
    assert free["finish_reason"] == "length" and free["num_generated_tokens"] == 15
    stop = free["generated_text"].strip()[3]
    [stopped] = jsonl(run_main(args + ["--stop_token", stop], stdin=PROMPTS[0]).stdout)
    assert stopped["finish_reason"] == "stop_token"
    assert stopped["generated_text"] == free["generated_text"][: free["generated_text"].index(stop)]
    assert stopped["num_generated_tokens"] < 15  # generation stopped early, not only the text


def test_a_failing_prompt_among_good_ones(tiny_models):
    stdin = b"\n".join([PROMPTS[0].encode(), b"dog " * 300, b"caf\xe9 au lait", PROMPTS[1].encode()])
    for output_format in ("jsonl", "text"):
        result = run_main(tiny_args(tiny_models, "gpt2", "--output_format", output_format), stdin=stdin)
        assert result.returncode == 1
        stderr = result.stderr.decode()
        assert "Traceback" not in stderr
        if output_format == "jsonl":
            records = jsonl(result.stdout)
            assert [r["prompt_index"] for r in records] == [0, 1, 2, 3]
            assert "context is 128" in records[1]["error"] and "not valid UTF-8" in records[2]["error"]
            assert records[0]["text"].startswith(PROMPTS[0]) and records[3]["text"].startswith(PROMPTS[1])
        else:
            assert list(blocks(result.stdout)) == ["=== PROMPT 1, GENERATED SEQUENCE 1 ===",
                                                   "=== PROMPT 4, GENERATED SEQUENCE 1 ==="]
            assert "prompt 2: error: prompt is" in stderr and "prompt 3: error: input is not valid UTF-8" in stderr


def test_a_model_failing_mid_run_still_writes_every_record(tiny_models, tmp_path):
    """Weights gone NaN fail the run at its first step: each prompt still gets its record in input order (those
    not generated saying why, a bad line's own error among them), then the one error line and a non-zero exit."""
    import shutil

    from safetensors.torch import load_file, save_file

    broken = tmp_path / "llama"
    shutil.copytree(tiny_models["llama"], broken)
    weights = load_file(broken / "model.safetensors")
    name = next(name for name in weights if name.endswith("mlp.down_proj.weight"))
    weights[name] = weights[name] * float("nan")
    save_file(weights, broken / "model.safetensors", metadata={"format": "pt"})
    stdin = b"\n".join([PROMPTS[0].encode(), b"caf\xe9 au lait", PROMPTS[1].encode()])
    result = run_main(["--model_name_or_path", str(broken), "--length", "4", "--temperature", "0",
                       "--output_format", "jsonl"], stdin=stdin)
    assert result.returncode == 2 and error_line(result).endswith("the model's scores are NaN: its weights are "
                                                                   "broken (a damaged file?)")
    records = jsonl(result.stdout)
    assert [r["prompt_index"] for r in records] == [0, 1, 2]
    assert [r["error"].split(":")[0] for r in records] == ["not generated", "input is not valid UTF-8 (invalid "
                                                           "continuation byte at byte 3)", "not generated"]


def test_invalid_json_line_is_an_error_record(tiny_models):
    stdin = '{"prompt": "Hello"}\n{"prompt": \n["not an object"]\n{"prompt": "Bye"}\n'
    args = tiny_args(tiny_models, "gpt2", "--input_format", "jsonl", "--output_format", "jsonl")
    result = run_main(args, stdin=stdin)
    assert result.returncode == 1
    records = jsonl(result.stdout)
    assert ["error" in r for r in records] == [False, True, True, False]


def _popen(args, stdin):
    process = subprocess.Popen([sys.executable, SCRIPT, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, env=cli_env())
    process.stdin.write(stdin.encode())
    process.stdin.close()
    process.stdin = None  # communicate() must not flush it again
    return process


@pytest.mark.slow
def test_closing_the_pipe_ends_the_run_quietly(tiny_models):
    """`run_generation.py ... | head -n 1`."""
    stdin = "\n".join(PROMPTS * 50)
    process = _popen(tiny_args(tiny_models, "gpt2", "--output_format", "jsonl", "--batch_size", "1"), stdin)
    first = process.stdout.readline()
    process.stdout.close()
    _, stderr = process.communicate(timeout=300)
    assert json.loads(first)["prompt_index"] == 0
    assert process.returncode == 0
    assert b"Traceback" not in stderr and b"BrokenPipe" not in stderr


@pytest.mark.slow
@pytest.mark.parametrize("stop, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_ctrl_c_keeps_what_was_generated(tiny_models, stop, code):
    """Ctrl-C in a run of piped prompts (a process, as a terminal sends it), or SIGTERM (timeout, a job scheduler):
    every record written is whole, in input order; the prompts running end with what they had (finish_reason
    "interrupted"), those finished are written, those not started are not."""
    stdin = "\n".join(PROMPTS * 100)
    process = _popen(tiny_args(tiny_models, "gpt2", "--output_format", "jsonl", "--batch_size", "2"), stdin)
    first = process.stdout.readline()  # the first batch is out and flushed
    process.send_signal(stop)
    rest, stderr = process.communicate(timeout=300)
    records = [json.loads(line) for line in (first + rest).decode().splitlines()]
    assert process.returncode == code
    assert stderr.decode().strip().splitlines()[-1] == "run_generation.py: interrupted"
    assert b"Traceback" not in stderr
    assert 1 <= len(records) < 400  # every line written is complete JSON
    indices = [record["prompt_index"] for record in records]
    assert indices == sorted(set(indices)) and indices[0] == 0
    cut = [record for record in records if record["finish_reason"] == "interrupted"]  # the batch's two rows at most
    assert len(cut) <= 2 and all(record["num_generated_tokens"] < 20 for record in cut)
    assert all(record["finish_reason"] == "eos" or record["num_generated_tokens"] == 20 for record in records
               if record not in cut)


def test_streaming_prints_the_same_text_as_the_blocks(tiny_models):
    base = tiny_args(tiny_models, "gpt2", "--prompt", PROMPTS[0], "--temperature", "0", "--length", "12")
    streamed, plain = run_main(base + ["--stream"]), run_main(base + ["--no-stream"])
    assert streamed.returncode == plain.returncode == 0, streamed.stderr.decode()
    assert streamed.stdout == plain.stdout
    stop = blocks(plain.stdout)["=== GENERATED SEQUENCE 1 ==="][len(PROMPTS[0]):].strip()[4]
    assert run_main(base + ["--stream", "--stop_token", stop]).stdout == run_main(base + ["--stop_token", stop]).stdout


def test_prompts_join_the_running_batch_and_each_gives_what_generate_gives_alone(tiny_models):
    # Rows end at different steps (a stop string, the lengths of their prompts) and the prompts waiting take
    # their places in the running batch; each prompt's text is still greedy generate()'s for it alone.
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = tiny_models["llama"]
    model, tokenizer = AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)
    prompts = PROMPTS + [prompt[::-1] for prompt in PROMPTS]
    expected = []
    for prompt in prompts:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        new = model.generate(ids, max_new_tokens=10, do_sample=False, eos_token_id=None)[0, ids.shape[1]:]
        whole = tokenizer.decode(ids[0].tolist() + new.tolist(), skip_special_tokens=True)
        expected.append(whole[len(tokenizer.decode(ids[0], skip_special_tokens=True)):])
    stop = expected[1].strip()[2]  # ends some rows early, not all
    args = tiny_args(tiny_models, "llama", "--temperature", "0", "--length", "10", "--output_format", "jsonl",
                     "--batch_size", "3", "--stop_token", stop)
    result = run_main(args, stdin="\n".join(prompts))
    assert result.returncode == 0, result.stderr.decode()
    records = jsonl(result.stdout)
    assert [record["prompt_index"] for record in records] == list(range(len(prompts)))
    stopped = [record for record in records if record["finish_reason"] == "stop_token"]
    assert 0 < len(stopped) < len(prompts)
    for record, text in zip(records, expected):
        assert record["generated_text"] == text.split(stop)[0], record


def test_sampled_text_follows_the_seed_whatever_the_batch(tiny_models):
    # Each prompt draws from its own generator, seeded in input order from --seed: the batch a prompt
    # decodes in does not change its text.
    args = tiny_args(tiny_models, "gpt2", "--length", "8", "--output_format", "jsonl", "--num_return_sequences", "2")
    runs = [jsonl(run_main(args + ["--seed", seed, "--batch_size", size], stdin="\n".join(PROMPTS)).stdout)
            for seed, size in (("5", "1"), ("5", "3"), ("6", "3"))]
    texts = [[record["generated_text"] for record in run] for run in runs]
    assert len(texts[0]) == 8 and texts[0] == texts[1]
    assert texts[2] != texts[1]


@pytest.mark.parametrize("n", [1, 2])
def test_piped_prompts_the_gpu_has_no_memory_to_batch_together_run_as_memory_allows(tiny_models, monkeypatch, n):
    """BLOOM (a left-padded batch: its ALiBi bias takes no slots): every piped prompt is prefilled, and copying their
    keys/values into one batch runs out of GPU memory (raised where CUDA raises it: the CPU has no such limit). The
    first prompt goes on in its own cache (its n rows' keys/values copied there), the others wait and run as rows
    leave: every prompt's text and the exit status are those of a run with memory to spare, each prompt's seed its
    own."""
    failed = []
    args = tiny_args(tiny_models, "bloom", "--length", "8", "--seed", "3", "--output_format", "jsonl",
                     "--num_return_sequences", str(n))
    spare = run_main(args, stdin="\n".join(PROMPTS))
    with monkeypatch.context() as patch:  # the prompts' first merge, into the empty batch
        merge_short_of_memory(patch, lambda batch, parts: batch.cache is None and len(parts) > 1, failed)
        short = run_main(args, stdin="\n".join(PROMPTS))
    assert failed == [n * len(PROMPTS)]
    assert short.returncode == spare.returncode == 0 and jsonl(short.stdout) == jsonl(spare.stdout)
    assert len(jsonl(spare.stdout)) == n * len(PROMPTS)
    assert f"out of GPU memory to add {3 * n} row(s) to the batch's {n}" in short.stderr.decode()


@pytest.mark.parametrize("model_type, layer", [("llama", "llama.modeling_llama.LlamaDecoderLayer"),
                                               ("bloom", "bloom.modeling_bloom.BloomBlock")])
def test_a_decode_step_out_of_gpu_memory_costs_the_newest_prompt_only(tiny_models, monkeypatch, model_type, layer):
    """A decode step of every prompt runs out of GPU memory in its last layer, the others' keys/values written
    (raised where CUDA raises it: the CPU has no such limit; the played GPU's own memory runs out in
    tests/test_cuda.py): the newest prompt gives way and goes on after the others from its first token (its prompt
    and that token prefilled again, its seed its own): every record is the one a run with memory to spare gives,
    with --logprobs too (its first token's items taken before it gave way). On fixed slots (llama) and on the
    left-padded batch (bloom), whose layers that grew in the failed step shrink back."""
    import importlib

    import torch

    module, name = layer.rsplit(".", 1)
    decoder_layer = getattr(importlib.import_module(f"transformers.models.{module}"), name)
    forward, failed = decoder_layer.forward, []

    def short_of_memory(self, hidden_states, *args, **kwargs):
        attention = getattr(self, "self_attn", None) or self.self_attention
        if hidden_states.shape[:2] == (len(PROMPTS), 1) and attention.layer_idx == 1 and not failed:
            failed.append(len(PROMPTS))  # the first step of every prompt together, in its last layer
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB")
        return forward(self, hidden_states, *args, **kwargs)

    def run(*extra, short=False):
        args = tiny_args(tiny_models, model_type, "--length", "8", "--seed", "3", "--output_format", "jsonl", *extra)
        failed.clear()
        with monkeypatch.context() as patch:
            if short:
                patch.setattr(decoder_layer, "forward", short_of_memory)
            result = run_main(args, stdin="\n".join(PROMPTS))
        assert failed == ([len(PROMPTS)] if short else [])
        return result.returncode, jsonl(result.stdout)

    assert run(short=True) == run()  # the newest prompt went on
    (code, records), (spare_code, expected) = run("--logprobs", "1", short=True), run("--logprobs", "1")
    assert code == spare_code == 0 and len(records) == len(PROMPTS)
    # Steps ran with a row fewer, the newest's tokens prefilled again: log-probabilities agree to float32's rounding.
    items = [[(item["id"], item["logprob"]) for item in record.pop("logprobs")["content"]]
             for record in records + expected]
    assert records == expected
    for mine, spare in zip(items[: len(records)], items[len(records) :]):
        assert [i for i, _ in mine] == [i for i, _ in spare]
        assert max(abs(a - b) for (_, a), (_, b) in zip(mine, spare)) < 1e-4


@pytest.mark.parametrize("path", ["engine", "generate()"])
def test_ctrl_c_writes_the_sequence_generated_so_far(tiny_models, monkeypatch, tmp_path, path):
    """Ctrl-C during a prompt's generation (SIGINT raised in this process in the model's tenth pass): the
    generation ends at its next step and its record is written, the text so far with finish_reason "interrupted";
    exit 130, "interrupted" on stderr. On the engine and on generate() (--generation_config's min_new_tokens). A
    second Ctrl-C stops at once: nothing written."""
    from transformers.models.gpt2.modeling_gpt2 import GPT2LMHeadModel

    forward, passes, presses = GPT2LMHeadModel.forward, [], {}

    def pressed(self, *args, **kwargs):
        passes.append(1)
        for _ in range(presses.get(len(passes), 0)):
            signal.raise_signal(signal.SIGINT)
        return forward(self, *args, **kwargs)

    config = tmp_path / "generation_config.json"
    config.write_text(json.dumps({"min_new_tokens": 30}))
    extra = ["--generation_config", str(config)] if path == "generate()" else []
    args = tiny_args(tiny_models, "gpt2", "--prompt", PROMPTS[0], "--length", "30", "--temperature", "0",
                     "--output_format", "jsonl", *extra)
    [whole] = jsonl(run_main(args).stdout)
    assert whole["num_generated_tokens"] == 30 and whole["finish_reason"] == "length"
    monkeypatch.setattr(GPT2LMHeadModel, "forward", pressed)
    presses[10] = 1
    result = run_main(args)
    assert result.returncode == 130 and error_line(result) == "run_generation.py: interrupted"
    [record] = jsonl(result.stdout)
    assert record["finish_reason"] == "interrupted" and 9 <= record["num_generated_tokens"] <= 10
    assert record["text"] == record["prompt"] + record["generated_text"]
    assert whole["generated_text"].startswith(record["generated_text"]) and record["generated_text"]
    passes.clear()
    presses[10] = 2
    result = run_main(args)
    assert result.returncode == 130 and error_line(result) == "run_generation.py: interrupted" and not result.stdout
