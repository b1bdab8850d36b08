"""What the Triton kernels of int8 and 4-bit codes (rungen/int8.py, rungen/int4_kernel.py) ask of a GPU, read without
one: Triton's own compiler builds them for a target (sm_90, an H100/H200, by default; sm_75 a T4, sm_70 a V100:
before Ampere the kernels tune over configurations of their own) and the cuobjdump in Triton's package reads each
build's registers, spills and shared memory. A decode step's kernel should be bound by the codes it reads from
memory; shared memory per program beyond the codes' own tiles is traffic beside them (and past what the GPU grants a
block, 227 KiB on sm_90, a configuration cannot run).

    python -m benchmarks.int8_kernel_resources [--arch 90] [--activations bf16 fp16]

Needs Triton (`pip install triton`; the CPU build of torch does not bring it). One row per weight layout (each GGUF
int8 form's scales and offsets, --quantize int8's scale a channel, the 4-bit kernel's two), activation dtype and
tuned configuration; then the GEMV kernels' (one to four rows: int8's in each layout, the 4-bit one's) in each of
their configurations, at one row and at four; then the fused decode step's kernels (rungen/step_triton.py) as their
launchers configure them.
"""

import argparse
import itertools
import os
import re
import subprocess
import sys
import tempfile

# (name, group, scales' dtype, offsets): the int8 forms of rungen/gguf/device.py and --quantize int8; and (group
# "int4") the 4-bit kernel's, offsets its constexprs (LEVELS, LOW, HIGH, GROUP: int4_kernel.py's form_of)
LAYOUTS = (("--quantize int8: a scale a channel", 0, "bf16", False),
           ("Q8_0, IQ4_NL: fp16 scale / 32", 32, "fp16", False),
           ("IQ4_XS: fp32 scale / 32", 32, "fp32", False),
           ("Q6_K, Q3_K: fp32 scale / 16", 16, "fp32", False),
           ("Q5_0, Q5_1, Q5_K: fp32 scale + offset / 32", 32, "fp32", True),
           ("Q2_K: fp32 scale + offset / 16", 16, "fp32", True),
           ("4-bit kernel, Q4_0, Q4_1: fp16 scale + offset / 32", "int4", "fp16", dict(LEVELS=0, LOW=4, HIGH=0,
                                                                                             GROUP=32)),
           ("4-bit kernel, Q4_K: u8 scale + min / 32, fp16 / 256", "int4", "u8", dict(LEVELS=5, LOW=4, HIGH=0,
                                                                                      GROUP=32)),
           ("4-bit kernel, MXFP4: e2m1, fp16 scale / 32", "int4", "fp16", dict(LEVELS=1, LOW=4, HIGH=0, GROUP=32)),
           ("4-bit kernel, IQ4_NL: levels, fp16 scale / 32", "int4", "fp16", dict(LEVELS=2, LOW=4, HIGH=0, GROUP=32)),
           ("4-bit kernel, Q5_0: signed 5 bits, fp16 scale / 32", "int4", "fp16", dict(LEVELS=3, LOW=4, HIGH=1,
                                                                                       GROUP=32)),
           ("4-bit kernel, Q5_K: 5 bits, u8 scale + min / 32, fp16 / 256", "int4", "u8", dict(LEVELS=5, LOW=4, HIGH=1,
                                                                                               GROUP=32)),
           ("4-bit kernel, Q6_K: signed 6 bits, i8 scale / 16, fp16 / 256", "int4", "i8", dict(LEVELS=4, LOW=4,
                                                                                                HIGH=2, GROUP=16)),
           ("4-bit kernel, Q3_K: signed 3 bits, i8 scale / 16, fp16 / 256", "int4", "i8", dict(LEVELS=4, LOW=2,
                                                                                                HIGH=1, GROUP=16)),
           ("4-bit kernel, Q2_K: 2 bits, u8 scale + min / 16, fp16 / 256", "int4", "u8", dict(LEVELS=5, LOW=2, HIGH=0,
                                                                                              GROUP=16)))
# The most shared memory a block may take, KiB, by compute capability (CUDA's programming guide)
MAX_SHARED = {70: 96, 75: 64, 80: 163, 86: 99, 87: 163, 89: 99, 90: 227}


def aligned(names):
    """The arguments Triton's launcher sees divisible by 16 (torch's pointers; a model's widths and channels), as
    a launch specializes them: their loads become 16-byte copies, as on the GPU."""
    divisible = ("x", "codes", "scales", "offsets", "y", "N", "K")
    return {(names.index(name),): [["tt.divisibility", 16]] for name in divisible}


def codes_type(group, form) -> str:
    """A layout's codes' pointer type: int8 (and the 4-bit kernel's signed codes) or uint8 bytes."""
    return "*u8" if group == "int4" and form["LEVELS"] not in (3, 4) else "*i8"


