"""Chat records: which characters of a rendered conversation are targets, and where a long one is cut.

Contract:
- `chat_tokens(tokenizer, messages, where, tools=None)` -> (ids, target flags, the [t0, t1) tokens of the chat's
  document or None); `tools`, a record's tool definitions, are rendered with every rendering (data/chat_render.py's
  `with_tools`: a template that writes none refuses them).
- The conversation is rendered with `tokenizer.apply_chat_template(tokenize=False)`
  and the rendered string is encoded with `add_special_tokens=False` (the template writes its own
  BOS), which is exactly what `apply_chat_template(tokenize=True)` produces. Only assistant turns
  are targets: each turn's content plus the end-of-turn marker the template writes after it (e.g.
  `<|im_end|>`, `<|eot_id|>`), so the model learns to stop; the role header before it and the
  newline after it are not. No EOS is appended: the end-of-turn marker is the stop token. A message whose text holds
  a special token's text (`<|im_end|>`, `<|endoftext|>`) is refused, naming its line: the encoding would parse it
  as that control token, a turn boundary the conversation does not have. Text and prompt/completion records keep
  them (a pre-rendered chat means them), counted in `TokenStats.special`.
- A chat longer than max_len (data/tokens.py cuts it, from `chat_tokens`' document span) loses the start of its
  document, the longest message before the first assistant turn
  (a long-context task's document, with its question at the end), so the headers, the question and the answers
  stay; when the rest alone does not fit, the document keeps its last max_len // 4 tokens, and the end is cut.
  (Until 2026-12-02 a chat kept its first max_len tokens: a long document's answer was cut away, the record
  dropped.) A chat whose document is not found verbatim keeps its first `max_len` tokens.
- `check_chat_content(messages, specials, where)` refuses a message holding a special token's text
  (`special_strings(tokenizer)`: the pattern of them); `char_targets` turns character spans into token flags (also
  prompt/completion records', data/tokens.py). The assistant turns' characters are data/chat_spans.py's
  `assistant_char_spans` (data/chat_turn.py: a turn rendered as the last; data/chat_render.py: the renderings).

Character spans become token flags through the fast tokenizer's offsets, so BPE merges across a boundary cannot shift
a span.
"""

from __future__ import annotations

import re

from data.chat_render import with_tools
from data.chat_spans import assistant_char_spans
from data.jsonl import DataError


def char_targets(offsets, special, inside, at) -> list[bool]:
    """Token flags from character spans: a token with characters is a target when `inside(a, b)`; one whose span the
    tokenizer trimmed to nothing when `at(a)`. Trimming (ByteLevel trim_offsets, GPT-2/RoBERTa-style files) leaves a
    whitespace-only token at the END of its whitespace, (e, e): so whitespace opening an answer is in it (e past the
    answer's start) and whitespace closing the prompt is not (e at it). Special tokens added around the text (empty
    spans) never: an EOS is the caller's."""
    return [inside(a, b) if b > a else not sp and at(a) for (a, b), sp in zip(offsets, special)]


def document_chars(full: str, messages: list[dict], spans) -> tuple[int, int] | None:
    """The [start, end) characters in `full` of the longest message content before the first assistant turn (a
    long-context task's document, with its question at the end): where truncation cuts a chat. None when there is
    none, or its text is not found verbatim before the first answer."""
    first = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), len(messages))
    contents = [m["content"].strip() for m in messages[:first] if isinstance(m.get("content"), str)]
    if not contents or not (longest := max(contents, key=len)):
        return None
    at = full.find(longest)
    return (at, at + len(longest)) if at >= 0 and (not spans or at + len(longest) <= spans[0][0]) else None


def chat_tokens(tokenizer, messages: list[dict], where: str,
                tools: list | None = None) -> tuple[list[int], list[bool], tuple | None]:
    """Token ids, target flags and the [t0, t1) tokens of the chat's document (`document_chars`; None: unknown).
    `tools`: the record's tool definitions, rendered where the template writes them (`with_tools`)."""
    weights = [m.get("weight", 1) for m in messages if m["role"] == "assistant"]   # OpenAI's fine-tuning format
    if bad := [w for w in weights if isinstance(w, bool) or w not in (0, 1)]:   # (JSON's true is no 1: a typo of 1?)
        raise DataError(f"{where}: an assistant message's \"weight\" is {bad[0]!r}: it is 0 (not trained on: context "
                        "only) or 1 (trained on, as without the key)")
    tokenizer = with_tools(tokenizer, tools, where, messages)
    full, spans = assistant_char_spans(tokenizer, messages, where)
    doc = document_chars(full, messages, spans)
    spans = [sp for sp, w in zip(spans, weights) if w != 0]   # ("weight": 0: the turn is context, as OpenAI's)
    try:
        enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True, return_special_tokens_mask=True)
        ids = enc["input_ids"]
        flags = char_targets(enc["offset_mapping"], enc["special_tokens_mask"],
                         lambda a, b: any(a < e and b > s for s, e in spans),
                         lambda a: any(s < a <= e for s, e in spans))
        inside = [t for t, (a, b) in enumerate(enc["offset_mapping"]) if doc and b > a and a >= doc[0] and b <= doc[1]]
        return ids, flags, (inside[0], inside[-1] + 1) if inside else None
    except NotImplementedError:
        # Slow (python) tokenizers have no offsets: use token counts of string prefixes instead.
        ids = tokenizer(full, add_special_tokens=False)["input_ids"]
        flags = [False] * len(ids)
        count = lambda s: len(tokenizer(full[:s], add_special_tokens=False)["input_ids"])
        for s, e in spans:
            for t in range(count(s), count(e)):
                flags[t] = True
    return ids, flags, None   # (no offsets: a long chat keeps its start)


def special_strings(tokenizer):
    """A pattern matching the text of any of the tokenizer's special tokens (None: it has none). Encoding parses them
    in text as those control tokens."""
    found = {t for t in getattr(tokenizer, "all_special_tokens", ()) if t}
    found |= {t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values() if t.special and t.content}
    return re.compile("|".join(map(re.escape, sorted(found, key=len, reverse=True)))) if found else None


def _strings(value, key: str):
    """(key path, text) of every string in a message's value: its content, and any other key a template may render
    (`reasoning_content`, `tool_calls` arguments, a content list's text parts)."""
    if isinstance(value, str):
        yield key, value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _strings(v, f"{key}.{k}" if key else str(k))
    elif isinstance(value, (list, tuple)):
        for n, v in enumerate(value):
            yield from _strings(v, f"{key}[{n}]")


def check_chat_content(messages: list[dict], specials, where: str, tools: list | None = None) -> None:
    """Refuse a message any of whose text (content, reasoning_content, tool calls: whatever the template may render)
    holds a special token, or a tool definition that does: the rendering would hold that control token, a turn
    boundary the conversation does not have (a fake turn, an answer that stops early)."""
    if not specials:
        return
    for key, text in _strings(tools or [], "tools"):
        if hit := specials.search(text):
            raise DataError(f"{where}: {key} holds the special token {hit.group()!r} (at character {hit.start()}), "
                            "which encodes as that control token, not as text; remove or respell it")
    for i, m in enumerate(messages):
        for key, text in _strings(m, ""):
            if hit := specials.search(text):
                raise DataError(f"{where}: message {i} ({m.get('role')}) holds the special token {hit.group()!r} in "
                                f"{key!r} (at character {hit.start()}), which encodes as that control token, not as "
                                "text: a turn boundary the conversation does not have. Remove or respell it (the "
                                'template writes the turns\' own tokens), or write the record as {"text": ...} with '
                                "the tokens meant")
