"""ShareGPT's conversations read as chat messages, for data/records.py's messages records and preference pairs.

Contract:
- `_sharegpt(obj, path, n)`: a ShareGPT record as a messages record: "conversations" (or "conversation") is
  "messages"; each {"from", "value"} message {"role", "content"}, its speaker as the chat template's role
  (SHAREGPT_ROLES; any other speaker is refused, named); a top-level "system" string (LLaMA-Factory's column) the
  first message. Any other record as it is; role/content messages are left as they are.
- `_sharegpt_messages` converts one list of messages and `_system_first` puts the "system" string first;
  data/records.py's `_pair` reads LLaMA-Factory's ShareGPT preference pairs with the same two.
- A message that is wrong raises data/jsonl.py's `line_error`, naming the line and, for a pair, the key it was given
  under.
"""

from __future__ import annotations

from pathlib import Path

from data.jsonl import VALID_LINES, line_error

# ShareGPT's conversations (`"conversations"` or `"messages"` of {"from", "value"}, a top-level "system") are read as
# messages: its speakers as the chat template's roles; any other speaker is refused, named
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system",
                  "tool": "tool", "observation": "tool"}


def _sharegpt_messages(msgs: object, path: str | Path, n: int, where: str = "", valid: str = VALID_LINES) -> object:
    """ShareGPT's {"from", "value"} messages as {"role", "content"}; role/content messages, or not a list, as they are
    (`where`: the pair's key they were given under, named in an error)."""
    # a ShareGPT message: "from"/"value" and neither "role" nor "content" (a role/content message may carry a "from"
    # or "value" of its own, metadata: read as before 2026-12-05, kept and passed to the template)
    share = [i for i, m in enumerate(msgs) if isinstance(m, dict) and ("from" in m or "value" in m) and not (
        "role" in m or "content" in m)] if isinstance(msgs, list) else []
    if not share:   # (role/content messages, or not a list: _check_messages says what is wrong)
        return msgs
    out = []
    for i, m in enumerate(msgs):
        if i not in share:
            raise line_error(path, n, f"{where}message {i} is not ShareGPT's {{\"from\", \"value\"}} as message "
                                      f'{share[0]} is: write every message of a line one way ("from"/"value", or '
                                      '"role"/"content")', valid)
        for k in ("from", "value"):
            if k not in m:
                raise line_error(path, n, f'{where}message {i} has no "{k}" (ShareGPT\'s messages are {{"from": '
                                          '"human" or "gpt", "value": "..."}})', valid)
        if (role := SHAREGPT_ROLES.get(m["from"]) if isinstance(m["from"], str) else None) is None:
            raise line_error(path, n, f'{where}message {i} is "from" {m["from"]!r}, not one of ShareGPT\'s speakers '
                                      f'this reader maps to a role ({", ".join(SHAREGPT_ROLES)}): rename it, or write '
                                      'its messages with "role" and "content"', valid)
        if not isinstance(m["value"], str) and not (m["value"] is None and m.get("tool_calls") and role == "assistant"):
            raise line_error(path, n, f'{where}message {i} "value" must be a string, got {type(m["value"]).__name__}',
                             valid)   # (here: _check_messages would name "content" and count a "system" put first)
        out.append({**{k: v for k, v in m.items() if k not in ("from", "value")}, "role": role,
                    "content": m["value"]})   # (other keys kept: "weight" 0 makes an answer context, as there)
    return out


def _sharegpt(obj: dict, path: str | Path, n: int) -> dict:
    """A ShareGPT record as a messages record: "conversations" (or "conversation") is "messages"; each {"from",
    "value"} message {"role", "content"}; a top-level "system" string the first message. Any other record as it is."""
    key = next((k for k in ("messages", "conversations", "conversation") if k in obj), None)
    if key is None or key != "messages" and any(k in obj for k in ("text", "prompt", "completion", "chosen",
                                                                     "rejected")):
        return obj   # (another kind of record that also holds a "conversations" field: read as that kind)
    msgs, rest = obj[key], {k: v for k, v in obj.items() if k != key}
    out = _sharegpt_messages(msgs, path, n)
    if out is msgs and key == "messages" or not isinstance(out, list):   # (a role/content "messages" record keeps
        return rest | {"messages": out}   # ignoring a "system" key, as before 2026-12-05)
    rest.pop("system", None)
    return rest | {"messages": _system_first(out, obj.get("system"), path, n)}


def _system_first(msgs: list, system, path: str | Path, n: int, where: str = "", valid: str = VALID_LINES) -> list:
    """A ShareGPT record's top-level "system" string (LLaMA-Factory's column) as its first message."""
    if system is not None and not isinstance(system, str):
        raise line_error(path, n, f'"system" must be a string (the system prompt), got {type(system).__name__}', valid)
    if not (system and system.strip() and isinstance(msgs, list)):
        return msgs
    if msgs and isinstance(msgs[0], dict) and msgs[0].get("role") == "system":
        raise line_error(path, n, f'has a "system" string and a first message from "system"{where}: give the system '
                                  "prompt once", valid)
    return [{"role": "system", "content": system}, *msgs]
