"""Tokenization with the checkpoint's tokenizer, target masks and shifted labels: the rules that turn a record into
its tokens. What they count and say is data/token_stats.py's `TokenStats`; a file's tokens, through the token cache,
data/load.py's `load_samples`.

Contract:
- `tokenize_records(records, tokenizer, max_len, path, day, long_text, all_targets)` turns validated records
  (`data.jsonl`) into samples `{"input_ids": [int], "labels": [int], "line": int}` (its record's line, -1 when the
  record has none: --eval-split holds out whole records) plus a `TokenStats`. Order is kept, except that samples left
  with no target are dropped (and counted), and a split text record gives its windows in a row. A template that writes
  today's date writes `day` (YYYY-MM-DD; None: today), data/templates.py's `on_day`.
- Text records: the text is encoded with the tokenizer's own special-token rule
  (`add_special_tokens=True`), so a BOS token is prepended exactly when the tokenizer defines one
  and adds it (Llama 3 prepends `<|begin_of_text|>`; Qwen defines none and adds nothing), and the text does
  not begin with that BOS's text already (a pre-rendered chat: its own BOS stays, no second one). Then the
  EOS token is appended (unless the tokenizer already appended it). Every token is a target,
  including EOS, so the model learns to stop.
- Prompt/completion records: `prompt + completion` (joined as they are: put any separator in one of them) is
  encoded like a text record (the tokenizer's BOS rule, EOS appended unless there), but only the completion is a
  target: every token whose characters reach into it (a token merged across the boundary counts), and EOS. For
  long-context tasks whose answer is short (a document and a question, then the answer), without a chat template.
  A record longer than max_len loses the start of its prompt (after a BOS), so the question and the answer stay, but
  when the answer alone (with one prompt token, or the BOS, to predict its first token) does not fit, the prompt
  keeps its last max_len // 4 tokens and the answer is cut at its end, as text is.
- Chat records: rendered with the chat template and encoded as `apply_chat_template(tokenize=True)` encodes them;
  only assistant turns (and the end-of-turn marker after each) are targets; a long chat loses the start of its
  document. data/chat.py has the rules. Text and prompt/completion records keep special tokens' text (a
  pre-rendered chat means them), counted in `TokenStats.special`.
- A text record longer than max_len (`long_text`, --long-text): "split" (the default) makes it windows of max_len
  tokens that overlap by one, each a sample of its own (positions from 0, no BOS added), so every token of the
  record after its first is a target exactly once: window k holds tokens [k(max_len-1), k(max_len-1)+max_len), whose
  first token is the previous window's last target. "truncate" keeps its first max_len tokens. Continued
  pretraining on documents longer than the context (books, code bases) then loses nothing, as a chunked pretraining
  corpus does; a prompt/completion or chat record is never split (its answer needs its question).
- `all_targets` (--train-on-prompt): every token of a prompt/completion or chat record is a target, as of a text
  record (TRL's default for conversations, `assistant_only_loss=False`; per-message "weight" is then not read).
- Records with no target are dropped, counted, and named by line (`TokenStats.warning`, said at load): those the cut
  left without one apart from those that never had one (a chat whose every assistant turn has "weight": 0).
- Labels are built after truncation, on the whole sequence:
  `labels[t] = input_ids[t+1]` if token t+1 is a target, else -100; the last position is -100.
"""

from __future__ import annotations

from pathlib import Path

from data.chat import char_targets, chat_tokens, check_chat_content, special_strings
from data.jsonl import DataError, where
from data.token_stats import DROPPED_LINES, LONG_TEXT, TokenStats
from loss import IGNORE_INDEX


def shift_labels(ids: list[int], is_target: list[bool]) -> list[int]:
    """labels[t] = ids[t+1] where token t+1 is a target; -100 elsewhere and at the last position."""
    return [ids[t + 1] if is_target[t + 1] else IGNORE_INDEX for t in range(len(ids) - 1)] + [IGNORE_INDEX]


