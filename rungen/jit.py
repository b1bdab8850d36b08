"""--jit: one decode step traced with torch.jit, frozen, and run on TorchScript's Static Runtime.

A traced graph cannot carry transformers' Cache objects or ModelOutputs: the traced function takes and returns
plain tensors and rebuilds the cache inside over preallocated buffers; the model's forward becomes a dispatcher
sending plain decode steps to the graph and everything else to the eager model.

Private APIs used (when one changes, tracing or the shape check fails and the run goes on eagerly):
- torch._C._jit_to_static_module (Static Runtime)
- transformers.masking_utils._ignore_causal_mask_sdpa (patched while tracing the unpadded graph)
- transformers.cache_utils.DynamicLayer internals: keys, values, is_initialized, dtype, device, and
  DynamicCache.layer_class_to_replicate / .layers
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
import time
import warnings

import torch
from transformers import DynamicCache, masking_utils
from transformers.cache_utils import DynamicLayer
from transformers.modeling_outputs import CausalLMOutputWithPast

from . import logger
from .controls import quiet_transformers

# A decode step's keyword arguments the graph serves (anything else -> eager).
JIT_SERVED_KWARGS = {"input_ids", "attention_mask", "position_ids", "past_key_values", "use_cache",
                     "logits_to_keep", "return_dict", "token_type_ids", "output_attentions",
                     "output_hidden_states"}


def cache_shape_of(config) -> tuple[int, int, int]:
    """(num_layers, num_kv_heads, head_dim); config.attribute_map maps GPT-2's n_layer etc. to these names."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return config.num_hidden_layers, kv_heads, head_dim


def generate_past_key_values(model, batch_size: int, seq_len: int) -> tuple[torch.Tensor, ...]:
    """Dummy past as flat (k0, v0, k1, v1, ...), each [batch, kv_heads, seq, head_dim]."""
    layers, kv_heads, head_dim = cache_shape_of(model.config)
    shape = (batch_size, kv_heads, seq_len, head_dim)
    return tuple(torch.randn(shape, dtype=model.dtype, device=model.device) for _ in range(2 * layers))


def prepare_jit_inputs(model, tokenizer, batch_size: int = 2, past_len: int = 3) -> tuple:
    """Dummy inputs of one decode step, as the original script makes them. The mask's leading 0 keeps the padding
    path in the trace: transformers may skip an all-ones mask, and the trace would bake that in."""
    ids = tokenizer(["enable jit"] * batch_size, return_tensors="pt")["input_ids"][:, -1:]
    mask = torch.ones(batch_size, past_len + 1, dtype=torch.long)
    mask[:, 0] = 0
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)[:, -1:]
    past = generate_past_key_values(model, batch_size, past_len + 5)  # buffers with spare room
    return ids.to(model.device), mask.to(model.device), position_ids.to(model.device), past


class _BufferLayer(DynamicLayer):
    """A cache layer over preallocated [batch, heads, capacity, head_dim] buffers: a step writes in place at
    `past_len` (DynamicLayer.update copies the whole cache every step)."""

    def __init__(self, key_buffer, value_buffer, past_len):
        super().__init__()
        self.key_buffer, self.value_buffer, self.past_len = key_buffer, value_buffer, past_len
        self.dtype, self.device, self.is_initialized = key_buffer.dtype, key_buffer.device, True
        self.keys, self.values = key_buffer.narrow(2, 0, past_len), value_buffer.narrow(2, 0, past_len)

    def update(self, key_states, value_states, *args, **kwargs):
        new = key_states.shape[-2]
        self.key_buffer.narrow(2, self.past_len, new).copy_(key_states)
        self.value_buffer.narrow(2, self.past_len, new).copy_(value_states)
        end = self.past_len + new
        self.keys, self.values = self.key_buffer.narrow(2, 0, end), self.value_buffer.narrow(2, 0, end)
        return self.keys, self.values


def _cache_over_buffers(buffers, past_len):
    cache = DynamicCache()
    cache.layer_class_to_replicate = None
    cache.layers = [_BufferLayer(k, v, past_len) for k, v in zip(buffers[0::2], buffers[1::2])]
    return cache


