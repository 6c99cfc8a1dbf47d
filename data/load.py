"""A data file's samples: the checkpoint's tokenizer, the file tokenized (data/tokens.py) or read from the token
cache (data/store.py), and its ids checked against the model's vocabulary.

Contract:
- `load_tokenizer(model_dir, template=None)` loads the tokenizer saved next to the checkpoint, offline only (one that
  encodes text to no tokens, its vocabulary file missing, is a `DataError`); `template` (--chat-template's text,
  data/templates.py) replaces the checkpoint's. A tokenizer with no template of its own takes a multimodal
  checkpoint's processor template (`chat_template.json`: Mistral Small 3.1's, Gemma 3's repos keep it there), as
  transformers' processor would render the text turns.
- `load_samples(path, ...)` does what data/tokens.py's `tokenize_records` does, for a file, chunk by chunk into a
  compact `data.samples.Samples`, read from or kept in a disk cache when given one (data/store.py), and checks the
  ids against the model's vocabulary.
- `check_vocab(samples, tokenizer, vocab_size, path)`: every token id indexes the model's embedding, else a
  `DataError` naming the fix, before any weight is read.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

from data.jsonl import DataError
from data.token_stats import LONG_TEXT, TokenStats
from data.tokens import tokenize_records

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")
PROCESSOR_TEMPLATE = "chat_template.json"   # {"chat_template": ...}: where a multimodal checkpoint's processor keeps it


def _processor_template(path: Path) -> str:
    """The chat template a multimodal checkpoint keeps for its processor only (AutoTokenizer does not read it), which
    renders text turns as its tokenizer's would."""
    import json

    try:
        text = json.loads(path.read_text(encoding="utf-8")).get("chat_template")
    except (OSError, ValueError, AttributeError) as e:
        raise DataError(f"{path} cannot be read as a chat template ({type(e).__name__}: {e}): fix or remove it") from e
    if not isinstance(text, str) or not text.strip():
        raise DataError(f"{path} holds no \"chat_template\" text: fix or remove it, or pass --chat-template")
    return text


def load_tokenizer(model_dir: str | Path, template: str | None = None):
    """`AutoTokenizer` from the checkpoint directory, never from the hub; `template`: --chat-template's text in place
    of the checkpoint's (`data.templates.apply_template` checks it)."""
    from transformers import AutoTokenizer  # import here: transformers takes seconds to import

    d = Path(model_dir)
    if not d.is_dir():
        raise DataError(f"model directory {d} does not exist")
    if not any((d / f).is_file() for f in TOKENIZER_FILES):
        raise DataError(
            f"model directory {d} has no tokenizer files (looked for {', '.join(TOKENIZER_FILES)}); "
            "copy the tokenizer that belongs to the checkpoint next to config.json"
        )
    try:
        tok = AutoTokenizer.from_pretrained(str(d), local_files_only=True)
    except Exception as e:
        why = _config_at_fault(d)   # (with the tokenizer's own words: it may be at fault too)
        raise DataError(f"{why} (the tokenizer's own error: {e})" if why else
                        f"could not load the tokenizer in {d}: {e}") from e
    if not tok("Hello world", add_special_tokens=False)["input_ids"]:   # (tokenizer_config.json without tokenizer.json:
        raise DataError(   # every record was tokenized to nothing, then refused as having no target, blaming the data)
            f"the tokenizer in {d} encodes text to no tokens (its vocabulary: {len(tok)} entries): its vocabulary file "
            "(tokenizer.json, tokenizer.model, or vocab.json with merges.txt) is missing or empty; copy the tokenizer "
            "that belongs to the checkpoint next to config.json")
    if tok.chat_template is None and (d / PROCESSOR_TEMPLATE).is_file():   # a multimodal checkpoint's template, kept
        tok.chat_template = _processor_template(d / PROCESSOR_TEMPLATE)   # for its processor (Mistral 3, Gemma 3)
    if template is not None:
        from data.templates import apply_template
        apply_template(tok, template)
    return tok


def _config_at_fault(d: Path) -> str | None:
    """Why transformers refuses `d`'s config.json, which AutoTokenizer reads to pick the tokenizer (transformers 5
    checks each field's type: a tie_word_embeddings "yes", an rms_norm_eps written 0), or None: the tokenizer's own."""
    from transformers import AutoConfig

    if not (d / "config.json").is_file():
        return None
    try:
        AutoConfig.from_pretrained(str(d), local_files_only=True)
    except Exception as e:   # noqa: BLE001 - transformers' own words name the field
        return (f"{d / 'config.json'} is refused by transformers, which reads it to load the tokenizer: {e}. Fix that "
                "field in config.json (the checkpoint's own value, of the type named)")
    return None


