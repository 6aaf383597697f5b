"""Stable fingerprints of stage graphs, and explanations of how two stage graphs differ.

[Note: stable stage graphs] A stage graph is a pure function of (model, partition spec): the same
inputs give byte-identical generated code and the same parameter order on every rank and in
every process. A compiler caches a stage by what it sees (code, parameters, input specs), so a
graph that changes slightly between builds or steps pays a recompilation. The fingerprint names
exactly those parts; :func:`explain_difference` says where two builds first differ, in words a
user can act on.
"""

from __future__ import annotations

import difflib
import hashlib
import json
from dataclasses import asdict, dataclass

from pippy_xla.split.partition import StageGraph

__all__ = ["Fingerprint", "fingerprint", "explain_difference"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Fingerprint:
    """What a compiler sees of one stage: code, parameters and boundary specs."""

    stage: int
    """Stage index."""
    code: str
    """The GraphModule's generated Python code."""
    params: tuple[tuple[str, tuple[int, ...], str], ...]
    """``(original name, shape, dtype)`` of every parameter and buffer, in module order."""
    boundary: tuple
    """``(batch_inputs, num_boundary_inputs, num_boundary_outputs, layers)``."""

    @property
    def digest(self) -> str:
        """sha256 over all fields: equal digests mean identical stage graphs."""
        return hashlib.sha256(self.to_json().encode()).hexdigest()

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Fingerprint:
        d = json.loads(text)
        return cls(
            stage=d["stage"],
            code=d["code"],
            params=tuple((n, tuple(s), t) for n, s, t in d["params"]),
            boundary=tuple(tuple(b) if isinstance(b, list) else b for b in d["boundary"]),
        )


def fingerprint(stage: StageGraph) -> Fingerprint:
    """The fingerprint of ``stage`` (its graph module, parameters and boundary)."""
    gm = stage.module
    tensors = list(gm.named_parameters(remove_duplicate=False)) + list(
        gm.named_buffers(remove_duplicate=False)
    )
    params = tuple(
        (stage.param_names[name], tuple(t.shape), str(t.dtype).removeprefix("torch."))
        for name, t in tensors
    )
    boundary = (
        tuple(stage.batch_inputs),
        stage.num_boundary_inputs,
        stage.num_boundary_outputs,
        tuple(stage.layers),
    )
    return Fingerprint(stage=stage.index, code=stage.code, params=params, boundary=boundary)


def explain_difference(a: StageGraph | Fingerprint, b: StageGraph | Fingerprint) -> str | None:
    """Where two stage graphs (or fingerprints) first differ, or ``None`` if they are identical.

    The answer names the first differing part: the stage's boundary (inputs, outputs, layers),
    a parameter (name, shape or dtype, with its position), or the first differing line of code
    with its neighbours.
    """
    fa = a if isinstance(a, Fingerprint) else fingerprint(a)
    fb = b if isinstance(b, Fingerprint) else fingerprint(b)
    if fa == fb:
        return None
    if fa.stage != fb.stage:
        return f"they are different stages: {fa.stage} vs {fb.stage}"
    labels = ("batch inputs", "boundary inputs", "boundary outputs", "decoder layers")
    for label, x, y in zip(labels, fa.boundary, fb.boundary, strict=True):
        if x != y:
            return (
                f"stage {fa.stage}: {label} differ: {x} vs {y}; the two builds were partitioned "
                "differently (layer ranges, input_names or model)"
            )
    if len(fa.params) != len(fb.params):
        names_a = {p[0] for p in fa.params}
        names_b = {p[0] for p in fb.params}
        only_a = sorted(names_a - names_b)[:5]
        only_b = sorted(names_b - names_a)[:5]
        return (
            f"stage {fa.stage}: {len(fa.params)} vs {len(fb.params)} parameters/buffers; only in "
            f"the first: {only_a}, only in the second: {only_b}"
        )
    for i, (pa, pb) in enumerate(zip(fa.params, fb.params, strict=True)):
        if pa[0] != pb[0]:
            return (
                f"stage {fa.stage}: parameter #{i} is '{pa[0]}' vs '{pb[0]}': the parameter order "
                "differs (module registration order changed)"
            )
        if pa[1] != pb[1]:
            return (
                f"stage {fa.stage}: '{pa[0]}' has shape {pa[1]} vs {pb[1]}: the model configs "
                "differ"
            )
        if pa[2] != pb[2]:
            return (
                f"stage {fa.stage}: '{pa[0]}' has dtype {pa[2]} vs {pb[2]}: cast the model to one "
                "dtype before wrapping it"
            )
    la, lb = fa.code.splitlines(), fb.code.splitlines()
    for i, (x, y) in enumerate(zip(la, lb, strict=False)):
        if x != y:
            context = "\n".join(
                difflib.unified_diff(la, lb, "first", "second", n=1, lineterm="")
            ).splitlines()[:12]
            return (
                f"stage {fa.stage}: generated code first differs at line {i + 1}:\n"
                f"  first:  {x.strip()}\n  second: {y.strip()}\n" + "\n".join(context)
            )
    return f"stage {fa.stage}: generated code has {len(la)} vs {len(lb)} lines"
