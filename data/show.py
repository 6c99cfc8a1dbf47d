"""What a run trains on, token by token: records tokenized as train.py tokenizes them, their targets marked.

    python -m data.show --model DIR --data FILE [FILE ...] [--n 3 | --lines 5 17] [--max-len N]
        [--chat-template NAME|FILE] [--long-text split|truncate] [--train-on-prompt] [--template-date YYYY-MM-DD]
    python -m data.show --run OUT [--n 3 | --lines ...]     # a run's own flags, from OUT/config.json

Contract:
- The records are the first `--n` non-blank lines of each file, or the lines `--lines` names (1-based, as errors
  and `--eval-split` name them; a JSON array's records, Parquet's rows: data/formats.py), read one at a time (a large
  file is not loaded whole). Each is tokenized by
  `data.tokens.tokenize_records` with the run's --max-len, --long-text, chat template and template date: the same
  function train.py calls, so the same samples, tokens and targets.
- Each sample prints a header `FILE:LINE sample k/K: N tokens, T targets` and its text, decoded span by span, the
  target tokens (those a label points to: `labels[t] = input_ids[t+1]`, so the first token never is) marked green
  on a terminal, between `[[` and `]]` otherwise (`--color`/`--no-color` force one). Joining the spans gives the
  tokenizer's decoding of the whole sample; the marked spans joined give that of its target tokens alone. A record
  left with no target (train.py drops it) is said as such. A last line sums the samples, tokens and targets.
- `--run OUT` takes `model`, `data`, `max_len`, `long_text`, the chat template's text and the template date from
  the run's config.json (paths as typed, from the directory it started in, `cwd`); flags given beside it win.
- Only the tokenizer is read, never the weights: seconds, on any machine.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

MARKS = ("[[", "]]")
GREEN = ("\x1b[32m", "\x1b[0m")


def spans(sample: dict) -> list[tuple[bool, list[int]]]:
    """The sample's ids as runs of (is a target, ids): token t is a target when labels[t - 1] points to it."""
    from loss import IGNORE_INDEX

    ids, labels = list(map(int, sample["input_ids"])), list(map(int, sample["labels"]))
    out = []
    for t, i in enumerate(ids):
        target = t > 0 and labels[t - 1] != IGNORE_INDEX
        if out and out[-1][0] == target:
            out[-1][1].append(i)
        else:
            out.append((target, [i]))
    return out


def render(sample: dict, tok, marks: tuple[str, str]) -> str:
    """The sample's text with its target spans between `marks`."""
    decode = lambda ids: tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    return "".join(f"{marks[0]}{decode(ids)}{marks[1]}" if target else decode(ids) for target, ids in spans(sample))


def records(path: str, n: int, lines: list[int] | None):
    """The file's records to show, one read at a time (module docstring)."""
    from data.formats import unit, units
    from data.jsonl import check_file
    from data.records import parse_record

    want, got, k = set(lines or ()), 0, 0
    for k, raw in units(check_file(path, "--data")):
        if lines is not None and k not in want:
            if k > max(want):
                break
            continue
        if isinstance(raw, str) and not raw.strip():
            if lines is not None:
                print(f"{path}:{k}: a blank line (no record)")
            continue
        yield parse_record(raw, path, k)
        got += 1
        if lines is None and got >= n:
            break
    if lines is not None and (past := sorted(x for x in want if x > k)):
        print(f"{path}: has {k} {unit(path)}s, not {unit(path)} {', '.join(map(str, past))}")


def from_run(out: str) -> dict:
    """The flags of the run in OUT that decide its tokens (module docstring)."""
    path = os.path.join(out, "config.json")
    if not os.path.isfile(path):
        raise ValueError(f"--run {out!r} has no config.json: pass a train.py run's --out directory")
    cfg = json.load(open(path))
    at = lambda f: os.path.join(cfg.get("cwd", ""), f)
    from data.mix import data_files
    model = at(cfg["model"]) if os.path.isdir(at(cfg["model"])) else cfg["model"]   # (the demo's is relative)
    return {"model": model, "data": [at(f) for f in data_files(cfg["data"])], "max_len": cfg["max_len"],
            "long_text": cfg.get("long_text", "truncate"), "template_text": cfg.get("chat_template_text"),
            "train_on_prompt": bool(cfg.get("train_on_prompt")),
            "template_date": cfg.get("template_date")}


