"""Checks on the tiny offline checkpoints that the other tests rely on."""

import filecmp
import os

import pytest
import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from tiny_models import (
    CONTEXT_ATTR,
    LOWERCASE_TYPES,
    MAX_POSITIONS,
    MODEL_CLASS_NAMES,
    MODEL_TYPES,
    build_tiny_checkpoint,
)

TEXT = "Hello, my dog is cute"
# The end of the original script's XLNet PREFIX (run_generation.py): markup that the tokenizers of
# several types turn into special / added tokens (XLNet's <eod>, the </s> of most).
PREFIX_TAIL = "with people, even a bishop, begging for his blessing. <eod> </s> <eos>"

# --------------------------------------------------------------------------- #
# Independent oracle: the special tokens of the PUBLISHED checkpoints, written from their
# hub files (tokenizer_config.json, special_tokens_map.json, config.json, generation_config.json
# of openai-community/gpt2, EleutherAI/gpt-j-6b, openai-community/openai-gpt, Salesforce/ctrl,
# FacebookAI/xlm-clm-enfr-1024, xlnet/xlnet-base-cased, bigscience/bloom-560m,
# meta-llama/Llama-2-7b-hf, mistralai/Mistral-7B-v0.1, facebook/opt-125m, Qwen/Qwen2-0.5B;
# where a hub file sets nothing, the transformers class defaults it falls back to), NOT from
# tiny_models.py.  A fixture that drifts from these fails here.
#   tokens:  the seven named special tokens (absent = None) and the extra special tokens
#   ids:     token -> id; an int is the published id, (ROWS, -k) is "k-th id from the end of the
#            embedding matrix", (TOKENS, -k) "k-th from the end of the tokenizer" (the published
#            vocabularies are larger, but the position is what the fixture mirrors)
#   fill_after: (token, pattern): the ids after token, up to the last row, are pattern.format(1, 2, ...)
#   config:  the tokens behind config.json's bos/eos/pad_token_id (and other *_id / *_index keys)
#   generation: generation_config.json ids where they differ from config.json
#   first / last: what tokenizer(text) (add_special_tokens=True) puts around the text
#   rows:    "==" embedding rows = len(tokenizer); ">" the embedding matrix is padded past it
# --------------------------------------------------------------------------- #
ROWS, TOKENS = "rows", "tokens"
EOT = "<|endoftext|>"
XLM_EXTRA = [f"<special{i}>" for i in range(10)]
PUBLISHED = {
    "gpt2": dict(  # vocab.json: <|endoftext|> = 50256, the last of 50257; config bos = eos = 50256
        tokens=dict(bos_token=EOT, eos_token=EOT, unk_token=EOT),
        ids={EOT: (ROWS, -1)},
        config=dict(bos_token_id=EOT, eos_token_id=EOT, pad_token_id=None),
        rows="=="),
    "gptj": dict(  # <|endoftext|> = 50256, then <|extratoken_1..143|> (non-special) up to 50399
        tokens=dict(bos_token=EOT, eos_token=EOT, unk_token=EOT),
        fill_after=(EOT, "<|extratoken_{}|>"),
        config=dict(bos_token_id=EOT, eos_token_id=EOT, pad_token_id=None),
        rows="=="),
    "openai-gpt": dict(  # <unk> only; config.json has no bos/eos/pad
        tokens=dict(unk_token="<unk>"),
        ids={"<unk>": 0},
        config=dict(bos_token_id=None, eos_token_id=None, pad_token_id=None),
        rows="=="),
    "ctrl": dict(  # <unk> only, = 246532 of 246534 rows; config.json has no bos/eos/pad
        tokens=dict(unk_token="<unk>"),
        ids={"<unk>": (ROWS, -2), "Links": 63674, "Books": 6665, "Wikipedia": 37583},
        config=dict(bos_token_id=None, eos_token_id=None, pad_token_id=None)),
    "xlm": dict(  # XLMTokenizer defaults (no eos!); config bos_index 0, eos_index 1, pad_index 2
        tokens=dict(bos_token="<s>", unk_token="<unk>", sep_token="</s>", pad_token="<pad>",
                    cls_token="</s>", mask_token="<special1>"),
        extra=XLM_EXTRA,
        ids={"<s>": 0, "</s>": 1, "<pad>": 2, "<unk>": 3, **{t: 4 + i for i, t in enumerate(XLM_EXTRA)}},
        config=dict(bos_token_id="<s>", eos_token_id="</s>", pad_token_id="<pad>", unk_index="<unk>",
                    mask_index="<special1>", mask_token_id="<s>"),
        generation=dict(bos_token_id="<s>", eos_token_id=None, pad_token_id="<pad>"),
        first="<s>", last=["</s>"], rows="=="),
    "xlnet": dict(
        tokens=dict(bos_token="<s>", eos_token="</s>", unk_token="<unk>", sep_token="<sep>",
                    pad_token="<pad>", cls_token="<cls>", mask_token="<mask>"),
        extra=["<eop>", "<eod>"],
        ids={"<unk>": 0, "<s>": 1, "</s>": 2, "<cls>": 3, "<sep>": 4, "<pad>": 5, "<mask>": 6,
             "<eod>": 7, "<eop>": 8},
        config=dict(bos_token_id="<s>", eos_token_id="</s>", pad_token_id="<pad>"),
        last=["<sep>", "<cls>"], rows="=="),
    "bloom": dict(  # 250680 tokens, 250880 rows; padding_side left
        tokens=dict(bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>"),
        ids={"<unk>": 0, "<s>": 1, "</s>": 2, "<pad>": 3},
        config=dict(bos_token_id="<s>", eos_token_id="</s>", pad_token_id="<pad>"),
        padding_side="left", rows=">"),
    "llama": dict(  # add_bos_token true, pad null; generation_config.json pad_token_id 0
        tokens=dict(bos_token="<s>", eos_token="</s>", unk_token="<unk>"),
        ids={"<unk>": 0, "<s>": 1, "</s>": 2},
        config=dict(bos_token_id="<s>", eos_token_id="</s>", pad_token_id=None),
        generation=dict(bos_token_id="<s>", eos_token_id="</s>", pad_token_id="<unk>"),
        first="<s>", rows="=="),
    "mistral": dict(
        tokens=dict(bos_token="<s>", eos_token="</s>", unk_token="<unk>"),
        ids={"<unk>": 0, "<s>": 1, "</s>": 2},
        config=dict(bos_token_id="<s>", eos_token_id="</s>", pad_token_id=None),
        first="<s>", rows="=="),
    "opt": dict(  # vocab <s> <pad> </s> <unk> = 0-3, but bos = eos = unk = </s>; 50265 tokens, 50272 rows
        tokens=dict(bos_token="</s>", eos_token="</s>", unk_token="</s>", pad_token="<pad>"),
        ids={"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3},
        config=dict(bos_token_id="</s>", eos_token_id="</s>", pad_token_id="<pad>"),
        first="</s>", rows=">"),
    "qwen2": dict(  # no bos, no unk; 151643-151645 after the BPE vocab; 151646 tokens, 151936 rows
        tokens=dict(eos_token=EOT, pad_token=EOT),
        extra=["<|im_start|>", "<|im_end|>"],
        ids={EOT: (TOKENS, -3), "<|im_start|>": (TOKENS, -2), "<|im_end|>": (TOKENS, -1)},
        config=dict(bos_token_id=EOT, eos_token_id=EOT, pad_token_id=None),
        rows=">"),
}
NAMED_SPECIAL = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


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


def test_oracle_covers_every_type():
    assert set(PUBLISHED) == set(MODEL_TYPES)


def _load(path):
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    return tok, model, model.get_input_embeddings().weight.shape[0]


def _expected_id(spec, tok, rows):
    if isinstance(spec, tuple):
        base, offset = spec
        return (rows if base == ROWS else len(tok)) + offset
    return spec


def test_special_tokens_match_the_published_checkpoint(tiny_model):
    model_type, path = tiny_model
    expected = PUBLISHED[model_type]
    tok, model, rows = _load(path)
    for name in NAMED_SPECIAL:
        assert getattr(tok, name) == expected["tokens"].get(name), name
    assert sorted(tok.extra_special_tokens) == sorted(expected.get("extra", []))
    for token, spec in expected.get("ids", {}).items():
        assert tok.convert_tokens_to_ids(token) == _expected_id(spec, tok, rows), token
    if "fill_after" in expected:  # GPT-J: <|extratoken_N|> from the id after <|endoftext|> to the last row
        anchor, pattern = expected["fill_after"]
        start = tok.convert_tokens_to_ids(anchor)
        fill = [tok.convert_tokens_to_ids(pattern.format(i)) for i in range(1, rows - start)]
        assert fill == list(range(start + 1, rows)) and fill
        assert not {pattern.format(i) for i in range(1, rows - start)} & set(tok.all_special_tokens)
    if "padding_side" in expected:
        assert tok.padding_side == expected["padding_side"]
    # what encoding with add_special_tokens=True puts around the text
    plain = tok(TEXT, add_special_tokens=False)["input_ids"]
    wrapped = tok.convert_ids_to_tokens(tok(TEXT)["input_ids"])
    first, last = expected.get("first"), expected.get("last", [])
    assert wrapped == ([first] if first else []) + tok.convert_ids_to_tokens(plain) + last
    # the embedding matrix: as many rows as tokens, or padded past the tokenizer
    assert rows == model.config.vocab_size
    assert {"==": rows == len(tok), ">": rows > len(tok)}.get(expected.get("rows"), True), (rows, len(tok))


def test_config_special_ids_match_the_published_checkpoint(tiny_model):
    model_type, path = tiny_model
    expected = PUBLISHED[model_type]
    tok = AutoTokenizer.from_pretrained(path)
    config = AutoConfig.from_pretrained(path)
    generation = GenerationConfig.from_pretrained(path)

    def ids(table):
        return {key: None if token is None else tok.convert_tokens_to_ids(token) for key, token in table.items()}

    assert {key: getattr(config, key) for key in expected["config"]} == ids(expected["config"])
    gen_expected = expected.get("generation") or {k: v for k, v in expected["config"].items() if k.endswith("token_id")
                                                  and k != "mask_token_id"}
    assert {key: getattr(generation, key) for key in gen_expected} == ids(gen_expected)


def test_every_token_id_is_inside_the_embeddings(tiny_model):
    """Every id the tokenizer can produce, special and added tokens included (XLNet's <eod>
    and <eop>, which the original script's PREFIX contains), is a row of the model's input embeddings."""
    model_type, path = tiny_model
    tok, model, rows = _load(path)
    assert rows == model.config.vocab_size
    assert 0 <= min(tok.get_vocab().values()) and max(tok.get_vocab().values()) < rows
    marked = list(dict.fromkeys(tok.all_special_tokens + list(tok.get_added_vocab())))
    for token in marked:
        token_id = tok.convert_tokens_to_ids(token)
        assert token_id is not None and 0 <= token_id < rows, token
        assert tok(token, add_special_tokens=False)["input_ids"] == [token_id], token
    text = " ".join([PREFIX_TAIL, *marked, TEXT])
    for add_special_tokens in (True, False):
        ids = tok(text, add_special_tokens=add_special_tokens)["input_ids"]
        assert ids and 0 <= min(ids) and max(ids) < rows
    if model_type == "xlnet":  # the PREFIX's <eod> is XLNet's own <eod>, not pieces of it
        assert tok.convert_tokens_to_ids("<eod>") in tok(PREFIX_TAIL, add_special_tokens=False)["input_ids"]
