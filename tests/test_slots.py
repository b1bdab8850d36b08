"""The engine's keys/values in fixed slots (rungen/slots.py) on transformers' models of the llama-shaped families:
rows that join at different steps, end at different lengths and move into freed slots decode what generate() gives
each prompt alone; requests admitted together prefill in one pass; the slots are written in place, never
re-concatenated; a seeded draw does not depend on the batch; a finished row's keys/values serve the next request that
starts as it does; a mixture of experts (Qwen3-MoE's attention) decodes in slots where its experts read nothing back
at a step; sliding windows (Mistral's, Phi-3's, Qwen2's, Gemma's, gpt-oss's) and eager attention take the slots under
the masks their models take; Gemma 4's layers of differing shapes each take their own."""

import pytest
import torch

from helpers import HOST_DATA, HOST_READS, RINGED, rings_decode_as_generate_does, watched
from rungen.engine import Engine
from rungen.loading import load
from rungen.requests import Done, Request
from rungen.sampling import Sampling
from rungen.slots import SlotCache, takes_slots
from tiny_models import build_tiny_checkpoint, smollm3_checkpoint

PROMPTS = ["The capital of France is Paris and the capital of Germany is", "Hello, my dog",
           "Once upon a time there was a little girl", "A", "One two three four five six seven eight"]


@pytest.fixture(scope="module", params=["llama", "qwen2", "smollm3"])
def loaded(request, tmp_path_factory):
    folder = str(tmp_path_factory.mktemp(request.param))
    # (SmolLM3's every fourth layer has no rotary: the slots hold its keys as any layer's)
    path = smollm3_checkpoint(folder) if request.param == "smollm3" else build_tiny_checkpoint(request.param, folder)
    return load(path, device=torch.device("cpu"))


def generate_alone(model, ids, new_tokens):
    out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                         max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    return out[0, len(ids):].tolist()


def run(engine, requests):
    done = {}

    def sink_of(number):
        def sink(event):
            if isinstance(event, Done):
                done.setdefault(number, {})[event.index] = event.finish.tokens
        return sink

    for number, (ids, max_tokens, sampling, n) in enumerate(requests):
        engine.submit(Request(ids, max_tokens=max_tokens, sampling=sampling, sink=sink_of(number), n=n))
    engine.run_here()
    return done


LENGTHS = [3, 9, 5, 12, 7]  # new tokens of each of PROMPTS: rows end at different steps


def decodes_as_generate_does(engine, tokenizer, model, prompts=PROMPTS, lengths=LENGTHS, label=None):
    """Asserts that `engine`, three rows at a time over fixed slots (the last prompts joining as the first ones end,
    at other positions), decodes each of `prompts` greedily for its `lengths` new tokens as generate() gives it alone
    on `model`."""
    assert engine.batch.kv.slots is not None and engine.batch.kv.form.startswith("fixed slots")  # (--verbose's)
    ids = [tokenizer(prompt).input_ids for prompt in prompts]
    done = run(engine, [(i, length, Sampling(temperature=0, ignore_eos=True), 1) for i, length in zip(ids, lengths)])
    with torch.no_grad():
        for number, (i, length) in enumerate(zip(ids, lengths)):
            assert done[number][0] == generate_alone(model, i, length), (label, prompts[number])


def test_rows_in_slots_decode_what_each_prompt_gives_alone(loaded):
    assert takes_slots(loaded.model)
    engine = Engine(loaded, max_batch=3, prefix_cache_bytes=0)
    decodes_as_generate_does(engine, loaded.tokenizer, loaded.model)
    # all slots freed at the end
    assert engine.batch.peak_rows == 3 and not engine.batch.rows and not engine.batch.kv.slots.keys


