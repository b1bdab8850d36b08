"""Shared pytest fixtures: tiny random checkpoints built on the spot, fully offline; each model loaded once.

Two tiers: plain `pytest` runs the tool in-process (run_main); tests marked `slow` start real processes
(pipes and signals, a pseudo-terminal, accelerate launches, the README's first run) or spend tens of seconds
of CPU on the real model (its GGUF file read directly, --jit and --quantize on it); they run with
`-m "slow or not slow"`, as CI does."""

import os
import signal
import sys

# A suite started in the background by a non-interactive shell (`pytest &` in a script) has SIGINT ignored, and
# every process it starts would inherit that (an ignored signal stays ignored across exec): the tests that press
# Ctrl-C on the tool need it at Python's default, as a terminal gives it.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

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
from hypothesis import settings as hypothesis_settings  # noqa: E402

# Under CI (CI=true) the slow tier's property tests draw their examples from a seed fixed per test
# (derandomize): a CI run is reproducible. Elsewhere they draw new examples each run, which is how they find
# what fixed seeds miss; the fast tier's are seeded everywhere.
hypothesis_settings.register_profile("ci", derandomize=True)
if os.environ.get("CI"):
    hypothesis_settings.load_profile("ci")

import run_generation  # noqa: E402
import rungen.gguf.build  # noqa: E402
import rungen.gguf.configs  # noqa: E402
import rungen.gguf.file  # noqa: E402
import rungen.loading  # noqa: E402
from helpers import LoadMemo, gguf_header_dir, run_main  # noqa: E402
from rungen.gguf import kernel_cache_dir  # noqa: E402
from tiny_models import MODEL_TYPES, build_all  # noqa: E402

LOAD = rungen.loading.load  # the real loader, whatever a test patches later
# The native kernels are built once per machine (about a minute) into the user's cache: tests that give the
# tool a fresh XDG_CACHE_HOME, and the processes they start, keep using that one build.
os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(os.path.dirname(os.path.dirname(kernel_cache_dir())),
                                                         "torch_extensions"))


def pytest_configure(config):
    config.addinivalue_line("markers", "fresh_load: main() loads its model from disk, not from the memo")


@pytest.fixture(scope="session")
def load_memo():
    """One memo for the whole session: every model is loaded from disk once (see helpers.LoadMemo)."""
    return LoadMemo(LOAD)


@pytest.fixture(autouse=True)
def memoized_loads(request, load_memo, monkeypatch):
    """main() (and the assistant model's loader) go through the memo, unless the test is marked fresh_load."""
    if request.node.get_closest_marker("fresh_load") is None:
        monkeypatch.setattr(run_generation, "load", load_memo)
        monkeypatch.setattr(rungen.loading, "load", load_memo)


@pytest.fixture(scope="module")
def module_cache_home(tmp_path_factory):
    """$XDG_CACHE_HOME a fresh folder for one module's header caches (restored afterwards)."""
    saved = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = str(tmp_path_factory.mktemp("xdg_cache"))
    yield os.environ["XDG_CACHE_HOME"]
    if saved is None:
        del os.environ["XDG_CACHE_HOME"]
    else:
        os.environ["XDG_CACHE_HOME"] = saved


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """{model_type: checkpoint_dir} for every type in tiny_models.MODEL_TYPES, built once per session."""
    return build_all(str(tmp_path_factory.mktemp("tiny_models")))


@pytest.fixture(params=MODEL_TYPES)
def tiny_model(request, tiny_models):
    """(model_type, checkpoint_dir), parametrized over every model type."""
    return request.param, tiny_models[request.param]


@pytest.fixture(scope="session")
def default_model(request, tmp_path_factory):
    """(cache_home, first_run, converted): the embedded default model, its GGUF header read by the tool's first
    run (converted: the cache was empty before it; with --dequantize a run converts it to float once more).

    The cache outlives the session in pytest's cache directory (as the tool's own cache outlives a run),
    under a name that changes with transformers and with the loaders' source, so that a changed conversion
    is converted again. Without pytest's cache (-p no:cacheprovider),
    a fresh directory. The README's first run on an empty cache is tests/test_default_model.py's slow test."""
    cache_home = default_model_cache(request.config) or tmp_path_factory.mktemp("xdg_cache")
    converted = gguf_header_dir(cache_home) is None
    first = run_main(["--prompt", "The capital of France is", "--temperature", "0", "--length", "4"],
                     cache_home=cache_home)
    assert first.returncode == 0, first.stderr.decode()[-3000:]
    return cache_home, first, converted


def default_model_cache(config):
    """A directory in pytest's cache for the converted default model, or None; older versions are removed."""
    if getattr(config, "cache", None) is None:
        return None
    import hashlib
    import shutil

    import transformers

    digest = hashlib.sha256()
    for module in (rungen.loading, rungen.gguf.file, rungen.gguf.configs, rungen.gguf.build):
        with open(module.__file__, "rb") as f:
            digest.update(f.read())
    version = f"{transformers.__version__}-{digest.hexdigest()[:16]}"
    parent = config.cache.mkdir("default_model")
    for old in os.listdir(parent):
        if old != version:
            shutil.rmtree(os.path.join(parent, old), ignore_errors=True)
    os.makedirs(os.path.join(parent, version), exist_ok=True)
    return os.path.join(parent, version)
