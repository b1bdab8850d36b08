"""Models whose layers attend in a sliding window (gemma2's every other layer, gemma3's five in six, mistral's every
layer when its config has a window, AFMoE's three in four) decode on the engine: its cache keeps every position of
those layers and the attention mask applies the window (rungen/kvcache.py), so the greedy tokens of a left-padded
batch are those generate() gives each prompt alone over transformers' own window cache (DynamicSlidingWindowLayer,
which drops what leaves the window). Prompts are longer than the window (4 positions here), and every row decodes
past it (a prompt shorter than the window crosses it while it decodes). The gemma files are GGUF, run on the own
model code (rungen/gguf/model.py: one native stack call a step, the kernel applying each layer's window) and
compared with generate() on transformers' model of the same file, its cache holding what the own model's holds
(float16); mistral is a safetensors checkpoint."""

import contextlib
import json
import os

import pytest
import torch

from helpers import stored_as_own
from rungen.engine import Engine
from rungen.gguf.model import GGUFCausalLM
from rungen.kvcache import MIN_ROOM, SlidingLayer
from rungen.loading import default_model_file, load
from rungen.requests import Done, Request
from rungen.sampling import Sampling
from tiny_models import (
    GGUF_FAMILIES,
    afmoe_checkpoint,
    build_tiny_checkpoint,
    default_tokenizer_fields,
    write_afmoe_gguf,
    write_family_gguf,
)

WINDOW = 4  # tiny_models' gemma files; the mistral checkpoint is given the same
PROMPTS = ["The capital of France is Paris and the capital of Germany is", "Hello, my dog",
           "Once upon a time there was a little girl"]
NEW_TOKENS = 12

pytestmark = pytest.mark.usefixtures("module_cache_home")


def load_both(path):
    """(Loaded on the own model code, transformers' model) of a GGUF file: its first load is transformers' model
    (and writes the weights map the own model code reads)."""
    reference = load(str(path), device=torch.device("cpu")).model
    own = load(str(path), device=torch.device("cpu"))
    assert isinstance(own.model, GGUFCausalLM) and not isinstance(reference, GGUFCausalLM)
    reference.stands_for_own = True  # generate_alone: its cache holds what the own model's holds
    return own, reference


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """{name: (Loaded, the model generate() runs)} of a gemma2 and a gemma3 GGUF file (gemma3: five sliding layers,
    one global; the own model code, and transformers' model of the file), a mistral checkpoint with a sliding
    window and an AFMoE GGUF file (three sliding layers, one global without rotary; transformers' model, both)."""
    folder = tmp_path_factory.mktemp("sliding")
    fields = default_tokenizer_fields(default_model_file(), 2048)
    paths = {"gemma2": write_family_gguf(folder / "gemma2.gguf", "gemma2", fields),
             "gemma3": write_family_gguf(folder / "gemma3.gguf", "gemma3", fields, layers=6)}
    mistral = build_tiny_checkpoint("mistral", str(folder / "mistral"))
    with open(os.path.join(mistral, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(mistral, "config.json"), "w") as f:
        json.dump(dict(config, sliding_window=WINDOW), f)
    out = {name: load_both(paths[name]) for name in ("gemma2", "gemma3")}
    loaded = load(mistral, device=torch.device("cpu"))
    out["mistral"] = loaded, loaded.model
    afmoe = write_afmoe_gguf(afmoe_checkpoint(str(folder)), str(folder / "afmoe.gguf"), "Q8_0")
    loaded = load(afmoe, device=torch.device("cpu"))
    out["afmoe"] = loaded, loaded.model
    return out


def generate_alone(model, ids, new_tokens=NEW_TOKENS):
    """generate()'s greedy tokens for one prompt, no padding, transformers' own cache (window layers included),
    holding what the own model's holds where `model` stands for it (load_both's reference)."""
    with stored_as_own() if getattr(model, "stands_for_own", False) else contextlib.nullcontext():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             do_sample=False, max_new_tokens=new_tokens, eos_token_id=None,
                             pad_token_id=0)
    return out[0, len(ids):].tolist()


def engine_batch(loaded, prompts):
    """The engine's greedy tokens for the prompts, decoded together (left-padded to the longest)."""
    engine = Engine(loaded, eos_ids=(), prefix_cache_bytes=0)
    tokens = {}
    for number, ids in enumerate(prompts):
        def sink(event, number=number):
            if isinstance(event, Done):
                tokens[number] = event.finish.tokens
        engine.submit(Request(ids, max_tokens=NEW_TOKENS, sampling=Sampling(temperature=0), sink=sink))
    engine.run_here()
    assert engine.batch.peak_rows == len(prompts)
    return [tokens[number] for number in range(len(prompts))]


@pytest.mark.parametrize("name", ["gemma2", "gemma3", "mistral", "afmoe"])
def test_a_left_padded_batch_decodes_past_the_window_as_generate_does_each_prompt(models, name):
    loaded, reference = models[name]
    config = loaded.model.config
    assert config.sliding_window == WINDOW
    prompts = [loaded.tokenizer.encode(text) for text in PROMPTS]
    # Prompts past the window, of different lengths (padded differently); every row decodes past it.
    assert max(len(ids) for ids in prompts) > 2 * WINDOW and len({len(ids) for ids in prompts}) == len(prompts)
    with torch.inference_mode():
        alone = [generate_alone(reference, ids) for ids in prompts]
    assert engine_batch(loaded, prompts) == alone


