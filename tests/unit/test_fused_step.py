"""Fast tier: the fused decode step (rungen/fused_step.py, the engine's step on a GPU) computes what transformers'
layers compute over the same slots, for every family of its table (llama; mistral; qwen2's q/k/v biases; qwen3's
per-head q/k norms; phi3's one q/k/v and one gate/up projection and its partial rotary; the mixtures of experts,
their blocks called whole; SmolLM3's layer without rotary), rows at different positions
in float32 and bfloat16; and its concatenated projections hold no weight twice. Here with torch's operators
(step_kernels.TORCH); the Triton kernels against them: tests/test_cuda.py."""

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    MistralConfig,
    Phi3Config,
    Qwen2Config,
    Qwen2MoeConfig,
    Qwen3Config,
    Qwen3MoeConfig,
    SmolLM3Config,
)

from rungen import fused_step
from rungen.slots import SlotCache, decode_step, prefill_step
from rungen.step_kernels import TORCH

SIZES = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=0)
FAMILIES = {
    "llama": (LlamaConfig, dict(head_dim=16)),
    "mistral": (MistralConfig, dict(head_dim=16, sliding_window=None)),
    "qwen2": (Qwen2Config, dict(use_sliding_window=False)),  # q/k/v with biases
    "qwen3": (Qwen3Config, dict(head_dim=32)),  # q/k norms, a head wider than hidden / heads
    "phi3": (Phi3Config, dict(partial_rotary_factor=0.5)),  # fused projections, half of each head rotated
    # mixtures: qwen3's attention and 4 experts of 32 (2 a token), the second layer's MLP dense (mlp_only_layers);
    # qwen2's attention and beside the experts a shared one behind its own gate
    "qwen3_moe": (Qwen3MoeConfig, dict(head_dim=32, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                       mlp_only_layers=[1])),
    "qwen2_moe": (Qwen2MoeConfig, dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                       shared_expert_intermediate_size=48, use_sliding_window=False)),
    "smollm3": (SmolLM3Config, dict(no_rope_layers=[1, 0])),  # its second layer without rotary
}
PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14]]


def model_of(family, dtype):
    config_class, extra = FAMILIES[family]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config_class(**SIZES, **extra), dtype=dtype).eval()
    with torch.no_grad():  # biases that matter (transformers starts them at zero)
        for module in model.modules():
            if isinstance(module, torch.nn.Linear) and module.bias is not None:
                module.bias.normal_(0, 0.5)
    return model


def decoded(model, step, steps=6):
    """Greedy tokens and each step's logits of PROMPTS decoded together over slots by `step`."""
    config = model.config
    size = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    cache = SlotCache(config.num_hidden_layers, 4, 256)
    empty = torch.zeros(1, config.num_key_value_heads, 0, size, dtype=model.dtype)
    cache.ensure(len(PROMPTS), 64, [(empty, empty)] * config.num_hidden_layers)
    tokens, logits_seen = [], []
    with torch.inference_mode():
        logits = prefill_step(model, cache, 0, PROMPTS, [0] * len(PROMPTS), torch.device("cpu"))
        cache.rows = len(PROMPTS)
        positions = torch.tensor([len(prompt) for prompt in PROMPTS])
        for _ in range(steps):
            chosen = logits.argmax(-1)[:, None]
            tokens.append(chosen[:, 0].tolist())
            logits = step(model, cache, chosen, positions, cache.step_length(int(positions.max())))
            logits_seen.append(logits)
            positions = positions + 1
    return tokens, torch.stack(logits_seen)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_fused_step_decodes_as_transformers_layers(family, dtype):
    model = model_of(family, dtype)
    assert fused_step.why_not(model) is None
    expected_tokens, expected = decoded(model, decode_step)
    tokens, logits = decoded(model, fused_step.FusedStep(model, TORCH))
    assert tokens == expected_tokens
    # the same operators in the same order but for the concatenated products and attention's head layout
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-5 if dtype == torch.float32 else 0.02)


