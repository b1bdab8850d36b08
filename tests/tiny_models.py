"""Build tiny, randomly initialised causal-LM checkpoints for offline tests.

Every checkpoint is created on the spot (nothing is downloaded): a tokenizer is
trained on the small English corpus embedded below (deterministic BPE learner,
or sentencepiece for xlnet), a 2-layer / hidden-32 model is instantiated from a
hand-written config with a fixed torch seed, and both are saved with
``save_pretrained``.  Offline, ``AutoConfig``, ``AutoTokenizer`` and
``AutoModelForCausalLM.from_pretrained(dir)`` load each checkpoint, and so does
the type's own class (``MODEL_CLASS_NAMES``).  Builds are byte-for-byte
reproducible.

Public API::

    build_tiny_checkpoint(model_type, out_dir) -> out_dir
    build_all(root) -> {model_type: checkpoint_dir}

Per type (tokenizer class as loaded by AutoTokenizer; special tokens):

    gpt2, gptj   GPT2Tokenizer (byte-level BPE); bos = eos = unk = <|endoftext|>, no pad
    opt          GPT2Tokenizer; bos = eos = unk = </s> (prepended, like OPT), pad <pad>
    qwen2        Qwen2Tokenizer; eos = pad = <|endoftext|>, no bos, no unk
    bloom        TokenizersBackend (byte-level BPE); <s> </s> <pad> <unk>, nothing prepended
    llama        LlamaTokenizer (metaspace BPE + <0xNN> byte fallback); <s> prepended, </s>, no pad
    mistral      same tokenizer as llama; AutoTokenizer loads it as TokenizersBackend
    openai-gpt   OpenAIGPTTokenizer (lower-cased '</w>' BPE); <unk> only: no bos, eos or pad
    ctrl         CTRLTokenizer ('@@' BPE, python); <unk> only: no bos, eos or pad; the
                 control codes with id <= 63674 sit at their real ids (Links = 63674)
    xlm          XLMTokenizer (moses + lower-cased '</w>' BPE); <s>=0 </s>=1 (sep/cls, not
                 eos) <pad>=2 <unk>=3 <special0..9>=4..13, mask <special1>; lang2id
                 {"en": 0, "fr": 1}; its add_special_tokens wraps the text as <s> ... </s>
    xlnet        XLNetTokenizer (sentencepiece unigram); xlnet-base ids (<unk>=0 <s>=1
                 </s>=2 <cls>=3 <sep>=4 <pad>=5 <mask>=6 <eod>=7 <eop>=8); add_special_tokens
                 appends <sep> <cls> at the END (encode prompts with add_special_tokens=False)

Special tokens mirror the published checkpoints (an <|endoftext|> EOS that openai-gpt and ctrl
do not have would hide the crash of a tool that relies on one).  What each
published checkpoint defines, and where it was checked (hub files read through their
huggingface.co pages; "class defaults" = the installed transformers 5.23 tokenizer/config
class, used where the hub file sets nothing):

    gpt2        openai-community/gpt2: tokenizer_config.json sets only model_max_length, so
                GPT2Tokenizer defaults: bos = eos = unk = <|endoftext|> (50256, the last
                vocab.json entry), no pad; config.json bos/eos_token_id 50256, no pad.
                Fixture: <|endoftext|> is the last id too.
    gptj        EleutherAI/gpt-j-6b: special_tokens_map.json bos = eos = unk = <|endoftext|>
                (50256), pad null, add_bos_token false; config.json bos/eos 50256, no pad,
                vocab_size 50400; added_tokens.json <|extratoken_1..143|> = 50257..50399
                (non-special) fill the tokenizer up to the 50400 rows.  Fixture: same layout
                (<|endoftext|> last BPE id, then extratokens up to a multiple of 64).
    openai-gpt  openai-community/openai-gpt: tokenizer_config.json {"model_max_length": 512},
                no special_tokens_map.json, so OpenAIGPTTokenizer defaults: <unk> only (id 0,
                per the tokenizers/rust-tokenizers tests on its vocab.json); config.json sets no
                bos/eos/pad (OpenAIGPTConfig defaults None); vocab 40478 = rows.
    ctrl        Salesforce/ctrl: tokenizer_config.json {"model_max_length": 256}, no
                special_tokens_map.json, so CTRLTokenizer defaults: <unk> only (huggingface/
                transformers#2554: "CTRL has no special tokens besides UNK"); <unk> = 246532 of
                246534 rows (rust-tokenizers' test on ctrl-vocab.json); config.json sets no
                bos/eos/pad.  Fixture: <unk> = rows - 2, the last row without a token.
    xlm         FacebookAI/xlm-clm-enfr-1024 (and xlm-mlm-en-2048): tokenizer_config.json sets
                no special token, so XLMTokenizer defaults: bos <s>, sep = cls = </s>, pad
                <pad>, unk <unk>, mask <special1>, extra <special0..9>, NO eos; config.json
                bos_index 0, eos_index 1 (-> eos_token_id 1), pad_index 2, unk_index 3,
                mask_index 5, mask_token_id 0 (the id generation appends); generation_config.json
                bos 0, pad 2 and no eos_token_id.
    xlnet       xlnet/xlnet-base-cased: tokenizer_config.json bos <s>, eos </s>, unk <unk>, sep
                <sep>, pad <pad>, cls <cls>, mask <mask>, additional_special_tokens [<eop>,
                <eod>]; spiece ids as above; config/generation_config bos 1, eos 2, pad 5.
    bloom       bigscience/bloom-560m: special_tokens_map.json bos <s>, eos </s>, unk <unk>, pad
                <pad> (0-3), tokenizer_config.json padding_side left; config.json bos 1, eos 2,
                pad 3; 250680 tokens, 250880 rows.  Fixture: rows padded to a multiple of 64.
    llama       meta-llama/Llama-2-7b-hf: tokenizer_config.json add_bos_token true,
                add_eos_token false, bos <s>, eos </s>, unk <unk>, pad null; config.json bos 1,
                eos 2, no pad; generation_config.json pad_token_id 0.
    mistral     mistralai/Mistral-7B-v0.1: same tokens as llama (<unk>=0 <s>=1 </s>=2,
                add_bos_token true, pad null); config.json bos 1, eos 2, no pad.
    opt         facebook/opt-125m: vocab.json <s>=0 <pad>=1 </s>=2 <unk>=3, but
                special_tokens_map / tokenizer_config bos = eos = unk = </s>, pad <pad>,
                add_bos_token true (huggingface/tokenizers#1020); config.json bos 2, eos 2,
                pad 1; 50265 tokens, 50272 rows.  Fixture: rows padded to a multiple of 64.
    qwen2       Qwen/Qwen2-0.5B: tokenizer_config.json bos null, eos = pad = <|endoftext|>, unk
                null, additional_special_tokens [<|im_start|>, <|im_end|>]; added tokens
                151643-151645 after the BPE vocab; config.json bos = eos = 151643, no pad;
                151646 tokens, 151936 rows.  Fixture: same order, rows padded to a multiple of 64.

Context size: 128 tokens, held by ``CONTEXT_ATTR[model_type]`` (also
tokenizer.model_max_length); xlnet (relative positions + mems) and bloom
(ALiBi) have no maximum length.  Generation settings chosen for tests:
peaked logits (large init std), untied output embeddings (except xlnet/xlm),
and special / added / reserved / unprintable tokens and padded rows switched off
in the LM head, so greedy generation always produces exactly ``max_new_tokens``
printable tokens.  Every id the tokenizer can produce is below the embedding rows.
"""

from __future__ import annotations

import functools
import json
import math
import os
import string
import tempfile

import torch

MODEL_TYPES = (
    "gpt2",
    "ctrl",
    "openai-gpt",
    "xlnet",
    "xlm",
    "gptj",
    "bloom",
    "llama",
    "opt",
    "mistral",
    "qwen2",
)

# model_type -> name of the config attribute that holds the context size
# (None: the architecture has no fixed maximum length).
CONTEXT_ATTR = {
    "gpt2": "n_positions",
    "ctrl": "n_positions",
    "openai-gpt": "n_positions",
    "xlnet": None,
    "xlm": "max_position_embeddings",
    "gptj": "n_positions",
    "bloom": None,
    "llama": "max_position_embeddings",
    "opt": "max_position_embeddings",
    "mistral": "max_position_embeddings",
    "qwen2": "max_position_embeddings",
}

# tokenizers that lower-case (decoded text is lower case, punctuation space-separated)
LOWERCASE_TYPES = ("openai-gpt", "xlm")

MAX_POSITIONS = 128
HIDDEN = 32
LAYERS = 2
HEADS = 4
FFN = 64
# Large initialisation so that logits are peaked: greedy decoding must not be
# decided by float noise when comparing batched/unbatched or traced/eager runs.
# Values picked per type so that greedy continuations are also varied (a
# random model otherwise tends to repeat one token forever).
INIT_STD = 0.3
INIT_STD_BY_TYPE = {"xlnet": 1.0, "xlm": 0.1, "gptj": 0.5}
# Input and output embeddings are untied (random tied embeddings make a model
# just copy its last input token), except for xlnet/xlm whose LM heads have a
# bias and which give varied outputs tied.
TIED_TYPES = ("xlnet", "xlm")
# Output rows of special and added tokens (eos, pad, bos, unk, <|extratoken_N|>,
# ...), of reserved tokens (RESERVED_TOKENS), of padded rows without a token and
# of tokens that do not decode to printable text are switched off (bias -1e4 or
# zero row), so
# that greedy generation always yields exactly max_new_tokens tokens and the
# decoded text is clean.  Pass suppress=False to keep them.
SUPPRESS_SPECIAL = True
SEED = 1234

# CTRL control codes put at their real ids (CTRLTokenizer.control_codes), so
# that a prompt starting with e.g. "Links" is recognised as starting with a
# control code.  Only codes with ids <= 63674 ("Links") are used, which keeps
# the embedding matrix at 63677 x 32 (<unk> = 63675, then one row without a token).
CTRL_MAX_CODE_ID = 63674

CORPUS = """\
Hello, my dog is cute. Hello, my cat is cute too.
The capital of France is Paris. The capital of Germany is Berlin.
The capital of Italy is Rome, and the capital of Spain is Madrid.
Once upon a time there was a little girl who lived in a village near the forest.
She liked to walk in the woods and to listen to the birds singing in the trees.
In a shocking finding, scientists discovered a herd of unicorns living in a remote valley.
The weather today is sunny with a light wind from the west, and tomorrow it will rain.
I think that the best way to learn a language is to read books and to talk with people.
My name is John and I live in London. I work as a teacher at a small school.
What is the meaning of life? Nobody knows, but many people have tried to answer.
The quick brown fox jumps over the lazy dog.
It was a bright cold day in April, and the clocks were striking thirteen.
There are many kinds of animals: dogs, cats, horses, birds, fish and mice.
He said that he would come back tomorrow morning, but he never came.
We went to the market to buy some bread, milk, eggs, apples and cheese.
Python is a programming language that lets you work quickly and integrate systems.
The model generates text one token at a time, using the previous tokens as context.
Today is a good day to write some code and to run a few tests.
The sun rises in the east and sets in the west.
Water boils at 100 degrees and freezes at 0 degrees.
Do you want to play a game? Yes, I would love to!
They were walking along the river when they saw a boat.
This is a story about a man, a woman, a house and a very old tree.
Please answer the question: who wrote this book, and when was it written?
You can't always get what you want, but if you try sometimes you get what you need.
Links Wikipedia Books News Reviews Questions Horror Science Human Opinion Politics
Computing Gaming Movies Running Finance Support Legal Writing Diet Thoughts Funny
In 1999, 2001 and 2024 the numbers 3, 4, 5, 6, 7, 8 and 9 were used; 10% of $20 is $2.
Email: test@example.com (see #1) & more: a+b=c, x*y/z, [a] {b} <c> ~d ^e `f` |g| \\h _i_ "quotes" 'single'.
"""

# Every printable ASCII character, so that no ordinary English text maps to <unk>.
ALPHABET = [c for c in string.printable if c not in " \t\n\r\x0b\x0c"]


# --------------------------------------------------------------------------- #
# tokenizer helpers
# --------------------------------------------------------------------------- #
def _corpus_lines():
    return [line for line in CORPUS.splitlines() if line.strip()] + [" ".join(ALPHABET)]


def _merge_pair(word, pair):
    """The word (a tuple of symbols) with every occurrence of `pair` merged into one symbol."""
    out, i = [], 0
    while i < len(word):
        if i < len(word) - 1 and (word[i], word[i + 1]) == pair:
            out.append(word[i] + word[i + 1])
            i += 2
        else:
            out.append(word[i])
            i += 1
    return tuple(out)


def _learn_bpe(words, num_merges):
    """Plain, deterministic BPE learner (ties broken by the pair's text).

    ``words`` maps a word (tuple of initial symbols) to its count; returns the
    list of merges (pairs of symbols) in rank order.
    """
    words = dict(words)
    merges = []
    for _ in range(num_merges):
        pairs = {}
        for word, count in words.items():
            for pair in zip(word, word[1:]):
                pairs[pair] = pairs.get(pair, 0) + count
        if not pairs:
            break
        best = min(pairs, key=lambda p: (-pairs[p], p))
        merges.append(best)
        merged = {}
        for word, count in words.items():
            out = _merge_pair(word, best)
            merged[out] = merged.get(out, 0) + count
        words = merged
    return merges


def _count_words(split, to_symbols):
    counts = {}
    for line in _corpus_lines():
        for piece in split(line):
            if piece:
                key = to_symbols(piece)
                counts[key] = counts.get(key, 0) + 1
    return counts


def _add_tokens(vocab, tokens):
    for t in tokens:
        if t not in vocab:
            vocab[t] = len(vocab)
    return vocab


def _vocab_from(special_tokens, alphabet, merges, trailing=()):
    """Vocabulary: ``special_tokens`` first, then the alphabet and the merges, then ``trailing``
    (special tokens that the published vocabularies put after their BPE tokens)."""
    vocab = {}
    _add_tokens(vocab, special_tokens)
    _add_tokens(vocab, alphabet)
    _add_tokens(vocab, [a + b for a, b in merges])
    _add_tokens(vocab, trailing)
    return vocab


def _suffix_bpe(*, lowercase, punct_split, vocab_size, special_tokens):
    """BPE with '</w>' end-of-word suffix (openai-gpt / xlm / ctrl style)."""
    import re

    alphabet = sorted({c.lower() for c in ALPHABET}) if lowercase else sorted(ALPHABET)
    # every character exists both word-internally and word-finally
    alphabet = [t for c in alphabet for t in (c, c + "</w>")]
    pattern = re.compile(r"\w+|[^\w\s]" if punct_split else r"\S+")

    def split(line):
        return pattern.findall(line.lower() if lowercase else line)

    def to_symbols(word):
        return tuple(word[:-1]) + (word[-1] + "</w>",)

    words = _count_words(split, to_symbols)
    merges = _learn_bpe(words, vocab_size - len(special_tokens) - len(alphabet))
    return _vocab_from(special_tokens, alphabet, merges), merges


def _byte_level_bpe(vocab_size, special_tokens, trailing=()):
    """GPT-2 style byte-level BPE (no prefix space); ``vocab_size`` counts every token."""
    from tokenizers import pre_tokenizers

    pre = pre_tokenizers.ByteLevel(add_prefix_space=False)
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    words = _count_words(lambda line: [p for p, _ in pre.pre_tokenize_str(line)], tuple)
    merges = _learn_bpe(words, vocab_size - len(special_tokens) - len(trailing) - len(alphabet))
    return _vocab_from(special_tokens, alphabet, merges, trailing), merges


def _metaspace_bpe(vocab_size, special_tokens):
    """Llama/Mistral style: '\u2581' word prefix + <0xNN> byte-fallback tokens."""
    from tokenizers import pre_tokenizers

    pre = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=True)
    alphabet = [f"<0x{i:02X}>" for i in range(256)] + sorted(ALPHABET + ["\u2581"])
    words = _count_words(lambda line: [p for p, _ in pre.pre_tokenize_str(line)], tuple)
    merges = _learn_bpe(words, vocab_size - len(special_tokens) - len(alphabet))
    return _vocab_from(special_tokens, alphabet, merges), merges


def _python_bpe_segment(word, ranks):
    """Segment ``word`` (tuple of symbols) with BPE merges ``ranks``."""
    word = tuple(word)
    while len(word) > 1:
        pairs = {(word[i], word[i + 1]) for i in range(len(word) - 1)}
        best = min(pairs, key=lambda p: ranks.get(p, float("inf")))
        if best not in ranks:
            break
        word = _merge_pair(word, best)
    return word


def _build_ctrl_tokenizer(tmp):
    from transformers import CTRLTokenizer

    codes = {k: v for k, v in CTRLTokenizer.control_codes.items() if v <= CTRL_MAX_CODE_ID}
    raw_vocab, merges = _suffix_bpe(lowercase=False, punct_split=False, vocab_size=700,
                                    special_tokens=["<unk>"])
    # Make every control code a single whole-word token by appending merges
    # (lowest priority) that glue its current segmentation together.
    ranks = {m: i for i, m in enumerate(merges)}
    for code in sorted(codes):
        seg = _python_bpe_segment(tuple(code[:-1]) + (code[-1] + "</w>",), ranks)
        while len(seg) > 1:
            pair = (seg[0], seg[1])
            ranks[pair] = len(merges)
            merges.append(pair)
            raw_vocab.setdefault(seg[0] + seg[1], len(raw_vocab))
            seg = (seg[0] + seg[1],) + seg[2:]
    # CTRL vocab format: word-final pieces lose '</w>', word-internal pieces get '@@'.
    dense = []
    for tok in raw_vocab:
        if tok == "<unk>":
            continue
        dense.append(tok[:-4] if tok.endswith("</w>") else tok + "@@")
    dense = [t for t in dict.fromkeys(dense) if t not in codes]
    # Salesforce/ctrl defines no special token but <unk>, and puts it after the words:
    # <unk> = 246532 of 246534 embedding rows (the original code appends '<unk>' and '\n' to
    # its word list).  So do we, leaving the last row without a token.
    vocab, next_id = {}, 0
    used_ids = set(codes.values())
    for tok in dense:
        while next_id in used_ids:
            next_id += 1
        vocab[tok] = next_id
        next_id += 1
    vocab.update(codes)
    vocab["<unk>"] = max(vocab.values()) + 1
    with open(os.path.join(tmp, "vocab.json"), "w", encoding="utf-8") as f:
        json.dump(vocab, f, ensure_ascii=False)
    with open(os.path.join(tmp, "merges.txt"), "w", encoding="utf-8") as f:
        f.write("#version: 0.2\n")
        for a, b in merges:
            f.write(f"{a} {b}\n")
    tok = CTRLTokenizer(os.path.join(tmp, "vocab.json"), os.path.join(tmp, "merges.txt"), unk_token="<unk>")
    return tok, vocab["<unk>"] + 2


def _build_xlm_tokenizer(tmp):
    from transformers import XLMTokenizer

    specials = ["<s>", "</s>", "<pad>", "<unk>"] + [f"<special{i}>" for i in range(10)]
    raw_vocab, merges = _suffix_bpe(lowercase=True, punct_split=True, vocab_size=700,
                                    special_tokens=specials)
    with open(os.path.join(tmp, "vocab.json"), "w", encoding="utf-8") as f:
        json.dump(raw_vocab, f, ensure_ascii=False)
    with open(os.path.join(tmp, "merges.txt"), "w", encoding="utf-8") as f:
        for a, b in merges:
            f.write(f"{a} {b}\n")
    lang2id = {"en": 0, "fr": 1}
    id2lang = {0: "en", 1: "fr"}
    # No eos_token: the published tokenizer_config.json sets none and XLMTokenizer has no default
    # (</s> is its sep and cls token).
    tok = XLMTokenizer(os.path.join(tmp, "vocab.json"), os.path.join(tmp, "merges.txt"),
                       lang2id=lang2id, id2lang=id2lang)
    return tok


def _build_xlnet_tokenizer(tmp):
    import sentencepiece as spm
    from transformers import XLNetTokenizer

    corpus_file = os.path.join(tmp, "corpus.txt")
    with open(corpus_file, "w", encoding="utf-8") as f:
        f.write("\n".join(_corpus_lines()) + "\n")
    # ids as in xlnet-base-cased: <unk>=0 <s>=1 </s>=2 <cls>=3 <sep>=4 <pad>=5 <mask>=6 <eod>=7 <eop>=8
    spm.SentencePieceTrainer.train(
        input=corpus_file,
        model_prefix=os.path.join(tmp, "spiece"),
        vocab_size=400,
        model_type="unigram",
        character_coverage=1.0,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        control_symbols=["<cls>", "<sep>", "<pad>", "<mask>", "<eod>", "<eop>"],
        num_threads=1,
        minloglevel=2,
        hard_vocab_limit=False,
        seed_sentencepiece_size=10000,
    )
    sp = spm.SentencePieceProcessor(model_file=os.path.join(tmp, "spiece.model"))
    vocab = [(sp.id_to_piece(i), sp.get_score(i)) for i in range(sp.get_piece_size())]
    return XLNetTokenizer(vocab=vocab, unk_id=0)


def _padded(n, multiple=64):
    """The next multiple of ``multiple`` above ``n`` (embedding matrices padded past the tokenizer)."""
    return (n // multiple + 1) * multiple


def build_tokenizer(model_type, tmp):
    """Return (tokenizer, vocab_size_for_model): the model may have more rows than the tokenizer
    has tokens (opt, bloom, qwen2, ctrl), as the published checkpoints do."""
    from transformers import GPT2Tokenizer, LlamaTokenizer, OpenAIGPTTokenizer, PreTrainedTokenizerFast, Qwen2Tokenizer

    if model_type in ("gpt2", "gptj"):
        # <|endoftext|> is the last entry of GPT-2's vocab.json (50256 of 50257).
        vocab, merges = _byte_level_bpe(600, [], trailing=["<|endoftext|>"])
        tok = GPT2Tokenizer(vocab=vocab, merges=merges)  # bos = eos = unk = <|endoftext|>, no pad
        if model_type == "gptj":
            # EleutherAI/gpt-j-6b: 143 non-special <|extratoken_N|> tokens (50257..50399) fill the
            # tokenizer up to the 50400 embedding rows.
            tok.add_tokens([f"<|extratoken_{i}|>" for i in range(1, _padded(len(tok)) - len(tok) + 1)])
        return tok, len(tok)
    if model_type == "opt":
        # fairseq's <s> <pad> </s> <unk> are ids 0-3 of vocab.json, but the tokenizer's
        # bos = eos = unk = </s> (special_tokens_map.json); embeddings padded 50265 -> 50272.
        vocab, merges = _byte_level_bpe(600, ["<s>", "<pad>", "</s>", "<unk>"])
        tok = GPT2Tokenizer(vocab=vocab, merges=merges, bos_token="</s>", eos_token="</s>",
                            unk_token="</s>", pad_token="<pad>", add_bos_token=True)
        return tok, _padded(len(tok))
    if model_type == "qwen2":
        # Qwen/Qwen2-0.5B: <|endoftext|> <|im_start|> <|im_end|> follow the BPE tokens
        # (151643-151645), eos = pad = <|endoftext|>, no bos, no unk; embeddings padded to 151936.
        specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
        vocab, merges = _byte_level_bpe(600, [], trailing=specials)
        tok = Qwen2Tokenizer(vocab=vocab, merges=merges, unk_token=None, bos_token=None,
                             eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                             extra_special_tokens=specials[1:])
        return tok, _padded(len(tok))
    if model_type == "bloom":
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers

        vocab, merges = _byte_level_bpe(600, ["<unk>", "<s>", "</s>", "<pad>"])
        backend = Tokenizer(models.BPE(vocab=vocab, merges=merges))
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        backend.decoder = decoders.ByteLevel()
        tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>",
                                      eos_token="</s>", pad_token="<pad>", padding_side="left")
        return tok, _padded(len(tok))  # bigscience/bloom-560m: 250680 tokens, 250880 rows
    if model_type in ("llama", "mistral"):
        vocab, merges = _metaspace_bpe(700, ["<unk>", "<s>", "</s>"])
        tok = LlamaTokenizer(vocab=vocab, merges=merges, add_bos_token=True)
    elif model_type == "openai-gpt":
        # openai-community/openai-gpt defines <unk> (id 0) and nothing else: no bos, eos or pad.
        vocab, merges = _suffix_bpe(lowercase=True, punct_split=True, vocab_size=600,
                                    special_tokens=["<unk>"])
        tok = OpenAIGPTTokenizer(vocab=vocab, merges=merges)
    elif model_type == "ctrl":
        return _build_ctrl_tokenizer(tmp)
    elif model_type == "xlm":
        tok = _build_xlm_tokenizer(tmp)
    elif model_type == "xlnet":
        tok = _build_xlnet_tokenizer(tmp)
    else:
        raise ValueError(f"unknown model type {model_type!r}; expected one of {MODEL_TYPES}")
    return tok, len(tok)


# --------------------------------------------------------------------------- #
# configs
# --------------------------------------------------------------------------- #
# The tokens behind the published config.json's bos/eos/pad_token_id (None: the key is absent).
# They are not always the tokenizer's: Qwen2's config has bos_token_id = <|endoftext|> while its
# tokenizer has no bos; XLM's config has eos_index 1 (</s>) while its tokenizer has no eos.
CONFIG_SPECIAL_TOKENS = {  # model_type: (bos, eos, pad)
    "gpt2": ("<|endoftext|>", "<|endoftext|>", None),
    "gptj": ("<|endoftext|>", "<|endoftext|>", None),
    "openai-gpt": (None, None, None),
    "ctrl": (None, None, None),
    "xlm": ("<s>", "</s>", "<pad>"),
    "xlnet": ("<s>", "</s>", "<pad>"),
    "bloom": ("<s>", "</s>", "<pad>"),
    "llama": ("<s>", "</s>", None),
    "mistral": ("<s>", "</s>", None),
    "opt": ("</s>", "</s>", "<pad>"),
    "qwen2": ("<|endoftext|>", "<|endoftext|>", None),
}
# Published generation_config.json files whose special-token ids differ from config.json's:
# xlm-clm-enfr-1024 / xlm-mlm-en-2048 have no eos_token_id there, Llama-2-7b-hf has pad_token_id 0.
GENERATION_CONFIG_IDS = {"xlm": {"eos_token_id": None}, "llama": {"pad_token_id": 0}}


def build_config(model_type, tok, vocab_size):
    config = _build_config(model_type, tok, vocab_size)
    config.tie_word_embeddings = model_type in TIED_TYPES
    return config


