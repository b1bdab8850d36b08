"""GGUF files run in their own blocks: every supported block type becomes a GGMLLinear whose logits match
the de-quantized float model's, the header is cached, and broken or unsupported files fail in one line.

The synthetic files imitate llama.cpp's: llama metadata keys, the default model's tokenizer fields, tensors
named token_embd/blk.N.*/output_norm with q/k rows permuted as convert_hf_to_gguf.py permutes them, and
k-quant blocks with valid fp16 scales (the gguf package cannot quantize to k-quants: their blocks are
random bytes, which any de-quantizer reads as some weights)."""

import contextlib
import gc
import importlib
import io
import logging
import os
import sys

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGUFReader, GGUFWriter, quants
from gguf import GGMLQuantizationType as Q

import run_generation
from helpers import (
    as_converted,
    assert_float16_cache_as_rounded,
    blocks_and_reference,
    error_of,
    experts_apart,
    plain_grouped_kernel,
    round_as_q8_0_file,
)
from rungen.gguf import weights
from rungen.gguf.blocks import (
    BLOCKS_MATMUL,
    INTERLEAVED_TYPES,
    SUPPORTED,
    CastLinear,
    GGMLEmbedding,
    GGMLLinear,
    GGMLParts,
    native_kernels,
)
from rungen.gguf.build import build_model
from rungen.gguf.decoder import DecoderStack, FusedDecoderLayer, products_one_by_one
from rungen.gguf.experts import ExpertRouter, GGMLExperts
from rungen.gguf.file import GGUFHeader, metadata_parsed_once
from rungen.gguf.model import GGUFCausalLM
from rungen.gguf.native_steps import NATIVE_ATTENTION, NativeGatedMLP, NativeGemma4Attention, NativeGptOssAttention
from rungen.gguf.weights import GGUFError
from rungen.kvcache import KV_FLOAT32_ENV, new_cache
from rungen.loading import default_model_file, load, load_gguf
from tiny_models import default_tokenizer_fields, write_gpt2_gguf, write_out

DEFAULT_GGUF = default_model_file()
HIDDEN, FFN, HEADS, KV_HEADS, LAYERS = 256, 512, 4, 2, 2  # k-quant rows need multiples of 256
# Each layer's linear weights in a different type, so that one file holds every type the loader runs.
MIXED = [
    {"attn_q": Q.Q4_0, "attn_k": Q.Q4_1, "attn_v": Q.Q8_0, "attn_output": Q.Q4_K,
     "ffn_gate": Q.Q5_K, "ffn_up": Q.Q6_K, "ffn_down": Q.F16},
    {"attn_q": Q.Q4_K, "attn_k": Q.Q5_K, "attn_v": Q.Q6_K, "attn_output": Q.Q4_0,
     "ffn_gate": Q.BF16, "ffn_up": Q.Q8_0, "ffn_down": Q.Q4_1},
    # As llama.cpp's Q4_K_M of a small model whose rows are not whole superblocks: q/k/v in Q5_0 (fused into one
    # product), and the other types a published file may hold.
    {"attn_q": Q.Q5_0, "attn_k": Q.Q5_0, "attn_v": Q.Q5_0, "attn_output": Q.Q5_1,
     "ffn_gate": Q.Q2_K, "ffn_up": Q.Q2_K, "ffn_down": Q.IQ4_XS},
    {"attn_q": Q.Q3_K, "attn_k": Q.IQ4_NL, "attn_v": Q.MXFP4, "attn_output": Q.IQ4_NL,
     "ffn_gate": Q.Q3_K, "ffn_up": Q.IQ4_XS, "ffn_down": Q.Q5_1},
]
FILES = {
    # The default model's layout: Q8_0 embedding tied to the head, no output.weight.
    "mixed_tied": dict(layers=MIXED, embedding=Q.Q8_0, output=None),
    # llama.cpp's Q4_0 files: Q4_0 everywhere but a Q6_K output head.
    "q4_0_untied": dict(layers=[{}] * LAYERS, default=Q.Q4_0, embedding=Q.Q4_0, output=Q.Q6_K),
    # llama.cpp's Q4_K_M of a model with tied embeddings: Q4_K, but Q6_K for the embedding (which it quantizes
    # as the output head it also is) and, in the layers it gives more bits (here the last), attn_v and ffn_down.
    "q4_k_m_tied": dict(layers=[{}, {"attn_v": Q.Q6_K, "ffn_down": Q.Q6_K}], default=Q.Q4_K, embedding=Q.Q6_K,
                        output=None),
    # llama.cpp's Q6_K: every weight Q6_K, the head its own tensor.
    "q6_k_untied": dict(layers=[{}] * LAYERS, default=Q.Q6_K, embedding=Q.Q6_K, output=Q.Q6_K),
    # Qwen2: biases on q/k/v (F32), no q/k permutation; transformers' generic tensor processor.
    "qwen2_biases": dict(arch="qwen2", layers=[{}] * LAYERS, default=Q.Q8_0, embedding=Q.Q8_0, output=Q.Q4_K),
}
PROMPTS = ["The capital of France is", "Hello, my dog", "A"]


# Each module's GGUF header caches in a fresh folder (conftest's module_cache_home).
pytestmark = pytest.mark.usefixtures("module_cache_home")


VOCAB = 4096  # the default model's first tokens: its special tokens, the 256 bytes and the commonest merges


@pytest.fixture(scope="module")
def tokenizer_fields():
    """The default model's tokenizer.* metadata as (key, value, type, element type), its vocabulary cut to
    its first VOCAB tokens and the merges among them: the same byte-level BPE, special tokens and chat
    template, in a file whose metadata parses in a fraction of a second instead of seconds."""
    return default_tokenizer_fields(DEFAULT_GGUF, VOCAB)


def permute(weights, heads, kv_heads):
    """convert_hf_to_gguf.py's LlamaModel.permute: the rows of q and k as llama.cpp's rotary wants them."""
    heads = kv_heads if kv_heads is not None and heads != kv_heads else heads
    return weights.reshape(heads, 2, weights.shape[0] // heads // 2, *weights.shape[1:]).swapaxes(1, 2) \
        .reshape(weights.shape)


# Types the gguf package cannot quantize to, written as random blocks: where their float16 scales lie (byte
# offset, and how many: d, or d and dmin); their other bytes (codes, sub-scales) may be anything.
RAW_SCALES = {Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208, 1), Q.Q2_K: (80, 2), Q.Q3_K: (108, 1),
              Q.IQ4_NL: (0, 1), Q.IQ4_XS: (0, 1), Q.IQ2_XXS: (0, 1)}


def encode(values, qtype, rng):
    """(data, raw_dtype) for GGUFWriter.add_tensor: float values in `qtype`, or random blocks (RAW_SCALES)."""
    if qtype == Q.F32:
        return values.astype(np.float32), None
    if qtype == Q.F16:
        return values.astype(np.float16), None
    if qtype in RAW_SCALES:
        block, size = GGML_QUANT_SIZES[qtype]
        blocks = rng.integers(0, 256, (values.shape[0], values.shape[1] // block, size), dtype=np.uint8)
        offset, count = RAW_SCALES[qtype]
        # d of the IQ4 types multiplies values up to 127 (and IQ4_XS's sub-scales up to 32): smaller. Q6_K's d
        # multiplies random int8 sub-scales times codes up to 32 (up to 4096 d): smaller, so that its weights stay
        # below one rather than reaching four, whose activations grow until float32 rounding alone moves the
        # logits past the comparison's tolerance.
        high = {Q.IQ4_NL: 1e-4, Q.IQ4_XS: 1e-4, Q.Q6_K: 2e-4}.get(qtype, 1e-3)
        scales = rng.uniform(high / 5, high, blocks.shape[:2] + (count,)).astype(np.float16).view(np.uint8)
        blocks[..., offset:offset + 2 * count] = scales
        return blocks.reshape(values.shape[0], -1), qtype
    return quants.quantize(values.astype(np.float32), qtype), qtype


def write_llama_gguf(path, tokenizer_fields, layers, embedding, output, default=None, seed=0, arch="llama",
                     shapes_of=None):
    """`shapes_of`: {(layer, name): shape} of tensors whose shape is not the one the metadata describes."""
    rng = np.random.default_rng(seed)
    vocab = next(len(value) for key, value, *_ in tokenizer_fields if key == "tokenizer.ggml.tokens")
    writer = GGUFWriter(str(path), arch)
    writer.add_name("Synthetic Llama")
    writer.add_context_length(2048)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(len(layers))
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_rope_dimension_count(HIDDEN // HEADS)
    writer.add_vocab_size(vocab)
    for key, value, vtype, sub_type in tokenizer_fields:
        writer.add_key_value(key, value, vtype, sub_type)

    def add(name, values, qtype):
        data, raw_dtype = encode(values, qtype, rng)
        writer.add_tensor(name, data, raw_dtype=raw_dtype)

    add("token_embd.weight", rng.normal(0, 0.5, (vocab, HIDDEN)), embedding)
    kv = HIDDEN // HEADS * KV_HEADS
    shapes = {"attn_q": (HIDDEN, HIDDEN), "attn_k": (kv, HIDDEN), "attn_v": (kv, HIDDEN),
              "attn_output": (HIDDEN, HIDDEN), "ffn_gate": (FFN, HIDDEN), "ffn_up": (FFN, HIDDEN),
              "ffn_down": (HIDDEN, FFN)}
    for number, types in enumerate(layers):
        add(f"blk.{number}.attn_norm.weight", rng.uniform(0.8, 1.2, HIDDEN), Q.F32)
        add(f"blk.{number}.ffn_norm.weight", rng.uniform(0.8, 1.2, HIDDEN), Q.F32)
        for name, shape in shapes.items():
            values = rng.normal(0, 0.08, (shapes_of or {}).get((number, name), shape))
            if name in ("attn_q", "attn_k") and arch == "llama":
                values = permute(values, HEADS, HEADS if name == "attn_q" else KV_HEADS)
            add(f"blk.{number}.{name}.weight", values, types.get(name, default))
            if name in ("attn_q", "attn_k", "attn_v") and arch == "qwen2":
                add(f"blk.{number}.{name}.bias", rng.normal(0, 0.5, shape[0]), Q.F32)
    add("output_norm.weight", rng.uniform(0.8, 1.2, HIDDEN), Q.F32)
    if output is not None:
        add("output.weight", rng.normal(0, 0.08, (vocab, HIDDEN)), output)
    return write_out(writer, path)


@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory, tokenizer_fields):
    folder = tmp_path_factory.mktemp("gguf")
    return {name: write_llama_gguf(folder / f"{name}.gguf", tokenizer_fields, **spec) for name, spec in FILES.items()}


@pytest.fixture(scope="module")
def loaded(gguf_files):
    """{file: (header, model in its own blocks, the de-quantized float32 reference)}, each loaded once.

    The reference is transformers' own GGUF loader (what --dequantize runs); it shares the header's one
    parse of the file's metadata, and reads the weights itself."""
    return blocks_and_reference(gguf_files)


@pytest.mark.parametrize("name", FILES)
def test_logits_match_the_dequantized_float_model(loaded, name, monkeypatch):
    header, model, reference = loaded[name]
    batch = header.tokenizer(PROMPTS[:2], return_tensors="pt", padding=True)
    with torch.no_grad():
        theirs = reference(**batch).logits
        decoding = model(**batch).logits  # activations rounded to int8 per block of 32, as llama.cpp rounds them
        exact = exact_weights(model, lambda: model(**batch).logits, monkeypatch)
    # The same de-quantized values multiplied in another order: float32 rounding only.
    torch.testing.assert_close(exact, theirs, rtol=1e-4, atol=1e-4)
    assert exact.abs().max() > 1  # logits of a real computation, not two zero tensors
    # int8 activations per block of 32 (as llama.cpp's) move the logits by about a percent of their range,
    # at the positions a prompt's tokens hold (padding's logits are never read).
    real = batch["attention_mask"].bool()
    error = (decoding - theirs)[real].abs()
    assert error.mean() < 0.01 * theirs[real].abs().max() and error.max() < 0.1 * theirs[real].abs().max()


def greedy(model, input_ids, steps):
    """`steps` tokens, each the argmax of a full forward pass over the sequence so far."""
    for _ in range(steps):
        next_token = model(input_ids=input_ids).logits[:, -1].argmax(-1, keepdim=True)
        input_ids = torch.cat([input_ids, next_token], dim=-1)
    return input_ids


def test_greedy_tokens_match_the_dequantized_float_model(loaded, monkeypatch):
    # Every supported type in its own blocks (the file's third and fourth layers hold the types published Q4_K_M,
    # Q3_K, Q2_K and IQ4 files add), products on float32 activations: the greedy text of --dequantize's model
    # (the weights are the same values, the sums in another order). With activations rounded to int8 per block
    # the logits move by about a percent (test above), which may change a near tie: that path is not held to it.
    header, model, reference = loaded["mixed_tied"]
    assert {m.qtype for m in model.model.layers[2:].modules() if isinstance(m, GGMLLinear)} >= {
        Q.Q5_0, Q.Q5_1, Q.Q2_K, Q.Q3_K, Q.IQ4_NL, Q.IQ4_XS}
    for prompt in PROMPTS[:2]:
        input_ids = header.tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            theirs = greedy(reference, input_ids, 8)
            ours = exact_weights(model, lambda ids=input_ids: greedy(model, ids, 8), monkeypatch)
        assert torch.equal(ours, theirs), prompt


def test_torch_fallback_runs_every_type(gguf_files, loaded, monkeypatch, capfd):
    # Without the native kernels (RUN_GENERATION_KERNELS=torch, or no compiler) every supported type loads and
    # runs on torch's kernels (int4 packing for Q4_0/Q4_1/Q4_K, float16 for the others): the logits within their
    # rounding of the de-quantized float model's.
    from rungen.gguf import kernels

    monkeypatch.setenv(kernels.KERNELS_ENV, "torch")
    monkeypatch.setattr(kernels, "_native", None)
    header, _, reference = loaded["mixed_tied"]
    model = build_model(GGUFHeader(gguf_files["mixed_tied"]), torch.float32)
    assert {m.qtype for m in model.modules() if isinstance(m, GGMLLinear)} == set(SUPPORTED)
    batch = header.tokenizer(PROMPTS[:1], return_tensors="pt")
    with torch.no_grad():
        ours, theirs = model(**batch).logits, reference(**batch).logits
    assert "RUN_GENERATION_KERNELS=torch" in capfd.readouterr().err
    assert all("_fallback" in m.__dict__ for m in model.modules() if isinstance(m, GGMLLinear))
    error = (ours - theirs).abs()
    assert error.mean() < 0.01 * theirs.abs().max() and error.max() < 0.1 * theirs.abs().max()


def exact_weights(model, run, monkeypatch):
    """run() with every product of `model` taken on the exactly de-quantized weights and float32 activations (a
    model without llama's decoder layers, GPT-2's, has none fused to take apart)."""
    if not native_kernels():
        pytest.skip("the exact path is the native kernels' (torch's fallback rounds scales to bfloat16)")
    unfused = products_one_by_one(model) if hasattr(model, "model") else contextlib.nullcontext()
    with monkeypatch.context() as patch, unfused:
        patch.setattr(GGMLLinear, "_matmul", lambda self, x: torch.ops.rungen_ggml.mm_tiled(
            x.float().contiguous(), self.blocks, self.code, self.in_features))
        return run()


def test_every_supported_type_runs_in_its_blocks(loaded):
    _, model, _ = loaded["mixed_tied"]
    layers = [m for m in model.modules() if isinstance(m, GGMLLinear)]
    assert {m.qtype for m in layers} == set(SUPPORTED)
    # F16 and BF16 weights keep their dtype; norms are the model's float32.
    assert {m.weight.dtype for m in model.modules() if isinstance(m, CastLinear)} == {torch.float16, torch.bfloat16}
    assert model.model.norm.weight.dtype == torch.float32
    # The tied head multiplies the embedding's own blocks: one copy of them in memory.
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    assert isinstance(embedding, GGMLEmbedding) and isinstance(head, GGMLLinear)
    assert head.blocks.data_ptr() == embedding.blocks.data_ptr()
    # Q4_0/Q4_1/Q5_0/Q5_1/Q8_0, Q4_K/Q5_K/Q6_K and IQ4_NL/IQ4_XS weights run with their rows interleaved for the
    # native kernels, the shared ones too (the lookup reads them so).
    interleaved = {m.qtype for m in layers if m.interleaved}
    assert interleaved == (set(INTERLEAVED_TYPES) if native_kernels() else set())
    assert head.interleaved == embedding.interleaved == native_kernels()
    assert not any(p.device.type == "meta" for p in [*model.parameters(), *model.buffers()])


def test_k_quant_file_runs_interleaved_with_its_tied_head(loaded):
    # Q4_K/Q6_K weights run with their rows interleaved, the Q6_K embedding too: the head multiplies it so, and
    # the lookup reads it so (the logits test holds both to the de-quantized model).
    _, model, _ = loaded["q4_k_m_tied"]
    layers = [m for m in model.modules() if isinstance(m, GGMLLinear)]
    assert {m.qtype for m in layers} == {Q.Q4_K, Q.Q6_K}
    assert all(m.interleaved for m in layers) == native_kernels()
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    assert head.blocks.data_ptr() == embedding.blocks.data_ptr() and embedding.qtype == Q.Q6_K
    assert head.interleaved == embedding.interleaved == native_kernels()


def test_k_quant_layers_run_as_one_stack(loaded):
    # A Q6_K file's layers fuse (q/k/v of one type) and run as one native call on the interleaved Q6_K rows
    # (the logits test holds it to the de-quantized model).
    _, model, _ = loaded["q6_k_untied"]
    layers = [m for m in model.modules() if isinstance(m, GGMLLinear)]
    assert {m.qtype for m in layers} == {Q.Q6_K} and all(m.interleaved for m in layers) == native_kernels()
    assert all(isinstance(layer, FusedDecoderLayer) for layer in model.model.layers)
    assert isinstance(model.model.forward, DecoderStack) == native_kernels()


def test_q4_k_m_layers_with_q6_k_attn_v_run_fused_as_one_stack(loaded, monkeypatch):
    # llama.cpp's Q4_K_M mix: the last layer's attn_v (and ffn_down) Q6_K beside Q4_K attn_q/attn_k. Every layer
    # fuses, that one's q/k/v as a product of two parts (q and k's rows, then v's), and the model runs its one
    # decoder_stack call (the logits test holds it to the de-quantized model).
    _, model, _ = loaded["q4_k_m_tied"]
    layers = model.model.layers
    assert all(isinstance(layer, FusedDecoderLayer) and layer.two_calls for layer in layers)
    assert isinstance(layers[0].qkv, GGMLLinear) and isinstance(layers[1].qkv, GGMLParts)
    assert [part.qtype for part in layers[1].qkv.parts] == [Q.Q4_K, Q.Q6_K]
    assert layers[1].down_proj.qtype == Q.Q6_K
    if not native_kernels():
        return
    assert isinstance(model.model.forward, DecoderStack)
    calls = []
    monkeypatch.setattr(torch.ops.rungen_ggml, "decoder_stack",
                        lambda *a, original=torch.ops.rungen_ggml.decoder_stack: calls.append(1) or original(*a))
    with torch.no_grad():
        model(torch.tensor([[5, 9, 13]]))
    assert calls == [1]


def test_untied_file_has_its_own_head(loaded):
    _, model, _ = loaded["q4_0_untied"]
    head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    assert head.qtype == Q.Q6_K and embedding.qtype == Q.Q4_0
    assert not embedding.interleaved  # only looked up: it stays a view of the file's map


def test_biases_go_to_their_quantized_layers(loaded):
    _, model, _ = loaded["qwen2_biases"]
    layer = model.model.layers[0]  # q/k/v in one product: their biases concatenated, in the same order
    assert isinstance(layer, FusedDecoderLayer) and isinstance(layer.qkv, GGMLLinear)
    assert layer.qkv.bias.shape == (HIDDEN + 2 * HIDDEN // HEADS * KV_HEADS,)


def test_cached_header_equals_the_files(gguf_files, loaded):
    header, _, _ = loaded["mixed_tied"]
    cached = GGUFHeader(gguf_files["mixed_tied"])
    assert cached.read_seconds is None  # read from the cache this time
    fresh = {key: value for key, value in header.config.to_dict().items() if key != "dtype"}  # set by build_model
    assert {key: value for key, value in cached.config.to_dict().items() if key != "dtype"} == fresh
    text = "Hello world, <|im_start|>user\nWhat is 2+2?<|im_end|>"
    assert cached.tokenizer(text).input_ids == header.tokenizer(text).input_ids
    assert cached.tokenizer.chat_template == header.tokenizer.chat_template


def test_batch_equals_single(gguf_files, loaded, monkeypatch, capsys):
    args = ["--model_name_or_path", gguf_files["mixed_tied"], "--temperature", "0", "--length", "6"]
    outputs = []
    for batch_size in ("1", "3"):
        monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO("\n".join(PROMPTS).encode())))
        outputs.append(run_generation.main(args + ["--batch_size", batch_size]))
    assert outputs[0] == outputs[1] and len(outputs[0]) == len(PROMPTS)


def test_a_split_files_part_is_refused_naming_the_split_never_run_with_weights_missing(tokenizer_fields, tmp_path,
                                                                                         monkeypatch, capsys):
    """llama-gguf-split's parts (NAME-00001-of-00002.gguf, as the gguf package writes them): the first part alone
    lacks the other's tensors. transformers' reading would start those at random and generate; refused instead."""
    import functools

    import gguf

    monkeypatch.setattr(sys.modules[__name__], "GGUFWriter", functools.partial(gguf.GGUFWriter, split_max_tensors=12))
    write_llama_gguf(tmp_path / "split.gguf", tokenizer_fields, [{}, {}], embedding=Q.Q8_0, output=None,
                     default=Q.Q8_0)
    first = tmp_path / "split-00001-of-00002.gguf"
    assert first.is_file() and (tmp_path / "split-00002-of-00002.gguf").is_file()
    for flags in ([], ["--dequantize"]):
        code, line = error_of(["--model_name_or_path", str(first), "--prompt", "Hi", "--length", "2", *flags], capsys)
        assert code == 2 and line.endswith("it is part 1 of 2 of a split file; merge the parts into one with "
                                           "llama.cpp's llama-gguf-split --merge"), (flags, line)


def test_a_tensor_of_another_shape_is_refused_in_one_line_every_time(tokenizer_fields, tmp_path, capsys):
    # The first run builds transformers' model of the file, which checks each tensor's shape; the runs after it
    # would build the own model by the weights map that build caches, checking none: a build that failed caches
    # no map, so every run says the same line.
    path = write_llama_gguf(tmp_path / "bad.gguf", tokenizer_fields, [{}, {}], embedding=Q.Q8_0, output=None,
                            default=Q.Q8_0, shapes_of={(1, "ffn_down"): (HIDDEN, HIDDEN)})
    args = ["--model_name_or_path", path, "--prompt", "Hi", "--length", "2", "--temperature", "0"]
    lines = [error_of(args, capsys) for _ in range(2)]
    assert lines[0] == lines[1] and lines[0][0] == 2
    assert lines[0][1].endswith(f"tensor blk.1.ffn_down.weight is [{HIDDEN}, {HIDDEN}], where the model its metadata "
                                f"describes has [{HIDDEN}, {FFN}]"), lines[0]


def test_the_header_cache_keeps_the_most_recently_used_entries(tmp_path, monkeypatch):
    from rungen.gguf import file

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    root = file.cache_root()
    for age, name in enumerate(["new", "used", "old", "oldest", ".tmp-writing"]):
        os.makedirs(os.path.join(root, name))
        os.utime(os.path.join(root, name), (1e9 - age, 1e9 - age))
    file.prune_cache(os.path.join(root, "oldest"), limit=2)  # the entry in use stays, whatever its age
    assert sorted(os.listdir(root)) == [".tmp-writing", "new", "oldest", "used"]


def test_a_header_whose_cache_entry_another_process_pruned_still_builds_its_model(gguf_files, tmp_path,
                                                                                   monkeypatch):
    # Another process loading other files may prune this one's entry (the least recently used past the limit)
    # while this one loads: the model builds all the same (its weights map is not cached), and a later load reads
    # the header again.
    import shutil

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    header = GGUFHeader(gguf_files["q4_0_untied"])
    assert header.config.num_hidden_layers == LAYERS  # (read from the entry before it goes)
    shutil.rmtree(header.cache_dir)
    model = build_model(header, torch.float32)
    with torch.no_grad():
        assert model(torch.tensor([[1, 2, 3]])).logits.shape == (1, 3, header.config.vocab_size)
    assert not os.path.exists(header.cache_dir)
    assert GGUFHeader(gguf_files["q4_0_untied"]).cached_weights_map() is None  # read again, nothing cached yet


def test_a_gguf_file_is_known_by_its_first_bytes_whatever_its_name(gguf_files, tmp_path, capsys):
    """ollama keeps its models as blobs named by their digest (sha256-...): GGUF files without the suffix."""
    import shutil

    blob, upper = tmp_path / "blobs" / "sha256-3f9a", tmp_path / "MODEL.GGUF"
    blob.parent.mkdir()
    for copy in (blob, upper):
        shutil.copy(gguf_files["q4_0_untied"], copy)
    args = ["--prompt", "Hello, my dog", "--length", "6", "--temperature", "0"]
    for flags in ([], ["--dequantize"]):  # its own blocks, and transformers' reading
        expected = run_generation.main(["--model_name_or_path", str(gguf_files["q4_0_untied"]), *args, *flags])
        for path in (blob, upper):
            assert run_generation.main(["--model_name_or_path", str(path), *args, *flags]) == expected
    (tmp_path / "dir.gguf").mkdir()
    code, line = error_of(["--model_name_or_path", str(tmp_path / "dir.gguf"), *args], capsys)
    assert code == 2 and line.endswith("dir.gguf: a directory, not a GGUF file")


def test_a_vocabulary_without_its_merges_fails_in_one_line_by_either_reader(tokenizer_fields, tmp_path, capsys):
    fields = [field for field in tokenizer_fields if field[0] != "tokenizer.ggml.merges"]  # a byte-level BPE's
    path = write_llama_gguf(tmp_path / "no_merges.gguf", fields, [{}], embedding=Q.Q8_0, output=None,
                            default=Q.Q8_0)
    for flags in ([], ["--dequantize"]):
        code, line = error_of(["--model_name_or_path", str(path), "--prompt", "Hi", "--length", "2", *flags], capsys)
        assert code == 2 and line.startswith(f"run_generation.py: error: {path}: "), (flags, line)


def test_corrupt_and_truncated_files_fail_in_one_line(gguf_files, tmp_path, capsys):
    data = open(gguf_files["q4_0_untied"], "rb").read()
    files = {"corrupt": b"GGUX" + data[4:], "empty": b"", "header cut": data[:1000],  # within the vocabulary
             "truncated": data[: len(data) // 2], "last bytes lost": data[:-10]}
    for kind, content in files.items():
        path = tmp_path / f"{kind}.gguf"
        path.write_bytes(content)
        for flags in ([], ["--dequantize"], ["--quantize", "int8"]):  # its blocks, or transformers' reading
            code, line = error_of(["--model_name_or_path", str(path), "--prompt", "Hi", *flags], capsys)
            assert code == 2 and line.startswith(f"run_generation.py: error: {path}: "), (kind, flags, line)
            if kind in ("truncated", "last bytes lost"):  # what went wrong, not how a reader tripped on it
                assert f"truncated (its tensors end at byte {len(data)}, the file has {len(content)}" in line
            else:
                why = {"corrupt": "it starts with b'GGUX', not GGUF", "empty": "it is empty",
                       "header cut": "its header is cut short or damaged: "}[kind]
                assert f"not a readable GGUF file ({why}" in line, (kind, flags, line)


@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q5_0, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_NL, Q.IQ4_XS],
                         ids=lambda q: q.name)
def test_interleaved_weights_are_read_a_chunk_at_a_time_into_their_layout(qtype, tmp_path, monkeypatch):
    # The loader reads a weight straight into the kernels' layout, a few MB at a time; chunks that split the
    # rows give the layout of the whole, and a file that ends early is an error, not zeros.
    if not native_kernels():
        pytest.skip("weights are interleaved only for the native kernels")
    rng = np.random.default_rng(3)
    blocks, _ = encode(rng.standard_normal((40, 512)), qtype, rng)
    path = tmp_path / "weights.bin"
    path.write_bytes(b"header" + blocks.tobytes())
    expected = torch.ops.rungen_ggml.interleave(torch.from_numpy(blocks), int(qtype))
    monkeypatch.setattr(weights, "READ_CHUNK", 16 * blocks.shape[1])  # 16 rows a chunk: 16, 16 and 8
    assert torch.equal(weights.read_interleaved(str(path), 6, blocks.shape, qtype), expected)
    path.write_bytes(b"header" + blocks.tobytes()[:-10])
    with pytest.raises(weights.GGUFError, match="truncated"):
        weights.read_interleaved(str(path), 6, blocks.shape, qtype)


def test_unsupported_type_fails_in_one_line(tokenizer_fields, tmp_path, capsys):
    path = write_llama_gguf(tmp_path / "iq2_xxs.gguf", tokenizer_fields, layers=[{"ffn_up": Q.IQ2_XXS}, {}],
                            default=Q.Q4_0, embedding=Q.Q8_0, output=None)
    code, line = error_of(["--model_name_or_path", path, "--prompt", "Hi"], capsys)
    assert code == 2 and "blk.0.ffn_up.weight is IQ2_XXS" in line and "--dequantize" in line
    assert all(qtype.name in line for qtype in SUPPORTED)  # the message lists what does run


def test_dequantize_on_a_float_checkpoint_is_refused(tiny_models, capsys):
    code, line = error_of(["--model_name_or_path", tiny_models["llama"], "--prompt", "Hi", "--dequantize"], capsys)
    assert code == 2 and "--dequantize applies to GGUF files" in line


@pytest.mark.fresh_load  # each run loads the file as a run of the tool would (the first writes the weights' map)
@pytest.mark.parametrize("name, fused_stack", [("mixed_tied", False), ("q4_0_untied", True)])
def test_jit_traces_the_blocks_and_keeps_the_greedy_text(gguf_files, name, fused_stack, monkeypatch, caplog):
    # Layers fused one by one are traced and the graph serves the steps; a stack that is one native call a
    # step (every layer Q4_0, as the default model's) is left untraced, with one line saying so, and runs on the
    # own model: transformers' model is not loaded for a trace that would not be made.
    import rungen.jit
    from rungen.gguf.model import GGUFCausalLM

    caplog.set_level(logging.INFO, logger="run_generation")
    args = ["--model_name_or_path", gguf_files[name], "--temperature", "0", "--length", "8", "--batch_size", "2"]
    outputs, traced = [], []  # the models enable_jit was given
    original = rungen.jit.enable_jit
    monkeypatch.setattr(rungen.jit, "enable_jit", lambda model, tokenizer: (
        original(model, tokenizer), traced.append(model))[0])
    for extra in ([], ["--jit"]):
        monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO("\n".join(PROMPTS).encode())))
        outputs.append(run_generation.main(args + extra))
    assert outputs[1] == outputs[0] and len(outputs[0]) == len(PROMPTS)
    [model] = traced
    if fused_stack:
        assert "--jit: not traced" in caplog.text and "Traced the decode step" not in caplog.text
        assert isinstance(model, GGUFCausalLM)
    else:
        assert "Traced the decode step" in caplog.text
        assert model.forward.graph_steps > 0  # the graph served the steps, not the eager fallback


