"""Fast tier: a quantized layer computes its float layer's product within the error its own codes
allow, and --quantize refuses what it cannot do in one line."""

import platform

import pytest
import torch
from transformers.pytorch_utils import Conv1D

from rungen.quantize import GROUP_SIZE, Fp16Linear, Int4Linear, Int8Linear, QuantizeError, head_class, quantize_model


def error_bound(layer, x, weight, rounding_step):
    """|quantized - exact| may be: the weights' rounding (half a step per weight) times |x|, the input's
    rounding to bfloat16 times |W|, and the output's rounding to bfloat16 (2^-8 relative)."""
    x16 = x.to(torch.bfloat16).float()
    exact = x @ weight.t()
    return x16.abs() @ (rounding_step / 2).t() + (x - x16).abs() @ weight.abs().t() + exact.abs() * 2**-8 + 1e-5


@pytest.mark.parametrize("out_features", [48, 37])  # 37: int4 pads output channels to a multiple of 16
def test_quantized_layers_stay_within_their_rounding(out_features):
    torch.manual_seed(0)
    weight, x = torch.randn(out_features, 64) * 0.05, torch.randn(5, 64)
    exact = x @ weight.t()

    int8 = Int8Linear(weight, None)
    step8 = int8.scales.float()[:, None].expand_as(weight)
    assert torch.all((int8(x) - exact).abs() <= error_bound(int8, x, weight, step8))

    int4 = Int4Linear(weight, None)
    scales = int4.scales_and_zeros[..., 0].float().t()[:out_features]  # [out, groups]
    step4 = scales.repeat_interleave(GROUP_SIZE, dim=1)
    assert int4(x).shape == (5, out_features)
    assert torch.all((int4(x) - exact).abs() <= error_bound(int4, x, weight, step4))


def test_the_gpu_int8_layer_holds_the_cpus_codes_and_widens_them_past_the_kernels_rows():
    # CudaInt8Linear (--quantize int8 on a GPU) keeps Int8Linear's codes and scales; its widened product (the
    # fallback, and the path for a prompt's many rows) is the codes' exact product in float32, and the checked
    # kernel serves a decode step's few rows only.
    from rungen.int8 import MOST_ROWS, CudaInt8Linear, cuda_int8_layers, int8_codes

    torch.manual_seed(0)
    weight, bias = torch.randn(40, 96) * 0.05, torch.randn(40)
    cpu = Int8Linear(weight, None)
    layer = cuda_int8_layers()(weight, bias, check=True)  # on the CPU: no kernel, the widened product
    assert isinstance(layer, CudaInt8Linear) and layer.kernel is None
    assert torch.equal(layer.codes, cpu.codes) and torch.equal(layer.scales, cpu.scales)
    assert layer.codes.dtype == torch.int8 and layer.codes.shape == weight.shape
    x = torch.randn(3, 7, 96)
    exact = x @ (layer.codes.float() * layer.scales.float()[:, None]).t() + bias
    assert torch.allclose(layer(x), exact, atol=1e-5)
    assert torch.equal(int8_codes(weight)[0], cpu.codes)
    calls = []
    layer.use_kernel(lambda flat, codes, scales, offsets: (calls.append(flat.shape[0]),
                                                        flat @ codes.float().t() * scales)[1])
    layer(torch.randn(MOST_ROWS, 96))
    layer(torch.randn(MOST_ROWS + 1, 96))
    assert calls == [MOST_ROWS]


