"""Train a small causal LM pipeline-parallel on real text, with the practitioner's recipe.

    torchrun --nproc-per-node 2 examples/train_text.py [--text FILE] [--export DIR]

Without ``--text`` the corpus is the Python standard library's own sources (present on every
machine, no download): ``--max-chars`` characters of its ``.py`` files in sorted order. Rank 0
trains a byte-level BPE tokenizer on it (the ``tokenizers`` library) and sends the tokenizer and
the token ids to the other ranks; the last 5% of the tokens are held out for validation.

The model (a Llama from a config, built on ``meta``; or ``--from-pretrained DIR``, a HF directory
such as an earlier ``--export``, whose tokenizer is then reused) trains with AdamW (no weight
decay on biases and norms), linear warmup then cosine decay, ``--accum`` gradient-accumulation
steps, global gradient clipping at 1.0 and optionally bf16 autocast (``--bf16``). Rank 0 shows a
progress bar, prints the training loss and the validation perplexity every ``--eval-every``
steps, and, for comparison, the unigram perplexity of the corpus (a model that knows only the
tokens' frequencies in the training split). About 3 minutes on 2 CPU cores with the defaults.

After training, every rank samples from the pipeline itself with ``pipe.generate`` (each stage
with its own layers' KV cache) and rank 0 prints a greedy continuation of ``--prompt`` and a
sampled one (``--sample-tokens`` new tokens). ``--export DIR`` writes the model with
``save_pretrained`` and the tokenizer as a ``PreTrainedTokenizerFast``; rank 0 then loads both
back with ``transformers`` and prints a sample from ``generate()``.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm import tqdm

import pippy_xla as px

EOS = "<|endoftext|>"


def default_corpus(max_chars: int) -> tuple[str, str]:
    """The standard library's ``.py`` files in sorted order, up to ``max_chars`` characters,
    separated by ``EOS``; and a description."""
    root = Path(os.__file__).parent
    parts, size, files = [], 0, 0
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts or "test" in path.parts or "tests" in path.parts:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        parts.append(text)
        size, files = size + len(text), files + 1
        if size >= max_chars:
            break
    return EOS.join(parts)[:max_chars], f"{files} files of the Python standard library ({root})"


def train_tokenizer(text: str, vocab: int):
    from tokenizers import ByteLevelBPETokenizer

    tok = ByteLevelBPETokenizer()
    tok.train_from_iterator([text], vocab_size=vocab, min_frequency=2, special_tokens=[EOS])
    return tok._tokenizer  # the plain tokenizers.Tokenizer behind the wrapper


def prepare(args, rank: int):
    """On rank 0: the corpus, the tokenizer (trained, or the pretrained model's) and the token
    ids; sent to every rank, so that all of them train on the same batches."""
    from tokenizers import Tokenizer

    payload = [None]
    if rank == 0:
        start = time.perf_counter()
        if args.text:
            text = Path(args.text).read_text(encoding="utf-8")[: args.max_chars]
            source = args.text
        else:
            text, source = default_corpus(args.max_chars)
        if args.from_pretrained:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(args.from_pretrained).backend_tokenizer
        else:
            tok = train_tokenizer(text, args.vocab)
        chunks = text.split(EOS)
        eos = tok.token_to_id(EOS)
        ids: list[int] = []
        for enc in tok.encode_batch(chunks):
            ids += [*enc.ids, eos]
        payload = [
            {
                "tokenizer": tok.to_str(),
                "ids": torch.tensor(ids, dtype=torch.long),
                "about": f"{len(text):,} characters from {source}",
                "seconds": time.perf_counter() - start,
            }
        ]
    dist.broadcast_object_list(payload, src=0)
    data = payload[0]
    data["tokenizer"] = Tokenizer.from_str(data["tokenizer"])
    return data


def unigram_perplexity(train: torch.Tensor, val: torch.Tensor, vocab: int) -> float:
    """exp of the cross-entropy on ``val`` of the training split's token frequencies (add-one
    smoothed): what a model that ignores the context achieves at best."""
    counts = torch.bincount(train, minlength=vocab).double() + 1
    logp = (counts / counts.sum()).log()
    return math.exp(-float(logp[val].mean()))


def windows(ids: torch.Tensor, seq: int, batch: int, generator: torch.Generator):
    """Endless random training batches of ``seq``-token windows (the same on every rank)."""
    while True:
        starts = torch.randint(0, len(ids) - seq, (batch,), generator=generator)
        x = torch.stack([ids[s : s + seq] for s in starts.tolist()])
        yield {"input_ids": x, "attention_mask": torch.ones_like(x), "labels": x}


def evaluate(pipe, val: torch.Tensor, seq: int, batch: int, max_batches: int) -> float:
    """Mean validation loss over consecutive windows of the held-out split."""
    usable = (len(val) // seq) * seq
    rows = val[:usable].view(-1, seq)
    losses = []
    for i in range(0, min(len(rows) // batch, max_batches) * batch, batch):
        x = rows[i : i + batch]
        out = pipe.run_eval(input_ids=x, attention_mask=torch.ones_like(x), labels=x)
        losses.append(float(out.loss))
    return sum(losses) / len(losses)


def build_model(args, vocab: int, eos: int):
    from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig

    if args.from_pretrained:
        config = AutoConfig.from_pretrained(args.from_pretrained)
    else:
        config = LlamaConfig(
            vocab_size=vocab,
            hidden_size=args.hidden,
            intermediate_size=4 * args.hidden,
            num_hidden_layers=args.layers,
            num_attention_heads=max(1, args.hidden // 32),
            num_key_value_heads=max(1, args.hidden // 64),
            max_position_embeddings=args.seq,
            bos_token_id=eos,
            eos_token_id=eos,
        )
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    names = set(model._no_split_modules or [])
    layer_cls = next(type(m) for m in model.modules() if type(m).__name__ in names)
    return model, layer_cls


def optimizer_and_schedule(pipe, args):
    decay = [p for p in pipe.parameters() if p.ndim >= 2]
    no_decay = [p for p in pipe.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
    )
    warmup = max(1, args.steps // 10)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - warmup) / (args.steps - warmup)))

    return opt, torch.optim.lr_scheduler.LambdaLR(opt, factor)


def sample(pipe, tokenizer, args, rank: int, eos: int) -> None:
    """Greedy and sampled continuations of ``--prompt`` from the pipeline itself, on every rank
    (``pipe.generate`` is a collective); rank 0 prints them."""
    prompt = torch.tensor([tokenizer.encode(args.prompt).ids])
    room = pipe.config.max_position_embeddings - prompt.shape[1]
    options = {"max_new_tokens": min(args.sample_tokens, room), "pad_token_id": eos}
    greedy = pipe.generate(prompt, do_sample=False, eos_token_id=eos, **options)
    torch.manual_seed(args.seed)  # the same seed on every rank
    sampled = pipe.generate(prompt, do_sample=True, top_k=20, temperature=0.7, **options)
    if rank == 0:
        print(f"pipe.generate greedy ids: {greedy[0].tolist()}", flush=True)
        print(f"pipe.generate, greedy: {tokenizer.decode(greedy[0].tolist())!r}", flush=True)
        print(f"pipe.generate, sampled: {tokenizer.decode(sampled[0].tolist())!r}", flush=True)


def export(pipe, tokenizer, args, rank: int, eos: int) -> None:
    from transformers import PreTrainedTokenizerFast

    pipe.save_pretrained(args.export)
    if rank == 0:
        fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=EOS, eos_token=EOS)
        fast.save_pretrained(args.export)
    dist.barrier()
    if rank == 0:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(args.export)
        tok = AutoTokenizer.from_pretrained(args.export)
        prompt = tok(args.prompt, return_tensors="pt")
        room = model.config.max_position_embeddings - prompt["input_ids"].shape[1]
        torch.manual_seed(args.seed)
        with torch.no_grad():
            out = model.generate(
                **prompt,
                max_new_tokens=min(64, room),
                do_sample=True,
                top_k=20,
                temperature=0.7,
                pad_token_id=eos,
                eos_token_id=eos,
            )
        print(f"exported to {args.export}; transformers loads it and generates:", flush=True)
        print(tok.decode(out[0]), flush=True)


def main(argv: list[str] | None = None) -> None:
    """The job, on this process's rank (``argv``: the flags, by default the command line's). A
    process group already initialized (ranks started by something other than torchrun) is used."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--text", help="a UTF-8 text file (default: the standard library's sources)")
    p.add_argument("--max-chars", type=int, default=3_000_000)
    p.add_argument("--vocab", type=int, default=2048, help="tokenizer vocabulary size")
    p.add_argument("--from-pretrained", metavar="DIR", help="a HF model directory with tokenizer")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--accum", type=int, default=2, help="gradient-accumulation steps")
    p.add_argument("--steps", type=int, default=150, help="optimizer steps")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--bf16", action="store_true", help="bf16 autocast")
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--eval-batches", type=int, default=16)
    p.add_argument("--export", metavar="DIR", help="save_pretrained + tokenizer, then generate")
    p.add_argument("--prompt", default="def ", help="the generation prompt")
    p.add_argument("--sample-tokens", type=int, default=32, help="new tokens of each sample")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    if not dist.is_initialized():
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    rank = dist.get_rank()
    data = prepare(args, rank)
    tokenizer, ids = data["tokenizer"], data["ids"]
    vocab, eos = tokenizer.get_vocab_size(), tokenizer.token_to_id(EOS)
    split = int(0.95 * len(ids))
    train, val = ids[:split], ids[split:]
    unigram = unigram_perplexity(train, val, vocab)
    if rank == 0:
        print(
            f"corpus: {data['about']}; tokenizer: {vocab} tokens; {len(train):,} training and "
            f"{len(val):,} validation tokens (prepared in {data['seconds']:.1f} s)",
            flush=True,
        )
        print(f"unigram perplexity of the validation split: {unigram:.1f}", flush=True)

    # Each rank initializes its own stage of the meta-built model: seeded, so that a run repeats
    # (torch's default generator starts from a random seed in every process).
    torch.manual_seed(args.seed + rank)
    model, layer_cls = build_model(args, vocab, eos)
    pipe = px.PipelineModel(model, layer_cls=layer_cls, num_microbatches=args.microbatches)
    if args.from_pretrained:
        pipe.load_pretrained(args.from_pretrained)
    opt, sched = optimizer_and_schedule(pipe, args)
    batches = windows(train, args.seq, args.batch, torch.Generator().manual_seed(args.seed))
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16)

    def report(step: int, train_loss: float) -> None:
        val_loss = evaluate(pipe, val, args.seq, args.batch, args.eval_batches)
        if rank == 0:
            bar.write(
                f"step {step:4d}  train loss {train_loss:.4f}  validation loss {val_loss:.4f}  "
                f"perplexity {math.exp(val_loss):.1f} (unigram {unigram:.1f})"
            )

    bar = tqdm(total=args.steps, disable=rank != 0, unit="step")
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        loss = 0.0
        for _ in range(args.accum):
            with autocast:
                loss += float(pipe.run_train(**next(batches))) / args.accum
        for param in pipe.parameters():  # the mean over the accumulation steps
            if param.grad is not None:
                param.grad.div_(args.accum)
        pipe.clip_grad_norm_(1.0)
        opt.step()
        sched.step()
        opt.zero_grad()
        bar.set_postfix(loss=f"{loss:.3f}", lr=f"{sched.get_last_lr()[0]:.1e}")
        bar.update()
        if step % args.eval_every == 0 or step == args.steps:
            report(step, loss)
    bar.close()
    if rank == 0:
        tokens = args.steps * args.accum * args.batch * args.seq
        seconds = time.perf_counter() - start
        print(f"trained on {tokens:,} tokens in {seconds:.0f} s", flush=True)
    sample(pipe, tokenizer, args, rank, eos)
    if args.export:
        export(pipe, tokenizer, args, rank, eos)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
