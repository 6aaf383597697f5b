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
"""

from __future__ import annotations

import argparse
import datetime
import os
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--schedule", default="1f1b", choices=["1f1b", "gpipe"])
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument(
        "--max-grad-norm", type=float, default=1.0, help="global gradient clipping (0: off)"
    )
    p.add_argument(
        "--device", default="cpu", choices=["cpu", "cuda"], help="cuda: NCCL, GPU LOCAL_RANK"
    )
    p.add_argument("--checkpoint-dir", default="checkpoints", help="where --save-every saves")
    p.add_argument("--save-every", type=int, default=0, metavar="N", help="save every N steps")
    p.add_argument("--resume", metavar="DIR", help="continue from the latest checkpoint in DIR")
    p.add_argument("--export", metavar="DIR", help="write the trained model as a HF checkpoint")
    args = p.parse_args()

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    backend = "nccl" if args.device == "cuda" else "gloo"
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
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
    )
    opt = torch.optim.AdamW(pipe.parameters(), lr=args.lr)
    first = 0
    if args.resume:
        first = pipe.load(args.resume, optimizer=opt) or 0
        if rank == 0:
            print(f"resumed from {args.resume} at step {first}", flush=True)
    if rank == world - 1:
        for s in range(world):
            print(f"stage {s}: layers {pipe.layers_of_stage(s)}", flush=True)

    bar = tqdm(total=args.steps, initial=first, disable=rank != 0, unit="step")
    tokens = args.batch * args.seq
    for step, batch in enumerate(batches(args.steps, args.batch, args.seq, args.vocab)):
        if step < first:
            continue
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
        if args.save_every and (step + 1) % args.save_every == 0:
            saved = pipe.save(args.checkpoint_dir, optimizer=opt, step=step + 1)
            if rank == 0:
                bar.write(f"saved {saved}")
    bar.close()
    if args.export:
        pipe.save_pretrained(args.export)
        if rank == 0:
            print(f"exported to {args.export} (AutoModelForCausalLM.from_pretrained loads it)")
    if rank == 0:
        print(f"stash peak on stage 0: {pipe.stash_peak_bytes / 2**20:.2f} MiB", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