def test_slots_are_written_in_place(loaded, monkeypatch):
    # A step writes each row's new position into the slots allocated when the rows joined: no step allocates
    # or concatenates keys/values (the shapes a CUDA graph of the step needs).
    ids = [loaded.tokenizer(prompt).input_ids for prompt in PROMPTS[:3]]
    engine = Engine(loaded, max_batch=4, prefix_cache_bytes=0)
    storages, steps = [], []
    step = engine.batch.step

    def watched():
        storages.append([k.data_ptr() for k in engine.batch.kv.slots.keys])
        steps.append(len(engine.batch.rows))
        step()

    update = SlotCache.update
    read = []

    def reading(cache, *args, **kwargs):  # attention reads views of the slots, never a copy of them
        keys, values = update(cache, *args, **kwargs)
        read.append(keys.data_ptr() == cache.keys[args[2]].data_ptr() and keys._base is cache.keys[args[2]])
        return keys, values

    monkeypatch.setattr(engine.batch, "step", watched)
    monkeypatch.setattr(SlotCache, "update", reading)
    run(engine, [(i, 10, Sampling(temperature=0, ignore_eos=True), 1) for i in ids])
    assert len(steps) >= 9 and all(s == storages[0] for s in storages) and engine.batch.kv.form == "fixed slots"
    assert len(read) == len(steps) * loaded.model.config.num_hidden_layers and all(read)


def test_a_seeded_draw_does_not_depend_on_the_batch(loaded):
    ids = [loaded.tokenizer(prompt).input_ids for prompt in PROMPTS]
    sampling = Sampling(temperature=1.0, top_k=20, top_p=0.9, seed=11, ignore_eos=True)
    alone = run(Engine(loaded, max_batch=4, prefix_cache_bytes=0), [(ids[1], 8, sampling, 3)])[0]
    others = [(i, 4 + number, Sampling(temperature=0.8, seed=number, ignore_eos=True), 1)
              for number, i in enumerate(ids)]
    batched = run(Engine(loaded, max_batch=4, prefix_cache_bytes=0), others[:2] + [(ids[1], 8, sampling, 3)]
                  + others[2:])[2]
    assert batched == alone and len({tuple(tokens) for tokens in alone.values()}) > 1  # three different choices


def test_a_finished_row_serves_the_next_request_that_starts_as_it_does(loaded):
    engine = Engine(loaded, max_batch=2)
    greedy = Sampling(temperature=0, ignore_eos=True)
    first = loaded.tokenizer(PROMPTS[0]).input_ids
    tokens = run(engine, [(first, 6, greedy, 1)])[0][0]
    follow = first + tokens + loaded.tokenizer(" and then").input_ids
    assert run(engine, [(follow, 5, greedy, 1)])[0][0] == generate_alone(loaded.model, follow, 5)
    # every position the first request's cache held (its last token fed only by a step launched ahead: a GPU)
    assert engine.metrics.reused_tokens == len(first) + len(tokens) - 1 + engine.batch.lookahead


def test_requests_admitted_together_prefill_in_one_pass(loaded, monkeypatch):
    # Waiting requests that fit together are prefilled in one forward pass straight into their slots: prompts of
    # other lengths (right-padded), one continuing a finished request's keys/values (the prefix cache's), one of
    # two choices (its slot copied); each decodes what generate() gives it alone.
    from rungen import batch_cache

    passes = []
    prefill_step = batch_cache.prefill_step
    monkeypatch.setattr(batch_cache, "prefill_step", lambda model, cache, first, prompts, starts, device: (
        passes.append((first, [len(p) for p in prompts], starts)), prefill_step(model, cache, first, prompts, starts,
                                                                               device))[1])
    engine = Engine(loaded, max_batch=8)
    greedy = Sampling(temperature=0, ignore_eos=True)
    first = loaded.tokenizer(PROMPTS[0]).input_ids
    tokens = run(engine, [(first, 4, greedy, 1)])[0][0]
    follow = first + tokens + loaded.tokenizer(" and").input_ids
    ids = [loaded.tokenizer(prompt).input_ids for prompt in PROMPTS[1:4]] + [follow]
    lengths = [6, 3, 8, 5]
    joins, join = [], engine.batch.join
    monkeypatch.setattr(engine.batch, "join", lambda rows, part, logits: (joins.append(len(rows)),
                                                                           join(rows, part, logits))[1])
    done = run(engine, [(i, length, greedy, 2 if number == 1 else 1)
                        for number, (i, length) in enumerate(zip(ids, lengths))])
    assert len(passes) == 1 and joins == [5]  # one pass, and the five rows' first tokens picked in one read
    slot, fed, starts = passes[0]
    assert slot == 0 and [start + count for start, count in zip(starts, fed)] == [len(i) for i in ids]
    assert starts[3] >= len(first)  # the follow-up's prefix came from the cache
    with torch.no_grad():
        for number, (i, length) in enumerate(zip(ids, lengths)):
            expected = generate_alone(loaded.model, i, length)
            assert all(choice == expected for choice in done[number].values()), number
    assert len(done[1]) == 2 and engine.batch.peak_rows == 5


