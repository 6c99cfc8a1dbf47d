"""train.py's command line: every run flag, with its default and help, grouped as a run reads them.

Contract:
- `run_parser(schedules, description, add_help=True)`: an argparse parser of the run's flags only (the
  planner's own flags are parallel/plan_cli.py's: `train.py --plan --help`). `schedules` are the `--lr-schedule`
  choices: train.py's `SCHEDULES`, beside the `lr_at` that computes them.
- Groups in the order a run uses them: Model, Parallel, LoRA, Optim, Data, Run. --help adds a default where the text
  does not say it (`notes.ShowDefaults`).
- A parser is only syntax. What each flag may hold given the others is checked in parallel/flags.py (`check_flags`,
  run and `--plan` alike) and parallel/mesh.py (`validate`); what a resume must keep, per flag, is parallel/resume.py's
  RUN_DEFINING / LAYOUT / FREE (a new flag goes in one: tests/test_runs.py -k classified).
"""

from __future__ import annotations

import argparse

from data import store
from data.batches import micro_batch_arg
from data.mix import Once
from data.templates import parse_day
from data.token_stats import LONG_TEXT
from model.lora_spec import DEFAULT_TARGETS, NotGiven, lora_layers_arg, lora_targets_arg
from parallel import notes
from parallel.metrics import SINKS
from parallel.plan_cli import max_len_arg


def hub_page(folder: bool = False):
    """--model's and --init-adapter's type: a Hugging Face repo page's address pasted from a browser
    (https://huggingface.co/ORG/NAME, .../tree/REVISION[/FOLDER]) read as the id it names, ORG/NAME[/FOLDER][@REVISION]
    (a folder: --init-adapter's only); another http(s) address is refused, naming the form; anything else is as given,
    but --init-adapter's trailing "/" on an id (org/name/checkpoint-500/) is dropped."""
    import re
    from urllib.parse import unquote

    def read(text: str) -> str:
        m = re.fullmatch(r"https?://(?:www\.)?(?:huggingface|hf)\.co/(datasets/|spaces/)?([\w.-]+)/([\w.-]+)"
                         r"(?:/tree/([^/]+)(/.*?)?)?/?", text.strip())
        if not m:
            if text.startswith(("http://", "https://")):
                raise argparse.ArgumentTypeError(f"{text!r} is not a Hugging Face repo's page: pass the repo's id, "
                                                 "org/name[@revision], a local folder, or the page's address "
                                                 "https://huggingface.co/org/name[/tree/revision]")
            return text.rstrip("/") if folder and text.count("/") >= 2 and not text.startswith(("/", ".", "~")) \
                else text
        kind, org, name, rev, sub = m.groups()
        if kind:
            raise argparse.ArgumentTypeError(f"{text!r} is a {kind[:-2]}'s page, not a model's or an adapter's")
        if sub and not folder:
            raise argparse.ArgumentTypeError(f"{text!r} names a folder of the repo; pass the repo: {org}/{name}"
                                             + (f"@{unquote(rev)}" if rev else ""))
        return f"{org}/{name}{(sub or '').rstrip('/')}" + (f"@{unquote(rev)}" if rev else "")
    read.__name__ = "Hub id or page"   # (argparse's "invalid ... value" names the type so)
    return read


