// Exact planner: contiguous layer ranges per stage and a set of checkpointed layers per stage,
// minimizing the bottleneck device time under per-device memory limits.
//
// [Note: planner cost model]
// Stage s runs layers [start, stop) plus its extras (prologue on the first stage, epilogue on the
// last). A checkpointed layer recomputes its forward during backward. For a set C of checkpointed
// layers:
//   forward_s   = extra.fwd + sum_i fwd_i
//   backward_s  = extra.bwd + sum_i bwd_i + sum_{i in C} recompute_i     (W included)
//                 + [split] sum_{i in C} (weight_ckpt_i - weight_i)
//   weight_s    = [split] (extra.weight + sum_{i not in C} weight_i + sum_{i in C} weight_ckpt_i)
//   time_s      = forward_s + backward_s
//   saved_s     = extra.saved + sum_{i not in C} saved_i + sum_{i in C} saved_ckpt_i
//   kept_s      = split ? extra.weight_bytes + sum_{i not in C} weight_bytes_i
//                         + sum_{i in C} weight_bytes_ckpt_i
//                       : saved_s
//   recorded_s  = [split] (extra.recorded + sum_i recorded_i)
//   static_s    = extra.static + sum_i static_i
//   transient_s = max(extra.transient, max_i transient_i,
//                     C empty ? 0 : max_i (saved_i - saved_ckpt_i + transient_i))
//   split_transient_s = the same with split_transient in place of transient
//
// `split` is StageExtra::split_backward: the stage runs a split backward (ZB-H1, a stage whose
// inputs need gradients). Its B records the gradients W needs (recorded_s) and keeps kept_s per
// microbatch until W; W (weight_s) computes the weight gradients from them. A checkpointed
// layer's W recomputes the layer's forward once more (checkpoint's recomputation is per backward
// call), which weight_ckpt_i measures. A stage of a split schedule that does not split (the
// first: no input needs a gradient) runs its whole backward in W and keeps its whole graph from B
// to W, hence kept_s = saved_s.
//
// A device runs one stage, or several (interleaved). Its peak is
//   memory_d = sum_{s on d} (static_s + extra.buffers_s)
//              + max over stages t on d, and live states x of d while t computes, of
//                (x.in_b_t ? split_transient_t : transient_t)
//                + sum_{s on d} (x.forwarded_s * saved_s + x.pending_s * kept_s
//                                + x.in_b_s * recorded_s)
// The live states are the schedule's counts per stage of the device ([Note: live states] in
// schedule/simulator.h): microbatches whose activations the stage holds (forwarded, not
// backwarded); under a split backward, microbatches whose B has run and W not yet (pending), and
// whether a split B is running (its recorded gradients pile up on the microbatch's graph until B
// ends). 1F1B on stage s has the single state (min(stages - s, microbatches), 0, 0), GPipe
// (microbatches, 0, 0).
//
// transient_s is the largest working set on top of what the stage keeps: the temporaries of one
// layer's (or the prologue's / epilogue's) forward or backward, measured by the profiler, and for
// a stage with checkpointed layers the recomputed activations of one of them during its backward.
// The last term takes the max over the whole range rather than over C, so that the stage's memory
// depends on C only through (recompute time, saved bytes, kept bytes, C empty): exact for
// identical layers, an upper bound otherwise. It charges the recomputation on top of all of the
// microbatch's activations, which is what happens for the stage's top layer; a lower layer
// recomputes after the layers above it have run their backward and freed theirs, so the term
// over-estimates there (by up to 13% of a stage's peak in tests/test_planner.py). Among choices
// equal in time and bytes the solver therefore checkpoints the later layers.
//
// The objective is the bottleneck device time max_d sum_{s on d} time_s (with uniform per-stage
// work the 1F1B / GPipe step time is (microbatches + stages - 1) * bottleneck); ties are broken
// by the smallest total time. (saved_i is LayerCost::saved_bytes, saved_ckpt_i saved_bytes_ckpt;
// recompute_i is the measured extra backward time of a checkpointed layer, about one forward.)
//
// [Note: planner exactness]
// For a fixed range the stage's memory and time depend on C only through (recompute time, saved
// bytes, kept bytes, C empty), and each is to be minimized: a point dominated in all can never be
// better (memory is non-decreasing in each byte count, as live states are non-negative). The
// solver therefore keeps, per range, the exact Pareto frontier of these over all subsets of the
// range (built layer by layer: frontier(i, j+1) is the pruned union of frontier(i, j) with and
// without layer j checkpointed). No greedy rule is involved, so it is exact for heterogeneous
// layers too (choosing C is a knapsack; greedy by bytes-per-second is not exact). With identical
// layers a frontier has at most (stop - start + 1) points.
// With one stage per device (1F1B, GPipe, ZB-H1) the best C for a stage is the fastest frontier
// point that fits its device's limit; the stages are independent given their ranges, so the
// minimax DP
//   D[s][j] = min_{i<j} max(D[s-1][i], cost(s, i, j))
// over (stage, layer prefix) is exact, and a second DP minimizing the sum of stage times subject
// to cost <= D[S-1][L] breaks ties exactly. The smallest feasible memory limit is found by the
// same minimax DP on memory excess (the least memory_s - limit_s over the frontier), in exact
// integer arithmetic.
// With several stages per device (interleaved) the layer ranges are given (the engine runs equal
// ones), the devices are independent, and each device takes the fastest combination of its
// stages' frontier points that fits (an exhaustive search over the product of the frontiers).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "schedule/simulator.h"

