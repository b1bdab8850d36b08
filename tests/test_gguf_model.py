"""A GGUF file of the llama-shaped families on the project's own model code (rungen/gguf/model.py): the same logits,
bit for bit, as transformers' model of the file fused by rungen/gguf/decoder.py over a cache holding what the own
model's holds (float16 keys and values; float32 with RUN_GENERATION_KV_FLOAT32=1) (a prompt, decode steps, a
left-padded batch), the same config values, generation config and tokenizer; transformers' model where only it runs
(generate()'s controls, --jit, a session turn that needs them); and a one-shot run that never imports transformers'
model modules. The files imitate the published ones (tests/test_gguf_loading.py's llama/qwen2 files, tests/
tiny_models.py's qwen3, phi3 (Phi-4-mini's partial rotary too), gemma2 and gemma3, tests/helpers.py's Qwen3-MoE and
Qwen2-MoE, and the embedded SmolLM2)."""

import json
import os
import subprocess
import sys

import pytest
import torch
from gguf import GGMLQuantizationType as Q
from test_gguf_loading import FILES as LLAMA_FILES
from test_gguf_loading import VOCAB, write_llama_gguf

import run_generation
from helpers import ROOT, cli_env, write_moe_gguf
from rungen import loading
from rungen.embeddings import embed, final_hidden_states
from rungen.gguf.blocks import native_kernels
from rungen.gguf.build import build_model
from rungen.gguf.file import GGUFHeader
from rungen.gguf.model import GGUFCausalLM, padded_causal_mask
from rungen.gguf.tokenizer import GGUFTokenizer
from rungen.gguf.tokenizer import own as own_tokenizer_refusal
from rungen.kvcache import KV_FLOAT32_ENV, new_cache
from rungen.loading import default_model_file, load_gguf
from tiny_models import (
    deepseek_coder_checkpoint,
    default_tokenizer_fields,
    ernie4_5_checkpoint,
    gemma_checkpoint,
    granite_checkpoint,
    llama3_checkpoint,
    mistral_small_checkpoint,
    qwen2vl_checkpoint,
    qwen3vl_checkpoint,
    smollm3_checkpoint,
    write_ernie4_5_gguf,
    write_family_gguf,
    write_gemma_gguf,
    write_granite_gguf,
    write_llama3_gguf,
    write_mistral3_gguf,
    write_qwen_vl_gguf,
    write_smollm3_gguf,
)

pytestmark = [pytest.mark.usefixtures("module_cache_home"),
              pytest.mark.skipif(not native_kernels(), reason="the own model code runs on the native kernels")]
