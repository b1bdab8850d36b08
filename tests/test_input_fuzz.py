"""The command line's inputs under property-based fuzzing (hypothesis), in-process through run_generation.cli:
--input_format jsonl lines (each bad one gets one error record, the good ones their text, exit 1), flag values
(a bad one is one line and exit 2, never a traceback), and GGUF headers (a broken one is one line and exit 2,
and leaves no half-written header cache)."""

import json
import os
import re
import struct

import pytest
from hypothesis import HealthCheck, assume, example, given, seed, settings
from hypothesis import strategies as st
from test_server import build_chat_llama

import run_generation
import rungen.loading
from helpers import run_main
from rungen.arguments import build_parser
from tiny_models import write_out

FAST = settings(deadline=None, database=None, suppress_health_check=list(HealthCheck))
ERROR_LINE = re.compile(r"run_generation\.py: error: \S.*")


def one_line_error(result):
    """The exit code, checking that stderr ends with the tool's one-line error, and holds no traceback and no
    usage block."""
    stderr = result.stderr.decode()
    assert "Traceback" not in stderr and "usage:" not in stderr, stderr[-3000:]
    lines = stderr.strip().splitlines()
    assert lines and ERROR_LINE.fullmatch(lines[-1]), stderr[-2000:]
    return result.returncode


#
# --input_format jsonl
#


@pytest.fixture(scope="module")
def chat_llama(tmp_path_factory):
    """A tiny llama with a chat template (as an instruct checkpoint has), so that "messages" lines run."""
    return build_chat_llama(str(tmp_path_factory.mktemp("input_fuzz") / "llama"))


GOOD_LINES = [{"prompt": "The capital of France is"}, {"prompt": "Hello", "id": 7, "meta": {"tags": ["a", 1.5]}},
              {"messages": [{"role": "user", "content": "Hi there"}]}, {"prompt": ""}]
JSONL_ARGS = ["--input_format", "jsonl", "--temperature", "0", "--length", "3"]


def jsonl_args(path, output_format):
    return ["--model_name_or_path", path, *JSONL_ARGS, "--output_format", output_format]


@pytest.fixture(scope="module")
def expected_texts(chat_llama):
    """Each good line's greedy continuation, from a run of the good lines alone."""
    stdin = "\n".join(json.dumps(line) for line in GOOD_LINES)
    result = run_main(jsonl_args(chat_llama, "jsonl"), stdin=stdin)
    assert result.returncode == 0, result.stderr.decode()[-2000:]
    return [json.loads(line)["generated_text"] for line in result.stdout.decode().splitlines()]


def deep(depth):
    return "[" * depth + "]" * depth


VALUES = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
                      | st.text(max_size=8), lambda inner: st.lists(inner, max_size=3)
                      | st.dictionaries(st.text(max_size=5), inner, max_size=3), max_leaves=8)
BAD_LINES = st.one_of(
    st.text(max_size=30).filter(lambda text: text.strip() and "\n" not in text and not text.strip().startswith("{"))
    .map(str.encode),  # not an object (blank lines are no prompts)
    st.just(b'{"prompt": "x"'),  # truncated
    st.just(b'{"prompt": "x", "seed": NaN}'), st.just(b'{"prompt": "x", "w": -Infinity}'),
    st.just(b'{"prompt": "x", "w": 1e999}'), st.just(b'{"prompt": "\\ud800"}'),
    st.just(b'{"prompt": "x", "k\\udfff": 1}'),
    st.integers(65, 20_000).map(lambda n: f'{{"prompt": "x", "nest": {deep(n)}}}'.encode()),
    st.just(b'{"prompt": "x", "n": ' + b"9" * 5000 + b"}"),  # past Python's 4,300-digit integers
    st.binary(min_size=1, max_size=3).map(lambda junk: b'{"prompt": "caf\xc3' + junk + b'"}').filter(
        lambda line: not _utf8(line) and b"\n" not in line),  # a newline byte would make it two lines
    VALUES.filter(lambda v: not isinstance(v, dict)).map(lambda v: json.dumps(v).encode()),
    st.dictionaries(st.sampled_from(["prompt", "messages"]), VALUES, min_size=1).filter(
        lambda record: not isinstance(record.get("prompt"), str)
        and not (isinstance(record.get("messages"), list) and record["messages"])).map(
        lambda record: json.dumps(record).encode()),
    st.lists(st.fixed_dictionaries({"role": VALUES, "content": VALUES}), min_size=1, max_size=2).filter(
        lambda messages: any(not isinstance(m["role"], str) or not isinstance(m["content"], str) for m in messages)
    ).map(lambda messages: json.dumps({"messages": messages}).encode()),
    st.sampled_from(["text", "error", "prompt_index", "generated_text", "finish_reason"]).map(
        lambda field: json.dumps({"prompt": "x", field: 1}).encode()),  # would overwrite the record's own
    st.just(json.dumps({"prompt": "word " * 300}).encode()),  # longer than the context
)


