"""A GGUF file's tokenizer without transformers (rungen/gguf/tokenizer.py, rungen/chat_template.py) gives transformers'
results for the same header cache: ids, text, special tokens, padding and chat templates, on the fixture GGUF files
(the llama-shaped ones of tests/test_gguf_loading.py, tests/tiny_models.py's families) and the default model, and
the published templates of tests/chat_templates on the default model's vocabulary."""

import json
import os
import re
import shutil

import jinja2
import pytest
import torch
from gguf import GGUFValueType
from test_gguf_loading import FILES as LLAMA_FILES
from test_gguf_loading import VOCAB, write_llama_gguf
from transformers import AutoTokenizer

from helpers import ROOT, run_main
from rungen.gguf.file import GGUFHeader, mend_tokenizer
from rungen.gguf.tokenizer import GGUFTokenizer, own
from rungen.loading import default_model_file, finish
from tiny_models import default_tokenizer_fields, gemma_tokenizer_fields, write_family_gguf, write_gpt2_gguf

pytestmark = pytest.mark.usefixtures("module_cache_home")
TEMPLATES = os.path.join(ROOT, "tests", "chat_templates")
# The fixture files whose tokenizer the own class runs: llama-style ones (TokenizersBackend), and the qwen2/qwen3
# (Qwen2Tokenizer) and gemma2/gemma3 (GemmaTokenizer) ones through what their header cache records of the class;
# the *_spm ones carry a sentencepiece vocabulary as the published Gemma files do (tiny_models.gemma_tokenizer_fields).
OWN = ["default", "q4_0_untied", "phi3", "qwen2_biases", "qwen3", "gemma2", "gemma3", "gemma2_spm", "gemma3_spm"]
TEXTS = ["The capital of France is", " leading and  double  spaces ", "tabs\tand\nnew\r\nlines\n\n",
         "Hi <|im_end|> there<|im_start|>user", "<|endoftext|><|im_start|>", "café naïve 日本語 🙂 emoji👍🏽",
         "", " ", "a" * 300, "x = {'k': [1, 2.5e-3]}  # code", "Ünïcödé\u00a0nbsp\u200bzero width",
         "<|im_end|>", "12345 678 3.14159 1,000,000", "a    b\t\t\tc   \n\n\n  d  ",
         "中文分词测试，你好！", "e\u0301 vs \u00e9 (NFC)"]
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi <|im_end|> there"},
     {"role": "assistant", "content": "Hello! 🙂"}, {"role": "user", "content": "  spaced\n\nlines  "}],
    [{"role": "user", "content": "ça va?"}, {"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}, "id": "call_1"}]},
     {"role": "tool", "content": "{\"temperature\": 21}", "tool_call_id": "call_1", "name": "get_weather"}],
]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]


