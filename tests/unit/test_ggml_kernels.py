"""Fast tier: the GGUF block kernels (torch.ops.rungen_ggml) compute x @ dequantize(blocks).T within the
error of quantizing the activations to 8 bits per block of 32, for every type, instruction set and
awkward shape; and torch's fallback kernels within their own bfloat16/float16 rounding.

The first run builds the native kernels (about a minute here) into $XDG_CACHE_HOME/run_generation/kernels;
later runs load them from there."""

import itertools

import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from helpers import SIMPLE, blocks_for
from rungen.gguf import blocks as ggml
from rungen.gguf import kernels
from rungen.gguf.blocks import GGMLLinear, dequantize, held, torch_layer

T = GGMLQuantizationType
# Raw random blocks with sane scales (the gguf package cannot quantize to most of these).
RAW = (T.Q4_K, T.Q6_K, T.Q5_K, T.Q2_K, T.Q3_K, T.IQ4_XS, T.IQ4_NL, T.MXFP4)
# The k-quants interleaved with their scales unpacked (a few percent larger than the file's blocks).
KQUANTS = (T.Q4_K, T.Q6_K, T.Q5_K, T.Q3_K)
# How much larger than the file's blocks interleaved ones may be: the unpacked scales (Q3_K: 114 bytes a row for 110).
X8_GROWTH = {T.Q4_K: 1.03, T.Q5_K: 1.03, T.Q6_K: 1.0, T.IQ4_XS: 1.03, T.Q3_K: 1.04}
# The types the kernels unpack row by row (all but Q4_0, Q4_1 and Q8_0).
UNPACKED = (T.Q5_0, T.Q5_1, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.IQ4_NL, T.IQ4_XS, T.MXFP4)
def held_blocks_for(qtype, *args, **kwargs):
    """blocks_for's blocks as the kernels hold them (MXFP4's converted: rungen.gguf.blocks.held)."""
    return torch.from_numpy(held(blocks_for(qtype, *args, **kwargs).numpy(), qtype))


def widths(qtype):
    """Row widths to try: whole superblocks, or for blocks of 32 an even and an odd number of them, and 18 (the
    default model's 576: offsets per 16 not a multiple of 8)."""
    return (512, 544, 576) if GGML_QUANT_SIZES[qtype][0] == 32 else (512,)


def activations_as_kernel_quantizes(x):
    """x rounded as the kernel rounds it: int8 per block of 32, scale max|x| / 127, ties to even."""
    blocks = x.reshape(x.shape[0], -1, 32)
    scale = blocks.abs().amax(-1, keepdim=True) / 127
    inverse = torch.where(scale == 0, 0, 1 / scale)
    return (torch.round(blocks * inverse) * scale).reshape(x.shape), scale


def check_native(y, x, weight):
    """Two checks. With the activations rounded as the kernel rounds them, the product is the same up to
    float32 summation (1e-4 of the sum of |terms|). Against the float32 product, the difference is at most
    what that rounding allows: half a step (max|x| / 254 per block) times |w| per term."""
    xq, scale = activations_as_kernel_quantizes(x)
    w64 = weight.double()
    exact_q = xq.double() @ w64.T
    terms = xq.double().abs() @ w64.abs().T
    assert torch.all((y.double() - exact_q).abs() <= 1e-4 * terms + 1e-6)
    half_step = (scale / 2).expand(-1, -1, 32).reshape(x.shape).double()
    bound = half_step @ w64.abs().T
    assert torch.all((y.double() - x.double() @ w64.T).abs() <= bound * (1 + 1e-3) + 1e-4 * terms + 1e-6)


def isas():
    """The instruction sets this CPU can run, the best first."""
    if not ggml.native_kernels():
        pytest.skip("native kernels unavailable")
    best = torch.ops.rungen_ggml.isa()
    names = ["amx", "avx512vnni", "avx2", "scalar"]
    return names[names.index(best):]


@pytest.fixture
def each_isa(request):
    yield
    if ggml.native_kernels():
        torch.ops.rungen_ggml.set_isa("best")


def inputs(n, in_features, seed, kind="random"):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, in_features, generator=g)
    if kind == "outlier":
        x[:, 3] = 80.0
    if kind == "zero-block":
        x[:, :32] = 0
    if kind == "saturating":  # every code 127 or -127: with extreme weights, the largest integer sums
        x = torch.where(torch.rand(n, in_features, generator=g) < 0.5, -1.0, 1.0)
        x[0] = 1.0
    if kind == "ties":  # each block's scale exactly 1 and its values halfway between codes: rounded to even
        x = (torch.randint(-120, 120, (n, in_features), generator=g) + 0.5).float()
        x[:, ::32] = 127.0
    if kind == "full":  # every code +-127: the largest integer products
        x = torch.where(torch.rand(n, in_features, generator=g) < 0.5, -3.0, 3.0)
    if kind == "positive":  # every code 127: with the largest weight codes, the largest sums of one sign
        x = torch.full((n, in_features), 3.0)
    return x


@pytest.mark.parametrize("qtype", SIMPLE + RAW, ids=lambda q: q.name)
def test_native_kernel_matches_reference_on_every_instruction_set(qtype, each_isa):
    simple = qtype in SIMPLE
    cases = [(7, 1, "random", "random"), (1, 3, "zeros", "random"), (33, 17, "zero-block", "outlier"),
             (16, 3, "extremes" if simple else "max", "zero-block"), (5, 37, "random", "random"),
             (9, 4, "extremes" if simple else "min", "full"), (6, 2, "random" if simple else "max", "full")]
    for isa in isas():
        torch.ops.rungen_ggml.set_isa(isa)
        for seed, ((rows, n, weights, xs), in_features) in enumerate(itertools.product(cases, widths(qtype))):
            blocks = held_blocks_for(qtype, rows, in_features, seed, weights)
            weight = dequantize(blocks, qtype, in_features)
            x = inputs(n, in_features, seed, xs)
            y = torch.ops.rungen_ggml.mm_int(x, blocks, int(qtype), in_features)
            assert y.shape == (n, rows)
            check_native(y, x, weight)


@pytest.mark.parametrize("qtype", SIMPLE + RAW, ids=lambda q: q.name)
def test_a_token_gets_the_same_bits_alone_and_among_others(qtype, each_isa):
    # Tokens go sixteen, four or one at a time through the 4-bit kernels, in tiles of sixteen: a token's product
    # must not depend on its company, or a greedy text would change with the batch it decodes in.
    for in_features in widths(qtype):
        blocks = held_blocks_for(qtype, 19, in_features, seed=5)
        x = inputs(37, in_features, seed=5, kind="outlier")
        for isa in isas():
            torch.ops.rungen_ggml.set_isa(isa)
            together = torch.ops.rungen_ggml.mm_int(x, blocks, int(qtype), in_features)
            for n in (1, 3, 4, 5, 9, 16, 17, 20, 33):
                part = torch.ops.rungen_ggml.mm_int(x[:n], blocks, int(qtype), in_features)
                assert torch.equal(part, together[:n]), (isa, in_features, n)
            for i in range(x.shape[0]):
                alone = torch.ops.rungen_ggml.mm_int(x[i:i + 1], blocks, int(qtype), in_features)
                assert torch.equal(alone[0], together[i]), (isa, in_features, i)


