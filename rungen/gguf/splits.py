"""How llama.cpp (src/llama-vocab.cpp) cuts a GGUF file's text before its merges, where transformers' GGUF reading
does otherwise.

A byte-level BPE vocabulary: the splits (`regex_exprs`) of the `tokenizer.ggml.pre` values of files the tool or
transformers can load, where transformers' reading has none and would split as GPT-2. Each regex splits what the
ones before it left, its matches kept as pieces of their own (tokenizers' Split, "isolated"), as llama.cpp's
unicode_regex_split does; then the pieces' bytes are mapped as GPT-2 maps them.

A SentencePiece vocabulary: its spaces spelled "\u2581", and one put before every piece of text that starts the
input or follows a special token, unless the file's tokenizer.ggml.add_space_prefix is false (sentencepiece's
dummy prefix, as the published Llama 2 and Mistral tokenizer.json files' normalizer puts it); transformers' reading
of a llama file puts it only at the input's start, and not before text that starts with a space."""

GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
QWEN2 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
         r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
CJK = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"  # CJK ideographs, and Hangul syllables
PORO = r" ?[^(\s|.,!?" "\u2026\u3002\uff0c\u3001\u0964\u06d4\u060c" ")]+"

SPLITS = {
    **dict.fromkeys(("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b", "mellum2"),
                    (r"\p{N}", GPT2)),  # each numeral alone, then GPT-2's: SmolLM's file, the default model
    "stablelm2": (QWEN2,),
    "deepseek-coder": ("[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", CJK, r"\p{N}"),
    "deepseek-llm": ("[\r\n]",
                     r"\s?" "[A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293"
                     "\u0295-\u02af\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-"
                     "\u03f5\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-"
                     "\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-"
                     "\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc"
                     "\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-"
                     "\u1ffc\u2102\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-"
                     "\u2134\u2139\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-"
                     "\u2cee\u2cf2\u2cf3\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-"
                     "\uabbf\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f\U000104b0-"
                     "\U000104d3\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2\U000118a0-"
                     "\U000118df\U0001e900-\U0001e943]+",
                     r"\s?" "[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+", r"\s+$", CJK, r"\p{N}+"),
    "falcon": (r"[\p{P}\$\+<=>\^~\|`]+", GPT2, "[0-9][0-9][0-9]"),
    "default": (r"[\p{P}\$\+<=>\^~\|]+", GPT2, r"\p{N}+", "[0-9][0-9][0-9]"),  # llama.cpp's, where a file says so
    **dict.fromkeys(("poro-chat", "bloom", "gpt3-finnish"), (PORO,)),
    "viking": (PORO, r"\p{N}"),
    # GLM-4's (and GLM-5's): llama 3's, numerals by three, contractions spelled in both cases
    **dict.fromkeys(("glm4", "glm5", "chatglm-bpe"), (
        r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
        r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",)),
    # Arcee's AFMoE (Trinity): numerals in groups of three counted from the right (llama.cpp's own digit split), runs
    # of CJK and other Asian scripts (its ranges as llama.cpp writes them), then its pattern
    "afmoe": (r"\p{N}{1,2}(?=(?:\p{N}{3})*(?!\p{N}))|\p{N}{3}",
              "[\u4e00-\u9fff\u3400-\u4dbf\u8c48-\ufaff\u3040-\u309f\u30a0-\u30ff\uff65-\uff9f\u2f00-\u2fdf"
              "\u0e40-\u0e7f\u0e80-\u0eff\u1780-\u17ff\u1000-\u109f\uaa60-\uaa7f\ua9e0-\ua9ff\uac00-\ud7af"
              "\u1100-\u11ff]+",
              r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"""
              r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"),
    # Hunyuan's dense models, Hy3's and Hy4's (llama.cpp's HUNYUAN_DENSE, HY_V4): numerals by three, runs of CJK and
    # kana, then AFMoE's pattern
    **dict.fromkeys(("hunyuan-dense", "hy_v4", "joyai-llm"), (
        r"\p{N}{1,3}", "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
        r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"""
        r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")),
    # Hunyuan-A13B's (llama.cpp's HUNYUAN): llama 3's with each numeral alone
    **dict.fromkeys(("hunyuan", "solar-open"), (
        r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
        r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",)),
    "seed-coder": (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}"
                   r"| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)|\s+",),
}


# The values llama.cpp splits as GPT-2 (its regex), as transformers splits every value it does not know.
GPT2_SPLITS = {"gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de", "a.x-4.0", "mellum",
               "modern-bert", "jina-v1-en", "jina-v2-code", "roberta-bpe", "exaone4", "mpt", "olmo", "jais",
               "trillion", "granite-docling"}


def pre_tokenizer(pre: str):
    """The tokenizers pre-tokenizer of llama.cpp's split named `pre`, or None where SPLITS has none."""
    from tokenizers import Regex, pre_tokenizers

    if pre not in SPLITS:
        return None
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(regex), behavior="isolated") for regex in SPLITS[pre]]
                                   + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def sentencepiece_text(add_space_prefix: bool):
    """(normalizer, decoder) of a SentencePiece vocabulary's text as llama.cpp writes it (the pre-tokenizer: none)."""
    from tokenizers import decoders, normalizers

    prefix = [normalizers.Prepend("\u2581")] if add_space_prefix else []
    strip = [decoders.Strip(" ", 1, 0)] if add_space_prefix else []  # the prefix's space, decoded
    return (normalizers.Sequence(prefix + [normalizers.Replace(" ", "\u2581")]),
            decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), *strip]))
