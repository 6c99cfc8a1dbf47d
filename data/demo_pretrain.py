"""Pretrain the demo's base model in full: plain PyTorch, the project's own decoder, CPU, float32.

Contract: `pretrain(model_dir, documents, steps, ...)` loads the checkpoint in `model_dir` (a freshly
initialised Qwen2 saved by transformers) into `model.llama.Transformer`, trains every parameter
with AdamW on `documents` (lists of token ids, each ending with its stop token) and writes the
weights back into `model_dir/model.safetensors` through transformers' `save_pretrained`, so the
file is exactly what transformers and `train.py` load. Returns the per-step losses.

Deterministic: documents are packed into rows in an order drawn from `torch.Generator(seed)`, and
the model is seeded the same way; on one machine with one thread count the weights are bitwise
reproducible (float32 matmul reductions may differ across CPU kernels or thread counts).

Rows are packed like `train.py --pack`: documents back to back, position ids restart at each
document, and attention never crosses a document boundary (the local attention kernel reads the
boundaries from the position ids), so a conversation sees position 0 at its start, as at inference.
"""

from __future__ import annotations

import math

import torch

from loss import IGNORE_INDEX
from model.load import from_pretrained


def pack_rows(documents: list[list[int]], row_len: int, pad_id: int, gen: torch.Generator):
    """One epoch of documents in a random order, packed greedily into rows of `row_len` tokens.

    Returns [(input_ids, position_ids, labels)] as 1-D tensors; labels are already shifted and are
    IGNORE_INDEX at the last token of each document and on padding. Documents longer than a row are cut.
    """
    rows, ids, pos, lab = [], [], [], []

    def flush():
        n, nxt = row_len - len(ids), pos[-1] + 1   # padding continues the last document's positions
        rows.append((torch.tensor(ids + [pad_id] * n), torch.tensor(pos + list(range(nxt, nxt + n))),
                     torch.tensor(lab + [IGNORE_INDEX] * n)))
        ids.clear(), pos.clear(), lab.clear()

    for i in torch.randperm(len(documents), generator=gen).tolist():
        doc = documents[i][:row_len]
        if len(ids) + len(doc) > row_len:
            flush()
        ids += doc
        pos += range(len(doc))
        lab += doc[1:] + [IGNORE_INDEX]
    if ids:
        flush()
    return rows


def pretrain(model_dir, documents: list[list[int]], steps: int, *, row_len: int = 256,
             batch_rows: int = 8, lr: float = 3e-3, warmup: int = 10, pad_id: int = 0,
             seed: int = 0, log=None) -> list[float]:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    model = from_pretrained(str(model_dir), dtype=torch.float32)
    model.train()
    decay = [p for n, p in model.named_parameters() if p.ndim == 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=lr, betas=(0.9, 0.95))
    rows, losses = [], []
    for step in range(steps):
        # linear warmup, cosine decay to 10%: a short run needs most of its steps at a high rate
        t = max(0.0, (step - warmup) / max(1, steps - warmup))
        for g in opt.param_groups:
            g["lr"] = lr * min((step + 1) / warmup, 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))
        while len(rows) < batch_rows:
            rows += pack_rows(documents, row_len, pad_id, gen)
        batch, rows = rows[:batch_rows], rows[batch_rows:]
        ids, pos, lab = (torch.stack(x) for x in zip(*batch))        # [B, S] each
        loss_sum, n = model(ids, position_ids=pos, labels=lab)
        loss = loss_sum / n
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if log and ((step + 1) % max(1, steps // 8) == 0 or step + 1 == steps):
            log(f"pretrain step {step + 1}/{steps} loss {losses[-1]:.3f}")
    # Write through transformers so the file is exactly what it (and peft) expect.
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    state = {k: v for k, v in model.state_dict().items() if not (model.args.tie_embeddings and k == "lm_head.weight")}
    missing, unexpected = hf.load_state_dict(state, strict=False)
    if unexpected or [k for k in missing if k != "lm_head.weight"]:
        raise RuntimeError(f"pretrained weights do not match transformers' names: {missing} {unexpected}")
    hf.save_pretrained(str(model_dir))
    return losses
