"""``px.PipelineTrainer`` against the plain ``run_train`` loop on the same model, ranks and data:
the Trainer's overhead per optimizer step.

Each arm runs in 2 fresh CPU processes (gloo, one thread each), on a Llama built from one seed
and the same rows (random tokens, ``--seq`` long, labels the inputs):

- ``loop``: the loop a user writes: for each batch of ``--batch`` rows in the order the Trainer's
  seeded sampler gives them, ``pipe.run_train``, ``pipe.clip_grad_norm_(1.0)``, an AdamW step, a
  linear schedule's step and ``zero_grad``;
- ``trainer``: ``px.PipelineTrainer`` with the same optimizer, schedule and clipping
  (``max_steps`` = warm-up + timed steps, a loss logged every 10 steps, no evaluation, no saving);
- ``own_loss``: the same through ``px.pipelined`` of a ``Trainer`` subclass whose
  ``compute_loss`` calls the model and computes the same loss from the logits itself: what a
  trainer with its own loss costs (two passes of the pipeline, the logits to every rank; see
  [Note: a trainer's own loss on the pipeline]).

A step's time is taken between successive step ends on each rank (the Trainer's ``on_step_end``
callback; the same points in the loop) and the slowest rank's counts; reported per arm: the
median over the timed steps and the steps per second it gives. The arms alternate, ``--rounds``
times each, so that a slow spell of the machine falls on both.

Run: ``python benchmarks/trainer.py``; results in ``benchmarks/results/trainer.json``.
"""

from __future__ import annotations

import argparse
import statistics
import time

from _common import llama_config, run_ranks, save

ARMS = ("loop", "trainer", "own_loss")


def _rows(args) -> list[dict]:
    import torch

    g = torch.Generator().manual_seed(0)
    count = args.batch * (args.warmup + args.steps)
    ids = torch.randint(0, 512, (count, args.seq), generator=g)
    return [{"input_ids": r, "attention_mask": torch.ones_like(r), "labels": r} for r in ids]


def _training_args(args, out: str):
    from transformers import TrainingArguments

    return TrainingArguments(
        output_dir=out,
        per_device_train_batch_size=args.batch,
        max_steps=args.warmup + args.steps,
        learning_rate=1e-4,
        lr_scheduler_type="linear",
        max_grad_norm=1.0,
        logging_steps=10,
        report_to=[],
        save_strategy="no",
        seed=0,
        use_cpu=True,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )


def _own_loss_trainer():
    """A ``Trainer`` whose ``compute_loss`` is its own: the model's loss, from the logits."""
    from transformers import Trainer

    class OwnLoss(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            labels = inputs.pop("labels")
            logits = model(**inputs).logits
            vocab = logits.shape[-1]
            loss = self.model.loss_function(logits, labels, vocab, num_items_in_batch=None)
            return loss

    return OwnLoss


def _arm(rank, world, args, arm: str, out: str) -> list[float]:
    import torch
    from transformers import LlamaForCausalLM, TrainerCallback
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    import pippy_xla as px

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = LlamaForCausalLM(llama_config(args.layers, args.hidden))
    config = px.PipelineConfig(num_microbatches=args.microbatches)
    ends: list[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, *_: object, **__: object) -> None:
            ends.append(time.perf_counter())

    cls = px.pipelined(_own_loss_trainer()) if arm == "own_loss" else px.PipelineTrainer
    trainer = cls(
        model=model,
        args=_training_args(args, f"{out}/{arm}"),
        train_dataset=_rows(args),
        layer_cls=LlamaDecoderLayer,
        pipeline=config,
        callbacks=[Clock()],
    )
    if arm != "loop":
        ends.append(time.perf_counter())
        trainer.train()
    else:  # the same pipeline, optimizer, schedule and batches, stepped by hand
        pipe = trainer.pipe
        trainer.create_optimizer_and_scheduler(num_training_steps=args.warmup + args.steps)
        opt, schedule = trainer.optimizer, trainer.lr_scheduler
        ends.append(time.perf_counter())
        for batch in trainer.get_train_dataloader():
            pipe.run_train(**batch)
            pipe.clip_grad_norm_(1.0)
            opt.step()
            schedule.step()
            opt.zero_grad()
            ends.append(time.perf_counter())
    times = [b - a for a, b in zip(ends[:-1], ends[1:], strict=True)]
    return times[args.warmup :]


def main() -> None:
    import tempfile

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    result: dict = {"args": vars(args), "runs": []}
    with tempfile.TemporaryDirectory() as out:
        for round_ in range(args.rounds):
            for arm in ARMS:
                ranks = run_ranks(2, _arm, args, arm, out, timeout=900)
                slowest = [max(r[i] for r in ranks) for i in range(args.steps)]
                step = statistics.median(slowest)
                result["runs"].append({"arm": arm, "round": round_, "step_s": step, "ranks": ranks})
                print(f"round {round_} {arm:8s} step {step * 1e3:7.2f} ms  {1 / step:6.3f} steps/s")
    for arm in ARMS:
        steps = [r["step_s"] for r in result["runs"] if r["arm"] == arm]
        result[arm] = {"step_s": statistics.median(steps), "per_round": steps}
    ratio = result["loop"]["step_s"] / result["trainer"]["step_s"]
    result["trainer_steps_per_s_over_loop"] = ratio
    print(f"PipelineTrainer's steps/s over the loop's: {ratio:.4f} (medians over the rounds)")
    own = result["trainer"]["step_s"] / result["own_loss"]["step_s"]
    result["own_loss_steps_per_s_over_trainer"] = own
    print(f"a trainer's own loss: {own:.4f} of PipelineTrainer's steps/s")
    print(save("trainer", result))


if __name__ == "__main__":
    main()
