"""Generation controls: log-probabilities and scoring, the library's samplers and stops,
--generation_config, prompt lookup and assisted decoding. Through main() in-process, or through the entry
point (helpers.run_main) where the exit code and stderr matter."""

import io
import json
import math
import os
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import run_generation
from helpers import default_model_dir, jsonl, run_cli, run_main, tiny_args
from tiny_models import build_tiny_checkpoint

PROMPTS = ["Hello, my dog is cute", "The capital of France is", "Once upon a time there was a little dog who"]
# float32: a token's log-probability from generate (KV cache, one position at a time) and from one forward
# pass over the whole sequence differ by rounding only, ~1e-6 to 2e-5 here; a sum over 20 tokens by ~5e-5.
TOKEN_TOL, SUM_TOL = 1e-4, 2e-4


def main_records(argv, capsys, stdin=None, monkeypatch=None):
    """main() in this process; returns the jsonl records it printed."""
    if stdin is not None:
        monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(stdin.encode())))
    run_generation.main(argv)
    return jsonl(capsys.readouterr().out.encode())


@pytest.fixture(scope="module")
def forward(tiny_models):
    """forward(model_dir, ids) -> log-probabilities (positions x vocabulary) of one unpadded forward pass."""
    cache = {}

    def log_probs(model_dir, ids):
        if model_dir not in cache:
            cache[model_dir] = AutoModelForCausalLM.from_pretrained(model_dir).eval()
        with torch.no_grad():
            return cache[model_dir](torch.tensor([ids])).logits[0].float().log_softmax(-1)

    return log_probs


