"""data/: JSONL validation, token targets and labels, layout-independent batch order, collation.

Pins the data contract of DESIGN.md ("One step, as data", points 1-3) against references we did not
write: the tokenizer's own `apply_chat_template(tokenize=True)` and `decode`, `torch.randperm` with
the documented seeds. The demo assets are pinned in tests/test_demo.py.

Run: .venv/bin/python -m pytest -q tests/test_data.py
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
import shutil
import socket
import sys
from pathlib import Path

import pytest
import torch

from data import (
    DataError,
    GlobalBatches,
    check_batch_sizes,
    collate,
    count_targets,
    load_jsonl,
    load_tokenizer,
    tokenize_records,
)
from loss import IGNORE_INDEX
from model.attention import document_starts
from tests.fixtures import make_chat_jsonl, make_text_jsonl, make_tokenizer

END = "<|im_end|>"


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    make_tokenizer(d)
    return d


@pytest.fixture
def tok(tok_dir):
    return load_tokenizer(tok_dir)  # fresh per test: some tests swap the chat template


def target_runs(tok, sample):
    """Decoded runs of consecutive target tokens, recovered from the shifted labels."""
    ids, labels = sample["input_ids"], sample["labels"]
    runs, cur = [], []
    for t in range(1, len(ids)):
        if labels[t - 1] != IGNORE_INDEX:
            assert labels[t - 1] == ids[t], f"label at {t - 1} is not input_ids[{t}]"
            cur.append(ids[t])
        elif cur:
            runs.append(cur)
            cur = []
    assert labels[-1] == IGNORE_INDEX, "last position must have no label"
    return [tok.decode(r) for r in runs + ([cur] if cur else [])]


# --- tokenization: text ---------------------------------------------------------------------------


def test_text_records_all_targets_plus_eos(tok, tmp_path):
    recs = make_text_jsonl(tmp_path / "t.jsonl", 20, seed=1)
    samples, stats = tokenize_records(load_jsonl(tmp_path / "t.jsonl"), tok, 10_000, "t.jsonl")
    assert stats.samples == 20 and stats.truncated == 0 and stats.dropped == 0
    for rec, s in zip(recs, samples):
        ref = tok(rec["text"])["input_ids"] + [tok.eos_token_id]
        assert s["input_ids"] == ref, "text = tokenizer(text) + EOS"
        assert s["labels"] == ref[1:] + [IGNORE_INDEX], "every next token (incl. EOS) is a target"


def test_text_bos_rule_follows_tokenizer(tok):
    """A tokenizer whose post-processor adds BOS (and EOS) gets exactly one of each."""
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    bt = tok.backend_tokenizer
    bt.post_processor = processors.TemplateProcessing(
        single="<|im_start|> $A <|endoftext|>",
        special_tokens=[("<|im_start|>", tok.convert_tokens_to_ids("<|im_start|>")), ("<|endoftext|>", 0)],
    )
    llama_like = PreTrainedTokenizerFast(tokenizer_object=bt, bos_token="<|im_start|>", eos_token="<|endoftext|>")
    (s,), _ = tokenize_records([{"text": "The fox ran."}], llama_like, 100)
    body = llama_like("The fox ran.", add_special_tokens=False)["input_ids"]
    assert s["input_ids"] == [llama_like.bos_token_id] + body + [llama_like.eos_token_id]
    long = "The quick brown fox jumps over the lazy dog. " * 6   # split (--long-text): the BOS opens window 0 only,
    body = llama_like(long, add_special_tokens=False)["input_ids"]   # and the tokenizer's EOS is the only one
    windows, stats = tokenize_records([{"text": long}], llama_like, 16)
    ids = [w["input_ids"] for w in windows]
    assert stats.split == 1 and ids[0][0] == llama_like.bos_token_id and llama_like.bos_token_id not in \
        [t for w in ids[1:] for t in w], "a BOS in a later window"
    assert ids[0] + [t for w in ids[1:] for t in w[1:]] == [llama_like.bos_token_id] + body + [llama_like.eos_token_id]


# --- tokenization: prompt / completion ------------------------------------------------------------


@pytest.mark.parametrize("prompt, completion", [("The fox ran.\nQ: who ran?\nA:", " the fox"),   # a space-led word
                                                ("the dog sat ", "on the mat."),   # the space may merge
                                                ("fox " * 300, "dog")])            # a long prompt, a short answer
def test_prompt_completion_targets_are_the_completion_and_eos(tok, tmp_path, prompt, completion):
    """ids = the tokenizer's own encoding of prompt + completion, then EOS; the targets are the tokens that are not
    wholly inside the prompt (found by decoding prefixes, not by offsets), and EOS. Read from a JSONL line."""
    import json

    (tmp_path / "pc.jsonl").write_text(json.dumps({"prompt": prompt, "completion": completion, "id": 7}) + "\n")
    recs = load_jsonl(tmp_path / "pc.jsonl")
    assert recs == [{"line": 1, "prompt": prompt, "completion": completion}], recs
    (s,), stats = tokenize_records(recs, tok, 10_000)
    ids = tok(prompt + completion)["input_ids"] + [tok.eos_token_id]
    assert s["input_ids"] == ids
    inside = max(t for t in range(len(ids)) if prompt.startswith(tok.decode(ids[:t])))   # tokens within the prompt
    assert 0 < inside < len(ids) - 1, inside
    want = [ids[t + 1] if t + 1 >= inside else IGNORE_INDEX for t in range(len(ids) - 1)] + [IGNORE_INDEX]
    assert s["labels"] == want
    assert "".join(target_runs(tok, s)).startswith(tok.decode(ids[inside:-1])), "the completion, then EOS"
    assert stats.targets == len(ids) - inside


def test_prompt_completion_eos_rule(tok):
    """A tokenizer that adds BOS and EOS itself: one of each, the BOS no target, the EOS one."""
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    bt = tok.backend_tokenizer
    bt.post_processor = processors.TemplateProcessing(
        single="<|im_start|> $A <|endoftext|>",
        special_tokens=[("<|im_start|>", tok.convert_tokens_to_ids("<|im_start|>")), ("<|endoftext|>", 0)])
    llama_like = PreTrainedTokenizerFast(tokenizer_object=bt, bos_token="<|im_start|>", eos_token="<|endoftext|>")
    (s,), _ = tokenize_records([{"prompt": "The fox", "completion": " ran."}], llama_like, 100)
    body = llama_like("The fox ran.", add_special_tokens=False)["input_ids"]
    assert s["input_ids"] == [llama_like.bos_token_id] + body + [llama_like.eos_token_id]
    n_prompt = len(llama_like("The fox", add_special_tokens=False)["input_ids"])
    assert s["labels"][:n_prompt] == [IGNORE_INDEX] * n_prompt and s["labels"][-2] == llama_like.eos_token_id


# --- tokenization: chat ---------------------------------------------------------------------------


def test_chat_tokens_equal_apply_chat_template(tok, tmp_path):
    recs = make_chat_jsonl(tmp_path / "c.jsonl", 30, seed=2)
    samples, stats = tokenize_records(load_jsonl(tmp_path / "c.jsonl"), tok, 10_000, "c.jsonl")
    assert stats.samples == 30
    for rec, s in zip(recs, samples):
        msgs = rec["messages"]
        ref = tok.apply_chat_template(msgs, tokenize=True, return_dict=False)
        text = tok.apply_chat_template(msgs, tokenize=False)
        assert s["input_ids"] == ref == tok(text, add_special_tokens=False)["input_ids"]
        # Exactly the assistant turns (content + end-of-turn) are targets; nothing of user/system.
        want = [m["content"] + END for m in msgs if m["role"] == "assistant"]
        assert target_runs(tok, s) == want


def test_sharegpt_conversations_are_the_same_messages(tok, tmp_path):
    """ShareGPT's {"conversations": [{"from": "human", "value": ...}, {"from": "gpt", ...}]} (a top-level "system", the
    role names too, "observation" for a tool's reply, "messages" of from/value, "weight" 0 on an answer) = the same
    conversations as role/content messages: records, tokens and targets (= apply_chat_template, above)."""
    recs = make_chat_jsonl(tmp_path / "c.jsonl", 12, seed=4)
    speaker = {"user": "human", "assistant": "gpt", "system": "system"}
    lines = []
    for i, rec in enumerate(recs):
        msgs = [{"from": speaker[m["role"]] if i % 3 else m["role"], "value": m["content"]} for m in rec["messages"]]
        top = {}
        if i % 4 == 1 and msgs[0]["from"] == "system":   # LLaMA-Factory's "system" column
            top, msgs = {"system": msgs[0]["value"]}, msgs[1:]
        lines.append({("conversations", "conversation", "messages")[i % 3]: msgs, "id": i, **top})
    assert any("system" in x for x in lines) and any(isinstance(x.get("conversations"), list) for x in lines)
    (tmp_path / "s.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    got, want = load_jsonl(tmp_path / "s.jsonl"), load_jsonl(tmp_path / "c.jsonl")
    assert [r["messages"] for r in got] == [r["messages"] for r in want]
    a, _ = tokenize_records(got, tok, 10_000, "s.jsonl")
    b, _ = tokenize_records(want, tok, 10_000, "c.jsonl")
    assert [(x["input_ids"], x["labels"]) for x in a] == [(x["input_ids"], x["labels"]) for x in b]
    tool = json.dumps({"conversations": [{"from": "human", "value": "time?"}, {"from": "gpt", "value": "calling"},
                                         {"from": "observation", "value": "12:00"}, {"from": "gpt", "value": "noon"}]})
    (tmp_path / "t.jsonl").write_text(tool + "\n")
    assert [m["role"] for m in load_jsonl(tmp_path / "t.jsonl")[0]["messages"]] == ["user", "assistant", "tool",
                                                                                      "assistant"]
    # "weight" 0 on an answer: context, as in a messages record (OpenAI's and axolotl's form)
    turns = [("human", "user", "q1", 1), ("gpt", "assistant", "a1", 0), ("human", "user", "q2", 1),
             ("gpt", "assistant", "a2", 1)]
    for name, rec in (("w_share", {"conversations": [{"from": f, "value": v, "weight": w} for f, _, v, w in turns]}),
                      ("w_msgs", {"messages": [{"role": r, "content": v, "weight": w} for _, r, v, w in turns]})):
        (tmp_path / f"{name}.jsonl").write_text(json.dumps(rec) + "\n")
    (a,), _ = tokenize_records(load_jsonl(tmp_path / "w_share.jsonl"), tok, 10_000)
    (b,), _ = tokenize_records(load_jsonl(tmp_path / "w_msgs.jsonl"), tok, 10_000)
    assert (a["input_ids"], a["labels"]) == (b["input_ids"], b["labels"]) and target_runs(tok, a) == ["a2" + END]


def test_alpaca_records_are_the_messages_llama_factory_builds(tok, tmp_path):
    """Alpaca's {"instruction", "input", "output"}, with LLaMA-Factory's "system" and "history" columns, = the messages
    its converter builds: each history pair a user and an assistant turn, instruction and input joined by a newline
    (an empty one left out), the system prompt first; tokens = apply_chat_template of those messages, every answer
    (the history's too) a target. Its pairs ("chosen"/"rejected") = TRL's prompt of messages; a line of this reader's
    own kinds that also holds an "instruction" key is read as that kind; a text record's bool "label" (a classifier's,
    no answer to judge: not KTO's, BAD_LINES) is metadata."""
    from data.records import parse_record

    u, a = (lambda c: {"role": "user", "content": c}), (lambda c: {"role": "assistant", "content": c})
    lines = [{"instruction": "Sum", "input": "2 and 3", "output": "5"},
             {"instruction": "Greet", "input": "", "output": "Hello", "system": "Be brief.", "id": 7},
             {"instruction": "And now?", "output": "Fine", "history": [["How are you?", "Good"], ["Sure?", "Yes"]]},
             {"instruction": "", "input": "only the input", "output": "ok", "system": None, "history": None}]
    want = [[u("Sum\n2 and 3"), a("5")], [{"role": "system", "content": "Be brief."}, u("Greet"), a("Hello")],
            [u("How are you?"), a("Good"), u("Sure?"), a("Yes"), u("And now?"), a("Fine")],
            [u("only the input"), a("ok")]]
    (tmp_path / "a.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    recs = load_jsonl(tmp_path / "a.jsonl")
    assert [r["messages"] for r in recs] == want
    samples, _ = tokenize_records(recs, tok, 10_000, "a.jsonl")
    for s, msgs in zip(samples, want, strict=True):
        assert s["input_ids"] == tok.apply_chat_template(msgs, tokenize=True, return_dict=False)
        assert target_runs(tok, s) == [m["content"] + END for m in msgs if m["role"] == "assistant"]
    pair = {"instruction": "q", "input": "ctx", "chosen": "good", "rejected": "bad", "system": "S"}
    trl = {"prompt": [{"role": "system", "content": "S"}, u("q\nctx")], "chosen": "good", "rejected": "bad"}
    assert parse_record(json.dumps(pair), "f", 1) == parse_record(json.dumps(trl), "f", 1)
    assert parse_record(json.dumps({"prompt": "p", "completion": "c", "instruction": "x", "output": "y"}), "f", 1) == \
        {"line": 1, "prompt": "p", "completion": "c"}
    assert parse_record(json.dumps({"text": "t", "label": False}), "f", 1) == {"line": 1, "text": "t"}   # (no KTO)


def test_text_records_holding_alpaca_fields_train_as_text_and_say_so(tok, tmp_path):
    """tatsu-lab/alpaca's rows hold "text" (the prompt template, instruction and answer) beside "instruction",
    "input" and "output": read as the text record they also are (every token a target: what TRL's dataset_text_field
    trains), the same samples as the line without those keys, and the warning names their lines and the jq that makes
    them chats; the data cache says it again; with "text" dropped they are chats, the answer alone a target."""
    from data import load_samples

    text = "Below is an instruction.\n\n### Instruction:\nAdd.\n\n### Response:\n5"
    row = {"instruction": "Add.", "input": "", "output": "5", "text": text}
    (tmp_path / "t.jsonl").write_text(json.dumps(row) + "\n" + json.dumps({"text": "plain"}) + "\n" +
                                      json.dumps(row) + "\n")
    (tmp_path / "plain.jsonl").write_text(json.dumps({"text": text}) + "\n")
    for cache in (str(tmp_path / "cache"), str(tmp_path / "cache")):   # (tokenized, then read back)
        said = []
        got, stats = load_samples(tmp_path / "t.jsonl", tok, 256, len(tok), cache=cache, log=said.append)
        warned = [m for m in said if "Alpaca" in m]
        assert len(warned) == 1 and "jq -c 'del(.text)'" in warned[0], said
        assert '2 of 3 records hold "text" beside Alpaca\'s "instruction" and "output" (lines 1, 3)' in warned[0]
    (want,), _ = tokenize_records(load_jsonl(tmp_path / "plain.jsonl"), tok, 256)
    assert torch.equal(got[0]["input_ids"], torch.tensor(want["input_ids"], dtype=got[0]["input_ids"].dtype))
    assert torch.equal(got[0]["labels"], torch.tensor(want["labels"], dtype=got[0]["labels"].dtype))
    (tmp_path / "chat.jsonl").write_text(json.dumps({k: v for k, v in row.items() if k != "text"}) + "\n")
    said = []
    (chat,), _ = load_samples(tmp_path / "chat.jsonl", tok, 256, len(tok), cache=None, log=said.append)
    assert not any("Alpaca" in m for m in said) and target_runs(tok, {k: chat[k].tolist() for k in chat}) == \
        ["5" + END], said


def test_sharegpt_reading_keeps_earlier_records_and_reads_pairs(tok, tmp_path):
    """Records read before ShareGPT was: role/content messages carrying a "from" or "value" key of their own (metadata)
    read as they were. A preference pair's ShareGPT lists (prompt, sides; a string side) are the same role/content
    pair: the prompt's own answers no target, a prompt ending with an answer refused; LLaMA-Factory's ShareGPT pairs
    are TRL's. A role/content "conversations" takes a top-level "system" as the ShareGPT form does."""
    from data.records import parse_record

    rc = [{"role": "user", "content": "q", "from": "web"}, {"role": "assistant", "content": "a", "value": 0.5}]
    assert parse_record(json.dumps({"messages": rc}), "f", 1)["messages"] == rc
    share = lambda msgs: [{"from": {"user": "human", "assistant": "gpt"}[m["role"]], "value": m["content"]}
                          for m in msgs]
    prompt = [{"role": "user", "content": "the fox"}, {"role": "assistant", "content": "ran over"},
              {"role": "user", "content": "the hill"}]
    sides = {"chosen": [{"role": "assistant", "content": "the fox sat"}], "rejected": "over the hill"}
    want = parse_record(json.dumps({"prompt": prompt, **sides}), "f", 1)
    got = parse_record(json.dumps({"prompt": share(prompt), "chosen": share(sides["chosen"]),
                                   "rejected": sides["rejected"]}), "f", 1)
    assert got == want and want["pair"][0]["prompt_turns"] == 1
    a, _ = tokenize_records([got], tok, 10_000)
    assert [target_runs(tok, s) for s in a] == [["the fox sat" + END], ["over the hill" + END]]
    with pytest.raises(DataError, match='"prompt" ends with an assistant message'):
        parse_record(json.dumps({"prompt": share(prompt[:2]), "chosen": "x", "rejected": "y"}), "f", 1)
    conv = {"system": "S", "conversations": prompt[:2]}
    assert parse_record(json.dumps(conv), "f", 1)["messages"] == [{"role": "system", "content": "S"}] + prompt[:2]
    # LLaMA-Factory's ShareGPT pairs: "conversations" so far, each side one message object, its "system" column
    lf = {"conversations": share(prompt), "chosen": share(sides["chosen"])[0],
          "rejected": {"from": "gpt", "value": "over the hill"}, "system": "S"}
    trl = {"prompt": [{"role": "system", "content": "S"}, *prompt], "chosen": sides["chosen"],
           "rejected": [{"role": "assistant", "content": "over the hill"}]}
    assert parse_record(json.dumps(lf), "f", 1) == parse_record(json.dumps(trl), "f", 1)
    with pytest.raises(DataError, match='has a "system" string and a first message from "system" in "conversations"'):
        parse_record(json.dumps(lf | {"conversations": [{"from": "system", "value": "T"}, *lf["conversations"]]}), "f",
                     1)


def test_train_on_prompt_makes_every_token_a_target(tok, tmp_path):
    """--train-on-prompt (`all_targets`): a chat record's tokens are apply_chat_template's, each after the first a
    target (TRL's assistant_only_loss=False); a prompt/completion record is the text record of prompt + completion
    (its BOS rule, EOS); text records are as they were; "weight" 0 is not read; the cache key holds the flag."""
    from data import store

    recs = make_chat_jsonl(tmp_path / "c.jsonl", 8, seed=5)
    recs[0]["messages"][-1]["weight"] = 0
    pc = [{"prompt": "The fox ran.\nQ: who ran?\nA:", "completion": " the fox"}, {"text": "a plain text"}]
    samples, stats = tokenize_records([*load_jsonl(tmp_path / "c.jsonl"), *pc], tok, 10_000, all_targets=True)
    plain, _ = tokenize_records([*load_jsonl(tmp_path / "c.jsonl"), *pc], tok, 10_000)
    for rec, s in zip(recs, samples):
        ids = tok.apply_chat_template(rec["messages"], tokenize=True, return_dict=False)
        assert s["input_ids"] == ids and s["labels"] == ids[1:] + [IGNORE_INDEX]
    (text,), _ = tokenize_records([{"text": pc[0]["prompt"] + pc[0]["completion"]}], tok, 10_000)
    assert samples[8] == {**text, "line": -1} and samples[9] == plain[9]
    assert stats.targets == sum(len(s["input_ids"]) - 1 for s in samples) > sum(
        sum(x != IGNORE_INDEX for x in s["labels"]) for s in plain)
    key = lambda every: store.cache_key("0" * 64, tok, 40, None, "split", every)   # noqa: E731
    assert key(True) != key(False) == store.cache_key("0" * 64, tok, 40, None, "split")


def test_train_on_prompt_cuts_a_long_prompt_as_without_it(tok):
    """--train-on-prompt keeps a prompt/completion record's cut: past --max-len its prompt's start goes (as a chat's
    document's does), never the answer and EOS; the same tokens as without the flag, every one a target."""
    rec = {"prompt": "Context: " + "the quick brown fox jumps over the lazy dog " * 6 + "\nQ: who?\nA:",
           "completion": " the fox"}
    (plain,), _ = tokenize_records([rec], tok, 32)
    (every,), _ = tokenize_records([rec], tok, 32, all_targets=True)
    assert every["input_ids"] == plain["input_ids"] and every["input_ids"][-1] == tok.eos_token_id
    assert every["labels"] == every["input_ids"][1:] + [IGNORE_INDEX]


QWEN3_LIKE = (  # rewrites history: only the LAST assistant turn gets an (empty) reasoning block
    "{%- for m in messages %}{%- if m['role'] == 'assistant' and loop.last %}"
    "{{- '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
LLAMA3_LIKE = (  # template writes its own BOS; end-of-turn marker with no newline after it
    "{{- '<|endoftext|>' }}{%- for m in messages %}"
    "{{- '<|im_start|>' + m['role'] + '<|im_start|>\\n\\n' + m['content'] | trim + '<|im_end|>' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant<|im_start|>\\n\\n' }}{%- endif %}"
)

NO_GENERATION_PROMPT = (  # ChatML that ignores add_generation_prompt: the assistant header is only in the turn
    "{%- for m in messages %}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{%- endfor %}"
)


@pytest.mark.parametrize("template", ["qwen3", "llama3", "no_generation_prompt"])
def test_chat_targets_with_other_templates(tok, template):
    """(no_generation_prompt: until 2026-12-02 the role header was taken for the answer's start and trained on.)"""
    tok.chat_template = {"qwen3": QWEN3_LIKE, "llama3": LLAMA3_LIKE}.get(template, NO_GENERATION_PROMPT)
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "Paris is the capital."},
        {"role": "user", "content": "And the river?"},
        {"role": "assistant", "content": "The river Seine."},
    ]
    (s,), _ = tokenize_records([{"messages": msgs}], tok, 10_000)
    assert s["input_ids"] == tok.apply_chat_template(msgs, tokenize=True, return_dict=False)
    last = "<think>\n\n</think>\n\nThe river Seine." if template == "qwen3" else "The river Seine."
    assert target_runs(tok, s) == ["Paris is the capital." + END, last + END]


# The last user message's index, and per assistant turn its answer and thought split at </think>.
SPLIT_THINK = (
    "{%- set last_user = namespace(i=-1) %}{%- for m in messages %}{%- if m['role'] == 'user' %}"
    "{%- set last_user.i = loop.index0 %}{%- endif %}{%- endfor %}"
    "{%- for m in messages %}{%- if m['role'] == 'assistant' %}"
    "{%- set answer = m['content'].split('</think>')[-1].lstrip('\\n') %}"
    "{%- set thought = m['content'].split('</think>')[0].split('<think>')[-1].strip('\\n') "
    "if '</think>' in m['content'] else '' %}"
)
# Like Qwen3's: an assistant turn's inline <think> block is split off, and kept only after the last user turn; the
# {% generation %} tags are for transformers' own assistant mask, the reference (our tokenization ignores them).
THINK_DROPPING = (
    SPLIT_THINK +
    "{{- '<|im_start|>assistant\\n' }}{% generation %}"
    "{%- if loop.index0 > last_user.i %}{{- '<think>\\n' + thought + '\\n</think>\\n\\n' }}{%- endif %}"
    "{{- answer + '<|im_end|>' }}{% endgeneration %}{{- '\\n' }}"
    "{%- else %}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def test_chat_turns_the_template_rewrites_are_targets_as_rendered(tok):
    """A multi-turn reasoning record whose earlier turns lose their inline <think> block when later turns follow (as
    Qwen3's template does): the targets are each assistant turn as rendered, its end marker included, which is
    transformers' own assistant mask (`return_assistant_tokens_mask` over the template's generation tags). Until
    2026-12-02 such a record was refused as "does not render assistant message 1 verbatim"."""
    tok.chat_template = THINK_DROPPING
    msgs = [{"role": "user", "content": "What is 2 + 2?"},
            {"role": "assistant", "content": "<think>\nadd them\n</think>\n\nIt is 4."},
            {"role": "user", "content": "And 3 + 3?"},
            {"role": "assistant", "content": "<think>\nagain\n</think>\n\nIt is 6."}]
    ref = tok.apply_chat_template(msgs, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    (s,), _ = tokenize_records([{"messages": msgs, "line": 3}], tok, 10_000)
    assert s["input_ids"] == ref["input_ids"], "the tokens are transformers' rendering"
    ours = [lab != IGNORE_INDEX for lab in s["labels"][:-1]]
    assert ours == [bool(m) for m in ref["assistant_masks"][1:]], "targets = transformers' assistant mask"
    assert target_runs(tok, s) == ["It is 4." + END, "<think>\nagain\n</think>\n\nIt is 6." + END]


# Generation-tagged forms of two template shapes, for transformers' assistant mask: one that ignores
# add_generation_prompt (as Llama 2's and Mistral's), one writing EOS after the last turn only (as Phi-3's).
NO_PROMPT_TAGGED = (
    "{%- for m in messages %}{{- '<|im_start|>' + m['role'] + '\\n' }}{%- if m['role'] == 'assistant' %}"
    "{% generation %}{{- m['content'] + '<|im_end|>' }}{% endgeneration %}{%- else %}{{- m['content'] + '<|im_end|>' }}"
    "{%- endif %}{{- '\\n' }}{%- endfor %}")
EOS_LAST_TAGGED = (
    "{%- for m in messages %}{{- '<|im_start|>' + m['role'] + '\\n' }}{%- if m['role'] == 'assistant' %}"
    "{% generation %}{{- m['content'] + '<|im_end|>' }}{% endgeneration %}{%- else %}{{- m['content'] + '<|im_end|>' }}"
    "{%- endif %}{{- '\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- else %}{{- eos_token }}{%- endif %}")


@pytest.mark.parametrize("template", ["no_prompt", "eos_last"])
def test_chat_targets_equal_transformers_assistant_mask_for_answers_its_markers_hold(tok, template):
    """Answers that also occur inside the end-of-turn marker ('d', 'im', 'end' of '<|im_end|>'), empty ones, ones
    with leading whitespace: the targets are transformers' own assistant mask. Until 2026-12-03, under a template
    ignoring add_generation_prompt, the answer was looked for by its text and found inside the marker (the answer
    itself never a target); and a template writing EOS after the last turn only (Phi-3's) left every earlier
    answer without its end-of-turn marker."""
    tok.chat_template = NO_PROMPT_TAGGED if template == "no_prompt" else EOS_LAST_TAGGED
    answers = ["d", "im", "end", "", "\nim", "  the end", "Paris.", "e "]
    for n, answer in enumerate(answers):
        msgs = [{"role": "user", "content": f"Question {n}?"}, {"role": "assistant", "content": answer},
                {"role": "user", "content": "And?"}, {"role": "assistant", "content": answers[n - 1]}]
        ref = tok.apply_chat_template(msgs, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        (s,), _ = tokenize_records([{"messages": msgs, "line": 1}], tok, 10_000)
        assert s["input_ids"] == ref["input_ids"]
        ours = [lab != IGNORE_INDEX for lab in s["labels"][:-1]]
        assert ours == [bool(m) for m in ref["assistant_masks"][1:]], (answer, target_runs(tok, s))


# Qwen2.5/Qwen3-shaped tool calls after an answer's content, generation-tagged; "dropping" also drops the reasoning of
# turns before the last user message (Qwen3), so an earlier turn is not a prefix of the full rendering.
def _tool_template(dropping: bool) -> str:
    think = ("{%- if loop.index0 > last_user.i %}{{- '<think>\\n' + thought + '\\n</think>\\n\\n' }}{%- endif %}"
             if dropping else "")
    return (
        SPLIT_THINK +
        "{{- '<|im_start|>assistant\\n' }}{% generation %}" + think +
        "{{- (answer if " + ("true" if dropping else "false") + " else m['content']) }}"
        "{%- for call in m.get('tool_calls', []) %}{%- if loop.first and m['content'] %}{{- '\\n' }}{%- endif %}"
        "{{- '<tool_call>\\n{\"name\": \"' + call['function']['name'] + '\", \"arguments\": ' }}"
        "{{- call['function']['arguments'] | tojson }}{{- '}\\n</tool_call>' }}{%- endfor %}"
        "{{- '<|im_end|>' }}{% endgeneration %}{{- '\\n' }}"
        "{%- elif m['role'] == 'tool' %}{{- '<|im_start|>user\\n<tool_response>\\n' + m['content'] + "
        "'\\n</tool_response><|im_end|>\\n' }}"
        "{%- else %}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{%- endif %}"
        "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


@pytest.mark.parametrize("dropping", [False, True], ids=["qwen2.5", "qwen3"])
def test_chat_targets_hold_tool_calls_and_the_end_of_turn_after_an_answer(tok, dropping):
    """An assistant turn with tool calls (Qwen2.5's and Qwen3's form: the calls after the content, then
    '<|im_end|>'): the calls and the marker are targets, as in transformers' assistant mask. From 2026-12-03 to
    2026-12-04 the turn ended at the first whitespace after its content: '<tool_call>' was trained, its arguments
    and '<|im_end|>' were not."""
    tok.chat_template = _tool_template(dropping)
    call = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    for content in ["", "Let me check.", "<think>\nlook it up\n</think>\n\nLet me check."]:
        msgs = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": content, "tool_calls": [call]},
                {"role": "tool", "content": "sunny, 21C"},
                {"role": "assistant", "content": "It is sunny and 21C."},
                {"role": "user", "content": "Thanks."}, {"role": "assistant", "content": "You are welcome."}]
        ref = tok.apply_chat_template(msgs, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        (s,), _ = tokenize_records([{"messages": msgs, "line": 1}], tok, 10_000)
        assert s["input_ids"] == ref["input_ids"]
        ours = [lab != IGNORE_INDEX for lab in s["labels"][:-1]]
        assert ours == [bool(m) for m in ref["assistant_masks"][1:]], (content, target_runs(tok, s))
        assert '"city": "Paris"}}\n</tool_call>' + END in target_runs(tok, s)[0], target_runs(tok, s)


def test_tool_calls_the_template_does_not_write_are_refused(tok):
    """An assistant message's tool_calls under a template that writes no calls (chatml's: content only) would train
    an empty turn, or the content without its calls: refused, naming the message (review, helper 53: trained
    silently); a template that writes them takes the same record (transformers' mask: the test above)."""
    from data.templates import TEMPLATES
    call = {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    for content in ("", "Let me check."):
        msgs = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": content, "tool_calls": [call]},
                {"role": "tool", "content": "sunny"}, {"role": "assistant", "content": "It is sunny."}]
        tok.chat_template = TEMPLATES["chatml"]
        with pytest.raises(DataError, match=r"f.jsonl, line 3: the chat template does not write assistant message 1's "
                                            r"tool_calls: the model would learn to answer without the calls"):
            tokenize_records([{"messages": msgs, "line": 3}], tok, 10_000, "f.jsonl")
        tok.chat_template = _tool_template(False)
        (s,), _ = tokenize_records([{"messages": msgs, "line": 3}], tok, 10_000, "f.jsonl")
        assert "get_weather" in target_runs(tok, s)[0], target_runs(tok, s)


def test_an_assistant_message_of_weight_0_is_context_not_a_target(tok):
    """OpenAI's fine-tuning format: "weight": 0 on an assistant message makes it context (review, helper 53: trained
    on, silently). The targets are transformers' assistant mask without that turn's run; weight 1 = no key; any
    other weight is refused, naming it; a record whose every answer is weight 0 has no target (dropped, counted and
    said apart from a record the cut left without one: no --max-len keeps it, so the warning names the weights)."""
    tok.chat_template = _tool_template(True)   # (Qwen3-shaped: an earlier turn's think block dropped)
    msgs = [U("Q?"), A("<think>\nx\n</think>\n\nFirst."), U("And?"), A("Second."), U("Thanks."), A("Bye.")]
    ref = tok.apply_chat_template(msgs, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    mask = [bool(m) for m in ref["assistant_masks"]]
    runs = [t for t in range(len(mask)) if mask[t] and (t == 0 or not mask[t - 1])]   # each turn's first token
    ends = [next((u for u in range(t, len(mask)) if not mask[u]), len(mask)) for t in runs]
    assert len(runs) == 3, runs
    for zero in ((), (0,), (1,), (0, 2)):
        one, n = [], 0
        for m in msgs:   # (the assistant messages numbered in `zero`: weight 0)
            one.append({**m, "weight": 0} if m["role"] == "assistant" and n in zero else m)
            n += m["role"] == "assistant"
        (s,), _ = tokenize_records([{"messages": one, "line": 1}], tok, 10_000)
        want = [m and not any(runs[k] <= t < ends[k] for k in zero) for t, m in enumerate(mask)]
        assert s["input_ids"] == ref["input_ids"]
        assert [lab != IGNORE_INDEX for lab in s["labels"][:-1]] == want[1:], (zero, target_runs(tok, s))
    (s,), _ = tokenize_records([{"messages": [{**m, "weight": 1} for m in msgs], "line": 1}], tok, 10_000)
    assert [lab != IGNORE_INDEX for lab in s["labels"][:-1]] == mask[1:]
    zeros = {"messages": [{**m, "weight": 0} for m in msgs], "line": 4}
    samples, stats = tokenize_records([zeros], tok, 10_000)
    assert not samples and (stats.no_target, stats.no_target_lines, stats.dropped) == (1, [4], 0), stats
    assert "1 with no target (nothing to train) dropped" in str(stats), str(stats)
    assert stats.warning("--data f.jsonl", 10_000) == (
        'warning: --data f.jsonl: 1 of 1 records (100.0%) have no target token at all (every assistant turn has '
        '"weight": 0) and are not trained on (line 4); no --max-len keeps them: give a turn "weight": 1 to train it, '
        "or drop them from the file"), stats.warning("--data f.jsonl", 10_000)
    assert "left out of eval_loss (line 4); no --max-len keeps them: give a turn \"weight\": 1 to evaluate it" in \
        stats.warning("--eval-data e.jsonl", 10_000)
    # beside a record whose answers the cut removes (its first answer past --max-len 12): each cause its own line
    _, stats = tokenize_records([zeros, {"messages": msgs, "line": 5}], tok, 12)
    assert (stats.no_target, stats.no_target_lines, stats.dropped, stats.dropped_lines) == (1, [4], 1, [5]), stats
    said = stats.warning("--data f.jsonl", 12).split("\n")
    assert said[0].startswith("warning: --data f.jsonl: 1 of 2 records (50.0%) have no target token at all") and \
        said[1] == ("warning: --data f.jsonl: 1 of 2 records (50.0%) have no target token within --max-len 12 and are "
                    "not trained on (line 5); a longer --max-len keeps them"), said
    import re
    for w in (0.5, 2, "0", None, True, False):   # (JSON's true and false are not 1 and 0: said, not taken as them)
        with pytest.raises(DataError, match=rf"f.jsonl, line 2: an assistant message's \"weight\" is "
                                            rf"{re.escape(repr(w))}: it is 0 \(not trained on: context only\) or 1"):
            tokenize_records([{"messages": [U("Q?"), A("a", weight=w)], "line": 2}], tok, 10_000, "f.jsonl")


def test_a_file_with_no_sample_left_names_the_cause_and_its_fix(tok, tmp_path):
    """A file every record of which loses its targets is refused naming why: the cut (--max-len, the longest record
    and the fix, a longer one; review, helper 111: "fix the file or drop it", for a --max-len too short), or answers all
    "weight": 0 (no --max-len helps); the size the same records train at is the reference that the cut was the cause."""
    from data import load_samples

    msgs = [{"role": "user", "content": "Which topic are these words about: mode stream file read"},
            {"role": "assistant", "content": "Topic: files."}]
    path = tmp_path / "c.jsonl"
    path.write_text("".join(json.dumps({"messages": msgs}) + "\n" for _ in range(3)))
    full, _ = load_samples(path, tok, 256, len(tok))
    n = len(full[0]["input_ids"])
    with pytest.raises(DataError) as e:
        load_samples(path, tok, 4, len(tok))
    assert (f"--max-len 4 left 3 of them no target (the longest record has {n} tokens): a longer --max-len keeps "
            "them") in str(e.value) and "fix the file" not in str(e.value), str(e.value)
    path.write_text(json.dumps({"messages": [msgs[0], {**msgs[1], "weight": 0}]}) + "\n")
    with pytest.raises(DataError, match=r'1 had none to begin with \(every assistant turn "weight": 0\): give a turn '
                                        r'"weight": 1'):
        load_samples(path, tok, 256, len(tok))


def test_a_text_that_begins_with_the_bos_gets_no_second_one(tok):
    """A tokenizer that prepends BOS (Llama 3's post-processor) and a text or prompt that already begins with the BOS's
    text (a pre-rendered chat): one BOS, as the tokenizer encodes the text without its own (review, helper 53: two, the
    second trained as a target); a text without it gets the tokenizer's."""
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast
    bt = tok.backend_tokenizer
    bos = tok.convert_tokens_to_ids("<|im_start|>")
    bt.post_processor = processors.TemplateProcessing(single="<|im_start|> $A", special_tokens=[("<|im_start|>", bos)])
    ll = PreTrainedTokenizerFast(tokenizer_object=bt, bos_token="<|im_start|>", eos_token="<|endoftext|>")
    body = ll("The fox ran.", add_special_tokens=False)["input_ids"]
    assert ll("The fox ran.")["input_ids"] == [bos, *body]   # (the tokenizer adds its BOS)
    eos = ll.eos_token_id
    for text, want in (("<|im_start|>The fox ran.", [bos, *body, eos]), ("The fox ran.", [bos, *body, eos])):
        (s,), _ = tokenize_records([{"line": 1, "text": text}], ll, 100)
        assert s["input_ids"] == want and s["labels"][0] == body[0], (text, s)
    (s,), _ = tokenize_records([{"line": 1, "prompt": "<|im_start|>The fox", "completion": " ran."}], ll, 100)
    assert s["input_ids"][:2] != [bos, bos] and s["input_ids"][0] == bos and s["input_ids"][-1] == eos, s
    assert tok.decode([s["input_ids"][t + 1] for t in range(len(s["input_ids"]) - 1)
                       if s["labels"][t] != IGNORE_INDEX]).strip().startswith("ran"), s


# Mistral-v0.3-shaped: no generation prompt, no assistant header, and a turn with tool calls writes the calls in place
# of its content.
DROPS_CONTENT_TAGGED = (
    "{{- bos_token }}{%- for m in messages %}{%- if m['role'] == 'user' %}{{- '[INST] ' + m['content'] + ' [/INST]' }}"
    "{%- elif m['role'] == 'tool' %}{{- '[TOOL_RESULTS] ' + m['content'] + ' [/TOOL_RESULTS]' }}"
    "{%- elif m['role'] == 'assistant' %}{% generation %}{%- if m.get('tool_calls') %}{{- '[TOOL_CALLS] ' }}"
    "{%- for c in m['tool_calls'] %}{{- '<tool_call>' + c['function']['name'] + ' ' + "
    "(c['function']['arguments'] | tojson) + '</tool_call>' }}{%- endfor %}{%- else %}{{- m['content'] }}{%- endif %}"
    "{{- eos_token }}{% endgeneration %}{%- endif %}{%- endfor %}")


def test_a_turn_whose_content_the_template_drops_beside_tool_calls(tok, tmp_path):
    """Under a template that writes tool calls in place of the content (Mistral v0.3's, Llama 3.1's), a turn of tool
    calls with empty or null content (OpenAI's form) is its calls and end marker, as in transformers' assistant mask
    (until 2026-12-04 only the marker: the empty content was looked for at the rendering's end); one with content
    the template drops is refused, naming the message (it was looked for by its text: 'call' inside '<tool_call>')."""
    tok.chat_template = DROPS_CONTENT_TAGGED
    call = {"type": "function", "function": {"name": "f", "arguments": {"x": 1}}}
    for content in ("", None):
        msgs = [{"role": "user", "content": "Q?"}, {"role": "assistant", "content": content, "tool_calls": [call]},
                {"role": "tool", "content": "1"}, {"role": "assistant", "content": "It is 1."}]
        path = tmp_path / "calls.jsonl"
        path.write_text(json.dumps({"messages": msgs}) + "\n")
        (s,), _ = tokenize_records(load_jsonl(path), tok, 10_000, path)
        ref = tok.apply_chat_template([{**m, "content": m["content"] or ""} for m in msgs], tokenize=True,
                                      return_dict=True, return_assistant_tokens_mask=True)
        assert s["input_ids"] == ref["input_ids"]
        ours = [lab != IGNORE_INDEX for lab in s["labels"][:-1]]
        assert ours == [bool(m) for m in ref["assistant_masks"][1:]], target_runs(tok, s)
        assert target_runs(tok, s)[0].startswith("[TOOL_CALLS] <tool_call>f"), target_runs(tok, s)
    msgs[1]["content"] = "call"
    with pytest.raises(DataError, match=r"line 5: the chat template does not write assistant message 1's content"):
        tokenize_records([{"messages": msgs, "line": 5}], tok, 10_000)


# Gemma-shaped: the assistant is "model", contents trimmed, roles must alternate (no system, no tools).
GEMMA_TAGGED = (
    "{{- bos_token }}{%- for m in messages %}{%- set role = 'model' if m['role'] == 'assistant' else m['role'] %}"
    "{{- '<start_of_turn>' + role + '\\n' }}{%- if m['role'] == 'assistant' %}{% generation %}"
    "{{- m['content'] | trim + '<end_of_turn>' }}{% endgeneration %}{%- else %}"
    "{{- m['content'] | trim + '<end_of_turn>' }}{%- endif %}{{- '\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<start_of_turn>model\\n' }}{%- endif %}")
# DeepSeek-V3-shaped: tool results gathered in one outputs block, and the answer after them written right after its
# close, with no assistant header; calls after the content; EOS ends every assistant turn.
DEEPSEEK_TAGGED = (
    "{{- bos_token }}{%- set ns = namespace(tool=false) %}{%- for m in messages %}"
    "{%- if m['role'] == 'user' %}{%- set ns.tool = false %}{{- '<|U|>' + m['content'] }}"
    "{%- elif m['role'] == 'tool' %}{%- if not ns.tool %}{{- '<|outs|>' }}{%- endif %}{%- set ns.tool = true %}"
    "{{- '<|out|>' + m['content'] + '<|/out|>' }}"
    "{%- elif m['role'] == 'assistant' %}{%- if ns.tool %}{{- '<|/outs|>' }}{%- else %}{{- '<|A|>' }}{%- endif %}"
    "{%- set ns.tool = false %}{% generation %}{{- m['content'] }}{%- if m.get('tool_calls') %}{{- '<|calls|>' }}"
    "{%- for c in m['tool_calls'] %}{{- '<|call|>' + c['function']['name'] + ' ' + "
    "(c['function']['arguments'] | tojson) + '<|/call|>' }}{%- endfor %}{{- '<|/calls|>' }}{%- endif %}"
    "{{- eos_token }}{% endgeneration %}{%- endif %}"
    "{%- endfor %}{%- if ns.tool %}{{- '<|/outs|>' }}{%- endif %}"
    "{%- if add_generation_prompt and not ns.tool %}{{- '<|A|>' }}{%- endif %}")


def _random_tool_chat(rng, tools: bool = True, runs: bool = True, reasoning: bool = False) -> list[dict]:
    """1-3 rounds; answers that are marker fragments, whitespace, reasoning (repeated in a later turn, or only an empty
    think block); 40% of turns call 1-2 tools first (content empty, whitespace, text); 20% two answers in a row;
    `reasoning`: 30% of answers carry a "reasoning_content" key (Qwen3's form of a separate think block)."""
    answers = ["d", "im", "end", "", " ", "Paris.", "e ", "\nim", "<think>\nx\n</think>\n\nok", "INST", "  two  words ",
               "<think>\n\n</think>\n\n", "ok"]
    msgs = [{"role": "user", "content": rng.choice(["Q?", "Hi", "x y"])}]
    think = lambda: {"reasoning_content": rng.choice(["think", "", "\nhmm\n"])} if reasoning and rng.random() < 0.3 \
        else {}
    for turn in range(rng.randint(1, 3)):
        if tools and rng.random() < 0.4:
            calls = [{"type": "function", "function": {"name": rng.choice(["f", "get_w"]), "arguments": {"x": k}}}
                     for k in range(rng.randint(1, 2))]
            said = rng.choice(["", "", " ", "\n", "Let me see."])
            msgs += [{"role": "assistant", "content": said, "tool_calls": calls, **think()},
                     {"role": "tool", "content": rng.choice(["1", "sunny"])}]
        msgs.append({"role": "assistant", "content": rng.choice(answers), **think()})
        if runs and rng.random() < 0.2:
            msgs.append({"role": "assistant", "content": rng.choice(answers)})
        if turn < 2 and rng.random() < 0.7:
            msgs.append({"role": "user", "content": rng.choice(["And?", "ok"])})
    return msgs if msgs[-1]["role"] == "assistant" else msgs + [{"role": "assistant", "content": "fine"}]


@pytest.mark.parametrize("template", ["qwen2.5_tools", "qwen3_tools", "qwen3_reasoning", "drops_content", "eos_last",
                                      "no_prompt", "gemma", "deepseek"])
def test_chat_targets_equal_transformers_mask_on_random_conversations(tok, template):
    """60 random conversations per template shape (tool calls, marker fragments, whitespace, reasoning, Qwen3's
    reasoning_content, Gemma's trimmed alternating turns, DeepSeek's answer after a tool-outputs block) against
    transformers' assistant mask; the only refusals are a content the template does not write."""
    import random

    qwen3_reasoning = _tool_template(True).replace(SPLIT_THINK, SPLIT_THINK + (
        "{%- if m.get('reasoning_content') is string %}{%- set thought = m['reasoning_content'].strip('\\n') %}"
        "{%- set answer = m['content'] %}{%- endif %}"), 1)   # (as Qwen3's: then the content is not split)
    tok.chat_template = {"qwen2.5_tools": _tool_template(False), "qwen3_tools": _tool_template(True),
                         "qwen3_reasoning": qwen3_reasoning, "drops_content": DROPS_CONTENT_TAGGED,
                         "eos_last": EOS_LAST_TAGGED, "no_prompt": NO_PROMPT_TAGGED, "gemma": GEMMA_TAGGED,
                         "deepseek": DEEPSEEK_TAGGED}[template]
    assert template != "qwen3_reasoning" or "reasoning_content" in tok.chat_template
    rng, refused = random.Random(template), 0
    for n in range(60):
        msgs = _random_tool_chat(rng, tools=template not in ("gemma", "eos_last", "no_prompt"), runs=template !=
                                 "gemma", reasoning=template == "qwen3_reasoning")   # (those three write no calls:
        try:   # a turn with calls is refused, test_tool_calls_the_template_does_not_write_are_refused)
            (s,), _ = tokenize_records([{"messages": msgs, "line": n}], tok, 10_000)
        except DataError as e:
            assert "does not write assistant message" in str(e) and template == "drops_content", (msgs, e)
            refused += 1
            continue
        ref = tok.apply_chat_template(msgs, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        assert s["input_ids"] == ref["input_ids"]
        ours = [lab != IGNORE_INDEX for lab in s["labels"][:-1]]
        assert ours == [bool(m) for m in ref["assistant_masks"][1:]], (msgs, target_runs(tok, s))
    assert refused <= 30, f"{refused} of 60 refused: too few compared"


# Tool definitions as Qwen2.5 writes them (a system turn listing them first) and as Mistral v0.3 does (before the LAST
# user message: where they sit moves as the conversation grows, so no earlier turn's rendering is a prefix).
QWEN_TOOLS = ("{%- if tools %}{{- '<|im_start|>system\\n# Tools\\n<tools>' }}{%- for t in tools %}"
              "{{- '\\n' + (t | tojson) }}{%- endfor %}{{- '\\n</tools><|im_end|>\\n' }}{%- endif %}")
MISTRAL_TOOLS = DROPS_CONTENT_TAGGED.replace(
    "{{- bos_token }}", "{{- bos_token }}{%- set ns = namespace(last=-1) %}{%- for m in messages %}"
    "{%- if m['role'] == 'user' %}{%- set ns.last = loop.index0 %}{%- endif %}{%- endfor %}").replace(
    "{%- if m['role'] == 'user' %}{{- '[INST] '", "{%- if m['role'] == 'user' %}{%- if tools and loop.index0 == "
    "ns.last %}{{- '[AVAILABLE_TOOLS] ' + (tools | tojson) + ' [/AVAILABLE_TOOLS]' }}{%- endif %}{{- '[INST] '")
# Llama-3.1-shaped: the tool definitions open the FIRST user message; a turn of tool calls writes them in place of its
# content; the tool result is its own header's turn.
LLAMA_TOOLS = (
    "{{- bos_token }}{%- set ns = namespace(done=false) %}{%- for m in messages %}"
    "{{- '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' }}"
    "{%- if m['role'] == 'user' and tools and not ns.done %}{{- 'Functions:\\n' }}{%- for t in tools %}"
    "{{- (t | tojson) + '\\n' }}{%- endfor %}{%- set ns.done = true %}{%- endif %}"
    "{%- if m['role'] == 'assistant' %}{% generation %}{%- if m.get('tool_calls') %}{%- for c in m['tool_calls'] %}"
    "{{- '{\"name\": \"' + c['function']['name'] + '\", \"parameters\": ' }}"
    "{{- (c['function']['arguments'] | tojson) + '}' }}"
    "{%- endfor %}{%- else %}{{- m['content'] }}{%- endif %}{{- '<|eot_id|>' }}{% endgeneration %}"
    "{%- else %}{{- m['content'] + '<|eot_id|>' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}")
TOOLS = [{"type": "function", "function": {"name": "get_w", "description": "the weather in a city",
                                           "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}}}}]


@pytest.mark.parametrize("template", ["qwen2.5", "mistral", "llama", "named"])
def test_a_records_tools_are_rendered_and_targets_equal_transformers_mask(tok, tmp_path, template):
    """A "messages" record's "tools" (a list of schemas, or a string holding one) reach the chat template, which
    writes them where the model reads them (until 2026-12-04 the key was ignored: the model learned to call tools it
    never saw defined); the targets equal transformers' assistant mask rendered with the same tools, over 40 random
    tool-calling conversations, also under Mistral's form that writes them before the last user message, Llama
    3.1's in the first user message, and a tokenizer's named templates (its "tool_use" one renders them)."""
    qwen = QWEN_TOOLS + _tool_template(False)
    tok.chat_template = {"mistral": MISTRAL_TOOLS, "llama": LLAMA_TOOLS, "qwen2.5": qwen,
                         # a tokenizer's named templates: transformers renders "tool_use" when tools are given
                         "named": {"default": NO_PROMPT_TAGGED, "tool_use": qwen}}[template]
    assert "[AVAILABLE_TOOLS]" in MISTRAL_TOOLS, "the replace above found nothing"
    rng, refused = random.Random(template), 0
    for n in range(40):
        msgs = _random_tool_chat(rng)
        try:
            (s,), _ = tokenize_records([{"messages": msgs, "tools": TOOLS, "line": n}], tok, 10_000)
        except DataError as e:
            assert "does not write assistant message" in str(e) and template in ("mistral", "llama"), (msgs, e)
            refused += 1
            continue
        ref = tok.apply_chat_template(msgs, tools=TOOLS, tokenize=True, return_dict=True,
                                      return_assistant_tokens_mask=True)
        assert s["input_ids"] == ref["input_ids"] and "the weather in a city" in tok.decode(s["input_ids"])
        ours = [lab != IGNORE_INDEX for lab in s["labels"][:-1]]
        assert ours == [bool(m) for m in ref["assistant_masks"][1:]], (msgs, target_runs(tok, s))
        compared = msgs
    assert refused <= 20, f"{refused} of 40 refused: too few compared"
    path = tmp_path / "tools.jsonl"   # the string form many Hub datasets use: the same tokens
    path.write_text("\n".join(json.dumps({"messages": compared, "tools": t}) for t in (TOOLS, json.dumps(TOOLS)))
                    + "\n")
    ref = tok.apply_chat_template(compared, tools=TOOLS, tokenize=True, return_dict=True)
    (a, b), _ = tokenize_records(load_jsonl(path), tok, 10_000, path)
    assert a["input_ids"] == b["input_ids"] == ref["input_ids"]


U, A = (lambda c: {"role": "user", "content": c}), (lambda c, **k: {"role": "assistant", "content": c, **k})
CALL = {"type": "function", "function": {"name": "get_w", "arguments": {"x": 1}}}


@pytest.mark.parametrize("template, msgs", [
    # a user text that also occurs in the markup ('I' in '[INST]', 'NST]' after it in both): before 2026-12-04 the
    # search took '[INST]'s 'I' and trained ' I [/INST]' (Mistral's moved tools make every turn but the last be placed
    # by what precedes it)
    ("mistral", [U("I"), A("Yes."), U("Q"), A("B")]),
    ("mistral", [U("I"), A("", tool_calls=[CALL]), {"role": "tool", "content": "sunny"}, A("It is sunny."),
                 U("Thanks"), A("Welcome.")]),   # (the tool-call turn was untrained)
    ("mistral", [U(""), A(""), U(""), A("x")]),   # empty turns: the first answer's end-of-turn was untrained
    ("mistral", [U("T]"), A("ok"), U("INST"), A("S")]),
    # a last turn Qwen3 writes with its leading newlines trimmed: its text as given is not where the template put it,
    # and the stripped text 'end' also occurs in '<|im_end|>' (which was left untrained), or in its own tool call
    ("qwen3", [U("Last word?"), A("\n  end"), U("ok"), A("fine")]),
    ("qwen3", [U("Weather?"), A("\n  x", tool_calls=[CALL]), {"role": "tool", "content": "sunny"}, A("Sunny."),
               U("ok"), A("fine")]),
    # a template that writes the content rewritten (the answer after '</think>' only; Qwen3 moves the reasoning into a
    # think block it writes before it): the turn is what it writes there. A search for the content as given found a
    # user or tool message holding the same text, and trained that (' r</think>ans [/INST]ans'), or refused the record
    ("split", [U("r</think>ans"), A("r</think>ans")]),
    ("split", [U("Q"), A("", tool_calls=[CALL]), {"role": "tool", "content": "r</think>ans"}, A("</think>"),
               U("r</think>ans"), A("r</think>ans")]),
    ("qwen3", [{"role": "system", "content": "x </think>"}, U("x </think>"), A("x </think>")]),
    ("qwen3", [U("Q"), A("r</think>ans"), U("R"), A("x </think> y")]),
])
def test_turns_placed_by_what_the_template_writes_not_by_searching_short_texts(tok, template, msgs):
    """Turns located where a sentinel put in a message's place is written, not by searching for its text (found by
    review); the targets equal transformers' assistant mask."""
    answer = "{%- else %}{{- m['content'] }}"
    split = MISTRAL_TOOLS.replace(answer, answer.replace("m['content']", "m['content'].split('</think>')[-1]"))
    assert split != MISTRAL_TOOLS, "the replace above found nothing"
    tok.chat_template = {"mistral": MISTRAL_TOOLS, "qwen3": QWEN_TOOLS + _tool_template(True), "split": split}[template]
    (s,), _ = tokenize_records([{"messages": msgs, "tools": TOOLS, "line": 1}], tok, 10_000)
    ref = tok.apply_chat_template(msgs, tools=TOOLS, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    assert s["input_ids"] == ref["input_ids"]
    ours = [lab != IGNORE_INDEX for lab in s["labels"][:-1]]
    assert ours == [bool(m) for m in ref["assistant_masks"][1:]], target_runs(tok, s)


# Llama-3.1-shaped (its real form, unlike LLAMA_TOOLS): with tools, the conversation's first message, whatever its
# role, is written into the user turn that holds them.
LLAMA31_FIRST = (
    "{{- bos_token }}{%- if tools %}{%- set first = messages[0]['content'] %}{%- set messages = messages[1:] %}"
    "{{- '<|start_header_id|>user<|end_header_id|>\\n\\nFunctions:\\n' }}{%- for t in tools %}"
    "{{- (t | tojson) + '\\n' }}{%- endfor %}{{- first + '<|eot_id|>' }}{%- endif %}"
    "{%- for m in messages %}{%- if m.get('tool_calls') %}"   # (calls: an assistant header whatever the role)
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% generation %}{%- for c in m['tool_calls'] %}"
    "{{- '{\"name\": \"' + c['function']['name'] + '\", \"parameters\": ' }}"
    "{{- (c['function']['arguments'] | tojson) + '}' }}"
    "{%- endfor %}{{- '<|eot_id|>' }}{% endgeneration %}{%- else %}"
    "{{- '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' }}"
    "{%- if m['role'] == 'assistant' %}{% generation %}{{- m['content'] + '<|eot_id|>' }}{% endgeneration %}"
    "{%- else %}{{- m['content'] + '<|eot_id|>' }}{%- endif %}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}")


@pytest.mark.parametrize("template", ["think_dropping", "qwen3_tools", "llama31"])
def test_a_conversation_opening_with_an_assistant_message(tok, template):
    """A greeting before the first user message ("How can I help?"), also empty or whitespace, after a system prompt
    or not: the targets equal transformers' assistant mask. Until 2026-12-04 (found by review), under Qwen3-shaped
    templates, which write a think block on turns after the last user message only, the first turn was looked for
    by what its rendering as the last turn writes before it (that think block) and found in the LAST turn: a non-empty
    one refused ("does not render assistant message 2 verbatim"), an empty one trained on nothing of its own and left
    the last turn's think block untrained. Under Llama 3.1's, which writes the first message into the user turn
    holding the tools, the greeting was trained from inside that user turn: now that record is refused, naming why."""
    tok.chat_template = {"think_dropping": THINK_DROPPING, "qwen3_tools": QWEN_TOOLS + _tool_template(True),
                         "llama31": LLAMA31_FIRST}[template]
    tools = TOOLS if template != "think_dropping" else None
    for n, first in enumerate(["How can I help?", "", "\n", " \n ", "<think>\nhi\n</think>\n\nHello."]):
        for system in ([], [{"role": "system", "content": "Be brief."}]):
            msgs = [*system, A(first), U("Weather in Paris?"), A("Sunny."), U("Thanks."), A("You are welcome.")]
            if template == "llama31":
                if system:
                    continue   # (it writes the system message, not the greeting, into that user turn)
                with pytest.raises(DataError, match=r"line 2: the chat template writes assistant message 0 as it "
                                                    r"writes a user message.*begin the conversation with a user"):
                    tokenize_records([{"messages": msgs, "tools": tools, "line": 2}], tok, 10_000)
                msgs = msgs[1:]   # (a user message first: trained; and the greeting without tools below)
                (s,), _ = tokenize_records([{"messages": [A(first), *msgs]}], tok, 10_000)
                ref = tok.apply_chat_template([A(first), *msgs], tokenize=True, return_dict=True,
                                              return_assistant_tokens_mask=True)
                ours = [lab != IGNORE_INDEX for lab in s["labels"][:-1]]
                assert ours == [bool(m) for m in ref["assistant_masks"][1:]], target_runs(tok, s)
            (s,), _ = tokenize_records([{"messages": msgs, "tools": tools, "line": n}], tok, 10_000)
            ref = tok.apply_chat_template(msgs, tools=tools, tokenize=True, return_dict=True,
                                          return_assistant_tokens_mask=True)
            assert s["input_ids"] == ref["input_ids"]
            ours = [lab != IGNORE_INDEX for lab in s["labels"][:-1]]
            assert ours == [bool(m) for m in ref["assistant_masks"][1:]], (first, system, target_runs(tok, s))
            assert target_runs(tok, s)[-1].startswith("<think>" if template != "llama31" else "You"), \
                target_runs(tok, s)
    # an agent trace opening with a tool call: Llama 3.1's writes calls under an assistant header whatever the role, so
    # the call is the turn (a review found it refused for a day); with tools, the first message's calls are dropped
    msgs = [A("", tool_calls=[CALL]), {"role": "tool", "content": "sunny"}, A("It is sunny.")]
    for system in ([], [{"role": "system", "content": "Find the weather."}]):
        if template == "llama31":
            with pytest.raises(DataError, match=r"writes assistant message 0 as it writes a user message"):
                tokenize_records([{"messages": msgs, "tools": TOOLS, "line": 2}], tok, 10_000)
            tools = None
        if template == "think_dropping":   # (it writes no tool_calls: refused since review, helper 53)
            with pytest.raises(DataError, match=r"line 3: the chat template does not write assistant message "
                                                rf"{len(system)}'s tool_calls"):
                tokenize_records([{"messages": system + msgs, "tools": tools, "line": 3}], tok, 10_000)
            continue
        (s,), _ = tokenize_records([{"messages": system + msgs, "tools": tools, "line": 3}], tok, 10_000)
        ref = tok.apply_chat_template(system + msgs, tools=tools, tokenize=True, return_dict=True,
                                      return_assistant_tokens_mask=True)
        assert s["input_ids"] == ref["input_ids"]
        ours = [lab != IGNORE_INDEX for lab in s["labels"][:-1]]
        assert ours == [bool(m) for m in ref["assistant_masks"][1:]], (system, target_runs(tok, s))
        assert '"get_w"' in target_runs(tok, s)[0], target_runs(tok, s)


# A template that writes the last user message first (a "question" block), and a placeholder in its place: the
# message after a turn is written before it.
QUESTION_FIRST = (
    "{%- set q = namespace(i=-1) %}{%- for m in messages %}{%- if m['role'] == 'user' %}{%- set q.i = loop.index0 %}"
    "{%- endif %}{%- endfor %}{%- if q.i >= 0 %}{{- '<|im_start|>question\\n' + messages[q.i]['content'] + "
    "'<|im_end|>\\n' }}{%- endif %}{%- for m in messages %}{%- if loop.index0 == q.i %}"
    "{{- '<|im_start|>user\\n(above)<|im_end|>\\n' }}{%- elif m['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}{% generation %}{{- m['content'] + '<|im_end|>' }}{% endgeneration %}{{- '\\n' }}"
    "{%- else %}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


def test_a_template_writing_a_later_message_before_a_turn(tok):
    """Turns searched for are bounded by where the next message is written, unless the template writes it before the
    turn (found by review: the greeting "ion" was trained inside "question", and a plain two-round chat refused)."""
    tok.chat_template = QUESTION_FIRST
    for msgs in ([A("ion"), U("Q"), A("A")], [A("a"), U("Q"), A("A")], [U("Q1"), A("A1"), U("Q2"), A("A2")],
                 [{"role": "system", "content": "S"}, A("Hi"), U("Q"), A("")]):
        (s,), _ = tokenize_records([{"messages": msgs, "line": 1}], tok, 10_000)
        ref = tok.apply_chat_template(msgs, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        assert s["input_ids"] == ref["input_ids"]
        ours = [lab != IGNORE_INDEX for lab in s["labels"][:-1]]
        assert ours == [bool(m) for m in ref["assistant_masks"][1:]], (msgs, target_runs(tok, s))


def test_tools_the_template_cannot_write_or_that_are_malformed_are_refused(tok, tmp_path):
    """A template that reads no tools (the model would train on calls to tools it never sees) is refused naming the
    line; so are "tools" on a text record, a "tools" string that is not JSON, a list of non-objects, and a tool
    description holding a special token's text."""
    msgs = [{"role": "user", "content": "Q?"}, {"role": "assistant", "content": "A."}]
    tok.chat_template = NO_PROMPT_TAGGED
    with pytest.raises(DataError, match=r"line 3: the record has \"tools\", which the chat template does not write"):
        tokenize_records([{"messages": msgs, "tools": TOOLS, "line": 3}], tok, 10_000)
    assert tokenize_records([{"messages": msgs, "line": 3}], tok, 10_000)[0], "without tools it trains"
    # a template that writes the tools only beside a system prompt: a record with one trains, one without is refused
    loop = "{%- for m in messages %}"
    tok.chat_template = NO_PROMPT_TAGGED.replace(loop, "{%- if tools and messages[0]['role'] == 'system' %}"
                                                 "{{- (tools | tojson) }}{%- endif %}" + loop, 1)
    assert "tools" in tok.chat_template, "the replace above found nothing"
    system = [{"role": "system", "content": "S."}, *msgs]
    (s,), _ = tokenize_records([{"messages": system, "tools": TOOLS, "line": 5}], tok, 10_000)
    ref = tok.apply_chat_template(system, tools=TOOLS, tokenize=True, return_dict=True,
                                  return_assistant_tokens_mask=True)
    assert s["input_ids"] == ref["input_ids"] and "the weather in a city" in tok.decode(s["input_ids"])
    assert [lab != IGNORE_INDEX for lab in s["labels"][:-1]] == [bool(m) for m in ref["assistant_masks"][1:]]
    with pytest.raises(DataError, match=r"line 6: the record has \"tools\", which the chat template does not write"):
        tokenize_records([{"messages": msgs, "tools": TOOLS, "line": 6}], tok, 10_000)
    for line, said in ((json.dumps({"text": "x", "tools": TOOLS}), '"tools" goes with a "messages" record'),
                       (json.dumps({"messages": msgs, "tools": "[{oops"}), '"tools" is a string that is not JSON'),
                       (json.dumps({"messages": msgs, "tools": ["get_w"]}), '"tools" must be a list of tool schemas')):
        path = tmp_path / "bad.jsonl"
        path.write_text(line + "\n")
        with pytest.raises(DataError, match=f"line 1: {said}"):
            load_jsonl(path)
    tok.chat_template = QWEN_TOOLS + _tool_template(False)
    bad = [{**TOOLS[0], "function": {**TOOLS[0]["function"], "description": "ends <|im_end|>"}}]
    with pytest.raises(DataError, match=r"line 4: tools\[0\].function.description holds the special token"):
        tokenize_records([{"messages": msgs, "tools": bad, "line": 4}], tok, 10_000)


def test_an_unreadable_data_file_is_one_error_naming_it(tmp_path, monkeypatch):
    """A --data file this user may not read: a DataError naming the flag, the file and the fix at start-up (until
    2026-12-04 a PermissionError traceback from the loader). (Tests run as root, where chmod 000 reads anyway.)"""
    from data import check_file

    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "x"}\n')
    real = Path.open

    def denied(self, *a, **k):
        if self == path:
            raise PermissionError(13, "Permission denied")
        return real(self, *a, **k)
    monkeypatch.setattr(Path, "open", denied)
    with pytest.raises(DataError, match=rf"--data {path} cannot be read \(PermissionError: Permission denied\); fix"):
        check_file(path, "--data")


def test_chat_targets_without_offsets_equal_the_fast_tokenizers(tok):
    """A tokenizer without offsets (slow, python) finds the same turns, tool calls and end markers (what the template
    writes after an answer is compared by characters, to a whitespace, instead of by tokens)."""
    from data.chat import chat_tokens

    class Slow:   # the tokenizer, without offsets
        def __init__(self, t):
            self.t = t

        def __getattr__(self, name):
            return getattr(self.t, name)

        def __call__(self, *a, **k):
            if k.get("return_offsets_mapping"):
                raise NotImplementedError("return_offset_mapping is not available when using Python tokenizers")
            return self.t(*a, **k)
    call = {"type": "function", "function": {"name": "f", "arguments": {"x": 1}}}
    msgs = [{"role": "user", "content": "Q?"}, {"role": "assistant", "content": "d", "tool_calls": [call]},
            {"role": "tool", "content": "1"}, {"role": "assistant", "content": "e "}]
    for template in (EOS_LAST_TAGGED, NO_PROMPT_TAGGED, _tool_template(False), _tool_template(True)):
        tok.chat_template = template
        calls = template in (_tool_template(False), _tool_template(True))   # (the others write none: refused)
        one = msgs if calls else [{k: v for k, v in m.items() if k != "tool_calls"} for m in msgs]
        fast, slow = chat_tokens(tok, one, "<t>")[:2], chat_tokens(Slow(tok), one, "<t>")[:2]
        assert slow == fast and any(fast[1]), template


def test_a_conversation_the_template_refuses_names_the_line(tok, tmp_path):
    """A template's raise_exception (Mistral's and Llama 2's "roles must alternate") on one record is a DataError
    naming the file and line and the fix, not jinja2's traceback."""
    tok.chat_template = ("{%- for m in messages %}{%- if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
                         "{{- raise_exception('Conversation roles must alternate user/assistant') }}{%- endif %}"
                         "{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{%- endfor %}"
                         "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
    ok = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}
    bad = {"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "a again"},
                        {"role": "assistant", "content": "b"}]}
    path = tmp_path / "alt.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in (ok, ok, bad)) + "\n")
    with pytest.raises(DataError, match=r"alt\.jsonl, line 3: the chat template refused this conversation "
                                        r"\(TemplateError: Conversation roles must alternate.*--chat-template"):
        tokenize_records(load_jsonl(path), tok, 1000, path)


def test_chat_leading_assistant_turn_skips_default_system_prompt(tok):
    msgs = [{"role": "assistant", "content": "Hello there."}, {"role": "user", "content": "Hi"}]
    (s,), _ = tokenize_records([{"messages": msgs}], tok, 10_000)
    assert target_runs(tok, s) == ["Hello there." + END]


def test_chat_template_flag_replaces_the_checkpoints(tok_dir, tmp_path):
    """--chat-template: "chatml" renders ChatML as written out here; a Jinja file renders its own format; the
    targets are the assistant content and its end marker either way. Refused, naming the flag: a missing file, a file
    with no `messages`, a template that raises or drops the assistant's text, one whose end-of-turn marker is not one
    token of this tokenizer (nothing a tuned model could stop on)."""
    import re

    from data.templates import TEMPLATES, chat_template, end_of_turn

    msgs = [{"role": "user", "content": "who ran?"}, {"role": "assistant", "content": "the fox"}]
    assert chat_template("chatml") == TEMPLATES["chatml"] and chat_template(None) is None
    tok = load_tokenizer(tok_dir, chat_template("chatml"))
    assert tok.chat_template == TEMPLATES["chatml"]
    (s,), _ = tokenize_records([{"messages": msgs}], tok, 1000)
    chatml = f"<|im_start|>user\nwho ran?{END}\n<|im_start|>assistant\nthe fox{END}\n"
    assert s["input_ids"] == tok(chatml, add_special_tokens=False)["input_ids"]
    assert target_runs(tok, s) == [f"the fox{END}"]
    own = tmp_path / "own.jinja"
    own.write_text("{% for m in messages %}[{{ m['role'] }}]\n{{ m['content'] }}" + END + "\n{% endfor %}"
                   "{% if add_generation_prompt %}[assistant]\n{% endif %}")
    tok = load_tokenizer(tok_dir, chat_template(str(own)))
    (s,), _ = tokenize_records([{"messages": msgs}], tok, 1000)
    assert s["input_ids"] == tok(f"[user]\nwho ran?{END}\n[assistant]\nthe fox{END}\n", add_special_tokens=False)[
        "input_ids"]
    assert target_runs(tok, s) == [f"the fox{END}"]
    # a marker written after a space (as Llama 2's " </s>") is its token
    spaced = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }} <|endoftext|>\n{% endfor %}"
    assert end_of_turn(load_tokenizer(tok_dir, spaced)) == ("<|endoftext|>", [tok.eos_token_id])
    (tmp_path / "plain.txt").write_text("hello")
    for spec, pattern in ((str(tmp_path / "nope.jinja"), "is neither a built-in \\(chatml\\) nor a file"),
                          (str(tmp_path / "plain.txt"), "no `messages` in it")):
        with pytest.raises(DataError, match=f"--chat-template '{re.escape(spec)}'.*{pattern}"):
            chat_template(spec)
    for text, pattern in (("{% for m in messages %}{{ raise_exception('no roles here') }}{% endfor %}",
                           "does not render a user and an assistant turn.*no roles here"),
                          ("{% for m in messages %}{{ m['role'] }}{% endfor %}",
                           "does not render a user and an assistant turn"),
                          (TEMPLATES["chatml"].replace("<|im_end|>", "</turn>"),
                           r"ends an assistant turn with '</turn>', which this tokenizer spells in \d+ tokens, "
                           "not one")):
        with pytest.raises(DataError, match=f"--chat-template: .*{pattern}"):
            load_tokenizer(tok_dir, text)


def test_chat_template_file_may_be_a_tokenizer_config_json(tok_dir, tmp_path):
    """--chat-template FILE.json (tokenizer_config.json): its "chat_template" string is the template (until 2026-12-06
    the JSON text itself was, so every chat rendered inside it); the tokens are the tokenizer's own
    apply_chat_template under that template. JSON of another shape (named templates, no "chat_template") is refused,
    naming the file and the fix."""
    import re

    from data.templates import TEMPLATES, chat_template

    msgs = [{"role": "user", "content": "who ran?"}, {"role": "assistant", "content": "the fox"}]
    ref = load_tokenizer(tok_dir).apply_chat_template(msgs, chat_template=TEMPLATES["chatml"], tokenize=True,
                                                      return_dict=False)
    config = tmp_path / "tokenizer_config.json"
    config.write_text(json.dumps({"model_max_length": 512, "chat_template": TEMPLATES["chatml"]}, indent=2))
    assert chat_template(str(config)) == TEMPLATES["chatml"]
    (s,), _ = tokenize_records([{"messages": msgs}], load_tokenizer(tok_dir, chat_template(str(config))), 1000)
    assert s["input_ids"] == ref
    named = [{"name": "default", "template": TEMPLATES["chatml"]}, {"name": "tool_use", "template": "messages"}]
    for name, doc, shape in (("named.json", named, r"JSON holding a list \(named templates\)"),
                             ("config_named.json", {"model_max_length": 512, "chat_template": named},
                              r'JSON whose "chat_template" is a list \(named templates\)'),
                             ("no_key.json", {"model_max_length": 512, "messages": []},
                              'JSON with no "chat_template" key')):
        (tmp_path / name).write_text(json.dumps(doc))
        with pytest.raises(DataError, match=rf"--chat-template '{re.escape(str(tmp_path / name))}' is {shape}, not "
                                            "a chat template: pass the Jinja template itself") as e:
            chat_template(str(tmp_path / name))
        assert ('.jinja file: the "template" of one of its entries (default, tool_use; transformers renders '
                '"default", or "tool_use" for records with "tools"))' in str(e.value)) == ("named" in name), e.value


def test_chat_template_file_drops_a_bom(tok_dir, tmp_path):
    """--chat-template FILE with a UTF-8 byte-order mark renders as without it (until 2026-12-06 the mark opened every
    rendered chat, 3 tokens a sample, and the exported chat_template.jinja): the tokenizer's own apply_chat_template."""
    from data.templates import TEMPLATES, chat_template

    msgs = [{"role": "user", "content": "who ran?"}, {"role": "assistant", "content": "the fox"}]
    ref = load_tokenizer(tok_dir).apply_chat_template(msgs, chat_template=TEMPLATES["chatml"], tokenize=True,
                                                      return_dict=False)
    files = {"bom.jinja": TEMPLATES["chatml"], "bom.json": json.dumps({"chat_template": TEMPLATES["chatml"]})}
    for name, text in files.items():
        (tmp_path / name).write_text("\ufeff" + text, encoding="utf-8")   # (what Notepad's "UTF-8 with BOM" saves)
        assert chat_template(str(tmp_path / name)) == TEMPLATES["chatml"], name
        (s,), _ = tokenize_records([{"messages": msgs}], load_tokenizer(tok_dir, chat_template(str(tmp_path / name))),
                                   1000)
        assert s["input_ids"] == ref, name


def test_chat_template_file_not_utf8_is_named_with_the_byte_and_the_fix(tmp_path):
    """--chat-template FILE not UTF-8 (a Windows editor's cp1252): a DataError naming the flag, the file, the byte and
    where it is, and the fix (until 2026-12-06 it was the codec's error alone); a byte-order mark counts as bytes."""
    import re

    from data.templates import TEMPLATES, chat_template

    for name, head in (("latin1.jinja", b""), ("latin1_bom.jinja", "\ufeff".encode())):
        latin = tmp_path / name
        latin.write_bytes(head + ("{# café #}" + TEMPLATES["chatml"]).encode("cp1252"))
        at = latin.read_bytes().index(b"\xe9")
        with pytest.raises(DataError, match=rf"--chat-template '{re.escape(str(latin))}': not UTF-8 \(byte 0xe9 at "
                                            rf"position {at}\): save it as UTF-8"):
            chat_template(str(latin))


def test_whitespace_tokens_with_trimmed_offsets_are_targets_inside_an_answer(tok):
    """A tokenizer whose offsets trim whitespace (ByteLevel trim_offsets, GPT-2/RoBERTa-style files) gives its
    whitespace-only tokens empty spans: inside a completion or an assistant turn they are targets (the indentation
    of code), also where they open it, and not where they close the prompt or the user's turn or follow the turn's
    end marker. Same ids and targets as untrimmed."""
    from tokenizers import processors

    recs = [{"prompt": "def f(x):", "completion": "\n    if x:\n        return x"},
            {"prompt": "def f():", "completion": "    return 1"},   # the answer opens with spaces: they are its
            {"prompt": "Q:   ", "completion": "A"},   # the prompt closes with spaces: they are not
            {"messages": [{"role": "user", "content": "code"},
                          {"role": "assistant", "content": "if x:\n    return x"}]},
            {"messages": [{"role": "user", "content": "code  "},
                          {"role": "assistant", "content": "    return x  "}]}]
    plain, _ = tokenize_records(recs, tok, 1000)
    assert "".join(target_runs(tok, plain[1])) == "    return 1" + tok.eos_token, "untrimmed: the reference"
    tok.backend_tokenizer.post_processor = processors.ByteLevel(trim_offsets=True)
    enc = tok("a\n    b", return_offsets_mapping=True)["offset_mapping"]
    assert any(b <= a for a, b in enc), f"this tokenizer's offsets are not trimmed: {enc}"
    trimmed, _ = tokenize_records(recs, tok, 1000)
    assert trimmed == plain


def test_prompt_completion_without_offsets_and_left_truncation(tok):
    """A tokenizer without offsets (slow, python) finds the completion where the prompt's own tokens stop matching, a
    token merged across the boundary included, as the fast path does. A record longer than --max-len loses the start
    of its prompt, not its answer; one whose completion alone does not fit is cut at its end."""
    rec = {"prompt": "the quick brow", "completion": "n fox"}
    (fast,), _ = tokenize_records([rec], tok, 100)

    class Slow:   # the tokenizer, without offsets
        def __init__(self, t):
            self.t, self.eos_token_id, self.bos_token_id = t, t.eos_token_id, t.bos_token_id

        def __call__(self, *a, **k):
            if k.get("return_offsets_mapping"):
                raise NotImplementedError("return_offset_mapping is not available when using Python tokenizers")
            return self.t(*a, **k)
    (slow,), _ = tokenize_records([rec], Slow(tok), 100)
    assert slow == fast
    long = {"prompt": "fox " * 40 + "Q: who ran?\nA:", "completion": " the dog"}
    (s,), stats = tokenize_records([long], tok, 24)
    whole = tok(long["prompt"] + long["completion"])["input_ids"] + [tok.eos_token_id]
    assert s["input_ids"] == whole[-24:] and stats.truncated == 1 and stats.longest == len(whole)
    assert "".join(target_runs(tok, s)) == long["completion"] + tok.eos_token, "the answer and EOS kept whole"
    short = {"prompt": "Q:", "completion": " fox" * 40}
    (s,), _ = tokenize_records([short], tok, 24)
    assert s["input_ids"] == (tok(short["prompt"] + short["completion"])["input_ids"])[:24]


def test_long_text_split_trains_every_token_once(tok):
    """--long-text split (the default): a text record longer than --max-len becomes windows of at most max_len tokens
    that overlap by one, so the tokenizer's own encoding of the text (+ EOS) is every window's tokens in a row, and
    each of its tokens after the first is a target exactly once, predicted from the tokens before it in its window;
    at max_len = len - 1 the last window holds two tokens (one target), at len none is split, at 2 each token is
    a window's target. Prompt/completion and chat records are truncated as under "truncate" (their answer needs its
    question); the stats count the split records and their windows; --long-text truncate keeps the first max_len."""
    text = {"text": "The quick brown fox jumps over the lazy dog. " * 12}
    whole = tok(text["text"])["input_ids"] + [tok.eos_token_id]   # the reference: the tokenizer's own encoding
    n = len(whole)
    qa = {"prompt": "fox " * 80 + "Q: who ran?\nA:", "completion": " the dog"}
    chat = {"messages": [{"role": "user", "content": "dog " * 80 + "Why?"}, {"role": "assistant", "content": "Sure."}]}
    for max_len in (2, 3, 7, 40, n - 1, n, n + 1):
        samples, stats = tokenize_records([text, qa, chat], tok, max_len)
        k = 1 if max_len >= n else -(-(n - 1) // (max_len - 1))
        windows, rest = samples[:k], samples[k:]
        ids = [s["input_ids"] for s in windows]
        assert all(2 <= len(w) <= max_len for w in ids), (max_len, [len(w) for w in ids])
        assert ids[0] + [t for w in ids[1:] for t in w[1:]] == whole, f"max_len {max_len}: not the text's tokens"
        assert all(w[0] == p[-1] for p, w in zip(ids, ids[1:])), f"max_len {max_len}: windows overlap by one"
        assert [t for s in windows for t in s["labels"] if t != IGNORE_INDEX] == whole[1:], \
            f"max_len {max_len}: every token after the first a target once"
        assert all(s["labels"] == s["input_ids"][1:] + [IGNORE_INDEX] for s in windows), "labels within a window"
        cut, cut_stats = tokenize_records([qa, chat], tok, max_len)
        assert rest == cut, f"max_len {max_len}: prompt/completion and chat records are not split"
        assert (stats.split, stats.windows) == ((1, k) if max_len < n else (0, 0)), (max_len, stats)
        assert (stats.samples, stats.truncated, stats.cut) == (k + cut_stats.samples, cut_stats.truncated,
                                                              cut_stats.cut), (max_len, stats)
        assert stats.targets == n - 1 + cut_stats.targets and stats.tokens == sum(map(len, ids)) + cut_stats.tokens
        assert (f"split 1 into {k} windows" in str(stats)) == (max_len < n), str(stats)
    (first, *_), stats = tokenize_records([text, qa], tok, 40, long_text="truncate")
    assert first["input_ids"] == whole[:40] and stats.truncated == 2 and stats.split == 0, stats
    with pytest.raises(ValueError, match="long_text must be one of"):
        tokenize_records([text], tok, 40, long_text="chunk")


def test_prompt_truncation_keeps_the_answer_learnable(tok):
    """A long prompt whose answer (with EOS) alone fills --max-len, or more: the prompt keeps its last max_len // 4
    tokens, at least one without a BOS (none needed with one), so the answer's first token is still a target; the
    answer loses its end, and the record is never dropped. An answer that fits beside a few prompt tokens (fewer
    than max_len // 4) is kept whole, EOS included."""
    from tokenizers import processors

    prompt, eos = "fox " * 40 + "Q: who ran?\nA:", tok.eos_token_id
    for answer in (" the dog", " the dog" * 20):
        whole = tok(prompt + answer)["input_ids"] + [eos]
        n = min(24, len(whole) - len(tok(prompt)["input_ids"]))   # the answer and its EOS: one short of that
        start = len(tok(prompt)["input_ids"]) - max(1, n // 4)   # " the" does not merge with ":"
        (s,), stats = tokenize_records([{"prompt": prompt, "completion": answer}], tok, n)
        assert (stats.truncated, stats.dropped) == (1, 0), f"{answer!r}: {stats}"
        assert s["input_ids"] == whole[start:start + n], f"{answer!r}: the prompt's end and the answer's start"
        targets = whole[len(tok(prompt)["input_ids"]):start + n]
        assert "".join(target_runs(tok, s)) == tok.decode(targets), f"{answer!r}: all of the answer kept"
    whole = tok(prompt + " the dog the dog")["input_ids"] + [eos]
    answer = len(whole) - len(tok(prompt)["input_ids"])
    (s,), _ = tokenize_records([{"prompt": prompt, "completion": " the dog the dog"}], tok, answer + 1)
    assert (answer + 1) // 4 > 1 and s["input_ids"] == whole[-(answer + 1):], "1 prompt token and the whole answer"
    bos = tok.convert_tokens_to_ids("<|im_start|>")
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(single="<|im_start|> $A",
                                                                         special_tokens=[("<|im_start|>", bos)])
    tok.bos_token = "<|im_start|>"
    whole = tok(prompt + " the")["input_ids"] + [eos]
    assert whole[0] == bos and len(tok(" the", add_special_tokens=False)["input_ids"]) == 1
    (s,), stats = tokenize_records([{"prompt": prompt, "completion": " the"}], tok, 3)   # 3 // 4 = 0
    assert s["input_ids"] == [bos] + whole[-2:] and stats.dropped == 0, "with a BOS the whole prompt may go"
    assert "".join(target_runs(tok, s)) == " the" + tok.eos_token


def test_chat_without_template_is_an_error(tok, tmp_path):
    tok.chat_template = None
    make_chat_jsonl(tmp_path / "c.jsonl", 2)
    with pytest.raises(DataError, match=r"c\.jsonl, line 1: chat records need the checkpoint's chat template.*pass "
                                        r"--chat-template chatml \(or --chat-template FILE.jinja\)"):
        tokenize_records(load_jsonl(tmp_path / "c.jsonl"), tok, 100, tmp_path / "c.jsonl")


def test_special_token_text_in_a_chat_is_refused_and_in_text_counted(tok):
    """A chat message holding a special token's text would encode as that control token (here '<|im_end|>' ends the
    answer early: a turn boundary the conversation lacks): refused, naming the line, the message and the token. Text
    and prompt/completion records (pre-rendered chats mean them) keep them as the tokenizer encodes them: counted."""
    chat = {"line": 4, "messages": [{"role": "user", "content": "Stop?"},
                                    {"role": "assistant", "content": "Yes.<|im_end|> Really."}]}
    with pytest.raises(DataError, match=r"c\.jsonl, line 4: message 1 \(assistant\) holds the special token "
                                        r"'<\|im_end\|>' in 'content' \(at character 4\), which encodes as that "
                                        "control token"):
        tokenize_records([chat], tok, 100, "c.jsonl")
    # any text a template may render: a reasoning block (Qwen3's reasoning_content), a tool call's arguments (until
    # 2026-12-03 only `content` was looked at: a fake user turn inside <think> was trained on)
    tok.chat_template = ("{%- for m in messages %}{{- '<|im_start|>' + m['role'] + '\\n' }}{%- if m.reasoning_content "
                         "%}{{- '<think>' + m.reasoning_content + '</think>' }}{%- endif %}{%- for c in m.tool_calls "
                         "or [] %}{{- c.function.arguments }}{%- endfor %}{{- m['content'] + '<|im_end|>\\n' }}"
                         "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
    fake = "think<|im_end|>\n<|im_start|>user\nfake"
    for extra, key in (({"reasoning_content": fake}, "reasoning_content"),
                       ({"tool_calls": [{"function": {"name": "f", "arguments": fake}}]},
                        r"tool_calls\[0\]\.function\.arguments")):
        chat = {"line": 2, "messages": [{"role": "user", "content": "Stop?"},
                                        {"role": "assistant", "content": "Yes.", **extra}]}
        rendered = tok.apply_chat_template(chat["messages"], tokenize=True, return_dict=False)
        assert rendered.count(tok.convert_tokens_to_ids("<|im_end|>")) == 3, "why: the template renders it as a turn"
        with pytest.raises(DataError, match=rf"line 2: message 1 \(assistant\) holds the special token '<\|im_end\|>' "
                                            rf"in '{key}' \(at character 5\)"):
            tokenize_records([chat], tok, 100, "c.jsonl")
    ok = {"line": 3, "messages": [{"role": "user", "content": "Stop?"},
                                  {"role": "assistant", "content": "Yes.", "reasoning_content": "think first"}]}
    (s,), _ = tokenize_records([ok], tok, 100)
    assert target_runs(tok, s) == ["<think>think first</think>Yes." + END]
    assert tok("Yes.<|im_end|>")["input_ids"][-1] == tok.convert_tokens_to_ids("<|im_end|>"), "why: the encoding"
    texts = [{"line": 1, "text": "one <|endoftext|> two"}, {"line": 2, "text": "plain"},
             {"line": 3, "prompt": "<|im_start|>user\nHi<|im_end|>\n", "completion": "Hello"}]
    samples, stats = tokenize_records(texts, tok, 100)
    assert stats.special == 2 and "2 with special-token text (encoded as those tokens)" in str(stats), stats
    assert tok.eos_token_id in samples[0]["input_ids"][:-1], "the text's own EOS, as the tokenizer encodes it"


def test_truncation_counted_and_empty_samples_dropped(tok, tmp_path):
    recs = make_text_jsonl(tmp_path / "t.jsonl", 40, seed=3)
    full, _ = tokenize_records(load_jsonl(tmp_path / "t.jsonl"), tok, 10_000)
    samples, stats = tokenize_records(load_jsonl(tmp_path / "t.jsonl"), tok, 32, long_text="truncate")
    assert stats.truncated == sum(len(s["input_ids"]) > 32 for s in full) > 0
    assert stats.longest == max(len(s["input_ids"]) for s in full)
    # the data: line says the record, not a sample, is that long (it read as if samples that long were trained)
    assert f"longest record {stats.longest} (before the cut to --max-len), truncated {stats.truncated}" in str(stats)
    assert "(before the cut" not in str(tokenize_records(load_jsonl(tmp_path / "t.jsonl"), tok, 10_000)[1])
    for f, s in zip(full, samples):
        n = len(s["input_ids"])
        assert s["input_ids"] == f["input_ids"][:32] and s["labels"] == f["labels"][: n - 1] + [IGNORE_INDEX]
    assert stats.samples == len(recs) and stats.dropped == 0
    assert stats.targets == sum(count_targets({"labels": torch.tensor(s["labels"])}) for s in samples)
    # A long chat loses the start of its document (the longest message before the answer): its headers, the
    # document's end and the answer are the untruncated rendering's, and the targets are all there.
    doc = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "fox " * 200 + "Why?"},
           {"role": "assistant", "content": "Sure."}]
    (whole,), _ = tokenize_records([{"messages": doc}], tok, 10_000)
    (cut,), stats = tokenize_records([{"messages": doc}], tok, 64)
    ids, w = cut["input_ids"], whole["input_ids"]
    head = tok(tok.apply_chat_template(doc[:1], tokenize=False) + "<|im_start|>user\n", add_special_tokens=False)
    assert len(ids) == 64 and ids[:len(head["input_ids"])] == head["input_ids"] == w[:len(head["input_ids"])], \
        ("the system turn and the user header stay", tok.decode(ids))
    assert ids[len(head["input_ids"]):] == w[len(w) - 64 + len(head["input_ids"]):], "the document's end and after"
    assert tok.decode([t for t in cut["labels"] if t != IGNORE_INDEX]) == \
        tok.decode([t for t in whole["labels"] if t != IGNORE_INDEX]) == "Sure.<|im_end|>", "every target kept"
    assert "Why?" in tok.decode(ids) and (stats.truncated, stats.cut, stats.dropped) == (1, len(w) - 64, 0), stats
    # When the rest alone does not fit (another long message before the answer), the document keeps its last
    # max_len // 4 tokens and the end is cut: here the answer too, so no target is left: dropped, counted, named.
    lost = {"line": 7, "messages": [{"role": "system", "content": "dog " * 60}, *doc[1:]]}
    samples, stats = tokenize_records([lost, {**recs[0], "line": 8}], tok, 32, long_text="truncate")
    assert (stats.records, stats.samples, stats.truncated, stats.dropped, stats.dropped_lines) == (2, 1, 1, 1, [7])
    kept_whole = tokenize_records([recs[0]], tok, 10**6)[1].tokens   # line 8 uncut
    assert f"truncated 1 ({kept_whole - 32} tokens cut)" in str(stats), ("only kept samples count", str(stats))
    dropped, cut = stats.warning("t.jsonl", 32, "truncate").split("\n")
    assert dropped == "warning: t.jsonl: 1 of 2 records (50.0%) have no target token within --max-len 32 and are " \
        "not trained on (line 7); a longer --max-len keeps them"
    share = f"{100 * stats.cut / (stats.tokens + stats.cut):.0f}%"
    assert cut == f"warning: t.jsonl: --max-len 32 cut {stats.cut:,} of the kept records' " \
        f"{stats.tokens + stats.cut:,} tokens ({share}), which are never trained on; a longer " \
        "--max-len keeps them, and --long-text split trains a text record whole", cut
    # Truncation that cuts 5% of the kept tokens or more is a warning too (under split: only prompt and chat records
    # are cut); less is the data: line's count only.
    samples, stats = tokenize_records(load_jsonl(tmp_path / "t.jsonl"), tok, 32, long_text="truncate")
    assert stats.cut >= 0.05 * (stats.tokens + stats.cut) and "--long-text split trains a text record whole" in \
        stats.warning("t.jsonl", 32, "truncate"), stats
    assert tokenize_records(load_jsonl(tmp_path / "t.jsonl"), tok, 32)[1].warning("t.jsonl", 32) is None, "split"
    few = tokenize_records([{"text": "The fox ran."}] * 40 + [{"text": "fox " * 40}], tok, 120, long_text="truncate")[1]
    assert 0 < few.cut < 0.05 * (few.tokens + few.cut) and few.warning("t.jsonl", 120, "truncate") is None, few


# --- JSONL validation -----------------------------------------------------------------------------

BAD_LINES = [
    ('{"text": "a"', "not valid JSON (Expecting ',' delimiter at column 13 (the line's end: cut short?))"),
    ("[", "not valid JSON (Expecting value at column 2 (the line's end: cut short?)); a valid line"),   # (a file
    # starting with "[" is one JSON array, read as such since 2026-12-06: tests/test_data_formats.py)
    ('{"text": "a",, "b": 1}', "not valid JSON (Expecting property name enclosed in double quotes at column 14)"),
    ("version https://git-lfs.github.com/spec/v1", "not valid JSON (Expecting value at column 1); the file is a "
                                                    "Git LFS pointer, not the data: fetch it (`git lfs pull`)"),
    ("[1, 2]", "expected a JSON object, got list"),
    ('{"foo": "a"}', 'has none of "text", "prompt"/"completion", "messages"'),
    ('{"prompt": "a"}', '"completion" must be a string, got nothing'),
    ('{"completion": "a"}', '"prompt" must be a string, got nothing'),
    ('{"prompt": 3, "completion": "a"}', '"prompt" must be a string, got int'),
    ('{"prompt": "q", "completion": " "}', '"completion" is empty'),
    ('{"text": "a", "prompt": "q", "completion": "a"}', "has 'text' and 'prompt'; use one kind per line"),
    ('{"text": 5}', '"text" must be a string'),
    ('{"text": "   "}', '"text" is empty'),
    ('{"text": "a", "messages": []}', "has 'text' and 'messages'; use one kind per line"),
    ('{"messages": "hi"}', '"messages" must be a list'),
    ('{"messages": []}', '"messages" is an empty list'),
    ('{"messages": ["hi"]}', "message 0 must be an object"),
    ('{"messages": [{"content": "hi"}]}', 'message 0 has no "role"'),
    ('{"messages": [{"role": "user", "content": 3}]}', 'message 0 "content" must be a string'),
    ('{"messages": [{"from": "human", "value": "hi"}]}', 'no message has role "assistant" (roles found: [\'user\'])'),
    ('{"conversations": [{"from": "human", "value": "a"}, {"from": "bot", "value": "b"}]}', 'message 1 is "from" '
     "'bot', not one of ShareGPT's speakers this reader maps to a role (human, user, gpt, assistant, system, tool, "
     'observation): rename it'),
    ('{"conversations": [{"from": "human", "value": "a"}, {"role": "assistant", "content": "b"}]}',
     'message 1 is not ShareGPT\'s {"from", "value"} as message 0 is: write every message of a line one way'),
    ('{"conversations": [{"from": "human"}, {"from": "gpt", "value": "b"}]}', 'message 0 has no "value"'),
    ('{"system": "s", "conversations": [{"from": "system", "value": "s"}, {"from": "human", "value": "a"}, '
     '{"from": "gpt", "value": "b"}]}', 'has a "system" string and a first message from "system": give the system '
     'prompt once'),
    ('{"conversations": "hi"}', '"messages" must be a list'),
    ('{"prompt": "q", "response": "a"}', '"completion" must be a string, got nothing; this line has "response", '
     'which this reader does not read: rename "response" to "completion"'),
    ('{"instruction": "q", "input": "ctx", "response": "a"}', 'has none of "text", "prompt"/"completion", "messages" '
     "(keys: ['input', 'instruction', 'response']); this line has \"instruction\" and \"input\" and \"response\", "
     'which this reader does not read: join "instruction" and "input" into one "prompt" string, rename "response" '
     'to "completion"'),   # (Alpaca's answer is "output")
    ('{"instruction": "q", "output": " "}', '"output" must be the answer, a string with text; got empty'),
    ('{"instruction": "", "input": "", "output": "a"}', '"instruction" and "input" are empty'),
    ('{"instruction": "q", "output": "a", "history": [["q0"]]}', '"history" must be a list of [query, answer] string '
     "pairs (LLaMA-Factory's), got [['q0']]"),
    ('{"instruction": 3, "output": "a"}', '"instruction" must be a string (Alpaca\'s), got int'),
    ('{"instruction": "q", "output": ["good", "bad"]}', '"output" is a list: LLaMA-Factory\'s older ranking form, '
     '[chosen, rejected]? write its sides as "chosen" and "rejected" (jq -c \'.chosen = .output[0] | .rejected = '
     ".output[1] | del(.output)' FILE)"),
    # KTO lines (TRL's unpaired preference form, LLaMA-Factory's KTO demo, an Alpaca kto_tag): read as SFT until
    # 2026-12-06, training their undesirable answers; a text record's bool "label" (a classifier's) still reads
    ('{"prompt": "q", "completion": "bad", "label": false}', 'has "label": false, a KTO label (TRL\'s unpaired '
     "preference data, LLaMA-Factory's kto_tag), which this trainer does not read: each answer would be a target, "
     "the undesirable ones too; keep the lines labelled true and drop the key (jq -c 'select(.label == true) | "
     "del(.label)' FILE), or pair the answers for --objective dpo"),
    ('{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}], "label": true}',
     'has "label": true, a KTO label'),
    ('{"instruction": "q", "output": "bad", "kto_tag": false}', 'has "kto_tag": false, a KTO label'),
    ('{"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": 3}]}',
     'message 1 "value" must be a string, got int'),
    ('{"system": "s", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": null}]}',
     'message 1 "value" must be a string, got NoneType'),   # (its own index, not one counting the "system" put first)
    ('{"system": ["s"], "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "a"}]}',
     '"system" must be a string (the system prompt), got list'),
    ('{"messages": [{"role": "user", "content": "a"}, {"role": "gpt", "content": "b"}]}',
     'no message has role "assistant"'),
    ('{"text": "cut \\ud83d here"}', r"has a lone UTF-16 surrogate escape (\ud83d at column 15: half of a pair"),
    ('{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "\\udE00"}]}',
     r"has a lone UTF-16 surrogate escape (\udE00 at column 83"),
    ('{"x": "\\ud800", "text": "ok\\udfff"}', r"has a lone UTF-16 surrogate escape (\udfff at column 28"),
]


@pytest.mark.parametrize("line,problem", BAD_LINES)
def test_malformed_line_names_file_line_and_fix(tmp_path, line, problem):
    p = tmp_path / "bad.jsonl"
    p.write_text('{"text": "fine"}\n\n' + line + "\n")
    with pytest.raises(DataError) as e:
        load_jsonl(p)
    msg = str(e.value)
    assert f"bad.jsonl, line 3: {problem}" in msg
    assert 'a valid line is {"text": ' in msg and '"messages": [{"role": "user"' in msg
    assert isinstance(e.value, ValueError)


def test_surrogate_pairs_and_escaped_backslashes_are_text(tok, tmp_path):
    """What the lone-surrogate refusal above lets through: a pair (how Python's json.dumps writes an emoji), a
    backslash written as \\\\ before "ud800", and a lone half in a key the record does not use. The half it refuses
    would have stopped the tokenizer itself with a TypeError naming no line."""
    lines = [json.dumps({"text": "a smile \U0001F600 here"}), r'{"text": "C:\\ud800 is a folder"}',
             '{"text": "fine", "meta": "\\udc00"}']
    assert '\\ud83d\\ude00' in lines[0], "json.dumps escapes the emoji as a surrogate pair"
    p = tmp_path / "ok.jsonl"
    p.write_text("\n".join(lines) + "\n")
    recs = load_jsonl(p)
    assert [r["text"] for r in recs] == ["a smile \U0001F600 here", "C:\\ud800 is a folder", "fine"]
    assert tokenize_records(recs, tok, 100)[1].samples == 3
    with pytest.raises(TypeError):
        tok(["lone \ud800"])


def test_a_byte_order_mark_and_windows_line_ends_are_read_as_the_text(tmp_path):
    """A file a Windows editor saved (UTF-8 with a byte-order mark, CRLF line ends) reads as the same records as the
    plain file; json.loads alone refuses the mark ("Unexpected UTF-8 BOM")."""
    lines = [json.dumps({"text": "first"}), json.dumps({"prompt": "Q?", "completion": " A"})]
    plain, windows = tmp_path / "plain.jsonl", tmp_path / "windows.jsonl"
    plain.write_bytes(("\n".join(lines) + "\n").encode())
    windows.write_bytes("\ufeff".encode() + ("\r\n".join(lines) + "\r\n").encode())
    assert load_jsonl(windows) == load_jsonl(plain) and load_jsonl(plain)[0]["text"] == "first"
    with pytest.raises(ValueError, match="BOM"):
        json.loads(windows.read_bytes().decode("utf-8").splitlines()[0])


def test_file_level_errors(tmp_path):
    with pytest.raises(DataError, match=r"nope\.jsonl does not exist"):
        load_jsonl(tmp_path / "nope.jsonl")
    (tmp_path / "blank.jsonl").write_text("\n  \n")
    with pytest.raises(DataError, match=r"has no records \(only blank lines\)"):
        load_jsonl(tmp_path / "blank.jsonl")
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(DataError, match=r"has no records \(an empty file\)"):
        load_jsonl(tmp_path / "empty.jsonl")
    (tmp_path / "latin.jsonl").write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
    with pytest.raises(DataError, match=r"latin\.jsonl, line 2: not UTF-8"):
        load_jsonl(tmp_path / "latin.jsonl")
    # (a compressed file, a zip, a JSON array, Parquet: read since 2026-12-06, tests/test_data_formats.py)
    with pytest.raises(DataError, match=r"has no tokenizer files"):
        load_tokenizer(tmp_path)
    with pytest.raises(DataError, match=r"missing does not exist"):
        load_tokenizer(tmp_path / "missing")
    (tmp_path / "ok.jsonl").write_text('\n{"text": "a", "id": 7}\n')
    assert load_jsonl(tmp_path / "ok.jsonl") == [{"line": 2, "text": "a"}]


def test_a_tokenizer_without_its_vocabulary_is_named_so(tok_dir, tmp_path):
    """A Qwen2 checkpoint folder holding tokenizer_config.json but not tokenizer.json loads in transformers as a
    tokenizer of one entry that encodes every text to no tokens (checked here on transformers' own AutoTokenizer):
    refused at load, naming the folder and the missing vocabulary. Until 2026-12-07 every record tokenized to nothing
    and the run stopped on "no sample has a target token ... every assistant turn "weight": 0", blaming the data."""
    from transformers import AutoTokenizer

    shutil.copytree(tok_dir, tmp_path / "tok")
    (tmp_path / "tok" / "tokenizer.json").unlink()
    (tmp_path / "tok" / "config.json").write_text(json.dumps({"model_type": "qwen2"}))   # (its tokenizer class)
    bare = AutoTokenizer.from_pretrained(str(tmp_path / "tok"), local_files_only=True)
    assert bare("Hello world", add_special_tokens=False)["input_ids"] == [], "transformers now fails or encodes it"
    with pytest.raises(DataError, match=rf"tokenizer in {tmp_path / 'tok'} encodes text to no tokens .*"
                                        r"tokenizer\.json.* copy the tokenizer that belongs to the checkpoint"):
        load_tokenizer(tmp_path / "tok")


@pytest.mark.parametrize("field,value", [("tie_word_embeddings", "yes"), ("rms_norm_eps", 0)])
def test_a_config_field_transformers_refuses_is_named_in_config_json_not_the_tokenizer(tok_dir, tmp_path, field, value):
    """A config.json field of a type transformers refuses (it reads config.json to pick the tokenizer: asked of its
    own AutoTokenizer here) is said as config.json's, with the field, then the tokenizer's own error."""
    from transformers import AutoTokenizer

    shutil.copytree(tok_dir, tmp_path / "tok")
    (tmp_path / "tok" / "config.json").write_text(json.dumps({"model_type": "qwen2", field: value}))
    with pytest.raises(Exception, match=field):
        AutoTokenizer.from_pretrained(str(tmp_path / "tok"), local_files_only=True)
    with pytest.raises(DataError) as e:
        load_tokenizer(tmp_path / "tok")
    said = str(e.value)
    assert said.startswith(f"{tmp_path / 'tok' / 'config.json'} is refused by transformers") and field in said and \
        "Fix that field in config.json" in said and "(the tokenizer's own error: " in said, said   # (both: either
    # may be at fault, as a broken tokenizer.json beside a model_type the installed transformers lacks)


# --- global batch order ---------------------------------------------------------------------------


def reference_step(n, g, seed, step):
    """The documented order, written out: concatenated per-epoch randperms, consecutive slices."""
    epochs = step * g // n + 2 + g // n
    stream = torch.cat([torch.randperm(n, generator=torch.Generator().manual_seed(seed + e)) for e in range(epochs)])
    return stream[step * g : (step + 1) * g].tolist()


@pytest.mark.parametrize("n,g", [(13, 8), (40, 8), (5, 8)])
def test_step_samples_independent_of_layout(n, g):
    for seed in (0, 7):
        order = GlobalBatches(n, g, seed)
        for step in range(8):
            ref = reference_step(n, g, seed, step)
            assert order.step_samples(step) == ref
            for d_ranks, mb in [(1, 4), (2, 1), (4, 1), (2, 2), (1, 8)]:
                got = [i for d in range(d_ranks) for mb_ids in order.micro_batches(step, d, d_ranks, mb)
                       for i in mb_ids]
                assert got == ref, f"layout D={d_ranks} micro_batch={mb} changed step {step}"
                sizes = {len(x) for d in range(d_ranks) for x in order.micro_batches(step, d, d_ranks, mb)}
                assert sizes == {mb}
    # Resume = a fresh object asked for step k; seeds matter; an epoch covers every sample once.
    assert GlobalBatches(n, g, 0).step_samples(5) == GlobalBatches(n, g, 0).step_samples(5)
    runs = [[GlobalBatches(n, g, seed).step_samples(k) for k in range(3)] for seed in (0, 1)]
    assert runs[0] != runs[1], "different seeds must give different orders"
    first_epoch = [i for k in range(n) for i in GlobalBatches(n, 1, 3).step_samples(k)]
    assert sorted(first_epoch) == list(range(n))


def test_check_batch_sizes_message():
    check_batch_sizes(16, 2, 4)
    with pytest.raises(ValueError) as e:
        check_batch_sizes(10, 4, 2)
    msg = str(e.value)
    for part in ("--global-batch 10", "--micro-batch 4", "2 data ranks", "= 8", "use --global-batch 8 or 16"):
        assert part in msg, (part, msg)
    with pytest.raises(ValueError, match="--global-batch 8 or 16"):
        GlobalBatches(100, 10, 0).micro_batches(0, 0, 2, 4)
    with pytest.raises(ValueError, match="positive"):
        check_batch_sizes(8, -1, 1)
    check_batch_sizes(8, 0, 2)   # (0: --micro-batch auto, cut by tokens: the global batch splits over the data ranks)


# --- collation ------------------------------------------------------------------------------------


def target_pairs(batch):
    keep = batch["labels"] != IGNORE_INDEX
    return list(zip(batch["input_ids"][keep].tolist(), batch["labels"][keep].tolist()))


@pytest.mark.parametrize("divisor", [1, 4, 6])
def test_pack_and_pad_keep_the_same_targets(tok, tmp_path, divisor):
    make_chat_jsonl(tmp_path / "c.jsonl", 3, seed=4)
    make_text_jsonl(tmp_path / "t.jsonl", 3, seed=4)
    recs = load_jsonl(tmp_path / "c.jsonl") + load_jsonl(tmp_path / "t.jsonl")
    samples, _ = tokenize_records(random.Random(0).sample(recs, len(recs)), tok, 64)
    lens = [len(s["input_ids"]) for s in samples]
    pad = tok.pad_token_id
    padded, packed = collate(samples, False, divisor, pad), collate(samples, True, divisor, pad)

    S = padded["input_ids"].shape[1]
    assert padded["input_ids"].shape == (len(samples), S) and S % divisor == 0 and S - divisor < max(lens)
    T = packed["input_ids"].shape[1]
    assert packed["input_ids"].shape == (1, T) and T % divisor == 0 and T - divisor < sum(lens)
    for b in (padded, packed):
        assert all(v.dtype == torch.long and v.shape == b["input_ids"].shape for v in b.values())
    assert target_pairs(padded) == target_pairs(packed)
    assert count_targets(padded) == count_targets(packed) == sum(
        sum(lab != IGNORE_INDEX for lab in s["labels"]) for s in samples
    )
    # Padded rows: one document each (positions 0..S-1 through the padding), pad never a target.
    for r, (s, n) in enumerate(zip(samples, lens)):
        assert padded["position_ids"][r].tolist() == list(range(S))
        assert padded["input_ids"][r, :n].tolist() == s["input_ids"]
        assert (padded["input_ids"][r, n:] == pad).all() and (padded["labels"][r, n:] == IGNORE_INDEX).all()
    # Packed row: positions restart exactly at each sample start; padding continues the last one.
    starts = [sum(lens[:i]) for i in range(len(lens))]
    assert torch.nonzero(document_starts(packed["position_ids"])[0]).flatten().tolist() == starts
    want_pos = [p for n in lens for p in range(n)] + list(range(lens[-1], lens[-1] + T - sum(lens)))
    assert packed["position_ids"][0].tolist() == want_pos
    # No target crosses a document: the label at each document's last token is ignored.
    assert all(packed["labels"][0, s - 1] == IGNORE_INDEX for s in starts[1:])


def test_eval_split_holds_out_whole_records_by_seed(tok_dir, tmp_path):
    """data.samples.hold_out (--eval-split): a share (rounded, at least one) or a count of the records that have a
    sample, each whole (a text record split into windows keeps every window on one side), the file's order kept on
    both sides; the same records for the same seed and lines whatever the order they are asked in, others for
    another seed; the subsets share the tensors, and their fingerprints differ from the whole's and each other's. A
    split leaving nothing to train on is refused, naming the numbers."""
    from data.load import load_samples
    from data.samples import fingerprint, hold_out

    path = tmp_path / "d.jsonl"
    make_text_jsonl(path, 30, seed=3)
    samples, stats = load_samples(path, load_tokenizer(tok_dir), 24, 10_000)
    lines = samples.lines.tolist()
    assert stats.split > 3 and len(set(lines)) == 30 and len(lines) > 40, stats   # windows: several samples a record
    for spec, k in ((0.1, 3), (0.25, 8), (0.001, 1), (5, 5), (29, 29)):
        train, held, chosen = hold_out(samples, spec, seed=7)
        assert len(chosen) == k and chosen == sorted(chosen), (spec, chosen)
        assert sorted(set(held.sample_lines().tolist())) == chosen, "every window of a held record is held"
        assert not set(train.sample_lines().tolist()) & set(chosen), "no window of a held record is trained on"
        rows = lambda part: part.rows.tolist()
        assert sorted(rows(train) + rows(held)) == list(range(len(samples))), "each sample on exactly one side"
        assert rows(train) == sorted(rows(train)) and rows(held) == sorted(rows(held)), "the file's order"
        for part in (train, held):
            assert part.ids is samples.ids and len(part) == len(part.rows)
            assert [part[i]["input_ids"].tolist() for i in range(len(part))] == \
                [samples[j]["input_ids"].tolist() for j in part.rows.tolist()]
            assert part.lengths.tolist() == [len(samples[j]["input_ids"]) for j in part.rows.tolist()]
        fps = {fingerprint(x) for x in (samples, train, held)}
        assert len(fps) == 3 and fingerprint(hold_out(samples, spec, seed=7)[0]) == fingerprint(train)
    assert hold_out(samples, 0.2, seed=7)[2] == hold_out(samples, 0.2, seed=7)[2]
    assert hold_out(samples, 0.2, seed=7)[2] != hold_out(samples, 0.2, seed=8)[2], "the seed chooses"
    backwards = samples.subset(torch.arange(len(samples) - 1, -1, -1))   # (the same records in another order)
    assert hold_out(backwards, 0.2, seed=7)[2] == hold_out(samples, 0.2, seed=7)[2]
    for spec, k in ((30, 30), (0.99, 30), (1000, 1000)):
        with pytest.raises(DataError, match=rf"--eval-split {spec:g} holds out {k} of the 30 records of --data that "
                                            "have a target, leaving none to train on: pass a smaller --eval-split"):
            hold_out(samples, spec, seed=0)


def test_tokenizing_in_processes_equals_one_process(tok_dir, tmp_path, monkeypatch):
    """--data-workers: chunks after the first tokenized by a pool of processes (forced here: POOL_SECONDS 0) give the
    same samples (ids, labels, boundaries, lines) and stats as one process, under a chat template set on the
    tokenizer (it travels to the processes); a bad record's error is the same, naming its line."""
    from data import store
    from data.load import load_samples

    recs = make_text_jsonl(tmp_path / "t.jsonl", 20, seed=1) + make_chat_jsonl(tmp_path / "c.jsonl", 30, seed=2)
    recs += [{"prompt": "Q: two plus two?", "completion": f" {i}"} for i in range(10)]
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in random.Random(0).sample(recs, len(recs))))
    tok = load_tokenizer(tok_dir)
    tok.chat_template = tok.chat_template.replace("<|im_start|>", "<|im_start|> ")   # (not the file's: pickled)
    one, one_stats = load_samples(path, tok, 40, len(tok))
    monkeypatch.setattr(store, "POOL_SECONDS", 0.0)
    said = []
    many, many_stats = load_samples(path, tok, 40, len(tok), log=said.append, workers=2)
    assert [m for m in said if "2 processes for the remaining" in m], said
    assert many_stats == one_stats and one_stats.split > 0 and one_stats.records == 60
    for k in ("ids", "labels", "offsets", "lines"):
        assert torch.equal(getattr(many, k), getattr(one, k)), k
    assert "<|im_start|> " in tok.decode(one.ids.tolist()), "the template set on the tokenizer was not used"
    bad = {"messages": [{"role": "user", "content": "ends <|im_end|>"}, {"role": "assistant", "content": "x"}]}
    lines = path.read_text().splitlines()
    path.write_text("\n".join(lines[:50] + [json.dumps(bad)] + lines[50:]) + "\n")
    errors = []
    for workers in (1, 2):
        with pytest.raises(DataError) as e:
            load_samples(path, tok, 40, len(tok), workers=workers)
        errors.append(str(e.value))
    assert errors[0] == errors[1] and "line 51: message 0 (user) holds the special token '<|im_end|>'" in errors[0]


@pytest.mark.timeout(120)
def test_a_tokenizing_process_that_dies_fails_the_load_instead_of_hanging(monkeypatch):
    """A pool process killed mid-chunk (here: its tokenizer ends it, as the OOM killer would) is one clear error
    naming --data-workers 1, not a wait for ever (a multiprocessing.Pool loses the task and waits)."""
    from data import store
    from data.token_stats import TokenStats
    from tests.helpers import DiesInAChildProcess

    monkeypatch.setattr(store, "POOL_SECONDS", 0.0)
    monkeypatch.setattr(store, "CHUNK_CHARS", 50)
    records = [{"text": "x" * 40, "line": n} for n in range(8)]
    first = lambda rs: ([], TokenStats(records=len(rs)))   # (the first chunk, in this process)
    with pytest.raises(DataError, match=r"tokenizing --data d.jsonl: a tokenizing process died .*out of memory\?\): "
                                        r"pass --data-workers 1"):
        store.build(records, first, None, "--data d.jsonl", workers=2, job=(DiesInAChildProcess(), 64, "d", None,
                                                                              "split"))


def test_load_samples_in_chunks_and_from_the_cache_equal_tokenize_records(tok_dir, tmp_path, monkeypatch):
    """data.store: `load_samples` tokenizes chunk by chunk into flat int32 tensors, and a rerun reads them back from
    the cache; both hold exactly `tokenize_records`' samples and stats, and collate to the same batch. A change in
    the data's bytes, --max-len, the chat template or a tokenizer file is a miss (a new key), never a stale hit; a
    damaged cache file is said and replaced; a cache that cannot be written costs nothing but the cache. A template
    that writes today's date is keyed by the day."""
    from data import store
    from data.load import load_samples

    path = tmp_path / "d.jsonl"
    recs = make_text_jsonl(tmp_path / "t.jsonl", 9, seed=1) + make_chat_jsonl(tmp_path / "c.jsonl", 9, seed=2)
    recs += [{"prompt": "Q: two plus two?", "completion": f" {i}"} for i in range(9)]
    recs += [{"messages": [{"role": "system", "content": "fox " * 60}, {"role": "user", "content": "word " * 80},
                           {"role": "assistant", "content": "ok"}]}] * 6   # no room for the answer: dropped
    path.write_text("".join(json.dumps(r) + "\n" for r in random.Random(0).sample(recs, len(recs))))
    tok, cache, said = load_tokenizer(tok_dir), tmp_path / "cache", []
    say = lambda m: m.startswith("warning: --data") or said.append(m)   # (the dropped records: said each load)
    ref, ref_stats = tokenize_records(load_jsonl(path), tok, 40, path)
    assert ref_stats.truncated > 0 and ref_stats.dropped >= 6 and ref_stats.cut > 0, "truncation and dropping"
    assert len(ref_stats.dropped_lines) == 5, ref_stats   # (the first 5; in chunks below: the same, merged)
    monkeypatch.setattr(store, "CHUNK_CHARS", 200)   # several chunks
    for attempt in ("tokenized", "cached"):
        samples, stats = load_samples(path, tok, 40, len(tok), cache=str(cache), log=say)
        assert stats == ref_stats, attempt
        assert len(samples) == len(ref) and samples.ids.dtype == torch.int32, attempt
        for i, r in enumerate(ref):
            assert samples[i]["input_ids"].tolist() == r["input_ids"], f"{attempt}: sample {i} ids"
            assert samples[i]["labels"].tolist() == r["labels"], f"{attempt}: sample {i} labels"
        for pack in (True, False):
            got, want = collate(samples[2:6], pack, 4, 0), collate(ref[2:6], pack, 4, 0)
            assert all(torch.equal(got[k], want[k]) for k in want), f"{attempt}: collate pack={pack}"
        assert samples.lengths.tolist() == [len(r["input_ids"]) for r in ref] and samples.max_id() == max(
            max(r["input_ids"]) for r in ref), attempt
        assert samples.lines.tolist() == [r["line"] for r in ref], f"{attempt}: the records' lines (--eval-split's)"
        monkeypatch.setattr("data.load.tokenize_records", lambda *a: pytest.fail("the cache was not read"))
    assert len(said) == 1 and "tokens from the cache" in said[0], said
    monkeypatch.undo()
    files = lambda: sorted(p.name for p in cache.iterdir())
    first = files()
    assert len(first) == 1, first
    changes = [lambda: load_samples(path, tok, 41, len(tok), cache=str(cache))]   # --max-len
    tok2 = load_tokenizer(tok_dir)
    tok2.chat_template = tok.chat_template.replace("<|im_start|>", "<|im_start|> ")
    changes.append(lambda: load_samples(path, tok2, 40, len(tok), cache=str(cache)))   # the template
    with open(path, "a") as f:
        f.write(json.dumps({"text": "one more"}) + "\n")
    changes.append(lambda: load_samples(path, tok, 40, len(tok), cache=str(cache)))   # the data's bytes
    changes.append(lambda: load_samples(path, tok, 40, len(tok), cache=str(cache), long_text="truncate"))
    for n, change in enumerate(changes, start=2):
        change()
        assert len(files()) == n, f"change {n - 1} made no new key"
    dated = load_tokenizer(tok_dir)   # a template that writes today's date (Llama 3.2/3.3) is keyed by the day
    dated.chat_template = '{{ strftime_now("%d %b %Y") }}' + tok.chat_template
    keys = {day: (store.cache_key("0" * 64, dated, 40, day), store.cache_key("0" * 64, tok, 40, day))
            for day in ("2026-12-01", "2026-12-02")}
    with monkeypatch.context() as m:   # no day given: today's, one reading (two of the real clock straddle midnight)
        m.setattr(store, "today", lambda: "2026-12-03")
        assert store.cache_key("0" * 64, dated, 40) == store.cache_key("0" * 64, dated, 40, "2026-12-03")
    assert keys["2026-12-01"][0] != keys["2026-12-02"][0], "a dated template's key ignores the date"
    assert keys["2026-12-01"][1] == keys["2026-12-02"][1], "an undated template's key changes with the date"
    import jinja2

    for what, module, name, other in (("the jinja2 version", jinja2, "__version__", "0.0"),
                                      ("the labels' IGNORE_INDEX", sys.modules["loss"], "IGNORE_INDEX", -1)):
        with monkeypatch.context() as m:
            m.setattr(module, name, other)
            assert store.cache_key("0" * 64, tok, 40) != keys["2026-12-01"][1], f"{what} is not in the key"
    tok_copy = tmp_path / "tok_copy"
    shutil.copytree(tok_dir, tok_copy)
    cfg = tok_copy / "tokenizer_config.json"
    cfg.write_text(cfg.read_text() + "\n")
    load_samples(path, load_tokenizer(tok_copy), 40, len(tok), cache=str(cache))
    assert len(files()) == 6, "a changed tokenizer file made no new key"
    damaged = cache / first[0]
    damaged.write_bytes(damaged.read_bytes()[:100])
    path.write_text("".join(json.dumps(r) + "\n" for r in random.Random(0).sample(recs, len(recs))))
    said.clear()
    samples, _ = load_samples(path, tok, 40, len(tok), cache=str(cache), log=say)
    assert [s.tolist() for s in samples.ids.split(samples.lengths.tolist())] == [r["input_ids"] for r in ref]
    assert len(said) == 1 and "unreadable" in said[0] and "tokenizing again" in said[0], said
    assert store.read(damaged, damaged.stem) is not None, "the damaged file was replaced"
    said.clear()
    blocked = tmp_path / "a_file"
    blocked.write_text("")
    samples, _ = load_samples(path, tok, 40, len(tok), cache=str(blocked / "cache"), log=say)
    assert len(samples) == len(ref) and len(said) == 1 and "not written" in said[0], said
    assert blocked.read_text() == "" and not list(tmp_path.glob("**/.*.tmp")), "no file left behind"


def test_a_cache_file_damaged_inside_its_tokens_or_out_of_reach_is_said_and_tokenized_again(tok, tmp_path, monkeypatch):
    """torch.load checks no checksum: a cache file whose token bytes were changed in place (same size; a bad disk, a
    patched copy) read back as other ids, most still in the vocabulary, and trained on (until 2026-12-03). Now the
    sha256 written with the tokens must match. A cache folder this user cannot enter (a colleague's, mode 0700) raised
    PermissionError out of train.py; now it costs a re-tokenization. A killed writer's temporary file goes a day on."""
    import os
    import struct
    import time
    import zipfile

    from data import store
    from data.load import load_samples

    path, cache, said = tmp_path / "t.jsonl", tmp_path / "cache", []
    make_text_jsonl(path, 12, seed=4)
    want = tokenize_records(load_jsonl(path), tok, 64, path)[0]
    load_samples(path, tok, 64, len(tok), cache=str(cache))
    (f,) = cache.glob("*.pt")
    with zipfile.ZipFile(f) as z:   # where the ids tensor's bytes start in the (uncompressed) zip
        info = next(i for i in z.infolist() if i.filename.endswith("/data/0"))
    raw = bytearray(f.read_bytes())
    at = info.header_offset + 30 + sum(struct.unpack("<HH", raw[info.header_offset + 26:info.header_offset + 30]))
    assert int.from_bytes(raw[at:at + 4], "little") == want[0]["input_ids"][0], "why: these are the first id's bytes"
    raw[at:at + 4] = (7).to_bytes(4, "little")
    f.write_bytes(raw)
    stale = cache / f".{'a' * 64}.pt.{'0' * 16}.tmp"   # a writer killed two days ago
    users = cache / ".thesis-draft.tmp"   # a file of the user's in a --data-cache folder of theirs, as old
    for old in (stale, users):
        old.write_bytes(b"x")
        os.utime(old, (time.time() - 2 * 86400,) * 2)
    fresh = cache / f".{'b' * 64}.pt.{'1' * 16}.tmp"   # one another machine may still be writing
    fresh.write_bytes(b"x")
    samples, _ = load_samples(path, tok, 64, len(tok), cache=str(cache), log=said.append)
    assert samples[0]["input_ids"].tolist() == want[0]["input_ids"], "the damaged ids were trained on"
    assert any("unreadable" in m and "do not match the sha256" in m for m in said), said
    assert store.read(f, f.stem) is not None, "the damaged file was replaced"
    assert not stale.exists() and fresh.exists()
    assert users.exists(), "a user's file named like no cache write was deleted"

    real = type(f).is_file

    def no_entry(self, *a, **k):   # (root enters any folder: the PermissionError a 0700 cache folder raises)
        if self.parent == cache:
            raise PermissionError(13, "Permission denied", str(self))
        return real(self, *a, **k)

    said.clear()
    monkeypatch.setattr(type(f), "is_file", no_entry)
    samples, _ = load_samples(path, tok, 64, len(tok), cache=str(cache), log=said.append)
    assert [s["input_ids"].tolist() for s in samples] == [w["input_ids"] for w in want]
    assert any("unreadable (PermissionError" in m for m in said), said


def test_data_rewritten_while_it_is_tokenized_is_refused(tok, tmp_path, monkeypatch):
    """A --data file that changes between the start-up hash (the one the run records, and a resume compares) and the
    end of tokenization stops the run naming the fix, with or without a cache, and writes no cache entry."""
    from data import store
    from data.load import load_samples

    path = tmp_path / "d.jsonl"
    make_text_jsonl(path, 6, seed=1)
    sha, real = store.file_sha256(path), store.build

    def build_while_appending(records, *a):
        with open(path, "a") as f:   # whatever writes the file is not done yet
            f.write(json.dumps({"text": "written late"}) + "\n")
        return real(records, *a)

    monkeypatch.setattr(store, "build", build_while_appending)
    for cache in (None, tmp_path / "cache"):
        with pytest.raises(DataError, match=rf"--data {path} changed while it was read .*start the run again"):
            load_samples(path, tok, 64, len(tok), cache=cache and str(cache), sha256=sha)
    assert not (tmp_path / "cache").exists() or not list((tmp_path / "cache").iterdir()), "a cache entry was written"


DATED = '{{ strftime_now("%A %d %B %Y") }}\n'   # a "Today Date" line, as Llama 3.2's and 3.3's templates write


def test_a_dated_template_renders_the_given_day_and_the_clock_comes_back(tok, tmp_path, monkeypatch):
    """data.templates.on_day through tokenize_records: a template that writes today's date (strftime_now) writes the
    given day instead, the same tokens as the template with that date spelled out in it (rendered by transformers,
    no clock involved); another day other tokens; outside the call the template reads the clock again. An undated
    template is untouched by a day. A transformers whose strftime_now does not take the fixed day is refused (no data
    that silently depend on the day); --template-date takes YYYY-MM-DD only."""
    import argparse
    import datetime

    from data.demo_compare import encode
    from data.templates import dated, on_day, parse_day

    records = make_chat_jsonl(tmp_path / "c.jsonl", 6, seed=4)
    chatml = tok.chat_template
    literal = lambda day: DATED.replace('{{ strftime_now("%A %d %B %Y") }}',
                                        datetime.date.fromisoformat(day).strftime("%A %d %B %Y"))
    tok.chat_template = DATED + chatml
    assert dated(tok.chat_template) and not dated(chatml) and dated({"default": tok.chat_template})
    got = {}
    for day in ("2024-07-26", "2025-03-09"):   # (neither is today: the clock's return is told apart)
        got[day] = tokenize_records(records, tok, 200, day=day)[0]
        ref_tok = load_tokenizer(tok.name_or_path)
        ref_tok.chat_template = literal(day) + chatml
        assert got[day] == tokenize_records(records, ref_tok, 200)[0], f"{day}: not the date spelled out"
    assert got["2024-07-26"] != got["2025-03-09"], "the day changed no token"
    prompt = records[0]["messages"][:1]   # the before/after script prompts on the run's day too
    ref_tok = load_tokenizer(tok.name_or_path)
    ref_tok.chat_template = literal("2025-03-09") + chatml
    assert torch.equal(encode(tok, prompt, "2025-03-09")["input_ids"], encode(ref_tok, prompt)["input_ids"]) and \
        not torch.equal(encode(tok, prompt, "2025-03-09")["input_ids"], encode(tok, prompt)["input_ids"]), \
        "demo_compare's prompt is not the run's day spelled out"
    before = datetime.date.today().strftime("%A %d %B %Y")
    text = tok.apply_chat_template(records[0]["messages"], tokenize=False)
    assert text.startswith((before, datetime.date.today().strftime("%A %d %B %Y"))), "the clock is not back"
    plain = load_tokenizer(tok.name_or_path)
    assert tokenize_records(records, plain, 200, day="2024-07-26") == tokenize_records(records, plain, 200)
    real = tok.apply_chat_template   # a transformers whose strftime_now reads another clock than the one swapped
    monkeypatch.setattr(tok, "apply_chat_template", lambda *a, **k: "1999-01-01" if "chat_template" in k else
                        real(*a, **k))
    with pytest.raises(RuntimeError, match="strftime_now renders '1999-01-01' under the fixed day 2024-07-26"):
        with on_day(tok, "2024-07-26"):
            pass
    from transformers.utils import chat_template_utils
    assert chat_template_utils.datetime is datetime.datetime, "the clock is not back after a refusal"
    assert parse_day("2026-12-02") == "2026-12-02"
    for bad in ("12/02/2026", "2026-13-01", "yesterday", "20261202", "2026-W49-3"):
        with pytest.raises(argparse.ArgumentTypeError, match=f"{bad!r} is not a date as YYYY-MM-DD"):
            parse_day(bad)


def test_run_data_says_what_the_eval_data_lost(tok, tmp_path):
    """train.py's data (run_data.load_run_data) logs --eval-data's stats as it logs --data's: eval records cut to
    --max-len, or dropped with no target left, are said, since eval_loss covers only what is left."""
    from types import SimpleNamespace

    from data import run_data

    make_text_jsonl(tmp_path / "train.jsonl", 4, seed=1)
    long_prompt = {"messages": [{"role": "system", "content": "fox " * 100}, {"role": "user", "content": "word " * 200},
                                {"role": "assistant", "content": "ok"}]}   # (two long messages: the answer is cut)
    short = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "fine"}]}
    (tmp_path / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in (long_prompt, short, long_prompt)))
    ref = tokenize_records(load_jsonl(tmp_path / "eval.jsonl"), tok, 64)[1]
    assert (ref.samples, ref.truncated, ref.dropped, ref.dropped_lines) == (1, 0, 2, [1, 3]), ref
    assert "truncated 0, " in str(ref), ("the dropped are not also truncated at no cost", str(ref))
    said = []
    args = SimpleNamespace(data=str(tmp_path / "train.jsonl"), eval_data=str(tmp_path / "eval.jsonl"), max_len=64,
                           data_cache="none", data_sha256=None, long_text="split")
    (_, stats), ev, _ = run_data.load_run_data(args, tok, len(tok), said.append)
    assert len(ev[0]) == 1 and ev[1] == ref and f"eval data: {ref}" in said, said
    assert f"warning: --eval-data {tmp_path / 'eval.jsonl'}: 2 of 3 records (66.7%) have no target token within " \
           "--max-len 64 and are left out of eval_loss (lines 1, 3); a longer --max-len keeps them" in said, said
    assert not [m for m in said if "also --data samples" in m], said
    (tmp_path / "both.jsonl").write_text((tmp_path / "train.jsonl").read_text() + json.dumps(short) + "\n")
    args.eval_data, said = str(tmp_path / "both.jsonl"), []   # the 4 training records and one more: 2 of them
    run_data.load_run_data(args, tok, len(tok), said.append)    # longer than --max-len, split into 2 windows each
    assert "note: 6 of the 7 --eval-data samples are also --data samples (the same tokens): eval_loss measures how " \
           "well the run learned them, not how it does on unseen data" in said, said
    # --eval-split over a file holding each record twice (found by review): every held-out sample is trained on too
    args.data, args.eval_data, args.eval_split, args.seed, said = args.eval_data, None, 2, 0, []
    (tmp_path / "twice.jsonl").write_text((tmp_path / "both.jsonl").read_text() * 2)
    args.data = str(tmp_path / "twice.jsonl")
    (train, _), (held, held_stats), _ = run_data.load_run_data(args, tok, len(tok), said.append)
    assert held_stats is None and len(held) + len(train) == 14 and len(held) in (2, 3, 4), (len(held), said)
    assert f"note: {len(held)} of the {len(held)} held-out samples are also training samples (the same tokens: the " \
           "same text on two lines of --data): eval_loss measures how well the run learned them" in "".join(said), said
    assert [m for m in said if m.startswith("eval split: 2 records of --data held out (--eval-split 2, --seed 0; ")]


def _timed(load_samples, times: list, rank: int, error: str | None):
    """load_samples that notes its start and end in `times`, or raises OSError(error)."""
    import time

    def load(*a, **kw):
        times.append(time.time())
        if error:
            raise OSError(error)
        got = load_samples(*a, **kw)
        time.sleep(0.5 if rank == 0 else 0)   # so that a rank 1 that did not wait would start before this ends
        times.append(time.time())
        return got
    return load


def _mapped_from(t: torch.Tensor) -> str | None:
    """The file whose memory-mapped pages hold `t`'s data (Linux /proc/self/maps), else None."""
    with open("/proc/self/maps") as f:
        for line in f:
            span, *rest = line.split()
            lo, hi = (int(x, 16) for x in span.split("-"))
            if lo <= t.data_ptr() < hi:
                return rest[4] if len(rest) > 4 and rest[4].startswith("/") else None
    return None


def _tokenize_once(rank, world, tok_dir, cases):
    """One rank of test_one_rank_per_machine_tokenizes: for each (case, data file, cache) in turn, train.py's
    data.run_data.load_run_data (LOCAL_RANK is the rank: rank 0 is the machine's first) -> the tokens, the log lines
    and the start and end of each load_samples call, or the error."""
    from types import SimpleNamespace

    from data import load, run_data, store

    real, out = load.load_samples, {}
    for case, path, cache in cases:
        tok, said, times, printed = load_tokenizer(tok_dir), [], [], io.StringIO()
        os.environ["LOCAL_RANK"] = "0" if case.startswith("two machines") else str(rank)   # each its machine's first
        if case.startswith("dated"):   # rank 1's clock says the next day
            tok.chat_template = DATED + tok.chat_template
            store.today = lambda: "2026-12-0" + str(1 + rank)

        load.load_samples = _timed(real, times, rank, f"{path}: rank 1 cannot read it" if
                                   case == "error on rank 1" and rank == 1 else None)
        eval_data = None
        if "|" in path:   # "rank 0's file|rank 1's": another copy behind one path on each machine
            mine = path.split("|")[rank]
            path, eval_data = (path.split("|")[0], mine) if "eval" in case else (mine, None)
        args = SimpleNamespace(data=path, eval_data=eval_data, max_len=96, data_cache=cache or "none",
                               data_sha256=None, long_text="split")
        try:
            with contextlib.redirect_stdout(printed):
                (samples, _), _, _ = run_data.load_run_data(args, tok, len(tok), said.append)
            out[case] = {"times": times, "said": said, "ids": [s["input_ids"].tolist() for s in samples],
                         "mapped": _mapped_from(samples.ids), "day": args.template_date, "printed": printed.getvalue()}
        except Exception as e:
            out[case] = {"error": (type(e).__name__, str(e)), "loaded": bool(times)}
    return out


@pytest.mark.timeout(240)
def test_one_rank_per_machine_tokenizes_and_the_others_read_its_cache(tok_dir, tmp_path):
    """data.run_data.load_run_data (once_per_machine) on 2 ranks of one machine: rank 0 tokenizes and writes the cache
    while rank 1 waits, then rank 1 reads that file back; both hold the tokens of one process, from that file's
    memory-mapped pages. A cache that cannot be written makes rank 1 tokenize itself; without a cache both
    tokenize. A dated template renders rank 0's day, under a key holding it, on both ranks (midnight passed on rank
    1), also when each rank tokenizes for itself: the tokens of that date spelled out in the template. Ranks on two
    machines each tokenize, and the other machine's first rank says its cache was not written (naming its host); the
    log speaks on rank 0 only. An error on either rank is raised on both. Two machines whose copies of --data (or
    --eval-data) differ behind one path both stop with one error naming the ranks and hosts."""
    from tests.dist import run_ranks

    path, chats = tmp_path / "d.jsonl", tmp_path / "chats.jsonl"
    make_text_jsonl(path, 12, seed=3)
    chats.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"hi {i}"}, {"role": "assistant",
                                         "content": "fine"}]}) + "\n" for i in range(6)))
    spelled = load_tokenizer(tok_dir)   # rank 0's day, written out: no clock
    spelled.chat_template = DATED.replace('{{ strftime_now("%A %d %B %Y") }}', "Tuesday 01 December 2026") + \
        spelled.chat_template
    ref = {str(p): [r["input_ids"] for r in tokenize_records(load_jsonl(p), t, 96, p)[0]]
           for p, t in ((path, load_tokenizer(tok_dir)), (chats, spelled))}
    assert len(ref[str(chats)]) == 6, "every chat keeps a target"
    blocked = tmp_path / "a_file"
    blocked.write_text("")
    empty = tmp_path / "empty.jsonl"
    empty.write_text(json.dumps({"prompt": "a question", "completion": ""}) + "\n")
    loads = [("shared", path, tmp_path / "cache"), ("unwritable", path, blocked / "cache"), ("no cache", path, None),
             ("dated, midnight on rank 1", chats, tmp_path / "cache_dated"),
             ("dated, no cache, midnight on rank 1", chats, None)]
    fails = [("error on rank 0", empty, tmp_path / "cache2"), ("error on rank 1", path, tmp_path / "cache2")]
    both = [("two machines, unwritable", path, blocked / "cache")]
    other = tmp_path / "other.jsonl"   # as many records, other bytes
    make_text_jsonl(other, 12, seed=4)
    differ = [("two machines, other --data", f"{path}|{other}", tmp_path / "cache3"),
              ("two machines, other --eval-data", f"{path}|{other}", None)]
    r0, r1 = run_ranks(_tokenize_once, 2, str(tok_dir), [(c, str(p), d and str(d))
                                                         for c, p, d in loads + both + fails + differ], timeout=200)
    for case, data, cache in loads:
        a, b = r0[case], r1[case]
        written = case in ("shared", "dated, midnight on rank 1")   # rank 0 wrote the file, rank 1 read it
        assert a.get("ids") == ref[str(data)] and b.get("ids") == ref[str(data)], (case, a, b)
        if case.startswith("dated"):
            assert a["day"] == b["day"] == "2026-12-01", (case, a["day"], b["day"])
            assert any("rendered as 2026-12-01" in s for s in a["said"]), (case, a["said"])
        assert not any("from the cache" in s for s in a["said"]), (case, a["said"])
        assert any("from the cache" in s for s in b["said"]) == written, (case, b["said"])
        assert any("not written" in s for s in a["said"]) == (case == "unwritable"), (case, a["said"])
        if cache is not None:   # rank 1 starts once rank 0 is done
            assert b["times"][0] >= a["times"][-1], (case, a["times"], b["times"])
        in_cache = [r["mapped"] is not None and Path(r["mapped"]).parent == cache for r in (a, b)]
        assert in_cache == [written, written], (case, a["mapped"], b["mapped"])   # the file's pages, not a copy
    a, b = r0["two machines, unwritable"], r1["two machines, unwritable"]   # rank 1: another machine's first rank
    assert a.get("ids") == ref[str(path)] and b.get("ids") == ref[str(path)], (a, b)
    assert b["times"][0] < a["times"][-1], "rank 1 waited for rank 0: they are not on one machine"
    assert any("not written" in s for s in a["said"]) and not a["printed"], a
    assert b["printed"].startswith(f"[{socket.gethostname()} rank 1] data cache ") and "not written" in b["printed"], b
    for case, _, _ in fails:
        got = [r0[case], r1[case]]
        want = ("DataError", f"{empty}, line 1") if case.endswith("0") else ("OSError", f"{path}: rank 1 cannot")
        for rank, r in enumerate(got):
            assert "error" in r and r["error"][0] == want[0] and r["error"][1].startswith(want[1]), (case, rank, r)
        assert got[0]["error"] == got[1]["error"], case
        assert got[1]["loaded"] == case.endswith("1"), "rank 1 loaded after rank 0 failed"
    host = socket.gethostname()
    for case, _, _ in differ:   # each machine tokenized its own copy without a word: now both stop, naming them
        what = "--eval-data" if "eval" in case else "--data"
        for rank, r in enumerate((r0[case], r1[case])):
            assert r.get("error", ("",))[0] == "DataError", (case, rank, r)
            assert r["error"][1].startswith(f"the ranks hold different {what} tokens (rank 0 ({host}"), (case, r)
            assert f"; rank 1 ({host}" in r["error"][1] and "shared filesystem" in r["error"][1], (case, r)
        assert r0[case]["error"] == r1[case]["error"], case


