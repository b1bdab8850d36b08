"""Fast tier: FusedDecoderLayer computes transformers' LlamaDecoderLayer (and Qwen2's, with q/k/v biases; Qwen3's,
with per-head q/k norms and heads wider than hidden / heads; Phi3's, with q/k/v and gate/up as one projection each
and a partial rotary; Gemma 2's and 3's, with a GELU-tanh gate, four norms of 1 + weight, sliding-window layers,
soft-capped attention logits, per-head q/k norms) over the same GGUF blocks, within float32 rounding: one token
after a prompt, a prompt, a left-padded batch; with the native kernels' steps and with the torch fallback of each
step."""

import copy

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize
from transformers import (
    DynamicCache,
    LlamaConfig,
    LlamaForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
from transformers.models.gemma2 import modeling_gemma2 as gemma2
from transformers.models.gemma3 import modeling_gemma3 as gemma3
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding
from transformers.models.phi3.modeling_phi3 import Phi3DecoderLayer, Phi3RotaryEmbedding
from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer, Qwen2RotaryEmbedding
from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer, Qwen3RotaryEmbedding

from helpers import padded_prompt_and_steps, to_blocks
from rungen.gguf import blocks as ggml
from rungen.gguf import decoder
from rungen.gguf.blocks import GGMLLinear
from rungen.gguf.decoder import DecoderStack, FusedDecoderLayer, fuse_decoder_layers
from rungen.kvcache import KV_FLOAT32_ENV, growing, new_cache

HIDDEN, FFN, HEADS, KV_HEADS = 128, 256, 4, 2
KINDS = ("llama", "qwen2", "qwen3", "phi3")  # with the one-call stack
GEMMAS = ("gemma2", "gemma3")  # also in the one-call stack, with their extra norms, windows and soft cap
CLASSES = {"llama": (LlamaConfig, LlamaDecoderLayer, LlamaForCausalLM, LlamaRotaryEmbedding),
           "qwen2": (Qwen2Config, Qwen2DecoderLayer, Qwen2ForCausalLM, Qwen2RotaryEmbedding),
           "qwen3": (Qwen3Config, Qwen3DecoderLayer, Qwen3ForCausalLM, Qwen3RotaryEmbedding),
           "phi3": (Phi3Config, Phi3DecoderLayer, Phi3ForCausalLM, Phi3RotaryEmbedding),
           "gemma2": (gemma2.Gemma2Config, gemma2.Gemma2DecoderLayer, gemma2.Gemma2ForCausalLM,
                      gemma2.Gemma2RotaryEmbedding),
           "gemma3": (gemma3.Gemma3TextConfig, gemma3.Gemma3DecoderLayer, gemma3.Gemma3ForCausalLM,
                      gemma3.Gemma3RotaryEmbedding)}
# The published checkpoints' quirks: Qwen3's heads are wider than hidden / heads (0.6B: 1024 / 16 heads of 128),
# Phi-4-mini (a phi3 model) rotates 3/4 of each head; Gemma's heads are not hidden / heads wide either, their scores
# are scaled by query_pre_attn_scalar (gemma-2-27b: hidden / heads, not the head size), every other gemma2 layer and
# five gemma3 layers in six slide a window (3 positions here, so that a 5-token prompt crosses it), gemma3's local
# layers rotate by a base of their own, and gemma2 soft-caps its attention logits (at 1 here rather than 50, so
# that the capping changes these small scores).
QUIRKS = {"qwen3": dict(head_dim=2 * HIDDEN // HEADS), "phi3": dict(partial_rotary_factor=0.75, pad_token_id=0),
          "gemma2": dict(head_dim=2 * HIDDEN // HEADS, query_pre_attn_scalar=HIDDEN // HEADS, sliding_window=3,
                         attn_logit_softcapping=1.0),
          "gemma3": dict(head_dim=2 * HIDDEN // HEADS, query_pre_attn_scalar=HIDDEN // HEADS, sliding_window=3,
                         sliding_window_pattern=6, rope_theta=1e6, rope_local_base_freq=1e4)}
# (kind, layer index): gemma's first layer slides a window, gemma2's second and gemma3's sixth attend to everything.
LAYERS = [(kind, 0) for kind in KINDS + GEMMAS] + [("gemma2", 1), ("gemma3", 5)]


def config_of(kind, layers=1):
    common = dict(hidden_size=HIDDEN, intermediate_size=FFN, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                  num_hidden_layers=layers, rms_norm_eps=1e-5, vocab_size=64)
    config = CLASSES[kind][0](**common, **QUIRKS.get(kind, {}))
    config._attn_implementation = "eager" if kind in GEMMAS else "sdpa"  # gemma2's soft-capping is eager's
    return config


def head_dim_of(config):
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def layer_in_blocks(kind, seed=0, index=0):
    """A decoder layer of `kind` whose linear weights are Q8_0/Q4_1 blocks (GGMLLinear), norms random."""
    torch.manual_seed(seed)
    config = config_of(kind, index + 1)
    layer = CLASSES[kind][1](config, layer_idx=index).eval()
    to_blocks(layer, np.random.default_rng(seed))
    return layer, config


def run(layer, config, hidden, attention_mask, past):
    """The layer's output for `hidden` after the cache `past` (as a model's forward calls it)."""
    batch, tokens, _ = hidden.shape
    seen = past.get_seq_length()
    if attention_mask is None:
        positions = torch.arange(seen, seen + tokens).unsqueeze(0)
    else:
        positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)[:, -tokens:]
    index = layer.layer_idx if isinstance(layer, FusedDecoderLayer) else layer.self_attn.layer_idx
    layer_type = getattr(config, "layer_types", ["full_attention"] * (index + 1))[index]
    masking = create_sliding_window_causal_mask if layer_type == "sliding_attention" else create_causal_mask
    mask = masking(config=config, inputs_embeds=hidden, attention_mask=attention_mask, past_key_values=past,
                   position_ids=positions)
    rotary = CLASSES[{"gemma3_text": "gemma3"}.get(config.model_type, config.model_type)][3](config)
    cos_sin = rotary(hidden, positions, *[layer_type] * (config.model_type == "gemma3_text"))
    return layer(hidden, attention_mask=mask, position_ids=positions, past_key_values=past, use_cache=True,
                 position_embeddings=cos_sin)


@pytest.mark.parametrize("native", [True, False], ids=["native", "torch-fallback"])
@pytest.mark.parametrize("kind, index", LAYERS, ids=[f"{kind}-{index}" for kind, index in LAYERS])
def test_fused_layer_equals_transformers_layer(kind, index, native, monkeypatch):
    if native and not ggml.native_kernels():
        pytest.skip("the native kernels are not available here")
    reference, config = layer_in_blocks(kind, index=index)
    fused = FusedDecoderLayer.fuse(reference)
    assert fused is not None and fused.qkv.out_features == (HEADS + 2 * KV_HEADS) * head_dim_of(config)
    monkeypatch.setattr(decoder, "native_kernels", lambda: native)
    torch.manual_seed(1)
    prompt, step = torch.randn(2, 5, HIDDEN), torch.randn(2, 1, HIDDEN)
    padding = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])  # the first row left-padded
    for mask in (None, padding):
        caches = DynamicCache(config=config), DynamicCache(config=config)
        with torch.no_grad():
            outputs = [run(layer, config, prompt, mask, cache) for layer, cache in zip((reference, fused), caches)]
            torch.testing.assert_close(outputs[1], outputs[0], rtol=1e-4, atol=1e-4)
            after = None if mask is None else torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], -1)
            outputs = [run(layer, config, step, after, cache) for layer, cache in zip((reference, fused), caches)]
        torch.testing.assert_close(outputs[1], outputs[0], rtol=1e-4, atol=1e-4)
        assert outputs[0].abs().max() > 0.1  # a real computation
        # The cache holds the same (rotated) keys and values.
        ours, theirs = caches[1].layers[index], caches[0].layers[index]
        torch.testing.assert_close(ours.keys, theirs.keys, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(ours.values, theirs.values, rtol=1e-4, atol=1e-4)


def test_only_layers_it_computes_are_fused():
    float_layer = LlamaDecoderLayer(config_of("llama"), layer_idx=0)
    assert FusedDecoderLayer.fuse(float_layer) is None  # float weights: transformers' layer as it is


# Projections in other block types than to_blocks gives them, as llama.cpp's mixes give some layers (a Q4_K_M
# file's attn_v in Q6_K beside Q4_K attn_q/attn_k; the k-quants need 256 inputs, these types stand for them):
# q, k and v each in its own type, gate and up in two.
MIXED_TYPES = {"k_proj": "Q4_0", "v_proj": "Q4_1", "up_proj": "Q8_0"}
MIXED_KINDS = ("llama", "qwen2", "qwen3")  # phi3's file holds q/k/v and gate/up as one tensor each


def retype(layer, seed, types=MIXED_TYPES):
    """`layer` with the named projections re-quantized, random weights, in other block types (interleaved as the
    loader leaves them), their biases kept."""
    rng = np.random.default_rng(seed)
    for parent in (layer.self_attn, layer.mlp):
        for name, qtype in types.items():
            linear = getattr(parent, name, None)
            if linear is None:
                continue
            weights = rng.standard_normal((linear.out_features, linear.in_features)).astype(np.float32) * 0.1
            qtype = GGMLQuantizationType[qtype]
            blocks = torch.from_numpy(quantize(weights, qtype)).reshape(linear.out_features, -1)
            setattr(parent, name, GGMLLinear(blocks, qtype, linear.in_features, linear.bias))
            getattr(parent, name).interleave()
    return layer


@pytest.mark.parametrize("native", [True, False], ids=["native", "torch-fallback"])
@pytest.mark.parametrize("kind", MIXED_KINDS + ("gemma3",))
def test_a_layer_with_projections_in_different_block_types_is_fused_and_equals_transformers_layer(
        kind, native, monkeypatch):
    if native and not ggml.native_kernels():
        pytest.skip("the native kernels are not available here")
    reference, config = layer_in_blocks(kind)
    retype(reference, 5)
    fused = FusedDecoderLayer.fuse(reference)
    assert fused is not None and fused.two_calls == (kind != "gemma3")
    assert isinstance(fused.qkv, ggml.GGMLParts) and [p.qtype.name for p in fused.qkv.parts] == ["Q8_0", "Q4_0",
                                                                                                  "Q4_1"]
    assert isinstance(fused.gate_up, ggml.GGMLParts) and len(fused.gate_up.parts) == 2
    monkeypatch.setattr(decoder, "native_kernels", lambda: native)
    torch.manual_seed(1)
    prompt, step = torch.randn(2, 5, HIDDEN), torch.randn(2, 1, HIDDEN)
    padding = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    for mask in (None, padding):
        caches = DynamicCache(config=config), DynamicCache(config=config)
        after = None if mask is None else torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], -1)
        with torch.no_grad():
            for hidden, attention in ((prompt, mask), (step, after)):
                outputs = [run(layer, config, hidden, attention, cache) for layer, cache in zip((reference, fused),
                                                                                                caches)]
                torch.testing.assert_close(outputs[1], outputs[0], rtol=1e-4, atol=1e-4)
        assert outputs[0].abs().max() > 0.1
        torch.testing.assert_close(caches[1].layers[0].keys, caches[0].layers[0].keys, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(caches[1].layers[0].values, caches[0].layers[0].values, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind", MIXED_KINDS)
def test_a_layer_in_different_block_types_gives_the_bits_of_its_parts_multiplied_one_by_one(kind):
    """The layer in two native calls, and layer by layer with its products of parts, against the same layer
    whose q/k/v and gate/up are each taken by their own modules (one mm a projection, as the parts multiplied
    one by one): the same bits."""
    if not ggml.native_kernels():
        pytest.skip("the native kernels are not available here")
    layer, config = layer_in_blocks(kind)
    retype(layer, 5)
    fused = FusedDecoderLayer.fuse(layer)
    projections = {"qkv": [getattr(layer.self_attn, name) for name in ("q_proj", "k_proj", "v_proj")],
                   "gate_up": [layer.mlp.gate_proj, layer.mlp.up_proj]}
    torch.manual_seed(3)
    prompt = torch.randn(2, 5, HIDDEN)
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    outputs = []
    for way in ("two calls", "layer by layer", "one by one"):
        fused.two_calls = way == "two calls"
        with pytest.MonkeyPatch.context() as patch:
            if way == "one by one":  # q, k, v (and gate, up) each through its own module's product
                for name, parts in projections.items():
                    patch.setattr(getattr(fused, name), "_matmul",
                                  lambda x, parts=parts: torch.cat([part._matmul(x) for part in parts], -1))
            with torch.no_grad():
                outputs.append(run(fused, config, prompt, mask, DynamicCache(config=config)))
    assert torch.equal(outputs[0], outputs[1]) and torch.equal(outputs[1], outputs[2])


def test_a_sequence_gets_the_same_bits_alone_and_left_padded_in_a_batch():
    if not ggml.native_kernels():
        pytest.skip("the native kernels are not available here")
    layer, config = layer_in_blocks("llama")
    fused = FusedDecoderLayer.fuse(layer)
    torch.manual_seed(2)
    prompt, step = torch.randn(1, 5, HIDDEN), torch.randn(1, 1, HIDDEN)
    # The same sequence as the second row of a batch whose other row is longer: 3 padding positions first.
    batch_prompt = torch.cat([torch.randn(1, 8, HIDDEN), torch.cat([torch.zeros(1, 3, HIDDEN), prompt], 1)])
    batch_step = torch.cat([torch.randn(1, 1, HIDDEN), step])
    mask = torch.tensor([[1] * 8, [0] * 3 + [1] * 5])
    with torch.no_grad():
        alone, batched = DynamicCache(config=config), DynamicCache(config=config)
        outputs = run(fused, config, prompt, None, alone), run(fused, config, batch_prompt, mask, batched)
        assert torch.equal(outputs[1][1, 3:], outputs[0][0])  # the prompt pass
        mask = torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], -1)
        outputs = run(fused, config, step, None, alone), run(fused, config, batch_step, mask, batched)
        assert torch.equal(outputs[1][1], outputs[0][0])  # a decoding step


