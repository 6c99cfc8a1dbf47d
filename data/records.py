"""One JSONL line as a validated, normalised training record (data/jsonl.py reads a file a line at a time).

Contract:
- Three record kinds:
    {"text": "..."}                                        every token is a target
    {"prompt": "...", "completion": "..."}                  prompt + completion as one text; only the
                                                            completion (and EOS) are targets
    {"messages": [{"role": "...", "content": "..."}, ...]}  rendered with the checkpoint's chat
                                                            template; only assistant turns are targets
  and, for `--objective dpo` only, a preference pair (TRL's two forms):
    {"prompt": "...", "chosen": "...", "rejected": "..."}   two prompt/completion records (no "prompt": two
                                                            text records, whose shared start is the prompt)
    {"prompt": [messages], "chosen": [messages], "rejected": [messages]}   two "messages" records,
                                                            prompt + chosen and prompt + rejected ("prompt" may
                                                            be left out when each side is a whole conversation;
                                                            a side given as a string is one assistant message)
  A "messages" record may carry "tools" (the tool definitions, as a list of JSON schemas or a string holding
  one, OpenAI's and the Hub's form): passed to the chat template (`apply_chat_template(tools=...)`), which writes them
  where the model expects them. Other keys on a line (ids, metadata) are ignored; extra keys inside a message (e.g.
  `reasoning_content`, `tool_calls`) are kept and passed to the chat template.
  ShareGPT's conversations (`"conversations"` or `"messages"` of {"from", "value"}, a top-level "system") are read
  as messages (data/sharegpt.py), and so are Alpaca's {"instruction", "input", "output"} records, with
  LLaMA-Factory's "system" and "history" (data/alpaca.py; its pairs: "chosen" and "rejected" for "output").
- `parse_record(raw, path, n)` validates one non-blank line (or a Parquet row's dict) and returns its record,
  normalised as data/jsonl.py's `load_jsonl` says. A line that is wrong raises `DataError` naming the file, the line
  number (data/jsonl.py's `where`), what is wrong and what a valid line looks like (VALID_LINES; a pair's:
  PAIR_LINES); a key of another format ("question", "response", an Alpaca "instruction" without "output", ...) is
  named with its rename (ALIASES). A KTO line (an answer with a bool "label", TRL's unpaired preference form, or
  "kto_tag", LLaMA-Factory's) is refused: read as SFT, its bad answers would be trained as good ones. A CSV or TSV
  row's error is said in columns, its lines named (data/tables.py's `Row.error`).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from data.alpaca import _alpaca
from data.jsonl import PAIR_LINES, VALID_LINES, DataError, line_error, where
from data.sharegpt import _sharegpt, _sharegpt_messages, _system_first
from data.tables import Row

SURROGATE_ESCAPE = re.compile(r"\\u[dD]([89a-fA-F])[0-9a-fA-F]{2}")   # a \\udXXX escape: half of a UTF-16 pair
KINDS = ("text", "prompt", "messages")   # a line holds one kind ("completion" goes with "prompt")
KTO_KEYS = ("label", "kto_tag")   # a bool under one: a KTO line (a good or a bad answer), not one to imitate


# Keys other formats use for this reader's (Alpaca, ShareGPT, preference data): never read, but named in the error,
# since a line holding them is almost always a file in another format, not a typo.
ALIASES = {"prompt": ("instruction", "question", "query", "input"), "completion": ("response", "output", "answer")}


def _alias_hint(obj: dict, want: tuple[str, ...]) -> str:
    """' (this line has "response": rename it "completion" ...)' for keys of `want` that `obj` spells another way."""
    found = {k: [a for a in ALIASES.get(k, ()) if a in obj] for k in want if k not in obj}
    found = {k: a for k, a in found.items() if a}
    if not found:
        return ""
    q = lambda keys: " and ".join(f'"{a}"' for a in keys)
    renames = ", ".join(f'rename {q(a)} to "{k}"' if len(a) == 1 else f'join {q(a)} into one "{k}" string'
                        for k, a in found.items())
    return f"; this line has {q(sum(found.values(), []))}, which this reader does not read: {renames}"


def _check_messages(messages: object, path: str | Path, n: int) -> None:
    if not isinstance(messages, list):
        raise line_error(path, n, f'"messages" must be a list, got {type(messages).__name__}')
    if not messages:
        raise line_error(path, n, '"messages" is an empty list')
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise line_error(path, n, f"message {i} must be an object, got {type(msg).__name__}")
        for key in ("role", "content"):
            if key not in msg:
                raise line_error(path, n, f'message {i} has no "{key}"')
            if key == "content" and msg[key] is None and msg.get("tool_calls") and msg["role"] == "assistant":
                msg[key] = ""   # (OpenAI's form of a turn that only calls tools: the templates read null as empty)
                continue
            if not isinstance(msg[key], str):
                raise line_error(
                    path, n, f'message {i} "{key}" must be a string, got {type(msg[key]).__name__}'
                )
        if not msg["role"]:
            raise line_error(path, n, f'message {i} has an empty "role"')
    # Without an assistant turn a chat record has no target token at all; that is almost always a
    # role-name mismatch (e.g. ShareGPT's "gpt"), so say so instead of training on nothing.
    if not any(m["role"] == "assistant" for m in messages):
        roles = sorted({m["role"] for m in messages})
        raise line_error(path, n, f'no message has role "assistant" (roles found: {roles})')


def _tools(tools: object, path: str | Path, n: int) -> list | None:
    """A record's "tools": a list of objects (JSON schemas), or a string holding one (how many Hub datasets store
    them); None or an empty list: none."""
    if isinstance(tools, str):
        try:
            tools = json.loads(tools) if tools.strip() else None
        except json.JSONDecodeError as e:
            raise line_error(path, n, f'"tools" is a string that is not JSON ({e.msg} at column {e.colno}): give '
                                      'the list of tool schemas itself, or a string holding it') from None
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise line_error(path, n, f'"tools" must be a list of tool schemas (objects, e.g. {{"type": "function", '
                                  f'"function": {{"name": ..., "parameters": ...}}}}), got {type(tools).__name__}'
                                  + (" of " + ", ".join(sorted({type(t).__name__ for t in tools}))
                                     if isinstance(tools, list) else ""))
    return tools


def _lone_surrogates(raw: str):
    """Where each \\uD800-\\uDFFF escape of `raw` that is not half of a high-low pair starts."""
    at = 0
    while m := SURROGATE_ESCAPE.search(raw, at):
        k = m.start()
        while k and raw[k - 1] == "\\":
            k -= 1
        if (m.start() - k) % 2:   # an escaped backslash, then "ud800" as text
            at = m.start() + 1
            continue
        high = m.group(1).lower() in "89ab"
        if not high or not (low := SURROGATE_ESCAPE.match(raw, m.end())) or low.group(1).lower() in "89ab":
            yield m.start()
            at = m.end()
        else:
            at = low.end()


def parse_record(raw: str | dict, path: str | Path, n: int) -> dict:
    """Validate one non-blank line (or a Parquet row, already a dict: data/formats.py) and return its record."""
    if isinstance(raw, dict):
        try:
            return _normalise(raw, path, n)
        except DataError as e:   # (a CSV or TSV row: said in columns, and its lines named)
            raise raw.error(e, path, n) if isinstance(raw, Row) else e from None
    try:
        obj = json.loads(raw.rstrip("\r\n"))   # (a line cut short errs at its end, not at "column 1" of the next)
    except json.JSONDecodeError as e:
        end = " (the line's end: cut short?)" if e.pos >= len(raw.rstrip("\r\n")) else ""
        hint = ("; the file is a Git LFS pointer, not the data: fetch it (`git lfs pull`)"   # (a JSON array: read
                if raw.startswith("version https://git-lfs.github.com/spec/") else   # as one, data/formats.py)
                "; a CSV or TSV file's header row? name the file .csv or .tsv: its name says how it is read (as "
                "records, a row each: data/tables.py)" if n == 1 and ("," in raw or "\t" in raw) and
                not raw.lstrip().startswith(("{", "[")) else "")
        raise line_error(path, n, f"not valid JSON ({e.msg} at column {e.pos + 1}{end}){hint}") from None
    rec = _normalise(obj, path, n)
    if SURROGATE_ESCAPE.search(raw):   # json.loads keeps a lone half; the tokenizer would raise a TypeError
        used = json.dumps(rec, ensure_ascii=False)   # (one in a key the record does not use is no harm)
        for col in _lone_surrogates(raw):
            if chr(int(raw[col + 2:col + 6], 16)) in used:
                raise line_error(path, n, f"has a lone UTF-16 surrogate escape ({raw[col:col + 6]} at column "
                                          f"{col + 1}: half of a pair, which encodes no character); fix or remove it")
    return rec


def _pair(obj: dict, path: str | Path, n: int) -> dict:
    """A preference record -> {"line", "pair": [chosen, rejected]}, each side normalised as a record of its own."""
    if other := [k for k in ("text", "messages", "completion") if k in obj]:
        raise line_error(path, n, f'has "chosen"/"rejected" and {" and ".join(repr(k) for k in other)}: use one kind '
                                  'per line', PAIR_LINES)
    for key in ("chosen", "rejected"):
        if key not in obj:
            raise line_error(path, n, f'has "{"rejected" if key == "chosen" else "chosen"}" but no "{key}": a '
                                      'preference pair needs both', PAIR_LINES)
    if "prompt" not in obj and (conv := next((k for k in ("conversations", "conversation") if k in obj), None)):
        # LLaMA-Factory's ShareGPT pairs: the conversation so far, then each side one message (an object), and its
        # "system" column first: TRL's prompt of messages, each side a list of one
        head = _sharegpt_messages(obj[conv], path, n, f'"{conv}": ', PAIR_LINES)
        head = _system_first(head, obj.get("system"), path, n, f' in "{conv}"', PAIR_LINES)
        obj = {k: v for k, v in obj.items() if k not in (conv, "system")} | {"prompt": head} | {
            k: [obj[k]] if isinstance(obj[k], dict) else obj[k] for k in ("chosen", "rejected")}
    obj = obj | {k: _sharegpt_messages(obj[k], path, n, f'"{k}": ', PAIR_LINES) for k in ("prompt", "chosen",
                                                                                        "rejected") if k in obj}
    prompt, tools = obj.get("prompt"), ({"tools": obj["tools"]} if "tools" in obj else {})   # ("tools": messages only,
    strings = [k for k in ("chosen", "rejected") if isinstance(obj[k], str)]   # as for any record, _normalise says)
    if prompt is None and len(strings) == 2:   # TRL's implicit prompt: their shared start is the prompt (no target:
        sides = [{"text": obj[k], **tools} for k in strings]   # data.tokens)
    elif prompt is None and strings:
        raise line_error(path, n, f'"{strings[0]}" is a string and the other side a list of messages, with no '
                                  '"prompt": a string side is one assistant message, which needs the "prompt" '
                                  'messages before it; give both sides as whole conversations, or add "prompt"',
                         PAIR_LINES)
    elif isinstance(prompt, str):
        sides = [{"prompt": prompt, "completion": obj[k], **tools} for k in ("chosen", "rejected")]
    else:
        head = [] if prompt is None else prompt
        if not isinstance(head, list):
            raise line_error(path, n, f'"prompt" must be a string or a list of messages, got {type(head).__name__}',
                             PAIR_LINES)
        if head and isinstance(head[-1], dict) and head[-1].get("role") == "assistant":
            raise line_error(path, n, '"prompt" ends with an assistant message, a prefill that TRL has each side '
                                      'continue; here each side is a turn of its own after the prompt: end the prompt '
                                      "with the user's message and start each side's answer with the prefill (it is "
                                      "then trained, as the rest of each answer)", PAIR_LINES)
        as_list = lambda v: [{"role": "assistant", "content": v}] if isinstance(v, str) else v
        sides = [{"messages": head + as_list(obj[k]) if isinstance(as_list(obj[k]), list) else obj[k], **tools}
                 for k in ("chosen", "rejected")]
    # a prompt of messages: its assistant turns are no target on either side (TRL's prompt; data.tokens)
    turns = {"prompt_turns": sum(isinstance(m, dict) and m.get("role") == "assistant" for m in prompt)} if \
        isinstance(prompt, list) else {}
    out = []
    for side, key in zip(sides, ("chosen", "rejected")):
        try:
            out.append({**_normalise(side, path, n), **turns})
        except DataError as e:   # named as the pair's side, in the pair's own words
            said = str(e).replace(VALID_LINES, PAIR_LINES).replace(
                ' (a record that is all target is {"text": ...})', ' (a pair with no prompt is {"chosen": "...", '
                '"rejected": "..."}, whose shared start is the prompt)')
            said = said.replace('"completion"', f'"{key}"') if '"completion"' in said else \
                said.replace(f"{where(path, n)}: ", f'{where(path, n)}: "{key}" side: ', 1)
            raise DataError(said) from None
    return {"line": n, "pair": out}


def _normalise(obj, path: str | Path, n: int) -> dict:
    if not isinstance(obj, dict):
        raise line_error(path, n, f"expected a JSON object, got {type(obj).__name__}")
    obj = _sharegpt(_alpaca(obj, path, n), path, n)
    if "chosen" in obj or "rejected" in obj:
        return _pair(obj, path, n)
    # a KTO line read as SFT would train its undesirable answers as good ones, without a word (a text record's
    # bool "label" is a classifier's: no answer there to judge)
    if "text" not in obj and (kto := next((k for k in KTO_KEYS if isinstance(obj.get(k), bool)), None)):
        raise line_error(path, n, f'has "{kto}": {json.dumps(obj[kto])}, a KTO label (TRL\'s unpaired preference '
                                  "data, LLaMA-Factory's kto_tag), which this trainer does not read: each answer would "
                                  "be a target, the undesirable ones too; keep the lines labelled true and drop the "
                                  f"key (jq -c 'select(.{kto} == true) | del(.{kto})' FILE), or pair the answers for "
                                  "--objective dpo")
    has_text, has_messages = "text" in obj, "messages" in obj
    kinds = [k for k in KINDS if k in obj] + (["completion"] if "completion" in obj and "prompt" not in obj else [])
    if len(kinds) > 1:
        raise line_error(path, n, f"has {' and '.join(repr(k) for k in kinds)}; use one kind per line")
    if obj.get("tools") and not has_messages:   # (rendered by a chat template only)
        raise line_error(path, n, '"tools" goes with a "messages" record (the chat template writes the tool '
                                  'definitions); a text or prompt/completion record holds its own text')
    if "prompt" in obj or "completion" in obj:
        for key in ("prompt", "completion"):
            if not isinstance(obj.get(key), str):
                got = "nothing" if key not in obj else type(obj[key]).__name__
                raise line_error(path, n, f'"{key}" must be a string, got {got}{_alias_hint(obj, (key,))}')
            if not obj[key].strip():
                raise line_error(path, n, f'"{key}" is empty' + (' (a record that is all target is {"text": ...})'
                                                                 if key == "prompt" else ""))
        return {"line": n, "prompt": obj["prompt"], "completion": obj["completion"]}
    if has_text:
        text = obj["text"]
        if not isinstance(text, str):
            raise line_error(path, n, f'"text" must be a string, got {type(text).__name__}')
        if not text.strip():
            raise line_error(path, n, '"text" is empty')
        # (tatsu-lab/alpaca's rows: "text" holds the prompt template, instruction and answer; read as text, as TRL's
        # dataset_text_field reads them, and said: data/token_stats.py's warning names the jq that makes chats)
        return {"line": n, "text": text, **({"alpaca": True} if "instruction" in obj and "output" in obj else {})}
    if has_messages:
        _check_messages(obj["messages"], path, n)
        tools = _tools(obj.get("tools"), path, n)
        return {"line": n, "messages": obj["messages"], **({"tools": tools} if tools else {})}
    keys = sorted(obj)[:8]
    raise line_error(path, n, f'has none of "text", "prompt"/"completion", "messages" (keys: {keys})'
                              + _alias_hint(obj, ("prompt", "completion", "messages")))
