"""The original script's behaviour on transformers 5: every model type, its flags, its output, its errors."""

import logging
import re
import sys
import time

import pytest
import torch

import run_generation
import rungen.loading
from helpers import SEED_TYPES, blocks, error_line, jsonl, run_main, tiny_args
from rungen.arguments import parse_args
from rungen.generation import UNBOUNDED_LENGTH, adjust_length_to_model
from rungen.loading import load, resolve_dtype

PROMPT = "Hello, my dog is cute"
FIGURES = re.compile(r"Generated (\d+) tokens in \d+\.\d\d s \(\d+\.\d tokens/s\)")


@pytest.mark.parametrize("model_type", SEED_TYPES)
def test_every_seed_type_generates_through_the_cli(tiny_models, model_type):
    result = run_main(tiny_args(tiny_models, model_type, "--prompt", PROMPT, "--length", "8"))
    assert result.returncode == 0, result.stderr.decode()
    out = blocks(result.stdout)
    assert list(out) == ["=== GENERATED SEQUENCE 1 ==="]
    text = out["=== GENERATED SEQUENCE 1 ==="]
    # The prompt, not the prefix XLNet generates from, then a continuation.
    assert text.startswith(PROMPT) and len(text) > len(PROMPT)
    # stderr ends with the run's figures; no arguments or device unless --verbose (warnings may come before).
    stderr = result.stderr.decode()
    assert FIGURES.fullmatch(stderr.splitlines()[-1]), stderr
    assert "device:" not in stderr and "Namespace(" not in stderr and "device:" not in result.stdout.decode()


@pytest.mark.parametrize("model_type", SEED_TYPES + ["mistral", "qwen2"])
def test_every_type_through_main_with_the_type_inferred(tiny_models, model_type, capsys):
    sequences = run_generation.main(
        tiny_args(tiny_models, model_type, "--prompt", PROMPT, "--length", "6", "--temperature", "0", with_type=False)
    )
    assert len(sequences) == 1 and sequences[0].startswith(PROMPT) and len(sequences[0]) > len(PROMPT)
    assert capsys.readouterr().out == f"=== GENERATED SEQUENCE 1 ===\n{sequences[0]}\n"


@pytest.mark.parametrize("model_type", ["llama", "gpt2"])
def test_stderr_is_one_line_of_figures_or_nothing_with_quiet(tiny_models, model_type):
    args = tiny_args(tiny_models, model_type, "--prompt", PROMPT, "--length", "6", "--output_format", "jsonl")
    plain, quiet = run_main(args), run_main(args + ["--quiet"])
    assert plain.returncode == quiet.returncode == 0, plain.stderr.decode()
    [line] = plain.stderr.decode().splitlines()
    assert int(FIGURES.fullmatch(line)[1]) == sum(record["num_generated_tokens"] for record in jsonl(plain.stdout))
    assert quiet.stderr == b"" and quiet.stdout == plain.stdout


def test_verbose_shows_the_arguments_and_the_device(tiny_models):
    result = run_main(tiny_args(tiny_models, "llama", "--prompt", PROMPT, "--length", "3", "--verbose"))
    assert result.returncode == 0, result.stderr.decode()
    stderr = result.stderr.decode()
    assert f"prompt='{PROMPT}'" in stderr and "length=3" in stderr and "device: cpu, processes: 1" in stderr
    assert FIGURES.fullmatch(stderr.splitlines()[-1]) and "Namespace(" not in result.stdout.decode()


