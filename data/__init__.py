"""Data pipeline: JSONL records -> token samples -> layout-independent global batches -> micro-batches.

    records = load_jsonl(path)                                   # data/jsonl.py
    samples, stats = tokenize_records(records, tok, max_len, path)  # data/tokens.py: lists
    samples, stats = load_samples(path, tok, max_len, vocab_size, cache=DIR)  # the same, compact and cached
                                                                 # (data/load.py, data/store.py): what train.py uses
    order = GlobalBatches(len(samples), global_batch, seed)      # data/batches.py
    for idx in order.micro_batches(step, data_rank, data_ranks, micro_batch):
        batch = collate([samples[i] for i in idx], pack, divisor, pad_id)  # data/collate.py
"""

from data.batches import GlobalBatches, check_batch_sizes
from data.collate import collate, count_targets
from data.demo import make_demo
from data.jsonl import DataError, check_file, load_jsonl
from data.load import check_vocab, load_samples, load_tokenizer
from data.token_stats import TokenStats
from data.tokens import tokenize_records

__all__ = [
    "DataError",
    "check_file",
    "check_vocab",
    "load_samples",
    "GlobalBatches",
    "TokenStats",
    "check_batch_sizes",
    "collate",
    "count_targets",
    "load_jsonl",
    "load_tokenizer",
    "make_demo",
    "tokenize_records",
]
