"""Assistant message i rendered as the conversation's last turn: where its target text starts, where its content
is, and what the template writes after it that is the turn's.

The first half of data/chat_spans.py's flow (its docstring has the whole), each answer a rendering compared with
another, the per-template ones asked once per template (`_key`):
- `_prefixrender`: the conversation up to message i with `add_generation_prompt=True`; where that string ends the
  turn's target text starts (None: the template ignores the flag, and renders the same string either way, ending
  before the role header).
- `_content_at`: where the turn's content starts in its rendering through message i: where the template writes a
  sentinel (`_SENTINEL`) put in its place, so an answer that also occurs in the end-of-turn marker, 'd' in
  '<|im_end|>', or an empty one, is not looked for by its text; and whether the template writes the content at all.
- `_header`: the generation prompt before the turn (its role header), "" when the template writes none.
- `_turn_tail`: what the template writes after the content that is the turn's (tool calls, the end-of-turn marker),
  but a trailer it writes after the last turn only (Phi-3's EOS: found by rendering one more message after the turn,
  the tokens both renderings write there are the turn's; asked once per template whether it has one).
"""

from __future__ import annotations

from data.chat_render import _key, render
from data.jsonl import DataError

_WRITES_PROMPT: dict = {}   # chat template text -> whether it writes a generation prompt
_PROBE_PROMPT: dict = {}   # chat template text -> the generation prompt it writes after a probe user message


def _prefixrender(tokenizer, messages: list[dict]) -> str | None:
    """The rendering up to where the next assistant turn's text starts (None if it cannot render, or the template
    ignores add_generation_prompt: that rendering then ends before the turn's role header)."""
    template, probe = _key(tokenizer), [{"role": "user", "content": "Hi"}]
    if template not in _WRITES_PROMPT:   # (asked once per template, not per turn)
        try:
            with_prompt, bare = render(tokenizer, probe, True), render(tokenizer, probe, False)
            _WRITES_PROMPT[template] = with_prompt != bare
            _PROBE_PROMPT[template] = with_prompt[len(bare):] if with_prompt.startswith(bare) else ""
        except Exception:   # a template that refuses the probe: asked per conversation
            _WRITES_PROMPT[template] = None
    try:  # some templates index messages[0] and fail on an empty conversation
        with_prompt = render(tokenizer, messages, True)
        if _WRITES_PROMPT[template] is None:
            return with_prompt if with_prompt != render(tokenizer, messages, False) else None
        return with_prompt if _WRITES_PROMPT[template] else None
    except Exception:
        return None


_SENTINEL = "@@answer-9f3c1a@@"   # text no template rewrites and no answer holds


def _content_at(tokenizer, messages: list[dict], i: int, through: str) -> tuple[int, int, bool, str]:
    """Where assistant message i's content, stripped, starts in `through`, its rendering as the last turn, and where
    its text as given (leading whitespace too) does: where the template writes a sentinel put in its place, when the
    content sits there (an answer that also occurs in the end-of-turn marker, 'd' in '<|im_end|>', or an empty one, is
    found where it is written); else, where the template writes it otherwise (a reasoning block put before it), the
    stripped content's last occurrence (-1: none). Third: whether the template writes the content at all (Mistral's
    and Llama 3.1's drop it beside tool_calls: then the turn starts where a plain answer's text would)."""
    raw = messages[i]["content"]
    content = raw.strip()
    try:
        probe = render(tokenizer, messages[:i] + [{**messages[i], "content": _SENTINEL}], False)
    except DataError:
        probe = ""
    at = probe.find(_SENTINEL)
    if probe and at < 0:   # not written: the turn is what the template writes in its place (its tool calls), from
        try:   # where a plain answer's text would start (Mistral v0.3 moves the system prompt to the last user turn)
            plain = render(tokenizer, messages[:i] + [{"role": "assistant", "content": _SENTINEL}], False)
        except DataError:
            return -1, -1, False, ""
        cut = plain.find(_SENTINEL)
        at = next((k for k in range(min(cut, len(through))) if plain[k] != through[k]), min(cut, len(through)))
        return (at if cut >= 0 else -1), (at if cut >= 0 else -1), False, ""
    if at >= 0 and through.startswith(probe[:at]):
        tail = probe[at + len(_SENTINEL):]   # (what follows the content: then it is through[at:end] exactly)
        written = through[at:len(through) - len(tail)] if through.endswith(tail) else None
        if written is not None and written.strip() == content:   # as given, or trimmed ('\n' off by Qwen3's)
            return at + len(written) - len(written.lstrip()), at, True, content
        if through.startswith(raw, at):
            return at + len(raw) - len(raw.lstrip()), at, True, content
        if through.startswith(content, at):   # (the template trims it)
            return at, at, True, content
        if written is not None:   # the template rewrites the content (drops a reasoning part before '</think>'):
            # the turn's text is what it writes there (a search for the content as given found a user message holding
            # the same text, and trained that)
            return at + len(written) - len(written.lstrip()), at, True, written.strip()
    elif at >= 0 and through.endswith(tail := probe[at + len(_SENTINEL):]):   # the template writes the turn otherwise
        # before the content too (Qwen3 moves an answer's reasoning, 'r</think>ans', into a think block it writes
        # before it): the turn's own text is where the two renderings part up to the text after the content
        lcp = next((k for k in range(min(at, len(through))) if probe[k] != through[k]), min(at, len(through)))
        region = through[lcp:len(through) - len(tail)]
        if (k := region.rfind(content)) >= 0:
            return lcp + k, lcp, True, content
        return lcp + len(region) - len(region.lstrip()), lcp, True, region.strip()
    try:   # searched for past what the conversation before it renders alike (never in an earlier message)
        bare = render(tokenizer, messages[:i], False)
    except DataError:
        bare = ""
    lo = next((k for k, (x, y) in enumerate(zip(bare, through)) if x != y), min(len(bare), len(through)))
    at = through.rfind(content, lo)
    return at, at, True, content