@pytest.fixture(scope="module")
def headers(tmp_path_factory):
    """{name: GGUFHeader} of the fixture GGUF files and the default model."""
    fields = default_tokenizer_fields(default_model_file(), VOCAB)
    folder = tmp_path_factory.mktemp("tok")
    paths = {name: write_llama_gguf(folder / f"{name}.gguf", fields, **spec) for name, spec in LLAMA_FILES.items()
             if name in ("q4_0_untied", "qwen2_biases")}
    for family in ("qwen3", "phi3", "gemma2", "gemma3"):
        paths[family] = write_family_gguf(folder / f"{family}.gguf", family, fields)
    for family in ("gemma2", "gemma3"):
        paths[f"{family}_spm"] = write_family_gguf(folder / f"{family}_spm.gguf", family, gemma_tokenizer_fields())
    paths["default"] = default_model_file()
    # a llama file of a sentencepiece vocabulary (Llama 2's, Mistral 7B's): add_space_prefix as llama.cpp defaults it
    # (no key), and false
    spm = [field for field in gemma_tokenizer_fields()
           if field[0] not in ("tokenizer.chat_template", "tokenizer.ggml.add_space_prefix")]
    no_prefix = [("tokenizer.ggml.add_space_prefix", False, GGUFValueType.BOOL, None)]
    for name, extra in (("llama_spm", []), ("llama_spm_no_prefix", no_prefix)):
        paths[name] = write_llama_gguf(folder / f"{name}.gguf", spm + extra, **LLAMA_FILES["q4_0_untied"])
    paths["gpt2"] = write_gpt2_gguf(folder / "gpt2.gguf", fields)  # transformers' GPT2Tokenizer runs its text
    fim = fields + [("tokenizer.ggml.fim_sep_token_id", 5, GGUFValueType.UINT32, None)]  # a coder's file-separator id
    paths["fim"] = write_llama_gguf(folder / "fim.gguf", fim, **LLAMA_FILES["q4_0_untied"])
    # files whose tokenizer.ggml.pre transformers' GGUF reading has no split for (StableLM 2's, DeepSeek Coder's, ...)
    for name, pre in (("stablelm2", "stablelm2"), ("deepseek-coder", "deepseek-coder"), ("falcon", "falcon"),
                      ("minerva-7b", "minerva-7b"), ("pre-default", "default")):
        named = [(key, pre if key == "tokenizer.ggml.pre" else value, *types) for key, value, *types in fields]
        paths[name] = write_llama_gguf(folder / f"{name}.gguf", named, **LLAMA_FILES["q4_0_untied"])
    return {name: GGUFHeader(path) for name, path in paths.items()}


@pytest.fixture(scope="module")
def caches(headers):
    """{name: header cache directory}."""
    return {name: header.cache_dir for name, header in headers.items()}


def transformers_tokenizer(directory, path=None):
    """transformers' tokenizer class on a header cache, cutting text as llama.cpp does where the file at `path` says
    more than transformers reads of it (the qwen2/3 and gemma fixtures carry SmolLM's split, whose files
    transformers splits as GPT-2): what the tool runs where it runs transformers' class."""
    tokenizer = AutoTokenizer.from_pretrained(directory)
    if path is not None:
        mend_tokenizer(tokenizer, path)
    return tokenizer


def pair(directory, path=None):
    """(own tokenizer, transformers' tokenizer) of a header cache, padded as the tool pads them (loading.finish)."""
    model = torch.nn.Module()
    model.config = type("Config", (), {"max_position_embeddings": 64, "model_type": "llama"})()
    model.get_input_embeddings = lambda: torch.nn.Embedding(1, 1)
    return tuple(finish(model, tokenizer, "llama", torch.device("cpu")).tokenizer
                 for tokenizer in (GGUFTokenizer(directory), transformers_tokenizer(directory, path)))


def test_which_files_get_the_own_tokenizer(caches, tmp_path):
    # Every fixture file: llama-style ones as their tokenizer.json is saved, qwen2/3 and gemma ones (whose class of
    # transformers' rebuilds the pipeline from the vocabulary) as the header cache records their class running it.
    for name in OWN:
        assert own(caches[name]) is None, name
    assert isinstance(GGUFHeader(default_model_file()).tokenizer, GGUFTokenizer)
    # The class's pipeline is recorded only where it is not tokenizer.json's (qwen's and gemma's classes rebuild it).
    assert not os.path.exists(os.path.join(caches["default"], "tokenizer_pipeline.json"))
    for name in ("qwen3", "gemma2"):
        assert os.path.isfile(os.path.join(caches[name], "tokenizer_pipeline.json")), name
    # A cache without that record (or with another class's) keeps transformers' class.
    for name, tokenizer_class in (("qwen3", "Qwen2Tokenizer"), ("gemma2", "GemmaTokenizer")):
        directory = tmp_path / name
        shutil.copytree(caches[name], directory)
        (directory / "tokenizer_class.json").unlink()
        assert own(str(directory)) == f"its tokenizer class is {tokenizer_class}", name


