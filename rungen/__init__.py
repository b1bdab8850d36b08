"""The stages of run_generation.py, one module per concern. Which file to open:

    arguments.py   every flag, its default and its validation (parse_args)
    loading.py     the model-type table, checkpoint resolution, the default model, dtype, placement (load)
    prompts.py     reading prompts from stdin, the seed's per-model preparation, encoding
    generation.py  generation settings -> generate() kwargs, batching, decoding a sequence, streaming
    output.py      writing results in input order, as text blocks or JSON lines
    processes.py   several processes under accelerate: who reads, who generates what, who writes
    quantize.py    --quantize int8/int4: weight-only quantized linear layers (imported only for --quantize)
    jit.py         --jit: the traced decode step (private torch/transformers APIs; imported only for --jit)
    session.py     a session in the terminal: the prompt loop, /commands, the conversation and its context
    controls.py    generation controls: their flags and checks, --generation_config, --assistant_model
    logprobs.py    --logprobs: per-token log-probabilities, and scoring prompts (--length 0)
    constrain.py   --json_schema/--regex/--grammar with xgrammar (imported only for those flags)
    server.py      --serve: the OpenAI-compatible HTTP server (FastAPI + uvicorn; imported only for --serve)
    engine.py      the server's model thread: continuous batching, per-row sampling and stopping

run_generation.py's main() calls them in that order (session.py instead of the batches when stdin is a
terminal); nothing here keeps state between calls.
"""

import logging
import sys

PROG = "run_generation.py"
logger = logging.getLogger("run_generation")


def fail(message, code=2):
    """Bad input: one line on stderr and a non-zero exit, never a traceback."""
    print(f"{PROG}: error: {message}", file=sys.stderr, flush=True)
    sys.exit(code)
