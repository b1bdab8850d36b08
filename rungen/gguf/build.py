"""A GGUF file's model: transformers' causal LM of its config, built on meta and given the file's weights tensor by
tensor (ModelBuild). On the CPU quantized weights stay in the file's blocks, memory-mapped, never converted to
float32: GGMLLinear layers over views of one memory map (read into memory where their rows are interleaved for the
kernels), a quantized embedding GGMLEmbedding, a mixture's experts GGMLExperts; F32/F16/BF16 weights keep their dtype.
On a device the forms device.py keeps them in there. GGUF names map to parameters by transformers' own tables; a
processor's transform of quantized blocks is applied only when it permutes rows (llama's q/k heads), otherwise that
tensor alone is de-quantized.
"""

from __future__ import annotations

import functools
import logging

import numpy as np
import torch

from ..int8 import CodesEmbedding
from .blocks import (
    SUPPORTED,
    CastEmbedding,
    CastLinear,
    GGMLEmbedding,
    GGMLLinear,
    dequantize,
    interleavable,
    weights_per_row,
)
from .conv_steps import conv_steps
from .conversions import Conversion, InputPermuted, converted
from .decoder import FUSED_WEIGHTS, fusable, fuse_decoder_layers
from .delta_steps import delta_steps
from .device import DeviceForms
from .experts import holds_experts, mixtures_in_one_call, part_of, route_rows_alike
from .families import WITH_EXPERTS
from .file import GGUFHeader, read_as_their_likes, unsupported_message
from .granite_steps import granite_steps
from .held_tensors import HeldTensors
from .latent_attention import absorb_latents
from .llama4 import llama4_lookup, llama4_mixtures
from .native_steps import GpuKernelHints, steps_natively
from .table import first_line
from .weights import FLOAT_TYPES, GGUFError, WeightReader, as_torch, check_shape, split_hint

logger = logging.getLogger("run_generation")


def build_model(header: GGUFHeader, dtype: torch.dtype, device: torch.device | None = None,
                quantize: str | None = None) -> torch.nn.Module:
    """The causal LM of `header`'s config over the file's weights. Given a `device`, quantized weights take the forms
    device.py's DeviceForms keeps them in there (codes for a checked kernel, an embedding's blocks), else are
    de-quantized to `dtype` a chunk of rows at a time (never whole in float32); with `quantize` (--quantize's mode)
    the linear layers' are de-quantized, and each block's layers quantized as soon as their weights are in
    (rungen/quantize.py)."""
    build = ModelBuild(header, dtype, device, quantize)
    for entry in build.reader.tensors:
        build.take(entry)
    build.place_collected()
    build.layers.update(build.held.layers())
    return build.finish()


