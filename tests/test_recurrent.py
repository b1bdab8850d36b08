"""Models with recurrent layers (Qwen3.5's Gated DeltaNet layers, LFM2's short convolutions, Granite 4.0 H's Mamba-2
layers, Falcon-H1's beside its attention in each layer, read from GGUF files as llama.cpp's converter writes them)
decode on the engine: a row's convolution window and state (transformers' LinearAttentionLayer; LFM2's keep a window
alone) are its own, joined one after another where rows join and picked where rows leave, beside the full-attention
layers' left-padded keys and values (a hybrid layer holds both). So the greedy
tokens of a batch are those generate() gives each prompt alone, and the server serves these models. Their prefix cache
keeps a row's states after exactly the tokens they stand for (a state is not cut back): a prompt's all but its last
token, and a finished row's prompt and reply, which the same prompt again and a conversation's next turn start from."""

import pytest
import torch

from rungen.engine import Engine
from rungen.loading import load
from rungen.requests import Done, Request
from rungen.sampling import Sampling

PROMPTS = ["The capital of France is Paris and the capital of Germany is", "Hello, my dog",
           "Once upon a time there was a little girl who"]
NEW_TOKENS = 10

pytestmark = pytest.mark.usefixtures("module_cache_home")


@pytest.fixture(scope="module",
                params=["qwen35", "lfm2", "granitehybrid", "nemotron_h", "nemotron_h_moe", "falcon_h1"])
def loaded(request, tmp_path_factory):
    """The tiny Qwen3.5 checkpoint's Q8_0 GGUF file (three Gated DeltaNet layers, one of full attention), the tiny
    LFM2's (three short convolution layers, one of attention), Granite 4.0 H's (three Mamba-2 layers, one of
    attention, experts), Nemotron-H's (three Mamba-2, one attention and three MLP layers), Nemotron 3's (mixtures
    in place of the MLPs) or Falcon-H1's (three layers of attention and a Mamba-2 mixer side by side: a cache layer
    holding keys and values beside a state), loaded."""
    import tiny_models

    folder = tmp_path_factory.mktemp(request.param)
    checkpoint = getattr(tiny_models, f"{request.param}_checkpoint")(str(folder))
    write = getattr(tiny_models, f"write_{request.param.removesuffix('_moe')}_gguf")
    return load(write(checkpoint, str(folder / f"{request.param}.gguf"), "Q8_0"), device=torch.device("cpu"))


def alone(model, ids, new_tokens):
    """generate()'s greedy tokens for one prompt, in a cache of the engine's form (kvcache.new_cache: its attention
    layers' keys and values in float16 where the native attend reads them so; a float32 cache's logits part from
    them by its rounding, which turns a near tie of the tiny models)."""
    from rungen.kvcache import new_cache

    out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                         do_sample=False, max_new_tokens=new_tokens, eos_token_id=None, pad_token_id=0,
                         past_key_values=new_cache(model))
    return out[0, len(ids):].tolist()


def turn(engine, prompt):
    """(the greedy tokens, the prompt tokens the prefix cache held) of one request on `engine`, run to its end."""
    done = {}

    def sink(event):
        if isinstance(event, Done):
            done["tokens"] = event.finish.tokens

    request = Request(prompt, max_tokens=NEW_TOKENS, sampling=Sampling(temperature=0), sink=sink)
    engine.submit(request)
    engine.run_here()
    return done["tokens"], request.reused


