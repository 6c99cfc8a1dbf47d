"""What tokenizing records counts and says: `TokenStats`, its one-line summary and its warnings.

Contract:
- `TokenStats` counts a file's records, kept samples, tokens and targets, what truncation cut, the text records split
  into windows (--long-text split), the records dropped with no target (apart: those that had none before any cut,
  `no_target`, and those the cut left none, `dropped`) and the preference pairs kept or dropped as tied (the first
  DROPPED_LINES of each named by line). data/tokens.py's `tokenize_records` fills it, data/store.py's
  `build` sums a file's chunks into one, and the token cache keeps it beside the samples (data/store.py's SOURCES
  hold this file).
- `str(stats)` is the line said at load; `stats.warning(what, max_len, long_text)` the `warning:` lines (records
  dropped, each cause its own line and fix; pairs tied, text records that also hold Alpaca's fields, truncation that
  cut CUT_WARN or more of the kept records' tokens), None when none.
- `LONG_TEXT`: what a text record longer than --max-len becomes (--long-text's choices; the first is the default,
  which the warning's `long_text` defaults to too).
"""

from __future__ import annotations

from dataclasses import dataclass, field

LONG_TEXT = ("split", "truncate")   # what a text record longer than --max-len becomes; the first is the default
DROPPED_LINES = 5   # dropped records named by line in the stats and the warning
CUT_WARN = 0.05   # truncation that cuts this share of the kept records' tokens, or more, is said in a warning


@dataclass
class TokenStats:
    records: int = 0
    samples: int = 0  # kept samples (records - dropped, a split record counting its windows)
    truncated: int = 0  # kept samples longer than max_len, cut to it (a record left with no target: dropped only)
    split: int = 0  # text records longer than max_len made into windows (long_text "split")
    windows: int = 0  # the samples those records became
    dropped: int = 0  # records with no target left after truncation (one before it: the cut took them all)
    no_target: int = 0  # records with no target before any cut (every chat assistant turn "weight": 0): dropped
    tokens: int = 0  # tokens in kept samples, after truncation
    targets: int = 0  # label positions != -100 in kept samples
    longest: int = 0  # longest record in tokens, before truncation or splitting
    cut: int = 0  # tokens truncation removed from kept samples
    special: int = 0  # text and prompt/completion records holding a special token's text (encoded as that token)
    tied: int = 0  # preference pairs dropped with nothing to prefer: the same tokens (after truncation), or the like
    tied_lines: list = field(default_factory=list)  # the first DROPPED_LINES of them
    pairs: int = 0  # preference pairs kept (--objective dpo), each two samples side by side: the chosen, the rejected
    dropped_lines: list = field(default_factory=list)  # the first DROPPED_LINES dropped records' line numbers
    no_target_lines: list = field(default_factory=list)  # the first DROPPED_LINES no-target records' line numbers
    alpaca_text: int = 0  # text records that also hold Alpaca's "instruction" and "output" (tatsu-lab/alpaca's)
    alpaca_text_lines: list = field(default_factory=list)  # the first DROPPED_LINES of them

    def __str__(self) -> str:
        return (
            f"{self.samples} samples from {self.records} records, {self.tokens} tokens "
            f"({self.targets} targets), longest record {self.longest}"
            + (" (before the cut to --max-len)" if self.truncated or self.split else "")
            + f", truncated {self.truncated}"
            + (f" ({self.cut} tokens cut)" if self.truncated else "")
            + (f", split {self.split} into {self.windows} windows" if self.split else "")
            + f", dropped {self.dropped} (no target left)"
            + (f", {self.no_target} with no target (nothing to train) dropped" if self.no_target else "")
            + (f", {self.pairs} preference pairs (two samples each)" if self.pairs else "")
            + (f", {self.tied} pairs dropped as tied (nothing to prefer)" if self.tied else "")
            + (f", {self.special} with special-token text (encoded as those tokens)" if self.special else "")
        )

    def warning(self, what: str, max_len: int, long_text: str = LONG_TEXT[0], unit: str = "line") -> str | None:
        """`warning:` lines: records dropped (nothing of theirs is trained on), naming the first by `unit` (line, record
        or row: data/formats.py); truncation
        that cut CUT_WARN or more of the kept records' tokens (never trained on either), naming the flags that keep
        them. None when neither."""
        said = []
        ev = what.startswith("--eval-data")
        lost = "left out of eval_loss" if ev else "not trained on"
        whole = "no target token at all (every assistant turn has \"weight\": 0)"
        for n, shown, why, fix in (
                (self.no_target, self.no_target_lines, whole,
                 "no --max-len keeps them: give a turn \"weight\": 1 to "
                 + ("evaluate" if ev else "train") + " it, or drop them from the file"),
                (self.dropped, self.dropped_lines, f"no target token within --max-len {max_len}",
                 "a longer --max-len keeps them")):
            if n:   # (each cause its own line: only the cut's is undone by a longer --max-len)
                lines = ", ".join(map(str, shown)) + (", ..." if n > len(shown) else "")
                share = f"{n} of {self.records} records ({100 * n / self.records:.1f}%)"
                said.append(f"warning: {what}: {share} have {why} and are {lost} ({unit}{'s' * (n > 1)} {lines}); "
                            + fix)
        if self.tied:
            more = ", ..." if self.tied > len(self.tied_lines) else ""
            lines = ", ".join(map(str, self.tied_lines)) + more
            many = self.tied > 1
            said.append(f"warning: {what}: {self.tied} preference pair{'s' * many} whose chosen and rejected sides are "
                        f"the same tokens within --max-len {max_len}, or differ in no target, or one ends where they "
                        "part (nothing to prefer) "
                        f"{'are' if many else 'is'} not trained on ({unit}{'s' * many} {lines}); where they differ "
                        "past --max-len, a longer --max-len keeps them")
        if self.alpaca_text:   # (since 2026-12-06; trained as text before too, without a word)
            many, more = self.alpaca_text > 1, ", ..." if self.alpaca_text > len(self.alpaca_text_lines) else ""
            said.append(f"warning: {what}: {self.alpaca_text} of {self.records} records hold \"text\" beside "
                        f"Alpaca's \"instruction\" and \"output\" ({unit}{'s' * many} "
                        f"{', '.join(map(str, self.alpaca_text_lines))}{more}): each is read as its text, every token "
                        "a target, the prompt's too (as TRL's dataset_text_field \"text\"); to train the answers only, "
                        "as chats in the model's template, drop the key (jq -c 'del(.text)' FILE)")
        if self.cut and self.cut >= CUT_WARN * (whole := self.tokens + self.cut):
            said.append(f"warning: {what}: --max-len {max_len} cut {self.cut:,} of the kept records' {whole:,} tokens "
                        f"({100 * self.cut / whole:.0f}%), which are never trained on; "
                        "a longer --max-len keeps them" + (", and --long-text split trains a text record whole" if
                                                            long_text == "truncate" and not self.pairs else ""))
        return "\n".join(said) or None
