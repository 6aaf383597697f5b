"""Recovery end to end: a two-node torchrun job (two agents of 2 ranks each on this machine, over
loopback, c10d rendezvous) loses a rank mid-run; with ``--max-restarts 1`` torchrun restarts
it, the job resumes from its latest checkpoint and ends with the same final loss, bit for bit,
as an uninterrupted run. The multi-node launch of docs/checkpoints.md, as it shows it."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

from test_materialize import run_example_forked

from pippy_xla.testing import _free_port

ROOT = Path(__file__).resolve().parents[1]
TINY = (
    *("--steps", "6", "--layers", "4", "--hidden", "64", "--vocab", "128", "--seq", "32"),
    *("--batch", "8", "--microbatches", "4", "--lr", "1e-2", "--timeout", "30"),
)


def _two_node_job(directory: Path, *flags: str) -> list[subprocess.Popen]:
    """Starts the two torchrun agents of one job (node ranks 0 and 1, 2 ranks each): node 0's
    first, hosting the rendezvous store (``is_host``), and node 1's once that store serves. A
    port taken by another process between :func:`_free_port` and node 0's bind (the other job's
    workers' store, another test's) left both agents clients of a store nobody served, each
    failing after 60 s (once in a fresh CI run): node 0 then exits at once, and the job starts
    again on another port."""
    for _ in range(3):
        port = _free_port()
        host = _agent(0, port, directory, flags)
        if _serving(host, port):
            return [host, _agent(1, port, directory, flags)]
        host.kill()
        host.communicate()
    raise AssertionError("no port for the rendezvous store in 3 tries")


def _agent(node: int, port: int, directory: Path, flags) -> subprocess.Popen:
    # A new store per attempt, as docs/checkpoints.md launches it: the agent's store, which torch
    # shares by default, keeps the killed attempt's gloo addresses, and restarted ranks read them
    # ([Note: torchrun's store across restarts]).
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    cmd = [
        *(sys.executable, "-m", "torch.distributed.run", "--nnodes", "2"),
        *("--nproc-per-node", "2", "--node-rank", str(node), "--rdzv-backend", "c10d"),
        *("--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-conf", f"is_host={int(node == 0)}"),
        *("--max-restarts", "1", str(ROOT / "examples" / "train_llama.py"), *TINY),
        *("--resume", str(directory), "--save-every", "1", *flags),
    ]
    return subprocess.Popen(
        cmd, env=env, cwd=directory.parent, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )


def _serving(host: subprocess.Popen, port: int, seconds: float = 120) -> bool:
    """Whether ``host``'s rendezvous store accepts connections on ``port`` (``False`` once the
    agent has exited: it could not bind the port; a listener that is another process's is told
    apart by the agent exiting within a second of its failed bind)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and host.poll() is None:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
        except OSError:
            time.sleep(0.2)
            continue
        time.sleep(1)
        return host.poll() is None
    return False


def _finish(agents: list[subprocess.Popen]) -> str:
    """Both agents' stdout, after checking that both succeeded."""
    outs = []
    for a in agents:
        try:
            stdout, stderr = a.communicate(timeout=180)
        except subprocess.TimeoutExpired:
            for b in agents:
                b.kill()
            raise
        text = stdout.decode(errors="replace")
        assert a.returncode == 0, text[-2000:] + stderr.decode(errors="replace")[-4000:]
        outs.append(text)
    return "\n".join(outs)


def _final_loss(stdout: str) -> str:
    found = re.findall(r"^final loss (\S+)$", stdout, re.M)
    assert len(found) == 1, stdout[-2000:]
    return found[0]


def test_a_killed_rank_restarts_the_two_node_job_from_its_checkpoint(tmp_path):
    interrupted = _two_node_job(tmp_path / "ckpt", "--die-at-step", "3")
    # The uninterrupted job: the same 4 ranks' world (one stage a rank) in forked ranks, not a
    # second two-node job (its interpreters' start-ups: 4 ranks' and 2 agents').
    flags = (*TINY, "--resume", str(tmp_path / "ckpt-uninterrupted"), "--save-every", "1")
    reference = run_example_forked(4, *flags, cwd=tmp_path)
    out = _finish(interrupted)
    assert "rank 3: killing itself at step 3" in out, out[-2000:]
    # The first attempt saved steps 1-3; the restarted one resumed at step 3.
    assert "no checkpoint in" in out and "resumed from" in out and "at step 3" in out, out
    assert "resumed from" not in reference
    assert _final_loss(out) == _final_loss(reference)  # every bit of the float's repr
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "step-00000006"


def test_a_job_restarted_over_the_agents_store_is_told_what_to_launch(monkeypatch, caplog):
    """[Note: torchrun's store across restarts]: a rank that torchrun may restart over its agent's
    store (which keeps the killed attempt's keys) logs once what to launch instead; a rank given
    a store per attempt, or never restarted, logs nothing."""
    from pippy_xla.runtime import failures

    monkeypatch.setattr(failures, "_WARNED_STORE", False)
    quiet = [("True", "0"), ("False", "1"), ("True", "")]  # (agent's store, max restarts)
    for shared, restarts in quiet:
        monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", shared)
        monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", restarts)
        failures.warn_if_store_outlives_restarts()
    assert not caplog.records
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "1")
    failures.warn_if_store_outlives_restarts()
    failures.warn_if_store_outlives_restarts()
    (record,) = caplog.records
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in record.getMessage()
    assert "--rdzv-backend c10d" in record.getMessage()
