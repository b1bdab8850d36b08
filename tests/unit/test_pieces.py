"""Fast tier: the pure pieces of the pipeline, no model (a tokenizer at most). `pytest tests/unit`."""

import dataclasses
import io
import json
import sys

import pytest
import torch
from transformers import DynamicCache

import run_generation
import rungen.arguments
from rungen.arguments import max_memory_map, parse_args, settings_from_args
from rungen.errors import UsageError
from rungen.generation import (
    UNBOUNDED_LENGTH,
    Sequence,
    Settings,
    adjust_length_to_model,
    describe_sequence,
    generation_kwargs,
    make_batches,
)
from rungen.jit import _served_by_graph
from rungen.output import Writer
from rungen.prompts import Prompt, parse_prompt_line, read_prompts

# Prompts


def test_text_and_jsonl_lines():
    assert parse_prompt_line(3, "Hello".encode(), "text") == Prompt(3, "Hello")
    line = json.dumps({"prompt": "Hi", "id": 7, "meta": {"a": 1}}).encode()
    assert parse_prompt_line(0, line, "jsonl") == Prompt(0, "Hi", extra={"id": 7, "meta": {"a": 1}})


@pytest.mark.parametrize(
    "line, input_format, error",
    [
        (b"caf\xe9 au lait", "text", "input is not valid UTF-8 (invalid continuation byte at byte 3)"),
        (b"{not json", "jsonl", "input: not valid JSON ("),
        (b'{"text": "no prompt field"}', "jsonl", 'a jsonl input line must be an object with a string "prompt"'),
        (b'["a list"]', "jsonl", 'a jsonl input line must be an object with a string "prompt"'),
        # fields a user would take for settings: refused, not carried and left undone
        (b'{"prompt": "Hi", "temperature": 0, "max_tokens": 3}', "jsonl", 'the field "max_tokens" is a request '
                                                                           'setting, which a jsonl line does not set'),
        (b'{"prompt": "Hi", "tools": []}', "jsonl", 'the field "tools" goes with a "messages" conversation'),
        (b'{"messages": [{"role": "robot", "content": "Hi"}]}', "jsonl",
         '"messages": messages[0].role "robot" is not supported'),
        (b'{"messages": [{"role": "user", "content": 5}]}', "jsonl",
         '"messages": messages[0].content must be a string'),
    ],
)
def test_unreadable_lines_become_error_records(line, input_format, error):
    prompt = parse_prompt_line(5, line, input_format)
    assert prompt.index == 5 and prompt.error.startswith(error)


@pytest.mark.parametrize("input_format", ["text", "jsonl"])
def test_a_byte_order_mark_starting_stdin_is_no_part_of_a_prompt(input_format, monkeypatch):
    lines = [b"Hello", b"World"] if input_format == "text" else [b'{"prompt": "Hello"}', b'{"prompt": "World"}']
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"\xef\xbb\xbf" + b"\r\n".join(lines))))
    prompts = read_prompts(None, input_format=input_format)
    assert [(prompt.text, prompt.error) for prompt in prompts] == [("Hello", None), ("World", None)]


def test_whole_stdin_is_one_prompt_with_a_windows_files_line_breaks_read_as_text_and_nothing_is_none(monkeypatch):
    for data, texts in ((b"Line one\r\nLine two\r\n", ["Line one\nLine two\n"]), (b" \r\n\n", [])):
        monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data)))
        assert [prompt.text for prompt in read_prompts(None, whole_stdin=True)] == texts


def test_a_prompt_the_context_leaves_too_little_room_is_said_not_silently_cut(caplog):
    import types

    from rungen.prompts import warn_short_room

    loaded = types.SimpleNamespace(context=128)
    prompt = Prompt(2, "x", ids=[1] * 120)
    for length, said in ((20, True), (8, False), (-1, False), (500, False)):  # -1, past the context: all it has
        caplog.clear()
        warn_short_room(loaded, prompt, length)
        assert ("prompt 3: its 120 tokens leave room for 8 of the 20 new tokens" in caplog.text) == said
    caplog.clear()
    warn_short_room(types.SimpleNamespace(context=0), prompt, 20)  # a context not known: nothing to say
    assert caplog.text == ""


