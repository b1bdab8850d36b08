"""Scale-out through accelerate: several processes on one prompt file, and models placed over devices."""

import collections
import socket
import subprocess
import sys

import pytest
import torch

import run_generation
from helpers import SCRIPT, blocks, cli_env, jsonl, run_main, tiny_args
from rungen.loading import load

PROMPTS = "\n".join(["Hello, my dog is cute", "The capital of France is", "A", "Once upon a time", "Water boils"])


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(num_processes, args, stdin):
    # --multi_gpu selects accelerate's torchrun launcher; on a machine without GPUs the tool then
    # asks PartialState for CPU and the processes form a gloo group.
    command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes",
               str(num_processes), "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
               "--main_process_port", str(free_port()), SCRIPT, *args]
    return subprocess.run(command, input=stdin.encode(), capture_output=True, env=cli_env(), timeout=600)


@pytest.mark.slow
def test_two_cpu_processes_give_the_single_process_output(tiny_models):
    """The main process alone writes, in input order, what one process writes: as jsonl for 11 prompts (uneven
    shares over several rounds), one too long for the context (its error record, and a failing exit), and as text,
    each block numbered by its prompt, whichever process generated it."""
    errors = PROMPTS + "\n" + "dog " * 300 + "\n" + PROMPTS
    for output_format, stdin in (("jsonl", errors), ("text", PROMPTS)):
        args = tiny_args(tiny_models, "llama", "--temperature", "0", "--length", "8", "--batch_size", "2",
                         "--output_format", output_format)
        single = run_main(args, stdin=stdin)  # in-process, as a process gives it (test_harness)
        double = launch(2, args + ["--verbose"], stdin)  # --verbose: the device line, with the process count
        assert "processes: 2" in double.stderr.decode(), double.stderr.decode()[-3000:]
        assert double.stdout == single.stdout
        if output_format == "jsonl":
            records = jsonl(single.stdout)
            assert single.returncode == 1 and double.returncode != 0
            assert [r["prompt_index"] for r in records] == list(range(11)) and "error" in records[5]
            assert sum("error" in record for record in records) == 1
        else:
            assert single.returncode == double.returncode == 0, double.stderr.decode()[-3000:]
            assert list(blocks(double.stdout)) == [f"=== PROMPT {i}, GENERATED SEQUENCE 1 ===" for i in range(1, 6)]


@pytest.mark.slow
def test_two_processes_sample_what_one_does_and_say_an_error_once(tiny_models, tmp_path):
    """A sampled prompt's seed comes from its place in the input, not from the process that runs it: the same
    prompt four times gives what one process gives (the second process's share is no copy of the first's). A bad
    flag or path is one line from the main process, the other ending quietly (no traceback from its collective)."""
    args = tiny_args(tiny_models, "llama", "--temperature", "1", "--seed", "7", "--length", "8", "--output_format",
                     "jsonl")
    stdin = "\n".join(["Write a name:"] * 4)
    single = run_main(args, stdin=stdin)
    double = launch(2, args, stdin)
    assert double.returncode == 0, double.stderr.decode()[-3000:]
    texts = [record["generated_text"] for record in jsonl(double.stdout)]
    assert double.stdout == single.stdout and texts[2:] != texts[:2]
    missing = launch(2, ["--model_name_or_path", str(tmp_path / "no such model"), "--prompt", "Hi"], "")
    err = missing.stderr.decode()
    assert missing.returncode != 0 and err.count("run_generation.py: error:") == 1, err[-3000:]
    assert "[rank1]" not in err and "Connection closed by peer" not in err, err[-3000:]


def test_device_map_auto_offloads_and_keeps_the_greedy_text(tiny_models, capsys):
    base = tiny_args(tiny_models, "llama", "--temperature", "0", "--length", "10", "--prompt", "Hello, my dog")
    placed = base + ["--device_map", "auto", "--max_memory", "cpu=20KB"]
    loaded = load(tiny_models["llama"], device=torch.device("cpu"), model_type="llama", device_map="auto",
                  max_memory={"cpu": "20KB"})
    placement = collections.Counter(loaded.model.hf_device_map.values())
    assert placement["disk"] > 0, placement  # the cap really forced layers out of memory
    assert run_generation.main(placed) == run_generation.main(base)


class Ended(Exception):
    pass


@pytest.mark.parametrize("outcome, code",
                         [(None, 0), (SystemExit(3), 3), (SystemExit(None), 0), (SystemExit("bad"), 1)])
def test_a_launched_process_ends_at_once_with_its_exit_code_after_leaving_together(monkeypatch, capsys, outcome,
                                                                                  code):
    """A launched process leaves the group at the barrier and ends there (os._exit, its output flushed) with the
    code the command would have exited with: the group's native teardown had aborted such a process at exit."""
    from rungen import processes

    calls = []

    class State:  # what finish() asks of accelerate's PartialState
        num_processes = 2

        def wait_for_everyone(self):
            calls.append("barrier")

        def destroy_process_group(self):
            calls.append("destroy")

    def cli():
        processes.finish(State())
        if outcome is not None:
            raise outcome

    def exit_now(status):
        calls.append(("exit", status))
        raise Ended

    monkeypatch.setattr(processes, "launched", lambda: True)
    monkeypatch.setattr(processes, "exit_follows", False)
    monkeypatch.setattr(run_generation, "cli", cli)
    monkeypatch.setattr(processes.os, "_exit", exit_now)
    with pytest.raises(Ended):
        run_generation.command()
    assert calls == ["barrier", ("exit", code)]
    assert capsys.readouterr().err == ("bad\n" if outcome is not None and outcome.code == "bad" else "")
    # Called as a library (main() in a process of its own making), the group is still torn down.
    monkeypatch.setattr(processes, "exit_follows", False)
    calls.clear()
    processes.finish(State())
    assert calls == ["barrier", "destroy"]
