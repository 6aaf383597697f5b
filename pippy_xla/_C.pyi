"""Type stub of ``pippy_xla._C``, the C++ core (csrc/bindings/): schedules, stash, engine,
the pipeline's collectives on C++-owned buffers, the counting CPU allocator and the planner's
solver. The ``pippy_xla::send/recv/...`` custom ops are registered with ``torch.ops``, not
here (see ``pippy_xla/runtime/ops.py``)."""

from collections.abc import Callable, Sequence
from typing import type_check_only

import torch
from typing_extensions import Never

# ---- pybind11's classes (stub-only names for what every class of the module derives from)

@type_check_only
class _pybind11_type(type):
    """The metaclass of every class of the module (``pybind11_builtins.pybind11_type``)."""

@type_check_only
class _pybind11_object(metaclass=_pybind11_type):
    """The base of every class of the module (``pybind11_builtins.pybind11_object``)."""

@type_check_only
class _NoConstructor(_pybind11_object):
    """A class whose instances only the module makes: it binds no constructor, and calling the
    class raises ``TypeError``."""

    def __init__(self, *args: Never, **kwargs: Never) -> None: ...

# ---- schedules (csrc/schedule/)

class Action(_pybind11_object):
    """One action of a rank's list: op (``F B W SF RF SB RB``), stage and microbatch."""

    def __init__(self, op: str, stage: int, mb: int) -> None: ...
    @property
    def op(self) -> str:
        """``"F"``, ``"B"``, ``"W"``, ``"SF"``, ``"RF"``, ``"SB"`` or ``"RB"``."""
    @property
    def stage(self) -> int:
        """The stage it runs or transfers for."""
    @property
    def mb(self) -> int:
        """The microbatch."""
    def __eq__(self, other: object, /) -> bool: ...
    def __hash__(self) -> int: ...

@type_check_only
class _ActionFields(_NoConstructor):
    """Stub-only base: the op, stage and microbatch of the action a record is about."""

    @property
    def op(self) -> str:
        """The action's op."""
    @property
    def stage(self) -> int:
        """The action's stage."""
    @property
    def mb(self) -> int:
        """The action's microbatch."""

class TimedAction(_ActionFields):
    """An action of a simulated timeline."""

    @property
    def rank(self) -> int:
        """The rank that runs it."""
    @property
    def start(self) -> float:
        """When it starts, in the unit of the costs."""
    @property
    def end(self) -> float:
        """When it ends."""

class SimResult(_NoConstructor):
    """What :meth:`Schedule.simulate` predicts."""

    @property
    def timeline(self) -> list[TimedAction]:
        """Every action, sorted by start time (rank order on ties)."""
    @property
    def makespan(self) -> float:
        """The step's duration."""
    @property
    def bubble(self) -> float:
        """1 - busy compute time / (ranks x makespan)."""
    @property
    def peak_inflight(self) -> list[int]:
        """Per stage, the most forwards whose backward was pending (zeros without backward)."""
    @property
    def live_states(self) -> list[list[list[list[int]]]]:
        """Per rank, per stage of the rank (ascending): the states while that stage computes
        that no other covers, each three counts per stage of the rank: microbatches forwarded
        and not backwarded, backwarded and not weighted, and 1 while a split B runs (see
        [Note: live states] in csrc/schedule/simulator.h)."""