def test_the_header_cache_names_its_added_tokens(caches):
    # tokenizer_config.json lists the added tokens (transformers' from_pretrained re-reads tokenizer.json without).
    for name in OWN:
        with open(os.path.join(caches[name], "tokenizer_config.json")) as f:
            added = json.load(f)["added_tokens_decoder"]
        theirs = AutoTokenizer.from_pretrained(caches[name]).added_tokens_decoder
        assert {int(index): token["content"] for index, token in added.items()} == {
            index: token.content for index, token in theirs.items()}, name


@pytest.mark.parametrize("name", OWN)
def test_ids_text_and_special_tokens_are_transformers(headers, caches, name):
    # The class's own padding side (GemmaTokenizer's left, the others' right), before the tool sets left.
    mine, theirs = GGUFTokenizer(caches[name]), AutoTokenizer.from_pretrained(caches[name])
    assert mine.padding_side == theirs.padding_side
    assert mine.pad({"input_ids": [[5, 6, 7], [8]]}) == dict(theirs.pad({"input_ids": [[5, 6, 7], [8]]}))
    mine, theirs = pair(headers[name].cache_dir, headers[name].path)
    for attribute in ("bos_token", "eos_token", "unk_token", "pad_token", "bos_token_id", "eos_token_id",
                      "unk_token_id", "pad_token_id", "all_special_ids", "all_special_tokens", "special_tokens_map",
                      "padding_side", "chat_template"):
        assert getattr(mine, attribute) == getattr(theirs, attribute), attribute
    assert mine.get_vocab() == theirs.get_vocab() and len(mine) == len(theirs)
    for text in TEXTS:
        for special in (True, False):
            ids = mine.encode(text, add_special_tokens=special)
            assert ids == theirs.encode(text, add_special_tokens=special), (text, special)
            for skip in (True, False):
                assert mine.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip)
        assert mine.convert_ids_to_tokens(ids) == theirs.convert_ids_to_tokens(ids)
    specials = mine.all_special_ids
    for ids in ([specials[0], 300, specials[-1], 301, 1000], [257, 258], specials, [0, 1, 2, 3, 4, 5]):
        for skip in (True, False):
            assert mine.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip), ids
    batch = TEXTS[:4]
    assert mine(batch)["input_ids"] == theirs(batch)["input_ids"]
    for got, expected in ((mine(batch, return_tensors="pt", padding=True), theirs(batch, return_tensors="pt",
                                                                                    padding=True)),
                          (mine.pad({"input_ids": [[5, 6, 7], [8]]}, return_tensors="pt"),
                           theirs.pad({"input_ids": [[5, 6, 7], [8]]}, return_tensors="pt"))):
        assert torch.equal(got["input_ids"], expected["input_ids"])
        assert torch.equal(got.attention_mask, expected.attention_mask.to(got.attention_mask.dtype))


def render_both(mine, theirs, conversation, **kwargs):
    """Both renderings, or both refusals (the template's raise_exception, or a filter failing: LFM2's tojson of a
    content left out). The one difference: a template changing a list it made (Kimi K2's queue of call ids), which
    transformers' sandbox refuses and the tool's renders (rungen/chat_template.py)."""
    results = []
    for tokenizer in (mine, theirs):
        try:
            results.append(tokenizer.apply_chat_template(conversation, tokenize=False, **kwargs))
        except (jinja2.TemplateError, TypeError) as error:
            results.append(("refused", type(error).__name__, str(error)))
    if results[1][:2] == ("refused", "SecurityError") and isinstance(results[0], str):
        assert re.fullmatch(r"access to attribute '(append|pop)' of 'list' object is unsafe\.", results[1][2])
        return results[0]
    assert results[0] == results[1], kwargs
    return results[0]


