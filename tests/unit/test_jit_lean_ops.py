"""Fast tier: the leaner norm and rotary embedding --jit traces compute the model's own bits, are used
only where they do, and are gone once tracing ends."""

import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama import modeling_llama

from rungen.jit import _lean_ops, _lean_rotary


def tiny_llama(dtype=torch.float32):
    # SmolLM2's quirks at toy size: grouped-query attention, tied head, eps 1e-5, rope theta 100k.
    config = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
                         rope_theta=100000.0, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval().to(dtype)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, modeling_llama.LlamaRMSNorm):
                module.weight.normal_(1.0, 0.3)  # trained norms are not all ones
    return model


def prefill_and_step(model):
    """Logits of a padded 2-prompt prefill and of one decode step after it."""
    ids = torch.randint(0, 97, (2, 5), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 5, dtype=torch.long)
    mask[1, :2] = 0
    with torch.no_grad():
        first = model(input_ids=ids, attention_mask=mask, use_cache=True)
        step = model(input_ids=ids[:, :1], attention_mask=torch.cat([mask, mask[:, :1] * 0 + 1], 1),
                     past_key_values=first.past_key_values, use_cache=True)
    return first.logits, step.logits


def test_lean_ops_give_the_models_bits_and_are_undone_after():
    model = tiny_llama()
    want = prefill_and_step(model)
    norms = [m for m in model.modules() if isinstance(m, modeling_llama.LlamaRMSNorm)]
    original_rotary = modeling_llama.apply_rotary_pos_emb
    with _lean_ops(model):
        assert all("forward" in vars(norm) for norm in norms)  # every norm replaced...
        assert modeling_llama.apply_rotary_pos_emb is not original_rotary  # ...and the rotary embedding
        got = prefill_and_step(model)
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    assert not any("forward" in vars(norm) for norm in norms)
    assert modeling_llama.apply_rotary_pos_emb is original_rotary


def test_lean_ops_keep_the_models_code_where_bits_would_differ():
    # In bfloat16 the norm computes in float32 and casts back: the lean norm would not, so it stays out.
    model = tiny_llama(torch.bfloat16)
    norms = [m for m in model.modules() if isinstance(m, modeling_llama.LlamaRMSNorm)]
    with _lean_ops(model):
        assert not any("forward" in vars(norm) for norm in norms)

    def interleaved(q, k, cos, sin, unsqueeze_dim=1):  # GPT-J's rotate-every-two, another rotation
        def rotate(x):
            return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)
        cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
        return q * cos + rotate(q) * sin, k * cos + rotate(k) * sin
    assert _lean_rotary(interleaved, tiny_llama()) is None
    assert _lean_rotary(modeling_llama.apply_rotary_pos_emb, tiny_llama()) is not None
