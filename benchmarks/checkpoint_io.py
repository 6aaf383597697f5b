"""Checkpoint save and load: time and per-rank peak host memory, 2 CPU ranks, a Llama of more
than 500M parameters (fp32), pippy_xla's per-stage paths against a full-state-dict save/load.

Phases, each timed on every rank (the slowest rank counts) with its memory sampled every 2 ms
from ``/proc/self/status``:

- ``build``: the model on ``meta``, wrapped (each rank materializes and initializes its stage);
- ``save_pretrained`` / ``load_pretrained``: HF safetensors, one shard per rank plus the index;
  the load is into a fresh pipeline built on meta;
- ``dcp_save`` / ``dcp_load``: ``pipe.save`` / ``pipe.load`` with the AdamW state (it exists
  before the save; the load is into a fresh AdamW, whose state torch's
  ``get_optimizer_state_dict`` allocates, with a transient zero gradient per parameter);
- ``full_save`` (baseline): every stage's state dict gathered on rank 0, ``torch.save`` to one
  file, as with ``torch.save(model.state_dict())``;
- ``full_load`` (baseline): every rank ``torch.load``s the whole file and keeps its keys with
  ``load_state_dict``.

Memory: ``anon`` is the rank's peak anonymous resident memory (``RssAnon``: what it allocated)
minus its value at the start of the phase; ``rss`` is the peak of ``VmRSS`` (anon plus file pages
mapped, such as safetensors' memory map). Run: ``python benchmarks/checkpoint_io.py``.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path

from _common import Phase, run_ranks, save


def _config(layers: int):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=32000,
        hidden_size=1536,
        intermediate_size=4096,
        num_hidden_layers=layers,
        num_attention_heads=12,
        num_key_value_heads=4,
        tie_word_embeddings=False,
    )


def _meta_pipe(layers: int):
    import torch
    from transformers import LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    import pippy_xla as px

    with torch.device("meta"):
        model = LlamaForCausalLM(_config(layers))
    pipe = px.PipelineModel(model, layer_cls=LlamaDecoderLayer, num_microbatches=2, timeout=600)
    return pipe, sum(p.numel() for p in model.parameters())


def _rank(rank, world, layers, workdir):
    import torch
    import torch.distributed as dist

    work = Path(workdir)
    results: dict = {}
    with Phase("build", results):
        pipe, total_params = _meta_pipe(layers)
    stage_bytes = sum(t.numel() * t.element_size() for t in pipe.state_dict().values())

    with Phase("save_pretrained", results):
        pipe.save_pretrained(work / "hf")
    with Phase("full_save", results):
        everyone = [None] * world if rank == 0 else None
        dist.gather_object(pipe.state_dict(), everyone, dst=0)
        if rank == 0:
            full = {k: v for sd in everyone for k, v in sd.items()}
            torch.save(full, work / "full.pt")
        del everyone
        full = None
        dist.barrier()
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-4)
    for q in pipe.parameters():  # the AdamW state exists before the save, as in training
        q.grad = torch.zeros_like(q)
    opt.step()
    opt.zero_grad(set_to_none=True)
    with Phase("dcp_save", results):
        pipe.save(work / "dcp", optimizer=opt, step=1)
    del pipe, opt

    with Phase("build_again", results):
        pipe, _ = _meta_pipe(layers)
    with Phase("load_pretrained", results):
        pipe.load_pretrained(work / "hf")
    with Phase("full_load", results):
        full = torch.load(work / "full.pt", map_location="cpu")
        pipe.load_state_dict(full)
        del full
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-4)
    with Phase("dcp_load", results):
        step = pipe.load(work / "dcp", optimizer=opt)
    assert step == 1
    return {"total_params": total_params, "stage_bytes": stage_bytes, "phases": results}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--layers", type=int, default=18)
    args = p.parse_args()
    workdir = tempfile.mkdtemp(prefix="pippy_ckpt_")
    try:
        out = run_ranks(2, _rank, args.layers, workdir, timeout=1800, pg_timeout=600)
        sizes = {
            "hf_bytes": sum(f.stat().st_size for f in (Path(workdir) / "hf").glob("*.safetensors")),
            "full_bytes": (Path(workdir) / "full.pt").stat().st_size,
            "dcp_bytes": sum(f.stat().st_size for f in (Path(workdir) / "dcp").rglob("*.distcp")),
        }
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    total = out[0]["total_params"]
    assert total >= 500_000_000, total
    gib = 2**30
    print(f"Llama, {total / 1e6:.0f}M parameters (fp32, {total * 4 / gib:.2f} GiB), 2 ranks")
    for r, o in enumerate(out):
        print(f"rank {r}: stage {o['stage_bytes'] / gib:.2f} GiB")
    print(f"{'phase':<16} {'s (slowest)':>11} {'anon GiB r0':>12} {'r1':>6} {'rss GiB r0':>11}")
    for phase in out[0]["phases"]:
        rows = [o["phases"][phase] for o in out]
        print(
            f"{phase:<16} {max(x['seconds'] for x in rows):>11.2f} "
            f"{rows[0]['anon_bytes'] / gib:>12.2f} {rows[1]['anon_bytes'] / gib:>6.2f} "
            f"{rows[0]['rss_peak_bytes'] / gib:>11.2f}"
        )
    print({k: f"{v / gib:.2f} GiB" for k, v in sizes.items()})
    path = save(
        "checkpoint_io",
        {"model": {"layers": args.layers, "params": total}, "files": sizes, "ranks": out},
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