@pytest.mark.parametrize("kind", KINDS)
def test_the_layer_in_two_native_calls_gives_the_bits_of_its_separate_operators(kind):
    if not ggml.native_kernels():
        pytest.skip("the native kernels are not available here")
    fused = FusedDecoderLayer.fuse(layer_in_blocks(kind)[0])
    config = fused.config
    assert fused.two_calls
    torch.manual_seed(3)
    prompt, step = torch.randn(2, 5, HIDDEN), torch.randn(2, 1, HIDDEN)
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    outputs, caches = [], []
    for two_calls in (True, False):
        fused.two_calls, cache = two_calls, DynamicCache(config=config)
        with torch.no_grad():
            first = run(fused, config, prompt, mask, cache)
            after = torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], -1)
            outputs.append((first, run(fused, config, step, after, cache)))
        caches.append(cache)
    assert torch.equal(outputs[0][0], outputs[1][0]) and torch.equal(outputs[0][1], outputs[1][1])
    assert torch.equal(caches[0].layers[0].keys, caches[1].layers[0].keys)
    assert torch.equal(caches[0].layers[0].values, caches[1].layers[0].values)


def model_in_blocks(kind, layers=3):
    torch.manual_seed(4)
    config = config_of(kind, layers)
    model = CLASSES[kind][2](config).eval()
    rng = np.random.default_rng(4)
    for layer in model.model.layers:
        to_blocks(layer, rng)
    assert fuse_decoder_layers(model) == layers
    return model