def _header(tokenizer, messages: list[dict], i: int, before: str | None) -> str:
    """The generation prompt before assistant message i ('<|im_start|>assistant\\n'): `before` past the conversation
    so far; "" when the template writes none. Before a first message (transformers renders no empty conversation),
    the one it writes after a probe user message."""
    if before is None and i == 0 and _WRITES_PROMPT.get(_key(tokenizer)):
        return _PROBE_PROMPT[_key(tokenizer)]   # (`_prefixrender`'s probe, asked once per template)
    if before is None:
        return ""
    bare = render(tokenizer, messages[:i], False)
    return before[len(bare):] if before.startswith(bare) else ""


_TRAILER: dict = {}   # chat template text -> whether it writes text after the last turn only (Phi-3's EOS)


def _turn_tail(tokenizer, messages: list[dict], i: int, through: str, ce: int) -> str:
    """What the template writes after assistant message i's content (at `ce` in `through`, its rendering as the last
    turn) that is the turn's: the text it writes there also when a message follows (a trailer written after the
    last turn only, Phi-3's EOS, is not), trailing whitespace off. Where the probe cannot tell, all of it."""
    rest = through[ce:]
    template = _key(tokenizer)
    if template not in _TRAILER:   # (asked once per template: most write nothing after the last turn alone)
        probe = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": _SENTINEL}]
        try:
            one, two = (render(tokenizer, m, False) for m in (probe, probe + [{"role": "user", "content": "Hi"}]))
            at = one.find(_SENTINEL) + len(_SENTINEL)
            _TRAILER[template] = not (at >= len(_SENTINEL) and two.startswith(one[:at]) and
                                      two[at:].startswith(one[at:].rstrip()))
        except DataError:
            _TRAILER[template] = True
    if not _TRAILER[template]:
        return rest.rstrip()
    try:
        nxt = render(tokenizer, messages[: i + 1] + [{"role": "user", "content": _SENTINEL}], False)
    except DataError:
        nxt = ""
    if not nxt.startswith(through[:ce]):   # (the template rewrites the turn once one follows: Qwen3's reasoning)
        return rest.rstrip()
    if nxt[ce:].startswith(rest):
        return rest.rstrip()
    try:   # the tokens both write: '<|im_end|>', '\n' of '<|im_end|>\n<|endoftext|>' and '<|im_end|>\n<|im_start|>...'
        a, b = (tokenizer(x, add_special_tokens=False, return_offsets_mapping=True) for x in (rest, nxt[ce:]))
        k = next((k for k, (x, y) in enumerate(zip(a["input_ids"], b["input_ids"])) if x != y), len(a["input_ids"]))
        return rest[:a["offset_mapping"][k - 1][1] if k else 0].rstrip()
    except NotImplementedError:   # (a slow tokenizer: the characters both write, to a whitespace)
        n = next(n for n in range(len(rest) + 1) if n == len(rest) or rest[n] != nxt[ce + n:ce + n + 1])
        if n < len(rest) and not rest[n - 1:n].isspace():
            n = max((j + 1 for j in range(n) if rest[j].isspace()), default=0)
        return rest[:n].rstrip()