def test_quiet_and_verbose_exclude_each_other(tiny_models, capsys):
    with pytest.raises(SystemExit) as exit_:
        run_generation.cli(["--quiet", "--verbose"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "not allowed with argument" in err and len(err.strip().splitlines()) == 1


def test_main_reads_patched_sys_argv(tiny_models, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["run_generation.py", *tiny_args(tiny_models, "gpt2", "--prompt", PROMPT)])
    sequences = run_generation.main()
    assert len(sequences) == 1 and sequences[0].startswith(PROMPT)


def test_greedy_is_deterministic_and_ignores_the_seed(tiny_models):
    args = tiny_args(tiny_models, "llama", "--prompt", PROMPT, "--temperature", "0", "--length", "12")
    first, second = run_main(args + ["--seed", "1"]), run_main(args + ["--seed", "2"])
    assert first.returncode == second.returncode == 0
    assert first.stdout == second.stdout


def test_sampling_is_reproducible_for_a_seed(tiny_models, capsys):
    args = tiny_args(tiny_models, "gpt2", "--prompt", PROMPT, "--temperature", "1.5", "--k", "50", "--p", "1.0")
    runs = [run_generation.main(args + ["--seed", seed, "--num_return_sequences", "4"]) for seed in ("7", "7", "8")]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]  # 4 sequences of 20 sampled tokens at temperature 1.5: a collision is not credible


def test_stop_token_cuts_the_continuation(tiny_models, capsys):
    base = tiny_args(tiny_models, "gpt2", "--prompt", PROMPT, "--temperature", "0", "--length", "20")
    full = run_generation.main(base)[0]
    continuation = full[len(PROMPT) :]
    stop = continuation.strip()[len(continuation.strip()) // 2]  # a character the continuation really produces
    cut = run_generation.main(base + ["--stop_token", stop])[0]
    assert cut == PROMPT + continuation[: continuation.index(stop)]


def test_prefix_conditions_generation_but_is_not_printed(tiny_models, capsys):
    prefix = "Once upon a time there was a dog. "
    base = tiny_args(tiny_models, "gpt2", "--temperature", "0", "--length", "10")
    with_prefix = run_generation.main(base + ["--prompt", PROMPT, "--prefix", prefix])[0]
    joined = run_generation.main(base + ["--prompt", prefix + PROMPT])[0]
    assert with_prefix == PROMPT + joined[len(prefix + PROMPT) :]
    # --padding_text is the original script's deprecated name for the same thing: one or the other.
    assert run_generation.main(base + ["--prompt", PROMPT, "--padding_text", prefix])[0] == with_prefix
    both = run_main(base + ["--prompt", PROMPT, "--padding_text", prefix, "--prefix", prefix])
    assert both.returncode == 2 and error_line(both).endswith("--padding_text is the original script's name for "
                                                             "--prefix; choose one")


def test_num_return_sequences(tiny_models):
    result = run_main(tiny_args(tiny_models, "opt", "--prompt", PROMPT, "--num_return_sequences", "3"))
    assert result.returncode == 0, result.stderr.decode()
    out = blocks(result.stdout)
    assert list(out) == [f"=== GENERATED SEQUENCE {i} ===" for i in (1, 2, 3)]
    assert all(text.startswith(PROMPT) for text in out.values())


def test_prompt_from_stdin(tiny_models):
    args = tiny_args(tiny_models, "gpt2", "--temperature", "0")
    piped = run_main(args, stdin=PROMPT + "\n")
    given = run_main(args + ["--prompt", PROMPT])
    assert piped.returncode == given.returncode == 0
    assert piped.stdout == given.stdout


def test_empty_prompt_generates_unconditionally(tiny_models, capsys):
    sequences = run_generation.main(tiny_args(tiny_models, "gpt2", "--prompt", "", "--length", "10"))
    assert len(sequences) == 1 and sequences[0].strip()


def test_ctrl_warns_without_a_control_code(tiny_models):
    result = run_main(tiny_args(tiny_models, "ctrl", "--prompt", PROMPT, "--length", "3"))
    assert result.returncode == 0
    assert "control code" in result.stderr.decode()
    assert "control code" not in result.stdout.decode()
    # as the original script said it: the temperature hint shown (the default 1.0 is over 0.7), and piped prompts
    # each named in their warning
    assert "CTRL typically works better with lower temperatures" in result.stderr.decode()
    piped = run_main(tiny_args(tiny_models, "ctrl", "--length", "2"), stdin=f"{PROMPT}\n{PROMPT}\n")
    warnings = [line for line in piped.stderr.decode().splitlines() if "control code" in line]
    assert len(warnings) == 2 and warnings[1].endswith("(prompt 2)"), warnings


def test_settings_past_what_torch_can_hold_are_one_line(tiny_models):
    """30000 beams over the tiny gpt2's 600 tokens: more categories than torch draws from (on a big model, more
    memory than the host has): one line saying how to fit, not torch's traceback."""
    result = run_main(["--model_name_or_path", tiny_models["gpt2"], "--prompt", PROMPT, "--num_beams", "30000",
                       "--length", "2"])
    assert result.returncode == 2 and "out of memory" in error_line(result) and "--num_beams" in error_line(result)
    assert b"Traceback" not in result.stderr


def test_xlm_language_is_required_without_a_terminal(tiny_models):
    args = ["--model_name_or_path", tiny_models["xlm"], "--prompt", PROMPT]
    assert "--xlm_language must be one of ['en', 'fr']" in error_line(run_main(args))
    assert run_main(args + ["--xlm_language", "fr"]).returncode == 0
    other = run_main(["--model_name_or_path", tiny_models["gpt2"], "--prompt", PROMPT, "--xlm_language", "fr"])
    assert other.returncode == 2 and "--xlm_language chooses an XLM model's language; this model is gpt2" in \
        error_line(other)


def test_xlm_language_where_the_model_has_no_language_embeddings(tiny_models, tmp_path):
    # xlm-mlm-17-1280's and xlm-mlm-100-1280's layout: use_lang_emb false, so no language to choose
    import json
    import shutil

    path = tmp_path / "xlm"
    shutil.copytree(tiny_models["xlm"], path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "use_lang_emb": False}))
    args = ["--model_name_or_path", str(path), "--prompt", PROMPT, "--length", "3"]
    assert run_main(args).returncode == 0
    refused = run_main(args + ["--xlm_language", "de"])
    assert refused.returncode == 2 and error_line(refused).endswith("--xlm_language: this XLM model has no language "
                                                                   "embeddings to choose from")