def _prompt_tokens(tokenizer, records: list[dict]) -> list[tuple[list[int], list[bool]]]:
    """Each prompt + completion as one text (BOS by the tokenizer's rule; one batched call); targets: the tokens
    reaching into the completion (EOS is the caller's)."""
    fulls = [r["prompt"] + r["completion"] for r in records]
    if not fulls:
        return []
    try:
        enc = tokenizer(fulls, add_special_tokens=True, return_offsets_mapping=True, return_special_tokens_mask=True)
        starts = [len(r["prompt"]) for r in records]
        return [(list(ids), char_targets(off, sp, lambda a, b, n=n: b > n, lambda a, n=n: a > n))
                for ids, off, sp, n in zip(enc["input_ids"], enc["offset_mapping"], enc["special_tokens_mask"], starts)]
    except NotImplementedError:   # slow (python) tokenizers: where the prompt's own tokens stop matching
        out = []
        for full, r in zip(fulls, records):
            ids = list(tokenizer(full, add_special_tokens=True)["input_ids"])
            head = tokenizer(r["prompt"], add_special_tokens=True)["input_ids"]
            n = next((t for t, (x, y) in enumerate(zip(head, ids)) if x != y), min(len(head), len(ids)))
            out.append((ids, [t >= n for t in range(len(ids))]))
        return out


def tokenize_records(records: list[dict], tokenizer, max_len: int, path: str | Path = "<records>",
                     day: str | None = None, long_text: str = LONG_TEXT[0], all_targets: bool = False):
    """Records -> (samples, TokenStats); see the module docstring for the exact token rules."""
    from data.store import today
    from data.templates import dated, on_day

    day = day or (today() if dated(getattr(tokenizer, "chat_template", None)) else None)   # one date for the call
    with on_day(tokenizer, day):
        return _tokenize_records(records, tokenizer, max_len, path, long_text, all_targets)


def _windows(ids: list[int], max_len: int) -> list[list[int]]:
    """A long text's windows of max_len tokens, overlapping by one: each token after the first is one window's target
    exactly once (the last window may be shorter; each has at least one target)."""
    stride = max_len - 1
    return [ids[s:s + max_len] for s in range(0, len(ids) - 1, stride)]