class Schedule(_pybind11_object):
    """Every rank's ordered action list, with the stage -> rank map."""

    def __init__(
        self,
        name: str,
        num_ranks: int,
        num_microbatches: int,
        stage_rank: Sequence[int],
        actions: Sequence[Sequence[Action | tuple[str, int, int]]],
        backward: bool = True,
        split_backward: bool = False,
    ) -> None:
        """A hand-written schedule; actions as :class:`Action` or ``(op, stage, mb)``."""
    @property
    def name(self) -> str:
        """The schedule's name."""
    @property
    def num_ranks(self) -> int:
        """Ranks of the pipeline."""
    @property
    def num_stages(self) -> int:
        """Stages of the pipeline (ranks x chunks)."""
    @property
    def num_microbatches(self) -> int:
        """Microbatches per step."""
    @property
    def backward(self) -> bool:
        """False for a forward-only (evaluation) schedule."""
    @property
    def split_backward(self) -> bool:
        """B computes input gradients only and W weight gradients."""
    @property
    def decode_groups(self) -> int:
        """0, or a decode schedule's groups (see [Note: decode schedules] in schedule.h)."""
    @property
    def stage_rank(self) -> list[int]:
        """The rank of every stage."""
    @staticmethod
    def from_csv(text: str, name: str = "csv") -> Schedule:
        """A schedule in torch.distributed.pipelining's CSV action format (the file's text),
        validated (see [Note: CSV schedules] in csrc/schedule/schedule.h)."""
    def to_csv(self, comms: bool = False) -> str:
        """This schedule in torch.distributed.pipelining's CSV action format."""
    @property
    def actions(self) -> list[list[Action]]:
        """Every rank's ordered actions."""
    def table(self) -> str:
        """One line per rank, e.g. ``rank 0: F0.0 SF0.0 F0.1 ...`` (stage.microbatch)."""
    def stages_of(self, rank: int, /) -> list[int]:
        """The stages ``rank`` runs, ascending."""
    def validate(self) -> None:
        """Raises ``RuntimeError`` naming the first missing, misplaced or deadlocked action."""
    def simulate(
        self,
        forward: Sequence[float] = ...,
        backward: Sequence[float] = ...,
        weight: Sequence[float] = ...,
        comm: float = 0.0,
        send: float = 0.0,
        recv: float = 0.0,
    ) -> SimResult:
        """The timeline for per-stage costs (empty: unit costs), a transfer latency (``comm``)
        and the time a rank spends posting each send (``send``) and receive (``recv``)."""

class ScheduleInfo(_NoConstructor):
    """The facts of one schedule, written once in C++ (``[Note: schedule facts]``)."""

    @property
    def name(self) -> str: ...
    @property
    def description(self) -> str: ...
    @property
    def trains(self) -> bool:
        """Runs backward actions (``False``: evaluation)."""
    @property
    def split_backward(self) -> bool:
        """B computes input gradients only, W the weights' gradients."""
    @property
    def min_chunks(self) -> int:
        """The fewest stages per rank."""
    @property
    def max_chunks(self) -> int:
        """The most stages per rank; 0: no bound."""
    @property
    def default_chunks(self) -> int:
        """Stages per rank when none is given."""
    @property
    def equal_stages(self) -> bool:
        """Every stage must hold the same number of layers."""
    @property
    def placement(self) -> str:
        """How stages sit on ranks: ``"loop"`` (stage ``s`` on rank ``s % ranks``) or ``"v"``
        (every odd chunk reversed: with 2 chunks, rank ``r`` runs ``r`` and ``2 * ranks - 1 - r``),
        as :func:`stage_rank`."""
    @property
    def list_scheduled(self) -> bool:
        """Whether the order is list-scheduled at per-stage costs (:func:`make_schedule`'s
        ``forward`` / ``backward`` / ``weight``; ``[Note: list scheduling at costs]``)."""

def libstdcxx_file() -> str:
    """The shared object that defines the libstdc++ functions this module calls ('' if unknown)."""

def schedule_table() -> list[ScheduleInfo]:
    """Every generated schedule's facts, ``"forward"`` (evaluation) last."""

def schedule_info(name: str) -> ScheduleInfo:
    """The facts of schedule ``name``; ``RuntimeError`` naming the known ones otherwise."""

def make_schedule(
    name: str,
    num_ranks: int,
    num_microbatches: int,
    chunks: int = 0,
    placement: str = "",
    *,
    forward: Sequence[float] = ...,
    backward: Sequence[float] = ...,
    weight: Sequence[float] = ...,
) -> Schedule:
    """The generated schedule ``name`` (one of :func:`schedule_names`); ``chunks`` 0: its
    default; ``placement`` empty: the schedule's own (``"forward"`` takes either, to evaluate on
    the stages where training placed them). ``forward`` / ``backward`` / ``weight``: per-stage
    costs (empty: unit costs) that order a list-scheduled schedule
    (:attr:`ScheduleInfo.list_scheduled`): the order list-scheduled at them if the simulator puts
    it ahead of the published one at those costs, else the published one. The other schedules
    refuse costs."""

def forward_schedule(stage_rank: Sequence[int], num_ranks: int, num_microbatches: int) -> Schedule:
    """Evaluation on the stages where ``stage_rank`` puts them (any placement)."""

def decode_schedule(
    stage_rank: Sequence[int], num_ranks: int, groups: int, tokens: int
) -> Schedule:
    """Pipelined decoding of ``tokens`` tokens for ``groups`` groups of rows ([Note: decode
    schedules] in csrc/schedule/schedule.h): microbatch ``t * groups + g`` is group ``g``'s token
    ``t``."""

