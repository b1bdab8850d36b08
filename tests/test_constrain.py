"""Constrained output: --json_schema, --regex, --grammar. Every sequence that ends with the
grammar complete must parse and validate; every failure is one line and exit 2."""

import json
import re

import pytest
from transformers import AutoTokenizer

from helpers import error_line, jsonl, run_main, tiny_args

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "enum": ["Paris", "Zürich", "東京"]},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
REGEX = r"(café|日本|[a-z]{1,5}) [0-9]{2}(!|\?)"
# Not regular (nested parentheses), so a regex could not stand in for it.
GBNF = r"""root ::= expr
expr ::= term (("+" | "-") term)*
term ::= [0-9] | "(" expr ")"
"""
PROMPTS = "Data:\nHello, my dog is cute\nThe capital of France is\nA"
# Tokenizers that can spell any text: byte-level BPE (gpt2, bloom, opt) and metaspace BPE with byte fallback
# (llama). XLNet's metaspace unigram has no byte fallback: only the characters of its vocabulary.
SUPPORTED = ["gpt2", "bloom", "opt", "llama"]
ASCII_SCHEMA = dict(SCHEMA, properties=dict(SCHEMA["properties"], city={"type": "string", "enum": ["Paris", "Rome"]}))
ASCII_REGEX = r"[a-z]{1,5} [0-9]{2}(!|\?)"


def valid_record(text, cities=("Paris", "Zürich", "東京")):
    """SCHEMA, checked by hand: the test must not trust the library it checks."""
    value = json.loads(text)
    assert isinstance(value, dict) and set(value) == {"name", "age", "city"}, value
    assert isinstance(value["name"], str) and len(value["name"]) <= 8, value
    assert type(value["age"]) is int and 0 <= value["age"] <= 120, value
    assert value["city"] in cities, value


def valid_expression(text):
    position = 0

    def term():
        nonlocal position
        if text[position : position + 1] == "(":
            position += 1
            expr()
            assert text[position : position + 1] == ")", text
            position += 1
        else:
            assert text[position : position + 1].isdigit(), text
            position += 1

    def expr():
        nonlocal position
        term()
        while text[position : position + 1] in ("+", "-") and position < len(text):
            position += 1
            term()

    expr()
    assert position == len(text), text


def generated(result):
    assert result.returncode == 0, result.stderr.decode()[-3000:]
    return jsonl(result.stdout)


@pytest.mark.parametrize("model_type", SUPPORTED)
def test_json_schema_sampled_batched_valid_by_construction(tiny_models, model_type):
    args = tiny_args(tiny_models, model_type, "--json_schema", json.dumps(SCHEMA), "--length", "90",
                     "--num_return_sequences", "3", "--batch_size", "4", "--output_format", "jsonl")
    records = generated(run_main(args, stdin=PROMPTS))
    assert len(records) == 12
    for record in records:
        # A random model never chooses JSON: only the constraint can make all of these parse.
        assert record["finish_reason"] == "grammar", record
        valid_record(record["generated_text"])


@pytest.mark.parametrize("model_type, regex", [("gpt2", REGEX), ("llama", REGEX), ("xlnet", ASCII_REGEX)])
def test_regex_greedy_and_beams(tiny_models, model_type, regex):
    for extra in (["--temperature", "0"], ["--temperature", "0", "--num_beams", "4", "--num_return_sequences", "3"]):
        args = tiny_args(tiny_models, model_type, "--regex", regex, "--length", "30", "--output_format", "jsonl",
                         *extra)
        for record in generated(run_main(args, stdin=PROMPTS)):
            assert record["finish_reason"] == "grammar", record
            assert re.fullmatch(regex, record["generated_text"]), record