def run_parser(schedules, description: str, add_help=True) -> argparse.ArgumentParser:
    """The run's flags (the module docstring)."""
    p = argparse.ArgumentParser(description=description, add_help=add_help,
                                formatter_class=notes.ShowDefaults)
    a = p.add_argument
    # Model
    a("--model", type=hub_page(), default=None, help="HF checkpoint dir (config.json, safetensors, tokenizer) or a "
      "Hub id org/name[@revision] (or its page's address); none: the demo")
    a("--quant", default="nf4", choices=["nf4", "none"], help="base weights: 4-bit NF4 or plain --dtype")
    a("--dtype", default=None, choices=["bf16", "fp32"], help="compute dtype (default bf16 on CUDA, fp32 on CPU)")
    a("--rope-scaling", default=None, metavar="SPEC", help="RoPE scaling in place of config.json's: yarn:F[@N] "
      "(N: the original length), linear:F, none, or a JSON object (transformers' form); the adapter records it")
    a("--compile", action="store_true", help="torch.compile RMSNorm, RoPE and SwiGLU per block (H200: 1-4%% faster "
      "after a slower first step)")
    a("--ac", default=True, action=argparse.BooleanOptionalAction, help="activation checkpointing per block")
    a("--ac-group", type=int, default=1, help="blocks per kept checkpoint: G > 1 keeps ceil(L/G) - 1 + G - 1 "
      "block inputs alive, not L - 1")
    a("--ac-blocks", type=int, default=None, help="checkpoint only the first N blocks (default all): less recompute, "
      "more memory; `--plan` names the fewest that fit")
    a("--ac-keep-attn", action="store_true", help="AC keeps each block's attention output: recompute skips attention")
    a("--fast", action="store_true", help="add the memory flags the planner ranks fastest that fit 95%% of this "
      "device (--plan's fastest: line; the smallest rank's device decides; logged)")
    a("--tiled-mlp", action="store_true", help="run each MLP over tiles of tokens, recomputed per tile in backward")
    a("--tiled-attn", action="store_true", help="run each attention sublayer over tiles of query rows (--cp 1)")
    a("--offload-activations", action="store_true", help="keep AC's block checkpoints in (pinned) host memory")
    a("--ple-on-device", action="store_true", help="Gemma 4 E2B / E4B: keep the per-layer embedding table on the "
      "device (default: host memory, each micro-batch's rows copied over; parallel/host_table.py)")
    # Parallel
    a("--cp", type=int, default=1, help="context-parallel degree: ranks that share one sequence")
    a("--dp-shard", type=int, default=-1, help="FSDP2 shard degree (-1: world / (dp_replicate·cp))")
    a("--dp-replicate", type=int, default=1, help="replicas of the sharded model (HSDP, across nodes)")
    a("--cp-impl", default="auto", choices=["ulysses", "ring", "hybrid", "auto"], help="auto: Ulysses, then ring")
    a("--ulysses-degree", type=int, default=None, help="Ulysses degree inside --cp for --cp-impl hybrid")
    # LoRA
    a("--lora-r", type=int, default=16, help="LoRA rank")
    a("--lora-alpha", type=float, default=32.0, help="LoRA alpha (scale alpha / r; alpha / sqrt(r) with --rslora)")
    a("--rslora", action="store_true", help="rank-stabilized LoRA: scale = alpha / sqrt(r) (peft's use_rslora)")
    a("--dora", action="store_true", help="DoRA: a trained magnitude per output row rescales W + scale·B A to it "
      "(peft's use_dora)")
    a("--train-norms", action="store_true", help="also train the RMSNorm weights (LongLoRA: with LoRA, what "
      "extends a context well); the adapter holds them as peft's modules_to_save")
    a("--train-embeddings", action="store_true", help="also train the input embedding (LongLoRA's other trained "
      "layer; a tied model's head, the same weight, trains with it, not under --objective dpo; its float32 state: "
      "16 bytes per vocab x hidden element over the shards)")
    a("--lora-plus-ratio", type=float, default=None, metavar="R", help="LoRA+: each B matrix trains at R × the LR "
      "(A at the LR; 16 in the paper, often with a lower --lr), as peft's create_loraplus_optimizer")
    a("--neftune-alpha", type=float, default=None, metavar="A", help="NEFTune: each training forward adds A / "
      "sqrt(L·d) × uniform[-1, 1) noise to the token embeddings (L the token's own document's length, d the hidden "
      "size; 5 in the paper), the same noise for a token on every layout (a hash of --seed, its sample's place in the "
      "data order, its position, the channel); none in evaluation; --objective sft only")
    a("--lora-dropout", type=float, default=0.0, help="LoRA dropout (>0 makes results depend on the layout)")
    a("--lora-targets", type=lora_targets_arg, default=NotGiven(",".join(DEFAULT_TARGETS)), help="comma-separated "
      "projection names to adapt, or all-linear (peft's: every linear of the language model but lm_head), attn (q, k, "
      "v, o; Qwen3.5's linear layers: in_proj_qkv, in_proj_z, out_proj), mlp (gate, up, down); default: attn,mlp "
      "(in_proj_b, in_proj_a only when named or with all-linear), or attn on an MoE model whose MLP is its experts "
      "(Qwen3-MoE, Qwen3.5-MoE, GPT-OSS); experts: those models' routed experts too, beside another name (e.g. "
      "attn,experts; peft's target_parameters format)")
    a("--lora-layers", type=lora_layers_arg, default=None, metavar="SPEC", help="adapt only these blocks (e.g. 14-27, "
      "0,4,8-11; default all; peft's layers_to_transform): from the lowest, the blocks below it run no backward")
    a("--objective", default="sft", choices=["sft", "dpo"], help="sft: cross-entropy on the targets (LOSS_FN); dpo: "
      "DPO on preference pairs ({'prompt', 'chosen', 'rejected'} records) against the base model (LoRA off), or "
      "with --init-adapter against that adapter held fixed (DPO after SFT: the policy starts from it)")
    a("--sft-loss", default="ce", choices=["ce", "dft"], help="--objective sft's training loss: ce, cross-entropy; "
      "dft, each target's cross-entropy × the model's probability of it, held constant (Dynamic Fine-Tuning, TRL's "
      "loss_type='dft'); the eval loss stays cross-entropy")
    a("--dpo-beta", type=float, default=0.1, help="DPO's beta: how strongly the policy may move from the reference")
    a("--dpo-loss", default="sigmoid", choices=["sigmoid", "ipo", "hinge", "simpo", "orpo"], help="the "
      "preference loss: sigmoid (DPO), ipo, hinge (SLiC); without a reference model (one forward less): simpo (try "
      "--dpo-beta 2), orpo (the chosen side's NLL + beta x the odds ratio's loss)")
    a("--dpo-label-smoothing", type=float, default=0.0, help="sigmoid's label smoothing in [0, 0.5): the share of "
      "pairs taken as mislabeled (conservative DPO)")
    a("--rpo-alpha", type=float, default=0.0, help="add this times the chosen side's mean NLL to each pair's loss "
      "(RPO)")
    a("--simpo-gamma", type=float, default=0.5, help="SimPO's target reward margin (with --dpo-loss simpo)")
    a("--dpo-share-prompt", action="store_true", help="a pair's prompt once in its row, the rejected answer seeing "
      "it as a branch: fewer tokens (about half for long prompts), the same losses")
    a("--dpo-cache-ref", action="store_true", help="keep each pair's reference log-probabilities from their first "
      "forward (the first epoch's steps, the first eval; in OUT for resumes): later epochs and evals run no reference "
      "forward, ~1/5 less compute a step")
    a("--init-adapter", type=hub_page(folder=True), default=None, metavar="DIR", help="start LoRA from this PEFT "
      "adapter (e.g. an earlier run's OUT/adapter: a longer --max-len, new data; or a Hub id, org/name[@revision], or "
      "org/name/FOLDER[@revision] for one in a folder of the repo, e.g. a trainer's checkpoint-500, or its page's "
      "address); a fresh optimizer")
    # Optim
    a("--lr", type=float, default=2e-4, help="peak learning rate (after --warmup, --lr-schedule takes it down)")
    a("--warmup", type=int, default=10, help="linear warmup steps (the first trains at --lr / N)")
    a("--lr-schedule", default="cosine", choices=schedules, help="after warmup: cosine or linear decay to "
      "--min-lr-ratio at the run's end; constant; wsd: constant, then a cosine decay over the last --wsd-decay of the "
      "steps (lr_at)")
    a("--min-lr-ratio", type=float, default=None, metavar="R", help="the LR the decay ends at, as a share of --lr "
      "(default 0.1; not with constant)")
    a("--wsd-decay", type=float, default=None, metavar="F", help="--lr-schedule wsd: the share of the run's steps its "
      "final decay takes (default 0.1)")
    a("--weight-decay", type=float, default=0.0, help="AdamW weight decay")
    a("--clip", type=float, default=1.0, help="clip the global grad norm to this (0: no clipping)")
    a("--steps", type=int, default=None, help="optimizer steps (neither this nor --epochs: one epoch, ceil(samples "
      "/ --global-batch); DPO's samples are pairs)")
    a("--epochs", type=float, default=None, metavar="E", help="train E passes over the data in place of --steps: "
      "ceil(E × samples / --global-batch) steps (0.5 and 2.5 allowed)")
    a("--global-batch", type=int, default=8, help="samples (DPO: pairs) per optimizer step (layout-independent)")
    a("--micro-batch", type=micro_batch_arg, default=1, metavar="N|auto", help="samples (DPO: pairs) per forward on "
      "each data rank; auto: as many as fit the longest sample's length, packed (fewer forwards for short samples)")
    # Data
    a("--data", nargs="+", action=Once, default=None, metavar="FILE", help="training JSONL ({'text'}, {'prompt', "
      "'completion'} or {'messages'} per line); several files train as one set; hf://datasets/ORG/NAME[@REV]/PATH: "
      "a Hub dataset's files PATH matches (a glob), fetched")
    a("--data-weights", nargs="+", action=Once, type=float, default=None, metavar="W", help="one per --data file: 2 "
      "trains each of its samples twice an epoch, 0.5 half of its records (chosen by --seed; the others next epoch)")
    a("--eval-data", nargs="+", action=Once, default=None, metavar="FILE", help="evaluation JSONL; several files: "
      "each file's eval loss too (eval_loss/FILE), beside the loss over all; hf://datasets/... as --data's")
    a("--eval-split", type=float, default=None, help="instead of --eval-data, hold out this share (below 1: 0.05 is "
      "5%%) or number (1 or more) of --data's records as the eval set, never trained on: whole records, chosen by "
      "--seed")
    a("--max-len", type=max_len_arg, default=256, help="the longest sample in tokens; longer records are cut, or "
      "split (--long-text) (`--plan --max-len auto`: the longest that fits)")
    a("--long-text", default=LONG_TEXT[0], choices=LONG_TEXT, help="a text record longer than --max-len: split into "
      "windows of --max-len (every token trained once) or truncate to its first --max-len tokens")
    a("--train-on-prompt", action="store_true", help="every token of prompt/completion and chat records is a target "
      "(not only the completion, or the assistant's turns): TRL's default for conversations")
    a("--chat-template", default=None, metavar="NAME|FILE", help="render {'messages'} with this template, not the "
      "checkpoint's: chatml, or a Jinja file (exported with the adapter)")
    a("--template-date", default=None, type=parse_day, metavar="YYYY-MM-DD", help="the date a chat template that "
      "writes today's (Llama 3.2/3.3) renders (default: rank 0's day at the start; a resume keeps its run's)")
    a("--data-workers", type=int, default=0, metavar="N", help="processes that tokenize a data file whose "
      "tokenizing would take 20 s or more (0: this machine's cores shared by the ranks that tokenize at once, at most "
      "32; 1: none)")
    a("--data-cache", default=store.DATA_CACHE, metavar="DIR|none", help="keep tokenized data here, keyed by the "
      "file's bytes, tokenizer, template, --max-len and the data code: a rerun reads it back (mmap; none: off)")
    a("--pack", default=None, action=argparse.BooleanOptionalAction, help="a micro-batch in one row (default)")
    a("--seed", type=int, default=0, help="seed for data order and LoRA init")
    # Run
    a("--out", default=None, help="output dir (default: a fresh runs/<date-time>); a used one: --resume/--overwrite")
    a("--overwrite", action="store_true", help="reuse a used --out: delete the run outputs in it (config, "
      "metrics, ckpt, adapters, diagnostics; never other files)")
    a("--eval-every", type=int, default=0, help="evaluate every N steps (0: at the end only)")
    a("--eval-positions", nargs="+", action=Once, type=int, default=None, metavar="P", help="also the eval loss and "
      "token accuracy of the targets at positions 0..P1-1 of their sample, P1..P2-1, ..., and from the last P on "
      "(eval_loss@0-1023, eval_token_acc@0-1023, ...): whether the model uses long context")
    a("--save-every", type=int, default=0, help="checkpoint every N steps (0: at --save-minutes' times and the end)")
    a("--save-minutes", type=float, default=30.0, help="also checkpoint once M minutes passed since the last save "
      "(rank 0's clock; 0: off): what a crash can lose")
    a("--keep-ckpts", type=int, default=2, help="keep the newest N checkpoints")
    a("--keep-best", action="store_true", help="also keep the checkpoint of the lowest eval loss (each --eval-every "
      "evaluation is saved) and export its adapter to OUT/adapter_best at the end")
    a("--early-stop", type=int, default=None, metavar="N", help="end the run once N evaluations in a row (each "
      "--eval-every) have not lowered the eval loss; it saves and exports that step")
    a("--early-stop-delta", type=float, default=0.0, metavar="D", help="with --early-stop: an evaluation improves when "
      "it is more than D below the best so far")
    a("--resume", default=None, help="continue from OUT/ckpt (its newest good step) or a step folder; same run flags "
      "(auto, with --out: OUT/ckpt when it holds a step, else a fresh run there: one command for every requeue)")
    a("--mem-check", default=True, action=argparse.BooleanOptionalAction, help="refuse at start-up a run the memory "
      "plan says cannot fit the device, or whose offload needs more than the free host memory (--no-: warn only)")
    a("--max-nonfinite", type=int, default=3, help="stop after N non-finite steps in a row (each is skipped)")
    a("--timeout", type=float, default=30.0, help="minutes without progress (a stuck rank) before the job ends")
    a("--no-progress", action="store_true", help="no progress bar (log lines only)")
    a("--report-to", nargs="+", choices=sorted(SINKS), default=None, metavar="SINK", help="also log each step's "
      f"metrics to: {', '.join(sorted(SINKS))} (OUT/tensorboard; W&B: a run named after OUT, configured by "
      "WANDB_PROJECT, WANDB_MODE=offline ...; metrics.jsonl is always written)")
    a("--push-to-hub", default=None, metavar="ORG/NAME[@BRANCH]", help="at the end, upload the run's adapter "
      "(OUT/adapter_best with --keep-best, else OUT/adapter) to this Hub model repo, created if missing; a token is "
      "needed at start-up (hf auth login, HF_TOKEN); a failed upload keeps the files and names the retry command")
    a("--hub-private", action="store_true", help="--push-to-hub creates the repo private (one that exists keeps its "
      "visibility)")
    a("--peak-tflops", type=float, default=None, help="bf16 dense peak for mfu (default: known GPUs, else no mfu)")
    a("--plan", action="store_true", help="print the per-rank memory plan and exit (`--plan --help`: its flags)")
    a("--mem-phases", action="store_true", help="the first step's peak memory per phase to OUT/mem_phases.json")
    a("--mem-trace", action="store_true", help="--mem-phases and, on CUDA, what is alive at that micro-batch's peak, "
      "by the line that allocated it, to OUT/mem_trace.rank<r>.txt")
    a("--schedule-steps", type=int, default=None, help=argparse.SUPPRESS)   # the lr schedule's length (bench/gpu.py
    # adds a profiled step past the timed ones and keeps their schedule)
    a("--profile", type=int, default=None, metavar="N", help="torch.profiler over step N: time per kernel to "
      "OUT/profile.txt")
    return p
