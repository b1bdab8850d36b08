"""Fast tier for the generation controls: flags and their checks, generate kwargs, stops,
the jsonl fields, and log-probability bookkeeping, with a tokenizer at most."""

import dataclasses
import io
import json

import pytest
import torch

import run_generation
from rungen.arguments import parse_args, settings_from_args
from rungen.errors import one_line
from rungen.generation import (
    Sequence,
    Settings,
    StopTokenStreamer,
    describe_sequence,
    generation_kwargs,
    one_at_a_time,
    stop_strings,
)
from rungen.logprobs import content, step_logits, token_logprobs, token_text
from rungen.output import Writer
from rungen.prompts import Prompt
from tiny_models import build_tokenizer


@pytest.fixture(scope="module")
def llama_tokenizer(tmp_path_factory):
    tokenizer, _ = build_tokenizer("llama", str(tmp_path_factory.mktemp("tok")))
    return tokenizer


# Flags


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--min_p", "1.5"], "--min_p must be in [0, 1], got 1.5"),
        (["--typical_p", "0"], "--typical_p must be in (0, 1], got 0.0"),
        (["--no_repeat_ngram_size", "-1"], "--no_repeat_ngram_size must be >= 0, got -1"),
        (["--logprobs", "-2", "--output_format", "jsonl"], "--logprobs must be >= 0, got -2"),
        (["--logprobs", "3"], "--logprobs needs --output_format jsonl"),
        (["--length", "0", "--output_format", "jsonl"], "--length 0 scores the prompts without generating"),
        (["--prompt_lookup_num_tokens", "0"], "--prompt_lookup_num_tokens must be >= 1, got 0"),
        (["--prompt_lookup_num_tokens", "3", "--assistant_model", "x"], "two ways of drafting tokens: choose one"),
        (["--prompt_lookup_num_tokens", "3", "--num_beams", "2"], "not beam search"),
        (["--assistant_model", "x", "--num_return_sequences", "2"], "one sequence per prompt"),
        (["--temperature", "0", "--num_return_sequences", "3"], "would print one greedy sequence 3 times"),
        (["--length", "0", "--logprobs", "1", "--output_format", "jsonl", "--num_return_sequences", "2"],
         "--num_return_sequences 2 applies to generated text; --length 0 scores the prompts"),
        (["--length", "0", "--logprobs", "1", "--output_format", "jsonl", "--prompt_lookup_num_tokens", "2"],
         "--prompt_lookup_num_tokens applies to generated text"),
    ],
)
def test_bad_control_flags_are_one_line_and_exit_2(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        run_generation.cli(argv)  # refused while parsing, before any model loads
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.startswith("run_generation.py: error: ") and message in err, err
    assert err.count("\n") == 1


def test_stop_token_is_repeatable_and_keeps_its_single_form():
    def stops(argv):
        return settings_from_args(parse_args(argv)).stop_token

    assert stops([]) is None
    assert stops(["--stop_token", "\n"]) == "\n"  # one: a string, as before
    assert stops(["--stop_token", ".", "--stop", "!", "--stop", ""]) == (".", "!")
    assert stop_strings(None) == () and stop_strings(".") == (".",) and stop_strings((".", "", "!")) == (".", "!")


def test_sampling_only_flags_warn_under_greedy(caplog):
    args = parse_args(["--temperature", "0", "--min_p", "0.1"])
    assert args.min_p == 0.1 and "--min_p applies to sampling only" in caplog.text
    assert "min_p" not in generation_kwargs(settings_from_args(args), pad_token_id=0)
    caplog.clear()
    parse_args(["--temperature", "0", "--k", "5", "--p", "0.5"])  # given: said so as well
    assert "--k and --p apply to sampling only" in caplog.text
    caplog.clear()
    parse_args(["--temperature", "0"])  # their defaults are not the user's
    assert "sampling only" not in caplog.text


def test_a_flags_warning_is_said_by_the_main_process_alone(caplog, monkeypatch):
    # Every launched process checks the same flags: the main one (rank 0) says what they warn of, the others not.
    from rungen import logger, processes

    before = logger.level
    for rank, said in (("1", False), ("0", True)):
        monkeypatch.setenv("RANK", rank)
        caplog.clear()
        with processes.said_once(logger):
            parse_args(["--temperature", "0", "--k", "5"])
        assert ("--k applies to sampling only" in caplog.text) is said
    assert logger.level == before  # as it was


def test_control_kwargs_reach_generate():
    args = parse_args(["--temperature", "0.8", "--min_p", "0.05", "--typical_p", "0.9", "--no_repeat_ngram_size",
                       "3", "--prompt_lookup_num_tokens", "4", "--logprobs", "2", "--output_format", "jsonl"])
    kwargs = generation_kwargs(settings_from_args(args), pad_token_id=0)
    assert (kwargs["min_p"], kwargs["typical_p"], kwargs["no_repeat_ngram_size"]) == (0.05, 0.9, 3)
    assert kwargs["prompt_lookup_num_tokens"] == 4
    assert kwargs["return_dict_in_generate"] is True and kwargs["output_logits"] is True
    plain = generation_kwargs(settings_from_args(parse_args([])), pad_token_id=0)
    for key in ("min_p", "typical_p", "no_repeat_ngram_size", "prompt_lookup_num_tokens", "return_dict_in_generate"):
        assert key not in plain  # nothing new reaches generate unless asked for


def test_several_stops_reach_generate_as_a_list(gpt2_tokenizer):
    kwargs = generation_kwargs(Settings(stop_token=(".", "!")), gpt2_tokenizer)
    assert kwargs["stop_strings"] == [".", "!"] and kwargs["tokenizer"] is gpt2_tokenizer


def test_one_prompt_at_a_time_for_assisted_modes():
    assert not one_at_a_time(Settings(), None)
    assert one_at_a_time(Settings(prompt_lookup_num_tokens=3), None)
    assert one_at_a_time(Settings(), object())
    assert one_at_a_time(Settings(generation_config={"assistant_early_exit": 2}), None)


# --generation_config


def write(tmp_path, values):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(values))
    return str(path)


