"""How the Triton kernels of codes (rungen/int8.py's int8 forms, rungen/int4_kernel.py's 4-bit one) are launched,
tuned and timed on a GPU: a tiled kernel for a step's rows (16 a program, on the tensor cores) tuned over the
configurations of the GPU's class (launcher), a GEMV kernel for a decode step's one to four rows and a mixture's
chosen experts (with_gemv), autotuning whose timings Triton keeps on disk (autotune), and the one-row timing that
decides between GEMV and tiled, and between tinygemm and the Triton form (one_row_ms, read from memory).
"""

from __future__ import annotations

import logging
import os

import torch

logger = logging.getLogger(__name__)

MOST_ROWS = 64  # the kernel's rows at most: past that a step is compute-bound and cuBLAS's product wins
# The tuned configurations (BLOCK_N, BLOCK_K, warps), by the GPUs they are for: Ampere on, where none spills a
# register in any int8 form in (b)float16 on sm_80, sm_89 or sm_90; before Ampere (Volta, Turing: float16), where
# Ampere's spill up to 2 KiB a thread in the int8 kernel and these spill none in either kernel on sm_70 or sm_75
# (python -m benchmarks.int8_kernel_resources --arch N).
CONFIGS = ((16, 128, 4), (16, 256, 4), (32, 256, 4), (32, 256, 8), (64, 128, 8))
CONFIGS_BEFORE_AMPERE = ((16, 64, 4), (16, 64, 8), (16, 128, 8), (32, 64, 8), (64, 64, 8))


GEMV_ROWS = 4  # rows a GEMV kernel takes at most (past them the tiled kernel's tensor cores)
GEMV_PRODUCTS = 8192  # products a GEMV program holds at once at most (past it, four rows take 255 registers on sm_90)


def configs_for(capability: tuple[int, int]) -> tuple:
    """The configurations tuned over on a GPU of compute `capability`."""
    return CONFIGS if capability >= (8, 0) else CONFIGS_BEFORE_AMPERE


def autotune(triton, configs, key, prune):
    """triton.autotune over `configs` keyed by `key`, pruned by `prune`, its timings kept in Triton's cache on disk
    where this Triton can (cache_results): a later process on the same GPU, kernel and shapes takes the choice without
    timing each configuration again (a model's first steps would otherwise tune each product's shapes anew)."""
    import inspect

    kept = {"cache_results": True} if "cache_results" in inspect.signature(triton.autotune).parameters else {}
    return triton.autotune(configs=configs, key=key, prune_configs_by={"early_config_prune": prune}, **kept)


def launcher(triton, matmul, constants, leave_out=()):
    """run(x, codes, scales, blocks=None, offsets=None) -> y: the Triton kernel `matmul` (x, codes, scales,
    offsets, y, M, N, K, M_BUCKET, its constexprs) over x [rows, in] in x's dtype, a block of 16 rows and BLOCK_N
    output channels a program, tuned over the GPU's configurations (configs_for, but `leave_out`) once for a decode
    step's rows and once past them; `constants(inner, codes, scales, offsets)`: its constexprs beside the blocks (a
    mixture's scales: one expert's); `blocks` ({"BLOCK_N", "BLOCK_K"}): one configuration instead of the tuned ones
    (Triton's interpreter on the CPU has nothing to time: one is taken there)."""
    tables = {table: [triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=w) for n, k, w in table
                      if (n, k, w) not in leave_out] for table in (CONFIGS, CONFIGS_BEFORE_AMPERE)}

    def for_the_gpu(configs, named_args, **kwargs):
        return tables[configs_for(torch.cuda.get_device_capability(named_args["x"].device))]

    tuned = autotune(triton, [config for table in tables.values() for config in table],
                     ["M_BUCKET", "N", "K", "GROUPED"], for_the_gpu)(matmul)

    def launch(x, codes, scales, offsets, blocks, rows, tiles=None, sources=None):
        grouped = tiles is not None  # codes, scales, offsets: a mixture's experts stacked [experts, ...]
        inner, channels = x.shape[1], codes.shape[-2]
        y = torch.empty(rows, channels, dtype=x.dtype, device=x.device)
        bucket = 16 if rows <= 16 and not grouped else MOST_ROWS  # one tuning for a decode step's rows, one past
        if blocks is None and os.environ.get("TRITON_INTERPRET") == "1":
            blocks = {"BLOCK_N": 32, "BLOCK_K": 128}

        def grid(meta):
            return triton.cdiv(rows, 16), triton.cdiv(channels, meta["BLOCK_N"])

        shifts = scales if offsets is None else offsets  # (never read without offsets)
        kernel, settings = (tuned, {}) if blocks is None else (matmul, blocks)
        kernel[grid](x, codes, scales, shifts, y, tiles if grouped else codes, sources if grouped else codes, rows,
                     channels, inner, bucket, BLOCK_M=16, GROUPED=grouped,
                     **constants(inner, codes, scales[0] if grouped else scales, offsets), **settings)
        return y

    def run(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, blocks: dict | None = None,
            offsets: torch.Tensor | None = None) -> torch.Tensor:
        return launch(x, codes, scales, offsets, blocks, x.shape[0])

    def grouped(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None,
                tiles: torch.Tensor, sources: torch.Tensor, blocks: dict | None = None) -> torch.Tensor:
        """y [16 x tiles, out]: block b of 16 rows expert tiles[b]'s (-1: none, its rows left unwritten), row m
        x[sources[m]] times that expert's weight (-1: unwritten); the experts' codes, scales and offsets stacked."""
        return launch(x, codes, scales, offsets, blocks, 16 * tiles.shape[0], tiles, sources)

    # for benchmarks/int8_kernel_resources.py: the kernel and the configurations of a compute capability
    run.jit, run.configs_for, run.grouped = matmul, lambda capability: tables[configs_for(capability)], grouped
    return run


