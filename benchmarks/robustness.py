"""Robustness: clean exits, fault handling, and long runs, on CPU ranks (gloo, tiny Llama).

    python benchmarks/robustness.py stress [--runs2 100 --runs4 50]
    python benchmarks/robustness.py faults [--trials 20] [--worlds 2,4] [--cases kill,save_kill]
    python benchmarks/robustness.py readme
    python benchmarks/robustness.py soak [--steps 2000]
    python benchmarks/robustness.py exit [--runs 100]

Every rank is its own plain subprocess (env:// rendezvous), so each rank's exit status, and a
death by a signal, is seen directly.

- ``stress``: normal runs (build, train 3 steps, evaluate, ``all_gather_object``,
  ``destroy_process_group``, exit) on 2 and 4 ranks; counts non-zero exits and signal deaths.
- ``faults``: each fault on 2 and 4 ranks (``--worlds``), ``--trials`` times: the last rank
  killed (SIGKILL) mid-step or between steps, the last rank's loss raising while its process
  lives on (8 s), ranks given batches of another sequence length or dtype, and the collectives
  outside the engine ([Note: watched collectives]): on a data x pipeline mesh (2 x 1, 2 x 2) the
  last rank's loss raising before FSDP's reductions, a GPT-2 tied-weight gradient sum raising on
  the last rank, a checkpoint ``save`` raising on the last rank (both living on 8 s), and the
  last rank SIGKILLed while ``save`` writes its shard (then the previous checkpoint must still
  be the latest and the partial one incomplete). Reports hangs (a rank still running after
  120 s), signal deaths other than the killed rank, the error each survivor raised (and where),
  how many survivors named the faulty rank (a killed one with ``died``), and the time from the
  fault to the last survivor's error and to its exit. ``--cases`` runs some of them; the results
  are merged into the JSON, and the table in ``docs/benchmarks.md`` is regenerated from it
  (``readme`` does only that).
- ``soak``: ``--steps`` training steps on 2 ranks; resident memory, threads and open files at
  step 100 and at the end.
- ``exit``: ``--runs`` times per arm (see ``_exit_after_collective``), rank 0 exits right after
  its last broadcast: through ``torch.distributed`` or the pipeline's own ``_C.broadcast_copy``,
  with the group alive, or destroyed but still held, with and without pippy_xla's exit hook.
  Counts rank 0's exit codes and signals (see [Note: collectives on C++-owned buffers] in
  csrc/transport/p2p.h).

Results go to ``benchmarks/results/robustness_<mode>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

from _common import RESULTS, ROOT, llama_config, save, token_batch

HANG_S = 120.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(world: int, mode: str, arg: str) -> list[dict]:
    """Runs ``world`` ranks of this file's worker; returns each rank's exit, timing and report."""
    port = _free_port()
    procs, outs = [], []
    for rank in range(world):
        env = {
            **os.environ,
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "WORLD_SIZE": str(world),
            "OMP_NUM_THREADS": "1",
        }
        out = Path(f"/tmp/pippy_robust_{port}_{rank}.json")
        out.unlink(missing_ok=True)
        outs.append(out)
        cmd = [sys.executable, __file__, "worker", mode, arg, str(out)]
        procs.append(
            subprocess.Popen(
                cmd, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
            )
        )
    start = time.time()
    exits: dict[int, float] = {}
    while len(exits) < world and time.time() - start < HANG_S:
        for r, p in enumerate(procs):
            if r not in exits and p.poll() is not None:
                exits[r] = time.time()
        time.sleep(0.01)
    base = f"/tmp/pippy_robust_{port}"
    checks = _checkpoints_after_kill(base) if arg == "save_kill" else {}
    shutil.rmtree(f"{base}_ckpt", ignore_errors=True)
    Path(f"{base}_{world - 1}.json.fault").unlink(missing_ok=True)
    results = []
    for r, p in enumerate(procs):
        hung = r not in exits
        if hung:
            p.kill()
        p.wait()
        stderr = p.stderr.read().decode(errors="replace")
        report = json.loads(outs[r].read_text()) if outs[r].exists() else {}
        outs[r].unlink(missing_ok=True)
        results.append(
            {
                "rank": r,
                "returncode": p.returncode,
                "signal": signal.Signals(-p.returncode).name if p.returncode < 0 else None,
                "hung": hung,
                "exit_time": exits.get(r),
                "report": report,
                "stderr_tail": stderr[-600:] if p.returncode else "",
                "checks": checks,
            }
        )
    return results


# ----------------------------------------------------------------------------- worker


def _worker(mode: str, arg: str, out: str) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    if mode == "exit":
        _exit_after_collective(rank, arg)
        return
    if mode == "faults" and arg in WATCHED_FAULTS:
        _watched_fault(rank, world, arg, out)
        dist.destroy_process_group()
        return

    from transformers import LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    import pippy_xla as px

    def make_batch(seed: int, seq: int = 16) -> dict:
        return token_batch(8, seq, 256, seed=seed)

    torch.manual_seed(0)
    model = LlamaForCausalLM(llama_config(layers=4, hidden=64, vocab=256))
    pipe = px.PipelineModel(model, layer_cls=LlamaDecoderLayer, num_microbatches=2, timeout=60)
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-3)
    report: dict = {}

    def write() -> None:
        Path(out).write_text(json.dumps(report))

    if mode == "stress":
        for step in range(3):
            pipe.run_train(**make_batch(seed=step))
            opt.step()
            opt.zero_grad()
        loss = pipe.run_eval(**make_batch(seed=9)).loss
        everyone = [None] * world
        dist.all_gather_object(everyone, float(loss))
        report["ok"] = len(set(everyone)) == 1
    elif mode == "faults":
        batch = make_batch(seed=0)
        pipe.run_train(**batch)
        last = world - 1
        if rank == last and arg == "kill_between":  # killed between steps
            Path(out + ".fault").write_text(str(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        if rank == last and arg in ("kill", "raise"):

            def faulty(*a):
                Path(out + ".fault").write_text(str(time.time()))
                if arg == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                raise ValueError("loss exploded")

            pipe.loss_fn = faulty
        if rank == last and arg == "shape":
            batch = make_batch(seed=0, seq=12)
        if rank == last and arg == "dtype":
            batch = {**batch, "input_ids": batch["input_ids"].int()}
        if arg in ("shape", "dtype"):
            report["fault_time"] = time.time()
        try:
            pipe.run_train(**batch)
            report["error"] = None
        except px.PipelineError as e:
            report.update(_error_report(e))
        fault_file = Path(out.rsplit("_", 1)[0] + f"_{last}.json.fault")
        if fault_file.exists():
            report["fault_time"] = float(fault_file.read_text())
        if arg == "raise" and rank == last:
            write()
            time.sleep(8)  # lives on: its peers must not depend on its exit
    elif mode == "soak":
        steps = int(arg)

        def probe() -> dict:
            status = dict(
                line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines()
            )
            return {
                "rss_bytes": int(status["VmRSS"].split()[0]) * 1024,
                "threads": int(status["Threads"]),
                "fds": len(os.listdir("/proc/self/fd")),
            }

        t0 = time.perf_counter()
        for step in range(steps):
            pipe.run_train(**make_batch(seed=step % 16))
            opt.step()
            opt.zero_grad()
            if step + 1 == 100:
                report["at_100"] = probe()
        report["at_end"] = probe()
        report["steps_per_s"] = steps / (time.perf_counter() - t0)
    dist.destroy_process_group()
    write()


def _error_report(e) -> dict:
    return {
        "error": type(e).__name__,
        "failed_rank": e.failed_rank,
        "died": e.died,
        "peer": e.peer,
        "action": e.action,
        "error_time": time.time(),
    }


WATCHED_FAULTS = ("mesh_raise", "tie_raise", "save_raise", "save_kill")


def _watched_fault(rank: int, world: int, case: str, out: str) -> None:
    """A fault in a collective outside the engine, on the last rank (see the module's doc)."""
    import torch

    import pippy_xla as px
    import pippy_xla.checkpoint as ckpt

    last = world - 1
    report: dict = {}
    base = out.rsplit("_", 1)[0]
    fault_file = Path(f"{base}_{last}.json.fault")

    def fault() -> None:
        fault_file.write_text(str(time.time()))

    def batch(seed: int) -> dict:
        return token_batch(8, 16, 256, seed=seed)

    torch.manual_seed(0)
    if case == "tie_raise":
        from transformers import GPT2Config, GPT2LMHeadModel
        from transformers.models.gpt2.modeling_gpt2 import GPT2Block

        config = GPT2Config(
            vocab_size=256, n_embd=64, n_layer=4, n_head=4, n_positions=128, resid_pdrop=0.0
        )
        config.embd_pdrop = config.attn_pdrop = 0.0
        model, layer_cls, options = GPT2LMHeadModel(config), GPT2Block, {}
    else:
        from transformers import LlamaForCausalLM
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer

        model = LlamaForCausalLM(llama_config(layers=4, hidden=64, vocab=256))
        layer_cls, options = LlamaDecoderLayer, {}
        if case == "mesh_raise":
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "pp"))
            options = {"mesh": mesh, "data_parallel": "shard"}
    pipe = px.PipelineModel(model, layer_cls=layer_cls, num_microbatches=2, timeout=60, **options)
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-3)
    pipe.run_train(**batch(0))
    opt.step()
    directory = f"{base}_ckpt"
    if case.startswith("save"):
        pipe.save(directory, optimizer=opt, step=1)
    if rank == last and case == "mesh_raise":

        def raising_loss(*a):
            fault()
            raise ValueError("loss exploded")

        pipe.loss_fn = raising_loss
    if rank == last and case == "tie_raise":

        def raising_sum():
            fault()
            raise OSError("tied gradient lost")

        pipe._runner._sum_tied_grads = raising_sum
    if rank == last and case == "save_raise":

        def raising_state(*a):
            fault()
            raise OSError("no space left on device")

        ckpt._optimizer_state = raising_state
    if rank == last and case == "save_kill":
        from torch.distributed.checkpoint import FileSystemWriter

        def killed_write(self, *a, **k):
            fault()
            os.kill(os.getpid(), signal.SIGKILL)

        FileSystemWriter.write_data = killed_write
    try:
        if case.startswith("save"):
            pipe.run_train(**batch(1))
            pipe.save(directory, optimizer=opt, step=2)
        else:
            pipe.run_train(**batch(1))
        report["error"] = None
    except px.PipelineError as e:
        report.update(_error_report(e))
    if fault_file.exists():
        report["fault_time"] = float(fault_file.read_text())
    Path(out).write_text(json.dumps(report))
    if rank == last and case.endswith("raise"):
        time.sleep(8)  # lives on: its peers must not depend on its exit


