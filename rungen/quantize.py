"""--quantize {int8,int4}: weight-only quantization of the linear layers and the output head, on torch's CPU kernels
(on a GPU: rungen/int8.py's Triton kernel; for int4 torch's tinygemm, or rungen/int4_kernel.py's Triton kernel where
tinygemm cannot run in half precision; the head keeps the model's dtype there).

Weights are int8 (one symmetric scale per output channel) or 4-bit codes (groups of 32 inputs, a scale and a zero
each); both kernels want bfloat16 activations, so a layer casts its input to bfloat16 and its output back, and the
rest of the model keeps its dtype. The output head is float16 (fbgemm's linear_dynamic_fp16; int8 without fbgemm):
a 4-bit head costs far more quality than the rest, and the float16 one no speed (docs/performance.md). Sibling
projections of one input (q/k/v, gate/up) become one matmul: at one token a step a call costs about as much as its
weights.
"""

from __future__ import annotations

import json
import os

import torch
from transformers.pytorch_utils import Conv1D

from .errors import UsageError
from .host_memory import release_freed_memory
from .int4 import GPU_INT4_ENV, GROUP_SIZE, Int4Linear, TinyGemmLinear, checked_tinygemm, int4_groups
from .int4_kernel import CHUNK, CudaInt4Linear, checked_int4_kernel, gpu_int4_form
from .int8 import Int8Linear, cuda_int8_layers

MODES = ("int8", "int4")
# Projections a block applies to one input, by the names the supported models give them.
SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class QuantizeError(UsageError):
    """A model or device --quantize cannot handle; one line, for the user."""


class Fp16Linear(torch.nn.Module):
    format = "float16"

    def __init__(self, weight, bias):
        super().__init__()
        bias = None if bias is None else bias.detach().float()
        self.packed = torch.ops.quantized.linear_prepack_fp16(weight.detach().float().contiguous(), bias)
        self.out_features, self.in_features = weight.shape

    def forward(self, x):
        return torch.ops.quantized.linear_dynamic_fp16(x.float(), self.packed).to(x.dtype)


def head_class() -> type[torch.nn.Module]:
    """The output head's layer: float16 through fbgemm where torch has it (every x86 build), else int8."""
    return Fp16Linear if "fbgemm" in torch.backends.quantized.supported_engines else Int8Linear


class Fused(torch.nn.Module):
    """One quantized matmul for sibling projections of the same input, each `Part` taking its rows; the product is
    kept until every part has taken its own and recomputed for a new input, so any calling order is right."""

    def __init__(self, layer, parts):
        super().__init__()
        self.layer, self.parts = layer, parts
        self._input, self._output, self._served = None, None, set()

    def rows(self, x, part):
        if x is not self._input or part in self._served:
            self._input, self._output, self._served = x, self.layer(x), set()
        self._served.add(part)
        output = self._output
        if len(self._served) == self.parts:  # all taken: do not hold the step's tensors
            self._input, self._output, self._served = None, None, set()
        return output


class Part(torch.nn.Module):
    def __init__(self, fused, part, start, end):
        super().__init__()
        self.fused, self.part, self.start, self.end = fused, part, start, end
        self.in_features, self.out_features = fused.layer.in_features, end - start

    def forward(self, x):
        return self.fused.rows(x, self.part)[..., self.start:self.end]


def _weight_of(module):
    """A layer's weight as [out_features, in_features], or None for a layer this does not handle."""
    if isinstance(module, torch.nn.Linear):
        return module.weight
    if isinstance(module, Conv1D):  # GPT-2's linear layers, stored transposed
        return module.weight.t()
    return None


def _fused_siblings(module, layers, layer_class):
    """Replaces each group of SIBLINGS in `layers` by Parts of one Fused layer; returns the names replaced."""
    done = []
    for names in SIBLINGS:
        if not all(name in layers for name in names):
            continue
        weights = [layers[name][0] for name in names]
        if len({w.shape[1] for w in weights}) != 1 or len({w.dtype for w in weights}) != 1:
            continue
        biases = [layers[name][1] for name in names]
        bias = None
        if any(b is not None for b in biases):
            bias = torch.cat([b if b is not None else w.new_zeros(w.shape[0]) for w, b in zip(weights, biases)])
        fused = Fused(layer_class(torch.cat(weights), bias), len(names))
        start = 0
        for part, (name, weight) in enumerate(zip(names, weights)):
            setattr(module, name, Part(fused, part, start, start + weight.shape[0]))
            start += weight.shape[0]
        done.extend(names)
    return done