def _files(tmp_path) -> list[str]:
    """Three --data files of other kinds (text records past --max-len 64 split into windows, chats, prompt/completion
    records, one left with no target), and one file holding their lines in that order: the set they must make."""
    make_text_jsonl(tmp_path / "a.jsonl", 10, seed=3)
    chats = make_chat_jsonl(tmp_path / "b.jsonl", 12, seed=4)
    cut = {"messages": [{"role": "system", "content": "fox " * 100}, {"role": "user", "content": "word " * 200},
                        {"role": "assistant", "content": "ok"}]}   # (its answer is cut away: dropped)
    (tmp_path / "b.jsonl").write_text("".join(json.dumps(r) + "\n" for r in chats[:5] + [cut] + chats[5:]))
    pc = [{"prompt": f"Q{i}: " + "word " * (3 + 5 * i), "completion": f" A{i}"} for i in range(6)]
    (tmp_path / "c.jsonl").write_text("".join(json.dumps(r) + "\n" for r in pc))
    files = [str(tmp_path / f"{x}.jsonl") for x in "abc"]
    (tmp_path / "abc.jsonl").write_text("".join(Path(f).read_text() for f in files))
    return files


def _run_data(tok, data, tmp_path, **kw):
    from types import SimpleNamespace

    from data import run_data

    said = []
    args = SimpleNamespace(data=data, eval_data=kw.pop("eval_data", None), max_len=64, long_text="split",
                           data_cache=kw.pop("cache", "none"), data_sha256=None, seed=kw.pop("seed", 0), **kw)
    (train, stats), ev, args.rows = run_data.load_run_data(args, tok, len(tok), said.append)
    return train, stats, ev, said, args