def _utf8(data):
    try:
        data.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


LINES = st.lists(st.one_of(st.integers(0, len(GOOD_LINES) - 1), BAD_LINES), min_size=1, max_size=5)


def check_jsonl_run(chat_llama, expected_texts, lines, output_format):
    stdin = b"\n".join(json.dumps(GOOD_LINES[line]).encode() if isinstance(line, int) else line for line in lines)
    result = run_main(jsonl_args(chat_llama, output_format), stdin=stdin)
    stderr = result.stderr.decode()
    assert "Traceback" not in stderr, stderr[-3000:]
    bad = [number for number, line in enumerate(lines) if not isinstance(line, int)]
    assert result.returncode == (1 if bad else 0), stderr[-2000:]
    if output_format == "jsonl":
        records = [json.loads(line) for line in result.stdout.decode().splitlines()]
        assert [record["prompt_index"] for record in records] == list(range(len(lines)))
        for record, line in zip(records, lines):
            if isinstance(line, int):
                assert "error" not in record and record["generated_text"] == expected_texts[line], record
            else:
                assert isinstance(record["error"], str) and "generated_text" not in record, record
    else:
        errors = [line for line in stderr.splitlines() if re.match(r"run_generation\.py: prompt \d+: error: ", line)]
        assert [int(line.split()[2].rstrip(":")) - 1 for line in errors] == bad, stderr[-2000:]
        blocks = re.findall(r"^=== PROMPT (\d+), GENERATED SEQUENCE 1 ===$", result.stdout.decode(), re.M)
        if len(lines) > 1:
            assert [int(block) - 1 for block in blocks] == [n for n in range(len(lines)) if n not in bad]
        if bad:
            assert stderr.strip().splitlines()[-1] == f"run_generation.py: error: {len(bad)} of {len(lines)} " \
                                                      "prompts failed"


@seed(20261125)
@settings(FAST, max_examples=40)
@given(lines=LINES, output_format=st.sampled_from(["jsonl", "text"]))
def test_jsonl_lines_each_bad_one_an_error_record(chat_llama, expected_texts, lines, output_format):
    check_jsonl_run(chat_llama, expected_texts, lines, output_format)


@pytest.mark.slow
@settings(FAST, max_examples=150)
@given(lines=LINES, output_format=st.sampled_from(["jsonl", "text"]))
def test_jsonl_lines_each_bad_one_an_error_record_at_length(chat_llama, expected_texts, lines, output_format):
    check_jsonl_run(chat_llama, expected_texts, lines, output_format)


#
# Flag values
#


class LoadReached(Exception):
    """The flags passed every check made before the model is loaded."""


def flag_table():
    """(option, kind) for every flag that takes a value: kind is int, float, choices or text."""
    table = []
    for action in build_parser()._actions:
        if not action.option_strings or action.nargs == 0 or action.dest == "help":
            continue
        kind = "choices" if action.choices else action.type if action.type in (int, float) else "text"
        table.append((action.option_strings[0], kind, action.choices))
    return table


FLAGS = flag_table()
NASTY = st.sampled_from(["", " ", "-1", "0", "1", "-0", "nan", "NaN", "inf", "-inf", "1e999", "-1e999", "abc",
                         "1.5", "0x10", "1_000", "9" * 30, "-" + "9" * 30, "--", "-", "=", "\u00e9", "\U0001f600",
                         "1e-400", "0.0", "2", "100"])


@st.composite
def flag_values(draw):
    numeric = [flag for flag in FLAGS if flag[1] in (int, float)]
    option, kind, choices = draw(st.sampled_from(numeric) | st.sampled_from(FLAGS))
    options = [NASTY, st.text(max_size=6).filter(lambda text: "\x00" not in text)]
    if kind is int:
        options.append(st.integers(-(2**70), 2**70).map(str))
    elif kind is float:
        options += [st.floats().map(repr), st.sampled_from(["nan", "inf", "-inf", "1e999", "-nan", "Infinity"])]
    elif kind == "choices":
        options.append(st.sampled_from([str(choice) for choice in choices]))
    return option, draw(st.one_of(options))


@st.composite
def command_lines(draw):
    pairs = draw(st.lists(flag_values(), min_size=1, max_size=3, unique_by=lambda pair: pair[0]))
    argv = []
    for option, value in pairs:
        argv += [f"{option}={value}"] if value.startswith("-") and draw(st.booleans()) else [option, value]
    if draw(st.booleans()):
        argv.append(draw(st.sampled_from(["--no_such_flag", "--lenght", "stray"])))
    return argv


def not_finite(value):
    try:
        number = float(value)
    except ValueError:
        return False
    return number != number or number in (float("inf"), float("-inf"))


