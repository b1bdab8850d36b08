"""GGUF files of the families beyond llama (qwen3, phi3, gemma2, gemma3) run through the fused decoder layers: their
config as the file states it (qwen3's and gemma's head size, Phi-4-mini's partial rotary, gemma2's soft-capping,
gemma's score scaling), their logits those of transformers' own model over the de-quantized weights, the same greedy
tokens fused and unfused, and what the tool cannot compute refused in one line. The files imitate the published ones
(tests/tiny_models.py, GGUF_FAMILIES)."""


import pytest
import torch

import run_generation
from helpers import blocks_and_reference, error_of
from rungen.gguf import build as gguf_loading
from rungen.gguf.blocks import GGMLLinear, native_kernels
from rungen.gguf.build import build_model
from rungen.gguf.decoder import DecoderStack, FusedDecoderLayer, products_one_by_one
from rungen.gguf.file import GGUFHeader
from rungen.loading import default_model_file
from tiny_models import default_tokenizer_fields, write_family_gguf

VOCAB = 2048
PROMPTS = ["The capital of France is", "Hello, my dog"]
# name -> (family, write_family_gguf's keywords)
FILES = {"qwen3": ("qwen3", {}), "phi3": ("phi3", {}), "phi3_partial_rotary": ("phi3", {"rotary": 24}),
         "gemma2": ("gemma2", {}), "gemma3": ("gemma3", {"layers": 6})}  # gemma3: five sliding layers, one global
FILES["phi3_longrope"] = ("phi3", {"longrope": True})  # Phi-3-mini-128k's, Phi-3.5-mini's
FILES["gemma3_linear_rope"] = ("gemma3", {"layers": 6, "rope_scaling": ("linear", 8.0)})  # gemma-3-4b's
# In the one-call stack: every one (gemma's sliding-window layers with their windows).
STACKED = tuple(FILES)


# Each module's GGUF header caches in a fresh folder (conftest's module_cache_home).
pytestmark = pytest.mark.usefixtures("module_cache_home")


@pytest.fixture(scope="module")
def tokenizer_fields():
    return default_tokenizer_fields(default_model_file(), VOCAB)


@pytest.fixture(scope="module")
def files(tmp_path_factory, tokenizer_fields):
    folder = tmp_path_factory.mktemp("families")
    return {name: write_family_gguf(folder / f"{name}.gguf", family, tokenizer_fields, **options)
            for name, (family, options) in FILES.items()}


@pytest.fixture(scope="module")
def loaded(files):
    """{file: (header, model in its own blocks, transformers' de-quantized float32 model)}, each loaded once."""
    return blocks_and_reference(files)


def test_the_config_has_the_files_head_size_and_rotary(loaded):
    config = loaded["qwen3"][0].config
    assert config.head_dim == 64 and config.hidden_size // config.num_attention_heads == 32  # key_length, not 64 / 2
    assert loaded["phi3_partial_rotary"][0].config.rope_parameters["partial_rotary_factor"] == 0.75  # 24 of 32
    assert loaded["phi3"][0].config.rope_parameters.get("partial_rotary_factor", 1.0) == 1.0
    longrope = loaded["phi3_longrope"][0].config.rope_parameters
    assert longrope["rope_type"] == "longrope" and longrope["original_max_position_embeddings"] == 128
    assert len(longrope["long_factor"]) == len(longrope["short_factor"]) == 16  # a factor per rotated pair
    assert 1 <= min(longrope["short_factor"]) and max(longrope["long_factor"]) <= 4
    gemma2, gemma3 = loaded["gemma2"][0].config, loaded["gemma3"][0].config
    assert (gemma2.attn_logit_softcapping, gemma2.final_logit_softcapping) == (20.0, 15.0)  # not the class's 50, 30
    assert gemma2.query_pre_attn_scalar == gemma3.query_pre_attn_scalar == 64  # the head size, as llama.cpp scales
    assert gemma3.layer_types.count("sliding_attention") == 5 and gemma3.sliding_window == 4
    assert gemma3.rope_parameters["full_attention"].get("rope_type", "default") == "default"
    scaled = loaded["gemma3_linear_rope"][0].config.rope_parameters
    assert scaled["full_attention"]["rope_type"] == "linear" and scaled["full_attention"]["factor"] == 8.0
    assert scaled["sliding_attention"].get("rope_type", "default") == "default"  # the local layers unscaled


@pytest.mark.parametrize("name", FILES)
def test_every_layer_is_fused_and_the_llama_shaped_run_in_the_one_call_stack(loaded, name):
    if not native_kernels():
        pytest.skip("the layers are fused over the native kernels' blocks")
    _, model, _ = loaded[name]
    layers = model.model.layers
    assert all(isinstance(layer, FusedDecoderLayer) for layer in layers)
    assert isinstance(model.model.forward, DecoderStack) == (name in STACKED)
    assert all((layer.q_norm is not None) == name.startswith(("qwen3", "gemma3")) for layer in layers)
    if name.startswith("phi3"):  # the file's attn_qkv and ffn_up are the fused products as they are
        assert layers[0].qkv.out_features == 3 * 64 and layers[0].gate_up.out_features == 2 * 128


def test_the_longrope_factors_change_the_function(loaded):
    """phi3_longrope holds phi3's weights, and its factors: its logits are another function's."""
    (header, plain, _), (_, scaled, _) = loaded["phi3"], loaded["phi3_longrope"]
    batch = header.tokenizer(PROMPTS[:1], return_tensors="pt")
    with torch.no_grad():
        assert (plain(**batch).logits - scaled(**batch).logits).abs().max() > 0.1