def test_several_data_files_train_as_one_file_of_their_lines(tok, tmp_path):
    """--data a b c: each file tokenized on its own (and cached on its own: a rerun reads all three from the cache,
    and a set of other files reuses those it shares), joined in the order given without copying the cache's
    memory-mapped tokens: the same samples (ids, labels,
    boundaries, so the same fingerprint and data_tokens) and summed stats as one file holding their lines, each
    file's stats and their sum logged."""
    from data.samples import fingerprint

    files = _files(tmp_path)
    one, one_stats, _, _, one_args = _run_data(tok, str(tmp_path / "abc.jsonl"), tmp_path)
    cache = str(tmp_path / "cache")
    got, stats, _, said, args = _run_data(tok, files, tmp_path, cache=cache)
    assert one_stats.split and one_stats.dropped and one_stats.truncated, one_stats   # (every kind of count)
    assert str(stats) == str(one_stats) and len(got) == len(one), (str(stats), str(one_stats))
    for i in range(len(one)):
        assert got[i]["input_ids"].tolist() == one[i]["input_ids"].tolist(), i
        assert got[i]["labels"].tolist() == one[i]["labels"].tolist(), i
    assert fingerprint(got) == fingerprint(one) and args.data_tokens == one_args.data_tokens
    for f in files:
        assert any(m.startswith(f"data: {f}: ") for m in said), said
    assert f"data: 3 files: {one_stats}" in said, said
    pieces = got.pieces()[0]   # each file's tokens as its cache file's memory-mapped pages, not a copy of all
    assert len(pieces) == 3 and all((_mapped_from(p) or "").startswith(cache) for p in pieces), \
        [_mapped_from(p) for p in pieces]
    _, again, _, said, _ = _run_data(tok, files, tmp_path, cache=cache)
    assert str(again) == str(stats) and sum("tokens from the cache" in m for m in said) == 3, said
    _, _, _, said, _ = _run_data(tok, [files[2], files[0]], tmp_path, cache=cache)
    assert sum("tokens from the cache" in m for m in said) == 2, said