class _DecodeStep(torch.nn.Module):
    """One decode step over plain tensors: in, the key/value buffers; out, the logits and the grown keys/values
    (views of the buffers); the past length is the mask's width. Two graphs: unpadded, generate passes no mask and
    attention skips it, which rounds differently from an all-ones mask; so only `padded` passes the mask on."""

    def __init__(self, model, forward, with_position_ids, padded):
        super().__init__()
        self.model = model
        self._forward = forward  # the instance's `forward` gets replaced
        self.with_position_ids, self.padded = with_position_ids, padded

    def forward(self, input_ids, attention_mask, position_ids, *buffers):
        cache = _cache_over_buffers(buffers, attention_mask.shape[-1] - 1)
        kwargs = {"position_ids": position_ids} if self.with_position_ids else {}
        out = self._forward(input_ids=input_ids, attention_mask=attention_mask if self.padded else None,
                            past_key_values=cache, use_cache=True, return_dict=True, **kwargs)
        return (out.logits,) + tuple(t for layer in cache.layers for t in (layer.keys, layer.values))


def _kv_buffers(cache, needed):
    """Flat buffers of generate's cache with room for `needed` positions; keys/values that are no longer a prefix
    view of their buffer (beam reordering, the prompt's pass, expansion) or a full buffer are copied to a larger
    one."""
    buffers = []
    for layer in cache.layers:
        for name in ("keys", "values"):
            tensor, buffer = getattr(layer, name), layer.__dict__.get("_jit_" + name)
            if tensor is layer.__dict__.get("_jit_view_" + name) and buffer.shape[2] >= needed:
                buffers.append(buffer)  # the view the last graph step left, untouched
                continue
            if buffer is None or buffer.shape[2] < needed or not _is_prefix_view(tensor, buffer):
                size = tensor.shape[:2] + (2 * needed + 16, tensor.shape[3])
                buffer = tensor.new_empty(size)
                buffer[:, :, :tensor.shape[2]] = tensor
                setattr(layer, "_jit_" + name, buffer)
            buffers.append(buffer)
    return buffers


def _is_prefix_view(tensor, buffer):
    return (tensor.data_ptr() == buffer.data_ptr() and tensor.stride() == buffer.stride()
            and tensor.shape[:2] == buffer.shape[:2] and tensor.shape[3] == buffer.shape[3])


def trace_decode_step(model, tokenizer) -> tuple:
    """({padded: runner}, with_position_ids): each graph traced, frozen, warmed up and checked at another
    batch size and cache length."""
    if any(type(layer) is not DynamicLayer for layer in DynamicCache(config=model.config).layers):
        raise ValueError("its cache has non-full-attention layers (sliding window, linear attention...)")
    forward = model.forward
    parameters = inspect.signature(forward).parameters
    if "past_key_values" not in parameters:  # XLNet's mems, say: the graph would never serve a step
        raise ValueError("its forward takes no past_key_values cache")
    with_pos = "position_ids" in parameters
    graphs = {}
    for padded in (True, False):
        step = _DecodeStep(model, forward, with_pos, padded).eval()
        example = _flat(prepare_jit_inputs(model, tokenizer))
        # quiet_transformers: the tracer reads every attribute of every submodule, and transformers' properties
        # warn of what a decode step never uses (a config naming no loss_type).
        with torch.no_grad(), warnings.catch_warnings(), _mask_skipped_as_in_eager(padded), _lean_ops(model), \
                quiet_transformers():
            # The branches the tracer warns about are constant (query length 1); --jit users know it is deprecated.
            for category in (torch.jit.TracerWarning, DeprecationWarning, FutureWarning):
                warnings.simplefilter("ignore", category)
            graph = _runner(torch.jit.freeze(torch.jit.trace(step, example, strict=False, check_trace=False).eval()))
            graph(*example)
            graph(*example)
        _check_against_eager(graph, step, _flat(prepare_jit_inputs(model, tokenizer, batch_size=3, past_len=7)))
        graphs[padded] = graph
    return graphs, with_pos


def _runner(frozen):
    """Static Runtime: far less per-operator overhead than the graph executor, which also re-profiles as the cache
    grows. Where that private API is missing or refuses the graph, the executor runs it unoptimized."""
    try:
        return torch._C._jit_to_static_module(frozen._c)
    except Exception:  # noqa: BLE001 - any refusal: fall back to the graph executor
        def run(*args):
            with torch.jit.optimized_execution(False):
                return frozen(*args)
        return run


