"""CSV and TSV files read as records, for data/formats.py: a header row naming the columns, then a record a row.

Contract:
- Which files: CSV has no magic bytes, so its name tells it (as `load_dataset("csv")` is told): a file named *.csv
  (read with `,`) or *.tsv (a tab), case aside, under one compression suffix too (`d.csv.gz`, .bz2, .xz, .zst, .zstd,
  .zip), or a zip whose one file is so named (`delimiter`). The bytes still come first (data/formats.py): a Parquet
  file is Parquet, and text whose first character past a byte-order mark and blanks is `{` or `[` is JSON whatever
  its name (a header cell never starts so; a JSONL file named .csv is read as the JSONL it is). The token cache's key
  holds the delimiter (data/store.py's `cache_key`, `read_as`): the same bytes named .tsv are other records.
- How: Python's `csv` (RFC 4180: `"` quotes a cell, `""` is a quote inside one, a quoted cell may hold the
  delimiter and line breaks; CRLF or LF), the same quoting for TSV (as pandas reads it), strict: text after a closing
  quote, or a quote open at the file's end, is an error, never a cell quietly joined to what follows. UTF-8, a
  byte-order mark left out. Read a line at a time (a large file is never read whole). A cell may hold FIELD_LIMIT
  characters (the module's default, 128 KiB, is a few pages: a long-context document is megabytes); the limit is
  process-global in Python, so it is raised only while this reader parses a row and put back after (other code in
  the process keeps its own), and bounded, so a quote left open in a large file fails before it holds the file.
- What: each row is {column: cell}, its empty cells left out (a CSV cannot say "no value" otherwise; pandas and
  `datasets` read them as None, and data/formats.py leaves Parquet's nulls out the same way): a file of text rows
  and prompt/completion rows has both columns, and Alpaca's empty "input" is no input, as in JSONL. Then it is any
  line's record (data/records.py's `parse_record`): "text", "prompt"/"completion", Alpaca's and ShareGPT's columns.
  A cell of a column that holds a list and never text ("messages", "conversations", "conversation", "history":
  JSON_COLUMNS) is parsed as JSON; "tools" is read as any record's string; every other cell stays text (a prompt may
  well start with "[INST]"). Blank lines are skipped, and so is a line of spaces and no delimiter (outside quotes:
  `"  "` is a cell; a TSV line of tabs is a row of empty cells), as JSONL's are: neither numbers a row. Rows are
  numbered from 1 under the header ("row N", as Parquet's rows; a spreadsheet shows row N + 1, and N + 1 + blank
  lines above it), and errors add the file's line (a cell may span lines).
- Errors, each a DataError naming the file, the row and its line: a header with an empty, repeated or space-padded
  name; a row with more or fewer cells than the header; a row whose every cell is empty; a row that is the header
  again, a BOM aside (files joined with cat keep each part's: it trained as a record); a quote left open; text that is
  not UTF-8 (Excel's "CSV" is not: its "CSV UTF-8" is); a JSON column's cell that is not JSON (Python's repr, as
  pandas' to_csv writes a list column, named with the command that writes JSONL); a file with no header, or a header
  and no row. Nothing is dropped without a word. A row's record errors are parse_record's, said in columns (`Row`:
  VALID_LINES as the cells a row fills, and a row of no record kind named by its filled columns and the header's
  empty ones, or, a header of none, by the columns it needs, with ALIASES' renames); a column of no kind is ignored
  when the row has a record, as a JSONL line's other keys are.
"""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path

from data.jsonl import PAIR_LINES, VALID_LINES, DataError

FIELD_LIMIT = 1 << 27   # characters a cell may hold while this reader parses (the csv module's default: 1 << 17)
SEPARATORS = {".csv": ",", ".tsv": "\t"}
PACKED = (".gz", ".bz2", ".xz", ".zst", ".zstd", ".zip")   # a suffix the name is read under
JSON_COLUMNS = ("messages", "conversations", "conversation", "history")   # lists, never text: a cell is their JSON