@pytest.mark.parametrize("name", OWN)
def test_each_files_chat_template_renders_as_transformers(headers, name):
    # The file's own template (as the header cache holds it), with and without the generation prompt, as text and ids.
    mine, theirs = pair(headers[name].cache_dir, headers[name].path)
    assert mine.chat_template == theirs.chat_template
    rendered = []
    for conversation in CONVERSATIONS:
        for generation in (True, False):
            rendered.append(render_both(mine, theirs, conversation, add_generation_prompt=generation))
            if isinstance(rendered[-1], str):
                assert (mine.apply_chat_template(conversation, add_generation_prompt=generation)
                        == theirs.apply_chat_template(conversation, add_generation_prompt=generation)["input_ids"])
    assert any(isinstance(text, str) and "France" in text for text in rendered)  # not all refused


@pytest.mark.parametrize("template", [None, *sorted(f for f in os.listdir(TEMPLATES) if f.endswith(".jinja"))])
def test_chat_templates_render_as_transformers(caches, tmp_path, template):
    # The default model's files with each published template (None: its own), every conversation with and without
    # the generation prompt, and with tools where the template takes them.
    directory = tmp_path / "tok"
    shutil.copytree(caches["default"], directory)
    if template is not None:
        shutil.copy(os.path.join(TEMPLATES, template), directory / "chat_template.jinja")
    mine, theirs = pair(str(directory))
    rendered = []
    for conversation in CONVERSATIONS:
        for generation in (True, False):
            rendered.append(render_both(mine, theirs, conversation, add_generation_prompt=generation))
            if "tools" in mine.chat_template:
                rendered.append(render_both(mine, theirs, conversation, add_generation_prompt=generation,
                                            tools=TOOLS))
    assert any(isinstance(text, str) and "France" in text for text in rendered)  # not all refused
    text = mine.apply_chat_template(CONVERSATIONS[0], add_generation_prompt=True, tokenize=False)
    assert mine.apply_chat_template(CONVERSATIONS[0], add_generation_prompt=True) == mine.encode(
        text, add_special_tokens=False)
    assert CONVERSATIONS[2][1]["content"] is None and "thinking" not in CONVERSATIONS[2][1]  # left as given


FEATURES_TEMPLATE = """{%- set ns = namespace(n=0) -%}
{%- for message in messages -%}
  {%- if message.role == 'system' %}{% continue %}{% endif -%}
  {%- if loop.index > 7 %}{% break %}{% endif -%}
  {%- set ns.n = ns.n + 1 -%}
  <{{ message.role }}>{% if message.role == 'assistant' %}{% generation %}{{ message.content }}{% endgeneration %}
  {%- else %}{{ message.content | trim }}{% endif %}</{{ message.role }}>
  {%- if message.tool_calls is defined %}{{ message.tool_calls | tojson }}{% endif -%}
  {%- if message.reasoning_content is defined %}[{{ message.thinking }}|{{ message.reasoning_content }}]{% endif %}
{% endfor -%}
{{ ns.n }} {{ tools | tojson(indent=2) }} {{ dict(a=1) | tojson }} {{ bos_token }}{{ eos_token }}
{%- if messages[-1].content == 'refuse' %}{{ raise_exception('refused: ' ~ messages[-1].role) }}{% endif -%}
{%- if add_generation_prompt %}<assistant>{% endif %}"""


def test_the_template_environment_is_transformers(caches, tmp_path):
    # What transformers' environment adds to jinja2's: loop controls, {% generation %}, namespace, dict, tojson
    # (non-ASCII kept, indent), raise_exception, trim_blocks/lstrip_blocks, reasoning under its names, None dropped.
    directory = tmp_path / "tok"
    shutil.copytree(caches["default"], directory)
    (directory / "chat_template.jinja").write_text(FEATURES_TEMPLATE)
    mine, theirs = pair(str(directory))
    messages = [*CONVERSATIONS[1], {"role": "assistant", "content": "Paris", "reasoning": "la capitale…"},
                *CONVERSATIONS[2]]
    for conversation in (messages, messages[:3], [{"role": "user", "content": "refuse"}]):
        for generation in (True, False):
            for tools in (None, TOOLS):
                render_both(mine, theirs, conversation, add_generation_prompt=generation, tools=tools)
    assert render_both(mine, theirs, [{"role": "user", "content": "refuse"}]) == \
        ("refused", "TemplateError", "refused: user")


