"""4-bit weights in groups of 32 for torch's int4 kernels, the CPU's (Int4Linear) and CUDA's tinygemm
(TinyGemmLinear), from float weights (--quantize int4) or a GGUF file's 4-bit blocks; both kernels compute
(code - 8) * scale + zero."""

from __future__ import annotations

import os

import torch

from .int8 import float32_rows

GROUP_SIZE = 32  # input channels sharing one scale and zero (GGUF's Q4_0/Q4_1 blocks are 32 too)
INNER_K_TILES = 8  # the CPU packing's layout; the kernel accepts 2, 4 or 8
# 4-bit codes on a GPU (a GGUF file's, --quantize int4's): "0" none, "triton" rungen/int4_kernel.py's form, else
# tinygemm's where it runs (int4_kernel.py's gpu_int4_form)
GPU_INT4_ENV = "RUN_GENERATION_GPU_INT4"


def int4_groups(weight):
    """A float weight [out, in] as 4-bit codes [out, in] (uint8, 0..15) and per group of GROUP_SIZE inputs a scale
    (rounded to bfloat16, as the kernels use it) and the group's least value: weight ~ scale * code + least."""
    rows, columns = weight.shape
    codes = torch.empty(rows, columns, dtype=torch.uint8, device=weight.device)
    scales = torch.empty(rows, columns // GROUP_SIZE, device=weight.device)
    low = torch.empty_like(scales)
    for part, float_rows in float32_rows(weight):
        groups = float_rows.reshape(-1, columns // GROUP_SIZE, GROUP_SIZE)
        least, most = groups.amin(dim=-1, keepdim=True), groups.amax(dim=-1, keepdim=True)
        scale = ((most - least).clamp(min=1e-12) / 15).to(torch.bfloat16).float()
        codes[part] = groups.sub_(least).div_(scale).round_().clamp_(0, 15).reshape(-1, columns)
        scales[part], low[part] = scale.squeeze(-1), least.squeeze(-1)
    return codes, scales, low


class Int4Linear(torch.nn.Module):
    def __init__(self, weight, bias):
        super().__init__()
        out_features, in_features = weight.shape
        # The packing wants output channels in multiples of 16: pad with zero rows, cut them off the output.
        padded = -out_features % 16
        codes, scales, low = (torch.nn.functional.pad(t, (0, 0, 0, padded)) for t in int4_groups(weight))
        zeros = low + 8 * scales  # zero is the value of code 8
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32),
                                                                                           INNER_K_TILES))
        scales_and_zeros = torch.stack([scales, zeros], dim=-1).transpose(0, 1)
        self.register_buffer("scales_and_zeros", scales_and_zeros.contiguous().to(torch.bfloat16))
        self.bias = bias
        self.out_features, self.in_features = out_features, in_features

    def forward(self, x):
        flat = x.reshape(-1, self.in_features).to(torch.bfloat16)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.packed, GROUP_SIZE, self.scales_and_zeros)
        if y.shape[1] != self.out_features:
            y = y[:, : self.out_features]
        y = y.reshape(x.shape[:-1] + (self.out_features,)).to(x.dtype)
        return y if self.bias is None else y + self.bias