class ModelBuild:
    """One build_model: the model on meta, each of the file's tensors taken into it (take; those that make a layer only
    together held in `held` until all are read), then the layers that replace the model's own set in place
    (finish)."""

    def __init__(self, header: GGUFHeader, dtype: torch.dtype, device: torch.device | None, quantize: str | None):
        from accelerate import init_empty_weights
        from transformers import AutoModelForCausalLM
        from transformers.initialization import no_init_weights

        self.header, self.dtype, self.device, self.quantize = header, dtype, device, quantize
        self.on_device = on_device = device is not None
        config = self.config = header.config
        # Parameters on meta; buffers real: rotary inv_freq and the like are computed in __init__, not in the file.
        with init_empty_weights(include_buffers=False), no_init_weights():
            model = self.model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        llama4_mixtures(model)  # (Llama 4's experts as the blocks take them)
        self.processor = tensor_processor(header.architecture, config)
        self.converted = isinstance(self.processor, Conversion)
        names = self.names = header.weights_map(model, self.processor)

        self.reader = WeightReader(header.path, header.tensors)
        # Weights that FusedDecoderLayer concatenates are read into memory: the concatenation copies them.
        self.fused = FUSED_WEIGHTS if fusable(model) and not on_device else ()
        # A tied head multiplies the embedding's blocks, interleaved for the kernels (the lookup reads either layout).
        self.tied_embedding = self.head_reads_embedding = None
        head = model.get_output_embeddings()
        if getattr(config, "tie_word_embeddings", False) and head is not None:
            head_name = next(n for n, m in model.named_modules() if m is head) + ".weight"
            in_file = {name for name, *_ in header.tensors}
            self.head_reads_embedding = not any(names.get(name) == head_name for name in in_file)
            if self.head_reads_embedding and not on_device:
                embedding = model.get_input_embeddings()
                self.tied_embedding = next(n for n, m in model.named_modules() if m is embedding)
        self.forms = DeviceForms(device, dtype) if on_device else None
        self.put = functools.partial(_set_tensor, model)
        if quantize is not None:
            from ..quantize import QuantizingLoad

            # Tied only where the file has no head of its own, as transformers (Falcon's files hold both, and differ).
            self.quantizing = QuantizingLoad(model, quantize, device, dtype, tie=bool(self.head_reads_embedding))
            self.put = self.quantizing.put
        # What processors that merge or split tensors (MoE experts) leave; on a device, each goes there as stored.
        self.collected = {"tensors": _Placed(device, dtype) if on_device else {}}
        self.biases = {}  # module name -> bias, given to the layer that ends up there
        self.layers = {}  # module name -> the layer that replaces the model's own
        self.held = HeldTensors(header.path, self.reader, model, dtype, device, quantize, self.forms, self.put)

    def take(self, entry) -> None:
        """One of the file's tensors into the model: a parameter set, a layer that replaces the model's own, or (a
        mixture's expert tensor) held until the layer's three are known."""
        name, code = entry.name, entry.code
        hf_name = self.names.get(name)
        if hf_name is None:
            return  # as transformers: tensors the model does not hold (e.g. llama3's rope_freqs)
        if self.converted and (split := self.processor.split(name)) is not None:  # (Qwen3-Next's fused projections)
            for target, rows in split:
                self.weight_tensor(entry, target, self.model.get_submodule(target.rpartition(".")[0]), rows)
            return
        module_name = hf_name.rpartition(".")[0]
        module = self.model.get_submodule(module_name)
        part = part_of(name)
        if part is not None and type(module).__name__ == "GptOssExperts":
            # gpt-oss's: the three weights and their biases, built as GGMLExperts
            self.held.expert(module_name, part if name.endswith(".weight") else f"{part}_bias", entry)
        # (on a device, under --quantize or for transformers' conversion table (which joins gate and up) of any type,
        # float ones too: de-quantized or cast an expert at a time)
        elif part is not None and holds_experts(module) and (
                code in SUPPORTED or self.on_device or self.quantize is not None or self.converted):
            self.held.expert(module_name, part, entry)  # built once the layer's three are known
        elif self.converted and (joined := self.processor.part(name)) is not None:
            self.held.joined_part(hf_name, *joined, entry)  # built once all are known
        else:
            self.weight_tensor(entry, hf_name, module)

    def weight_tensor(self, entry, hf_name: str, module: torch.nn.Module, rows: np.ndarray | None = None) -> None:
        """A tensor (`rows`: those of it, where the table splits it) as float values or blocks, by its type."""
        if entry.code in FLOAT_TYPES:
            self.float_tensor(entry, hf_name, module, rows)
        else:
            self.blocks_tensor(entry, hf_name, module, rows)

    def float_tensor(self, entry, hf_name: str, module: torch.nn.Module, rows: np.ndarray | None = None) -> None:
        """An F32/F16/BF16 tensor (`rows`: those of it, where the table splits it): on the CPU in its own dtype where
        the model's differs (CastLinear, CastEmbedding), a linear layer's bias kept for the layer it ends up in."""
        from gguf import GGMLQuantizationType
        from transformers.modeling_gguf_pytorch_utils import GGUFTensor
        from transformers.pytorch_utils import Conv1D

        name, code, dtype = entry.name, entry.code, self.dtype
        module_name, _, attr = hf_name.rpartition(".")
        raw = self.reader.values(entry)
        result = (_process(self.processor, self.header, name, raw, self.names, self.collected) if rows is None
                  else GGUFTensor(raw := np.ascontiguousarray(raw[rows]), hf_name, {}))
        if result.name is None:
            return  # the processor stored it in `collected`
        if code == GGMLQuantizationType.BF16 and result.weights.dtype != np.int16:
            raise GGUFError(f"{self.header.path}: tensor {name} is BF16, which this architecture's transform "
                            "cannot take here; --dequantize loads it in float32")
        tensor = _unsqueezed(as_torch(raw if result.weights is raw else np.ascontiguousarray(result.weights), code),
                             module, attr)
        check_shape(self.header.path, name, module, attr, tensor.shape)
        if self.on_device:
            self.put(hf_name, tensor.to(device=self.device, dtype=dtype))
        elif attr == "bias" and isinstance(module, (torch.nn.Linear, Conv1D)):
            self.biases[module_name] = tensor.to(dtype)
        elif attr == "weight" and tensor.dtype != dtype and isinstance(module, torch.nn.Linear):
            self.layers[module_name] = CastLinear(tensor, None)
        elif attr == "weight" and tensor.dtype != dtype and isinstance(module, torch.nn.Embedding):
            self.layers[module_name] = CastEmbedding(tensor, dtype, getattr(module, "embed_scale", None))
        else:
            _set_tensor(self.model, hf_name, tensor.to(dtype))  # norms, or weights already in the model's dtype

    def blocks_tensor(self, entry, hf_name: str, module: torch.nn.Module, rows: np.ndarray | None = None) -> None:
        """A quantized tensor (`rows`: those of it, where the table splits it): a linear layer's or an embedding's
        weight in its blocks (on a device: the form DeviceForms keeps), else (a transform only float values can take)
        de-quantized alone."""
        from gguf import GGMLQuantizationType
        from transformers.modeling_gguf_pytorch_utils import GGUFTensor
        from transformers.pytorch_utils import Conv1D

        name, code, shape, reader, on_device = entry.name, entry.code, entry.shape, self.reader, self.on_device
        module_name, _, attr = hf_name.rpartition(".")
        if code not in SUPPORTED and not on_device:  # de-quantized, any type the gguf package reads will do
            raise GGUFError(unsupported_message(self.header.path, name, code))
        qtype = GGMLQuantizationType(code)
        in_features = weights_per_row(qtype, shape[-1])
        out_features = shape[0] if rows is None else len(rows)
        if len(shape) == 2 and attr == "weight" and isinstance(module, (torch.nn.Linear, Conv1D, torch.nn.Embedding)):
            check_shape(self.header.path, name, module, attr,
                        (in_features, out_features) if isinstance(module, Conv1D) else (out_features, in_features))
            order = _row_permutation(self.processor, name, shape[0]) if rows is None else rows
            embedding = isinstance(module, torch.nn.Embedding)
            columns = self.processor.column_order(name) if self.converted else None
            if on_device and order is not False:
                if self.quantize is not None and not embedding:  # quantized by put
                    form = reader.dequantized(entry, self.dtype, self.device, order)
                else:
                    form = self.forms.keep(reader, entry, qtype, in_features, module, order,
                                           embedding and self.head_reads_embedding)
                if isinstance(form, torch.Tensor) and isinstance(module, Conv1D):  # de-quantized, stored transposed
                    # (a view for QuantizingLoad, which quantizes the rows as they are)
                    self.put(hf_name, form.t() if self.quantize is not None else form.t().contiguous())
                elif isinstance(form, torch.Tensor):
                    self.put(hf_name, form[:, columns.to(form.device)] if columns is not None else form)
                else:
                    self.layers[module_name] = form if columns is None else InputPermuted(form, columns)
                return
            interleave = (not embedding or module_name == self.tied_embedding) and interleavable(qtype, out_features)
            if order is not False:
                blocks = reader.rows(entry, interleave, order, read=hf_name.endswith(self.fused))
                if embedding:
                    self.layers[module_name] = GGMLEmbedding(blocks, qtype, in_features, self.dtype,
                                                             getattr(module, "embed_scale", None),
                                                             interleaved=interleave)
                else:  # GGUF rows are output channels, also for GPT-2's transposed Conv1D
                    layer = GGMLLinear(blocks, qtype, in_features, interleaved=interleave)
                    self.layers[module_name] = layer if columns is None else InputPermuted(layer, columns)
                return
        # A transform only float values can take: this tensor alone is de-quantized, as transformers does.
        logger.info("GGUF tensor %s (%s) de-quantized to float: its layout needs it", name, qtype.name)
        values = dequantize(torch.from_numpy(reader.blocks(entry).reshape(-1, shape[-1])), qtype, in_features)
        values = values.numpy().reshape(*shape[:-1], in_features)
        result = (_process(self.processor, self.header, name, values, self.names, self.collected) if rows is None
                  else GGUFTensor(values[rows], hf_name, {}))
        if result.name is not None:
            check_shape(self.header.path, name, module, attr, result.weights.shape)
            self.put(hf_name, torch.from_numpy(np.ascontiguousarray(result.weights)).to(self.device, self.dtype))

    def place_collected(self) -> None:
        """What processors that merge or split tensors left in `collected`, set in the model."""
        for hf_name, value in self.collected["tensors"].items():
            self.put(hf_name, value.to(self.device, self.dtype))

    def finish(self) -> torch.nn.Module:
        """The model with its layers in place, eval mode, on the device (quantized where asked)."""
        from transformers.pytorch_utils import Conv1D

        model, layers = self.model, self.layers
        _activations_from_keys(model, self.config)
        if self.on_device:
            for module_name, layer in layers.items():  # weights kept in codes or blocks
                if isinstance(model.get_submodule(module_name), (torch.nn.Linear, Conv1D)):  # a linear layer's bias
                    bias = model.get_submodule(module_name).bias
                    layer.bias = bias if bias is not None and bias.device.type != "meta" else None
                model.set_submodule(module_name, layer)
            layers.clear()
            _tie_head(model, self.config)
            llama4_lookup(model)
            model = _finish_built(self.header, model, self.names, self.device)
            return model if self.quantize is None else self.quantizing.finish(self.header.path)

        for module_name, layer in layers.items():
            if module_name in self.biases:
                layer.bias = self.biases.pop(module_name)
            model.set_submodule(module_name, layer)
        for module_name, bias in self.biases.items():
            model.get_submodule(module_name).bias = torch.nn.Parameter(bias, requires_grad=False)
        _tie_head(model, self.config)
        llama4_lookup(model)
        layers.clear()  # the model holds them now: fused layer by layer, each layer's parts are freed as it goes
        route_rows_alike(model)
        mixtures_in_one_call(model)
        fuse_decoder_layers(model)
        steps_natively(model)
        delta_steps(model)
        conv_steps(model)
        granite_steps(model)
        absorb_latents(model)
        GpuKernelHints.quiet()  # (on the CPU no CUDA kernel package would take a recurrent layer's PyTorch forms)
        return _finish_built(self.header, model, self.names)


