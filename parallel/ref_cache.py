"""--dpo-cache-ref: each pair's reference log-probabilities, kept from their first forward (on the device, and in
OUT/reference_logps[_eval].pt for a resume), so later epochs and evaluations run no reference forward.

Contract:
- `ref_caches(dpo, args, splits, device, log)` sets `dpo.cache[split]` (parallel/preference.py's `DPO` reads and fills
  it: `known`, `add`, `sync`) for the train and eval pairs, each a `RefCache` read back from its file when that was kept
  for the same tokens, model, numerics, reference and code (`IDENTITY`, `code_digest`), else computed again (said).
- The file holds the values, which pairs have one, and their sha256 (`_digest`): a file that does not match is never
  trusted.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from functools import partial

import torch
import torch.distributed as dist


class RefCache:
    """--dpo-cache-ref: each pair's reference log-probabilities (chosen, rejected) in float64, from the first forward
    that computes them: the first epoch's steps (a step whose pairs all are known reads them: a later epoch's), the
    first evaluation. `add` keeps this rank's new ones (once per cp group) and `sync` adds every rank's (an all-reduce
    over dp × cp of the step's [pairs, 3]: sums and counts, a pair twice in a step averaged), the same on every rank
    after it. It holds 49 bytes a pair on the device (1M pairs: 49 MB).
    The reference is held fixed, so a value kept is exact for the rest of the run: the first epoch trains as without
    the cache (the same forwards), a later one reads each pair's value from the rows it had then."""

    def __init__(self, n: int, device, path: str, ident: dict, log=print):
        self.values = torch.zeros(n, 2, dtype=torch.float64, device=device)
        self.have = torch.zeros(n, dtype=torch.bool, device=device)
        self.new = torch.zeros(n, 3, dtype=torch.float64, device=device)
        self.path, self.ident, self.written, self.log = path, ident, 0, log

    def known(self, pairs) -> bool:
        pairs = torch.as_tensor(list(pairs), dtype=torch.long, device=self.have.device)
        return bool(self.have[pairs].all())

    def add(self, pairs: list[int], ref: torch.Tensor, once: float) -> None:
        i = torch.as_tensor(pairs, dtype=torch.long, device=self.new.device)
        self.new.index_add_(0, i, once * torch.cat([ref.detach().view(-1, 2), torch.ones(len(pairs), 1,
                                                                                         device=ref.device,
                                                                                         dtype=ref.dtype)], 1))

    def sync(self, group, pairs=None) -> None:
        """Every rank's new values into the cache (collective: call it after each step or evaluation that ran the
        reference, on every rank, with the same `pairs`: those any rank may have added, all when None; only their
        rows travel); written to `path` (rank 0, whole then renamed) once a tenth of the pairs more is known than
        the file holds, and when all are: a resume reads it (`load`)."""
        idx = torch.arange(len(self.have), device=self.new.device) if pairs is None else torch.as_tensor(
            sorted(set(pairs)), dtype=torch.long, device=self.new.device)
        part = self.new[idx]
        if dist.is_initialized() and dist.get_world_size(group) > 1:
            dist.all_reduce(part, group=group)
        got = part[:, 2] > 0
        self.values[idx[got]] = part[got, :2] / part[got, 2:]
        self.have[idx[got]] = True
        self.new[idx] = 0
        n, have = len(self.have), int(self.have.sum())
        if have - self.written >= max(n // 10, 1) or have == n > self.written:
            from parallel import guard
            guard.on_rank0(self._write, f"writing {self.path}")
            if have == n:   # (once: a run's log says from when its steps or evals read them)
                self.log(f"reference: all {n} pairs' log-probabilities of {os.path.basename(self.path)} are kept: "
                         "the steps or evaluations of those pairs run no reference forward from here")
            self.written = have

    def _write(self) -> None:
        try:
            values, have = self.values.cpu(), self.have.cpu()
            torch.save({"identity": self.ident, "values": values, "have": have, "sha256": _digest(values, have)},
                       self.path + ".tmp")
            os.replace(self.path + ".tmp", self.path)
        except (OSError, RuntimeError) as e:   # (a cache: the run goes on without its file; a resume computes them
            # again. torch.save says a refused write as a RuntimeError: review, helper 47)
            self.log(f"warning: {self.path} could not be written ({type(e).__name__}: {str(e).strip()[:200]}): a "
                     "resume computes those reference log-probabilities again")
            with contextlib.suppress(OSError):
                os.remove(self.path + ".tmp")

    def load(self) -> None:
        """A resume's: the file's values when it was kept for the same model, reference and pairs (rank 0 reads and
        decides, then broadcasts); else none, said."""
        from parallel import guard
        got = guard.on_rank0(partial(_read, self.path, self.ident, len(self.have), self.log), f"reading {self.path}")
        box = [None if got is None else int(got[1].sum())]
        many = dist.is_initialized() and dist.get_world_size() > 1
        if many:
            dist.broadcast_object_list(box, src=0)
        if box[0] is None:
            return
        both = torch.cat([got[0], got[1][:, None].double()], 1) if got is not None else torch.empty(
            len(self.have), 3, dtype=torch.float64)
        both = both.to(self.values.device)
        if many:
            dist.broadcast(both, src=0)
        self.values, self.have, self.written = both[:, :2].contiguous(), both[:, 2] > 0, box[0]
        self.log(f"reference: {box[0]} of {len(self.have)} pairs' log-probabilities read from {self.path}")


IDENTITY = ("model_sha256", "quant", "dtype", "rope_scaling", "max_len", "dpo_reference")   # (and the split's tokens)


def ref_caches(dpo, args, splits: dict, device, log) -> None:
    """`dpo.cache` (parallel.preference.DPO's) for each of `splits` ({"train": Pairs, "eval": Pairs or None}), kept
    in OUT/reference_logps[_eval].pt with what they were computed for (the split's tokens, the model's fingerprint and
    numerics, the reference, the code: `code_digest`): a resume in the run's folder reads those of the same."""
    # --rope-scaling as it means ("yarn:2" = "yarn:2.0"), as a resume compares it (review, helper 51)
    from parallel.resume import _norm
    for split, samples in splits.items():
        if samples:
            ident = {"format": 3, "tokens": getattr(args, f"{'data' if split == 'train' else 'eval'}_tokens"),
                     **{k: str(_norm(k, getattr(args, k, None))) for k in IDENTITY}, "code": code_digest()}
            path = os.path.join(args.out, f"reference_logps{'_eval' * (split == 'eval')}.pt")
            dpo.cache[split] = RefCache(len(samples), device, path, ident, log)
            dpo.cache[split].load()


def code_digest(root: str | None = None) -> str:
    """The sha256 of the code a reference log-probability comes from (model/, parallel/, loss.py) and torch's version:
    a resume after an edit there (a fork's fix to attention, say) computes the values again rather than read ones an
    older forward gave (until 2026-12-05 the cache kept them across any edit)."""
    root = root or os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    h = hashlib.sha256(torch.__version__.encode() + b"\0")
    for d in ("model", "parallel"):
        for name in sorted(f for f in os.listdir(os.path.join(root, d)) if f.endswith(".py")):
            with open(os.path.join(root, d, name), "rb") as f:
                h.update(f"{d}/{name}\0".encode() + f.read() + b"\0")
    with open(os.path.join(root, "loss.py"), "rb") as f:
        h.update(b"loss.py\0" + f.read())
    return h.hexdigest()


def _digest(values: torch.Tensor, have: torch.Tensor) -> str:
    """The sha256 of a cache's values (float64) and which pairs it has."""
    return hashlib.sha256(values.double().contiguous().numpy().tobytes() + have.bool().numpy().tobytes()).hexdigest()


def _read(path: str, ident: dict, n: int, log) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`path`'s (values, have) when it was kept for `ident` and holds `n` pairs, else None (said, unless absent)."""
    if not os.path.exists(path):
        return None
    try:
        got = torch.load(path, map_location="cpu", weights_only=True)
        if (kept := got["identity"]) != ident or got["values"].shape != (n, 2) or got["have"].shape != (n,):
            code = isinstance(kept, dict) and {**kept, "code": None, "format": None} == {**ident, "code": None,
                                                                                           "format": None}
            log(f"note: {path} was kept " + ("by other code (model/, parallel/ or loss.py edited since, or another "
                                             "torch)" if code else "for another model, reference or data")
                + ": its values are computed again")
            return None
        if got["sha256"] != _digest(got["values"], got["have"]):   # (a disk's or a hand's change: never trusted)
            log(f"note: {path}'s values do not match the sha256 written with them: they are computed again")
            return None
        return got["values"].double(), got["have"].bool()
    except Exception as e:   # noqa: BLE001 - a torn or foreign file is computed again, never trusted
        log(f"note: {path} cannot be read ({type(e).__name__}: {e}): its values are computed again")
        return None