@pytest.mark.parametrize("grouped", [False, True], ids=["a scale a channel", "a scale a group of 32 (Q8_0)"])
def test_the_widened_product_holds_float16s_range(grouped):
    # A float16 checkpoint's outputs of a few hundred: the codes' own product (127 / max|w| times larger) would be
    # past float16's 65504; the weight scaled first is not.
    from rungen.int8 import int8_codes, widened

    torch.manual_seed(0)
    weight, x = torch.randn(16, 256) * 0.02, torch.randn(4, 256) * 200
    codes, scales = int8_codes(weight)
    if grouped:
        scales = scales.float()[:, None].expand(16, 8).to(torch.float16)
    exact = x @ (codes.float() * scales.float().repeat_interleave(256 // scales.shape[1], dim=1)
                 if grouped else codes.float() * scales.float()[:, None]).t()
    assert exact.abs().max() > 100
    half = widened(x.half(), codes, scales)
    assert half.dtype == torch.float16 and torch.isfinite(half).all()
    torch.testing.assert_close(half.float(), exact, rtol=0.01, atol=0.5)


def test_the_widened_product_of_a_large_table_takes_slices_of_it(monkeypatch):
    # Past the kernel's rows a GPU layer widens its codes: a head's table a slice of output channels at a time (at
    # most WIDEN_BYTES), the product the same (integer values and power-of-two scales: every sum exact).
    import rungen.int8
    from rungen.int8 import widened

    generator = torch.Generator().manual_seed(0)
    codes = torch.randint(-128, 128, (100, 64), dtype=torch.int8, generator=generator)
    scales = 2.0 ** -torch.randint(4, 8, (100, 2), generator=generator).float()
    x = torch.randint(-8, 8, (3, 64), generator=generator).float()
    whole = widened(x, codes, scales)
    widened_rows = []
    linear = torch.nn.functional.linear
    monkeypatch.setattr(rungen.int8, "WIDEN_BYTES", 16 * 64 * 4)  # 16 channels of float32 at a time
    monkeypatch.setattr(torch.nn.functional, "linear", lambda x, weight: (widened_rows.append(weight.shape[0]),
                                                                          linear(x, weight))[1])
    assert torch.equal(widened(x, codes, scales), whole)
    assert whole.shape == (3, 100) and widened_rows == [16] * 6 + [4]


def test_the_int8_kernels_check_multiplies_a_heads_first_channels_and_catches_a_wrong_kernel():
    # The check a GPU load runs on the first int8 weight of each type (often a head of 128k rows): the kernel and the
    # float32 reference multiply its first CHECKED_CHANNELS output channels only (the whole table widened to
    # float32 would be gigabytes at load), and a kernel that computes otherwise is refused with its reason.
    from rungen.int8 import CHECKED_CHANNELS, CudaInt8Linear, disagreement, widened

    generator = torch.Generator().manual_seed(0)
    codes = torch.randint(-128, 128, (3 * CHECKED_CHANNELS, 64), dtype=torch.int8, generator=generator)
    layer = CudaInt8Linear(codes, (torch.rand(3 * CHECKED_CHANNELS, 2, generator=generator) / 100).half(), None)
    seen = []

    def kernel(x, codes, scales, offsets):
        seen.append(codes.shape[0])
        return widened(x.float(), codes, scales, offsets).to(x.dtype)

    assert disagreement(kernel, layer, torch.float32) is None and seen == [CHECKED_CHANNELS] * 2
    why = disagreement(lambda x, codes, scales, offsets: kernel(x, codes, scales, offsets) * 1.1, layer, torch.float32)
    assert why == "the Triton kernel disagrees with the plain product on this GPU"


def test_a_kernel_check_that_fails_keeps_no_hold_on_the_layers_table():
    # A Triton launch that fails leaves its arguments in the kernel's autotuner (its `nargs`) for the process's life;
    # the load then de-quantizes the weight and drops the layer. What the check passed must be copies of the checked
    # channels: a view would keep the layer's whole table (a 128k-row head's codes: half a GB) on the GPU beside the
    # de-quantized weight, as the played GPU showed under a Triton that imports without a driver.
    from rungen.int8 import CHECKED_CHANNELS, CudaInt8Linear, disagreement

    layer = CudaInt8Linear(torch.ones(3 * CHECKED_CHANNELS, 64, dtype=torch.int8),
                           torch.ones(3 * CHECKED_CHANNELS, 2, dtype=torch.float16), None)
    kept = {}

    def failing(x, codes, scales, offsets):
        kept.update(codes=codes, scales=scales)
        raise RuntimeError("libcuda.so cannot found!")

    assert disagreement(failing, layer, torch.float32) == "the Triton kernel failed (libcuda.so cannot found!)"
    for name in ("codes", "scales"):
        theirs, ours = kept[name].untyped_storage(), getattr(layer, name).untyped_storage()
        assert theirs.data_ptr() != ours.data_ptr() and theirs.nbytes() == ours.nbytes() // 3


@pytest.mark.parametrize("check", ["int8 or 4-bit Triton kernel", "torch's int4 kernel"])
def test_a_kernels_check_that_runs_out_of_gpu_memory_says_so(check):
    # A kernel's check fails over to another form for a kernel that fails; running out of memory is no such
    # failure: it reaches the user as itself (the command line's "out of GPU memory ... fit it with"), never as
    # "the kernel failed" and a wider form that needs more memory still.
    from rungen.int4 import checked_tinygemm
    from rungen.int8 import CudaInt8Linear, disagreement

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.")

    with pytest.raises(torch.OutOfMemoryError, match="^CUDA out of memory"):
        if check == "torch's int4 kernel":
            checked_tinygemm(out_of_memory, torch.zeros(16, 32))
        else:
            layer = CudaInt8Linear(torch.zeros(16, 64, dtype=torch.int8), torch.ones(16, dtype=torch.bfloat16), None)
            disagreement(out_of_memory, layer, torch.float32)
    assert checked_tinygemm(lambda: (_ for _ in ()).throw(RuntimeError("no kernel image")), torch.zeros(16, 32)) == (
        None, "failed (no kernel image)")


@pytest.mark.parametrize("name", ["Q8_0", "Q6_K", "Q5_0", "Q5_1", "Q5_K", "IQ4_NL", "IQ4_XS", "Q3_K", "Q2_K",
                                  "MXFP4"])
def test_an_int8_types_weight_for_the_gpu_keeps_the_files_codes_and_scales(name, monkeypatch):
    # A GGUF weight of an int8 type on a GPU (rungen/gguf/device.py's int8_of_blocks): Q8_0's 32 int8 codes and
    # float16 scale a block as the file has them, Q6_K's codes (-32..31) and a float32 scale a group of 16 (its
    # superblock's float16 scale times the group's int8 one), the Q5 types' codes (0..31) and a float32 scale and
    # offset a group of 32, the IQ4 types' levels and a scale a group of 32, MXFP4's doubled e2m1 values (-12..12)
    # and its power-of-two scale as float16 a group of 32 (from its blocks as read: held), Q3_K's codes (-4..3) and
    # Q2_K's (0..3, with an offset) a group of 16, rows permuted where the architecture asks, read a few rows at a
    # time; codes times scales plus offsets is exactly the de-quantized weight.
    import numpy as np
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    import rungen.gguf.device
    from helpers import blocks_for
    from rungen.gguf.blocks import dequantize, held
    from rungen.gguf.device import int8_of_blocks

    qtype = GGMLQuantizationType[name]
    file_blocks = blocks_for(qtype, 24, 512)
    blocks = torch.from_numpy(held(file_blocks.numpy(), qtype))
    order = np.random.default_rng(0).permutation(24)
    monkeypatch.setattr(rungen.gguf.device, "CODES_CHUNK_ROWS", 5)  # five rows at a time: five chunks, one short
    layer = int8_of_blocks(blocks, qtype, 512, torch.device("cpu"), order)
    group, dtype = {"Q8_0": (32, torch.float16), "IQ4_NL": (32, torch.float16), "MXFP4": (32, torch.float16),
                    "Q6_K": (16, torch.float32),
                    "Q3_K": (16, torch.float32), "Q2_K": (16, torch.float32)}.get(name, (32, torch.float32))
    assert layer.codes.dtype == torch.int8 and layer.scales.dtype == dtype and layer.scales.shape == (24, 512 // group)
    assert (layer.offsets is None) == (not name.startswith("Q5") and name != "Q2_K")
    weight = dequantize(blocks, qtype, 512)[torch.from_numpy(order)]
    torch.testing.assert_close(weight, torch.from_numpy(gguf_dequantize(file_blocks.numpy(), qtype))[order],
                               rtol=0, atol=0)  # the file's weights, as the gguf package reads them
    x = torch.randn(5, 512, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    values = layer.codes.float() * layer.scales.float().repeat_interleave(group, dim=1)
    if layer.offsets is not None:
        values = values + layer.offsets.repeat_interleave(group, dim=1)
    assert torch.equal(values, weight)
    reference = (x @ weight.double().t()).float()  # float32 sums of 512 products against float64's
    torch.testing.assert_close(layer(x.float()), reference, rtol=1e-4, atol=1e-5 * reference.abs().max().item())


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q4_K"])
def test_a_4_bit_weight_for_the_triton_kernel_keeps_the_files_codes_two_a_byte(name, monkeypatch):
    # A GGUF weight of a 4-bit type on a GPU as RUN_GENERATION_GPU_INT4=triton asks (rungen/gguf/device.py's
    # int4_codes_of_blocks): its codes two a byte, byte j of each chunk of 64 inputs holding input j low and input
    # j + 32 high, and each group of 32's scale and offset (float16 for Q4_0 and Q4_1, their blocks' own; Q4_K's as
    # its blocks hold them, each group's 6-bit scale and minimum and each superblock's float16 two: 0.578 bytes a
    # weight, the file's 0.5625), rows permuted where the architecture asks; unpacked, codes times scales plus
    # offsets is exactly the de-quantized weight, and the layer's product past the kernel's rows (widened a slice at
    # a time) is its product.
    import numpy as np
    from gguf import GGMLQuantizationType

    import rungen.int8
    from helpers import blocks_for
    from rungen.gguf.blocks import dequantize
    from rungen.gguf.codes import int4_parts
    from rungen.gguf.device import int4_codes_of_blocks
    from rungen.int4_kernel import superblock_scales, unpacked

    qtype = GGMLQuantizationType[name]
    blocks = blocks_for(qtype, 24, 512)
    order = np.random.default_rng(0).permutation(24)
    layer = int4_codes_of_blocks(blocks, qtype, 512, torch.device("cpu"), order)
    assert layer.codes.dtype == torch.uint8 and layer.codes.shape == (24, 256) and layer.format == "int4"
    scales, offsets = layer.scales, layer.offsets
    if name == "Q4_K":
        assert scales.dtype == torch.uint8 and scales.shape == (24, 2 * 512 // 32)
        assert offsets.dtype == torch.float16 and offsets.shape == (24, 2 * 512 // 256)
        assert sum(t.numel() * t.element_size() for t in (layer.codes, scales, offsets)) == 24 * 512 * 0.578125
        scales, offsets = superblock_scales(scales, offsets)
    else:
        assert scales.dtype == offsets.dtype == torch.float16 and scales.shape == (24, 512 // 32)
    codes = int4_parts(blocks, qtype, 512)[0][torch.from_numpy(order)]
    chunks = layer.codes.reshape(24, 8, 32)
    assert torch.equal(chunks & 0x0F, codes.reshape(24, 8, 2, 32)[:, :, 0])
    assert torch.equal(chunks >> 4, codes.reshape(24, 8, 2, 32)[:, :, 1])
    assert torch.equal(unpacked(layer.codes), codes)
    weight = dequantize(blocks, qtype, 512)[torch.from_numpy(order)]
    values = codes.float() * scales.float().repeat_interleave(32, dim=1) + offsets.float().repeat_interleave(32, dim=1)
    assert torch.equal(values, weight)
    monkeypatch.setattr(rungen.int8, "WIDEN_BYTES", 512 * 5 * 4)  # five channels at a time: five slices
    x = torch.randn(70, 512, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    reference = (x @ weight.double().t()).float()
    torch.testing.assert_close(layer(x.float()), reference, rtol=1e-4, atol=1e-5 * reference.abs().max().item())


@pytest.mark.parametrize("kind", ["random", "max", "min"])
@pytest.mark.parametrize("name", ["MXFP4", "IQ4_NL", "IQ4_XS"])
def test_a_weight_of_levels_for_the_triton_kernel_keeps_its_4_bit_codes_two_a_byte(name, kind, monkeypatch):
    # The 4-bit types whose codes are no affine integers, on a GPU (rungen/gguf/device.py's int4_codes_of_blocks):
    # their nibbles two a byte in the 4-bit kernel's layout and each group's scale. MXFP4 (gpt-oss's): e2m1's bits and
    # a power-of-two float16 scale, no offsets (0.5625 bytes a weight where int8 codes take 1.06); IQ4_NL and IQ4_XS:
    # indices of their 16 levels, in the table of byte pairs the kernels look them up in, and IQ4_NL's float16 scale
    # or IQ4_XS's float32 one (0.5625 and 0.625 bytes, where int8 codes take 1.06 and 1.13). Rows permuted where asked;
    # the codes' values times the scales are exactly the de-quantized weight, and the layer's product (widened a
    # slice at a time, the plain path) its product.
    import numpy as np
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    import rungen.int8
    from helpers import blocks_for
    from rungen.gguf.blocks import held
    from rungen.gguf.device import int4_codes_of_blocks
    from rungen.int4_kernel import E2M1_LEVELS, IQ4_LEVELS, e2m1_unpacked, level_pairs, table_levels, unpacked

    qtype = GGMLQuantizationType[name]
    file_blocks = blocks_for(qtype, 24, 512, kind=kind)
    order = np.random.default_rng(0).permutation(24)
    layer = int4_codes_of_blocks(torch.from_numpy(held(file_blocks.numpy(), qtype)), qtype, 512, torch.device("cpu"),
                                 order)
    scale_type = torch.float32 if name == "IQ4_XS" else torch.float16
    assert layer.codes.dtype == torch.uint8 and layer.codes.shape == (24, 256)
    assert layer.scales.dtype == scale_type and layer.scales.shape == (24, 512 // 32)
    size = {"MXFP4": 0.5625, "IQ4_NL": 0.5625, "IQ4_XS": 0.625}[name]
    assert sum(t.numel() * t.element_size() for t in (layer.codes, layer.scales)) == 24 * 512 * size
    weight = torch.from_numpy(gguf_dequantize(file_blocks.numpy(), qtype))[torch.from_numpy(order)]
    if name == "MXFP4":
        assert layer.offsets is None and layer.format == "e2m1"
        levels = e2m1_unpacked(layer.codes)
        assert torch.equal(levels, torch.tensor(E2M1_LEVELS, dtype=torch.int8)[unpacked(layer.codes).long()])
    else:  # the table: byte b's low nibble's level in its low 16 bits, the high nibble's in the high 16
        assert layer.offsets is level_pairs(IQ4_LEVELS, torch.device("cpu")) and layer.format == "int4 levels"
        pairs = layer.offsets.tolist()
        assert pairs[0x3A] == (IQ4_LEVELS[0xA] & 0xFFFF) | (IQ4_LEVELS[0x3] << 16)
        assert table_levels(layer.offsets).tolist() == list(IQ4_LEVELS)
        levels = torch.tensor(IQ4_LEVELS)[unpacked(layer.codes).long()]
    values = levels.float() * layer.scales.float().repeat_interleave(32, dim=1)
    assert torch.equal(values, weight)
    monkeypatch.setattr(rungen.int8, "WIDEN_BYTES", 512 * 5 * 4)  # five channels at a time: five slices
    x = torch.randn(70, 512, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    reference = (x @ weight.double().t()).float()
    torch.testing.assert_close(layer(x.float()), reference, rtol=1e-4, atol=1e-5 * reference.abs().max().item())


# Bytes a weight each type keeps on a GPU in its packed form (the file's: 0.69, 0.75, 0.69, 0.82, 0.43, 0.33).
PLANE_BYTES = {"Q5_0": 0.6875, "Q5_1": 0.75, "Q5_K": 0.703125, "Q6_K": 0.8203125, "Q3_K": 0.4453125, "Q2_K": 0.390625}


@pytest.mark.parametrize("kind", ["random", "max", "min"])
@pytest.mark.parametrize("name", list(PLANE_BYTES))
def test_a_5_or_6_bit_or_low_k_weight_keeps_its_codes_packed_for_the_triton_kernel(name, kind, monkeypatch):
    # The types of 5 and 6 bits and of groups of 16 on a GPU (rungen/gguf/device.py's int4_codes_of_blocks): their low
    # four bits two a byte in the 4-bit kernel's layout (Q2_K's and Q3_K's low two bits four a byte), the bits above in
    # a plane after them (packed()), Q5_0's, Q6_K's and Q3_K's codes signed (int8 bytes), and each group's scale (and
    # offset) exactly as the file has them: the K-quants' as their blocks do, each group's integer scale (and minimum)
    # and each superblock's float16 one (and minimum) (Q6_K: the file's bytes), where their int8 codes took 1.25-1.5
    # bytes a weight. Rows permuted where asked; the codes times the scales (plus offsets) are exactly the de-quantized
    # weight, the bytes hold each code's low bits and the plane its top bits where the layout says, and the layer's
    # product (widened a slice at a time, the plain path) is the weight's product.
    import numpy as np
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    import rungen.int4_kernel
    import rungen.int8
    from helpers import blocks_for
    from rungen.gguf.device import int4_codes_of_blocks
    from rungen.int4_kernel import superblock_scales, unpacked

    qtype = GGMLQuantizationType[name]
    file_blocks = blocks_for(qtype, 24, 512, kind=kind)
    order = np.random.default_rng(0).permutation(24)
    layer = int4_codes_of_blocks(file_blocks, qtype, 512, torch.device("cpu"), order)
    bits = {"Q5_0": 5, "Q5_1": 5, "Q5_K": 5, "Q6_K": 6, "Q3_K": 3, "Q2_K": 2}[name]
    signed = name in ("Q5_0", "Q6_K", "Q3_K")
    group = 16 if name in ("Q6_K", "Q3_K", "Q2_K") else 32
    assert layer.in_features == 512 and layer.codes.shape == (24, 512 * bits // 8)
    superblocks, minimums = name in ("Q6_K", "Q3_K", "Q5_K", "Q2_K"), name in ("Q5_K", "Q2_K")
    assert layer.codes.dtype == (torch.int8 if signed else torch.uint8) and (layer.offsets is None) == (name == "Q5_0")
    assert layer.format == ("signed " if signed else "") + f"int{bits}"
    assert layer.scales.shape == (24, (2 if minimums else 1) * 512 // group)
    if superblocks:  # (a group's integer scale, and minimum; a superblock's float16 one, and minimum)
        assert layer.scales.dtype == (torch.uint8 if minimums else torch.int8) and layer.offsets.dtype == torch.float16
        assert layer.offsets.shape == (24, (2 if minimums else 1) * 512 // 256)
    held_bytes = sum(t.numel() * t.element_size() for t in (layer.codes, layer.scales, layer.offsets) if t is not None)
    assert held_bytes == 24 * 512 * PLANE_BYTES[name]
    codes = unpacked(layer.codes, 512)
    # input 64c + run x p + j (run = 64 x low / 8; p < 8 / low): its low bits in byte run x c + j, at bit low x p;
    # its top bits in plane byte (run x c + j) // (8 / tops), at bit (run x c + j) % (8 / tops) x tops + high x p,
    # a byte's codes' tops side by side (tops = 8 / low x high bits)
    low = 2 if bits < 4 else 4
    per, run, high = 8 // low, 64 * low // 8, bits - low
    raw = (codes & ((1 << bits) - 1)).reshape(24, -1, per, run)
    held = layer.codes.view(torch.uint8).long()
    position = torch.arange(512 * low // 8).reshape(-1, run)  # [c, j]: the byte
    for part in range(per):
        assert torch.equal((held[:, position] >> (low * part)) & ((1 << low) - 1), raw[:, :, part] & ((1 << low) - 1))
        if high:
            tops = per * high
            plane = held[:, 512 * low // 8:]
            top = plane[:, position // (8 // tops)] >> ((position % (8 // tops)) * tops + high * part)
            assert torch.equal(top & ((1 << high) - 1), raw[:, :, part] >> low)
    weight = torch.from_numpy(gguf_dequantize(file_blocks.numpy(), qtype))[torch.from_numpy(order)]
    scales, offsets = superblock_scales(layer.scales, layer.offsets) if superblocks else (layer.scales.float(),
                                                                                          layer.offsets)
    values = codes.float() * scales.repeat_interleave(group, dim=1)
    if offsets is not None:
        values = values + offsets.float().repeat_interleave(group, dim=1)
    assert torch.equal(values, weight)
    monkeypatch.setattr(rungen.int8, "WIDEN_BYTES", 512 * 5 * 4)  # five channels at a time: five slices
    monkeypatch.setattr(rungen.int4_kernel, "SCALED_ROWS", 7)  # (the K-quants' scales: four slices)
    x = torch.randn(70, 512, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    reference = (x @ weight.double().t()).float()
    torch.testing.assert_close(layer(x.float()), reference, rtol=1e-4, atol=1e-5 * reference.abs().max().item())


@pytest.mark.parametrize("name", ["MXFP4", "IQ4_NL", "Q4_K", *PLANE_BYTES])
def test_a_packed_weights_plain_product_reads_nothing_back_and_makes_no_host_data(name):
    # The plain product of a packed GPU form (the codes widened for the GPU's own product) as a CUDA graph can hold
    # it: no operator that reads a count or a value back (repeat_interleave's count, nonzero...), no tensor made from
    # host data (a table of levels built at each call), so a captured step or a product timed in a graph runs it.
    from gguf import GGMLQuantizationType

    from helpers import HOST_DATA, HOST_READS, blocks_for, watched
    from rungen.gguf.blocks import held
    from rungen.gguf.device import int4_codes_of_blocks

    qtype = GGMLQuantizationType[name]
    blocks = torch.from_numpy(held(blocks_for(qtype, 24, 512).numpy(), qtype))
    layer = int4_codes_of_blocks(blocks, qtype, 512, torch.device("cpu"))
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(0))
    layer(x)  # (a first call may set up what later ones share: a table of levels on its device)
    run, calls = watched(layer, HOST_READS | HOST_DATA)
    run(x)
    assert calls == [[]], calls


def test_weights_of_levels_take_the_4_bit_form_on_a_gpu_and_int8_codes_where_its_kernel_fails(monkeypatch, caplog):
    # Which form a GPU load gives MXFP4, IQ4_NL and IQ4_XS, and the types of 5 and 6 bits and of groups of 16
    # (DeviceForms): the packed Triton form in any dtype wherever the inputs fill whole chunks of 64 (tinygemm has no
    # such codes), none where RUN_GENERATION_GPU_INT4=0 turns the packed forms off; where the kernel fails its check
    # on the first MXFP4 weight (and the first Q6_K one), one warning and every weight of the type in int8 codes (each
    # kind of codes checked apart: the affine 4-bit types, IQ4's and Q5_K's keep their form).
    import logging

    from gguf import GGMLQuantizationType as Q

    import rungen.gguf.device as device
    from helpers import blocks_for, plain_grouped_kernel
    from rungen.gguf.blocks import held
    from rungen.int4_kernel import CudaInt4Linear, widened4
    from rungen.int8 import CudaInt8Linear

    cuda = torch.device("cuda")  # (no GPU needed to name one)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        assert all(device.gpu_int4(qtype, 2880, dtype, cuda) == "triton" for qtype in device.TRITON_TYPES)
    assert device.gpu_int4(Q.MXFP4, 2880 + 32, torch.bfloat16, cuda) is None
    assert device.gpu_int4(Q.MXFP4, 2880, torch.bfloat16, torch.device("cpu")) is None
    monkeypatch.setenv("RUN_GENERATION_GPU_INT4", "0")
    assert device.gpu_int4(Q.MXFP4, 2880, torch.bfloat16, cuda) is None
    monkeypatch.delenv("RUN_GENERATION_GPU_INT4")
    # A load on the CPU standing in for a GPU's: the kernels plain products, the first MXFP4 check failing.
    checks = []

    def checked(layer, dtype):
        checks.append(layer.format)
        failing = layer.format in ("e2m1", "signed int6")  # (MXFP4's and Q6_K's)
        return (None, "the Triton kernel disagrees") if failing else (plain_grouped_kernel(widened4), None)

    monkeypatch.setattr(device, "gpu_int4", lambda qtype, in_features, dtype, where: (
        "triton" if qtype in (Q.MXFP4, Q.Q4_0, Q.IQ4_XS, Q.IQ4_NL, Q.Q5_K, Q.Q6_K) else None))
    monkeypatch.setattr(device, "gpu_int8", lambda qtype, where: qtype in device.INT8_TYPES)
    monkeypatch.setattr(device, "checked_int4_kernel", checked)
    monkeypatch.setattr(device, "checked_kernel", lambda layer, dtype, instead: plain_grouped_kernel())
    forms = device.DeviceForms(torch.device("cpu"), torch.bfloat16)
    mxfp4 = held(blocks_for(Q.MXFP4, 8, 128).numpy(), Q.MXFP4)
    with caplog.at_level(logging.WARNING):
        made = [forms.codes_layer(mxfp4, Q.MXFP4, 128, None, None) for _ in range(2)]
        q4_0 = forms.codes_layer(blocks_for(Q.Q4_0, 8, 128).numpy(), Q.Q4_0, 128, None, None)
        iq4 = [forms.codes_layer(held(blocks_for(qtype, 8, 256).numpy(), qtype), qtype, 256, None, None)
               for qtype in (Q.IQ4_XS, Q.IQ4_NL)]
        q5_k, q6_k = ([forms.codes_layer(blocks_for(qtype, 8, 256).numpy(), qtype, 256, None, None) for _ in range(2)]
                      for qtype in (Q.Q5_K, Q.Q6_K))
    assert all(type(layer) is CudaInt8Linear and layer.kernel is not None for layer in made + q6_k)
    assert type(q4_0) is CudaInt4Linear and q4_0.offsets is not None and q4_0.kernel is not None
    assert all(type(layer) is CudaInt4Linear and layer.format == "int4 levels" and layer.kernel for layer in iq4)
    assert all(type(layer) is CudaInt4Linear and layer.format == "int5" and layer.kernel for layer in q5_k)
    assert checks == ["e2m1", "int4", "int4 levels", "int5", "signed int6"]  # each kind of codes checked once
    for name in ("MXFP4", "Q6_K"):
        assert caplog.text.count(f"the 4-bit Triton kernel: the Triton kernel disagrees; {name} weights take int8 "
                                 "codes instead") == 1


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "Q3_K", "Q2_K"])
def test_an_embeddings_rows_de_quantize_on_any_device_as_the_gguf_package_does(name):
    # DeviceRowsEmbedding's lookup on a GPU: torch operators over the gathered rows' blocks, the same floats.
    from gguf import GGMLQuantizationType

    from helpers import blocks_for
    from rungen.gguf.blocks import dequantize
    from rungen.gguf.codes import dequantize_rows
    from rungen.gguf.device import DeviceRowsEmbedding

    qtype = GGMLQuantizationType[name]
    blocks = blocks_for(qtype, 20, 512)
    assert torch.equal(dequantize_rows(blocks, qtype, 512), dequantize(blocks, qtype, 512))
    table = DeviceRowsEmbedding(blocks, qtype, 512, torch.bfloat16, scale=2.0)
    ids = torch.tensor([[3, 3, 19], [0, 7, 1]])
    assert torch.equal(table(ids), dequantize(blocks, qtype, 512).to(torch.bfloat16)[ids] * 2.0)


def test_float16_head_is_the_product_of_the_float16_rounded_weights():
    torch.manual_seed(0)
    weight, bias, x = torch.randn(300, 64) * 0.05, torch.randn(300), torch.randn(2, 5, 64)
    # Only the weights are rounded (float32 activations and sums): the result is the float32 product
    # of the rounded weights up to summation order, far inside int8's rounding.
    want = x @ weight.half().float().t() + bias
    got = Fp16Linear(weight, bias)(x)
    assert got.shape == (2, 5, 300) and got.dtype == torch.float32
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)
    assert not torch.equal(weight.half().float(), weight)  # the rounding is real, the test is not vacuous


def test_head_is_float16_on_x86():
    # The claim README makes: every x86 build of torch has fbgemm, so x86 users get the float16 head.
    if platform.machine().lower() in ("x86_64", "amd64"):
        assert head_class() is Fp16Linear
    else:
        expected = Fp16Linear if "fbgemm" in torch.backends.quantized.supported_engines else Int8Linear
        assert head_class() is expected


def test_bias_and_leading_dimensions_are_kept():
    torch.manual_seed(0)
    linear = torch.nn.Linear(32, 16)
    x = torch.randn(2, 3, 32)
    for layer_class in (Int8Linear, Int4Linear, Fp16Linear):
        got = layer_class(linear.weight, linear.bias)(x)
        assert got.shape == (2, 3, 16) and got.dtype == torch.float32
        assert torch.allclose(got, linear(x), atol=0.1)


def test_conv1d_and_nested_layers_are_all_replaced():
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Sequential(Conv1D(16, 32)))
    model.device, model.config = torch.device("cpu"), type("Config", (), {"model_type": "toy"})()
    x = torch.randn(4, 32)
    expected = model(x)
    assert quantize_model(model, "int8") == 2
    assert isinstance(model[0], Int8Linear) and isinstance(model[1][0], Int8Linear)
    assert torch.allclose(model(x), expected, atol=0.05)


def toy(module):
    module.device, module.config = torch.device("cpu"), type("Config", (), {"model_type": "toy"})()
    return module


def test_what_quantize_refuses():
    with pytest.raises(QuantizeError, match="has no linear layers to quantize"):
        quantize_model(toy(torch.nn.Sequential(torch.nn.Embedding(10, 4))), "int8")
    with pytest.raises(QuantizeError, match="has 40 input channels, not a multiple of the group size 32; use int8"):
        quantize_model(toy(torch.nn.Sequential(torch.nn.Linear(40, 16))), "int4")


def test_int8_on_a_gpu_takes_the_gpu_layer():
    from rungen.int8 import CudaInt8Linear

    model = toy(torch.nn.Sequential(torch.nn.Linear(32, 16), torch.nn.Linear(16, 8)))
    model.device = torch.device("cuda")  # as a GPU's model says (its weights stay here)
    x = torch.randn(2, 32)
    with torch.no_grad():
        exact = model(x)
    assert quantize_model(model, "int8") == 2
    assert all(isinstance(layer, CudaInt8Linear) for layer in model)
    assert (model(x) - exact).abs().max() <= 0.02 * exact.abs().max()


def test_int4_in_half_precision_on_a_gpu_takes_the_triton_kernels_layer(monkeypatch):
    # --quantize int4 where torch's int4 kernel cannot run in half precision (float16; GPUs before Ampere run in
    # float16) or RUN_GENERATION_GPU_INT4=triton asks, the CPU standing in for the GPU and the plain product for the
    # Triton kernel: every layer keeps the CPU layer's codes two a byte with a float16 scale and least value a group
    # (0.625 bytes a weight), the kernel checked once; what neither kernel can take is refused in one line.
    from rungen import quantize
    from rungen.int4 import TinyGemmLinear, int4_groups
    from rungen.int4_kernel import CudaInt4Linear, unpacked, widened4

    monkeypatch.delenv("RUN_GENERATION_GPU_INT4", raising=False)
    monkeypatch.setattr(TinyGemmLinear, "runs_on", staticmethod(lambda in_features, dtype, device: (
        device.type == "cuda" and dtype == torch.bfloat16)))  # an Ampere GPU's
    checked = []
    monkeypatch.setattr(quantize, "checked_int4_kernel",
                        lambda layer, dtype: (checked.append(dtype), (widened4, None))[1])
    cuda = torch.device("cuda")
    assert quantize.gpu_layer_class("int4", cuda, torch.bfloat16) == (quantize.gpu_int4_linear, GROUP_SIZE)
    assert quantize.gpu_layer_class("int4", cuda, torch.float16)[1] == 64

    torch.manual_seed(0)
    model = toy(torch.nn.Sequential(torch.nn.Linear(128, 64), torch.nn.Linear(64, 16, bias=False))).half()
    model.device = cuda
    weights, bias = [layer.weight.detach().clone() for layer in model], model[0].bias.detach().float()
    x = torch.randn(3, 128, dtype=torch.float16)
    with torch.no_grad():
        assert quantize_model(model, "int4") == 2
        got = model(x)
    assert all(isinstance(layer, CudaInt4Linear) and layer.kernel is widened4 for layer in model)
    assert checked == [torch.float16] and got.dtype == torch.float16
    coded = []  # each weight as its codes say, in float32
    for layer, weight in zip(model, weights):
        codes, scales, low = int4_groups(weight)
        assert torch.equal(unpacked(layer.codes), codes.to(torch.uint8))
        assert torch.equal(layer.scales, scales.half()) and torch.equal(layer.offsets, low.half())
        held = sum(t.numel() * t.element_size() for t in (layer.codes, layer.scales, layer.offsets))
        assert held == 0.625 * weight.numel()
        groups = codes.reshape(weight.shape[0], -1, GROUP_SIZE).float()
        coded.append((groups * scales.half().float()[..., None] + low.half().float()[..., None]).reshape(weight.shape))
    exact = torch.nn.functional.linear(torch.nn.functional.linear(x.float(), coded[0], bias), coded[1])
    assert (got.float() - exact).abs().max() <= 0.01 * exact.abs().max()  # float16's rounding

    monkeypatch.setenv("RUN_GENERATION_GPU_INT4", "triton")  # asked for in bfloat16 too
    assert quantize.gpu_layer_class("int4", cuda, torch.bfloat16)[1] == 64
    wide = toy(torch.nn.Sequential(torch.nn.Linear(96, 16))).half()
    wide.device = cuda
    with pytest.raises(QuantizeError, match=r"^--quantize int4: layer \.0 has 96 input channels, not a multiple of "
                       r"64 \(the 4-bit kernel's chunk of two groups\); use int8$"):
        quantize_model(wide, "int4")
    monkeypatch.delenv("RUN_GENERATION_GPU_INT4")
    monkeypatch.setattr(quantize, "checked_int4_kernel", lambda layer, dtype: (None, "it disagrees"))
    model = toy(torch.nn.Sequential(torch.nn.Linear(64, 16))).half()
    model.device = cuda
    with pytest.raises(QuantizeError, match="^--quantize int4: the 4-bit Triton kernel on this GPU: it disagrees; "
                       "run without --quantize$"):
        quantize_model(model, "int4")
    assert isinstance(model[0], torch.nn.Linear)  # checked before any layer is replaced
    with pytest.raises(QuantizeError, match=r"^--quantize int4 on a GPU runs in bfloat16 or float16; the model is "
                       r"torch.float32: drop --dtype$"):
        quantize.gpu_layer_class("int4", cuda, torch.float32)
    monkeypatch.setenv("RUN_GENERATION_GPU_INT4", "0")
    with pytest.raises(QuantizeError, match="^--quantize int4: RUN_GENERATION_GPU_INT4=0 turns the GPU's 4-bit "
                       "kernels off; unset it, or use --quantize int8$"):
        quantize.gpu_layer_class("int4", cuda, torch.float16)


class Block(torch.nn.Module):
    """The shape of a Llama block's projections: q/k/v and gate/up read one input each."""

    def __init__(self):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = (torch.nn.Linear(64, 64), torch.nn.Linear(64, 16, bias=False),
                                                 torch.nn.Linear(64, 16))
        self.o_proj = torch.nn.Linear(64, 64)
        self.gate_proj, self.up_proj = torch.nn.Linear(64, 96, bias=False), torch.nn.Linear(64, 96, bias=False)
        self.lm_head = torch.nn.Linear(64, 80, bias=False)

    def get_output_embeddings(self):
        return self.lm_head


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_fused_siblings_give_each_projection_its_own_layers_result(mode):
    torch.manual_seed(0)
    block = toy(Block())
    layer_class = Int8Linear if mode == "int8" else Int4Linear
    alone = {name: layer_class(getattr(block, name).weight, getattr(block, name).bias)
             for name in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")}
    head_alone = head_class()(block.lm_head.weight, None)
    assert quantize_model(block, mode) == 7
    assert block.q_proj.fused is block.k_proj.fused is block.v_proj.fused
    assert block.gate_proj.fused is block.up_proj.fused is not block.q_proj.fused
    assert isinstance(block.o_proj, layer_class) and isinstance(block.lm_head, head_class())  # same head in both

    x, y = torch.randn(2, 3, 64), torch.randn(2, 3, 64)
    with torch.no_grad():
        # Any order, a part asked twice, and a sibling on another input: each gets its own layer's product.
        for name, inputs in [("v_proj", x), ("q_proj", x), ("q_proj", x), ("k_proj", y), ("k_proj", x),
                             ("up_proj", y), ("gate_proj", x), ("up_proj", x)]:
            got = getattr(block, name)(inputs)
            assert got.shape == (2, 3, alone[name].out_features)
            assert torch.equal(got, alone[name](inputs)), name
        assert torch.equal(block.lm_head(x), head_alone(x))
    assert block.gate_proj.fused._output is None  # all parts served: the step's tensors are let go


def test_gpu_int4_packs_what_the_cpu_int4_layer_packs(monkeypatch):
    # --quantize int4 on a GPU: the same codes, scales and zeros as the CPU's layer, in the packing of torch's CUDA
    # kernel (stood in for here by the CPU's, reading two codes a byte, the even one high; the GPU checks its own
    # reading before replacing any layer).
    from rungen import quantize

    def cpu_int4pack(pairs, inner):
        codes = torch.stack([(pairs >> 4).to(torch.int32), (pairs & 15).to(torch.int32)], -1)
        return torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.reshape(pairs.shape[0], -1), inner)

    monkeypatch.setattr(torch.ops.aten, "_convert_weight_to_int4pack", cpu_int4pack)
    monkeypatch.setattr(torch.ops.aten, "_weight_int4pack_mm", torch.ops.aten._weight_int4pack_mm_for_cpu)
    weight = torch.randn(40, 96, generator=torch.Generator().manual_seed(0))
    bias = torch.randn(40)
    x = torch.randn(3, 5, 96)
    gpu, cpu = quantize.gpu_int4_linear(weight, bias), quantize.Int4Linear(weight, bias)
    torch.testing.assert_close(gpu(x), cpu(x), rtol=0, atol=0)
    assert (gpu(x) - torch.nn.functional.linear(x, weight, bias)).abs().max() < 0.1 * weight.abs().max() * 96 ** 0.5
    assert isinstance(quantize.gpu_int4_linear(weight, bias, check=True), quantize.TinyGemmLinear)
    # a torch build or GPU without the kernel: refused in one line, not a traceback
    monkeypatch.setattr(torch.ops.aten, "_weight_int4pack_mm", lambda *args: (_ for _ in ()).throw(
        RuntimeError("CUDA error: no kernel image is available for execution on the device\nmore")))
    with pytest.raises(quantize.QuantizeError, match=r"^--quantize int4: torch's int4 kernel on this GPU failed "
                       r"\(CUDA error: no kernel image is available for execution on the device\); run without"):
        quantize.gpu_int4_linear(weight, bias, check=True)


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_a_weight_quantized_some_rows_at_a_time_gets_the_whole_weights_codes(monkeypatch, mode):
    # A weight is quantized QUANTIZE_ROWS output channels at a time (its float32 working copies a slice of it, not
    # several copies of a 117M-weight projection on the GPU): cut anywhere, its codes and scales are those of the
    # plain formula over the whole weight, and the float32 weight given is left as it was.
    import rungen.int4
    import rungen.int8

    weight = torch.randn(50, 64, generator=torch.Generator().manual_seed(0))
    given = weight.clone()
    if mode == "int8":
        scale = (weight.abs().amax(dim=1).clamp(min=1e-12) / 127).to(torch.bfloat16)
        plain = (torch.round(weight / scale.float()[:, None]).clamp(-128, 127).to(torch.int8), scale)
    else:
        groups = weight.reshape(50, 2, GROUP_SIZE)
        low, high = groups.amin(dim=-1, keepdim=True), groups.amax(dim=-1, keepdim=True)
        scales = ((high - low).clamp(min=1e-12) / 15).to(torch.bfloat16).float()
        codes = torch.round((groups - low) / scales).clamp(0, 15).to(torch.uint8).reshape(50, 64)
        plain = (codes, scales.squeeze(-1), low.squeeze(-1))
    quantized = rungen.int8.int8_codes if mode == "int8" else rungen.int4.int4_groups
    for rows in (4096, 7, 1):
        monkeypatch.setattr(rungen.int8, "QUANTIZE_ROWS", rows)  # both quantizers' slices (float32_rows)
        got = quantized(weight)
        assert [t.dtype for t in got] == [t.dtype for t in plain]
        assert all(torch.equal(a, b) for a, b in zip(got, plain)), rows
        assert torch.equal(weight, given)
