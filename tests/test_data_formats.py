"""data/formats.py: the same records read from compressed JSONL, a zip of one file, one JSON array, Parquet, and CSV
and TSV (data/tables.py).

Pins that every form gives the samples JSONL text gives through train.py's loading path (data/load.py's
`load_samples`), that a bad record is named by its line, record or row, that a compressed file cut short is an error
naming it, and Parquet's null rule (a key only some rows or messages have). The files are written by the standard
library (`csv` writes the tables), `zstandard` and `pyarrow` (references nobody here wrote); JSONL text, read as
before, is the reference.

Run: .venv/bin/python -m pytest -q tests/test_data_formats.py
"""

from __future__ import annotations

import bz2
import codecs
import gzip
import json
import lzma
import os
import sys
import zipfile

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import zstandard

from data import DataError, check_file, load_jsonl, load_tokenizer
from data.jsonl import iter_jsonl
from data.load import load_samples
from tests.fixtures import make_tokenizer
from tests.helpers import one_thread, train_argv

MSGS = [{"role": "user", "content": "Is the sky blue at noon?"}, {"role": "assistant", "content": "Yes, mostly."},
        {"role": "user", "content": "And at night? Ça dépend 🙂"}, {"role": "assistant", "content": "Dark."}]
RECORDS = [{"text": "A short document about rivers and the sea."},
           {"prompt": "Name a colour:", "completion": " green"},
           {"messages": MSGS},
           {"messages": [MSGS[0], {**MSGS[1], "weight": 0}, *MSGS[2:]]},   # ("weight" in this row's message only)
           {"text": "Another document, and the last, é à ü."}]


def write_forms(d, records, blank_first=False) -> dict:
    """`records` as JSONL and in every other form, each file's path by its form."""
    jl = ("\n" if blank_first else "") + "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
    raw = jl.encode()
    files = {"jsonl": d / "d.jsonl", "gzip": d / "d.jsonl.gz", "bzip2": d / "d.jsonl.bz2", "xz": d / "d.jsonl.xz",
             "zstd": d / "d.jsonl.zst", "zip": d / "d.zip", "array": d / "d.json", "parquet": d / "d.parquet",
             "gzip named .jsonl": d / "gz.jsonl"}   # (told by its bytes, not its name)
    files["jsonl"].write_bytes(raw)
    for form, pack in (("gzip", gzip.compress), ("bzip2", bz2.compress), ("xz", lzma.compress),
                       ("zstd", zstandard.ZstdCompressor().compress), ("gzip named .jsonl", gzip.compress)):
        files[form].write_bytes(pack(raw))
    with zipfile.ZipFile(files["zip"], "w") as z:   # (a directory and macOS's resource forks beside it: left out)
        z.writestr("data/", b"")
        z.writestr("__MACOSX/data/._d.jsonl", b"\x00\x05\x16\x07")
        z.writestr("data/d.jsonl", raw)
    files["array"].write_text(json.dumps(records, indent=2, ensure_ascii=False), encoding="utf-8")
    keys = sorted({k for r in records for k in r})   # (a column a key: null where a row has none, as the Hub's)
    pq.write_table(pa.table({k: [r.get(k) for r in records] for k in keys}), files["parquet"], row_group_size=2)
    return files


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    make_tokenizer(d)
    return load_tokenizer(d)


def test_every_form_gives_the_samples_of_its_jsonl(tmp_path, tok, monkeypatch):
    """Through load_samples (train.py's path, with the token cache): the same ids, labels and record numbers, and the
    same stats, for every form; and again with the reads cut to 7 bytes (array elements and UTF-8 characters split
    across reads)."""
    import data.formats
    import data.packed

    files = write_forms(tmp_path, RECORDS)
    ref, ref_stats = load_samples(files["jsonl"], tok, 256, len(tok))
    assert len(ref) == ref_stats.records == len(RECORDS)
    for small in (False, True):
        if small:
            monkeypatch.setattr(data.packed, "CHUNK", 7)
        for form, path in files.items():
            cache = str(tmp_path / f"cache{small}")
            for _ in range(2):   # tokenized, then read from the cache
                got, stats = load_samples(path, tok, 256, len(tok), cache=cache)
                assert stats == ref_stats, (form, small)
                assert len(got) == len(ref) and torch.equal(got.sample_lines(), ref.sample_lines()), (form, small)
                for a, b in zip(got, ref):
                    assert torch.equal(a["input_ids"], b["input_ids"]), (form, small)
                    assert torch.equal(a["labels"], b["labels"]), (form, small)


