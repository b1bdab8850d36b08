"""rungen/step_kernels.py's operators as Triton kernels: one launch each where torch's operators take 2 to 16, and
attention split over a long slot's positions (the module imports Triton: it is imported only where a GPU step asks
for them)."""

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
                                 ADD=residual is not None, BLOCK=power_of_two(width), num_warps=norm_warps(width))
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


@triton.jit
def decode_attention_kernel(query, keys, values, positions, out, partial, lse, scale, slot_stride, head_stride,
                            position_stride, HEADS: tl.constexpr, GROUP: tl.constexpr, SIZE: tl.constexpr,
                            CHUNK: tl.constexpr, SPLITS: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
                            BLOCK_N: tl.constexpr):
    # Program (row, key/value head, split): that head's GROUP query heads over the split's CHUNK positions up to the
    # row's own (flash decoding: a long slot read by many programs), keys and values read once for the group; an
    # online softmax in float32. One split writes the output; several write their part and its log-sum-exp.
    row = tl.program_id(0).to(tl.int64)
    kv = tl.program_id(1)
    split = tl.program_id(2)
    end = tl.minimum(split * CHUNK + CHUNK, tl.load(positions + row).to(tl.int32) + 1)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    heads = kv * GROUP + g
    wanted = (g[:, None] < GROUP) & (d[None, :] < SIZE)
    q = tl.load(query + (row * HEADS + heads[:, None]) * SIZE + d[None, :], mask=wanted, other=0.0)
    base = row * slot_stride + kv * head_stride
    top = tl.full([BLOCK_G], -float("inf"), tl.float32)
    total = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for start in range(split * CHUNK, end, BLOCK_N):
        at = start + tl.arange(0, BLOCK_N)
        held = (at[:, None] < end) & (d[None, :] < SIZE)
        k = tl.load(keys + base + at[:, None] * position_stride + d[None, :], mask=held, other=0.0)
        scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        scores = tl.where(at[None, :] < end, scores, -float("inf"))
        new_top = tl.maximum(top, tl.max(scores, 1))
        p = tl.exp(scores - new_top[:, None])
        shrink = tl.exp(top - new_top)
        total = total * shrink + tl.sum(p, 1)
        v = tl.load(values + base + at[:, None] * position_stride + d[None, :], mask=held, other=0.0)
        acc = acc * shrink[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        top = new_top
    seen = total > 0  # (a split past the row's position saw nothing)
    total = tl.where(seen, total, 1.0)
    mean = acc / total[:, None]
    if SPLITS == 1:
        tl.store(out + (row * HEADS + heads[:, None]) * SIZE + d[None, :], mean.to(out.dtype.element_ty), mask=wanted)
    else:
        tl.store(partial + ((row * HEADS + heads[:, None]) * SPLITS + split) * SIZE + d[None, :], mean, mask=wanted)
        tl.store(lse + (row * HEADS + heads) * SPLITS + split, tl.where(seen, top + tl.log(total), -float("inf")),
                 mask=g < GROUP)


@triton.jit
def combine_kernel(partial, lse, out, SPLITS: tl.constexpr, SIZE: tl.constexpr, BLOCK_S: tl.constexpr,
                   BLOCK_D: tl.constexpr):
    # Program (row, query head): the splits' parts weighted by their share of the softmax's sum
    at = tl.program_id(0).to(tl.int64)  # row * HEADS + head
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    sums = tl.load(lse + at * SPLITS + s, mask=s < SPLITS, other=-float("inf"))
    weights = tl.exp(sums - tl.max(sums, 0))
    parts = tl.load(partial + (at * SPLITS + s[:, None]) * SIZE + d[None, :],
                    mask=(s[:, None] < SPLITS) & (d[None, :] < SIZE), other=0.0)
    mean = tl.sum(parts * weights[:, None], 0) / tl.sum(weights, 0)
    tl.store(out + at * SIZE + d, mean.to(out.dtype.element_ty), mask=d < SIZE)


SPLIT_POSITIONS = 256  # positions a program of decode_attention reads at most (the slots' length bucket)


def attention_blocks(size: int) -> tuple[int, int, int]:
    """decode_attention_kernel's (BLOCK_D, BLOCK_N, warps) for heads of `size`: none spills a register on sm_90 in
    bfloat16, float16 or float32 for heads of 64 to 256 (python -m benchmarks.int8_kernel_resources; 64 positions a
    loop step with 4 warps spilled 300-400 bytes a thread at heads of 128)."""
    block_d = max(16, power_of_two(size))
    return (block_d, 32, 8) if block_d <= 128 else (block_d, 16, 4)


def norm_warps(width: int) -> int:
    return min(16, max(1, width // 512))


def decode_attention(query, keys, values, positions, length, mask, scale):
    rows, heads, size = query.shape
    kv_heads = keys.shape[1]
    group, splits = heads // kv_heads, max(1, triton.cdiv(length, SPLIT_POSITIONS))
    out = torch.empty_like(query)
    partial = lse = out
    if splits > 1:
        partial = torch.empty((rows, heads, splits, size), dtype=torch.float32, device=query.device)
        lse = torch.empty((rows, heads, splits), dtype=torch.float32, device=query.device)
    block_d, block_n, warps = attention_blocks(size)
    decode_attention_kernel[(rows, kv_heads, splits)](
        query, keys, values, positions, out, partial, lse, scale, keys.stride(0), keys.stride(1), keys.stride(2),
        HEADS=heads, GROUP=group, SIZE=size, CHUNK=SPLIT_POSITIONS, SPLITS=splits,
        BLOCK_G=max(16, power_of_two(group)), BLOCK_D=block_d, BLOCK_N=block_n, num_warps=warps)
    if splits > 1:
        combine_kernel[(rows * heads,)](partial, lse, out, SPLITS=splits, SIZE=size,
                                        BLOCK_S=max(2, power_of_two(splits)), BLOCK_D=block_d)
    return out
