"""Alpaca's records read as chat messages, for data/records.py: {"instruction", "input", "output"} and LLaMA-Factory's
"system" and "history" columns (its preference form: "chosen" and "rejected" in place of "output").

Contract:
- `_alpaca(obj, path, n)`: a record with "instruction" and "output" (or "chosen" and "rejected"), and none of this
  reader's own kinds ("text", "prompt", "completion", "messages", "conversations"), as the messages LLaMA-Factory's
  Alpaca converter builds: each "history" pair [query, answer] a user and an assistant message; then one user
  message of "instruction" and "input" joined by a newline (an empty or missing one left out); then "output" as the
  assistant's; a "system" string first. A preference record becomes TRL's {"prompt": [messages up to that user
  message], "chosen": "...", "rejected": "..."} (each side one assistant message). Other keys stay ("tools": passed to
  the template; the rest ignored, as on any line). Any other record is returned as it is.
- The messages are then any chat record's: rendered with the checkpoint's chat template (or --chat-template), every
  assistant turn a target, the history's answers too (--train-on-prompt: every token).
- A field of the wrong type or an empty answer raises data/jsonl.py's `line_error`, naming the line and the field; an
  "output" list (LLaMA-Factory's older ranking form) names the jq that writes it as "chosen" and "rejected".
"""

from __future__ import annotations

from pathlib import Path

from data.jsonl import PAIR_LINES, VALID_LINES, line_error

OWN = ("text", "prompt", "completion", "messages", "conversations", "conversation")   # read as this reader's kinds
ALPACA = ("instruction", "input", "output", "system", "history")


def _alpaca(obj: dict, path: str | Path, n: int) -> dict:
    """An Alpaca record as a messages record (or a TRL preference pair of messages); any other record as it is."""
    pair = "chosen" in obj or "rejected" in obj
    if "instruction" not in obj or not ("output" in obj or pair) or any(k in obj for k in OWN):
        return obj
    valid = PAIR_LINES if pair else VALID_LINES
    for k in ("instruction", "input", "system"):
        if obj.get(k) is not None and not isinstance(obj[k], str):
            raise line_error(path, n, f'"{k}" must be a string (Alpaca\'s), got {type(obj[k]).__name__}', valid)
    history = obj.get("history") or []
    if not isinstance(history, list) or not all(isinstance(h, (list, tuple)) and len(h) == 2 and all(
            isinstance(x, str) for x in h) for h in history):
        raise line_error(path, n, '"history" must be a list of [query, answer] string pairs (LLaMA-Factory\'s), got '
                                  f"{str(obj['history'])[:80]}", valid)
    query = "\n".join(x for x in (obj["instruction"], obj.get("input")) if x)
    if not query.strip():
        raise line_error(path, n, '"instruction" and "input" are empty: the user message would be', valid)
    msgs = [{"role": "system", "content": obj["system"]}] if obj.get("system") else []
    for q, a in history:
        msgs += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
    msgs.append({"role": "user", "content": query})
    rest = {k: v for k, v in obj.items() if k not in ALPACA}
    if pair:   # (data/records.py's _pair checks both sides are there and what they hold)
        return rest | {"prompt": msgs}
    if isinstance(obj["output"], list):   # (LLaMA-Factory's ranking form before "chosen"/"rejected" columns)
        raise line_error(path, n, '"output" is a list: LLaMA-Factory\'s older ranking form, [chosen, rejected]? '
                                  'write its sides as "chosen" and "rejected" (jq -c \'.chosen = .output[0] | '
                                  ".rejected = .output[1] | del(.output)' FILE), a pair for --objective dpo; else "
                                  '"output" is the answer, a string', valid)
    if not isinstance(obj["output"], str) or not obj["output"].strip():
        got = type(obj["output"]).__name__ if not isinstance(obj["output"], str) else "empty"
        raise line_error(path, n, f'"output" must be the answer, a string with text; got {got}', valid)
    return rest | {"messages": msgs + [{"role": "assistant", "content": obj["output"]}]}
