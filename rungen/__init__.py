"""The stages of run_generation.py, one module per concern. Which file to open:

    arguments.py   every flag, its default and its checks (parse_args), and the generation Settings they make
    controls.py    the generation controls' flags and checks, --generation_config, --assistant_model
    loading.py     the model-type table, checkpoint resolution, the default model, dtype, placement (load)
    prompts.py     reading prompts (argument, stdin, jsonl), the original script's per-model preparation, encoding
    conversation.py  OpenAI chat messages read and checked, for jsonl lines and the server's chat requests alike
    generation.py  generation Settings -> generate() kwargs, batching, decoding a sequence, streaming
    batch.py       the command line's prompts and a session's turns on the engine, or why generate() runs them
    logprobs.py    --logprobs: per-token log-probabilities, and scoring prompts (--length 0)
    output.py      writing results in input order, as text blocks or JSON lines
    interrupt.py   Ctrl-C ends the generation at its next step, what came kept (the command line, the session)
    processes.py   several processes under accelerate: who reads, who generates what, who writes
    session.py     a session in the terminal: the prompt loop, /commands, the conversation and its context
    gguf/          the GGUF runtime: a file run in its own quantized blocks (its __init__ lists its modules)
    chat_template.py  chat templates rendered by jinja2 as transformers renders them
    kvcache.py     the key/value cache that grows in place, for the fused layers' native attention
    quantize.py    --quantize int8/int4: weight-only quantized linear layers
    int4.py        4-bit weights in groups of 32 for torch's int4 kernels (CPU's; CUDA's tinygemm)
    int8.py        int8 weights a scale an output channel: torch's CPU kernel; a Triton kernel on CUDA
    int4_kernel.py 4-bit codes two a byte for a Triton kernel on CUDA, where tinygemm cannot run or is not asked for
    code_triton.py the Triton kernels of packed codes and the widening one (imported only where Triton is)
    jit.py         --jit: the traced decode step (private torch/transformers APIs)
    constrain.py   --json_schema/--regex/--grammar with xgrammar
    tools.py       tool calling: a request's tools, the conversation for the template, the calls' grammar
    tool_formats.py  the families' call formats, one row each, and which one a chat template asks for
    tool_reply.py  a reply's content and calls, read whole or as it grows
    tool_xml.py    tool calls written as XML (Qwen3.5's, GLM's, DeepSeek's DSML), read from a growing reply
    tool_python.py Python's literals as call values (LFM2.5's), written and read into JSON as they grow
    reasoning.py   a thinking model's reasoning apart from its answer: delimiters, the reply's splitter
    engine.py      the engine's scheduler (server, piped prompts, session): its queue and thread, admission
    prefill.py     a request's prompt through the model before it joins: alone, or several in one pass into slots
    decode.py      the rows decoded together: a step for all at once (on a GPU launched before the last is read)
    requests.py    what the engine takes and gives: a Request and its events (Delta, Done, End)
    rows.py        a row of the batch: the tokens picked for all rows at once, the text each adds, stop strings
    sampling.py    the engine's logits processors and sampler over the whole batch on its device
    host_memory.py freed weight-sized buffers given back to the system (glibc's malloc_trim)
    transfers.py   the decode loop's small copies to and from a GPU, made without waiting for it; the accelerators
                   a spread model sits on
    batch_cache.py the batch's keys/values: fixed slots (slots.py) or a left-padded cache, behind one interface
    slots.py       the key/value cache in fixed slots, the prefill into them and the decode step's CUDA graphs
    prefix_cache.py  finished sequences' keys/values that a request starting the same way reuses
    server.py      --serve: the HTTP server's app and routes (FastAPI + uvicorn)
    metrics.py     the server's counters and histograms as Prometheus text
    openai_api.py  the OpenAI chat and completions requests; run_chat, the chat path the other APIs translate to
    messages.py    the server's /v1/messages: Anthropic's Messages API, to and from the chat path
    responses.py   the server's /v1/responses: OpenAI's Responses API, to and from the chat path
    response_store.py  stored responses: previous_response_id, GET, DELETE and input_items
    embeddings.py  the server's /v1/embeddings: last-token pooling of the final hidden states
    strict_json.py strict JSON for request bodies and jsonl lines
    errors.py      the exceptions library code raises; run_generation.cli turns them into exit codes

Imports point one way: run_generation.py -> arguments -> server, the APIs and session -> batch -> engine ->
generation -> prompts -> loading -> gguf -> the rest; errors.py and conversation.py import nothing of the package.
Optional dependencies (accelerate, xgrammar, FastAPI) are imported only where used.
"The original script" is transformers' examples/pytorch/text-generation/run_generation.py.
"""

import logging

__version__ = "0.3.0"
PROG = "run_generation.py"
logger = logging.getLogger("run_generation")
# stderr's default level, between INFO (--verbose) and WARNING (--quiet): a run's figures, long first steps.
NOTICE = 25
logging.addLevelName(NOTICE, "NOTICE")
