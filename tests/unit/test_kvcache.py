"""Fast tier: GrowingLayer (the own Cache's, and the one on transformers' DynamicLayer) holds what transformers'
DynamicLayer holds through every operation generate(), the terminal session and the server apply (steps, crop, row
selection, repeat), writing steps in place; the own Cache crops as DynamicCache does; the native attention reads
its strided views as it reads contiguous tensors."""

import pytest
import torch
from transformers.cache_utils import DynamicLayer

from rungen.gguf import blocks as ggml
from rungen.kvcache import MIN_ROOM, Cache, GrowingLayer, transformers_layer


def states(batch, tokens, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 3, tokens, 8, generator=g), torch.randn(batch, 3, tokens, 8, generator=g)


def both(operation, layers):
    for layer in layers:
        operation(layer)
    torch.testing.assert_close(layers[0].keys, layers[1].keys, rtol=0, atol=0)
    torch.testing.assert_close(layers[0].values, layers[1].values, rtol=0, atol=0)
    assert layers[0].get_seq_length() == layers[1].get_seq_length()


@pytest.mark.parametrize("kind", ["own", "transformers"])
def test_growing_layer_holds_what_dynamic_layer_holds(kind):
    layers = GrowingLayer() if kind == "own" else transformers_layer()(), DynamicLayer()
    both(lambda layer: layer.update(*states(2, 5, 0)), layers)  # a prompt
    buffer = layers[0].buffers[0].data_ptr()
    for step in range(MIN_ROOM - 5):  # steps within the room: written in place, no new buffer
        step_states = states(2, 1, 1 + step)
        both(lambda layer, given=step_states: layer.update(*given), layers)
        assert layers[0].buffers[0].data_ptr() == buffer and layers[0].keys.data_ptr() == buffer
    both(lambda layer: layer.update(*states(2, 1, 100)), layers)  # past the room: moved to larger buffers
    assert layers[0].buffers[0].shape[-2] > MIN_ROOM + 1
    both(lambda layer: layer.crop(-4), layers)  # a session's next turn rewinds...
    both(lambda layer: layer.update(*states(2, 3, 101)), layers)  # ...and overwrites what was cut
    if kind == "own":
        return  # the engine selects the own cache's rows by new_cache from (keys, values), not on its layers
    both(lambda layer: layer.batch_select_indices(torch.tensor([1])), layers)  # a row leaves
    both(lambda layer: layer.update(*states(1, 1, 102)), layers)
    both(lambda layer: layer.batch_repeat_interleave(3), layers)  # beams, n > 1
    both(lambda layer: layer.update(*states(3, 2, 103)), layers)


def test_own_cache_crops_as_dynamic_cache():
    from transformers import DynamicCache

    own, theirs = Cache([GrowingLayer(), GrowingLayer()]), DynamicCache()
    for cache in (own, theirs):
        for index in range(2):
            cache.update(*states(1, 7, index), index)
    for remove in (-2, 0, -5):  # some, none, all that is left
        own.crop(remove)
        theirs.crop(remove)
        assert own.get_seq_length() == theirs.get_seq_length()
        for a, b in zip(own.layers, theirs.layers):
            assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    for cache in (own, theirs):
        with pytest.raises(ValueError):
            cache.crop(1)


def test_what_the_layer_was_filled_from_is_never_written():
    keys, values = states(1, 6, 7)
    kept = keys.clone(), values.clone()
    layer = GrowingLayer()
    layer.update(keys, values)
    layer.update(*states(1, 1, 8))
    assert torch.equal(keys, kept[0]) and torch.equal(values, kept[1])


def test_native_attention_reads_the_strided_views_in_place():
    if not ggml.native_kernels():
        pytest.skip("the native kernels are not available here")
    layer = GrowingLayer()
    layer.update(*states(2, 7, 9))
    layer.update(*states(2, 1, 10))
    assert not layer.keys.is_contiguous()
    q = torch.randn(2, 6, 1, 8)
    mask = torch.tensor([[False, False, True, True, True, True, True, True], [True] * 8])[:, None, None, :]
    for m in (None, mask):
        strided = torch.ops.rungen_ggml.attend(q, layer.keys, layer.values, m, 0.3)
        dense = torch.ops.rungen_ggml.attend(q, layer.keys.contiguous(), layer.values.contiguous(), m, 0.3)
        assert torch.equal(strided, dense)


def test_layers_that_read_another_layers_keys_take_no_room_of_their_own():
    """Gemma 4 E2B/E4B read their last layers' keys and values from earlier layers (transformers' DummyLayer in the
    cache): a token's keys/values are the other layers' only, and the batch's cache keeps the DummyLayers as such."""
    import torch
    import transformers

    from rungen.batch_cache import probed_layers, token_bytes
    from rungen.kvcache import holding, new_cache

    config = transformers.Gemma4TextConfig(
        vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, sliding_window=8, max_position_embeddings=128,
        layer_types=["sliding_attention", "full_attention"] * 2, hidden_size_per_layer_input=16,
        vocab_size_per_layer_input=64, num_kv_shared_layers=2)
    shared = transformers.Gemma4ForCausalLM(config).eval()
    cache = new_cache(shared)
    assert len(cache.layers) == 4 and len(holding(cache)) == 2
    assert [type(layer).__name__ for layer in cache.layers][2:] == ["DummyLayer", "DummyLayer"]
    alone = transformers.Gemma4ForCausalLM(config.__class__(**{**config.to_dict(), "num_kv_shared_layers": 0})).eval()
    cpu = torch.device("cpu")
    assert 2 * token_bytes(probed_layers(shared, cpu, "gemma4_text", 1)) == token_bytes(
        probed_layers(alone, cpu, "gemma4_text", 1))