def delimiter(name: str) -> str | None:
    """"," for a name ending in .csv, a tab for .tsv, under one compression suffix too; None for any other name."""
    name = name.lower()
    if name.endswith(PACKED):
        name = name.rsplit(".", 1)[0]
    return next((sep for end, sep in SEPARATORS.items() if name.endswith(end)), None)


# The columns of each record kind a row may fill (data/records.py's kinds, Alpaca's and ShareGPT's columns, a pair's)
KINDS = (("text",), ("prompt", "completion"), ("instruction", "output"), ("messages",), ("conversations",),
         ("conversation",), ("chosen", "rejected"))
NEEDS = ("a text column, prompt and completion columns, Alpaca's instruction and output, or a messages column "
         "holding JSON")
IN_COLUMNS = {   # parse_record's JSONL words -> a table's
    VALID_LINES: f"a valid row fills {NEEDS.replace('column', 'cell')} (--objective dpo: prompt, chosen and rejected "
                 "cells)",
    PAIR_LINES: "a valid pair (--objective dpo) fills prompt, chosen and rejected cells (a header: "
                "prompt,chosen,rejected)",
    ' (a record that is all target is {"text": ...})': " (a record that is all target is a text cell)",
    "; use one kind per line": "; fill one kind's cells a row", "; this line has ": "; this row has "}


class Row(dict):
    """A row's {column: cell}, which knows its lines and the header: data/records.py's `parse_record` raises its errors
    through `error`, in columns."""

    def __init__(self, cells: dict, at: str, header: list[str]):
        super().__init__(cells)
        self.at, self.header = at, header

    def error(self, e: DataError, p, n: int) -> DataError:
        """parse_record's DataError on this row (row `n` of `p`) in a table's words, the row's lines named."""
        from data.jsonl import where
        from data.records import _alias_hint

        head, said = f"{where(p, n)}: ", str(e)
        if not said.startswith(head):
            return e
        said = said[len(head):]
        if said.startswith('has none of "text", "prompt"/"completion", "messages"'):   # (no kind: words of its own)
            kinds = [c for k in KINDS if all(c in self.header for c in k) for c in k]
            if not kinds:
                hint = _alias_hint(dict.fromkeys(self.header), ("prompt", "completion", "messages"))
                said = f"no column of a record kind: the header ({', '.join(self.header)}) needs {NEEDS}" + \
                    hint.replace("; this line has ", "; it has ").replace(", which this", ", columns this")
            else:
                empty = [c for c in dict.fromkeys(kinds) if c not in self]
                said = (f"no record: its {' and '.join(empty)} cell{'s are' if len(empty) > 1 else ' is'} empty, and "
                        f"this row's filled columns ({', '.join(self)}) make none (a record needs {NEEDS}); fill "
                        f"{'them' if len(empty) > 1 else 'it'} or delete the row")
        for jsonl, table in IN_COLUMNS.items():
            said = said.replace(jsonl, table)
        said = re.sub(r'^("\w+" side: )?"(\w+)" must be a string, got nothing', r"\1its \2 cell is empty", said)
        return DataError(f"{p}, row {n} ({self.at}): {said}")


class _NotUTF8(Exception):
    pass


def _text(lines):
    """The file's lines as text, a byte-order mark left out."""
    for i, line in enumerate(lines):
        try:
            yield line.decode("utf-8-sig" if i == 0 else "utf-8")
        except UnicodeDecodeError as e:
            raise _NotUTF8(f"not UTF-8 ({e.reason} at byte {e.start} of line {i + 1}); write it as UTF-8 (Excel: "
                           'Save As "CSV UTF-8")') from None