def main(argv=None) -> int:
    from data.templates import parse_day
    from data.token_stats import LONG_TEXT

    p = argparse.ArgumentParser(prog="python -m data.show", description=__doc__.split("\n")[0])
    p.add_argument("--run", default=None, metavar="OUT", help="a run's folder: its model, data and token flags")
    p.add_argument("--model", default=None, help="the checkpoint folder (its tokenizer is read)")
    p.add_argument("--data", nargs="+", default=None, metavar="FILE", help="JSONL files (or hf://datasets/..., as "
                   "train.py's)")
    p.add_argument("--n", type=int, default=3, help="the first N records of each file")
    p.add_argument("--lines", nargs="+", type=int, default=None, metavar="L",
                   help="these lines of each file instead (a JSON array's records, Parquet's rows)")
    p.add_argument("--max-len", type=int, default=None, help="as train.py's (default 256, or the run's)")
    p.add_argument("--long-text", choices=LONG_TEXT, default=None, help=f"as train.py's (default {LONG_TEXT[0]})")
    p.add_argument("--train-on-prompt", action="store_true", default=None, help="as train.py's (--run: the run's)")
    p.add_argument("--chat-template", default=None, help="as train.py's: a name or a Jinja file")
    p.add_argument("--template-date", type=parse_day, default=None, help="as train.py's: the day a dated template "
                   "writes")
    p.add_argument("--color", default=None, action=argparse.BooleanOptionalAction, help="green targets (default: on a "
                   "terminal; else [[...]])")
    args = p.parse_args(argv)
    try:
        show(args)
    except (ValueError, FileNotFoundError) as e:   # (DataError too: the message names the line and the fix; a Hub
        # fetch's failure, the URL)
        print(f"error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:   # (`| head`: the reader has what it wanted)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


def show(args) -> None:
    from data.hub_data import is_hub, resolve
    from data.load import load_tokenizer
    from data.mix import data_files
    from data.templates import chat_template
    from data.token_stats import LONG_TEXT
    from data.tokens import tokenize_records

    if args.data and any(map(is_hub, args.data)):   # hf://datasets/...: its files, fetched as train.py fetches them
        hub = argparse.Namespace(data=args.data, data_weights=None)
        resolve(hub)
        args.data = data_files(hub.data)
    run = from_run(args.run) if args.run else {}
    model, files = args.model or run.get("model"), args.data or run.get("data")
    if not model or not files:
        raise ValueError("pass --model DIR and --data FILE [FILE ...], or --run OUT (a train.py run's folder)")
    max_len = args.max_len or run.get("max_len") or 256
    long_text = args.long_text or run.get("long_text") or LONG_TEXT[0]
    every = bool(args.train_on_prompt or run.get("train_on_prompt"))
    template = chat_template(args.chat_template) if args.chat_template else run.get("template_text")
    day = args.template_date or run.get("template_date")
    if args.n < 1 or (args.lines is not None and min(args.lines) < 1):
        raise ValueError("--n and --lines count from 1")
    tok = load_tokenizer(model, template)
    color = sys.stdout.isatty() if args.color is None else args.color
    marks = GREEN if color else MARKS
    print(f"targets: {'green' if color else ' '.join(MARKS)}; --max-len {max_len}, --long-text {long_text}"
          + ", --train-on-prompt" * every
          + (", the run's chat template" if template and not args.chat_template else ""))
    n_samples = n_tokens = n_targets = 0
    for path in files:
        for rec in records(str(path), args.n, args.lines):
            if every and "pair" in rec:   # (as train.py: --objective dpo refuses the flag)
                raise ValueError(f"{path}:{rec['line']}: a preference pair, and --train-on-prompt is refused with "
                                 "--objective dpo (no run trains a pair's prompt): drop it")
            samples, stats = tokenize_records([rec], tok, max_len, path, day, long_text, every)
            if not samples:
                why = (f"tied: its chosen and rejected sides are the same tokens, or differ in no target, or one "
                       f"ends where they part, within --max-len {max_len}" if stats.tied else
                       "no target token at all (every assistant turn has \"weight\": 0)" if stats.no_target else
                       f"no target left (--max-len {max_len}" + " in one side" * ("pair" in rec) + ")")
                print(f"\n{path}:{rec['line']}: {why}: train.py drops this record")
                continue
            # a pair's side is cut when it lost tokens (its own end, or the prompt start both sides lose)
            alone = lambda side, p=path: len(tokenize_records([side], tok, 2**62, p, day, long_text)[0][0]["input_ids"])
            whole = [stats.truncated > 0] if "pair" not in rec else \
                [alone(side) > len(s["input_ids"]) for side, s in zip(rec["pair"], samples)]
            for k, s in enumerate(samples, start=1):
                targets = sum(t for t, ids in spans(s) for _ in ids)
                n_samples, n_tokens, n_targets = n_samples + 1, n_tokens + len(s["input_ids"]), n_targets + targets
                which = ("chosen", "rejected")[k - 1] if "pair" in rec else f"sample {k}/{len(samples)}"
                print(f"\n{path}:{rec['line']} {which}: {len(s['input_ids'])} tokens, {targets} targets"
                      + (" (cut to --max-len)" if whole[min(k, len(whole)) - 1] else ""))
                print(render(s, tok, marks))
    print(f"\n{n_samples} sample{'s' * (n_samples != 1)}, {n_tokens} tokens, {n_targets} targets")


if __name__ == "__main__":
    sys.exit(main())