def test_prefills_together_can_be_turned_off(loaded, monkeypatch):
    # RUN_GENERATION_PREFILL_TOGETHER=0 (what benchmarks/gpu.py compares with): each request prefilled alone.
    from rungen import batch_cache

    monkeypatch.setenv(batch_cache.PREFILL_ENV, "0")
    monkeypatch.setattr(batch_cache, "prefill_step", lambda *args: pytest.fail("prefilled together"))
    engine = Engine(loaded, max_batch=4, prefix_cache_bytes=0)
    ids = [loaded.tokenizer(prompt).input_ids for prompt in PROMPTS[:3]]
    done = run(engine, [(i, 3, Sampling(temperature=0, ignore_eos=True), 1) for i in ids])
    with torch.no_grad():
        assert [done[number][0] for number in range(3)] == [generate_alone(loaded.model, i, 3) for i in ids]


def test_slot_cache_grows_by_copying_what_it_holds():
    # Slots for the rows' bucket (what a captured step runs: 1, 2, 4, then multiples of 8), positions in multiples of
    # 256: one prompt holds one row's keys/values, not a bucket of eight.
    cache = SlotCache(layers=1, max_slots=64, max_positions=4096)
    like = [(torch.zeros(1, 2, 1, 4), torch.zeros(1, 2, 1, 4))]
    cache.ensure(1, 10, like)
    assert (cache.slots, cache.capacity) == (1, 256)
    cache.ensure(2, 10, like)
    assert (cache.slots, cache.capacity) == (2, 256)
    keys = torch.randn(1, 2, 10, 4)
    cache.write(1, [(keys, -keys)])
    cache.rows = 2
    cache.ensure(3, 10, like)
    assert (cache.slots, cache.capacity) == (4, 256)
    cache.ensure(9, 300, like)  # more rows and a longer request: new buffers, the rows in use copied
    assert (cache.slots, cache.capacity) == (16, 512)
    torch.testing.assert_close(cache.row_layers(1, 10)[0][0], keys)
    torch.testing.assert_close(cache.row_layers(1, 10)[0][1], -keys)
    cache.move(1, 0, 10)
    torch.testing.assert_close(cache.row_layers(0, 10)[0][0], keys)


def test_replayed_steps_pad_the_rows_to_their_bucket(loaded, monkeypatch):
    # What the CUDA graphs run, with a replay that runs the step again on the graph's static inputs (the capture
    # itself needs a GPU: tests/test_cuda.py): rows padded to 1, 2, 4, 8... write position 0 of free slots and
    # their logits are never read, so the tokens are the eager steps'.
    from rungen import slots

    class Replay:
        def __init__(self, run):
            self.replay = run

    def capture(graphs, bucket, length, tokens, positions):
        static_tokens, static_positions = tokens.new_zeros((bucket, 1)), positions.new_zeros(bucket)
        static_tokens[: tokens.shape[0]], static_positions[: tokens.shape[0]] = tokens, positions  # as the warm-up
        logits = slots.decode_step(graphs.model, graphs.cache, static_tokens, static_positions, length)

        def run():
            logits.copy_(slots.decode_step(graphs.model, graphs.cache, static_tokens, static_positions, length))

        captured.append((bucket, length))
        graphs.graphs[bucket, length] = Replay(run), static_tokens, static_positions, logits
        return graphs.graphs[bucket, length]

    captured = []
    monkeypatch.setattr(slots.DecodeGraphs, "capture", capture)
    ids = [loaded.tokenizer(prompt).input_ids for prompt in PROMPTS]
    greedy = Sampling(temperature=0, ignore_eos=True)
    eager = run(Engine(loaded, max_batch=5, prefix_cache_bytes=0), [(i, n, greedy, 1) for i, n in zip(ids, LENGTHS)])
    engine = Engine(loaded, max_batch=5, prefix_cache_bytes=0)
    engine.batch.kv.graphs = slots.DecodeGraphs(engine.model, engine.batch.kv.slots)
    replayed = run(engine, [(i, n, greedy, 1) for i, n in zip(ids, LENGTHS)])
    assert replayed == eager
    assert {bucket for bucket, _ in captured} == {8, 4, 2, 1} and len(captured) == len(set(captured))  # once each