def test_template_flags_are_refused_where_no_line_goes_through_the_template():
    jsonl_args = ["--input_format", "jsonl"]
    text_line = parse_prompt_line(0, b'{"prompt": "Hi"}', "jsonl")
    conversation = parse_prompt_line(1, b'{"messages": [{"role": "user", "content": "Hi"}]}', "jsonl")
    for flags in (["--system", "S"], ["--chat_template_kwargs", '{"enable_thinking": false}']):
        with pytest.raises(UsageError, match="no line is a conversation: add --chat"):
            rungen.arguments.check_template_flags(parse_args(jsonl_args + flags), [text_line])
        for args, prompts in ((jsonl_args + flags, [text_line, conversation]), (jsonl_args + flags + ["--chat"],
                              [text_line]), (jsonl_args + flags + ["--no-chat"], [conversation])):
            rungen.arguments.check_template_flags(parse_args(args), prompts)  # a line it applies to


def test_a_conversations_text_parts_are_joined_and_a_developer_message_is_a_system_one():
    line = (b'{"messages": [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": [{"type": '
            b'"text", "text": "<ctx>"}, {"type": "text", "text": "Capital of France?"}]}], "id": 7}')
    prompt = parse_prompt_line(0, line, "jsonl")
    assert prompt.error is None and prompt.text == "<ctx>\nCapital of France?"
    assert prompt.messages == [{"role": "system", "content": "Be brief."},
                               {"role": "user", "content": "<ctx>\nCapital of France?"}]
    assert prompt.extra["id"] == 7 and prompt.extra["messages"][1]["content"][0]["text"] == "<ctx>"  # carried as given


# Batching


def test_batches_group_similar_lengths_within_a_window_and_keep_every_prompt():
    lengths = [5, 1, 4, 2, 3, 9, 8, 7, 6, 10]
    prompts = [Prompt(i, "x", ids=[0] * n) for i, n in enumerate(lengths)]
    batches = list(make_batches(prompts, 2))  # sorted inside a window of 8; the last 2 come after it
    assert [[len(p.ids) for p in batch] for batch in batches] == [[1, 2], [3, 4], [5, 7], [8, 9], [6, 10]]
    assert sorted(p.index for batch in batches for p in batch) == list(range(10))


def test_length_is_clamped_to_the_context():
    assert adjust_length_to_model(20, 128) == 20
    assert adjust_length_to_model(-1, 128) == 128
    assert adjust_length_to_model(500, 128) == 128
    assert adjust_length_to_model(-1, 0) == UNBOUNDED_LENGTH


# Output


def sequence(text, tokens=3):
    return Sequence(text, "p" + text, 1, tokens, "length")


def test_writer_keeps_input_order_and_flushes_as_soon_as_it_can(capsys):
    writer = Writer("jsonl", 3)
    writer.add(Prompt(1, "b"), [sequence("B")])
    assert capsys.readouterr().out == ""  # prompt 0 is not done: nothing may be written yet
    writer.add(Prompt(0, "a", extra={"id": "x"}), [sequence("A"), sequence("A2")])
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["prompt_index"], r["sequence_index"]) for r in records] == [(0, 0), (0, 1), (1, 0)]
    assert records[0] == {"prompt_index": 0, "sequence_index": 0, "prompt": "a", "generated_text": "A",
                          "text": "pA", "num_prompt_tokens": 1, "num_generated_tokens": 3,
                          "finish_reason": "length", "id": "x"}
    writer.add(Prompt(2, None, error="bad"))
    assert json.loads(capsys.readouterr().out) == {"prompt_index": 2, "prompt": None, "error": "bad"}
    assert (writer.failed, writer.tokens, writer.sequences) == (1, 9, ["pA", "pA2", "pB"])