PROMPTS = ["The capital of France is", "Hello, my dog", "A"]
# mixed_tied holds F16/BF16 layer weights beside the blocks: transformers' model runs it (its own test below).
NAMES = [*(name for name in LLAMA_FILES if name != "mixed_tied"), "qwen3", "phi3", "phi4_partial", "gemma2", "gemma3",
         "qwen3moe", "qwen2moe", "mixtral", "smollm3", "granite", "mistral3", "qwen3vl", "qwen2vl",
         "ernie4_5", "gemma", "llama3", "deepseek_coder", "default"]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    fields = default_tokenizer_fields(default_model_file(), VOCAB)
    folder = tmp_path_factory.mktemp("own")
    out = {name: write_llama_gguf(folder / f"{name}.gguf", fields, **spec) for name, spec in LLAMA_FILES.items()}
    out["qwen3"] = write_family_gguf(folder / "qwen3.gguf", "qwen3", fields)
    # Phi-4-mini's partial rotary: 24 of each head's 32 values rotated.
    out["phi3"] = write_family_gguf(folder / "phi3.gguf", "phi3", fields)
    out["phi4_partial"] = write_family_gguf(folder / "phi4_partial.gguf", "phi3", fields, rotary=24)
    # gemma3: five sliding layers and a global one (their window of 4 crossed by the prompts and decode steps).
    out["gemma2"] = write_family_gguf(folder / "gemma2.gguf", "gemma2", fields)
    out["gemma3"] = write_family_gguf(folder / "gemma3.gguf", "gemma3", fields, layers=6)
    # Mixtures of experts: Qwen3-30B-A3B's layout (Q4_K gate and up, Q6_K down, as Q4_K_M mixes them) and
    # Qwen1.5-MoE-A2.7B's (its shared expert), each layer's MLP one native call inside the stack.
    out["qwen3moe"] = write_moe_gguf(folder / "qwen3moe.gguf", experts=8, used=3, expert_ffn=256, hidden=256,
                                     expert_types=(Q.Q4_K, Q.Q4_K, Q.Q6_K), fields=fields)
    out["qwen2moe"] = write_moe_gguf(folder / "qwen2moe.gguf", arch="qwen2moe", experts=6, used=2, expert_ffn=256,
                                     fields=fields)
    # Mixtral's: a llama file with experts (Q4_K_M's mix), its top 2 weights normalized.
    out["mixtral"] = write_moe_gguf(folder / "mixtral.gguf", arch="llama", experts=8, used=2, expert_ffn=256,
                                    hidden=256, expert_types=(Q.Q4_K, Q.Q4_K, Q.Q6_K), fields=fields)
    # SmolLM3's: every fourth layer without rotary (the stack's layers pass it), as llama.cpp's converter writes it.
    out["smollm3"] = write_smollm3_gguf(smollm3_checkpoint(str(folder)), str(folder / "smollm3.gguf"), "Q8_0")
    # Granite 3's: llama's with its embedding, residual and score multipliers and the logits' divisor.
    out["granite"] = write_granite_gguf(granite_checkpoint(str(folder)), str(folder / "granite.gguf"), "Q8_0")
    # Mistral Small 3.x's as llama.cpp converts it now: a mistral3 file without Ministral 3's rotary, llama's.
    out["mistral3"] = write_mistral3_gguf(mistral_small_checkpoint(str(folder)), str(folder / "mistral3.gguf"), "Q8_0")
    # Qwen3-VL's text model: Qwen3's, under the qwen3vl architecture.
    out["qwen3vl"] = write_qwen_vl_gguf(qwen3vl_checkpoint(str(folder)), str(folder / "qwen3vl.gguf"), "Q8_0")
    # Qwen2.5-VL's text model: Qwen2's (q/k/v biases), under the qwen2vl architecture.
    out["qwen2vl"] = write_qwen_vl_gguf(qwen2vl_checkpoint(str(folder)), str(folder / "qwen2vl.gguf"), "Q8_0")
    # ERNIE 4.5's dense model: llama's over its un-permuted q/k rows, which its converter leaves as they are.
    # Llama 3.1's: its llama3 rotary in the rope_freqs tensor alone.
    out["llama3"] = write_llama3_gguf(llama3_checkpoint(str(folder)), str(folder / "llama3.gguf"), "Q8_0")
    # DeepSeek Coder's: a llama whose rotary is linearly scaled (rope.scaling keys).
    out["deepseek_coder"] = write_llama3_gguf(deepseek_coder_checkpoint(str(folder)),
                                              str(folder / "deepseek_coder.gguf"), "Q8_0")
    # Gemma (1)'s: Gemma 2's keys and stored norms, without its output norms and caps.
    out["gemma"] = write_gemma_gguf(gemma_checkpoint(str(folder)), str(folder / "gemma.gguf"), "Q8_0")
    out["ernie4_5"] = write_ernie4_5_gguf(ernie4_5_checkpoint(str(folder)), str(folder / "ernie4_5.gguf"), "Q8_0")
    out["default"] = default_model_file()
    return out


@pytest.fixture(scope="module")
def models(files):
    """{file: (own Loaded, transformers' model of the file as today's loader builds it)}; the first load writes the
    weights map the own model reads."""
    out = {}
    for name in NAMES:
        path = files[name]
        reference = build_model(GGUFHeader(path), torch.float32)
        own = load_gguf(path)
        assert isinstance(own.model, GGUFCausalLM), name
        out[name] = own, reference
    return out


def steps(model, tokenizer, prompts, decode=3):
    """The engine's calls on `model`: a left-padded batch's prompt (with each row's positions), then `decode` greedy
    steps, over the cache new_cache gives it (transformers' model of a file, its fused layers reading float16, holds
    what the own model's does); every call's logits."""
    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    cache, out = new_cache(model), []
    with torch.inference_mode():
        for _ in range(decode + 1):
            logits = model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache,
                           use_cache=True).logits
            out.append(logits)
            ids = logits[:, -1].argmax(-1, keepdim=True)
            mask = torch.cat([mask, torch.ones_like(ids)], 1)
            positions = positions[:, -1:] + 1
    return out


@pytest.mark.parametrize("name", NAMES)
def test_logits_are_those_of_transformers_model_of_the_file(models, name):
    own, reference = models[name]
    for prompts in (PROMPTS[:1], PROMPTS):  # alone (no mask), then a left-padded batch
        got, expected = steps(own.model, own.tokenizer, prompts), steps(reference, own.tokenizer, prompts)
        for step, (a, b) in enumerate(zip(got, expected)):
            assert torch.equal(a, b), (name, len(prompts), step, (a - b).abs().max())


