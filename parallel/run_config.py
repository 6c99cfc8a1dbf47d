"""OUT/config.json: the run's record for people and tools (data/show.py, data/demo_compare.py, the W&B sink's
config, the merge's --quant for an adapter without trained_on.json). Rank 0 writes it once the run holds its folder
(parallel/runs.py's `open_files`).

Contract:
- `write_config(args, layout, stats, eval_samples)`: OUT/config.json: the run's flags (`vars(args)`), its working
  directory, layout, data statistics and, for --eval-split, the records it held out of each --data file.
- `config_json(config)`: its text; `json.loads` gives the dict back (a tuple as a list, a value JSON has no type for
  as its `str`).
"""

from __future__ import annotations

import json
import os
import uuid


def write_config(args, layout, stats, eval_samples) -> None:
    """OUT/config.json (rank 0's): the run's flags, its working directory, layout, data statistics and, for
    --eval-split, the records it held out of each --data file."""
    from data.mix import data_files, held_records
    held = {"eval_split_records": held_records(eval_samples, data_files(args.data))} if args.eval_split else {}
    with open(os.path.join(args.out, "config.json"), "w") as f:
        f.write(config_json({**vars(args), "cwd": os.getcwd(), "layout": str(layout), "data_stats": str(stats),
                             **held}))


def config_json(config: dict) -> str:
    """config.json's text: one key a line (indent 1), and a list of whole numbers on one line (--eval-split's
    held-out lines of a large split took one line each, megabytes of them). Strings are never touched."""
    tag, flat = uuid.uuid4().hex, {}

    def mark(o):
        if isinstance(o, dict):
            return {k: mark(v) for k, v in o.items()}
        if isinstance(o, list) and o and all(type(x) is int for x in o):
            flat[f"{tag}:{len(flat)}"] = json.dumps(o)
            return f"{tag}:{len(flat) - 1}"
        return [mark(x) for x in o] if isinstance(o, list) else o

    text = json.dumps(mark(config), indent=1, default=str)
    for key, numbers in flat.items():
        text = text.replace(json.dumps(key), numbers, 1)
    return text