def test_a_data_set_in_many_shards_is_said_in_one_line(tok, tmp_path):
    """More --data files than run_data.MANY_FILES (a data set in shards): no line per file (the stats' sum, and on a
    rerun the count read from the cache, in one line each), but each file's warning; the samples are those of one
    file of their lines."""
    from data import run_data
    from data.samples import fingerprint

    lines = Path(_files(tmp_path)[1]).read_text().splitlines(True) * 2   # (13 chats, one left with no target)
    shards = []
    for k in range(run_data.MANY_FILES + 2):
        shards.append(str(tmp_path / f"shard-{k:05d}.jsonl"))
        Path(shards[-1]).write_text("".join(lines[k::run_data.MANY_FILES + 2]))
    (tmp_path / "all.jsonl").write_text("".join(Path(f).read_text() for f in shards))
    cache = str(tmp_path / "cache")
    one, one_stats, _, _, _ = _run_data(tok, str(tmp_path / "all.jsonl"), tmp_path)
    for run in range(2):   # (the shards are the eval files too: their cache lines are one count as well)
        got, stats, _, said, _ = _run_data(tok, shards, tmp_path, cache=cache, eval_data=shards)
        assert fingerprint(got) == fingerprint(one) and str(stats) == str(one_stats)
        assert f"data: {len(shards)} files: {one_stats}" in said and not [m for m in said if ".jsonl: " in m and
                                                                          not m.startswith("warning: ")], said
        assert [m for m in said if m.startswith("warning: --data ") and "shard-00005.jsonl" in m], said
        hit = f"data: {len(shards)} of the {len(shards)} --data files' tokens from the cache {cache}"
        assert (hit in said) == (run == 1) and not [m for m in said if m.startswith(("--data ", "--eval-data "))], said
        assert hit.replace("--data", "--eval-data") in said, said   # (also on run 0: the same files, just cached)
    from data import check_file
    with pytest.raises(DataError, match="--data /dev/null is not a regular file"):
        check_file("/dev/null", "--data")