def test_a_model_spread_over_two_gpus_decodes_on_the_padded_batch(loaded, monkeypatch):
    # --device_map over two GPUs: each layer's keys/values on its own device, where fixed slots (one device's) cannot
    # follow; layers offloaded to the CPU or disk run on the first GPU, so slots serve (each request prefilled alone).
    from rungen.batch_cache import PaddedBatch, SlotBatch, batch_cache

    def form(device_map):
        monkeypatch.setattr(loaded.model, "hf_device_map", device_map, raising=False)
        return batch_cache(loaded.model, torch.device("cpu"), True, 4, 64)

    assert isinstance(form({"model.layers.0": 0, "model.layers.1": 1}), PaddedBatch)
    offloaded = form({"model.layers.0": 0, "model.layers.1": "cpu", "lm_head": "disk"})
    assert isinstance(offloaded, SlotBatch) and not offloaded.prefills_together
    assert isinstance(form({"": 0}), SlotBatch) and form({"": 0}).prefills_together


def test_a_decode_step_neither_waits_for_the_device_nor_takes_host_data(loaded, monkeypatch):
    """What a CUDA graph's capture of the step and a step launched ahead of the host's reading need, read off the
    operators on the CPU (tests/test_cuda.py checks it on a GPU under torch's sync debug mode): the decode step reads
    nothing back to the host and makes no tensor of host data; the sampler, with every processor at once as on a
    GPU, reads nothing back (its settings are copied in, without waiting)."""
    import rungen.batch_cache
    import rungen.decode
    from rungen import sampling

    monkeypatch.setattr(sampling, "together_on", lambda device: True)
    step, steps = watched(rungen.batch_cache.decode_step, HOST_READS | HOST_DATA)
    pick, picks = watched(rungen.decode.pick, HOST_READS)
    monkeypatch.setattr(rungen.batch_cache, "decode_step", step)
    monkeypatch.setattr(rungen.decode, "pick", pick)
    engine = Engine(loaded, max_batch=4, prefix_cache_bytes=0)
    samplings = [Sampling(temperature=0, ignore_eos=True),
                 Sampling(temperature=0.9, top_p=0.9, top_k=20, min_p=0.05, seed=1, ignore_eos=True),
                 Sampling(temperature=0.7, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.25,
                          logit_bias=((4, 2.5),), seed=2, ignore_eos=True)]
    for number, each in enumerate(samplings):
        engine.submit(Request(loaded.tokenizer(PROMPTS[number]).input_ids, 12, each, sink=lambda event: None,
                              logprobs=2 if number else None))
    engine.run_here()
    assert len(steps) == 11 and len(picks) == 12  # the first token comes from the prefill
    assert steps == [[]] * 11 and picks == [[]] * 12


def test_one_prompt_holds_one_rows_keys_and_values(loaded):
    # An engine that may batch 16 rows, given one prompt (the command line's --prompt): while it decodes, its cache
    # is one slot of the positions the request reserves, rounded up to 256 (the tiny model's whole context of 128
    # here), not a bucket of rows.
    engine = Engine(loaded, max_batch=16, prefix_cache_bytes=0)
    slots, held = engine.batch.kv.slots, []

    def sink(event):
        bytes_held = sum(t.numel() * t.element_size() for t in slots.keys + slots.values)
        held.append((slots.slots, slots.capacity, bytes_held))

    ids = loaded.tokenizer(PROMPTS[0]).input_ids
    engine.submit(Request(ids, max_tokens=5, sampling=Sampling(temperature=0, ignore_eos=True), sink=sink))
    engine.run_here()
    positions = min(256, loaded.context)
    assert {figures for figures in held if figures[0]} == {(1, positions, positions * engine.bytes_per_token)}