def schedule_names() -> list[str]:
    """Every schedule :func:`make_schedule` generates, ``"forward"`` (evaluation) last."""

def train_schedule_names() -> list[str]:
    """The schedules that train: :func:`schedule_names` without ``"forward"``."""

def default_chunks(name: str) -> int:
    """Stages per rank of schedule ``name`` when none is given (its :class:`ScheduleInfo`'s)."""

def stage_rank(stage: int, num_ranks: int, placement: str = "loop") -> int:
    """The rank that runs ``stage`` under ``placement`` (see :attr:`ScheduleInfo.placement`)."""

def check_stage_count(num_layers: int, num_stages: int) -> None:
    """Raises ``ValueError`` unless every one of ``num_stages`` stages gets a layer."""

def balanced_ranges(num_layers: int, num_stages: int) -> list[tuple[int, int]]:
    """Contiguous layer ranges ``(start, stop)`` whose sizes differ by at most one (earlier
    stages get more); ``ValueError`` as :func:`check_stage_count`, or without stages."""

# ---- activation stash (csrc/runtime/stash.h)

class StashSlot(_NoConstructor):
    """What the stash keeps of one (stage, microbatch): references, never copies."""

    @property
    def inputs(self) -> list[torch.Tensor]:
        """The stage's inputs."""
    @property
    def outputs(self) -> list[torch.Tensor]:
        """The stage's outputs."""

class Stash(_pybind11_object):
    """Activations kept for backward, one slot per (stage, microbatch)."""

    def __init__(self) -> None: ...
    def push(
        self, stage: int, mb: int, inputs: list[torch.Tensor], outputs: list[torch.Tensor], /
    ) -> None:
        """Fills a slot; a full slot is an error."""
    def pop(self, stage: int, mb: int, /) -> StashSlot:
        """Empties a slot and returns what it held."""
    def peek(self, stage: int, mb: int, /) -> StashSlot:
        """What a slot holds, left in place."""
    def contains(self, stage: int, mb: int, /) -> bool:
        """Whether the slot is full."""
    def __len__(self) -> int: ...
    @property
    def live_bytes(self) -> int:
        """Bytes held now."""
    @property
    def peak_bytes(self) -> int:
        """Most bytes held at once since the last :meth:`reset_peak`."""
    def reset_peak(self) -> None:
        """Sets the peak to the bytes held now."""
    def check_empty(self) -> None:
        """Raises ``RuntimeError`` naming the slots still full."""

# ---- engine (csrc/runtime/engine.h)

TIED_WEIGHT_TAG_BASE: int
"""Transfer tags at and above this are not the engine's: tied weights use them."""

def tied_weight_tag(tie: int) -> int:
    """The first of the two transfer tags of tie number ``tie``."""

RECV_LOOKAHEAD: int
"""Receive actions a rank posts ahead of the one it waits on."""

SHM_SLOTS: int
"""Messages a same-host channel holds at once (more are deferred; see [Note: deferred sends])."""

SHM_SPIN_US: int
"""How long a same-host wait polls before it sleeps, where every rank of the host has a core of
its own (see [Note: spinning before sleeping])."""

DEFAULT_TIMEOUT_MS: int
"""How long a transfer waits when no timeout is given (the engine's and the ops' default)."""

def peak_receive_buffers(schedule: Schedule) -> list[int]:
    """Per rank, the most receive buffers alive at once during a step (the engine's rule)."""

class WeightWork(_NoConstructor):
    """What a split backward's W runs for one microbatch of a stage."""

    def run(self) -> None:
        """W: accumulates the weight gradients into the parameters' ``.grad`` (once)."""

def input_gradients(
    roots: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], leaves: Sequence[torch.Tensor]
) -> tuple[list[torch.Tensor], WeightWork]:
    """B of a split backward, as the engine runs it for zbh1: the gradients of ``leaves``, and
    the WeightWork W runs later (see [Note: split backward] in
    csrc/runtime/split_backward.cpp)."""

class ActionTiming(_ActionFields):
    """When an action of the last step ran (system clock, nanoseconds)."""

    @property
    def start_ns(self) -> int:
        """Start; for F and B, when their received inputs were there."""
    @property
    def end_ns(self) -> int:
        """End."""