@pytest.mark.parametrize("kind", KINDS + GEMMAS)
def test_the_decoder_stack_in_one_call_gives_the_bits_of_the_layers_one_by_one(kind, monkeypatch):
    """gemma's six layers: sliding ones (a 6-token prompt crosses their window of 3) and a global one, gemma3's
    each with its rope base; the layers one by one attend under
    transformers' window masks, the stack under the padding's mask and its own windows."""
    if not ggml.native_kernels():
        pytest.skip("the native kernels are not available here")
    model = model_in_blocks(kind, 6 if kind in GEMMAS else 3)
    stack = model.model.forward
    assert isinstance(stack, DecoderStack) and model.cache_grows_in_place
    calls = []
    monkeypatch.setattr(torch.ops.rungen_ggml, "decoder_stack",
                        lambda *a, original=torch.ops.rungen_ggml.decoder_stack: calls.append(1) or original(*a))
    ids = torch.tensor([[0, 0, 5, 9, 13, 2], [7, 3, 5, 9, 13, 2]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    runs = []
    for one_call in (True, False):
        if not one_call:  # transformers' forward, the fused layers one by one
            monkeypatch.setattr(model.model, "forward", stack.original)
        cache, logits = new_cache(model), []
        with torch.no_grad():
            logits.append(model(ids, attention_mask=mask, past_key_values=cache).logits)
            for step in (11, 17):
                mask = torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], -1)
                step_ids = torch.tensor([[step], [step + 1]])
                logits.append(model(step_ids, attention_mask=mask, past_key_values=cache).logits)
        mask = mask[:, :6]
        runs.append((logits, cache))
    assert len(calls) == 3  # the prompt and two steps, each in one call
    assert all(growing(layer) for layer in runs[0][1].layers)
    for a, b in zip(runs[0][0], runs[1][0]):
        assert torch.equal(a, b)
    for a, b in zip(runs[0][1].layers, runs[1][1].layers):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