def test_data_weights_copy_files_and_take_a_seeded_share_of_their_records(tok, tmp_path):
    """--data-weights W: floor(W) copies of a file's samples, in order, then the share W - floor(W) of its records
    (rounded; at least one below 1), whole (a text record's windows together), read from the file's records ordered by
    the sha256 of f"{seed}:mix:{identity}" (identity: file index << 32 | line): epoch e takes the k records from
    position e·k on, wrapping round, so another seed takes others, the same seed the same, and a share of 0.5 trains
    each record once in two epochs; `data_mix` "fixed" (a run from before 2026-12-04) takes epoch 0's every epoch.
    Records --eval-split holds out are never trained on, whatever their file's weight; a file it holds out whole,
    whose weight then trains nothing, is a warning naming the file, its weight and the fix."""
    import hashlib
    import math
    from fractions import Fraction

    from data import GlobalBatches
    from data.mix import FILE_SHIFT

    files = _files(tmp_path)
    base, _, _, _, _ = _run_data(tok, files, tmp_path)
    ident = base.sample_lines()
    per_file = lambda k: [i for i in range(len(base)) if int(ident[i]) >> FILE_SHIFT == k]
    records = lambda k: sorted({int(ident[i]) for i in per_file(k)})

    share = lambda w, k: max(0 if w >= 1 else 1, math.floor(Fraction(str(w)) % 1 * len(records(k)) + Fraction(1, 2)))

    def expect(weights, seed, epoch):   # (exact: 1.15 % 1 in floats is 0.1499...)
        rows = []
        for k, w in enumerate(weights):
            rows += per_file(k) * int(w)
            if Fraction(str(w)) % 1:
                n = share(w, k)
                key = lambda r: hashlib.sha256(f"{seed}:mix:{r}".encode()).digest()
                order = sorted(records(k), key=key)
                chosen = [order[(epoch * n + j) % len(order)] for j in range(n)]
                rows += [i for i in per_file(k) if int(ident[i]) in chosen]
        return rows

    ids = lambda s, rows: [s[i]["input_ids"].tolist() for i in rows]
    assert len(records(0)) == 10   # (1.15: 1.5 of them, rounded up to 2)
    for weights, seed in (((2, 0.5, 1), 0), ((0.5, 1, 2.5), 1), ((0.5, 1, 2.5), 2), ((1e-6, 1, 1), 0),
                          ((1.15, 1, 1), 0), ((2, 1, 3), 0)):
        got, _, _, said, args = _run_data(tok, files, tmp_path, data_weights=list(weights), seed=seed)
        rows = expect(weights, seed, 0)
        line = next(m for m in said if m.startswith(f"data mix: --data-weights {' '.join(f'{w:g}' for w in weights)}: "
                                                    "a.jsonl × "))
        if all(w == int(w) for w in weights):   # whole weights: the same samples every epoch, as one Samples
            assert args.rows is None and ids(got, range(len(got))) == ids(base, rows) and \
                line.endswith(f"; {len(rows)} samples a pass"), line
            continue
        passes = max(math.ceil(len(records(k)) / share(w, k)) for k, w in enumerate(weights) if w % 1)
        assert line.endswith(f"; {len(rows)} samples a pass (the first; every record of the shares is trained at "
                             f"least once in {passes} passes)"), line
        order = GlobalBatches(len(got), 4, seed, args.rows)
        for epoch in range(5):
            rows = expect(weights, seed, epoch)
            assert ids(got, args.rows(epoch)) == ids(base, rows), (weights, seed, epoch)
            assert order.size(epoch) == len(rows) and sorted(order.permutation(epoch)) == \
                sorted(args.rows(epoch).tolist())
            taken = [x for i in args.rows(epoch) if (x := int(got.sample_lines()[i])) >> FILE_SHIFT == 0]
            windows = {r: sum(int(ident[i]) == r for i in per_file(0)) for r in records(0)}
            assert all(taken.count(r) % windows[r] == 0 for r in set(taken)), "a text record's windows go together"
        stream = [i for step in range(12) for i in order.step_samples(step)]   # the epochs one after another
        assert stream == [i for e in range(5) for i in order.permutation(e)][:48]
        assert order.samples_in(2.5) == order.size(0) + order.size(1) + math.ceil(order.size(2) / 2)
        assert order.epoch(3) == 12 / order.size(0) if order.size(0) > 12 else order.epoch(3) >= 1
        fixed, _, _, _, again = _run_data(tok, files, tmp_path, data_weights=list(weights), seed=seed,
                                          data_mix="fixed")   # (a run from before rotation: epoch 0's every epoch)
        assert again.rows is None and ids(fixed, range(len(fixed))) == ids(base, expect(weights, seed, 0))
    _, _, _, _, half = _run_data(tok, files, tmp_path, data_weights=[0.5, 1, 1], seed=0)
    seen = [int(x) for e in (0, 1) for x in half.rows.lines[half.rows(e)] if int(x) >> FILE_SHIFT == 0]
    assert sorted(set(seen)) == records(0) and len(set(seen)) == 10, "each of a's 10 records once in 2 epochs"
    assert len(seen) == len(per_file(0)), "(its windows once each)"
    other = [_run_data(tok, files, tmp_path, data_weights=[0.5, 1, 1], seed=s)[4].rows(0).tolist() for s in (1, 0)]
    assert other[1] == half.rows(0).tolist() != other[0]
    got, _, (held, _), said, _ = _run_data(tok, files, tmp_path, data_weights=[3, 3, 3], eval_split=0.3)
    out = set(held.sample_lines().tolist())
    assert out and not out & set(got.sample_lines().tolist()) and len(got) == 3 * (len(base) - len(held)), said
    assert {x >> FILE_SHIFT for x in out} == {0, 1, 2}, "held out of every file (likely at 0.3 of 25 records)"
    line = next(m for m in said if m.startswith("eval split: "))
    assert "a.jsonl:" in line and "b.jsonl:" in line, line   # (each held-out record named by file and line)
    got, _, (held, _), _, args = _run_data(tok, files, tmp_path, data_weights=[0.5, 0.5, 0.5], eval_split=0.3)
    out = set(held.sample_lines().tolist())
    assert not out & {int(x) for e in range(4) for x in got.sample_lines()[args.rows(e)]}, "never a held-out one"
    # a fourth file of one record, which --eval-split 1 holds out at the seed whose smallest hash is its record's
    from data.samples import smallest_hashes
    (tmp_path / "d.jsonl").write_text(json.dumps({"prompt": "Q: one?", "completion": " yes"}) + "\n")
    four = files + [str(tmp_path / "d.jsonl")]
    every = sorted(set(_run_data(tok, four, tmp_path)[0].sample_lines().tolist()))
    takes_d = lambda s: smallest_hashes(every, 1, f"{s}:") == [(3 << FILE_SHIFT) | 1]
    seed, other = next(s for s in range(1000) if takes_d(s)), next(s for s in range(1000) if not takes_d(s))
    fix = "trains nothing: pass a smaller --eval-split, or give the eval set as --eval-data FILE"
    for weights, named in (([1, 1, 1, 5], "--data-weights 5"), (None, "1, no --data-weights")):
        got, _, (held, _), said, _ = _run_data(tok, four, tmp_path, data_weights=weights, eval_split=1, seed=seed)
        assert {x >> FILE_SHIFT for x in got.sample_lines().tolist()} == {0, 1, 2} and len(held) == 1, said
        warned = [m for m in said if m.startswith("warning: --eval-split")]
        assert warned == [f"warning: --eval-split 1 held out every record of --data {four[3]}, so its weight "
                          f"({named}) {fix}"], said
    said = _run_data(tok, four, tmp_path, data_weights=[1, 1, 1, 5], eval_split=1, seed=other)[3]
    assert not [m for m in said if m.startswith("warning: --eval-split")], said   # (d trains: nothing said)