def test_an_error_record_keeps_the_lines_own_fields_and_never_lets_them_overwrite_its_own(capsys):
    """A batch's user joins results on their own id (custom_id): error records carry it too; a field named as
    one of the record's is the error, and cannot pass the record off as another line's, or as no error."""
    lines = [b'{"messages": "oops", "prompt_index": 7, "error": null, "custom_id": "c0"}',
             b'{"prompt": "Hi", "error": "mine", "custom_id": "c1"}',
             b'{"messages": [{"role": "user", "content": "Hi"}], "generated_text": "x", "custom_id": "c2"}']
    writer = Writer("jsonl", 3)
    for index, line in enumerate(lines):
        writer.add(parse_prompt_line(index, line, "jsonl"))
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["prompt_index"], r["custom_id"]) for r in records] == [(0, "c0"), (1, "c1"), (2, "c2")]
    assert records[0]["error"] == '"messages": must be a non-empty list'
    assert [r["error"] for r in records[1:]] == [f'the field "{name}" is one the output record writes; rename it'
                                                 for name in ("error", "generated_text")]
    assert "generated_text" not in records[2] and records[1]["prompt"] == "Hi"


def test_text_blocks_errors_on_stderr_and_streamed_text_printed_once(capsys):
    writer = Writer("text", 2)
    writer.add(Prompt(0, "a"), [sequence("A")])
    writer.add(Prompt(1, "b", error="too long"))
    out, err = capsys.readouterr()
    assert out == "=== PROMPT 1, GENERATED SEQUENCE 1 ===\npA\n"
    assert err == "run_generation.py: prompt 2: error: too long\n"
    single = Writer("text", 1)
    single.add(Prompt(0, "a"), [sequence("A")], streamed=True)
    assert capsys.readouterr().out == "" and single.sequences == ["pA"]


# Decoding a sequence


def test_eos_ends_a_sequence_and_its_text(gpt2_tokenizer):
    tok = gpt2_tokenizer
    prompt = Prompt(0, "Hello", ids=tok.encode("Hello"))
    new = tok.encode(" dog cat") + [tok.eos_token_id, tok.eos_token_id]
    described = describe_sequence(Settings(), tok, prompt, new, {tok.eos_token_id})
    assert described == Sequence(" dog cat", "Hello dog cat", len(prompt.ids), len(new) - 1, "eos")


def test_an_end_that_is_no_special_token_is_none_of_the_text(gpt2_tokenizer):
    # a file's end-of-turn token may be an ordinary one (llama.cpp ends generation at it all the same, unprinted)
    tok = gpt2_tokenizer
    prompt = Prompt(0, "Hello", ids=tok.encode("Hello"))
    [end] = tok.encode(" cat")
    described = describe_sequence(Settings(), tok, prompt, tok.encode(" dog") + [end], {end, tok.eos_token_id})
    assert (described.generated_text, described.num_generated_tokens, described.finish_reason) == (" dog", 2, "eos")


def test_stop_token_cuts_the_continuation_not_the_prompt(gpt2_tokenizer):
    tok = gpt2_tokenizer
    prompt = Prompt(0, "a.b", ids=tok.encode("a.b"))
    new = tok.encode(" dog. cat")
    described = describe_sequence(Settings(stop_token="."), tok, prompt, new, set())
    assert (described.generated_text, described.text, described.finish_reason) == (" dog", "a.b dog", "stop_token")


def test_chat_prints_the_reply_alone(gpt2_tokenizer):
    tok = gpt2_tokenizer
    prompt = Prompt(0, "Hi", ids=tok.encode("Hi"))
    described = describe_sequence(Settings(chat=True), tok, prompt, tok.encode(" there"), set())
    assert described.text == described.generated_text == " there"