@pytest.mark.parametrize("kind", MIXED_KINDS)
def test_a_model_whose_layers_mix_block_types_runs_one_stack_with_the_layers_bits(kind, monkeypatch):
    """Layers as a Q4_K_M file mixes them: one of one type, one with q/k/v and gate/up in several, one with only
    v and down in another. Every layer fused, the stack installed and called, the bits of the fused layers one
    by one; with every product taken on the de-quantized weights (no int8 rounding of the activations, whose
    codes a float32 difference may flip), transformers' own layers' logits over the same blocks within float32
    rounding."""
    if not ggml.native_kernels():
        pytest.skip("the native kernels are not available here")
    monkeypatch.setenv(KV_FLOAT32_ENV, "1")  # (transformers' float32 cache: what this compares is the arithmetic)
    torch.manual_seed(4)
    reference = CLASSES[kind][2](config_of(kind, 3)).eval()
    rng = np.random.default_rng(4)
    for layer, types in zip(reference.model.layers, ({}, MIXED_TYPES, {"v_proj": "Q4_1", "down_proj": "Q4_1"})):
        to_blocks(layer, rng)
        retype(layer, 6, types)
    model = copy.deepcopy(reference)
    assert fuse_decoder_layers(model) == 3
    stack = model.model.forward
    assert isinstance(stack, DecoderStack)
    assert [isinstance(layer.qkv, ggml.GGMLParts) for layer in model.model.layers] == [False, True, True]
    calls = []
    monkeypatch.setattr(torch.ops.rungen_ggml, "decoder_stack",
                        lambda *a, original=torch.ops.rungen_ggml.decoder_stack: calls.append(1) or original(*a))
    stacked = padded_prompt_and_steps(model)
    assert len(calls) == 3  # the prompt and two steps, each in one call
    monkeypatch.setattr(model.model, "forward", stack.original)
    for ours, theirs in zip(stacked, padded_prompt_and_steps(model)):
        assert torch.equal(ours, theirs)
    monkeypatch.setattr(GGMLLinear, "_matmul", lambda self, x: torch.ops.rungen_ggml.mm_tiled(
        x.float().contiguous(), self.blocks, self.code, self.in_features))
    with decoder.products_one_by_one(model):
        exact = padded_prompt_and_steps(model)
    for ours, theirs in zip(exact, padded_prompt_and_steps(reference)):
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
    assert exact[0].abs().max() > 0.1 and len(calls) == 3