class Failure(_NoConstructor):
    """Where a failed step failed."""

    @property
    def stage(self) -> int:
        """The action's stage (-1 if none)."""
    @property
    def microbatch(self) -> int:
        """The action's microbatch (-1 if none)."""
    @property
    def peer(self) -> int:
        """The transfer's peer rank (-1 if none)."""
    @property
    def action(self) -> str:
        """The action that failed."""
    @property
    def aborted(self) -> bool:
        """The step was aborted because a peer failed, not by its own error."""

class InOrderGroups(_pybind11_object):
    """The process groups of an engine whose transfers are matched in posting order (see [Note:
    transfers matched in order] in csrc/runtime/engine.h)."""

    def __init__(self, *, up_group: str, down_group: str, header_group: str) -> None: ...
    @property
    def up_group(self) -> str:
        """Sends to higher ranks."""
    @property
    def down_group(self) -> str:
        """Sends to lower ranks."""
    @property
    def header_group(self) -> str:
        """gloo: boundary headers and the step handshake, in host memory."""

class HeaderChannel(_NoConstructor):
    """Where boundary headers and the step handshake travel."""

    @property
    def group_name(self) -> str: ...
    @property
    def device(self) -> str: ...

def header_channel(
    group_name: str, device: str, in_order: InOrderGroups | None = None
) -> HeaderChannel:
    """The group and device of an engine's boundary headers and of the step handshake: the
    pipeline's group on its device, or the header group on the CPU where transfers are matched
    in order."""

class Engine(_pybind11_object):
    """Runs one rank's action list of a schedule every step."""

    def __init__(
        self,
        schedule: Schedule,
        group_name: str,
        timeout_ms: int,
        device: str = "cpu",
        in_order: InOrderGroups | None = None,
    ) -> None:
        """``in_order``: the groups of an engine whose transfers are matched in posting order
        (NCCL); see [Note: transfers matched in order] in csrc/runtime/engine.h."""
    def run(
        self,
        signature: int,
        forward: Callable[[int, int, list[torch.Tensor]], list[torch.Tensor]],
        grads_ready: Callable[[int], None] | None = None,
    ) -> None:
        """Runs one step: ``forward(stage, mb, inputs)`` per F, ``grads_ready(stage)`` per stage."""
    def abort(self) -> None:
        """Wakes the running step's transfer waits so that :meth:`run` fails now."""
    def failure(self) -> Failure | None:
        """Where the failed step failed; ``None`` while no step has failed."""
    def inject_fault(self, op: str, stage: int, mb: int) -> None:
        """Fault injection, for tests: the next step that runs action ``(op, stage, mb)`` on this
        rank fails right after it, its transfers left in flight."""
    @property
    def rank(self) -> int:
        """This rank in the pipeline's group."""
    @property
    def schedule(self) -> Schedule:
        """The schedule it runs."""
    def timings(self) -> list[ActionTiming]:
        """The last step's actions on this rank."""
    @property
    def stash_live_bytes(self) -> int:
        """Bytes the stash holds now."""
    @property
    def stash_peak_bytes(self) -> int:
        """Most bytes the stash held at once since the last reset."""
    def reset_stash_peak(self) -> None:
        """Sets the stash's peak to the bytes held now."""
    def stash_contains(self, stage: int, mb: int, /) -> bool:
        """Whether the stash holds (stage, mb)."""
    def stash_peek(self, stage: int, mb: int, /) -> StashSlot:
        """What the stash holds for (stage, mb)."""

class TransferError(RuntimeError):
    """A transfer or collective that failed or timed out (csrc/transport/p2p.h)."""

# ---- collectives on C++-owned buffers (csrc/transport/p2p.h)

class Abortable(_pybind11_object):
    """Lets another thread end a collective's waits: pass it as ``abortable`` to a collective
    over shared memory and call :meth:`abort` (see [Note: watched collectives] in
    pippy_xla/runtime/failures.py)."""

    def __init__(self) -> None: ...
    def abort(self) -> None:
        """Ends the waits of the collective it was given to, and of any it is given to later,
        with an error (thread-safe)."""
    @property
    def aborted(self) -> bool: ...

def all_gather_int64(
    values: Sequence[int],
    group_name: str,
    device: str,
    timeout_ms: int,
    what: str,
    abortable: Abortable | None = None,
) -> list[list[int]]:
    """Every rank's ``values`` (the same count on every rank), gathered on buffers that never
    reach Python."""