def test_rows_joining_and_leaving_keep_their_own_states(loaded):
    prompts = [loaded.tokenizer.encode(text) for text in PROMPTS + ["A cat sat"]]
    lengths = [NEW_TOKENS, NEW_TOKENS - 6, NEW_TOKENS, NEW_TOKENS - 4]
    with torch.inference_mode():
        expected = [alone(loaded.model, ids, length) for ids, length in zip(prompts, lengths)]
    # Four rows at most: the first three prompts' (the third asks for two sequences: its state repeated for each);
    # the second's row, between the others, leaves first, and the fourth prompt joins the three left, mid-decode.
    engine = Engine(loaded, max_batch=4, eos_ids=())
    assert engine.keeps_states
    tokens = {}
    for number, (ids, length) in enumerate(zip(prompts, lengths)):
        def sink(event, number=number):
            if isinstance(event, Done):
                tokens.setdefault(number, []).append(event.finish.tokens)
        engine.submit(Request(ids, max_tokens=length, sampling=Sampling(temperature=0), sink=sink,
                              n=2 if number == 2 else 1))
    engine.run_here()
    assert engine.batch.peak_rows == 4
    assert tokens == {0: [expected[0]], 1: [expected[1]], 2: [expected[2]] * 2, 3: [expected[3]]}


def test_a_conversations_next_turn_starts_from_the_states_the_prefix_cache_kept(loaded):
    # A first turn's prompt, then its next turn (the prompt, the reply, more tokens), then the first prompt again:
    # the next turn starts from the states after the prompt and reply (the finished row's), the same prompt again
    # from those after all of it but its last token (kept at its prefill); each reply what generate() gives the
    # whole prompt alone. A prompt sharing a start that is no entry's whole (a state is not cut back) reuses nothing.
    ids = loaded.tokenizer.encode(PROMPTS[0])
    with torch.inference_mode():
        first = alone(loaded.model, ids, NEW_TOKENS)
    engine = Engine(loaded, max_batch=2, eos_ids=(), prefix_cache_bytes=64 << 20)
    assert engine.prefix_cache is not None


    assert turn(engine, ids) == (first, 0)
    more = loaded.tokenizer.encode(" And then")
    next_turn = ids + first + more
    with torch.inference_mode():
        wanted = alone(loaded.model, next_turn, NEW_TOKENS)
    # (the finished row's cache holds its prompt and reply but the reply's last token, never fed)
    assert turn(engine, next_turn) == (wanted, len(ids) + len(first) - 1)
    assert turn(engine, ids) == (first, len(ids) - 1)
    assert turn(engine, ids[:-3] + more)[1] == 0
    entries = list(engine.prefix_cache.entries.values())
    assert entries and all(states for *_, states in entries)


def test_a_next_turn_rendered_otherwise_after_the_last_turns_end_starts_from_there(loaded):
    # A template may render a conversation's history otherwise than the prompt before (a reply's reasoning dropped,
    # the generation prompt's thinking opener): the prefix cache also keeps the states after the prompt's last turn
    # end (a token that ends a reply), which such a next turn shares.
    tokenizer = loaded.tokenizer
    end = tokenizer.eos_token_id
    # (the pieces without special tokens: a BOS the tokenizer starts each with would stand between them)
    history, opener, reply = (tokenizer.encode(text, add_special_tokens=False)
                              for text in (PROMPTS[2], " Sure: think", " Sure: the answer"))
    engine = Engine(loaded, max_batch=2, eos_ids=(end,), prefix_cache_bytes=64 << 20)


    assert turn(engine, history + [end] + opener)[1] == 0
    next_turn = history + [end] + reply + [end] + opener
    tokens, reused = turn(engine, next_turn)
    assert reused == len(history) + 1
    with torch.inference_mode():
        wanted = alone(loaded.model, next_turn, NEW_TOKENS)
    assert tokens == (wanted[:wanted.index(end) + 1] if end in wanted else wanted)