def tensor_processor(architecture: str, config):
    """transformers' tensor processor of the file's architecture; for a family llama.cpp writes under another's
    architecture with experts (Mixtral's), that architecture's with the experts mapped as Qwen-MoE's processor maps
    them (transformers has none for it)."""
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, Qwen2MoeTensorProcessor, TensorProcessor

    if converted(architecture):
        return Conversion(architecture, config)
    read_as_their_likes()
    own = TENSOR_PROCESSORS.get(architecture, TensorProcessor)
    if WITH_EXPERTS.get(architecture) != config.model_type:
        return own(config=config.to_dict())

    class WithExperts(own, Qwen2MoeTensorProcessor):  # names as Qwen-MoE's processor maps them (the MRO's second)
        def process(self, weights, name, **kwargs):
            if Qwen2MoeTensorProcessor.GGUF_MOE_WEIGHTS_PATTERN.fullmatch(name):
                return Qwen2MoeTensorProcessor.process(self, weights, name, **kwargs)
            return own.process(self, weights, name, **kwargs)

    return WithExperts(config=config.to_dict())


def _row_permutation(processor, name: str, rows: int):
    """The processor's transform of tensor `name` as a permutation of its rows: None when it is the
    identity, an index array when it permutes rows, False when it is anything else. A tensor the processor stores
    whole and unchanged under its own parameter's name (GPT-2's output.weight, kept apart from attn_output's
    transpose) is the identity too."""
    stored = {"tensors": {}}
    try:
        result = processor.process(weights=np.arange(rows), name=name, tensor_key_mapping={},
                                   parsed_parameters=stored)
    except Exception:  # a transform that needs the real shape (a reshape across columns)
        return False
    if result.name is None and len(stored["tensors"]) == 1:
        [order] = stored["tensors"].values()
        order = np.asarray(order)
        return None if order.shape == (rows,) and np.array_equal(order, np.arange(rows)) else False
    order = result.weights
    if result.name is None or not isinstance(order, np.ndarray) or order.shape != (rows,):
        return False
    if np.array_equal(order, np.arange(rows)):
        return None
    return order if np.array_equal(np.sort(order), np.arange(rows)) else False


