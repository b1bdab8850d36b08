"""The grammar's logits processor follows each sequence by its tokens, not its row: beam search reorders
rows, several rows share a parent, and a finished or stuck row must not break sampling."""

import json
import math

import torch
import xgrammar as xgr

from rungen.constrain import Constraint

A, B, C, EOS = 0, 1, 2, 3
PROMPT = [7, 7]  # the prompt's ids are never read by the grammar


def regex_constraint(regex, stop_ids=(EOS,)):
    info = xgr.TokenizerInfo(["a", "b", "c", ""], vocab_size=4, stop_token_ids=list(stop_ids) or None)
    return Constraint("--regex", xgr.GrammarCompiler(info).compile_regex(regex), tuple(stop_ids), 4)


def allowed(processor, rows):
    scores = processor(torch.tensor([PROMPT + row for row in rows]), torch.zeros(len(rows), 4))
    return [{token for token in range(4) if not math.isinf(scores[r, token])} for r in range(len(rows))]


def test_rows_are_followed_by_their_tokens_when_reordered_and_shared():
    processor, stop = regex_constraint("(ab|ba)c").processors()
    assert allowed(processor, [[], []]) == [{A, B}, {A, B}]
    assert allowed(processor, [[A], [B]]) == [{B}, {A}]
    assert allowed(processor, [[B, A], [A, B]]) == [{C}, {C}]  # rows swapped, as beam search does
    assert allowed(processor, [[A, B, C], [A, B, C]]) == [{EOS}, {EOS}]  # two rows from one parent
    ended = torch.tensor([PROMPT + [A, B, C, EOS], PROMPT + [A, B, C, EOS]])
    assert stop(ended, None).tolist() == [True, True]


def test_an_ended_row_is_left_alone_and_a_stuck_row_is_let_loose_then_stopped():
    constraint = regex_constraint("ab")
    processor, stop = constraint.processors()
    allowed(processor, [[], []])
    allowed(processor, [[A], [A]])
    # Row 0 ended (EOS, then padding); row 1 took a token outside the language (it had been let loose).
    assert allowed(processor, [[A, B, EOS], [A, C, C]]) == [{A, B, C, EOS}, {A, B, C, EOS}]
    assert stop(torch.tensor([PROMPT + [A, B, EOS, A], PROMPT + [A, C, C, C]]), None).tolist() == [True, True]
    assert constraint.follow([A, B, EOS, EOS]) == (3, None)
    assert constraint.follow([A, C, C]) == (None, 1)
    assert constraint.follow([A, B]) == (None, None)  # cut off before EOS


def test_without_eos_the_grammar_ends_the_sequence_where_it_is_complete():
    constraint = regex_constraint("ab", stop_ids=())
    processor, stop = constraint.processors()
    allowed(processor, [[]])
    assert stop(torch.tensor([PROMPT + [A]]), None).tolist() == [False]
    assert stop(torch.tensor([PROMPT + [A, B]]), None).tolist() == [True]
    assert constraint.follow([A, B, A]) == (2, None)


def test_a_length_bounded_json_string_takes_escapes_and_no_raw_control_character(gpt2_tokenizer):
    # xgrammar's own grammar for a string with maxLength admits raw control characters (json.loads rejects
    # them) and no escape; compile_constraint gives each bounded character JSON's own spelling.
    from rungen.constrain import compile_constraint

    schema = json.dumps({"type": "object", "properties": {"name": {"type": "string", "maxLength": 4}},
                         "required": ["name"], "additionalProperties": False})
    eos = gpt2_tokenizer.eos_token_id
    constraint = compile_constraint("json_schema", schema, gpt2_tokenizer, len(gpt2_tokenizer), {eos})

    def stuck_at(text):
        return constraint.follow(gpt2_tokenizer(text)["input_ids"] + [eos])[1]

    for valid in ('{"name": "abcd"}', '{"name": "a\\"b"}', '{"name": "\\u00e9\\n"}', '{"name": ""}'):
        json.loads(valid)
        assert stuck_at(valid) is None, valid
    for invalid in ('{"name": "a\x13"}', '{"name": "a\tb"}', '{"name": "abcde"}'):
        assert stuck_at(invalid) is not None, invalid


def test_a_json_string_takes_whole_characters_and_no_lone_surrogate(tmp_path):
    """On a SentencePiece vocabulary's byte tokens: a JSON string takes a character's UTF-8 bytes one token at a
    time (’ is E2 80 99), never the bytes of a lone surrogate (ED B8 94 decodes as three U+FFFD, past maxLength)."""
    from rungen.constrain import compile_constraint
    from tiny_models import build_tokenizer

    tokenizer, _ = build_tokenizer("mistral", str(tmp_path))
    schema = json.dumps({"type": "object", "properties": {"a": {"type": "string", "maxLength": 3}}, "required": ["a"]})
    constraint = compile_constraint("json_schema", schema, tokenizer, len(tokenizer), {tokenizer.eos_token_id})

    def accepted(*pieces):
        matcher = constraint.matcher()
        assert matcher.accept_string('{"a": "')  # xgrammar's compact JSON: a space after the colon
        return all(matcher.accept_token(tokenizer.convert_tokens_to_ids(piece)) for piece in pieces)

    assert accepted("<0xE2>", "<0x80>", "<0x99>")
    assert accepted("<0xED>", "<0x9F>", "<0xBF>")  # U+D7FF, the last character before the surrogates
    assert not accepted("<0xED>", "<0xB8>", "<0x94>")
    assert not accepted("<0xED>", "<0xA0>")