def _prompt_drop(n: int, cut, max_len: int) -> int:
    """Tokens of the cuttable text `cut` = (t0, t1, least) a sample of `n` tokens loses to fit `max_len`."""
    if n <= max_len or not cut:
        return 0
    t0, t1, least = cut
    room = max_len - (n - (t1 - t0))   # tokens of that text beside everything else
    keep = room if room >= least else min(t1 - t0, max(least, max_len // 4))
    return max(0, t1 - t0 - keep)


def _runs(labels: list[int]) -> list[tuple[int, int]]:
    """The runs of consecutive targets in `labels`, (start, end) each: one per trained turn of a chat."""
    out, start = [], None
    for t, lab in enumerate(labels + [IGNORE_INDEX]):
        if lab != IGNORE_INDEX and start is None:
            start = t
        elif lab == IGNORE_INDEX and start is not None:
            out.append((start, t))
            start = None
    return out


def _tokenize_records(records: list[dict], tokenizer, max_len: int, path, long_text: str = LONG_TEXT[0],
                      all_targets: bool = False):
    if max_len < 2:
        raise ValueError(f"max_len must be >= 2 (one input and one target), got {max_len}")
    if long_text not in LONG_TEXT:
        raise ValueError(f"long_text must be one of {LONG_TEXT}, got {long_text!r}")
    specials = special_strings(tokenizer)
    eos = tokenizer.eos_token_id
    # A preference pair's two sides are records of their own here, side by side (the chosen first); both or neither
    # are kept (a pair with a side left without a target is dropped whole, as one record)
    flat = [dict(side, pair=k) for r in records for k, side in (enumerate(r["pair"]) if "pair" in r else [(None, r)])]
    texts = [r["text"] for r in flat if "text" in r]
    if (texts or any("prompt" in r for r in flat)) and eos is None:
        raise DataError(
            f"{path}: text and prompt/completion records need an EOS token to mark where a document ends, but the "
            "tokenizer defines no eos_token"
        )
    chats = [r for r in flat if "messages" in r]
    if chats and not getattr(tokenizer, "chat_template", None):
        raise DataError(
            f"{where(path, chats[0].get('line', '?'))}: chat records need the checkpoint's chat "
            "template, but the tokenizer has none (base models often ship without one); pass --chat-template "
            "chatml (or --chat-template FILE.jinja), use an instruct checkpoint, or write {\"text\": ...}"
        )
    # One batched call for all text records, one for all prompt/completion ones: the fast tokenizer parallelises it.
    text_ids = iter(tokenizer(texts, add_special_tokens=True)["input_ids"]) if texts else iter(())
    prompt_ids = iter(_prompt_tokens(tokenizer, [r for r in flat if "prompt" in r]))
    bos = getattr(tokenizer, "bos_token_id", None)
    bos_text = getattr(tokenizer, "bos_token", None)

    def doubled(ids, text) -> int:   # 1: the tokenizer's BOS before the text's own (a pre-rendered chat's; review,
        # helper 53: a doubled BOS, trained as a target), which stays
        return int(bos is not None and bool(bos_text) and text.startswith(bos_text) and ids[:2] == [bos, bos])

    def count(r, why="dropped", lines="dropped_lines"):   # (a dropped record by default; any counted kind: why)
        setattr(stats, why, getattr(stats, why) + 1)
        if len(getattr(stats, lines)) < DROPPED_LINES:
            getattr(stats, lines).append(r.get("line", "?"))

    samples, stats, held, pending = [], TokenStats(records=len(records)), None, False
    for r in flat:
        doc = None
        hit = bool(specials and "messages" not in r and specials.search(r.get("text") or r["prompt"] + r["completion"]))
        if r["pair"] == 0:   # (pre-rendered text means them: counted, in the data: line; a pair once, either side)
            pending = hit
        else:
            stats.special += hit or (r["pair"] == 1 and pending)
        if r.get("alpaca"):   # (a text record that also holds Alpaca's fields: said, data/token_stats.py)
            count(r, "alpaca_text", "alpaca_text_lines")
        if "text" in r:
            ids = list(next(text_ids))
            ids = ids[doubled(ids, r["text"]):]
            if not ids or ids[-1] != eos:
                ids.append(eos)
            flags = [True] * len(ids)
        elif "prompt" in r:
            ids, flags = next(prompt_ids)
            cut = doubled(ids, r["prompt"] + r["completion"])
            ids, flags = ids[cut:], flags[cut:]
            if not ids or ids[-1] != eos:
                ids, flags = ids + [eos], flags + [True]
            flags[-1] = True   # EOS: the model learns to stop after the completion
        else:
            at = where(path, r.get('line', '?'))
            check_chat_content(r["messages"], specials, at, r.get("tools"))
            ids, flags, doc = chat_tokens(tokenizer, r["messages"], at, r.get("tools"))
        answer = flags.index(True) if "prompt" in r else None   # where its answer starts: a cut drops the prompt
        if all_targets and "text" not in r:   # --train-on-prompt: the prompt's tokens too (BOS never: no label)
            flags = [True] * len(ids)
        stats.longest = max(stats.longest, len(ids))
        if len(ids) > max_len and "text" in r and long_text == "split" and r["pair"] is None:   # every token trained,
            parts = _windows(ids, max_len)   # in windows (never a pair's side: its two sides are one sample each)
            stats.split, stats.windows = stats.split + 1, stats.windows + len(parts)
            for w in parts:   # (each has a target: never dropped)
                samples.append({"input_ids": w, "labels": shift_labels(w, [True] * len(w)), "line": r.get("line", -1)})
                stats.samples, stats.tokens, stats.targets = stats.samples + 1, stats.tokens + len(w), \
                    stats.targets + len(w) - 1
            continue
        # A prompt's start may go (after a BOS), or a chat's document's (the longest message before the first answer:
        # its headers and the question after it stay), so the answers fit; when they cannot, that text keeps its last
        # max_len // 4 tokens (a prompt without a BOS at least one: it predicts the answer's first) and the end is
        # cut. A pair's two sides lose the same tokens of their shared prompt: the longer side's count, so both
        # answers are scored after the same context.
        if "prompt" in r:
            head = int(bos is not None and ids[0] == bos)
            cut = (head, answer, head == 0)   # (--train-on-prompt too)
        else:   # (text: None)
            cut = doc and (*doc, 0)
        side = (r, ids, flags, cut, _prompt_drop(len(ids), cut, max_len))
        if r["pair"] == 0:   # the chosen side waits for the rejected one
            held = side
            continue
        group = [side] if r["pair"] is None else [held, side]
        drop = max(g[4] for g in group)
        made, whole = [], True
        for r, ids, flags, cut, _ in group:
            n_ids, flags0 = len(ids), flags
            if cut and (d := min(drop, cut[1] - cut[0])) > 0:
                ids, flags = ids[:cut[0]] + ids[cut[0] + d:], flags[:cut[0]] + flags[cut[0] + d:]
            ids, flags = ids[:max_len], flags[:max_len]
            labels = shift_labels(ids, flags)
            made.append(({"input_ids": ids, "labels": labels, "line": r.get("line", -1)}, n_ids,
                         sum(lab != IGNORE_INDEX for lab in labels)))
            whole &= any(flags0[1:])   # a target before any cut (label t is token t + 1's)
        held = None
        if not all(n for _, _, n in made):   # no --max-len keeps a record that had no target to lose: said apart
            count(r) if whole else count(r, "no_target", "no_target_lines")
            continue
        if len(made) == 2 and made[0][0]["input_ids"] == made[1][0]["input_ids"] and \
                made[0][0]["labels"] == made[1][0]["labels"]:   # no preference to learn (and a margin of float noise)
            count(r, "tied", "tied_lines")
            continue
        if len(made) == 2:   # TRL's targets: where a prompt is given, each side's whole answer, a start it shares
            # with the other's too (SimPO's, IPO's and ORPO's means and the NLL terms count it): a string prompt is no
            # target already, a prompt of messages has its own assistant turns masked (`prompt_turns`, data.records).
            # Without a prompt the sides' shared start is the prompt (TRL's implicit one): two texts' shared tokens;
            # two conversations' shared messages (back to the start of the answer where they part)
            shared = next((t for t, (x, y) in enumerate(zip(*(m[0]["input_ids"] for m in made))) if x != y),
                          min(len(m[0]["input_ids"]) for m in made))   # (the first token that differs)
            part = max(0, shared - 1) if "prompt" not in r and "prompt_turns" not in r else 0   # (label t: token
            for sample, _, _ in made:   # t + 1's: those before token `shared`)
                labels, start = sample["labels"], part
                while "messages" in r and 0 < start < len(labels) and labels[start] != IGNORE_INDEX and \
                        labels[start - 1] != IGNORE_INDEX:   # back to the start of the answer it parts in
                    start -= 1
                labels[:start] = [IGNORE_INDEX] * start
                for a, e in _runs(labels)[:r.get("prompt_turns", 0)]:   # the prompt's assistant turns (shared by
                    if e <= shared:   # both sides: never where they part)
                        labels[a:e] = [IGNORE_INDEX] * (e - a)
            # both answers scored after the same context (TRL's completion: from where either side's tokens leave the
            # prompt): a token merging the prompt's end with one answer's start (" cap" + "ital" -> " capital") starts
            # that side's targets earlier, so the other side's prompt tokens from there train too (" cap"); until
            # 2026-12-06 each side began at its own, the two answers scored after different contexts (review, helper 85)
            firsts = [next((t for t, lab in enumerate(m[0]["labels"]) if lab != IGNORE_INDEX), None) for m in made]
            c, j = (m[0]["input_ids"] for m in made)   # (the same context before, and the sides part by the later)
            if None not in firsts and (lo := min(firsts)) < (hi := max(firsts)) and c[:lo + 1] == j[:lo + 1] and \
                    c[:hi + 1] != j[:hi + 1]:
                for (sample, _, _), first in zip(made, firsts):
                    sample["labels"][lo:first] = sample["input_ids"][lo + 1:first + 1]
            made = [(sample, n_ids, sum(lab != IGNORE_INDEX for lab in sample["labels"])) for sample, n_ids, _ in made]
            if not all(n for _, _, n in made):   # nothing to prefer: they part in untrained tokens only, or one side
                count(r, "tied", "tied_lines")   # ends where they part (its every target the other's too)
                continue
            stats.pairs += 1
        for sample, n_ids, n_targets in made:
            samples.append(sample)
            stats.samples += 1
            stats.truncated += n_ids > len(sample["input_ids"])   # (until 2026-12-04 dropped records too)
            stats.cut += n_ids - len(sample["input_ids"])
            stats.tokens += len(sample["input_ids"])
            stats.targets += n_targets
    return samples, stats