@pytest.mark.fresh_load  # load_quantized must really run, not a loaded model be reused
@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize("model_type", ["llama", "gpt2", "opt"])
def test_quantizing_while_loading_equals_quantizing_after(tiny_models, model_type, mode, monkeypatch, capsys):
    import rungen.quantize

    args = ["--model_name_or_path", tiny_models[model_type], "--prompt", "Hello, my dog", "--temperature", "0",
            "--length", "8", "--quantize", mode]
    built = []
    original = rungen.quantize.load_quantized
    monkeypatch.setattr(rungen.quantize, "load_quantized", lambda *a: built.append(original(*a)) or built[-1])
    streamed = run_generation.main(args)
    assert built and built[0] is not None  # the checkpoint was quantized block by block
    monkeypatch.setattr(rungen.quantize, "load_quantized", lambda *a: None)
    assert run_generation.main(args) == streamed


def accelerator_forms(header, reference):
    """What a GPU runs (build_model given a device, here the CPU): transformers' model with every weight de-quantized
    onto the device, no block left; in float32 the very weights of --dequantize's model, in bfloat16 those rounded.
    Returns the bfloat16 model."""
    batch = header.tokenizer(PROMPTS[:2], return_tensors="pt", padding=True)
    real = batch["attention_mask"].bool()
    with torch.no_grad():
        theirs = reference(**batch).logits
        for dtype, tolerance in ((torch.float32, 1e-5), (torch.bfloat16, 0.05)):
            model = build_model(header, dtype, torch.device("cpu"))
            assert not [m for m in model.modules() if isinstance(m, (GGMLLinear, GGMLEmbedding, CastLinear))]
            assert {p.dtype for p in model.parameters()} == {dtype}
            ours = model(**batch).logits.float()
            error = (ours - theirs)[real].abs().max()
            assert error <= tolerance * theirs[real].abs().max(), (dtype, error)
    return model


@pytest.mark.parametrize("name", FILES)
def test_the_accelerator_form_is_the_dequantized_model(loaded, name):
    header, _, reference = loaded[name]
    model = accelerator_forms(header, reference)
    if header.config.tie_word_embeddings:
        assert model.get_output_embeddings().weight is model.get_input_embeddings().weight  # one copy


@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize("name", ["mixed_tied", "q4_0_untied", "qwen2_biases"])
def test_quantizing_a_file_as_it_loads_equals_quantizing_its_dequantized_model(loaded, name, mode, monkeypatch):
    # --quantize on a GGUF file: each block's layers quantized as soon as their weights are de-quantized (the float
    # model never whole in memory) give the very layers of quantizing the whole de-quantized model after loading.
    header, _, _ = loaded[name]
    quantized_as_it_loads(header, mode, monkeypatch)


def quantized_as_it_loads(header, mode, monkeypatch):
    """build_model(quantize=mode) quantizes each block's layers before the file's last tensor comes, into the very
    model quantizing the de-quantized model after loading gives (the same logits); returns how many layers."""
    import rungen.quantize
    from rungen.quantize import QuantizingLoad, quantize_model

    cpu = torch.device("cpu")
    after = build_model(header, torch.float32, cpu)
    layers = quantize_model(after, mode)
    events = []
    monkeypatch.setattr(QuantizingLoad, "put", lambda self, *a, put=QuantizingLoad.put: events.append("put")
                        or put(self, *a))
    monkeypatch.setattr(rungen.quantize, "_quantize_group", lambda *a, group=rungen.quantize._quantize_group:
                        events.append("quantized") or group(*a))
    streamed = build_model(header, torch.float32, cpu, quantize=mode)
    last_put = len(events) - events[::-1].index("put")
    assert events[:last_put].count("quantized") >= LAYERS  # every block's own before the last tensor came
    assert streamed.quantized_layers == layers
    assert [type(m) for m in streamed.modules()] == [type(m) for m in after.modules()]
    assert not [name for name, p in streamed.named_parameters() if p.device.type == "meta"]
    tokenizer = header.tokenizer  # (a padded batch where the vocabulary has a padding token)
    batch = tokenizer(PROMPTS[:2], return_tensors="pt", padding=True) if tokenizer.pad_token else \
        tokenizer(PROMPTS[:1], return_tensors="pt")
    with torch.no_grad():
        assert torch.equal(streamed(**batch).logits, after(**batch).logits)
    return layers