def test_generate_kwargs(gpt2_tokenizer):
    greedy = generation_kwargs(Settings(temperature=0), gpt2_tokenizer)
    assert greedy["do_sample"] is False and "temperature" not in greedy
    sampled = generation_kwargs(Settings(temperature=0.7, top_k=5, top_p=0.8, stop_token="\n"), gpt2_tokenizer)
    assert (sampled["do_sample"], sampled["temperature"], sampled["top_k"], sampled["top_p"]) == (True, 0.7, 5, 0.8)
    assert sampled["stop_strings"] == "\n" and sampled["tokenizer"] is gpt2_tokenizer


def test_settings_from_flags_clamp_the_length():
    settings = settings_from_args(parse_args(["--length", "500", "--temperature", "0", "--k", "3"]), context=128)
    assert (settings.length, settings.temperature, settings.top_k) == (128, 0, 3)
    assert dataclasses.replace(settings, temperature=0.5).temperature == 0.5


# Arguments


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--k", "-1"], "--k must be >= 0, got -1"),
        (["--num_beams", "2", "--num_return_sequences", "3"], "--num_return_sequences cannot exceed --num_beams"),
        (["--batch_size", "0"], "--batch_size must be >= 1"),
        (["--max_memory", "cpu=1GB"], "--max_memory needs --device_map"),
        (["--device_map", "auto", "--max_memory", "0=10MiB,cpu=1GiB"],
         "--max_memory 0=10MiB,cpu=1GiB: SIZE is bytes or a number with a unit"),
        (["--device_map", "auto", "--max_memory", "gpu0=1GiB"], "--max_memory gpu0=1GiB: takes DEVICE=SIZE items"),
        (["--device_map", "auto", "--max_memory", "10GiB"], "--max_memory 10GiB: takes DEVICE=SIZE items"),
        (["--model_type", "transfo-xl"], "Transformer-XL was removed"),
        # flags the run would not read
        (["--prompt", "hi", "--system", "Be brief."], "--system is the chat template's system message: add --chat"),
        (["--prompt", "hi", "--input_format", "jsonl"], "--input_format is how stdin is read; with --prompt"),
        (["--whole_stdin", "--input_format", "jsonl"], "--whole_stdin reads stdin as one text prompt"),
        (["--port", "9000"], "--port is a server setting: it needs --serve"),
        (["--fp16", "--dtype", "float32"], "--fp16 is --dtype float16; with --dtype float32 choose one"),
        # on a machine without a GPU (as this test makes every machine)
        (["--device_map", "cuda:0"], "--device_map cuda:0: no such device here (torch sees no accelerator)"),
        (["--device_map", "bogus"], "--device_map bogus: takes auto, balanced, balanced_low_0, sequential or a "
                                    "device"),
        (["--device_map", "auto", "--max_memory", "cpu=10GiB", "0=1GiB"], "--max_memory 0=...: no GPU 0 here"),
    ],
)
def test_bad_flags_are_one_line_and_exit_2(argv, message, capsys, monkeypatch):
    monkeypatch.setattr(rungen.arguments, "accelerators_here", lambda: (None, 0))
    with pytest.raises(SystemExit) as exit_:
        run_generation.cli(argv)  # refused while parsing, before any model loads
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.startswith("run_generation.py: error: ") and message in err
    assert err.count("\n") == 1


def test_padding_text_is_folded_into_prefix_once(monkeypatch):
    monkeypatch.setattr(rungen.arguments, "accelerators_here", lambda: ("cuda", 1))  # a machine with one GPU
    args = parse_args(["--padding_text", "P. "])
    assert args.prefix == "P. "
    with pytest.raises(UsageError, match="--padding_text is the original script's name for --prefix; choose one"):
        parse_args(["--padding_text", "P. ", "--prefix", "Q. "])  # one of them would be dropped
    assert parse_args(["--fp16"]).dtype == "float16"
    args = parse_args(["--device_map", "auto", "--max_memory", "0=1GiB", "cpu=2GiB"])
    assert args.max_memory == ["0=1GiB", "cpu=2GiB"]  # the declared type; accelerate's map is made from it
    assert max_memory_map(args.max_memory) == {0: "1GiB", "cpu": "2GiB"}
    assert max_memory_map(["0=1073741824", "disk=20GB"]) == {0: 1 << 30, "disk": "20GB"}  # bytes, as accelerate takes


