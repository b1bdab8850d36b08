"""The architectures whose GGUF files transformers reads by its own conversion table (transformers.integrations.gguf:
Qwen3.5's qwen35 and qwen35moe, LFM2's lfm2), and those given entries of its kind (own_tables.py's OWN_TABLES, taught
to transformers here): their config is transformers' (the header reads it), and Conversion gives build.py that table
as the weights map and tensor processor it takes for the others.

A transform of values (a norm's offset, ssm_a's log) applies to the tensor's float values; a permutation of rows to
a quantized tensor's rows of blocks; a permutation of a quantized weight's columns (Qwen3.5's out_proj, which reads
the value heads llama.cpp's converter tiled) to the layer's input instead (InputPermuted), as transformers' own
GgufLinear does.
"""

from __future__ import annotations

import copy
import functools

import numpy as np
import torch

from .own_tables import OWN_TABLES


def converted(architecture: str) -> bool:
    """Whether transformers reads files of `architecture` by its conversion table (OWN_TABLES' too)."""
    from transformers.integrations.gguf import GGUF_ARCHS

    teach_own_tables()
    return architecture in GGUF_ARCHS


def teach_own_tables() -> None:
    """Adds OWN_TABLES' entries to transformers' conversion tables (idempotent)."""
    from transformers.integrations.gguf import GGUF_ARCHS, GGUF_CONFIG_ARCHS

    for architecture, (config, tensors) in OWN_TABLES.items():
        GGUF_CONFIG_ARCHS.setdefault(architecture, config)
        GGUF_ARCHS.setdefault(architecture, tensors)


class Conversion:
    """transformers' conversion table of `architecture` for `config`: a GGUF tensor's name in the model, what its
    converter does to its values (process, as transformers' tensor processors), its rows (by process, as build.py
    asks) and its columns (column_order)."""

    def __init__(self, architecture: str, config):
        from transformers.core_model_loading import WeightConverter, WeightRenaming
        from transformers.integrations.gguf import get_gguf_conversion_mapping

        # (a copy: matching a name arms the table's stateful renamings, as transformers' get_gguf_plan says)
        mapping = copy.deepcopy(get_gguf_conversion_mapping(architecture, config))
        self.renamings = [entry for entry in mapping if isinstance(entry, WeightRenaming)]
        self.converters = [entry for entry in mapping if isinstance(entry, WeightConverter)]
        self.by_pattern = {pattern: converter for converter in self.converters
                           for pattern in converter.source_patterns}

    @functools.lru_cache(maxsize=None)  # noqa: B019 (one table a build: its names asked for a few times each)
    def matched(self, name: str) -> tuple[str, str | None]:
        """(the model's name for GGUF tensor `name`, the source pattern of the table it matched or None)."""
        from transformers.core_model_loading import rename_source_key

        return rename_source_key(name, self.renamings, self.converters)

    def rename(self, name: str):
        """(the model's name for GGUF tensor `name`, its converter or None)."""
        renamed, pattern = self.matched(name)
        return renamed, self.by_pattern.get(pattern)

    def part(self, name: str) -> tuple[int, int] | None:
        """(which, of how many) where transformers joins tensor `name` with others into one weight by rows
        (ConcatenateRows: Granite 4.0's shared MLP's gate and up), else None."""
        from transformers.integrations.gguf.gguf_conversion_mapping import ConcatenateRows

        pattern = self.matched(name)[1]
        converter = self.by_pattern.get(pattern)
        if converter is None or len(converter.source_patterns) < 2 or not any(
                isinstance(op, ConcatenateRows) and op.dim == 0 for op in converter.operations):
            return None
        return converter.source_patterns.index(pattern), len(converter.source_patterns)

    def split(self, name: str) -> list[tuple[str, np.ndarray]] | None:
        """[(the model's name, the rows it takes)] for each weight transformers' table splits tensor `name` into by
        rows (SplitRows: Qwen3-Next's fused projections), else None."""
        renamed, converter = self.rename(name)
        targets = getattr(converter, "target_patterns", ())
        splits = [op for op in getattr(converter, "operations", ()) if type(op).__name__ == "SplitRows"]
        if len(targets) < 2 or not splits:
            return None
        return [(renamed.replace(targets[0], target), rows.numpy()) for target, rows in zip(targets, splits[0].rows)]

    def weights_map(self, model: torch.nn.Module, tensor_names) -> dict[str, str]:
        """GGUF tensor name -> the model's parameter, for the file's tensors the model holds (not Qwen3.5's
        multi-token prediction block, which transformers' table names mtp.*)."""
        held = set(model.state_dict())
        names = {name: self.rename(name)[0] for name in tensor_names}
        return {name: hf_name for name, hf_name in names.items() if hf_name in held}

    def column_order(self, name: str) -> torch.Tensor | None:
        """The order a quantized weight's columns take in the model (its layer's input is gathered so instead), or
        None where they keep the file's."""
        from transformers.integrations.gguf.gguf_conversion_mapping import PermuteInputFeatures

        _, converter = self.rename(name)
        operations = getattr(converter, "operations", ())
        orders = [op.permutation for op in operations if isinstance(op, PermuteInputFeatures)]
        if not orders or torch.equal(torch.as_tensor(orders[0]), torch.arange(len(orders[0]))):
            return None  # (as many value heads as key heads: the file's order is the model's)
        return orders[0]

    def process(self, weights: np.ndarray, name: str, **kwargs):
        """transformers' tensor processors' result (GGUFTensor) of tensor `name`'s values `weights` (F32/F16; BF16's
        int16 views in float32, back to that view): its converter's operations in order. A column order is left to
        the layer's input where the values are a rows-only probe (build.py's _row_permutation: one dimension)."""
        from transformers.integrations.gguf.gguf_conversion_mapping import PermuteInputFeatures
        from transformers.modeling_gguf_pytorch_utils import GGUFTensor

        hf_name, converter = self.rename(name)
        if converter is None:
            return GGUFTensor(weights, hf_name, {})
        if len(converter.source_patterns) > 1:
            raise ValueError(f"transformers joins it with {len(converter.source_patterns) - 1} other tensors, which "
                             "this loader does not do outside a mixture's experts")
        bfloat16 = weights.dtype == np.int16
        tensor = torch.from_numpy(np.ascontiguousarray(weights))
        tensor = tensor.view(torch.bfloat16).float() if bfloat16 else tensor
        for operation in converter.operations:
            if isinstance(operation, PermuteInputFeatures) and tensor.dim() < 2:
                continue
            [tensor] = operation.convert({name: tensor}, source_patterns=converter.source_patterns,
                                         target_patterns=[hf_name]).values()
        if bfloat16:
            tensor = tensor.to(torch.bfloat16).view(torch.int16)
        return GGUFTensor(tensor.numpy(), hf_name, {})


class InputPermuted(torch.nn.Module):
    """`layer` (a weight whose columns stay in the file's order) over its input's features in that order: `columns`
    the order they take in the model (Conversion.column_order)."""

    def __init__(self, layer: torch.nn.Module, columns: torch.Tensor):
        super().__init__()
        self.layer = layer
        self.register_buffer("gather", torch.argsort(columns), persistent=False)

    @property
    def bias(self):
        return self.layer.bias

    @bias.setter
    def bias(self, value):  # (build.py gives a layer its bias once built)
        self.layer.bias = value

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x.index_select(-1, self.gather))