@pytest.mark.parametrize("name", ["q4_k_m_tied", "gemma3", "qwen3moe", "default"])
def test_the_cache_holds_float16_or_with_RUN_GENERATION_KV_FLOAT32_1_transformers_float32(models, name, monkeypatch):
    """The own model's cache holds keys and values in float16, half float32's bytes (llama.cpp's cache holds them
    so); RUN_GENERATION_KV_FLOAT32=1 holds float32, and the own model then computes the bits of transformers' model
    of the file over its own float32 cache. The float16 cache moves the logits (a float16 key is not the float32
    one), the float32 one does not."""
    own, reference = models[name]
    prompt = own.tokenizer(PROMPTS[:1], return_tensors="pt")
    with torch.inference_mode():
        cache = own.model(**prompt).past_key_values
    assert {layer.keys.dtype for layer in cache.layers} == {layer.values.dtype for layer in cache.layers} == {
        torch.float16}
    half = steps(own.model, own.tokenizer, PROMPTS)
    monkeypatch.setenv(KV_FLOAT32_ENV, "1")
    with torch.inference_mode():
        float32 = own.model(**prompt).past_key_values
    # The first layer's keys and values (computed alike either way) as torch rounds them to float16.
    assert float32.layers[0].keys.dtype == torch.float32
    assert torch.equal(cache.layers[0].keys, float32.layers[0].keys.half())
    assert torch.equal(cache.layers[0].values, float32.layers[0].values.half())
    got, expected = steps(own.model, own.tokenizer, PROMPTS), steps(reference, own.tokenizer, PROMPTS)
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    assert not torch.equal(half[0], got[0])


@pytest.mark.parametrize("name", ["q4_0_untied", "default"])
def test_scoring_and_the_last_logits_only(models, name):
    # --length 0 scores a padded batch without a cache (use_cache=False); the engine's prefill keeps the last logits.
    own, reference = models[name]
    batch = own.tokenizer(PROMPTS, return_tensors="pt", padding=True)
    with torch.inference_mode():
        scored = own.model(**batch, use_cache=False)
        assert scored.past_key_values is None
        expected = reference(**batch, past_key_values=new_cache(reference)).logits  # (float16, as the own model's)
        assert torch.equal(scored.logits[:, -1], expected[:, -1])
        last = own.model(input_ids=batch["input_ids"][:1], logits_to_keep=1).logits
    assert last.shape[1] == 1 and torch.equal(last[0, -1], scored.logits[0, -1])


@pytest.mark.parametrize("name", ["q4_0_untied", "gemma2", "qwen2moe", "default"])
def test_final_hidden_states_and_embeddings(models, name):
    """The final hidden states embed() pools, of the own model and of transformers' model of the file (its layers
    fused): what the head turns into forward's logits, bit for bit, and the same in both; embed() pools the last
    position, the same alone and in a batch."""
    own, reference = models[name]
    batch = own.tokenizer(PROMPTS, return_tensors="pt", padding=True)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    softcap = own.model.final_softcap
    with torch.inference_mode():
        for model in (own.model, reference):
            hidden = final_hidden_states(model, ids, mask, positions)
            head = model.lm_head(hidden)
            head = head if softcap is None else torch.tanh(head / softcap) * softcap
            assert torch.equal(head, model(**batch, position_ids=positions, use_cache=False).logits), model
        # (the reference over a cache holding what the own model's holds)
        hidden = reference.model(input_ids=ids, attention_mask=mask, position_ids=positions,
                                 past_key_values=new_cache(reference)).last_hidden_state
        assert torch.equal(final_hidden_states(own.model, ids, mask, positions)[:, -1], hidden[:, -1])
    ids = [own.tokenizer.encode(prompt) for prompt in PROMPTS]
    together = embed(own, ids)
    assert torch.allclose(together, torch.nn.functional.normalize(hidden[:, -1], dim=-1), atol=1e-6)
    for row, prompt in enumerate(ids):
        assert torch.allclose(embed(own, [prompt])[0], together[row], atol=1e-6), (name, row)