def shm_attach(group_name: str, timeout_ms: int, spin_us: int = -1) -> int:
    """Collective: moves the group's point-to-point transfers between ranks of this host onto
    shared memory (see [Note: same-host transport] in csrc/transport/shm.h). Returns how many
    peers this rank reaches that way (0: none, the group's own transport stays). ``spin_us``: how
    long this rank's waits on the group poll before they sleep (negative: decided from the host's
    ranks and cores, [Note: spinning before sleeping]); attaching again with ``spin_us`` >= 0
    sets it anew."""

def shm_peers(group_name: str) -> int:
    """How many peers of the group this rank reaches through shared memory."""

def shm_whole_group(group_name: str) -> bool:
    """Whether this rank reaches every other rank of the group through shared memory (its small
    collectives then run there, and an :class:`Abortable` can end their waits)."""

def shm_spin_us(group_name: str) -> int:
    """How many microseconds this rank's waits on the group's shared-memory channels poll before
    they sleep (0: they sleep at once; see [Note: spinning before sleeping] in
    csrc/transport/shm.cpp)."""

def _receive_checked_at_step_end(
    buffer: torch.Tensor, peer: int, tag: int, group_name: str, timeout_ms: int
) -> torch.Tensor:
    """For tests: a receive into `buffer` that DeviceWaits checks (see [Note: waits on a GPU]):
    returns `buffer` once it arrived, or raises TransferError at `timeout_ms`."""

def content_digest(tensor: torch.Tensor) -> int:
    """A 64-bit fingerprint of the tensor's bytes (not a cryptographic hash)."""

class BatchKey(_NoConstructor):
    """What the step handshake compares of a batch ([Note: step handshake] in
    pippy_xla/runtime/_batch.py)."""

    @property
    def signature(self) -> int:
        """Fingerprint of the input names, dtypes and shapes."""
    @property
    def content(self) -> int:
        """Fingerprint of the values (0: not checked)."""
    @property
    def contents(self) -> list[int]:
        """Each input's :func:`content_digest` in the order given (empty: not checked)."""

def batch_key(
    names: Sequence[str], tensors: Sequence[torch.Tensor], check_content: bool
) -> BatchKey:
    """Fingerprints of a batch's input names, dtypes and shapes and (with ``check_content``) of
    its values, whole and per input (:func:`content_digest`), for the step handshake."""

def broadcast_copy(
    tensor: torch.Tensor,
    root: int,
    group_name: str,
    timeout_ms: int,
    what: str,
    abortable: Abortable | None = None,
) -> torch.Tensor:
    """A copy of group rank ``root``'s tensor, broadcast on a buffer that never reaches Python."""

def all_reduce_sum_copy(
    tensor: torch.Tensor,
    group_name: str,
    timeout_ms: int,
    what: str,
    abortable: Abortable | None = None,
) -> torch.Tensor:
    """The sum of every rank's tensor, all-reduced on a buffer that never reaches Python."""

# ---- counting CPU allocator (csrc/runtime/memory.h)

def memory_tracker_install() -> None:
    """Installs the counting CPU allocator (stays installed)."""

class MemoryStats(_NoConstructor):
    """What the counting CPU allocator counted (picklable)."""

    @property
    def live_bytes(self) -> int:
        """Bytes of counted storages alive now."""
    @property
    def peak_bytes(self) -> int:
        """Most live bytes since install or the last :func:`memory_reset_peak`."""
    @property
    def allocations(self) -> int:
        """Storages counted since install."""
    def __getstate__(self) -> tuple[int, int, int]: ...
    def __setstate__(self, state: tuple[int, int, int], /) -> None: ...

def memory_stats() -> MemoryStats:
    """The counting allocator's counts now; ``RuntimeError`` unless it is installed."""

def memory_reset_peak() -> None:
    """Sets the counted peak to the live bytes now."""

# ---- planner (csrc/plan/planner.h); pippy_xla/plan/cost_model.py re-exports the classes