def test_generate_runs_the_stack_on_its_own_cache_and_gives_the_layers_tokens(monkeypatch):
    if not ggml.native_kernels():
        pytest.skip("the native kernels are not available here")
    model = model_in_blocks("llama")
    calls = []
    original = torch.ops.rungen_ggml.decoder_stack
    monkeypatch.setattr(torch.ops.rungen_ggml, "decoder_stack", lambda *a: calls.append(1) or original(*a))
    ids = torch.tensor([[5, 9, 13, 2]])
    with torch.no_grad():
        stacked = model.generate(ids, max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert len(calls) == 6  # the prompt, then every step but the last token's
        monkeypatch.setattr(model.model, "forward", model.model.forward.original)
        one_by_one = model.generate(ids, max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert torch.equal(stacked, one_by_one)


def test_the_stack_without_padding_gives_the_layers_bits_for_a_prompt_and_for_the_rest_after_a_cached_start(
        monkeypatch):
    """No padding (a mask of ones, as generate() and the server pass it): the stack's causal default gives the
    bits of the layers one by one with their explicit mask, for a whole prompt and for the rest of a prompt after
    a cached start (the server's shared prefixes)."""
    if not ggml.native_kernels():
        pytest.skip("the native kernels are not available here")
    model = model_in_blocks("llama")
    stack = model.model.forward
    ids = torch.tensor([[5, 9, 13, 2, 8, 8, 4, 1, 7, 3, 6]])
    runs = []
    for one_call in (True, False):
        if not one_call:
            monkeypatch.setattr(model.model, "forward", stack.original)
        whole_cache, start_cache = new_cache(model), new_cache(model)
        with torch.no_grad():
            whole = model(ids, attention_mask=torch.ones_like(ids), past_key_values=whole_cache).logits
            model(ids[:, :4], attention_mask=torch.ones(1, 4, dtype=torch.long), past_key_values=start_cache)
            rest = model(ids[:, 4:], attention_mask=torch.ones_like(ids), position_ids=torch.arange(4, 11)[None],
                         past_key_values=start_cache).logits
        runs.append((whole, rest, whole_cache, start_cache))
    for a, b in zip(runs[0], runs[1]):
        if isinstance(a, torch.Tensor):
            assert torch.equal(a, b)
        else:
            for x, y in zip(a.layers, b.layers):
                assert torch.equal(x.keys, y.keys) and torch.equal(x.values, y.values)


@pytest.mark.parametrize("native", [True, False], ids=["native", "torch-fallback"])
@pytest.mark.parametrize("kind", GEMMAS)
def test_a_gemma_model_runs_every_layer_fused_and_computes_transformers_logits(kind, native, monkeypatch):
    """Six layers (gemma3: five sliding, one global, each with its rope base): every one fused, all in one native
    stack, the logits of transformers' own layers over the same blocks (its own cache, which drops what leaves the
    window), for a left-padded prompt and two steps: through the stack on the engine's cache (native), through the
    fused layers one by one on transformers' cache (both)."""
    if native and not ggml.native_kernels():
        pytest.skip("the native kernels are not available here")
    monkeypatch.setattr(decoder, "native_kernels", lambda: native)
    monkeypatch.setenv(KV_FLOAT32_ENV, "1")  # (transformers' float32 cache: what this compares is the arithmetic)
    torch.manual_seed(4)
    reference = CLASSES[kind][2](config_of(kind, 6)).eval()
    rng = np.random.default_rng(4)
    for layer in reference.model.layers:
        to_blocks(layer, rng)
    model = copy.deepcopy(reference)
    assert fuse_decoder_layers(model) == 6 and isinstance(model.model.forward, DecoderStack)
    assert not any(layer.two_calls for layer in model.model.layers)
    calls = []
    monkeypatch.setattr(torch.ops.rungen_ggml, "decoder_stack",
                        lambda *a, original=torch.ops.rungen_ggml.decoder_stack: calls.append(1) or original(*a))
    ids = torch.tensor([[0, 0, 5, 9, 13, 2], [7, 3, 5, 9, 13, 2]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    caches = DynamicCache(config=model.config), DynamicCache(config=model.config), new_cache(model)
    logits = [], [], []
    with torch.no_grad():
        for step in (None, 11, 17):
            if step is not None:
                mask = torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], -1)
            step_ids = ids if step is None else torch.tensor([[step], [step + 1]])
            for m, cache, out in zip((reference, model, model), caches, logits):
                out.append(m(step_ids, attention_mask=mask, past_key_values=cache).logits)
    assert len(calls) == (3 if native else 0)  # transformers' window cache: the layers one by one
    for theirs, ours, stacked in zip(*logits):
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(stacked, theirs, rtol=1e-4, atol=1e-4)
    assert logits[0][0].abs().max() > 0.1  # a real computation (gemma's logits are small at random weights)
    with torch.no_grad():  # a deep copy (the tests' model memo, a caller's) computes the same
        torch.testing.assert_close(copy.deepcopy(model)(ids, attention_mask=mask[:, :6]).logits,
                                   model(ids, attention_mask=mask[:, :6]).logits, rtol=0, atol=0)
