"""A mixture's experts on a CUDA GPU in codes (build.py's build_model given a device): each expert's gate and up rows
one layer, its down rows another, in the form device.py keeps a dense weight of their type in (coded_experts).

Where every expert of a layer is in a Triton form (4-bit codes two a byte, int8 codes) the layer is CodedExperts:
each part's codes, scales and offsets stacked in one buffer [experts, out, ...] that the experts' layers hold views
of, and a decode step's chosen experts multiplied by the GEMV kernels' grouped launch, two a layer (gate/up, down),
with nothing read back to the host: the step a CUDA graph can hold (rungen/slots.py takes such a model). A prompt's
pairs go through the tiled kernels' grouped launch, two a layer too: the pairs sorted by expert on the device, each
expert's rows in blocks of 16 (tile_layout); a prompt of more than MOST_ROWS rows an expert on average goes an
expert at a time, as GGMLExperts does (its largest experts through the GPU's own product). Elsewhere (tinygemm's
4-bit form) the layer is GGMLExperts over the experts' layers, a read of how many tokens each expert has at every
step.
"""

from __future__ import annotations

import functools

import numpy as np
import torch
from gguf import GGMLQuantizationType

from ..code_kernels import MOST_ROWS
from ..int8 import CodesLinear
from .blocks import dequantize_to, weights_per_row
from .experts import GGMLExperts, check_shapes
from .weights import FLOAT_TYPES, Tensor, WeightReader

# (token, expert) pairs a step multiplies in the GEMV kernels' grouped launch at most: a decode step's (a few rows x
# the experts a token takes); a prompt's more go to the tiled kernels' grouped launch, each expert's weight read once
# for all its tokens.
GROUPED_PAIRS = 128
TILE_ROWS = 16  # the tiled kernels' rows a block (their BLOCK_M): a block holds one expert's pairs


