"""Where each assistant turn is in a rendered conversation: `assistant_char_spans(tokenizer, messages, where)` ->
(the full rendering, each assistant turn's [start, end) characters in it), the targets of a chat record
(data/chat.py) and --chat-template's start-up probe (data/templates.py).

Assistant spans are found without `{% generation %}` tags (real Qwen/Llama templates lack them):
render the conversation up to message i with `add_generation_prompt=True`; where that string ends
the turn's target text starts (a template that ignores the flag renders the same string either way, ending before
the role header: then the turn starts where its content does, found by rendering a sentinel in its place, so an
answer that also occurs in the end-of-turn marker, 'd' in '<|im_end|>', or an empty one, is not looked for by its
text). Render it through message i; the turn is the content and what the template writes after it (tool calls, the
end-of-turn marker) but a trailer it writes after the last turn only (Phi-3's EOS: found by rendering one more message
after the turn, the tokens both renderings write there are the turn's; asked once per template whether it has one).
Both renderings are prefixes of the full one for ordinary templates. Templates that rewrite earlier turns once later
ones exist (Qwen3 drops old reasoning) break the second prefix, so then the turn's content is searched for in the
full rendering after its start and before the first end-of-turn marker after it (a later turn may repeat it), and what
follows it is matched right after it (else its first word, the marker). A turn whose earlier turns render otherwise
once it is the last (Qwen3 writes an empty think block on the last turn only) starts after its role header.
A turn searched for is not looked for past where the next message's content is written (a sentinel in its place;
unless the template writes that before the turn, as one putting the last question first): a greeting before the first
user message, whose rendering alone has the think block the full one writes on the last turn only, was found there. A
template that writes an assistant message as it would a user one, its tool calls aside (Llama 3.1's puts the first
message, whatever its role, into the user turn holding the tools; it writes calls under an assistant header whatever
the role), has the record refused, naming the fix.
Checked against transformers' own assistant mask (`return_assistant_tokens_mask` over `{% generation %}` tags;
tests/test_data.py). The probes of a turn rendered as the last one are data/chat_turn.py's; the renderings,
data/chat_render.py's.
"""

from __future__ import annotations

import re

from data.chat_render import _key, render
from data.chat_turn import _SENTINEL, _content_at, _header, _prefixrender, _turn_tail
from data.jsonl import DataError


def _after(full: str, before: str, lo: int, hi: int, least: int = 4) -> int:
    """Where the longest tail of `before` found in `full` ending at `lo` or later, and at `hi` or earlier, ends (its
    first such occurrence: the previous turn, ending at `lo`, may be part of it), or -1 when even `least` characters
    of it are not there. (A tail found implies each shorter one is: a binary search over its length.) `hi` keeps the
    search out of later turns, which write the same markup (a conversation opening with an assistant message: its
    rendering as the last turn holds Qwen3's think block, which the full one writes on its last turn only)."""
    found = lambda k: full.find(before[len(before) - k:], max(0, lo - k), hi) if k else lo
    a, b = 0, len(before)
    while a < b:
        k = (a + b + 1) // 2
        a, b = (k, b) if found(k) >= 0 else (a, k - 1)
    return found(a) + a if a >= min(least, len(before)) and a else -1


def _written_end(tokenizer, messages: list[dict], j: int, text: str) -> int:
    """Where message j's content, as the template writes it, ends in `text` (its rendering of `messages`): rendered
    again with a sentinel in its place, the text after the sentinel is the end of `text` (-1: it is not, or the
    template writes nothing there). Exact where a search for the content is not: a short text ('I') also occurs in
    the markup ('[INST]'), and an empty one is nowhere."""
    try:
        probe = render(tokenizer, [*messages[:j], {**messages[j], "content": _SENTINEL}, *messages[j + 1:]], False)
    except DataError:
        return -1
    k = probe.rfind(_SENTINEL)
    tail = probe[k + len(_SENTINEL):]
    end = len(text) - len(tail)
    return end if k >= 0 and end >= k and text.endswith(tail) and text.startswith(probe[:k]) else -1


def _sentinel_at(tokenizer, messages: list[dict], j: int, full: str) -> int:
    """Where message j's content starts in `full`, their rendering: where the template writes a sentinel put in its
    place (-1: it writes none, or twice, or the rest otherwise)."""
    try:
        probe = render(tokenizer, [*messages[:j], {**messages[j], "content": _SENTINEL}, *messages[j + 1:]], False)
    except DataError:
        return -1
    k = probe.rfind(_SENTINEL)   # (a content written twice leaves a sentinel before it: then it cannot tell)
    return k if k >= 0 and full.startswith(probe[:k]) else -1