def _checkpoints_after_kill(base: str) -> dict:
    """After ``save_kill``: whether the previous checkpoint is still the latest and complete,
    and the partial one incomplete (refused by ``load``)."""
    directory = Path(f"{base}_ckpt")
    latest = directory / "latest"
    named = latest.read_text().strip() if latest.is_file() else None
    previous_ok = named == "step-00000001" and (directory / named / ".metadata").is_file()
    partial = directory / ".step-00000002.partial"
    refused = not (partial / ".metadata").exists()
    return {"previous_loadable": previous_ok, "partial_refused": refused}


EXIT_ARMS = ("torch", "pippy_xla", "held", "held_hook")


def _exit_after_collective(rank: int, arm: str) -> None:
    """Rank 0 exits as soon as its last broadcast returns.

    - ``torch``: ``dist.broadcast`` of a Python tensor, the group alive at exit (as it is while
      a PipelineModel holds it).
    - ``pippy_xla``: the pipeline's own loss broadcast, ``_C.broadcast_copy`` ([Note:
      collectives on C++-owned buffers]).
    - ``held``: ``dist.broadcast``, then ``destroy_process_group``, while an object still holds
      the group (as a PipelineModel does).
    - ``held_hook``: the same, the holder registered where pippy_xla's exit hook releases it
      ([Note: releasing the group at exit]).
    """
    import torch
    import torch.distributed as dist

    from pippy_xla import _C
    from pippy_xla.runtime._exit import release_at_exit
    from pippy_xla.runtime.ops import group_name_of

    class Holder:  # holds the group as a PipelineModel does: in an instance attribute
        def __init__(self) -> None:
            self.group = dist.group.WORLD

    holder = Holder()
    if arm == "held_hook":
        release_at_exit(holder, "group")
    name = group_name_of(dist.group.WORLD)
    t = torch.ones(1000)
    if rank == 1:
        time.sleep(0.01)  # rank 0 waits in its broadcast, so it exits right after completion
    for _ in range(3):
        if arm == "pippy_xla":
            t = _C.broadcast_copy(t, 1, name, 60_000, "broadcast")
        else:
            dist.broadcast(t, src=1)
    if arm.startswith("held"):
        dist.destroy_process_group()
    if rank == 1:
        time.sleep(1)