def with_gemv(triton, tiled, gemv_kernel, constants, env: str):
    """run(x, codes, scales, blocks=None, offsets=None) -> y: the autotuned `gemv_kernel` (x, codes, scales, offsets,
    y, M, N, K, its constexprs: `constants(inner, codes, scales, offsets)`, ROWS, BLOCK_N, BLOCK_K) over a step's
    GEMV_ROWS rows at most, while run.gemv (`env` not 0; a check keeps it where it is the faster at one row), else
    the `tiled` launcher; run.gemv_launch(x, codes, scales, offsets, blocks) runs the GEMV kernel alone (`blocks`:
    one configuration; Triton's interpreter, with nothing to time, takes one); run.grouped(x, codes, scales,
    offsets, pairs): a mixture's experts stacked ([experts, out, ...] each), y [P, out] with y[p] = x[pairs[p, 1]]
    times expert pairs[p, 0]'s weight (a decode step's chosen experts in one launch, no read on the host);
    run.grouped_tiles(x, codes, scales, offsets, tiles, sources): the tiled kernel's (launcher's run.grouped), a
    prompt's chosen experts in blocks of 16 rows an expert."""

    def gemv(x, codes, scales, offsets=None, blocks=None, pairs=None):
        grouped = pairs is not None  # codes, scales, offsets: a mixture's experts stacked, pairs [P, 2] int32
        rows, channels, inner = (pairs if grouped else x).shape[0], codes.shape[-2], x.shape[1]
        y = torch.empty(rows, channels, dtype=x.dtype, device=x.device)
        if blocks is None and os.environ.get("TRITON_INTERPRET") == "1":
            blocks = {"BLOCK_N": 16, "BLOCK_K": 128}
        kernel, settings = (gemv_kernel, {}) if blocks is None else (gemv_kernel.fn, blocks)
        kernel[lambda meta: (triton.cdiv(channels, meta["BLOCK_N"]), rows if grouped else 1)](
            x, codes, scales, scales if offsets is None else offsets, y, pairs if grouped else codes,
            1 if grouped else rows, channels, inner, **constants(inner, codes, scales[0] if grouped else scales,
                                                                  offsets),
            ROWS=1 if grouped else 1 << (rows - 1).bit_length(), GROUPED=grouped, **settings)
        return y

    def run(x, codes, scales, blocks=None, offsets=None):
        if blocks is not None or x.shape[0] > GEMV_ROWS or not run.gemv:
            return tiled(x, codes, scales, blocks, offsets)
        return gemv(x, codes, scales, offsets)

    run.gemv = os.environ.get(env, "1") != "0"
    run.timed = False  # whether a check timed the GEMV kernel against the tiled one (the first: it decides)
    run.jit, run.configs_for, run.tiled, run.gemv_launch = tiled.jit, tiled.configs_for, tiled, gemv
    run.grouped = lambda x, codes, scales, offsets, pairs: gemv(x, codes, scales, offsets, pairs=pairs)
    run.grouped_tiles = tiled.grouped
    run.gemv_jit = gemv_kernel.fn  # (benchmarks/int8_kernel_resources.py builds it apart)
    return run


def choose_gemv(kernel, layer, dtype: torch.dtype) -> None:
    """The first checked layer on a GPU decides, once a process, whether `kernel` (with_gemv's run, or a stand-in
    without a GEMV) takes a step's few rows on its GEMV kernel: where that multiplies `layer` at one row faster than
    the tiled kernel (faster_at_one_row). Triton's interpreter, with nothing to time, keeps the GEMV."""
    if getattr(kernel, "gemv", False) and not kernel.timed and layer.codes.is_cuda and \
            os.environ.get("TRITON_INTERPRET") != "1":
        kernel.timed, kernel.gemv = True, faster_at_one_row(kernel, layer, dtype)


def faster_at_one_row(kernel, layer, dtype: torch.dtype) -> bool:
    """Whether `kernel`'s GEMV multiplies one row by `layer` faster than its tiled kernel (one_row_ms); one line says
    what each took."""
    x = torch.randn(1, layer.in_features, dtype=dtype, device=layer.codes.device)
    times = {name: one_row_ms(lambda x, run=run: run(x, layer.codes, layer.scales, offsets=layer.offsets), x)
             for name, run in (("GEMV", kernel.gemv_launch), ("tiled", kernel.tiled))}
    logger.info("%s Triton kernels at one row on a %d x %d layer: GEMV %.4f ms, tiled %.4f ms", layer.format,
                layer.out_features, layer.in_features, times["GEMV"], times["tiled"])
    return times["GEMV"] < times["tiled"]


def one_row_ms(multiply, x: torch.Tensor) -> float:
    """The median milliseconds of multiply(x) on a GPU, after a call that tunes and compiles, its weight read from
    memory as a decode step reads it (Triton's do_bench clears the L2 cache before each call, which one layer's codes
    would otherwise stay in)."""
    from triton.testing import do_bench

    multiply(x)
    return do_bench(lambda: multiply(x), warmup=5, rep=25, return_mode="median")
