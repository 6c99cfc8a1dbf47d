"""The folder a merge writes into (--out): its lock, the staging folder inside it, and what a new model replaces there.

Contract:
- `_hold(out_dir)`: an exclusive flock on --out itself, held for the whole merge (`model.merged.merge`), or a
  refusal naming the merge that holds it; a filesystem without flock goes on unguarded. Returns the fd to close.
- `STAGE` (OUT/.merge-tmp) is where the merge writes every file before moving them into --out; `STAGE_MARK` inside it
  makes it the merge's own (`is_stage`): a killed merge's is cleared, a user's .merge-tmp is refused, never removed.
- `_clear_out(out_dir)`: once the stage is whole, what the new files would replace goes (links and hard links under
  the names the merge writes; an earlier model's config.json first, then its weight files and index); the user's
  other files stay. `_copied(name, remote_code)`: the base's files that travel with the weights.
- `MovesFailed`: a move into --out failed after the earlier model went; its message says where the new files are.
"""

from __future__ import annotations

import errno
import os
import re

STAGE = ".merge-tmp"   # merge()'s folder inside --out, whose files move into --out once all are written
STAGE_MARK = ".merge-stage"   # the file inside STAGE that makes it merge()'s own (a user's .merge-tmp is left alone)


# what transformers loads a model from (and would load instead of the new merge); other files are the user's
_WEIGHTS = re.compile(r"(model(-\d+-of-\d+)?\.safetensors|model\.safetensors\.index\.json|"
                      r"pytorch_model(-\d+-of-\d+)?\.bin|pytorch_model\.bin\.index\.json|config\.json(\.tmp)?)$")


_COPIED = ("tokenizer", "special_tokens", "generation_config", "chat_template", "vocab", "merges", "added_tokens",
           "preprocessor_config", "processor_config")   # (the last two: a multimodal wrapper's image processor)


def _copied(name: str, remote_code: bool) -> bool:
    """A base's file the merge copies beside the weights: tokenizer and generation files, and remote code."""
    return name.startswith(_COPIED) or name.endswith(".tiktoken") or (name.endswith(".py") and remote_code)


def _clear_out(out_dir: str) -> list[str]:
    """Before a merge's files move into `out_dir` (empty, or --force), what they would replace is removed: links (a
    `cp -rs` view of another model, a shared tokenizer.json; their targets untouched) and hard links (a `cp -al` copy of
    the base or of another model), under the names the merge writes; and an earlier model's config.json, weight files
    and index under the names transformers loads (its model.safetensors beside a sharded merge loads instead of it;
    config.json goes first, so a merge killed in the moves leaves no folder that loads). Other files and links (an
    adapter_model.safetensors of the user's, a link to a data folder) stay. Returns the names removed."""
    gone = []
    for e in sorted(os.listdir(out_dir), key=lambda e: (e != "config.json", e)):
        p = os.path.join(out_dir, e)
        writes = bool(_WEIGHTS.match(e)) or _copied(e, True) or e == "additional_chat_templates"
        link = os.path.islink(p) and writes
        if link or (os.path.isfile(p) and (_WEIGHTS.match(e) or (writes and os.stat(p).st_nlink > 1))):   # (st_nlink:
            # a hard link, the file shared with another folder)
            os.remove(p)
            gone.append(e + (" (a link)" if link else ""))
    return gone


def _hold(out_dir: str) -> int:
    """An exclusive flock on the --out directory itself (no file left in the merged model), or a refusal: a second
    merge into the same --out took the first one's live stage for a killed merge's and cleared it, so the two
    wrote one mixed, incomplete model, one of them saying done (review, helper 54)."""
    import fcntl

    fd = os.open(out_dir, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise ValueError(f"another merge is writing into {out_dir!r} now (it holds that folder's lock): wait for it "
                         "to end, or pass another --out") from None
    except OSError as e:   # a filesystem without flock (some network mounts): the merge goes on unguarded
        if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL, errno.EBADF):   # (EBADF: NFS and CIFS take
            # flock as a byte-range lock, which an exclusive one wants a file open for writing for)
            os.close(fd)
            raise
    return fd


class MovesFailed(OSError):
    """merge() failed once the earlier model in --out was removed: its message says where the new files are."""


def is_stage(path: str) -> bool:
    """`path` is a merge's own staging folder (its marker file inside), not a user's."""
    return os.path.isdir(path) and not os.path.islink(path) and os.path.isfile(os.path.join(path, STAGE_MARK))