def test_past_the_original_context_longrope_switches_to_its_long_factors_as_transformers_does(loaded, monkeypatch):
    if not native_kernels():
        pytest.skip("the exact path is the native kernels' (torch's fallback rounds scales to bfloat16)")
    _, model, reference = loaded["phi3_longrope"]
    ids = torch.arange(3, 3 + 150)[None] % 2000  # past the original 128 positions
    with torch.no_grad(), monkeypatch.context() as patch, products_one_by_one(model):
        exact_products(patch)
        torch.testing.assert_close(model(ids).logits, reference(ids).logits, rtol=1e-4, atol=1e-4)
    assert torch.equal(model.model.rotary_emb.inv_freq, reference.model.rotary_emb.inv_freq)
    assert not torch.equal(model.model.rotary_emb.inv_freq, model.model.rotary_emb.original_inv_freq)  # long


@pytest.mark.parametrize("name", FILES)
def test_logits_match_transformers_over_the_dequantized_weights(loaded, name, monkeypatch):
    if not native_kernels():
        pytest.skip("the exact path is the native kernels' (torch's fallback rounds scales to bfloat16)")
    header, model, reference = loaded[name]
    batch = header.tokenizer(PROMPTS, return_tensors="pt", padding=True)
    with torch.no_grad(), monkeypatch.context() as patch, products_one_by_one(model):
        patch.setattr(GGMLLinear, "_matmul", lambda self, x: torch.ops.rungen_ggml.mm_tiled(
            x.float().contiguous(), self.blocks, self.code, self.in_features))
        exact = model(**batch).logits
        theirs = reference(**batch).logits
    real = batch["attention_mask"].bool()  # padding's logits are never read
    torch.testing.assert_close(exact[real], theirs[real], rtol=1e-4, atol=1e-4)
    assert theirs.abs().max() > 1  # a real computation


def greedy(header, model, count=12):
    ids = header.tokenizer(PROMPTS[:1], return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=count, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, ids.shape[1]:].tolist()


def exact_products(patch):
    """Every GGMLLinear product on the exactly de-quantized weights and float32 activations: the int8 rounding of
    the activations (the same function fused and unfused) turns a float sum's last bit into a flipped code, and on
    a 64-wide model into a logit a few tenths of a percent away, which can pass a near-tie."""
    patch.setattr(GGMLLinear, "_matmul", lambda self, x: torch.ops.rungen_ggml.mm_tiled(
        x.float().contiguous(), self.blocks, self.code, self.in_features))


@pytest.mark.parametrize("name", FILES)
def test_greedy_tokens_are_the_same_fused_and_unfused(loaded, name, monkeypatch):
    """The fused layers give the greedy tokens of transformers' own layers over the same blocks; where the model
    runs as one call a step, that call gives the fused layers' own tokens, rounding and all."""
    if not native_kernels():
        pytest.skip("the exact path is the native kernels' (torch's fallback rounds scales to bfloat16)")
    header, fused, _ = loaded[name]
    with monkeypatch.context() as patch:
        patch.setattr(gguf_loading, "fuse_decoder_layers", lambda model: 0)
        unfused = build_model(header, torch.float32)
    assert not any(isinstance(layer, FusedDecoderLayer) for layer in unfused.model.layers)
    with monkeypatch.context() as patch, products_one_by_one(fused):
        exact_products(patch)
        tokens = greedy(header, fused), greedy(header, unfused)
    assert tokens[0] == tokens[1]
    assert len(set(tokens[0])) > 1  # not one token repeated, which any two models might agree on
    if name in STACKED:  # the stack with the products' own rounding: the layers' bits
        with products_one_by_one(fused):
            layer_by_layer = greedy(header, fused)
        assert greedy(header, fused) == layer_by_layer


@pytest.mark.parametrize("family, options, reason", [
    ("phi3", {"longrope": "factors only"}, "rope.scaling.original_context_length"),
    ("qwen3", {"value_length": 32}, "keys of 64 and values of 32"),
    ("gemma3", {"rope_scaling": ("yarn", 4.0)}, "scaled by 'yarn'"),
], ids=["phi3-longrope", "qwen3-value-length", "gemma3-yarn"])
def test_what_the_tool_cannot_compute_is_refused_in_one_line(tokenizer_fields, tmp_path, capsys, family, options,
                                                            reason):
    path = write_family_gguf(tmp_path / f"{family}.gguf", family, tokenizer_fields, **options)
    code, line = error_of(["--model_name_or_path", path, "--prompt", "Hi"], capsys)
    assert code == 2 and line.startswith(f"run_generation.py: error: {path}") and reason in line
    code, line = error_of(["--model_name_or_path", path, "--prompt", "Hi", "--dequantize"], capsys)
    assert code == 2 and reason in line  # transformers' own loader would compute another function


@pytest.mark.parametrize("name", ["qwen3", "gemma3"])
def test_the_command_line_generates_from_the_file(files, name):
    args = ["--model_name_or_path", files[name], "--prompt", PROMPTS[0], "--temperature", "0", "--length", "5"]
    first, second = run_generation.main(args), run_generation.main(args)
    assert len(first) == 1 and first[0].startswith(PROMPTS[0]) and len(first[0]) > len(PROMPTS[0])
    assert first == second  # greedy: the same text again


def test_gemma2_27b_scales_its_scores_by_hidden_over_heads(tokenizer_fields, tmp_path):
    # llama.cpp knows gemma-2-27b by its 46 layers and scales by hidden / heads (4608 / 32 = 144, its
    # query_pre_attn_scalar), not by the head size (128); here 64 / 2 = 32, the head size 64.
    path = write_family_gguf(tmp_path / "gemma2_27b.gguf", "gemma2", tokenizer_fields, layers=46)
    config = GGUFHeader(path).config
    assert config.query_pre_attn_scalar == 32 and config.head_dim == 64
