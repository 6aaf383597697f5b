"""Fine-tune a pretrained causal LM with LoRA (PEFT), pipeline-parallel, on real text.

    torchrun --nproc-per-node 2 examples/finetune_lora.py [--steps N] [--out DIR]

1. The "pretrained" checkpoint: unless ``--base DIR`` names one (a HF directory, such as
   ``train_text.py --export``'s, whose tokenizer is then used), rank 0 writes a small Llama of its
   own with ``save_pretrained`` to ``OUT/base`` (random weights standing in for a downloaded
   checkpoint: nothing is fetched) and the text is read as bytes (token id = byte value).
2. Every rank builds the model on ``meta``, adds LoRA with PEFT's ``get_peft_model`` (r=8 on
   every projection of the decoder layers), wraps it in a ``PipelineModel`` (each rank
   materializes its own stage, PEFT initializing the new adapters) and loads the base weights of
   its stage with ``load_pretrained``.
3. It fine-tunes for ``--steps`` steps on the Python standard library's sources (present on every
   machine) with AdamW over the adapters only, gradients clipped to a global norm of 1.0.
4. ``pipe.save_pretrained(OUT/adapter)`` writes what PEFT writes (``adapter_config.json``,
   ``adapter_model.safetensors``: the adapters of every stage, none of the frozen base).
5. Rank 0 loads the base with ``AutoModelForCausalLM.from_pretrained`` and the adapter with
   ``PeftModel.from_pretrained`` in one process, prints its loss on a held-out batch next to the
   pipeline's, and a greedy continuation of ``--prompt`` from PEFT's ``generate``.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
import torch.distributed as dist
from peft import LoraConfig, PeftModel, get_peft_model
from train_text import default_corpus
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

import pippy_xla as px

PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def batches(ids: torch.Tensor, batch: int, seq: int, seed: int):
    """Random windows of ``seq + 1`` tokens, the same on every rank (one seed)."""
    g = torch.Generator().manual_seed(seed)
    while True:
        starts = torch.randint(0, len(ids) - seq - 1, (batch,), generator=g)
        rows = torch.stack([ids[s : s + seq] for s in starts.tolist()])
        yield {"input_ids": rows, "attention_mask": torch.ones_like(rows), "labels": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base", type=Path, help="a HF checkpoint directory (default: write one)")
    parser.add_argument("--out", type=Path, default=Path("lora_out"))
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--max-chars", type=int, default=400_000)
    parser.add_argument("--prompt", default="def ")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)

    base = args.base or args.out / "base"
    if args.base is None and rank == 0:
        torch.manual_seed(0)
        config = LlamaConfig(
            vocab_size=256,
            hidden_size=256,
            intermediate_size=768,
            num_hidden_layers=4,
            num_attention_heads=8,
            num_key_value_heads=2,
        )
        LlamaForCausalLM(config).save_pretrained(base)
    dist.barrier()
    text, source = default_corpus(args.max_chars)
    if args.base is None:
        encode = lambda s: torch.tensor(list(s.encode()), dtype=torch.long)  # noqa: E731
        decode = lambda ids: bytes(ids).decode(errors="replace")  # noqa: E731
    else:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(base)
        encode = lambda s: torch.tensor(tokenizer(s)["input_ids"])  # noqa: E731
        decode = tokenizer.decode
    ids = encode(text)
    split = int(len(ids) * 0.95)

    # Build on meta, add the adapters, pipeline, then load the base weights of this stage.
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(base))
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=PROJECTIONS))
    pipe = px.PipelineModel(model, num_microbatches=args.microbatches)
    pipe.load_pretrained(base)
    trainable = [p for p in pipe.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=args.lr)
    if rank == 0:
        total = sum(p.numel() for p in pipe.parameters())
        print(f"training on {source}: {len(ids):,} tokens")
        print(f"rank 0 trains {sum(p.numel() for p in trainable):,} of its {total:,} parameters")

    data = batches(ids[:split], args.batch, args.seq, seed=0)
    for step in range(args.steps):
        loss = pipe.run_train(**next(data))
        pipe.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
        if rank == 0 and (step % 10 == 0 or step == args.steps - 1):
            print(f"step {step:4d}  loss {loss.item():.4f}", flush=True)

    pipe.save_pretrained(args.out / "adapter")
    held_out = next(batches(ids[split:], args.batch, args.seq, seed=1))
    pipe_loss = pipe.run_eval(**held_out).loss.item()
    if rank == 0:
        files = sorted(os.listdir(args.out / "adapter"))
        print(f"adapter written to {args.out / 'adapter'}: {files}")
        peft_model = PeftModel.from_pretrained(
            AutoModelForCausalLM.from_pretrained(base), args.out / "adapter"
        )
        with torch.no_grad():
            peft_loss = peft_model(**held_out).loss.item()
            prompt = encode(args.prompt)[None]
            out = peft_model.generate(
                input_ids=prompt,
                attention_mask=torch.ones_like(prompt),
                max_new_tokens=48,
                do_sample=False,
                pad_token_id=0,
            )
        print(f"held-out loss: pipeline {pipe_loss:.4f}, PEFT in one process {peft_loss:.4f}")
        print(f"PEFT's greedy continuation of {args.prompt!r}: {decode(out[0].tolist())!r}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