@pytest.mark.parametrize(
    "argv, prompts, tty, expected",
    [
        ([], 1, True, True),  # a terminal, one prompt: streamed by default
        ([], 1, False, False),  # a pipe: blocks
        ([], 2, True, False),  # several prompts never stream
        (["--stream"], 1, False, True),
        (["--stream"], 0, False, True),  # an empty pipe: nothing to stream, nothing refused
        (["--no-stream"], 1, True, False),
        # asked for where it cannot be: refused (a flag the run cannot honour), never turned off
        (["--stream", "--num_beams", "2"], 1, False, "not with --num_beams 2"),
        (["--stream"], 3, False, "not with 3 prompts"),
        (["--stream", "--output_format", "jsonl", "--num_return_sequences", "2"], 1, False,
         "not with --num_return_sequences 2 and --output_format jsonl"),
    ],
)
def test_when_output_streams(argv, prompts, tty, expected, monkeypatch):
    monkeypatch.setattr("sys.stdout", type("Tty", (io.StringIO,), {"isatty": lambda self: tty})())
    args = parse_args(argv)
    settings = settings_from_args(args)
    if isinstance(expected, str):
        with pytest.raises(UsageError, match=expected):
            run_generation.choose_streaming(args.stream, settings, prompts, 1, args.output_format)
    else:
        assert run_generation.choose_streaming(args.stream, settings, prompts, 1, args.output_format) is expected


# The JIT dispatcher's decision


def decode_step(batch=2, past=3, **extra):
    cache = DynamicCache()
    for layer in range(2):
        cache.update(torch.zeros(batch, 1, past, 4), torch.zeros(batch, 1, past, 4), layer)
    kwargs = dict(input_ids=torch.zeros(batch, 1, dtype=torch.long), past_key_values=cache, use_cache=True,
                  attention_mask=torch.ones(batch, past + 1, dtype=torch.long))
    return {**kwargs, **extra}


def test_the_graph_serves_plain_decode_steps_only():
    assert _served_by_graph(decode_step(), ())
    assert _served_by_graph(decode_step(attention_mask=None), ())  # generate drops an all-ones mask
    assert not _served_by_graph(decode_step(), (torch.zeros(1),))  # positional arguments
    assert not _served_by_graph(decode_step(input_ids=torch.zeros(2, 4, dtype=torch.long)), ())  # the prompt
    assert not _served_by_graph(decode_step(past=0), ())  # nothing cached yet
    assert not _served_by_graph(decode_step(output_attentions=True), ())
    assert not _served_by_graph(decode_step(inputs_embeds=torch.zeros(2, 1, 4)), ())  # unknown kwarg
    assert not _served_by_graph(decode_step(attention_mask=torch.ones(2, 9, dtype=torch.long)), ())  # odd mask
    assert not _served_by_graph(decode_step(past_key_values=((torch.zeros(1),),)), ())  # a legacy tuple


