"""The pipeline inside other libraries' formats and loops: PEFT adapters in and out
(:mod:`pippy_xla.integrations.peft`) and HF's ``Trainer`` (:mod:`pippy_xla.integrations.trainer`).
Imports the front; nothing below imports it: the front finds a model's wrapper through
:func:`pippy_xla.checkpoint.register_wrapper`, which this package calls on import (the package's
``__init__`` imports it, for ``PipelineTrainer``)."""

from pippy_xla import checkpoint
from pippy_xla.integrations.peft import PeftAdapters, is_peft_model
from pippy_xla.integrations.trainer import PipelineTrainer, pipelined

checkpoint.register_wrapper(lambda model: PeftAdapters(model) if is_peft_model(model) else None)

__all__ = ["PeftAdapters", "PipelineTrainer", "is_peft_model", "pipelined"]