def test_a_continuation_after_sentencepiece_byte_tokens_keeps_its_text(caches):
    """Gemma's and Llama-2's vocabularies spell a character they lack as byte tokens (<0xE6>...), and a run of them
    decoded from its middle is all U+FFFD, valid bytes after the cut too: the engine's rows decode their tokens
    after the prompt's last ones from a character's start, so a reply after a long run of them (a CJK prompt) keeps
    its text; a stop string never matches the U+FFFD that stands for an unfinished character; log-probabilities
    name each token's own text."""
    import threading

    from rungen.logprobs import content_items
    from rungen.requests import Request
    from rungen.rows import TAIL_TOKENS, Reporter, Row
    from rungen.sampling import Sampling

    tokenizer = GGUFTokenizer(caches["gemma2_spm"])
    byte = {value: tokenizer.convert_tokens_to_ids(f"<0x{value:02X}>") for value in range(256)}
    text = "日本語のテキスト日本語"  # 11 characters of 3 bytes: the last 32 tokens start inside the first
    prompt = tokenizer.encode("Say:", add_special_tokens=False) + [byte[value] for value in text.encode()]
    assert len(text.encode()) == TAIL_TOKENS + 1 and tokenizer.decode(prompt[-TAIL_TOKENS:]).startswith("\ufffd")
    reporter = Reporter(tokenizer, threading.Lock(), set())
    newline = byte[0x0A]

    def row_of(stop=()):
        request = Request(prompt, 8, Sampling(temperature=0), lambda event: None, stop=stop)
        return Row(request, 0, None, len(prompt), prompt_tail=reporter.prompt_tail(prompt))

    row = row_of()
    row.generated = [newline] * 3
    assert reporter.continuation(row) == "\n\n\n"
    # an emoji's first two bytes: held as U+FFFD, which the stop string "\ufffd" must not take for text
    row = row_of(stop=("\ufffd", "🐦"))
    for value in "\n🐦".encode()[:3]:
        row.generated.append(byte[value])
        reporter.report(row, row.generated[-1], None)
        assert row.finish is None
    for value in "\n🐦".encode()[3:]:
        row.generated.append(byte[value])
        reporter.report(row, row.generated[-1], None)
    assert row.finish.reason == "stop" and row.finish.stop == "🐦" and row.finish.text == "\n"
    # a reply ending inside a character keeps the newline before it (the byte run decodes as UTF-8 does)
    row = row_of()
    row.generated = [newline, byte[0xF0], byte[0x9F]]
    assert reporter.continuation(row) == "\n\ufffd"
    from rungen.generation import Settings, describe_sequence
    from rungen.prompts import Prompt

    described = describe_sequence(Settings(), tokenizer, Prompt(0, text, ids=prompt), row.generated, set())
    assert described.generated_text == "\n\ufffd"  # the generate() path's text, the same
    items = content_items(tokenizer, prompt, [newline], [0.0], [[]], [[]])
    assert items[0]["token"] == "\n" and items[0]["bytes"] == [10]
    # a stray byte, then valid ones and text: the whole reply reads as it read growing (a stream's deltas), the
    # stray byte one U+FFFD and the "7" after it kept, on either path and in its log-probability's token
    row = row_of()
    grown = []
    for token in [byte[0xEA], byte[0x37]] + tokenizer.encode(" end", add_special_tokens=False):
        row.generated.append(token)
        grown.append(reporter.continuation(row))
    assert all(later.startswith(earlier.rstrip("\ufffd")) for earlier, later in zip(grown, grown[1:]))
    assert grown[-1] == "\ufffd7 end"
    described = describe_sequence(Settings(), tokenizer, Prompt(0, text, ids=prompt), row.generated, set())
    assert described.generated_text == "\ufffd7 end"
    items = content_items(tokenizer, prompt, row.generated[:2], [0.0] * 2, [[]] * 2, [[]] * 2)
    assert [item["token"] for item in items] == ["\ufffd", "7"]


