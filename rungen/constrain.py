"""Constrained output: --json_schema, --regex and --grammar (GBNF, as llama.cpp writes it).

xgrammar compiles the constraint against the model's vocabulary once; a logits processor masks every token that
would leave the language, so each sequence is valid by construction (why xgrammar: docs/performance.md).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import re
import sys
import tempfile
import threading

import torch
import xgrammar as xgr
from transformers import LogitsProcessor, StoppingCriteria

from .errors import UsageError, one_line

KINDS = {"json_schema": "--json_schema", "regex": "--regex", "grammar": "--grammar",
         "tools": "tools"}  # a chat request's tool calls: a grammar built by rungen/tools.py


class ConstraintError(UsageError):
    """A schema, regex or grammar that cannot be used: the message is one line."""


def read_constraint(*, json_schema: str | None = None, regex: str | None = None,
                    grammar: str | None = None) -> tuple[str, str] | None:
    """(kind, source text) from the flags' values, or None; raises ConstraintError."""
    values = {"json_schema": json_schema, "regex": regex, "grammar": grammar}
    given = [(kind, value) for kind, value in values.items() if value is not None]
    if not given:
        return None
    kind, value = given[0]  # argparse lets one through
    flag = KINDS[kind]
    if kind == "grammar" or (kind == "json_schema" and os.path.isfile(value)):
        try:
            with open(value, encoding="utf-8") as f:
                value = f.read()
        except (OSError, UnicodeDecodeError) as error:
            raise ConstraintError(f"{flag} {value}: {getattr(error, 'strerror', None) or error}") from error
    if kind == "json_schema":
        try:
            schema = json.loads(value)
        except json.JSONDecodeError as error:
            raise ConstraintError(f"{flag}: neither a file nor valid JSON ({error.msg})") from error
        if not isinstance(schema, (dict, bool)):
            raise ConstraintError(f"{flag}: a JSON schema is an object, got {type(schema).__name__}")
    if not value.strip():
        raise ConstraintError(f"{flag}: empty")
    return kind, value