@contextlib.contextmanager
def _mask_skipped_as_in_eager(padded):
    """Eager attention skips the mask for one unpadded query token, but tracing never does (the sizes it reads
    might change); the unpadded graph has no mask to size, so it skips it exactly when eager does."""
    original = masking_utils._ignore_causal_mask_sdpa
    if not padded:
        masking_utils._ignore_causal_mask_sdpa = (
            lambda padding_mask, q_length, kv_length, q_offset, kv_offset, local_attention_size=None:
            padding_mask is None and q_length == 1 and local_attention_size is None)
    try:
        yield
    finally:
        masking_utils._ignore_causal_mask_sdpa = original


@contextlib.contextmanager
def _lean_ops(model):
    """While tracing, RMS norms and the rotary embedding written in fewer operators with the same bits (a graph
    operator costs microseconds whatever its size); each replacement is used only where it matches the model's own
    code bit for bit on random inputs."""
    norms = [m for m in model.modules() if _is_plain_rms_norm(m)]
    for norm in norms:
        norm.forward = _lean_rms_norm(norm)
    module = sys.modules.get(type(model).__module__)
    rotary = getattr(module, "apply_rotary_pos_emb", None)
    lean_rotary = _lean_rotary(rotary, model) if rotary else None
    if lean_rotary:
        module.apply_rotary_pos_emb = lean_rotary
    try:
        yield
    finally:
        for norm in norms:
            del norm.forward
        if lean_rotary:
            module.apply_rotary_pos_emb = rotary


def _is_plain_rms_norm(module):
    weight, eps = getattr(module, "weight", None), getattr(module, "variance_epsilon", None)
    if not isinstance(weight, torch.Tensor) or weight.ndim != 1 or not isinstance(eps, float):
        return False
    if "forward" in vars(module):  # already replaced by someone else
        return False
    probe = torch.randn(2, 3, weight.shape[0], dtype=weight.dtype, device=weight.device) * 3
    with torch.no_grad():
        return torch.equal(module(probe), _lean_rms_norm(module)(probe))


def _lean_rms_norm(norm):
    # 0-dim tensors: a tensor-scalar operator costs the graph twice a tensor-tensor one
    size, eps = (torch.tensor(value, dtype=norm.weight.dtype, device=norm.weight.device)
                 for value in (float(norm.weight.shape[0]), norm.variance_epsilon))

    def forward(hidden_states):
        variance = hidden_states.pow(2).sum(-1, keepdim=True) / size
        return norm.weight * (hidden_states * torch.rsqrt(variance + eps))
    return forward


def _lean_rotary(original, model):
    """apply_rotary_pos_emb with one swap of halves against a pre-signed sine ((-a)*b == a*(-b) exactly), or None
    where it differs from `original` (interleaved or partial rotary...)."""
    _, _, head_dim = cache_shape_of(model.config)
    if head_dim % 2:
        return None
    half = head_dim // 2
    sign = torch.cat([-torch.ones(half), torch.ones(half)]).to(model.dtype).to(model.device)
    step = {}  # the last sin -> (cos, signed sin): once a step for all layers

    def rotary(q, k, cos, sin, *args, **kwargs):
        if args or kwargs or q.shape[-1] != head_dim or cos.shape[-1] != head_dim:
            return original(q, k, cos, sin, *args, **kwargs)
        if step.get("sin") is not sin or step.get("cos") is not cos:
            step.update(sin=sin, cos=cos, rotation=(cos.unsqueeze(1), (sin * sign).unsqueeze(1)))
        cos, signed_sin = step["rotation"]
        return (q * cos) + (_swap_halves(q, half) * signed_sin), (k * cos) + (_swap_halves(k, half) * signed_sin)

    q, k = (torch.randn(2, heads, 3, head_dim, dtype=model.dtype, device=model.device) for heads in (4, 2))
    cos, sin = (torch.randn(2, 3, head_dim, dtype=model.dtype, device=model.device) for _ in range(2))
    try:
        with torch.no_grad():
            same = all(torch.equal(a, b) for a, b in zip(original(q, k, cos, sin), rotary(q, k, cos, sin)))
    except Exception:  # noqa: BLE001 - a function of another signature: not ours to replace
        return None
    step.clear()
    return rotary if same else None


def _swap_halves(x, half):
    return torch.cat((x[..., half:], x[..., :half]), dim=-1)  # what roll(half, -1) does, in less time


def _flat(inputs):
    ids, mask, position_ids, past = inputs
    return (ids, mask, position_ids) + past