def test_several_eval_files_are_one_eval_set_that_knows_its_files(tok, tmp_path):
    """--eval-data a b: one eval set (the samples of one file of their lines), each file's stats said before their
    sum, its samples knowing their files (evaluate's eval_loss/FILE); so do --eval-split's held-out samples of
    several --data files, and one file's know none."""
    files = _files(tmp_path)
    (tmp_path / "ab.jsonl").write_text("".join(Path(f).read_text() for f in files[:2]))
    _, _, (ev, ev_stats), said, _ = _run_data(tok, files[2], tmp_path, eval_data=files[:2])
    _, _, (one, one_stats), _, _ = _run_data(tok, files[2], tmp_path, eval_data=str(tmp_path / "ab.jsonl"))
    assert [ev[i]["labels"].tolist() for i in range(len(ev))] == [one[i]["labels"].tolist() for i in range(len(one))]
    assert str(ev_stats) == str(one_stats) and f"eval data: 2 files: {one_stats}" in said, said
    assert [m for m in said if m.startswith(f"eval data: {files[0]}: ")], said
    assert ev.files == ["a.jsonl", "b.jsonl"] and one.files is None
    _, _, (held, _), _, _ = _run_data(tok, files, tmp_path, eval_split=0.3)
    assert held.files == ["a.jsonl", "b.jsonl", "c.jsonl"]


