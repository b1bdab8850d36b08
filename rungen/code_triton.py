"""The Triton kernels over packed codes (rungen/int4_kernel.py's forms: 2 to 6 bits, MXFP4's e2m1, tables of levels)
and the widening kernel (rungen/int8.py's), with the pieces they share as jit functions of their own: an expert's
stacks, a group's scale, a code's bits. The module imports Triton: int4_kernel.triton_kernel and int8.widen_kernel
import it only where Triton is. (Module-level jit functions, not a closure's: Triton's interpreter resolves these.)
"""

import triton
import triton.language as tl


@triton.jit
def expert_start(codes, scales, offsets, expert, N, K, LEVELS: tl.constexpr, LOW: tl.constexpr, HIGH: tl.constexpr,
                 GROUP: tl.constexpr):
    """codes, scales and offsets moved to `expert`'s in stacks [experts, N, ...] (LEVELS as int4_matmul's)."""
    codes += expert * N * (K * (LOW + HIGH) // 8)
    if LEVELS == 5:  # (a group's scale and minimum, a superblock's two)
        scales += expert * N * (K // GROUP) * 2
        offsets += expert * N * (K // 256) * 2
    else:
        scales += expert * N * (K // GROUP)
    if LEVELS == 0:
        offsets += expert * N * (K // GROUP)
    if LEVELS == 4:
        offsets += expert * N * (K // 256)
    return codes, scales, offsets


@triton.jit
def group_scale(scales, offsets, channels, groups, held, K, LEVELS: tl.constexpr, GROUP: tl.constexpr):
    """(scale, shift) of each (channel, group) of the broadcast `channels` and `groups`: a weight is code x scale +
    shift. LEVELS as int4_matmul's: 5, the group's integer scale and minimum times its superblock's float16 ones
    (shift: minus the minimum); 4, the group's int8 scale times its superblock's float16 one; 0, the offset; else
    none."""
    where = channels * (K // GROUP) + groups
    shift = tl.zeros(where.shape, dtype=tl.float32)
    if LEVELS == 5:
        duo = 2 * where  # (the group's scale, then its minimum)
        whole = channels * (K // 256) * 2 + (groups // (256 // GROUP)) * 2
        scale = tl.load(scales + duo, mask=held, other=0).to(tl.float32) * \
            tl.load(offsets + whole, mask=held, other=0.0).to(tl.float32)
        shift -= tl.load(scales + duo + 1, mask=held, other=0).to(tl.float32) * \
            tl.load(offsets + whole + 1, mask=held, other=0.0).to(tl.float32)
    else:
        scale = tl.load(scales + where, mask=held, other=0.0).to(tl.float32)
    if LEVELS == 4:
        scale *= tl.load(offsets + channels * (K // 256) + groups // (256 // GROUP), mask=held,
                         other=0.0).to(tl.float32)
    if LEVELS == 0:
        shift += tl.load(offsets + where, mask=held, other=0.0).to(tl.float32)
    return scale, shift


@triton.jit
def plane_bits(codes, row_at, byte_at, held, lows, WIDE: tl.constexpr):
    """The top bits of the codes in bytes `byte_at` of a row starting at `row_at`, from the row's plane after its
    `lows` bytes, where a byte's codes' tops lie side by side (WIDE bits: codes a byte x their bits above LOW),
    shifted down to the byte's."""
    tops = tl.load(codes + row_at + lows + byte_at // (8 // WIDE), mask=held, other=0).to(tl.int32) & 0xFF
    return tops >> ((byte_at % (8 // WIDE)) * WIDE)


@triton.jit
def code_bits(b, tops, part, LOW: tl.constexpr, HIGH: tl.constexpr, SIGNED: tl.constexpr):
    """Part `part` of bytes `b`'s codes (its LOW bits) joined to its HIGH bits in `tops` (plane_bits), as an int32:
    two's complement of LOW + HIGH bits where SIGNED."""
    code = ((b >> (LOW * part)) & ((1 << LOW) - 1)).to(tl.int32)
    if HIGH:
        code = code | (((tops >> (HIGH * part)) & ((1 << HIGH) - 1)) << LOW)
    if SIGNED:
        code = (code << (32 - LOW - HIGH)) >> (32 - LOW - HIGH)
    return code


@triton.jit
def code_values(b, tops, levels, part, LOW: tl.constexpr, HIGH: tl.constexpr, LEVELS: tl.constexpr):
    """Part `part`'s codes of bytes `b` as float32 values for their group's scale (LEVELS as int4_matmul's): e2m1's
    doubled value (1), the level a table gives (2: `levels`, each byte's two, the low nibble's in the low half), else
    the integer (code_bits, with its `tops`; signed for 3 and 4)."""
    if LEVELS == 1:  # e2m1's value x 2^-14, times 2^15: exact
        w = e2m1((b >> (LOW * part)) & ((1 << LOW) - 1)) * 32768.0
    elif LEVELS == 2:
        if part == 0:
            w = ((levels << 16) >> 16).to(tl.float32)
        else:
            w = (levels >> 16).to(tl.float32)
    else:
        w = code_bits(b, tops, part, LOW, HIGH, LEVELS == 3 or LEVELS == 4).to(tl.float32)
    return w


@triton.jit
def e2m1(nibbles):
    """e2m1's value x 2^-14 of each nibble's bits: shifted into a float16's sign, exponent and mantissa."""
    bits = nibbles.to(tl.uint16)
    bits = (((bits & 8) << 12) | ((bits & 7) << 9)).to(tl.uint16)  # (16 bits whatever Triton promotes)
    return bits.to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit(do_not_specialize=["M", "M_BUCKET"])  # one compilation for every decode batch
def int4_matmul(x, codes, scales, offsets, y, tiles, sources, M, N, K, M_BUCKET, LEVELS: tl.constexpr,
                LOW: tl.constexpr, HIGH: tl.constexpr, GROUP: tl.constexpr, GROUPED: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # y[m, n] = sum_k x[m, k] * (code[n, k] * scales[n, k // GROUP] + offsets[n, k // GROUP]), BLOCK_K inputs
    # (whole chunks of 64) at a time: the bytes' low nibbles hold each chunk's first 32 inputs and the high ones
    # its second (LOW 2: their four 2-bit parts its four runs of 16), so each is a product over whole groups.
    # LEVELS (levels_of): 1, each code e2m1's bits (MXFP4's); 2, each byte's two levels looked up in offsets
    # (level_pairs); 3, signed codes, no offsets; 4, signed codes, the group's int8 scale times its superblock's
    # float16 one (offsets [N, K / 256]); 5, a group's integer scale and minimum side by side (uint8 scales [N, 2K
    # / GROUP]) times its superblock's float16 two (offsets [N, 2K / 256]): code x scale - minimum. HIGH: each
    # code's bits above its LOW ones, in the row's plane after them (packed()). Grid, rows and GROUPED as
    # rungen/int8.py's kernel's.
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    if GROUPED:
        expert = tl.load(tiles + tl.program_id(0)).to(tl.int64)
        if expert < 0:
            return
        codes, scales, offsets = expert_start(codes, scales, offsets, expert, N, K, LEVELS, LOW, HIGH, GROUP)
        reads = tl.load(sources + rows).to(tl.int64)
        held_rows = reads >= 0
    else:
        reads, held_rows = rows, rows < M
    channels = (tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    # per: codes a byte; run: the inputs of a chunk one part of its bytes holds; split: groups in a run
    per: tl.constexpr = 8 // LOW  # (annotated: else the compiler takes it for a runtime value)
    run: tl.constexpr = 8 * LOW
    lows = K * LOW // 8  # the row's bytes before its plane
    row_bytes, split = K * (LOW + HIGH) // 8, 8 * LOW // GROUP
    part_bytes = tl.arange(0, BLOCK_K // per)
    low_inputs = (part_bytes // run) * 64 + part_bytes % run  # a tile's inputs in its bytes' lowest bits
    sub = tl.arange(0, BLOCK_K // (per * GROUP))  # the groups of a chunk's run in the tile: chunk, then group
    total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for start in range(0, K, BLOCK_K):
        low_at = start + low_inputs
        held_x = held_rows[:, None] & (low_at[None, :] < K)
        byte_at = start * LOW // 8 + part_bytes
        held_b = (channels[None, :] < N) & (byte_at[:, None] < lows)
        b = tl.load(codes + channels[None, :] * row_bytes + byte_at[:, None], mask=held_b, other=0)
        tops = b  # (read where HIGH)
        levels = b  # (read where LEVELS 2)
        if HIGH:
            tops = plane_bits(codes, channels[None, :] * row_bytes, byte_at[:, None], held_b, lows, per * HIGH)
        if LEVELS == 2:  # both nibbles' levels at once (a byte past the weight: 0's, times a scale of 0)
            levels = tl.load(offsets + b.to(tl.int32))
        for part in tl.static_range(per):  # the low nibbles (a chunk's first 32 inputs), the high ones (LOW 4)
            a = tl.load(x + reads[:, None] * K + run * part + low_at[None, :], mask=held_x, other=0.0)
            # each group's one scale and shift spread over its codes in registers
            group = start // GROUP + (sub // split) * per * split + part * split + sub % split
            held = (channels[None, :] < N) & (group[:, None] < K // GROUP)
            scale, shift = group_scale(scales, offsets, channels[None, :], group[:, None], held, K, LEVELS, GROUP)
            w = code_values(b, tops, levels, part, LOW, HIGH, LEVELS)
            w = tl.reshape(w, (BLOCK_K // (per * GROUP), GROUP, BLOCK_N)) * scale[:, None, :]
            if LEVELS == 0 or LEVELS == 5:
                w += shift[:, None, :]
            total += tl.dot(a, tl.reshape(w, (BLOCK_K // per, BLOCK_N)).to(a.dtype), input_precision="ieee")
    tl.store(y + rows[:, None] * N + channels[None, :], total.to(y.dtype.element_ty),
             mask=held_rows[:, None] & (channels[None, :] < N))


@triton.jit(do_not_specialize=["M"])
def int4_gemv(x, codes, scales, offsets, y, pairs, M, N, K, LEVELS: tl.constexpr, LOW: tl.constexpr,
              HIGH: tl.constexpr, GROUP: tl.constexpr, ROWS: tl.constexpr, GROUPED: tl.constexpr,
              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # y[m, n] for a decode step's few rows (M <= ROWS) without the tensor cores, whose tiles of 16 rows a row
    # would waste: BLOCK_N output channels a program over all K inputs, BLOCK_K (whole chunks) at a time, each
    # nibble's codes widened with their group's scale and offset in registers and multiplied into every row.
    # GROUPED: a mixture's experts stacked [experts, N, ...]; program_id(1) a pair p (pairs[p]: its expert and
    # its row of x), y[p] = x[row] times that expert's weight. LEVELS, LOW, HIGH, GROUP as int4_matmul's.
    if GROUPED:
        pair = tl.program_id(1)
        expert = tl.load(pairs + 2 * pair).to(tl.int64)
        codes, scales, offsets = expert_start(codes, scales, offsets, expert, N, K, LEVELS, LOW, HIGH, GROUP)
        x += tl.load(pairs + 2 * pair + 1).to(tl.int64) * K
        y += pair * N
    channels = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    per: tl.constexpr = 8 // LOW  # as int4_matmul's
    run: tl.constexpr = 8 * LOW
    lows = K * LOW // 8
    row_bytes, split = K * (LOW + HIGH) // 8, 8 * LOW // GROUP
    rows = tl.arange(0, ROWS)
    part_bytes = tl.arange(0, BLOCK_K // per)
    low_inputs = (part_bytes // run) * 64 + part_bytes % run
    sub = tl.arange(0, BLOCK_K // (per * GROUP))
    total = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
    for start in range(0, K, BLOCK_K):
        byte_at = start * LOW // 8 + part_bytes
        held_b = (channels[:, None] < N) & (byte_at[None, :] < lows)
        b = tl.load(codes + channels[:, None] * row_bytes + byte_at[None, :], mask=held_b, other=0)
        tops = b  # as int4_matmul's
        levels = b
        if HIGH:
            tops = plane_bits(codes, channels[:, None] * row_bytes, byte_at[None, :], held_b, lows, per * HIGH)
        if LEVELS == 2:
            levels = tl.load(offsets + b.to(tl.int32))
        for part in tl.static_range(per):  # the low nibbles (a chunk's first 32 inputs), the high ones (LOW 4)
            group = start // GROUP + (sub // split) * per * split + part * split + sub % split
            held = (channels[:, None] < N) & (group[None, :] < K // GROUP)
            scale, shift = group_scale(scales, offsets, channels[:, None], group[None, :], held, K, LEVELS, GROUP)
            w = code_values(b, tops, levels, part, LOW, HIGH, LEVELS)
            w = tl.reshape(w, (BLOCK_N, BLOCK_K // (per * GROUP), GROUP)) * scale[:, :, None]
            if LEVELS == 0 or LEVELS == 5:
                w += shift[:, :, None]
            w = tl.reshape(w, (BLOCK_N, BLOCK_K // per))
            at = start + run * part + low_inputs
            a = tl.load(x + rows[:, None] * K + at[None, :], mask=(rows[:, None] < M) & (at[None, :] < K),
                        other=0.0).to(tl.float32)
            total += tl.sum(a[:, None, :] * w[None, :, :], axis=2)
    tl.store(y + rows[:, None] * N + channels[None, :], total.to(y.dtype.element_ty),
             mask=(rows[:, None] < M) & (channels[None, :] < N))


@triton.jit
def widen(codes, scales, offsets, table, out, K, GROUP: tl.constexpr, OFFSET: tl.constexpr, CHUNK: tl.constexpr,
          TABLE: tl.constexpr, LOW: tl.constexpr, HIGH: tl.constexpr, SIGNED: tl.constexpr, BLOCK: tl.constexpr):
    # out[n, k] = codes[n, k] * scale (+ offset), in float32: scales[n] (GROUP 0) or scales[n, k // GROUP]. CHUNK:
    # code k's LOW bits in byte (k // CHUNK) * run + k % run of the row (run = CHUNK * LOW / 8), a chunk's first
    # run the byte's lowest, its HIGH bits above in the row's plane after them (int4_kernel.py's packed()); SIGNED:
    # two's complement; neither OFFSET nor SIGNED: e2m1's bits, for their doubled value (as the kernels above read
    # them)
    row = tl.program_id(0).to(tl.int64)
    at = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    held = at < K
    if CHUNK:
        row_bytes, run = K * (LOW + HIGH) // 8, CHUNK * LOW // 8
        byte_at = (at // CHUNK) * run + at % run
        byte = tl.load(codes + row * row_bytes + byte_at, mask=held, other=0)
        upper = (at % CHUNK) // run  # the code's part of the byte (LOW 4: 1, its high nibble)
        if TABLE:  # the byte's two levels, the low nibble's in the low half
            pair = tl.load(table + byte.to(tl.int32), mask=held, other=0)
            weight = ((pair << (16 - 16 * upper)) >> 16).to(tl.float32)
        elif OFFSET or SIGNED:
            tops = byte  # (read where HIGH)
            if HIGH:
                tops = plane_bits(codes, row * row_bytes, byte_at, held, K * LOW // 8, 8 // LOW * HIGH)
            weight = code_bits(byte, tops, upper, LOW, HIGH, SIGNED).to(tl.float32)
        else:  # e2m1's value x 2^-14, times 2^15
            weight = e2m1((byte >> (LOW * upper)) & ((1 << LOW) - 1)) * 32768.0
    else:
        weight = tl.load(codes + row * K + at, mask=held, other=0).to(tl.float32)
    if GROUP:
        where = row * (K // GROUP) + at // GROUP
        weight = weight * tl.load(scales + where, mask=held, other=0.0).to(tl.float32)
        if OFFSET:
            weight += tl.load(offsets + where, mask=held, other=0.0).to(tl.float32)
    else:
        weight = weight * tl.load(scales + row).to(tl.float32)
    tl.store(out + row * K + at, weight.to(out.dtype.element_ty), mask=held)
