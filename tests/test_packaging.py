"""The package as users install it: `pip install .` gives a `run-generation` command equal to
`python run_generation.py`, and its pinned dependencies are the tested stack of requirements.txt."""

import configparser
import os
import subprocess
import sys

import pytest

from helpers import ROOT, cli_env


def pins(lines):
    return {line.split("==")[0].lower(): line.split("==")[1] for line in lines if "==" in line}


def test_install_requires_pins_the_tested_stack():
    setup = configparser.ConfigParser()
    setup.read(os.path.join(ROOT, "setup.cfg"))
    declared = pins(line.strip() for line in setup["options"]["install_requires"].splitlines() if line.strip())
    with open(os.path.join(ROOT, "requirements.txt")) as f:
        tested = pins(line.split("#")[0].strip() for line in f)
    assert declared and all(tested.get(name) == version for name, version in declared.items()), (declared, tested)
    assert "torch" in declared  # exact: an open range pulls a multi-GB CUDA build


@pytest.mark.slow
def test_pip_install_gives_the_run_generation_command(tmp_path):
    target = tmp_path / "site"
    install = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", "--no-compile",
         "--target", str(target), ROOT], capture_output=True, text=True, timeout=300)
    assert install.returncode == 0, install.stderr[-2000:]
    command = target / "bin" / "run-generation"
    env = dict(cli_env(), PYTHONPATH=str(target))
    result = subprocess.run([str(command), "--k", "-1"], capture_output=True, text=True, env=env, cwd=tmp_path,
                            timeout=300)
    assert result.returncode == 2
    assert result.stderr == "run_generation.py: error: --k must be >= 0, got -1\n"
    help_text = subprocess.run([str(command), "--help"], capture_output=True, text=True, env=env, cwd=tmp_path,
                               timeout=300)
    assert help_text.returncode == 0 and "--model_name_or_path" in help_text.stdout