def check_flags(monkeypatch, argv):
    def reached(*args, **kwargs):
        raise LoadReached

    monkeypatch.setattr(run_generation, "load", reached)
    monkeypatch.setattr(rungen.loading, "load", reached)
    result = run_main([*argv, "--prompt", "Hi"])
    if "LoadReached" in result.stderr.decode():
        floats = {option for option, kind, _ in FLAGS if kind is float}
        given_values = list(zip(argv, argv[1:])) + [tuple(arg.split("=", 1)) for arg in argv if "=" in arg]
        assert not any(option in floats and not_finite(value) for option, value in given_values), argv
        return
    assert one_line_error(result) == 2, argv


@seed(20261125)
@settings(FAST, max_examples=120)
@given(argv=command_lines())
@example(argv=["--generation_config=--"])  # argparse's [] for a flag of any type, found at length
@example(argv=["--tools=--"])
def test_any_flag_value_is_accepted_or_one_line(monkeypatch, argv):
    check_flags(monkeypatch, argv)


@pytest.mark.slow
@settings(FAST, max_examples=500)
@given(argv=command_lines())
def test_any_flag_value_is_accepted_or_one_line_at_length(monkeypatch, argv):
    check_flags(monkeypatch, argv)


#
# GGUF headers
#


def write_tiny_gguf(path, architecture="llama", vocab=64, hidden=32):
    """A small, valid llama GGUF file (F32 weights, a byte-level BPE vocabulary of `vocab` tokens)."""
    import numpy as np
    from gguf import GGUFWriter

    rng = np.random.default_rng(0)
    writer = GGUFWriter(str(path), architecture)
    writer.add_context_length(64)
    writer.add_embedding_length(hidden)
    writer.add_block_count(1)
    writer.add_feed_forward_length(hidden * 2)
    writer.add_head_count(2)
    writer.add_head_count_kv(2)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(hidden // 2)
    writer.add_vocab_size(vocab)
    writer.add_tokenizer_model("gpt2")
    tokens = ["<s>", "</s>"] + [chr(ord("a") + n % 26) * (1 + n // 26) for n in range(vocab - 2)]
    writer.add_token_list(tokens)
    writer.add_token_types([3, 3] + [1] * (vocab - 2))
    writer.add_token_scores([0.0] * vocab)
    writer.add_token_merges([])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)
    shapes = {"token_embd.weight": (vocab, hidden), "output_norm.weight": (hidden,),
              "blk.0.attn_norm.weight": (hidden,), "blk.0.ffn_norm.weight": (hidden,),
              "blk.0.attn_q.weight": (hidden, hidden), "blk.0.attn_k.weight": (hidden, hidden),
              "blk.0.attn_v.weight": (hidden, hidden), "blk.0.attn_output.weight": (hidden, hidden),
              "blk.0.ffn_gate.weight": (hidden * 2, hidden), "blk.0.ffn_up.weight": (hidden * 2, hidden),
              "blk.0.ffn_down.weight": (hidden, hidden * 2)}
    for name, shape in shapes.items():
        writer.add_tensor(name, rng.normal(0, 0.1, shape).astype(np.float32))
    return write_out(writer, path)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gguf_fuzz")
    path = write_tiny_gguf(folder / "tiny.gguf")
    result = run_main(["--model_name_or_path", path, "--prompt", "ab", "--length", "2", "--temperature", "0"],
                      cache_home=folder / "cache")
    assert result.returncode == 0, result.stderr.decode()[-3000:]  # the unbroken file runs
    return path


def header_fields(path):
    """[(name, offset, size, kind)] of the header's numbers worth breaking: the counts, each key's value
    length and type, each tensor's dimensions, type and offset; from the gguf package's reader."""
    from gguf import GGUFReader, GGUFValueType

    reader = GGUFReader(path)
    fields = [("tensor count", 8, 8, "count"), ("key count", 16, 8, "count")]
    for name, field in reader.fields.items():
        if name.startswith("GGUF."):
            continue
        start = int(field.offset)
        key_length = int(field.parts[0][0])
        fields.append((f"{name} type", start + 8 + key_length, 4, "type"))
        if field.types and field.types[0] == GGUFValueType.ARRAY:
            fields.append((f"{name} element type", start + 12 + key_length, 4, "type"))
            fields.append((f"{name} count", start + 16 + key_length, 8, "count"))
        elif field.types and field.types[0] == GGUFValueType.STRING:
            fields.append((f"{name} length", start + 12 + key_length, 8, "count"))
    for tensor in reader.tensors:
        start = int(tensor.field.offset)
        name_length = len(tensor.name.encode())
        dims = len(tensor.shape)
        fields.append((f"{tensor.name} dims", start + 8 + name_length, 4, "count"))
        for number in range(dims):
            fields.append((f"{tensor.name} dim {number}", start + 12 + name_length + 8 * number, 8, "dim"))
        after = start + 12 + name_length + 8 * dims
        fields.append((f"{tensor.name} type", after, 4, "type"))
        fields.append((f"{tensor.name} offset", after + 4, 8, "offset"))
    return fields


class Short(bytes):
    def __repr__(self):  # a failing example prints it; the description says what changed
        return f"<{len(self)} bytes>"


@st.composite
def broken_ggufs(draw, data, fields):
    """(description, bytes): the file cut short, or one header number set to something it should not be."""
    if draw(st.integers(0, 4)) == 0:
        cut = draw(st.integers(0, len(data) - 1))
        return f"cut at {cut}", Short(data[:cut])
    name, offset, size, kind = draw(st.sampled_from(fields))
    big = 2 ** (8 * size) - 1
    value = draw(st.sampled_from([0, 1, 2, 3, 7, 31, 41, 255, 2**31 - 1, 2**31, 2**32 - 1, big, big // 2])
                 | st.integers(0, big))
    assume(value < 2 ** (8 * size))
    raw = value.to_bytes(size, "little")
    assume(raw != data[offset:offset + size])
    return f"{name} = {value}", Short(data[:offset] + raw + data[offset + size:])


@pytest.fixture(scope="module")
def gguf_bytes(tiny_gguf):
    with open(tiny_gguf, "rb") as f:
        data = Short(f.read())
    return data, header_fields(tiny_gguf)


def check_gguf(tmp_path, data, monkeypatch, flags=()):
    path = tmp_path / "broken.gguf"
    path.write_bytes(data)
    cache = tmp_path / "cache"
    result = run_main(["--model_name_or_path", str(path), "--prompt", "ab", "--length", "2", *flags],
                      cache_home=cache)
    if result.returncode != 0:  # a change that leaves a runnable file may run
        assert one_line_error(result) == 2
    entries = cache / "run_generation" / "gguf"
    for entry in os.listdir(entries) if entries.is_dir() else []:
        assert not entry.startswith(".tmp-"), entry  # no half-written header cache
        files = set(os.listdir(entries / entry))
        assert {"tensors.json", "config.json"} <= files, files
        json.load(open(entries / entry / "tensors.json"))


def fuzz_headers(gguf_bytes, tmp_path_factory, monkeypatch, examples, flags=(), fixed_seed=None):
    """check_gguf on `examples` files broken anywhere (seeded where `fixed_seed` is given)."""
    data, fields = gguf_bytes

    @settings(FAST, max_examples=examples)
    @given(case=broken_ggufs(data, fields))
    def run(case):
        check_gguf(tmp_path_factory.mktemp("broken"), case[1], monkeypatch, flags)

    (seed(fixed_seed)(run) if fixed_seed is not None else run)()


def test_gguf_headers_broken_anywhere_fail_in_one_line(gguf_bytes, tmp_path_factory, monkeypatch):
    fuzz_headers(gguf_bytes, tmp_path_factory, monkeypatch, 60, fixed_seed=20261125)


def test_gguf_headers_broken_anywhere_fail_in_one_line_dequantized(gguf_bytes, tmp_path_factory, monkeypatch):
    """--dequantize: transformers' reader reads the file, and what it trips on is one line too."""
    fuzz_headers(gguf_bytes, tmp_path_factory, monkeypatch, 30, ["--dequantize"], fixed_seed=20261129)


@pytest.mark.slow
def test_gguf_headers_broken_anywhere_fail_in_one_line_at_length(gguf_bytes, tmp_path_factory, monkeypatch):
    fuzz_headers(gguf_bytes, tmp_path_factory, monkeypatch, 250)


def test_gguf_of_an_unknown_architecture_fails_in_one_line(tmp_path):
    path = write_tiny_gguf(tmp_path / "unknown.gguf", architecture="no-such-arch")
    result = run_main(["--model_name_or_path", path, "--prompt", "ab"], cache_home=tmp_path / "cache")
    assert one_line_error(result) == 2
    assert not os.path.isdir(tmp_path / "cache" / "run_generation" / "gguf") or not any(
        entry.startswith(".tmp-") for entry in os.listdir(tmp_path / "cache" / "run_generation" / "gguf"))


def test_struct_layout_of_the_header_fields(gguf_bytes):
    """The offsets the fuzzing writes at are the header's own: the counts read back as the file's."""
    data, fields = gguf_bytes
    tensors, keys = struct.unpack_from("<QQ", data, 8)
    assert tensors == 11 and keys > 10
    dims = [f for f in fields if f[0] == "token_embd.weight dim 1"]
    assert dims and struct.unpack_from("<Q", data, dims[0][1])[0] == 64  # the vocabulary