def test_xlnet_runs_in_float32_only(tiny_models):
    # transformers' XLNet builds its positional encoding in float32: half precision is refused in one line, not a
    # traceback from inside the model (auto keeps float32, on a GPU too)
    result = run_main(["--model_name_or_path", tiny_models["xlnet"], "--prompt", PROMPT, "--fp16"])
    assert result.returncode == 2 and "--dtype float16: xlnet runs in float32 only" in error_line(result)
    config = type("Config", (), {"model_type": "xlnet", "dtype": torch.float32})()
    assert resolve_dtype("auto", config, torch.device("cpu")) == torch.float32


def test_a_length_past_the_context_is_said(tiny_models, caplog, capsys):
    # gpt2's context is 128: --length 1000 ends there, with the notice --length 128 gets
    with caplog.at_level(logging.WARNING, logger="run_generation"):
        run_generation.main(tiny_args(tiny_models, "gpt2", "--prompt", PROMPT, "--length", "1000"))
    assert "new tokens --length asks for" in caplog.text and "of the 1000 new tokens" in caplog.text


def test_length_is_clamped_to_the_context(tiny_models, capsys):
    assert adjust_length_to_model(-1, 128) == 128
    assert adjust_length_to_model(500, 128) == 128
    assert adjust_length_to_model(-1, 0) == UNBOUNDED_LENGTH
    # gpt2's learned positions end at 128: a run past them would index out of range.
    text = run_generation.main(tiny_args(tiny_models, "gpt2", "--prompt", PROMPT, "--length", "500"))[0]
    assert len(text) > len(PROMPT)


def test_half_precision_asked_for_is_honoured_on_slow_cpus(tiny_models, monkeypatch, caplog, capsys):
    monkeypatch.setattr(rungen.loading, "cpu_has_fast", lambda dtype: False)
    with caplog.at_level(logging.WARNING, logger="run_generation"):
        dtype = parse_args(["--fp16"]).dtype  # --fp16 asks for float16: a model that only fits so
        loaded = load(tiny_models["llama"], device=torch.device("cpu"), model_type="llama", dtype=dtype)
    assert loaded.model.dtype == torch.float16
    assert "--dtype float16 runs slower than float32 here" in caplog.text
    text = run_generation.main(tiny_args(tiny_models, "llama", "--prompt", PROMPT, "--fp16", "--temperature", "0"))
    assert len(text[0]) > len(PROMPT)


def test_a_half_precision_checkpoint_runs_in_float32_on_slow_cpus(monkeypatch, caplog):
    monkeypatch.setattr(rungen.loading, "cpu_has_fast", lambda dtype: False)
    config = type("Config", (), {"dtype": torch.bfloat16})()
    with caplog.at_level(logging.WARNING, logger="run_generation"):
        assert resolve_dtype("auto", config, torch.device("cpu")) == torch.float32
    assert "keeping float32 (--dtype bfloat16 to run it anyway" in caplog.text
    monkeypatch.setattr(rungen.loading, "cpu_has_fast", lambda dtype: True)
    assert resolve_dtype("auto", config, torch.device("cpu")) == torch.bfloat16


def test_dtype_bfloat16_where_the_cpu_is_fast(tiny_models, monkeypatch, capsys):
    monkeypatch.setattr(rungen.loading, "cpu_has_fast", lambda dtype: True)
    loaded = load(tiny_models["llama"], device=torch.device("cpu"), model_type="llama", dtype="bfloat16")
    assert loaded.model.dtype == torch.bfloat16


