"""Checks on the tiny offline checkpoints that the other tests rely on."""

import filecmp
import os

import pytest
import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from tiny_models import (
    CONTEXT_ATTR,
    LOWERCASE_TYPES,
    MAX_POSITIONS,
    MODEL_CLASS_NAMES,
    MODEL_TYPES,
    build_tiny_checkpoint,
)

TEXT = "Hello, my dog is cute"
BOS_TYPES = ("llama", "mistral", "qwen2", "gptj", "bloom", "opt")


def test_build_all_covers_every_type(tiny_models):
    assert set(tiny_models) == set(MODEL_TYPES)
    for path in tiny_models.values():
        files = set(os.listdir(path))
        assert {"config.json", "model.safetensors", "tokenizer_config.json"} <= files


def test_config(tiny_model):
    model_type, path = tiny_model
    config = AutoConfig.from_pretrained(path)
    assert config.model_type == model_type
    assert config.num_hidden_layers == 2
    assert config.hidden_size == 32
    attr = CONTEXT_ATTR[model_type]
    if attr is None:  # xlnet, bloom: no position limit
        assert model_type in ("xlnet", "bloom")
    else:
        assert getattr(config, attr) == MAX_POSITIONS


def test_loads_with_auto_and_own_class(tiny_model):
    model_type, path = tiny_model
    own_class = getattr(transformers, MODEL_CLASS_NAMES[model_type])
    auto = AutoModelForCausalLM.from_pretrained(path)
    assert type(auto) is own_class
    model, info = own_class.from_pretrained(path, output_loading_info=True)
    assert not any(info.values()), info  # no missing / unexpected / mismatched keys
    assert model.config.model_type == model_type


def test_tokenizer_round_trip(tiny_model):
    model_type, path = tiny_model
    tok = AutoTokenizer.from_pretrained(path)
    ids = tok(TEXT, add_special_tokens=False)["input_ids"]
    assert ids and tok.unk_token_id not in ids
    decoded = tok.decode(ids, skip_special_tokens=True)
    if model_type in LOWERCASE_TYPES:  # lower-cased, punctuation split off
        assert decoded.replace(" ,", ",") == TEXT.lower()
    else:
        assert decoded == TEXT
    assert tok("The capital of France is", add_special_tokens=False)["input_ids"]
    assert tok.eos_token is not None
    if model_type in BOS_TYPES:
        assert tok.bos_token is not None


def test_ctrl_control_codes(tiny_models):
    tok = AutoTokenizer.from_pretrained(tiny_models["ctrl"])
    ids = tok.encode("Links Hello, my dog is cute", add_special_tokens=False)
    assert ids[0] == tok.control_codes["Links"] == 63674
    assert tok.unk_token_id not in ids
    assert AutoConfig.from_pretrained(tiny_models["ctrl"]).vocab_size > 63674


def test_xlm_languages(tiny_models):
    config = AutoConfig.from_pretrained(tiny_models["xlm"])
    assert config.use_lang_emb and config.n_langs == 2
    assert config.lang2id == {"en": 0, "fr": 1}
    tok = AutoTokenizer.from_pretrained(tiny_models["xlm"])
    assert tok.lang2id == {"en": 0, "fr": 1}


def test_greedy_generation(tiny_model):
    """20 new, non-special, printable tokens; peaked logits (no near-ties)."""
    model_type, path = tiny_model
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    enc = tok(TEXT, return_tensors="pt", add_special_tokens=model_type not in ("xlnet", "xlm"))
    out = model.generate(**enc, max_new_tokens=20, do_sample=False, pad_token_id=tok.eos_token_id,
                         output_scores=True, return_dict_in_generate=True)
    new = out.sequences[0, enc["input_ids"].shape[1]:].tolist()
    assert len(new) == 20
    assert not set(new) & set(tok.all_special_ids)
    assert len(set(new)) > 1  # not one token repeated forever
    text = tok.decode(new, skip_special_tokens=True)
    assert text.strip() and text.isprintable() and "\ufffd" not in text
    top2 = torch.stack([s[0].topk(2).values for s in out.scores])
    assert (top2[:, 0] - top2[:, 1]).min() > 1e-4


@pytest.mark.parametrize("model_type", ["gpt2", "ctrl", "xlm", "xlnet"])
def test_build_is_reproducible(tiny_models, tmp_path, model_type):
    again = build_tiny_checkpoint(model_type, str(tmp_path / model_type))
    first = tiny_models[model_type]
    names = sorted(os.listdir(first))
    assert names == sorted(os.listdir(again))
    _, mismatch, errors = filecmp.cmpfiles(first, again, names, shallow=False)
    assert not mismatch and not errors

