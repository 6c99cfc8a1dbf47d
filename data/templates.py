"""--chat-template: a chat template in place of the checkpoint's, and what makes one usable for training.

Contract:
- `chat_template(spec)` -> the Jinja text, or None (keep the checkpoint's): a name of TEMPLATES ("chatml"), else the
  file's contents (a UTF-8 byte-order mark dropped), or its "chat_template" string when the file is JSON
  (tokenizer_config.json). A spec that is neither, a file not UTF-8, JSON of another shape (named templates, no
  "chat_template"), or a template with no `messages` in it is a DataError naming it.
- `apply_template(tokenizer, text)` sets it after checking, on a user and an assistant turn, that it renders the
  assistant's text verbatim (data/tokens.py finds the targets that way) and that what it writes right after that
  text, the end-of-turn marker (`<|im_end|>`), is one token of this tokenizer. Chat records get no EOS: the marker is
  how a tuned model says it is done, and one spelled in several ordinary tokens (a template written for another
  model's special tokens) would be nothing a generation loop stops on. Refused, naming the marker and the count.
- `end_of_turn(tokenizer)` -> (marker, its token ids; spaces around it are not part of it) under the tokenizer's
  template. `model.merged.merge` adds the
  marker's id to the merged generation_config.json's eos_token_id, so generation stops there.
- `dated(template)`: the template writes the date (`strftime_now`: Llama 3.2's and 3.3's "Today Date" line).
  `on_day(day)` makes every rendering inside it write that date ("YYYY-MM-DD", at 00:00) in place of today's: the
  run's tokens then do not depend on the day or the machine (train.py: --template-date, rank 0's day by default,
  kept by a resume). transformers gives templates no way to pass a function (it turns template arguments into plain
  data), so the clock its `strftime_now` reads is swapped for the length of the block, and checked to have taken.
- train.py keeps the text (args.chat_template_text) in the run's config.json and in every checkpoint: a resume
  compares the text, not the file's name, and an adapter exported from a checkpoint carries the text it was trained
  with (chat_template.jinja), whatever became of the file.
"""

from __future__ import annotations

import argparse
import datetime
import json
from contextlib import contextmanager
from pathlib import Path

from data.jsonl import DataError

TEMPLATES = {   # ChatML (<|im_start|>role ... <|im_end|>), with no default system prompt
    "chatml": "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
              "'<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
              "{%- endif %}",
}
PROBE = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there!"}]


def chat_template(spec: str | None) -> str | None:
    """--chat-template's Jinja text (module docstring)."""
    if spec is None or spec in TEMPLATES:
        return TEMPLATES.get(spec)
    p = Path(spec)
    if not p.is_file():
        raise DataError(f"--chat-template {spec!r} is neither a built-in ({', '.join(TEMPLATES)}) nor a file; pass "
                        "one of those names or the path of a Jinja chat template")
    raw = p.read_bytes()
    try:   # (utf-8-sig's error would count from after the mark; read_text's names neither the file nor the flag)
        text = raw.decode("utf-8").removeprefix("\ufeff")   # (a byte-order mark: no template text)
    except UnicodeDecodeError as e:
        raise DataError(f"--chat-template {spec!r}: not UTF-8 (byte 0x{raw[e.start]:02x} at position {e.start}): save "
                        "it as UTF-8") from None
    text = _from_json(spec, text)
    if "messages" not in text:
        raise DataError(f"--chat-template {spec!r}: no `messages` in it, so not a chat template (a Jinja template "
                        "over `messages`, as tokenizer_config.json's chat_template)")
    return text