def _set_tensor(model, hf_name: str, value: torch.Tensor):
    module_name, _, attr = hf_name.rpartition(".")
    module = model.get_submodule(module_name)
    if isinstance(getattr(module, attr, None), torch.nn.Parameter) or attr in module._parameters:
        module._parameters[attr] = torch.nn.Parameter(value, requires_grad=False)
    else:
        setattr(module, attr, value)


def _process(processor, header: GGUFHeader, name: str, weights: np.ndarray, names: dict, collected: dict):
    """transformers' processor on one tensor; a shape it cannot take is a GGUFError."""
    try:
        return processor.process(weights=weights, name=name, tensor_key_mapping=names, parsed_parameters=collected)
    except (ValueError, IndexError, RuntimeError) as error:
        raise GGUFError(f"{header.path}: tensor {name} {list(weights.shape)}: {first_line(error)}") from None


class _Placed(dict):
    """Tensors that go to `device` in `dtype` as they are stored: a processor's MoE experts (a layer's up to GBs in
    float32) reach the GPU one tensor at a time, never all held in host memory. Processors store whole tensors, or
    zeros they then copy halves into (which the device's tensor takes)."""

    def __init__(self, device: torch.device, dtype: torch.dtype):
        super().__init__()
        self.device, self.dtype = device, dtype

    def __setitem__(self, name: str, value: torch.Tensor) -> None:
        super().__setitem__(name, value.to(self.device, self.dtype))