def test_generation_config_fills_flags_not_given_and_keeps_the_rest(tmp_path):
    path = write(tmp_path, {"temperature": 0.6, "top_k": 40, "max_new_tokens": 7, "stop_strings": ["\n", "."],
                            "min_p": 0.1, "epsilon_cutoff": 0.001, "transformers_version": "4.50.0"})
    args = parse_args(["--generation_config", path, "--k", "5"])
    assert (args.temperature, args.k, args.length, args.min_p) == (0.6, 5, 7, 0.1)  # --k given: the flag wins
    settings = settings_from_args(args)
    assert settings.stop_token == ("\n", ".") and settings.generation_config == {"epsilon_cutoff": 0.001}
    kwargs = generation_kwargs(settings, pad_token_id=0)
    assert (kwargs["epsilon_cutoff"], kwargs["top_k"], kwargs["temperature"]) == (0.001, 5, 0.6)


def test_do_sample_false_in_the_file_is_greedy_unless_a_temperature_is_given(tmp_path):
    path = write(tmp_path, {"do_sample": False})
    assert parse_args(["--generation_config", path]).temperature == 0
    assert parse_args(["--generation_config", path, "--temperature", "0.7"]).temperature == 0.7


def test_one_line_of_a_generation_config_error():
    error = ValueError("GenerationConfig is invalid: \n- `top_k`: bad.\n- `top_p`: worse.\nIf you're using ...")
    assert one_line(error) == "`top_k`: bad. `top_p`: worse."
    assert one_line(ValueError("plain\nsecond")) == "plain"


# Stops in the text and in the streamer


def test_the_earliest_of_several_stops_cuts(gpt2_tokenizer):
    tok = gpt2_tokenizer
    prompt = Prompt(0, "a", ids=tok.encode("a"))
    new = tok.encode(" dog! cat. cow")
    for stops in ((".", "!"), ("!", ".")):
        described = describe_sequence(Settings(stop_token=stops), tok, prompt, new, set())
        assert (described.generated_text, described.finish_reason) == (" dog", "stop_token")


def test_streamer_cuts_at_the_earliest_stop_and_keeps_what_it_printed(gpt2_tokenizer, monkeypatch):
    out = io.StringIO()
    monkeypatch.setattr("sys.stdout", out)
    streamer = StopTokenStreamer(gpt2_tokenizer, (".", "dog!"))
    for text in [" my ", "dog", "! cat.", " cow"]:
        streamer.on_finalized_text(text)
    streamer.on_finalized_text("", stream_end=True)
    # "dog!" starts inside a piece that is printed already: the cut keeps it, and nothing after is printed.
    assert out.getvalue() == " my dog\n"


# The jsonl record


def test_logprob_fields_appear_only_when_set(capsys):
    writer = Writer("jsonl", 2)
    writer.add(Prompt(0, "a"), [Sequence("A", "aA", 1, 1, "length")])
    scored = Sequence("", "b", 2, 0, "length", prompt_logprobs={"content": []}, perplexity=3.5)
    writer.add(Prompt(1, "b"), [scored])
    first, second = (json.loads(line) for line in capsys.readouterr().out.splitlines())
    assert list(first) == ["prompt_index", "sequence_index", "prompt", "generated_text", "text",
                           "num_prompt_tokens", "num_generated_tokens", "finish_reason"]  # as before
    assert second["prompt_logprobs"] == {"content": []} and second["perplexity"] == 3.5
    assert "logprobs" not in second
    assert dataclasses.asdict(scored)["logprobs"] is None