namespace pippy_xla {

// Bound to Python with these field names and defaults (csrc/bindings/plan.cpp, pippy_xla/_C.pyi);
// the Python planner uses the bound classes, so there is one definition of each.
struct LayerCost {
  double fwd = 0.0;               // forward time
  double bwd = 0.0;               // backward time (without recomputation)
  double recompute = 0.0;         // extra backward time when checkpointed (measured)
  int64_t saved_bytes = 0;        // bytes saved for backward per microbatch, not checkpointed
  int64_t saved_bytes_ckpt = 0;   // bytes saved for backward per microbatch, checkpointed
  int64_t static_bytes = 0;       // parameters + gradients + optimizer state
  int64_t transient_bytes = 0;    // largest working set of its forward or backward (see above)
  double weight = 0.0;            // the part of bwd a split backward's W runs (measured)
  double weight_ckpt = 0.0;       // W's time when checkpointed (it recomputes the forward)
  int64_t weight_bytes = 0;       // kept from B to W per microbatch (split backward)
  int64_t weight_bytes_ckpt = 0;  // the same, checkpointed
  int64_t recorded_bytes = 0;     // the gradients a split B records for W (part of weight_bytes)
  int64_t split_transient_bytes = 0;  // a split B's working set on top of what it records
};

// A LayerCost from its fields, those not given (nullopt) derived from the others: recompute is
// fwd (a checkpointed layer runs its forward once more), weight_ckpt is weight and
// weight_bytes_ckpt is weight_bytes (checkpointing changes nothing of W). A default-constructed
// LayerCost follows the same rule. Bound as LayerCost's constructor, in this argument order.
LayerCost make_layer_cost(double fwd, double bwd, std::optional<double> recompute,
                          int64_t saved_bytes, int64_t saved_bytes_ckpt, int64_t static_bytes,
                          int64_t transient_bytes, double weight, std::optional<double> weight_ckpt,
                          int64_t weight_bytes, std::optional<int64_t> weight_bytes_ckpt,
                          int64_t recorded_bytes, int64_t split_transient_bytes);

struct StageExtra {
  double fwd = 0.0;
  double bwd = 0.0;
  int64_t saved_bytes = 0;  // per microbatch
  int64_t static_bytes = 0;
  int64_t transient_bytes = 0;
  int64_t buffer_bytes = 0;    // transfer buffers live during the step (receives posted ahead)
  double weight = 0.0;         // the part of bwd W runs under a split backward
  int64_t weight_bytes = 0;    // kept from B to W per microbatch (split backward)
  int64_t recorded_bytes = 0;  // the gradients a split B records for W
  int64_t split_transient_bytes = 0;  // a split B's working set on top of what it records
  bool split_backward = false;        // the stage runs B and W apart (see the cost model)
};

std::string to_string(const LayerCost& l);
std::string to_string(const StageExtra& e);

struct PlanProblem {
  std::vector<LayerCost> layers;
  std::vector<StageExtra> extras;  // per stage
  // Per device, per stage of the device (ascending): the schedule's live states while that stage
  // computes, each kLiveCounts counts per stage of the device: [forwarded not backwarded,
  // backwarded not weighted, running split B] (SimResult::live_states, [Note: live states] in
  // schedule/simulator.h).
  LiveStates live_states;
  std::vector<int64_t> memory_limit;  // per device
  std::vector<int32_t> stage_device;  // per stage: its device (empty: stage s on device s)
  // Given layer ranges (one per stage); empty: the solver chooses them (one stage per device).
  std::vector<std::pair<int32_t, int32_t>> ranges;
  bool allow_checkpoint = true;
};

struct StageEval {
  int32_t start = 0;
  int32_t stop = 0;
  std::vector<int32_t> checkpoint;  // global layer indices
  int32_t device = 0;
  double forward = 0.0;
  double backward = 0.0;  // including recomputation and W
  double weight = 0.0;    // W's part of backward (a splitting stage; else 0)
  double time = 0.0;
  int64_t saved_bytes = 0;   // per microbatch, forward to backward
  int64_t weight_bytes = 0;  // per microbatch, B to W (split backward)
  // At its device's peak live state: microbatches with activations, and with B done and W not.
  int32_t inflight = 0;
  int32_t pending_weight = 0;
  bool in_backward = false;  // its split B runs at the device's peak
  int64_t recorded_bytes = 0;
  // inflight * saved_bytes + pending_weight * weight_bytes + in_backward * recorded_bytes
  int64_t activation_bytes = 0;
  int64_t static_bytes = 0;
  // The device's (shared by its stages): the working set at its peak, transfer buffers, peak.
  int64_t transient_bytes = 0;
  int64_t buffer_bytes = 0;
  int64_t memory = 0;  // device: statics, activations and buffers of its stages + transient
};

struct PlanResult {
  bool feasible = false;
  std::vector<StageEval> stages;  // empty when infeasible
  double bottleneck = 0.0;
  double total_time = 0.0;
  // Smallest limits that admit a plan: memory_limit[d] + delta with the smallest such delta (one
  // shift for every device; with equal limits this is the smallest common limit).
  std::vector<int64_t> min_memory_limit;
};

// Throws c10::Error on malformed input (sizes, negative values, more stages than layers, several
// stages on a device without given ranges).
PlanResult solve_plan(const PlanProblem& problem);

// The cost model applied to a given plan (ranges and checkpointed global layer indices;
// problem.ranges is ignored).
std::vector<StageEval> evaluate_plan(const PlanProblem& problem,
                                     const std::vector<std::pair<int32_t, int32_t>>& ranges,
                                     const std::vector<std::vector<int32_t>>& checkpoint);

}  // namespace pippy_xla