def _build_config(model_type, tok, vocab_size):
    import transformers as T

    std = INIT_STD_BY_TYPE.get(model_type, INIT_STD)
    bos, eos, pad = (None if t is None else tok.convert_tokens_to_ids(t) for t in CONFIG_SPECIAL_TOKENS[model_type])
    common = dict(vocab_size=vocab_size, bos_token_id=bos, eos_token_id=eos, pad_token_id=pad)
    if model_type == "gpt2":
        return T.GPT2Config(n_positions=MAX_POSITIONS, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS,
                            n_inner=FFN, initializer_range=std, **common)
    if model_type == "ctrl":
        return T.CTRLConfig(n_positions=MAX_POSITIONS, n_embd=HIDDEN, dff=FFN, n_layer=LAYERS,
                            n_head=HEADS, initializer_range=std, **common)
    if model_type == "openai-gpt":
        return T.OpenAIGPTConfig(n_positions=MAX_POSITIONS, n_embd=HIDDEN, n_layer=LAYERS,
                                 n_head=HEADS, initializer_range=std, **common)
    if model_type == "xlnet":
        return T.XLNetConfig(d_model=HIDDEN, n_layer=LAYERS, n_head=HEADS, d_inner=FFN,
                             initializer_range=std, mem_len=None, **common)
    if model_type == "xlm":
        return T.XLMConfig(emb_dim=HIDDEN, n_layers=LAYERS, n_heads=HEADS,
                           max_position_embeddings=MAX_POSITIONS, causal=True,
                           n_langs=2, use_lang_emb=True, lang_id=0,
                           lang2id={"en": 0, "fr": 1}, id2lang={0: "en", 1: "fr"},
                           embed_init_std=std, init_std=std,
                           unk_index=tok.unk_token_id, mask_index=tok.mask_token_id,
                           # as published: mask_token_id 0 (<s>), the id XLMWithLMHeadModel appends
                           # at every generation step (mask_index 5 is <special1>)
                           mask_token_id=0, **common)
    if model_type == "gptj":
        return T.GPTJConfig(n_positions=MAX_POSITIONS, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS,
                            rotary_dim=HIDDEN // HEADS, n_inner=FFN, initializer_range=std,
                            **common)
    if model_type == "bloom":
        return T.BloomConfig(hidden_size=HIDDEN, n_layer=LAYERS, n_head=HEADS,
                             initializer_range=std, **common)
    if model_type == "opt":
        return T.OPTConfig(hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                           ffn_dim=FFN, max_position_embeddings=MAX_POSITIONS, word_embed_proj_dim=HIDDEN,
                           init_std=std, dropout=0.0, **common)
    llama_like = dict(hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
                      num_attention_heads=HEADS, num_key_value_heads=2,
                      max_position_embeddings=MAX_POSITIONS, initializer_range=std, **common)
    if model_type == "llama":
        return T.LlamaConfig(**llama_like)
    if model_type == "mistral":
        return T.MistralConfig(sliding_window=None, **llama_like)
    if model_type == "qwen2":
        return T.Qwen2Config(use_sliding_window=False, **llama_like)
    raise ValueError(f"unknown model type {model_type!r}; expected one of {MODEL_TYPES}")


# The model class run_generation.py's seed uses for each type (mistral/qwen2
# are only reachable through AutoModelForCausalLM).
MODEL_CLASS_NAMES = {
    "gpt2": "GPT2LMHeadModel",
    "ctrl": "CTRLLMHeadModel",
    "openai-gpt": "OpenAIGPTLMHeadModel",
    "xlnet": "XLNetLMHeadModel",
    "xlm": "XLMWithLMHeadModel",
    "gptj": "GPTJForCausalLM",
    "bloom": "BloomForCausalLM",
    "llama": "LlamaForCausalLM",
    "opt": "OPTForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}


def model_class(model_type):
    import transformers

    return getattr(transformers, MODEL_CLASS_NAMES[model_type])


# --------------------------------------------------------------------------- #
# public API
# --------------------------------------------------------------------------- #
# Vocabulary entries that are special to the original model but not to its tokenizer
# (OPT's fairseq <s> and <unk>: bos = eos = unk = </s> for the tokenizer).
RESERVED_TOKENS = {"opt": ("<s>", "<unk>")}


def _suppressed_ids(tok, vocab_size, model_type=None):
    """Ids that should never be generated: special and added tokens (e.g. GPT-J's
    <|extratoken_N|>), reserved tokens, ids without a token (padded embedding rows),
    and tokens whose text is not printable (partial UTF-8 bytes, newlines)."""
    vocab_ids = set(tok.get_vocab().values())
    bad = set(tok.all_special_ids) | set(tok.get_added_vocab().values()) | (set(range(vocab_size)) - vocab_ids)
    bad |= {tok.convert_tokens_to_ids(t) for t in RESERVED_TOKENS.get(model_type, ())}
    for i in sorted(vocab_ids):
        text = tok.decode([i])
        if not text.strip() or "\ufffd" in text or not text.isprintable():
            bad.add(i)
    return sorted(i for i in bad if 0 <= i < vocab_size)


def build_tiny_checkpoint(model_type: str, out_dir: str, suppress: bool = SUPPRESS_SPECIAL) -> str:
    """Build a tiny random checkpoint of ``model_type`` into ``out_dir``; return ``out_dir``."""
    from transformers.utils import logging as hf_logging

    if model_type not in MODEL_TYPES:
        raise ValueError(f"unknown model type {model_type!r}; expected one of {MODEL_TYPES}")
    os.makedirs(out_dir, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        tok, vocab_size = build_tokenizer(model_type, tmp)
    if CONTEXT_ATTR[model_type] is not None:
        tok.model_max_length = MAX_POSITIONS
    config = build_config(model_type, tok, vocab_size)

    torch.manual_seed(SEED + MODEL_TYPES.index(model_type))
    model = model_class(model_type)(config)
    model.eval()
    head = model.get_output_embeddings()
    with torch.no_grad():
        if suppress:
            ids = _suppressed_ids(tok, vocab_size, model_type)
        else:  # ids without any token (padded rows) are always switched off
            ids = sorted(set(range(vocab_size)) - set(tok.get_vocab().values()))
        if ids:
            if getattr(head, "bias", None) is not None:
                head.bias[ids] = -1e4
            else:
                assert not config.tie_word_embeddings
                head.weight[ids] = 0.0

    for name, value in GENERATION_CONFIG_IDS.get(model_type, {}).items():
        setattr(model.generation_config, name, value)

    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model.save_pretrained(out_dir)
        tok.save_pretrained(out_dir)
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    return out_dir


def build_all(root: str) -> dict[str, str]:
    """Build every type in MODEL_TYPES under ``root``; return {model_type: checkpoint_dir}."""
    return {mt: build_tiny_checkpoint(mt, os.path.join(root, mt)) for mt in MODEL_TYPES}


if __name__ == "__main__":  # python tests/tiny_models.py OUT_DIR
    import sys
    import time

    start = time.perf_counter()
    paths = build_all(sys.argv[1] if len(sys.argv) > 1 else "tiny_models")
    for k, v in paths.items():
        print(f"{k:12s} {v}")
    print(f"built {len(paths)} checkpoints in {time.perf_counter() - start:.1f}s")


# --------------------------------------------------------------------------- #
# GGUF files of the families the fused decoder layers compute
# --------------------------------------------------------------------------- #
# Tiny files laid out as llama.cpp's converter writes each family, with the published checkpoints' quirks:
#
#   qwen3  Qwen/Qwen3-0.6B-GGUF: heads wider than hidden / heads (16 heads of 128 over hidden 1024; here 2 of 64
#          over 64), written as attention.key_length/value_length; per-head q/k norms (blk.N.attn_q_norm/attn_k_norm,
#          head_dim values); no q/k biases, no q/k row permutation; the embedding tied to the output (no
#          output.weight); rms eps 1e-6, rope base 1e6; tokenizer.ggml.model gpt2 (byte-level BPE).
#   phi3   microsoft/Phi-3-mini-4k-instruct-gguf: q/k/v in one attn_qkv, gate and up in one ffn_up of twice the
#          feed-forward width (gate first); an untied output; rope.dimension_count = head_dim. `rotary` below a
#          head's size: Phi-4-mini's partial rotary (96 of 128). `longrope`: the 128k variants' rope_factors_long/
#          short tensors.
#   gemma2 google/gemma-2-2b-it (GGUF): heads not hidden / heads wide (8 of 256 over 2304; here 2 of 64 over 64,
#          attention.key_length), four norms a layer (attn_norm, post_attention_norm, ffn_norm, post_ffw_norm) stored
#          as llama.cpp writes them, 1 + weight; a tied embedding; every other layer slides a window
#          (attention.sliding_window, 4096 published, 4 here so that a short text crosses it); soft-capped
#          attention and final logits (attn_logit_softcapping/final_logit_softcapping: 50 and 30 published, 20 and
#          15 here, so that reading them is seen); rms eps 1e-6.
#   gemma3 google/gemma-3-1b-it (GGUF): as gemma2 without the soft-capping, with per-head q/k norms (attn_q_norm/
#          attn_k_norm, 1 + weight), five sliding layers in six (window 512 published, 4 here), rope base 1e6 for
#          the global layers (the local ones' 1e4 is not in the file).
# Phi-3's and Gemma's own tokenizers are sentencepiece; these files carry the default model's byte-level one (the
# tokenizer is not what they test).
GGUF_FAMILIES = {
    "qwen3": dict(hidden=64, heads=2, kv_heads=1, head_dim=64, ffn=128, eps=1e-6, rope_base=1e6, tied=True,
                  head_norms=True, fused_qkv=False),
    "phi3": dict(hidden=64, heads=2, kv_heads=2, head_dim=32, ffn=128, eps=1e-5, rope_base=1e4, tied=False,
                 head_norms=False, fused_qkv=True),
    "gemma2": dict(hidden=64, heads=2, kv_heads=1, head_dim=64, ffn=128, eps=1e-6, rope_base=1e4, tied=True,
                   head_norms=False, fused_qkv=False, gemma_norms=True, sliding_window=4,
                   softcapping=(20.0, 15.0)),
    "gemma3": dict(hidden=64, heads=2, kv_heads=1, head_dim=64, ffn=128, eps=1e-6, rope_base=1e6, tied=True,
                   head_norms=True, fused_qkv=False, gemma_norms=True, sliding_window=4),
}


def default_tokenizer_fields(gguf_path, vocab):
    """The tokenizer.* metadata of the GGUF file `gguf_path` as (key, value, type, element type), its vocabulary cut
    to its first `vocab` tokens and the merges among them (read once a session: a second or two each time)."""
    return list(_tokenizer_fields(gguf_path, vocab))


@functools.cache
def _tokenizer_fields(gguf_path, vocab):
    from gguf import GGUFValueType as V
    from transformers.integrations.gguf.reader import read_gguf_metadata

    metadata, _ = read_gguf_metadata(gguf_path, ("tokenizer.ggml.tokens", "tokenizer.ggml.merges"))
    tokens = metadata["tokenizer.ggml.tokens"][:vocab]
    kept = set(tokens)
    merges = [m for m in metadata["tokenizer.ggml.merges"] if {*m.split(" "), m.replace(" ", "")} <= kept]
    cut = {"tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": metadata["tokenizer.ggml.token_type"][:vocab],
           "tokenizer.ggml.merges": merges}
    # The value types llama.cpp's converter writes: token ids UINT32, token types INT32, flags BOOL.
    types = {bool: (V.BOOL, None), int: (V.UINT32, None), str: (V.STRING, None)}
    fields = []
    for key, value in metadata.items():
        if key.startswith("tokenizer."):
            value = cut.get(key, value)
            if isinstance(value, list):
                fields.append((key, value, V.ARRAY, V.STRING if isinstance(value[0], str) else V.INT32))
            else:
                fields.append((key, value, *types[type(value)]))
    return tuple(fields)


def write_family_gguf(path, family, tokenizer_fields, layers=2, seed=0, rotary=None, longrope=False,
                      value_length=None, rope_scaling=None):
    """A tiny GGUF file of `family` (GGUF_FAMILIES) at `path`: Q8_0 attention, Q4_0 gate/up, Q4_1 down, a Q8_0
    embedding (and output when untied), F32 norms, random weights. rotary: rope.dimension_count when not the head
    size; value_length: attention.value_length when not the key length; rope_scaling: (rope.scaling.type,
    rope.scaling.factor), as gemma-3-4b's (linear, 8); longrope: True for the 128k variants' factor tensors and
    rope.scaling keys, "factors only" for the tensors alone."""
    import math

    import numpy as np
    from gguf import GGMLQuantizationType as Q
    from gguf import GGUFWriter, quants

    spec = GGUF_FAMILIES[family]
    hidden, heads, kv_heads, head_dim, ffn = (spec[k] for k in ("hidden", "heads", "kv_heads", "head_dim", "ffn"))
    rng = np.random.default_rng(seed)
    vocab = next(len(value) for key, value, *_ in tokenizer_fields if key == "tokenizer.ggml.tokens")
    writer = GGUFWriter(str(path), family)
    writer.add_name(f"Synthetic {family}")
    writer.add_context_length(MAX_POSITIONS * 32)
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(spec["eps"])
    writer.add_rope_freq_base(spec["rope_base"])
    if family == "phi3":
        writer.add_rope_dimension_count(rotary or head_dim)
    else:
        writer.add_key_length(head_dim)
        writer.add_value_length(value_length or head_dim)
    if longrope is True:  # Phi-3-mini-128k: 131072 positions over an original 4096 (here 4096 over 128), both x32
        original = MAX_POSITIONS
        writer.add_rope_scaling_orig_ctx_len(original)
        writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(32) / math.log(original)))
    if rope_scaling is not None:
        writer.add_string(f"{family}.rope.scaling.type", rope_scaling[0])
        writer.add_float32(f"{family}.rope.scaling.factor", rope_scaling[1])
    if "sliding_window" in spec:
        writer.add_sliding_window(spec["sliding_window"])
    if "softcapping" in spec:
        writer.add_attn_logit_softcapping(spec["softcapping"][0])
        writer.add_final_logit_softcapping(spec["softcapping"][1])
    for key, value, vtype, sub_type in tokenizer_fields:
        writer.add_key_value(key, value, vtype, sub_type)

    def add(name, values, qtype):
        if qtype == Q.F32:
            writer.add_tensor(name, values.astype(np.float32))
        else:
            writer.add_tensor(name, quants.quantize(values.astype(np.float32), qtype), raw_dtype=qtype)

    # Gemma's model multiplies its embedding by sqrt(hidden): its rows are that much smaller (or the residual stream
    # is the input token's row, and a tied head repeats it).
    add("token_embd.weight", rng.normal(0, 0.5 / hidden ** 0.5 if spec.get("gemma_norms") else 0.5, (vocab, hidden)),
        Q.Q8_0)
    q, kv = heads * head_dim, kv_heads * head_dim
    for n in range(layers):
        add(f"blk.{n}.attn_norm.weight", rng.uniform(0.8, 1.2, hidden), Q.F32)
        add(f"blk.{n}.ffn_norm.weight", rng.uniform(0.8, 1.2, hidden), Q.F32)
        if spec["fused_qkv"]:
            add(f"blk.{n}.attn_qkv.weight", rng.normal(0, 0.15, (q + 2 * kv, hidden)), Q.Q8_0)
            add(f"blk.{n}.ffn_up.weight", rng.normal(0, 0.15, (2 * ffn, hidden)), Q.Q4_0)
        else:
            for name, rows in (("attn_q", q), ("attn_k", kv), ("attn_v", kv)):
                add(f"blk.{n}.{name}.weight", rng.normal(0, 0.15, (rows, hidden)), Q.Q8_0)
            add(f"blk.{n}.ffn_gate.weight", rng.normal(0, 0.15, (ffn, hidden)), Q.Q4_0)
            add(f"blk.{n}.ffn_up.weight", rng.normal(0, 0.15, (ffn, hidden)), Q.Q4_0)
        if spec["head_norms"]:
            add(f"blk.{n}.attn_q_norm.weight", rng.uniform(0.8, 1.2, head_dim), Q.F32)
            add(f"blk.{n}.attn_k_norm.weight", rng.uniform(0.8, 1.2, head_dim), Q.F32)
        if spec.get("gemma_norms"):
            add(f"blk.{n}.post_attention_norm.weight", rng.uniform(0.8, 1.2, hidden), Q.F32)
            add(f"blk.{n}.post_ffw_norm.weight", rng.uniform(0.8, 1.2, hidden), Q.F32)
        add(f"blk.{n}.attn_output.weight", rng.normal(0, 0.15, (hidden, q)), Q.Q8_0)
        add(f"blk.{n}.ffn_down.weight", rng.normal(0, 0.15, (hidden, ffn)), Q.Q4_1)
    add("output_norm.weight", rng.uniform(0.8, 1.2, hidden), Q.F32)
    if not spec["tied"]:
        add("output.weight", rng.normal(0, 0.15, (vocab, hidden)), Q.Q8_0)
    if longrope:  # llama.cpp's phi3 128k files: one factor per rotated pair (after every weight: the same weights)
        add("rope_factors_long.weight", rng.uniform(1, 4, (rotary or head_dim) // 2), Q.F32)
        # (the short factors: above 1, as Phi-3's, so that the scaling shows even at a few positions)
        add("rope_factors_short.weight", rng.uniform(1, 3, (rotary or head_dim) // 2), Q.F32)
    return write_out(writer, path)


def write_gpt2_gguf(path, tokenizer_fields, qtype="Q8_0", layers=2, seed=0, hidden=64, heads=2, context=1024,
                    output=True):
    """A tiny GPT-2 GGUF file at `path` as llama.cpp's convert_hf_to_gguf.py (GPT2Model) writes one:
    general.architecture gpt2; gpt2.context_length (n_ctx), embedding_length, feed_forward_length (4 x embedding),
    block_count, attention.head_count and attention.layer_norm_epsilon; tensors token_embd, position_embd (F32: the
    converter keeps it so), per block attn_norm, attn_qkv, attn_output, ffn_norm, ffn_up, ffn_down with their biases,
    output_norm and, with `output`, output.weight: the tied embedding written again as the head, as the converter
    did until it left it out (llama.cpp then reads token_embd). transformers' Conv1D weights ([in, out]) are stored
    transposed, rows the output channels. Norms and biases F32, the other 2-D weights in `qtype` (Q8_0, as --outtype
    q8_0 writes them, or Q4_0, Q4_1, Q5_0, Q5_1: the gguf package's quantizer), random weights of `seed`."""
    import numpy as np
    from gguf import GGMLQuantizationType as Q
    from gguf import GGUFWriter, LlamaFileType, quants

    qtype = Q[qtype] if isinstance(qtype, str) else qtype
    ffn = 4 * hidden
    rng = np.random.default_rng(seed)
    vocab = next(len(value) for key, value, *_ in tokenizer_fields if key == "tokenizer.ggml.tokens")
    writer = GGUFWriter(str(path), "gpt2")
    writer.add_name("Synthetic GPT-2")
    writer.add_block_count(layers)
    writer.add_context_length(context)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_layer_norm_eps(1e-5)
    writer.add_file_type(LlamaFileType[f"MOSTLY_{qtype.name}"])
    for key, value, vtype, sub_type in tokenizer_fields:
        writer.add_key_value(key, value, vtype, sub_type)

    def add(name, values, kind=qtype):
        if kind == Q.F32:
            writer.add_tensor(name, values.astype(np.float32))
        else:
            writer.add_tensor(name, quants.quantize(values.astype(np.float32), kind), raw_dtype=kind)

    embedding = rng.normal(0, 0.5, (vocab, hidden))
    add("token_embd.weight", embedding)
    add("position_embd.weight", rng.normal(0, 0.1, (context, hidden)), Q.F32)
    # (rows, columns) of each product as the file holds it: GPT-2's Conv1D [in, out] transposed
    products = {"attn_qkv": (3 * hidden, hidden), "attn_output": (hidden, hidden), "ffn_up": (ffn, hidden),
                "ffn_down": (hidden, ffn)}
    for n in range(layers):
        add(f"blk.{n}.attn_norm.weight", rng.uniform(0.8, 1.2, hidden), Q.F32)
        add(f"blk.{n}.attn_norm.bias", rng.normal(0, 0.1, hidden), Q.F32)
        for name in ("attn_qkv", "attn_output"):
            add(f"blk.{n}.{name}.weight", rng.normal(0, 0.15, products[name]))
            add(f"blk.{n}.{name}.bias", rng.normal(0, 0.1, products[name][0]), Q.F32)
        add(f"blk.{n}.ffn_norm.weight", rng.uniform(0.8, 1.2, hidden), Q.F32)
        add(f"blk.{n}.ffn_norm.bias", rng.normal(0, 0.1, hidden), Q.F32)
        for name in ("ffn_up", "ffn_down"):
            add(f"blk.{n}.{name}.weight", rng.normal(0, 0.15, products[name]))
            add(f"blk.{n}.{name}.bias", rng.normal(0, 0.1, products[name][0]), Q.F32)
    add("output_norm.weight", rng.uniform(0.8, 1.2, hidden), Q.F32)
    add("output_norm.bias", rng.normal(0, 0.1, hidden), Q.F32)
    if output:
        add("output.weight", embedding)
    return write_out(writer, path)


# google/gemma-2-2b-it's chat template (gemma-3's differs in taking a system message into the first user turn).
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}"
    "{% endif %}{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}")


def gemma_tokenizer_fields(vocab_size=700):
    """tokenizer.* metadata as llama.cpp writes a Gemma file's (google/gemma-2-2b-it, gemma-3-1b-it GGUF), for
    write_family_gguf: tokenizer.ggml.model "llama" (sentencepiece BPE with byte fallback, no merges: transformers
    rebuilds them from the order of the tokens), <pad> <eos> <bos> <unk> <mask> first, <start_of_turn>/<end_of_turn>
    control tokens, <0xNN> byte tokens, "\u2581"-prefixed pieces, runs of spaces stored as real spaces and typed
    user-defined (convert_hf_to_gguf's reading of the published tokenizer_config.json's added whitespace tokens, as
    "\n\n"), add_bos_token true, add_eos_token false, add_space_prefix false, the published template."""
    from gguf import GGUFValueType as V

    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"]
    vocab, _ = _metaspace_bpe(vocab_size - 4, specials)
    tokens = list(vocab) + ["  ", "   ", "    ", "\n\n"]  # whitespace-only runs spelled with spaces, as published
    types = [3 if t in specials and t != "<unk>" else 2 if t == "<unk>" else 6 if t.startswith("<0x") else
             4 if len(t) > 1 and not t.strip() else 1 for t in tokens]
    return [("tokenizer.ggml.model", "llama", V.STRING, None), ("tokenizer.ggml.pre", "default", V.STRING, None),
            ("tokenizer.ggml.tokens", tokens, V.ARRAY, V.STRING),
            ("tokenizer.ggml.scores", [float(-i) for i in range(len(tokens))], V.ARRAY, V.FLOAT32),
            ("tokenizer.ggml.token_type", types, V.ARRAY, V.INT32),
            ("tokenizer.ggml.bos_token_id", 2, V.UINT32, None), ("tokenizer.ggml.eos_token_id", 1, V.UINT32, None),
            ("tokenizer.ggml.unknown_token_id", 3, V.UINT32, None),
            ("tokenizer.ggml.padding_token_id", 0, V.UINT32, None),
            ("tokenizer.ggml.add_bos_token", True, V.BOOL, None),
            ("tokenizer.ggml.add_eos_token", False, V.BOOL, None),
            ("tokenizer.ggml.add_space_prefix", False, V.BOOL, None),
            ("tokenizer.chat_template", GEMMA_CHAT_TEMPLATE, V.STRING, None)]


def add_tensors(writer, checkpoint: str, names, qtype_name: str, skip=None, reshape=None, float_kept=()) -> None:
    """The checkpoint's tensors (model.safetensors) under the GGUF names of gguf's name table `names`, as llama.cpp's
    converter writes them: a matrix of whole Q8_0 blocks a row in Q8_0 where `qtype_name` is Q8_0 (unless its GGUF name
    holds one of `float_kept`), the rest F32; `skip(hf_name)`: left out; `reshape(hf_name, values)`: the converter's
    change of shape."""
    import gguf
    import numpy as np
    from gguf import GGMLQuantizationType as Q
    from safetensors.torch import load_file

    for hf_name, value in load_file(os.path.join(checkpoint, "model.safetensors")).items():
        if skip is not None and skip(hf_name):
            continue
        values = value.float().numpy()
        values = reshape(hf_name, values) if reshape is not None else values
        base, _, suffix = hf_name.rpartition(".")
        name = names.get_name(base) + "." + suffix
        if qtype_name == "Q8_0" and values.ndim == 2 and values.shape[-1] % 32 == 0 and not any(
                part in name for part in float_kept):
            writer.add_tensor(name, gguf.quants.quantize(np.ascontiguousarray(values), Q.Q8_0), raw_dtype=Q.Q8_0)
        else:
            writer.add_tensor(name, np.ascontiguousarray(values))


def write_out(writer, path) -> str:
    """Writes a GGUFWriter's header, metadata and tensors to its file and closes it; returns the path."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def set_context(path: str, context: int) -> None:
    """Gives the checkpoint at `path` an instruct model's context (config.max_position_embeddings): a tool prompt
    takes hundreds of the tiny vocabulary's tokens (the rotary positions go on past the tiny default)."""
    update_config(path, max_position_embeddings=context)


def update_config(path: str, **fields) -> None:
    """The checkpoint at `path` with these fields in its config.json (a published config's keys a writer reads)."""
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({**config, **fields}, f)


# Gemma 4's two layouts, at tiny sizes: E2B/E4B's (a per-layer embedding beside each layer's input, the last layers
# reusing earlier layers' keys and values with MLPs twice as wide) and 31B's (no per-layer embedding, the full layers
# with their own kv head count and their keys as values, no value projection).
GEMMA4_VARIANTS = {
    "e2b": dict(hidden_size_per_layer_input=64, num_kv_shared_layers=2, use_double_wide_mlp=True),
    "31b": dict(hidden_size_per_layer_input=0, attention_k_eq_v=True, num_global_key_value_heads=1,
                final_logit_softcapping=30.0),
    # 26B-A4B's: a mixture of experts beside each layer's dense MLP
    "26b-a4b": dict(hidden_size_per_layer_input=0, enable_moe_block=True, num_experts=4, top_k_experts=2,
                    moe_intermediate_size=64),
}


def gemma4_checkpoint(out_dir: str, variant: str) -> str:
    """A tiny random Gemma 4 checkpoint (Gemma4ForCausalLM, GEMMA4_VARIANTS' layout) in `out_dir`, with the llama
    tokenizer's SentencePiece-style BPE (Gemma's kind); every layer's output scale away from 1, as trained ones are."""
    from transformers import AutoTokenizer, Gemma4ForCausalLM, Gemma4TextConfig

    tokenizer_dir = build_tiny_checkpoint("llama", os.path.join(out_dir, "tokenizer"))
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = Gemma4TextConfig(
        vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, global_head_dim=64, sliding_window=8,
        max_position_embeddings=512, vocab_size_per_layer_input=len(tokenizer),
        layer_types=["sliding_attention"] * 2 + ["full_attention"] + ["sliding_attention"] * 2 + ["full_attention"],
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id, tie_word_embeddings=True, **GEMMA4_VARIANTS[variant])
    config.architectures = ["Gemma4ForCausalLM"]
    torch.manual_seed(SEED)
    model = Gemma4ForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.layer_scalar.uniform_(0.5, 1.5)
    path = os.path.join(out_dir, variant)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def write_gemma4_gguf(checkpoint: str, path: str, qtype_name: str = "F32") -> str:
    """The GGUF file llama.cpp's converter (conversion/gemma.py's Gemma4Model) writes of a Gemma 4 checkpoint: its
    metadata keys, its vocabulary (model "gemma4"), the rope_freqs tensor of the full layers' proportional rotary
    (1 for a rotated pair, 1e30 for the others), each layer's scalar as layer_output_scale, norms as stored (Gemma 4's
    add no 1); matrices and experts in `qtype_name` (F32; Q8_0 as --outtype q8_0 writes them, the router F32; Q5_0, the
    type llama.cpp's Q4_K_M falls back to where a row is not whole superblocks: 26B-A4B's 704 and 2112)."""
    import pathlib

    import gguf
    import numpy as np
    from gguf import GGMLQuantizationType as Q
    from safetensors.torch import load_file

    with open(os.path.join(checkpoint, "config.json")) as f:
        config = json.load(f)
    state = load_file(os.path.join(checkpoint, "model.safetensors"))
    layers, kinds = config["num_hidden_layers"], config["layer_types"]
    full = kinds.index("full_attention")
    full_head = config["per_layer_config"][str(full)]["head_dim"]
    writer = gguf.GGUFWriter(path, "gemma4")
    writer.add_type("model")
    writer.add_block_count(layers)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    shared = config["num_kv_shared_layers"]
    if config["use_double_wide_mlp"]:
        width = config["intermediate_size"]
        writer.add_feed_forward_length([width if i < layers - shared else 2 * width for i in range(layers)])
    else:
        writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    full_kv = config["per_layer_config"][str(full)].get("num_key_value_heads")
    if full_kv is not None:
        writer.add_head_count_kv([config["num_key_value_heads"] if kind == "sliding_attention" else full_kv
                                  for kind in kinds])
    else:
        writer.add_head_count_kv(config["num_key_value_heads"])
    rope = config["rope_parameters"]
    writer.add_rope_freq_base(rope["full_attention"]["rope_theta"])
    writer.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_key_length(full_head)
    writer.add_value_length(full_head)
    writer.add_file_type({"F32": 0, "Q8_0": 7, "Q5_0": 8}[qtype_name])
    if config.get("final_logit_softcapping"):
        writer.add_final_logit_softcapping(config["final_logit_softcapping"])
    writer.add_sliding_window(config["sliding_window"])
    writer.add_shared_kv_layers(shared)
    writer.add_embedding_length_per_layer_input(config["hidden_size_per_layer_input"] or 0)
    writer.add_sliding_window_pattern([kind == "sliding_attention" for kind in kinds])
    writer.add_key_length_swa(config["head_dim"])
    writer.add_value_length_swa(config["head_dim"])
    writer.add_rope_dimension_count(full_head)
    writer.add_rope_dimension_count_swa(config["head_dim"])
    if config.get("enable_moe_block"):
        writer.add_expert_count(config["num_experts"])
        writer.add_expert_used_count(config["top_k_experts"])
        writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    vocab = gguf.LlamaHfVocab(pathlib.Path(checkpoint))
    tokens, scores, types = zip(*vocab.all_tokens())
    writer.add_tokenizer_model("gemma4")
    writer.add_token_list(list(tokens))
    writer.add_token_scores(list(scores))
    writer.add_token_types(list(types))
    gguf.SpecialVocab(pathlib.Path(checkpoint), load_merges=True).add_to_gguf(writer)
    writer.add_add_space_prefix(False)
    writer.add_add_bos_token(True)

    rotated = int(full_head * rope["full_attention"]["partial_rotary_factor"] / 2)
    writer.add_tensor("rope_freqs.weight",
                      np.array([1.0] * rotated + [1e30] * (full_head // 2 - rotated), dtype=np.float32))
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA4, layers)
    for hf_name, value in state.items():
        if hf_name == "lm_head.weight":
            continue  # tied
        base, dot, suffix = hf_name.rpartition(".")
        if suffix in ("scale", "per_expert_scale"):  # the router's scales, named as the converter names them
            layer = hf_name.split(".")[2]
            name = f"blk.{layer}.ffn_gate_inp.scale" if suffix == "scale" else f"blk.{layer}.ffn_down_exps.scale"
        else:
            if suffix not in ("weight", "bias"):  # the layer scalar and the experts' tensors: ".weight" added
                base, suffix = hf_name, "weight"
            name = names.get_name(base) + "." + suffix
        values = value.float().numpy()
        # (matrices and the experts' 3-D tensors; the router's stays F32, as the converter keeps ffn_gate_inp)
        if qtype_name != "F32" and values.ndim in (2, 3) and values.shape[-1] % 32 == 0 and "gate_inp" not in name:
            writer.add_tensor(name, gguf.quants.quantize(values, Q[qtype_name]), raw_dtype=Q[qtype_name])
        else:
            writer.add_tensor(name, values)
    return write_out(writer, path)


def add_text_shape(writer, config: dict) -> None:
    """The keys llama.cpp's converter writes of every text model's config first (TextModel.set_gguf_parameters):
    the layers, context, widths and heads."""
    writer.add_type("model")
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    if "intermediate_size" in config:  # (a mixture without a dense MLP has none)
        writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])


def add_text_keys(writer, config: dict, qtype_name: str, experts: tuple[int, int] | None = None,
                  head_dim: bool = False) -> None:
    """add_text_shape's keys, then those llama.cpp's converter writes of most text models after them: the rotary's
    base, the norms' epsilon, the experts' count and those a token takes (`experts`), the head size (`head_dim`:
    key_length and value_length, the config's head_dim), the file's type (`qtype_name`: F32 or Q8_0)."""
    add_text_shape(writer, config)
    writer.add_rope_freq_base(config["rope_parameters"]["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    if experts is not None:
        writer.add_expert_count(experts[0])
        writer.add_expert_used_count(experts[1])
    if head_dim:
        writer.add_key_length(config["head_dim"])
        writer.add_value_length(config["head_dim"])
    writer.add_file_type({"F32": 0, "Q8_0": 7}[qtype_name])


def tiny_gpt2_tokenizer(out_dir: str):
    """The tiny GPT-2 checkpoint's byte-level BPE tokenizer, built in out_dir/tokenizer."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(build_tiny_checkpoint("gpt2", os.path.join(out_dir, "tokenizer")))


def save_tiny(out_dir: str, name: str, model_class, config, tokenizer, draw=None) -> str:
    """A random `model_class` of `config` (its weights drawn by SEED) and `tokenizer` saved in out_dir/name; the
    path. `draw(name, tensor)`: each parameter and buffer drawn again where it says, before the save (values a
    trained model holds that the initializer leaves constant: norms at 1 or 0, biases at 0)."""
    config.architectures = [model_class.__name__]
    torch.manual_seed(SEED)
    path = os.path.join(out_dir, name)
    model = model_class(config)
    if draw is not None:
        with torch.no_grad():
            for tensor_name, tensor in [*model.named_parameters(), *model.named_buffers()]:
                draw(tensor_name, tensor)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def drawn_norms(mean: float):
    """save_tiny's `draw` of each norm's weight around `mean` (its initial value), spread 0.3."""
    return lambda name, tensor: tensor.normal_(mean, 0.3) if "norm" in name else None


def drawn_router_bias(suffix: str):
    """save_tiny's `draw` of a router's bias (the buffer named ending in `suffix`: a trained one is not 0) around 0
    and each norm's weight around 1, spread 0.3 and 0.3."""
    def draw(name, tensor):
        if name.endswith(suffix):
            tensor.normal_(0, 0.3)
        elif "norm" in name:
            tensor.normal_(1, 0.3)

    return draw


def drawn_mamba2(name, tensor):
    """save_tiny's `draw` of a Mamba-2 hybrid (what a trained one holds that the initializer leaves constant): each
    norm's weight, D and dt_bias around 1, A_log around 0.5, the convolution's bias around 0."""
    if "norm" in name or name.endswith((".D", "dt_bias")):
        tensor.normal_(1, 0.3)
    elif name.endswith("A_log"):
        tensor.normal_(0.5, 0.5)
    elif name.endswith("conv1d.bias"):
        tensor.normal_(0, 0.3)


def smollm3_checkpoint(out_dir: str) -> str:
    """A tiny random SmolLM3 checkpoint (SmolLM3ForCausalLM) in `out_dir`: SmolLM3-3B's layout 64 wide, 8 layers of
    which every fourth (the 4th and the 8th) has no rotary (SmolLM3Config's no_rope_layers), 4 heads over 2, tied
    embeddings; a byte-level BPE vocabulary. The weights drawn wider than the config's 0.02."""
    from transformers import SmolLM3Config, SmolLM3ForCausalLM

    tokenizer = tiny_gpt2_tokenizer(out_dir)
    config = SmolLM3Config(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.15, tie_word_embeddings=True,
        pad_token_id=None, eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id)
    return save_tiny(out_dir, "smollm3", SmolLM3ForCausalLM, config, tokenizer)


def write_smollm3_gguf(checkpoint: str, path: str, qtype_name: str = "F32") -> str:
    """The GGUF file llama.cpp's converter (conversion/llama.py's SmolLM3Model, a LlamaModel) writes of a SmolLM3
    checkpoint: llama's keys under the smollm3 architecture (no key for the layers without rotary: llama.cpp fixes
    every fourth), q and k permuted for its interleaved rotary, no output.weight where tied, a GPT-2 style BPE
    vocabulary; matrices in `qtype_name` (F32, or Q8_0 as --outtype q8_0 writes them)."""
    return write_as_llama(checkpoint, path, "smollm3", qtype_name, "gpt-2")


def granite_checkpoint(out_dir: str) -> str:
    """A tiny random Granite 3 checkpoint (GraniteForCausalLM) in `out_dir`: granite-3.3-2b-instruct's layout 64
    wide (4 heads over 2, tied embeddings) and its multipliers: the embedding's 12, each residual branch's 0.22, the
    scores' 1 / 64 in place of 1 / sqrt(head size), the logits divided by 8. The weights drawn wider than the
    config's 0.02."""
    from transformers import GraniteConfig, GraniteForCausalLM

    tokenizer = tiny_gpt2_tokenizer(out_dir)
    config = GraniteConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.15, tie_word_embeddings=True,
        rms_norm_eps=1e-5, embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=1 / 64,
        logits_scaling=8.0, rope_parameters={"rope_type": "default", "rope_theta": 10000000.0},
        pad_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id)
    return save_tiny(out_dir, "granite", GraniteForCausalLM, config, tokenizer)


def write_granite_gguf(checkpoint: str, path: str, qtype_name: str = "F32") -> str:
    """The GGUF file llama.cpp's converter (conversion/granite.py's GraniteModel, a LlamaModel) writes of a Granite
    checkpoint: llama's keys and q/k permutation under the granite architecture, and its multipliers as
    attention.scale, embedding_scale, residual_scale and logit_scale; Granite 3's vocabulary is a byte-level BPE
    that llama.cpp splits as refact's."""
    with open(os.path.join(checkpoint, "config.json")) as f:
        config = json.load(f)
    return write_as_llama(checkpoint, path, "granite", qtype_name, "refact", {
        "attention.scale": config["attention_multiplier"], "embedding_scale": config["embedding_multiplier"],
        "residual_scale": config["residual_multiplier"], "logit_scale": config["logits_scaling"]})


def ministral3_checkpoint(out_dir: str) -> str:
    """A tiny random Ministral 3 checkpoint (Ministral3ForCausalLM, the text model of Ministral-3-3B's
    Mistral3ForConditionalGeneration) in `out_dir`: 64 wide, 4 heads of 32 over 2 (wider than hidden / heads, as the
    3B's 32 heads of 128 over 3072), tied embeddings, its rotary's yarn and llama 4's query temperature with their
    published constants (beta_fast 32, beta_slow 1, mscale and mscale_all_dim 1, llama_4_scaling_beta 0.1) over an
    original context of 16 (the published 16384, scaled down so that a prompt crosses it), factor 4."""
    from transformers import Ministral3Config, Ministral3ForCausalLM

    tokenizer = tiny_gpt2_tokenizer(out_dir)
    config = Ministral3Config(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=64, initializer_range=0.15,
        tie_word_embeddings=True, rope_parameters={
            "rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0, "original_max_position_embeddings": 16,
            "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0, "llama_4_scaling_beta": 0.1},
        pad_token_id=None, eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id)
    return save_tiny(out_dir, "ministral3", Ministral3ForCausalLM, config, tokenizer)


def write_ministral3_gguf(checkpoint: str, path: str, qtype_name: str = "F32") -> str:
    """The GGUF file llama.cpp's converter (conversion/mistral3.py's Ministral3Model, a LlamaModel) writes of a
    Ministral 3 checkpoint: llama's keys and q/k permutation under the mistral3 architecture, the head size as
    key_length, the yarn rotary's type, factor, original context and betas, mscale_all_dim as yarn_log_multiplier
    and llama_4_scaling_beta as attention.temperature_scale; Ministral 3's tekken vocabulary is a byte-level BPE."""
    with open(os.path.join(checkpoint, "config.json")) as f:
        rope = json.load(f)["rope_parameters"]

    def keys(writer):
        add_yarn(writer, rope)
        writer.add_rope_scaling_yarn_log_mul(rope["mscale_all_dim"])
        writer.add_attn_temperature_scale(rope["llama_4_scaling_beta"])

    return write_as_llama(checkpoint, path, "mistral3", qtype_name, "tekken", more_keys=keys)


def mistral_small_checkpoint(out_dir: str) -> str:
    """A tiny random checkpoint of Mistral Small 3.x's text model (MistralForCausalLM, no sliding window) in
    `out_dir`: 64 wide, 4 heads of 32 over 2 (Mistral Small's 32 heads of 128 over 5120: wider than hidden / heads),
    untied embeddings, rope base 1e9, no rotary scaling."""
    from transformers import MistralConfig, MistralForCausalLM

    tokenizer = tiny_gpt2_tokenizer(out_dir)
    config = MistralConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=512, initializer_range=0.15, sliding_window=None,
        tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 1000000000.0},
        pad_token_id=None, eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id)
    return save_tiny(out_dir, "mistral_small", MistralForCausalLM, config, tokenizer)


def write_mistral3_gguf(checkpoint: str, path: str, qtype_name: str = "F32") -> str:
    """The GGUF file llama.cpp's converter (Ministral3Model) writes of Mistral Small 3.x's text model: llama's keys
    under the mistral3 architecture, without Ministral 3's rotary keys (written for a ministral3 config only)."""
    return write_as_llama(checkpoint, path, "mistral3", qtype_name, "tekken")


def qwen3vl_checkpoint(out_dir: str, experts: bool = False) -> str:
    """A tiny random Qwen3-VL checkpoint (Qwen3VLForConditionalGeneration) in `out_dir`: Qwen3-VL-2B's text model 64
    wide (4 heads of 32 over 2, q/k norms, tied embeddings) with its interleaved MRoPE (sections 6, 5, 5 of a head's 16
    frequencies: the published 24, 20, 20 of 64, scaled), rope base 5e6; a one-layer vision tower with a deepstack
    merger (what a text prompt never reaches); a byte-level BPE vocabulary. `experts`: Qwen3-VL-30B-A3B's instead
    (Qwen3VLMoeForConditionalGeneration: each layer 8 experts of 32, 2 a token, untied)."""
    from transformers import (
        Qwen3VLConfig,
        Qwen3VLForConditionalGeneration,
        Qwen3VLMoeConfig,
        Qwen3VLMoeForConditionalGeneration,
    )

    tokenizer = tiny_gpt2_tokenizer(out_dir)
    text = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
                initializer_range=0.15, rms_norm_eps=1e-6, rope_parameters={
                    "rope_type": "default", "rope_theta": 5000000.0, "mrope_section": [6, 5, 5],
                    "mrope_interleaved": True})
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                  num_position_embeddings=16, deepstack_visual_indexes=[0], initializer_range=0.15)
    if experts:
        text.update(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)
    config_class, model_class = (Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration) if experts else (
        Qwen3VLConfig, Qwen3VLForConditionalGeneration)
    config = config_class(text_config=text, vision_config=vision, tie_word_embeddings=not experts,
                           image_token_id=len(tokenizer) - 3, video_token_id=len(tokenizer) - 2,
                           vision_start_token_id=len(tokenizer) - 4, vision_end_token_id=len(tokenizer) - 1)
    return save_tiny(out_dir, "qwen3vlmoe" if experts else "qwen3vl", model_class, config, tokenizer)


