"""Train a small Llama pipeline-parallel on CPU ranks.

    torchrun --nproc-per-node 2 examples/train_llama.py [--steps 60] [--microbatches 4]

Each rank builds the model on the ``meta`` device (no rank ever holds the full model),
materializes only its own stage, and trains on a synthetic, learnable task (arithmetic
progressions modulo the vocabulary): the loss starts near ln(vocab) (6.24) and falls by about a
third over the default 60 steps (to about 4.1; about 50 s on 2 CPU cores). Rank 0 shows a progress
bar and prints the loss and throughput every 10 steps; the last rank prints the stage layout.

Checkpoints (any rank count can resume what another saved; ``--export`` writes a HF checkpoint
that ``AutoModelForCausalLM.from_pretrained`` loads):

    torchrun --nproc-per-node 2 examples/train_llama.py --steps 30 --save-every 10 \
        --checkpoint-dir ckpt
    torchrun --nproc-per-node 4 examples/train_llama.py --resume ckpt --export trained

Restarts: with ``--resume DIR --save-every 1`` every step is saved into ``DIR`` and a (re)started
job continues from the latest checkpoint there (a first run finds none and starts at step 0), so
torchrun's ``--max-restarts`` recovers a job whose rank died. ``--die-at-step N`` makes one rank
(``--die-rank``, the last by default) SIGKILL itself at step ``N`` of the first attempt only
(torchrun's ``TORCHELASTIC_RESTART_COUNT`` is 0), to try it:

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nnodes 2 --nproc-per-node 2 \
        --rdzv-backend c10d --rdzv-endpoint HOST:29400 --max-restarts 1 examples/train_llama.py \
        --resume ckpt --save-every 1 --die-at-step 20
    # and the same on the second machine (or in a second shell)

(The variable gives each attempt a new store: torch's default keeps the killed attempt's keys,
which the restarted ranks would read; docs/checkpoints.md, "Restarts".)
"""

from __future__ import annotations

import argparse
import datetime
import os
import signal
import time

import torch
import torch.distributed as dist
from tqdm import tqdm
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

import pippy_xla as px