def test_the_window_decides_these_tokens(models, tmp_path, monkeypatch):
    """The comparison above can fail: without the window (the same weights in a file whose window outlasts the
    text) the same prompts give other tokens."""
    loaded, reference = models["gemma3"]
    prompts = [loaded.tokenizer.encode(text) for text in PROMPTS]
    monkeypatch.setitem(GGUF_FAMILIES["gemma3"], "sliding_window", 4096)
    fields = default_tokenizer_fields(default_model_file(), 2048)
    unwindowed, _ = load_both(write_family_gguf(tmp_path / "gemma3.gguf", "gemma3", fields, layers=6))
    with torch.inference_mode():
        windowed = [generate_alone(reference, ids) for ids in prompts]
        assert engine_batch(unwindowed, prompts) != windowed


@pytest.mark.parametrize("name", ["gemma2", "gemma3", "mistral"])
def test_the_command_line_decodes_them_on_the_engine(models, name):
    """Piped prompts and a session's turns go to the engine, not to generate() a batch at a time."""
    from rungen.batch import open_engine
    from rungen.generation import Settings

    assert isinstance(open_engine(models[name][0], Settings(temperature=0), batch_size=4), Engine)


def test_bytes_per_token_count_every_layer(models):
    """The cache bound (max_cache_tokens) counts a position in every layer, the sliding ones too: what rows would
    take were every layer to hold all their positions (the sliding layers hold their window's last ones), each key
    and value a float16."""
    loaded, _ = models["gemma3"]
    engine = Engine(loaded, eos_ids=(), prefix_cache_bytes=0)
    config = loaded.model.config
    assert engine.bytes_per_token == config.num_hidden_layers * 2 * config.num_key_value_heads * config.head_dim * 2


def steps(engine, count):
    for _ in range(count):
        engine.admission.admit()
        engine.step()


def test_sliding_layers_let_go_of_what_their_window_no_longer_reaches_and_decode_as_generate_does(models):
    """The own model's sliding layers (gemma3's five in six) hold the window's last positions, not every one: rows
    joining a batch whose sliding layers let go of their first positions, rows ending (the batch trimmed), and a
    next turn from the prefix cache's entry of a row that let go of them give generate()'s greedy tokens over
    transformers' window cache; the full layer holds every position."""
    loaded, reference = models["gemma3"]
    engine = Engine(loaded, eos_ids=())
    prompts = [loaded.tokenizer.encode(text) for text in PROMPTS]
    tokens, requests = {}, {}

    def submit(number, ids, max_tokens):
        def sink(event):
            if isinstance(event, Done):
                tokens[number] = event.finish.tokens
        requests[number] = Request(ids, max_tokens=max_tokens, sampling=Sampling(temperature=0), sink=sink)
        engine.submit(requests[number])

    submit(0, prompts[0], 120)
    steps(engine, 80)
    layers = engine.batch.kv.cache.layers
    sliding = [layer for layer in layers if getattr(layer, "window", 0)]
    assert len(sliding) == 5 and all(layer.dropped > 0 for layer in sliding)
    length = len(prompts[0]) + 80
    assert all(layer.get_seq_length() == length for layer in layers)
    # A sliding layer's buffers: the window, MIN_ROOM and a stride of room, against every position's
    assert max(layer.buffers[0].shape[2] for layer in sliding) <= WINDOW - 1 + 2 * MIN_ROOM + 1 < length
    assert [layer.held() for layer in layers if layer not in sliding] == [length]
    submit(1, prompts[1], 70)  # joins a batch that let go of its first positions
    submit(2, prompts[2], 20)  # ends first: the batch is trimmed, its rows decode on
    engine.run_here()
    submit(3, prompts[0] + tokens[0] + loaded.tokenizer.encode(" and then"), 40)  # the next turn
    engine.run_here()
    assert requests[3].reused == len(prompts[0]) + len(tokens[0]) - 1
    with torch.inference_mode():
        for number, request in requests.items():
            assert tokens[number] == generate_alone(reference, request.ids, request.max_tokens), number