def test_a_bad_record_is_named_by_line_record_or_row(tmp_path):
    files = write_forms(tmp_path, [{"text": "fine"}, {"text": ""}, {"text": "fine too"}], blank_first=True)
    for form, path in files.items():
        where = {"array": "record 2", "parquet": "row 2"}.get(form, "line 3")   # (JSONL counts the blank line)
        with pytest.raises(DataError, match=rf"^{path}, {where}: \"text\" is empty"):
            load_jsonl(path)
    bad = tmp_path / "bad.json"
    for text, said in (('[{"text": "a"}, {"text": "b"}', 'record 3: the JSON array ends without its closing ]'),
                       ('[{"text": "a"}, {"text": "b"', r"record 2: not valid JSON \(.*; the file ends inside it: cut"),
                       ('[{"text": "a"} {"text": "b"}]', "record 2: expected , or ] after record 1"),
                       ('[{"text": "a"}, {"text": "b",}]', "record 2: not valid JSON"),
                       ('[{"text": "a"}] [{"text": "b"}]',
                        r"the JSON array ends after record 1, and '\[{\"text\": \"b\"}\]' follows it: one array")):
        bad.write_text(text)
        with pytest.raises(DataError, match=rf"^{bad}(: |, ){said}"):
            load_jsonl(bad)
    (tmp_path / "empty.json").write_text(" [ ]\n")
    with pytest.raises(DataError, match="has no records"):
        load_jsonl(tmp_path / "empty.json")


def test_a_json_array_read_in_any_pieces_is_json_loads_of_it(tmp_path, monkeypatch):
    """Each read size from 1 byte to past the file's end: the elements are json.loads's of the whole text (the
    reference), a number cut at its "." or "e+" included (read as "1" it was another record, then "expected , or ]"),
    and after a byte-order mark cut by the reads (its first byte alone was taken for the start of a JSONL line)."""
    import data.formats
    import data.packed

    text = ('[1.5e+3 , -0.0,{"a": [1e-2, {"b": "\\ud83d\\ude00 \\" é€😀\\n"}], "c": null} ,\n 12.25,2E-2, true,'
            '"x\\u00e9", [[], {}], false]')
    path = tmp_path / "a.json"
    for bom in (b"", codecs.BOM_UTF8):
        path.write_bytes(bom + text.encode())
        for chunk in range(1, len(text.encode()) + 2):
            monkeypatch.setattr(data.packed, "CHUNK", chunk)
            got = [(n, json.loads(raw)) for n, raw in data.formats.units(path)]
            assert got == list(enumerate(json.loads(text), start=1)), (bom, chunk)


