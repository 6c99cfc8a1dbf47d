"""The memory plan's result and what it adds up to: `Plan` (named byte counts, parallel/plan.py's terms) with
`peak` and `total`, the slack and runtime a total adds (FRAGMENTATION, RUNTIME), and the run facts the planner
and the run's checks share: the longest sample (`sample_tokens`), whether a reference model runs
(`with_reference`). Imports nothing of the project, so the run's checks read these without the model's code.

The terms are numbered as in parallel/plan.py's docstring:
Peak = 1 + 2 + 3 + 4 + 5 + max(6 + 7 + 9 + 10 + 11, 8); planned total = peak · FRAGMENTATION + RUNTIME[target].
"""

from __future__ import annotations

from dataclasses import dataclass, field

GB = 1e9
FRAGMENTATION = 1.10   # caching-allocator (CUDA) / malloc (CPU) slack on top of the live tensors
RUNTIME = {"cuda": 1.0e9,  # CUDA context (~0.5 GB) + NCCL communicators and their buffers
           "cpu": 0.5e9}   # Python + torch + transformers + peft + bitsandbytes imports: 0.41 GB RSS measured


@dataclass
class Plan:
    terms: dict = field(default_factory=dict)   # name -> bytes; the max() group is marked by "|"
    notes: list = field(default_factory=list)
    target: str = "cuda"
    alt_activations: float = 0.0                 # activations + recompute with AC toggled, for the printout
    host: float = 0.0                            # host bytes on CUDA (--offload-activations' pinned buffers, + ...)
    host_ple: float = 0.0                        # ... Gemma 4 E2B / E4B's per-layer table and its pinned rows
    host_each: float = 0.0                       # of one offloaded block input (HostOffload's reserve)
    attn_block: int = 0                          # the attention backward's block (kernels.backward_block of a row)
    attn_row: int = 0                            # the tokens of that row

    @property
    def peak(self) -> float:
        """The larger of the step's phases: the persistent terms with the block's backward ("| block" lines, added)
        or with the loss ("| or:" lines, added); or the end of the backward ("| end:" lines), when the
        activations are gone."""
        fixed = sum(v for k, v in self.terms.items() if not k.startswith("|"))
        block = sum(v for k, v in self.terms.items() if k.startswith("| block"))
        end = sum(v for k, v in self.terms.items() if k.startswith("| end:"))
        acts = sum(v for k, v in self.terms.items() if k.startswith("activations:"))
        return max(fixed + max(block, sum(v for k, v in self.terms.items() if k.startswith("| or:"))),
                   fixed - acts + end)

    @property
    def total(self) -> float:
        return self.peak * FRAGMENTATION + RUNTIME[self.target]


REFERENCE_FREE = ("simpo", "orpo")   # --dpo-loss choices without a reference model (parallel/preference.py)


def with_reference(args) -> bool:
    """A run that computes a reference model's forward each micro-batch: --objective dpo, but for SimPO and ORPO."""
    return getattr(args, "objective", "sft") == "dpo" and getattr(args, "dpo_loss", "sigmoid") not in REFERENCE_FREE


def sample_tokens(args) -> int:
    """The longest sample --max-len allows: a DPO pair (--objective dpo) is two sequences of up to --max-len each."""
    return args.max_len * (2 if getattr(args, "objective", "sft") == "dpo" else 1)
