"""A GGUF file's tokenizer without importing transformers (most of a cached run's start-up): the header cache's
tokenizer.json on the tokenizers library, special tokens from tokenizer_config.json, the chat template by jinja2
(rungen/chat_template.py), with transformers' results for the same files (tests/test_tokenizer.py).

Files it does not cover load transformers' tokenizer (own() says why). Classes that rebuild the pipeline in Python
(Qwen2Tokenizer, GemmaTokenizer) have what they run recorded in the header cache by save_class_run.
"""

from __future__ import annotations

import json
import os

import torch

SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# tokenizer_config.json keys that change nothing this class computes (the tool never truncates), or it applies.
INERT_KEYS = {"backend", "is_local", "local_files_only", "model_max_length", "tokenizer_class", "name_or_path",
              "clean_up_tokenization_spaces", "padding_side", "truncation_side"}
BACKEND_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")
# Classes whose whole behaviour save_class_run records, their pipeline holding what these keys set.
RECORDED_CLASSES = {"Qwen2Tokenizer": {"add_prefix_space"}, "GemmaTokenizer": {"add_bos_token", "add_eos_token"}}
PIPELINE_FILE = "tokenizer_pipeline.json"  # the class's backend_tokenizer, as it runs
CLASS_FILE = "tokenizer_class.json"  # what the class adds to it in Python


def save_class_run(directory: str, mend) -> None:
    """Records in the header cache `directory` what transformers' tokenizer loaded from the saved files runs: its
    pipeline, `mend`ed (a class that rebuilds it drops what file.mend_tokenizer gave the saved one), and its class's
    Python-side behaviour; added tokens go into tokenizer_config.json (else from_pretrained parses the whole
    tokenizer.json again)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(directory)
    mend(tokenizer)
    config_path = os.path.join(directory, "tokenizer_config.json")
    with open(config_path) as f:
        config = json.load(f)
    config["added_tokens_decoder"] = {str(index): token.__getstate__()
                                      for index, token in tokenizer.added_tokens_decoder.items()}
    with open(config_path, "w") as f:
        json.dump(config, f, indent=2, ensure_ascii=False)
    # The pipeline is kept only where it differs from tokenizer.json (a large vocabulary is MBs twice).
    with open(os.path.join(directory, "tokenizer.json"), encoding="utf-8") as f:
        saved = json.load(f)
    if json.loads(tokenizer.backend_tokenizer.to_str()) != saved:
        tokenizer.backend_tokenizer.save(os.path.join(directory, PIPELINE_FILE))
    behaviour = {"tokenizer_class": type(tokenizer).__name__, "padding_side": tokenizer.padding_side,
                 "clean_up_tokenization_spaces": bool(tokenizer.clean_up_tokenization_spaces),
                 "special_tokens": dict(tokenizer.special_tokens_map),
                 "all_special_tokens": list(tokenizer.all_special_tokens)}
    with open(os.path.join(directory, CLASS_FILE), "w") as f:
        json.dump(behaviour, f, ensure_ascii=False)


def _recorded(directory: str) -> dict | None:
    path = os.path.join(directory, CLASS_FILE)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


def own(directory: str) -> str | None:
    """Why the header cache's tokenizer in `directory` needs transformers' class, or None."""
    with open(os.path.join(directory, "tokenizer_config.json")) as f:
        config = json.load(f)
    tokenizer_class = config.get("tokenizer_class")
    recorded = _recorded(directory)
    if tokenizer_class not in BACKEND_CLASSES and (tokenizer_class not in RECORDED_CLASSES or recorded is None):
        return f"its tokenizer class is {tokenizer_class}"
    if recorded is not None:
        if recorded["tokenizer_class"] != tokenizer_class:
            return f"its recorded tokenizer class is {recorded['tokenizer_class']}, not {tokenizer_class}"
        if recorded["all_special_tokens"] != list(dict.fromkeys(recorded["special_tokens"].values())):
            return "its class has special tokens beyond bos/eos/unk/sep/pad/cls/mask"
        if recorded["clean_up_tokenization_spaces"]:
            return "it cleans up tokenization spaces"
    elif not os.path.isfile(os.path.join(directory, "tokenizer.json")):
        return "it has no tokenizer.json"
    inert = INERT_KEYS | RECORDED_CLASSES.get(tokenizer_class, set())
    other = sorted(set(config) - inert - set(SPECIAL_TOKENS) - {"added_tokens_decoder"})
    if other:
        return f"its tokenizer_config.json sets {', '.join(other)}"
    if config.get("clean_up_tokenization_spaces"):
        return "it cleans up tokenization spaces"
    if os.path.isdir(os.path.join(directory, "additional_chat_templates")):
        return "it has several chat templates"
    return None


def _content(token) -> str | None:
    """A special token as tokenizer_config.json holds it: a string, or a serialized AddedToken."""
    return token.get("content") if isinstance(token, dict) else token


class Encoding(dict):
    """What the tool and its tests read of transformers' BatchEncoding: the keys, and .to(device)."""

    def __getattr__(self, name: str):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None

    def to(self, device) -> Encoding:
        return Encoding({key: value.to(device) if isinstance(value, torch.Tensor) else value
                         for key, value in self.items()})