def test_a_sentencepiece_llama_file_puts_the_prefix_space_where_llama_cpp_does(caches):
    """sentencepiece's dummy prefix, as llama.cpp (and Llama 2's and Mistral's own tokenizer.json) put it: before
    text that starts with spaces too, and after a special token; none where the file's add_space_prefix is false."""
    def pieces(name, text):
        tokenizer = GGUFTokenizer(caches[name])
        return tokenizer.convert_ids_to_tokens(tokenizer.encode(text, add_special_tokens=False))

    assert pieces("llama_spm", " two")[:2] == ["\u2581", "\u2581t"]  # two spaces: the prefix and its own
    assert pieces("llama_spm", "  two")[:2] == ["  ", "\u2581t"]  # a user-defined run read whole, as llama.cpp does
    assert pieces("llama_spm", "<start_of_turn>user")[1].startswith("\u2581")
    assert pieces("llama_spm_no_prefix", "two")[0] == "t" and pieces("llama_spm_no_prefix", " two")[0] == "\u2581t"
    assert not pieces("llama_spm_no_prefix", "<start_of_turn>user")[1].startswith("\u2581")
    # Gemma's runs of spaces (user-defined, stored with real spaces; no prefix) read whole, the longest first
    assert pieces("gemma2_spm", "a  b")[1] == "\u2581\u2581"
    assert pieces("gemma2_spm", " " * 9)[:2] == ["\u2581" * 4] * 2
    for name in ("llama_spm", "llama_spm_no_prefix", "gemma2_spm"):  # and the text decodes back as it was
        tokenizer = GGUFTokenizer(caches[name])
        assert tokenizer.decode(tokenizer.encode("  two words", add_special_tokens=False)) == "  two words"


def test_the_files_pre_tokenizer_splits_as_llama_cpp_splits(headers, caches):
    """tokenizer.ggml.pre names how text is split before the merges: SmolLM's ("smollm", the default model) puts
    every numeral on its own, then splits as GPT-2 (llama.cpp's llama-vocab.cpp, and SmolLM's own tokenizer.json),
    which transformers' GGUF reading, lacking "smollm", would not; StableLM 2's splits as Qwen2's."""
    def pieces(name, text):
        tokenizer = GGUFTokenizer(caches[name])
        return tokenizer.convert_ids_to_tokens(tokenizer.encode(text, add_special_tokens=False))

    assert pieces("default", "x = 12345") == ["x", "Ġ=", "Ġ", "1", "2", "3", "4", "5"]
    arabic = pieces("default", "عام ٢٠٢٤")  # Arabic-Indic digits: two bytes each, none merged with another
    assert arabic[arabic.index("Ġ") + 1 :] == ["Ù", "¢", "Ù", "ł", "Ù", "¢", "Ù", "¤"]
    assert "Ġâ" not in pieces("default", "Chapter Ⅻ")  # the space is not merged into the numeral
    def split(name, text):
        from tokenizers import Tokenizer

        backend = Tokenizer.from_file(os.path.join(caches[name], "tokenizer.json"))
        return [piece for piece, _ in backend.pre_tokenizer.pre_tokenize_str(text)]

    assert split("stablelm2", "x!Hello 12") == ["x", "!Hello", "Ġ", "1", "2"]  # Qwen2's: a mark joins its word
    assert split("default", "x!Hello 12") == ["x", "!", "Hello", "Ġ", "1", "2"]
    assert split("minerva-7b", "x = 12345") == split("default", "x = 12345") == ["x", "Ġ=", "Ġ", *"12345"]
    # DeepSeek Coder's: a line break alone, each digit alone, a CJK run apart from the letters around it
    assert split("deepseek-coder", "a\n\n12 中文abc") == ["a", "Ċ", "Ċ", "1", "2", "Ġ", "ä¸Ńæĸĩ", "abc"]
    assert split("falcon", "x=12345, (y)") == ["x", "=", "123", "45", ",", "Ġ", "(", "y", ")"]  # 3 digits at most
    assert split("pre-default", "don't $12345") == ["don", "'", "t", "Ġ", "$", "123", "45"]  # llama.cpp's "default"
    # a class of transformers' that builds its own pipeline (GPT-2's) is given the file's split too
    gpt2 = headers["gpt2"].tokenizer
    assert not isinstance(gpt2, GGUFTokenizer)
    assert gpt2.convert_ids_to_tokens(gpt2.encode("x = 12345", add_special_tokens=False)) == pieces("default",
                                                                                                   "x = 12345")