def qwen3vlmoe_checkpoint(out_dir: str) -> str:
    """qwen3vl_checkpoint's mixture of experts (Qwen3-VL-30B-A3B's layout)."""
    return qwen3vl_checkpoint(out_dir, experts=True)


def qwen2vl_checkpoint(out_dir: str) -> str:
    """A tiny random Qwen2.5-VL checkpoint (Qwen2_5_VLForConditionalGeneration) in `out_dir`: Qwen2.5-VL-7B's text
    model 128 wide (4 heads of 32 over 2, q/k/v biases, untied embeddings) with its MRoPE (sections 4, 6, 6 of a head's
    16 frequencies: the published 16, 24, 24 of 64, scaled), rope base 1e6; a one-layer vision tower (what a text
    prompt never reaches); a byte-level BPE vocabulary."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    tokenizer = tiny_gpt2_tokenizer(out_dir)
    text = dict(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.15,
                rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0,
                                                    "mrope_section": [4, 6, 6]},
                bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=128,
                  fullatt_block_indexes=[0], initializer_range=0.15)
    config = Qwen2_5_VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=False,
                              image_token_id=len(tokenizer) - 3, video_token_id=len(tokenizer) - 2,
                              vision_start_token_id=len(tokenizer) - 4, vision_end_token_id=len(tokenizer) - 1)
    return save_tiny(out_dir, "qwen2vl", Qwen2_5_VLForConditionalGeneration, config, tokenizer)


def write_qwen_vl_gguf(checkpoint: str, path: str, qtype_name: str = "F32") -> str:
    """The GGUF file llama.cpp's converter (conversion/qwen3vl.py's Qwen3VLTextModel, a Qwen3Model; for a mixture
    Qwen3VLMoeTextModel, a Qwen3MoeModel) writes of a Qwen3-VL checkpoint's text model (the vision tower goes to a
    separate mmproj file): qwen3's (qwen3moe's) keys and tensors under the qwen3vl (qwen3vlmoe) architecture, the
    MRoPE sections (rope.dimension_sections, padded to 4) and the deepstack layers' count, the language model's
    tensors without their prefix, each layer's experts' gate, up and down as 3-D ffn_*_exps, no q/k permutation,
    no output.weight where tied, a byte-level BPE vocabulary llama.cpp splits as qwen2's. Of a Qwen2.5-VL (or
    Qwen2-VL) checkpoint (conversion/qwenvl.py's Qwen2VLModel): qwen2's keys and tensors (q/k/v biases) under the
    qwen2vl architecture with the sections, without key_length (its config has no head_dim) or deepstack."""

    import gguf
    import numpy as np
    from gguf import GGMLQuantizationType as Q
    from transformers import AutoModelForImageTextToText

    with open(os.path.join(checkpoint, "config.json")) as f:
        full = json.load(f)
    config, rope = full["text_config"], full["text_config"]["rope_parameters"]
    experts = config.get("num_experts") or config.get("num_local_experts")
    qwen2 = full["model_type"] == "qwen2_5_vl"
    arch = gguf.MODEL_ARCH.QWEN2VL if qwen2 else gguf.MODEL_ARCH.QWEN3VLMOE if experts else gguf.MODEL_ARCH.QWEN3VL
    writer = gguf.GGUFWriter(path, gguf.MODEL_ARCH_NAMES[arch])
    add_text_shape(writer, config)
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(config["num_experts_per_tok"])
        writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    writer.add_rope_dimension_sections([*rope["mrope_section"], 0][:4])
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    if not qwen2:  # (Qwen2.5-VL's config has no head_dim: the converter writes no key_length)
        writer.add_key_length(config["head_dim"])
        writer.add_value_length(config["head_dim"])
    writer.add_file_type({"F32": 0, "Q8_0": 7}[qtype_name])
    if not qwen2:
        writer.add_num_deepstack_layers(len(full["vision_config"]["deepstack_visual_indexes"]))
    add_bpe_vocabulary(writer, checkpoint, "qwen2")
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    names = gguf.get_tensor_name_map(arch, config["num_hidden_layers"])
    state = AutoModelForImageTextToText.from_pretrained(checkpoint, dtype=torch.float32).state_dict()

    def add(name, values):
        values = np.ascontiguousarray(values)
        if qtype_name == "Q8_0" and values.ndim >= 2 and values.shape[-1] % 32 == 0 and ".ffn_gate_inp." not in name:
            writer.add_tensor(name, gguf.quants.quantize(values, Q.Q8_0), raw_dtype=Q.Q8_0)
        else:
            writer.add_tensor(name, values)

    for hf_name, value in state.items():
        if hf_name.startswith("model.visual.") or (hf_name == "lm_head.weight" and full["tie_word_embeddings"]):
            continue
        values = value.float().numpy()
        base = hf_name.replace("language_model.", "").removesuffix(".weight").removesuffix(".bias")
        if base.endswith("mlp.experts.gate_up_proj"):  # [experts, gate rows; up rows, hidden]: two tensors
            prefix = names.get_name(base.replace("gate_up_proj", "gate_proj")).replace("_gate_exps", "")
            width = values.shape[1] // 2
            add(f"{prefix}_gate_exps.weight", values[:, :width])
            add(f"{prefix}_up_exps.weight", values[:, width:])
        elif base.endswith("mlp.experts.down_proj"):  # [experts, hidden, inner]
            add(names.get_name(base) + ".weight", values)
        else:
            add(names.get_name(base) + "." + hf_name.rpartition(".")[2], values)
    return write_out(writer, path)


def qwen35_checkpoint(out_dir: str, experts: bool = False) -> str:
    """A tiny random Qwen3.5 checkpoint (Qwen3_5ForConditionalGeneration) in `out_dir`: Qwen3.5-9B's text model 64
    wide, three Gated DeltaNet layers and one of gated full attention (4 heads of 32 over 2, a quarter of each head
    rotated by its interleaved MRoPE, sections 2, 1, 1), the linear attention's 4 value heads over 2 key heads (so
    llama.cpp's converter tiles them), heads of 32 (a whole Q8_0 block each), tied embeddings; its norms (1 + weight)
    drawn random; a one-layer vision tower; a byte-level BPE vocabulary. `experts`: Qwen3.5-35B-A3B's instead
    (Qwen3_5MoeForConditionalGeneration: each layer 8 experts of 32, 2 a token, a shared expert of 64 behind its
    sigmoid gate, untied)."""
    from transformers import (
        Qwen3_5Config,
        Qwen3_5ForConditionalGeneration,
        Qwen3_5MoeConfig,
        Qwen3_5MoeForConditionalGeneration,
    )

    tokenizer = tiny_gpt2_tokenizer(out_dir)
    size = len(tokenizer)
    text = dict(vocab_size=size, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=32, linear_conv_kernel_dim=4, linear_key_head_dim=32,
                linear_value_head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
                max_position_embeddings=512, initializer_range=0.15, rms_norm_eps=1e-6,
                rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                                 "mrope_section": [2, 1, 1], "mrope_interleaved": True})
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                  num_position_embeddings=16, initializer_range=0.15)
    if experts:
        del text["intermediate_size"]
        text.update(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=64)
    config_class, model_class = (Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration) if experts else (
        Qwen3_5Config, Qwen3_5ForConditionalGeneration)
    config = config_class(text_config=text, vision_config=vision, tie_word_embeddings=not experts,
                          image_token_id=size - 3, video_token_id=size - 2, vision_start_token_id=size - 4,
                          vision_end_token_id=size - 1)
    # (its norms initialized to 0: their offset would go untested)
    return save_tiny(out_dir, "qwen35moe" if experts else "qwen35", model_class, config, tokenizer, drawn_norms(0))


def qwen35moe_checkpoint(out_dir: str) -> str:
    """qwen35_checkpoint's mixture of experts (Qwen3.5-35B-A3B's layout)."""
    return qwen35_checkpoint(out_dir, experts=True)


def write_qwen35_gguf(checkpoint: str, path: str, qtype_name: str = "F32") -> str:
    """The GGUF file llama.cpp's converter (conversion/qwen.py's Qwen3_5TextModel) writes of a Qwen3.5 checkpoint's
    text model: the ssm.* keys of the linear attention, which layers are recurrent, the MRoPE sections (padded to 4)
    and rotated width; its multi-token prediction block as one more layer (nextn_predict_layers, blk.N.nextn.*: the
    published checkpoints hold one, transformers' model none, so random here); A_log as -exp(A_log), dt_bias as
    ssm_dt.bias, the convolution squeezed, every norm but the linear attention's stored as 1 + weight, and the value
    heads tiled rather than grouped by key head in each tensor that makes or reads them (_LinearAttentionVReorderBase);
    of a mixture (qwen35moe, Qwen3_5MoeTextModel) the experts' keys, each layer's experts' gate, up and down as 3-D
    ffn_*_exps, the shared expert's as ffn_*_shexp; matrices in Q8_0 where asked, the convolution, norms and gates
    F32."""
    import gguf
    import numpy as np
    from gguf import GGMLQuantizationType as Q
    from transformers import AutoModelForImageTextToText

    with open(os.path.join(checkpoint, "config.json")) as f:
        full = json.load(f)
    config = full["text_config"]
    layers, rope, experts = config["num_hidden_layers"], config["rope_parameters"], config.get("num_experts")
    key_heads, value_heads = config["linear_num_key_heads"], config["linear_num_value_heads"]
    key_dim, value_dim = config["linear_key_head_dim"], config["linear_value_head_dim"]
    arch = gguf.MODEL_ARCH.QWEN35MOE if experts else gguf.MODEL_ARCH.QWEN35
    prefix = gguf.MODEL_ARCH_NAMES[arch]
    writer = gguf.GGUFWriter(path, prefix)
    add_text_shape(writer, {**config, "num_hidden_layers": layers + 1})  # (the MTP block a layer)
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(config["num_experts_per_tok"])
        writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
        writer.add_expert_shared_feed_forward_length(config["shared_expert_intermediate_size"])
    writer.add_rope_dimension_sections([*rope["mrope_section"], 0, 0, 0][:4])
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_key_length(config["head_dim"])
    writer.add_value_length(config["head_dim"])
    writer.add_file_type({"F32": 0, "Q8_0": 7, "Q4_0": 2}[qtype_name])
    writer.add_ssm_conv_kernel(config["linear_conv_kernel_dim"])
    writer.add_ssm_state_size(key_dim)
    writer.add_ssm_group_count(key_heads)
    writer.add_ssm_time_step_rank(value_heads)
    writer.add_ssm_inner_size(value_dim * value_heads)
    writer.add_array(f"{prefix}.attention.recurrent_layers",  # (gguf 0.19's writer has no add_recurrent_layers)
                     [kind == "linear_attention" for kind in config["layer_types"]] + [False])
    writer.add_full_attention_interval(4)
    writer.add_rope_dimension_count(int(config["head_dim"] * rope["partial_rotary_factor"]))
    writer.add_nextn_predict_layers(1)
    add_bpe_vocabulary(writer, checkpoint, "qwen35")
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    names = gguf.get_tensor_name_map(arch, layers + 1)

    def tiled(values, axis, size):  # grouped by key head -> tiled (_reorder_v_heads)
        values = np.moveaxis(values, axis, 0)
        shape = values.shape
        values = values.reshape(key_heads, value_heads // key_heads, size, *shape[1:]).swapaxes(0, 1)
        return np.moveaxis(values.reshape(shape), 0, axis)

    def add(name, values):
        values = np.ascontiguousarray(values, dtype=np.float32)
        if qtype_name != "F32" and values.ndim >= 2 and values.shape[-1] % 32 == 0 and not any(
                part in name for part in ("ssm_conv1d", "ffn_gate_inp")):
            writer.add_tensor(name, gguf.quants.quantize(values, Q[qtype_name]), raw_dtype=Q[qtype_name])
        else:
            writer.add_tensor(name, values)

    state = AutoModelForImageTextToText.from_pretrained(checkpoint, dtype=torch.float32).state_dict()
    query_keys = 2 * key_heads * key_dim
    for hf_name, value in state.items():
        if hf_name.startswith("model.visual.") or (hf_name == "lm_head.weight" and full["tie_word_embeddings"]):
            continue  # (the vision tower goes to an mmproj file)
        values = value.float().numpy()
        base, _, suffix = hf_name.replace("language_model.", "").rpartition(".")
        if hf_name.endswith("mlp.experts.gate_up_proj"):  # [experts, gate rows; up rows, hidden]: two tensors
            layer = names.get_name(f"{base}.gate_proj").removesuffix("_gate_exps")
            add(f"{layer}_gate_exps.weight", values[:, :values.shape[1] // 2])
            add(f"{layer}_up_exps.weight", values[:, values.shape[1] // 2:])
            continue
        if hf_name.endswith("mlp.experts.down_proj"):
            base, suffix = f"{base}.{suffix}", "weight"
        elif suffix == "A_log":
            values, base, suffix = tiled(-torch.exp(value.float()).numpy(), 0, 1), f"{base}.A_log", ""
        elif suffix == "dt_bias":
            values, base, suffix = tiled(values, 0, 1), f"{base}.dt_proj", "bias"
        elif base.endswith("conv1d"):
            values = values.squeeze(1)
            values = np.concatenate([values[:query_keys], tiled(values[query_keys:], 0, value_dim)])
        elif base.endswith("in_proj_qkv"):
            values = np.concatenate([values[:query_keys], tiled(values[query_keys:], 0, value_dim)])
        elif base.endswith("in_proj_z"):
            values = tiled(values, 0, value_dim)
        elif base.endswith(("in_proj_a", "in_proj_b")):
            values = tiled(values, 0, 1)
        elif base.endswith("linear_attn.out_proj"):
            values = tiled(values, 1, value_dim)
        elif base.endswith("norm") and not base.endswith("linear_attn.norm"):
            values = values + 1
        add(names.get_name(base) + (f".{suffix}" if suffix else ""), values)
    hidden, head = config["hidden_size"], config["head_dim"]
    inner = config.get("shared_expert_intermediate_size") or config["intermediate_size"]
    generator = np.random.default_rng(SEED)
    mtp = {"nextn.eh_proj.weight": (hidden, 2 * hidden), "nextn.enorm.weight": (hidden,),
           "nextn.hnorm.weight": (hidden,), "nextn.shared_head_norm.weight": (hidden,),
           "attn_norm.weight": (hidden,), "post_attention_norm.weight": (hidden,),
           "attn_q.weight": (2 * config["num_attention_heads"] * head, hidden),
           "attn_k.weight": (config["num_key_value_heads"] * head, hidden),
           "attn_v.weight": (config["num_key_value_heads"] * head, hidden),
           "attn_output.weight": (hidden, config["num_attention_heads"] * head),
           "attn_q_norm.weight": (head,), "attn_k_norm.weight": (head,),
           "ffn_gate.weight": (inner, hidden), "ffn_up.weight": (inner, hidden), "ffn_down.weight": (hidden, inner)}
    if experts:  # (its MLP a mixture too)
        for part in ("gate", "up", "down"):
            del mtp[f"ffn_{part}.weight"]
            mtp[f"ffn_{part}_shexp.weight"] = (hidden, inner) if part == "down" else (inner, hidden)
            mtp[f"ffn_{part}_exps.weight"] = (experts, *mtp[f"ffn_{part}_shexp.weight"])
        mtp.update({"ffn_gate_inp.weight": (experts, hidden), "ffn_gate_inp_shexp.weight": (1, hidden)})
    for name, shape in mtp.items():
        add(f"blk.{layers}.{name}", generator.normal(0, 0.1, shape))
    return write_out(writer, path)


def qwen3next_checkpoint(out_dir: str) -> str:
    """A tiny random Qwen3-Next checkpoint (Qwen3NextForCausalLM) in `out_dir`: Qwen3-Next-80B-A3B's layout 64 wide,
    three Gated DeltaNet layers (4 value heads over 2 key heads of 32: each key head's q, k, v and z rows in one fused
    in_proj_qkvz, its b and a in in_proj_ba) and one of gated full attention (4 heads of 32 over 2, a quarter of each
    head rotated), each layer 8 experts of 32, 2 a token, beside a shared expert of 64 behind its sigmoid gate,
    untied; its norms (1 + weight) drawn random. Its config.json as published: the rotary's base and part at the top,
    no layer_types (every fourth layer full)."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    tokenizer = tiny_gpt2_tokenizer(out_dir)
    config = Qwen3NextConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, linear_conv_kernel_dim=4, linear_key_head_dim=32, linear_value_head_dim=32,
        linear_num_key_heads=2, linear_num_value_heads=4, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=32, shared_expert_intermediate_size=64, norm_topk_prob=True, partial_rotary_factor=0.25,
        rope_theta=10000000.0, max_position_embeddings=512, initializer_range=0.15, rms_norm_eps=1e-6,
        tie_word_embeddings=False, pad_token_id=None, eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id)
    path = save_tiny(out_dir, "qwen3next", Qwen3NextForCausalLM, config, tokenizer, drawn_norms(0))
    with open(os.path.join(path, "config.json")) as f:
        saved = json.load(f)
    rope = saved.pop("rope_parameters")
    del saved["layer_types"]
    saved.update(rope_theta=rope["rope_theta"], partial_rotary_factor=rope["partial_rotary_factor"],
                 full_attention_interval=4)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(saved, f, indent=2)
    return path