def rows(p: Path, lines, sep: str):
    """(n, {column: cell}) for each row under the header of the CSV (or TSV: `sep`) text `lines` (bytes, a line each,
    from data/formats.py), as the module docstring says."""
    ink = [False]   # whether the row being read has a character past whitespace (a quote is one: "  " is a cell)

    def text():
        for line in _text(lines):
            ink[0] = ink[0] or not line.isspace()
            yield line

    reader = csv.reader(text(), delimiter=sep, strict=True)
    what = "TSV" if sep == "\t" else "CSV"
    where = lambda first, last: f"line {last}" if first >= last else f"lines {first}-{last}"
    name = lambda: f"row {n + 1}" if n >= 0 else "its header"   # (the row being read)

    def row():   # the next row, or None at the end; [] a blank line (spaces too: one cell of them, unquoted)
        old = csv.field_size_limit()
        csv.field_size_limit(FIELD_LIMIT)   # (process-global: ours only while we parse)
        start, ink[0] = reader.line_num + 1, False
        try:
            cells = next(reader, None)
            return [] if cells and len(cells) == 1 and not ink[0] else cells
        except _NotUTF8 as e:
            raise DataError(f"{p}, {name()}: {e}") from None
        except csv.Error as e:
            said = str(e)
            if "field limit" in said:
                said = f"a cell longer than {FIELD_LIMIT} characters: a quote (\") opened and never closed?"
            elif "unexpected end of data" in said:
                said = "the file ends inside a quoted cell: a quote (\") opened there and never closed"
            else:
                said += (": a quote inside a cell must be doubled (\"\"), and a quoted cell end at the next "
                         f"{'tab' if sep == chr(9) else sep!r} or line break")
            raise DataError(f"{p}, {name()} ({where(start, max(start, reader.line_num))}): not valid {what} "
                            f"({said})") from None
        finally:
            csv.field_size_limit(old)

    n = -1
    while (header := row()) == []:
        pass
    if header is None:
        raise DataError(f"{p} is empty: a {what} file's first row names its columns (text, or prompt,completion, or "
                        "instruction,input,output), and each row under it is a record")
    for i, col in enumerate(header, start=1):
        if not col or col != col.strip() or header.index(col) < i - 1:
            why = "empty" if not col else "a space around it" if col != col.strip() else "a name it repeats"
            raise DataError(f"{p}, its header (line {reader.line_num}): column {i} is {col!r}, {why}: each column "
                            f"needs a name of its own, without spaces around it (a file written with "
                            f"'{sep} ' between cells keeps the space in every cell too)")
    n = 0
    while True:
        start = reader.line_num + 1
        if (cells := row()) is None:
            break
        if not cells:
            continue
        n += 1
        at = where(start, reader.line_num)
        if len(cells) != len(header):
            raise DataError(f"{p}, row {n} ({at}): {len(cells)} cells, and the header has {len(header)} "
                            f"({sep.join(header)!r}): a cell holding {'a tab' if sep == chr(9) else repr(sep)}, a "
                            "quote or a line break must be quoted (\"...\"), a quote in it doubled (\"\")")
        if [cells[0].removeprefix("\ufeff"), *cells[1:]] == header:   # (a part's BOM too: in its first cell)
            raise DataError(f"{p}, row {n} ({at}): the header row again ({sep.join(header)!r}): files joined (cat "
                            "a.csv b.csv) keep each one's header, which would train as a record; delete it, or pass "
                            "the files to --data one by one")
        rec = {k: v for k, v in zip(header, cells) if v != ""}
        if not rec:
            raise DataError(f"{p}, row {n} ({at}): every cell is empty, no record; delete the row")
        for k in JSON_COLUMNS:
            if k in rec:
                try:
                    rec[k] = json.loads(rec[k])
                except json.JSONDecodeError as e:
                    hint = ("; it reads as Python's repr of a list (pandas' to_csv writes a list column so), not "
                            "JSON: write the data as JSONL, df.to_json('d.jsonl', orient='records', lines=True)"
                            if rec[k].lstrip().startswith(("[{'", "[['", "['")) else
                            f"; a {what} cell of {k!r} holds its JSON list, [{{\"role\": \"user\", \"content\": "
                            "...}, ...]")
                    raise DataError(f"{p}, row {n} ({at}): the {k!r} cell is not JSON ({e.msg} at character "
                                    f"{e.pos + 1}){hint}") from None
        yield n, Row(rec, at, header)
    if not n:
        raise DataError(f"{p}: a header row ({sep.join(header)!r}) and no row under it: no records")