def storages(model):
    return {parameter.untyped_storage().data_ptr(): parameter.untyped_storage().nbytes()
            for parameter in model.parameters()}


def test_the_concatenated_projections_hold_no_weight_twice():
    model = model_of("llama", torch.float32)
    before = sum(storages(model).values())
    attention = model.model.layers[0].self_attn
    weights = [getattr(attention, name).weight.detach().clone() for name in ("q_proj", "k_proj", "v_proj")]
    step = fused_step.FusedStep(model, TORCH)
    assert sum(storages(model).values()) == before  # the three weights are views of one, the old ones let go
    one = step.layers[0].qkv.one.weight
    for name, weight in zip(("q_proj", "k_proj", "v_proj"), weights):
        module = getattr(attention, name)
        assert module.weight.untyped_storage().data_ptr() == one.untyped_storage().data_ptr()
        assert torch.equal(module.weight, weight)


def test_the_step_is_wanted_on_a_gpu_unless_switched_off(monkeypatch):
    monkeypatch.delenv(fused_step.FUSED_STEP_ENV, raising=False)
    assert fused_step.wanted(torch.device("cuda")) and not fused_step.wanted(torch.device("cpu"))
    monkeypatch.setenv(fused_step.FUSED_STEP_ENV, "0")
    assert not fused_step.wanted(torch.device("cuda"))
    monkeypatch.setenv(fused_step.FUSED_STEP_ENV, "1")
    assert fused_step.wanted(torch.device("cpu"))


def test_a_family_without_fused_layers_keeps_transformers_step():
    config = LlamaConfig(**SIZES, head_dim=16, hidden_act="gelu")
    model = AutoModelForCausalLM.from_config(config).eval()
    assert fused_step.why_not(model) == "activation gelu"
    assert fused_step.for_model(model, torch.device("cuda")) is None


@pytest.mark.parametrize("family", ["mistral", "phi3", "qwen2"])
def test_a_model_with_a_sliding_window_keeps_transformers_step(family):
    # Mistral-7B-v0.1's window, Phi-3-mini's (2047), Qwen2's sliding layers: the fused attention reads every position
    # of a slot, so their steps stay transformers' layers over the slots, whose masks keep the window.
    config_class, extra = FAMILIES[family]
    extra = {**extra, "sliding_window": 8} | ({"use_sliding_window": True, "max_window_layers": 1}
                                             if family == "qwen2" else {})
    model = AutoModelForCausalLM.from_config(config_class(**SIZES, **extra)).eval()
    assert fused_step.why_not(model) == "a sliding window of 8 (the fused attention reads every position)"
    assert fused_step.for_model(model, torch.device("cuda")) is None


def test_a_model_whose_forward_is_hooked_keeps_transformers_step():
    # accelerate's offload (and a caller's hook) lives in the modules' forward, which the fused step would skip
    model = model_of("llama", torch.float32)
    model.model.layers[1].mlp.register_forward_hook(lambda module, args, out: out)
    assert fused_step.why_not(model).startswith("its forward is hooked")
    assert fused_step.for_model(model, torch.device("cuda")) is None


def test_fused_layers_that_fail_to_build_leave_transformers_step(monkeypatch, caplog):
    # a layer of a form the table did not foresee: one warning, transformers' layers decode, the model intact
    model = model_of("llama", torch.float32)
    expected_tokens, expected = decoded(model, decode_step)

    def fails(modules):
        raise ValueError("a form of codes no class knows")

    monkeypatch.setattr(fused_step, "concatenated", fails)
    monkeypatch.setenv(fused_step.FUSED_STEP_ENV, "1")
    assert fused_step.for_model(model, torch.device("cpu")) is None
    assert "the fused ones failed to build (ValueError: a form of codes no class knows)" in caplog.text
    tokens, logits = decoded(model, decode_step)
    assert tokens == expected_tokens and torch.equal(logits, expected)
