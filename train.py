"""Long-context (Q)LoRA fine-tuning with FSDP2 × context parallelism, in one readable loop.

    # 1 process on CPU (the embedded demo model and corpus when --model/--data are omitted)
    python train.py --steps 20
    # 4 CPU processes: context parallel 2 × FSDP 2 (what `make demo` runs)
    OMP_NUM_THREADS=1 torchrun --nproc_per_node 4 train.py --cp 2 --dp-shard 2
    # 8 GPUs: Qwen2.5-7B, 32k tokens, Ulysses/ring chosen automatically, NF4 base weights
    torchrun --nproc_per_node 8 train.py --model /ckpt/Qwen2.5-7B-Instruct --data chat.jsonl \
        --max-len 32768 --cp 4 --dp-shard 2 --global-batch 16 --out runs/qwen7b
    # know first whether it fits (reads config.json only; `--plan --help` lists the planner's flags)
    python train.py --plan --model /ckpt/Qwen2.5-72B --max-len 32768 --cp 2 --dp-shard 2 --world-size 4

Flow: args -> process group + mesh (every flag validated before any weight is read) -> data (tokenized
before the model, so data errors come first too) -> model -> optimizer -> loop (micro-steps,
global-token loss, clip, AdamW) -> save (checkpoints, PEFT adapter).
"""

from __future__ import annotations

import gc
import json
import math
import os
import sys
import time

from parallel.alloc import default_allocator

default_allocator()   # expandable CUDA segments unless the user set the allocator: before torch is imported

import torch
import torch.distributed as dist
from tqdm import tqdm

from data import GlobalBatches, load_tokenizer, run_data
from data.demo import main as build_demo
from data.pairs import for_run
from loss import IGNORE_INDEX
from model.flops import flops_per_token
from model.load import read_args
from parallel import guard, notes, phases, preflight, preflight_memory, resume, runs, signals
from parallel.cp import LocalBatches, cp_attention
from parallel.cp_linear import cp_linear
from parallel.evaluate import baseline, evaluate
from parallel.mesh import dense_bf16_tflops, device_type, init_distributed, validate
from parallel.metrics import rounded, step_record
from parallel.neftune import NEFTune
from parallel.notes import log0
from parallel.preference import DPO
from parallel.profiler import StepProfiler
from parallel.ref_cache import ref_caches
from parallel.run_cli import run_parser
from parallel.saves import Saves

# The loss: None is the fused chunked cross-entropy. Any `loss_fn(logits [c, V] float32, labels [c])`
# returning the SUM over the chunk's target rows rides the same chunks, autograd does the gradient, e.g.
#   LOSS_FN = lambda z, y: torch.nn.functional.cross_entropy(z, y, ignore_index=IGNORE_INDEX, reduction="sum",
#                                                            label_smoothing=0.1)
# (a mean, or a term over rows with no target, is refused at start-up: recorded.not_a_sum calls it 4 times on a
# random CPU chunk 11 columns wide, under no_grad, before anything else)
LOSS_FN = None

# No --model/--data: the embedded demo, with these defaults (flags win); its tiny base needs lr 5e-3, 100 steps.
DEMO = dict(model="runs/demo_assets/model", data="runs/demo_assets/train.jsonl",
            eval_data="runs/demo_assets/eval.jsonl", steps=100, lr=5e-3, warmup=5, global_batch=16, micro_batch=8)

# ----------------------------------------------------------------------------- args


def build_parser(add_help=True):
    """The run's flags: parallel/run_cli.py (a new flag also goes in a list of parallel/resume.py)."""
    return run_parser(SCHEDULES, (__doc__ or "").split("\n")[0], add_help)


def make_optimizer(params, args):
    """The optimizer; a fork's goes here (its class and settings are recorded: a resume must keep them)."""
    return torch.optim.AdamW(params, lr=args.lr, weight_decay=args.weight_decay, betas=(0.9, 0.999))


SCHEDULES = ("cosine", "linear", "constant", "wsd")