class GatheredExperts(torch.nn.Module):
    """transformers' Experts computation with nothing read back to the host (each pair's expert's weights gathered
    on the device): on the CPU, the stand-in of a GPU's experts in codes (rungen/gguf/device_experts.py), for the
    slots' mixture families."""

    captures_decode, most_pairs = True, 24

    def __init__(self, experts):
        super().__init__()
        self.gate_up, self.down, self.act_fn = experts.gate_up_proj, experts.down_proj, experts.act_fn

    def forward(self, hidden_states, top_k_index, top_k_weights):
        tokens, chosen = top_k_index.shape
        experts = top_k_index.reshape(-1)
        rows = hidden_states.repeat_interleave(chosen, dim=0)
        gate, up = torch.bmm(self.gate_up[experts], rows[:, :, None])[..., 0].chunk(2, dim=-1)
        done = torch.bmm(self.down[experts], (self.act_fn(gate) * up)[:, :, None])[..., 0]
        return (done * top_k_weights.reshape(-1, 1)).view(tokens, chosen, -1).sum(dim=1)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_a_mixture_whose_experts_read_nothing_back_decodes_in_slots(loaded, family, monkeypatch):
    # Qwen3-MoE's attention is qwen3's, Mixtral's llama's: its rows decode in slots, as generate() gives each prompt
    # alone, where every layer's experts read nothing back to the host at a step: transformers' own in their
    # grouped_mm form (their default; a decode step reads nothing back, as a CUDA graph needs), not in their eager
    # form (which reads the experts a step chose); a GPU's coded experts, whose step of more rows than their grouped
    # pairs take (their most_pairs over the experts a token takes) is not captured.
    import copy

    from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    import rungen.batch_cache
    from rungen.loading import Loaded
    from rungen.slots import DecodeGraphs, captured_rows

    torch.manual_seed(0)
    shape = dict(vocab_size=loaded.vocab_size, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, num_experts_per_tok=2, max_position_embeddings=loaded.context)
    if family == "mixtral":
        theirs = MixtralForCausalLM(MixtralConfig(**shape, intermediate_size=32, num_local_experts=4)).eval()
    else:
        theirs = Qwen3MoeForCausalLM(Qwen3MoeConfig(**shape, intermediate_size=128, head_dim=16,
                                                    moe_intermediate_size=32, num_experts=4)).eval()
    assert theirs.config._experts_implementation == "grouped_mm" and takes_slots(theirs)
    assert captured_rows(theirs) is None  # (any rows)
    eager = copy.deepcopy(theirs)
    eager.set_experts_implementation("eager")
    assert not takes_slots(eager)
    step, steps = watched(rungen.batch_cache.decode_step, HOST_READS | HOST_DATA)
    monkeypatch.setattr(rungen.batch_cache, "decode_step", step)
    grouped = Loaded(theirs, loaded.tokenizer, family, torch.device("cpu"), loaded.context, loaded.vocab_size)
    decodes_as_generate_does(Engine(grouped, max_batch=3, prefix_cache_bytes=0), loaded.tokenizer, theirs,
                             label=family)
    assert steps and steps == [[]] * len(steps)
    model = copy.deepcopy(theirs)
    for layer in model.model.layers:
        layer.mlp.experts = GatheredExperts(layer.mlp.experts)
    assert takes_slots(model) and captured_rows(model) == 24 // 2
    graphs = DecodeGraphs(model, SlotCache(2, 16, 256))
    assert graphs.most_rows == 12
    moe = Loaded(model, loaded.tokenizer, family, torch.device("cpu"), loaded.context, loaded.vocab_size)
    decodes_as_generate_does(Engine(moe, max_batch=3, prefix_cache_bytes=0), loaded.tokenizer, theirs, label=family)


