"""Rendering a conversation with the checkpoint's chat template, and with a record's tool definitions.

Contract:
- `render(tokenizer, messages, generation_prompt, where)`: `tokenizer.apply_chat_template(tokenize=False)`; a
  conversation the template refuses (its `raise_exception`: roles must alternate, ...; a Jinja error) is a DataError
  naming `where` and the fix.
- `with_tools(tokenizer, tools, where, messages)`: the tokenizer rendering every conversation with `tools`, a record's
  tool definitions (None: the tokenizer itself). A template that writes no tools refuses them, since the model would
  learn to call tools it never sees defined: asked once per template with one user message, and where that finds
  none, again with the record's `messages` (a template may write them beside a system prompt only).
- `_key(tokenizer)`: what the per-template answers of data/chat_turn.py and data/chat_spans.py are cached under (the
  template's text, and whether tools are rendered).
"""

from __future__ import annotations

from data.jsonl import DataError


def render(tokenizer, messages: list[dict], generation_prompt: bool, where: str = "<records>") -> str:
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    except Exception as e:   # a template's raise_exception (roles must alternate, ...) or a Jinja error
        raise DataError(f"{where}: the chat template refused this conversation ({type(e).__name__}: {e}); fix the "
                        "record, or render it with another --chat-template") from e


class _WithTools:
    """The tokenizer, rendering every conversation with one record's tool definitions (`tools=`)."""

    def __init__(self, tokenizer, tools: list):
        self._tok, self._tools = tokenizer, tools

    def __getattr__(self, name):
        return getattr(self._tok, name)

    def __call__(self, *a, **k):
        return self._tok(*a, **k)

    def apply_chat_template(self, messages, **k):
        return self._tok.apply_chat_template(messages, tools=self._tools, **k)


def _key(tokenizer) -> str:
    """What the per-template answers below are cached under: the template's text, and whether tools are rendered
    (Mistral v0.3 writes them before the last user message, which moves as a conversation grows)."""
    return repr(getattr(tokenizer, "chat_template", None)) + ("+tools" if isinstance(tokenizer, _WithTools) else "")


_WRITES_TOOLS: dict = {}   # chat template text -> whether it writes the tools it is given
_PROBE_TOOL = {"type": "function", "function": {"name": "probe_9f3c1a", "description": "a probe",
                                                  "parameters": {"type": "object", "properties": {}}}}


def _writes_probe_tool(tokenizer, messages: list[dict]) -> bool | None:
    """Whether the template writes a tool it is given when rendering `messages` (None: it refuses them)."""
    try:
        return "probe_9f3c1a" in tokenizer.apply_chat_template(messages, tools=[_PROBE_TOOL], tokenize=False,
                                                               add_generation_prompt=False)
    except Exception:   # noqa: BLE001 (a template's raise_exception or a Jinja error: the real render says it)
        return None


def with_tools(tokenizer, tools: list | None, where: str, messages: list[dict] | None = None):
    """The tokenizer rendering with `tools` (None: the tokenizer itself); a template that writes no tools refused:
    asked once per template with one user message, and where that finds none, again with the record's `messages` (a
    template may write them beside a system prompt only)."""
    if not tools:
        return tokenizer
    template = repr(getattr(tokenizer, "chat_template", None))
    if template not in _WRITES_TOOLS:
        _WRITES_TOOLS[template] = _writes_probe_tool(tokenizer, [{"role": "user", "content": "Hi"}])
    writes = _WRITES_TOOLS[template]
    if not writes and messages is not None:
        writes = _writes_probe_tool(tokenizer, messages)
    if writes is False:
        raise DataError(f"{where}: the record has \"tools\", which the chat template does not write (it reads no "
                        "tools): the model would learn to call tools it never sees defined. Render it with a "
                        "template that writes them (--chat-template FILE), or drop \"tools\"")
    return _WithTools(tokenizer, tools)