class GGUFTokenizer:
    """The tokenizers library's Tokenizer of a header cache, with the tokenizer interface the tool uses."""

    def __init__(self, directory: str):
        from tokenizers import Tokenizer

        recorded = _recorded(directory) or {}
        pipeline = os.path.join(directory, PIPELINE_FILE)
        if not (recorded and os.path.isfile(pipeline)):
            pipeline = os.path.join(directory, "tokenizer.json")
        self.backend_tokenizer = Tokenizer.from_file(pipeline)
        self.backend_tokenizer.no_truncation()
        self.backend_tokenizer.no_padding()
        with open(os.path.join(directory, "tokenizer_config.json")) as f:
            config = json.load(f)
        self.special_tokens = {name: _content(config[name]) for name in SPECIAL_TOKENS if config.get(name) is not None}
        self.special_tokens.update(recorded.get("special_tokens", {}))
        template = os.path.join(directory, "chat_template.jinja")
        self.chat_template = None
        if os.path.isfile(template):
            with open(template, encoding="utf-8") as f:
                self.chat_template = f.read()
        # The class's side where recorded, else transformers' default; the tool sets left.
        self.padding_side = recorded.get("padding_side", config.get("padding_side", "right"))
        self.name_or_path = directory

    def __getattr__(self, name: str):
        # bos_token, eos_token... and their ids; transformers' tokenizer answers None for one it does not have.
        if name == "special_tokens":  # not set yet (a copy being made)
            raise AttributeError(name)
        if name in SPECIAL_TOKENS:
            return self.special_tokens.get(name)
        if name.endswith("_id") and name[:-3] in SPECIAL_TOKENS:
            token = self.special_tokens.get(name[:-3])
            return None if token is None else self.convert_tokens_to_ids(token)
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")

    def __setattr__(self, name: str, value) -> None:
        if name in SPECIAL_TOKENS:
            self.special_tokens[name] = value
        else:
            super().__setattr__(name, value)

    def __len__(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def special_tokens_map(self) -> dict[str, str]:
        return {name: self.special_tokens[name] for name in SPECIAL_TOKENS if self.special_tokens.get(name)}

    @property
    def all_special_tokens(self) -> list[str]:
        return list(dict.fromkeys(self.special_tokens_map.values()))

    @property
    def all_special_ids(self) -> list[int]:
        return [self.convert_tokens_to_ids(token) for token in self.all_special_tokens]

    def get_vocab(self) -> dict[str, int]:
        return self.backend_tokenizer.get_vocab(with_added_tokens=True)

    def convert_tokens_to_ids(self, tokens):
        if isinstance(tokens, str):
            index = self.backend_tokenizer.token_to_id(tokens)
            return index if index is not None else self.unk_token_id
        return [self.convert_tokens_to_ids(token) for token in tokens]

    def convert_ids_to_tokens(self, ids, skip_special_tokens: bool = False):
        if isinstance(ids, int):
            return self.backend_tokenizer.id_to_token(ids)
        special = set(self.all_special_ids) if skip_special_tokens else set()
        return [self.backend_tokenizer.id_to_token(index) for index in ids if index not in special]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def __call__(self, text, add_special_tokens: bool = True, padding: bool = False, return_tensors=None):
        """{"input_ids", "attention_mask"} of a text or a list of texts, padded (on padding_side) when asked."""
        texts = [text] if isinstance(text, str) else list(text)
        encodings = self.backend_tokenizer.encode_batch(texts, add_special_tokens=add_special_tokens)
        ids = [encoding.ids for encoding in encodings]
        if padding or return_tensors is not None:
            return self.pad({"input_ids": ids}, return_tensors=return_tensors)
        if isinstance(text, str):
            return Encoding(input_ids=ids[0], attention_mask=[1] * len(ids[0]))
        return Encoding(input_ids=ids, attention_mask=[[1] * len(row) for row in ids])

    def pad(self, encoded: dict, return_tensors=None) -> Encoding:
        """encoded["input_ids"] padded to the longest on padding_side, with their attention mask."""
        rows = encoded["input_ids"]
        width = max((len(row) for row in rows), default=0)
        pad = self.pad_token_id
        if pad is None and any(len(row) < width for row in rows):
            raise ValueError("padding needs a pad token")
        ids, mask = [], []
        for row in rows:
            fill = width - len(row)
            if self.padding_side == "left":
                ids.append([pad] * fill + list(row))
                mask.append([0] * fill + [1] * len(row))
            else:
                ids.append(list(row) + [pad] * fill)
                mask.append([1] * len(row) + [0] * fill)
        if return_tensors == "pt":
            return Encoding(input_ids=torch.tensor(ids, dtype=torch.long), attention_mask=torch.tensor(mask))
        if return_tensors is not None:
            raise ValueError(f"return_tensors={return_tensors!r}: this tokenizer gives lists or torch tensors")
        return Encoding(input_ids=ids, attention_mask=mask)

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        if isinstance(ids, int):
            ids = [ids]
        elif isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        return self.backend_tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def batch_decode(self, sequences, skip_special_tokens: bool = False) -> list[str]:
        return [self.decode(ids, skip_special_tokens=skip_special_tokens) for ids in sequences]

    def apply_chat_template(self, conversation: list[dict], tools: list[dict] | None = None,
                            documents: list[dict] | None = None, add_generation_prompt: bool = False,
                            tokenize: bool = True, **kwargs):
        """The conversation rendered as transformers' apply_chat_template renders it; its ids where `tokenize`."""
        from ..chat_template import render

        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat template")
        if not conversation:
            raise ValueError("Cannot apply chat template to an empty conversation. Provide at least one message.")
        messages = [{key: value for key, value in message.items() if value is not None} for message in conversation]
        text = render(self.chat_template, messages, tools=tools, documents=documents,
                      add_generation_prompt=add_generation_prompt, **{**self.special_tokens_map, **kwargs})
        return self.encode(text, add_special_tokens=False) if tokenize else text