def write_qwen3next_gguf(checkpoint: str, path: str, qtype_name: str = "F32", legacy: bool = False) -> str:
    """The GGUF file llama.cpp's converter (conversion/qwen.py's Qwen3NextModel, a Qwen2MoeModel) writes of a
    Qwen3-Next checkpoint: qwen2moe's keys with the experts' and the shared expert's widths, the ssm.* keys of the
    linear attention, which layers are recurrent, the rotated width; its multi-token prediction block as one more
    layer (nextn_predict_layers: the published checkpoints hold one, transformers' model none, so random here); A_log
    as -exp(A_log), dt_bias as ssm_dt.bias, the convolution squeezed, every norm but the linear attention's stored as
    1 + weight, in_proj_qkvz split into attn_qkv (every key head's q, then k, then v) and attn_gate (z), in_proj_ba
    as ssm_ba as it is, each layer's experts stacked into ffn_*_exps, the shared expert as ffn_*_shexp and its gate
    as ffn_gate_inp_shexp; matrices in Q8_0 where asked, the convolution, norms and gates F32. `legacy`: as it wrote
    them before splitting in_proj_qkvz (in_proj_qkvz whole as ssm_in; no multi-token prediction block)."""
    import gguf
    import numpy as np
    from gguf import GGMLQuantizationType as Q
    from safetensors.torch import load_file

    with open(os.path.join(checkpoint, "config.json")) as f:
        config = json.load(f)
    layers, experts = config["num_hidden_layers"], config["num_experts"]
    key_heads, value_heads = config["linear_num_key_heads"], config["linear_num_value_heads"]
    key_dim, value_dim = config["linear_key_head_dim"], config["linear_value_head_dim"]
    mtp = 0 if legacy else 1
    arch = gguf.MODEL_ARCH.QWEN3NEXT
    writer = gguf.GGUFWriter(path, gguf.MODEL_ARCH_NAMES[arch])
    add_text_shape(writer, {**config, "num_hidden_layers": layers + mtp})
    writer.add_rope_freq_base(config["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_expert_count(experts)
    writer.add_expert_used_count(config["num_experts_per_tok"])
    writer.add_key_length(config["head_dim"])
    writer.add_value_length(config["head_dim"])
    writer.add_file_type({"F32": 0, "Q8_0": 7}[qtype_name])
    writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    writer.add_expert_shared_feed_forward_length(config["shared_expert_intermediate_size"])
    writer.add_ssm_conv_kernel(config["linear_conv_kernel_dim"])
    writer.add_ssm_state_size(key_dim)
    writer.add_ssm_group_count(key_heads)
    writer.add_ssm_time_step_rank(value_heads)
    writer.add_ssm_inner_size(value_dim * value_heads)
    if not legacy:
        writer.add_array(f"{gguf.MODEL_ARCH_NAMES[arch]}.attention.recurrent_layers",
                         [(layer + 1) % 4 != 0 for layer in range(layers)] + [False] * mtp)
    writer.add_full_attention_interval(config["full_attention_interval"])
    writer.add_rope_dimension_count(int(config["head_dim"] * config["partial_rotary_factor"]))
    if mtp:
        writer.add_nextn_predict_layers(mtp)
    add_bpe_vocabulary(writer, checkpoint, "qwen2")
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    names = gguf.get_tensor_name_map(arch, layers + mtp)

    def add(name, values):
        values = np.ascontiguousarray(values, dtype=np.float32)
        if qtype_name != "F32" and values.ndim >= 2 and values.shape[-1] % 32 == 0 and not any(
                part in name for part in ("ssm_conv1d", "ffn_gate_inp")):
            writer.add_tensor(name, gguf.quants.quantize(values, Q[qtype_name]), raw_dtype=Q[qtype_name])
        else:
            writer.add_tensor(name, values)

    state = load_file(os.path.join(checkpoint, "model.safetensors"))
    widths = [key_dim, key_dim, value_heads // key_heads * value_dim, value_heads // key_heads * value_dim]
    for hf_name, value in state.items():
        values = value.float().numpy()
        base, _, suffix = hf_name.rpartition(".")
        if ".mlp.experts." in hf_name:  # (each part stacked at its first expert's)
            if (stacked := stacked_experts(state, hf_name, experts)) is not None:
                layer, part, values = stacked
                add(names.get_name(f"{layer}.mlp.experts.{part}") + ".weight", values)
            continue
        if base.endswith("in_proj_qkvz") and not legacy:  # each key head's [q, k, v, z] -> [q..., k..., v...], z
            q, k, v, z = np.split(values.reshape(key_heads, sum(widths), -1), np.cumsum(widths)[:3], axis=1)
            hidden = values.shape[-1]
            add(names.get_name(base).replace("ssm_in", "attn_qkv") + ".weight",
                np.concatenate([part.reshape(-1, hidden) for part in (q, k, v)]))
            add(names.get_name(base).replace("ssm_in", "attn_gate") + ".weight", z.reshape(-1, hidden))
            continue
        if suffix == "A_log":  # (torch's exp, as the converter's: numpy's parts from it by an ulp)
            values, base, suffix = -torch.exp(value.float()).numpy(), f"{base}.A_log", ""
        elif suffix == "dt_bias":
            base, suffix = f"{base}.dt_proj", "bias"
        elif base.endswith("conv1d"):
            values = values.squeeze(1)
        elif base.endswith("norm") and not base.endswith("linear_attn.norm"):
            values = values + 1
        add(names.get_name(base) + (f".{suffix}" if suffix else ""), values)
    hidden, head, inner = config["hidden_size"], config["head_dim"], config["shared_expert_intermediate_size"]
    generator = np.random.default_rng(SEED)
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_tensors = {"nextn.eh_proj.weight": (hidden, 2 * hidden), "nextn.enorm.weight": (hidden,),
                    "nextn.hnorm.weight": (hidden,), "nextn.shared_head_norm.weight": (hidden,),
                    "attn_norm.weight": (hidden,), "post_attention_norm.weight": (hidden,),
                    "attn_q.weight": (2 * heads * head, hidden), "attn_k.weight": (kv_heads * head, hidden),
                    "attn_v.weight": (kv_heads * head, hidden), "attn_output.weight": (hidden, heads * head),
                    "attn_q_norm.weight": (head,), "attn_k_norm.weight": (head,),
                    "ffn_gate_inp.weight": (experts, hidden), "ffn_gate_inp_shexp.weight": (1, hidden)}
    for part in ("gate", "up", "down"):
        head_tensors[f"ffn_{part}_shexp.weight"] = (hidden, inner) if part == "down" else (inner, hidden)
        head_tensors[f"ffn_{part}_exps.weight"] = (experts, *head_tensors[f"ffn_{part}_shexp.weight"])
    for name, shape in head_tensors.items() if mtp else ():
        add(f"blk.{layers}.{name}", generator.normal(0, 0.1, shape))
    return write_out(writer, path)


def write_qwen3next_legacy_gguf(checkpoint: str, path: str, qtype_name: str = "F32") -> str:
    """write_qwen3next_gguf's file as llama.cpp's converter wrote them before it split in_proj_qkvz (ssm_in)."""
    return write_qwen3next_gguf(checkpoint, path, qtype_name, legacy=True)


def lfm2_checkpoint(out_dir: str) -> str:
    """A tiny random LFM2 checkpoint (Lfm2ForCausalLM) in `out_dir`: LFM2-350M's layout 64 wide, three gated short
    convolution layers (a window of 3) and one of attention (4 heads of 16 over 2, q/k norms), tied embeddings, the
    final norm after the layers (embedding_norm); its norms drawn around 1; a byte-level BPE vocabulary."""
    from transformers import Lfm2Config, Lfm2ForCausalLM

    tokenizer = tiny_gpt2_tokenizer(out_dir)
    config = Lfm2Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, norm_eps=1e-5,
                        layer_types=["conv", "conv", "full_attention", "conv"], block_auto_adjust_ff_dim=False,
                        conv_L_cache=3, initializer_range=0.15, tie_word_embeddings=True, pad_token_id=None,
                        bos_token_id=None, eos_token_id=tokenizer.eos_token_id)
    return save_tiny(out_dir, "lfm2", Lfm2ForCausalLM, config, tokenizer, drawn_norms(1))


def write_lfm2_gguf(checkpoint: str, path: str, qtype_name: str = "F32") -> str:
    """The GGUF file llama.cpp's converter (conversion/lfm2.py's LFM2Model) writes of an LFM2 checkpoint: the kv heads
    a layer (0 for a convolution layer), the vocabulary's size, the convolution's window (shortconv.l_cache) and the
    MLP's width as the config gives it (block_auto_adjust_ff_dim off), the convolution squeezed; matrices in Q8_0
    where asked, the convolution and norms F32; a byte-level BPE vocabulary llama.cpp splits as lfm2's."""
    import gguf

    with open(os.path.join(checkpoint, "config.json")) as f:
        config = json.load(f)
    writer = gguf.GGUFWriter(path, "lfm2")
    writer.add_type("model")
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_head_count(config["num_attention_heads"])
    kv_heads = config["num_key_value_heads"]
    writer.add_head_count_kv([0 if kind == "conv" else kv_heads for kind in config["layer_types"]])
    writer.add_rope_freq_base(config["rope_parameters"]["rope_theta"])
    writer.add_file_type({"F32": 0, "Q8_0": 7}[qtype_name])
    writer.add_vocab_size(config["vocab_size"])
    writer.add_shortconv_l_cache(config["conv_L_cache"])
    writer.add_layer_norm_rms_eps(config["norm_eps"])
    writer.add_feed_forward_length(config["intermediate_size"])
    add_bpe_vocabulary(writer, checkpoint, "lfm2")
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    add_tensors(writer, checkpoint, gguf.get_tensor_name_map(gguf.MODEL_ARCH.LFM2, config["num_hidden_layers"]),
                qtype_name, skip=lambda name: name == "lm_head.weight" and config["tie_word_embeddings"],
                reshape=lambda name, values: values.squeeze(1) if "conv.conv" in name else values,
                float_kept=("shortconv.conv",))
    return write_out(writer, path)


def lfm2moe_checkpoint(out_dir: str) -> str:
    """A tiny random LFM2-MoE checkpoint (Lfm2MoeForCausalLM) in `out_dir`: LFM2-8B-A1B's layout 64 wide (lfm2's
    convolutions and attention), a dense first layer (num_dense_layers 1), then 8 experts of 32, 2 a token, by
    sigmoid scores with the expert bias (drawn: a trained one is not 0) added to choose by, normalized; tied
    embeddings; its norms drawn around 1."""
    from transformers import Lfm2MoeConfig, Lfm2MoeForCausalLM

    tokenizer = tiny_gpt2_tokenizer(out_dir)
    config = Lfm2MoeConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                           num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                           max_position_embeddings=512, norm_eps=1e-5, conv_L_cache=3, num_dense_layers=1,
                           num_experts=8, num_experts_per_tok=2, use_expert_bias=True, norm_topk_prob=True,
                           routed_scaling_factor=1.0, layer_types=["conv", "conv", "full_attention", "conv"],
                           initializer_range=0.15, tie_word_embeddings=True, pad_token_id=None, bos_token_id=None,
                           eos_token_id=tokenizer.eos_token_id)

    return save_tiny(out_dir, "lfm2moe", Lfm2MoeForCausalLM, config, tokenizer, drawn_router_bias("expert_bias"))


def write_lfm2moe_gguf(checkpoint: str, path: str, qtype_name: str = "F32") -> str:
    """The GGUF file llama.cpp's converter (conversion/lfm2.py's LFM2MoeModel) writes of an LFM2-MoE checkpoint:
    lfm2's keys and the experts' (count, used, inner width, the dense layers first, sigmoid gating), each layer's
    experts (w1, w3, w2 a tensor each, as published) stacked into 3-D ffn_{gate,up,down}_exps, the expert bias as
    exp_probs_b.bias, the convolution squeezed; matrices in Q8_0 where asked, the router, convolution and norms
    F32; a byte-level BPE vocabulary llama.cpp splits as lfm2's."""
    import gguf

    with open(os.path.join(checkpoint, "config.json")) as f:
        config = json.load(f)
    layers, kv_heads = config["num_hidden_layers"], config["num_key_value_heads"]
    arch = gguf.MODEL_ARCH.LFM2MOE
    writer = gguf.GGUFWriter(path, gguf.MODEL_ARCH_NAMES[arch])
    add_text_shape(writer, {**config, "num_key_value_heads": [0 if kind == "conv" else kv_heads
                                                              for kind in config["layer_types"]]})
    writer.add_rope_freq_base(config["rope_parameters"]["rope_theta"])
    writer.add_layer_norm_rms_eps(config["norm_eps"])
    writer.add_expert_count(config["num_experts"])
    writer.add_expert_used_count(config["num_experts_per_tok"])
    writer.add_file_type({"F32": 0, "Q8_0": 7}[qtype_name])
    writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    writer.add_leading_dense_block_count(config["num_dense_layers"])
    writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    writer.add_vocab_size(config["vocab_size"])
    writer.add_shortconv_l_cache(config["conv_L_cache"])
    add_bpe_vocabulary(writer, checkpoint, "lfm2")
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    names = gguf.get_tensor_name_map(arch, layers)
    add = converter_adder(writer, qtype_name)

    def special(hf_name, values):
        base = hf_name.rpartition(".")[0]
        if hf_name == "lm_head.weight":
            return config["tie_word_embeddings"]  # (tied: not written)
        if "conv.conv" in hf_name:  # (squeezed, F32)
            writer.add_tensor(names.get_name(base) + ".weight", values.squeeze(1))
            return True
        if hf_name.endswith("expert_bias"):
            add(names.get_name(hf_name) + ".bias", values)
            return True
        if ".feed_forward.experts." in hf_name:  # w1/w3/w2 of every expert, stacked
            layer, _, rest = hf_name.partition(".feed_forward.experts.")
            if rest.startswith("0."):
                part = rest.split(".")[1]
                stacked = [load_tensor(f"{layer}.feed_forward.experts.{index}.{part}.weight")
                           for index in range(config["num_experts"])]
                merged = layer.removeprefix("model.")  # (the converter's name of the merged tensor)
                add(names.get_name(f"{merged}.feed_forward.experts.{part}") + ".weight", np.stack(stacked))
            return True
        return False

    import numpy as np
    from safetensors.torch import load_file

    state = load_file(os.path.join(checkpoint, "model.safetensors"))

    def load_tensor(name):
        return state[name].float().numpy()

    add_mixture_tensors(add, checkpoint, names, config["num_experts"], special)
    return write_out(writer, path)


def granitehybrid_checkpoint(out_dir: str, experts: bool = True) -> str:
    """A tiny random Granite 4.0 H checkpoint (GraniteMoeHybridForCausalLM) in `out_dir`: granite-4.0-h-tiny's layout
    64 wide, three Mamba-2 layers (8 heads of 16, a state of 16, one group, a window of 4) and one of attention (4
    heads over 2) without rotary, each MLP 8 experts of 32, 2 a token (the softmax of their logits), beside a shared
    one of 64; Granite's multipliers (the embedding's 12, each residual branch's 0.22, the scores' 1 / 16, the logits
    divided by 8); tied embeddings. Without `experts`: granite-4.0-h-micro's dense MLP (the shared one alone, as
    wide as its intermediate_size: llama.cpp reads that width). Its norms, D, dt_bias, A_log and the convolution's
    bias drawn (a trained model's are not the initializer's constants); the layer types under the published
    config's names (mamba, attention), which llama.cpp's converter reads."""
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

    tokenizer = tiny_gpt2_tokenizer(out_dir)

    config = GraniteMoeHybridConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=32 if experts else 64,
        shared_intermediate_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        layer_types=["mamba", "mamba", "attention", "mamba"], mamba_n_heads=8, mamba_n_groups=1, mamba_d_state=16,
        mamba_d_head=16, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=16,
        num_local_experts=8 if experts else 0, num_experts_per_tok=2, embedding_multiplier=12.0,
        residual_multiplier=0.22, attention_multiplier=1 / 16, logits_scaling=8.0,
        position_embedding_type=None, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        max_position_embeddings=512, rms_norm_eps=1e-5, initializer_range=0.15, tie_word_embeddings=True,
        pad_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id)
    path = save_tiny(out_dir, "granitehybrid" if experts else "granitehybrid_dense", GraniteMoeHybridForCausalLM,
                     config, tokenizer, drawn_mamba2)
    with open(os.path.join(path, "config.json")) as f:
        saved = json.load(f)
    saved["layer_types"] = ["attention" if kind == "full_attention" else "mamba" for kind in saved["layer_types"]]
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(saved, f, indent=2)
    return path


def granitehybrid_dense_checkpoint(out_dir: str) -> str:
    """granitehybrid_checkpoint's dense MLP (granite-4.0-h-micro's)."""
    return granitehybrid_checkpoint(out_dir, experts=False)


def llama_permuted(w, n_head):
    """llama.cpp's LlamaModel.permute of q's or k's rows: each head's two halves interleaved, for its rotary."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def stacked_experts(state: dict, hf_name: str, experts: int, block: str = "mlp"):
    """(the layer's prefix, the part, its experts' weights stacked [experts, rows, columns]) where `hf_name` is the
    first expert's weight of a part in a checkpoint of one tensor an expert (`state`: its tensors), as llama.cpp's
    converter stacks them; None for another expert's."""
    import numpy as np

    layer, _, rest = hf_name.partition(f".{block}.experts.")
    if not rest.startswith("0."):
        return None
    part = rest.split(".")[1]
    return layer, part, np.stack([state[f"{layer}.{block}.experts.{expert}.{part}.weight"].float().numpy()
                                  for expert in range(experts)])


def mamba2_adder(writer, qtype_name: str):
    """converter_adder's add for a Mamba-2 hybrid: the convolution, A, D and the gated norm F32 whatever the type, as
    llama.cpp's converter keeps them."""
    import numpy as np

    quantized = converter_adder(writer, qtype_name)

    def add(name, values):
        if {"ssm_conv1d", "ssm_a", "ssm_d", "ssm_norm"} & set(name.split(".")):
            writer.add_tensor(name, np.ascontiguousarray(values, dtype=np.float32))
        else:
            quantized(name, values)

    return add


def mamba2_tensor(add, names, hf_name: str, value, blk: str | None, groups: int, heads: int, kv_heads: int) -> None:
    """A Mamba-2 hybrid's tensor `hf_name` by `add` as llama.cpp's converter writes it (Mamba2Model's and LlamaModel's
    changes): A_log as -exp(A_log) and D a column each, dt_bias as ssm_dt.bias, the convolution squeezed, the gated
    norm a row a group, q and k permuted as llama's; under gguf's name table `names` (`blk`: the layer's prefix)."""
    values = value.float().numpy()
    base, _, suffix = hf_name.rpartition(".")
    if suffix in ("A_log", "D", "dt_bias"):
        name, values = {"A_log": ("ssm_a", -torch.exp(value.float()).numpy()[:, None]),
                        "D": ("ssm_d", values[:, None]), "dt_bias": ("ssm_dt.bias", values)}[suffix]
        add(f"{blk}.{name}", values)
        return
    if base.endswith("conv1d") and suffix == "weight":
        values = values.squeeze(1)
    elif base.endswith(("mamba.norm", "mixer.norm")):
        values = values.reshape(groups, -1)
    elif base.endswith("q_proj"):
        values = llama_permuted(values, heads)
    elif base.endswith("k_proj"):
        values = llama_permuted(values, kv_heads)
    add(names.get_name(base) + "." + suffix, values)


# Granite 4.0's chat template, its turns' markup (the published one adds a default system turn and tools' blocks).
GRANITE4_TEMPLATE = ("{% for message in messages %}<|start_of_role|>{{ message['role'] }}<|end_of_role|>"
                     "{{ message['content'] }}<|end_of_text|>\n{% endfor %}"
                     "{% if add_generation_prompt %}<|start_of_role|>assistant<|end_of_role|>{% endif %}")


