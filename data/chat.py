"""Chat records: which characters of a rendered conversation are targets, and where a long one is cut.

Contract:
- `chat_tokens(tokenizer, messages, where, tools=None)` -> (ids, target flags, the [t0, t1) tokens of the chat's
  document or None); `tools`, a record's tool definitions, are rendered with every rendering below (`with_tools`: a
  template that writes none refuses them).
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
  prompt/completion records', data/tokens.py); `assistant_char_spans` is also --chat-template's start-up probe.

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
tests/test_data.py). Character spans become token flags through the fast tokenizer's offsets, so BPE merges across
a boundary cannot shift a span.
"""

from __future__ import annotations

import re

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
    if bad := [w for w in weights if w not in (0, 1)]:
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
