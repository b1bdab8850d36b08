"""The tool's token ids against llama.cpp's own tokenizer (its llama-tokenize), on the same GGUF files.

    python -m benchmarks.llama_cpp_tokenize --llama-tokenize LLAMA_CPP/build/bin/llama-tokenize
                                            [--pre smollm deepseek-coder ...] [--dir DIR]

For every `tokenizer.ggml.pre` value the tool gives llama.cpp's split (rungen/gguf/splits.py) and a few that
transformers' GGUF reading already splits (llama-bpe, qwen2, tekken, as controls), a small file in the default
model's shape with its vocabulary and merges and that value is written; each of TEXTS is tokenized by the tool (the
header cache's tokenizer, as the command line reads it) and by llama-tokenize (`--ids --no-bos`), and the rows
that differ are printed with both id lists. Files of a SentencePiece vocabulary (the default model's is byte-level
BPE) are not covered here. Exit 1 when any text differs.
"""

import argparse
import ast
import os
import subprocess
import sys
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from benchmarks.gguf_files import write_family  # noqa: E402
from rungen.gguf.splits import SPLITS  # noqa: E402

CONTROLS = ("llama-bpe", "qwen2", "tekken")
TEXTS = ["The capital of France is", " leading and  double  spaces ", "tabs\tand\nnew\r\nlines\n\n",
         "café naïve 日本語 🙂 emoji👍🏽", "x = {'k': [1, 2.5e-3]}  # code", "Ünïcödé\u00a0nbsp\u200bzero width",
         "12345 678 3.14159 1,000,000", "a    b\t\t\tc   \n\n\n  d  ", "中文分词测试，你好！한국어 텍스트",
         "e\u0301 vs \u00e9 (NFC)", "I'm sure they'll've DON'T", "def f(x):\n    return x**2  # 二乗\n",
         "Ⅻ ٢٠٢٤ ½ ²", "...!!?? -- (a|b) $x+y^2 <= ~z `q`", "Hello, world. Ok? Yes! 1.5…", "   ", "\n"]
# The default model's shape, two layers: the vocabulary is what is compared, the weights are never used.
SHAPE = dict(arch="llama", layers=2, hidden=64, heads=2, kv_heads=1, head_dim=32, ffn=128, eps=1e-5, rope_base=1e4,
             tied=True)


def fields_with_pre(source, pre):
    """The tokenizer.* metadata of the GGUF file `source`, its tokenizer.ggml.pre set to `pre`."""
    from gguf import GGUFReader
    from gguf import GGUFValueType as V

    fields = [(key, field.contents(), field.types[0], field.types[-1] if len(field.types) > 1 else None)
              for key, field in GGUFReader(source).fields.items()
              if key.startswith("tokenizer.") and key != "tokenizer.ggml.pre"]
    return fields + [("tokenizer.ggml.pre", pre, V.STRING, None)]


def llama_cpp_ids(binary, path, text):
    """llama-tokenize's ids for `text` (no BOS), from its `--ids` line ([1, 2, 3])."""
    done = subprocess.run([binary, "-m", path, "-p", text, "--ids", "--no-bos", "--log-disable"], capture_output=True,
                          text=True, check=True)
    return ast.literal_eval(done.stdout.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-tokenize", required=True, help="llama.cpp's build/bin/llama-tokenize")
    parser.add_argument("--pre", nargs="+", default=[*SPLITS, *CONTROLS], help="tokenizer.ggml.pre values")
    parser.add_argument("--dir", help="where the files go (default: a temporary folder)")
    args = parser.parse_args()
    from rungen.gguf.file import GGUFHeader
    from rungen.gguf.tokenizer import GGUFTokenizer
    from rungen.loading import default_model_file

    folder = args.dir or tempfile.mkdtemp(prefix="llama_cpp_tokenize.")
    os.makedirs(folder, exist_ok=True)
    source, differing = default_model_file(), 0
    for pre in args.pre:
        path = os.path.join(folder, f"{pre}.gguf")
        write_family(path, "llama", "Q8_0", fields_with_pre(source, pre), shape=SHAPE)
        tokenizer = GGUFTokenizer(GGUFHeader(path).cache_dir)
        rows = [(text, tokenizer.encode(text, add_special_tokens=False), llama_cpp_ids(args.llama_tokenize, path,
                                                                                         text)) for text in TEXTS]
        wrong = [(text, ours, theirs) for text, ours, theirs in rows if ours != theirs]
        differing += len(wrong)
        print(f"{pre:>16}: {len(rows) - len(wrong)} of {len(rows)} texts the same ids")
        for text, ours, theirs in wrong:
            print(f"{'':>18}{text!r}\n{'':>20}tool      {ours}\n{'':>20}llama.cpp {theirs}")
    sys.exit(1 if differing else 0)


if __name__ == "__main__":
    main()