def write_granitehybrid_gguf(checkpoint: str, path: str, qtype_name: str = "F32", rotates: bool = False,
                             chat: bool = False) -> str:
    """The GGUF file llama.cpp's converter (conversion/granite.py's GraniteHybridModel) writes of a Granite 4.0 H
    checkpoint: llama's keys with the kv heads a layer (0 for a Mamba-2 layer), Granite's multipliers as
    attention.scale, embedding_scale, residual_scale and logit_scale, the ssm.* keys, the attention without rotary
    (rope.scaling.finetuned false, the context 2^20, as it writes every hybrid Granite), the experts' and the shared
    MLP's widths (`rotates`: the attention rotating, rope.scaling.finetuned true, as it writes Bamba's files; `chat`:
    Granite 4.0's chat template's turns as tokenizer.chat_template); q and k
    permuted as llama's, A_log as -exp(A_log) and D a column each, the convolution squeezed, the gated norm a row a
    group, dt_bias as ssm_dt.bias; each layer's experts (input_linear: gate and up rows) split into ffn_gate_exps and
    ffn_up_exps, output_linear as ffn_down_exps, the shared MLP's input_linear split into ffn_gate_shexp and
    ffn_up_shexp (a dense model's into ffn_gate and ffn_up); matrices in Q8_0 where asked, the router, convolution,
    A, D and norms F32; a byte-level BPE vocabulary (tokenizer.ggml.pre dbrx)."""
    import gguf
    import numpy as np
    from safetensors.torch import load_file

    with open(os.path.join(checkpoint, "config.json")) as f:
        config = json.load(f)
    layers, heads, kv_heads = config["num_hidden_layers"], config["num_attention_heads"], config["num_key_value_heads"]
    attention = [kind == "attention" for kind in config["layer_types"]]
    experts = config["num_local_experts"]
    arch = gguf.MODEL_ARCH.GRANITE_HYBRID
    architecture = gguf.MODEL_ARCH_NAMES[arch]
    writer = gguf.GGUFWriter(path, architecture)
    add_text_shape(writer, {**config, "num_key_value_heads": [kv_heads if kind else 0 for kind in attention],
                            "max_position_embeddings": 2 ** 20})
    writer.add_rope_freq_base(config["rope_parameters"]["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_expert_count(experts)
    writer.add_expert_used_count(config["num_experts_per_tok"])
    writer.add_file_type({"F32": 0, "Q8_0": 7}[qtype_name])
    writer.add_vocab_size(config["vocab_size"])
    writer.add_rope_dimension_count(config["hidden_size"] // heads)
    for key, field in (("attention.scale", "attention_multiplier"), ("embedding_scale", "embedding_multiplier"),
                       ("residual_scale", "residual_multiplier"), ("logit_scale", "logits_scaling")):
        writer.add_float32(f"{architecture}.{key}", config[field])
    writer.add_expert_shared_feed_forward_length(config["shared_intermediate_size"])
    inner = config["mamba_expand"] * config["hidden_size"]
    writer.add_ssm_conv_kernel(config["mamba_d_conv"])
    writer.add_ssm_state_size(config["mamba_d_state"])
    writer.add_ssm_group_count(config["mamba_n_groups"])
    writer.add_ssm_inner_size(inner)
    writer.add_ssm_time_step_rank(config["mamba_n_heads"])
    writer.add_rope_scaling_finetuned(rotates)
    add_bpe_vocabulary(writer, checkpoint, "dbrx")
    if chat:
        writer.add_chat_template(GRANITE4_TEMPLATE)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    names = gguf.get_tensor_name_map(arch, layers)
    add = mamba2_adder(writer, qtype_name)

    for hf_name, value in load_file(os.path.join(checkpoint, "model.safetensors")).items():
        if hf_name == "lm_head.weight" and config["tie_word_embeddings"]:
            continue
        values = value.float().numpy()
        base, _, suffix = hf_name.rpartition(".")
        layer = base.split(".")[2] if base.startswith("model.layers.") else None
        blk = f"blk.{layer}"
        if base.endswith("input_linear"):  # gate rows, then up rows
            gate, up = np.split(values, 2, axis=-2)
            part = "exps" if "block_sparse_moe" in base else "shexp" if experts else None
            add(f"{blk}.ffn_gate{'_' + part if part else ''}.weight", gate)
            add(f"{blk}.ffn_up{'_' + part if part else ''}.weight", up)
            continue
        if base.endswith("output_linear"):
            part = "exps" if "block_sparse_moe" in base else "shexp" if experts else None
            add(f"{blk}.ffn_down{'_' + part if part else ''}.weight", values)
            continue
        if base.endswith("router.layer"):
            add(f"{blk}.ffn_gate_inp.weight", values)
            continue
        mamba2_tensor(add, names, hf_name, value, blk, config["mamba_n_groups"], heads, kv_heads)
    return write_out(writer, path)


def falcon_h1_checkpoint(out_dir: str, norm: bool = False) -> str:
    """A tiny random Falcon-H1 checkpoint (FalconH1ForCausalLM) in `out_dir`: Falcon-H1-0.5B's layout 64 wide, three
    layers, each its attention (4 heads of 32 over 2: wider than the hidden size, as the published 8 of 64 over 1024)
    and its Mamba-2 mixer (6 heads of 16, 1.5 times the hidden size as published, a state of 16, one group, a window
    of 4, the convolution's bias) side by side behind one norm, then an MLP of 96; Falcon-H1-0.5B's multipliers (its
    embedding's, the head's, the keys', the attention's output, the mixer's input and output, the MLP's gate and down,
    the mixer's projections' five parts); rotary base 1e11; untied. With `norm`: the mixer's gated norm over two
    groups (mamba_rms_norm), which the 0.5B has not. Its norms, D, dt_bias, A_log and the convolution's bias drawn; a
    byte-level BPE vocabulary."""
    from transformers import FalconH1Config, FalconH1ForCausalLM

    tokenizer = tiny_gpt2_tokenizer(out_dir)
    config = FalconH1Config(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, mamba_d_ssm=96, mamba_n_heads=6, mamba_d_head=16,
        mamba_n_groups=2 if norm else 1, mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=16,
        mamba_conv_bias=True, mamba_proj_bias=False, mamba_norm_before_gate=False, mamba_rms_norm=norm,
        projectors_bias=False, attention_bias=False, mlp_bias=False, max_position_embeddings=512, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 1e11}, tie_word_embeddings=False,
        lm_head_multiplier=0.0390625, embedding_multiplier=5.656854249492381, key_multiplier=0.390625,
        attention_out_multiplier=0.9375, attention_in_multiplier=1.0, ssm_in_multiplier=1.25,
        ssm_out_multiplier=0.23570226039551587, mlp_multipliers=[0.8838834764831844, 0.5859375],
        ssm_multipliers=[0.3535533905932738, 0.25, 0.3535533905932738, 0.5, 0.3535533905932738],
        initializer_range=0.15, pad_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id)
    def draw(name, tensor):  # (and the head as wide as the small multiplier after it wants, as muP trains it)
        if name == "lm_head.weight":
            tensor.normal_(0, 3)
        drawn_mamba2(name, tensor)

    return save_tiny(out_dir, "falcon_h1_norm" if norm else "falcon_h1", FalconH1ForCausalLM, config, tokenizer, draw)


def falcon_h1_norm_checkpoint(out_dir: str) -> str:
    """falcon_h1_checkpoint's with the mixer's gated norm over two groups."""
    return falcon_h1_checkpoint(out_dir, norm=True)


def falcon_h1_folded(name: str, values, config: dict):
    """Falcon-H1's tensor `name` (numpy) with the multipliers llama.cpp's converter (conversion/falcon_h1.py)
    multiplies into it: the MLP's gate and down, q, k and v by the attention's input (k by the keys' too), o_proj
    by the attention's output, the mixer's out_proj by its output and in_proj by its input and each of its five
    parts' (z, x, B, C, dt), the head's, the embedding's."""
    inner, states = config["mamba_d_ssm"], config["mamba_n_groups"] * config["mamba_d_state"]
    if "down_proj" in name:
        return values * config["mlp_multipliers"][1]
    if "gate_proj" in name:
        return values * config["mlp_multipliers"][0]
    if "k_proj" in name:
        return values * config["key_multiplier"] * config["attention_in_multiplier"]
    if "q_proj" in name or "v_proj" in name:
        return values * config["attention_in_multiplier"]
    if "o_proj" in name:
        return values * config["attention_out_multiplier"]
    if "out_proj" in name:
        return values * config["ssm_out_multiplier"]
    if "in_proj" in name:
        values = values * config["ssm_in_multiplier"]
        bounds = [0, inner, 2 * inner, 2 * inner + states, 2 * inner + 2 * states, values.shape[0]]
        for part, multiplier in enumerate(config["ssm_multipliers"]):
            values[bounds[part]:bounds[part + 1]] *= multiplier
        return values
    if "lm_head" in name:
        return values * config["lm_head_multiplier"]
    if "embed_tokens" in name:
        return values * config["embedding_multiplier"]
    return values


def write_falcon_h1_gguf(checkpoint: str, path: str, qtype_name: str = "F32", fork: bool = False) -> str:
    """The GGUF file llama.cpp's converter (conversion/falcon_h1.py's FalconH1Model, a Mamba2Model) writes of a
    Falcon-H1 checkpoint: Mamba-2's keys (ssm.*) then Falcon-H1's (the vocabulary's size, the context, the MLP's width,
    the heads and the head size, the rotary's base), its multipliers multiplied into the weights (falcon_h1_folded)
    and none in a key; A_log as -exp(A_log) and D a column each, the convolution squeezed, the gated norm a row a
    group, dt_bias as ssm_dt.bias, q and k as the checkpoint holds them (Falcon-H1's rotary turns halves), the MLP's
    norm named blk.N.ffn_norm (no .weight: gguf's table maps pre_ff_layernorm's whole name); matrices in Q8_0 where
    asked, the convolution, A, D and norms F32; a byte-level BPE vocabulary (tokenizer.ggml.pre falcon-h1). `fork`:
    as TII's llama.cpp fork wrote Falcon-H1's files before that converter, the weights as trained and their
    multipliers in keys (falcon-h1.mlp_gate_multiplier, ..., falcon-h1.ssm.has_mup)."""
    import gguf
    from safetensors.torch import load_file

    with open(os.path.join(checkpoint, "config.json")) as f:
        config = json.load(f)
    layers, heads, kv_heads = config["num_hidden_layers"], config["num_attention_heads"], config["num_key_value_heads"]
    arch = gguf.MODEL_ARCH.FALCON_H1
    writer = gguf.GGUFWriter(path, gguf.MODEL_ARCH_NAMES[arch])
    writer.add_type("model")
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_block_count(layers)
    writer.add_ssm_conv_kernel(config["mamba_d_conv"])
    writer.add_ssm_inner_size(config["mamba_d_ssm"])
    writer.add_ssm_state_size(config["mamba_d_state"])
    writer.add_ssm_time_step_rank(config["mamba_d_ssm"] // config["mamba_d_head"])
    writer.add_ssm_group_count(config["mamba_n_groups"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_file_type({"F32": 0, "Q8_0": 7}[qtype_name])
    writer.add_vocab_size(config["vocab_size"])
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(config["head_dim"])
    writer.add_value_length(config["head_dim"])
    writer.add_rope_freq_base(config["rope_parameters"]["rope_theta"])
    if fork:
        for key, value in (("mlp_gate_multiplier", config["mlp_multipliers"][0]),
                           ("mlp_down_multiplier", config["mlp_multipliers"][1]),
                           ("key_multiplier", config["key_multiplier"]),
                           ("lm_head_multiplier", config["lm_head_multiplier"])):
            writer.add_float32(f"falcon-h1.{key}", value)
        writer.add_bool("falcon-h1.ssm.has_mup", True)
    add_bpe_vocabulary(writer, checkpoint, "falcon-h1")
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    names = gguf.get_tensor_name_map(arch, layers)
    add = mamba2_adder(writer, qtype_name)

    for hf_name, value in load_file(os.path.join(checkpoint, "model.safetensors")).items():
        if not fork:
            value = torch.from_numpy(falcon_h1_folded(hf_name, value.float().numpy(), config))
        blk = f"blk.{hf_name.split('.')[2]}" if hf_name.startswith("model.layers.") else None
        if hf_name.endswith(("q_proj.weight", "k_proj.weight")):  # (not permuted)
            add(names.get_name(hf_name.rpartition(".")[0]) + ".weight", value.numpy())
            continue
        if hf_name.endswith("pre_ff_layernorm.weight"):  # (gguf's table maps the whole name: no .weight)
            add(f"{blk}.ffn_norm", value.numpy())
            continue
        mamba2_tensor(add, names, hf_name, value, blk, config["mamba_n_groups"], heads, kv_heads)
    return write_out(writer, path)


def olmoe_checkpoint(out_dir: str) -> str:
    """A tiny random OLMoE checkpoint (OlmoeForCausalLM: AI2's OLMoE-1B-7B) in `out_dir`: its layout 64 wide, 2 layers
    of 4 heads (kv heads as many), q and k each normalized over all their heads, every MLP a mixture of 8 experts of
    32, 2 a token (the top 2 of the softmax, not normalized, as published); untied. Its norms drawn; a byte-level BPE
    vocabulary."""
    from transformers import OlmoeConfig, OlmoeForCausalLM

    tokenizer = tiny_gpt2_tokenizer(out_dir)
    config = OlmoeConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=512, rms_norm_eps=1e-5, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=False, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, initializer_range=0.15,
        tie_word_embeddings=False, pad_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id)
    return save_tiny(out_dir, "olmoe", OlmoeForCausalLM, config, tokenizer, drawn_norms(1))


def write_olmoe_gguf(checkpoint: str, path: str, qtype_name: str = "F32") -> str:
    """The GGUF file llama.cpp's converter (conversion/olmo.py's OlmoeModel, a TextModel) writes of an OLMoE
    checkpoint: a text model's keys, the experts' count and those a token takes (feed_forward_length their width), q
    and k as the checkpoint holds them, q's and k's norms, each layer's experts stacked; matrices in Q8_0 where asked,
    the router and norms F32; a byte-level BPE vocabulary (tokenizer.ggml.pre olmo)."""
    import gguf

    with open(os.path.join(checkpoint, "config.json")) as f:
        config = json.load(f)
    layers, experts = config["num_hidden_layers"], config["num_experts"]
    arch = gguf.MODEL_ARCH.OLMOE
    writer = gguf.GGUFWriter(path, gguf.MODEL_ARCH_NAMES[arch])
    add_text_keys(writer, config, qtype_name, (experts, config["num_experts_per_tok"]))
    add_bpe_vocabulary(writer, checkpoint, "olmo")
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    add_mixture_tensors(converter_adder(writer, qtype_name), checkpoint, gguf.get_tensor_name_map(arch, layers),
                        experts)
    return write_out(writer, path)


def llama4_checkpoint(out_dir: str) -> str:
    """A tiny random Llama 4 checkpoint (Llama4ForCausalLM: Llama-4-Scout's and Maverick's text model) in `out_dir`:
    64 wide, 4 layers of 4 heads of 32 over 2, every fourth layer without rotary (full attention, its queries'
    temperature tuning), the others' rotary llama3-scaled as Scout's (factor 16, low and high frequency factors 1,
    original context 8192: a step, no ramp) and their q and k L2-normalized after it; Maverick's interleave (a dense
    MLP of 128, then a mixture: 4 experts of 32, 1 a token, its input scaled by the sigmoid of its logit, beside a
    shared expert); Scout's context (10M positions), chunks of 8192; untied. Its norms drawn; a byte-level BPE
    vocabulary."""
    from transformers import Llama4ForCausalLM, Llama4TextConfig

    tokenizer = tiny_gpt2_tokenizer(out_dir)
    config = Llama4TextConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=32, intermediate_size_mlp=128,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        max_position_embeddings=10485760, rms_norm_eps=1e-5, num_local_experts=4, num_experts_per_tok=1,
        interleave_moe_layer_step=2, use_qk_norm=True, attention_chunk_size=8192, initializer_range=0.15,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 16.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 1.0, "original_max_position_embeddings": 8192},
        tie_word_embeddings=False, pad_token_id=None, eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id)
    return save_tiny(out_dir, "llama4", Llama4ForCausalLM, config, tokenizer, drawn_norms(1))


def write_llama4_gguf(checkpoint: str, path: str, qtype_name: str = "F32", window: int | None = None) -> str:
    """The GGUF file llama.cpp's converter (conversion/llama.py's Llama4Model, a LlamaModel that permutes nothing)
    writes of a Llama 4 checkpoint's text model: llama's keys with the dense MLP's width as feed_forward_length and
    the experts' as expert_feed_forward_length, the interleave, q and k as the checkpoint holds them (its rotary turns
    pairs, as llama.cpp's does), the llama3 rotary as rope_freqs; each mixture's gate_up_proj [experts, hidden, gate;
    up] split and transposed into ffn_gate_exps and ffn_up_exps, its down_proj transposed; matrices in Q8_0 where
    asked, the router and norms F32; a byte-level BPE vocabulary (tokenizer.ggml.pre llama4). `window`: the
    attention.sliding_window the converter writes (0) where the config's layers are all full (MobileLLM-R1's)."""
    import gguf
    import numpy as np
    from safetensors.torch import load_file

    with open(os.path.join(checkpoint, "config.json")) as f:
        config = json.load(f)
    rope, layers = config["rope_parameters"], config["num_hidden_layers"]
    arch = gguf.MODEL_ARCH.LLAMA4
    writer = gguf.GGUFWriter(path, gguf.MODEL_ARCH_NAMES[arch])
    add_text_keys(writer, {**config, "intermediate_size": config["intermediate_size_mlp"]}, qtype_name,
                  (config["num_local_experts"], config["num_experts_per_tok"]), head_dim=True)
    writer.add_vocab_size(config["vocab_size"])
    writer.add_rope_dimension_count(config["head_dim"])
    writer.add_interleave_moe_layer_step(config["interleave_moe_layer_step"])
    writer.add_expert_feed_forward_length(config["intermediate_size"])
    if window is not None:
        writer.add_sliding_window(window)
    add_bpe_vocabulary(writer, checkpoint, "llama4")
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    add, names = converter_adder(writer, qtype_name), gguf.get_tensor_name_map(arch, layers)
    add("rope_freqs.weight", llama3_factors(rope, config["head_dim"]))
    for hf_name, tensor in load_file(os.path.join(checkpoint, "model.safetensors")).items():
        values = tensor.float().numpy()
        if hf_name.endswith(".experts.gate_up_proj"):  # [experts, hidden, gate; up]
            prefix = names.get_name(hf_name.replace("gate_up_proj", "gate_proj")).replace("_gate_exps", "")
            gate, up = np.split(values.transpose(0, 2, 1), 2, axis=1)
            add(f"{prefix}_gate_exps.weight", gate)
            add(f"{prefix}_up_exps.weight", up)
        elif hf_name.endswith(".experts.down_proj"):  # [experts, inner, hidden]
            add(names.get_name(hf_name) + ".weight", values.transpose(0, 2, 1))
        else:
            base, _, suffix = hf_name.rpartition(".")
            add(names.get_name(base) + "." + suffix, values)
    return write_out(writer, path)


def minimax_m2_checkpoint(out_dir: str) -> str:
    """A tiny random MiniMax-M2 checkpoint (MiniMaxM2ForCausalLM: MiniMax-M2, M2.1, M2.5) in `out_dir`: 64 wide, 2
    layers of 4 heads of 32 over 2, q and k each normalized over all their heads, half of each head rotated (its
    rotary_dim 16: the published 64 of 128, scaled), every MLP 8 experts of 32, 2 a token (the sigmoid of their
    logits, chosen by those plus a correction, normalized: its config's scoring_func sigmoid, as published); untied.
    Its norms and correction drawn; a byte-level BPE vocabulary."""
    from transformers import MiniMaxM2Config, MiniMaxM2ForCausalLM

    tokenizer = tiny_gpt2_tokenizer(out_dir)
    config = MiniMaxM2Config(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, rotary_dim=16, max_position_embeddings=512, num_local_experts=8,
        num_experts_per_tok=2, initializer_range=0.15, tie_word_embeddings=False,
        eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id, scoring_func="sigmoid")

    return save_tiny(out_dir, "minimax_m2", MiniMaxM2ForCausalLM, config, tokenizer,
                     drawn_router_bias("e_score_correction_bias"))


def write_minimax_m2_gguf(checkpoint: str, path: str, qtype_name: str = "F32") -> str:
    """The GGUF file llama.cpp's converter (conversion/minimax.py's MiniMaxM2Model, a TextModel) writes of a
    MiniMax-M2 checkpoint: a text model's keys with the head size, the experts' width and the rotated part of a head
    (rotary_dim as rope.dimension_count), the router's gating function (its config's scoring_func), q and k as the
    checkpoint holds them with their norms over all heads, each layer's experts (w1, w3, w2: gate, up, down)
    stacked, the router's correction as exp_probs_b.bias; matrices in Q8_0 where asked, the router, correction and
    norms F32; a byte-level BPE vocabulary (tokenizer.ggml.pre minimax-m2)."""
    import gguf
    import numpy as np
    from safetensors.torch import load_file

    with open(os.path.join(checkpoint, "config.json")) as f:
        config = json.load(f)
    layers, experts = config["num_hidden_layers"], config["num_local_experts"]
    arch = gguf.MODEL_ARCH.MINIMAXM2
    writer = gguf.GGUFWriter(path, gguf.MODEL_ARCH_NAMES[arch])
    add_text_keys(writer, config, qtype_name, (experts, config["num_experts_per_tok"]), head_dim=True)
    writer.add_expert_feed_forward_length(config["intermediate_size"])
    writer.add_rope_dimension_count(int(config["head_dim"] * config["rope_parameters"]["partial_rotary_factor"]))
    writer.add_expert_gating_func({"sigmoid": gguf.ExpertGatingFuncType.SIGMOID,
                                   "softmax": gguf.ExpertGatingFuncType.SOFTMAX}[config["scoring_func"]])
    add_bpe_vocabulary(writer, checkpoint, "minimax-m2")
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    add, names = converter_adder(writer, qtype_name), gguf.get_tensor_name_map(arch, layers)
    state = load_file(os.path.join(checkpoint, "model.safetensors"))
    for hf_name, tensor in state.items():
        base, _, suffix = hf_name.rpartition(".")
        layer, _, rest = hf_name.partition(".block_sparse_moe.experts.")
        if rest:
            if rest.startswith("0."):  # (the first expert's: the part stacked over all)
                part = rest.split(".")[1]
                add(names.get_name(f"{layer}.block_sparse_moe.experts.{part}") + ".weight",
                    np.stack([state[f"{layer}.block_sparse_moe.experts.{expert}.{part}.weight"].float().numpy()
                              for expert in range(experts)]))
        elif suffix == "e_score_correction_bias":  # (the converter's e_score_correction.bias)
            add(names.get_name(f"{base}.e_score_correction") + ".bias", tensor.float().numpy())
        else:
            add(names.get_name(base) + "." + suffix, tensor.float().numpy())
    return write_out(writer, path)


def hy_v3_checkpoint(out_dir: str) -> str:
    """A tiny random HY V3 checkpoint (HYV3ForCausalLM: Tencent's Hy3) in `out_dir`: 64 wide, 3 layers of 4 heads of
    32 over 2, q and k normalized per head, a dense first layer (128), then mixtures of 8 experts of 32, 2 a token
    (sigmoid scores, chosen by those plus a correction, normalized and scaled by 2.826) beside a shared expert of 32;
    untied. Its norms and correction drawn; a byte-level BPE vocabulary."""
    from transformers import HYV3Config, HYV3ForCausalLM

    tokenizer = tiny_gpt2_tokenizer(out_dir)
    config = HYV3Config(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=8,
        num_experts_per_tok=2, num_shared_experts=1, max_position_embeddings=512, initializer_range=0.15,
        tie_word_embeddings=False, eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id)

    return save_tiny(out_dir, "hy_v3", HYV3ForCausalLM, config, tokenizer,
                     drawn_router_bias("e_score_correction_bias"))


def write_hy_v3_gguf(checkpoint: str, path: str, qtype_name: str = "F32") -> str:
    """The GGUF file llama.cpp's converter (conversion/hunyuan.py's HYV3Model, a TextModel) writes of an HY V3
    checkpoint: a text model's keys with the head size, the experts' and the shared experts' widths, the weights'
    normalization and scale (router_scaling_factor), a sigmoid gating function; q and k as the checkpoint holds
    them with their per-head norms, the dense layers' MLP, each mixture's experts stacked, its router (router.gate),
    correction (expert_bias: exp_probs_b, no .bias) and shared experts (shared_mlp) as the converter names them;
    matrices in Q8_0 where asked, the router, correction and norms F32; a byte-level BPE
    vocabulary split as Hunyuan's dense models' (tokenizer.ggml.pre hunyuan-dense)."""
    import gguf

    with open(os.path.join(checkpoint, "config.json")) as f:
        config = json.load(f)
    layers, experts = config["num_hidden_layers"], config["num_experts"]
    # (the installed gguf package names no hy_v3 architecture: its tensors named as GLM-4.5's, the same names)
    writer = gguf.GGUFWriter(path, "hy_v3")
    add_text_keys(writer, config, qtype_name, (experts, config["num_experts_per_tok"]), head_dim=True)
    writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    writer.add_expert_shared_feed_forward_length(config["moe_intermediate_size"] * config["num_shared_experts"])
    writer.add_expert_weights_norm(True)
    writer.add_expert_weights_scale(config["router_scaling_factor"])
    writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    add_bpe_vocabulary(writer, checkpoint, "hunyuan-dense")
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    add = converter_adder(writer, qtype_name)

    def published(hf_name, values):  # (Hy3's own names of its router, correction and shared experts)
        layer = hf_name.split(".")[2] if hf_name.startswith("model.layers.") else None
        if hf_name.endswith(".mlp.router.gate.weight"):
            add(f"blk.{layer}.ffn_gate_inp.weight", values)
        elif hf_name.endswith(".mlp.expert_bias"):  # (named without .bias, as the converter names it)
            add(f"blk.{layer}.exp_probs_b", values)
        elif ".mlp.shared_mlp." in hf_name:
            add(f"blk.{layer}.ffn_{hf_name.split('.')[-2].removesuffix('_proj')}_shexp.weight", values)
        elif hf_name.endswith(".post_attention_layernorm.weight"):  # (GLM-4.5's table names it otherwise)
            add(f"blk.{layer}.ffn_norm.weight", values)
        else:
            return False
        return True

    add_mixture_tensors(add, checkpoint, gguf.get_tensor_name_map(gguf.MODEL_ARCH.GLM4_MOE, layers), experts,
                        published)
    return write_out(writer, path)


def dots1_checkpoint(out_dir: str) -> str:
    """A tiny random dots.llm1 checkpoint (Dots1ForCausalLM) in `out_dir`: Qwen3's attention (64 wide, 4 heads of 32
    over 2, wider than the width over the heads as the published 4608 and 32 of 128 are, q and k normalized per
    head), a dense first layer (256), then DeepSeek-V3's mixture: 8 experts of 32, 2 a
    token (sigmoid scores chosen with a correction, one group, normalized, scaled by 2.5), beside a shared expert; its
    config's scoring_func sigmoid, as its converter reads it; untied. Its norms and correction drawn; a byte-level BPE
    vocabulary."""
    from transformers import Dots1Config, Dots1ForCausalLM

    tokenizer = tiny_gpt2_tokenizer(out_dir)
    config = Dots1Config(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=256, moe_intermediate_size=32, head_dim=32,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, n_routed_experts=8, num_experts_per_tok=2,
        n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1, norm_topk_prob=True,
        routed_scaling_factor=2.5, max_position_embeddings=512, initializer_range=0.15, tie_word_embeddings=False,
        eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id)
    config.scoring_func = "sigmoid"  # (the published config's key, which the converter reads)

    return save_tiny(out_dir, "dots1", Dots1ForCausalLM, config, tokenizer,
                     drawn_router_bias("e_score_correction_bias"))


def write_dots1_gguf(checkpoint: str, path: str, qtype_name: str = "F32") -> str:
    """The GGUF file llama.cpp's converter (conversion/dots1.py's Dots1Model, a Qwen2MoeModel) writes of a dots.llm1
    checkpoint: a text model's keys, the experts' width, the dense layers before the mixtures, the shared experts'
    count, the weights' scale and normalization, the groups, a sigmoid gating function, the head size (its config's
    head_dim, as TextModel writes one); q and k as the checkpoint
    holds them with their per-head norms, each layer's experts stacked, the router's correction as exp_probs_b.bias;
    matrices in Q8_0 where asked, the router, correction and norms F32; a byte-level BPE vocabulary (pre qwen2)."""
    import gguf

    with open(os.path.join(checkpoint, "config.json")) as f:
        config = json.load(f)
    layers, experts = config["num_hidden_layers"], config["n_routed_experts"]
    arch = gguf.MODEL_ARCH.DOTS1
    writer = gguf.GGUFWriter(path, gguf.MODEL_ARCH_NAMES[arch])
    add_text_keys(writer, config, qtype_name, (experts, config["num_experts_per_tok"]), head_dim="head_dim" in config)
    writer.add_expert_group_count(config["n_group"])
    writer.add_expert_group_used_count(config["topk_group"])
    writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    writer.add_leading_dense_block_count(config["first_k_dense_replace"])
    writer.add_expert_shared_count(config["n_shared_experts"])
    writer.add_expert_weights_scale(config["routed_scaling_factor"])
    writer.add_expert_weights_norm(config["norm_topk_prob"])
    add_bpe_vocabulary(writer, checkpoint, "qwen2")
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    add_mixture_tensors(converter_adder(writer, qtype_name), checkpoint, gguf.get_tensor_name_map(arch, layers),
                        experts)
    return write_out(writer, path)


def afmoe_checkpoint(out_dir: str) -> str:
    """A tiny random AFMoE checkpoint (AfmoeForCausalLM: Arcee's Trinity models) in `out_dir`: Trinity-Mini's layout 64
    wide, 4 layers (three sliding over a window of 4 with rotary, the fourth full without), 4 heads of 32 over 2 (wider
    than the hidden size, as published), each attention's output gated and its q and k normalized per head; a dense
    first layer (an MLP of 128), then mixtures of 8 experts of 32, 2 a token (sigmoid scores with the expert bias to
    choose them, normalized, times 2.5) beside one shared expert; muP's embedding scale; the published config's
    route_norm; untied. Its norms and the expert bias drawn; a byte-level BPE vocabulary."""
    from transformers import AfmoeConfig, AfmoeForCausalLM

    tokenizer = tiny_gpt2_tokenizer(out_dir)
    config = AfmoeConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=4, num_dense_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        max_position_embeddings=512, rms_norm_eps=1e-5, num_experts=8, num_experts_per_tok=2, num_shared_experts=1,
        route_scale=2.5, global_attn_every_n_layers=4, sliding_window=4, mup_enabled=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, initializer_range=0.15,
        tie_word_embeddings=False, pad_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id)
    config.route_norm = True  # (the published configs': llama.cpp's converter writes it, AfmoeConfig has no field)
    return save_tiny(out_dir, "afmoe", AfmoeForCausalLM, config, tokenizer, drawn_router_bias("expert_bias"))


def write_afmoe_gguf(checkpoint: str, path: str, qtype_name: str = "F32") -> str:
    """The GGUF file llama.cpp's converter (conversion/afmoe.py's AfmoeModel, a LlamaModel) writes of an AFMoE
    checkpoint: llama's keys (the head size, the rotary's dimension), the experts' (count, used, width, shared count,
    the dense layers first, the weights normalized and scaled), the window; q and k as the checkpoint holds them (its
    non-expert tensors skip LlamaModel's permutation), each layer's experts stacked, the expert bias as
    exp_probs_b.bias, the four norms as attn_norm, post_attention_norm, ffn_norm and post_ffw_norm, the attention's
    gate as attn_gate; matrices in Q8_0 where asked, the router and norms F32; a byte-level BPE vocabulary
    (tokenizer.ggml.pre afmoe)."""
    import gguf

    with open(os.path.join(checkpoint, "config.json")) as f:
        config = json.load(f)
    layers, experts = config["num_hidden_layers"], config["num_experts"]
    arch = gguf.MODEL_ARCH.AFMOE
    writer = gguf.GGUFWriter(path, gguf.MODEL_ARCH_NAMES[arch])
    add_text_keys(writer, config, qtype_name, (experts, config["num_experts_per_tok"]), head_dim=True)
    writer.add_vocab_size(config["vocab_size"])
    writer.add_rope_dimension_count(config["head_dim"])
    writer.add_expert_shared_count(config["num_shared_experts"])
    writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    writer.add_leading_dense_block_count(config["num_dense_layers"])
    if config.get("route_norm") is not None:
        writer.add_expert_weights_norm(config["route_norm"])
    writer.add_expert_weights_scale(config["route_scale"])
    writer.add_sliding_window(config["sliding_window"])
    add_bpe_vocabulary(writer, checkpoint, "afmoe")
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    add = converter_adder(writer, qtype_name)

    def expert_bias(hf_name, values):  # (the converter's exp_probs_b.bias)
        if hf_name.endswith(".expert_bias"):
            add(f"blk.{hf_name.split('.')[2]}.exp_probs_b.bias", values)
            return True
        return False

    add_mixture_tensors(add, checkpoint, gguf.get_tensor_name_map(arch, layers), experts, expert_bias)
    return write_out(writer, path)


def granitemoe_checkpoint(out_dir: str) -> str:
    """A tiny random Granite 3 mixture checkpoint (GraniteMoeForCausalLM) in `out_dir`: granite-3.1-1b-a400m's
    layout 64 wide (4 heads over 2, rotary), each MLP 8 experts of 32, 2 a token (the softmax of their logits);
    Granite's multipliers (the embedding's 12, each residual branch's 0.22, the scores' 1 / 16, the logits divided by
    6); tied embeddings; its norms drawn around 1."""
    from transformers import GraniteMoeConfig, GraniteMoeForCausalLM

    tokenizer = tiny_gpt2_tokenizer(out_dir)
    config = GraniteMoeConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2, embedding_multiplier=12.0,
        residual_multiplier=0.22, attention_multiplier=1 / 16, logits_scaling=6.0, max_position_embeddings=512,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, rms_norm_eps=1e-6, initializer_range=0.15,
        tie_word_embeddings=True, pad_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id)
    return save_tiny(out_dir, "granitemoe", GraniteMoeForCausalLM, config, tokenizer, drawn_norms(1))


