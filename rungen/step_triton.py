"""rungen/step_kernels.py's operators as Triton kernels: one launch each where torch's operators take 2 to 16 (the
module imports Triton: it is imported only where a GPU step asks for them)."""

import torch
import triton
import triton.language as tl


def power_of_two(value: int) -> int:
    return 1 << (value - 1).bit_length()


@triton.jit
def add_rms_norm_kernel(x, residual, weight, normed, summed, N, eps, ADD: tl.constexpr, BLOCK: tl.constexpr):
    # A row a program: summed = residual + x (rounded), normed = weight * round(summed * rsqrt(mean(summed^2)))
    row = tl.program_id(0).to(tl.int64)
    at = tl.arange(0, BLOCK)
    held = at < N
    hidden = tl.load(x + row * N + at, mask=held, other=0.0)
    if ADD:
        hidden = (tl.load(residual + row * N + at, mask=held, other=0.0).to(tl.float32)
                  + hidden.to(tl.float32)).to(summed.dtype.element_ty)
        tl.store(summed + row * N + at, hidden, mask=held)
    hidden = hidden.to(tl.float32)
    scale = tl.rsqrt(tl.sum(hidden * hidden, axis=0) / N + eps)
    normed_value = (hidden * scale).to(normed.dtype.element_ty).to(tl.float32)
    out = tl.load(weight + at, mask=held, other=0.0).to(tl.float32) * normed_value
    tl.store(normed + row * N + at, out.to(normed.dtype.element_ty), mask=held)


@triton.jit
def rotated_head(source, cos, sin, row, norm, eps, SIZE: tl.constexpr, WIDTH: tl.constexpr, NORM: tl.constexpr,
                 BLOCK: tl.constexpr, OUT_DTYPE: tl.constexpr):
    # One head [SIZE] at `source`: normed (NORM: weight * round(x * rsqrt(mean(x^2)))), then its first WIDTH
    # rotated by halves (round(x * cos) + round(rotate_half(x) * sin)), the rest passed through.
    at = tl.arange(0, BLOCK)
    held = at < SIZE
    half = WIDTH // 2
    partner = tl.where(at < half, at + half, at - half)
    turned = at < WIDTH
    x = tl.load(source + at, mask=held, other=0.0).to(tl.float32)
    other = tl.load(source + partner, mask=turned, other=0.0).to(tl.float32)
    if NORM:
        scale = tl.rsqrt(tl.sum(x * x, axis=0) / SIZE + eps)
        x = (tl.load(norm + at, mask=held, other=0.0).to(tl.float32)
             * (x * scale).to(OUT_DTYPE).to(tl.float32)).to(OUT_DTYPE).to(tl.float32)
        other = (tl.load(norm + partner, mask=turned, other=0.0).to(tl.float32)
                 * (other * scale).to(OUT_DTYPE).to(tl.float32)).to(OUT_DTYPE).to(tl.float32)
    c = tl.load(cos + row * WIDTH + at, mask=turned, other=1.0).to(tl.float32)
    s = tl.load(sin + row * WIDTH + at, mask=turned, other=0.0).to(tl.float32)
    other = tl.where(at < half, -other, other)
    rotated = ((x * c).to(OUT_DTYPE).to(tl.float32) + (other * s).to(OUT_DTYPE).to(tl.float32)).to(OUT_DTYPE)
    return tl.where(turned, rotated, x.to(OUT_DTYPE)), at, held


@triton.jit
def rotary_kernel(q, k, v, q_stride, k_stride, v_stride, cos, sin, q_norm, k_norm, eps, keys, values, positions,
                  query_out, slot_stride, head_stride, position_stride, HEADS: tl.constexpr,
                  SIZE: tl.constexpr, WIDTH: tl.constexpr, NORM: tl.constexpr, BLOCK: tl.constexpr):
    # Program (row, head): a query head rotated into query_out [rows, HEADS, SIZE], or (past HEADS) a key head
    # rotated and its value, written at the row's position of its slot.
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    if head < HEADS:
        out, at, held = rotated_head(q + row * q_stride + head * SIZE, cos, sin, row, q_norm, eps, SIZE, WIDTH,
                                     NORM, BLOCK, query_out.dtype.element_ty)
        tl.store(query_out + (row * HEADS + head) * SIZE + at, out, mask=held)
    else:
        head -= HEADS
        out, at, held = rotated_head(k + row * k_stride + head * SIZE, cos, sin, row, k_norm, eps, SIZE, WIDTH,
                                     NORM, BLOCK, keys.dtype.element_ty)
        where = row * slot_stride + head * head_stride + tl.load(positions + row).to(tl.int64) * position_stride
        tl.store(keys + where + at, out, mask=held)
        value = tl.load(v + row * v_stride + head * SIZE + at, mask=held, other=0.0)
        tl.store(values + where + at, value.to(values.dtype.element_ty), mask=held)


@triton.jit
def silu_mul_kernel(gate, up, out, N, gate_stride, up_stride, BLOCK: tl.constexpr):
    # out = round(silu(gate)) * up, rounded: a row's BLOCK columns a program
    row = tl.program_id(0).to(tl.int64)
    at = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    held = at < N
    g = tl.load(gate + row * gate_stride + at, mask=held, other=0.0).to(tl.float32)
    u = tl.load(up + row * up_stride + at, mask=held, other=0.0).to(tl.float32)
    activated = (g / (1.0 + tl.exp(-g))).to(out.dtype.element_ty).to(tl.float32)
    tl.store(out + row * N + at, (activated * u).to(out.dtype.element_ty), mask=held)


def add_rms_norm(x, residual, weight, eps):
    rows, width = x.shape
    normed = torch.empty_like(x)
    summed = x if residual is None else torch.empty_like(x)
    add_rms_norm_kernel[(rows,)](x, x if residual is None else residual, weight, normed, summed, width, eps,
                                 ADD=residual is not None, BLOCK=power_of_two(width),
                                 num_warps=min(16, max(1, width // 512)))
    return normed, summed


def rotary_into_slots(q, k, v, cos, sin, keys, values, positions, q_norm=None, k_norm=None, eps=0.0):
    rows, size = q.shape[0], keys.shape[-1]
    heads, kv_heads = q.shape[1] // size, k.shape[1] // size
    query_out = torch.empty((rows, heads, size), dtype=q.dtype, device=q.device)
    cos, sin = cos.reshape(rows, -1).contiguous(), sin.reshape(rows, -1).contiguous()
    rotary_kernel[(rows, heads + kv_heads)](
        q, k, v, q.stride(0), k.stride(0), v.stride(0), cos, sin, q_norm if q_norm is not None else cos,
        k_norm if k_norm is not None else cos, eps, keys, values, positions, query_out, keys.stride(0),
        keys.stride(1), keys.stride(2), HEADS=heads, SIZE=size, WIDTH=cos.shape[-1], NORM=q_norm is not None,
        BLOCK=power_of_two(size))
    return query_out


def silu_mul(gate, up):
    rows, width = gate.shape
    out = torch.empty((rows, width), dtype=gate.dtype, device=gate.device)
    block = min(1024, power_of_two(width))
    silu_mul_kernel[(rows, triton.cdiv(width, block))](gate, up, out, width, gate.stride(0), up.stride(0),
                                                       BLOCK=block)
    return out