def lr_at(step, args, total):
    """The LR of 0-based step `step` of `total`: linear warmup from --lr / --warmup (transformers' schedules train
    their first step at 0: theirs one step on), then --lr-schedule from --lr down to --min-lr-ratio × --lr at `total`
    (as transformers' get_cosine_with_min_lr_schedule_with_warmup, get_linear_schedule_with_warmup,
    get_constant_schedule_with_warmup and get_wsd_schedule compute it: tests/test_schedule.py)."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    if args.lr_schedule == "constant":
        return args.lr
    start = args.warmup if args.lr_schedule != "wsd" else max(args.warmup, total - round(args.wsd_decay * total))
    t = min(1.0, (step - start) / max(1, total - start)) if step >= start else 0.0
    down = 1 - t if args.lr_schedule == "linear" else 0.5 * (1 + math.cos(math.pi * t))   # 1 -> 0
    return args.lr * (args.min_lr_ratio + (1 - args.min_lr_ratio) * down)


def set_lr(opt, lr):
    """Each param group's LR: lr_at's, × the group's `lr_ratio` (LoRA+'s B matrices) where it has one."""
    for g in opt.param_groups:
        g["lr"] = lr * g.get("lr_ratio", 1.0)


# ----------------------------------------------------------------------------- main


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--plan" in argv:   # before the heavy imports below: config.json and arithmetic only
        from parallel.plan_cli import main as plan_main
        return plan_main(argv, build_parser(add_help=False), DEMO)
    args, demo = preflight.parse(build_parser(), argv, DEMO)   # no --model and no --data: the demo, DEMO's defaults
    name, ckpt = preflight.check_start(args, demo, code=(LOSS_FN, lr_at, make_optimizer))   # a refusal writes nothing
    # peft and bitsandbytes take seconds to import: only now, past --plan and the flag checks (tests/test_plan.py)
    from model.export import export_adapter
    from parallel import checkpoint, keep_best
    from parallel.fsdp import clip_grad_norm_
    from parallel.parallelize import BuildOptions, build_model, lora_groups, lora_parameters
    # ------------------------------------------------------------------------- process group + mesh
    dt = device_type()
    own_pg, device = init_distributed(dt, guard.pg_timeout(args.timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    run = wd = metrics = stop = None
    try:
        # SIGTERM/SIGINT/SIGUSR1 (schedulers, Ctrl-C, SLURM's warning): all ranks stop at one micro-batch boundary
        stop = signals.StopSignals(rank, log0, guard.pg_timeout(args.timeout))   # NCCL runs: its gloo group, now
        if demo:   # rank 0 builds the demo's assets once (a minute or two on CPU, said as it goes), the others wait;
            # a failure stops every rank, naming it (until 2026-12-07 they waited in a barrier rank 0 never reached)
            guard.on_rank0(lambda: build_demo([os.path.dirname(DEMO["model"])]), "building the demo's assets")
        preflight.same_everywhere(name, args, ckpt)   # one --model and --init-adapter commit, one --resume step
        margs = read_args(args.model, args.rope_scaling)
        dims, args.pack = validate(args, margs, world, say=log0)   # (--lora-targets: this model's, from here)
        dpo = args.objective == "dpo"
        notes.start(args, margs, dims, ckpt, log0, LOSS_FN is None)   # the layout, the loss, what to know
        preflight.model_files(name, args, margs, log0)   # its weights and tokenizer, once the layout passed its checks
        dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]   # (resolved by check_start)
        meshes = dims.build_mesh(dt)

        # --------------------------------------------------------------------- data (before any weight)
        tok = load_tokenizer(args.model, args.chat_template_text)   # one rank a machine tokenizes, the others read it
        (samples, stats), (eval_samples, eval_stats), rows = for_run(   # (dpo: a pair a sample)
            args.objective, *run_data.load_run_data(args, tok, margs.vocab_size, log0), args.dpo_share_prompt)
        ended = notes.resumed(args, argv, demo, ckpt, stats, eval_stats, log0)   # (a run --early-stop ended)
        longest = int(samples.lengths.max())   # the memory plans' length (--max-len is only a cap)
        # every rank's memory; --fast: the memory flags the planner ranks fastest there, the same math, the layout
        # anew; then a run that cannot fit stops here (an eval sample longer than training's: a note)
        dims, plan = preflight_memory.fit(args, margs, dims, world, rank, log0, longest, eval_samples)
        order = GlobalBatches(len(samples), args.global_batch, args.seed, rows)   # (rows: the epochs' shares)
        steps = notes.length(args, order, dpo, ckpt, ended, lr_at, log0)   # (--steps, --epochs, one epoch or ended)
        cp_rank, data_rank = meshes.cp.get_local_rank(), meshes.dp.get_local_rank()
        to_local = LocalBatches(samples, tok, dims, cp_rank, args.pack, dpo, device, margs)   # -> this rank's
        docs = getattr(samples, "sides", lambda i: (int(samples.lengths[i]),))   # a sample's documents' lengths
        noise = NEFTune.of_run(args, samples, dims, data_rank, cp_rank)   # --neftune-alpha's (training forwards only)

        # --------------------------------------------------------------------- model
        run = runs.claim(args.out, resume=args.resume, overwrite=args.overwrite, resolved=ckpt, auto=args.resume_auto)
        args.out = run.path   # (claimed and locked only now: after the data's and the memory's checks)
        log0(f"config: {json.dumps(vars(args), default=str)}")   # final: --fast's flags, the template date, --out
        log0(notes.out_line(run, args, ckpt))
        t0 = time.time()
        torch.manual_seed(args.seed * 4096 + rank)   # LoRA dropout's masks: a function of --seed and the rank
        model, peft_model = build_model(BuildOptions.from_args(args, dtype, plan), fsdp_mesh=meshes.fsdp,
                                        attention=cp_attention(meshes, dims, args.max_len),
                                        linear=cp_linear(meshes, dims), device=device)
        params = lora_parameters(model)
        dpo = dpo and DPO.of_run(model, args, meshes.cp.get_group(), device, dtype)   # (its reference model)
        log0(notes.model_line(model, margs, args, ckpt, dtype, time.time() - t0))

        # --------------------------------------------------------------------- optimizer
        opt = make_optimizer(lora_groups(model, args.lora_plus_ratio), args)   # (LoRA+: B's group, lr_ratio)
        start = checkpoint.load(ckpt, model, opt, steps=steps) if ckpt else 0   # prints where it resumed
        best = keep_best.Best.of_run(args, ckpt, log0)   # --keep-best's (a resume's, if measured alike)
        early = keep_best.EarlyStop.of_run(args, ckpt, log0)   # --early-stop's count (a resume's, likewise)
        here = resume.own_checkpoint(ckpt, args.out)   # resumed from this run's own OUT/ckpt
        metrics, logs = runs.open_files(run, args, dims, stats, eval_samples, branch=here and ckpt,   # rank 0's:
                                        resume_step=start if ckpt else None, log=log0)   # config, metrics, sinks
        dp_cp = meshes.dp_cp.get_group()
        wd = guard.Watchdog(args.timeout * 60, rank).start()
        nonfinite = guard.NonFiniteSteps.of_run(args, ckpt)   # --max-nonfinite's (a resume goes on counting)
        eval_args = (eval_samples, to_local, data_rank, dims.dp, dp_cp, device, LOSS_FN,   # eval samples packed in
                     longest if args.pack else 1, args.eval_positions)   # rows of the plan's length
        if dpo and args.dpo_cache_ref:   # (the steps' and evaluations' reference forwards kept, read once known)
            ref_caches(dpo, args, {"train": samples, "eval": eval_samples}, device, log0)
        way = (args.out, bool(args.resume_auto), bool(args.resume))   # (a stop before any save)
        stop.start()   # (before the baseline evaluation, minutes on a large eval set: a Ctrl-C there is a stop too)
        if eval_samples and start == 0:   # the baseline the eval losses below are compared with
            baseline(model, eval_args, dpo, lambda: wd.phase("eval", 0), log0)
            if got := stop.requested():   # (every rank together)
                raise stop.stopped(got, 0, None, notes.way_on(*way))
        bar = tqdm(total=steps, initial=start, desc="train", file=sys.stdout, leave=False,   # a bar on terminals
                   disable=rank > 0 or args.no_progress or not sys.stdout.isatty())     # only; lines always
        peak_tflops = args.peak_tflops or (dense_bf16_tflops(torch.cuda.get_device_name()) if dt == "cuda" else None)
        meter = (args.mem_phases or args.mem_trace) and phases.PhaseMeter(model, device, args.out, log0, args.mem_trace)
        prof = StepProfiler(args.profile, device, args.out, rank, log0)
        meta = lambda: {"args": vars(args), **best.meta(), **early.meta(), "tie_embeddings": margs.tie_embeddings,
                        "wrapper": margs.wrapper, "nonfinite": nonfinite.state(), "steps_total": steps}
        saves = Saves(args, model, opt, meta, saved=start if here else 0, protect=lambda: best.step, phase=wd.phase)

        # --------------------------------------------------------------------- loop
        for step in range(start, steps):
            wd.phase("data", step + 1)
            prof.begin(step + 1)
            t_step, rng = time.time(), checkpoint.rng_state()   # the RNG as step `step` left it, for a stop's save
            lr = lr_at(step, args, args.schedule_steps or steps)
            set_lr(opt, lr)
            idxs = order.micro_batches(step, data_rank, dims.dp, args.micro_batch, samples.lengths, longest)
            known = bool(dpo) and dpo.known("train", order.step_samples(step))   # (--dpo-cache-ref: no reference)
            micro = [to_local([samples[i] for i in idx] if idx else [to_local.idle]) for idx in idxs]   # (idle: when
            # another rank's --micro-batch auto cut more forwards). The step's GLOBAL target count, known before any
            # backward (DESIGN.md step 5); real (unpadded) tokens are counted once per cp group
            lens = [n for idx in idxs for i in idx for n in docs(i)] if cp_rank == 0 else []   # each document's
            counts = torch.tensor([sum(len(idx) for idx in idxs) * (cp_rank == 0) if dpo else   # (dpo: pairs)
                                   sum(int((lab != IGNORE_INDEX).sum()) for _, _, lab, *_ in micro), sum(lens),
                                   sum(n * flops_per_token(margs, abs(n)) for n in lens) * (
                                       1 + (dpo and dpo.ref and not known) / 3)],   # (dpo: a second forward, the
                                  dtype=torch.float64, device=device)   # reference's, unless its values are known)
            dist.all_reduce(counts, group=dp_cp)
            n_targets = counts[0].clamp(min=1)
            loss_sum = torch.zeros(4, dtype=torch.float64, device=device)   # (dpo: + pairs preferred, rewards)
            hits = torch.zeros((), dtype=torch.int64, device=device)   # (integer: FSDP2's bf16 casts a float: a copy)
            for i, (ids, pos, lab, *sides) in enumerate(micro):
                if got := stop.requested():   # every rank together; this step's partial gradients are dropped
                    raise stop.stopped(got, step, saves.before_stop(step, rng), notes.way_on(*way), way[1])
                with phases.measuring(meter, step == start and i == 0):   # --mem-phases: the first micro-batch
                    wd.phase("forward", step + 1)
                    if dpo:   # each pair's loss, the same on each rank of a cp group: counted once (dpo.once)
                        losses, rewards = dpo(ids, pos, lab, sides[0], len(idxs[i]), idxs[i], known=known)
                        lsum, won = losses.sum(), (rewards[:, 0] > rewards[:, 1]).sum()
                        loss_sum += dpo.once * torch.stack([lsum.detach(), won, *rewards.sum(0)])
                    else:
                        lsum, _ = model(ids, position_ids=pos, labels=lab, loss_fn=LOSS_FN, hits=hits,
                                        noise=noise and noise(step, idxs, i), dft=args.sft_loss == "dft")
                        loss_sum[0] += lsum.detach().double()   # (hits: targets predicted right)
                    wd.phase("backward", step + 1)
                    (lsum / n_targets.float()).backward()
            if dpo and not known:
                dpo.sync("train", dp_cp, order.step_samples(step))
            wd.phase("optimizer", step + 1)
            gnorm = clip_grad_norm_(params, args.clip)
            loss_sum[1] += hits   # (dpo: 0)
            dist.all_reduce(loss_sum, group=dp_cp)
            loss = (loss_sum[0] / n_targets).item()
            if nonfinite.check(step + 1, loss, float(gnorm)):   # same loss and norm on every rank: same choice
                opt.step()
            else:
                log0(f"step {step + 1}: non-finite loss {loss} or grad norm {float(gnorm)}: update skipped")
            opt.zero_grad(set_to_none=True)
            dt_step = time.time() - t_step
            mem = torch.tensor([*phases.step_peaks(meter, device), saves.clock()], device=device)   # (rank 0's clock
            dist.all_reduce(mem, op=dist.ReduceOp.MAX)   # decides --save-minutes for all ranks)
            rec = step_record(step + 1, loss, float(gnorm), lr, int(counts[1].item()), dt_step, world, mem.tolist(),
                              order.epoch(step + 1), nonfinite.skipped,
                              dpo.step_metrics(loss_sum, n_targets) if dpo else   # (dpo: n_targets counts pairs)
                              {"token_acc": rounded((loss_sum[1] / n_targets).item())},   # (top logit = target)
                              cuda=dt == "cuda", profiled=prof.end(step + 1, dt_step),
                              mfu=peak_tflops and counts[2].item() / dt_step / (world * peak_tflops * 1e12))
            halt = False   # --early-stop: this step's evaluation ends the run
            if eval_samples and ((args.eval_every and (step + 1) % args.eval_every == 0) or step + 1 == steps):
                beat = lambda at=step + 1: wd.phase("eval", at)   # per eval row: a long eval is not a stuck rank
                ev = evaluate(model, *eval_args, beat=beat, dpo=dpo or None)   # (eval_loss, each file's of several)
                rec.update({k: rounded(v) for k, v in ev.items()})
                if args.keep_best:   # the same loss on every rank: the same best
                    best.update(step + 1, ev["eval_loss"])
                halt = early.update(step + 1, ev["eval_loss"]) and step + 1 < steps   # (and the same stop)
            guard.on_rank0(lambda r=rec: (metrics.write(r), bar.write(" ".join(f"{k} {v}" for k, v in r.items())),
                                          bar.update(1)), f"writing {logs} (step {step + 1})")   # (above the bar)
            saves.after(step + 1, steps, mem[2].item() or (args.keep_best and "eval_loss" in rec) or halt)
            if halt:
                log0(early.said(step + 1, steps))
                break

        # --------------------------------------------------------------------- save
        bar.close()
        wd.phase("export", steps)
        checkpoint.check_finite(model, "the adapter")
        export_adapter(peft_model, os.path.join(args.out, "adapter"), args.model,
                       rope_parameters=margs.rope_overrides() if args.rope_scaling is not None else None,
                       chat_template=args.chat_template_text, quant=args.quant, model_sha256=args.model_sha256)
        wd.phase("finish", steps)
        runs.close_files(run, args, metrics, best, saves.dir, log0)   # rank 0's last writes, then OUT's lock let go
        wd.stop()   # the last collective is behind
        log0(notes.done_line(args))
    except (OSError, RuntimeError, KeyboardInterrupt) as e:   # (cli's advice names the run's way on)
        e.way_on = (run and run.ours, bool(args.resume_auto), bool(args.resume))   # (None: unclaimed, or not yet its)
        raise
    finally:
        for closing in (stop and stop.close, wd and wd.stop, metrics and metrics.close, run and run.release):
            if closing:
                closing()
        if own_pg and dist.is_initialized():
            dist.destroy_process_group()


def cli(argv=None) -> int:
    """`python train.py ...`: main()'s exit code, and one `error:` line for the errors whose message is the fix."""
    return notes.exit_code(main, argv)


if __name__ == "__main__":
    code = cli()
    # The run is over and its files closed: the interpreter's exit-time collections would walk every object torch,
    # transformers and peft made (~1 s of a core per process, a third of a tiny run's); leave them to the OS
    gc.freeze()
    sys.exit(code)