def write_granitemoe_gguf(checkpoint: str, path: str, qtype_name: str = "F32") -> str:
    """The GGUF file llama.cpp's converter (conversion/granite.py's GraniteMoeModel, a LlamaModel) writes of a Granite
    3 mixture checkpoint: llama's keys and q/k permutation under the granitemoe architecture, the experts' (count,
    used; feed_forward_length their width), Granite's multipliers as attention.scale, embedding_scale, residual_scale
    and logit_scale; each layer's experts (input_linear: gate and up rows) split into ffn_gate_exps and ffn_up_exps,
    output_linear as ffn_down_exps, the router as ffn_gate_inp; matrices in Q8_0 where asked, the router and norms
    F32; Granite 3's byte-level BPE vocabulary (tokenizer.ggml.pre refact)."""
    import gguf

    with open(os.path.join(checkpoint, "config.json")) as f:
        config = json.load(f)

    def more_keys(writer):
        writer.add_expert_count(config["num_local_experts"])
        writer.add_expert_used_count(config["num_experts_per_tok"])

    return write_as_llama(checkpoint, path, gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.GRANITE_MOE], qtype_name, "refact", {
        "attention.scale": config["attention_multiplier"], "embedding_scale": config["embedding_multiplier"],
        "residual_scale": config["residual_multiplier"], "logit_scale": config["logits_scaling"]}, more_keys,
        special=functools.partial(granite_experts, add_for=lambda writer: converter_adder(writer, qtype_name)))


def granite_experts(writer, hf_name: str, values, add_for) -> bool:
    """write_as_llama's `special` for a Granite mixture (llama.cpp's GraniteMoeModel): a layer's experts'
    input_linear (gate rows, then up rows) as ffn_gate_exps and ffn_up_exps, output_linear as ffn_down_exps, the
    router as ffn_gate_inp, by `add_for(writer)`'s add; True where it wrote the tensor."""
    import numpy as np

    if ".block_sparse_moe." not in hf_name:
        return False
    add, blk = add_for(writer), f"blk.{hf_name.split('.')[2]}"
    if hf_name.endswith("input_linear.weight"):
        gate, up = np.split(values, 2, axis=-2)
        add(f"{blk}.ffn_gate_exps.weight", gate)
        add(f"{blk}.ffn_up_exps.weight", up)
    elif hf_name.endswith("output_linear.weight"):
        add(f"{blk}.ffn_down_exps.weight", values)
    elif hf_name.endswith("router.layer.weight"):
        add(f"{blk}.ffn_gate_inp.weight", values)
    else:
        return False
    return True


def nemotron_h_checkpoint(out_dir: str) -> str:
    """A tiny random Nemotron-H checkpoint (NemotronHForCausalLM) in `out_dir`: NVIDIA-Nemotron-Nano-9B-v2's layout 64
    wide, its kinds of layer by its hybrid_override_pattern (M-M*-M-: three Mamba-2 layers of 8 heads of 16 over 2
    groups with a state of 16 and a window of 4, one attention layer of 4 heads of 16 over 2 without rotary, three MLP
    layers of 128 by relu^2 of up, then down), a norm before each, untied; its norms, D, dt_bias, A_log and the
    convolution's bias drawn. Its config.json as published: the pattern and the layer count, none of the mixture's
    fields (transformers' NemotronHConfig adds them, which llama.cpp's converter reads as a mixture's)."""
    from transformers import NemotronHConfig, NemotronHForCausalLM

    tokenizer = tiny_gpt2_tokenizer(out_dir)

    pattern = "M-M*-M-"
    config = NemotronHConfig(
        vocab_size=len(tokenizer), hidden_size=64, hybrid_override_pattern=pattern, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, intermediate_size=128, ssm_state_size=16, mamba_num_heads=8,
        mamba_head_dim=16, n_groups=2, conv_kernel=4, chunk_size=16, max_position_embeddings=512,
        initializer_range=0.15, layer_norm_epsilon=1e-5, tie_word_embeddings=False,
        pad_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id)
    path = save_tiny(out_dir, "nemotron_h", NemotronHForCausalLM, config, tokenizer, drawn_mamba2)
    with open(os.path.join(path, "config.json")) as f:
        saved = json.load(f)
    for field in ("layers_block_type", "mtp_layers_block_type", "n_routed_experts", "num_experts_per_tok",
                  "moe_intermediate_size", "moe_shared_expert_intermediate_size", "moe_latent_size",
                  "moe_shared_expert_overlap", "n_shared_experts", "routed_scaling_factor", "n_group", "topk_group",
                  "norm_topk_prob", "num_nextn_predict_layers", "output_router_logits"):
        saved.pop(field, None)
    saved.update(hybrid_override_pattern=pattern, num_hidden_layers=len(pattern))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(saved, f, indent=2)
    return path


def nemotron_h_moe_checkpoint(out_dir: str, latent: bool = False) -> str:
    """A tiny random Nemotron 3 checkpoint (NemotronHForCausalLM with mixtures) in `out_dir`:
    NVIDIA-Nemotron-3-Nano-30B-A3B's layout 64 wide, its kinds of layer by its hybrid_override_pattern (MEM*EME:
    three Mamba-2 layers as nemotron_h_checkpoint's, one attention layer without rotary, three mixtures of 8 experts of
    32 (up, relu^2, down: no gate), 2 a token by the sigmoid router with its score correction (drawn: a trained one
    is not 0) in one group, the chosen weights normalized and scaled by 2.5, a shared expert of 64 beside), untied;
    `latent`: Nemotron-3-Super-120B-A12B's experts over a latent of 32 (fc1_latent_proj in, fc2_latent_proj out) and
    its multi-token prediction head (mtp.layers.0: the token's and the hidden state's norms, their projection, an
    attention layer; mtp.layers.1: a mixture, a final norm; drawn), which transformers' model does not read. Its
    config.json as published: the pattern and the layer count (and num_nextn_predict_layers 1)."""
    from transformers import NemotronHConfig, NemotronHForCausalLM

    tokenizer = tiny_gpt2_tokenizer(out_dir)
    pattern = "MEM*EME"
    config = NemotronHConfig(
        vocab_size=len(tokenizer), hidden_size=64, hybrid_override_pattern=pattern, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, intermediate_size=32, ssm_state_size=16, mamba_num_heads=8,
        mamba_head_dim=16, n_groups=2, conv_kernel=4, chunk_size=16, max_position_embeddings=512, n_routed_experts=8,
        num_experts_per_tok=2, moe_intermediate_size=32, moe_shared_expert_intermediate_size=64, n_group=1,
        topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.5, moe_latent_size=32 if latent else None,
        initializer_range=0.15, layer_norm_epsilon=1e-5, tie_word_embeddings=False,
        pad_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id)
    correction = drawn_router_bias("e_score_correction_bias")

    def draw(name, tensor):
        correction(name, tensor)
        drawn_mamba2(name, tensor)

    path = save_tiny(out_dir, "nemotron_h_latent" if latent else "nemotron_h_moe", NemotronHForCausalLM, config,
                     tokenizer, draw)
    with open(os.path.join(path, "config.json")) as f:
        saved = json.load(f)
    for field in ("layers_block_type", "mtp_layers_block_type"):
        saved.pop(field, None)
    saved.update(hybrid_override_pattern=pattern, num_hidden_layers=len(pattern))
    if latent:
        saved.update(num_nextn_predict_layers=1, mtp_hybrid_override_pattern="*E")
        add_mtp_head(path, config)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(saved, f, indent=2)
    return path


def add_mtp_head(path: str, config) -> None:
    """Nemotron 3 Super's multi-token prediction head's tensors (as its checkpoint holds them: mtp.layers.*) drawn
    into the checkpoint at `path` of `config`: the norms around 1, the rest as the initializer's spread."""
    from safetensors.torch import load_file, save_file

    state = load_file(os.path.join(path, "model.safetensors"))
    generator = torch.Generator().manual_seed(SEED)
    hidden, head = config.hidden_size, config.head_dim
    latent, inner = config.moe_latent_size or hidden, config.moe_intermediate_size
    shapes = {"0.enorm": (hidden,), "0.hnorm": (hidden,), "0.eh_proj": (hidden, 2 * hidden), "0.norm": (hidden,),
              "0.mixer.q_proj": (config.num_attention_heads * head, hidden),
              "0.mixer.k_proj": (config.num_key_value_heads * head, hidden),
              "0.mixer.v_proj": (config.num_key_value_heads * head, hidden),
              "0.mixer.o_proj": (hidden, config.num_attention_heads * head), "1.norm": (hidden,),
              "1.final_layernorm": (hidden,), "1.mixer.gate": (config.n_routed_experts, hidden),
              "1.mixer.shared_experts.up_proj": (config.moe_shared_expert_intermediate_size, hidden),
              "1.mixer.shared_experts.down_proj": (hidden, config.moe_shared_expert_intermediate_size),
              **({"1.mixer.fc1_latent_proj": (latent, hidden), "1.mixer.fc2_latent_proj": (hidden, latent)}
                 if config.moe_latent_size else {}),
              **{f"1.mixer.experts.{e}.{part}": shape for e in range(config.n_routed_experts)
                 for part, shape in (("up_proj", (inner, latent)), ("down_proj", (latent, inner)))}}
    for name, shape in shapes.items():
        drawn = torch.randn(shape, generator=generator) * config.initializer_range
        state[f"mtp.layers.{name}.weight"] = drawn + 1 if len(shape) == 1 else drawn
    state["mtp.layers.1.mixer.gate.e_score_correction_bias"] = torch.randn(config.n_routed_experts,
                                                                           generator=generator) * 0.3
    save_file(state, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})


def nemotron_h_latent_checkpoint(out_dir: str) -> str:
    """nemotron_h_moe_checkpoint's with its experts over a latent and a multi-token prediction head
    (Nemotron-3-Super-120B-A12B's layout)."""
    return nemotron_h_moe_checkpoint(out_dir, latent=True)


def write_nemotron_h_gguf(checkpoint: str, path: str, qtype_name: str = "F32") -> str:
    """The GGUF file llama.cpp's converter (conversion/nemotron.py's NemotronHModel, a GraniteHybridModel) writes of a
    Nemotron-H checkpoint: a layer's kv heads and MLP width (0 where it has none: its kind), the ssm.* keys, the head
    size, the layer norm's epsilon, no rotary (rope.scaling.finetuned false, the context 2^20); q and k permuted as
    llama's, A_log as -exp(A_log) and D a column each, the convolution squeezed, the gated norm a row a group, dt_bias
    as ssm_dt.bias; matrices in Q8_0 where asked, the convolution, A, D and norms F32. A Nemotron 3 checkpoint's (its
    config has num_experts_per_tok) under nemotron_h_moe: a mixture's layer of the experts' width, the mixture's keys
    (the experts' count, those a token takes, their width, the shared expert's count and width, the weights' norm and
    scale, the groups and those a token takes, the latent width), each layer's experts stacked into ffn_up_exps and
    ffn_down_exps, the router as ffn_gate_inp (F32) and its correction as exp_probs_b.bias, the shared expert as
    ffn_*_shexp, the latent projections as ffn_latent_down and ffn_latent_up; a multi-token prediction head
    (num_nextn_predict_layers) as one last block (its attention's kv heads and its mixture's width in the keys,
    nextn_predict_layers) of the head's norms and projection (nextn.*), the attention, the norm before the mixture
    (post_attention_norm), the mixture (its router in the type asked)."""
    import gguf
    import numpy as np
    from safetensors.torch import load_file

    with open(os.path.join(checkpoint, "config.json")) as f:
        config = json.load(f)
    pattern, heads, kv_heads = config["hybrid_override_pattern"], config["num_attention_heads"], \
        config["num_key_value_heads"]
    mixture = "num_experts_per_tok" in config
    arch = gguf.MODEL_ARCH.NEMOTRON_H_MOE if mixture else gguf.MODEL_ARCH.NEMOTRON_H
    # (the multi-token prediction head one last block of an attention and a mixture: pattern's kinds "*E" in one)
    nextn = config.get("num_nextn_predict_layers", 0) if mixture else 0
    blocks = len(pattern) + nextn
    writer = gguf.GGUFWriter(path, gguf.MODEL_ARCH_NAMES[arch])
    writer.add_type("model")
    writer.add_block_count(blocks)
    writer.add_context_length(2 ** 20)
    writer.add_embedding_length(config["hidden_size"])
    if mixture:
        writer.add_feed_forward_length([config["moe_intermediate_size"] if kind == "E" else 0 for kind in pattern]
                                       + [config["moe_intermediate_size"]] * nextn)
        writer.add_expert_used_count(config["num_experts_per_tok"])
        writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
        writer.add_expert_shared_feed_forward_length(config["moe_shared_expert_intermediate_size"])
        writer.add_expert_count(config["n_routed_experts"])
        writer.add_expert_shared_count(config["n_shared_experts"])
        writer.add_expert_weights_norm(config["norm_topk_prob"])
        writer.add_expert_weights_scale(config["routed_scaling_factor"])
        writer.add_expert_group_count(config["n_group"])
        writer.add_expert_group_used_count(config["topk_group"])
        if config.get("moe_latent_size") is not None:
            writer.add_moe_latent_size(config["moe_latent_size"])
    else:
        writer.add_feed_forward_length([config["intermediate_size"] if kind == "-" else 0 for kind in pattern])
    writer.add_head_count(heads)
    writer.add_head_count_kv([kv_heads if kind == "*" else 0 for kind in pattern] + [kv_heads] * nextn)
    writer.add_layer_norm_eps(config["layer_norm_epsilon"])
    writer.add_file_type({"F32": 0, "Q8_0": 7}[qtype_name])
    writer.add_vocab_size(config["vocab_size"])
    writer.add_rope_dimension_count(config["head_dim"])
    writer.add_ssm_conv_kernel(config["conv_kernel"])
    writer.add_ssm_state_size(config["ssm_state_size"])
    writer.add_ssm_group_count(config["n_groups"])
    writer.add_ssm_inner_size(config["mamba_num_heads"] * config["mamba_head_dim"])
    writer.add_ssm_time_step_rank(config["mamba_num_heads"])
    writer.add_rope_scaling_finetuned(False)
    writer.add_key_length(config["head_dim"])
    writer.add_value_length(config["head_dim"])
    if nextn:
        writer.add_nextn_predict_layers(nextn)
    add_bpe_vocabulary(writer, checkpoint, "default")
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    names = gguf.get_tensor_name_map(arch, blocks)
    quantized = converter_adder(writer, qtype_name)

    def add(name, values):  # (the convolution, A, D and the norms F32 whatever the type)
        if {"ssm_conv1d", "ssm_a", "ssm_d", "ssm_norm"} & set(name.split(".")) or name.endswith("norm.weight"):
            writer.add_tensor(name, np.ascontiguousarray(values, dtype=np.float32))
        elif qtype_name == "Q8_0" and name == f"blk.{len(pattern)}.ffn_gate_inp.weight":
            # (the head's router in the type asked, where the converter keeps the layers' F32)
            writer.add_tensor(name, gguf.quants.quantize(np.ascontiguousarray(values, dtype=np.float32),
                                                         gguf.GGMLQuantizationType.Q8_0),
                              raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            quantized(name, values)

    # The head's tensors as the converter names them (the rest of mtp.layers.0 and .1 a layer of the last block's).
    head = {"mtp.layers.0.enorm.weight": "nextn.enorm.weight", "mtp.layers.0.hnorm.weight": "nextn.hnorm.weight",
            "mtp.layers.0.eh_proj.weight": "nextn.eh_proj.weight",
            "mtp.layers.1.norm.weight": "post_attention_norm.weight",
            "mtp.layers.1.final_layernorm.weight": "nextn.shared_head_norm.weight"}
    state = load_file(os.path.join(checkpoint, "model.safetensors"))
    for hf_name, value in state.items():
        if hf_name.startswith("mtp.layers.") and hf_name in head:
            add(f"blk.{len(pattern)}.{head[hf_name]}", value.float().numpy())
            continue
        layer_name = f"backbone.layers.{len(pattern)}." + hf_name.split(".", 3)[3] \
            if hf_name.startswith("mtp.layers.") else hf_name
        blk = f"blk.{layer_name.split('.')[2]}" if layer_name.startswith("backbone.layers.") else None
        if ".mixer.experts." in hf_name:  # (each part stacked at its first expert's)
            if (stacked := stacked_experts(state, hf_name, config["n_routed_experts"], "mixer")) is not None:
                _, part, values = stacked
                add(f"{blk}.ffn_{part.removesuffix('_proj')}_exps.weight", values)
        elif hf_name.endswith("e_score_correction_bias"):
            add(f"{blk}.exp_probs_b.bias", value.float().numpy())
        else:
            mamba2_tensor(add, names, layer_name, value, blk, config["n_groups"], heads, kv_heads)
    return write_out(writer, path)


def cohere_checkpoint(out_dir: str, version: int = 1) -> str:
    """A tiny random Cohere checkpoint (CohereForCausalLM: Command R's layout 64 wide, 4 heads of 16 over 2, the
    attention and the MLP side by side after one layer norm, a logit scale, interleaved rotary; Command R+'s q and k
    layer norms per head) in `out_dir`, or where `version` is 2 Command R7B's (Cohere2ForCausalLM: three layers in
    four sliding, a window of 8, the full ones without rotary; its config's rotary_pct, which llama.cpp's converter
    reads); tied embeddings, its norms drawn around 1; a byte-level BPE vocabulary."""
    from transformers import Cohere2Config, Cohere2ForCausalLM, CohereConfig, CohereForCausalLM

    tokenizer = tiny_gpt2_tokenizer(out_dir)
    config_class, model_class, extra = (Cohere2Config, Cohere2ForCausalLM, dict(sliding_window=8)) if version == 2 \
        else (CohereConfig, CohereForCausalLM, dict(use_qk_norm=True))
    config = config_class(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                          initializer_range=0.2, layer_norm_eps=1e-5, logit_scale=0.5, tie_word_embeddings=True,
                          pad_token_id=None, bos_token_id=None, eos_token_id=tokenizer.eos_token_id, **extra)
    name = "cohere2" if version == 2 else "cohere"
    path = save_tiny(out_dir, name, model_class, config, tokenizer, drawn_norms(1))
    if version == 2:
        with open(os.path.join(path, "config.json")) as f:
            saved = json.load(f)
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(dict(saved, rotary_pct=1.0), f, indent=2)
    return path


def cohere2_checkpoint(out_dir: str) -> str:
    """cohere_checkpoint's Command R7B (Cohere2ForCausalLM)."""
    return cohere_checkpoint(out_dir, version=2)


def write_cohere_gguf(checkpoint: str, path: str, qtype_name: str = "F32") -> str:
    """The GGUF file llama.cpp's converter (conversion/command_r.py: CommandR2Model, Cohere2Model) writes of a Cohere
    checkpoint: command-r's (cohere2's) keys, the layer norm's epsilon, the logit scale, no rotary scaling; cohere2's
    head size, window, vocabulary size and rotated width; tensors as the checkpoint holds them (no q/k permutation:
    llama.cpp rotates pairs as Cohere does), no output.weight (tied); a byte-level BPE vocabulary llama.cpp splits as
    command-r's."""
    import gguf

    with open(os.path.join(checkpoint, "config.json")) as f:
        config = json.load(f)
    version = 2 if config["model_type"] == "cohere2" else 1
    arch = gguf.MODEL_ARCH.COHERE2 if version == 2 else gguf.MODEL_ARCH.COMMAND_R
    writer = gguf.GGUFWriter(path, gguf.MODEL_ARCH_NAMES[arch])
    add_text_shape(writer, config)
    writer.add_rope_freq_base(config["rope_parameters"]["rope_theta"])
    writer.add_layer_norm_eps(config["layer_norm_eps"])
    writer.add_file_type({"F32": 0, "Q8_0": 7}[qtype_name])
    head = config["hidden_size"] // config["num_attention_heads"]
    if version == 2:
        writer.add_key_length(head)
        writer.add_value_length(head)
    writer.add_logit_scale(config["logit_scale"])
    if version == 2:
        writer.add_sliding_window(config["sliding_window"])
        writer.add_vocab_size(config["vocab_size"])
        writer.add_rope_dimension_count(int(config["rotary_pct"] * head))
    writer.add_rope_scaling_type(gguf.RopeScalingType.NONE)
    add_bpe_vocabulary(writer, checkpoint, "command-r")
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    add_tensors(writer, checkpoint, gguf.get_tensor_name_map(arch, config["num_hidden_layers"]), qtype_name,
                skip=lambda name: name == "lm_head.weight", float_kept=("norm",))  # (tied)
    return write_out(writer, path)


def seed_oss_checkpoint(out_dir: str) -> str:
    """A tiny random Seed-OSS checkpoint (SeedOssForCausalLM) in `out_dir`: Seed-OSS-36B's layout 64 wide, heads of 32
    (wider than hidden / heads, as its 128 over 5120 / 80) 4 over 2, q/k/v biases (drawn), none on the output,
    untied; a byte-level BPE vocabulary."""
    from transformers import SeedOssConfig, SeedOssForCausalLM

    tokenizer = tiny_gpt2_tokenizer(out_dir)
    config = SeedOssConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
                           initializer_range=0.15, rms_norm_eps=1e-6, tie_word_embeddings=False, pad_token_id=None,
                           bos_token_id=None, eos_token_id=tokenizer.eos_token_id,
                           rope_parameters={"rope_type": "default", "rope_theta": 10000000.0})
    return save_tiny(out_dir, "seed_oss", SeedOssForCausalLM, config, tokenizer,  # (its biases initialized to 0)
                     lambda name, tensor: tensor.normal_(0, 0.3) if name.endswith(".bias") else None)


def write_seed_oss_gguf(checkpoint: str, path: str, qtype_name: str = "F32") -> str:
    """The GGUF file llama.cpp's converter (conversion/olmo.py's SeedOssModel, a TextModel) writes of a Seed-OSS
    checkpoint: the text shape, head size, its biases and matrices as the checkpoint holds them, Seed-Coder's split."""
    return write_as_llama(checkpoint, path, "seed_oss", qtype_name, "seed-coder", permute=False, llama_keys=False)