@pytest.mark.parametrize("name", ["q4_0_untied", "qwen2_biases", "qwen3", "default"])
def test_config_generation_config_and_tokenizer_are_transformers(models, files, name):
    own, reference = models[name]
    header = GGUFHeader(files[name])
    for field in ("model_type", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "hidden_size",
                  "max_position_embeddings", "rms_norm_eps", "vocab_size", "tie_word_embeddings", "rope_parameters",
                  "bos_token_id", "eos_token_id", "pad_token_id"):
        assert getattr(own.model.config, field, None) == getattr(reference.config, field, None), field
    for field in ("bos_token_id", "eos_token_id", "pad_token_id"):
        assert getattr(own.model.generation_config, field) == getattr(reference.generation_config, field), field
    assert own.context == loading.model_context(reference.config)
    assert own.vocab_size == reference.get_input_embeddings().num_embeddings
    from transformers import AutoTokenizer

    auto = AutoTokenizer.from_pretrained(header.cache_dir)
    # The tokenizers library's alone where it gives transformers' results (tests/test_tokenizer.py), else theirs.
    assert type(own.tokenizer) is (GGUFTokenizer if own_tokenizer_refusal(header.cache_dir) is None else type(auto))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi <|im_end|> there"}]
    assert (own.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            == auto.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
    assert own.tokenizer(PROMPTS)["input_ids"] == auto(PROMPTS)["input_ids"]


def test_the_padded_mask_is_create_causal_masks(models):
    from transformers.masking_utils import create_causal_mask

    _, reference = models["default"]
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 1, 1, 1, 1]])
    for held, tokens in ((0, 5), (4, 1), (3, 2)):
        cache = new_cache(reference)
        if held:
            states = torch.zeros(3, reference.config.num_key_value_heads, held, 64)
            for layer in cache.layers:
                layer.update(states, states)
        hidden = torch.zeros(3, tokens, reference.config.hidden_size)
        seen = mask[:, :held + tokens]
        expected = create_causal_mask(config=reference.config, inputs_embeds=hidden, attention_mask=seen,
                                      past_key_values=cache, position_ids=None)
        assert torch.equal(padded_causal_mask(seen, held, tokens), expected), (held, tokens)


def test_a_file_with_float_layer_weights_runs_on_transformers_model(models, files):
    # Layers not all in blocks are not one native stack: transformers' model computes them, as before.
    loaded = load_gguf(files["mixed_tied"])
    assert not isinstance(loaded.model, GGUFCausalLM) and loaded.model.config.model_type == "llama"


def test_a_phi3_file_with_longrope_runs_on_transformers_model(tmp_path):
    # The 128k variants' longrope switches its factors with the length: transformers' model computes it.
    fields = default_tokenizer_fields(default_model_file(), VOCAB)
    path = write_family_gguf(tmp_path / "phi3_128k.gguf", "phi3", fields, longrope=True)
    load_gguf(path)  # the first load writes the weights map
    loaded = load_gguf(path)
    assert not isinstance(loaded.model, GGUFCausalLM)
    assert loaded.model.config.rope_parameters["rope_type"] == "longrope"


def test_what_only_transformers_model_runs_loads_it(models, files, monkeypatch):
    # Flags that need generate() (beam search here) or --jit load transformers' model: decided before loading.
    calls = []
    original = run_generation.load
    monkeypatch.setattr(run_generation, "load", lambda *a, **k: calls.append(k["own_model"]) or original(*a, **k))
    sequences = run_generation.main(["--model_name_or_path", files["q4_0_untied"], "--prompt", "Hello, my dog",
                                     "--length", "4", "--num_beams", "2", "--temperature", "0", "--quiet"])
    assert calls == [False] and len(sequences) == 1 and sequences[0].startswith("Hello, my dog")
    greedy = run_generation.main(["--model_name_or_path", files["q4_0_untied"], "--prompt", "Hello, my dog",
                                  "--length", "4", "--temperature", "0", "--quiet"])
    assert calls == [False, True] and greedy[0].startswith("Hello, my dog")
    # A draft model drafts through generate(): it and the main model load as transformers' models.
    drafts = []
    draft_load = loading.load
    monkeypatch.setattr(loading, "load", lambda *a, **k: drafts.append(k["own_model"]) or draft_load(*a, **k))
    assisted = run_generation.main(["--model_name_or_path", files["q4_0_untied"], "--prompt", "Hello, my dog",
                                    "--length", "4", "--temperature", "0", "--quiet",
                                    "--assistant_model", files["q6_k_untied"]])
    assert calls == [False, True, False] and drafts == [False] and assisted[0].startswith("Hello, my dog")


def test_the_swap_to_transformers_model_keeps_the_function(files):
    # A session turn that needs generate() swaps the own model for transformers' (the own one released first).
    loaded = load_gguf(files["q4_k_m_tied"])
    before = steps(loaded.model, loaded.tokenizer, PROMPTS, decode=1)
    assert loading.use_transformers_model(loaded) and not isinstance(loaded.model, GGUFCausalLM)
    assert not loading.use_transformers_model(loaded)  # already transformers'
    after = steps(loaded.model, loaded.tokenizer, PROMPTS, decode=1)
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    ids = loaded.tokenizer(PROMPTS[:1], return_tensors="pt")
    with torch.inference_mode():
        beams = loaded.model.generate(**ids, max_new_tokens=3, num_beams=2, do_sample=False)
    assert beams.shape == (1, ids["input_ids"].shape[1] + 3)