def test_prefix_cache_gives_the_longest_shared_start_and_leaves_a_token_to_prefill():
    from rungen.prefix_cache import PrefixCache

    def layers(tokens):  # keys/values whose position p holds the token there, so a view shows its positions
        k = torch.tensor(tokens, dtype=torch.float32).view(1, 1, -1, 1)
        return [(k, k + 0.5)]

    cache = PrefixCache(max_bytes=1 << 20)
    cache.put([1, 2, 3, 4, 5], layers([1, 2, 3, 4, 5]))
    cache.put([1, 2, 9, 9], layers([1, 2, 9, 9]))
    assert cache.longest([7, 1, 2]) == (0, None, None, None)
    length, [(k, v)], buffers, states = cache.longest([1, 2, 3, 8, 8])
    assert length == 3 and k.flatten().tolist() == [1, 2, 3] and v.flatten().tolist() == [1.5, 2.5, 3.5]
    assert buffers is None and states is None
    assert cache.longest([1, 2, 9, 9, 9])[0] == 4  # a whole entry: the next turn of its conversation
    assert cache.longest([1, 2, 3, 4, 5])[0] == 4  # all of it cached: the last token is still fed
    assert cache.longest([1])[0] == 0
    assert len(cache.entries) == 2  # entries without buffers are only read


def test_a_prefix_entry_with_recurrent_states_serves_only_a_start_of_all_of_it():
    # A recurrent model's entry: its attention layer's keys/values and its recurrent layer's states after exactly its
    # tokens (a state is not cut back). A request that starts with all of them takes both (views, counted in the
    # entry's bytes); one sharing a shorter start takes nothing from it, but from an entry without states that start;
    # a caller that takes no states (the slots) passes such entries over.
    from rungen.prefix_cache import PrefixCache

    keys = torch.arange(5, dtype=torch.float32).view(1, 1, 5, 1)
    states = [(torch.ones(1, 3, 4), torch.full((1, 2, 2, 2), 7.0))]
    cache = PrefixCache(max_bytes=1 << 20)
    cache.put([1, 2, 3, 4, 5], [(keys, keys)], states=states)
    assert cache.bytes == 2 * 5 * 4 + (12 + 8) * 4
    assert cache.longest([1, 2, 3, 9, 9]) == (0, None, None, None)
    length, [(k, _)], _, [(window, state)] = cache.longest([1, 2, 3, 4, 5, 6])
    assert length == 5 and k.flatten().tolist() == list(range(5)) and window is states[0][0] and state is states[0][1]
    assert cache.longest([1, 2, 3, 4, 5, 6], states=False)[0] == 0
    assert cache.longest([1, 2, 3, 4, 5])[0] == 0  # (all of it: the last token still to feed, the state past it)
    cache.put([1, 2, 3, 8], [(keys[:, :, :4], keys[:, :, :4])])
    assert cache.longest([1, 2, 3, 4, 9])[0] == 3


def test_a_prefix_entry_whose_sliding_layer_holds_a_ring_serves_only_whole():
    # A finished row whose sliding layer held a ring of 4 positions (rungen/slots.py, on a GPU) past 6 tokens: its
    # full layer holds every position, the ring only the last four. Its next turn (a request starting with all six)
    # takes the whole entry, the ring as it is; a request sharing only a start takes nothing from it, but from an
    # entry whose layers hold every position it takes that start.
    from rungen.prefix_cache import PrefixCache

    full = torch.arange(6, dtype=torch.float32).view(1, 1, 6, 1)
    ring = torch.tensor([4, 5, 2, 3], dtype=torch.float32).view(1, 1, 4, 1)  # positions 4, 5 at 0, 1
    cache = PrefixCache(max_bytes=1 << 20)
    cache.put([1, 2, 3, 4, 5, 6], [(full, full), (ring, ring)])
    assert cache.longest([1, 2, 3, 9, 9]) == (0, None, None, None)
    length, [(k, _), (r, _)], *_ = cache.longest([1, 2, 3, 4, 5, 6, 7])
    assert length == 6 and k.flatten().tolist() == list(range(6)) and r.flatten().tolist() == [4, 5, 2, 3]
    cache.put([1, 2, 3, 8], [(full[:, :, :4], full[:, :, :4]), (ring, ring)])  # (four positions: every one held)
    length, [(k, _), (r, _)], *_ = cache.longest([1, 2, 3, 9, 9])
    assert length == 3 and k.flatten().tolist() == [0, 1, 2] and r.flatten().tolist() == [4, 5, 2]


