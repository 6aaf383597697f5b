"""Real step time of a planned pipeline against checkpointing every layer and against the
uniform split without checkpointing, on CPU gloo ranks.

``python benchmarks/planner_run.py [--ranks 2] [--layers 8] [--hidden 128]``; prints a table and
saves ``benchmarks/results/planner_run.json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _model(layers: int, hidden: int):
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=256,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    return LlamaForCausalLM(cfg), LlamaDecoderLayer


def _worker(rank, world, port, args, variants, out_path):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120)
    )
    import pippy_xla as px

    results = {}
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (args.batch, args.seq), generator=g)
    batch = dict(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids)
    for name, spec in variants.items():
        model, layer_cls = _model(args.layers, args.hidden)
        pipe = px.PipelineModel(
            model,
            layer_cls=layer_cls,
            num_microbatches=args.microbatches,
            timeout=120,
            plan=px.Plan.from_json(spec),
        )
        times = []
        for step in range(args.steps + 1):
            dist.barrier()
            t = time.perf_counter()
            pipe.run_train(**batch)
            dist.barrier()
            if step:
                times.append(time.perf_counter() - t)
            for p in pipe.parameters():
                p.grad = None
        results[name] = statistics.median(times)
    if rank == 0:
        pathlib.Path(out_path).write_text(json.dumps(results))
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()

    import pippy_xla as px
    from pippy_xla.planner import evaluate, profile_model

    torch.set_num_threads(1)
    model, layer_cls = _model(args.layers, args.hidden)
    prof = profile_model(
        model, layer_cls, microbatch_size=args.batch // args.microbatches, seq_len=args.seq
    )
    uniform = px.balanced_ranges(args.layers, args.ranks)
    plain = evaluate(prof, layer_ranges=uniform, num_microbatches=args.microbatches)
    every = evaluate(
        prof,
        layer_ranges=uniform,
        checkpoint_layers=range(args.layers),
        num_microbatches=args.microbatches,
    )
    limit = (
        max(s.memory_bytes for s in plain.stages) + max(s.memory_bytes for s in every.stages)
    ) // 2
    plan = px.plan(
        model,
        layer_cls=layer_cls,
        num_stages=args.ranks,
        num_microbatches=args.microbatches,
        batch_size=args.batch,
        seq_len=args.seq,
        memory_limit=limit,
        profile=prof,
    )
    print(plan.table())
    for p in (plain, every):
        for st in p.stages:
            st.memory_limit = limit
    variants = {
        "uniform_no_checkpoint": plain.to_json(),
        "checkpoint_all": every.to_json(),
        "plan": plan.to_json(),
    }
    tmp = pathlib.Path("/tmp") / f"planner_run_{os.getpid()}.json"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(args.ranks, port, args, variants, str(tmp)), nprocs=args.ranks)
    measured = json.loads(tmp.read_text())
    tmp.unlink()
    out = {"args": vars(args), "memory_limit": limit}
    for name, p in (("uniform_no_checkpoint", plain), ("checkpoint_all", every), ("plan", plan)):
        out[name] = dict(
            measured_step_s=measured[name],
            predicted_step_s=p.step_time,
            predicted_peak_memory=max(s.memory_bytes for s in p.stages),
            fits=all(s.memory_bytes <= limit for s in p.stages),
            checkpoint_layers=p.checkpoint_layers,
            layer_ranges=p.layer_ranges,
        )
        print(
            f"{name:>22}: measured {measured[name] * 1e3:8.1f} ms/step, predicted "
            f"{p.step_time * 1e3:8.1f} ms, peak memory {out[name]['predicted_peak_memory']} "
            f"(limit {limit}, fits {out[name]['fits']})"
        )
    path = pathlib.Path(__file__).parent / "results" / "planner_run.json"
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(out, indent=1))
    print(f"saved {path}")


if __name__ == "__main__":
    main()