class LayerCost(_pybind11_object):
    """Per-microbatch cost of one decoder layer (see [Note: planner cost model])."""

    def __init__(
        self,
        *,
        fwd: float,
        bwd: float,
        recompute: float | None = None,
        saved_bytes: int,
        saved_bytes_ckpt: int,
        static_bytes: int,
        transient_bytes: int = 0,
        weight: float = 0.0,
        weight_ckpt: float | None = None,
        weight_bytes: int = 0,
        weight_bytes_ckpt: int | None = None,
        recorded_bytes: int = 0,
        split_transient_bytes: int = 0,
    ) -> None: ...
    fwd: float
    bwd: float
    recompute: float
    saved_bytes: int
    saved_bytes_ckpt: int
    static_bytes: int
    transient_bytes: int
    weight: float
    weight_ckpt: float
    weight_bytes: int
    weight_bytes_ckpt: int
    recorded_bytes: int
    split_transient_bytes: int

class StageExtra(_pybind11_object):
    """Per-microbatch cost a stage has besides its layers (prologue, epilogue, buffers)."""

    def __init__(
        self,
        *,
        fwd: float = 0.0,
        bwd: float = 0.0,
        saved_bytes: int = 0,
        static_bytes: int = 0,
        transient_bytes: int = 0,
        buffer_bytes: int = 0,
        weight: float = 0.0,
        weight_bytes: int = 0,
        recorded_bytes: int = 0,
        split_transient_bytes: int = 0,
        split_backward: bool = False,
    ) -> None: ...
    fwd: float
    bwd: float
    saved_bytes: int
    static_bytes: int
    transient_bytes: int
    buffer_bytes: int
    weight: float
    weight_bytes: int
    recorded_bytes: int
    split_transient_bytes: int
    split_backward: bool

class PlanProblem(_pybind11_object):
    """Solver input: layers, per-stage extras, the stages' devices, the schedule's live states
    and memory limits per device, and optionally given layer ranges."""

    def __init__(
        self,
        *,
        layers: Sequence[LayerCost],
        extras: Sequence[StageExtra],
        live_states: Sequence[Sequence[Sequence[Sequence[int]]]],
        memory_limit: Sequence[int],
        stage_device: Sequence[int] = (),
        ranges: Sequence[tuple[int, int]] = (),
        allow_checkpoint: bool = True,
    ) -> None: ...
    layers: list[LayerCost]
    extras: list[StageExtra]
    stage_device: list[int]
    live_states: list[list[list[list[int]]]]
    memory_limit: list[int]
    ranges: list[tuple[int, int]]
    allow_checkpoint: bool

class StageEval(_NoConstructor):
    """One stage of a solved or evaluated plan; transient_bytes, buffer_bytes and memory are its
    device's."""

    @property
    def range(self) -> tuple[int, int]:
        """Its layers, ``(start, stop)``."""
    @property
    def checkpoint(self) -> list[int]:
        """Global indices of checkpointed layers."""
    @property
    def device(self) -> int: ...
    @property
    def forward(self) -> float: ...
    @property
    def backward(self) -> float:
        """Including recomputation and W."""
    @property
    def weight(self) -> float:
        """W's part of backward (a splitting stage)."""
    @property
    def time(self) -> float: ...
    @property
    def saved_bytes(self) -> int:
        """Per microbatch, forward to backward."""
    @property
    def weight_bytes(self) -> int:
        """Per microbatch, B to W."""
    @property
    def inflight(self) -> int:
        """At the device's peak live state."""
    @property
    def pending_weight(self) -> int:
        """At the device's peak."""
    @property
    def in_backward(self) -> bool:
        """Its split B runs at the peak."""
    @property
    def recorded_bytes(self) -> int:
        """Gradients its split B records for W."""
    @property
    def activation_bytes(self) -> int: ...
    @property
    def static_bytes(self) -> int: ...
    @property
    def transient_bytes(self) -> int: ...
    @property
    def buffer_bytes(self) -> int: ...
    @property
    def memory(self) -> int:
        """Predicted peak bytes of its device."""

class PlanResult(_NoConstructor):
    """The solver's answer."""

    @property
    def feasible(self) -> bool: ...
    @property
    def stages(self) -> list[StageEval]:
        """Empty when infeasible."""
    @property
    def bottleneck(self) -> float: ...
    @property
    def total_time(self) -> float: ...
    @property
    def min_memory_limit(self) -> list[int]: ...

def solve_plan(problem: PlanProblem) -> PlanResult:
    """Exact planner: layer ranges and checkpointed layers minimizing the bottleneck device."""

def evaluate_plan(
    problem: PlanProblem, ranges: Sequence[tuple[int, int]], checkpoint: Sequence[Sequence[int]]
) -> list[StageEval]:
    """The planner's cost model applied to a given plan."""

# ---- end planner