def test_an_moe_file_computes_transformers_model_over_its_experts(tmp_path, monkeypatch):
    # Qwen3-MoE (Qwen3-30B-A3B's layout): the experts' 3-D tensors stay in their blocks on the CPU (in float32
    # Qwen3-30B-A3B's are 115 GB), one product per expert; its logits are transformers' own loader's
    # (--dequantize), on the CPU's blocks (their products taken on the exactly de-quantized weights) and in the form
    # a GPU gets (build_model given a device: the experts de-quantized, gate and up merged by transformers'
    # processor).
    from helpers import write_moe_gguf

    [(header, model, reference)] = blocks_and_reference({"moe": write_moe_gguf(tmp_path / "qwen3moe.gguf")}).values()
    assert model.config.model_type == "qwen3_moe" and model.config.num_local_experts == 4
    assert_experts_in_blocks(model, header)
    ids = torch.tensor([header.tokenizer(PROMPTS[0]).input_ids])
    with torch.no_grad():
        theirs = reference(ids).logits
        device_form = build_model(header, torch.float32, torch.device("cpu"))(ids).logits
        blocks = exact_weights(model, lambda: model(ids).logits, monkeypatch)
    assert theirs.abs().max() > 1  # logits of a real computation
    torch.testing.assert_close(device_form, theirs, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(blocks, theirs, rtol=1e-4, atol=1e-4)


def assert_experts_in_blocks(model, header):
    """Every layer's experts are a GGMLExperts over exactly the file's expert bytes (no float copy of them), in a
    fused layer."""

    layers = model.model.layers  # the attention fused, the router and experts transformers' module over the blocks
    assert all(isinstance(layer, FusedDecoderLayer) and isinstance(layer.mlp.experts, GGMLExperts) for layer in layers)
    assert not [name for name, p in model.named_parameters() if p.dim() == 3]
    storages = [m.blocks.untyped_storage() for layer in layers for m in layer.mlp.experts.modules()
                if isinstance(m, GGMLLinear)]
    held = {storage.data_ptr(): storage.nbytes() for storage in storages}  # each layer's buffers, once
    in_file = sum(nbytes for name, _, _, _, _, nbytes in header.tensors if "_exps." in name)
    assert in_file * 0.99 < sum(held.values()) < in_file * 1.05  # interleaved k-quant scales unpack a little


@pytest.mark.parametrize("expert_types", [(Q.Q4_0, Q.Q4_0, Q.Q6_K), (Q.Q8_0, Q.Q4_1, Q.Q2_K), (Q.Q2_K,) * 3],
                         ids=["q4_0-q6_k", "mixed-q2_k", "q2_k"])
def test_an_moe_files_experts_of_llama_cpp_mixes_compute_in_their_blocks(tmp_path, monkeypatch, expert_types):
    # llama.cpp's mixes give ffn_down_exps more bits (Q6_K in Q4_K_M); gate and up of two types are one product of
    # two parts (an expert at a time), of one type one product (every chosen expert's in one call: mm_grouped); Q2_K's
    # rows stay as the file has them. A padded batch of two prompts routes each token alone.
    from helpers import write_moe_gguf

    hidden = 256 if expert_types[0] == Q.Q2_K else 64  # (Q2_K's superblocks of 256 in gate and up)
    path = write_moe_gguf(tmp_path / "qwen3moe.gguf", experts=8, used=3, expert_types=expert_types, expert_ffn=512,
                          hidden=hidden)
    [(header, model, reference)] = blocks_and_reference({"moe": path}).values()
    # The experts' width read from the file (transformers' reading leaves Qwen3MoeConfig's default, 768: Qwen3-235B-
    # A22B's 1536 would not load), the top-k routing weights normalized (as every published Qwen3-MoE's config.json
    # and llama.cpp's qwen3moe graph have it; transformers' reading sets it).
    assert (model.config.moe_intermediate_size, model.config.norm_topk_prob) == (512, True)
    assert_experts_in_blocks(model, header)
    experts = model.model.layers[0].mlp.experts
    assert {experts.down[0].qtype} == {expert_types[2]}
    assert isinstance(experts.gate_up[0], GGMLParts) == (expert_types[0] != expert_types[1])
    assert (experts.grouped[0] is not None) == (expert_types[0] == expert_types[1]) and experts.grouped[1] is not None
    rows = [header.tokenizer(prompt).input_ids for prompt in PROMPTS[:2]]  # (its vocabulary has no pad token)
    width = max(map(len, rows))
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    batch = dict(input_ids=torch.tensor([[0] * (width - len(r)) + r for r in rows]), attention_mask=mask,
                 position_ids=(mask.cumsum(-1) - 1).clamp(min=0))  # each row's own positions, as the engine's
    with torch.no_grad():
        theirs = reference(**batch).logits
        blocks = exact_weights(model, lambda: model(**batch).logits, monkeypatch)
        grouped = model(**batch).logits  # each layer's mixture in one native call (rungen_ggml.mixture)
    assert theirs.abs().max() > 1 and batch["attention_mask"].min() == 0
    # (float32 sums in another order than transformers': their difference grows with the width)
    torch.testing.assert_close(blocks, theirs, rtol=1e-4, atol=1e-4 * hidden / 64)
    # A token gets its bits alone and in a batch: the router's logits by rows, each expert's tokens' activations
    # rounded row by row, each token's experts summed in one order; so the same experts, and a greedy sequence
    # does not change with its batch.
    assert all(isinstance(layer.mlp.gate, ExpertRouter) for layer in model.model.layers)
    with torch.no_grad():
        for row, ids in enumerate(rows):
            alone = model(input_ids=torch.tensor([ids])).logits[0]
            assert torch.equal(alone, grouped[row, width - len(ids):])


@pytest.mark.parametrize("architecture", ["glm4moe", "deepseek_v3", "ernie4_5_moe"])
def test_a_file_of_our_own_mixture_reading_computes_its_checkpoint_as_a_device_takes_it(architecture, tmp_path,
                                                                                        monkeypatch, capsys):
    # GLM-4.5's, DeepSeek-V3's and ERNIE 4.5's mixtures' Q8_0 files as a device takes them (their build on the CPU
    # here): transformers' own experts de-quantized, or in codes (plain products standing in for the GPU's kernel),
    # the router's score correction read (and DeepSeek's kv_b joined from its halves there): what the checkpoint with
    # the file's weights computes. transformers' own loader (--dequantize) is refused in one line.
    from transformers import AutoModelForCausalLM

    import rungen.gguf.device
    import tiny_models
    from rungen.gguf.device import INT8_TYPES
    from rungen.gguf.device_experts import CodedExperts

    spec = CHECKPOINT_FILES[architecture]
    make_checkpoint, write = (getattr(tiny_models, name) for name in spec["files"])
    checkpoint = make_checkpoint(str(tmp_path))
    q8_0 = write(checkpoint, str(tmp_path / "moe.gguf"), "Q8_0")
    reference = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    ids = torch.arange(3, 43)[None] * 7
    round_as_q8_0_file(reference)  # the weights the Q8_0 file holds (the router's F32)
    with torch.no_grad():
        theirs = reference(ids).logits
        assert theirs.abs().max() > 1
        device = build_model(GGUFHeader(q8_0), torch.float32, torch.device("cpu"))
        assert type(device.model.layers[1].mlp.experts) is type(reference.model.layers[1].mlp.experts)
        router = device.model.layers[1].mlp.gate
        assert getattr(router, "moe_statics", router).e_score_correction_bias.abs().max() > 0.1
        torch.testing.assert_close(device(ids).logits, theirs, rtol=1e-4, atol=1e-4)
        del device
        monkeypatch.setattr(rungen.gguf.device, "gpu_int8", lambda qtype, device: qtype in INT8_TYPES)
        monkeypatch.setattr(rungen.gguf.device, "checked_kernel", lambda layer, dtype, instead: plain_grouped_kernel())
        coded = build_model(GGUFHeader(q8_0), torch.float32, torch.device("cpu"))
        assert isinstance(coded.model.layers[1].mlp.experts, CodedExperts)
        torch.testing.assert_close(coded(ids).logits, theirs, rtol=1e-4, atol=1e-4)
    code, line = error_of(["--model_name_or_path", q8_0, "--prompt", "Hi", "--length", "2", "--dequantize"], capsys)
    kind, missed = {"glm4moe": ("GLM-4.5 mixture (glm4moe) file", "its router's score correction, its multi-token "
                                "prediction layer"),
                    "deepseek_v3": ("DeepSeek V2/V3 (deepseek2) file", "its latent attention's kv_b split in two, "
                                    "its router's score correction"),
                    "ernie4_5_moe": ("ERNIE 4.5 mixture (ernie4_5-moe) file", "its router's score correction")
                    }[architecture]
    assert code == 2 and line.endswith(f"moe.gguf: transformers reads no {kind} as llama.cpp writes it ({missed}); "
                                       "it runs here in its own blocks, without --dequantize or --device_map"), line


@pytest.mark.parametrize("version", [2, 3])
def test_deepseeks_attention_over_its_latents_computes_its_checkpoint_in_chunks(version, tmp_path, monkeypatch):
    # DeepSeek's attention over its cache of latents, kv_b's k rows taken into the query and its v rows after
    # (AbsorbedLatentAttention): a prompt given in two calls (the second's queries after cached positions, as a
    # session's next turn or a chunked prompt) gives the checkpoint's logits, and its cache holds transformers' own
    # latents (the latent and the rotated key a position: 48 values a layer, where a head's k and v would take 4 x 72).
    from transformers import AutoModelForCausalLM

    import tiny_models
    from rungen.gguf.latent_attention import AbsorbedLatentAttention

    monkeypatch.setenv(KV_FLOAT32_ENV, "1")
    checkpoint = tiny_models.deepseek_checkpoint(str(tmp_path), version)
    path = tiny_models.write_deepseek2_gguf(checkpoint, str(tmp_path / "f32.gguf"))
    reference = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    model = load(path, device=torch.device("cpu")).model
    assert all(isinstance(layer.self_attn, AbsorbedLatentAttention) for layer in model.model.layers)
    ids = torch.arange(3, 43)[None] * 7
    cache = new_cache(model)
    with torch.no_grad():
        theirs = reference(ids).logits
        first = model(ids[:, :25], past_key_values=cache).logits
        second = model(ids[:, 25:], past_key_values=cache).logits
    torch.testing.assert_close(torch.cat([first, second], dim=1), theirs, rtol=1e-4, atol=1e-4)
    assert [tuple(layer.keys.shape[-1:]) + tuple(layer.values.shape[-1:]) for layer in cache.layers] == [(32, 16)] * 3


@pytest.mark.parametrize("kind,groups", [("glm4_moe", (1, 1)), ("deepseek_v3", (4, 2)), ("deepseek_v2", (1, 1)),
                                         ("deepseek_v2", (4, 2)), ("mistral4", (1, 1)), ("mistral4", (4, 2)),
                                         ("dots1", (1, 1))])
def test_a_grouped_router_chooses_as_transformers_and_alike_in_a_batch(kind, groups):
    # GLM-4.5's and DeepSeek-V3's routers (sigmoid scores, a correction added to choose by, the best groups first
    # where there are several, the chosen scores normalized and scaled), DeepSeek-V2's (the softmax's top k,
    # group_limited_greedy among the groups of the best experts, scaled) and Mistral 4's (the softmax's top k among
    # the groups best by their two best, normalized and scaled) as GroupedRouter: transformers' experts and weights,
    # and a token's the same bits alone as in a batch (its logits a row at a time).
    from transformers import AutoConfig

    from rungen.gguf.experts import GroupedRouter

    fields = dict(hidden_size=64, n_routed_experts=16, num_experts_per_tok=4, n_group=groups[0],
                  topk_group=groups[1], routed_scaling_factor=2.5)
    if kind == "deepseek_v2":
        fields["topk_method"] = "group_limited_greedy" if groups[0] > 1 else "greedy"
    else:
        fields["norm_topk_prob"] = True
    config = AutoConfig.for_model(kind, **fields)
    module = importlib.import_module(f"transformers.models.{kind}.modeling_{kind}")
    torch.manual_seed(0)
    router = next(getattr(module, name) for name in dir(module) if name.endswith("TopkRouter"))(config)
    with torch.no_grad():
        router.weight.normal_(0, 0.3)
        if kind not in ("deepseek_v2", "mistral4"):
            router.e_score_correction_bias.normal_(0, 0.5)
    x = torch.randn(9, 64)
    with torch.no_grad():
        logits, weights, experts = router(x)
        ours = GroupedRouter(router)
        got_logits, got_weights, got_experts = ours(x)
        alone = [ours(row[None]) for row in x]
    torch.testing.assert_close(got_logits, logits, rtol=1e-5, atol=1e-5)
    order, got_order = experts.sort(dim=-1), got_experts.sort(dim=-1)
    assert torch.equal(got_order.values, order.values)
    torch.testing.assert_close(got_weights.gather(1, got_order.indices), weights.gather(1, order.indices))
    if kind != "deepseek_v2":  # (normalized, then scaled)
        assert weights.sum(dim=-1).allclose(torch.full((9,), 2.5))
    if groups[0] > 1:  # (each token's experts in its two best groups of four)
        assert all(len(set((row // 4).tolist())) <= 2 for row in got_experts)
    for row, (row_logits, row_weights, row_experts) in enumerate(alone):
        assert torch.equal(row_logits[0], got_logits[row]) and torch.equal(row_experts[0], got_experts[row])
        assert torch.equal(row_weights[0], got_weights[row])


@pytest.mark.parametrize("architecture", ["lfm2moe", "granitehybrid", "granitehybrid_dense", "granitemoe",
                                          "nemotron_h", "nemotron_h_latent", "falcon_h1", "afmoe", "olmoe", "hy_v3",
                                          "dots1"])
def test_a_file_of_our_own_tables_entry_loads_with_transformers_own_loader_too(architecture, tmp_path):
    # LFM2-MoE's, Granite 4.0 H's, Granite 3's mixtures', Nemotron-H's and Nemotron 3's (its experts over a latent),
    # Falcon-H1's, AFMoE's, OLMoE's, HY V3's and dots.llm1's entries in transformers' conversion tables
    # (own_tables.OWN_TABLES) serve its own loader as well (Granite's shared MLP joined from two tensors there too):
    # --dequantize computes the checkpoint with the Q8_0 file's weights.
    from transformers import AutoModelForCausalLM

    import tiny_models

    spec = CHECKPOINT_FILES[architecture]
    make_checkpoint, write = (getattr(tiny_models, name) for name in spec["files"])
    checkpoint = make_checkpoint(str(tmp_path))
    path = write(checkpoint, str(tmp_path / "q8_0.gguf"), "Q8_0")
    reference = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    if spec.get("as_converted"):
        reference = as_converted(reference)
    round_as_q8_0_file(reference)
    model = load(path, device=torch.device("cpu"), dequantize=True).model
    assert type(model).__name__ == spec["model"]
    ids = torch.arange(3, 43)[None] * 7
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, reference(ids).logits, rtol=1e-4, atol=1e-4)


def test_a_qwen3next_file_is_refused_by_transformers_own_loader_in_one_line(tmp_path, capsys):
    # Qwen3-Next's entry splits its fused projections by rows (SplitRows), which transformers' own loader cannot
    # take (it casts each converted tensor alone): --dequantize says so in one line, the file runs without it.
    import tiny_models

    path = tiny_models.write_qwen3next_gguf(tiny_models.qwen3next_checkpoint(str(tmp_path)),
                                            str(tmp_path / "next.gguf"), "Q8_0")
    code, line = error_of(["--model_name_or_path", path, "--prompt", "Hi", "--length", "2", "--dequantize"], capsys)
    assert code == 2 and line.endswith("transformers reads no Qwen3-Next (qwen3next) file as llama.cpp writes it (its "
                                       "fused projections, which its model takes split by rows); it runs here in its "
                                       "own blocks, without --dequantize or --device_map")


def test_a_mistral4_file_is_refused_by_transformers_own_loader_in_one_line(tmp_path, capsys):
    # Mistral 4's kv_b split in two and its experts' gate and up in one tensor, which transformers' own loader does
    # not read: --dequantize says so in one line, the file runs without it (its header cached by then: its text
    # model's class is named to transformers' auto classes all the same).
    import tiny_models

    path = tiny_models.write_deepseek2_gguf(tiny_models.mistral4_checkpoint(str(tmp_path)),
                                            str(tmp_path / "mistral4.gguf"), "Q8_0")
    code, line = error_of(["--model_name_or_path", path, "--prompt", "Hi", "--length", "2", "--dequantize"], capsys)
    assert code == 2 and line.endswith("transformers reads no Mistral 4 (mistral4) file as llama.cpp writes it (its "
                                       "latent attention's kv_b split in two, its experts' gate and up in one "
                                       "tensor); it runs here in its own blocks, without --dequantize or "
                                       "--device_map"), line
    assert run_generation.main(["--model_name_or_path", path, "--prompt", "Hi", "--length", "2"])


def test_a_granitehybrid_file_whose_attention_rotates_is_refused_in_one_line(tmp_path):
    # llama.cpp's converter writes Bamba's checkpoints as granitehybrid files whose attention rotates (by part of a
    # head); Granite 4.0 H's attention, the class these files are read into, has no rotary: refused, not computed
    # as another model.
    import tiny_models

    checkpoint = tiny_models.granitehybrid_dense_checkpoint(str(tmp_path))
    path = tiny_models.write_granitehybrid_gguf(checkpoint, str(tmp_path / "bamba.gguf"), rotates=True)
    with pytest.raises(GGUFError, match="its attention rotates") as raised:
        GGUFHeader(path)
    assert "\n" not in str(raised.value)


def test_a_llama4_file_attends_in_chunks_past_its_first_as_its_checkpoint(tmp_path, monkeypatch):
    # Scout's layers with rotary attend within chunks of 8192 positions and those without tune their queries'
    # temperature from position 8191: its native attention computes both (its layers read as full ones, which the
    # engine's batches hold), so the file runs to its context (10M positions), a left-padded batch's prompts past
    # the first chunk and two steps after them computing what transformers' Llama 4 computes of each row alone.
    from transformers import AutoModelForCausalLM

    import tiny_models
    from helpers import round_as_q8_0_file
    from rungen.kvcache import new_cache

    monkeypatch.setenv(KV_FLOAT32_ENV, "1")  # (the checkpoint's float32 cache: what this compares is the attention)
    checkpoint = tiny_models.llama4_checkpoint(str(tmp_path))
    reference = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    round_as_q8_0_file(reference)  # (the weights the Q8_0 file holds)
    path = tiny_models.write_llama4_gguf(checkpoint, str(tmp_path / "scout.gguf"), "Q8_0")
    loaded = load(path, device=torch.device("cpu"))
    assert loaded.context == 10485760 and loaded.model.attends_positions
    rows = torch.randint(3, 590, (2, 8202), generator=torch.Generator().manual_seed(0))
    lengths = (8200, 8196)  # (the second row left-padded by 4)
    ids = torch.stack([rows[0, :8200], torch.cat([torch.zeros(4, dtype=torch.long), rows[1, :8196]])])
    mask = (torch.arange(8200) >= torch.tensor([0, 4])[:, None]).long()
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    cache, model = new_cache(loaded.model), loaded.model

    def run():
        out = [model(ids, attention_mask=mask, position_ids=positions, past_key_values=cache).logits[:, -1]]
        attended = mask
        for step in range(2):
            attended = torch.cat([attended, torch.ones(2, 1, dtype=mask.dtype)], -1)
            steps = torch.stack([rows[0, 8200 + step], rows[1, 8196 + step]])[:, None]
            out.append(model(steps, attention_mask=attended, position_ids=positions[:, -1:] + 1 + step,
                             past_key_values=cache).logits[:, -1])
        return out

    with torch.no_grad():
        ours = exact_weights(model, run, monkeypatch)
        for row, length in enumerate(lengths):
            theirs = reference(rows[row : row + 1, : length + 2]).logits[0, -3:]
            torch.testing.assert_close(torch.stack([step[row] for step in ours]), theirs, rtol=1e-4, atol=1e-4)


def test_a_llama4_file_dequantized_runs_within_its_first_chunk_as_in_its_blocks(tmp_path, capsys):
    # --dequantize runs transformers' own model (its experts transposed) over the file's weights, its llama3 rotary
    # from rope_freqs, which transformers' reading of the keys leaves out, without transformers' report of that
    # tensor; its layers read as full ones, it runs before the first chunk's last position (8191), where they are
    # plain attention (a longer prompt refused in one line, not cut).
    from transformers import AutoModelForCausalLM

    import tiny_models
    from helpers import round_as_q8_0_file

    checkpoint = tiny_models.llama4_checkpoint(str(tmp_path))
    path = tiny_models.write_llama4_gguf(checkpoint, str(tmp_path / "scout.gguf"), "Q8_0")
    reference = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    round_as_q8_0_file(reference)
    capsys.readouterr()
    loaded = load(path, device=torch.device("cpu"), dequantize=True)
    assert type(loaded.model.model.layers[1].feed_forward).__name__ == "Llama4TextMoe" and loaded.context == 8191
    ids = torch.arange(3, 43)[None] * 7
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(ids).logits, reference(ids).logits, rtol=1e-5, atol=1e-5)
    assert "rope_freqs" not in capsys.readouterr().err
    code, line = error_of(["--model_name_or_path", path, "--dequantize", "--prompt", "a b " * 4096, "--length",
                           "2"], capsys)
    assert code == 2 and line.endswith("prompt is 8193 tokens; the model's context is 8191"), line


def test_a_deepseek2_file_with_a_queries_temperature_computes_it_past_its_length(tmp_path, monkeypatch):
    # Mistral Large 3's files (deepseek2, as conversion/mistral.py writes them) carry llama 4's temperature of the
    # queries (attention.temperature_scale and _length), which llama.cpp's graph applies and transformers' DeepSeek
    # attention has not: the absorbed latent attention applies it by position (a prompt of 40 positions crossing a
    # length of 16 twice, a left-padded batch), as transformers' DeepSeek-V3 with its queries scaled so computes, and
    # the file runs to its context; the same file without the keys computes DeepSeek-V3 itself.
    from transformers import AttentionInterface, AutoModelForCausalLM
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    import tiny_models
    from helpers import padded_prompt_and_steps

    def tempered(module, query, key, value, attention_mask, position_ids=None, **kwargs):
        tuned = torch.log1p(torch.floor(position_ids.float() / 16)) * 0.1 + 1
        return sdpa_attention_forward(module, query * tuned[:, None, :, None], key, value, attention_mask, **kwargs)

    monkeypatch.setenv(KV_FLOAT32_ENV, "1")
    AttentionInterface.register("rungen_tempered_test", tempered)
    checkpoint = tiny_models.deepseek_checkpoint(str(tmp_path))
    reference = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32,
                                                     attn_implementation="rungen_tempered_test").eval()
    path = tiny_models.write_deepseek2_gguf(checkpoint, str(tmp_path / "large3.gguf"), temperature=(0.1, 16))
    loaded = load(path, device=torch.device("cpu"))
    assert loaded.model.attends_positions and loaded.context == reference.config.max_position_embeddings
    ids = torch.arange(3, 43)[None] * 7
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(ids).logits, reference(ids).logits, rtol=1e-4, atol=1e-4)
        untempered = load(tiny_models.write_deepseek2_gguf(checkpoint, str(tmp_path / "v3.gguf")),
                          device=torch.device("cpu")).model(ids).logits
        assert not torch.allclose(untempered[:, 16:], reference(ids).logits[:, 16:], atol=1e-3)
        torch.testing.assert_close(untempered[:, :16], reference(ids).logits[:, :16], rtol=1e-4, atol=1e-4)
    ours, theirs = padded_prompt_and_steps(loaded.model), padded_prompt_and_steps(reference)
    for got, wanted in zip(ours, theirs):
        torch.testing.assert_close(got[1], wanted[1], rtol=1e-4, atol=1e-4)  # (the unpadded row)


@pytest.mark.parametrize("architecture", ["glm4", "glm4moe"])
def test_a_glm4v_text_models_file_is_refused_in_one_line(architecture, tmp_path, monkeypatch):
    # GLM-4.1V's and GLM-4.5V's text models are written as glm4 and glm4moe files with their M-RoPE's sections, each
    # head's rotated q and k rows reordered for llama.cpp's M-RoPE kernel: read as GLM-4's (GLM-4.5's) they would turn
    # the wrong pairs. Refused in one line, not computed as another function.
    import gguf

    import tiny_models

    make, write = ((tiny_models.glm4_checkpoint, tiny_models.write_glm4_gguf) if architecture == "glm4" else
                   (tiny_models.glm4moe_checkpoint, tiny_models.write_glm4moe_gguf))
    add_eps = gguf.GGUFWriter.add_layer_norm_rms_eps
    monkeypatch.setattr(gguf.GGUFWriter, "add_layer_norm_rms_eps", lambda writer, value: (  # (as TextModel writes)
        add_eps(writer, value), writer.add_rope_dimension_sections([8, 12, 12, 0])))
    path = write(make(str(tmp_path)), str(tmp_path / "glm4v.gguf"))
    said = rf"a GLM-4.1V/4.5V text model's file \({architecture}.rope.dimension_sections\)"
    with pytest.raises(GGUFError, match=said) as raised:
        GGUFHeader(path)
    assert "\n" not in str(raised.value)


def test_a_minimax_m2_file_whose_router_is_not_sigmoid_is_refused_in_one_line(tmp_path):
    # MiniMax-M2's model scores its experts by a sigmoid; a file whose expert_gating_func says softmax would be
    # computed as another model: refused in one line.

    import tiny_models

    checkpoint = tiny_models.minimax_m2_checkpoint(str(tmp_path))
    tiny_models.update_config(checkpoint, scoring_func="softmax")
    path = tiny_models.write_minimax_m2_gguf(checkpoint, str(tmp_path / "softmax.gguf"))
    with pytest.raises(GGUFError, match=r"its router's gating function 1 \(minimax-m2.expert_gating_func\)") as raised:
        GGUFHeader(path)
    assert "\n" not in str(raised.value)


def test_a_llama4_file_without_chunks_or_experts_is_refused_in_one_line(tmp_path):
    # llama.cpp's converter writes attention.sliding_window 0 for a Llama 4 config whose layers are all full
    # (MobileLLM-R1's, without experts too): not Llama 4's chunks and rotary-free layers, refused, not computed as
    # Scout's.
    import tiny_models

    checkpoint = tiny_models.llama4_checkpoint(str(tmp_path))
    path = tiny_models.write_llama4_gguf(checkpoint, str(tmp_path / "full.gguf"), window=0)
    with pytest.raises(GGUFError, match=r"a sliding window of 0 \(attention.sliding_window\)") as raised:
        GGUFHeader(path)
    assert "\n" not in str(raised.value)


def test_a_falcon_h1_file_with_its_multipliers_in_keys_is_refused_in_one_line(tmp_path, capsys):
    # TII's llama.cpp fork wrote Falcon-H1's files with the weights as trained and their multipliers in keys, which
    # llama.cpp's converter now multiplies into the weights (the multipliers this tool then takes as 1): such a file
    # is refused, not computed without its multipliers.
    import tiny_models

    path = tiny_models.write_falcon_h1_gguf(tiny_models.falcon_h1_checkpoint(str(tmp_path)),
                                            str(tmp_path / "fork.gguf"), "Q8_0", fork=True)
    code, line = error_of(["--model_name_or_path", path, "--prompt", "Hi", "--length", "2"], capsys)
    assert code == 2 and line.endswith("its multipliers are in keys (falcon-h1.key_multiplier), as TII's llama.cpp "
                                       "fork wrote Falcon-H1's files before llama.cpp's converter multiplied them "
                                       "into the weights; convert the checkpoint again with llama.cpp's "
                                       "convert_hf_to_gguf.py)"), line


def test_a_nemotron_3_file_of_expert_groups_without_the_count_a_token_takes_is_refused(tmp_path, monkeypatch):
    # A router that chooses within groups of experts needs how many groups a token takes (expert_group_used_count,
    # which llama.cpp's converter now writes beside expert_group_count): a file without it is refused in one line,
    # not routed over all experts.

    import gguf

    import tiny_models

    checkpoint = tiny_models.nemotron_h_moe_checkpoint(str(tmp_path))
    tiny_models.update_config(checkpoint, n_group=2)
    monkeypatch.setattr(gguf.GGUFWriter, "add_expert_group_used_count", lambda writer, count: None)
    path = tiny_models.write_nemotron_h_gguf(checkpoint, str(tmp_path / "groups.gguf"))
    with pytest.raises(GGUFError, match=r"its experts are in 2 groups \(expert_group_count\) without") as raised:
        GGUFHeader(path)
    assert "\n" not in str(raised.value)


def test_an_ernie45_mixture_file_requantized_by_llama_cpp_computes_as_the_converters(tmp_path):
    # llama.cpp's quantizer writes the converter's [1, experts] router correction as [experts] (the published Q4_K_M
    # files hold it so): read into the model's [1, experts] all the same, the same logits.
    import tiny_models

    checkpoint = tiny_models.ernie4_5_moe_checkpoint(str(tmp_path))
    converted, requantized = (tiny_models.write_ernie4_5_moe_gguf(checkpoint, str(tmp_path / f"{name}.gguf"), "Q8_0",
                                                                  requantized=name == "requantized")
                              for name in ("converted", "requantized"))
    shapes = [[row[2] for row in GGUFHeader(path).tensors if row[0] == "blk.1.exp_probs_b.bias"]
              for path in (converted, requantized)]
    assert shapes == [[[1, 8]], [[8]]]
    ids = torch.arange(3, 43)[None] * 7
    with torch.no_grad():
        logits = [build_model(GGUFHeader(path), torch.float32)(ids).logits for path in (converted, requantized)]
    assert torch.equal(*logits)


@pytest.mark.parametrize("kind", ["lfm2_moe", "lfm2_moe_unbiased", "ernie4_5_moe", "afmoe"])
def test_a_biased_router_chooses_as_transformers_and_alike_in_a_batch(kind):
    # LFM2-MoE's router (sigmoid scores, the block's expert bias added to choose by, normalized: BiasedRouter),
    # ERNIE 4.5's (the softmax, its correction added to choose by, normalized: ErnieRouter) and AFMoE's (sigmoid
    # scores, the block's expert bias, normalized, scaled: BiasedRouter too): transformers' experts and weights, and a
    # token's the same bits alone as in a batch (its logits a row at a time).
    from transformers import AfmoeConfig, Ernie4_5_MoeConfig, Lfm2MoeConfig
    from transformers.models.afmoe.modeling_afmoe import AfmoeTokenChoiceRouter
    from transformers.models.ernie4_5_moe.modeling_ernie4_5_moe import Ernie4_5_MoeTopKRouter
    from transformers.models.lfm2_moe.modeling_lfm2_moe import Lfm2MoeTopKRouter

    from rungen.gguf.experts import ROUTER_FORMS

    torch.manual_seed(0)
    bias = torch.randn(16) * 0.5
    if kind == "ernie4_5_moe":
        router = Ernie4_5_MoeTopKRouter(Ernie4_5_MoeConfig(hidden_size=64, moe_num_experts=16, moe_k=4))
        with torch.no_grad():
            router.moe_statics.e_score_correction_bias.copy_(bias[None])
        args = ()
    elif kind == "afmoe":
        router = AfmoeTokenChoiceRouter(AfmoeConfig(hidden_size=64, num_experts=16, num_experts_per_tok=4,
                                                    route_scale=1.5))
        args = (bias,)
    else:
        router = Lfm2MoeTopKRouter(Lfm2MoeConfig(hidden_size=64, num_experts=16, num_experts_per_tok=4,
                                                 use_expert_bias=kind == "lfm2_moe", routed_scaling_factor=1.5))
        args = (bias,)
    with torch.no_grad():
        (router.gate if kind == "afmoe" else router).weight.normal_(0, 0.3)
    x = torch.randn(9, 64)
    with torch.no_grad():
        logits, weights, experts = router(x[None] if kind == "afmoe" else x, *args)  # (AFMoE's: [batch, tokens])
        ours = ROUTER_FORMS[type(router).__name__](router)
        got_logits, got_weights, got_experts = ours(x, *args)
        alone = [ours(row[None], *args) for row in x]
    torch.testing.assert_close(got_logits, logits, rtol=1e-5, atol=1e-5)
    assert torch.equal(got_experts, experts)
    torch.testing.assert_close(got_weights, weights)
    assert weights.sum(dim=-1).allclose(torch.full((9,), 1.0 if kind == "ernie4_5_moe" else 1.5))
    for row, (row_logits, row_weights, row_experts) in enumerate(alone):
        assert torch.equal(row_logits[0], got_logits[row]) and torch.equal(row_experts[0], got_experts[row])
        assert torch.equal(row_weights[0], got_weights[row])


def test_a_qwen2_moe_files_experts_and_shared_expert_compute_in_their_blocks(tmp_path, monkeypatch):
    # Qwen1.5-MoE-A2.7B's layout (qwen2's attention with q/k/v biases, a shared expert beside the routed ones, gated
    # by its own sigmoid), of widths other than Qwen2MoeConfig's defaults (1408, 5632: Qwen2-57B-A14B's are 2560 and
    # 20480), which transformers' reading leaves in the config.
    from helpers import write_moe_gguf

    path = write_moe_gguf(tmp_path / "qwen2moe.gguf", arch="qwen2moe", experts=6, used=2, expert_ffn=256,
                          shared_ffn=512)
    [(header, model, reference)] = blocks_and_reference({"moe": path}).values()
    config = model.config
    assert (config.model_type, config.moe_intermediate_size, config.shared_expert_intermediate_size,
            config.norm_topk_prob) == ("qwen2_moe", 256, 512, False)  # (llama.cpp's qwen2moe graph: unnormalized)
    assert_experts_in_blocks(model, header)
    assert isinstance(model.model.layers[0].mlp.shared_expert.gate_proj, GGMLLinear)
    ids = torch.tensor([header.tokenizer(PROMPTS[0]).input_ids])
    with torch.no_grad():
        theirs = reference(ids).logits
        blocks = exact_weights(model, lambda: model(ids).logits, monkeypatch)
    assert theirs.abs().max() > 1
    torch.testing.assert_close(blocks, theirs, rtol=1e-4, atol=1e-4)


def test_a_mixtral_file_is_a_llama_file_with_experts_and_computes_mixtral_in_its_blocks(tmp_path, monkeypatch, capsys):
    # llama.cpp writes Mixtral-8x7B as a llama file with experts (llama.expert_count), which transformers' reading
    # takes for a dense llama, whose MLP the file lacks. It is transformers' Mixtral here, over the experts in their
    # blocks, a token's top 2 weights divided by their sum as Mixtral's router does; the reference is that class
    # over the file's tensors de-quantized by the gguf package and mapped by hand (q/k rows un-permuted).
    from helpers import write_moe_gguf

    path = write_moe_gguf(tmp_path / "mixtral.gguf", arch="llama", experts=8, used=2, expert_ffn=256,
                          expert_types=(Q.Q4_0, Q.Q4_0, Q.Q6_K))
    [(header, model, reference)] = blocks_and_reference({"mixtral": path}).values()
    config = model.config
    assert (config.model_type, config.num_local_experts, config.num_experts_per_tok, config.intermediate_size) == (
        "mixtral", 8, 2, 256)
    assert_experts_in_blocks(model, header)
    assert all(isinstance(layer.mlp.gate, ExpertRouter) and layer.mlp.gate.norm_topk_prob
               for layer in model.model.layers)
    ids = torch.tensor([header.tokenizer(PROMPTS[0]).input_ids])
    with torch.no_grad():
        theirs = reference(ids).logits
        blocks = exact_weights(model, lambda: model(ids).logits, monkeypatch)
        device_form = build_model(header, torch.float32, torch.device("cpu"))(ids).logits  # gate/up merged there
    assert theirs.abs().max() > 1
    torch.testing.assert_close(blocks, theirs, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(device_form, theirs, rtol=1e-4, atol=1e-4)
    # transformers' own loader (--dequantize, --device_map) cannot read it: refused in one line that says so.
    code, line = error_of(["--model_name_or_path", path, "--prompt", "Hi", "--length", "2", "--dequantize"], capsys)
    assert code == 2 and line.endswith("transformers reads no mixtral file (llama's with experts, as llama.cpp writes "
                                       "it); it runs here in its own blocks, without --dequantize or --device_map)")
    # The first Mixtral files (llama.cpp's converter until April 2024) hold each expert's gate, up and down as a
    # tensor of its own: the same model, each expert read from its own tensor, on the CPU, in a device's form and on
    # the own model code.
    legacy = experts_apart(path, tmp_path / "legacy.gguf")
    header = GGUFHeader(legacy)
    apart = build_model(header, torch.float32)
    assert_experts_in_blocks(apart, header)
    with torch.no_grad():
        assert torch.equal(apart(ids).logits, model(ids).logits)
        assert torch.equal(build_model(header, torch.float32, torch.device("cpu"))(ids).logits, device_form)
        own = load_gguf(legacy).model
        expected = model(ids, past_key_values=new_cache(model)).logits  # over a cache as the own model's (float16)
        assert isinstance(own, GGUFCausalLM) and torch.equal(own(ids).logits, expected)
    code, line = error_of(["--model_name_or_path", experts_apart(path, tmp_path / "gap.gguf", skip=3), "--prompt",
                           "Hi", "--length", "2"], capsys)
    assert code == 2 and line.endswith("gap.gguf: the experts of blk.0.ffn_gate (a tensor each) are not numbered "
                                       "from 0 or differ in type or shape")


def gemma4_files(tmp_path, variant: str, qtype_name: str):
    """(transformers' model of a tiny Gemma 4 checkpoint of `variant`'s layout, a prompt's ids, its F32 and
    `qtype_name` GGUF files as llama.cpp's converter writes them)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tiny_models import gemma4_checkpoint, write_gemma4_gguf

    checkpoint = gemma4_checkpoint(str(tmp_path), variant)
    reference = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    ids = torch.tensor([AutoTokenizer.from_pretrained(checkpoint)(PROMPTS[0]).input_ids])
    return (reference, ids, write_gemma4_gguf(checkpoint, str(tmp_path / "f32.gguf")),
            write_gemma4_gguf(checkpoint, str(tmp_path / f"{qtype_name.lower()}.gguf"), qtype_name))


@pytest.mark.parametrize("variant", ["e2b", "31b"])
def test_a_gemma4_file_as_llama_cpp_writes_it_computes_its_checkpoint(tmp_path, monkeypatch, variant):
    # transformers' reading of a Gemma 4 file leaves Gemma4TextConfig's defaults (one published model's) where the
    # converter writes its own keys: the sliding layers' head size, which layers slide, the last layers reusing
    # earlier keys and values, the per-layer embedding's width, both rotaries, the full layers' kv heads and keys as
    # values, the double-wide MLP, the logits' cap; and its loader leaves each layer's output scale at 1. E2B's and
    # 31B's layouts: the F32 file computes the checkpoint (in its own blocks' path, with the native attention over a
    # cache growing in place in a padded batch and two steps, and with --dequantize), the Q8_0 file in its blocks
    # what the checkpoint with those weights de-quantized does.
    from gguf import GGMLQuantizationType as Q

    monkeypatch.setenv(KV_FLOAT32_ENV, "1")  # (the checkpoint's float32 cache: what this compares is the weights)

    reference, ids, f32, q8_0 = gemma4_files(tmp_path, variant, "Q8_0")
    with torch.no_grad():
        theirs = reference(ids).logits
        for dequantize in (False, True):
            ours = load(f32, device=torch.device("cpu"), dequantize=dequantize).model(ids).logits
            torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    if native_kernels():  # its attention the native one, over a cache read in place (the shared layers' too)
        from helpers import padded_prompt_and_steps

        model = load(f32, device=torch.device("cpu")).model
        assert model.config._attn_implementation == NATIVE_ATTENTION and model.cache_grows_in_place
        ours, theirs = padded_prompt_and_steps(model), padded_prompt_and_steps(reference)
        ours[0][0, :2], theirs[0][0, :2] = 0, 0  # (the padding's own positions: no key to see)
        for got, wanted in zip(ours, theirs):
            torch.testing.assert_close(got, wanted, rtol=1e-4, atol=1e-4)
    with torch.no_grad():
        for parameter in reference.parameters():  # the weights the Q8_0 file holds
            if parameter.dim() == 2 and parameter.shape[-1] % 32 == 0:
                blocks = quants.quantize(parameter.numpy(), Q.Q8_0)
                parameter.copy_(torch.from_numpy(quants.dequantize(blocks, Q.Q8_0)))
        theirs = reference(ids).logits
        model = load(q8_0, device=torch.device("cpu")).model
        assert any(isinstance(module, GGMLLinear) for module in model.modules())
        if native_kernels():  # its norms one native call each, its MLPs' gate and up one product, its attention's
            # q/k/v one product and their norms and rotation one call
            assert not [m for m in model.modules() if type(m).__name__ in ("Gemma4RMSNorm", "Gemma4TextMLP")]
            assert all(isinstance(layer.mlp, NativeGatedMLP) for layer in model.model.layers)
            assert all(isinstance(layer.self_attn, NativeGemma4Attention) for layer in model.model.layers)
        blocks = exact_weights(model, lambda: model(ids).logits, monkeypatch)
    assert theirs.abs().max() > 0.5
    torch.testing.assert_close(blocks, theirs, rtol=1e-4, atol=1e-4)
    if native_kernels():  # and in a padded batch and two steps on the cache growing in place
        from helpers import padded_prompt_and_steps

        ours = exact_weights(model, lambda: padded_prompt_and_steps(model), monkeypatch)
        theirs = padded_prompt_and_steps(reference)
        ours[0][0, :2], theirs[0][0, :2] = 0, 0  # (the padding's own positions: no key to see)
        for got, wanted in zip(ours, theirs):
            torch.testing.assert_close(got, wanted, rtol=1e-4, atol=1e-4)
        # The engine's cache as it is by default (the shared layers reading float16 keys and values too).
        monkeypatch.delenv(KV_FLOAT32_ENV)
        assert_float16_cache_as_rounded(model)


def test_a_gemma4_mixture_of_experts_file_computes_its_checkpoint(tmp_path, monkeypatch, capsys):
    # 26B-A4B's layout: a mixture beside each layer's dense MLP, its experts' gate and up in one tensor
    # (ffn_gate_up_exps), the router's input scale and its scale of each expert as llama.cpp's converter names them
    # (ffn_gate_inp.scale, ffn_down_exps.scale): transformers' reading drops all of it and would compute the dense
    # MLPs alone. The F32 file computes its checkpoint; a Q5_0 file (the experts in blocks, the router F32: the type
    # llama.cpp's Q4_K_M takes for 26B-A4B's rows of 704 and 2112, which transformers' header reader cannot size) in
    # its blocks what the checkpoint with those weights de-quantized does, each expert's gate and up halves read from
    # the one tensor; the same as a device takes it (de-quantized there, or in codes: plain products standing in for
    # the GPU's kernel). transformers' own loader (--dequantize) is refused in one line.
    import rungen.gguf.device
    from rungen.gguf.device import INT8_TYPES
    from rungen.gguf.device_experts import CodedExperts

    reference, ids, f32, q5_0 = gemma4_files(tmp_path, "26b-a4b", "Q5_0")
    with torch.no_grad():
        theirs = reference(ids).logits
        torch.testing.assert_close(load(f32, device=torch.device("cpu")).model(ids).logits, theirs, rtol=1e-5,
                                   atol=1e-5)
        for name, parameter in reference.named_parameters():  # the weights the Q5_0 file holds (the router's F32)
            if parameter.dim() in (2, 3) and parameter.shape[-1] % 32 == 0 and ".router." not in name:
                blocks = quants.quantize(parameter.numpy(), Q.Q5_0)
                parameter.copy_(torch.from_numpy(quants.dequantize(blocks, Q.Q5_0)))
        theirs = reference(ids).logits
    assert theirs.abs().max() > 0.5
    model = load(q5_0, device=torch.device("cpu")).model
    experts = model.model.layers[0].experts
    assert isinstance(experts, GGMLExperts) and experts.gate_up[0].qtype == Q.Q5_0
    assert experts.gate_up[0].out_features == 2 * model.config.moe_intermediate_size
    with torch.no_grad():
        ours = exact_weights(model, lambda m=model: m(ids).logits, monkeypatch)
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
    if native_kernels():  # each layer's chosen experts one native call, as the modules compute them within rounding
        calls = []
        original = torch.ops.rungen_ggml.chosen_experts
        monkeypatch.setattr(torch.ops.rungen_ggml, "chosen_experts", lambda *a: calls.append(1) or original(*a))
        with torch.no_grad():
            native = model(ids).logits
            assert len(calls) == len(model.model.layers)
            with monkeypatch.context() as patch:
                patch.setattr(GGMLLinear, "_matmul", lambda self, x: BLOCKS_MATMUL(self, x))
                modules = model(ids).logits
        assert len(calls) == len(model.model.layers)
        torch.testing.assert_close(native, modules, rtol=1e-4, atol=1e-4)
    del model, experts
    # --quantize: the experts (a minority of this tiny model's weights) de-quantized an expert at a time, the halves
    # too, the linear layers quantized
    [sequence] = run_generation.main(["--model_name_or_path", q5_0, "--prompt", "Hi", "--length", "2",
                                      "--quantize", "int8", "--temperature", "0"])
    assert sequence.startswith("Hi")
    # as a device takes it (its build on the CPU here): transformers' own experts, de-quantized; in codes
    device = build_model(GGUFHeader(q5_0), torch.float32, torch.device("cpu"))
    assert type(device.model.layers[0].experts).__name__ == "Gemma4TextExperts"
    with torch.no_grad():
        torch.testing.assert_close(device(ids).logits, theirs, rtol=1e-4, atol=1e-4)
    del device
    monkeypatch.setattr(rungen.gguf.device, "gpu_int8", lambda qtype, device: qtype in INT8_TYPES)
    monkeypatch.setattr(rungen.gguf.device, "checked_kernel", lambda layer, dtype, instead: plain_grouped_kernel())
    coded = build_model(GGUFHeader(q5_0), torch.float32, torch.device("cpu"))
    assert isinstance(coded.model.layers[0].experts, CodedExperts)
    with torch.no_grad():
        torch.testing.assert_close(coded(ids).logits, theirs, rtol=1e-4, atol=1e-4)
    del coded
    code, line = error_of(["--model_name_or_path", q5_0, "--prompt", "Hi", "--length", "2", "--dequantize"], capsys)
    assert code == 2 and line.endswith("q5_0.gguf: transformers reads no Gemma 4 mixture of experts as llama.cpp "
                                       "writes it (its experts' gate and up in one tensor, the router's scales); it "
                                       "runs here in its own blocks, without --dequantize or --device_map"), line


# Files whose model transformers' GGUF reading misses: of architectures it does not know, which llama.cpp writes as
# another's (llama's, or Qwen3-VL's text model as Qwen3's), and a Llama 3.1 file's llama3 rotary, which llama.cpp
# keeps only in its rope_freqs tensor. Each one's checkpoint and writer (tiny_models), transformers' class the file is
# read into, and what the model of the Q8_0 file must hold where given: its layers' fields, its stack's (its layers
# fused), its native steps' modules.
CHECKPOINT_FILES = {
    # Llama 3.1-3.3's llama3 rotary: the frequency factors of rope_freqs, read back as its parameters (transformers'
    # reading drops the tensor and rotated by the plain frequencies: 0.08 off in the logits of this tiny model).
    "llama3": dict(files=("llama3_checkpoint", "write_llama3_gguf"), model="LlamaForCausalLM",
                   stack=dict(head_dim=32)),
    # Qwen3's yarn for long contexts, in rope.scaling keys that transformers' reading drops: transformers' layers.
    "qwen3_yarn": dict(files=("qwen3_yarn_checkpoint", "write_qwen3_gguf"), model="Qwen3ForCausalLM",),
    # DeepSeek Coder's linear rotary (positions / 4), in rope.scaling keys that transformers' llama reading drops.
    "deepseek_coder": dict(files=("deepseek_coder_checkpoint", "write_llama3_gguf"), model="LlamaForCausalLM",
                           stack=dict(head_dim=32)),
    # SmolLM3's every fourth layer without rotary, as llama.cpp fixes it.
    "smollm3": dict(files=("smollm3_checkpoint", "write_smollm3_gguf"), model="SmolLM3ForCausalLM",
                    layers=dict(rotates=[True, True, True, False] * 2), stack=dict(rotary=[1, 1, 1, 0] * 2)),
    # Granite 3's multipliers, read from the file's keys: each residual branch's (0.22), the scores' (1 / 64); the
    # embedding's (12) and the logits' divisor (8) are the model's around the layers.
    "granite": dict(files=("granite_checkpoint", "write_granite_gguf"), model="GraniteForCausalLM",
                    layers=dict(residual=[pytest.approx(0.22)] * 4, scaling=[1 / 64] * 4),
                    stack=dict(residual_scale=pytest.approx(0.22), scale=1 / 64)),
    # Ministral 3's yarn rotary and its queries' temperature past the original context (16 positions here, which
    # the F32 file's prompt crosses twice): transformers' Ministral3 layers over the blocks, their steps native (the
    # stack takes no temperature).
    "ministral3": dict(files=("ministral3_checkpoint", "write_ministral3_gguf"), model="Ministral3ForCausalLM",
                       native=dict(self_attn="NativeMinistral3Attention", mlp="NativeGatedMLP")),
    # Mistral Small 3.x as llama.cpp converts it now (mistral3, no rotary scaling): llama's, fused and stacked.
    "mistral3": dict(files=("mistral_small_checkpoint", "write_mistral3_gguf"), model="LlamaForCausalLM",
                     stack=dict(head_dim=32)),
    # Qwen3-VL's text model (its interleaved MRoPE over a text prompt's positions: Qwen3's rotary), dense and
    # Qwen3-VL-30B-A3B's mixture (whose router always normalizes its top-k weights, as llama.cpp's graph does).
    "qwen3vl": dict(files=("qwen3vl_checkpoint", "write_qwen_vl_gguf"), model="Qwen3ForCausalLM",
                    stack=dict(head_dim=32)),
    "qwen3vlmoe": dict(files=("qwen3vlmoe_checkpoint", "write_qwen_vl_gguf"), model="Qwen3MoeForCausalLM",
                       stack=dict(head_dim=32)),
    # MiniMax-M2's (transformers reads its files: q/k norms over all heads, half of each head rotated, experts chosen
    # by sigmoid scores plus a correction): transformers' layers over the blocks, their steps native, its experts in
    # them.
    "minimax-m2": dict(files=("minimax_m2_checkpoint", "write_minimax_m2_gguf"), model="MiniMaxM2ForCausalLM",
                       native=dict(self_attn="NativeOlmoAttention", input_layernorm="NativeRMSNorm")),
    # HY V3's (Tencent's Hy3: q/k norms per head, a dense first layer, sigmoid-scored experts chosen with a
    # correction, normalized and scaled, beside a shared one): transformers' layers over the blocks, their steps
    # native, its experts in them.
    "hy_v3": dict(files=("hy_v3_checkpoint", "write_hy_v3_gguf"), model="HYV3ForCausalLM",
                  native=dict(self_attn="NativeExaone4Attention", input_layernorm="NativeRMSNorm")),
    # dots.llm1's (Qwen3's attention, DeepSeek-V3's mixtures after a dense first layer): transformers' layers over the
    # blocks, their steps native, its experts in them.
    "dots1": dict(files=("dots1_checkpoint", "write_dots1_gguf"), model="Dots1ForCausalLM",
                  native=dict(self_attn="NativeExaone4Attention", input_layernorm="NativeRMSNorm")),
    # Llama 4's (Scout's rotary and q/k norms, Maverick's interleave of dense and mixture layers): transformers' layers
    # over the blocks, their steps native, its mixtures' experts in them.
    "llama4": dict(files=("llama4_checkpoint", "write_llama4_gguf"), model="Llama4ForCausalLM",
                   native=dict(self_attn="NativeLlama4Attention", input_layernorm="NativeRMSNorm")),
    # Qwen2.5-VL's (and Qwen2-VL's) text model: Qwen2's under the qwen2vl architecture (its MRoPE over a text
    # prompt's positions: Qwen2's rotary), q/k/v biases and all.
    "qwen2vl": dict(files=("qwen2vl_checkpoint", "write_qwen_vl_gguf"), model="Qwen2ForCausalLM",
                    stack=dict(head_dim=32), vision=True),
    # Gemma (1): Gemma 2's keys and stored norms, without its output norms, caps and windows; fused and stacked.
    "gemma": dict(files=("gemma_checkpoint", "write_gemma_gguf"), model="GemmaForCausalLM",
                  stack=dict(gelu=True, head_dim=32)),
    # ERNIE 4.5's dense model: llama's over its q/k rows un-permuted (its rotary turns each pair of a head's values,
    # as llama.cpp's permuted llama rows are turned), fused and stacked.
    "ernie4_5": dict(files=("ernie4_5_checkpoint", "write_ernie4_5_gguf"), model="LlamaForCausalLM",
                     stack=dict(head_dim=32)),
    # EXAONE 4's norms after the attention and the MLP, q/k norms per head, three sliding layers in four with full
    # ones without rotary, its llama3 rotary in rope_freqs: transformers' layers over the blocks, their steps native.
    "exaone4": dict(files=("exaone4_checkpoint", "write_exaone4_gguf"), model="Exaone4ForCausalLM",
                    native=dict(self_attn="NativeExaone4Attention", mlp="NativeGatedMLP")),
    "exaone4_global": dict(files=("exaone4_global_checkpoint", "write_exaone4_gguf"), model="Exaone4ForCausalLM",
                           native=dict(self_attn="NativeExaone4Attention", mlp="NativeGatedMLP")),
    # GLM-4-0414's partial pairwise rotary (half of each head), q/k/v biases, gate and up one projection, norms after
    # the attention and the MLP too: transformers' layers over the blocks.
    "glm4": dict(files=("glm4_checkpoint", "write_glm4_gguf"), model="Glm4ForCausalLM"),
    # OLMo 2's norms after the attention and the MLP (none before), q and k normalized over all their heads; OLMo
    # 3's sliding layers beside every fourth full one with its yarn rotary (the F32 file's prompt crosses the
    # window and the original context twice): transformers' layers over the blocks, their steps native.
    "olmo2": dict(files=("olmo2_checkpoint", "write_olmo2_gguf"), model="Olmo2ForCausalLM",
                  native=dict(self_attn="NativeOlmoAttention", mlp="NativeGatedMLP")),
    "olmo3": dict(files=("olmo3_checkpoint", "write_olmo2_gguf"), model="Olmo3ForCausalLM",
                  native=dict(self_attn="NativeOlmoAttention", mlp="NativeGatedMLP")),
    # Qwen3.5's Gated DeltaNet layers beside gated full attention, read by transformers' own conversion table (its
    # norms' offset, A_log, the convolution's shape, the value heads llama.cpp's converter tiles: rows permuted in
    # their blocks, out_proj's columns on its input), its multi-token prediction block left out: transformers' layers,
    # a decode step of the linear attention in fewer calls (the Q8_0 file's two steps), the gated attention and the
    # norms native (their sums in another order, which the recurrent layers carry on: up to 6e-5 apart on the F32
    # files' logits of about 6, as the Q8_0 file's tolerance).
    "qwen35": dict(files=("qwen35_checkpoint", "write_qwen35_gguf"), model="Qwen3_5ForCausalLM", vision=True,
                   steps=dict(linear_attn="DeltaNetStep", mlp="NativeGatedMLP", self_attn="NativeGatedAttention"),
                   native=dict(input_layernorm="NativeRMSNorm"), quantized=True, f32_atol=1e-4),
    # Qwen3.5-35B-A3B's: the same layers, each MLP a mixture (its experts in their blocks, F32 ones cast) beside a
    # shared expert behind its sigmoid gate.
    "qwen35moe": dict(files=("qwen35moe_checkpoint", "write_qwen35_gguf"), model="Qwen3_5MoeForCausalLM",
                      vision=True, steps=dict(linear_attn="DeltaNetStep", mlp="MixtureInOneCall",
                                              self_attn="NativeGatedAttention"),
                      native=dict(input_layernorm="NativeRMSNorm"), f32_atol=1e-4),
    # Qwen3-Next's (qwen3next, which transformers' table lacks) read as Qwen3.5's mixture, whose model computes it:
    # the value heads as the file keeps them (grouped by key head), its fused b and a (ssm_ba) split by rows, the
    # multi-token prediction block unread; the files of before the converter split in_proj_qkvz (ssm_in whole) too.
    # The same native steps as Qwen3.5's.
    "qwen3next": dict(files=("qwen3next_checkpoint", "write_qwen3next_gguf"), model="Qwen3_5MoeForCausalLM",
                      steps=dict(linear_attn="DeltaNetStep", mlp="MixtureInOneCall",
                                 self_attn="NativeGatedAttention"),
                      native=dict(input_layernorm="NativeRMSNorm"), f32_atol=1e-4),
    "qwen3next_legacy": dict(files=("qwen3next_checkpoint", "write_qwen3next_legacy_gguf"),
                             model="Qwen3_5MoeForCausalLM",
                             steps=dict(linear_attn="DeltaNetStep", mlp="MixtureInOneCall",
                                        self_attn="NativeGatedAttention"),
                             native=dict(input_layernorm="NativeRMSNorm"), f32_atol=1e-4),
    # Command R's (command-r: transformers' GGUF reading knows none of its keys) parallel attention and MLP after one
    # layer norm, its logit scale, Command R+'s q and k layer norms per head; Command R7B's (cohere2) three sliding
    # layers in four, the full ones without rotary (the F32 file's prompt crosses the window of 8): transformers'
    # layers.
    "cohere": dict(files=("cohere_checkpoint", "write_cohere_gguf"), model="CohereForCausalLM"),
    "cohere2": dict(files=("cohere2_checkpoint", "write_cohere_gguf"), model="Cohere2ForCausalLM"),
    # GLM-4.5's mixture: its own keys (the experts', the dense first layer, the sigmoid router's groups and scale), its
    # score correction as exp_probs_b, half of each head rotated by halves, q/k/v biases and q/k norms, the multi-token
    # prediction block the converter writes as a last layer left unread: transformers' layers, its experts in blocks
    # in one native call, its router's logits a row at a time, its steps native.
    "glm4moe": dict(files=("glm4moe_checkpoint", "write_glm4moe_gguf"), model="Glm4MoeForCausalLM",
                    steps=dict(self_attn="NativeGlm4MoeAttention"),
                    native=dict(input_layernorm="NativeRMSNorm", post_attention_layernorm="NativeRMSNorm")),
    # DeepSeek's latent attention (the converter's kv_b split into attn_k_b, transposed, and attn_v_b: joined back),
    # yarn's mscale from yarn_log_multiplier, a dense first layer, shared experts: V3's sigmoid router with its
    # correction in groups and q through its rank, V2-Lite's softmax router and q straight from the hidden state.
    # transformers' layers, the experts in blocks, the attention over the latents unexpanded.
    "deepseek_v3": dict(files=("deepseek_checkpoint", "write_deepseek2_gguf"), model="DeepseekV3ForCausalLM",
                        steps=dict(self_attn="AbsorbedLatentAttention")),
    "deepseek_v2": dict(files=("deepseek_v2_checkpoint", "write_deepseek2_gguf"), model="DeepseekV2ForCausalLM",
                        steps=dict(self_attn="AbsorbedLatentAttention")),
    # (the files of 2024, before the converter split kv_b: the kv_b whole, de-quantized, the key and value widths a
    # head's)
    # Mistral 4's (mistral4: deepseek2's keys and tensors, its experts' gate and up in one tensor, its softmax
    # router, llama 4's temperature of its queries past yarn's original context, which the 40-token prompt crosses).
    "mistral4": dict(files=("mistral4_checkpoint", "write_deepseek2_gguf"), model="Mistral4ForCausalLM",
                     steps=dict(self_attn="AbsorbedLatentAttention"), vision=True),
    "deepseek_v2_unsplit": dict(files=("deepseek_v2_checkpoint", "write_deepseek2_unsplit_gguf"),
                                model="DeepseekV2ForCausalLM", unsplit=True,
                                steps=dict(self_attn="AbsorbedLatentAttention")),
    # Seed-OSS's heads wider than hidden / heads and its q/k/v biases (qwen2's keys, nothing permuted); Arcee's
    # llama attention (its q/k permutation undone) and ReLU^2 MLP of up and down: transformers' layers.
    "seed_oss": dict(files=("seed_oss_checkpoint", "write_seed_oss_gguf"), model="SeedOssForCausalLM"),
    "arcee": dict(files=("arcee_checkpoint", "write_arcee_gguf"), model="ArceeForCausalLM"),
    # Apertus's per-head q/k norms (nothing permuted), its llama3 rotary from rope_freqs and each layer's xIELU from
    # the file's xielu.* keys (no tensor holds it): transformers' layers.
    "apertus": dict(files=("apertus_checkpoint", "write_apertus_gguf"), model="ApertusForCausalLM"),
    # Hunyuan's dense model: q/k norms after the rotation, its NTK alpha folded into the file's rope base.
    "hunyuan": dict(files=("hunyuan_checkpoint", "write_hunyuan_gguf"), model="HunYuanDenseV1ForCausalLM"),
    # LFM2's gated short convolutions beside attention with q/k norms, read by transformers' own conversion table (the
    # convolution's shape), the final norm after the layers: transformers' layers, their steps native (a convolution's
    # decode step a few operations).
    # ERNIE 4.5's mixture: its own keys (the experts', the dense layers first, the layer step, the shared experts), its
    # router's correction (moe_statics) as exp_probs_b, its rotary turning pairs (nothing permuted): transformers'
    # layers, the experts in blocks.
    "ernie4_5_moe": dict(files=("ernie4_5_moe_checkpoint", "write_ernie4_5_moe_gguf"),
                         model="Ernie4_5_MoeForCausalLM"),
    # LFM2-MoE's: lfm2's layers, a dense first MLP, then experts by sigmoid scores with the expert bias to choose by,
    # read by transformers' kind of table (its own lacks the architecture); its experts in blocks, its router's logits
    # a row at a time, its steps native as LFM2's.
    "lfm2moe": dict(files=("lfm2moe_checkpoint", "write_lfm2moe_gguf"), model="Lfm2MoeForCausalLM",
                    steps=dict(conv="ShortConvStep", self_attn="NativeLfm2Attention"),
                    native=dict(operator_norm="NativeRMSNorm")),
    # Granite 4.0 H's Mamba-2 layers beside attention without rotary (q and k as llama.cpp permutes them, read back),
    # Granite's multipliers, read by transformers' kind of table (its own lacks the architecture): A from -exp(A_log),
    # D and the gated norm from a column and a row a group, the convolution's shape; each MLP a mixture (the softmax of
    # the top 2 logits) beside the shared MLP, whose gate and up rows the file holds apart and transformers' layer
    # joins (one product over their blocks); granite-4.0-h-micro's dense MLP alone. transformers' layers, the
    # experts in blocks in one native call, a Mamba-2 layer's decode step between its products one native call (the
    # Q8_0 file's two steps), the norms and the shared MLP's activation native (the recurrent layers carry the sums'
    # other order on: the F32 files' tolerance, as Qwen3.5's).
    "granitehybrid": dict(files=("granitehybrid_checkpoint", "write_granitehybrid_gguf"),
                          model="GraniteMoeHybridForCausalLM",
                          steps=dict(block_sparse_moe="MixtureInOneCall", mamba="MambaStep",
                                     self_attn="NativeGraniteAttention"),
                          native=dict(input_layernorm="NativeRMSNorm", shared_mlp="NativeGatedMLP"), f32_atol=1e-4),
    "granitehybrid_dense": dict(files=("granitehybrid_dense_checkpoint", "write_granitehybrid_gguf"),
                                model="GraniteMoeHybridForCausalLM", quantized=True,
                                steps=dict(mamba="MambaStep", self_attn="NativeGraniteAttention"),
                                native=dict(input_layernorm="NativeRMSNorm", shared_mlp="NativeGatedMLP"),
                                f32_atol=1e-4),
    # Granite 3's mixtures (granitemoe: llama's keys, q and k permuted, its multipliers, each layer's experts beside
    # no MLP, the softmax of the top 2 logits), which transformers' GGUF reading does not know: the same table as
    # Granite 4.0 H's, its rotary over the rows read back; transformers' layers, the experts in one native call.
    "granitemoe": dict(files=("granitemoe_checkpoint", "write_granitemoe_gguf"), model="GraniteMoeForCausalLM",
                       steps=dict(block_sparse_moe="MixtureInOneCall"),
                       native=dict(input_layernorm="NativeRMSNorm", self_attn="NativeGraniteAttention")),
    # Nemotron-H's layers of one mixer each behind its norm (Mamba-2 of two groups, attention without rotary, relu^2
    # MLPs), their kinds from the kv heads and MLP widths a layer, read by the same kind of table as Granite 4.0 H's
    # (its config.json as published: llama.cpp's converter reads transformers' NemotronHConfig's defaults as a
    # mixture's): transformers' layers, a Mamba-2 decode step one native call, the attention and norms native.
    "nemotron_h": dict(files=("nemotron_h_checkpoint", "write_nemotron_h_gguf"), model="NemotronHForCausalLM",
                       quantized=True, steps=dict(mixer=("MambaStep", "NativeGraniteAttention", "NemotronHMLP")),
                       native=dict(norm="NativeRMSNorm"),
                       f32_atol=1e-4),
    # Nemotron 3's (nemotron_h_moe): Nemotron-H's layers with mixtures in place of MLPs (experts of up and down by
    # relu^2, no gate; the sigmoid router with its correction, the chosen weights normalized and scaled; a shared
    # expert beside), Nemotron-3-Super's experts over a latent between two products: transformers' layers, the
    # experts in blocks in one native call, the router's logits a row at a time.
    "nemotron_h_moe": dict(files=("nemotron_h_moe_checkpoint", "write_nemotron_h_gguf"), model="NemotronHForCausalLM",
                           steps=dict(mixer=("MambaStep", "NativeGraniteAttention", "NemotronHMoE")),
                           native=dict(norm="NativeRMSNorm"), f32_atol=1e-4),
    "nemotron_h_latent": dict(files=("nemotron_h_latent_checkpoint", "write_nemotron_h_gguf"),
                              model="NemotronHForCausalLM",
                              steps=dict(mixer=("MambaStep", "NativeGraniteAttention", "NemotronHMoE")),
                              native=dict(norm="NativeRMSNorm"), f32_atol=1e-4),
    # Falcon-H1's layers, each its attention (q and k as the checkpoint holds them: its rotary turns halves) and its
    # Mamba-2 mixer side by side behind one norm, then its MLP (behind the norm the converter names without .weight),
    # read by the same kind of table as Granite 4.0 H's, its multipliers 1 (the converter multiplied them into the
    # weights): the F32 file computes the checkpoint; the Q8_0 file what the checkpoint with its multipliers
    # multiplied in and its weights rounded does; the mixer's gated norm over two groups where a file has one.
    # transformers' layers, a Mamba-2 decode step one native call, the attention, the MLP and the norms native.
    "falcon_h1": dict(files=("falcon_h1_checkpoint", "write_falcon_h1_gguf"), model="FalconH1ForCausalLM",
                      as_converted=True, quantized=True,
                      steps=dict(mamba="MambaStep", self_attn="NativeGraniteAttention"),
                      native=dict(input_layernorm="NativeRMSNorm", feed_forward="NativeGatedMLP"), f32_atol=1e-4),
    "falcon_h1_norm": dict(files=("falcon_h1_norm_checkpoint", "write_falcon_h1_gguf"), model="FalconH1ForCausalLM",
                           as_converted=True, steps=dict(mamba="MambaStep", self_attn="NativeGraniteAttention"),
                           native=dict(input_layernorm="NativeRMSNorm", feed_forward="NativeGatedMLP"),
                           f32_atol=1e-4),
    # Arcee's AFMoE (Trinity: afmoe), read by the same kind of table: every fourth layer full and without rotary, the
    # others sliding, each attention's output gated and q and k normalized per head, four norms a layer, a dense
    # first layer, then mixtures (sigmoid scores with the expert bias, normalized and scaled) beside a shared expert;
    # muP's embedding scale: transformers' layers over the blocks, the experts in blocks, the attention (its gate
    # beside), the dense and shared MLPs and the norms native.
    "afmoe": dict(files=("afmoe_checkpoint", "write_afmoe_gguf"), model="AfmoeForCausalLM",
                  native=dict(self_attn="NativeAfmoeAttention", input_layernorm="NativeRMSNorm",
                              post_mlp_layernorm="NativeRMSNorm")),
    # AI2's OLMoE (olmoe), read by the same kind of table: q and k normalized over all their heads, every MLP a
    # mixture of softmax-scored experts (not normalized): transformers' layers over the blocks, the attention and
    # norms native, each mixture one native call.
    "olmoe": dict(files=("olmoe_checkpoint", "write_olmoe_gguf"), model="OlmoeForCausalLM",
                  native=dict(self_attn="NativeOlmoAttention", input_layernorm="NativeRMSNorm"),
                  steps=dict(mlp="MixtureInOneCall")),
    "lfm2": dict(files=("lfm2_checkpoint", "write_lfm2_gguf"), model="Lfm2ForCausalLM", quantized=True,
                 steps=dict(conv="ShortConvStep", self_attn="NativeLfm2Attention"),
                 native=dict(feed_forward="NativeGatedMLP", operator_norm="NativeRMSNorm")),
}


@pytest.mark.parametrize("architecture", CHECKPOINT_FILES)
def test_a_file_as_llama_cpp_writes_it_computes_its_checkpoint(architecture, tmp_path, monkeypatch):
    # transformers' GGUF reading knows none of the smollm3 (SmolLM3-3B's files), granite (Granite 3's), mistral3
    # (Ministral 3's, and Mistral Small 3.x's as llama.cpp now converts them), qwen3vl and qwen3vlmoe (Qwen3-VL's),
    # qwen2vl (Qwen2-VL's, Qwen2.5-VL's),
    # ernie4_5, gemma and olmo2 architectures: read as the one llama.cpp writes them as (its keys, its q/k
    # permutation undone) into the class of the model they were written from (a vision-language model's text model),
    # with what its config lacks from the file's other keys (a Llama 3.1 file's: its rotary from rope_freqs). The F32
    # file computes its checkpoint; the Q8_0 file in its blocks (its layers fused and in one native call a step where
    # the family's are) what the checkpoint with those weights de-quantized does, in a left-padded batch and two
    # steps; its own model code the same bits as the stack (tests/test_gguf_model.py).
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    import tiny_models
    from helpers import padded_prompt_and_steps

    monkeypatch.setenv(KV_FLOAT32_ENV, "1")  # (the checkpoint's float32 cache: what this compares is the weights)
    spec = CHECKPOINT_FILES[architecture]
    make_checkpoint, write = (getattr(tiny_models, name) for name in spec["files"])
    checkpoint = make_checkpoint(str(tmp_path))
    # (a vision-language checkpoint: its text positions counted from the mask unless given: given here)
    vision = architecture.startswith("qwen3vl") or spec.get("vision", False)
    loader = AutoModelForImageTextToText if vision else AutoModelForCausalLM
    reference = loader.from_pretrained(checkpoint, dtype=torch.float32).eval()
    ids = torch.arange(3, 43)[None] * 7  # (40 positions: past Ministral 3's original context twice)
    f32, q8_0 = write(checkpoint, str(tmp_path / "f32.gguf")), write(checkpoint, str(tmp_path / "q8_0.gguf"), "Q8_0")
    with torch.no_grad():
        theirs = reference(ids).logits
        torch.testing.assert_close(load(f32, device=torch.device("cpu")).model(ids).logits, theirs, rtol=1e-5,
                                   atol=spec.get("f32_atol", 1e-5))
        if spec.get("as_converted"):  # (the weights the converter multiplied its multipliers into, then rounded)
            reference = as_converted(reference)
        round_as_q8_0_file(reference, split_latent=not spec.get("unsplit"))  # the file's weights (gates' F32)
    theirs = padded_prompt_and_steps(reference, positions=vision)
    assert theirs[0].abs().max() > 1
    model = build_model(GGUFHeader(q8_0), torch.float32)
    assert type(model).__name__ == spec["model"]
    for field, wanted in spec.get("layers", {}).items():
        assert [getattr(layer, field) for layer in model.model.layers] == wanted, field
    if native_kernels():  # transformers' layers with their steps native (rungen/gguf/native_steps.py), or some of
        # their steps in fewer calls (`steps`: rungen/gguf/delta_steps.py, in the layers that have that part; a
        # tuple: the forms of a part that differs by the layer's kind, Nemotron-H's mixer)
        for part, name in spec.get("native", {}).items():
            assert {type(getattr(layer, part)).__name__ for layer in model.model.layers} == {name}, part
        for part, name in spec.get("steps", {}).items():
            assert {type(getattr(layer, part)).__name__ for layer in model.model.layers
                    if getattr(layer, part, None) is not None} == (set(name) if isinstance(name, tuple) else {name}), \
                part
    stacked = native_kernels() and spec.get("stack") is not None
    if stacked:
        assert all(isinstance(layer, FusedDecoderLayer) for layer in model.model.layers)
        assert isinstance(model.model.__dict__.get("forward"), DecoderStack)
        for field, wanted in spec["stack"].items():
            assert getattr(model.model.forward.stack, field) == wanted, field
    with torch.no_grad():  # the long prompt too (past Ministral 3's original context and OLMo 3's window)
        torch.testing.assert_close(exact_weights(model, lambda: model(ids).logits, monkeypatch), reference(ids).logits,
                                   rtol=1e-4, atol=1e-4)
    ours = exact_weights(model, lambda: padded_prompt_and_steps(model, positions=vision), monkeypatch)
    ours[0][0, :2], theirs[0][0, :2] = 0, 0  # (the padding's own positions: no key to see)
    for got, wanted in zip(ours, theirs):
        torch.testing.assert_close(got, wanted, rtol=1e-4, atol=1e-4)
    if stacked:  # the stack's one call a step gives what the fused layers one by one do, each over the float16
        # cache the engine gives it by default (the stack rounding as torch's conversion does)
        monkeypatch.delenv(KV_FLOAT32_ENV)
        cache = new_cache(model)
        stacked = padded_prompt_and_steps(model, cache, positions=vision)
        assert {layer.keys.dtype for layer in cache.layers} == {torch.float16}
        with products_one_by_one(model):
            layered = padded_prompt_and_steps(model, positions=vision)
        for got, wanted in zip(stacked, layered):
            torch.testing.assert_close(got, wanted, rtol=1e-5, atol=1e-5)
    if spec.get("quantized"):  # --quantize int8 as it loads: the layers quantizing the loaded float model gives (a
        # permutation of out_proj's columns taken once)
        quantized_as_it_loads(GGUFHeader(q8_0), "int8", monkeypatch)
    if native_kernels() and spec.get("native"):  # the engine's float16 cache: the same model's logits over
        # transformers' cache rounding what it stores
        monkeypatch.delenv(KV_FLOAT32_ENV)
        assert_float16_cache_as_rounded(model)


def test_a_qwen35_mixture_in_one_native_call_computes_its_blocks_modules(tmp_path):
    # Qwen3.5-MoE's block (its router's softmax, top 8 normalized, the experts, the shared expert behind its sigmoid
    # gate) as one `mixture` call: what its modules give over the same blocks for each layer's inputs in a prompt,
    # within float32 rounding. (Layer by layer: through the whole model a rounding apart can choose another expert
    # where two are near a tie, and the positions after it part.)
    import tiny_models
    from rungen.gguf.experts import MixtureInOneCall

    if not native_kernels():
        pytest.skip("the one call is the native kernels'")
    path = tiny_models.write_qwen35_gguf(tiny_models.qwen35moe_checkpoint(str(tmp_path)), str(tmp_path / "m.gguf"),
                                         "Q8_0")
    model = build_model(GGUFHeader(path), torch.float32)
    assert all(isinstance(layer.mlp, MixtureInOneCall) for layer in model.model.layers)
    inputs = []
    hooks = [layer.mlp.register_forward_pre_hook(lambda module, args: inputs.append(args[0]))
             for layer in model.model.layers]
    with torch.no_grad():
        model(torch.arange(3, 43)[None] * 7)
        for hook in hooks:
            hook.remove()
        assert len(inputs) == len(model.model.layers)
        for layer, x in zip(model.model.layers, inputs):
            (one_call, _), modules = layer.mlp(x), layer.mlp.block(x)  # (the one call's: beside no router logits)
            assert modules.abs().max() > 0.1
            torch.testing.assert_close(one_call, modules, rtol=1e-5, atol=1e-5)


# The files whose decode steps LayerLoop takes: (checkpoint, writer, the types it writes the blocks in).
LOOPED_FILES = {**{name: (*CHECKPOINT_FILES[name]["files"], ("Q8_0",))
                   for name in ("qwen35", "qwen35moe", "lfm2", "exaone4", "exaone4_global", "olmo2", "olmo3",
                                "ministral3", "glm4moe", "lfm2moe", "granitehybrid", "granitehybrid_dense",
                                "granitemoe", "nemotron_h", "nemotron_h_moe", "qwen3next", "falcon_h1",
                                "falcon_h1_norm", "afmoe", "olmoe")},
                "gpt-oss": ("gpt_oss_checkpoint", "write_gpt_oss_gguf", ("MXFP4", "Q8_0"))}


@pytest.mark.parametrize("architecture", LOOPED_FILES)
def test_a_models_decode_steps_in_one_loop_are_its_layers_one_by_one(architecture, tmp_path):
    # The decode steps of a model on transformers' layers with native steps (Qwen3.5's, LFM2's and LFM2-MoE's, EXAONE
    # 4's, OLMo 2's and 3's, Ministral 3's, gpt-oss's, GLM-4.5's, Granite 4.0 H's: its multipliers, no rotary, its
    # shared MLP beside the mixture or alone; Nemotron-H's one mixer a layer by its kind) as one loop over their
    # layers' parts (LayerLoop, installed as the inner model's forward): the bits transformers' own forward over the
    # same parts gives, in a left-padded batch (its masks) and for a row alone (none), the loop taking the steps and
    # transformers' forward the prompts.
    import tiny_models
    from helpers import padded_prompt_and_steps
    from rungen.gguf.layer_loop import LayerLoop

    if not native_kernels():
        pytest.skip("the loop's parts are the native steps")
    make_checkpoint, write, blocks = LOOPED_FILES[architecture]
    checkpoint = getattr(tiny_models, make_checkpoint)(str(tmp_path))
    model = build_model(GGUFHeader(getattr(tiny_models, write)(checkpoint, str(tmp_path / "file.gguf"), *blocks)),
                        torch.float32)
    loop = model.model.__dict__.get("forward")
    assert isinstance(loop, LayerLoop)
    prompts = []  # (the token counts transformers' forward was given)
    original = loop.original
    loop.original = lambda **kwargs: prompts.append(kwargs["input_ids"].shape[1]) or original(**kwargs)

    def alone():
        cache, ids = new_cache(model), torch.tensor([[5, 9, 13, 2, 7]])
        with torch.no_grad():
            out = [model(ids, past_key_values=cache).logits]
            for step in (11, 17):
                out.append(model(torch.tensor([[step]]), past_key_values=cache).logits)
        return out

    looped = padded_prompt_and_steps(model) + alone()
    assert prompts == [6, 5]
    del model.model.forward  # transformers' forward over the same parts
    layered = padded_prompt_and_steps(model) + alone()
    assert looped[1].abs().max() > 0.1
    for got, wanted in zip(looped, layered):
        assert torch.equal(got, wanted)


def test_a_llama3_rotary_of_other_parameters_is_read_back_from_its_factors(tmp_path):
    # Every published llama3 rotary has low and high frequency factors 1 and 4 over 8192 positions; another's (its
    # ramp over four of the sixteen frequencies here) is fitted to the factors' ramp: the function, within float32
    # rounding, as the factors depend only on low / original and high / original.
    from transformers import AutoModelForCausalLM

    from tiny_models import llama3_checkpoint, write_llama3_gguf

    checkpoint = llama3_checkpoint(str(tmp_path), dict(factor=16.0, low_freq_factor=1.0, high_freq_factor=32.0,
                                                       original_max_position_embeddings=16384))
    ids = torch.arange(3, 43)[None] * 7
    model = load(write_llama3_gguf(checkpoint, str(tmp_path / "f32.gguf")), device=torch.device("cpu")).model
    rope = model.config.rope_parameters
    assert (rope["rope_type"], rope["factor"], rope["original_max_position_embeddings"]) == ("llama3", 16.0, 8192)
    assert rope["low_freq_factor"] == pytest.approx(0.5) and rope["high_freq_factor"] == pytest.approx(16.0)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, AutoModelForCausalLM.from_pretrained(checkpoint)(ids).logits,
                                   rtol=1e-4, atol=1e-4)


def test_a_rope_freqs_tensor_no_llama3_rotary_gives_is_refused_in_one_line(tmp_path, capsys):
    # llama.cpp writes a llama3 rotary as its frequency factors alone; factors no llama3 rotary gives (here the
    # published ones with the ramp's last factor changed) would compute another model, as would dropping them.
    import numpy as np

    from tiny_models import llama3_checkpoint, write_as_llama

    def keys(writer):
        factors = [1.0] * 8 + [1.9, 8.0, 8.0, 8.0, 8.0, 8.0, 8.0, 8.0]  # (the one ramp value of the fixture's: 3.58)
        writer.add_tensor("rope_freqs.weight", np.array(factors, dtype=np.float32))

    odd = write_as_llama(llama3_checkpoint(str(tmp_path)), str(tmp_path / "odd.gguf"), "llama", "Q8_0", "llama-bpe",
                         more_keys=keys)
    code, line = error_of(["--model_name_or_path", odd, "--prompt", "Hi", "--length", "2"], capsys)
    assert code == 2 and line.endswith("odd.gguf: its rope_freqs tensor holds frequency factors no llama3 rotary "
                                       "gives (the only kind this tool reads from it)"), line


def test_a_mistral3_file_with_a_rotary_or_temperature_it_cannot_compute_is_refused_in_one_line(tmp_path, capsys):
    # Ministral 3's files scale their rotary by yarn; another scaling, or a query temperature without yarn's original
    # context to count positions by, would compute another model: one line naming the key, exit 2.
    from tiny_models import gguf_rope_type, mistral_small_checkpoint, write_as_llama

    checkpoint = mistral_small_checkpoint(str(tmp_path))
    linear = write_as_llama(checkpoint, str(tmp_path / "linear.gguf"), "mistral3", "Q8_0", "tekken",
                            more_keys=lambda writer: (writer.add_rope_scaling_type(gguf_rope_type("linear")),
                                                      writer.add_rope_scaling_factor(8.0)))
    warm = write_as_llama(checkpoint, str(tmp_path / "warm.gguf"), "mistral3", "Q8_0", "tekken",
                          more_keys=lambda writer: writer.add_attn_temperature_scale(0.1))
    code, line = error_of(["--model_name_or_path", linear, "--prompt", "Hi", "--length", "2"], capsys)
    assert code == 2 and line.endswith("linear.gguf: a mistral3 file whose rotary embedding is scaled by 'linear', "
                                       "which this tool does not read (Ministral 3's is yarn)"), line
    code, line = error_of(["--model_name_or_path", warm, "--prompt", "Hi", "--length", "2"], capsys)
    assert code == 2 and line.endswith("warm.gguf: a mistral3 file with a query temperature "
                                       "(attention.temperature_scale) and no yarn rotary, whose original context the "
                                       "temperature counts positions by"), line


def test_mxfp4_blocks_are_held_as_iq4_nl_blocks_of_their_table_and_the_same_weights():
    # gpt-oss's experts: each 32 weights a power-of-two scale byte e, 2^(e - 128), and e2m1 codes, held as IQ4_NL's
    # blocks (a float16 scale, the codes as they are) that index MXFP4's table. A zero block, and scales below
    # float16's range (weights under 4e-7: float16's nearest); one past it is refused. The native conversion gives
    # numpy's bytes, and the held blocks de-quantize (natively and in numpy) to the file's weights.
    from rungen.gguf.blocks import GGMLError, dequantize, mxfp4_held, mxfp4_held_reference

    rng = np.random.default_rng(0)
    weights = rng.normal(0, 0.05, (16, 256)).astype(np.float32)
    weights[0, :32], weights[1, :32] = 0, weights[1, :32] * 1e-9
    blocks = quants.quantize(weights, Q.MXFP4)
    blocks[2:4].reshape(-1, 17)[:, 0] = rng.integers(90, 144, 16)  # scales from 2^-38 to 2^15
    exact = quants.dequantize(blocks, Q.MXFP4)
    for convert in (mxfp4_held, mxfp4_held_reference):
        held = convert(blocks)
        assert held.shape == (16, 256 // 32 * 18) and np.array_equal(held, mxfp4_held_reference(blocks))
        got = [dequantize(torch.from_numpy(held), Q.MXFP4, 256).numpy()]
        if native_kernels():
            got.append(torch.ops.rungen_ggml.dequantize(torch.from_numpy(held), int(Q.MXFP4), 256).numpy())
        for values in got:
            assert np.array_equal(values[4:], exact[4:]) and np.array_equal(values[:2, 32:], exact[:2, 32:])
            assert not values[0, :32].any() and np.abs(values[1:4] - exact[1:4]).max() < 4e-7
    blocks[5, 0] = 200  # a scale of 2^72
    for convert in (mxfp4_held, mxfp4_held_reference):
        with pytest.raises(GGMLError, match="scale 2\\^72 is beyond float16's range"):
            convert(blocks)


def test_a_gpt_oss_file_as_llama_cpp_writes_it_computes_its_checkpoint(tmp_path, monkeypatch, capsys):
    # transformers' reading of a gpt-oss file fails on its rotary keys and would leave the head size and window at
    # GptOssConfig's defaults; its loader reads none of the experts' tensors as llama.cpp writes them (gate and up
    # apart, MXFP4). The file computes its checkpoint with the experts' weights as MXFP4 holds them: in its blocks
    # on the CPU (the native attention with its sinks, over a cache read in place), in a left-padded batch and two
    # steps (sliding layers, sinks, biases, the router's top 2 and their softmax, the clamped SwiGLU), and
    # de-quantized where a device takes it.
    from transformers import AutoModelForCausalLM

    from helpers import padded_prompt_and_steps
    from tiny_models import gpt_oss_checkpoint, write_gpt_oss_gguf

    monkeypatch.setenv(KV_FLOAT32_ENV, "1")  # (the checkpoint's float32 cache: what this compares is the weights)

    checkpoint = gpt_oss_checkpoint(str(tmp_path))
    reference = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    path = write_gpt_oss_gguf(checkpoint, str(tmp_path / "gpt-oss.gguf"))
    with torch.no_grad():
        for layer in reference.model.layers:  # the experts' weights the file holds: rows of MXFP4 blocks
            for weight in (layer.mlp.experts.gate_up_proj, layer.mlp.experts.down_proj):
                rows = np.ascontiguousarray(weight.transpose(-1, -2).numpy())
                held = quants.dequantize(quants.quantize(rows, Q.MXFP4), Q.MXFP4)
                weight.copy_(torch.from_numpy(held).transpose(-1, -2))
    theirs = padded_prompt_and_steps(reference)
    model = load(path, device=torch.device("cpu")).model
    experts = model.model.layers[0].mlp.block.experts
    assert isinstance(experts, GGMLExperts) and experts.down[0].qtype == Q.MXFP4
    if native_kernels():  # its attention the native one (sinks and all), over a cache read in place
        assert model.config._attn_implementation == NATIVE_ATTENTION and model.cache_grows_in_place
    ours = exact_weights(model, lambda: padded_prompt_and_steps(model), monkeypatch)
    assert theirs[0].abs().max() > 1
    for got, wanted in zip(ours, theirs):
        torch.testing.assert_close(got, wanted, rtol=1e-4, atol=1e-4)
    if native_kernels():  # each layer's mixture one native call, as its modules compute it within float32 rounding
        calls = []
        original = torch.ops.rungen_ggml.mixture
        monkeypatch.setattr(torch.ops.rungen_ggml, "mixture", lambda *a: calls.append(1) or original(*a))
        native = padded_prompt_and_steps(model)
        assert len(calls) == 3 * len(model.model.layers)
        with monkeypatch.context() as patch:
            patch.setattr(GGMLLinear, "_matmul", lambda self, x: BLOCKS_MATMUL(self, x))
            modules = padded_prompt_and_steps(model)
        assert len(calls) == 3 * len(model.model.layers)
        for got, wanted in zip(native, modules):
            torch.testing.assert_close(got, wanted, rtol=1e-4, atol=1e-4)
        with monkeypatch.context() as default:  # the engine's cache as it is by default (sinks and windows)
            default.delenv(KV_FLOAT32_ENV)
            assert_float16_cache_as_rounded(model)
    # Its published form (MXFP4_MOE: the other matrices Q8_0, the router F32): the attention's q, k and v with their
    # biases one product, their rotation one native call (NativeGptOssAttention)
    published = write_gpt_oss_gguf(checkpoint, str(tmp_path / "mxfp4_moe.gguf"), others="Q8_0")
    with torch.no_grad():
        for name, parameter in reference.named_parameters():  # the weights the file holds in Q8_0
            if name.endswith("proj.weight") and ".experts." not in name or name.endswith("embed_tokens.weight") \
                    or name == "lm_head.weight":
                blocks = quants.quantize(parameter.numpy(), Q.Q8_0)
                parameter.copy_(torch.from_numpy(quants.dequantize(blocks, Q.Q8_0)))
    theirs_q8 = padded_prompt_and_steps(reference)
    q8 = load(published, device=torch.device("cpu")).model
    if native_kernels():
        assert all(isinstance(layer.self_attn, NativeGptOssAttention) for layer in q8.model.layers)
    for got, wanted in zip(exact_weights(q8, lambda m=q8: padded_prompt_and_steps(m), monkeypatch), theirs_q8):
        torch.testing.assert_close(got, wanted, rtol=1e-4, atol=1e-4)
    del q8
    # as a device takes it (its build on the CPU here): transformers' own experts, de-quantized
    device = build_model(GGUFHeader(path), torch.float32, torch.device("cpu"))
    assert type(device.model.layers[0].mlp.experts).__name__ == "GptOssExperts"
    for got, wanted in zip(padded_prompt_and_steps(device), theirs):
        torch.testing.assert_close(got, wanted, rtol=1e-4, atol=1e-4)
    # and where the GPU's 4-bit Triton kernel serves (stood in by plain products): MXFP4's e2m1 codes two a byte and
    # its scales, exact, in CodedExperts with the biases and the clamped SwiGLU, a prompt's pairs through the tiled
    # launch, a step's through the grouped GEMV launch; where it does not (RUN_GENERATION_GPU_INT4=0, or a failed
    # check), the int8 kernel's codes, the same.
    del device
    import rungen.gguf.device
    from rungen.gguf.device import INT8_TYPES
    from rungen.gguf.device_experts import CodedExperts
    from rungen.int4_kernel import widened4
    from rungen.slots import takes_slots

    monkeypatch.setattr(rungen.gguf.device, "gpu_int8", lambda qtype, device: qtype in INT8_TYPES)
    monkeypatch.setattr(rungen.gguf.device, "checked_kernel", lambda layer, dtype, instead: plain_grouped_kernel())
    monkeypatch.setattr(rungen.gguf.device, "checked_int4_kernel",
                        lambda layer, dtype: (plain_grouped_kernel(widened4), None))
    monkeypatch.setattr(CodedExperts, "most_pairs", 8)  # a prompt's 24 pairs tiled, a step's 4 on the GEMV
    paths = []
    for path_name in ("_paired", "_tiled"):
        original = getattr(CodedExperts, path_name)
        monkeypatch.setattr(CodedExperts, path_name, lambda self, *a, f=original, n=path_name: paths.append(n)
                            or f(self, *a))
    for form, codes in (("4-bit", torch.uint8), ("0", torch.int8)):
        monkeypatch.setattr(rungen.gguf.device, "gpu_int4", lambda qtype, in_features, dtype, device, f=form: (
            "triton" if f == "4-bit" and qtype == Q.MXFP4 else None))
        coded = build_model(GGUFHeader(path), torch.float32, torch.device("cpu"))
        experts = coded.model.layers[0].mlp.experts
        assert isinstance(experts, CodedExperts) and experts.down[0].codes.dtype == codes, form
        assert takes_slots(coded), form  # (its decode steps in fixed slots: CUDA graphs on a GPU)
        assert experts.down[0].scales.dtype == torch.float16 and experts.down[0].offsets is None  # (powers of two)
        for got, wanted in zip(padded_prompt_and_steps(coded), theirs):
            torch.testing.assert_close(got, wanted, rtol=1e-4, atol=1e-4)
        layers = len(coded.model.layers)
        assert paths.count("_tiled") == layers and paths.count("_paired") == 2 * layers, form
        paths.clear()
        del coded
    code, line = error_of(["--model_name_or_path", path, "--prompt", "Hi", "--length", "2", "--dequantize"], capsys)
    assert code == 2 and line.endswith("gpt-oss.gguf: transformers reads no gpt-oss file as llama.cpp writes it "
                                       "(its experts' tensors); it runs here in its own blocks, without --dequantize "
                                       "or --device_map"), line
    # An expert's block scaled past what the kernels hold (2^72): one line naming the file and the tensor.
    broken = str(tmp_path / "broken.gguf")
    data = bytearray(open(path, "rb").read())
    [tensor] = [t for t in GGUFReader(path).tensors if t.name == "blk.1.ffn_down_exps.weight"]
    data[tensor.data_offset] = 200
    open(broken, "wb").write(bytes(data))
    code, line = error_of(["--model_name_or_path", broken, "--prompt", "Hi", "--length", "2"], capsys)
    assert code == 2 and line.endswith("broken.gguf: tensor blk.1.ffn_down_exps.weight[0]: an MXFP4 block's scale "
                                       "2^72 is beyond float16's range"), line


MIXTURES = [("qwen3moe", (Q.Q4_0, Q.Q4_0, Q.Q6_K)), ("qwen3moe", (Q.Q8_0, Q.Q4_1, Q.Q2_K)), ("qwen2moe", (None,) * 3),
            ("llama", (Q.Q4_0, Q.Q4_0, Q.Q6_K))]


@pytest.mark.parametrize("arch, expert_types", MIXTURES,
                         ids=["qwen3moe", "qwen3moe-mixed-q2_k", "qwen2moe", "mixtral"])
def test_a_mixture_decodes_in_one_native_call_a_step_as_transformers_modules(
        tmp_path, monkeypatch, arch, expert_types):
    # Each layer's mixture block (router, experts, Qwen2-MoE's shared expert) is one native call, which the
    # one-call stack takes: a left-padded prompt and two steps give the bits of the fused layers one by one, and
    # transformers' blocks' logits over ExpertRouter and GGMLExperts, each expert's products alone (gate and up of
    # two types as two parts, Q2_K's rows as the file has them), within float32 rounding.
    if not native_kernels():
        pytest.skip("the native kernels are not available here")
    from helpers import padded_prompt_and_steps, write_moe_gguf

    shared = dict(shared_ffn=512) if arch == "qwen2moe" else {}
    path = write_moe_gguf(tmp_path / f"{arch}.gguf", arch=arch, experts=8, used=3, expert_types=expert_types,
                          expert_ffn=256, hidden=256 if expert_types[0] == Q.Q2_K else 64, **shared)
    [(_, model, _)] = blocks_and_reference({"moe": path}).values()
    stack = model.model.forward
    assert isinstance(stack, DecoderStack) and all(layer.mixture is not None for layer in model.model.layers)
    calls = {"decoder_stack": 0, "mixture": 0}
    for name, original in [(name, getattr(torch.ops.rungen_ggml, name)) for name in calls]:
        monkeypatch.setattr(torch.ops.rungen_ggml, name,
                            lambda *a, name=name, original=original: calls.update({name: calls[name] + 1})
                            or original(*a))
    stacked = padded_prompt_and_steps(model)
    assert calls == {"decoder_stack": 3, "mixture": 0}  # the prompt and two steps, each in one call
    monkeypatch.setattr(model.model, "forward", stack.original)
    layers = padded_prompt_and_steps(model)
    assert calls == {"decoder_stack": 3, "mixture": 3 * len(model.model.layers)}
    with monkeypatch.context() as patch, products_one_by_one(model):
        patch.setattr(GGMLLinear, "_matmul", lambda self, x: BLOCKS_MATMUL(self, x))
        modules = padded_prompt_and_steps(model)
    assert calls["mixture"] == 3 * len(model.model.layers) and stacked[0].abs().max() > 1
    for ours, one_by_one, theirs in zip(stacked, layers, modules):
        assert torch.equal(ours, one_by_one)
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


def test_an_moe_files_odd_experts_load_on_a_device_or_fail_in_one_line(tmp_path, capsys):
    # Float experts beside blocks (a partial conversion): on a device cast there an expert at a time as the others
    # are de-quantized; on the CPU refused in one line naming the float tensor. A missing expert tensor, or more
    # experts a token than the file has: one line naming it.
    from helpers import write_moe_gguf

    path = write_moe_gguf(tmp_path / "f16-gate.gguf", expert_types=(Q.F16, Q.Q8_0, Q.Q8_0))
    ours = build_model(GGUFHeader(path), torch.float32, torch.device("cpu")).state_dict()  # the form a GPU gets
    theirs = load(path, device=torch.device("cpu"), dequantize=True).model.state_dict()
    assert [name for name in theirs if "experts" in name] and all(
        torch.equal(ours[name], theirs[name]) for name in theirs if "experts" in name)
    code, message = error_of(["--model_name_or_path", path, "--prompt", "Hi", "--length", "2"], capsys)
    assert code == 2 and "blk.0's experts are partly in float tensors (blk.0.ffn_gate_exps.weight)" in message
    assert "--dequantize runs the file" in message

    base = write_moe_gguf(tmp_path / "q8_0.gguf")

    def rewritten(name, skip=None, used=None):
        reader, target = GGUFReader(base), str(tmp_path / name)
        writer = GGUFWriter(target, "qwen3moe")
        for key, field in reader.fields.items():
            if key.startswith("GGUF.") or key == "general.architecture":
                continue
            value = field.contents()
            if key == "qwen3moe.expert_used_count" and used is not None:
                value = used
            writer.add_key_value(key, value, field.types[0], field.types[-1] if len(field.types) > 1 else None)
        for tensor in reader.tensors:
            if tensor.name != skip:
                writer.add_tensor(tensor.name, tensor.data, raw_dtype=tensor.tensor_type)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        return target

    code, message = error_of(["--model_name_or_path", rewritten("no-down.gguf", skip="blk.1.ffn_down_exps.weight"),
                              "--prompt", "Hi", "--length", "2"], capsys)
    assert code == 2 and message.endswith("no-down.gguf: the file has no tensor blk.1.ffn_down_exps.weight")
    code, message = error_of(["--model_name_or_path", rewritten("used.gguf", used=16), "--prompt", "Hi", "--length",
                              "2"], capsys)
    assert code == 2 and message.endswith("used.gguf: 16 experts a token (expert_used_count) of 4 (expert_count)")


def test_a_mixtures_greedy_text_is_the_same_alone_and_in_a_batch_over_a_cache_growing_in_place(tmp_path, monkeypatch):
    # The engine's batch over a mixture: its cache's layers grow into buffers with room (not copied every step), each
    # prompt's tokens routed as alone.
    from helpers import write_moe_gguf
    from rungen.kvcache import growing, new_cache

    path = write_moe_gguf(tmp_path / "qwen3moe.gguf", experts=8, used=3)
    prompts = "Hello, my dog\nThe capital of France is\nA\n"
    texts = {}
    for batch in ("1", "3"):
        monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(prompts.encode())))
        texts[batch] = run_generation.main(["--model_name_or_path", path, "--temperature", "0", "--length", "12",
                                            "--batch_size", batch, "--output_format", "jsonl"])
    assert texts["1"] == texts["3"] and len(texts["1"]) == 3
    [(header, model, _)] = blocks_and_reference({"moe": path}).values()
    assert model.cache_grows_in_place and all(growing(layer) for layer in new_cache(model).layers)


def test_jit_leaves_a_mixture_of_experts_untraced_with_one_warning(tmp_path, caplog):
    # A trace would record one step's routing (which experts, how many tokens each) for every later step.
    from helpers import write_moe_gguf

    path = write_moe_gguf(tmp_path / "qwen3moe.gguf")
    args = ["--model_name_or_path", path, "--prompt", "Hello", "--temperature", "0", "--length", "6"]
    eager = run_generation.main(args)
    with caplog.at_level(logging.WARNING, logger="run_generation"):
        assert run_generation.main(args + ["--jit"]) == eager
    assert "--jit: not traced: its mixture of experts picks each token's experts by their values" in caplog.text


@pytest.mark.fresh_load  # the file must really load, not a loaded model be reused
def test_quantize_on_a_gguf_file_quantizes_it_as_it_loads(gguf_files, monkeypatch, caplog):
    import rungen.quantize

    made = []
    monkeypatch.setattr(rungen.quantize.QuantizingLoad, "finish", lambda self, what, finish=rungen.quantize
                        .QuantizingLoad.finish: made.append(finish(self, what)) or made[-1])
    args = ["--model_name_or_path", gguf_files["q4_k_m_tied"], "--prompt", "Hello", "--temperature", "0",
            "--length", "4", "--quantize", "int8"]
    with caplog.at_level(logging.INFO, logger="run_generation"):
        [sequence] = run_generation.main(args)
    assert len(made) == 1 and sequence.startswith("Hello")
    assert f"Quantized {made[0].quantized_layers} linear layers to int8" in caplog.text


@pytest.mark.parametrize("name", FILES)
def test_the_gpus_codes_and_blocks_compute_the_dequantized_model(loaded, name, monkeypatch):
    # What a GPU keeps in codes (the CPU standing in, the int8 kernel stood in by the product it is checked against):
    # every Q8_0, Q6_K and Q5 matrix as int8 codes with its scales (and the Q5 types' offsets; biases kept), an
    # untied embedding in its blocks, a tied Q8_0 or Q6_K table as the head's codes that the lookup reads too; the
    # model computes --dequantize's logits.
    import rungen.gguf.device
    from rungen.gguf.device import DEVICE_ROW_TYPES, INT8_TYPES, DeviceRowsEmbedding
    from rungen.int8 import CodesEmbedding, CudaInt8Linear, widened

    header, _, reference = loaded[name]
    monkeypatch.setattr(rungen.gguf.device, "gpu_int8", lambda qtype, device: qtype in INT8_TYPES)
    monkeypatch.setattr(rungen.gguf.device, "gpu_embedding", lambda qtype, device: qtype in DEVICE_ROW_TYPES)
    monkeypatch.setattr(rungen.gguf.device, "checked_kernel", lambda layer, dtype, instead: widened)
    model = build_model(header, torch.float32, torch.device("cpu"))
    types = {entry[0]: Q(entry[1]) for entry in header.tensors}
    in_codes = sum(1 for tensor, qtype in types.items() if qtype in INT8_TYPES and tensor != "token_embd.weight")
    embedding, tied = types["token_embd.weight"], "output.weight" not in types
    in_codes += tied and embedding in INT8_TYPES
    assert len([m for m in model.modules() if isinstance(m, CudaInt8Linear)]) == in_codes > 0
    kind = (CodesEmbedding if embedding in INT8_TYPES else torch.nn.Embedding) if tied else DeviceRowsEmbedding
    assert type(model.get_input_embeddings()) is kind
    batch = header.tokenizer(PROMPTS[:2], return_tensors="pt", padding=True)
    real = batch["attention_mask"].bool()
    with torch.no_grad():
        theirs, ours = reference(**batch).logits, model(**batch).logits
    assert (ours - theirs)[real].abs().max() <= 1e-5 * theirs[real].abs().max()


def test_the_gpus_packed_codes_compute_the_dequantized_model(loaded, monkeypatch):
    # MXFP4, IQ4_NL and IQ4_XS matrices, and those of 5 and 6 bits and of groups of 16, as a GPU keeps them where the
    # 4-bit Triton kernel serves (the CPU standing in, the kernels stood in by the products they are checked
    # against): their codes two a byte (e2m1's bits, IQ4's indices of a table every layer shares; the Q5 types' and
    # Q6_K's top bits in a plane beside them, Q5_0's, Q6_K's and Q3_K's signed) with each group's scale (and
    # offset); the model computes --dequantize's logits.
    import rungen.gguf.device
    from rungen.gguf.device import INT8_TYPES, TRITON_TYPES
    from rungen.int4_kernel import CudaInt4Linear, widened4
    from rungen.int8 import widened

    header, _, reference = loaded["mixed_tied"]
    monkeypatch.setattr(rungen.gguf.device, "gpu_int4", lambda qtype, in_features, dtype, device: (
        "triton" if qtype in TRITON_TYPES else None))
    monkeypatch.setattr(rungen.gguf.device, "checked_int4_kernel", lambda layer, dtype: (widened4, None))
    monkeypatch.setattr(rungen.gguf.device, "gpu_int8", lambda qtype, device: qtype in INT8_TYPES)
    monkeypatch.setattr(rungen.gguf.device, "checked_kernel", lambda layer, dtype, instead: widened)
    model = build_model(header, torch.float32, torch.device("cpu"))
    types = [Q(entry[1]) for entry in header.tensors]
    four_bit = [m for m in model.modules() if isinstance(m, CudaInt4Linear)]
    formats = {Q.MXFP4: "e2m1", Q.IQ4_NL: "int4 levels", Q.IQ4_XS: "int4 levels", Q.Q5_0: "signed int5",
               Q.Q5_1: "int5", Q.Q5_K: "int5", Q.Q6_K: "signed int6", Q.Q3_K: "signed int3", Q.Q2_K: "int2"}
    assert set(formats) == set(TRITON_TYPES)
    assert sorted(m.format for m in four_bit) == sorted(formats[qtype] for qtype in types if qtype in TRITON_TYPES)
    assert len({m.offsets.data_ptr() for m in four_bit if m.format == "int4 levels"}) == 1  # one table
    batch = header.tokenizer(PROMPTS[:2], return_tensors="pt", padding=True)
    real = batch["attention_mask"].bool()
    with torch.no_grad():
        theirs, ours = reference(**batch).logits, model(**batch).logits
    assert (ours - theirs)[real].abs().max() <= 1e-5 * theirs[real].abs().max()


@pytest.mark.parametrize("kernels", ["native", "gguf"])
def test_dequantize_to_reads_chunks_of_rows(monkeypatch, kernels):
    # The weights go to a device a few rows at a time (never the whole weight in float32 on the host): every chunk
    # boundary lands where the whole weight's de-quantization puts it, with either de-quantizer.
    from rungen.gguf import blocks as ggml

    if kernels == "native" and not native_kernels():
        pytest.skip("the native kernels are not built here")
    monkeypatch.setattr(ggml, "native_kernels", lambda: kernels == "native")
    monkeypatch.setattr(ggml, "DEQUANTIZE_CHUNK", 3 * 256)  # three rows of 256 at a time
    rng = np.random.default_rng(0)
    for qtype in (Q.Q4_0, Q.Q8_0, Q.Q4_K, Q.Q6_K, Q.IQ4_XS):
        block, size = GGML_QUANT_SIZES[qtype]
        blocks = rng.integers(0, 256, size=(10, 256 // block * size), dtype=np.uint8)
        for start in range(0, blocks.shape[1], size):  # finite float16 scales at every block's start
            blocks[:, start : start + 2] = np.frombuffer(np.float16(0.01).tobytes(), dtype=np.uint8)
        whole = ggml.dequantize(torch.from_numpy(blocks), qtype, 256)
        chunked = ggml.dequantize_to(blocks, qtype, 256, torch.float32, torch.device("cpu"))
        torch.testing.assert_close(chunked, whole, rtol=0, atol=0)
        assert ggml.dequantize_to(blocks, qtype, 256, torch.bfloat16, torch.device("cpu")).dtype == torch.bfloat16


def test_the_accelerator_form_takes_types_the_kernels_do_not_run(tokenizer_fields, tmp_path):
    # A GPU de-quantizes every weight, so a type the CPU's blocks refuse (IQ2_XXS here) loads there too, as
    # --dequantize's model would read it.
    from transformers import AutoModelForCausalLM

    path = write_llama_gguf(tmp_path / "iq2_xxs.gguf", tokenizer_fields, layers=[{"ffn_up": Q.IQ2_XXS}, {}],
                            default=Q.Q4_0, embedding=Q.Q8_0, output=None)
    with metadata_parsed_once():
        header = GGUFHeader(path, blocks=False)
        reference = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="iq2_xxs.gguf").eval()
    model = build_model(header, torch.float32, torch.device("cpu"))
    batch = header.tokenizer(PROMPTS[:1], return_tensors="pt")
    with torch.no_grad():
        torch.testing.assert_close(model(**batch).logits, reference(**batch).logits, rtol=1e-5, atol=1e-5)


def cpu_int4pack(pairs, inner_k_tiles, swapped=False):
    """torch's CUDA int4 packing stood in for by the CPU's: the codes two a byte as torchao packs them for it (the
    even column in the high nibble), unpacked for _convert_weight_to_int4pack_for_cpu."""
    high, low = (pairs >> 4).to(torch.int32), (pairs & 15).to(torch.int32)
    codes = torch.stack([low, high] if swapped else [high, low], dim=-1).reshape(pairs.shape[0], -1)
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, inner_k_tiles)


def test_4_bit_weights_keep_their_codes_on_a_gpu(loaded, monkeypatch, caplog):
    # On a CUDA GPU Q4_0/Q4_1/Q4_K weights take torch's int4 kernel (about the file's bytes, not 3.5x them), the
    # others are de-quantized. Here the CUDA kernel is stood in for by the CPU's (the packing's nibble order is the
    # GPU's own to check: tinygemm_agrees does once a load, and tests/test_cuda.py).
    from rungen.int4 import TinyGemmLinear

    monkeypatch.setattr(TinyGemmLinear, "runs_on", staticmethod(lambda in_features, dtype, device: True))
    monkeypatch.setattr(torch.ops.aten, "_convert_weight_to_int4pack", cpu_int4pack)
    monkeypatch.setattr(torch.ops.aten, "_weight_int4pack_mm", torch.ops.aten._weight_int4pack_mm_for_cpu)
    header, _, reference = loaded["mixed_tied"]
    batch = header.tokenizer(PROMPTS[:2], return_tensors="pt", padding=True)
    real = batch["attention_mask"].bool()
    with torch.no_grad():
        theirs = reference(**batch).logits
        model = build_model(header, torch.bfloat16, torch.device("cpu"))
        int4 = {m.out_features: m for m in model.modules() if isinstance(m, TinyGemmLinear)}
        assert len([m for m in model.modules() if isinstance(m, TinyGemmLinear)]) == 6  # MIXED's Q4_0/Q4_1/Q4_K
        assert all(m.packed.dtype != torch.float32 and m.scales_and_zeros.dtype == torch.bfloat16
                   for m in int4.values())
        ours = model(**batch).logits.float()
        assert (ours - theirs)[real].abs().max() <= 0.05 * theirs[real].abs().max()
        # A packing the kernel reads otherwise is caught before any weight is trusted: all run de-quantized.
        monkeypatch.setattr(torch.ops.aten, "_convert_weight_to_int4pack",
                            lambda pairs, tiles: cpu_int4pack(pairs, tiles, swapped=True))
        with caplog.at_level(logging.WARNING, logger="run_generation"):
            model = build_model(header, torch.bfloat16, torch.device("cpu"))
        assert not [m for m in model.modules() if isinstance(m, TinyGemmLinear)]
        assert "int4 GPU kernel disagrees" in caplog.text
        ours = model(**batch).logits.float()
        assert (ours - theirs)[real].abs().max() <= 0.05 * theirs[real].abs().max()
        # A torch build or GPU without the kernel raises at the first layer: all run de-quantized, said once.
        def missing(*args):
            raise RuntimeError("CUDA error: no kernel image is available for execution on the device")

        monkeypatch.setattr(torch.ops.aten, "_convert_weight_to_int4pack", missing)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="run_generation"):
            model = build_model(header, torch.bfloat16, torch.device("cpu"))
        assert not [m for m in model.modules() if isinstance(m, TinyGemmLinear)]
        assert caplog.text.count("int4 GPU kernel failed (CUDA error: no kernel image") == 1
        ours = model(**batch).logits.float()
        assert (ours - theirs)[real].abs().max() <= 0.05 * theirs[real].abs().max()


def test_the_header_read_parses_once_and_keeps_no_reader_for_the_tokenizer(gguf_files, tmp_path, monkeypatch):
    """A first run reads the header through transformers (config, then tokenizer) without reading weights: gguf's
    reader, an object per vocabulary entry (about 170 MB for a 49k vocabulary), is dropped after the one parse
    rather than kept alive while the tokenizer is built, which is the first run's peak memory."""
    import weakref

    import gguf
    import transformers

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    alive, at_tokenizer = weakref.WeakSet(), []
    reader_class, tokenizer_load = gguf.GGUFReader, transformers.AutoTokenizer.from_pretrained

    class Reader(reader_class):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            alive.add(self)

    def tokenizer_from_pretrained(*args, **kwargs):
        gc.collect()
        at_tokenizer.append(len(alive))
        return tokenizer_load(*args, **kwargs)

    monkeypatch.setattr(gguf, "GGUFReader", Reader)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", tokenizer_from_pretrained)
    header = GGUFHeader(str(gguf_files["q4_0_untied"]))
    assert header.read_seconds is not None  # read from the file, not a cache
    assert at_tokenizer and not any(at_tokenizer)  # none alive whenever a tokenizer is built


def test_dequantize_parses_the_file_once_and_loads_what_transformers_loads(gguf_files, monkeypatch):
    # --dequantize is transformers' GGUF loader: its config, tokenizer and weights would each parse the file
    # (seconds for a real vocabulary), and its name mapping rebuilds gguf's name table for every submodule. The
    # tool's load shares one parse and one table, and the model is the one transformers loads on its own.
    import gguf
    from transformers import AutoModelForCausalLM

    from rungen.loading import load

    path = gguf_files["q4_0_untied"]
    reference = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path)).eval()
    parses, tables = [], []
    reader_class, table = gguf.GGUFReader, gguf.get_tensor_name_map
    monkeypatch.setattr(gguf, "GGUFReader", lambda file, *args: parses.append(file) or reader_class(file, *args))
    monkeypatch.setattr(gguf, "get_tensor_name_map", lambda *args: tables.append(args) or table(*args))
    loaded = load(str(path), device=torch.device("cpu"), dequantize=True)
    assert len(parses) == 1 and len(tables) == 1
    batch = loaded.tokenizer(PROMPTS[:2], return_tensors="pt", padding=True)
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(**batch).logits, reference(**batch).logits, rtol=0, atol=0)