@pytest.mark.parametrize("qtype", SIMPLE + RAW, ids=lambda q: q.name)
def test_native_dequantize_and_tiled_path_match_gguf(qtype):
    if not ggml.native_kernels():
        pytest.skip("native kernels unavailable")
    blocks = held_blocks_for(qtype, 37, 768, seed=3)
    weight = dequantize(blocks, qtype, 768)
    torch.testing.assert_close(torch.ops.rungen_ggml.dequantize(blocks, int(qtype), 768), weight,
                               rtol=1e-6, atol=1e-7)
    x = inputs(40, 768, 4)
    y = torch.ops.rungen_ggml.mm_tiled(x, blocks, int(qtype), 768)  # float tiles: float32 matmul accuracy
    torch.testing.assert_close(y, x @ weight.T, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("qtype", UNPACKED, ids=lambda q: q.name)
def test_unpacked_rows_give_the_same_bits_on_every_instruction_set(qtype, each_isa):
    # The types a row of which is unpacked (codes, scales per 32 and 16, offsets per 16) and multiplied by one
    # kernel: the weights are the gguf package's to the bit (a lookup too), the product within the activations'
    # rounding, and one arithmetic (exact integer sums per four codes, float sums in a fixed order) that every
    # instruction set computes to the same bits. Adversarial blocks: zero scales, the extreme codes and scales
    # (IQ4's -127 against activations all +-127, at the edge of AVX2's 16-bit pair sums), odd numbers of blocks.
    paths = isas()
    ops = torch.ops.rungen_ggml
    raw = qtype in RAW
    cases = [(8, 1, "random", "random"), (5, 3, "max" if raw else "extremes", "full"),
             (7, 4, "min" if raw else "extremes", "full"), (3, 5, "zero-block", "zero-block"),
             (4, 2, "zeros", "outlier"), (6, 6, "random", "ties"), (8, 2, "max" if raw else "high", "positive")]
    sizes = widths(qtype) + ((96,) if GGML_QUANT_SIZES[qtype][0] == 32 else (768,))
    for seed, ((rows, n, weights, xs), in_features) in enumerate(itertools.product(cases, sizes)):
        blocks = held_blocks_for(qtype, rows, in_features, seed, weights)
        weight = dequantize(blocks, qtype, in_features)
        assert torch.equal(ops.dequantize(blocks, int(qtype), in_features), weight)
        ids = torch.tensor([rows - 1, 0, rows // 2, 0])
        assert torch.equal(ops.embed(blocks, int(qtype), in_features, ids), weight[ids])
        x = inputs(n, in_features, seed, xs)
        results = []
        for isa in paths:
            ops.set_isa(isa)
            y = ops.mm_int(x, blocks, int(qtype), in_features)
            check_native(y, x, weight)
            results.append(y)
        assert all(torch.equal(y, results[0]) for y in results[1:]), (paths, weights, xs, in_features)


@pytest.mark.parametrize("qtype", ggml.INTERLEAVED_TYPES, ids=lambda q: q.name)
def test_interleaved_rows_match_reference_with_the_same_bits_on_every_path_and_alone(qtype, each_isa):
    # The layout these weights run in: the same weights (de-quantized exactly as the file's blocks), the product
    # within the activations' rounding, and one arithmetic (integer block sums, then a multiply-add per block in
    # order) that every instruction set computes to the same bits, a token alone or among any others.
    paths = isas()  # builds or loads the kernels
    ops = torch.ops.rungen_ggml
    cases = [(8, 1, "random", "random"), (64, 3, "extremes", "outlier"), (40, 17, "zero-block", "zero-block"),
             (16, 37, "zeros", "random"), (24, 6, "random", "outlier"), (8, 5, "random", "ties"),
             (16, 4, "extremes", "saturating"), (16, 2, "high" if qtype in SIMPLE else "max", "positive"),
             (8, 3, "extremes", "full")]
    if qtype in RAW:  # every code and scale at its lowest (IQ4: -127, IQ4_XS's scale -32) against +-127
        cases.append((8, 3, "min", "full"))
    # 32-blocks a row, even and odd; superblocks of 256 a row, odd and even.
    widths = (512, 544) if GGML_QUANT_SIZES[qtype][0] == 32 else (768, 512)
    for seed, ((rows, n, weights, xs), in_features) in enumerate(itertools.product(cases, widths)):
        blocks = held_blocks_for(qtype, rows, in_features, seed, weights)
        weight = dequantize(blocks, qtype, in_features)
        x8 = ops.interleave(blocks, int(qtype))
        assert x8.shape == (rows // 8, ggml.interleaved_row_bytes(qtype, in_features))
        # The k-quants' and IQ4_XS's packed 6-bit scales are unpacked to a byte each: a few percent more than the
        # file's.
        assert x8.numel() <= blocks.numel() * X8_GROWTH.get(qtype, 1)
        assert torch.equal(ops.dequantize(x8, int(qtype) | ggml.X8, in_features), weight)
        ids = torch.tensor([rows - 1, 0, 3, 3, rows // 2])  # an embedding's lookup reads either layout
        for layout, code in ((blocks, int(qtype)), (x8, int(qtype) | ggml.X8)):
            assert torch.equal(ops.embed(layout, code, in_features, ids), weight[ids])
        x = inputs(n, in_features, seed, xs)
        results = []
        for isa in paths:
            ops.set_isa(isa)
            y = ops.mm_int(x, x8, int(qtype) | ggml.X8, in_features)
            check_native(y, x, weight)
            for i in range(n):
                assert torch.equal(ops.mm_int(x[i:i + 1], x8, int(qtype) | ggml.X8, in_features)[0], y[i]), (isa, i)
            results.append(y)
        assert all(torch.equal(y, results[0]) for y in results[1:]), paths
        torch.testing.assert_close(ops.mm_tiled(x, x8, int(qtype) | ggml.X8, in_features), x @ weight.T,
                                   rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("qtype", ggml.INTERLEAVED_TYPES, ids=lambda q: q.name)
def test_interleaved_rows_give_each_token_its_bits_for_every_count_of_tokens(qtype, each_isa):
    # The kernels take tokens a few at a time (a pass of four, then two, then one) and, with several tokens on
    # AVX-512, groups of eight rows two at a time (an odd group left over with 24 rows; the k-quants' and IQ4's
    # blocks unpacked once for all passes past a few tokens; on AMX, sixteen tokens a tile and the rest so): every
    # count from 1 to 17, 29 (AMX: 13 left after the tile) and 33 leaves other remainders, and each token's product
    # must be the one it gets alone, on every path.
    paths = isas()
    ops = torch.ops.rungen_ggml
    in_features = 512
    code = int(qtype) | ggml.X8
    x = inputs(33, in_features, 7, "full")
    x[::3] = inputs(33, in_features, 8)[::3]
    for rows in (16, 24):
        blocks = held_blocks_for(qtype, rows, in_features, 7, "extremes" if qtype in SIMPLE else "max")
        x8 = ops.interleave(blocks, int(qtype))
        for isa in paths:
            ops.set_isa(isa)
            alone = torch.cat([ops.mm_int(x[i:i + 1], x8, code, in_features) for i in range(33)])
            if isa == paths[0]:
                check_native(alone, x, dequantize(blocks, qtype, in_features))
                reference = alone
            assert torch.equal(alone, reference), (rows, isa)
            for n in list(range(1, 18)) + [29, 33]:
                assert torch.equal(ops.mm_int(x[:n], x8, code, in_features), alone[:n]), (rows, isa, n)


@pytest.mark.parametrize("qtype", ggml.INTERLEAVED_TYPES, ids=lambda q: q.name)
def test_a_prompts_tokens_get_their_bits_past_the_kernels_chunks(qtype, each_isa):
    # A prompt's product runs in chunks (on AMX: 64 tokens and 16 blocks at a time, 16 tokens a tile, the outputs
    # carried from one chunk of blocks to the next; elsewhere passes of four): 97 tokens (64 + 16 + 16 + 1) over
    # 17 or 24 blocks a row and 24 rows (a pair of groups and one left over) cross every boundary, and each token's
    # product must still be the one it gets alone, on every path.
    paths = isas()
    ops = torch.ops.rungen_ggml
    in_features = 544 if GGML_QUANT_SIZES[qtype][0] == 32 else 768
    blocks = held_blocks_for(qtype, 24, in_features, 11, "random")
    x8, code = ops.interleave(blocks, int(qtype)), int(qtype) | ggml.X8
    x = inputs(97, in_features, 11, "outlier")
    ops.set_isa(paths[-1])
    alone = torch.cat([ops.mm_int(x[i:i + 1], x8, code, in_features) for i in range(97)])
    check_native(alone, x, dequantize(blocks, qtype, in_features))
    for isa in paths:
        ops.set_isa(isa)
        assert torch.equal(ops.mm_int(x, x8, code, in_features), alone), isa


def test_a_layer_interleaves_in_place_where_the_kernels_take_it():
    if not ggml.native_kernels():
        pytest.skip("native kernels unavailable")
    blocks = held_blocks_for(T.Q4_0, 32, 256, seed=9)
    x = inputs(5, 256, 9)
    plain, layer = GGMLLinear(blocks, T.Q4_0, 256), GGMLLinear(blocks, T.Q4_0, 256)
    assert layer.interleave() and layer.interleaved and layer.blocks.shape == (4, 8 * blocks.shape[1])
    assert layer.out_features == 32 and layer.code == int(T.Q4_0) | ggml.X8
    torch.testing.assert_close(layer(x), plain(x), rtol=1e-4, atol=1e-4)
    # q/k/v-like parts concatenate as they are, rows in order; a mix of layouts does not.
    parts = [GGMLLinear(held_blocks_for(T.Q4_0, rows, 256, seed=rows), T.Q4_0, 256) for rows in (16, 8, 8)]
    expected = torch.cat([part(x) for part in parts], dim=-1)
    assert ggml.concat([parts[0], parts[1]]) is not None and parts[0].interleave()
    assert ggml.concat(parts) is None
    for part in parts[1:]:
        part.interleave()
    joined = ggml.concat(parts)
    assert joined.interleaved and joined.out_features == 32
    torch.testing.assert_close(joined(x), expected, rtol=1e-4, atol=1e-4)
    # k-quant layers too; rows that are not whole groups of eight are not interleaved, and stay row-major.
    for qtype in KQUANTS:
        blocks, x = held_blocks_for(qtype, 16, 512), inputs(3, 512, 1)
        plain, layer = GGMLLinear(blocks, qtype, 512), GGMLLinear(blocks, qtype, 512)
        assert layer.interleave() and layer.blocks.shape == (2, ggml.interleaved_row_bytes(qtype, 512))
        torch.testing.assert_close(layer(x), plain(x), rtol=1e-4, atol=1e-4)
    for qtype in (T.Q4_1, T.Q4_K, T.Q3_K):
        layer = GGMLLinear(held_blocks_for(qtype, 12, 256), qtype, 256)
        assert not layer.interleave() and layer.blocks.shape[0] == 12
    with pytest.raises(RuntimeError, match="multiple of 8"):
        torch.ops.rungen_ggml.interleave(held_blocks_for(T.Q4_1, 12, 256), int(T.Q4_1))


def test_parts_of_different_types_side_by_side_give_each_parts_own_bits(each_isa):
    """A Q4_K_M layer's q/k/v (Q4_K q and k, Q6_K v; Q8_0 and Q4_1 beside them) as one product of parts: each
    part's columns hold the bits of that part multiplied alone, on every instruction set, interleaved and
    row-major, for one token and many, on the tiled path too; a whole weight with empty parts gives mm's bits."""
    ops = torch.ops.rungen_ggml
    parts = [GGMLLinear(held_blocks_for(qtype, rows, 512, seed=rows), qtype, 512)
             for qtype, rows in ((T.Q4_K, 32), (T.Q4_K, 16), (T.Q6_K, 16), (T.Q8_0, 8), (T.Q4_1, 24))]
    for isa, interleaved in itertools.product(isas(), (False, True)):
        ops.set_isa(isa)
        if interleaved:
            assert all(part.interleave() for part in parts)
        blocks, codes = [p.blocks for p in parts], [p.code for p in parts]
        for n in (1, 5, 17):
            x = inputs(n, 512, n)
            joined = ops.mm_parts(x, blocks, codes, 512)
            assert torch.equal(joined, torch.cat([ops.mm(x, b, c, 512) for b, c in zip(blocks, codes)], -1))
            empty = blocks[0][:0]
            assert torch.equal(ops.mm_parts(x, [blocks[0], empty, empty], [codes[0]] * 3, 512),
                               ops.mm(x, blocks[0], codes[0], 512))
            layer = ggml.join(parts[:3])  # q/k of one type: one part of their rows, v another
            assert isinstance(layer, ggml.GGMLParts) and [p.out_features for p in layer.parts] == [48, 16]
            assert torch.equal(layer(x), joined[:, :64])
        threshold = ops.set_tile_threshold(4)  # the tiled path: each part tiled alone, into its columns
        try:
            x = inputs(6, 512, 6)
            assert torch.equal(ops.mm_parts(x, blocks, codes, 512),
                               torch.cat([ops.mm(x, b, c, 512) for b, c in zip(blocks, codes)], -1))
        finally:
            ops.set_tile_threshold(threshold)
    with pytest.raises(RuntimeError, match="one type for each"):
        ops.mm_parts(inputs(1, 512, 0), blocks, codes[:2], 512)


def test_groups_of_rows_each_times_its_own_weight_give_each_group_mms_bits(each_isa):
    """A mixture's experts in one call (mm_grouped): x's rows in groups, each group times its own expert's weight;
    a group's rows hold the bits of mm over that group alone, on every instruction set, interleaved (Q4_K, Q6_K,
    Q8_0) and row-major (Q2_K), for groups of no rows, of one, and of more than four (the activations' groups)."""
    ops = torch.ops.rungen_ggml
    counts = [1, 0, 6, 3, 0, 9]
    for qtype, isa in itertools.product((T.Q4_K, T.Q6_K, T.Q8_0, T.Q2_K), isas()):
        ops.set_isa(isa)
        experts = [GGMLLinear(held_blocks_for(qtype, 16, 512, seed=e), qtype, 512) for e in range(len(counts))]
        assert all(expert.interleave() for expert in experts) == (qtype != T.Q2_K)
        blocks, codes = [e.blocks for e in experts], [e.code for e in experts]
        x = inputs(sum(counts), 512, 3)
        grouped = ops.mm_grouped(x, blocks, codes, counts, 512)
        assert torch.equal(grouped, torch.cat([ops.mm(part, b, c, 512)
                                               for part, b, c in zip(x.split(counts), blocks, codes)]))
    with pytest.raises(RuntimeError, match="add up to 19, not x's 18"):
        ops.mm_grouped(x[1:], blocks, codes, counts, 512)
    with pytest.raises(RuntimeError, match="one shape"):
        ops.mm_grouped(x[:2], [blocks[0], blocks[1][:1]], codes[:2], [1, 1], 512)


def test_chosen_experts_compute_each_tokens_experts_as_mm_and_the_gate_do(each_isa):
    """A mixture's experts routed by the caller in one call (chosen_experts: Gemma 4's and Nemotron 3's, whose
    routers are their own): each token's k experts' gate/up products (one stack, interleaved), the gate (GELU's tanh
    approximation or SiLU) times up, or relu(up)^2 of experts without a gate (Nemotron 3's), the down products,
    weighted and summed: what mm and torch compute expert by expert, within float32 rounding, on every instruction
    set; an expert past the stacks and an activation the call lacks are refused."""
    from rungen.gguf.experts import GELU_GATED, RELU2, SILU_GATED

    ops = torch.ops.rungen_ggml
    experts, inner, hidden, k = 5, 256, 256, 2
    activations = {GELU_GATED: lambda gate: torch.nn.functional.gelu(gate, approximate="tanh"),
                   SILU_GATED: torch.nn.functional.silu, RELU2: lambda up: torch.relu(up) ** 2}
    x = inputs(7, hidden, 3)
    g = torch.Generator().manual_seed(1)
    ids = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(7)])
    weights = torch.rand(7, k, generator=g)
    for activation, isa in itertools.product(activations, isas()):
        ops.set_isa(isa)
        rows = inner if activation == RELU2 else 2 * inner
        gate_up = [GGMLLinear(held_blocks_for(T.Q8_0, rows, hidden, seed=e), T.Q8_0, hidden) for e in range(experts)]
        down = [GGMLLinear(held_blocks_for(T.Q6_K, hidden, inner, seed=9 + e), T.Q6_K, inner)
                for e in range(experts)]
        assert all(layer.interleave() for layer in gate_up + down)
        stacks = [torch.stack([layer.blocks for layer in layers]) for layers in (gate_up, down)]
        y = ops.chosen_experts(x, ids, weights, stacks, [gate_up[0].code, down[0].code], activation)
        wanted = torch.zeros_like(x)
        for t in range(7):
            for j in range(k):
                e = int(ids[t, j])
                products = ops.mm(x[t:t + 1], gate_up[e].blocks, gate_up[e].code, hidden)
                if activation == RELU2:
                    act = activations[activation](products)
                else:
                    gate, up = products.chunk(2, dim=-1)
                    act = activations[activation](gate) * up
                wanted[t] += weights[t, j] * ops.mm(act, down[e].blocks, down[e].code, inner)[0]
        assert wanted.abs().max() > 1
        torch.testing.assert_close(y, wanted, rtol=1e-4, atol=1e-4 * wanted.abs().max().item())
    with pytest.raises(RuntimeError, match="a chosen expert past the 5 experts"):
        ops.chosen_experts(x[:1], torch.tensor([[0, 5]]), weights[:1], stacks, [gate_up[0].code, down[0].code],
                           activation)
    with pytest.raises(RuntimeError, match="not 3"):
        ops.chosen_experts(x[:1], ids[:1], weights[:1], stacks, [gate_up[0].code, down[0].code], 3)


def test_row_products_give_a_row_its_bits_in_any_batch_and_on_every_code_path(each_isa):
    """dot_rows (a mixture's router, where torch's product of one row and of several differ in their last bits): x @
    w.T within float32's summation error of the float64 product, a row the same bits alone and among others, and on
    every instruction set; widths a multiple of 8 and not, rows of w a multiple of 8 and not."""
    ops = torch.ops.rungen_ggml
    g = torch.Generator().manual_seed(0)
    for n, e in ((2048, 128), (2048, 60), (100, 13)):
        x, w = torch.randn(9, n, generator=g), torch.randn(e, n, generator=g)
        results = []
        for isa in isas():
            ops.set_isa(isa)
            y = ops.dot_rows(x, w)
            assert all(torch.equal(ops.dot_rows(x[i:i + 1], w), y[i:i + 1]) for i in range(len(x)))
            results.append(y)
        terms = x.double().abs() @ w.double().abs().T
        assert torch.all((results[0].double() - x.double() @ w.double().T).abs() <= 1e-6 * terms)
        assert all(torch.equal(y, results[0]) for y in results)


def test_layer_takes_any_leading_shape_strided_rows_and_bias():
    blocks = held_blocks_for(T.Q4_1, 24, 256, seed=5)
    bias = torch.randn(12)
    layer = GGMLLinear(blocks[::2], T.Q4_1, 256, bias=bias)  # every other row: a strided view
    x = inputs(6, 256, 6).reshape(2, 3, 256)
    y = layer(x)
    assert y.shape == (2, 3, 12)
    weight = dequantize(blocks[::2], T.Q4_1, 256)
    check_native((y - bias).reshape(6, 12), x.reshape(6, 256), weight)


@pytest.mark.parametrize("qtype", SIMPLE + RAW, ids=lambda q: q.name)
def test_torch_fallback_stays_within_its_rounding(qtype):
    """int4 packing: codes exact, scale/zero and activations rounded to bfloat16 (2^-8 relative each);
    float16: weights rounded to 2^-11 relative. 2^-6 of the sum of |terms| covers both."""
    in_features = 512
    for seed, (rows, n) in enumerate([(7, 1), (1, 3), (33, 17)]):
        blocks = held_blocks_for(qtype, rows, in_features, seed)
        weight = dequantize(blocks, qtype, in_features)
        x = inputs(n, in_features, seed)
        y = torch_layer(blocks, qtype, in_features)(x).float()
        assert y.shape == (n, rows)
        terms = x.abs() @ weight.abs().T
        assert torch.all((y - x @ weight.T).abs() <= 2**-6 * terms + 1e-5)


def test_forced_fallback_warns_once_and_layers_use_torch_kernels(monkeypatch, capfd):
    monkeypatch.setenv(kernels.KERNELS_ENV, "torch")
    monkeypatch.setattr(kernels, "_native", None)
    blocks = held_blocks_for(T.Q4_1, 16, 256, seed=7)
    layer = GGMLLinear(blocks, T.Q4_1, 256)
    x = inputs(2, 256, 7)
    layer(x), layer(x)
    GGMLLinear(blocks, T.Q4_1, 256)(x)
    assert capfd.readouterr().err.count("RUN_GENERATION_KERNELS=torch") == 1
    assert "_fallback" in layer.__dict__ and not list(layer.children())


def test_failed_build_falls_back_with_one_line(monkeypatch, capfd):
    def no_compiler():
        raise RuntimeError("Error building extension 'rungen_ggml': g++: not found")

    monkeypatch.delenv(kernels.KERNELS_ENV, raising=False)
    monkeypatch.setattr(kernels, "_native", None)
    monkeypatch.setattr(kernels, "build_kernels", no_compiler)
    blocks = held_blocks_for(T.Q8_0, 5, 64, seed=8)
    x = inputs(3, 64, 8)
    y = GGMLLinear(blocks, T.Q8_0, 64)(x)
    weight = dequantize(blocks, T.Q8_0, 64)
    assert torch.all((y - x @ weight.T).abs() <= 2**-6 * (x.abs() @ weight.abs().T) + 1e-5)
    err = capfd.readouterr().err
    assert err.count("\n") == 1 and "could not be built" in err and "g++: not found" in err


@pytest.mark.parametrize("dim", [64, 48, 128, 96])  # the default model's, odd, qwen3's and llama 3's, phi3's
def test_attention_over_many_keys_is_softmax_attention_and_the_same_bits_alone_and_padded(dim):
    """One query alone and left-padded beside another row; several queries under the causal default and under
    the same mask given: softmax attention, and the same bits whichever way the keys are grouped."""
    if not ggml.native_kernels():
        pytest.skip("the native kernels are not available here")
    torch.manual_seed(5)
    heads, kv, keys, pad = 6, 2, 203, 3  # key counts off the kernel's groups of four and eight
    q, k, v = torch.randn(1, heads, 1, dim), torch.randn(1, kv, keys, dim) * 2, torch.randn(1, kv, keys, dim)
    alone = torch.ops.rungen_ggml.attend(q, k, v, None, dim ** -0.5)
    reference = torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True, scale=dim ** -0.5)
    torch.testing.assert_close(alone, reference.transpose(1, 2).reshape(1, 1, -1), rtol=1e-5, atol=1e-5)
    # The same query beside a row with no padding; its keys shifted right by the padding, masked out.
    padded_k = torch.cat([torch.randn(1, kv, keys + pad, dim), torch.cat([torch.zeros(1, kv, pad, dim), k], 2)])
    padded_v = torch.cat([torch.randn(1, kv, keys + pad, dim), torch.cat([torch.zeros(1, kv, pad, dim), v], 2)])
    mask = torch.ones(2, 1, 1, keys + pad, dtype=torch.bool)
    mask[1, ..., :pad] = False
    batched = torch.ops.rungen_ggml.attend(torch.cat([torch.randn_like(q), q]), padded_k, padded_v, mask, dim ** -0.5)
    assert torch.equal(batched[1], alone[0])
    # A prompt's last 5 tokens over the keys (the rest after a cached start): the causal default is softmax
    # attention with its causal mask, and gives the bits of that mask given as booleans (another code path).
    tokens = 5
    rest = torch.randn(1, heads, tokens, dim)
    causal = torch.ones(tokens, keys, dtype=torch.bool).tril(keys - tokens)
    default = torch.ops.rungen_ggml.attend(rest, k, v, None, dim ** -0.5)
    reference = torch.nn.functional.scaled_dot_product_attention(rest, k, v, attn_mask=causal, enable_gqa=True,
                                                                 scale=dim ** -0.5)
    torch.testing.assert_close(default, reference.transpose(1, 2).reshape(1, tokens, -1), rtol=1e-5, atol=1e-5)
    assert torch.equal(torch.ops.rungen_ggml.attend(rest, k, v, causal[None, None], dim ** -0.5), default)


@pytest.mark.parametrize("dim", [64, 48])
def test_soft_capped_attention_is_gemma2s_eager_attention_and_the_same_bits_alone_and_padded(dim):
    """gemma2's attention: scores tanh(s / cap) * cap before the mask and the softmax, as transformers' own gemma2
    eager attention computes them; scores both sides of the cap's polynomial/exponential switch (|s| / cap about
    0.625), key counts off the kernel's groups of eight; a left-padded batch and an additive mask give a query the
    bits it gets alone."""
    if not ggml.native_kernels():
        pytest.skip("the native kernels are not available here")
    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

    torch.manual_seed(7)
    heads, kv, keys, pad, cap, tokens = 4, 2, 77, 3, 5.0, 6
    q, k, v = torch.randn(1, heads, tokens, dim), torch.randn(1, kv, keys, dim) * 3, torch.randn(1, kv, keys, dim)
    scores = torch.einsum("bhtd,bhkd->bhtk", q, k.repeat_interleave(heads // kv, 1)) * dim ** -0.5
    assert (scores.abs() < 0.5 * cap).any() and (scores.abs() > cap).any()
    causal = torch.ones(tokens, keys, dtype=torch.bool).tril(keys - tokens)
    additive = torch.zeros(1, 1, tokens, keys).masked_fill(~causal, torch.finfo(torch.float32).min)
    module = torch.nn.Module()
    module.num_key_value_groups, module.training = heads // kv, False
    reference = eager_attention_forward(module, q, k, v, additive, dropout=0.0, scaling=dim ** -0.5, softcap=cap)[0]
    capped = torch.ops.rungen_ggml.attend(q, k, v, None, dim ** -0.5, cap)
    torch.testing.assert_close(capped, reference.reshape(1, tokens, -1), rtol=1e-5, atol=1e-5)
    assert torch.equal(torch.ops.rungen_ggml.attend(q, k, v, additive, dim ** -0.5, cap), capped)
    assert not torch.allclose(torch.ops.rungen_ggml.attend(q, k, v, None, dim ** -0.5), capped, atol=1e-3)
    # The last query beside a row with no padding, its keys shifted right by the padding, masked out.
    last = q[:, :, -1:]
    padded_k = torch.cat([torch.randn(1, kv, keys + pad, dim), torch.cat([torch.zeros(1, kv, pad, dim), k], 2)])
    padded_v = torch.cat([torch.randn(1, kv, keys + pad, dim), torch.cat([torch.zeros(1, kv, pad, dim), v], 2)])
    mask = torch.ones(2, 1, 1, keys + pad, dtype=torch.bool)
    mask[1, ..., :pad] = False
    batched = torch.ops.rungen_ggml.attend(torch.cat([torch.randn_like(last), last]), padded_k, padded_v, mask,
                                           dim ** -0.5, cap)
    assert torch.equal(batched[1, 0], capped[0, -1])
    with pytest.raises(RuntimeError, match="softcap"):
        torch.ops.rungen_ggml.attend(q, k, v, None, dim ** -0.5, -1.0)


@pytest.mark.parametrize("dim", [64, 48])
@pytest.mark.parametrize("window", [5, 13, 500])
def test_windowed_attention_is_attention_under_the_window_mask_and_the_same_bits_as_that_mask_given(dim, window):
    """A sliding window (gemma's local layers, mistral's): query i at cache position T - t + i sees the keys after
    position - window (transformers' sliding_window_overlay), within float32 rounding of torch's attention under
    that mask, and the bits of that mask given as booleans, or as an additive mask with gemma2's soft cap, with or
    without the window passed too; windows off the kernel's groups of eight, and one wider than the keys."""
    if not ggml.native_kernels():
        pytest.skip("the native kernels are not available here")
    torch.manual_seed(9)
    heads, kv, keys, tokens = 4, 2, 61, 7
    q, k, v = torch.randn(1, heads, tokens, dim), torch.randn(1, kv, keys, dim) * 2, torch.randn(1, kv, keys, dim)
    positions, seen = torch.arange(keys - tokens, keys)[:, None], torch.arange(keys)[None, :]
    windowed = (seen <= positions) & (seen > positions - window)
    reference = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=windowed, enable_gqa=True,
                                                                 scale=dim ** -0.5)
    got = torch.ops.rungen_ggml.attend(q, k, v, None, dim ** -0.5, 0.0, window)
    torch.testing.assert_close(got, reference.transpose(1, 2).reshape(1, tokens, -1), rtol=1e-5, atol=1e-5)
    mask = windowed[None, None]
    assert torch.equal(torch.ops.rungen_ggml.attend(q, k, v, mask, dim ** -0.5), got)
    assert torch.equal(torch.ops.rungen_ggml.attend(q, k, v, mask, dim ** -0.5, 0.0, window), got)
    additive = torch.zeros(1, 1, tokens, keys).masked_fill(~mask, torch.finfo(torch.float32).min)
    capped = torch.ops.rungen_ggml.attend(q, k, v, None, dim ** -0.5, 5.0, window)
    assert torch.equal(torch.ops.rungen_ggml.attend(q, k, v, additive, dim ** -0.5, 5.0), capped)
    if window < keys:
        assert not torch.allclose(torch.ops.rungen_ggml.attend(q, k, v, None, dim ** -0.5), got, atol=1e-3)
    with pytest.raises(RuntimeError, match="window"):
        torch.ops.rungen_ggml.attend(q, k, v, None, dim ** -0.5, 0.0, -1)


@pytest.mark.parametrize("ffn", [9216, 37])
def test_gelu_tanh_gate_is_torchs_and_a_row_gets_the_same_bits_alone_and_among_others(ffn):
    """gemma's gate: gelu(gate, approximate="tanh") * up of the fused [gate, up] product, within float32 rounding
    of torch's over the range a gate takes and beyond (both sides of tanh's polynomial/exponential switch, and
    saturated), a width off the kernel's groups of eight included; a row alone and among others the same bits."""
    if not ggml.native_kernels():
        pytest.skip("the native kernels are not available here")
    torch.manual_seed(9)
    gate_up = torch.randn(5, 2 * ffn) * torch.tensor([0.05, 1.0, 4.0, 30.0, 1.0])[:, None]
    gated = torch.ops.rungen_ggml.gelu_tanh_mul(gate_up)
    gate, up = gate_up.double().chunk(2, dim=-1)
    reference = torch.nn.functional.gelu(gate, approximate="tanh") * up
    torch.testing.assert_close(gated.double(), reference, rtol=1e-6, atol=1e-6 * reference.abs().max().item())
    for row in range(gate_up.shape[0]):
        assert torch.equal(torch.ops.rungen_ggml.gelu_tanh_mul(gate_up[row:row + 1]), gated[row:row + 1])


@pytest.mark.parametrize("ffn", [1536, 37])
def test_silu_gate_is_torchs_and_a_row_gets_the_same_bits_alone_and_among_others(ffn):
    """llama's gate: silu(gate) * up of the fused [gate, up] product, within float32 rounding of torch's over the
    range a gate takes and beyond (both signs, near zero, and far past where exp overflows or underflows), a width
    off the kernel's groups of eight included; a row alone and among others the same bits."""
    if not ggml.native_kernels():
        pytest.skip("the native kernels are not available here")
    torch.manual_seed(11)
    gate_up = torch.randn(6, 2 * ffn) * torch.tensor([1e-3, 1.0, 4.0, 30.0, 120.0, 1.0])[:, None]
    gated = torch.ops.rungen_ggml.silu_mul(gate_up)
    gate, up = gate_up.double().chunk(2, dim=-1)
    reference = torch.nn.functional.silu(gate) * up
    torch.testing.assert_close(gated.double(), reference, rtol=1e-6, atol=1e-6 * reference.abs().max().item())
    assert torch.isfinite(gated).all()
    for row in range(gate_up.shape[0]):
        assert torch.equal(torch.ops.rungen_ggml.silu_mul(gate_up[row:row + 1]), gated[row:row + 1])
    # Gates far below zero (past where exp underflows) give torch's zeros, also against a huge up.
    far = torch.tensor([[-90.0, -200.0, -1e30, 3.0, 1e30, 1e30, 1e30, 2.0]])
    torch.testing.assert_close(torch.ops.rungen_ggml.silu_mul(far),
                               torch.nn.functional.silu(far[:, :4]) * far[:, 4:], rtol=1e-6, atol=0)


@pytest.mark.parametrize("isa", ["avx512vnni", "avx2", "scalar"])
def test_attention_and_gates_give_the_same_bits_on_every_code_path(isa, each_isa):
    """The attention and the gates compiled for AVX2 and for the baseline (the code path in use picks one): the same
    bits on either, under the causal default, a boolean mask, gemma2's soft cap and a window, at head sizes 64, 48,
    96 and 256 (the values' sums in registers 64 dimensions at a time, and the rest)."""
    if isa not in isas():
        pytest.skip(f"this CPU does not run {isa}")
    torch.manual_seed(13)
    heads, kv, keys, tokens = 4, 2, 45, 6
    cases = []
    for dim in (64, 48, 96, 256):
        q, k, v = torch.randn(1, heads, tokens, dim), torch.randn(1, kv, keys, dim) * 2, torch.randn(1, kv, keys, dim)
        mask = torch.ones(1, 1, tokens, keys, dtype=torch.bool).tril(keys - tokens)
        mask[..., :3] = False
        cases += [(q, k, v, None, dim ** -0.5), (q, k, v, mask, dim ** -0.5), (q, k, v, None, dim ** -0.5, 5.0),
                  (q, k, v, None, dim ** -0.5, 0.0, 9)]
    gate_up = torch.randn(3, 2 * 37) * 4

    def run():
        return ([torch.ops.rungen_ggml.attend(*case) for case in cases],
                torch.ops.rungen_ggml.silu_mul(gate_up), torch.ops.rungen_ggml.gelu_tanh_mul(gate_up))

    best = run()
    torch.ops.rungen_ggml.set_isa(isa)
    other = run()
    for a, b in zip(best[0] + [best[1], best[2]], other[0] + [other[1], other[2]]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("isa", ["avx512vnni", "avx2", "scalar"])
def test_attention_over_a_float16_cache_is_attention_over_its_values_widened(isa, each_isa):
    """The own model's cache holds keys and values in float16: attention reads them in place (strided views of
    buffers with room) and gives the bits of the same attention over those values widened to float32, on every code
    path, under the causal default, a boolean mask, an additive one, gemma2's soft cap and a window, at head sizes
    64, 48, 96, 256 and 20 (the values' sums in registers 64 dimensions at a time, the rest, and a head of no whole
    vector); a decode step's few queries (widened a chunk of keys at a time) and a prompt's many over keys of several
    chunks (a kv head's keys widened whole)."""
    if isa not in isas():
        pytest.skip(f"this CPU does not run {isa}")
    torch.ops.rungen_ggml.set_isa(isa)
    torch.manual_seed(17)
    heads, kv = 4, 2
    for dim, (keys, tokens) in itertools.product((64, 48, 96, 256, 20), ((45, 6), (150, 24))):
        q = torch.randn(2, heads, tokens, dim)
        buffers = (torch.randn(2, kv, keys + 11, dim) * 2).half(), torch.randn(2, kv, keys + 11, dim).half()
        k, v = (buffer[:, :, :keys] for buffer in buffers)  # views with room after them, as a cache's
        mask = torch.ones(2, 1, tokens, keys, dtype=torch.bool).tril(keys - tokens)
        mask[0, ..., :3] = False
        additive = torch.zeros(mask.shape).masked_fill_(~mask, torch.finfo(torch.float32).min)
        for options in ((None, dim ** -0.5), (mask, dim ** -0.5), (additive, dim ** -0.5), (None, dim ** -0.5, 5.0),
                        (None, dim ** -0.5, 0.0, 9)):
            held = torch.ops.rungen_ggml.attend(q, k, v, *options)
            widened = torch.ops.rungen_ggml.attend(q, k.float(), v.float(), *options)
            assert torch.equal(held, widened), (dim, keys, len(options))
    # (a float16 key and a float32 value are widened together: the float32 form)
    mixed = torch.ops.rungen_ggml.attend(q, k, v.float(), None, 0.5)
    assert torch.equal(mixed, torch.ops.rungen_ggml.attend(q, k.float(), v.float(), None, 0.5))


@pytest.mark.parametrize("isa", ["avx512vnni", "avx2", "scalar"])
@pytest.mark.parametrize("dim", [64, 48])
def test_attention_with_a_sink_far_above_the_other_keys_is_softmax_attention(dim, isa, each_isa):
    """A key scored far above the rest (an attention sink: the others' weights below e^-87, where float's normal
    range ends; as float32's softmax makes them, they weigh exactly nothing, so a sink whose value row is zero
    gives zeros), and scores spread evenly down to 100 below the top: softmax attention, on every code path."""
    if isa not in isas():
        pytest.skip(f"this CPU does not run {isa}")
    torch.ops.rungen_ggml.set_isa(isa)
    torch.manual_seed(17)
    heads, kv, keys, tokens, scale = 4, 2, 83, 5, dim ** -0.5
    q, k, v = torch.randn(1, heads, tokens, dim), torch.randn(1, kv, keys, dim), torch.randn(1, kv, keys, dim)
    q[..., 0], k[:, :, 0, 0] = 40.0, 40.0 * dim ** 0.5 / 10  # key 0 scores about 160 above the others
    v[:, :, 0] = 0.0
    sink = torch.ops.rungen_ggml.attend(q, k, v, None, scale)
    assert torch.equal(sink, torch.zeros_like(sink))
    graded = k.clone()
    graded[:, :, :, 0] = torch.linspace(-100.0, 0.0, keys) * dim ** 0.5 / 40  # scores spread over [-100, 0]
    got = torch.ops.rungen_ggml.attend(q, graded, v, None, scale)
    reference = torch.nn.functional.scaled_dot_product_attention(q, graded, v, enable_gqa=True, scale=scale,
                                                                 is_causal=False,
                                                                 attn_mask=torch.ones(tokens, keys).tril(
                                                                     keys - tokens).bool())
    torch.testing.assert_close(got, reference.transpose(1, 2).reshape(1, tokens, -1), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("isa", ["avx512vnni", "avx2", "scalar"])
@pytest.mark.parametrize("dim", [64, 48])
def test_attention_with_learned_sinks_is_gpt_oss_attention_and_the_same_bits_alone_and_padded(dim, isa, each_isa):
    """gpt-oss's sinks: a logit a query head that its softmax takes beside the keys' scores (scaled, masked) and
    whose weight goes to no value. transformers' eager gpt-oss attention, under its additive mask and a sliding
    window, on every code path; a sink far above the keys leaves nearly nothing; a row alone and left-padded beside
    another gives the same bits."""
    if isa not in isas():
        pytest.skip(f"this CPU does not run {isa}")
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    torch.ops.rungen_ggml.set_isa(isa)
    torch.manual_seed(23)
    heads, kv, keys, tokens, scale, window = 8, 2, 77, 5, dim ** -0.5, 19
    q, k, v = torch.randn(1, heads, tokens, dim), torch.randn(1, kv, keys, dim), torch.randn(1, kv, keys, dim)
    sinks = torch.randn(heads) * 3
    sinks[1] = 60.0  # one head all but silenced
    for window_of in (0, window):
        allowed = torch.ones(tokens, keys).tril(keys - tokens).bool()
        if window_of:
            allowed &= ~torch.ones(tokens, keys).tril(keys - tokens - window_of).bool()
        additive = torch.zeros(1, 1, tokens, keys).masked_fill(~allowed, torch.finfo(torch.float32).min)
        module = type("Attention", (), {"num_key_value_groups": heads // kv, "sinks": sinks, "training": False})()
        reference, _ = eager_attention_forward(module, q, k, v, additive, scale)
        got = torch.ops.rungen_ggml.attend(q, k, v, additive, scale, 0.0, window_of, sinks)
        torch.testing.assert_close(got, reference.reshape(1, tokens, -1), rtol=1e-5, atol=1e-5)
        assert got.view(tokens, heads, dim)[:, 1].abs().max() < 1e-20
    pad = 3
    alone = torch.ops.rungen_ggml.attend(q[:, :, -1:], k, v, None, scale, 0.0, window, sinks)
    padded_k = torch.cat([torch.randn(1, kv, keys + pad, dim), torch.cat([torch.zeros(1, kv, pad, dim), k], 2)])
    padded_v = torch.cat([torch.randn(1, kv, keys + pad, dim), torch.cat([torch.zeros(1, kv, pad, dim), v], 2)])
    mask = torch.ones(2, 1, 1, keys + pad, dtype=torch.bool)
    mask[1, ..., :pad] = False
    batched = torch.ops.rungen_ggml.attend(torch.cat([torch.randn_like(q[:, :, -1:]), q[:, :, -1:]]), padded_k,
                                           padded_v, mask, scale, 0.0, window, sinks)
    assert torch.equal(batched[1], alone[0])


def test_a_short_conv_step_is_transformers_decode_step_of_a_short_convolution():
    # LFM2's short convolution, one position a row, between its products: C times the convolution (transformers'
    # causal_conv1d_update over the window, updated in place) of B * x, within float32 rounding; the window as
    # transformers' cache holds it after the step.
    from transformers.models.lfm2.modeling_lfm2 import causal_conv1d_update

    if not ggml.native_kernels():
        pytest.skip("native kernels unavailable")
    rows, channels, kernel = 3, 40, 3
    g = torch.Generator().manual_seed(11)
    bcx, taps = torch.randn(rows, 3 * channels, generator=g), torch.randn(channels, kernel, generator=g)
    for length in (kernel - 1, kernel):  # (a window of the kernel's length, or one shorter)
        window = torch.randn(rows, channels, length, generator=g)
        b, c, x = bcx.chunk(3, dim=-1)
        theirs_window = window.clone()
        theirs = c * causal_conv1d_update((b * x)[:, :, None], theirs_window, taps)[:, :, 0]
        ours_window = window.clone()
        ours = torch.ops.rungen_ggml.short_conv_step(ours_window, bcx, taps)
        assert torch.equal(ours_window, theirs_window)
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("value_heads", [2, 4])
def test_a_delta_step_is_transformers_decode_step_of_a_gated_deltanet_layer(value_heads, each_isa):
    # Qwen3.5's linear attention, one position a row: transformers' own PyTorch forms (the convolution's update, the
    # gated delta rule's recurrent step, the gated norm) on the same window, state and products, within float32
    # rounding; the window and the state updated in place as transformers' cache holds them. Two key heads, each
    # serving one or two value heads, of 24 (a vector and a half of AVX-512's).
    import torch.nn.functional as F
    from transformers.models.qwen3_5.modeling_qwen3_5 import (
        Qwen3_5RMSNormGated,
        causal_conv1d_update,
        torch_recurrent_gated_delta_rule,
    )

    rows, key_heads, size, kernel = 3, 2, 24, 4
    channels = 2 * key_heads * size + value_heads * size
    g = torch.Generator().manual_seed(7)
    window, state = torch.randn(rows, channels, kernel, generator=g), torch.randn(rows, value_heads, size, size,
                                                                                    generator=g) * 0.3
    mixed, conv = torch.randn(rows, channels, generator=g), torch.randn(channels, kernel, generator=g) * 0.5
    a, b = torch.randn(rows, value_heads, generator=g), torch.randn(rows, value_heads, generator=g)
    z, norm = torch.randn(rows, value_heads * size, generator=g), torch.randn(size, generator=g)
    a_log, dt_bias = torch.rand(value_heads, generator=g) * 2, torch.randn(value_heads, generator=g)

    theirs_window, theirs_state = window.clone(), state.clone()
    mixed_out = causal_conv1d_update(mixed[:, :, None], theirs_window, conv, None, "silu")[:, :, 0]
    q, k, v = mixed_out.split([key_heads * size, key_heads * size, value_heads * size], -1)
    out, theirs_state = torch_recurrent_gated_delta_rule(
        q.reshape(rows, 1, key_heads, size), k.reshape(rows, 1, key_heads, size),
        v.reshape(rows, 1, value_heads, size), g=(-a_log.exp() * F.softplus(a + dt_bias))[:, None],
        beta=b.sigmoid()[:, None], initial_state=theirs_state, output_final_state=True, use_qk_l2norm_in_kernel=True)
    gated = Qwen3_5RMSNormGated(size, eps=1e-6)
    gated.weight.data = norm
    theirs = gated(out.reshape(-1, size), z.reshape(-1, size)).reshape(rows, -1)
    each = []
    for isa in isas():
        torch.ops.rungen_ggml.set_isa(isa)
        ours_window, ours_state = window.clone(), state.clone()
        ours = torch.ops.rungen_ggml.delta_step(ours_window, mixed, conv, ours_state, a, b, z, -a_log.exp(),
                                                dt_bias, norm, key_heads, 1e-6)
        torch.testing.assert_close(ours_window, theirs_window, rtol=0, atol=0)
        torch.testing.assert_close(ours_state, theirs_state, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
        each.append((ours, ours_state))
        # written for an out_proj whose columns keep another order: column c of a row at scatter[c]
        scatter = torch.randperm(value_heads * size, generator=g)
        scattered = torch.ops.rungen_ggml.delta_step(window.clone(), mixed, conv, state.clone(), a, b, z,
                                                     -a_log.exp(), dt_bias, norm, key_heads, 1e-6, scatter)
        assert torch.equal(scattered[:, scatter], ours)
    for ours, ours_state in each[1:]:  # each instruction set's build the same bits
        assert torch.equal(ours, each[0][0]) and torch.equal(ours_state, each[0][1])
    with pytest.raises(RuntimeError, match="not a permutation"):
        torch.ops.rungen_ggml.delta_step(window.clone(), mixed, conv, state.clone(), a, b, z, -a_log.exp(), dt_bias,
                                         norm, key_heads, 1e-6, torch.zeros(value_heads * size, dtype=torch.long))


@pytest.mark.parametrize("value_heads", [2, 4])
def test_a_delta_scan_is_transformers_prompt_and_the_steps_one_by_one(value_heads, each_isa):
    # Qwen3.5's linear attention over a prompt of 70 positions (past one of transformers' chunks of 64) in two
    # sequences, after earlier inputs (the cache's window of 3) and from a state: transformers' own PyTorch forms (the
    # convolution over the window and the prompt, the chunked gated delta rule, the gated norm) within float32
    # rounding; and to the bit what delta_step gives taking the positions one at a time (the state and each output),
    # on every instruction set's build alike. A scattered output is the same columns in another order.
    import torch.nn.functional as F
    from transformers.models.qwen3_5.modeling_qwen3_5 import (
        Qwen3_5RMSNormGated,
        causal_conv1d_fn,
        torch_chunk_gated_delta_rule,
    )

    ops = torch.ops.rungen_ggml
    sequences, positions, key_heads, size, kernel = 2, 70, 2, 24, 4
    channels = 2 * key_heads * size + value_heads * size
    g = torch.Generator().manual_seed(9)
    window = torch.randn(sequences, kernel - 1, channels, generator=g)
    mixed = torch.randn(sequences, positions, channels, generator=g)
    state = torch.randn(sequences, value_heads, size, size, generator=g) * 0.3
    conv = torch.randn(channels, kernel, generator=g) * 0.5
    a, b = torch.randn(sequences, positions, value_heads, generator=g), torch.randn(sequences, positions,
                                                                                      value_heads, generator=g)
    z, norm = torch.randn(sequences, positions, value_heads * size, generator=g), torch.randn(size, generator=g)
    a_log, dt_bias = torch.rand(value_heads, generator=g) * 2, torch.randn(value_heads, generator=g)
    inputs = torch.cat([window, mixed], dim=1)

    convolved = causal_conv1d_fn(inputs.transpose(1, 2), conv, None, "silu")[:, :, kernel - 1:].transpose(1, 2)
    q, k, v = convolved.split([key_heads * size, key_heads * size, value_heads * size], -1)
    out, theirs_state = torch_chunk_gated_delta_rule(
        q.reshape(sequences, positions, key_heads, size), k.reshape(sequences, positions, key_heads, size),
        v.reshape(sequences, positions, value_heads, size), g=-a_log.exp() * F.softplus(a + dt_bias),
        beta=b.sigmoid(), initial_state=state.clone(), output_final_state=True, use_qk_l2norm_in_kernel=True)
    gated = Qwen3_5RMSNormGated(size, eps=1e-6)
    gated.weight.data = norm
    theirs = gated(out.reshape(-1, size), z.reshape(-1, size)).reshape(sequences, positions, -1)
    each = []
    for isa in isas():
        ops.set_isa(isa)
        ours_state = state.clone()
        ours = ops.delta_scan(inputs, positions, conv, ours_state, a, b, z, -a_log.exp(), dt_bias, norm, key_heads,
                              1e-6)
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(ours_state, theirs_state, rtol=1e-4, atol=1e-4)
        # (delta_step's window: the kernel's last inputs, its oldest shifted out as the new one comes)
        step_window = torch.cat([torch.zeros(sequences, 1, channels), window], dim=1).transpose(1, 2).contiguous()
        step_state, steps = state.clone(), []
        for t in range(positions):
            steps.append(ops.delta_step(step_window, mixed[:, t], conv, step_state, a[:, t], b[:, t], z[:, t],
                                        -a_log.exp(), dt_bias, norm, key_heads, 1e-6))
        assert torch.equal(ours, torch.stack(steps, dim=1)) and torch.equal(ours_state, step_state)
        scatter = torch.randperm(value_heads * size, generator=g)
        scattered = ops.delta_scan(inputs, positions, conv, state.clone(), a, b, z, -a_log.exp(), dt_bias, norm,
                                   key_heads, 1e-6, scatter)
        assert torch.equal(scattered[..., scatter], ours)
        each.append((ours, ours_state))
    for ours, ours_state in each[1:]:
        assert torch.equal(ours, each[0][0]) and torch.equal(ours_state, each[0][1])
    # a prompt with no earlier inputs: its first positions convolved over zeros, as transformers pads them
    fresh = ops.delta_scan(mixed, positions, conv, state.clone(), a, b, z, -a_log.exp(), dt_bias, norm, key_heads,
                           1e-6)
    padded = ops.delta_scan(torch.cat([torch.zeros_like(window), mixed], dim=1), positions, conv, state.clone(), a,
                            b, z, -a_log.exp(), dt_bias, norm, key_heads, 1e-6)
    assert torch.equal(fresh, padded)


@pytest.mark.parametrize("groups", [1, 2])
def test_a_mamba_step_is_transformers_decode_step_of_a_mamba2_layer(groups, each_isa):
    # Granite 4.0 H's Mamba-2 layer, one position a row: transformers' own PyTorch forms (the convolution's update
    # with its bias, selective_state_update's step of each head's state, the gated norm over each group) on the same
    # window, state and products, within float32 rounding; the window and the state updated in place as
    # transformers' cache holds them. Four heads of 24 over one or two groups of B and C, a state of 40 (a vector
    # and a half of AVX-512's); one call without a convolution bias.
    import torch.nn.functional as F
    from transformers.models.granitemoehybrid.modeling_granitemoehybrid import (
        GraniteMoeHybridRMSNormGated,
        causal_conv1d_update,
        mamba2_selective_state_update,
    )

    rows, heads, size, state_size, kernel = 3, 4, 24, 40, 4
    inner = heads * size
    channels = inner + 2 * groups * state_size
    g = torch.Generator().manual_seed(5)
    window = torch.randn(rows, channels, kernel, generator=g)
    state = torch.randn(rows, heads, size, state_size, generator=g) * 0.3
    xbc, conv = torch.randn(rows, channels, generator=g), torch.randn(channels, kernel, generator=g) * 0.5
    conv_bias, dt = torch.randn(channels, generator=g) * 0.3, torch.randn(rows, heads, generator=g)
    a, d = -(torch.rand(heads, generator=g) * 2).exp(), torch.randn(heads, generator=g)
    dt_bias, z, norm = torch.randn(heads, generator=g), torch.randn(rows, inner, generator=g), torch.randn(inner,
                                                                                                          generator=g)
    for bias in (conv_bias, None):
        theirs_window, theirs_state = window.clone(), state.clone()
        x_b_c = causal_conv1d_update(xbc[:, :, None], theirs_window, conv, bias, "silu")[:, :, 0]
        x, b, c = x_b_c.split([inner, groups * state_size, groups * state_size], dim=-1)
        out = mamba2_selective_state_update(
            theirs_state, x.view(rows, heads, size), dt[:, :, None].expand(-1, -1, size),
            a[:, None, None].expand(-1, size, state_size), b.view(rows, groups, state_size),
            c.view(rows, groups, state_size), d[:, None].expand(-1, size), z=None,
            dt_bias=dt_bias[:, None].expand(-1, size), dt_softplus=True)
        gated = GraniteMoeHybridRMSNormGated(inner, group_size=inner // groups, eps=1e-5)
        gated.weight.data = norm
        theirs = gated(out.reshape(rows, inner), z)
        assert not torch.equal(theirs_state, state) and F.silu(z).abs().max() > 0
        each = []
        for isa in isas():
            torch.ops.rungen_ggml.set_isa(isa)
            ours_window, ours_state = window.clone(), state.clone()
            ours = torch.ops.rungen_ggml.mamba_step(ours_window, xbc, conv, bias, ours_state, dt, dt_bias, a, d, z,
                                                    norm, groups, 1e-5)
            torch.testing.assert_close(ours_window, theirs_window, rtol=0, atol=0)
            torch.testing.assert_close(ours_state, theirs_state, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
            each.append((ours, ours_state))
        for ours, ours_state in each[1:]:  # each instruction set's build the same bits
            assert torch.equal(ours, each[0][0]) and torch.equal(ours_state, each[0][1])
        # no norm (Falcon-H1's mixer without it): the output times silu of the gate alone
        ungated = []
        for isa in isas():
            torch.ops.rungen_ggml.set_isa(isa)
            ungated.append(torch.ops.rungen_ggml.mamba_step(window.clone(), xbc, conv, bias, state.clone(), dt,
                                                            dt_bias, a, d, z, None, groups, 1e-5))
        for ours in ungated:
            torch.testing.assert_close(ours, out.reshape(rows, inner) * F.silu(z), rtol=1e-5, atol=1e-5)
            assert torch.equal(ours, ungated[0])
    with pytest.raises(RuntimeError, match="not x, B and C"):
        torch.ops.rungen_ggml.mamba_step(window.clone(), xbc, conv, None, state[:, :2].clone(), dt, dt_bias, a, d, z,
                                         norm, groups, 1e-5)


@pytest.mark.parametrize("groups", [1, 2])
def test_a_mamba_scan_is_transformers_prompt_and_the_steps_one_by_one(groups, each_isa):
    # Nemotron-H's Mamba-2 layer over a prompt of 70 positions (past one of transformers' chunks of 64) in two
    # sequences, after earlier inputs (the cache's window of 3) and from a state: transformers' own PyTorch forms
    # (the convolution over the window and the prompt with its bias, the chunked scan with its time step limit, the
    # gated norm over each group) within float32 rounding; and to the bit what mamba_step gives taking the positions
    # one at a time (no time step limit, as a decode step has none), on every instruction set's build alike. A
    # padded position (mask 0) has its convolved x, B and C zeroed, as transformers masks them.
    from transformers.models.nemotron_h.modeling_nemotron_h import (
        NemotronHRMSNormGated,
        causal_conv1d_fn,
        mamba2_chunk_scan,
    )

    ops = torch.ops.rungen_ggml
    sequences, positions, heads, size, state_size, kernel = 2, 70, 4, 24, 40, 4
    inner = heads * size
    channels = inner + 2 * groups * state_size
    g = torch.Generator().manual_seed(6)
    window = torch.randn(sequences, kernel - 1, channels, generator=g)
    xbc = torch.randn(sequences, positions, channels, generator=g)
    state = torch.randn(sequences, heads, size, state_size, generator=g) * 0.3
    conv, conv_bias = torch.randn(channels, kernel, generator=g) * 0.5, torch.randn(channels, generator=g) * 0.3
    dt = torch.randn(sequences, positions, heads, generator=g)
    a, d = -(torch.rand(heads, generator=g) * 2).exp(), torch.randn(heads, generator=g)
    dt_bias, norm = torch.randn(heads, generator=g), torch.randn(inner, generator=g)
    z = torch.randn(sequences, positions, inner, generator=g)
    inputs = torch.cat([window, xbc], dim=1)
    mask = torch.ones(sequences, positions)
    mask[1, :5] = 0  # (the second sequence left-padded by five)

    def theirs(limit, mask):
        convolved = causal_conv1d_fn(inputs.transpose(1, 2), conv, conv_bias, "silu")[:, :, kernel - 1:]
        convolved = convolved.transpose(1, 2) * mask[:, :, None]
        x, b, c = convolved.split([inner, groups * state_size, groups * state_size], dim=-1)
        out, final = mamba2_chunk_scan(
            x.reshape(sequences, positions, heads, size), dt, a, b.reshape(sequences, positions, groups, state_size),
            c.reshape(sequences, positions, groups, state_size), chunk_size=64, D=d, dt_bias=dt_bias,
            initial_states=state.clone(), dt_softplus=True, dt_limit=(limit, float("inf")), return_final_states=True)
        gated = NemotronHRMSNormGated(inner, group_size=inner // groups, eps=1e-5)
        gated.weight.data = norm
        return gated(out.reshape(sequences, positions, inner), z), final

    each = []
    for isa in isas():
        ops.set_isa(isa)
        for limit in (0.0, 0.5):  # (0.5: above many of the time steps, which it raises)
            ours_state = state.clone()
            ours = ops.mamba_scan(inputs, positions, conv, conv_bias, ours_state, dt, dt_bias, a, d, z, norm, groups,
                                  1e-5, limit, mask)
            wanted, wanted_state = theirs(limit, mask)
            torch.testing.assert_close(ours, wanted, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(ours_state, wanted_state, rtol=1e-4, atol=1e-4)
        ours_state = state.clone()
        ours = ops.mamba_scan(inputs, positions, conv, conv_bias, ours_state, dt, dt_bias, a, d, z, norm, groups,
                              1e-5)
        step_window = torch.cat([torch.zeros(sequences, 1, channels), window], dim=1).transpose(1, 2).contiguous()
        step_state, steps = state.clone(), []
        for t in range(positions):
            steps.append(ops.mamba_step(step_window, xbc[:, t], conv, conv_bias, step_state, dt[:, t], dt_bias, a, d,
                                        z[:, t], norm, groups, 1e-5))
        assert torch.equal(ours, torch.stack(steps, dim=1)) and torch.equal(ours_state, step_state)
        # no norm (Falcon-H1's mixer without it): the steps' gated outputs alone, to the bit
        ungated = ops.mamba_scan(inputs, positions, conv, conv_bias, state.clone(), dt, dt_bias, a, d, z, None, groups,
                                 1e-5)
        step_window = torch.cat([torch.zeros(sequences, 1, channels), window], dim=1).transpose(1, 2).contiguous()
        step_state = state.clone()
        assert torch.equal(ungated, torch.stack([ops.mamba_step(step_window, xbc[:, t], conv, conv_bias, step_state,
                                                                dt[:, t], dt_bias, a, d, z[:, t], None, groups, 1e-5)
                                                 for t in range(positions)], dim=1))
        each.append((ours, ours_state))
    for ours, ours_state in each[1:]:
        assert torch.equal(ours, each[0][0]) and torch.equal(ours_state, each[0][1])