def test_a_compressed_file_cut_short_is_an_error_naming_it(tmp_path):
    """Raised when the reader gets there (the records before the cut are read), naming the file and what is wrong:
    not an EOFError traceback, and never a file quietly shorter (zstd's stream reader ends at a cut without a word)."""
    many = "".join(json.dumps({"text": f"record {i} " + "words " * 20}) + "\n" for i in range(10000)).encode()
    for form, pack in (("gzip", gzip.compress), ("bzip2", bz2.compress), ("xz", lzma.compress),
                       ("zstd", zstandard.ZstdCompressor().compress)):
        path = tmp_path / f"cut.{form}"
        path.write_bytes(pack(many)[:-len(pack(many)) // 3])
        check_file(path, "--data")   # (start-up reads its first bytes only)
        assert next(iter_jsonl(path))["line"] == 1, form
        with pytest.raises(DataError, match=rf"^{path}: the {form} data is cut short or corrupt .*, after line \d+;"):
            load_jsonl(path)


def test_streams_one_after_another_are_read_to_the_last_and_what_is_no_stream_is_an_error(tmp_path):
    """xz and bzip2 files may hold several streams (`cat a.xz b.xz`, pbzip2, xz's stream padding of zero bytes between
    them): every record of every stream is read, as `xz -dc` and `bzip2 -dc` read them. Python's LZMAFile and BZ2File
    stop at the first bytes after a stream that start no stream, and take what follows for trailing garbage: xz's
    padding, or a later stream whose header is corrupt, lost every record after it without a word."""
    lines = ["".join(json.dumps({"text": f"part {p} record {i}"}) + "\n" for i in range(3)).encode() for p in (1, 2)]
    want = [json.loads(x) for part in lines for x in part.decode().splitlines()]
    for form, pack, pads in (("xz", lzma.compress, 2), ("bzip2", bz2.compress, 2),
                             ("zstd", zstandard.ZstdCompressor().compress, 1)):   # (zstd's format has no padding)
        path = tmp_path / f"two.{form}"
        for between in (b"", b"\0" * 4)[:pads]:   # (xz's stream padding; zero bytes, as gzip's reader skips them)
            path.write_bytes(pack(lines[0]) + between + pack(lines[1]))
            assert [{"text": r["text"]} for r in load_jsonl(path)] == want, (form, between)
        bad = bytearray(pack(lines[1]))
        bad[1] ^= 0xFF   # (the second stream's header, corrupt)
        path.write_bytes(pack(lines[0]) + bytes(bad))
        with pytest.raises(DataError, match=rf"^{path}: the {form} data is cut short or corrupt .*, after line 3;"):
            load_jsonl(path)


def test_a_zip_of_several_files_is_refused_at_start_up_naming_them(tmp_path):
    path = tmp_path / "two.zip"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("train.jsonl", '{"text": "a"}\n')
        z.writestr("eval.jsonl", '{"text": "b"}\n')
    with pytest.raises(DataError, match=rf"^--data {path} is a zip archive of 2 files \(train.jsonl, eval.jsonl\): .*"
                                        rf"unzip {path}"):
        check_file(path, "--data")
    inner = tmp_path / "inner.zip"
    with zipfile.ZipFile(inner, "w") as z:
        z.writestr("d.jsonl.gz", gzip.compress(b'{"text": "a"}\n'))
    with pytest.raises(DataError, match=rf"^{inner}: the file it holds is gzip, not JSONL or a JSON array"):
        load_jsonl(inner)


def test_a_zip_whose_file_zipfile_cannot_read_is_refused_at_start_up_naming_it(tmp_path):
    """Deflate64 (Windows' own zip, for large files) and encryption pass a look at the zip's directory but not
    zipfile's open: a NotImplementedError or RuntimeError traceback once the data were read, naming no file."""
    for what, method, flags in (("compressed by deflate64", 9, 0), ("encrypted", 0, 1)):
        path = tmp_path / f"{method}.zip"
        with zipfile.ZipFile(path, "w") as z:
            z.writestr("d.jsonl", b'{"text": "a"}\n')
        b = bytearray(path.read_bytes())
        for magic, at in ((b"PK\x03\x04", 6), (b"PK\x01\x02", 8)):   # (the local header's and the directory's fields)
            i = b.find(magic) + at
            b[i:i + 4] = flags.to_bytes(2, "little") + method.to_bytes(2, "little")
        path.write_bytes(bytes(b))
        with zipfile.ZipFile(path) as z, pytest.raises((NotImplementedError, RuntimeError)):
            z.open("d.jsonl")   # (the reference: zipfile itself cannot read it)
        with pytest.raises(DataError, match=rf"^--data {path}: its file d.jsonl is {what}, which Python's zipfile "
                                            rf"cannot read: extract it \(unzip {path}\)"):
            check_file(path, "--data")


def test_a_missing_package_is_named_with_its_install(tmp_path, monkeypatch):
    files = write_forms(tmp_path, RECORDS[:1])
    monkeypatch.setitem(sys.modules, "zstandard", None)   # (import fails: the GPU machine's python has none)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    for form, pip in (("zstd", "zstandard"), ("parquet", "pyarrow")):
        with pytest.raises(DataError, match=rf"^--data {files[form]} is .*needs the {pip} package.*pip install {pip}"):
            check_file(files[form], "--data")


def test_parquet_nulls_are_missing_keys(tmp_path):
    """Parquet has no missing key: a struct column holds every key any row's has, null where a row has none. Read as
    the JSONL of the same records reads: a message's "weight" or "tool_calls" only some have, a tool schema's
    properties only another tool has, "tools" only some rows have; a tool-calling turn's null "content" stays."""
    weather = {"type": "function", "function": {"name": "weather", "description": "Weather in a city", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "description": "the city"}},
        "required": ["city"]}}}
    clock = {"type": "function", "function": {"name": "clock", "parameters": {
        "type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}}}}}
    call = {"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "weather", "arguments": {"city": "Oslo"}}}]}
    records = [{"messages": [MSGS[0], {**MSGS[1], "weight": 0}, *MSGS[2:]]},
               {"messages": [{"role": "user", "content": "Weather in Oslo?"}, call,
                             {"role": "tool", "content": "rain"}, {"role": "assistant", "content": "Rain."}],
                "tools": [weather, clock]},
               {"messages": MSGS, "tools": [clock]},
               {"text": "plain"}]
    files = write_forms(tmp_path, records)
    read = pq.read_table(files["parquet"]).to_pylist()
    assert read[0]["messages"][1]["tool_calls"] is None and read[0]["tools"] is None   # (what Parquet gives)
    assert read[1]["tools"][1]["function"]["parameters"]["properties"]["city"] is None
    assert load_jsonl(files["parquet"]) == load_jsonl(files["jsonl"])


def test_a_parquet_map_holding_a_key_twice_is_named_by_its_row(tmp_path):
    """A map column (pyarrow's dict of a row) holding one key twice: a dict keeps one of the values, so the row is
    refused naming it (pyarrow's "lossy" reading kept the last value with only a warning)."""
    import pyarrow as pa

    maps = [[("city", "Oslo")], [("city", "Oslo"), ("city", "Rome")]] * 3
    pq.write_table(pa.table({"text": [f"doc {i}" for i in range(6)],
                             "meta": pa.array(maps, type=pa.map_(pa.string(), pa.string()))}), tmp_path / "m.parquet")
    with pytest.raises(DataError) as e:
        load_jsonl(tmp_path / "m.parquet")
    assert str(e.value).startswith(f"{tmp_path / 'm.parquet'}, row 2: a map column holds a key twice ("), str(e.value)
    pq.write_table(pa.table({"text": ["a", "b"], "meta": pa.array(maps[:1] * 2, type=pa.map_(pa.string(),
                                                                                          pa.string()))}),
                   tmp_path / "ok.parquet")
    assert [r["text"] for r in load_jsonl(tmp_path / "ok.parquet")] == ["a", "b"]


def test_show_and_pairs_count_records_and_rows(tmp_path, capsys):
    from data.pairs import check_records
    from data.show import records

    files = write_forms(tmp_path, RECORDS)
    got = list(records(str(files["array"]), 3, [2, 9]))
    assert [r["line"] for r in got] == [2] and got[0]["completion"] == " green"
    assert "has 5 records, not record 9" in capsys.readouterr().out
    with pytest.raises(ValueError, match=rf"--data {files['parquet']} row 1 is not a preference pair"):
        check_records(load_jsonl(files["parquet"]), files["parquet"], "--data", "dpo")


def _same_losses(assets, tmp_path, data: str) -> None:
    """train.py, 1 process, 2 steps on the demo's JSONL and on `data`, its records in another form: the same losses."""
    import train

    losses = []
    for given in (assets["data"], data):
        out = str(tmp_path / f"out{len(losses)}")
        with one_thread():
            train.main(train_argv(assets, out, "--data", given, "--steps", "2"))
        with open(os.path.join(out, "metrics.jsonl")) as f:
            losses.append([json.loads(line)["loss"] for line in f])
    assert len(losses[0]) == 2 and losses[1] == losses[0], losses


def test_a_run_on_gzip_equals_the_run_on_its_jsonl(assets, tmp_path):
    """train.py, 1 process, 2 steps: --data d.jsonl.gz trains the losses --data d.jsonl trains."""
    gz = tmp_path / "chat.jsonl.gz"
    gz.write_bytes(gzip.compress(open(assets["data"], "rb").read()))
    _same_losses(assets, tmp_path, str(gz))


# --- CSV and TSV (data/tables.py): Python's csv module writes the files, the same records as JSONL are the reference

LONG = "A long-context document, over the csv module's 128 KiB cell limit. " * 2400   # (~160K characters)
TABLE = [({"text": "A document, with commas, \"quotes\"\nand a second line;\ttab."}, {}),
         ({"prompt": "Name a colour,\r\nplease:", "completion": " green"}, {}),
         ({"instruction": "Add the numbers", "input": "1, 2", "output": "3"}, {}),
         ({"instruction": "Say hi", "input": "", "output": "Hi \"there\"!"}, {}),   # (Alpaca's empty input)
         ({"messages": MSGS}, {"messages": json.dumps(MSGS, ensure_ascii=False)}),   # (a cell of JSON)
         ({"text": LONG}, {}),
         ({"text": "The last, é à ü 🙂"}, {})]
COLUMNS = ["text", "prompt", "completion", "instruction", "input", "output", "messages"]


def write_table(path, rows, sep=",", bom=False, newline="\r\n", columns=COLUMNS):
    """`rows` ({column: cell}) as a CSV or TSV file by Python's csv module, a column's cell empty where a row has none;
    gzip-compressed or zipped as the name says."""
    import csv
    import io

    f = io.StringIO(newline="")
    w = csv.DictWriter(f, columns, delimiter=sep, lineterminator=newline, restval="")
    w.writeheader()
    w.writerows(rows)
    raw = (codecs.BOM_UTF8 if bom else b"") + f.getvalue().encode()
    if path.suffix == ".zip":
        with zipfile.ZipFile(path, "w") as z:
            z.writestr("train/d" + (".tsv" if sep == "\t" else ".csv"), raw)
    else:
        path.write_bytes(gzip.compress(raw) if path.suffix == ".gz" else raw)
    return path


def test_csv_and_tsv_give_the_samples_of_their_jsonl(tmp_path, tok, monkeypatch):
    """Text, prompt/completion, Alpaca (an empty "input" cell: no input) and messages rows mixed in one file (a row's
    empty cells are no keys), cells holding the delimiter, quotes, line breaks (CRLF in one), a tab, and one over 128
    KiB: through load_samples (with the token cache), the ids, labels, row numbers and stats of the same records as
    JSONL; as CSV and TSV, LF and CRLF, with a byte-order mark, gzip-compressed and zipped, and with 7-byte reads."""
    import csv

    import data.formats
    import data.packed

    jl = tmp_path / "d.jsonl"
    jl.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r, _ in TABLE), encoding="utf-8")
    rows = [{**r, **cells} for r, cells in TABLE]
    files = {"csv": write_table(tmp_path / "d.csv", rows),
             "tsv": write_table(tmp_path / "d.tsv", rows, sep="\t"),
             "csv, LF, BOM": write_table(tmp_path / "bom.CSV", rows, bom=True, newline="\n"),
             "tsv, BOM": write_table(tmp_path / "bom.tsv", rows, sep="\t", bom=True),
             "csv.gz": write_table(tmp_path / "d.csv.gz", rows),
             "zip of a tsv": write_table(tmp_path / "d.zip", rows, sep="\t")}
    limit = csv.field_size_limit()
    ref, ref_stats = load_samples(jl, tok, 256, len(tok))
    assert ref_stats.records == len(TABLE) and ref_stats.split == 1   # (the long document: windows of 256)
    want = load_jsonl(jl)
    for small in (False, True):
        if small:
            monkeypatch.setattr(data.packed, "CHUNK", 7)
        for form, path in files.items():
            assert load_jsonl(path) == want, (form, small)
            assert data.formats.unit(path) == "row", form
            cache = str(tmp_path / f"cache{small}")
            for _ in range(2):   # tokenized, then read from the cache
                got, stats = load_samples(path, tok, 256, len(tok), cache=cache)
                assert stats == ref_stats, (form, small)
                assert torch.equal(got.sample_lines(), ref.sample_lines()), (form, small)
                for a, b in zip(got, ref):
                    assert torch.equal(a["input_ids"], b["input_ids"]), (form, small)
                    assert torch.equal(a["labels"], b["labels"]), (form, small)
    assert csv.field_size_limit() == limit   # (process-global: raised only while our rows are parsed)


def test_a_table_named_csv_that_holds_json_is_read_as_json_and_a_cell_limit_is_kept_for_other_code(tmp_path):
    """The bytes first: JSONL or a JSON array named .csv reads as the JSON it is. csv.field_size_limit is
    process-global: another reader parsing between our rows keeps its own limit (a cell over it is its error)."""
    import csv
    import io

    from data.jsonl import iter_jsonl

    records = [{"text": "a, b"}, {"prompt": "p", "completion": " c"}]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (tmp_path / "lines.csv").write_text("\n" + "".join(json.dumps(r) + "\n" for r in records))
    (tmp_path / "array.tsv").write_text(json.dumps(records))
    want = load_jsonl(tmp_path / "d.jsonl")
    assert load_jsonl(tmp_path / "lines.csv") == [{**r, "line": r["line"] + 1} for r in want]
    assert load_jsonl(tmp_path / "array.tsv") == want
    write_table(tmp_path / "long.csv", [{"text": LONG}, {"text": "short"}], columns=["text"])
    it = iter_jsonl(tmp_path / "long.csv")
    assert next(it)["text"] == LONG
    with pytest.raises(csv.Error, match="field larger than field limit"):   # (between our rows: the default limit)
        list(csv.reader(io.StringIO(f'"{LONG}"')))
    assert next(it)["text"] == "short"


def test_a_bad_table_is_named_by_its_row_and_line(tmp_path):
    """Each error names the file, the row (from 1 under the header) and its line, at the first record's read
    (train.py's start-up check reads it: parallel/preflight.py) when the header or the first row is wrong."""
    from data.pairs import check_first

    h = "instruction,input,output\r\n"
    for name, text, said in (
            ("empty.csv", "", r" is empty: a CSV file's first row names its columns"),
            ("blank.csv", "\n\r\n", r" is empty"),
            ("header.csv", h + "\r\n", r": a header row \('instruction,input,output'\) and no row under it"),
            ("dup.csv", "text,prompt,text\na,b,c\n", r", its header \(line 1\): column 3 is 'text', a name it repeats"),
            ("nameless.tsv", "text\t\ta\tb\t\n", r", its header \(line 1\): column 2 is '', empty"),
            ("spaced.csv", "instruction, input, output\na,b,c\n", r", its header \(line 1\): column 2 is ' input', a "
                                                                  "space around it"),
            ("more.csv", h + 'a,"b\nc",d,e\r\n', r", row 1 \(lines 2-3\): 4 cells, and the header has 3"),
            ("fewer.tsv", "text\tx\na\tb\nc\n", r", row 2 \(line 3\): 1 cells, and the header has 2 .*a tab"),
            ("open.csv", h + 'a,b,c\r\n\r\nd,"e\r\nf,g\r\n', r", row 2 \(lines 4-5\): not valid CSV \(the file ends "
                                                             "inside a quoted cell"),
            ("after.csv", h + 'a,"b"c,d\r\n', r", row 1 \(line 2\): not valid CSV \(',' expected after '\"'"),
            ("cells.csv", h + "a,b,c\n,,\n", r", row 2 \(line 3\): every cell is empty"),
            ("latin1.csv", (h + "caf\xe9,,ok\n").encode("latin-1"), r", row 1: not UTF-8 \(.* of line 2\).*CSV UTF-8"),
            ("repr.csv", "messages\n\"[{'role': 'user', 'content': 'hi'}]\"\n",
             r", row 1 \(line 2\): the 'messages' cell is not JSON .*Python's repr.*orient='records', lines=True"),
            ("notjson.csv", "messages\nhello\n", r", row 1 \(line 2\): the 'messages' cell is not JSON"),
            ("noanswer.csv", h + "a,b,c\nd,e,\n", r", row 2 \(line 3\): no record: its output cell is empty"),
            ("toolong.csv", 'text\n"' + "x" * 200 + "\n", None)):
        path = tmp_path / name
        path.write_bytes(text if isinstance(text, bytes) else text.encode())
        if said is None:   # a quote never closed in a large file: stopped at the cell limit, not the file's end
            import data.tables
            with pytest.MonkeyPatch.context() as m:
                m.setattr(data.tables, "FIELD_LIMIT", 100)
                with pytest.raises(DataError, match=rf"^{path}, row 1 \(line 2\): not valid CSV \(a cell longer than "
                                                    r"100 characters: a quote \(\"\) opened and never closed\?"):
                    load_jsonl(path)
            continue
        with pytest.raises(DataError, match=rf"^{path}{said}"):
            load_jsonl(path)
        if "row 2" not in said:   # (the header and the first row: read at start-up)
            with pytest.raises(DataError, match=rf"^{path}{said}"):
                check_first(str(path), "--data", "sft")


def test_a_table_whose_header_comes_again_is_refused_naming_the_row(tmp_path):
    """CSV files joined (`cat part-*.csv`: Spark's and split exports' parts each have their header; Excel's a BOM too)
    hold a header row among the records: it was read as one ({"prompt": "prompt", "completion": "completion"}, with a
    BOM in its first cell) and trained on without a word, where the same join of JSONL files is refused (its BOM is not
    JSON). Each form, CSV and TSV, gzip-compressed too, names the row, its line and the fix (review, helper 116)."""
    for name, part in (("joined.csv", "prompt,completion\r\nq,a\r\n"), ("joined.tsv.gz", "text\nfirst\n")):
        for bom in (b"", codecs.BOM_UTF8):
            path = tmp_path / name
            raw = (bom + part.encode()) * 2
            path.write_bytes(gzip.compress(raw) if name.endswith(".gz") else raw)
            with pytest.raises(DataError, match=rf"^{path}, row 2 \(line 3\): the header row again "
                                                r"\('(prompt,completion|text)'\): files joined \(cat a.csv b.csv\)"):
                load_jsonl(path)
    (tmp_path / "named.csv").write_text("text\nprompt\n")   # (a cell that is another column's name: a record)
    assert load_jsonl(tmp_path / "named.csv") == [{"line": 1, "text": "prompt"}]


def test_a_line_of_spaces_in_a_table_is_a_blank_line(tmp_path):
    """A line of spaces and no delimiter (an editor's stray indent, "  \r\n") outside quotes is blank: skipped as an
    empty line is, numbering no row, before the header too. It was a row of one cell ("1 cells, and the header has
    3"; in a one-column file an empty "text"). A quoted cell of spaces is a cell still, and its record refused
    (review, helper 117)."""
    rows = [{"prompt": "q1", "completion": "a1"}, {"text": "t2"}]
    for sep, name, spaces in ((",", "d.csv", b" \t "), ("\t", "d.tsv", b"   ")):
        clean = write_table(tmp_path / f"clean.{name}", rows, sep=sep, columns=["text", "prompt", "completion"])
        header, one, two, _ = clean.read_bytes().split(b"\r\n")
        path = tmp_path / name
        lines = [spaces, header, b"  ", one, spaces, b"", two, b"a" + sep.encode() * 3, b"  "]
        path.write_bytes(b"\r\n".join(lines))   # (the last line of spaces without its line break)
        with pytest.raises(DataError, match=rf"^{path}, row 3 \(line 8\): 4 cells, and the header has 3 "):
            load_jsonl(path)   # (rows 1-2 as in the clean file; row 3 its line, blank lines counted)
        path.write_bytes(b"\r\n".join(lines[:7] + lines[8:]))
        assert load_jsonl(path) == load_jsonl(clean) == [{"line": 1, "prompt": "q1", "completion": "a1"},
                                                         {"line": 2, "text": "t2"}], name
    (tmp_path / "one.csv").write_bytes(b"text\n  \nfirst\n \r\nsecond\n")
    assert load_jsonl(tmp_path / "one.csv") == [{"line": 1, "text": "first"}, {"line": 2, "text": "second"}]
    (tmp_path / "quoted.csv").write_bytes(b'text\nfirst\n"  "\n')
    with pytest.raises(DataError, match=rf'^{tmp_path / "quoted.csv"}, row 2\b.*: "text" is empty'):
        load_jsonl(tmp_path / "quoted.csv")


def test_a_rows_record_error_names_its_columns(tmp_path):
    """parse_record's errors on a CSV or TSV row were in JSONL's words ('has none of "text"... (keys: [...]); a valid
    line is {"text": ...}') and named no line: they name the row's lines and columns, the columns a header of no record
    kind needs (with the renames of another format's), or the kind's empty cells. A column of no kind is ignored, as a
    JSONL line's other keys are; Parquet's rows keep JSONL's words (review, helper 117)."""
    import re

    needs = ("a text column, prompt and completion columns, Alpaca's instruction and output, or a messages column "
             "holding JSON")
    valid = ("a valid row fills a text cell, prompt and completion cells, Alpaca's instruction and output, or a "
             "messages cell holding JSON (--objective dpo: prompt, chosen and rejected cells)")
    for name, text, said in (
            ("none.csv", "a,b\r\n\r\n1,2\r\n",
             f"row 1 (line 3): no column of a record kind: the header (a, b) needs {needs}"),
            ("other.tsv", "id\tquestion\tanswer\n1\tq\ta\n",
             f"row 1 (line 2): no column of a record kind: the header (id, question, answer) needs {needs}; it has "
             '"question" and "answer", columns this reader does not read: rename "question" to "prompt", rename '
             '"answer" to "completion"'),
            ("alpaca.csv", 'instruction,input,output\nSay hi,,Hi\nd,"e\nf",\n',
             "row 2 (lines 3-4): no record: its output cell is empty, and this row's filled columns (instruction, "
             f"input) make none (a record needs {needs}); fill it or delete the row"),
            ("id.csv", "text,id\nhi,6\n,7\n", "row 2 (line 3): no record: its text cell is empty, and this row's "
                                              f"filled columns (id) make none (a record needs {needs}); fill it or "
                                              "delete the row"),
            ("both.csv", "text,instruction,output\n,x,\n",
             "row 1 (line 2): no record: its text and output cells are empty, and this row's filled columns "
             f"(instruction) make none (a record needs {needs}); fill them or delete the row"),
            ("half.csv", "prompt,completion\nq,\n", f"row 1 (line 2): its completion cell is empty; {valid}"),
            ("two.csv", "text,completion\nx,y\n", f"row 1 (line 2): has 'text' and 'completion'; fill one kind's "
                                                   f"cells a row; {valid}"),
            ("pair.csv", "prompt,chosen,rejected\nq,,b\n", 'row 1 (line 2): has "rejected" but no "chosen": a '
                                                            "preference pair needs both; a valid pair (--objective "
                                                            "dpo) fills prompt, chosen and rejected cells (a header: "
                                                            "prompt,chosen,rejected)")):
        path = tmp_path / name
        path.write_text(text)
        with pytest.raises(DataError) as e:
            load_jsonl(path)
        assert str(e.value) == f"{path}, {said}", name
    jl = tmp_path / "id.jsonl"
    jl.write_text(json.dumps({"text": "hi", "id": "6"}) + "\n")
    assert [next(iter_jsonl(tmp_path / "id.csv"))] == load_jsonl(jl) == [{"line": 1, "text": "hi"}]
    pq.write_table(pa.Table.from_pylist([{"a": "1", "b": "2"}]), tmp_path / "none.parquet")
    with pytest.raises(DataError, match=rf'^{re.escape(str(tmp_path))}/none.parquet, row 1: has none of "text", '
                                        r'"prompt"/"completion", "messages" \(keys: \[.a., .b.\]\); a valid line is'):
        load_jsonl(tmp_path / "none.parquet")


def test_the_same_bytes_named_csv_and_tsv_are_cached_apart(tmp_path, tok):
    """The token cache is keyed by the file's bytes, and a table's name says how they split: a file that reads as
    CSV and as TSV, to other texts, must not take the other's cached tokens."""
    raw = b"text\tx,text\na\tb,c\n"   # CSV: columns "text\tx" and "text" (text "c"); TSV: "text" and "x,text" ("a")
    (tmp_path / "d.csv").write_bytes(raw)
    (tmp_path / "d.tsv").write_bytes(raw)
    assert [r["text"] for r in load_jsonl(tmp_path / "d.csv")] == ["c"]
    assert [r["text"] for r in load_jsonl(tmp_path / "d.tsv")] == ["a"]
    fresh, _ = load_samples(tmp_path / "d.tsv", tok, 64, len(tok))
    load_samples(tmp_path / "d.csv", tok, 64, len(tok), cache=str(tmp_path / "cache"))
    got, _ = load_samples(tmp_path / "d.tsv", tok, 64, len(tok), cache=str(tmp_path / "cache"))
    assert torch.equal(got[0]["input_ids"], fresh[0]["input_ids"])


def test_a_csv_of_any_other_name_is_named_in_the_json_error(tmp_path):
    path = tmp_path / "alpaca.txt"
    path.write_text("instruction,input,output\na,,b\n")
    with pytest.raises(DataError, match=rf"^{path}, line 1: not valid JSON .*; a CSV or TSV file's header row\? name "
                                        "the file .csv or .tsv"):
        load_jsonl(path)


def test_a_run_on_csv_equals_the_run_on_its_jsonl(assets, tmp_path):
    """train.py, 1 process, 2 steps: --data d.csv (a "messages" column of JSON cells, written by csv) trains the losses
    --data d.jsonl trains."""
    rows = [{"messages": json.dumps(json.loads(line)["messages"])} for line in open(assets["data"]) if line.strip()]
    path = write_table(tmp_path / "chat.csv", rows, columns=["messages"])
    _same_losses(assets, tmp_path, str(path))