def test_chat_needs_a_template(tiny_models):
    result = run_main(tiny_args(tiny_models, "gpt2", "--prompt", PROMPT, "--chat"))
    assert result.returncode == 2
    assert error_line(result).endswith("--chat: this tokenizer has no chat template")


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model_type", "foo"], "unknown --model_type 'foo'; supported: gpt2, ctrl"),
        (["--model_name_or_path", "./no/such/dir"], "no such directory"),
        (["--model_name_or_path", "missing.gguf"], "no such file"),
        (["--model_name_or_path", "someone/some-model"], "the hub is offline; pass a local path"),
        (["--p", "0"], "--p must be in (0, 1]"),
        (["--p", "1.5"], "--p must be in (0, 1]"),
        (["--temperature", "-0.5"], "--temperature must be >= 0"),
        (["--num_return_sequences", "0"], "--num_return_sequences must be >= 1"),
        (["--repetition_penalty", "0"], "--repetition_penalty must be > 0"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args, message):
    result = run_main(args + ["--prompt", PROMPT])
    assert result.returncode == 2
    assert message in error_line(result)
    assert result.stdout == b""


def test_directory_without_a_model(tmp_path):
    result = run_main(["--model_name_or_path", str(tmp_path), "--prompt", PROMPT])
    assert result.returncode == 2
    assert "holds no model" in error_line(result)


def test_prompt_longer_than_the_context(tiny_models):
    result = run_main(tiny_args(tiny_models, "gpt2", "--prompt", "dog " * 300))
    assert result.returncode == 2
    assert "the model's context is 128" in result.stderr.decode()
    assert "Traceback" not in result.stderr.decode() and result.stdout == b""


def test_mismatched_model_type(tiny_models):
    result = run_main(["--model_type", "gpt2", "--model_name_or_path", tiny_models["llama"], "--prompt", PROMPT])
    assert result.returncode == 2
    assert "does not match the checkpoint's model_type llama" in error_line(result)


def test_weights_that_do_not_fit_the_config_are_one_line(tiny_models, tmp_path, capsys):
    """A checkpoint whose config.json describes other shapes than its weights hold: one line naming the folder and
    a weight's two shapes (transformers prints a table and raises), exit 2."""
    import json
    import shutil

    from helpers import error_of

    path = tmp_path / "llama"
    shutil.copytree(tiny_models["llama"], path)
    config = json.loads((path / "config.json").read_text())
    config["intermediate_size"] += 32
    (path / "config.json").write_text(json.dumps(config))
    code, line = error_of(["--model_name_or_path", str(path), "--prompt", "Hi"], capsys)
    assert code == 2 and line.startswith(f"run_generation.py: error: {path}: its weights do not fit the model its "
                                         "config describes (model.layers.")
    assert f"in the weights, [{config['intermediate_size']}, " in line or f", {config['intermediate_size']}]" in line


def test_once_interrupted_another_signal_ends_the_process_at_once(monkeypatch, capsys):
    """After the first Ctrl-C the tool exits 130 (143 for SIGTERM), and a second press while it exits ends the
    process by the signal, not with a traceback from an exit handler: the default handlers are back."""
    import signal

    def interrupted(argv=None):
        raise KeyboardInterrupt

    monkeypatch.setattr(run_generation, "main", interrupted)
    handlers = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    try:
        for terminated, code in (([], 130), ([signal.SIGTERM], 143)):
            signal.signal(signal.SIGINT, signal.default_int_handler)
            with pytest.raises(SystemExit) as exit:
                run_generation.interruptible_cli(terminated)
            assert exit.value.code == code
            assert signal.getsignal(signal.SIGINT) is signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    finally:
        signal.signal(signal.SIGINT, handlers[0])
        signal.signal(signal.SIGTERM, handlers[1])
    assert capsys.readouterr().err.splitlines() == ["run_generation.py: interrupted"] * 2


def test_sigterm_reaches_what_the_tool_started(tmp_path):
    """SIGTERM sent to the tool alone (timeout, a scheduler) is passed on to its children and theirs, as a kernel
    build's ninja and its compilers: none is left running when the tool ends."""
    import signal
    import subprocess

    from rungen.interrupt import signal_children

    shell = subprocess.Popen(["sh", "-c", "sleep 60 & echo $!; wait"], stdout=subprocess.PIPE, text=True)
    grandchild = int(shell.stdout.readline())
    try:
        signal_children(signal.SIGTERM)
        assert shell.wait(timeout=10) == -signal.SIGTERM
        for _ in range(100):
            with open(f"/proc/{grandchild}/stat") as f:  # a zombie until init reaps it: gone or dead
                if f.read().split(")")[1].split()[0] == "Z":
                    break
            time.sleep(0.05)
        else:
            raise AssertionError("the grandchild still runs")
    except FileNotFoundError:
        pass  # reaped
    finally:
        if shell.poll() is None:
            shell.kill()