def offsets_type(group, scales, form) -> str:
    """A layout's offsets' pointer type: its scales' (the 4-bit kernel's table of levels: int32; a K-quant's
    superblock scales: float16)."""
    if group == "int4" and form["LEVELS"] in (2, 4, 5):
        return "*i32" if form["LEVELS"] == 2 else "*fp16"
    return f"*{scales}"


def resources(cubin: bytes, cuobjdump: str) -> dict:
    """{"REG", "SHARED", "STACK"...} of the one function in `cubin`, as cuobjdump --dump-resource-usage prints it."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([cuobjdump, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    return {key: int(value) for key, value in re.findall(r"(\w+):(\d+)", text.split("Resource usage:")[-1])}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90, help="the compute capability built for (90: H100/H200)")
    parser.add_argument("--activations", nargs="*", default=["bf16", "fp16"], choices=["bf16", "fp16", "fp32"])
    args = parser.parse_args()
    try:
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except ImportError:
        sys.exit("this needs Triton: pip install triton")
    from rungen import int4_kernel, int8

    runs = {"int8": int8.triton_kernel(), "int4": int4_kernel.triton_kernel()}
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    most = MAX_SHARED.get(args.arch, 99) * 1024
    print(f"Triton {triton.__version__}, sm_{args.arch}; BLOCK_M 16 (a decode step's rows)")
    print("| layout | activations | BLOCK_N x BLOCK_K, warps, stages | registers | spilled bytes | shared KiB |")
    print("| --- | --- | --- | ---: | ---: | ---: |")
    for name, group, scales, offsets in LAYOUTS:
        for activations in args.activations:
            run = runs["int4" if group == "int4" else "int8"]
            names = run.jit.arg_names
            for config, grouped in itertools.product(run.configs_for(divmod(args.arch, 10)), (False, True)):
                block_n, block_k = config.kwargs["BLOCK_N"], config.kwargs["BLOCK_K"]
                signature = {"x": f"*{activations}", "codes": codes_type(group, offsets),
                             "scales": f"*{scales}", "offsets": offsets_type(group, scales, offsets),
                             "y": f"*{activations}", "tiles": "*i32", "sources": "*i32", "M": "i32", "N": "i32",
                             "K": "i32", "M_BUCKET": "i32", **{key: "constexpr" for key in names[11:]}}
                form = offsets if group == "int4" else {"GROUP": group, "OFFSET": offsets}
                constants = {**form, "GROUPED": grouped, "BLOCK_M": 16, "BLOCK_N": block_n, "BLOCK_K": block_k}
                constants = {(names.index(key),): value for key, value in constants.items() if key in names}
                source = ASTSource(run.jit, signature, constants, aligned(names))
                built = triton.compile(source, target=GPUTarget("cuda", args.arch, 32),
                                       options={"num_warps": config.num_warps, "num_stages": config.num_stages})
                used = resources(built.asm["cubin"], cuobjdump)
                shared = built.metadata.shared
                print(f"| {name}{' (grouped)' if grouped else ''} | {activations} | {block_n} x {block_k}, "
                      f"{config.num_warps}, {config.num_stages} | {used.get('REG', '?')} | "
                      f"{used.get('STACK', 0)} | {shared / 1024:.0f}{' (too much)' if shared > most else ''} |",
                      flush=True)
    gemv(args, runs, triton, GPUTarget, ASTSource, cuobjdump, most)
    step(args, triton, GPUTarget, ASTSource, cuobjdump, most)


def gemv(args, runs, triton, GPUTarget, ASTSource, cuobjdump, most):
    """The GEMV kernels (a decode step's 1 to 4 rows), int8's in every int8 layout and the 4-bit one's, in each of
    their configurations, at one row and at four where the configuration serves four (GEMV_PRODUCTS), and grouped
    (a mixture's experts stacked, a program a chosen expert's pair) at one row."""
    from rungen.code_kernels import GEMV_PRODUCTS
    from rungen.int4_kernel import GEMV_CONFIGS
    from rungen.int8 import INT8_GEMV_CONFIGS

    print("\n| GEMV kernel | activations | rows | BLOCK_N x BLOCK_K, warps | registers | spilled bytes | shared KiB |")
    print("| --- | --- | ---: | --- | ---: | ---: | ---: |")
    for name, group, scales, offsets in LAYOUTS:
        int4 = group == "int4"
        run = runs["int4" if int4 else "int8"]
        names = run.gemv_jit.arg_names
        for activations in args.activations:
            for rows, grouped in ((1, False), (4, False), (1, True)):  # (grouped: a mixture's chosen experts)
                for block_n, block_k, warps in GEMV_CONFIGS if int4 else INT8_GEMV_CONFIGS:
                    if rows * block_n * block_k // (2 if int4 else 1) > GEMV_PRODUCTS:
                        continue  # (the autotuner prunes it at these rows)
                    signature = {"x": f"*{activations}", "codes": codes_type(group, offsets),
                                 "scales": f"*{scales}", "offsets": offsets_type(group, scales, offsets),
                                 "y": f"*{activations}", "pairs": "*i32", "M": "i32", "N": "i32", "K": "i32",
                                 **{key: "constexpr" for key in names[9:]}}
                    form = offsets if int4 else {"GROUP": group, "OFFSET": offsets}
                    constants = {**form, "ROWS": rows, "GROUPED": grouped, "BLOCK_N": block_n, "BLOCK_K": block_k}
                    constants = {(names.index(key),): value for key, value in constants.items() if key in names}
                    built = triton.compile(ASTSource(run.gemv_jit, signature, constants, aligned(names)),
                                           target=GPUTarget("cuda", args.arch, 32), options={"num_warps": warps})
                    used = resources(built.asm["cubin"], cuobjdump)
                    shared = built.metadata.shared
                    print(f"| {name} | {activations} | {rows}{' (grouped)' if grouped else ''} | "
                          f"{block_n} x {block_k}, {warps} | "
                          f"{used.get('REG', '?')} | {used.get('STACK', 0)} | "
                          f"{shared / 1024:.0f}{' (too much)' if shared > most else ''} |", flush=True)


def step(args, triton, GPUTarget, ASTSource, cuobjdump, most):
    """The fused decode step's kernels (rungen/step_triton.py) as their launchers configure them: add_rms_norm at the
    published hidden sizes, rotary_into_slots with and without Qwen3's q/k norms, silu_mul, and decode_attention at
    head sizes 64 to 256 (split over a slot's positions, as the 8B shape at 4,096 positions) with its combine."""
    from rungen import step_triton as kernels

    def build(fn, dtype, pointers, scalars, constants, warps):
        names = fn.arg_names
        signature = {name: "constexpr" for name in names}
        signature.update({name: f"*{kind if kind != 'act' else dtype}" for name, kind in pointers.items()})
        signature.update(scalars)
        source = ASTSource(fn, signature, {(names.index(key),): value for key, value in constants.items()})
        built = triton.compile(source, target=GPUTarget("cuda", args.arch, 32), options={"num_warps": warps})
        used = resources(built.asm["cubin"], cuobjdump)
        shared = built.metadata.shared
        shown = ", ".join(f"{key} {value}" for key, value in constants.items())
        print(f"| {fn.__name__} | {dtype} | {shown}, {warps} warps | {used.get('REG', '?')} | "
              f"{used.get('STACK', 0)} | {shared / 1024:.0f}{' (too much)' if shared > most else ''} |", flush=True)

    print("\n| fused step kernel | activations | configuration | registers | spilled bytes | shared KiB |")
    print("| --- | --- | --- | ---: | ---: | ---: |")
    act = "act"
    for dtype in args.activations:
        for width in (576, 2048, 4096, 8192):
            build(kernels.add_rms_norm_kernel, dtype, dict(x=act, residual=act, weight=act, normed=act, summed=act),
                  dict(N="i32", eps="fp32"), dict(ADD=True, BLOCK=kernels.power_of_two(width)),
                  kernels.norm_warps(width))
        for size, normed in ((64, False), (128, False), (128, True), (96, False)):
            build(kernels.rotary_kernel, dtype, dict(q=act, k=act, v=act, cos=act, sin=act, q_norm=act, k_norm=act,
                                                     keys=act, values=act, positions="i64", query_out=act),
                  dict(q_stride="i64", k_stride="i64", v_stride="i64", eps="fp32", slot_stride="i64",
                       head_stride="i64", position_stride="i64"),
                  dict(HEADS=32, SIZE=size, WIDTH=size if size != 96 else 48, NORM=normed,
                       BLOCK=kernels.power_of_two(size)), 4)
        build(kernels.silu_mul_kernel, dtype, dict(gate=act, up=act, out=act),
              dict(N="i32", gate_stride="i32", up_stride="i32"), dict(BLOCK=1024), 4)
        for size in (64, 96, 128, 256):
            block_d, block_n, warps = kernels.attention_blocks(size)
            build(kernels.decode_attention_kernel, dtype, dict(query=act, keys=act, values=act, positions="i64",
                                                               out=act, partial="fp32", lse="fp32"),
                  dict(scale="fp32", slot_stride="i64", head_stride="i64", position_stride="i64"),
                  dict(HEADS=32, GROUP=4, SIZE=size, CHUNK=kernels.SPLIT_POSITIONS, SPLITS=16, BLOCK_G=16,
                       BLOCK_D=block_d, BLOCK_N=block_n), warps)
        build(kernels.combine_kernel, dtype, dict(partial="fp32", lse="fp32", out=act), {},
              dict(SPLITS=16, SIZE=128, BLOCK_S=16, BLOCK_D=128), 4)


if __name__ == "__main__":
    main()
