"""The pipeline inside other libraries' formats and loops: PEFT adapters in and out
(:mod:`pippy_xla.integrations.peft`). Imports the front; nothing below imports it: the front
finds a model's wrapper through :func:`pippy_xla.checkpoint.register_wrapper`, which this
package calls on import."""

from pippy_xla import checkpoint
from pippy_xla.integrations.peft import PeftAdapters, is_peft_model

checkpoint.register_wrapper(lambda model: PeftAdapters(model) if is_peft_model(model) else None)

__all__ = ["PeftAdapters", "is_peft_model"]