def batches(steps, batch, seq, vocab, seed=0):
    """The same sequence of batches on every rank and in every run (a resumed run skips the
    ones it has trained on)."""
    g = torch.Generator().manual_seed(seed)
    t = torch.arange(seq)
    for _ in range(steps):
        start = torch.randint(0, vocab, (batch, 1), generator=g)
        stride = torch.randint(1, 8, (batch, 1), generator=g)
        ids = (start + stride * t) % vocab
        yield {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def main(argv: list[str] | None = None) -> None:
    """The job, on this process's rank (``argv``: the flags, by default the command line's). A
    process group already initialized (ranks started by something other than torchrun, a
    test's) is used as it is."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument(
        "--schedule",
        default="1f1b",
        help="a training schedule: 1f1b, gpipe, interleaved, zbh1, looped_bfs, interleaved_zb, "
        "zbv, dualpipev (the V and interleaved ones need layers for 2 stages per rank)",
    )
    p.add_argument(
        "--tune-after",
        type=int,
        default=-1,
        metavar="N",
        help="zbh1, interleaved_zb, zbv: after step N, reorder the schedule for the costs "
        "measured in that step (PipelineModel.tune_schedule)",
    )
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument(
        "--max-grad-norm", type=float, default=1.0, help="global gradient clipping (0: off)"
    )
    p.add_argument(
        "--device", default="cpu", choices=["cpu", "cuda"], help="cuda: NCCL, GPU LOCAL_RANK"
    )
    p.add_argument(
        "--checkpoint-dir", help="where --save-every saves (default: --resume's DIR or checkpoints)"
    )
    p.add_argument("--save-every", type=int, default=0, metavar="N", help="save every N steps")
    p.add_argument(
        "--resume",
        metavar="DIR",
        help="continue from the latest checkpoint in DIR (none yet: start at step 0)",
    )
    p.add_argument(
        "--die-at-step",
        type=int,
        metavar="N",
        help="--die-rank SIGKILLs itself at step N, on torchrun's first attempt only",
    )
    p.add_argument("--die-rank", type=int, default=-1, help="which rank --die-at-step kills")
    p.add_argument("--timeout", type=float, default=120, help="seconds any wait on a peer may take")
    p.add_argument("--export", metavar="DIR", help="write the trained model as a HF checkpoint")
    args = p.parse_args(argv)
    if args.tune_after >= 0:
        try:
            tunable = px.schedule_info(args.schedule).list_scheduled
        except RuntimeError:  # an unknown name: PipelineModel's error lists the schedules
            tunable = True
        if not tunable:
            p.error(f"--tune-after: {args.schedule!r} has a fixed order; use zbh1, interleaved_zb "
                    "or zbv")  # fmt: skip

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    backend = "nccl" if args.device == "cuda" else "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=args.timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    checkpoint_dir = args.checkpoint_dir or args.resume or "checkpoints"
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    dies = args.die_at_step is not None and first_attempt and rank == args.die_rank % world
    torch.manual_seed(rank)

    config = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=args.seq,
    )
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    pipe = px.PipelineModel(
        model,
        layer_cls=LlamaDecoderLayer,
        num_microbatches=args.microbatches,
        schedule=args.schedule,
        timeout=args.timeout,
    )
    opt = torch.optim.AdamW(pipe.parameters(), lr=args.lr)
    first = 0
    if args.resume:
        found = pipe.load(args.resume, optimizer=opt, missing_ok=True)
        first = found or 0
        if rank == 0 and found is None:
            print(f"no checkpoint in {args.resume} yet: starting at step 0", flush=True)
        elif rank == 0:
            print(f"resumed from {args.resume} at step {first}", flush=True)
    if rank == world - 1:
        for s in range(pipe.num_stages):
            print(f"stage {s}: layers {pipe.layers_of_stage(s)}", flush=True)

    bar = tqdm(total=args.steps, initial=first, disable=rank != 0, unit="step")
    tokens = args.batch * args.seq
    for step, batch in enumerate(batches(args.steps, args.batch, args.seq, args.vocab)):
        if step < first:
            continue
        if dies and step == args.die_at_step:
            print(f"rank {rank}: killing itself at step {step} (--die-at-step)", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        start = time.perf_counter()
        loss = pipe.run_train(**batch)
        if args.max_grad_norm > 0:  # the whole model's norm, not this stage's
            pipe.clip_grad_norm_(args.max_grad_norm)
        opt.step()
        opt.zero_grad()
        elapsed = time.perf_counter() - start
        bar.set_postfix(loss=f"{loss.item():.4f}", tok_s=f"{tokens / elapsed:,.0f}")
        bar.update()
        if rank == 0 and (step % 10 == 0 or step == args.steps - 1):
            bar.write(f"step {step:4d}  loss {loss.item():.4f}  {tokens / elapsed:,.0f} tokens/s")
        if step == args.tune_after:
            order = pipe.tune_schedule()  # a collective: every rank
            if rank == 0:
                bar.write(f"step {step:4d}  {order.name} reordered for this step's costs")
        if args.save_every and (step + 1) % args.save_every == 0:
            saved = pipe.save(checkpoint_dir, optimizer=opt, step=step + 1)
            if rank == 0:
                bar.write(f"saved {saved}")
    bar.close()
    if rank == 0 and first < args.steps:
        print(f"final loss {loss.item()!r}", flush=True)  # every bit, to compare runs
    if args.export:
        pipe.save_pretrained(args.export)
        if rank == 0:
            print(f"exported to {args.export} (AutoModelForCausalLM.from_pretrained loads it)")
    if rank == 0:
        print(f"stash peak on stage 0: {pipe.stash_peak_bytes / 2**20:.2f} MiB", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