@pytest.mark.slow  # a fresh interpreter: what it imports is the point
@pytest.mark.parametrize("name", ["default", "qwen3", "qwen3moe"])
def test_a_gguf_one_shot_run_imports_no_transformers(models, files, name):
    # A cached one-shot run on the own model code imports none of transformers (its top level alone is most of the
    # start-up above torch's), nor accelerate (several processes only): the default model's file, and a qwen3 one,
    # whose Qwen2Tokenizer runs as its header cache recorded it (rungen/gguf/tokenizer.py).
    # A prompt, then a chat (its template rendered by jinja2).
    model = [] if name == "default" else ["--model_name_or_path", files[name]]
    code = ("import json, sys, run_generation; "
            f"run_generation.main({model} + ['--prompt', 'Hi', '--length', '2', '--quiet']); "
            f"run_generation.main({model} + ['--chat', '--prompt', 'Hi', '--length', '2', '--quiet']); "
            "print(json.dumps(sorted(sys.modules)))")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                            env=cli_env(os.environ["XDG_CACHE_HOME"]), timeout=600)
    assert result.returncode == 0, result.stderr.decode()[-3000:]
    modules = set(json.loads(result.stdout.decode().splitlines()[-1]))
    assert {"rungen.gguf.model", "rungen.engine", "rungen.gguf.tokenizer", "rungen.chat_template"} <= modules
    loaded = sorted(m for m in modules if m.split(".")[0] in ("transformers", "accelerate"))
    assert loaded == []


@pytest.mark.slow  # a terminal session is a process on a pseudo-terminal
def test_a_session_turn_under_beam_search_swaps_to_transformers_model(files, tmp_path, monkeypatch):
    # The first turn runs on the own model (the engine); beam search needs generate(): transformers' model of the
    # file replaces it for that turn and the rest, and every reply is the one a pipe gives the same conversation.
    from test_session import start

    from helpers import jsonl, run_main

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    build_model(GGUFHeader(files["q4_k_m_tied"]), torch.float32)  # the header cache and its weights map
    args = ["--model_name_or_path", files["q4_k_m_tied"], "--temperature", "0", "--length", "6"]
    terminal = start(args + ["--verbose"], tmp_path)
    terminal.ask("Hello there")
    terminal.command("/set num_beams 2")
    terminal.ask("How are you")
    terminal.command("/set num_beams 1")
    terminal.ask("Goodbye")
    terminal.command(f"/save {tmp_path / 'chat.jsonl'}")
    terminal.send("/exit\r")
    assert terminal.wait() == 0
    shown = terminal.output.decode()
    assert "(GGUFCausalLM)" in shown and shown.count("Loading transformers' model") == 1
    messages = json.loads((tmp_path / "chat.jsonl").read_text())["messages"]
    for end, beams in ((1, "1"), (3, "2"), (5, "1")):
        piped = run_main(args + ["--num_beams", beams, "--input_format", "jsonl", "--output_format", "jsonl"],
                         stdin=json.dumps({"messages": messages[:end]}), cache_home=tmp_path)
        assert piped.returncode == 0, piped.stderr.decode()
        assert jsonl(piped.stdout)[0]["generated_text"] == messages[end]["content"], end


@pytest.mark.parametrize("rope", [{"rope_type": "default"}, {"rope_type": "linear", "factor": 4.0},
                                  {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 64}])
def test_rotary_cos_sin_are_llamas(rope, tmp_path):
    # The frequencies llama 3.x files (llama3) and linearly scaled ones carry, as LlamaRotaryEmbedding computes them.
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from rungen.gguf.model import read_config, rotary_cos_sin, rotary_frequencies

    fields = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  rope_parameters={"rope_theta": 500000.0, **rope})
    reference = LlamaRotaryEmbedding(LlamaConfig(**fields))
    (tmp_path / "config.json").write_text(json.dumps(LlamaConfig(**fields).to_dict()))  # as the header cache holds
    inv_freq, scaling = rotary_frequencies(read_config(str(tmp_path)))
    positions = torch.tensor([[0, 1, 2, 100, 511], [0, 0, 0, 7, 8]])
    expected = reference(torch.zeros(1, dtype=torch.float32), positions)
    got = rotary_cos_sin(inv_freq, scaling, positions)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