def test_a_start_the_sliding_layers_still_hold_the_window_of_is_reused_and_one_they_do_not_is_not(models):
    """A finished row's prefix cache entry whose sliding layers let go of their first positions serves a request
    that shares all but its last few tokens (a template rendering a reply's end otherwise): the layers hold the
    window before that start; not one that parts from it further back, which is prefilled afresh. Both decode as
    generate() does."""
    loaded, reference = models["gemma3"]
    engine = Engine(loaded, eos_ids=())
    prompt = loaded.tokenizer.encode(PROMPTS[0])
    got, requests = {}, {}

    def run(number, ids, max_tokens):
        requests[number] = Request(ids, max_tokens=max_tokens, sampling=Sampling(temperature=0),
                                   sink=lambda event: got.setdefault(number, event.finish.tokens)
                                   if isinstance(event, Done) else None)
        engine.submit(requests[number])
        engine.run_here()

    run(0, prompt, 100)
    [(held, (layers, *_))] = engine.prefix_cache.entries.items()
    assert min(keys.shape[2] for keys, _ in layers) < len(held)  # its sliding layers let go
    ending = loaded.tokenizer.encode(" and so on")
    run(1, list(held[: len(prompt)]) + ending, 12)  # parts where the window is gone: afresh
    assert requests[1].reused == 0
    run(2, list(held[:-3]) + ending, 12)  # parts 3 tokens before the entry's end
    assert requests[2].reused == len(held) - 3
    with torch.inference_mode():
        for number in (1, 2):
            assert got[number] == generate_alone(reference, requests[number].ids, 12), number


def test_a_prompt_longer_than_a_pass_goes_in_passes_whose_sliding_layers_let_go_between_them(models):
    """The own model's prompt in passes of OWN_PASS tokens: after it the sliding layers hold about a pass and the
    window, not the prompt; the tokens are generate()'s."""
    from rungen.prefill import OWN_PASS

    loaded, reference = models["gemma3"]
    ids = loaded.tokenizer.encode(" ".join(PROMPTS * 40))
    assert len(ids) > 2 * OWN_PASS
    engine = Engine(loaded, eos_ids=(), prefix_cache_bytes=0)
    tokens = []
    engine.submit(Request(ids, max_tokens=NEW_TOKENS, sampling=Sampling(temperature=0), n=2,  # (its rows: copies)
                          sink=lambda event: tokens.append(event.finish.tokens) if isinstance(event, Done) else None))
    engine.admission.admit()  # the prompt's passes; its keys/values join the batch
    layers = engine.batch.kv.cache.layers
    assert all(layer.get_seq_length() == len(ids) for layer in layers)
    sliding = [layer.buffers[0].shape[2] for layer in layers if getattr(layer, "window", 0)]
    assert len(sliding) == 5 and max(sliding) <= OWN_PASS + WINDOW - 1 + 2 * MIN_ROOM
    engine.run_here()
    with torch.inference_mode():
        assert tokens == [generate_alone(reference, ids)] * 2


def test_the_verbose_line_says_so_and_RUN_GENERATION_RINGS_0_holds_every_position(models, monkeypatch):
    from rungen.engine import describe_memory

    loaded, _ = models["gemma3"]
    ids = loaded.tokenizer.encode(PROMPTS[0])
    got = {}
    for rings in ("1", "0"):
        monkeypatch.setenv("RUN_GENERATION_RINGS", rings)
        engine = Engine(loaded, eos_ids=(), prefix_cache_bytes=0)
        engine.submit(Request(ids, max_tokens=90, sampling=Sampling(temperature=0), sink=lambda event: None))
        steps(engine, 80)
        got[rings] = [layer.held() for layer in engine.batch.kv.cache.layers], describe_memory(engine)
        engine.run_here()
    held, line = got["1"]
    assert "per token position (every layer's: a sliding layer holds fewer)" in line
    assert min(held) < len(ids) + 80 == max(held)
    held, line = got["0"]
    assert "sliding layer" not in line and held == [len(ids) + 80] * len(held)


def test_a_sliding_layer_holds_the_last_positions_and_goes_back_no_further_than_its_window_reaches():
    layer = SlidingLayer(WINDOW)
    states = torch.arange(200, dtype=torch.float32).reshape(1, 1, 200, 1)
    for position in range(200):
        layer.update(states[:, :, position : position + 1], -states[:, :, position : position + 1])
    assert layer.get_seq_length() == 200 and layer.dropped > 0
    assert layer.held() <= layer.keep + layer.stride
    assert torch.equal(layer.keys, states[:, :, layer.dropped:]) and torch.equal(layer.values, -layer.keys)
    reachable = layer.held() - (WINDOW - 1)  # the most it can go back: the window before the new end still held
    with pytest.raises(ValueError, match="cannot go back"):
        layer.crop(-(reachable + 1))
    layer.crop(-reachable)
    assert layer.get_seq_length() == 200 - reachable
    assert torch.equal(layer.keys, states[:, :, layer.dropped : -reachable])


def test_a_gemma3_model_is_served(models):
    from starlette.testclient import TestClient

    from rungen.server import ServeOptions, build

    loaded, reference = models["gemma3"]
    app, engine = build(loaded, ServeOptions(model_id="tiny-gemma3"))
    try:
        with TestClient(app) as client:
            response = client.post("/v1/completions", json={"model": "tiny-gemma3", "prompt": PROMPTS[0],
                                                            "max_tokens": NEW_TOKENS, "temperature": 0})
    finally:
        engine.close()
        engine.abort()
    assert response.status_code == 200, response.text
    ids = loaded.tokenizer.encode(PROMPTS[0])
    with torch.inference_mode():
        expected = loaded.tokenizer.decode(generate_alone(reference, ids), skip_special_tokens=True)
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "length" and response.json()["usage"]["completion_tokens"] == NEW_TOKENS
    assert choice["text"] == expected