def test_chats_under_one_system_prompt_start_after_it(loaded):
    # An application's chats share a system prompt (its instructions, its tools): the prefix cache also keeps the
    # states after a prompt's first turn's end, which another chat under the same system prompt starts from.
    tokenizer = loaded.tokenizer
    end = tokenizer.eos_token_id
    system, question, other, opener = (tokenizer.encode(text, add_special_tokens=False) for text in
                                       (PROMPTS[0], " What is it?", PROMPTS[1], " Sure:"))
    engine = Engine(loaded, max_batch=2, eos_ids=(end,), prefix_cache_bytes=64 << 20)
    assert turn(engine, system + [end] + question + [end] + opener)[1] == 0
    chat = system + [end] + other + [end] + opener
    tokens, reused = turn(engine, chat)
    assert reused == len(system) + 1
    with torch.inference_mode():
        wanted = alone(loaded.model, chat, NEW_TOKENS)
    assert tokens == (wanted[:wanted.index(end) + 1] if end in wanted else wanted)


def test_such_a_model_is_served(loaded):
    from starlette.testclient import TestClient

    from rungen.server import ServeOptions, build

    app, engine = build(loaded, ServeOptions(model_id="tiny-qwen35"))
    try:
        with TestClient(app) as client:
            responses = [client.post("/v1/completions", json={"model": "tiny-qwen35", "prompt": prompt,
                                                              "max_tokens": NEW_TOKENS, "temperature": 0})
                         for prompt in PROMPTS[:2]]
    finally:
        engine.close()
        engine.abort()
    for prompt, response in zip(PROMPTS, responses):
        assert response.status_code == 200, response.text
        with torch.inference_mode():
            expected = alone(loaded.model, loaded.tokenizer.encode(prompt), NEW_TOKENS)
        assert response.json()["choices"][0]["text"] == loaded.tokenizer.decode(expected, skip_special_tokens=True)


def test_the_memory_line_states_each_rows_recurrent_state(loaded):
    # The engine's bound counts token positions; the states (a row's, whatever its length) are said beside it: what
    # transformers' own cache holds of a row's recurrent layers after a prompt.
    from transformers import DynamicCache

    from rungen.engine import describe_memory

    cache = DynamicCache(config=loaded.model.config)
    with torch.inference_mode():
        loaded.model(input_ids=torch.tensor([loaded.tokenizer.encode(PROMPTS[1])]), past_key_values=cache)
    states = [state for layer in cache.layers for kind in ("conv_states", "recurrent_states")
              for state in getattr(layer, kind, {}).values() if state is not None]
    held = sum(state.numel() * state.element_size() for state in states)
    engine = Engine(loaded, max_batch=4, eos_ids=())
    assert engine.bytes_per_row == held > 0
    assert f"{held / 2**20:.1f} MiB of recurrent state a row" in describe_memory(engine)


def test_the_cpu_steps_leave_out_transformers_hint_to_install_cuda_kernels(loaded):
    # transformers says, once a process, that causal-conv1d and flash-linear-attention (CUDA kernels) are missing
    # where a prompt takes their PyTorch forms; on the CPU those forms (or a native scan) are the way, a decode step
    # native: not said.
    import logging

    from rungen.gguf.native_steps import GpuKernelHints

    hub_logger = logging.getLogger(GpuKernelHints.LOGGER)
    hinted = [f for f in hub_logger.filters if isinstance(f, GpuKernelHints)]
    assert hinted
    said = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: said.append(record.getMessage())

    def prompt_said():
        logging.Logger.warning_once.cache_clear()  # (said once a process: said again here)
        said.clear()
        with torch.no_grad():
            loaded.model(torch.tensor([[5, 9, 13, 2, 7]]))
        return any(GpuKernelHints.MESSAGE in message for message in said)

    hub_logger.addHandler(handler)
    try:
        assert not prompt_said()
        if any(type(module).__name__ in ("DeltaNetStep", "MambaStep") for module in loaded.model.modules()):
            return  # (Qwen3.5's and the Mamba-2 hybrids' prompts take delta_scan and mamba_scan: transformers'
            # forms, which the hint is of, are not called)
        for hint in hinted:
            hub_logger.removeFilter(hint)
        assert prompt_said()  # (transformers does say it)
    finally:
        hub_logger.removeHandler(handler)
        for hint in hinted:
            hub_logger.addFilter(hint)
