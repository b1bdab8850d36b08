"""The GGUF runtime: a GGUF file run on the CPU in its own quantized blocks by the native kernels, and on an
accelerator in codes its kernels read or de-quantized (device.py's forms, build.py's build_model).

Modules, from the ground up:
- kernels.py: the native kernels (rungen/gguf/csrc, torch.ops.rungen_ggml), built on first use and cached.
- codes.py: the blocks read as codes and scales by torch operators, the gguf package's floats.
- blocks.py: the file's tensors as torch layers (GGMLLinear, GGMLParts, GGMLEmbedding; float ones kept in their
  dtype), the torch fallback where the kernels are missing.
- device.py: the forms a CUDA GPU keeps the blocks in (int4 for torch's kernel, int8 codes, an embedding's blocks).
- families.py: the model families, one row each: what a family differs in from llama's decoder.
- weights.py: WeightReader, the file's tensors as the builders take them (views of the map, interleaved rows).
- experts.py: a mixture's experts in their blocks (GGMLExperts), its MLP in one native call (NativeMixture).
- device_experts.py: a mixture's experts in codes on a GPU (CodedExperts: a step's or a prompt's in two grouped
  launches).
- stack.py: every decoder layer in one native call (NativeStack), the layers' tensors in its order.
- decoder.py: the decoder layers fused over the blocks (FusedDecoderLayer), the stack as transformers' forward
  (DecoderStack).
- layer_loop.py: the decode step of a model with native steps as one plain loop over its layers' parts (LayerLoop).
- native_steps.py: transformers' own layers of the families decoder.py does not fuse (gpt-oss, Gemma 4, OLMo,
  OLMoE, Ministral 3, EXAONE 4, GLM-4.5, AFMoE) with their attention, norms and gated MLPs on the native kernels.
- llama4.py: Llama 4's mixture in the form the blocks take its experts (Llama4Mixture: a token's input scaled by its
  expert's score before it).
- latent_attention.py: DeepSeek's attention over its cache of latents without expanding them
  (AbsorbedLatentAttention).
- delta_steps.py: Qwen3.5's layers with their steps native: a Gated DeltaNet layer's decode step in one native call
  (DeltaNetStep), the gated attention (NativeGatedAttention), norms and MLPs.
- conv_steps.py: LFM2's layers with their steps native: a short convolution's decode step (ShortConvStep), the
  attention (NativeLfm2Attention), norms and MLPs.
- granite_steps.py: the Mamba-2 hybrids' and Granite's layers with their steps native (Granite 4.0 H, Granite 3's
  mixtures, Nemotron-H, Nemotron 3, Falcon-H1): a Mamba-2 layer's decode step and a prompt's in one native call
  (MambaStep), the attention (NativeGraniteAttention), norms and MLPs.
- own_tables.py: the entries of transformers' kind of conversion table added here, a config reader and a tensor table
  an architecture (LFM2-MoE, Granite 4.0 H, Granite 3's mixtures, Nemotron-H, Nemotron 3, Qwen3-Next, Falcon-H1,
  AFMoE, OLMoE, Llama 4, HY V3, dots.llm1: OWN_TABLES).
- conversions.py: the architectures transformers reads by its own conversion table (Qwen3.5, LFM2) and OWN_TABLES',
  taught to it, as the build's weights map and processor (Conversion; InputPermuted for a weight whose columns stay
  in the file's order).
- table.py: the file's tensor table (names, types, shapes, offsets), read once a process; why a file is unreadable.
- configs.py: what the file's metadata says of its model as transformers' config takes it, architecture by
  architecture (complete_config).
- file.py: the header and its cache (config, tokenizer, tensor table, what the file holds for transformers).
- held_tensors.py: the tensors that make one layer only together (a mixture's experts, a weight joined by rows),
  held until all are read, then built (HeldTensors).
- build.py: transformers' model of the file, its weights taken in tensor by tensor (build_model).
- model.py: the own model (GGUFCausalLM) of the families' files, without transformers.
- tokenizer.py: the file's tokenizer on the tokenizers library alone.

A decoder layer runs by one of four routes, the same function in the same order (the same bits) in each:
1. GGUFCausalLM (model.py): the own model calls NativeStack directly, every layer in one native call a step. Taken
   for a file of the table's families on the CPU in float32 with the kernels built (model.refusal says why not).
2. DecoderStack (decoder.py) over NativeStack: the same one call as transformers' model's inner forward. Taken where
   transformers' model of the file runs instead (a file route 1 refuses, generate()'s beam search and other
   generate()-only controls: rungen/loading.py) and every layer fused alike and in blocks (a mixture's MLP by
   NativeMixture's native code: Qwen3-MoE, Qwen2-MoE).
3. FusedDecoderLayer._two_calls: a layer in two native calls (attention in; attention out and the MLP). Taken layer by
   layer where DecoderStack steps aside (no cache or another kind, hidden states or attention maps asked for, --jit's
   tracing, layers cut to different lengths) for the layers it covers: full attention, SiLU, no output norms.
4. FusedDecoderLayer.forward: a fused product and a native step at a time. Taken there for the other layers
   (windows, soft caps, GELU, gemma's norms, a mixture of experts' MLP: NativeMixture's one call), under
   products_one_by_one (a mixture's MLP: transformers' module over GGMLExperts), and on torch's operators without
   the kernels (RUN_GENERATION_KERNELS=torch).
"""

from __future__ import annotations

import importlib

# The names the tool uses, by module, imported when first asked for: a run without a GGUF file imports few.
PUBLIC = {
    "native_kernels": "kernels", "kernel_cache_dir": "kernels",
    "holds_blocks": "blocks", "GGMLLinear": "blocks",
    "GGUFCausalLM": "model",
    "GGUFError": "file", "GGUFHeader": "file", "build_model": "build", "metadata_parsed_once": "file",
}
__all__ = sorted(PUBLIC)


def __getattr__(name: str):
    if name not in PUBLIC:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{PUBLIC[name]}"), name)