class TinyGemmLinear(torch.nn.Module):
    """y = x @ W.T (+ bias) on a CUDA GPU by tinygemm, W = scale * code + offset given as 4-bit codes [out, in] and
    per group of 32 inputs a scale and an offset; activations in bfloat16."""

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, device: torch.device):
        super().__init__()
        rows, self.in_features = codes.shape
        self.out_features = rows
        padded = -rows % 16  # output channels in multiples of 16 (cut off the output)
        if padded:
            codes, scale, offset = (torch.nn.functional.pad(t, (0, 0, 0, padded)) for t in (codes, scale, offset))
        inner = next(tiles for tiles in (8, 4, 2) if self.in_features % (16 * tiles) == 0)
        pairs = codes[:, ::2].to(torch.uint8) << 4 | codes[:, 1::2].to(torch.uint8)
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack(pairs.to(device), inner))
        scales_and_zeros = torch.stack([scale, offset + 8 * scale], dim=-1).transpose(0, 1)
        self.register_buffer("scales_and_zeros", scales_and_zeros.contiguous().to(device, torch.bfloat16))
        self.bias = None

    @staticmethod
    def runs_on(in_features: int, dtype: torch.dtype, device: torch.device) -> bool:
        """Whether such a layer runs on `device` for a model in `dtype` (CUDA, Ampere on, bfloat16, whole groups)."""
        return (device.type == "cuda" and dtype == torch.bfloat16 and in_features % GROUP_SIZE == 0
                and os.environ.get(GPU_INT4_ENV, "1") != "0" and torch.cuda.get_device_capability(device) >= (8, 0))

    @classmethod
    def concatenated(cls, layers: list[TinyGemmLinear]) -> TinyGemmLinear | None:
        """One layer whose output is the layers' side by side (a fused step's q/k/v or gate/up: one launch), its
        packed codes and scales those the layers now read (their codes are rows of the one buffer; their scales a
        slice of its channels, made contiguous as a layer runs: prompts' passes); None where their inputs differ or
        a layer's channels were padded (its rows would sit inside the one buffer's)."""
        first = layers[0]
        if len({(layer.in_features, layer.packed.shape[1:]) for layer in layers}) > 1 or any(
                layer.bias is not None or layer.out_features != layer.scales_and_zeros.shape[1] for layer in layers):
            return None
        one = object.__new__(cls)
        torch.nn.Module.__init__(one)
        one.in_features, one.bias = first.in_features, None
        one.out_features = sum(layer.out_features for layer in layers)
        one.register_buffer("packed", torch.cat([layer.packed for layer in layers]))  # (rows of 8 channels first)
        one.register_buffer("scales_and_zeros", torch.cat([layer.scales_and_zeros for layer in layers], dim=1))
        rows, start = one.packed.shape[0], 0  # packed rows: a channel each (the CPU's layout), 8 channels (CUDA's)
        for layer in layers:
            end = start + layer.out_features
            layer.packed = one.packed[start * rows // one.out_features : end * rows // one.out_features]
            layer.scales_and_zeros = one.scales_and_zeros[:, start:end]
            start = end
        return one

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(torch.bfloat16).contiguous()  # the kernel reads rows whole
        scales = self.scales_and_zeros.contiguous()  # (a layer concatenated into another reads a slice of its scales)
        y = torch.ops.aten._weight_int4pack_mm(flat, self.packed, GROUP_SIZE, scales)
        y = y[:, : self.out_features]
        y = y.reshape(x.shape[:-1] + (self.out_features,)).to(x.dtype)
        return y if self.bias is None else y + self.bias


def checked_tinygemm(make, weight: torch.Tensor) -> tuple[TinyGemmLinear | None, str | None]:
    """(the layer make() builds, None) where torch's int4 kernel multiplies it as the de-quantized `weight` does;
    else (None, why): the first layer's check of the packing and of the kernel itself (a build or GPU without it
    raises)."""
    try:
        layer = make()
        agrees = tinygemm_agrees(layer, weight)
    except torch.OutOfMemoryError:  # the model does not fit, whatever the kernel: the user must hear that
        raise
    except RuntimeError as error:
        return None, f"failed ({(str(error).splitlines() or [type(error).__name__])[0][:200]})"
    return (layer, None) if agrees else (None, "disagrees with the de-quantized weights")


def tinygemm_agrees(layer: TinyGemmLinear, weight: torch.Tensor) -> bool:
    """Whether `layer` multiplies as the de-quantized `weight` [out, in] does, to bfloat16 rounding: a GPU run's
    one check of the packing before trusting it."""
    x = torch.randn(4, layer.in_features, dtype=torch.bfloat16, device=weight.device,
                    generator=torch.Generator(weight.device).manual_seed(0))
    reference = (x.float() @ weight.float().T)
    error = (layer(x).float() - reference).abs().max()
    return bool(error <= 0.02 * reference.abs().max())