def load_samples(path, tokenizer, max_len: int, vocab_size: int, flag: str = "--data", cache: str | None = None,
                 write: bool = True, log=None, sha256: str | None = None, day: str | None = None, warn=None,
                 long_text: str = LONG_TEXT[0], workers: int = 1, objective: str | None = None,
                 all_targets: bool = False):
    """A JSONL file -> (data.samples.Samples, TokenStats), refusing a file with no target and out-of-vocab ids. With
    `cache` (a directory): read from there when it holds this file's tokens under the same key (data/store.py),
    else tokenized and, when `write`, kept there for the next run, and then read back from there (memory-mapped: the
    machine's other ranks share those pages). `sha256`: the file's, when already known; `day`: the date a dated
    template writes and its key holds (data/store.py's `today()` if None). `warn` (default `log`): where a cache that
    cannot be read or written is said. `long_text`: what a text record longer than max_len becomes (data/tokens.py's
    docstring). `all_targets`: --train-on-prompt (data/tokens.py's docstring). `workers`: processes that may tokenize
    (data/store.py's `build`). `objective` (sft, dpo): every record read is checked to be of its kind
    (`data.pairs.check_records`) before any is tokenized."""
    from data import store
    from data.formats import table, unit
    from data.jsonl import load_jsonl

    warn, day = warn or log, day or store.today()   # (one date for the key and the rendering)
    sha256 = sha256 or (cache and store.file_sha256(path))
    try:
        key = cache and store.cache_key(sha256, tokenizer, max_len, day, long_text, all_targets, table(Path(path)))
    except OSError as e:   # an unreadable tokenizer file: no cache this time, never the run
        key = None
        if warn:
            warn(f"data cache skipped: {e}")
    hit = key and store.read(Path(cache) / f"{key}.pt", key, warn)
    if hit:
        samples, stats = hit[0], TokenStats(**hit[1])
        if log:
            log(f"{flag} {path}: tokens from the cache {Path(cache) / key}.pt")
    else:
        job = (tokenizer, max_len, path, day, long_text, all_targets)   # (tokenize_records' arguments after records)
        records = load_jsonl(path)
        if objective:
            from data.pairs import check_records
            check_records(records, path, flag, objective)
        samples, stats = store.build(records, lambda rs: tokenize_records(rs, *job), log, f"{flag} {path}", workers,
                                     job)
    if not len(samples):   # (the cut's drops name --max-len: "fix the file" misled there, review, helper 111)
        why = [f"--max-len {max_len} left {stats.dropped} of them no target (the longest record has {stats.longest} "
               f"tokens): a longer --max-len keeps them"] if stats.dropped else []
        why += [f"{stats.no_target} had none to begin with (every assistant turn \"weight\": 0): give a turn "
                "\"weight\": 1"] if stats.no_target else []
        why += ["every preference pair is tied (its sides the same tokens within --max-len, or differing in no "
                "target, or one ending where they part): where they differ past --max-len, a longer --max-len keeps "
                "them; else fix the file or drop it"] if stats.tied else []
        raise DataError(f"{flag} {path}: no sample has a target token ({stats}); "
                        + ("; ".join(why) or f"fix the file or drop it from {flag}"))
    if log and (said := stats.warning(f"{flag} {path}", max_len, long_text, unit(path))):
        log(said)
    check_vocab(samples, tokenizer, vocab_size, path)
    if not hit and sha256 and store.file_sha256(path) != sha256:   # the run records `sha256` as what it read
        raise DataError(f"{flag} {path} changed while it was read (its sha256 at start-up was {sha256[:12]}); let "
                        "whatever writes it finish, then start the run again")
    if key and not hit and write:
        if store.write(Path(cache) / f"{key}.pt", key, samples, asdict(stats), warn):
            samples = (store.read(Path(cache) / f"{key}.pt", key) or (samples,))[0]   # the shared pages
    return samples, stats


def check_vocab(samples, tokenizer, vocab_size: int, path: str | Path) -> None:
    """Every token id must index the model's embedding: out-of-range ids crash late (an IndexError on
    CPU, an illegal memory access on CUDA), so they are refused here, before any weight is read."""
    top = samples.max_id() if hasattr(samples, "max_id") else max((max(s["input_ids"]) for s in samples), default=-1)
    n_tok = len(tokenizer)
    if top >= vocab_size or n_tok > vocab_size:
        raise DataError(
            f"{path}: the tokenizer has {n_tok} tokens and the data's largest token id is {top}, but the "
            f"model's vocab_size is {vocab_size} (config.json): the {'data' if top >= vocab_size else 'tokenizer'}"
            f" is bigger. Use the tokenizer that belongs to this checkpoint (next to its config.json)"
        )