# Attention over the slots as each family's model takes its mask: a sliding window where the config has one (every
# layer's for Mistral and Phi-3, a dict of the full and the sliding layers' masks for the families whose config lists
# layer_types), and an additive float mask for eager attention (transformers adds it to the scores: a boolean one
# would add 1 to the positions it means to keep). gpt-oss's attention is eager (its sinks) and sliding on every other
# layer; Gemma 2's eager too (its soft-capping).
WINDOWED = {
    "llama, eager": ("LlamaConfig", {}, "eager"),
    "mistral": ("MistralConfig", dict(sliding_window=4), "sdpa"),
    "phi3": ("Phi3Config", dict(sliding_window=4, pad_token_id=0), "sdpa"),
    "qwen2": ("Qwen2Config", dict(use_sliding_window=True, sliding_window=4, max_window_layers=1), "sdpa"),
    "gemma2": ("Gemma2Config", dict(sliding_window=4, head_dim=16), "eager"),
    "gemma3_text": ("Gemma3TextConfig", dict(sliding_window=4, head_dim=16,
                                             layer_types=["sliding_attention", "full_attention"]), "sdpa"),
    "gpt_oss": ("GptOssConfig", dict(sliding_window=4, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                                     intermediate_size=32), "eager"),
    # and on the attention the tool gives it (rungen/sinks_attention.py: sdpa's boolean masks), which gives eager's
    # tokens
    "gpt_oss, sinks attention": ("GptOssConfig", dict(sliding_window=4, head_dim=16, num_local_experts=4,
                                                      num_experts_per_tok=2, intermediate_size=32), "sinks"),
}


@pytest.fixture(scope="module")
def llama_tokenizer(tmp_path_factory):
    return load(build_tiny_checkpoint("llama", str(tmp_path_factory.mktemp("llama"))),
                device=torch.device("cpu"))


@pytest.mark.parametrize("family", list(WINDOWED))
def test_sliding_windows_and_eager_attention_decode_in_slots_as_generate_does(llama_tokenizer, family):
    # Rows joining and ending at different steps, prompts longer than the window, decode in slots what generate()
    # gives each prompt alone (its caches keep the window); with the window opened the text differs, so the window
    # is what the slots apply.
    import copy

    import transformers

    from rungen.loading import Loaded

    source = llama_tokenizer
    name, fields, attention = WINDOWED[family]
    torch.manual_seed(0)
    config = getattr(transformers, name)(vocab_size=source.vocab_size, hidden_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=source.context, **fields)
    model = transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation="eager" if attention == "sinks" else attention).eval()
    eager = copy.deepcopy(model)
    if attention == "sinks":
        from rungen.sinks_attention import SINKS_ATTENTION, use_sinks_attention

        assert use_sinks_attention(model) and model.config._attn_implementation == SINKS_ATTENTION
    for module in model.modules():  # gpt-oss's experts: read as a GPU's coded ones are (nothing back to the host)
        if type(module).__name__.endswith("Experts"):
            module.captures_decode, module.most_pairs = True, 24
    assert takes_slots(model)
    engine = Engine(Loaded(model, source.tokenizer, family, torch.device("cpu"), source.context, source.vocab_size),
                    max_batch=3, prefix_cache_bytes=0)
    decodes_as_generate_does(engine, source.tokenizer, model, label=family)
    ids = [source.tokenizer(prompt).input_ids for prompt in PROMPTS]
    with torch.no_grad():
        if attention == "sinks":
            assert all(generate_alone(model, i, 12) == generate_alone(eager, i, 12) for i in ids)
        if "sliding_window" in fields:
            opened = copy.deepcopy(model)
            opened.config.sliding_window = 10_000
            assert any(generate_alone(opened, i, 12) != generate_alone(model, i, 12) for i in ids), family