# ----------------------------------------------------------------------------- modes


def _exit(runs: int, arms: list[str]) -> dict:
    summary = {}
    for how in arms:
        codes: dict[str, int] = {}
        for _ in range(runs):
            r = _launch(2, "exit", how)[0]
            key = r["signal"] or f"exit code {r['returncode']}"
            codes[key] = codes.get(key, 0) + 1
            if r["returncode"]:
                summary.setdefault(f"{how}_stderr", r["stderr_tail"])
        summary[how] = {"runs": runs, "rank_0_exits": codes}
        print(how, json.dumps(summary[how]), flush=True)
    return summary


def _stress(runs2: int, runs4: int) -> dict:
    summary = {}
    for world, runs in ((2, runs2), (4, runs4)):
        bad = []
        for i in range(runs):
            for r in _launch(world, "stress", "-"):
                if r["returncode"] != 0 or r["hung"] or not r["report"].get("ok"):
                    bad.append({"run": i, **r})
        summary[f"{world}_ranks"] = {"runs": runs, "bad_exits": len(bad), "bad": bad[:10]}
        print(f"{world} ranks: {runs} runs, {len(bad)} bad rank exits", flush=True)
    return summary


FAULTS = ("kill", "kill_between", "raise", "shape", "dtype", *WATCHED_FAULTS)