# GPT-2 files (llama.cpp's gpt2 architecture): transformers' Conv1D layers, whose [in, out] weights the file holds
# transposed (rows the output channels), their biases, a learned position table (F32). The converter wrote the tied
# embedding again as output.weight (gpt2_q8_0) until it left it out (gpt2_q4_0_tied: the head reads token_embd).
GPT2_FILES = {"gpt2_q8_0": dict(qtype="Q8_0"), "gpt2_q4_0_tied": dict(qtype="Q4_0", output=False, seed=1)}


@pytest.fixture(scope="module")
def gpt2_files(tmp_path_factory, tokenizer_fields):
    folder = tmp_path_factory.mktemp("gpt2")
    return {name: write_gpt2_gguf(folder / f"{name}.gguf", tokenizer_fields, **spec)
            for name, spec in GPT2_FILES.items()}


@pytest.fixture(scope="module")
def gpt2_loaded(gpt2_files):
    """{file: (header, the tool's model in its own blocks, transformers' de-quantized float32 model)}."""
    return blocks_and_reference(gpt2_files)


@pytest.mark.parametrize("name", GPT2_FILES)
def test_a_gpt2_file_runs_its_conv1d_layers_in_blocks_with_transformers_logits(gpt2_files, gpt2_loaded, name,
                                                                                monkeypatch):
    # The tool's default path (load_gguf: gpt2 has no own model code, so transformers' GPT2LMHeadModel over the
    # file's blocks on the CPU): every Conv1D a GGMLLinear over the file's rows with its bias, the logits and greedy
    # tokens those of transformers' own GGUF loader (--dequantize) on the exactly de-quantized weights.
    from rungen.loading import load_gguf

    header, _, reference = gpt2_loaded[name]
    model = load_gguf(gpt2_files[name]).model
    assert type(model).__name__ == "GPT2LMHeadModel"
    qtype = Q[GPT2_FILES[name]["qtype"]]
    block = model.transformer.h[0]
    for layer, (out_features, in_features) in ((block.attn.c_attn, (192, 64)), (block.attn.c_proj, (64, 64)),
                                               (block.mlp.c_fc, (256, 64)), (block.mlp.c_proj, (64, 256))):
        assert isinstance(layer, GGMLLinear) and layer.qtype == qtype
        assert (layer.out_features, layer.in_features) == (out_features, in_features)
        assert layer.bias is not None and layer.bias.shape == (out_features,)
    assert isinstance(model.get_input_embeddings(), GGMLEmbedding)
    head = model.get_output_embeddings()
    assert isinstance(head, GGMLLinear) and head.qtype == qtype  # in blocks, never a float32 copy of the vocabulary
    if not GPT2_FILES[name].get("output", True):  # the head multiplies the embedding's own blocks
        assert head.blocks.data_ptr() == model.get_input_embeddings().blocks.data_ptr()
    batch = header.tokenizer(PROMPTS[:2], return_tensors="pt", padding=True)
    real = batch["attention_mask"].bool()
    with torch.no_grad():
        theirs = reference(**batch).logits
        exact = exact_weights(model, lambda: model(**batch).logits, monkeypatch)
    torch.testing.assert_close(exact[real], theirs[real], rtol=1e-4, atol=1e-4)
    assert theirs.abs().max() > 1  # a real computation
    input_ids = header.tokenizer(PROMPTS[0], return_tensors="pt").input_ids
    with torch.no_grad():
        tokens = greedy(reference, input_ids, 8)
        assert torch.equal(exact_weights(model, lambda: greedy(model, input_ids, 8), monkeypatch), tokens)
    assert len(set(tokens[0, input_ids.shape[1]:].tolist())) > 1  # not one token repeated


