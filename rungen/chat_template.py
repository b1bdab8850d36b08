"""A chat template rendered by jinja2 as transformers renders it (transformers/utils/chat_template_utils.py:
_cached_compile_jinja_template and render_jinja_template), for rungen/gguf/tokenizer.py's GGUFTokenizer.

The same environment, a sandbox, with trim_blocks and lstrip_blocks, loop controls, the {% generation %} tag (its body
rendered as it is: the tool never asks for the assistant mask), tojson without HTML escaping, raise_exception,
strftime_now, a dict() and a namespace() that hold no underscore names; the same inputs: JSON-like data copied (the
tool's messages come from JSON or its own code), a message's reasoning also under the names templates read. What this
leaves out of transformers' function (continue_final_message, the assistant mask, tools given as Python functions) the
tool does not use. One thing more: transformers' sandbox refuses any change to a list or dict
(ImmutableSandboxedEnvironment), this one lets a template change its own (Kimi K2's later templates queue the ids of a
turn's calls in a list, as llama.cpp's engine renders them); what the template is given is a copy made for the one
rendering, so nothing outside it changes, and what transformers renders renders alike.
"""

from __future__ import annotations

import functools
import json
from datetime import datetime

REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def plain(value):
    """A copy of JSON-like data (what transformers' _plain_template_data makes of it), so the template's view is
    the caller's data and never the caller's objects."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, dict):
        return {plain(key): plain(item) for key, item in value.items()}
    if isinstance(value, list):
        return [plain(item) for item in value]
    if isinstance(value, tuple):
        return tuple(plain(item) for item in value)
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    return f"<{type(value).__name__}>"


def alias_reasoning(messages: list[dict]) -> list[dict]:
    """A message's reasoning under each name templates read it by (transformers' _alias_reasoning_fields)."""
    out = []
    for message in messages:
        reasoning = next((message[key] for key in REASONING_FIELDS if message.get(key) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


@functools.cache
def environment():
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import SandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        """{% generation %}...{% endgeneration %}: the body, as transformers renders it without the mask."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format):
        return datetime.now().strftime(format)

    class TemplateDict:
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):
        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check_name(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"Chat templates cannot store underscore-prefixed attributes on a namespace, but got {name!r}. "
                    "Please rename the attribute.")

    env = SandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now, dict=TemplateDict(),
                       namespace=TemplateNamespace)
    return env


@functools.lru_cache(maxsize=8)
def compiled(template: str):
    return environment().from_string(template)


def render(template: str, messages: list[dict], tools: list[dict] | None = None, documents: list[dict] | None = None,
           add_generation_prompt: bool = False, **kwargs) -> str:
    """The template's text for one conversation; jinja2.TemplateError where the template refuses it."""
    if tools is not None and not all(isinstance(tool, dict) for tool in tools):
        raise ValueError("tools are JSON schemas (dicts) here")
    chat = alias_reasoning(plain(messages))
    for message in chat:
        if not isinstance(message, dict):
            raise TypeError(f"Chat messages should be dicts, but got {message!r}.")
    return compiled(template).render(messages=chat, tools=plain(tools), documents=plain(documents),
                                     add_generation_prompt=add_generation_prompt, **plain(kwargs))