@pytest.mark.parametrize("variant", ["e2b", "31b", "26b-a4b"])
def test_gemma_4_decodes_in_slots_as_generate_does(variant, tmp_path):
    # Gemma 4's layers differ (its full layers' heads and head size; E2B's last layers reading earlier ones' keys,
    # holding none; 26B-A4B's experts beside the MLP, transformers' grouped_mm ones): the slots take each layer's
    # shapes as a pass writes them. Rows joining and ending, prompts past the window of 8, a prompt again (the
    # prefix cache's keys into a slot): what generate() gives each prompt alone.
    from tiny_models import gemma4_checkpoint

    loaded = load(gemma4_checkpoint(str(tmp_path), variant), device=torch.device("cpu"))
    experts = [m for m in loaded.model.modules() if type(m).__name__.endswith("Experts")]
    assert bool(experts) == (variant == "26b-a4b")
    assert takes_slots(loaded.model)
    engine = Engine(loaded, max_batch=3)
    reused = []
    longest = engine.prefix_cache.longest
    engine.prefix_cache.longest = lambda tokens, **kwargs: reused.append(longest(tokens, **kwargs)[0]) or \
        longest(tokens, **kwargs)
    decodes_as_generate_does(engine, loaded.tokenizer, loaded.model, PROMPTS + PROMPTS[:1], LENGTHS + [10], variant)
    assert max(reused) > 0  # (the last prompt's keys from the cache)
    # each layer that holds keys its own shapes: E2B's last two hold none; 31B's full layers one head of 64
    config = loaded.model.config
    shapes = engine.batch.kv.shapes
    assert len(shapes) == config.num_hidden_layers - (2 if variant == "e2b" else 0)
    for kind, (keys, _) in zip(config.layer_types, shapes):
        full = kind == "full_attention"
        assert keys == ((1, 64) if full and variant == "31b" else (2, 64) if full else (2, 32)), (variant, kind)


@pytest.mark.parametrize("family", list(RINGED))
def test_sliding_layers_hold_rings_and_decode_as_generate_does(family, monkeypatch, tmp_path):
    # tests/helpers.py's rings_decode_as_generate_does on the CPU (tests/test_cuda.py: on a GPU)
    rings_decode_as_generate_does(family, torch.device("cpu"), monkeypatch, tmp_path)


# More of transformers' families whose attention takes the slots as llama's does (Gemma 1, Granite, OLMo 1-3, Command
# R and R7B, StarCoder2, Phi-2, EXAONE 4, ERNIE 4.5, Seed-OSS, Apertus, AFM/Arcee, StableLM, GLM and GLM-4, InternLM3,
# Helium, Hunyuan, Nemotron, BitNet, Ministral and Ministral 3, VaultGemma, Granite's sliding one, CWM, Jais 2,
# IQuest-Coder, HyperCLOVA X, nanochat, Doge, Diff Transformer, Flint, Gemma 4's unified text model; and the older
# ones the original script served: GPT-2, GPT-NeoX, GPT-J, CodeGen, GPTBigCode, Falcon, OPT, MPT's ALiBi, XGLM,
# BioGPT), their configs' defaults at a tiny size (a head of 16 where the default sets none; GPT-J's and CodeGen's
# rotary over 8 of it); the sliding ones (Command R7B, OLMo 3, EXAONE 4, Ministral, VaultGemma, Granite's, CWM,
# Gemma 4's by layer type, StarCoder2, Ministral 3 and Doge on every layer) with a window of 4. No EOS (generate()'s
# min_new_tokens would forbid it where the engine's rows just go on: StableLM's 0; CWM's config takes a BOS only as an
# integer).
WINDOW = {"sliding_window": 4}
MORE = {"gemma": {}, "granite": {}, "olmo": {}, "olmo2": {}, "olmo3": WINDOW, "cohere": {}, "cohere2": WINDOW,
        "starcoder2": WINDOW, "phi": {}, "exaone4": WINDOW, "ernie4_5": {}, "seed_oss": {}, "apertus": {}, "arcee": {},
        "stablelm": {}, "glm": {}, "glm4": {}, "internlm3": {}, "helium": {"head_dim": 16},
        "hunyuan_v1_dense": {"head_dim": 16}, "nemotron": {}, "bitnet": {}, "ministral": {"head_dim": 16, **WINDOW},
        "ministral3": WINDOW, "vaultgemma": {"head_dim": 16, **WINDOW}, "granite_swa": WINDOW,
        "cwm": {"bos_token_id": 0, **WINDOW}, "jais2": {}, "iquestcoder": {}, "hyperclovax": {}, "nanochat": {},
        "doge": WINDOW, "diffllama": {}, "flint": WINDOW, "gemma4_unified_text": WINDOW,
        "gpt2": {}, "gpt_neox": {}, "gptj": {"rotary_dim": 8}, "codegen": {"rotary_dim": 8}, "gpt_bigcode": {},
        "falcon": {"new_decoder_architecture": True, "num_kv_heads": 2}, "opt": {}, "mpt": {}, "xglm": {},
        "biogpt": {}}


