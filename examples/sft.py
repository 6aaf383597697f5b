"""Supervised fine-tuning with TRL's ``SFTTrainer``, pipeline-parallel, on real text.

    torchrun --nproc-per-node 2 examples/sft.py [--steps N] [--out DIR]

1. The "pretrained" checkpoint: rank 0 writes a small Llama of its own with ``save_pretrained``
   to ``OUT/base`` with a byte-level tokenizer (random weights standing in for a downloaded
   checkpoint: nothing is fetched).
2. The data: the Python standard library's sources (present on every machine), cut into
   paragraphs, each a document of byte tokens; TRL packs them (``packing=True``) into rows of
   ``--seq`` tokens, positions restarting at every document.
3. ``px.pipelined(SFTTrainer)`` is TRL's trainer with its steps on a pipeline: the same
   ``SFTConfig`` (AdamW, cosine schedule, clipping, gradient accumulation, logging, eval,
   checkpoints) and ``train()``, with ``layer_cls=`` and ``pipeline=px.PipelineConfig(...)``
   added. Every rank loads the base on ``meta`` and takes its stage's weights from the checkpoint
   (``trainer.pipe.load_pretrained``).
   With ``--save-every N`` it checkpoints every N steps and a relaunch resumes from the latest
   checkpoint in ``OUT/run`` (HF's ``get_last_checkpoint``; ``--die-at-step`` tests it), as
   torchrun restarts it: ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --standalone
   --max-restarts 1 --nproc-per-node 2 examples/sft.py --save-every 20`` (the variable: a new
   store per attempt, see docs/checkpoints.md, "Restarts").
4. ``trainer.save_model(OUT/model)`` writes HF's format (every stage's weights) and the tokenizer;
   rank 0 loads it with ``AutoModelForCausalLM.from_pretrained`` in one process, prints its loss on
   a held-out batch next to the pipeline's, and a greedy continuation of ``--prompt``.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
import torch.distributed as dist
from train_text import default_corpus
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    TrainerCallback,
)
from transformers.models.llama.modeling_llama import LlamaDecoderLayer
from transformers.trainer_utils import get_last_checkpoint
from trl import SFTConfig, SFTTrainer

import pippy_xla as px


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """One token per byte (id = byte value), made here: byte 0 pads, byte 3 ends a document."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    chars = bytes_to_unicode()  # byte -> the printable character HF's byte-level BPE uses
    tokenizer = Tokenizer(models.BPE(vocab={chars[b]: b for b in range(256)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token=chars[0], eos_token=chars[3]
    )


def documents(text: str, tokenizer, longest: int) -> list[dict]:
    """The text's paragraphs of 32 bytes or more, each cut to ``longest`` tokens and ended with
    the end-of-document token."""
    eos = tokenizer.eos_token_id
    paragraphs = [p for p in text.split("\n\n") if len(p.encode()) >= 32]
    return [{"input_ids": tokenizer(p)["input_ids"][: longest - 1] + [eos]} for p in paragraphs]


class Die(TrainerCallback):
    """The last rank exits at the end of step ``step``, in the job's first attempt only."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, **kwargs) -> None:
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        last = dist.get_rank() == dist.get_world_size() - 1
        if state.global_step == self.step and first_attempt and last:
            print(f"rank {dist.get_rank()}: killing itself after step {self.step}", flush=True)
            os._exit(1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("sft_out"))
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--max-chars", type=int, default=400_000)
    parser.add_argument("--prompt", default="def ")
    parser.add_argument("--save-every", type=int, default=0, help="checkpoint every N steps")
    parser.add_argument(
        "--die-at-step",
        type=int,
        default=0,
        help="the last rank kills itself after step N (in a "
        "job's first attempt; for the restart test: torchrun --max-restarts 1 resumes it)",
    )
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)

    base = args.out / "base"
    tokenizer = byte_tokenizer()
    if rank == 0:
        torch.manual_seed(0)
        config = LlamaConfig(
            vocab_size=256,
            hidden_size=256,
            intermediate_size=768,
            num_hidden_layers=4,
            num_attention_heads=8,
            num_key_value_heads=2,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
        LlamaForCausalLM(config).save_pretrained(base)
        tokenizer.save_pretrained(base)
    dist.barrier()
    text, source = default_corpus(args.max_chars)
    docs = documents(text, tokenizer, args.seq)
    held_out = len(docs) * 95 // 100
    from datasets import Dataset

    train, evaluation = Dataset.from_list(docs[:held_out]), Dataset.from_list(docs[held_out:])
    if rank == 0:
        print(f"training on {source}: {len(docs):,} paragraphs, {held_out:,} to train on")

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(base))
    trainer = px.pipelined(SFTTrainer)(
        model=model,
        args=SFTConfig(
            output_dir=str(args.out / "run"),
            max_steps=args.steps,
            per_device_train_batch_size=args.batch,
            per_device_eval_batch_size=args.batch,
            learning_rate=args.lr,
            lr_scheduler_type="cosine",
            warmup_steps=args.steps // 10,
            max_grad_norm=1.0,
            packing=True,
            max_length=args.seq,
            bf16=False,
            logging_steps=max(1, args.steps // 10),
            report_to=[],
            save_strategy="steps" if args.save_every else "no",
            save_steps=args.save_every or 500,
            use_cpu=True,
            disable_tqdm=True,
        ),
        train_dataset=train,
        eval_dataset=evaluation,
        processing_class=tokenizer,
        layer_cls=LlamaDecoderLayer,
        pipeline=px.PipelineConfig(num_microbatches=args.microbatches),
        callbacks=[Die(args.die_at_step)] if args.die_at_step else None,
    )
    trainer.pipe.load_pretrained(base)
    last = get_last_checkpoint(str(args.out / "run")) if args.save_every else None
    if last is not None and rank == 0:
        print(f"resuming from {last}", flush=True)
    trainer.train(resume_from_checkpoint=last)
    eval_loss = trainer.evaluate()["eval_loss"]
    trainer.save_model(str(args.out / "model"))
    # A held-out batch as the pipeline takes it (TRL's packed rows, positions restarting per
    # document), for the pipeline and for HF's model loaded in one process.
    held = trainer.data_collator([trainer.eval_dataset[i] for i in range(args.batch)])
    pipe_loss = trainer.pipe.run_eval(**held).loss.item()
    if rank == 0:
        for entry in trainer.state.log_history:
            if "loss" in entry:
                print(f"step {entry['step']:4d}  loss {entry['loss']:.4f}", flush=True)
        model_dir = args.out / "model"
        files = sorted(os.listdir(model_dir))
        print(f"eval loss {eval_loss!r}; model written to {model_dir}: {files}")
        loaded = AutoModelForCausalLM.from_pretrained(model_dir)
        tok = AutoTokenizer.from_pretrained(model_dir)
        prompt = tok(args.prompt, return_tensors="pt")
        with torch.no_grad():
            hf_loss = loaded(**held).loss.item()
            out = loaded.generate(**prompt, max_new_tokens=48, do_sample=False)
        print(f"held-out loss: pipeline {pipe_loss:.4f}, HF in one process {hf_loss:.4f}")
        print(f"HF's greedy continuation of {args.prompt!r}: {tok.decode(out[0])!r}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
