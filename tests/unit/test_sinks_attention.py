"""gpt-oss's attention without eager attention's scores of every query against every key (rungen/sinks_attention.py):
what transformers' eager attention computes, for a prompt (causal, padded, after a cached prefix, in a sliding window)
and a decode step, each key and value head serving its group of query heads; a long prompt without the scores."""

import pytest
import torch

from rungen.sinks_attention import sinks_attention


class Module(torch.nn.Module):  # what the attention reads of GptOssAttention
    def __init__(self, heads, kv_heads, generator):
        super().__init__()
        self.sinks = torch.nn.Parameter(torch.randn(heads, generator=generator) * 2)
        self.num_key_value_groups = heads // kv_heads
        self.training = False


def causal(queries, keys, window=None, padding=0, rows=2):
    at = torch.arange(keys)
    seen = at[None, :] <= at[keys - queries:, None]
    if window is not None:
        seen &= at[None, :] > at[keys - queries:, None] - window
    seen = seen[None, None].repeat(rows, 1, 1, 1)
    seen[0, ..., :padding] = False  # the first row left-padded
    return seen


@pytest.mark.parametrize("queries, keys, window, padding", [(9, 9, None, 0), (9, 9, None, 3), (5, 12, None, 2),
                                                            (12, 12, 4, 0), (1, 12, None, 3), (1, 12, 4, 0)])
def test_sinks_attention_computes_what_eager_attention_does(queries, keys, window, padding):
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    generator = torch.Generator().manual_seed(queries + keys)
    heads, kv_heads, size = 8, 2, 64
    module = Module(heads, kv_heads, generator)
    query = torch.randn(2, heads, queries, size, generator=generator)
    key, value = (torch.randn(2, kv_heads, keys, size, generator=generator) for _ in range(2))
    seen = causal(queries, keys, window, padding)
    additive = torch.zeros(seen.shape).masked_fill_(~seen, torch.finfo(torch.float32).min)
    with torch.no_grad():
        theirs, _ = eager_attention_forward(module, query, key, value, additive, scaling=size ** -0.5)
        for mask in (seen, additive) + ((None,) if window is None and not padding else ()):
            ours, _ = sinks_attention(module, query, key, value, mask, scaling=size ** -0.5)
            assert ours.shape == (2, queries, heads, size)
            torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("masked", [False, True])
def test_a_long_prompt_holds_no_scores_of_every_query_against_every_key(masked):
    # 2048 tokens, 16 heads over 2 (gpt-oss's groups of 8): eager attention's scores are 16 x 2048 x 2048 float32
    # (268 MB, twice over with the sinks beside them); the prompt's attention here allocates nothing near them: alone
    # and causal (no mask), nothing of queries x keys at all; under a mask (padding, a window, the slots), the mask
    # alone, one head's worth.
    from torch.profiler import ProfilerActivity, profile

    generator = torch.Generator().manual_seed(0)
    heads, kv_heads, size, tokens = 16, 2, 64, 2048
    module = Module(heads, kv_heads, generator)
    query = torch.randn(1, heads, tokens, size, generator=generator)
    key, value = (torch.randn(1, kv_heads, tokens, size, generator=generator) for _ in range(2))
    mask = causal(tokens, tokens, window=128, rows=1) if masked else None
    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as run:
        sinks_attention(module, query, key, value, mask, scaling=size ** -0.5)
    largest = max(event.cpu_memory_usage for event in run.events())
    held = tokens * (tokens + 1) * 4 if masked else 1.05 * (tokens + 1) * heads * (size + 8) * 4  # (the keys spread)
    assert 0 < largest <= held < heads * tokens * tokens * 4 / 8


def test_a_gpt_oss_checkpoint_loads_on_the_sinks_attention_and_computes_what_eager_attention_does(tmp_path):
    # The tool's load of a gpt-oss checkpoint (transformers' eager attention by default: sdpa has no sinks) takes
    # sinks_attention, with sdpa's masks: a left-padded prompt and two steps over the tool's cache (its sliding
    # layers' window and all) give transformers' eager model's logits.
    from transformers import AutoModelForCausalLM

    from helpers import padded_prompt_and_steps
    from rungen.loading import load
    from rungen.sinks_attention import SINKS_ATTENTION
    from tiny_models import gpt_oss_checkpoint

    checkpoint = gpt_oss_checkpoint(str(tmp_path))
    theirs = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    assert theirs.config._attn_implementation == "eager"
    ours = load(checkpoint, device=torch.device("cpu")).model
    assert ours.config._attn_implementation == SINKS_ATTENTION
    for got, wanted in zip(padded_prompt_and_steps(ours), padded_prompt_and_steps(theirs)):
        torch.testing.assert_close(got, wanted, rtol=1e-4, atol=1e-4)