def _from_json(spec: str, text: str) -> str:
    """A tokenizer_config.json-like file's "chat_template" string; the text itself when it is not JSON (a Jinja
    template over `messages` never parses as JSON)."""
    try:
        doc = json.loads(text)
    except ValueError:
        return text
    if isinstance(doc, dict) and isinstance(doc.get("chat_template"), str):
        return doc["chat_template"]
    kind = {list: "a list (named templates)", dict: "an object", str: "a string", bool: "true or false",
            type(None): "null"}
    got = doc.get("chat_template") if isinstance(doc, dict) else doc
    names = [t.get("name") for t in got if isinstance(t, dict)] if isinstance(got, list) else []
    if not isinstance(doc, dict):
        shape = f"JSON holding {kind.get(type(doc), 'a number')}"
    elif "chat_template" not in doc:
        shape = 'JSON with no "chat_template" key'
    else:
        shape = f'JSON whose "chat_template" is {kind.get(type(doc["chat_template"]), "a number")}'
    which = f': the "template" of one of its entries ({", ".join(map(str, names))}; transformers renders "default", ' \
        'or "tool_use" for records with "tools")' if names else ""
    raise DataError(f"--chat-template {spec!r} is {shape}, not a chat template: pass the Jinja template itself (the "
                    f"one to train with, saved as its own .jinja file{which})")


def dated(template) -> bool:
    """Whether the template (a text, or a dict of named ones) writes the date it is rendered on."""
    return "strftime_now" in json.dumps(template)


def parse_day(text: str) -> str:
    """--template-date's value, checked: YYYY-MM-DD (argparse prints the error as it is)."""
    try:
        return datetime.datetime.strptime(text, "%Y-%m-%d").date().isoformat()
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(f"{text!r} is not a date as YYYY-MM-DD, e.g. 2026-12-02") from None


_ABSENT = object()


@contextmanager
def on_day(tokenizer, day: str | None):
    """Renderings inside write `day` where the tokenizer's template asks for today's date (module docstring); None,
    or a template that writes no date: nothing changes."""
    if day is None or not dated(tokenizer.chat_template):
        yield
        return
    from transformers.utils import chat_template_utils as ctu

    real, at = getattr(ctu, "datetime", _ABSENT), datetime.datetime.combine(datetime.date.fromisoformat(day),
                                                                             datetime.time())

    class Fixed(datetime.datetime):
        @classmethod
        def now(cls, tz=None):
            return at.replace(tzinfo=tz)

    ctu.datetime = Fixed
    try:
        probe = tokenizer.apply_chat_template(PROBE, chat_template='{{ strftime_now("%Y-%m-%d") }}', tokenize=False)
        if probe != at.date().isoformat():
            raise RuntimeError(f"the chat template writes the date, and this transformers version's strftime_now "
                               f"renders {probe!r} under the fixed day {day}: the data would depend on the day it is "
                               "tokenized. Pin the date in the template (--chat-template FILE) or use transformers 5")
        yield
    finally:
        if real is _ABSENT:
            del ctu.datetime
        else:
            ctu.datetime = real


def end_of_turn(tokenizer) -> tuple[str, list[int]]:
    """(what the template writes right after an assistant's text, its token ids); raises what rendering raises."""
    from data.chat_spans import assistant_char_spans

    full, spans = assistant_char_spans(tokenizer, PROBE, "--chat-template")
    content = PROBE[1]["content"]
    marker = full[full.index(content, spans[0][0]) + len(content):spans[0][1]].strip()   # (Llama 2 writes " </s>")
    return marker, tokenizer(marker, add_special_tokens=False)["input_ids"]


def apply_template(tokenizer, text: str) -> None:
    """Set `text` as the tokenizer's chat template once it passes the checks of the module docstring."""
    old, tokenizer.chat_template = tokenizer.chat_template, text
    try:
        marker, ids = end_of_turn(tokenizer)
    except Exception as e:   # noqa: BLE001 (Jinja's errors, a template that drops the turn: the same advice)
        tokenizer.chat_template = old
        cause = e.__cause__ or e
        if type(cause).__name__ == "TemplateSyntaxError":   # the file, not a record: say where in it
            raise DataError(f"--chat-template: the template is not valid Jinja (line {getattr(cause, 'lineno', '?')}: "
                            f"{getattr(cause, 'message', cause)}): fix the template") from None
        raise DataError(f"--chat-template: the template does not render a user and an assistant turn "
                        f"({type(e).__name__}: {e})") from None
    if len(ids) != 1:
        tokenizer.chat_template = old
        raise DataError(f"--chat-template: the template ends an assistant turn with {marker!r}, which this tokenizer "
                        f"spells in {len(ids)} tokens, not one: nothing a tuned model could stop on. Use a template "
                        "written with this model's own special tokens (tokenizer_config.json's added_tokens_decoder)")