def _finish_built(header: GGUFHeader, model: torch.nn.Module, names: dict, device: torch.device | None = None):
    """The built model in eval mode, on `device`, its weights map cached; GGUFError when a parameter found no
    tensor in the file."""
    missing = [name for name, p in [*model.named_parameters(), *model.named_buffers()] if p.device.type == "meta"]
    if missing:
        raise GGUFError(f"{header.path}: the file has no tensor for {missing[0]}"
                        + (f" and {len(missing) - 1} more" if len(missing) > 1 else "") + split_hint(header.path))
    header.keep_weights_map(names)
    if device is not None:
        model.to(device)
    model.eval()
    return model


def _unsqueezed(tensor: torch.Tensor, module: torch.nn.Module, attr: str) -> torch.Tensor:
    """`tensor` as the parameter it replaces is shaped where they differ only in dimensions of 1: llama.cpp's
    quantizer writes a [1, n] tensor (ERNIE 4.5's router correction, as its converter writes it) as [n]."""
    expected = getattr(module, attr, None)
    if isinstance(expected, torch.Tensor) and tuple(expected.shape) != tuple(tensor.shape) and \
            [size for size in expected.shape if size != 1] == [size for size in tensor.shape if size != 1]:
        return tensor.reshape(expected.shape)
    return tensor


def _activations_from_keys(model, config) -> None:
    """Each layer's xIELU (Apertus's) as its file's keys give it (config.xielu, configs.py's _apertus_config): its
    parameters and buffers, which no tensor holds."""
    values = getattr(config, "xielu", None)
    if not values:
        return
    for number, layer in enumerate(model.model.layers):
        activation = layer.mlp.act_fn
        for part in ("alpha_p", "alpha_n"):
            activation._parameters[part] = torch.nn.Parameter(torch.tensor([values[part][number]]),
                                                              requires_grad=False)
        activation.beta, activation.eps = (torch.tensor(values[part][number]) for part in ("beta", "eps"))
        activation._beta_scalar, activation._eps_scalar = values["beta"][number], values["eps"][number]


def _tie_head(model, config):
    """A tied output head reads the input embedding's own tensor: blocks, or a float table."""
    if not getattr(config, "tie_word_embeddings", False):
        return
    head = model.get_output_embeddings()
    if head is None or not isinstance(head, torch.nn.Linear) or head.weight.device.type != "meta":
        return  # the file had its own output tensor
    embedding = model.get_input_embeddings()
    name = next(n for n, m in model.named_modules() if m is head)
    bias = head.bias if head.bias is not None and head.bias.device.type != "meta" else None
    if isinstance(embedding, GGMLEmbedding):
        model.set_submodule(name, GGMLLinear(embedding.blocks, embedding.qtype, embedding.embedding_dim, bias,
                                             interleaved=embedding.interleaved))
    elif isinstance(embedding, CastEmbedding):
        model.set_submodule(name, CastLinear(embedding.weight, bias))
    elif isinstance(embedding, CodesEmbedding):
        embedding.head.bias = bias
        model.set_submodule(name, embedding.head)
    else:
        head.weight = embedding.weight