def test_a_reply_ends_at_the_end_of_its_turn_as_in_llama_cpp(headers, tmp_path):
    """Gemma's files say eos <eos>, and its turns end with <end_of_turn>: a reply ends at either, as llama.cpp's
    end-of-generation set has it (SmolLM's: <|im_end|>, and <|endoftext|> and its <reponame>)."""
    gemma = headers["gemma2_spm"]
    tokenizer = gemma.tokenizer
    assert gemma.config.eos_token_id == tokenizer.convert_tokens_to_ids(["<eos>", "<end_of_turn>"])
    assert headers["default"].tokenizer.convert_ids_to_tokens(headers["default"].config.eos_token_id) == [
        "<|im_end|>", "<|endoftext|>", "<reponame>"]
    assert sorted(headers["fim"].config.eos_token_id) == sorted(headers["default"].config.eos_token_id + [5])  # its id
    # transformers' conversion adds <s> and </s> past a sentencepiece vocabulary that has none: not the model's
    assert max(headers["llama_spm"].config.eos_token_id) < headers["llama_spm"].config.vocab_size
    # pushed to end its turn at once, the reply does
    end = tokenizer.convert_tokens_to_ids("<end_of_turn>")
    config = tmp_path / "push.json"
    config.write_text(json.dumps({"sequence_bias": [[[end], 100.0]]}))
    for flags in ([], ["--dequantize"]):  # in its blocks, and transformers' float model of the file
        result = run_main(["--model_name_or_path", gemma.path, "--chat", "--prompt", "Hi", "--temperature", "0",
                           "--length", "8", "--output_format", "jsonl", "--generation_config", str(config), *flags])
        assert result.returncode == 0, result.stderr.decode()[-2000:]
        [record] = [json.loads(line) for line in result.stdout.decode().splitlines()]
        assert (record["finish_reason"], record["num_generated_tokens"], record["generated_text"]) == ("eos", 1, ""), \
            flags


@pytest.mark.parametrize("add_bos", [None, False, True])
def test_a_llama3_like_vocabulary_starts_with_bos_where_llama_cpp_does(tmp_path, add_bos):
    # llama.cpp starts a byte-level BPE vocabulary's text with BOS for Llama 3's split and those alike (Falcon-H1's,
    # LFM2's, ...) where the file has no tokenizer.ggml.add_bos_token, and as that key says where it has: the header's
    # tokenizer and transformers' of the file alike.
    fields = [(key, "falcon-h1" if key == "tokenizer.ggml.pre" else value, *types)
              for key, value, *types in default_tokenizer_fields(default_model_file(), VOCAB)
              if key != "tokenizer.ggml.add_bos_token"]  # (the default model's file says false)
    if add_bos is not None:
        fields.append(("tokenizer.ggml.add_bos_token", add_bos, GGUFValueType.BOOL, None))
    path = write_llama_gguf(tmp_path / "f.gguf", fields, **LLAMA_FILES["q4_0_untied"])
    header = GGUFHeader(path)
    assert isinstance(header.tokenizer, GGUFTokenizer)
    ids = [header.tokenizer("Hello")["input_ids"], header.transformers_tokenizer("Hello")["input_ids"]]
    bos = header.tokenizer.bos_token_id
    assert bos is not None and all((tokens[0] == bos) == (add_bos is not False) for tokens in ids), ids
    assert ids[0] == ids[1]