def test_data_weights_refuse_what_they_cannot_mean():
    from data.mix import check_weights

    check_weights(None, ["a"])
    check_weights([2, 0.5], ["a", "b"])
    for weights, files, says in (
            ([1], ["a", "b"], "--data-weights gives 1 weight for 2 --data files: give one per file, in --data's order"),
            ([1, 1, 1], ["a"], "gives 3 weights for 1 --data file"),
            ([1], [], "--data-weights weighs --data files: pass --data FILE"),
            ([0], ["a"], "--data-weights 0 for a: a weight must be above 0 .* to leave a file out, drop it from "
                         "--data"),
            ([-1], ["a"], "--data-weights -1 for a"), ([float("nan")], ["a"], "--data-weights nan for a"),
            ([float("inf")], ["a"], "--data-weights inf for a"), ([1000.5], ["a"], "at most 1000")):
        with pytest.raises(ValueError, match=says):
            check_weights(weights, files)


def test_records_of_several_files_are_named_by_file_and_line():
    """Logs name a record of a set of several files `file:line` (its basename, or the path as given where two files
    share one), and one file's by its line alone."""
    from data.mix import FILE_SHIFT, record_name

    assert record_name(17, ["x/a.jsonl"]) == "17"
    assert record_name((1 << FILE_SHIFT) | 17, ["x/a.jsonl", "y/b.jsonl"]) == "b.jsonl:17"
    assert record_name(3, ["x/train.jsonl", "y/train.jsonl"]) == "x/train.jsonl:3"
    assert record_name(3, ["a/x/t.jsonl", "b/x/t.jsonl", "c.jsonl"]) == "a/x/t.jsonl:3"