def test_beams_over_a_grammar_of_few_tokens_keep_stderr_clean(tiny_models, capfd, tmp_path):
    """Beam search keeps more candidates than the grammar allows tokens: the masked-out ones it keeps (llama's
    <unk> and <s> among them) leave the grammar without xgrammar's native warnings on stderr."""
    grammar = tmp_path / "yes_or_no.gbnf"
    grammar.write_text('root ::= "yes" | "no"')
    args = tiny_args(tiny_models, "llama", "--grammar", str(grammar), "--length", "5", "--num_beams", "3",
                     "--prompt", "Is Paris in France? Answer: ", "--output_format", "jsonl", "--quiet")
    [record] = generated(run_main(args))
    assert record["finish_reason"] == "grammar" and record["generated_text"] in ("yes", "no")
    assert capfd.readouterr().err == ""


def test_metaspace_vocabulary_without_byte_fallback(tiny_models):
    args = tiny_args(tiny_models, "xlnet", "--json_schema", json.dumps(ASCII_SCHEMA), "--length", "90",
                     "--num_return_sequences", "2", "--output_format", "jsonl")
    for record in generated(run_main(args, stdin=PROMPTS)):
        assert record["finish_reason"] == "grammar", record
        valid_record(record["generated_text"], cities=("Paris", "Rome"))


def test_a_character_the_vocabulary_cannot_spell_fails_that_prompt_in_one_line(tiny_models):
    # The tiny XLNet vocabulary has no "ü" and no byte fallback; "Zürich" can be begun but not finished.
    assert "ü" not in "".join(AutoTokenizer.from_pretrained(tiny_models["xlnet"]).get_vocab())
    args = tiny_args(tiny_models, "xlnet", "--json_schema", '{"enum": ["Zürich"]}', "--length", "20",
                     "--output_format", "jsonl")
    result = run_main(args, stdin=PROMPTS)
    assert result.returncode == 1
    records = jsonl(result.stdout)
    assert [record["prompt_index"] for record in records] == [0, 1, 2, 3]
    assert all("vocabulary has no token to continue '\"Z'" in record["error"] for record in records), records
    assert error_line(result) == "run_generation.py: error: 4 of 4 prompts failed"


def test_gbnf_grammar_file(tiny_models, tmp_path):
    grammar = tmp_path / "expr.gbnf"
    grammar.write_text(GBNF)
    args = tiny_args(tiny_models, "llama", "--grammar", str(grammar), "--length", "40", "--num_return_sequences",
                     "4", "--output_format", "jsonl")
    records = generated(run_main(args, stdin=PROMPTS))
    finished = [record for record in records if record["finish_reason"] == "grammar"]
    assert finished, records
    for record in finished:
        valid_expression(record["generated_text"])
    for record in records:  # cut off by --length: still a prefix the grammar allows
        assert re.fullmatch(r"[0-9()+\-]*", record["generated_text"]), record


def test_text_output_and_streaming_show_the_constrained_text(tiny_models):
    args = tiny_args(tiny_models, "gpt2", "--regex", REGEX, "--length", "30", "--prompt", "Data:")
    for stream in ("--stream", "--no-stream"):
        result = run_main(args + [stream])
        assert result.returncode == 0, result.stderr.decode()
        text = result.stdout.decode().splitlines()[1]
        assert text.startswith("Data:") and re.fullmatch(REGEX, text[len("Data:") :]), text


def test_without_eos_the_sequence_ends_where_the_grammar_does(tiny_models, tmp_path):
    config = tmp_path / "no_eos.json"
    config.write_text(json.dumps({"eos_token_id": None}))
    args = tiny_args(tiny_models, "llama", "--regex", "[a-z]{3} [0-9]{2}!", "--length", "30", "--batch_size", "4",
                     "--generation_config", str(config), "--output_format", "jsonl")
    for record in generated(run_main(args, stdin=PROMPTS)):
        assert record["finish_reason"] == "grammar", record
        assert re.fullmatch("[a-z]{3} [0-9]{2}!", record["generated_text"]), record
        assert record["num_generated_tokens"] < 30  # stopped there, and the padding after is not counted


@pytest.mark.parametrize("prompt, regex, length, finish", [
    ("Data: abc 12! abc 12! abc 12! abc 12! abc", "(abc 12! ){3}abc 1[0-9]!", 30, "grammar"),
    # drafts the grammar rules out from the first token: the greedy check starts over from the prompt
    ("abc abc abc", " [a-z ]+", 6, "length")])