def arcee_checkpoint(out_dir: str) -> str:
    """A tiny random Arcee checkpoint (ArceeForCausalLM) in `out_dir`: AFM-4.5B's layout 64 wide, llama's attention
    (4 heads over 2) and its MLP of up and down alone with ReLU^2, untied; a byte-level BPE vocabulary."""
    from transformers import ArceeConfig, ArceeForCausalLM

    tokenizer = tiny_gpt2_tokenizer(out_dir)
    config = ArceeConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         initializer_range=0.15, rms_norm_eps=1e-5, tie_word_embeddings=False, pad_token_id=None,
                         bos_token_id=None, eos_token_id=tokenizer.eos_token_id)
    return save_tiny(out_dir, "arcee", ArceeForCausalLM, config, tokenizer)


def write_arcee_gguf(checkpoint: str, path: str, qtype_name: str = "F32") -> str:
    """The GGUF file llama.cpp's converter (conversion/llama.py's ArceeModel, a LlamaModel) writes of an Arcee
    checkpoint: llama's keys and q/k permutation under the arcee architecture, its MLP's up and down."""
    return write_as_llama(checkpoint, path, "arcee", qtype_name, "llama-bpe")


def apertus_checkpoint(out_dir: str) -> str:
    """A tiny random Apertus checkpoint (ApertusForCausalLM) in `out_dir`: Apertus-8B's layout 64 wide, q and k
    RMS-normalized per head (4 heads over 2), an MLP of up and down with each layer's own xIELU (its alpha_p, alpha_n,
    beta and eps drawn), its llama3 rotary (Apertus-8B's: 8 times over 8192 positions), untied; its norms drawn
    around 1; a byte-level BPE vocabulary."""
    from transformers import ApertusConfig, ApertusForCausalLM

    tokenizer = tiny_gpt2_tokenizer(out_dir)
    config = ApertusConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=65536,
                           initializer_range=0.15, rms_norm_eps=1e-5, tie_word_embeddings=False, pad_token_id=None,
                           bos_token_id=None, eos_token_id=tokenizer.eos_token_id, dtype="float32",
                           rope_parameters={"rope_type": "llama3", "rope_theta": 12000000.0, "factor": 8.0,
                                            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                            "original_max_position_embeddings": 8192})

    def draw(name, tensor):
        if "norm" in name:
            tensor.normal_(1, 0.3)
        elif "act_fn.alpha" in name:
            tensor.normal_(0, 0.5)
        elif name.endswith("act_fn.beta"):
            tensor.uniform_(0.3, 0.7)

    return save_tiny(out_dir, "apertus", ApertusForCausalLM, config, tokenizer, draw)


def write_apertus_gguf(checkpoint: str, path: str, qtype_name: str = "F32") -> str:
    """The GGUF file llama.cpp's converter (conversion/llama.py's ApertusModel, a LlamaModel that leaves q and k as
    they are) writes of an Apertus checkpoint: llama's keys under the apertus architecture, each layer's xIELU as the
    xielu.* arrays (a value a layer, not tensors), its llama3 rotary as rope_freqs, the q/k norms and the MLP's up
    and down."""
    from safetensors.torch import load_file

    state = load_file(os.path.join(checkpoint, "model.safetensors"))
    with open(os.path.join(checkpoint, "config.json")) as f:
        config = json.load(f)

    def xielu(writer):
        head = config["hidden_size"] // config["num_attention_heads"]
        writer.add_tensor("rope_freqs.weight", llama3_factors(config["rope_parameters"], head))
        layers = sorted({int(name.split(".")[2]) for name in state if ".act_fn." in name})
        for part, add in (("alpha_n", writer.add_xielu_alpha_n), ("alpha_p", writer.add_xielu_alpha_p),
                          ("beta", writer.add_xielu_beta), ("eps", writer.add_xielu_eps)):
            add([state[f"model.layers.{layer}.mlp.act_fn.{part}"].float().item() for layer in layers])

    return write_as_llama(checkpoint, path, "apertus", qtype_name, "llama-bpe", permute=False, more_keys=xielu,
                          leave_out=lambda name: ".act_fn." in name)


def hunyuan_checkpoint(out_dir: str) -> str:
    """A tiny random Hunyuan dense checkpoint (HunYuanDenseV1ForCausalLM) in `out_dir`: Hunyuan-7B's layout 64 wide,
    q and k RMS-normalized per head after their rotation (4 heads of 16 over 2), its NTK rotary of a fixed alpha (1000:
    the base stretched), tied embeddings; its norms drawn around 1; a byte-level BPE vocabulary."""
    from transformers import HunYuanDenseV1Config, HunYuanDenseV1ForCausalLM

    tokenizer = tiny_gpt2_tokenizer(out_dir)
    config = HunYuanDenseV1Config(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=32768, initializer_range=0.15, rms_norm_eps=1e-5,
        tie_word_embeddings=True, pad_token_id=None, bos_token_id=None, eod_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "alpha": 1000.0, "factor": 1.0})
    return save_tiny(out_dir, "hunyuan", HunYuanDenseV1ForCausalLM, config, tokenizer, drawn_norms(1))


def write_hunyuan_gguf(checkpoint: str, path: str, qtype_name: str = "F32") -> str:
    """The GGUF file llama.cpp's converter (conversion/hunyuan.py's HunYuanModel, a TextModel) writes of a Hunyuan
    dense checkpoint: a TextModel's keys, its NTK alpha folded into the rope base (base * alpha^(dim / (dim - 2)), no
    scaling) and its context set to 256K, the tensors as the checkpoint holds them (the q/k norms as attn_q_norm and
    attn_k_norm), no output.weight (tied)."""
    import gguf

    with open(os.path.join(checkpoint, "config.json")) as f:
        config = json.load(f)
    rope, dim = config["rope_parameters"], config["head_dim"]
    writer = gguf.GGUFWriter(path, "hunyuan-dense")
    add_text_shape(writer, {**config, "max_position_embeddings": 256 * 1024})
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_key_length(dim)
    writer.add_value_length(dim)
    writer.add_file_type({"F32": 0, "Q8_0": 7}[qtype_name])
    writer.add_rope_freq_base(rope["rope_theta"] * rope["alpha"] ** (dim / (dim - 2)))
    writer.add_rope_scaling_type(gguf.RopeScalingType.NONE)
    writer.add_rope_scaling_factor(1)
    writer.add_rope_scaling_orig_ctx_len(256 * 1024)
    add_bpe_vocabulary(writer, checkpoint, "hunyuan-dense")
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.HUNYUAN_DENSE, config["num_hidden_layers"])
    add_tensors(writer, checkpoint, names, qtype_name, skip=lambda name: name == "lm_head.weight")  # (tied)
    return write_out(writer, path)


def olmo2_checkpoint(out_dir: str, version: int = 2) -> str:
    """A tiny random OLMo 2 checkpoint (Olmo2ForCausalLM) in `out_dir`: OLMo-2-1B's layout 64 wide (4 heads of 16,
    norms after the attention and the MLP and none before, q and k normalized over all their heads), untied, rope
    base 5e5. `version` 3: OLMo 3's (Olmo3ForCausalLM) instead, every fourth layer full and the others sliding (a
    window of 4, the published 4096 scaled down), the full layers' rotary yarn (factor 8 over an original context of
    16, the published 8192 scaled down; its attention factor 0.1 ln 8 + 1, as published), the sliding layers' plain."""
    from transformers import Olmo2Config, Olmo2ForCausalLM, Olmo3Config, Olmo3ForCausalLM

    tokenizer = tiny_gpt2_tokenizer(out_dir)
    shape = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=4, initializer_range=0.15, rms_norm_eps=1e-6,
                 tie_word_embeddings=False, pad_token_id=None, eos_token_id=tokenizer.eos_token_id,
                 bos_token_id=tokenizer.bos_token_id)
    if version == 3:
        yarn = {"rope_type": "yarn", "rope_theta": 500000.0, "factor": 8.0, "original_max_position_embeddings": 16,
                "beta_fast": 32.0, "beta_slow": 1.0, "attention_factor": 0.1 * math.log(8.0) + 1}
        config, model_class = Olmo3Config(**shape, max_position_embeddings=128, sliding_window=4, rope_parameters={
            "full_attention": yarn, "sliding_attention": {"rope_type": "default", "rope_theta": 500000.0}}), \
            Olmo3ForCausalLM
    else:
        config, model_class = Olmo2Config(**shape, max_position_embeddings=512, rope_parameters={
            "rope_type": "default", "rope_theta": 500000.0}), Olmo2ForCausalLM
    return save_tiny(out_dir, f"olmo{version}", model_class, config, tokenizer)


def olmo3_checkpoint(out_dir: str) -> str:
    """olmo2_checkpoint's OLMo 3."""
    return olmo2_checkpoint(out_dir, version=3)


def write_olmo2_gguf(checkpoint: str, path: str, qtype_name: str = "F32") -> str:
    """The GGUF file llama.cpp's converter (conversion/olmo.py's Olmo2Model, for OLMo 2 and 3) writes: the text
    shape, rope base and norm epsilon under the olmo2 architecture, the full layers' yarn rotary (type, factor,
    original context, attention factor, betas) and the sliding layers' base where the config has them, OLMo 3's
    sliding window and its layers' pattern; tensors as the checkpoint holds them (no q/k permutation), a byte-level
    BPE vocabulary (OLMo's is split as dbrx's)."""
    with open(os.path.join(checkpoint, "config.json")) as f:
        config = json.load(f)
    rope = config["rope_parameters"]

    def keys(writer):
        full = rope.get("full_attention", rope)
        if full["rope_type"] == "yarn":
            add_yarn(writer, full)
        if "sliding_attention" in rope:
            writer.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
        if config.get("sliding_window"):
            writer.add_sliding_window(config["sliding_window"])
            writer.add_sliding_window_pattern([kind == "sliding_attention" for kind in config["layer_types"]])

    return write_as_llama(checkpoint, path, "olmo2", qtype_name, "dbrx", more_keys=keys, permute=False)


def llama3_checkpoint(out_dir: str, rope: dict | None = None) -> str:
    """A tiny random Llama 3.1 checkpoint (LlamaForCausalLM) in `out_dir`: 64 wide (2 heads of 32 over 1), its
    llama3 rotary as published (factor 8, low and high frequency factors 1 and 4, original context 8192, base 5e5:
    of a head's 16 frequencies the slower ones turned 8 times slower, one in between) or with `rope`'s parameters
    in place of those, untied."""
    return scaled_llama_checkpoint(out_dir, "llama3", {
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192, **(rope or {})})


def deepseek_coder_checkpoint(out_dir: str) -> str:
    """llama3_checkpoint's layout with DeepSeek Coder's (1.3B-33B, a llama) linear rotary: positions / 4, base 1e5."""
    return scaled_llama_checkpoint(out_dir, "deepseek_coder", {"rope_type": "linear", "rope_theta": 100000.0,
                                                               "factor": 4.0})


def qwen3_yarn_checkpoint(out_dir: str) -> str:
    """A tiny random Qwen3 checkpoint (Qwen3ForCausalLM: q/k norms, heads of 32 over 64, tied) with the yarn rotary
    Qwen's model cards give for long contexts (factor 4 over 32768 positions), which llama.cpp's converter writes
    as rope.scaling keys."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tokenizer = tiny_gpt2_tokenizer(out_dir)
    config = Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=131072, initializer_range=0.15,
        tie_word_embeddings=True, rms_norm_eps=1e-6, rope_parameters={
            "rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0, "original_max_position_embeddings": 32768},
        pad_token_id=None, eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id)
    return save_tiny(out_dir, "qwen3_yarn", Qwen3ForCausalLM, config, tokenizer)


def write_qwen3_gguf(checkpoint: str, path: str, qtype_name: str = "F32") -> str:
    """The GGUF file llama.cpp's converter (Qwen3Model, a TextModel) writes of a Qwen3 checkpoint: qwen3's keys, the
    head size, its yarn rotary's keys (add_yarn), tensors as the checkpoint holds them, Qwen's byte-level BPE."""
    with open(os.path.join(checkpoint, "config.json")) as f:
        rope = json.load(f)["rope_parameters"]
    return write_as_llama(checkpoint, path, "qwen3", qtype_name, "qwen2", permute=False,
                          more_keys=lambda writer: add_yarn(writer, rope))


def scaled_llama_checkpoint(out_dir: str, name: str, rope: dict) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = tiny_gpt2_tokenizer(out_dir)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=131072, initializer_range=0.15, tie_word_embeddings=False,
        rms_norm_eps=1e-5, rope_parameters=rope, pad_token_id=None, eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id)
    return save_tiny(out_dir, name, LlamaForCausalLM, config, tokenizer)


def write_llama3_gguf(checkpoint: str, path: str, qtype_name: str = "F32") -> str:
    """The GGUF file llama.cpp's converter (LlamaModel) writes of a Llama 3.1 checkpoint: llama's keys and q/k
    permutation, and its llama3 rotary in no key but as the rope_freqs tensor of frequency factors
    (generate_extra_tensors: 1 for the fast frequencies, the factor for the slow ones, the smooth ramp between); of
    another scaled rotary (DeepSeek Coder's linear one) its rope.scaling keys, as TextModel writes them."""
    with open(os.path.join(checkpoint, "config.json")) as f:
        config = json.load(f)
    rope, dim = config["rope_parameters"], config["hidden_size"] // config["num_attention_heads"]
    if rope["rope_type"] == "linear":
        return write_as_llama(checkpoint, path, "llama", qtype_name, "deepseek-coder", more_keys=lambda writer: (
            writer.add_rope_scaling_type(gguf_rope_type("linear")), writer.add_rope_scaling_factor(rope["factor"])))
    return write_as_llama(checkpoint, path, "llama", qtype_name, "llama-bpe", more_keys=lambda writer: (
        writer.add_tensor("rope_freqs.weight", llama3_factors(rope, dim))))


def llama3_factors(rope: dict, dim: int):
    """The rope_freqs tensor llama.cpp's converter writes of a llama3 rotary over heads of `dim`
    (LlamaModel.generate_extra_tensors: 1 for the fast frequencies, the factor for the slow, the ramp between)."""
    import math

    freqs = 1.0 / (rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    low, high, old, factor = (rope[name] for name in ("low_freq_factor", "high_freq_factor",
                                                       "original_max_position_embeddings", "factor"))
    factors = []
    for freq in freqs:
        wavelength = 2 * math.pi / freq
        if wavelength < old / high:
            factors.append(1)
        elif wavelength > old / low:
            factors.append(factor)
        else:
            smooth = (old / wavelength - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(factors, dtype=torch.float32).numpy()


def exaone4_checkpoint(out_dir: str, sliding: bool = True) -> str:
    """A tiny random EXAONE 4 checkpoint (Exaone4ForCausalLM) in `out_dir`: EXAONE-4.0-32B's layout 64 wide (4 heads
    of 16 over 2, norms after the attention and the MLP and none before, q and k normalized per head), three
    sliding layers of every four (a window of 4, the published 4096 scaled down) whose full ones have no rotary, its
    llama3 rotary (factor 16, low and high frequency factors 1 and 4 over 8192 positions, base 1e6), untied.
    `sliding` False: EXAONE-4.0-1.2B's every layer full, with rotary."""
    from transformers import Exaone4Config, Exaone4ForCausalLM

    tokenizer = tiny_gpt2_tokenizer(out_dir)
    config = Exaone4Config(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=131072, initializer_range=0.15, tie_word_embeddings=False,
        rms_norm_eps=1e-5, sliding_window=4 if sliding else None,
        layer_types=["sliding_attention"] * 3 + ["full_attention"] if sliding else ["full_attention"] * 4,
        rope_parameters={"rope_type": "llama3", "rope_theta": 1000000.0, "factor": 16.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        pad_token_id=None, eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id)
    return save_tiny(out_dir, "exaone4" if sliding else "exaone4_global", Exaone4ForCausalLM, config, tokenizer)


def exaone4_global_checkpoint(out_dir: str) -> str:
    """exaone4_checkpoint's 1.2B: every layer full."""
    return exaone4_checkpoint(out_dir, sliding=False)


def write_exaone4_gguf(checkpoint: str, path: str, qtype_name: str = "F32") -> str:
    """The GGUF file llama.cpp's converter (conversion/exaone.py's Exaone4Model, a TextModel) writes of an EXAONE 4
    checkpoint: the text shape, rope base, norm epsilon and vocabulary size under the exaone4 architecture, its
    sliding window and layers' pattern, its llama3 rotary as the rope_freqs tensor (as LlamaModel writes it), the
    tensors as the checkpoint holds them (no q/k permutation)."""
    with open(os.path.join(checkpoint, "config.json")) as f:
        config = json.load(f)

    def keys(writer):
        if config.get("sliding_window") is not None:
            writer.add_sliding_window(config["sliding_window"])
            writer.add_sliding_window_pattern([kind == "sliding_attention" for kind in config["layer_types"]])
        dim = config["hidden_size"] // config["num_attention_heads"]
        writer.add_tensor("rope_freqs.weight", llama3_factors(config["rope_parameters"], dim))

    return write_as_llama(checkpoint, path, "exaone4", qtype_name, "exaone4", more_keys=keys, permute=False)


def glm4_checkpoint(out_dir: str) -> str:
    """A tiny random GLM-4-0414 checkpoint (Glm4ForCausalLM) in `out_dir`: GLM-4-9B's layout 64 wide (4 heads of 32
    over 2, q/k/v biases), half of each head rotated pair by pair (partial_rotary_factor 0.5; the base 1e5, not the
    class's 1e4), gate and up one projection, norms after the attention and the MLP besides those before, untied."""
    from transformers import Glm4Config, Glm4ForCausalLM

    tokenizer = tiny_gpt2_tokenizer(out_dir)
    config = Glm4Config(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=512, initializer_range=0.15,
        tie_word_embeddings=False, rms_norm_eps=1e-5, attention_bias=True,
        rope_parameters={"rope_type": "default", "rope_theta": 100000.0, "partial_rotary_factor": 0.5},
        pad_token_id=None, eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id)
    return save_tiny(out_dir, "glm4", Glm4ForCausalLM, config, tokenizer)


def write_glm4_gguf(checkpoint: str, path: str, qtype_name: str = "F32") -> str:
    """The GGUF file llama.cpp's converter (conversion/glm.py's Glm4Model, a TextModel) writes of a GLM-4-0414
    checkpoint: the text shape, head size, rope base and norm epsilon under the glm4 architecture, the rotated share
    of a head as rope.dimension_count, the tensors as the checkpoint holds them (gate and up one ffn_up), GLM's
    byte-level BPE (pre glm4)."""
    with open(os.path.join(checkpoint, "config.json")) as f:
        config = json.load(f)
    rotary = int(config["head_dim"] * config["rope_parameters"]["partial_rotary_factor"])
    return write_as_llama(checkpoint, path, "glm4", qtype_name, "glm4", permute=False, rotary=rotary)


def converter_adder(writer, qtype_name: str):
    """add(name, values): a tensor into `writer` as llama.cpp's converter writes it with --outtype `qtype_name` (F32
    or Q8_0): vectors, the router (ffn_gate_inp) and its correction (exp_probs_b) F32; for Q8_0 a matrix of whole
    blocks a row in Q8_0, another F16."""
    import gguf
    import numpy as np
    from gguf import GGMLQuantizationType as Q

    def add(name, values):
        values = np.ascontiguousarray(values, dtype=np.float32)
        if qtype_name != "Q8_0" or values.ndim < 2 or ".ffn_gate_inp." in name or ".exp_probs_b." in name:
            writer.add_tensor(name, values)
        elif values.shape[-1] % 32 == 0:
            writer.add_tensor(name, gguf.quants.quantize(values, Q.Q8_0), raw_dtype=Q.Q8_0)
        else:  # (a row of no whole blocks)
            writer.add_tensor(name, values.astype(np.float16))

    return add


def add_mixture_tensors(add, checkpoint: str, names, experts: int, special=None) -> None:
    """A mixture checkpoint's tensors (model.safetensors, its experts a tensor each as published) by `add` under
    gguf's names (`names`) as llama.cpp's converter writes them: each layer's experts stacked into one 3-D tensor a
    part (ffn_{gate,up,down}_exps), the router's score correction as exp_probs_b.bias; `special(hf_name, values)`:
    True where it wrote that tensor itself."""
    from safetensors.torch import load_file

    state = load_file(os.path.join(checkpoint, "model.safetensors"))
    for hf_name, tensor in state.items():
        values = tensor.float().numpy()
        base, _, suffix = hf_name.rpartition(".")
        if special is not None and special(hf_name, values):
            continue
        if ".mlp.experts." in hf_name:
            if (stacked := stacked_experts(state, hf_name, experts)) is not None:
                layer, part, values = stacked
                add(names.get_name(f"{layer}.mlp.experts.{part}") + ".weight", values)
        elif suffix == "e_score_correction_bias":  # (the converter's e_score_correction.bias)
            add(names.get_name(f"{base}.e_score_correction") + ".bias", values)
        else:
            add(names.get_name(base) + "." + suffix, values)


def glm4moe_checkpoint(out_dir: str) -> str:
    """A tiny random GLM-4.5 checkpoint (Glm4MoeForCausalLM) in `out_dir`: GLM-4.5's layout 64 wide (4 heads of 32
    over 2: wider than hidden / heads, as its 96 heads of 128 over 5120; q/k/v biases, q/k norms), half of each head
    rotated by halves (partial_rotary_factor 0.5, base 1e6); a dense first layer (first_k_dense_replace 1), then 8
    experts of 32, 2 a token, by the sigmoid router with its score correction (drawn: a trained one is not 0) in one
    group, the chosen weights normalized and scaled by 2.5, a shared expert beside; untied."""
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM

    tokenizer = tiny_gpt2_tokenizer(out_dir)
    config = Glm4MoeConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=512, initializer_range=0.15,
        tie_word_embeddings=False, rms_norm_eps=1e-5, attention_bias=True, use_qk_norm=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "partial_rotary_factor": 0.5},
        moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
        first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True, n_group=1, topk_group=1,
        pad_token_id=None, eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id)

    return save_tiny(out_dir, "glm4moe", Glm4MoeForCausalLM, config, tokenizer,
                     drawn_router_bias("e_score_correction_bias"))


def write_glm4moe_gguf(checkpoint: str, path: str, qtype_name: str = "F32") -> str:
    """The GGUF file llama.cpp's converter (conversion/glm.py's Glm4MoeModel, a TextModel) writes of a GLM-4.5
    checkpoint: the text shape with its multi-token prediction block as one more layer (nextn_predict_layers,
    blk.N.nextn.* beside a whole layer's tensors: the published checkpoints hold one, transformers' model none, so
    random here), the rotated share of a head, the experts' keys (count, inner size, shared count, groups, the
    dense layers before them, the sigmoid gating, the weights' scale and normalization), the tensors as the
    checkpoint holds them (no q/k permutation: its rotary turns halves), each layer's experts stacked into 3-D
    ffn_*_exps, the router's score correction as exp_probs_b.bias, GLM's byte-level BPE (pre glm4); matrices in Q8_0
    where asked, the router F32."""
    import gguf
    import numpy as np

    with open(os.path.join(checkpoint, "config.json")) as f:
        config = json.load(f)
    layers, rope, head = config["num_hidden_layers"], config["rope_parameters"], config["head_dim"]
    arch = gguf.MODEL_ARCH.GLM4_MOE
    writer = gguf.GGUFWriter(path, gguf.MODEL_ARCH_NAMES[arch])
    add_text_shape(writer, {**config, "num_hidden_layers": layers + 1})  # (the MTP block a layer)
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_expert_used_count(config["num_experts_per_tok"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_key_length(head)
    writer.add_value_length(head)
    writer.add_file_type({"F32": 0, "Q8_0": 7}[qtype_name])
    writer.add_rope_dimension_count(int(head * rope["partial_rotary_factor"]))
    writer.add_expert_count(config["n_routed_experts"])
    writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    writer.add_expert_shared_count(config["n_shared_experts"])
    writer.add_expert_group_count(config["n_group"])
    writer.add_expert_group_used_count(config["topk_group"])
    writer.add_leading_dense_block_count(config["first_k_dense_replace"])
    writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    writer.add_expert_weights_scale(config["routed_scaling_factor"])
    writer.add_expert_weights_norm(config["norm_topk_prob"])
    writer.add_nextn_predict_layers(1)
    add_bpe_vocabulary(writer, checkpoint, "glm4")
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    names = gguf.get_tensor_name_map(arch, layers + 1)

    add = converter_adder(writer, qtype_name)
    add_mixture_tensors(add, checkpoint, names, config["n_routed_experts"])
    hidden, experts, inner = config["hidden_size"], config["n_routed_experts"], config["moe_intermediate_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    generator = np.random.default_rng(SEED)
    mtp = {"nextn.eh_proj.weight": (hidden, 2 * hidden), "nextn.enorm.weight": (hidden,),
           "nextn.hnorm.weight": (hidden,), "nextn.shared_head_norm.weight": (hidden,),
           "attn_norm.weight": (hidden,), "post_attention_norm.weight": (hidden,),
           "attn_q.weight": (heads * head, hidden), "attn_q.bias": (heads * head,),
           "attn_k.weight": (kv_heads * head, hidden), "attn_k.bias": (kv_heads * head,),
           "attn_v.weight": (kv_heads * head, hidden), "attn_v.bias": (kv_heads * head,),
           "attn_output.weight": (hidden, heads * head), "attn_q_norm.weight": (head,), "attn_k_norm.weight": (head,),
           "ffn_gate_inp.weight": (experts, hidden), "exp_probs_b.bias": (experts,),
           "ffn_gate_exps.weight": (experts, inner, hidden), "ffn_up_exps.weight": (experts, inner, hidden),
           "ffn_down_exps.weight": (experts, hidden, inner), "ffn_gate_shexp.weight": (inner, hidden),
           "ffn_up_shexp.weight": (inner, hidden), "ffn_down_shexp.weight": (hidden, inner)}
    for name, shape in mtp.items():
        add(f"blk.{layers}.{name}", generator.normal(0, 0.1, shape))
    return write_out(writer, path)


def deepseek_checkpoint(out_dir: str, version: int = 3) -> str:
    """A tiny random DeepSeek checkpoint in `out_dir`, its multi-head latent attention (4 heads: q through a rank of 64
    and its norm, k and v from a 32-wide latent and its norm, 32 values a head not rotated and 16 rotated pair by
    pair, 24 a value head, the scores scaled by yarn's mscale), yarn over a 128-token original context (4x); a dense
    first layer, then 8 experts of 32, 2 a token, beside shared experts; untied. `version` 3: DeepSeek-V3's
    (DeepseekV3ForCausalLM: sigmoid scores with a correction (drawn) in 2 groups, 1 used, normalized and scaled by
    2.5, one shared expert; mscale 1); 2: DeepSeek-V2-Lite's (DeepseekV2ForCausalLM: q straight from the hidden state,
    the softmax's top 2 unnormalized, two shared experts; mscale 0.707). config.json names the scoring function and
    top-k method as the published ones do."""
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM

    tokenizer = tiny_gpt2_tokenizer(out_dir)
    v3 = version == 3
    mscale = 1.0 if v3 else 0.707
    shape = dict(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2,
        n_shared_experts=1 if v3 else 2, first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=64 if v3 else None,
        qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=24, max_position_embeddings=512, initializer_range=0.15,
        tie_word_embeddings=False, rms_norm_eps=1e-6, n_group=2 if v3 else 1, topk_group=1,
        routed_scaling_factor=2.5 if v3 else 1.0, norm_topk_prob=v3,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 128, "beta_fast": 32.0, "beta_slow": 1.0,
                         "mscale": mscale, "mscale_all_dim": mscale},
        pad_token_id=None, eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id)
    if not v3:
        shape["topk_method"] = "greedy"
    config = (DeepseekV3Config if v3 else DeepseekV2Config)(**shape)
    config.scoring_func = "sigmoid" if v3 else "softmax"  # (the published configs' keys, which the converter reads)
    if v3:
        config.topk_method = "noaux_tc"

    return save_tiny(out_dir, f"deepseek_v{version}", DeepseekV3ForCausalLM if v3 else DeepseekV2ForCausalLM, config,
                     tokenizer, drawn_router_bias("e_score_correction_bias"))


def mistral4_checkpoint(out_dir: str) -> str:
    """A tiny random Mistral 4 checkpoint (Mistral3ForConditionalGeneration over Mistral 4's text model, as its
    checkpoints are published) in `out_dir`: deepseek_checkpoint's V3 layout (its latent attention, rotated pair by
    pair, a dense first layer, then 8 experts of 32, 2 a token, beside a shared one) with Mistral 4's router (the
    softmax of the logits, one group, the top 2 normalized) and its yarn (32x over a 16-token original context,
    mscale 1) with llama 4's temperature of the queries past that context (beta 0.1, its class's default); its
    experts stacked as its checkpoints hold them; a one-layer Pixtral vision tower (what a text prompt never
    reaches); untied."""
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration, Mistral4Config

    tokenizer = tiny_gpt2_tokenizer(out_dir)
    text = Mistral4Config(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2,
        n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=64, qk_rope_head_dim=16,
        qk_nope_head_dim=32, v_head_dim=24, max_position_embeddings=512, initializer_range=0.15,
        tie_word_embeddings=False, rms_norm_eps=1e-6, n_group=1, topk_group=1, routed_scaling_factor=1.0,
        norm_topk_prob=True,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 32.0,
                         "original_max_position_embeddings": 16, "max_position_embeddings": 512, "beta_fast": 32.0,
                         "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0, "llama_4_scaling_beta": 0.1},
        pad_token_id=None, eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, head_dim=16,
                  image_size=64, patch_size=16, initializer_range=0.15)
    config = Mistral3Config(text_config=text.to_dict(), vision_config=vision, image_token_index=len(tokenizer) - 1,
                            tie_word_embeddings=False)
    return save_tiny(out_dir, "mistral4", Mistral3ForConditionalGeneration, config, tokenizer)


def write_deepseek2_unsplit_gguf(checkpoint: str, path: str, qtype_name: str = "F32") -> str:
    """write_deepseek2_gguf's file as the converter wrote it before it split kv_b."""
    return write_deepseek2_gguf(checkpoint, path, qtype_name, split=False)


def deepseek_v2_checkpoint(out_dir: str) -> str:
    """deepseek_checkpoint's DeepSeek-V2-Lite layout."""
    return deepseek_checkpoint(out_dir, version=2)


def write_deepseek2_gguf(checkpoint: str, path: str, qtype_name: str = "F32", split: bool = True,
                         temperature: tuple[float, int] | None = None) -> str:
    """The GGUF file llama.cpp's converter (conversion/deepseek.py's DeepseekV2Model) writes of a DeepSeek V2 or V3
    checkpoint (deepseek2): a TextModel's keys with one kv head (its latent attention as multi-query), the latent
    ranks, the key and value widths as the latent's (key_length, value_length) and as a head's (key_length_mla,
    value_length_mla), the rotated width, yarn's keys with mscale_all_dim times 0.1 as yarn_log_multiplier, the
    experts' keys (the gating function from config.scoring_func, the weights' normalization only where set), the
    tensors as the checkpoint holds them (nothing permuted: llama.cpp turns pairs, as DeepSeek does), kv_b_proj
    split per head into attn_k_b (transposed: [heads, latent, not rotated]) and attn_v_b, each layer's experts
    stacked into 3-D ffn_*_exps, the router's score correction as exp_probs_b.bias, a byte-level BPE (pre
    deepseek-v3); matrices in Q8_0 where asked (F16 where a row is no whole blocks), the router F32. `split` False:
    as the converter wrote them before it split kv_b (the files of 2024): attn_kv_b whole, key_length and
    value_length a head's, no MLA keys. `temperature` (scale, length): the queries' temperature keys
    (attention.temperature_scale and _length) conversion/mistral.py's MistralMoeModel writes of Mistral Large 3
    (its llama_4_scaling beta, its yarn's original context). Of a Mistral 4 checkpoint (conversion/mistral3.py's
    Mistral4Model, a DeepseekV2Model): its text model's, under the mistral4 architecture, no gating function (its
    config names none: llama.cpp's softmax), its experts as the checkpoint stacks them (gate and up in one
    ffn_gate_up_exps), no temperature (the converter writes none), a byte-level BPE (pre tekken)."""
    import gguf

    with open(os.path.join(checkpoint, "config.json")) as f:
        config = json.load(f)
    mistral4 = config["model_type"] == "mistral3"
    config = config["text_config"] if mistral4 else config
    layers, rope = config["num_hidden_layers"], config["rope_parameters"]
    heads, nope, value = config["num_attention_heads"], config["qk_nope_head_dim"], config["v_head_dim"]
    rank, rotated = config["kv_lora_rank"], config["qk_rope_head_dim"]
    arch = gguf.MODEL_ARCH.MISTRAL4 if mistral4 else gguf.MODEL_ARCH.DEEPSEEK2
    writer = gguf.GGUFWriter(path, gguf.MODEL_ARCH_NAMES[arch])
    add_text_shape(writer, {**config, "num_key_value_heads": 1})
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_expert_used_count(config["num_experts_per_tok"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_expert_group_count(config["n_group"])
    writer.add_expert_group_used_count(config["topk_group"])
    if not mistral4:
        writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID if config["scoring_func"] == "sigmoid"
                                      else gguf.ExpertGatingFuncType.SOFTMAX)
    writer.add_file_type({"F32": 0, "Q8_0": 7}[qtype_name])
    writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    writer.add_rope_scaling_factor(rope["factor"])
    writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    writer.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
    writer.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
    writer.add_leading_dense_block_count(config["first_k_dense_replace"])
    writer.add_vocab_size(config["vocab_size"])
    if config.get("q_lora_rank") is not None:
        writer.add_q_lora_rank(config["q_lora_rank"])
    writer.add_kv_lora_rank(rank)
    if split:
        writer.add_key_length(rank + rotated)
        writer.add_value_length(rank)
        writer.add_key_length_mla(nope + rotated)
        writer.add_value_length_mla(value)
    else:
        writer.add_key_length(nope + rotated)
        writer.add_value_length(value)
    writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    writer.add_expert_count(config["n_routed_experts"])
    writer.add_expert_shared_count(config["n_shared_experts"])
    writer.add_expert_weights_scale(config["routed_scaling_factor"])
    if config.get("norm_topk_prob"):
        writer.add_expert_weights_norm(True)
    writer.add_rope_dimension_count(rotated)
    writer.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])
    if temperature is not None:
        writer.add_attn_temperature_scale(temperature[0])
        writer.add_attn_temperature_length(temperature[1])
    add_bpe_vocabulary(writer, checkpoint, "tekken" if mistral4 else "deepseek-v3")
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    names = gguf.get_tensor_name_map(arch, layers)

    add = converter_adder(writer, qtype_name)

    def special(hf_name, values):  # kv_b per head: k's rows transposed, v's as they are; Mistral 4's own names
        if not mistral4:
            return split_kv_b(hf_name, values)
        if hf_name.startswith("language_model."):  # (the vision tower's and projector's go to the mmproj file)
            hf_name = hf_name.removeprefix("language_model.")
            hf_name += "" if hf_name.endswith(".weight") else ".weight"  # (its stacked experts' names)
            if not split_kv_b(hf_name, values):
                base, _, suffix = hf_name.rpartition(".")
                add(names.get_name(base) + "." + suffix, values)
        return True

    def split_kv_b(hf_name, values):
        base = hf_name.removesuffix(".weight")
        if not split or not base.endswith("kv_b_proj"):
            return False
        per_head = values.reshape(heads, nope + value, rank)
        add(names.get_name(base.replace("kv_b_proj", "k_b_proj")) + ".weight", per_head[:, :nope].transpose(0, 2, 1))
        add(names.get_name(base.replace("kv_b_proj", "v_b_proj")) + ".weight", per_head[:, nope:])
        return True

    add_mixture_tensors(add, checkpoint, names, config["n_routed_experts"], special)
    return write_out(writer, path)


def gemma_checkpoint(out_dir: str) -> str:
    """A tiny random Gemma (1) checkpoint (GemmaForCausalLM) in `out_dir`: gemma-7b's layout 64 wide (4 heads of 32
    over 4: wider than hidden / heads, as its 16 heads of 256 over 3072), GELU-tanh gate, tied embeddings scaled by
    sqrt(hidden), norms of 1 + weight (the weights 0, as initialized), rope base 1e4."""
    from transformers import GemmaConfig, GemmaForCausalLM

    tokenizer = tiny_gpt2_tokenizer(out_dir)
    config = GemmaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=4, head_dim=32, max_position_embeddings=512, initializer_range=0.15,
        tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        pad_token_id=None, eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id)
    return save_tiny(out_dir, "gemma", GemmaForCausalLM, config, tokenizer)


def write_gemma_gguf(checkpoint: str, path: str, qtype_name: str = "F32") -> str:
    """The GGUF file llama.cpp's converter (conversion/gemma.py's GemmaModel) writes of a Gemma checkpoint: the text
    shape, norm epsilon and head size under the gemma architecture, each norm stored as 1 + weight, no q/k
    permutation, no output.weight; Gemma's vocabulary is SentencePiece's, this one a byte-level BPE (the logits are
    what this file is for)."""
    return write_as_llama(checkpoint, path, "gemma", qtype_name, "default", permute=False, norms_plus_one=True)


def ernie4_5_checkpoint(out_dir: str) -> str:
    """A tiny random ERNIE 4.5 checkpoint (Ernie4_5ForCausalLM) in `out_dir`: ERNIE-4.5-0.3B's layout 64 wide (4
    heads of 32 over 2: wider than hidden / heads, as its 16 heads of 128 over 1024), its rotary interleaved (each
    pair of a head's values turned together), tied embeddings, no biases, rope base 5e5."""
    from transformers import Ernie4_5Config, Ernie4_5ForCausalLM

    tokenizer = tiny_gpt2_tokenizer(out_dir)
    config = Ernie4_5Config(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=512, initializer_range=0.15,
        tie_word_embeddings=True, use_bias=False, rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
        pad_token_id=None, eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id)
    return save_tiny(out_dir, "ernie4_5", Ernie4_5ForCausalLM, config, tokenizer)


def write_ernie4_5_gguf(checkpoint: str, path: str, qtype_name: str = "F32") -> str:
    """The GGUF file llama.cpp's converter (conversion/ernie.py's Ernie4_5Model, a TextModel) writes of an ERNIE 4.5
    checkpoint: the text shape, rope base, norm epsilon, the head size as key_length, under the ernie4_5
    architecture; tensors as the checkpoint holds them (no q/k permutation: llama.cpp rotates ERNIE's pairs as its
    llama files' permuted rows), no output.weight where tied. ERNIE's vocabulary is SentencePiece's; this one a
    byte-level BPE (the logits are what this file is for)."""
    return write_as_llama(checkpoint, path, "ernie4_5", qtype_name, "default", permute=False)


def ernie4_5_moe_checkpoint(out_dir: str) -> str:
    """A tiny random ERNIE 4.5 mixture checkpoint (Ernie4_5_MoeForCausalLM) in `out_dir`: ERNIE-4.5-21B-A3B's layout
    64 wide (4 heads of 16 over 2, its rotary interleaved), a dense first layer, then 8 experts of 32, 2 a token by
    the softmax with the correction (drawn) added to choose by, normalized, two shared experts (as wide as the
    converter's intermediate_size / kv heads, as the published model's are); tied embeddings, rope base 5e5."""
    from transformers import Ernie4_5_MoeConfig, Ernie4_5_MoeForCausalLM

    tokenizer = tiny_gpt2_tokenizer(out_dir)
    config = Ernie4_5_MoeConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.15, tie_word_embeddings=True,
        use_bias=False, moe_intermediate_size=32, moe_k=2, moe_num_experts=8, moe_num_shared_experts=2,
        moe_layer_start_index=1, moe_layer_end_index=2, moe_layer_interval=1,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0}, pad_token_id=None,
        eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id)
    return save_tiny(out_dir, "ernie4_5_moe", Ernie4_5_MoeForCausalLM, config, tokenizer,
                     drawn_router_bias("e_score_correction_bias"))