def _next_at(tokenizer, messages: list[dict], i: int, full: str, lo: int) -> int:
    """Where the content of the first message after assistant message i that is neither a system one (a template may
    move those: Mistral's to the last user message) nor an assistant one (a template may write a run of them as one
    turn) starts in `full`: no turn of message i's lies past it. len(full)
    where there is none or the probe cannot tell, and where the template writes it before message i's own content
    or before the previous turn's end `lo` (one that puts the last question first)."""
    j = next((j for j in range(i + 1, len(messages)) if messages[j]["role"] not in ("system", "assistant")
              and isinstance(messages[j].get("content"), str)), None)
    k = -1 if j is None else _sentinel_at(tokenizer, messages, j, full)
    if k <= lo or (isinstance(messages[i].get("content"), str) and _sentinel_at(tokenizer, messages, i, full) >= k):
        return len(full)
    return k


def _start_after(tokenizer, messages: list[dict], i: int, prev: int, full: str, through: str, given_at: int,
                 lo: int, hi: int) -> int:
    """Where assistant message i starts in `full` when the conversation before it renders otherwise once it is the
    last turn (`through`, where it starts at `given_at`): after the last message between it and the previous
    assistant turn `prev` (which ends at `lo`) and the text `through` writes between that message and the turn
    (' [/INST]'), both located by `_written_end`; else after the longest tail of what `through` writes before the
    turn (`_after`). -1: not found."""
    last = next((j for j in range(i - 1, prev, -1) if messages[j]["role"] != "system"   # (Mistral moves the system
                 and isinstance(messages[j].get("content"), str)), None)               # prompt onto the last user one)
    if last is not None:
        e, t = _written_end(tokenizer, messages, last, full), _written_end(tokenizer, messages[: i + 1], last, through)
        if lo <= e <= hi and 0 <= t <= given_at and full.startswith(markup := through[t:given_at], e):
            return e + len(markup)
    # else the longest tail of what `through` writes before the turn (a short text, '1', may occur inside another)
    return _after(full, through[:given_at], lo, hi)


def _as_user(tokenizer, messages: list[dict], i: int) -> str | None:
    """The rendering with message i a user message, of its content only (None: the template refuses it). (Llama
    3.1's writes tool calls under an assistant header whatever the role: the calls are dropped, or an assistant
    opening with a call renders alike.)"""
    user = {**{k: v for k, v in messages[i].items() if k != "tool_calls"}, "role": "user"}
    try:
        return render(tokenizer, [*messages[:i], user, *messages[i + 1:]], False)
    except DataError:
        return None


_WRITES_CALLS: set = set()   # the templates (`_key`) seen writing an assistant message's tool_calls


def _writes_calls(tokenizer, messages: list[dict], i: int, where: str) -> bool:
    """Whether the template writes assistant message i's tool_calls: the conversation through it rendered with the
    calls' names replaced by a probe's (a template that writes them writes their names). Asked per template until
    one writes them; calls of another shape than OpenAI's are taken as written."""
    calls = messages[i].get("tool_calls")
    if not calls or _key(tokenizer) in _WRITES_CALLS:
        return True
    probe = []
    for c in calls if isinstance(calls, list) else ():
        if isinstance(c, dict) and isinstance(c.get("function"), dict):
            probe.append({**c, "function": {**c["function"], "name": "probe_9f3c1a"}})
        elif isinstance(c, dict) and "name" in c:
            probe.append({**c, "name": "probe_9f3c1a"})
        else:
            return True
    if "probe_9f3c1a" in render(tokenizer, messages[:i] + [{**messages[i], "tool_calls": probe}], False, where):
        _WRITES_CALLS.add(_key(tokenizer))
        return True
    return False