def test_a_list_flag_given_twice_is_refused_and_a_default_is_replaced(capsys):
    """--data, --data-weights and --eval-data take several values after one flag: a second flag would replace the
    first (argparse's rule), so it is refused naming both; a default (the demo's eval file) is replaced as before."""
    import train

    parser = train.build_parser()
    parser.set_defaults(eval_data="runs/demo_assets/eval.jsonl")
    assert parser.parse_args(["--eval-data", "x.jsonl", "y.jsonl"]).eval_data == ["x.jsonl", "y.jsonl"]
    for flag, a, b in (("--data", "a.jsonl", "b.jsonl"), ("--eval-data", "a.jsonl", "b.jsonl"),
                       ("--data-weights", "2", "0.5")):
        with pytest.raises(SystemExit):
            parser.parse_args([flag, a, flag, b])
        err = capsys.readouterr().err
        assert f"argument {flag}: given twice ({a}; then {b}): pass every value after one {flag}" in err, err


def test_show_prints_each_sample_with_its_targets_marked(tok_dir, tmp_path, capsys):
    """`python -m data.show`: the first --n records of each file (or those --lines names), tokenized with the flags
    given as train.py tokenizes them, one block a sample: `FILE:LINE sample k/K: N tokens, T targets` and its text with
    the target spans between [[ and ]]. Unmarked, the text is the tokenizer's decoding of the sample; the marked spans
    are its runs of target tokens (`target_runs`), a prompt/completion record's one span its completion and EOS; a
    record left with no target is said; `--run OUT` takes a run's model, files and token flags from its config.json
    (relative paths from its cwd) and prints the same; bad input is one `error:` line and exit 2."""
    import re

    from data.show import main

    files = _files(tmp_path)
    tok = load_tokenizer(tok_dir)
    argv = ["--data", *files, "--n", "6", "--max-len", "64", "--no-color"]
    assert main(["--model", str(tok_dir), *argv]) == 0
    out = capsys.readouterr().out
    blocks = re.split(r"\n\n(?=\S+\.jsonl:\d+[ :])", out.split("\n", 1)[1].strip().rsplit("\n\n", 1)[0])
    want = []
    for f in files:
        for rec in load_jsonl(f)[:6]:
            samples, _ = tokenize_records([rec], tok, 64, f)
            if not samples:
                want.append((f"{f}:{rec['line']}: no target left (--max-len 64): train.py drops this record", None))
            for k, s in enumerate(samples, start=1):
                n = sum(label != IGNORE_INDEX for label in s["labels"])
                want.append((f"{f}:{rec['line']} sample {k}/{len(samples)}: {len(s['input_ids'])} tokens, {n} targets",
                             s))
    assert len(blocks) == len(want) > 18, (len(blocks), len(want))   # (a's long text records: several windows)
    for block, (head, s) in zip(blocks, want):
        assert block.split("\n", 1)[0].startswith(head), (block, head)
        if s is None:
            continue
        text = block.split("\n", 1)[1]
        assert text.replace("[[", "").replace("]]", "") == tok.decode(s["input_ids"]), block
        assert re.findall(r"\[\[(.*?)\]\]", text, re.S) == target_runs(tok, s), block
        if "prompt" in load_jsonl(head.split(":")[0])[0]:
            line = int(head.split(":")[1].split()[0])
            assert re.findall(r"\[\[(.*?)\]\]", text, re.S) == [f" A{line - 1}{tok.eos_token}"], block
    assert "b.jsonl:6: no target left" in out and out.rstrip().endswith("targets")
    assert main(["--model", str(tok_dir), "--data", files[1], "--lines", "2", "6", "40", "--no-color"]) == 0
    some = capsys.readouterr().out
    assert f"{files[1]}:2 sample 1/1" in some and f"{files[1]}:6: no target left" in some and \
        f"{files[1]}: has 13 lines, not line 40" in some and ":1 sample" not in some, some
    run = tmp_path / "run"   # a run's config.json, its paths relative to where it started
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"model": str(tok_dir), "data": [os.path.basename(f) for f in files],
                                                 "cwd": str(tmp_path), "max_len": 64, "long_text": "split",
                                                 "chat_template_text": None, "template_date": None}))
    assert main(["--run", str(run), "--n", "6", "--no-color"]) == 0
    assert capsys.readouterr().out == out, "not the run's flags"   # (its files found from its cwd: the same paths)
    (run / "config.json").write_text(json.dumps({"model": tok_dir.name, "data": files, "cwd": str(tok_dir.parent),
                                                 "max_len": 64, "long_text": "split"}))   # (the demo's: relative)
    assert main(["--run", str(run), "--n", "6", "--no-color"]) == 0 and capsys.readouterr().out == out
    with pytest.raises(SystemExit) as e:   # (argparse's one line, as train.py's)
        main(["--run", str(run), "--template-date", "2026-13-01"])
    assert e.value.code == 2 and "--template-date" in capsys.readouterr().err
    for bad, says in ((["--data", files[0]], "pass --model DIR and --data FILE"),
                      (["--run", str(tmp_path)], "has no config.json"),
                      (["--model", str(tok_dir), "--data", str(tmp_path / "no.jsonl")], "does not exist")):
        assert main(bad) == 2 and says in capsys.readouterr().err


def test_micro_batch_auto_cuts_each_ranks_share_by_tokens():
    """--micro-batch auto (0): each data rank's share of the step, in order, cut into runs of samples whose lengths
    sum to at most the budget (a longer sample alone); every rank pads its list with [] to the most any rank has (the
    same number of forwards everywhere); the step's samples are those of any micro-batch size; --global-batch must be
    a multiple of the data ranks; the flag reads auto as 0."""
    import argparse
    import random

    from data.batches import micro_batch_arg

    rng = random.Random(0)
    for trial in range(200):
        n, ranks = rng.randint(1, 40), rng.choice([1, 2, 4])
        g = ranks * rng.randint(1, 6)
        lengths = [rng.randint(1, 50) for _ in range(n)]
        budget = rng.randint(1, 80)
        order = GlobalBatches(n, g, trial)
        for step in range(3):
            cuts = [order.micro_batches(step, d, ranks, 0, lengths, budget) for d in range(ranks)]
            assert len({len(c) for c in cuts}) == 1, "every rank runs the same number of forwards"
            share = g // ranks
            for d, c in enumerate(cuts):
                real = [m for m in c if m]
                assert [i for m in real for i in m] == order.step_samples(step)[d * share:(d + 1) * share]
                assert all(sum(lengths[i] for i in m) <= budget or len(m) == 1 for m in real)
                assert all(not m for m in c[len(real):]), "the padding comes last"
                assert all(sum(lengths[i] for i in a) + lengths[b[0]] > budget for a, b in zip(real, real[1:])), \
                    "a cut only where the next sample does not fit"
            assert max(len(c) for c in cuts) == max(len([m for m in c if m]) for c in cuts)
    assert micro_batch_arg("auto") == 0 and micro_batch_arg("3") == 3
    for bad in ("0", "-1", "x"):
        with pytest.raises(argparse.ArgumentTypeError, match="neither a positive number of samples nor auto"):
            micro_batch_arg(bad)
    with pytest.raises(ValueError, match=r"--global-batch 6 must be a multiple of the 4 data ranks .* use "
                                         r"--global-batch 4 or 8"):
        GlobalBatches(10, 6, 0).micro_batches(0, 0, 4, 0, [1] * 10, 5)


def test_micro_batch_help_offers_only_values_the_flag_takes(capsys):
    """train.py --help's --micro-batch line names auto, never the 0 it is read as (until 2026-12-06 it said "auto
    (0)", and --micro-batch 0 was refused as "neither a positive number of samples nor auto")."""
    import re

    import train

    parser = train.build_parser()
    (action,) = [a for a in parser._actions if "--micro-batch" in a.option_strings]
    assert "auto" in action.help and not re.search(r"\b0\b", action.help), action.help
    assert parser.parse_args(["--micro-batch", "auto"]).micro_batch == 0
    with pytest.raises(SystemExit):
        parser.parse_args(["--micro-batch", "0"])
    assert "'0' is neither a positive number of samples nor auto" in capsys.readouterr().err