def _check_against_eager(traced, step, example):
    """Refuse a trace that bakes in the dummy's batch size or cache length: another shape must match eager."""
    with torch.no_grad():
        got = [t.clone() for t in traced(*example)]  # clone: the keys/values are views of the buffers
        want = step(*example)
    if len(got) != len(want) or any(g.shape != w.shape or not torch.allclose(g, w, rtol=1e-4, atol=1e-5)
                                    for g, w in zip(got, want)):
        raise RuntimeError("the traced step disagrees with the eager model at another batch size/cache length")


def _served_by_graph(kwargs, args):
    cache = kwargs.get("past_key_values")
    ids = kwargs.get("input_ids")
    if args or ids is None or ids.shape[1] != 1 or not isinstance(cache, DynamicCache):
        return False
    if any(k not in JIT_SERVED_KWARGS for k in kwargs):
        return False
    if kwargs.get("use_cache") is False or kwargs.get("output_attentions") or kwargs.get("output_hidden_states"):
        return False
    if kwargs.get("token_type_ids") is not None:
        return False
    if not cache.layers or any(type(layer) is not DynamicLayer or not layer.is_initialized for layer in cache.layers):
        return False
    past = cache.get_seq_length()
    mask = kwargs.get("attention_mask")
    return past > 0 and (mask is None or (mask.ndim == 2 and mask.shape == (ids.shape[0], past + 1)))


def _install_dispatcher(model, graphs, with_pos):
    eager_forward = model.forward

    @functools.wraps(eager_forward)  # keeps the signature: generate inspects `self.forward`
    def forward(*args, **kwargs):
        if not _served_by_graph(kwargs, args):
            return eager_forward(*args, **kwargs)
        cache = kwargs["past_key_values"]
        ids = kwargs["input_ids"]
        past = cache.get_seq_length()
        mask = kwargs.get("attention_mask")
        graph = graphs[mask is not None]
        if mask is None:  # generate drops an all-ones mask; the unpadded graph reads only its width
            mask = torch.ones(ids.shape[0], past + 1, dtype=torch.long, device=ids.device)
        pos = kwargs.get("position_ids")
        if pos is None:
            if with_pos:  # eager would derive positions itself; do not guess, let it
                return eager_forward(*args, **kwargs)
            pos = ids  # unused placeholder for models without position ids (bloom)
        outputs = graph(ids, mask, pos, *_kv_buffers(cache, past + 1))
        forward.graph_steps += 1
        for layer, k, v in zip(cache.layers, outputs[1::2], outputs[2::2]):
            layer.keys, layer.values = k, v
            layer._jit_view_keys, layer._jit_view_values = k, v
        out = CausalLMOutputWithPast(logits=outputs[0], past_key_values=cache)
        return out if kwargs.get("return_dict", True) is not False else out.to_tuple()

    forward.graph_steps = 0  # tests check the graph is used
    model.forward = forward
    model.traced_step = True  # its decode steps read a DynamicCache (rungen/slots.py leaves it the padded batch)


def enable_jit(model, tokenizer) -> float | None:
    """Route `model.generate`'s decode steps through a traced graph. Returns the tracing time in seconds, or None
    (after one warning, the model untouched) where it cannot be traced or the graph would never run."""
    if any(type(module).__name__.endswith("Experts") for module in model.modules()):  # transformers' and GGMLExperts
        logger.warning("--jit: not traced: its mixture of experts picks each token's experts by their values, and a "
                       "trace would fix one choice")
        return None
    if getattr(model, "cache_grows_in_place", False):
        # Its steps native over a cache growing in place (one call a step, or one loop over native steps): the
        # graph would never be given a step.
        logger.warning("--jit: not traced: this model's decode step already runs on the native kernels "
                       "(add --dequantize or --quantize to trace it)")
        return None
    start = time.perf_counter()
    try:
        with torch.random.fork_rng():  # the dummy inputs must not move the --seed'ed sampling stream
            graphs, with_pos = trace_decode_step(model, tokenizer)
    except Exception as err:  # any failure: the run goes on without JIT, same text
        logger.warning("--jit: cannot trace %s (%s: %s); generating without JIT",
                       model.config.model_type, type(err).__name__, str(err).splitlines()[0] if str(err) else "")
        return None
    _install_dispatcher(model, graphs, with_pos)
    return time.perf_counter() - start