def assistant_char_spans(tokenizer, messages: list[dict], where: str) -> tuple[str, list[tuple[int, int]]]:
    """The full rendering and the [start, end) character span of every assistant turn in it."""
    full = render(tokenizer, messages, False, where)
    spans, prev_end = [], 0
    for i, msg in enumerate(messages):
        if msg["role"] != "assistant":
            continue
        if not any(m["role"] == "user" for m in messages[:i]) and full == _as_user(tokenizer, messages, i):
            raise DataError(f"{where}: the chat template writes assistant message {i} as it writes a user message "
                            "(Llama 3.1's does so with tools: it puts the conversation's first message into the user "
                            "turn holding them), so it is no answer to train on: begin the conversation with a user "
                            "message, drop that one, or render it with another --chat-template")
        hi = None   # where a turn is searched for, the search's bound: the next message (`_next_at`)
        content = msg["content"].strip()
        before = _prefixrender(tokenizer, messages[:i])
        through = render(tokenizer, messages[: i + 1], False, where)
        at, given_at, written, text = _content_at(tokenizer, messages, i, through)  # as the last turn
        if not written and content:   # (an empty one, beside tool calls, is the usual form)
            raise DataError(f"{where}: the chat template does not write assistant message {i}'s content (it drops it, "
                            "e.g. beside tool_calls): remove the content from that message, or render it with another "
                            "--chat-template")
        if not _writes_calls(tokenizer, messages, i, where):   # (its turn would train an answer without them;
            # review, helper 53)
            raise DataError(f"{where}: the chat template does not write assistant message {i}'s tool_calls: the "
                            "model would learn to answer without the calls it made (an empty turn where content is "
                            "null). Render it with a template that writes them (--chat-template FILE), or drop the "
                            "calls and their tool results")
        content = text if written else ""
        if before is not None and full.startswith(before) and len(before) >= prev_end:
            start = len(before)
        elif at >= 0 and full.startswith(through[:given_at]) and given_at >= prev_end:
            # the conversation so far renders otherwise once this turn follows (a default system prompt that appears
            # once a message exists; Qwen3's think block written on the last turn only): the turn starts after its
            # role header, so what the template writes there before the content (that think block) is the turn's
            header = _header(tokenizer, messages, i, before)
            h = through.rfind(header, prev_end, given_at) if header else -1
            start = h + len(header) if h >= 0 else given_at
        elif (header := _header(tokenizer, messages, i, before)) and \
                (h := full.find(header, prev_end, hi := _next_at(tokenizer, messages, i, full, prev_end))) >= 0:
            start = h + len(header)   # a turn rendered otherwise once later turns follow: after its role header
        else:   # the conversation before it renders otherwise once it is the last turn (Mistral v0.3 writes the
            # tools and the system prompt before the last user message): it starts where the text just before it,
            # as it renders as the last turn, ends in the full rendering
            prev = max((j for j in range(i) if messages[j]["role"] == "assistant"), default=-1)
            hi = _next_at(tokenizer, messages, i, full, prev_end) if hi is None else hi
            start = _start_after(tokenizer, messages, i, prev, full, through, given_at, prev_end, hi) if at >= 0 \
                else -1
            if start < 0 and content:
                start = full.find(content, prev_end)
        if start < 0 or at < 0:
            raise DataError(f"{where}: the chat template does not render assistant message {i} verbatim")
        # What the template writes after the content as the turn's own (tool calls, '<|im_end|>', ' </s>'): what it
        # writes there when another message follows too (Phi-3 writes EOS after the last turn only: not the turn's).
        ce = at + len(content)
        tail = _turn_tail(tokenizer, messages, i, through, ce)
        marker = re.match(r"\s*\S*", tail).group()   # its first word, where the full rendering holds no more of it
        if full.startswith(through[:ce + len(tail)]) and ce + len(tail) > start:
            end = ce + len(tail)
        else:
            # The template renders this turn differently once later turns follow (e.g. Qwen3 drops
            # reasoning): take the content as rendered plus what follows it; when the content itself is
            # rewritten (an inline <think> block dropped), the turn as rendered, up to and with what follows it.
            # Looked for inside this turn only: before the first end-of-turn marker after its start (a special
            # token's text, which no message holds), or the search runs on into a later turn that repeats it.
            stop = full.find(marker.strip(), start) if marker.strip() and marker.strip() not in content else -1
            stop = len(full) if stop < 0 else stop
            c = full.find(content, start, stop)
            if c >= 0:   # (after the content's own trailing whitespace, which `content` is stripped of)
                e = c + len(content)
                ws = len(full) - len(full[e:].lstrip())   # (or past whitespace it kept: ' ' of ' \n<tool_call>')
                end = next((j + len(x) for x, j in ((tail, e), (tail.lstrip(), ws), (marker, e), (marker.lstrip(), ws))
                            if x and full.startswith(x, j)), e)
            elif tail.strip() and (m := full.find(tail.strip(), start)) >= 0:
                end = m + len(tail.strip())
            elif marker.strip() and (m := full.find(marker.strip(), start)) >= 0:
                end = m + len(marker.strip())
            else:
                raise DataError(
                    f"{where}: the chat template does not render assistant message {i} verbatim"
                )
        # The newline a template writes between turns is a separator, not something to generate.
        while end > start and full[end - 1].isspace():
            end -= 1
        if hi is not None and end > hi:   # (a turn searched for, found past where the next message is written)
            raise DataError(f"{where}: the chat template does not render assistant message {i} verbatim")
        spans.append((start, end))
        prev_end = end
    return full, spans
