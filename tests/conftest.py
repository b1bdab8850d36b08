"""Shared pytest fixtures: tiny random checkpoints built on the spot, fully offline."""

import os
import sys

# Never touch the Hugging Face hub from the test suite (also inherited by any
# subprocess a test starts, e.g. the CLI).
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The models are tiny: one intra-op thread is much faster than several on a
# shared CPU (20-token generation ~50 ms instead of ~500 ms with 2 contended
# threads).  Set before torch is imported; an explicit value wins.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

TESTS = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [TESTS, os.path.dirname(TESTS)]  # helpers, and run_generation.py itself

import pytest  # noqa: E402

from helpers import run_cli  # noqa: E402
from tiny_models import MODEL_TYPES, build_all  # noqa: E402


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """{model_type: checkpoint_dir} for every type in tiny_models.MODEL_TYPES, built once per session."""
    return build_all(str(tmp_path_factory.mktemp("tiny_models")))


@pytest.fixture(params=MODEL_TYPES)
def tiny_model(request, tiny_models):
    """(model_type, checkpoint_dir), parametrized over every model type."""
    return request.param, tiny_models[request.param]


@pytest.fixture(scope="session")
def default_model(tmp_path_factory):
    """(cache_home, first_run): the embedded default model, converted once into a fresh cache."""
    cache_home = tmp_path_factory.mktemp("xdg_cache")
    first = run_cli(["--prompt", "The capital of France is", "--temperature", "0", "--length", "4"],
                    cache_home=cache_home)
    assert first.returncode == 0, first.stderr.decode()[-3000:]
    return cache_home, first


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: a test that takes more than a few seconds (deselect with -m 'not slow')")