# Log-probabilities


def test_content_lists_chosen_tokens_and_sorted_alternatives(gpt2_tokenizer):
    tok = gpt2_tokenizer
    ids = tok.encode(" dog cat")
    logprobs = torch.full((len(ids), len(tok)), -20.0)
    for row, token in enumerate(ids):
        logprobs[row, token] = -0.5
        logprobs[row, (token + 1) % len(tok)] = -1.0
        logprobs[row, (token + 2) % len(tok)] = -3.0
    items = content(tok, tok.encode("Hello"), ids, logprobs, 2)
    assert [item["id"] for item in items] == ids and "".join(item["token"] for item in items) == " dog cat"
    for item, token in zip(items, ids):
        assert item["logprob"] == -0.5
        expected = [(token, -0.5), ((token + 1) % len(tok), -1.0)]
        assert [(t["id"], t["logprob"]) for t in item["top_logprobs"]] == expected
    assert all(item["top_logprobs"] == [] for item in content(tok, [], ids, logprobs, 0))


def test_token_text_keeps_sentencepiece_spaces_and_names_special_tokens(llama_tokenizer):
    tok = llama_tokenizer
    ids = tok.encode("Hello my dog")  # <s> ▁H ello ▁my ▁dog
    texts = [token_text(tok, ids[:i], ids[i]) for i in range(1, len(ids))]
    assert "".join(texts) == "Hello my dog" and texts[-2:] == [" my", " dog"]  # no space before the first
    assert token_text(tok, ids, tok.eos_token_id) == tok.eos_token


@pytest.mark.parametrize("kind", ["gpt2", "llama"])  # byte-level BPE; SentencePiece with byte tokens <0xNN>
def test_token_bytes_join_to_the_text_where_tokens_split_characters(kind, gpt2_tokenizer, llama_tokenizer):
    """An emoji is several byte tokens, each alone no character: its `token` is the replacement character (or
    nothing), its `bytes` what it holds, so a client joining bytes gets the text back (OpenAI's meaning)."""
    tok = gpt2_tokenizer if kind == "gpt2" else llama_tokenizer
    text = "Party \U0001f389\U0001f389 time \u00e9"
    ids = tok.encode(text, add_special_tokens=False)
    items = content(tok, ids[:1], ids[1:], torch.zeros(len(ids) - 1, len(tok)).log_softmax(-1), 1)
    assert any(item["token"] in ("", "\ufffd") for item in items)  # the emoji are split over byte tokens
    assert bytes(b for item in items for b in item["bytes"]).decode() == text[len(tok.decode(ids[:1])):]
    assert items[0]["bytes"] == list(items[0]["token"].encode())  # a whole character's bytes are its text's
    assert all(isinstance(top["bytes"], list) for item in items for top in item["top_logprobs"])
    # The end of text, named as its token, adds no text to the reply: no bytes, so the join is still the text.
    [end] = content(tok, ids, [tok.eos_token_id], torch.zeros(1, len(tok)).log_softmax(-1), 1)
    assert end["token"] == tok.eos_token and end["bytes"] == []


def test_step_logits_follow_beams():
    logits = (torch.arange(6.0).view(3, 2), torch.arange(6.0, 12.0).view(3, 2))  # 2 steps, 3 rows (beams)
    beams = torch.tensor([[2, 0], [1, 1]])  # output row 0 came from beam 2, then beam 0
    assert step_logits(logits, beams, 0, 0).tolist() == [4.0, 5.0]
    assert step_logits(logits, beams, 0, 1).tolist() == [6.0, 7.0]
    assert step_logits(logits, None, 1, 1).tolist() == [8.0, 9.0]


def test_token_logprobs_are_log_softmax_of_raw_logits(gpt2_tokenizer):
    tok = gpt2_tokenizer
    new = tok.encode(" dog cat") + [tok.eos_token_id] * 3
    steps = [torch.randn(len(tok), generator=torch.Generator().manual_seed(i)) for i in range(2)]
    result = token_logprobs(tok, tok.encode("Hi"), new, steps, 1)
    assert len(result["content"]) == 2  # the padding after the produced tokens is left out
    for item, step in zip(result["content"], steps):
        assert item["logprob"] == pytest.approx(step.log_softmax(-1)[item["id"]].item())
    assert token_logprobs(tok, [], new, [], 1) == {"content": []}