def check_against_forward(record, model_dir, forward):
    """The record's logprobs are the forward pass's, token by token, and sum to its log-likelihood."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompt_ids = tokenizer.encode(record["prompt"])
    items = record["logprobs"]["content"]
    ids = [item["id"] for item in items]
    assert len(items) == record["num_generated_tokens"]  # padding after the end is not listed
    reference = forward(model_dir, prompt_ids + ids)
    expected = [reference[len(prompt_ids) - 1 + i, token].item() for i, token in enumerate(ids)]
    got = [item["logprob"] for item in items]
    assert max(abs(a - b) for a, b in zip(expected, got)) < TOKEN_TOL
    assert abs(sum(expected) - sum(got)) < SUM_TOL
    return items


# Log-probabilities of generated tokens


@pytest.mark.parametrize("extra", [["--temperature", "0"], ["--temperature", "0.7", "--k", "20", "--seed", "3"]])
def test_logprobs_sum_to_the_log_likelihood_of_a_forward_pass(tiny_models, forward, extra, capsys, monkeypatch):
    # Several prompts of different lengths: left padding in the batch does not change them. Sampling settings
    # do not either: the log-probabilities are the model's raw ones.
    args = tiny_args(tiny_models, "llama", "--length", "12", "--output_format", "jsonl", "--logprobs", "3", *extra)
    records = main_records(args, capsys, "\n".join(PROMPTS), monkeypatch)
    assert len(records) == len(PROMPTS)
    for record in records:
        items = check_against_forward(record, tiny_models["llama"], forward)
        assert "".join(item["token"] for item in items) == record["generated_text"]


def test_top_logprobs_are_sorted_and_hold_the_greedy_token(tiny_models, capsys):
    args = tiny_args(tiny_models, "gpt2", "--prompt", PROMPTS[0], "--temperature", "0", "--length", "10",
                     "--output_format", "jsonl", "--logprobs", "5")
    [record] = main_records(args, capsys)
    for item in record["logprobs"]["content"]:
        top = item["top_logprobs"]
        assert len(top) == 5
        assert [t["logprob"] for t in top] == sorted((t["logprob"] for t in top), reverse=True)
        assert (top[0]["id"], top[0]["logprob"]) == (item["id"], item["logprob"])  # greedy: the most likely
        assert all(t["logprob"] <= 0 for t in top)
        assert set(item) == {"token", "id", "logprob", "bytes", "top_logprobs"}
        assert set(top[0]) == {"token", "id", "logprob", "bytes"}


def test_logprobs_stop_where_the_sequence_ends(tiny_models, forward, capsys, monkeypatch):
    # A file makes a greedy token of the first prompt (the first that is not a repeat, after the first one)
    # an end-of-sequence token: that sequence ends early (finish_reason eos), its batch-mates go on, and
    # its logprobs list only the tokens it produced, not the padding after them.
    base = tiny_args(tiny_models, "llama", "--temperature", "0", "--length", "10", "--output_format", "jsonl",
                     "--logprobs", "0")
    [first] = main_records(base + ["--prompt", PROMPTS[0]], capsys)
    ids = [item["id"] for item in first["logprobs"]["content"]]
    end = next(i for i in range(1, len(ids) - 1) if ids[i] not in ids[:i])
    path = os.path.join(os.path.dirname(tiny_models["llama"]), "eos_config.json")
    with open(path, "w") as f:
        json.dump({"eos_token_id": ids[end]}, f)
    records = main_records(base + ["--generation_config", path], capsys, "\n".join(PROMPTS), monkeypatch)
    assert (records[0]["finish_reason"], records[0]["num_generated_tokens"]) == ("eos", end + 1)
    assert [len(r["logprobs"]["content"]) for r in records] == [r["num_generated_tokens"] for r in records]
    assert any(r["num_generated_tokens"] > end + 1 for r in records[1:])
    for record in records:
        check_against_forward(record, tiny_models["llama"], forward)


def test_beam_search_logprobs_follow_each_beam(tiny_models, forward, capsys):
    args = tiny_args(tiny_models, "gpt2", "--prompt", PROMPTS[1], "--temperature", "0", "--length", "8",
                     "--num_beams", "3", "--num_return_sequences", "3", "--output_format", "jsonl", "--logprobs", "1")
    records = main_records(args, capsys)
    assert len(records) == 3 and len({r["generated_text"] for r in records}) == 3
    for record in records:
        check_against_forward(record, tiny_models["gpt2"], forward)


@pytest.mark.slow  # converts the default model to float: tens of seconds of CPU
def test_logprobs_of_the_default_model(default_model, forward):
    cache_home, _, _ = default_model
    # In float32 (--dequantize), against a forward pass of the same float checkpoint.
    args = ["--dequantize", "--temperature", "0", "--length", "20", "--output_format", "jsonl", "--logprobs", "2"]
    result = run_main(args, stdin="\n".join(PROMPTS), cache_home=cache_home)
    assert result.returncode == 0, result.stderr.decode()
    model_dir = default_model_dir(cache_home)
    for record in jsonl(result.stdout):
        check_against_forward(record, model_dir, forward)


# Scoring: --length 0


def test_scoring_gives_perplexity_of_a_forward_pass_and_batch_equals_single(tiny_models, forward, capsys, monkeypatch):
    model_dir = tiny_models["llama"]
    args = tiny_args(tiny_models, "llama", "--length", "0", "--output_format", "jsonl", "--logprobs", "2")
    batched = main_records(args, capsys, "\n".join(PROMPTS), monkeypatch)
    single = main_records(args + ["--batch_size", "1"], capsys, "\n".join(PROMPTS), monkeypatch)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    for record, alone in zip(batched, single):
        ids = tokenizer.encode(record["prompt"])
        assert (record["generated_text"], record["num_generated_tokens"], record["text"]) == ("", 0, record["prompt"])
        items = record["prompt_logprobs"]["content"]
        assert [item["id"] for item in items] == ids[1:]  # tokens 2..n
        reference = forward(model_dir, ids)
        nll = [-reference[i - 1, ids[i]].item() for i in range(1, len(ids))]
        assert record["perplexity"] == pytest.approx(math.exp(sum(nll) / len(nll)), rel=1e-4)
        assert max(abs(item["logprob"] + n) for item, n in zip(items, nll)) < TOKEN_TOL
        assert record["perplexity"] == pytest.approx(alone["perplexity"], rel=1e-4)
        pairs = zip(items, alone["prompt_logprobs"]["content"])
        assert all(a["id"] == b["id"] and abs(a["logprob"] - b["logprob"]) < TOKEN_TOL for a, b in pairs)
        assert "logprobs" not in record


@pytest.mark.slow  # converts the default model to float: tens of seconds of CPU
def test_scoring_the_default_model(default_model, forward):
    cache_home, _, _ = default_model
    args = ["--dequantize", "--length", "0", "--output_format", "jsonl", "--logprobs", "0"]
    result = run_main(args, stdin="\n".join(PROMPTS), cache_home=cache_home)
    assert result.returncode == 0, result.stderr.decode()
    model_dir = default_model_dir(cache_home)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    for record in jsonl(result.stdout):
        ids = tokenizer.encode(record["prompt"])
        reference = forward(model_dir, ids)
        nll = sum(-reference[i - 1, ids[i]].item() for i in range(1, len(ids))) / (len(ids) - 1)
        assert record["perplexity"] == pytest.approx(math.exp(nll), rel=1e-4)


def test_scoring_a_conversation_scores_what_it_holds(tmp_path):
    """--length 0 on a conversation (a chat evaluation's): the template's text of its messages, without the
    opening of a reply that no one wrote after the last one."""
    from test_server import build_chat_llama

    path = build_chat_llama(str(tmp_path / "llama"))
    messages = [{"role": "user", "content": "What is the capital of France?"},
                {"role": "assistant", "content": "Paris."}]
    result = run_main(["--model_name_or_path", path, "--length", "0", "--input_format", "jsonl", "--output_format",
                       "jsonl", "--logprobs", "0"], stdin=json.dumps({"messages": messages}))
    assert result.returncode == 0, result.stderr.decode()
    [record] = jsonl(result.stdout)
    tokenizer = AutoTokenizer.from_pretrained(path)
    held = tokenizer.apply_chat_template(messages, add_generation_prompt=False, tokenize=False)
    ids = tokenizer.encode(held, add_special_tokens=False)
    assert record["num_prompt_tokens"] == len(ids)
    assert [item["id"] for item in record["prompt_logprobs"]["content"]] == ids[1:]


def test_a_one_token_prompt_has_nothing_to_score(tiny_models):
    args = tiny_args(tiny_models, "gpt2", "--length", "0", "--output_format", "jsonl", "--logprobs", "0")
    result = run_main(args, stdin="A\nHello, my dog")
    assert result.returncode == 1, result.stderr.decode()
    records = jsonl(result.stdout)
    assert records[0]["error"] == "the prompt is one token: nothing to score" and records[1]["perplexity"] > 0


# Samplers and stops of the library


def test_min_p_one_keeps_only_the_most_likely_token(tiny_models, capsys):
    base = tiny_args(tiny_models, "gpt2", "--prompt", PROMPTS[0], "--length", "12")
    greedy = run_generation.main(base + ["--temperature", "0"])
    sampled = [run_generation.main(base + ["--min_p", "1", "--seed", seed]) for seed in ("1", "2")]
    plain = [run_generation.main(base + ["--seed", seed]) for seed in ("1", "2")]
    assert sampled[0] == sampled[1] == greedy
    assert plain[0] != plain[1]  # without min_p, sampling does vary: min_p reached generate


def test_typical_p_tiny_leaves_one_token(tiny_models, capsys):
    base = tiny_args(tiny_models, "gpt2", "--prompt", PROMPTS[0], "--length", "12", "--typical_p", "1e-9")
    assert run_generation.main(base + ["--seed", "1"]) == run_generation.main(base + ["--seed", "2"])


def test_no_repeat_ngram_size_one_repeats_no_token(tiny_models, capsys):
    base = tiny_args(tiny_models, "llama", "--prompt", "a a a", "--temperature", "0", "--length", "30",
                     "--output_format", "jsonl", "--logprobs", "0")
    [plain] = main_records(base, capsys)
    [blocked] = main_records(base + ["--no_repeat_ngram_size", "1"], capsys)
    plain_ids = [item["id"] for item in plain["logprobs"]["content"]]
    ids = [item["id"] for item in blocked["logprobs"]["content"]]
    prompt_ids = AutoTokenizer.from_pretrained(tiny_models["llama"]).encode("a a a")
    assert len(set(plain_ids)) < len(plain_ids)  # greedy alone does repeat itself
    assert len(set(ids)) == len(ids) == 30 and not set(ids) & set(prompt_ids)  # the prompt counts too


def test_several_stop_strings_cut_at_the_earliest(tiny_models, capsys):
    base = tiny_args(tiny_models, "gpt2", "--prompt", PROMPTS[0], "--temperature", "0", "--length", "20")
    continuation = run_generation.main(base)[0][len(PROMPTS[0]) :]
    early, late = continuation[3:6], continuation[-8:-5]  # two stop strings the greedy text really produces
    assert 0 < continuation.index(early) < continuation.index(late)
    expected = PROMPTS[0] + continuation[: continuation.index(early)]
    assert run_generation.main(base + ["--stop_token", late, "--stop", early]) == [expected]
    assert run_generation.main(base + ["--stop", late, "--stop_token", "#never#"]) == [
        PROMPTS[0] + continuation[: continuation.index(late)]]
    capsys.readouterr()
    [record] = main_records(base + ["--stop", late, "--stop", early, "--output_format", "jsonl"], capsys)
    assert record["finish_reason"] == "stop_token" and record["text"] == expected
    # The streamer cuts at the same place.
    run_generation.main(base + ["--stop", late, "--stop", early, "--stream"])
    assert capsys.readouterr().out == f"=== GENERATED SEQUENCE 1 ===\n{expected}\n"


# --generation_config


def write_config(tmp_path, values):
    path = tmp_path / "generation_config.json"
    path.write_text(values if isinstance(values, str) else json.dumps(values))
    return str(path)


def test_generation_config_file_is_applied_and_flags_win(tiny_models, tmp_path, capsys):
    base = tiny_args(tiny_models, "llama", "--prompt", PROMPTS[0], "--output_format", "jsonl", "--logprobs", "0")
    [greedy5] = main_records(base + ["--temperature", "0", "--length", "5"], capsys)
    config = write_config(tmp_path, {"do_sample": False, "max_new_tokens": 5, "transformers_version": "4.40.0"})
    assert main_records(base + ["--generation_config", config], capsys) == [greedy5]
    [shorter] = main_records(base + ["--generation_config", config, "--length", "3"], capsys)  # the flag wins
    assert shorter["num_generated_tokens"] == 3 and greedy5["generated_text"].startswith(shorter["generated_text"])
    # A key without a flag goes to generate as it is: suppressing the first greedy token changes the text.
    first_id = greedy5["logprobs"]["content"][0]["id"]
    suppress = write_config(tmp_path, {"do_sample": False, "max_new_tokens": 5, "suppress_tokens": [first_id]})
    [other] = main_records(base + ["--generation_config", suppress], capsys)
    assert other["logprobs"]["content"][0]["id"] != first_id


@pytest.mark.parametrize(
    "values, message",
    [
        ({"foo": 1}, "unknown GenerationConfig key(s): foo"),
        ("{not json", "not valid JSON"),
        ([1, 2], "must hold a JSON object"),
        ({"top_k": "many"}, 'top_k must be an integer, got "many"'),
        ({"output_scores": True}, "output_scores cannot be set here (use --logprobs)"),
        ({"length_penalty": 0.5}, "`length_penalty`: `num_beams` is set to 1"),  # GenerationConfig.validate(strict)
        ({"cache_implementation": "nope"}, "Invalid `cache_implementation` (nope)"),
        ({"epsilon_cutoff": 2.0}, "`epsilon_cutoff` has to be a float > 0 and < 1"),  # generate would skip it
        ({"top_p": 2.0}, "--p must be in (0, 1], got 2.0"),  # a key with a flag is checked as the flag
        ({"do_sample": "yes"}, "do_sample must be true or false"),
        # modes transformers moved to the hub: refused before the model loads, not three lines after it
        ({"penalty_alpha": 0.6, "top_k": 4}, "penalty_alpha asks for contrastive search, which transformers moved"),
        ({"num_beam_groups": 2, "num_beams": 4, "diversity_penalty": 1.0}, "asks for group (diverse) beam search"),
    ],
)
def test_bad_generation_config_is_one_line_and_exit_2(tmp_path, values, message):
    result = run_main(["--generation_config", write_config(tmp_path, values)])  # refused before any model loads
    err = result.stderr.decode()
    assert result.returncode == 2 and err.count("\n") == 1 and message in err, err


@pytest.mark.parametrize("flag", [["--temperature", "0.5"], ["--k", "5"], ["--p", "0.5"],
                                  ["--repetition_penalty", "1.5"], ["--stop_token", "x"], ["--min_p", "0.1"],
                                  ["--typical_p", "0.5"], ["--no_repeat_ngram_size", "2"], ["--jit"]])
def test_scoring_refuses_flags_for_generated_text(flag):
    # --length 0 generates nothing: a flag that only acts on generated text would be silently idle
    result = run_main(["--length", "0", "--logprobs", "0", "--output_format", "jsonl", "--prompt", "x", *flag])
    err = result.stderr.decode()
    assert result.returncode == 2 and err.count("\n") == 1, err
    assert f"{flag[0]} applies to generated text; --length 0 scores the prompts and generates none" in err


def test_an_assistants_drafting_keys_need_an_assistant(tmp_path):
    # num_assistant_tokens without --assistant_model: generate() would ignore it, silently
    config = write_config(tmp_path, {"num_assistant_tokens": 3})
    result = run_main(["--generation_config", config, "--prompt", "x"])
    assert result.returncode == 2 and "num_assistant_tokens shapes an assistant model's drafts; it needs " \
        "--assistant_model" in result.stderr.decode()
    missing = run_main(["--prompt", "x", "--assistant_model", "no-such/model"])
    assert missing.returncode == 2 and "error: --assistant_model: " in missing.stderr.decode()


def one_line_exit(argv, capsys):
    """The tool on argv must end with exit 2 and a single line on stderr after the log lines; returns that line."""
    result = run_main(argv)
    err = result.stderr.decode()
    assert result.returncode == 2 and result.stdout == b"" and "Traceback" not in err, err
    return err.strip().splitlines()[-1]


def test_generation_config_values_only_generate_checks_are_one_line(tiny_models, tmp_path, capsys):
    config = write_config(tmp_path, {"bad_words_ids": [[-5]]})
    line = one_line_exit(tiny_args(tiny_models, "gpt2", "--prompt", "Hi", "--generation_config", config), capsys)
    assert line.startswith("run_generation.py: error: ") and "bad_words_ids" in line


def test_missing_generation_config_file(capsys):
    line = one_line_exit(["--prompt", "Hi", "--generation_config", "/nonexistent/config.json"], capsys)
    assert line == "run_generation.py: error: --generation_config /nonexistent/config.json: No such file or directory"


# Prompt lookup and assisted decoding: greedy text unchanged, batches generated prompt by prompt


@pytest.fixture(scope="module")
def second_llama(tmp_path_factory):
    """Another tiny llama with the same tokenizer and other weights (the first one's, perturbed): a draft
    model that proposes tokens the main model sometimes rejects."""
    directory = build_tiny_checkpoint("llama", str(tmp_path_factory.mktemp("second_llama")))
    model = AutoModelForCausalLM.from_pretrained(directory)
    generator = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.05)
    model.save_pretrained(directory)
    return directory


@pytest.mark.parametrize("mode", ["prompt_lookup", "self_assistant", "other_assistant", "mistral_assistant"])
def test_speculative_modes_keep_the_greedy_text(tiny_models, second_llama, mode, capsys, monkeypatch):
    extra = {
        "prompt_lookup": ["--prompt_lookup_num_tokens", "3"],
        "self_assistant": ["--assistant_model", tiny_models["llama"]],
        "other_assistant": ["--assistant_model", second_llama],
        "mistral_assistant": ["--assistant_model", tiny_models["mistral"]],  # another type, the same tokenizer
    }[mode]
    stdin = "\n".join(["the cat sat on the mat and the cat sat on the", *PROMPTS])
    args = tiny_args(tiny_models, "llama", "--temperature", "0", "--length", "16", "--output_format", "jsonl",
                     "--logprobs", "1")
    plain = main_records(args, capsys, stdin, monkeypatch)
    drafted = main_records(args + extra, capsys, stdin, monkeypatch)
    assert [r["generated_text"] for r in drafted] == [r["generated_text"] for r in plain]
    for fast, slow in zip(drafted, plain):
        pairs = zip(fast["logprobs"]["content"], slow["logprobs"]["content"])
        assert all(a["id"] == b["id"] and abs(a["logprob"] - b["logprob"]) < TOKEN_TOL for a, b in pairs)


@pytest.mark.slow  # converts the default model to float: tens of seconds of CPU
def test_prompt_lookup_keeps_the_default_models_greedy_text(default_model):
    # An input-grounded prompt (copy a passage), where prompt lookup drafts many tokens that are accepted.
    cache_home, _, _ = default_model
    passage = ("The town of Millbrook sits where two rivers meet, and for most of its history the rivers decided "
               "everything. The first settlers built their houses on the eastern bank.")
    # In float (--dequantize), where a forward pass over several tokens gives each the bits of one over one:
    # in the GGUF blocks the attention over a draft sums in another order, and the text may part at a near-tie.
    args = ["--dequantize", "--chat", "--prompt", f"Copy the following text exactly: {passage}", "--temperature",
            "0", "--length", "40"]
    plain = run_main(args, cache_home=cache_home)
    lookup = run_main(args + ["--prompt_lookup_num_tokens", "10"], cache_home=cache_home)
    assert plain.returncode == lookup.returncode == 0, lookup.stderr.decode()
    assert lookup.stdout == plain.stdout and b"Millbrook" in plain.stdout


def test_an_assistant_with_another_tokenizer_is_refused(tiny_models, capsys):
    line = one_line_exit(tiny_args(tiny_models, "llama", "--prompt", "Hi", "--assistant_model", tiny_models["gpt2"]),
                         capsys)
    assert line.endswith("its tokenizer differs from the model's; assisted decoding needs the same vocabulary")


@pytest.mark.parametrize("model_type", ["llama", "xlnet"])
def test_generate_leaves_stderr_to_the_figures(tiny_models, model_type, monkeypatch):
    """transformers warns of its own calls on some generate() paths: the assistant model it passes a
    generation_config beside arguments, XLNet's unbounded positions (-1) counted as exceeded. Neither reaches
    stderr (a process: transformers' handler holds the process's stderr), which holds the run's figures; not
    even with $CI set, as CI services set it, where transformers' records also reach the root logger."""
    monkeypatch.setenv("CI", "true")
    extra = ["--assistant_model", tiny_models["llama"]] if model_type == "llama" else []
    result = run_cli(tiny_args(tiny_models, model_type, "--prompt", "Hello", "--length", "5", *extra))
    assert result.returncode == 0
    [figures] = result.stderr.decode().splitlines()
    assert figures.startswith("Generated 5 tokens in ")