@pytest.mark.parametrize("name", GPT2_FILES)
def test_a_gpt2_files_accelerator_form_is_the_dequantized_model(gpt2_loaded, name):
    # build_model given a device (the CPU standing in): the Conv1D weights de-quantized and transposed back to
    # [in, out], the very weights of --dequantize's model in float32, those rounded in bfloat16.
    from transformers.pytorch_utils import Conv1D

    header, _, reference = gpt2_loaded[name]
    model = accelerator_forms(header, reference)
    assert sum(isinstance(m, Conv1D) for m in model.modules()) == 4 * LAYERS


def test_a_gpt2_files_conv1d_layers_and_head_keep_their_codes_on_a_gpu(gpt2_loaded, monkeypatch):
    # As test_the_gpus_codes_and_blocks_compute_the_dequantized_model (the CPU standing in for a GPU): every Q8_0
    # Conv1D (rows the output channels, as a linear layer's) and the file's own output.weight become int8 codes, the
    # untied embedding stays in its blocks; the model computes --dequantize's logits.
    import rungen.gguf.device
    from rungen.gguf.device import DEVICE_ROW_TYPES, INT8_TYPES, DeviceRowsEmbedding
    from rungen.int8 import CudaInt8Linear, widened

    header, _, reference = gpt2_loaded["gpt2_q8_0"]
    monkeypatch.setattr(rungen.gguf.device, "gpu_int8", lambda qtype, device: qtype in INT8_TYPES)
    monkeypatch.setattr(rungen.gguf.device, "gpu_embedding", lambda qtype, device: qtype in DEVICE_ROW_TYPES)
    monkeypatch.setattr(rungen.gguf.device, "checked_kernel", lambda layer, dtype, instead: widened)
    model = build_model(header, torch.float32, torch.device("cpu"))
    in_codes = {name for name, m in model.named_modules() if isinstance(m, CudaInt8Linear)}
    assert in_codes == {f"transformer.h.{n}.{name}" for n in range(LAYERS)
                        for name in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")} | {"lm_head"}
    assert all(model.get_submodule(name).bias is not None for name in in_codes - {"lm_head"})
    assert type(model.get_input_embeddings()) is DeviceRowsEmbedding
    batch = header.tokenizer(PROMPTS[:2], return_tensors="pt", padding=True)
    real = batch["attention_mask"].bool()
    with torch.no_grad():
        theirs, ours = reference(**batch).logits, model(**batch).logits
    assert (ours - theirs)[real].abs().max() <= 1e-5 * theirs[real].abs().max()


@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize("name", GPT2_FILES)
def test_quantizing_a_gpt2_file_as_it_loads_equals_quantizing_its_dequantized_model(gpt2_loaded, name, mode,
                                                                                   monkeypatch):
    # As test_quantizing_a_file_as_it_loads_equals_quantizing_its_dequantized_model, over Conv1D layers: the
    # de-quantized rows transposed to Conv1D's [in, out] as they are put, and back to rows as they are quantized.
    header, _, _ = gpt2_loaded[name]
    assert quantized_as_it_loads(header, mode, monkeypatch) >= 4 * LAYERS  # c_attn, attn.c_proj, c_fc, mlp.c_proj


@pytest.mark.parametrize("name", GPT2_FILES)
def test_the_command_line_generates_from_a_gpt2_file(gpt2_files, name):
    args = ["--model_name_or_path", gpt2_files[name], "--prompt", PROMPTS[0], "--temperature", "0", "--length", "4"]
    [text] = run_generation.main(args)
    assert text.startswith(PROMPTS[0]) and len(text) > len(PROMPTS[0])
