"""Running the tool the way users do: as a subprocess, and through main() in-process."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "run_generation.py")
SEED_TYPES = ["gpt2", "ctrl", "openai-gpt", "xlnet", "xlm", "gptj", "bloom", "llama", "opt"]
# What each type needs beyond a prompt to run non-interactively.
TYPE_ARGS = {"xlm": ["--xlm_language", "en"]}


def cli_env(cache_home=None):
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1")
    if cache_home:
        env["XDG_CACHE_HOME"] = str(cache_home)
    return env


def run_cli(args, stdin=None, cache_home=None, timeout=600):
    """Runs run_generation.py; stdin is bytes or str (None: no stdin, like CI)."""
    if isinstance(stdin, str):
        stdin = stdin.encode()
    return subprocess.run(
        [sys.executable, SCRIPT, *args],
        input=stdin if stdin is not None else b"",
        capture_output=True,
        env=cli_env(cache_home),
        timeout=timeout,
    )


def tiny_args(tiny_models, model_type, *extra, with_type=True):
    args = ["--model_name_or_path", tiny_models[model_type]]
    if with_type:
        args += ["--model_type", model_type]
    return args + TYPE_ARGS.get(model_type, []) + list(extra)


def blocks(stdout):
    """Splits the seed's text output into {header: text}."""
    out, header = {}, None
    for line in stdout.decode().splitlines(keepends=True):
        if line.startswith("=== ") and line.rstrip().endswith(" ==="):
            header = line.strip()
            out[header] = ""
        else:
            assert header is not None, f"text before the first header: {line!r}"
            out[header] += line
    return {h: t[:-1] if t.endswith("\n") else t for h, t in out.items()}


def jsonl(stdout):
    return [json.loads(line) for line in stdout.decode().splitlines()]


def error_line(result):
    """The last stderr line, which must be the tool's one-line error, with no traceback before it."""
    stderr = result.stderr.decode()
    assert "Traceback" not in stderr, stderr
    return stderr.strip().splitlines()[-1]