def test_prompt_lookup_keeps_the_constrained_greedy_text(tiny_models, prompt, regex, length, finish):
    base = tiny_args(tiny_models, "gpt2", "--regex", regex, "--temperature", "0", "--length", str(length),
                     "--prompt", prompt, "--output_format", "jsonl")
    plain = generated(run_main(base))
    drafted = generated(run_main(base + ["--prompt_lookup_num_tokens", "3"]))
    assert drafted == plain
    assert plain[0]["finish_reason"] == finish


@pytest.mark.parametrize("model_type", ["openai-gpt", "ctrl", "xlm"])
def test_word_end_tokenizers_are_refused_in_one_line(tiny_models, model_type):
    result = run_main(tiny_args(tiny_models, model_type, "--regex", "[a-z]+", "--prompt", "Hello"))
    assert result.returncode == 2
    assert "marks word ends" in error_line(result)
    assert result.stdout == b""


@pytest.mark.parametrize("flags, message", [
    (["--regex", "[a-z"], "--regex: Regex parsing error"),
    (["--json_schema", '{"type": 5}'], "--json_schema:"),
    (["--json_schema", "schema.json"], "--json_schema: neither a file nor valid JSON"),
    (["--json_schema", "[1, 2]"], "--json_schema: a JSON schema is an object"),
    (["--grammar", "missing.gbnf"], "--grammar missing.gbnf: No such file or directory"),
    (["--regex", "[a-z]+", "--length", "0", "--logprobs", "1", "--output_format", "jsonl"], "--length 0"),
    (["--regex", "a", "--json_schema", "{}"], "not allowed with argument"),
    # what xgrammar would compile otherwise than asked: a keyword it drops, an escape or anchor it reads otherwise
    (["--json_schema", '{"type": "array", "items": {"type": "integer"}, "uniqueItems": true}'],
     "--json_schema: uniqueItems: not enforced by the grammar compiler"),
    (["--json_schema", '{"type": "object", "properties": {"a": {"type": "array", "contains": {"const": 1}}}}'],
     "--json_schema: properties.a.contains: not enforced"),
    # xgrammar compiles these without a warning and lets through what they exclude
    (["--json_schema", '{"type": "object", "properties": {"a": {"not": {"type": "string"}}}}'],
     "--json_schema: properties.a.not: not enforced"),
    (["--json_schema", '{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], '
                       '"if": {"properties": {"a": {"const": 1}}}, "then": {"required": ["b"]}}'],
     "--json_schema: if: not enforced"),
    (["--json_schema", '{"type": "number", "multipleOf": 0.5}'],
     "--json_schema: multipleOf is not supported for type:number"),
    (["--json_schema", '{"allOf": [{"type": "integer"}, {"minimum": 1000}]}'],
     "--json_schema: allOf with more than one schema: not enforced"),
    (["--json_schema", '{"type": "object", "required": ["a"], "properties": {}, "additionalProperties": false}'],
     "--json_schema: required 'a', which is not among the properties"),
    (["--regex", "\\A[0-9]{3}\\Z"], "--regex: Regex parsing warning at position 1: Escape sequence '\\A' is not"),
    (["--regex", "a^b"], "'^' should be at the start of the regex"),
])
def test_bad_constraints_are_one_line_and_exit_2(tiny_models, flags, message):
    result = run_main(tiny_args(tiny_models, "gpt2", "--prompt", "Hello", *flags))
    assert result.returncode == 2
    assert message in error_line(result)
    assert result.stdout == b""