# More mixtures of experts whose attention takes the slots, transformers' own experts in their grouped_mm form (their
# default): OLMoE, FlexOlmo, Granite's, Phi-MoE, GLM-4.5's, Hunyuan's, ERNIE 4.5's, EXAONE's, Command's, AFMoE,
# Solar Open; 4 experts, 2 a token.
MORE_MIXTURES = {"olmoe": dict(num_experts=4, num_experts_per_tok=2), "flex_olmo": dict(num_experts=4,
                 num_experts_per_tok=2), "granitemoe": dict(num_local_experts=4, num_experts_per_tok=2),
                 "phimoe": dict(num_local_experts=4, num_experts_per_tok=2),
                 "glm4_moe": dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                  first_k_dense_replace=1, n_group=1, topk_group=1),
                 "hunyuan_v1_moe": dict(num_experts=4, moe_topk=2, head_dim=16),
                 "ernie4_5_moe": dict(moe_num_experts=4, moe_k=2, moe_intermediate_size=32),
                 "exaone_moe": {}, "cohere2_moe": {}, "afmoe": {}, "solar_open": {}}


@pytest.mark.parametrize("family", list(MORE) + list(MORE_MIXTURES))
def test_more_families_decode_in_slots_as_generate_does(llama_tokenizer, family):
    import transformers

    from rungen.loading import Loaded

    source = llama_tokenizer
    config = transformers.AutoConfig.for_model(
        family, vocab_size=source.vocab_size, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=64, max_position_embeddings=source.context,
        **{"bos_token_id": None, "eos_token_id": None, "pad_token_id": None, **{**MORE, **MORE_MIXTURES}[family]})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    assert takes_slots(model) and (family not in MORE_MIXTURES or config._experts_implementation == "grouped_mm")
    engine = Engine(Loaded(model, source.tokenizer, family, torch.device("cpu"), source.context, source.vocab_size),
                    max_batch=3, prefix_cache_bytes=0)
    decodes_as_generate_does(engine, source.tokenizer, model, label=family)


def test_falcons_alibi_models_decode_on_the_padded_batch(llama_tokenizer):
    # Falcon's ALiBi models (Falcon-RW) build their bias from a 2D mask, which the slots' 4D one is not: they take the
    # padded batch, and decode there as generate() gives each prompt alone.
    import transformers

    from rungen.loading import Loaded

    source = llama_tokenizer
    config = transformers.AutoConfig.for_model(
        "falcon", vocab_size=source.vocab_size, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        alibi=True, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    assert not takes_slots(model)
    engine = Engine(Loaded(model, source.tokenizer, "falcon", torch.device("cpu"), source.context, source.vocab_size),
                    max_batch=3, prefix_cache_bytes=0)
    assert engine.batch.kv.form == "a left-padded batch"  # (what --verbose says)
    ids = [source.tokenizer(prompt).input_ids for prompt in PROMPTS]
    done = run(engine, [(i, length, Sampling(temperature=0, ignore_eos=True), 1) for i, length in zip(ids, LENGTHS)])
    with torch.no_grad():
        for number, (i, length) in enumerate(zip(ids, LENGTHS)):
            assert done[number][0] == generate_alone(model, i, length), PROMPTS[number]