def _faults(trials: int, worlds: list[int], cases: list[str]) -> dict:
    summary: dict = {}
    for world in worlds:
        last = world - 1
        for case in cases:
            killed = "kill" in case
            hangs = signals = named = counted = 0
            delays, to_error, errors = [], [], {}
            checks = {"previous_loadable": 0, "partial_refused": 0}
            for _ in range(trials):
                results = _launch(world, "faults", case)
                survivors = [r for r in results if not (killed and r["rank"] == last)]
                if case.endswith("raise"):
                    survivors = [r for r in results if r["rank"] != last]  # it lives on, 8 s
                hangs += sum(r["hung"] for r in results)
                signals += sum(
                    1 for r in results if r["signal"] and not (killed and r["rank"] == last)
                )
                for r in survivors:
                    rep = r["report"]
                    key = f"{rep.get('error')} (failed_rank {rep.get('failed_rank')})"
                    if case in WATCHED_FAULTS:
                        key += f" in {rep.get('action')}"
                    errors[key] = errors.get(key, 0) + 1
                    counted += 1
                    if case in ("shape", "dtype"):  # each rank names the other side
                        named += r["rank"] == last or rep.get("peer") == last
                    else:
                        named += rep.get("failed_rank") == last and (rep.get("died") or not killed)
                for k in checks:
                    checks[k] += bool(results[0]["checks"].get(k))
                fault = next(
                    (r["report"]["fault_time"] for r in survivors if "fault_time" in r["report"]),
                    None,
                )
                ends = [r["exit_time"] for r in survivors if r["exit_time"] is not None]
                raised = [r["report"].get("error_time") for r in survivors]
                if fault is not None and ends:
                    delays.append(max(ends) - fault)
                if fault is not None and raised and None not in raised:
                    to_error.append(max(raised) - fault)
            result = {
                "ranks": world,
                "trials": trials,
                "hangs": hangs,
                "signal_deaths": signals,
                "survivors_naming_the_faulty_rank": f"{named} of {counted}",
                "survivor_errors": errors,
                "fault_to_last_survivor_error_s": _median_max(to_error),
                "fault_to_last_survivor_exit_s": _median_max(delays),
            }
            if case == "save_kill":
                result["checkpoints"] = {k: f"{v} of {trials}" for k, v in checks.items()}
            summary[f"{case} ({world} ranks)"] = result
            print(case, json.dumps(result), flush=True)
    return summary


def _median_max(xs: list[float]) -> dict:
    return {
        "median": statistics.median(xs) if xs else None,
        "max": max(xs) if xs else None,
        "n": len(xs),
    }


# The page whose fault table the ``readme`` mode writes.
TABLE_PAGE = ROOT / "docs" / "benchmarks.md"
TABLE_BEGIN = "<!-- fault table: generated by benchmarks/robustness.py readme, do not edit -->"
TABLE_END = "<!-- end of fault table -->"
FAULT_NAMES = {
    "kill": "last rank SIGKILLed inside a step",
    "kill_between": "last rank SIGKILLed between steps",
    "raise": "last rank's loss raises, its process lives on",
    "shape": "last rank given another sequence length",
    "dtype": "last rank given another dtype",
    "mesh_raise": "mesh (2 x ranks/2, FSDP shard): last rank's loss raises, lives on",
    "tie_raise": "GPT-2: last rank's tied-weight gradient sum raises, lives on",
    "save_raise": "`save`: last rank raises inside it, lives on",
    "save_kill": "`save`: last rank SIGKILLed while writing its shard",
}


