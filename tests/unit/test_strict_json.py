"""rungen/strict_json.py: what Python's json takes and JSON does not, refused naming its field; the nesting
depth counted without recursion, brackets inside strings ignored."""

import json

import pytest
from hypothesis import given, seed, settings
from hypothesis import strategies as st

from rungen.strict_json import JSONError, loads, nesting_depth


@pytest.mark.parametrize("text, field, words", [
    ('{"a": 1, "temperature": NaN}', "temperature", "NaN"),
    ('{"x": [1, {"y": -Infinity}]}', "x", "-Infinity"),
    ('{"n": 1e999}', "n", "1e999"),
    ('{"messages": [{"content": "\\ud800"}]}', "messages", "surrogate"),
    ('{"k\\udfff": 1}', "k\\udfff", "surrogate"),
    ("[NaN]", None, "NaN"),
    ('{"a": 1', None, "not valid JSON"),
    ('{"n": ' + "9" * 5000 + "}", None, "not valid JSON"),
    # A key given twice: which value the sender meant is unknown (Python's json would keep the last silently).
    ('{"prompt": "first", "prompt": "second"}', "prompt", 'the key "prompt" is given twice'),
    ('{"messages": [{"role": "user", "role": "system", "content": "x"}]}', None, 'the key "role" is given twice'),
])
def test_what_json_does_not_allow_is_refused_naming_its_field(text, field, words):
    with pytest.raises(JSONError) as error:
        loads(text)
    assert error.value.field == field and words in error.value.message


def test_valid_json_and_a_paired_surrogate_load_as_json_loads_them():
    text = '{"a": [1, 2.5, "\\ud83d\\ude00", {"b": null}], "c": "[[[{{{"}'
    assert loads(text) == json.loads(text)


def test_the_depth_limit_is_exact_and_deep_texts_cost_no_recursion():
    assert loads("[" * 64 + "]" * 64, max_depth=64) == json.loads("[" * 64 + "]" * 64)
    for text in ("[" * 65 + "]" * 65, "[" * 1_000_000, '{"a":' * 200_000):
        with pytest.raises(JSONError, match="nest"):
            loads(text, max_depth=64)


def true_depth(value):
    if isinstance(value, dict):
        return 1 + max(map(true_depth, value.values()), default=0)
    if isinstance(value, list):
        return 1 + max(map(true_depth, value), default=0)
    return 0


VALUES = st.recursive(st.none() | st.integers() | st.text(alphabet='[]{}"\\ab'),
                      lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(alphabet="[]{}\"\\a"),
                                                                                  inner, max_size=3),
                      max_leaves=30)


@seed(20261125)
@settings(max_examples=300, deadline=None, database=None)
@given(value=VALUES, limit=st.integers(0, 8))
def test_the_counted_depth_passes_the_limit_exactly_when_the_value_does(value, limit):
    text = json.dumps(value, ensure_ascii=bool(limit % 2))
    depth = nesting_depth(text, limit)
    assert (depth > limit) == (true_depth(value) > limit)
    if depth > limit:
        assert depth == true_depth(value)
