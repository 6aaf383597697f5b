"""``examples/train_text.py`` run as docs/examples.md runs it (torchrun, 2 ranks) with tiny flags:
it beats the corpus's unigram perplexity, exports a model and tokenizer that ``transformers`` loads
and generates with, and resumes from its export."""

from __future__ import annotations

import json
import math
import re

import pytest
from test_materialize import run_example, run_example_forked

TINY = (
    *("--max-chars", "300000", "--vocab", "512", "--seq", "32", "--batch", "8"),
    *("--microbatches", "2", "--layers", "2", "--hidden", "64"),
)


def _report(stdout: str) -> tuple[float, list[tuple[int, float, float]]]:
    unigram = float(
        re.search(r"^unigram perplexity of the validation split: ([\d.]+)", stdout, re.M)[1]
    )
    evals = [
        (int(step), float(train), float(val))
        for step, train, val in re.findall(
            r"^step +(\d+) +train loss ([\d.]+) +validation loss ([\d.]+)", stdout, re.M
        )
    ]
    return unigram, evals


def test_train_text_beats_unigram_exports_and_resumes(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    export = tmp_path / "hf"
    flags = ("--steps", "60", "--eval-every", "30", "--lr", "1e-2", "--export", str(export))
    out = run_example(2, *TINY, *flags, script="train_text.py")
    unigram, evals = _report(out)
    assert [e[0] for e in evals] == [30, 60], out
    last_val = evals[-1][2]
    # The model uses the context: well below what token frequencies alone achieve.
    assert math.exp(last_val) < 0.7 * unigram, (unigram, evals)
    assert evals[-1][2] < evals[0][2], evals

    # transformers loads the export and generates with it; its loss on the held-out split's
    # first windows is the pipeline's.
    model = AutoModelForCausalLM.from_pretrained(export)
    tok = AutoTokenizer.from_pretrained(export)
    assert tok.get_vocab()["<|endoftext|>"] == model.config.eos_token_id
    prompt = tok("def ", return_tensors="pt")
    new = model.generate(**prompt, max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert new.shape[1] == prompt["input_ids"].shape[1] + 5
    assert "exported to" in out
    # The example sampled from the pipeline itself: its greedy continuation is the export's.
    piped = json.loads(re.search(r"^pipe.generate greedy ids: (.*)$", out, re.M)[1])
    eos = model.config.eos_token_id
    want = model.generate(
        **prompt,
        max_new_tokens=len(piped) - prompt["input_ids"].shape[1],
        do_sample=False,
        pad_token_id=eos,
        eos_token_id=eos,
    )
    assert piped == want[0].tolist()
    assert "pipe.generate, sampled: " in out

    # Resuming from the export: its first evaluation is where the export ended, far below the
    # first run's start (the tokenizer is the export's, so the ids are the same). In forked ranks:
    # the first run was the torchrun launch.
    resumed = run_example_forked(
        2,
        *TINY,
        "--steps",
        "2",
        "--eval-every",
        "1",
        "--lr",
        "1e-4",
        "--from-pretrained",
        str(export),
        script="train_text.py",
    )
    assert _report(resumed)[0] == pytest.approx(unigram)
    first_val = _report(resumed)[1][0][2]
    assert first_val == pytest.approx(last_val, abs=0.05), (first_val, last_val)
    assert math.log(512) - first_val > 1.0
    assert tuple(model.get_input_embeddings().weight.shape) == (512, 64)