def _seconds(d: dict | None) -> str:
    if not d or d.get("median") is None:
        return "-"
    return f"{d['median']:.2f} ({d['max']:.2f})"


def _readme_table(results: dict) -> str:
    """The fault table of ``docs/benchmarks.md``: the ``faults`` results (see ``readme``)."""
    lines = [
        TABLE_BEGIN,
        "",
        "| fault | ranks | trials | hangs | signal deaths | survivors naming the faulty rank "
        "| fault to last survivor's error, s median (max) | fault to last survivor's exit, s "
        "median (max) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for case, title in FAULT_NAMES.items():
        for world in (2, 4):
            r = results.get(f"{case} ({world} ranks)")
            if r is None:
                continue
            named = r["survivors_naming_the_faulty_rank"]
            if "checkpoints" in r:
                c = r["checkpoints"]
                named += (
                    f"; previous checkpoint still the latest: {c['previous_loadable']}, "
                    f"partial one incomplete: {c['partial_refused']}"
                )
            lines.append(
                f"| {title} | {world} | {r['trials']} | {r['hangs']} | {r['signal_deaths']} "
                f"| {named} | {_seconds(r.get('fault_to_last_survivor_error_s'))} "
                f"| {_seconds(r.get('fault_to_last_survivor_exit_s'))} |"
            )
    return "\n".join([*lines, "", TABLE_END])


def _write_readme(results: dict) -> None:
    text = TABLE_PAGE.read_text()
    begin, end = text.index(TABLE_BEGIN), text.index(TABLE_END) + len(TABLE_END)
    TABLE_PAGE.write_text(text[:begin] + _readme_table(results) + text[end:])


def _soak(steps: int) -> dict:
    results = _launch(2, "soak", str(steps))
    summary = {"steps": steps, "ranks": []}
    for r in results:
        rep = r["report"]
        a, b = rep.get("at_100", {}), rep.get("at_end", {})
        row = {
            "rank": r["rank"],
            "returncode": r["returncode"],
            "at_100": a,
            "at_end": b,
            "rss_growth": (b["rss_bytes"] - a["rss_bytes"]) / a["rss_bytes"] if a and b else None,
            "steps_per_s": rep.get("steps_per_s"),
        }
        summary["ranks"].append(row)
        print(json.dumps(row), flush=True)
    return summary


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "worker":
        _worker(*sys.argv[2:5])
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("mode", choices=["stress", "faults", "soak", "exit", "readme"])
    p.add_argument("--runs2", type=int, default=100)
    p.add_argument("--runs4", type=int, default=50)
    p.add_argument("--trials", type=int, default=20)
    p.add_argument("--worlds", default="2,4", help="faults: rank counts")
    p.add_argument("--cases", default=",".join(FAULTS), help="faults: which of " + str(FAULTS))
    p.add_argument(
        "--no-readme",
        action="store_true",
        help="faults: leave the table in docs/benchmarks.md as it is",
    )
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--runs", type=int, default=100)
    p.add_argument(
        "--arms", default=",".join(EXIT_ARMS), help="exit mode: which of " + str(EXIT_ARMS)
    )
    args = p.parse_args()
    if args.mode == "stress":
        result = _stress(args.runs2, args.runs4)
    elif args.mode in ("faults", "readme"):
        # Cases run separately keep each other's results; the docs' table follows the file.
        previous = RESULTS / "robustness_faults.json"
        result = json.loads(previous.read_text()) if previous.exists() else {}
        result.pop("machine", None)
        if args.mode == "readme":
            _write_readme(result)
            print(f"wrote {TABLE_PAGE}")
            return
        cases = args.cases.split(",")
        unknown = sorted(set(cases) - set(FAULTS))
        if unknown:
            p.error(f"unknown --cases {unknown}; choose from {FAULTS}")
        result.update(_faults(args.trials, [int(w) for w in args.worlds.split(",")], cases))
        if not args.no_readme:
            _write_readme(result)
    elif args.mode == "exit":
        arms = args.arms.split(",")
        # Arms run separately keep each other's results.
        previous = RESULTS / "robustness_exit.json"
        result = json.loads(previous.read_text()) if previous.exists() else {}
        result.pop("machine", None)
        ours = {*arms, *(f"{a}_stderr" for a in arms)}
        result = {k: v for k, v in result.items() if k not in ours}
        result.update(_exit(args.runs, arms))
    else:
        result = _soak(args.steps)
    print(f"wrote {save(f'robustness_{args.mode}', result)}")


if __name__ == "__main__":
    main()