def write_ernie4_5_moe_gguf(checkpoint: str, path: str, qtype_name: str = "F32", requantized: bool = False) -> str:
    """The GGUF file llama.cpp's converter (conversion/ernie.py's Ernie4_5MoeModel) writes of an ERNIE 4.5 mixture
    checkpoint: a TextModel's keys, the experts' (count, used, the layer step and the dense layers before them, the
    inner width, the shared count and width), each layer's experts stacked into 3-D ffn_*_exps, the router's
    correction (moe_statics) as exp_probs_b.bias, the tensors as the checkpoint holds them (no q/k permutation);
    matrices in Q8_0 where asked, the router F32; a byte-level BPE vocabulary (ERNIE's is SentencePiece's).
    `requantized`: the correction [experts] as llama.cpp's quantizer writes the converter's [1, experts] (the
    published Q4_K_M files')."""
    import gguf

    with open(os.path.join(checkpoint, "config.json")) as f:
        config = json.load(f)
    arch = gguf.MODEL_ARCH.ERNIE4_5_MOE
    writer = gguf.GGUFWriter(path, gguf.MODEL_ARCH_NAMES[arch])
    add_text_keys(writer, config, qtype_name, (config["moe_num_experts"], config["moe_k"]))
    writer.add_interleave_moe_layer_step(config["moe_layer_interval"])
    writer.add_leading_dense_block_count(config["moe_layer_start_index"])
    writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    writer.add_expert_shared_count(config["moe_num_shared_experts"])
    writer.add_expert_shared_feed_forward_length(config["intermediate_size"] // config["num_key_value_heads"])
    add_bpe_vocabulary(writer, checkpoint, "default")
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    converted = converter_adder(writer, qtype_name)

    def add(name, values):
        converted(name, values.reshape(-1) if requantized and ".exp_probs_b." in name else values)

    add_mixture_tensors(add, checkpoint, gguf.get_tensor_name_map(arch, config["num_hidden_layers"]),
                        config["moe_num_experts"],
                        lambda hf_name, values: hf_name == "lm_head.weight" and config["tie_word_embeddings"])
    return write_out(writer, path)


def add_yarn(writer, rope: dict) -> None:
    """A yarn rotary's keys as llama.cpp's converter writes them (TextModel.set_gguf_parameters): type, factor,
    original context, then the attention factor and the betas where the config names them."""
    import gguf

    writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    writer.add_rope_scaling_factor(rope["factor"])
    writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    if rope.get("attention_factor") is not None:
        writer.add_rope_scaling_yarn_attn_factor(rope["attention_factor"])
    if rope.get("beta_fast") is not None:
        writer.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
    if rope.get("beta_slow") is not None:
        writer.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])


def gguf_rope_type(name: str):
    import gguf

    return {"yarn": gguf.RopeScalingType.YARN, "linear": gguf.RopeScalingType.LINEAR}[name]


def add_bpe_vocabulary(writer, checkpoint: str, pre: str) -> None:
    """The byte-level BPE vocabulary of `checkpoint`'s tokenizer as llama.cpp's converter writes it
    (_set_vocab_gpt2): its tokens by id (an added special token CONTROL, the rest NORMAL), tokenizer.ggml.pre `pre`,
    the merges and special tokens' ids."""
    import pathlib

    import gguf
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    vocab = [text for text, _ in sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])]
    special = set(tokenizer.all_special_tokens)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(vocab)
    writer.add_token_types([gguf.TokenType.CONTROL if text in special else gguf.TokenType.NORMAL for text in vocab])
    gguf.SpecialVocab(pathlib.Path(checkpoint), load_merges=True).add_to_gguf(writer)


def write_as_llama(checkpoint: str, path: str, architecture: str, qtype_name: str, pre: str,
                   scales: dict | None = None, more_keys=None, permute: bool = True,
                   norms_plus_one: bool = False, rotary: int | None = None, llama_keys: bool = True,
                   leave_out=None, special=None) -> str:
    """What llama.cpp's LlamaModel converter writes of a llama-shaped checkpoint under `architecture`: the text
    shape, rope base, norm epsilon, the head size where the config names one, file type, vocabulary size and rotary
    width, `scales` as float32 keys under the architecture and what `more_keys(writer)` adds, a GPT-2 style BPE
    vocabulary (tokenizer.ggml.pre `pre`), q and k permuted for its interleaved rotary (`permute` False: as they are,
    as a TextModel's converter leaves them), no output.weight where tied, each norm's weight plus one where
    `norms_plus_one` (gemma's converter), `rotary` the rotated share of a head where not all; matrices in
    `qtype_name` (F32, or Q8_0 as --outtype q8_0 writes them). `llama_keys` False: without the keys LlamaModel writes
    beyond a TextModel's (the vocabulary's size, the rotary width unless `rotary`, no space prefix); `leave_out(name)`:
    the checkpoint's tensors the converter writes as keys instead; `special(writer, hf_name, values)`: True where it
    wrote that tensor itself (a mixture's experts)."""

    import gguf
    import numpy as np
    from gguf import GGMLQuantizationType as Q
    from safetensors.torch import load_file

    with open(os.path.join(checkpoint, "config.json")) as f:
        config = json.load(f)
    heads, kv_heads, layers = config["num_attention_heads"], config["num_key_value_heads"], config["num_hidden_layers"]
    writer = gguf.GGUFWriter(path, architecture)
    add_text_shape(writer, config)
    rope = config["rope_parameters"]
    writer.add_rope_freq_base(rope.get("full_attention", rope)["rope_theta"])  # (a set a layer type: OLMo 3's)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_file_type({"F32": 0, "Q8_0": 7}[qtype_name])
    if llama_keys:
        writer.add_vocab_size(config["vocab_size"])
    if config.get("head_dim"):
        writer.add_key_length(config["head_dim"])
        writer.add_value_length(config["head_dim"])
    if llama_keys or rotary:
        writer.add_rope_dimension_count(rotary or config.get("head_dim") or config["hidden_size"] // heads)
    for key, value in (scales or {}).items():
        writer.add_float32(f"{architecture}.{key}", value)
    if more_keys is not None:
        more_keys(writer)

    add_bpe_vocabulary(writer, checkpoint, pre)
    if llama_keys:
        writer.add_add_space_prefix(False)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)

    def permuted(w, n_head):  # llama.cpp's LlamaModel.permute
        return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    arch = next(key for key, name in gguf.MODEL_ARCH_NAMES.items() if name == architecture)
    names = gguf.get_tensor_name_map(arch, layers)
    for hf_name, value in load_file(os.path.join(checkpoint, "model.safetensors")).items():
        if hf_name == "lm_head.weight" and config.get("tie_word_embeddings") or leave_out and leave_out(hf_name):
            continue  # tied, or written as keys
        values = value.float().numpy()
        if special is not None and special(writer, hf_name, values):
            continue
        if norms_plus_one and hf_name.endswith("norm.weight"):
            values = values + 1
        if permute and hf_name.endswith("q_proj.weight"):
            values = permuted(values, heads)
        elif permute and hf_name.endswith("k_proj.weight"):
            values = permuted(values, kv_heads)
        base, _, suffix = hf_name.rpartition(".")
        name = names.get_name(base) + "." + suffix
        if qtype_name == "Q8_0" and values.ndim == 2 and values.shape[-1] % 32 == 0:
            writer.add_tensor(name, gguf.quants.quantize(np.ascontiguousarray(values), Q.Q8_0), raw_dtype=Q.Q8_0)
        else:
            writer.add_tensor(name, np.ascontiguousarray(values))
    return write_out(writer, path)


# gpt-oss's special tokens (o200k_harmony's): the text's start and end, a reply's end, and harmony's message markup.
HARMONY_TOKENS = ("<|startoftext|>", "<|endoftext|>", "<|return|>", "<|constrain|>", "<|channel|>", "<|start|>",
                  "<|end|>", "<|message|>", "<|call|>")


def gpt_oss_checkpoint(out_dir: str) -> str:
    """A tiny random gpt-oss checkpoint (GptOssForCausalLM) in `out_dir`, gpt-oss-20b's layout 64 wide: attention of
    4 heads of 32 (wider than the hidden state, as 20b's 64 heads of 64 are than its 2880), 2 kv heads, q/k/v/o biases,
    a sink logit a head, every other layer sliding (the first; a window of 8), the yarn rotary; a mixture of 4 experts,
    2 a token, the router's bias and softmax over the top 2, the experts' biases and clamped SwiGLU. A byte-level BPE
    vocabulary with harmony's special tokens (<|return|> ends a reply). The weights drawn wider than the config's
    0.02 (which leaves every logit near 0)."""
    from transformers import GptOssConfig, GptOssForCausalLM

    tokenizer = tiny_gpt2_tokenizer(out_dir)
    tokenizer.add_special_tokens({"bos_token": "<|startoftext|>", "eos_token": "<|return|>",
                                  "pad_token": "<|endoftext|>", "additional_special_tokens": list(HARMONY_TOKENS)})
    config = GptOssConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
        max_position_embeddings=512, initializer_range=0.15,
        rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=8.0, beta_fast=32.0, beta_slow=1.0,
                             truncate=False, original_max_position_embeddings=64),
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id, tie_word_embeddings=False)
    config.architectures = ["GptOssForCausalLM"]
    torch.manual_seed(SEED)
    model = GptOssForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers:  # trained biases and sinks are not zero; some gate and up values pass the
            layer.mlp.experts.gate_up_proj_bias.normal_(0, 4.0)  # clamp at 7
            layer.mlp.experts.down_proj_bias.normal_(0, 0.3)
            layer.self_attn.sinks.normal_(0, 1.0)
    path = os.path.join(out_dir, "gpt-oss")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def gpt_oss_tensors(state: dict, layers: int) -> dict:
    """A gpt-oss checkpoint's tensors as llama.cpp's converter (conversion/gpt_oss.py) names and lays them out: each
    expert's gate_up_proj [hidden, gate and up interleaved] split into gate and up rows [inner, hidden], down_proj
    transposed to rows [hidden, inner], the biases split as the rows; the sinks as attn_sinks.weight."""
    out = {"token_embd.weight": state["model.embed_tokens.weight"], "output.weight": state["lm_head.weight"],
           "output_norm.weight": state["model.norm.weight"]}
    for n in range(layers):
        blk, layer = f"blk.{n}.", f"model.layers.{n}."
        out |= {blk + "attn_norm.weight": state[layer + "input_layernorm.weight"],
                blk + "post_attention_norm.weight": state[layer + "post_attention_layernorm.weight"],
                blk + "attn_sinks.weight": state[layer + "self_attn.sinks"],
                blk + "ffn_gate_inp.weight": state[layer + "mlp.router.weight"],
                blk + "ffn_gate_inp.bias": state[layer + "mlp.router.bias"]}
        for part, proj in (("attn_q", "q_proj"), ("attn_k", "k_proj"), ("attn_v", "v_proj"),
                           ("attn_output", "o_proj")):
            for kind in ("weight", "bias"):
                out[f"{blk}{part}.{kind}"] = state[f"{layer}self_attn.{proj}.{kind}"]
        gate_up, bias = state[layer + "mlp.experts.gate_up_proj"].transpose(-1, -2), \
            state[layer + "mlp.experts.gate_up_proj_bias"]
        out |= {blk + "ffn_gate_exps.weight": gate_up[:, ::2], blk + "ffn_up_exps.weight": gate_up[:, 1::2],
                blk + "ffn_gate_exps.bias": bias[:, ::2], blk + "ffn_up_exps.bias": bias[:, 1::2],
                blk + "ffn_down_exps.weight": state[layer + "mlp.experts.down_proj"].transpose(-1, -2),
                blk + "ffn_down_exps.bias": state[layer + "mlp.experts.down_proj_bias"]}
    return out


def write_gpt_oss_gguf(checkpoint: str, path: str, experts: str = "MXFP4", others: str = "F32") -> str:
    """The GGUF file llama.cpp writes of a gpt-oss checkpoint (its converter's keys and tensors, gpt_oss_tensors),
    the experts' three 3-D tensors in `experts` blocks (MXFP4: the published files', llama-quantize's MXFP4_MOE), the
    other matrices in `others` (F32 or Q8_0, as MXFP4_MOE quantizes them); the vocabulary as its converter writes
    o200k_harmony's (model gpt2, pre-tokenizer gpt-4o), with harmony's chat template."""
    import pathlib

    import gguf
    import numpy as np
    from gguf import GGMLQuantizationType as Q
    from safetensors.torch import load_file

    with open(os.path.join(checkpoint, "config.json")) as f:
        config = json.load(f)
    rope = config["rope_parameters"]
    writer = gguf.GGUFWriter(path, "gpt-oss")
    add_text_shape(writer, config)
    add_yarn(writer, rope)
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_expert_count(config["num_local_experts"])
    writer.add_expert_used_count(config["num_experts_per_tok"])
    writer.add_key_length(config["head_dim"])
    writer.add_value_length(config["head_dim"])
    writer.add_file_type(38 if experts == "MXFP4" else 7)  # llama.cpp's MOSTLY_MXFP4_MOE, MOSTLY_Q8_0
    writer.add_sliding_window(config["sliding_window"])
    writer.add_expert_feed_forward_length(config["intermediate_size"])

    with open(os.path.join(checkpoint, "tokenizer.json")) as f:
        tokenizer = json.load(f)
    vocab = {**tokenizer["model"]["vocab"], **{t["content"]: t["id"] for t in tokenizer["added_tokens"]}}
    special = {t["content"] for t in tokenizer["added_tokens"] if t["special"]}
    tokens = sorted(vocab, key=vocab.get)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-4o")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if token in special else gguf.TokenType.NORMAL
                            for token in tokens])
    gguf.SpecialVocab(pathlib.Path(checkpoint), load_merges=True).add_to_gguf(writer)
    with open(os.path.join(os.path.dirname(__file__), "chat_templates", "gpt-oss.jinja")) as f:
        writer.add_chat_template(f.read())  # harmony's, as the published files hold it

    state = load_file(os.path.join(checkpoint, "model.safetensors"))
    for name, value in gpt_oss_tensors(state, config["num_hidden_layers"]).items():
        values = np.ascontiguousarray(value.float().numpy())
        qtype = {"F32": None, "Q8_0": Q.Q8_0, "MXFP4": Q.MXFP4}[experts if "_exps.weight" in name else others]
        if qtype is not None and name.endswith(".weight") and values.ndim >= 2 and "ffn_gate_inp" not in name:
            writer.add_tensor(name, gguf.quants.quantize(values, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(name, values)
    return write_out(writer, path)
