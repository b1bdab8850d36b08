"""The stages of run_generation.py, one module per concern. Which file to open:

    arguments.py   every flag, its default and its checks (parse_args), and the generation Settings they make
    controls.py    the generation controls' flags and checks, --generation_config, --assistant_model
    loading.py     the model-type table, checkpoint resolution, the default model, dtype, placement (load)
    prompts.py     reading prompts from stdin, the original script's per-model preparation, encoding
    generation.py  generation Settings -> generate() kwargs, batching, decoding a sequence, streaming
    logprobs.py    --logprobs: per-token log-probabilities, and scoring prompts (--length 0)
    output.py      writing results in input order, as text blocks or JSON lines
    processes.py   several processes under accelerate: who reads, who generates what, who writes (accelerate
                   imported only where a launcher started several)
    session.py     a session in the terminal: the prompt loop, /commands, the conversation and its context
    gguf_loading.py  a GGUF file run in its own quantized blocks, memory-mapped, its header cached
    gguf_model.py  the own model code of a GGUF file's decoder (llama, mistral, qwen2/3, phi3, gemma2/3; no
                   transformers import)
    tokenizer.py   a GGUF file's tokenizer on the tokenizers library, with transformers' results for its files
    chat_template.py  chat templates rendered by jinja2 as transformers renders them (for tokenizer.py)
    decoder.py     decoder layers over GGUF blocks (llama, mistral, qwen2/3, phi3, gemma2/3; FAMILIES says
                   what differs), fused into a few native operators
    kvcache.py     the key/value cache that grows in place (for the fused layers' native attention): the own
                   model's Cache, or layers in transformers' DynamicCache
    quantize.py    --quantize int8/int4: weight-only quantized linear layers (imported only for --quantize)
    jit.py         --jit: the traced decode step (private torch/transformers APIs; imported only for --jit)
    constrain.py   --json_schema/--regex/--grammar with xgrammar (imported only for those flags)
    ggml.py        GGUF's quantized blocks as torch layers
    server.py      --serve: the HTTP server's app and routes (FastAPI + uvicorn; imported only for --serve)
    openai_api.py  the OpenAI API's chat and completions requests: fields, generate() over the engine, answers
                   and streams; run_chat, the one chat path the other APIs translate to
    int4.py        4-bit weights in groups of 32 for torch's int4 kernels (CPU's; CUDA's tinygemm)
    embeddings.py  the server's /v1/embeddings: last-token pooling of the final hidden states over a padded batch
    messages.py    the server's /v1/messages: Anthropic's Messages API, translated to and from the chat path
    responses.py   the server's /v1/responses (OpenAI's Responses API) to and from its chat path; the stored responses
    engine.py      the generation engine of the server, the piped prompts and the session: continuous
                   batching, per-row stopping
    sampling.py    the engine's logits processors and sampler over the whole batch on its device
    slots.py       the engine's key/value cache in fixed slots (transformers' llama-shaped models) and the decode
                   step's CUDA graphs
    reasoning.py   a thinking model's reasoning apart from its answer: the block's delimiters read from the chat
                   template, the splitter of a reply, the template variables a request sets
    errors.py      the exceptions library code raises; run_generation.cli turns them into exit codes

Imports point one way: run_generation.py -> arguments/controls -> session -> engine -> generation -> the rest;
errors.py is imported by all and imports nothing. "The original script" is transformers'
examples/pytorch/text-generation/run_generation.py, which this tool grew from.
"""

import logging

__version__ = "0.3.0"
PROG = "run_generation.py"
logger = logging.getLogger("run_generation")
# What a run shows on stderr by default, between INFO (--verbose: arguments, device, loading detail) and WARNING
# (all --quiet leaves): a run's one line of figures, a first run's long steps, where a server listens.
NOTICE = 25
logging.addLevelName(NOTICE, "NOTICE")