def vocabulary_type(tokenizer, flag: str) -> str:
    """How xgrammar should read the tokens as text (a metaspace vocabulary counts as byte fallback: "\u2581" is a
    space). Word-end marks ("</w>", "@@") spell a token by what follows it, which no per-token mask can follow:
    refused."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = str(backend.decoder) if backend is not None else "none"
    if backend is None or "BPEDecoder" in decoder or "WordPiece" in decoder:
        raise ConstraintError(f"{flag}: {type(tokenizer).__name__} marks word ends in its tokens, so a token's "
                              "text depends on the next one; constrained output needs a byte-level or "
                              "SentencePiece tokenizer")
    if "ByteLevel" in decoder:
        return xgr.VocabType.BYTE_LEVEL
    if "Metaspace" in decoder or "\u2581" in decoder or "ByteFallback" in decoder:
        return xgr.VocabType.BYTE_FALLBACK  # "\u2581" -> " ", "<0x0A>" -> "\n"
    return xgr.VocabType.RAW


def tokenizer_info(tokenizer, vocab_size: int, eos_ids: set[int], flag: str,
                   spelled: frozenset = frozenset()) -> xgr.TokenizerInfo:
    """What each token id spells, for xgrammar; special tokens and ids past the tokenizer spell nothing, so they
    are never allowed, but those `spelled`, which spell their names (a tool format's markers: Mistral's
    [TOOL_CALLS], which the model writes as that token)."""
    spellings = [""] * vocab_size
    for token, index in tokenizer.get_vocab().items():
        if index < vocab_size:
            spellings[index] = token
    for index in tokenizer.all_special_ids:
        if index < vocab_size and index not in spelled:
            spellings[index] = ""
    # add_prefix_space=False: the constrained text continues a prompt, so a leading space is text.
    return xgr.TokenizerInfo(spellings, vocabulary_type(tokenizer, flag), vocab_size=vocab_size,
                             stop_token_ids=sorted(eos_ids), add_prefix_space=False)


@dataclasses.dataclass(frozen=True, eq=False)
class Constraint:
    """A compiled constraint. Without an EOS token a sequence ends where the grammar is complete."""

    flag: str
    compiled: xgr.CompiledGrammar
    stop_ids: tuple[int, ...]
    vocab_size: int

    def matcher(self) -> xgr.GrammarMatcher:
        return xgr.GrammarMatcher(self.compiled, override_stop_tokens=list(self.stop_ids) or None,
                                  terminate_without_stop_token=not self.stop_ids)

    def follow(self, tokens: list[int]) -> tuple[int | None, int | None]:
        """(ended, stuck) for generated tokens: how many tokens ended the grammar (EOS included), or how many it
        accepted before the vocabulary had no token to go on; both None: cut by --length or a stop string."""
        matcher = self.matcher()
        for position, token in enumerate(tokens):
            if token in self.special or not matcher.accept_token(token):
                return None, position
            if matcher.is_terminated():
                return position + 1, None
        return None, None

    @functools.cached_property
    def special(self) -> frozenset:
        """The special tokens but the stop ones: the grammar takes none, and leaves them here rather than in xgrammar
        (which would say so on stderr)."""
        return frozenset(self.compiled.tokenizer_info.special_token_ids) - set(self.stop_ids)

    def processors(self) -> tuple[LogitsProcessor, StoppingCriteria]:
        """A (logits processor, stopping criterion) pair for one generate() call, sharing the grammar states."""
        states = GrammarStates(self)
        return GrammarLogitsProcessor(states), GrammarStop(states)


# JSON Schema keywords xgrammar's converter drops without a word (its grammar is the same without them): an output
# breaking them would pass as finished, so they are refused.
UNENFORCED_KEYWORDS = ("uniqueItems", "contains", "minContains", "maxContains", "propertyNames", "dependentRequired",
                       "dependentSchemas", "dependencies", "unevaluatedProperties", "unevaluatedItems", "not", "if")
# Where a schema holds schemas: by name, in a list, or as the values of an object.
SUBSCHEMA = ("items", "additionalProperties", "additionalItems", "then", "else")  # "not", "if": refused whole
SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
# xgrammar's C++ warnings while it compiles: "[03:41:56] /project/cpp/regex_converter.cc:89: Warning: ...".
CAPTURING = threading.Lock()
NATIVE_WARNING = re.compile(rb"^\[[0-9:]+\] \S+\.cc:\d+: Warning: (.*)$", re.M)


def unenforced(schema, path="") -> str | None:
    """What of a JSON schema xgrammar would not enforce (a keyword, at its path), or None."""
    if not isinstance(schema, dict):
        return None
    for keyword in UNENFORCED_KEYWORDS:
        if keyword in schema:
            return f"{path}{keyword}"
    if isinstance(schema.get("allOf"), list) and len(schema["allOf"]) > 1:
        return f"{path}allOf with more than one schema"
    properties = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
    extra = schema.get("additionalProperties")
    missing = [name for name in schema.get("required") or [] if isinstance(name, str) and name not in properties]
    if missing and not (extra is True or isinstance(extra, dict)):  # xgrammar allows no property it is not told of
        return f"{path}required {missing[0]!r}, which is not among the properties"
    found = [unenforced(schema.get(key), f"{path}{key}.") for key in SUBSCHEMA]
    found += [unenforced(item, f"{path}{key}[{index}].") for key in SUBSCHEMA_LISTS
              if isinstance(schema.get(key), list) for index, item in enumerate(schema[key])]
    found += [unenforced(item, f"{path}{key}.{name}.") for key in SUBSCHEMA_MAPS
              if isinstance(schema.get(key), dict) for name, item in schema[key].items()]
    return next((what for what in found if what), None)


@contextlib.contextmanager
def native_warnings():
    """The warnings xgrammar's C++ writes straight to file descriptor 2 inside the block (a regex escape it reads as
    a plain character, an anchor it ignores, an allOf it only partly follows), collected into the list yielded;
    anything else written there meanwhile (another thread's log line) is passed on."""
    warnings = []
    with CAPTURING:  # one at a time: the descriptor is the process's (the server compiles on executor threads)
        sys.stderr.flush()
        saved = os.dup(2)
        with tempfile.TemporaryFile() as capture:
            os.dup2(capture.fileno(), 2)
            try:
                yield warnings
            finally:
                os.dup2(saved, 2)
                os.close(saved)
                capture.seek(0)
                written = capture.read()
                warnings += [found.decode(errors="replace") for found in NATIVE_WARNING.findall(written)]
                rest = NATIVE_WARNING.sub(b"", written).strip()
                if rest:
                    os.write(2, rest + b"\n")


def empty_alternatives(source: str) -> str:
    """GBNF with its empty alternatives spelled `""`: llama.cpp's parser takes `ws ::= | " " | "\\n"` (its own
    json.gbnf ends so), xgrammar's wants an element there. Outside strings, character classes and comments, a `|`
    right after `::=`, `(` or another `|` gets `""` before it, one right before `|`, `)` or the end gets it after."""
    marks, significant = [], []  # insertion points; (position, character) outside literals and comments
    position, size = 0, len(source)
    while position < size:
        char = source[position]
        if char in "\"[":  # a literal: an element, whatever it holds
            significant.append((position, char))
            close = '"' if char == '"' else "]"
            position += 1
            while position < size and source[position] != close:
                position += 2 if source[position] == "\\" else 1
        elif char == "#":
            while position < size and source[position] != "\n":
                position += 1
        elif not char.isspace():
            significant.append((position, char))
        position += 1
    for number, (at, char) in enumerate(significant):
        if char != "|":
            continue
        before = significant[number - 1][1] if number else ""
        after = significant[number + 1][1] if number + 1 < len(significant) else ""
        if before in ("=", "(", "|"):
            marks.append((at, '"" '))
        if after in (")", ""):  # (before another `|`, that one's own mark does)
            marks.append((at + 1, ' ""'))
    for at, text in sorted(marks, reverse=True):
        source = source[:at] + text + source[at:]
    return source


def compile_constraint(kind: str, source: str, tokenizer, vocab_size: int, eos_ids: set[int],
                       spelled: frozenset = frozenset()) -> Constraint:
    """Compiles (kind, source) for this vocabulary (`spelled`: special tokens the grammar takes as their names);
    raises ConstraintError, also where xgrammar would compile a different language than the one asked for (a
    keyword it drops, a regex escape it reads otherwise)."""
    flag = KINDS[kind]
    compiler = xgr.GrammarCompiler(tokenizer_info(tokenizer, vocab_size, eos_ids, flag, spelled))
    if kind == "json_schema":
        dropped = unenforced(json.loads(source))
        if dropped:
            raise ConstraintError(f"{flag}: {dropped}: not enforced by the grammar compiler (xgrammar), so an output "
                                  "could break it; leave it out or check the output yourself")
    try:
        with native_warnings() as warnings:
            if kind == "json_schema":
                # Compact JSON: free whitespace lets a small model pad with spaces until --length runs out.
                grammar = xgr.Grammar.from_json_schema(source, any_whitespace=False)
                compiled = compiler.compile_grammar(json_string_characters(str(grammar)))
            elif kind == "regex":
                compiled = compiler.compile_regex(source)
            else:
                compiled = compiler.compile_grammar(empty_alternatives(source))
    except (RuntimeError, ValueError, TypeError) as error:
        # xgrammar's messages start with a time and its source file: "[01:51:00] /project/cpp/x.cc:83: ..."
        message = re.sub(r"^\[[0-9:]+\] \S+: ", "", one_line(error))
        raise ConstraintError(f"{flag}: {message}") from error
    if warnings:  # it compiled something other than what was asked for
        raise ConstraintError(f"{flag}: {one_line(warnings[0])}")
    constraint = Constraint(flag, compiled, tuple(sorted(eos_ids)), vocab_size)
    bitmask = xgr.allocate_token_bitmask(1, vocab_size)
    constraint.matcher().fill_next_token_bitmask(bitmask)
    if nothing_allowed(bitmask)[0]:
        raise ConstraintError(f"{flag}: no token of this model's vocabulary can start the output")
    return constraint


# xgrammar writes a bounded string as a repetition of this class, which lets raw control characters through and no
# escape (mlc-ai/xgrammar#800): each repetition is made one JSON character instead.
BOUNDED_STRING_CHARACTER = r'[^\"\\\r\n]'
JSON_CHARACTER = r'([^\0-\x1f\"\\] | ("\\" basic_escape))'


# xgrammar's string characters take the UTF-8 of a lone surrogate (ED A0-BF xx), which no text holds: a byte-token
# model can write it, and the reply reads as three U+FFFD (a string past its maxLength).
STRING_CHARACTERS = r'[^\0-\x1f\"\\'
NO_SURROGATE = STRING_CHARACTERS + r"\ud800-\udfff"


def json_string_characters(ebnf: str) -> str:
    """A JSON schema's grammar (xgrammar's EBNF) with its strings' characters made valid JSON ones: a bounded
    string's each one JSON character, and no string's a lone surrogate."""
    return ebnf.replace(BOUNDED_STRING_CHARACTER, JSON_CHARACTER).replace(STRING_CHARACTERS, NO_SURROGATE)


def nothing_allowed(bitmask: torch.Tensor) -> bool:
    """Per row: no token allowed (xgrammar leaves the bits past the vocabulary at 0)."""
    return (bitmask == 0).all(dim=1)


class GrammarStates:
    """The grammar state of each sequence, keyed by its generated tokens: beam search and assisted decoding move
    rows, so a row is found by what it holds."""

    def __init__(self, constraint):
        self.constraint = constraint
        self.start = None  # prompt length (padded): the first call sees the prompt alone
        self.states = {}
        self.rows = []
        # Beam search keeps candidates the mask ruled out: a special token among them leaves the grammar.
        self.special = constraint.special

    def update(self, input_ids):
        """The states of the rows of input_ids (once per length: the processor and the stop share it)."""
        if self.start is None:
            self.start = input_ids.shape[1]
            self.states = {(): self.constraint.matcher()}
        keys = [tuple(row) for row in input_ids[:, self.start :].tolist()]
        if [key for key, _ in self.rows] == keys:
            return self.rows
        states, children = {}, {}
        for key in dict.fromkeys(keys):
            if key in self.states:
                states[key] = self.states[key]
            elif not key:  # back at the prompt: assisted decoding's greedy check starts over from it
                states[key] = self.constraint.matcher()
            else:
                children.setdefault(key[:-1], []).append(key)
        for parent_key, kids in children.items():
            parent = self.states[parent_key] if parent_key in self.states else self.replay(parent_key)
            for number, key in enumerate(kids):
                # The last child takes the parent over unless a row still holds the parent itself.
                in_place = number == len(kids) - 1 and parent_key not in states
                states[key] = advance(parent, key[-1], in_place, self.special)
        self.states = states
        self.rows = [(key, states[key]) for key in keys]
        return self.rows

    def replay(self, key):
        """The state after key from the start (a draft token's row whose parent was not kept)."""
        matcher = self.constraint.matcher()
        for token in key:
            matcher = advance(matcher, token, in_place=True, special=self.special)
        return matcher


def advance(matcher: xgr.GrammarMatcher, token: int, in_place: bool, special=frozenset()) -> xgr.GrammarMatcher | None:
    """The state after one more token: None once the grammar rejected one (a `special` token always); an ended
    grammar stays as it is."""
    if matcher is None or matcher.is_terminated():
        return matcher
    if token in special:
        return None
    if not in_place:
        matcher = matcher.fork()
    return matcher if matcher.accept_token(token) else None


class GrammarLogitsProcessor(LogitsProcessor):
    """Masks the tokens that would leave the language; an ended sequence (padding follows) is left alone."""

    def __init__(self, states):
        self.states = states
        self.bitmask = None

    def __call__(self, input_ids, scores):
        rows = self.states.update(input_ids)
        vocab_size = self.states.constraint.vocab_size
        if self.bitmask is None or self.bitmask.shape[0] != len(rows):
            self.bitmask = xgr.allocate_token_bitmask(len(rows), vocab_size)
        self.bitmask.fill_(-1)  # all allowed
        for row, (_, matcher) in enumerate(rows):
            if matcher is not None and not matcher.is_terminated():
                matcher.fill_next_token_bitmask(self.bitmask, row)
        # A row with no token allowed would fail sampling: it goes free and GrammarStop ends it.
        self.bitmask[nothing_allowed(self.bitmask)] = -1
        logits = scores[:, :vocab_size] if scores.shape[1] > vocab_size else scores
        xgr.apply_token_bitmask_inplace(logits, self.bitmask.to(scores.device))
        if scores.shape[1] > vocab_size:
            scores[:, vocab_size:] = float("-inf")  # the embedding's padding rows are no tokens
        return scores


class GrammarStop(StoppingCriteria):
    """Ends a sequence whose grammar has terminated or that has left it (Constraint.follow)."""

    def __init__(self, states):
        self.states = states

    def __call__(self, input_ids, scores, **kwargs):
        rows = self.states.update(input_ids)
        done = [matcher is None or matcher.is_terminated() for _, matcher in rows]
        return torch.tensor(done, dtype=torch.bool, device=input_ids.device)
