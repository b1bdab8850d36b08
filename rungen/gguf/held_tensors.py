"""The file's tensors that make one layer only together, held by the build until all are read (HeldTensors): a
mixture's experts (gate, up and down; gpt-oss's biases too) and a weight transformers' table joins by rows from
several tensors (Granite 4.0's shared MLP: its gate and up). On the CPU they become one layer over their blocks, on a
device one over their codes where their types have them there, else their values de-quantized."""

from __future__ import annotations

import torch

from .blocks import SUPPORTED, GGMLLinear, interleavable, join, weights_per_row
from .device import DeviceForms, JoinedRows
from .device_experts import coded_experts
from .experts import ClampedSwiGLU, build_experts, dequantized_experts, expert_products, gpt_oss_dequantized
from .file import type_name, unsupported_message
from .weights import FLOAT_TYPES, GGUFError, WeightReader, check_shape, split_hint


class HeldTensors:
    """What build.py's ModelBuild holds back: `expert` and `joined_part` as it reads them, `layers` once the file is
    read. De-quantized values go to the model by `put` (QuantizingLoad's under --quantize); `forms` given (on a
    device), quantized ones take its forms there."""

    def __init__(self, path: str, reader: WeightReader, model: torch.nn.Module, dtype: torch.dtype,
                 device: torch.device | None, quantize: str | None, forms: DeviceForms | None, put):
        self.path, self.reader, self.model, self.dtype, self.device = path, reader, model, dtype, device
        self.on_device, self.quantize, self.forms, self.put = device is not None, quantize, forms, put
        self.expert_parts = {}  # a mixture's Experts module name -> its gate/up/down tensors (gpt-oss: and biases)
        self.joined = {}  # a weight joined by rows from several tensors -> (how many, {which: tensor})

    def expert(self, module_name: str, part: str, entry) -> None:
        self.expert_parts.setdefault(module_name, {})[part] = entry

    def joined_part(self, hf_name: str, which: int, count: int, entry) -> None:
        self.joined.setdefault(hf_name, (count, {}))[1][which] = entry

    def layers(self) -> dict[str, torch.nn.Module]:
        """The layers that replace the model's own, by module name; what has no such layer is put as parameters."""
        built = {}
        for module_name, parts in self.expert_parts.items():
            layer = self.experts(module_name, parts)
            if layer is not None:
                built[module_name] = layer
        for hf_name, (count, parts) in self.joined.items():
            layer = self.joined_weight(hf_name, count, parts)
            if layer is not None:
                built[hf_name.rpartition(".")[0]] = layer
        return built

    def experts(self, module_name: str, parts: dict) -> torch.nn.Module | None:
        """A mixture's experts from its tensors: on the CPU in their blocks, on a device in codes where their types
        have them there, else de-quantized into the module's own parameters (None)."""
        reader = self.reader
        biases = {name: parts.pop(name) for name in ("gate_bias", "up_bias", "down_bias") if name in parts}
        module = self.model.get_submodule(module_name)
        wanted = ("gate", "up", "down") if getattr(module, "has_gate", True) else ("up", "down")
        if any(part not in parts for part in wanted):
            layer = next(iter(parts.values())).name.rsplit(".", 2)[0]  # blk.N
            missing = [f"{layer}.ffn_{part}_exps.weight" for part in wanted if part not in parts]
            if all(name in reader.table for name in missing):
                raise GGUFError(f"{self.path}: {layer}'s experts are partly in float tensors ({missing[0]}), partly "
                                "in blocks, which this loader does not hold together on the CPU; --dequantize "
                                "runs the file")
            absent = next(name for name in missing if name not in reader.table)
            raise GGUFError(f"{self.path}: the file has no tensor {absent}{split_hint(self.path)}")
        if type(module).__name__ == "GptOssExperts":
            return self.gpt_oss_experts(module_name, module, parts, biases)
        shapes = expert_products(module).values()
        if self.on_device and self.quantize is None:
            coded = coded_experts(reader, parts, *shapes, module.act_fn, self.forms)
            if coded is not None:
                return coded
        if self.on_device or self.quantize is not None or any(part.code in FLOAT_TYPES for part in parts.values()):
            for attr, value in dequantized_experts(reader, parts, module, self.dtype,
                                                   self.device or torch.device("cpu")).items():
                self.put(f"{module_name}.{attr}", value)  # no codes on the GPU; --quantize's; floats
            return None
        return build_experts(reader, parts, *shapes, module.act_fn)

    def gpt_oss_experts(self, module_name: str, module: torch.nn.Module, parts: dict,
                        biases: dict) -> torch.nn.Module | None:
        """gpt-oss's Experts module (gate_up_proj [experts, hidden, gate and up interleaved], down_proj [experts,
        inner, hidden], their biases, the clamped SwiGLU) as experts over the file's blocks (gate rows then up rows,
        the biases in that order): GGMLExperts on the CPU; on a GPU experts in codes (coded_experts) where its types
        have them there, else its own parameters de-quantized there (None)."""
        missing = [part for part in ("gate", "up", "down") if f"{part}_bias" not in biases]
        if missing:
            layer = parts["down"].name.rsplit(".", 2)[0]
            raise GGUFError(f"{self.path}: the file has no tensor {layer}.ffn_{missing[0]}_exps.bias")
        blocks = [tensor for tensor in biases.values() if tensor.code not in FLOAT_TYPES]
        if blocks:
            raise GGUFError(f"{self.path}: tensor {blocks[0].name} is in {type_name(blocks[0].code)} blocks, "
                            "where a bias is F32, F16 or BF16")
        floats = [tensor.name for tensor in parts.values() if tensor.code in FLOAT_TYPES]
        if floats and not self.on_device:
            raise GGUFError(f"{self.path}: gpt-oss's experts in float tensors ({floats[0]}), which this loader "
                            "holds only in blocks on the CPU")
        values = {name: self.reader.float_tensor(tensor).to(self.device or "cpu", self.dtype)
                  for name, tensor in biases.items()}
        count, hidden, inner = module.gate_up_proj.shape
        shapes = (count, inner, hidden), (count, hidden, inner // 2)
        held = ((torch.cat([values["gate_bias"], values["up_bias"]], dim=-1), values["down_bias"]),
                ClampedSwiGLU(module.alpha, module.limit))
        experts = (coded_experts(self.reader, parts, *shapes, None, self.forms, *held) if self.on_device
                   else build_experts(self.reader, parts, *shapes, None, *held))
        if experts is not None:
            return experts
        del values, held  # (their copies on the GPU go before the de-quantized ones come)
        for attr, value in gpt_oss_dequantized(self.reader, parts, biases, module, self.dtype, self.device).items():
            self.put(f"{module_name}.{attr}", value)
        return None

    def joined_weight(self, hf_name: str, count: int, parts: dict) -> torch.nn.Module | None:
        """A weight transformers' table joins by rows from `count` of the file's tensors: on the CPU one product over
        their blocks (blocks.join: one layer where their types agree), on a device each part in its codes
        (JoinedRows), else their values concatenated into the parameter (None; de-quantized under --quantize, or
        where a part's type has no codes there)."""
        from gguf import GGMLQuantizationType

        path, reader = self.path, self.reader
        module_name, _, attr = hf_name.rpartition(".")
        module = self.model.get_submodule(module_name)
        if len(parts) < count:
            raise GGUFError(f"{path}: {hf_name} is joined from {count} tensors, of which the file has "
                            f"{len(parts)} ({next(iter(parts.values())).name}){split_hint(path)}")
        entries = [parts[which] for which in range(count)]
        blocks = not any(entry.code in FLOAT_TYPES for entry in entries) and self.quantize is None
        qtypes = [GGMLQuantizationType(entry.code) for entry in entries] if blocks else []
        widths = [weights_per_row(qtype, entry.shape[-1]) for qtype, entry in zip(qtypes, entries)]
        if blocks and not self.on_device:
            unsupported = [entry for entry in entries if entry.code not in SUPPORTED]
            if unsupported:
                raise GGUFError(unsupported_message(path, unsupported[0].name, unsupported[0].code))
            interleave = all(interleavable(qtype, entry.shape[0]) for qtype, entry in zip(qtypes, entries))
            layer = join([GGMLLinear(reader.rows(entry, interleave), qtype, width, interleaved=interleave)
                          for qtype, entry, width in zip(qtypes, entries, widths)])
            if layer is None:
                raise GGUFError(f"{path}: tensors {entries[0].name} and {entries[1].name}, joined into one "
                                "weight, take inputs of different widths")
            check_shape(path, entries[0].name, module, attr, (layer.out_features, layer.in_features))
            return layer
        if blocks:  # on a device: each part in its codes where its type has them there
            forms = [self.forms.keep(reader, entry, qtype, width, module, None, False)
                     for qtype, entry, width in zip(qtypes, entries, widths)]
            if not any(isinstance(form, torch.Tensor) for form in forms):
                return JoinedRows(forms)
            del forms
        device = self.device or torch.device("cpu")
        values = torch.cat([reader.float_tensor(entry).to(device, self.dtype) if entry.code in FLOAT_TYPES
                            else reader.dequantized(entry, self.dtype, device) for entry in entries])
        check_shape(path, entries[0].name, module, attr, values.shape)
        self.put(hf_name, values)
        return None