def test_a_next_turn_takes_over_the_buffers_of_its_conversation_and_grows_in_them():
    """An entry kept with its buffers (the last row of a batch): a request that extends all of it takes them,
    and the entry leaves the cache; one that shares only a start gets views and leaves the entry there."""
    from transformers import LlamaConfig

    from rungen.kvcache import new_cache, transformers_layer
    from rungen.prefix_cache import PrefixCache

    model = torch.nn.Module()
    model.config = LlamaConfig(num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, hidden_size=8)
    model.cache_grows_in_place = True
    filled = new_cache(model, [(torch.randn(1, 1, 6, 4), torch.randn(1, 1, 6, 4)) for _ in range(2)])
    layers = [(layer.keys, layer.values) for layer in filled.layers]
    buffers = [layer.buffers for layer in filled.layers]
    held = sum(k.untyped_storage().nbytes() + v.untyped_storage().nbytes() for k, v in buffers)
    cache = PrefixCache(max_bytes=1 << 20)
    cache.put([1, 2, 3, 4, 5, 6], layers, size=held, buffers=buffers)
    assert cache.bytes == held
    shared, views, none, _ = cache.longest([1, 2, 3, 7, 7])
    assert (shared, none) == (3, None) and len(cache.entries) == 1
    length, whole, given, _ = cache.longest([1, 2, 3, 4, 5, 6, 7, 8])
    assert (length, given) == (6, buffers) and not cache.entries and cache.bytes == 0
    grown = new_cache(model, whole, given)
    new = torch.randn(1, 1, 2, 4)
    for layer, (keys, _) in zip(grown.layers, buffers):
        assert type(layer) is transformers_layer() and layer.get_seq_length() == 6
        layer.update(new, new)
        assert layer.keys.data_ptr() == keys.data_ptr() and torch.equal(layer.keys[..., 6:, :], new)
    assert torch.equal(grown.layers[0].keys[..., :6, :], layers[0][0][..., :6, :])


def test_text_sent_as_byte_tokens_come_is_the_text_they_end_as(tmp_path):
    """Byte-fallback tokens that make no character yet decode to one replacement character each, and to one
    character once the last byte comes: what the engine sends as it goes must add up to the final text."""
    from rungen.rows import held_back
    from tiny_models import build_tokenizer

    tokenizer, _ = build_tokenizer("llama", str(tmp_path))
    vocab = tokenizer.get_vocab()
    ids = [vocab["a"], vocab["<0xF0>"], vocab["<0x9F>"], vocab["<0x98>"], vocab["<0x80>"], vocab['"'], vocab["a"]]
    sent = ""
    for end in range(1, len(ids) + 1):
        text = tokenizer.decode(ids[:end])
        ready = len(text) if end == len(ids) else len(text) - held_back(text, ())
        assert text[: len(sent)] == sent  # nothing sent is taken back
        sent += text[len(sent) : ready] if ready > len(sent) else ""
    assert sent == tokenizer.decode(ids) == 'a\U0001f600"a'


def test_an_engine_call_the_shutdown_cancelled_is_a_503():
    # The engine ends every request once shutdown's grace is over and cancels the calls it has not run (embeddings,
    # prompt scoring): their handlers answer 503 in OpenAI's shape, not a cancelled task; a cancel while the
    # engine runs (the client gone) stays a cancel.
    import asyncio
    import concurrent.futures
    import types

    from rungen.openai_api import APIError, called

    def outcome(stopped):
        future = concurrent.futures.Future()
        future.cancel()
        try:
            asyncio.run(called(types.SimpleNamespace(stopped=stopped), future, "the embeddings were computed"))
        except (APIError, asyncio.CancelledError) as error:
            return error

    error = outcome(True)
    assert isinstance(error, APIError) and error.status == 503
    assert error.message == "the server stopped before the embeddings were computed"
    assert isinstance(outcome(False), asyncio.CancelledError)
