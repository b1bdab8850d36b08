"""The native GGUF kernels (torch.ops.rungen_ggml): built from rungen/gguf/csrc on first use, cached by the hash of
their sources, their flags and torch's version, loaded from the cache afterwards (docs/kernels.md)."""

from __future__ import annotations

import fcntl
import glob
import hashlib
import logging
import os
import shutil
import sys
import tempfile
import time

import torch

KERNELS_ENV = "RUN_GENERATION_KERNELS"  # "torch": never build or load the native kernels
_SOURCE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")
_SOURCES = ("ggml_kernels.cpp", "ggml_dispatch.cpp", "ggml_products.cpp", "ggml_scalar.cpp", "ggml_avx2.cpp",
            "ggml_vnni.cpp", "ggml_attend.cpp", "ggml_layers.cpp", "ggml_decoder.cpp", "ggml_mixture.cpp",
            "ggml_delta.cpp", "ggml_shortconv.cpp", "ggml_mamba.cpp", "ggml_interleave.cpp",
            "ggml_formats.h", "ggml_kernels.h", "ggml_ops.h", "ggml_simd.h", "ggml_x8.h", "ggml_x8_avx2.h",
            "ggml_x16.h", "ggml_amx.h", "ggml_spans.h", "ggml_attend.h", "ggml_delta.h", "ggml_mamba.h",
            "ggml_lanes.h", "ggml_builds.h")
# -ffp-contract=off: no multiply-add is fused unless the source says so, so that the same arithmetic compiled in
# two functions (a token alone, tokens four at a time) gives the same bits.
_CFLAGS = ("-O3", "-fopenmp", "-ffp-contract=off")
_native: bool | None = None  # undecided, loaded, or not available (warned once)


def kernel_cache_dir() -> str:
    """Where built kernels are kept: $TORCH_EXTENSIONS_DIR, else $XDG_CACHE_HOME/run_generation/kernels."""
    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return os.path.join(os.environ["TORCH_EXTENSIONS_DIR"], "run_generation")
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "run_generation", "kernels")


def _source_key() -> str:
    digest = hashlib.sha256(torch.__version__.encode() + " ".join(_CFLAGS).encode())
    for name in _SOURCES:
        with open(os.path.join(_SOURCE_DIR, name), "rb") as f:
            digest.update(name.encode() + b"\0" + f.read())
    return digest.hexdigest()[:16]


def build_kernels(verbose: bool = False) -> str:
    """Builds (unless cached) and loads the native kernels; returns the library's path. Raises on failure.

    Processes take turns on an flock (freed if its holder dies); the library is built in a private folder and
    os.replace'd into the cache, so a half-built one is never loaded."""
    key = _source_key()
    cache = kernel_cache_dir()
    os.makedirs(cache, exist_ok=True)
    library = os.path.join(cache, f"rungen_ggml_{key}.so")
    with open(os.path.join(cache, f"rungen_ggml_{key}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not os.path.exists(library):
            from torch.utils import cpp_extension  # slow to import (setuptools): only to build

            from .. import NOTICE

            log = logging.getLogger("run_generation")
            log.log(NOTICE, "Building the native GGUF kernels (once: about a minute; cached in %s)", cache)
            start = time.perf_counter()
            for stale in glob.glob(os.path.join(cache, "build-*")):  # a build killed outright (the lock is ours)
                shutil.rmtree(stale, ignore_errors=True)
            build = tempfile.mkdtemp(prefix="build-", dir=cache)
            try:
                name = f"rungen_ggml_{key}"
                sources = [os.path.join(_SOURCE_DIR, source) for source in _SOURCES if source.endswith(".cpp")]
                cpp_extension.load(name=name, sources=sources,
                                   extra_cflags=list(_CFLAGS), extra_ldflags=["-fopenmp"],
                                   build_directory=build, is_python_module=False, verbose=verbose)
                # load() has loaded the library from the build folder; the rename keeps that mapping valid.
                os.replace(os.path.join(build, f"{name}.so"), library)
                log.log(NOTICE, "Built the native GGUF kernels in %.0f s", time.perf_counter() - start)
                return library
            finally:
                shutil.rmtree(build, ignore_errors=True)
    torch.ops.load_library(library)
    return library


def native_kernels() -> bool:
    """Whether torch.ops.rungen_ggml is available (built or loaded on the first call); else one warning and False."""
    global _native
    if _native is None:
        reason = None
        if os.environ.get(KERNELS_ENV, "").lower() == "torch":
            reason = f"{KERNELS_ENV}=torch"
        else:
            try:
                build_kernels()
            except Exception as error:  # a compiler's failure comes in many types; the fallback covers all
                reason = f"the native kernels could not be built ({type(error).__name__}: {str(error)[-300:]})"
        _native = reason is None
        if reason:
            print(f"run_generation: GGUF weights use torch's int4/float16 kernels: {reason}", file=sys.stderr)
    return _native