def test_llama_cpps_json_gbnf_with_its_empty_alternatives(tiny_models, tmp_path):
    # llama.cpp's grammars/json.gbnf ends with `ws ::= | " " | "\n" [ \t]{0,20}`: an empty alternative, which
    # llama.cpp's parser takes and xgrammar's does not; spelled "" for it, the grammar runs as llama.cpp's does
    from rungen.constrain import empty_alternatives

    assert empty_alternatives('ws ::= | " " | "\\n"') == 'ws ::= "" | " " | "\\n"'
    assert empty_alternatives('x ::= ("a" | ) "|" [|] # a | b') == 'x ::= ("a" | "" ) "|" [|] # a | b'
    assert empty_alternatives('y ::= "a" || "b"') == 'y ::= "a" |"" | "b"'
    grammar = tmp_path / "json.gbnf"
    grammar.write_text(LLAMA_CPP_JSON_GBNF)
    result = run_main(tiny_args(tiny_models, "gpt2", "--prompt", "Hello", "--grammar", str(grammar), "--length", "30",
                                "--temperature", "0", "--output_format", "jsonl"))
    assert result.returncode == 0, result.stderr.decode()
    [record] = [json.loads(line) for line in result.stdout.decode().splitlines()]
    if record["finish_reason"] == "grammar":
        json.loads(record["generated_text"])


# llama.cpp's grammars/json.gbnf as published
LLAMA_CPP_JSON_GBNF = r"""root   ::= object
value  ::= object | array | string | number | ("true" | "false" | "null") ws

object ::=
  "{" ws (
            string ":" ws value
    ("," ws string ":" ws value)*
  )? "}" ws

array  ::=
  "[" ws (
            value
    ("," ws value)*
  )? "]" ws

string ::=
  "\"" (
    [^"\\\x7F\x00-\x1F] |
    "\\" (["\\/bfnrt] | "u" [0-9a-fA-F]{4}) # escapes
  )* "\"" ws

number ::= ("-"? ([0-9] | [1-9] [0-9]{0,15})) ("." [0-9]+)? ([eE] [-+]? [0-9] [1-9]{0,15})? ws

# Optional space: by convention, applied in this grammar after literal chars when allowed
ws ::= | " " | "\n" [ \t]{0,20}
"""


def test_a_ban_that_leaves_the_grammar_nothing_is_named(tiny_models):
    # --no_repeat_ngram_size 1 bans the one token "x{30}" can go on with: the error record says so (it blamed the
    # vocabulary), and xgrammar's C++ rejecting the token that came instead says nothing on stderr
    result = run_main(tiny_args(tiny_models, "gpt2", "--regex", "x{30}", "--no_repeat_ngram_size", "1", "--length",
                                "40", "--temperature", "0", "--output_format", "jsonl"), stdin="Hello\n")
    [record] = [json.loads(line) for line in result.stdout.decode().splitlines()]
    assert result.returncode == 1 and "is banned by --no_repeat_ngram_size 1" in record["error"], record
    assert "/project/cpp/" not in result.stderr.decode()


def test_a_property_named_like_a_keyword_is_a_property(tiny_models):
    # "not" and "contains" as property names are not the keywords: the schema is enforced, and nothing is refused
    schema = {"type": "object", "properties": {"not": {"type": "integer"}, "contains": {"type": "boolean"}},
              "required": ["not", "contains"]}
    result = run_main(tiny_args(tiny_models, "gpt2", "--prompt", "Hello", "--json_schema", json.dumps(schema),
                                "--length", "40", "--temperature", "0"))
    assert result.returncode == 0 and b"Warning" not in result.stderr, result.stderr.decode()


def test_bad_gbnf_is_one_line(tiny_models, tmp_path):
    grammar = tmp_path / "bad.gbnf"
    grammar.write_text('root ::= "a" | ("b"')
    result = run_main(tiny_args(tiny_models, "gpt2", "--prompt", "Hello", "--grammar", str(grammar)))
    assert result.returncode == 2
    assert error_line(result).startswith("run_generation.py: error: --grammar: EBNF parser error")


def test_default_model_gives_schema_valid_json(default_model):
    cache_home, _, _ = default_model
    prompts = "\n".join(json.dumps({"messages": [{"role": "user", "content": text}]}) for text in (
        "Describe a person who lives in Paris as JSON.", "Give me a JSON record of someone from Tokyo."))
    args = ["--json_schema", json.dumps(SCHEMA), "--length", "60", "--input_format", "jsonl",
            "--output_format", "jsonl", "--temperature", "0"]
    for record in generated(run_main(args, stdin=prompts, cache_home=cache_home)):
        assert record["finish_reason"] == "grammar", record
        valid_record(record["generated_text"])
