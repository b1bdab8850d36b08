"""Fixtures of the fast tier: a tokenizer written on the spot, no model."""

import pytest

from tiny_models import build_tokenizer


@pytest.fixture(scope="module")
def gpt2_tokenizer(tmp_path_factory):
    tokenizer, _ = build_tokenizer("gpt2", str(tmp_path_factory.mktemp("tok")))
    tokenizer.pad_token = tokenizer.eos_token
    return tokenizer
