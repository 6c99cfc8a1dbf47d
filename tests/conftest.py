"""Fixtures shared by the train.py tests."""

import os
import shutil
import tempfile

import pytest

# What the tests' runs keep in a user cache (--data-cache's default, data.store.DATA_CACHE, read at import) goes to a
# folder of this session, removed at its end: tests never fill or read ~/.cache. Spawned ranks inherit it.
CACHE_HOME = os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="lcl-test-cache-")


def pytest_sessionfinish(session, exitstatus):
    shutil.rmtree(CACHE_HOME, ignore_errors=True)


# `make test` hands whole files to 2 workers (--dist loadfile) in collection order (--no-loadscope-reorder: xdist would
# otherwise put the files with the most tests first, which runs the few-test, several-minute files last and leaves one
# worker idle at the end). The costliest files go first, so the cheap ones fill in behind them (longest first: the two
# workers finish within about one cheap file of each other). Their order: the per-file sums of `--durations=0` of a
# full run (2026-12-08, a 2-core Intel Xeon with AVX-512, runs/demo_assets removed: test_demo holds the asset build);
# a file not named runs after them, in the usual order.
COSTLIEST_FIRST = (
    "test_demo", "test_train", "test_train_runs", "test_gemma3_run", "test_dpo", "test_qwen3_5_hybrid", "test_memory",
    "test_bench_smoke", "test_bench_gpu", "test_compile", "test_qlora", "test_plan", "test_olmo_smollm3_granite_run",
    "test_moe_lora", "test_gemma4_moe", "test_data", "test_hub", "test_qwen3_moe_run", "test_gemma4_small",
    "test_phi3_run", "test_recorded", "test_phases", "test_guard", "test_new_arch_combos", "test_runs")


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(COSTLIEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))   # (stable: the usual order within a rank)


@pytest.fixture(scope="session")
def assets(tmp_path_factory):
    import transformers as T

    from tests.fixtures import make_chat_jsonl, make_text_jsonl, make_tokenizer, save_sharp_model

    d = tmp_path_factory.mktemp("train_assets")
    tok = make_tokenizer(d / "model")
    shape = dict(vocab_size=len(tok), hidden_size=48, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=6, num_key_value_heads=2, tie_word_embeddings=False, max_position_embeddings=4096)
    # (q and k scaled: attention peaked, so a wrong RoPE position or softmax scale moves the runs: tests/fixtures.py)
    save_sharp_model(T.Qwen2Config(**shape), d / "model")
    make_chat_jsonl(d / "chat.jsonl", 40, seed=1)
    make_text_jsonl(d / "text.jsonl", 16, seed=4)   # plain text, a third of it past --max-len 64: split into windows
    # the same model with a 16-token sliding window on layer 1 (Qwen2: layers >= max_window_layers slide)
    make_tokenizer(d / "window")
    save_sharp_model(T.Qwen2Config(**shape, use_sliding_window=True, sliding_window=16, max_window_layers=1),
                     d / "window")
    # the same shape with its output head tied to the input embedding (Qwen2.5 0.5-3B, Llama 3.2)
    make_tokenizer(d / "tied")
    save_sharp_model(T.Qwen2Config(**{**shape, "tie_word_embeddings": True}), d / "tied")
    return {"model": str(d / "model"), "data": str(d / "chat.jsonl"), "dir": str(d), "window": str(d / "window"),
            "tied": str(d / "tied"),
            "text": str(d / "text.jsonl")}