def _targets(model, mode, multiple=GROUP_SIZE):
    """{parent module: {child name: child}} for every linear layer --quantize replaces, and the output
    head; raises QuantizeError for a layer `mode` cannot hold (int4: inputs not a multiple of `multiple`)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    targets = {}
    for name, module in model.named_modules():
        for child_name, child in module.named_children():
            weight = _weight_of(child)
            if weight is None:
                continue
            if child is not head and mode == "int4" and weight.shape[1] % multiple:
                unit = (f"the group size {GROUP_SIZE}" if multiple == GROUP_SIZE
                        else f"{multiple} (the 4-bit kernel's chunk of two groups)")
                raise QuantizeError(f"--quantize int4: layer {name}.{child_name} has {weight.shape[1]} input "
                                    f"channels, not a multiple of {unit}; use int8")
            targets.setdefault(module, {})[child_name] = child
    if not targets:
        raise QuantizeError(f"--quantize: {model.config.model_type} has no linear layers to quantize")
    _check_experts(model, mode, sum(_weight_of(child).numel() for children in targets.values()
                                    for child in children.values()))
    return targets, head


def _check_experts(model, mode, quantized):
    """QuantizeError where more weights stay out of the linear layers than go in: a mixture of experts' stacked
    expert tensors (transformers keeps them as 3-D parameters: Qwen3-MoE's, gpt-oss's, Gemma 4's), which --quantize
    does not store in 8 or 4 bits, so it would save little of what it says."""
    stacked = [(name, parameter.numel()) for name, parameter in model.named_parameters() if parameter.dim() == 3]
    left = sum(count for _, count in stacked)
    if left > quantized:
        share = left / (left + quantized)
        raise QuantizeError(f"--quantize {mode}: {share:.0%} of the weights of {model.config.model_type} are its "
                            f"experts' ({stacked[0][0]} and {len(stacked) - 1} more), which --quantize does not store "
                            f"in {8 if mode == 'int8' else 4} bits; run without it (a GGUF file's experts stay in "
                            "its blocks then; a checkpoint: on GPUs, --device_map auto spreads it over them), or run "
                            "a GGUF file of the model")


def _quantize_group(module, layers, layer_class, head):
    """Replaces the children of `module` named in `layers` ({name: (weight, bias)}) by quantized layers."""
    with torch.no_grad():
        for name in _fused_siblings(module, layers, layer_class):
            del layers[name]
        for name, (weight, bias) in layers.items():
            cls = head_class() if getattr(module, name) is head else layer_class
            setattr(module, name, cls(weight, bias))


def _check(mode):
    if mode not in MODES:
        raise QuantizeError(f"--quantize must be one of {', '.join(MODES)}, got {mode!r}")
    return Int8Linear if mode == "int8" else Int4Linear


def gpu_int4_linear(weight, bias, check=False):
    """--quantize int4 on a CUDA GPU: the weight's 4-bit codes and groups (int4_groups) in torch's int4 packing for
    its CUDA kernel (TinyGemmLinear, as a GGUF file's 4-bit blocks run there), on the weight's device. check: raise
    QuantizeError where the kernel does not multiply it as its codes say (the nibble order a CPU cannot check)."""
    codes, scales, low = int4_groups(weight)

    def make():
        return TinyGemmLinear(codes, scales, low, weight.device)

    if check:
        zeros = (low + 8 * scales).to(torch.bfloat16).float()
        rows, groups = scales.shape
        exact = ((codes.float() - 8).reshape(rows, groups, GROUP_SIZE) * scales[..., None] + zeros[..., None])
        layer, why = checked_tinygemm(make, exact.reshape(weight.shape).to(torch.bfloat16))
        if layer is None:
            raise QuantizeError(f"--quantize int4: torch's int4 kernel on this GPU {why}; run without --quantize "
                                "(bfloat16)")
    else:
        layer = make()
    layer.bias = bias
    return layer


def triton_int4_layers():
    """--quantize int4 on a CUDA GPU where tinygemm cannot run in half precision (float16, GPUs before Ampere) or
    RUN_GENERATION_GPU_INT4=triton asks: (weight, bias, check) -> CudaInt4Linear, the weight's 4-bit codes and groups
    (CudaInt4Linear.of_weight) two a byte, each group's scale and least value in float16 (0.625 bytes a weight). The
    layer made with check=True (the first) must check out on the Triton kernel, else QuantizeError."""
    kernel = None

    def make(weight, bias, check=False):
        nonlocal kernel
        layer = CudaInt4Linear.of_weight(weight)
        if check:
            kernel, why = checked_int4_kernel(layer, weight.dtype)
            if kernel is None:
                raise QuantizeError(f"--quantize int4: the 4-bit Triton kernel on this GPU: {why}; run without "
                                    "--quantize")
        layer.use_kernel(kernel)
        layer.bias = bias
        return layer

    return make


def gpu_layer_class(mode, device, dtype):
    """(the layer maker --quantize `mode` uses on an accelerator for a model in `dtype`: (weight, bias, check) ->
    layer, the multiple its layers' inputs must be). int8 keeps its codes for a Triton kernel (rungen/int8.py), int4
    packs them for torch's tinygemm or rungen/int4_kernel.py's Triton kernel (gpu_int4_form)."""
    if mode == "int8":
        return cuda_int8_layers(), 1
    form = gpu_int4_form(CHUNK, dtype, device)
    if form == "tinygemm":
        return gpu_int4_linear, GROUP_SIZE
    if form == "triton":
        return triton_int4_layers(), CHUNK
    if os.environ.get(GPU_INT4_ENV) == "0":
        raise QuantizeError(f"--quantize int4: {GPU_INT4_ENV}=0 turns the GPU's 4-bit kernels off; unset it, or use "
                            "--quantize int8")
    if device.type != "cuda":
        raise QuantizeError(f"--quantize int4 on {device.type} needs a CUDA GPU (torch's int4 kernel or a Triton "
                            "kernel); add --use_cpu")
    raise QuantizeError(f"--quantize int4 on a GPU runs in bfloat16 or float16; the model is {dtype}: drop --dtype")


def layer_maker(mode: str, device: torch.device, dtype: torch.dtype):
    """(the layer class --quantize `mode` makes on `device` for a model in `dtype`, called (weight, bias); the
    multiple a layer's inputs must be). On an accelerator the first layer made is checked on its kernel, before any
    is replaced (gpu_layer_class)."""
    layer_class = _check(mode)
    if device.type == "cpu":
        return layer_class, GROUP_SIZE
    make, multiple = gpu_layer_class(mode, device, dtype)
    checked = False

    def first_checked(weight, bias):
        nonlocal checked
        layer, checked = make(weight, bias, check=not checked), True
        return layer

    return first_checked, multiple


def _quantized_targets(model, mode, multiple, device):
    """_targets, less the head on an accelerator (it keeps the model's dtype there)."""
    targets, head = _targets(model, mode, multiple)
    if device.type != "cpu":
        targets = {module: {name: child for name, child in children.items() if child is not head}
                   for module, children in targets.items()}
        targets = {module: children for module, children in targets.items() if children}
    return targets, head


def quantize_model(model: torch.nn.Module, mode: str) -> int:
    """Replaces every linear layer and the output head by its quantized twin, in place, one block at a time (so
    its float weights go early). Returns how many layers were quantized; raises QuantizeError."""
    if getattr(model, "quantized_layers", None):
        return model.quantized_layers
    layer_class, multiple = layer_maker(mode, model.device, next(model.parameters()).dtype)
    targets, head = _quantized_targets(model, mode, multiple, model.device)
    count = sum(len(children) for children in targets.values())
    while targets:
        module, children = targets.popitem()
        layers = {name: (_weight_of(child), child.bias) for name, child in children.items()}
        del children
        _quantize_group(module, layers, layer_class, head)
    return count


def _safetensors_files(path):
    """The safetensors files of a local checkpoint directory, or None."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            return sorted({os.path.join(path, name) for name in json.load(f)["weight_map"].values()})
    single = os.path.join(path, "model.safetensors")
    return [single] if os.path.isfile(single) else None


class QuantizingLoad:
    """A model built on meta taking its tensors one at a time (put), each block's target layers quantized as soon as
    their weights are all in: at most one block's float weights wait, never the whole float model, in host or device
    memory. `tie`: the model's tied parameters are one, a tensor put under either name reaching both (transformers
    ties while loading, not when constructing); else each takes its own tensor."""

    def __init__(self, model: torch.nn.Module, mode: str, device: torch.device, dtype: torch.dtype, tie: bool = True):
        self.layer_class, multiple = layer_maker(mode, device, dtype)
        if tie:
            model.tie_weights()
        self.model, self.dtype = model, dtype
        self.params = dict(model.named_parameters(remove_duplicate=False))
        self.aliases = {}  # a parameter's names: tied weights share one parameter
        for name, param in self.params.items():
            self.aliases.setdefault(id(param), []).append(name)
        self.targets, self.head = _quantized_targets(model, mode, multiple, device)
        self.owner = {}  # parameter name -> (parent module, child name, "weight" or "bias")
        modules = {module: name for name, module in model.named_modules()}
        for module, children in self.targets.items():
            for child_name, child in children.items():
                prefix = f"{modules[module]}.{child_name}".lstrip(".")
                for attr in ("weight", "bias"):
                    if getattr(child, attr, None) is not None:
                        self.owner[f"{prefix}.{attr}"] = (module, child_name, attr)
        self.count = sum(len(children) for children in self.targets.values())
        self.pending = {module: {} for module in self.targets}  # parent -> {child: {"weight": w, "bias": b}}

    def covers(self, names) -> bool:
        """Whether tensors of exactly these `names` give every parameter of the model."""
        if not set(names) <= set(self.params):
            return False
        covered = {alias for name in names for alias in self.aliases[id(self.params[name])]}
        return covered == set(self.params)

    def put(self, name: str, value: torch.Tensor) -> None:
        """Tensor `name` of the model: held for its layer's quantization, or set in place (a buffer too)."""
        if name not in self.params:
            module_name, _, attr = name.rpartition(".")
            setattr(self.model.get_submodule(module_name), attr, value)
            return
        shared = None
        for alias in self.aliases[id(self.params[name])]:
            if alias in self.owner:
                self._hold(alias, value)
            else:
                module_name, _, attr = alias.rpartition(".")
                if shared is None:
                    shared = torch.nn.Parameter(value.to(self.dtype), requires_grad=False)
                self.model.get_submodule(module_name)._parameters[attr] = shared

    def _hold(self, name, value):
        module, child_name, attr = self.owner[name]
        child = self.targets[module][child_name]
        if attr == "weight" and isinstance(child, Conv1D):
            value = value.t()
        self.pending[module].setdefault(child_name, {})[attr] = value
        got = self.pending[module]
        if all(name in got and all(a in got[name] for a in ("weight", "bias") if getattr(layer, a, None) is not None)
               for name, layer in self.targets[module].items()):
            layers = {n: (w["weight"], w.get("bias")) for n, w in self.pending.pop(module).items()}
            _quantize_group(module, layers, self.layer_class, self.head)
            del layers
            release_freed_memory()  # the block's float weights, else kept in glibc's heap between the codes

    def finish(self, what: str) -> torch.nn.Module:
        """The model, quantized; QuantizeError naming `what` where a layer's weights never came."""
        if self.pending:
            raise QuantizeError(f"--quantize: {what}: weights missing for {len(self.pending)} layers")
        self.model.quantized_layers = self.count
        self.model.eval()
        return self.model


def load_quantized(path: str, config, dtype: torch.dtype, mode: str,
                   device: torch.device) -> torch.nn.Module | None:
    """The causal LM of a local safetensors checkpoint, quantized block by block as it loads onto `device`
    (QuantizingLoad: a tensor at a time is read). None (load whole, quantize after) unless its tensor names are
    exactly the model's parameters (transformers renames or converts some checkpoints while loading). Its buffers
    stay on the host until the model is moved to `device`."""
    from accelerate import init_empty_weights
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    files = os.path.isdir(path) and _safetensors_files(path)
    if not files:
        return None
    with init_empty_weights(include_buffers=False), no_init_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    keys = {}
    for file in files:
        with safe_open(file, "pt") as f:
            keys.update((key, file) for key in f.keys())
    load = QuantizingLoad(model, mode, device, dtype)
    if not load.covers(keys):
        return None
    for key, file in keys.items():
        # One handle per tensor: a mapping's pages count as resident while it is open.
        with safe_open(file, "pt") as f:
            value = f.get_tensor(key)
        if device.type != "cpu":  # the accelerator's layers take the weight as the model holds it there
            value = value.to(device, dtype)
        load.put(key, value)
        del value
    if os.path.isfile(os.path.join(path, "generation_config.json")):  # as from_pretrained reads it
        from transformers import GenerationConfig

        model.generation_config = GenerationConfig.from_pretrained(path)
    return load.finish(path)