def tile_layout(experts: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A prompt's (token, expert) pairs (experts [P]: each pair's expert, of `count`) laid out for the tiled kernels'
    grouped launch, on the device with nothing read back: each expert's pairs in order in whole blocks of TILE_ROWS
    rows. (tiles [T]: each block's expert, -1 past the last; positions [P]: each pair's row; owner [TILE_ROWS x T]:
    the pair at each row, -1 none), T = ceil(P / TILE_ROWS) + count, what the blocks need at most."""
    pairs, device = experts.shape[0], experts.device
    order = torch.argsort(experts, stable=True)
    ordered = experts[order]
    # (bincount would read its largest value back to the host to size its output)
    counts = torch.zeros(count, dtype=torch.long, device=device).index_add_(0, experts, torch.ones_like(experts))
    blocks = (counts + TILE_ROWS - 1) // TILE_ROWS
    first_row = (torch.cumsum(blocks, 0) - blocks) * TILE_ROWS  # each expert's first row
    first_pair = torch.cumsum(counts, 0) - counts  # each expert's first pair in the sorted order
    rows = first_row[ordered] + torch.arange(pairs, device=device) - first_pair[ordered]
    positions = torch.empty_like(rows).index_copy_(0, order, rows)
    total = (pairs + TILE_ROWS - 1) // TILE_ROWS + count
    tiles = torch.full((total,), -1, dtype=torch.int32, device=device)
    tiles[rows // TILE_ROWS] = ordered.to(torch.int32)  # (a block's rows all write its one expert)
    owner = torch.full((TILE_ROWS * total,), -1, dtype=torch.int32, device=device)
    owner[rows] = order.to(torch.int32)
    return tiles, positions, owner


def coded_experts(reader: WeightReader, parts: dict[str, Tensor], gate_up_shape: tuple, down_shape: tuple, act_fn,
                  forms, biases: tuple[torch.Tensor, torch.Tensor] | None = None,
                  gating: torch.nn.Module | None = None) -> GGMLExperts | None:
    """The experts of a layer's three expert tensors over layers of codes (`forms`: device.py's DeviceForms), in
    place of an Experts module of these shapes (build_experts'; `biases` and `gating`: gpt-oss's): CodedExperts where
    they all took a Triton form with a grouped launch, else GGMLExperts; None where a part's type has no codes on the
    GPU (float tensors, gate and up of two types, types the GPU de-quantizes, a kernel that failed its check): the
    caller then de-quantizes the layer. GGUFError where the tensors' shapes are not the module's. Experts without a
    gate (parts up and down) hold their up rows alone."""
    check_shapes(reader, parts, gate_up_shape, down_shape)
    gate, up, down = parts.get("gate", parts["up"]), parts["up"], parts["down"]
    gated = "gate" in parts
    if gate.code != up.code or any(tensor.code in FLOAT_TYPES for tensor in (gate, down)):
        return None
    qtype, down_type = GGMLQuantizationType(gate.code), GGMLQuantizationType(down.code)
    width = {name: weights_per_row(GGMLQuantizationType(t.code), t.shape[-1]) for name, t in parts.items()}

    def made(blocks: np.ndarray, qtype: GGMLQuantizationType, in_features: int):
        dequantized = functools.partial(dequantize_to, blocks, qtype, in_features, forms.dtype, forms.device)
        return forms.codes_layer(blocks, qtype, in_features, None, dequantized, grouped=True)

    gate_up, down_layers = [], []
    for e in range(up.shape[0]):
        gate_rows, up_rows, down_rows = (reader.blocks(reader.expert(part, e)) for part in (gate, up, down))
        gate_up.append(made(np.concatenate([gate_rows, up_rows]) if gated else up_rows, qtype, width["up"]))
        down_layers.append(made(down_rows, down_type, width["down"]))
        if gate_up[-1] is None or down_layers[-1] is None:  # (the first expert's: forms decide a type at its first)
            return None
    if all(stackable(layers) for layers in (gate_up, down_layers)):
        return CodedExperts(gate_up, down_layers, act_fn, biases, gating, gated)
    return GGMLExperts(gate_up, down_layers, act_fn, biases, gating, gated)


def stackable(layers: list[torch.nn.Module]) -> bool:
    """Whether `layers` (a part's experts) are one Triton form alike, whose kernel has a grouped launch."""
    first = layers[0]
    return (isinstance(first, CodesLinear) and hasattr(first.kernel, "grouped")
            and len({(type(layer), layer.codes.shape, layer.codes.dtype, layer.scales.shape, layer.scales.dtype,
                      None if layer.offsets is None else layer.offsets.shape, layer.kernel) for layer in layers}) == 1)


def stack(layers: list[CodesLinear]) -> dict[str, torch.Tensor | None]:
    """{"codes", "scales", "offsets"}: each stacked over `layers` [experts, ...], the layers now holding views of
    them (the experts' own tensors freed as each part is stacked: a part's codes twice for a moment, not the
    layer's); a table of levels as offsets (rungen/int4_kernel.py's level_pairs) is the one every expert reads."""
    stacked = {}
    if layers[0].offsets is not None and layers[0].offsets.dim() == 1:
        stacked["offsets"] = layers[0].offsets
    for name in ("codes", "scales", "offsets"):
        if name in stacked:
            continue
        parts = [getattr(layer, name) for layer in layers]
        stacked[name] = None if parts[0] is None else torch.stack(parts)
        for e, layer in enumerate(layers):
            setattr(layer, name, None if parts[0] is None else stacked[name][e])
        del parts
    return stacked


class CodedExperts(GGMLExperts):
    """A layer's experts in a Triton form, each part's codes stacked (stack): forward(hidden [tokens, hidden],
    top_k_index, top_k_weights) as transformers' Experts modules compute it, in two grouped launches with no read on
    the host: a decode step's GROUPED_PAIRS (token, expert) pairs at most on the GEMV kernels, a prompt's on the
    tiled ones to MOST_ROWS rows an expert on average; more an expert at a time."""

    captures_decode = True  # (rungen/slots.py: its model's decode step may be a CUDA graph, to most_pairs pairs)
    most_pairs = GROUPED_PAIRS

    def __init__(self, gate_up: list[CodesLinear], down: list[CodesLinear], act_fn,
                 biases: tuple[torch.Tensor, torch.Tensor] | None = None, gating: torch.nn.Module | None = None,
                 gated: bool = True):
        super().__init__(gate_up, down, act_fn, biases, gating, gated)
        self.kernel = gate_up[0].kernel, down[0].kernel
        self.stacks = stack(gate_up), stack(down)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        if top_k_index.numel() > MOST_ROWS * self.num_experts:
            return super().forward(hidden_states, top_k_index, top_k_weights)
        tokens, chosen = top_k_index.shape
        path = self._paired if top_k_index.numel() <= self.most_pairs else self._tiled
        done = path(hidden_states, top_k_index.reshape(-1), chosen)  # [pair, hidden], a pair's expert's output
        weighted = done.float() * top_k_weights.reshape(-1, 1).float()
        return weighted.view(tokens, chosen, -1).sum(dim=1).to(hidden_states.dtype)

    def _paired(self, hidden_states: torch.Tensor, experts: torch.Tensor, chosen: int) -> torch.Tensor:
        """Each pair's expert over its token (pair p: token p // chosen), a program a pair (the GEMV kernels)."""
        which = experts.to(torch.int32)
        pairs = torch.arange(which.shape[0], dtype=torch.int32, device=which.device)
        gate_up = self._grouped(0, hidden_states, torch.stack([which, pairs // chosen], dim=1))
        down = self._grouped(1, self.gated(gate_up, experts), torch.stack([which, pairs], dim=1))
        return down if self.down_bias is None else down + self.down_bias[experts]

    def _tiled(self, hidden_states: torch.Tensor, experts: torch.Tensor, chosen: int) -> torch.Tensor:
        """_paired's result in blocks of 16 rows an expert (tile_layout's), on the tiled kernels' grouped launch."""
        tiles, positions, owner = tile_layout(experts, self.num_experts)
        held = owner >= 0
        token_rows = torch.where(held, owner // chosen, -1).to(torch.int32)
        own_rows = torch.where(held, torch.arange(owner.shape[0], device=owner.device, dtype=torch.int32), -1)
        # (rows of no pair hold what the buffer held: never read, the launches skip them)
        gate_up = self._blocks(0, hidden_states, tiles, token_rows)
        row_experts = tiles.clamp(min=0).repeat_interleave(TILE_ROWS)  # (a block of no expert's: never read)
        down = self._blocks(1, self.gated(gate_up, row_experts), tiles, own_rows)[positions]
        return down if self.down_bias is None else down + self.down_bias[experts]

    def _blocks(self, which: int, x: torch.Tensor, tiles: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Row m of the result: x[rows[m]] times block m // TILE_ROWS's expert's gate/up (`which` 0) or down (1)."""
        held = self.stacks[which]
        return self.kernel[which].grouped_tiles(x.contiguous(), held["codes"], held["scales"], held["offsets"],
                                                tiles, rows)

    def _grouped(self, which: int, x: torch.Tensor, pairs: torch.Tensor) -> torch.Tensor:
        """Row p of the result: x[pairs[p, 1]] times expert pairs[p, 0]'s gate/up (`which` 0) or down (1)."""
        held = self.stacks[which]
        return self.kernel[which].grouped(x.contiguous(), held["codes"], held["scales"], held["offsets"],
                                          pairs.contiguous())