def test_a_pre_tokenizer_without_a_split_here_is_said(tmp_path, caplog):
    # DeepSeek V3's files name a split the tool does not have: its text is split as transformers splits it, and the
    # header's read says so, naming the value
    fields = [(key, "deepseek-v3" if key == "tokenizer.ggml.pre" else value, *types)
              for key, value, *types in default_tokenizer_fields(default_model_file(), VOCAB)]
    path = write_llama_gguf(tmp_path / "ds.gguf", fields, **LLAMA_FILES["q4_0_untied"])
    with caplog.at_level("WARNING", logger="run_generation"):
        GGUFHeader(path)
    said = [record.getMessage() for record in caplog.records if "tokenizer.ggml.pre" in record.getMessage()]
    assert said == ["ds.gguf: its tokenizer.ggml.pre 'deepseek-v3' has no split here: its text is split as GPT-2's, "
                    "as transformers splits it, which llama.cpp does not"]


def test_afmoes_split_is_llama_cpps():
    # llama.cpp's AFMOE split (Arcee's Trinity files): numerals in groups of three from the right (its own digit
    # split: the leading one or two first), runs of CJK alone, then its pattern (a punctuation mark with the ASCII
    # letters after it, letters with what precedes them, a space before a numeral alone)
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    from rungen.gguf.splits import pre_tokenizer

    text = "Hello WORLD'S 12345!\n\n\u4e2d\u6587 abc.def 7 123456"
    wanted = ["Hello", " WORLD", "'S", " ", "12", "345", "!\n\n", "\u4e2d\u6587", " abc", ".def", " ", "7", " ", "123",
              "456"]
    spelled = bytes_to_unicode()
    assert [piece for piece, _ in pre_tokenizer("afmoe").pre_tokenize_str(text)] == \
        ["".join(spelled[byte] for byte in piece.encode()) for piece in wanted]


@pytest.mark.parametrize("pre, wanted", [
    # HUNYUAN_DENSE (Hunyuan's dense models, Hy3, Hy4): numerals by three, CJK and kana runs alone, then AFMoE's
    # pattern
    ("hunyuan-dense", ["Hello", " WORLD", "'S", " ", "123", "45", "!\n\n", "\u4e2d\u6587", " ", "\u30ab\u30ca",
                       " abc", ".def"]),
    # HUNYUAN (Hunyuan-A13B): llama 3's with each numeral alone
    ("hunyuan", ["Hello", " WORLD", "'S", " ", "1", "2", "3", "4", "5", "!\n\n", "\u4e2d\u6587", " \u30ab\u30ca",
                 " abc", ".def"])])
def test_hunyuans_splits_are_llama_cpps(pre, wanted):
    # llama.cpp's Hunyuan splits, each regex splitting what the ones before it left (its unicode_regex_split)
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    from rungen.gguf.splits import pre_tokenizer

    spelled = bytes_to_unicode()
    text = "Hello WORLD'S 12345!\n\n\u4e2d\u6587 \u30ab\u30ca abc.def"
    assert [piece for piece, _ in pre_tokenizer(pre).pre_tokenize_str(text)] == \
        ["".join(spelled[byte] for byte in piece.encode()) for piece in wanted]


def test_glm4s_split_is_llama_cpps():
    # llama.cpp's CHATGLM4 split (GLM-4's and GLM-5's files): contractions in either case, letters with what precedes
    # them, numerals by three, a space before a numeral alone
    from rungen.gguf.splits import pre_tokenizer

    pieces = [piece for piece, _ in pre_tokenizer("glm4").pre_tokenize_str("Hello WORLD'S 12345!\n\nok")]
    assert pieces == ["Hello", "ĠWORLD", "'S", "Ġ", "123", "45", "!ĊĊ", "ok"]
