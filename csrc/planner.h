// Exact planner: contiguous layer ranges per stage and a set of checkpointed layers per stage,
// minimizing the bottleneck stage time under per-device memory limits.
//
// [Note: planner cost model]
// Stage s runs layers [start, stop) plus its extras (prologue on the first stage, epilogue on the
// last). A checkpointed layer recomputes its forward during backward. For a set C of checkpointed
// layers:
//   forward_s  = extra.fwd + sum_i fwd_i
//   backward_s = extra.bwd + sum_i bwd_i + sum_{i in C} recompute_i
//   time_s     = forward_s + backward_s
//   memory_s   = inflight_s * (extra.saved + sum_{i not in C} saved_i + sum_{i in C} saved_ckpt_i)
//                + extra.static + sum_i static_i + extra.buffers + transient_s
//   transient_s = max(extra.transient, max_i transient_i,
//                     C empty ? 0 : max_i (saved_i - saved_ckpt_i + transient_i))
// (saved_i is LayerCost::saved_bytes, saved_ckpt_i saved_bytes_ckpt, and so on; recompute_i is
// the measured extra backward time of a checkpointed layer, about one forward.)
// transient_s is the largest working set on top of what the stage keeps: the temporaries of one
// layer's (or the prologue's / epilogue's) forward or backward, measured by the profiler, and for
// a stage with checkpointed layers the recomputed activations of one of them during its backward.
// The last term takes the max over the whole range rather than over C, so that the stage's memory
// depends on C only through (recompute time, activation bytes, C empty): exact for identical
// layers, an upper bound otherwise. It charges the recomputation on top of all of the
// microbatch's activations, which is what happens for the stage's top layer; a lower layer
// recomputes after the layers above it have run their backward and freed theirs, so the term
// over-estimates there (by up to 13% of a stage's peak in tests/test_planner.py). Among choices
// equal in time and bytes the solver therefore checkpoints the later layers.
// where inflight_s is the number of microbatches whose activations stage s holds at once under
// the schedule (1F1B: min(stages - s, microbatches); GPipe: microbatches). The objective is the
// bottleneck max_s time_s (with uniform per-stage work the 1F1B / GPipe step time is
// (microbatches + stages - 1) * bottleneck); ties are broken by the smallest total time.
//
// [Note: planner exactness]
// For a fixed range the stage's memory and time depend on C only through the pair
// (recompute time, activation bytes), and both are to be minimized: a point dominated in both can
// never be better. The solver therefore keeps, per range, the exact Pareto frontier of these
// pairs over all subsets of the range (built layer by layer: frontier(i, j+1) is the pruned union
// of frontier(i, j) with and without layer j checkpointed). No greedy rule is involved, so it is
// exact for heterogeneous layers too (choosing C is a knapsack; greedy by bytes-per-second is not
// exact). With identical layers a frontier has at most (stop - start + 1) points. The best C for a
// stage is then the fastest frontier point that fits the stage's memory limit; the stages are
// independent given their ranges, so the minimax DP
//   D[s][j] = min_{i<j} max(D[s-1][i], cost(s, i, j))
// over (stage, layer prefix) is exact, and a second DP minimizing the sum of stage times subject
// to cost <= D[S-1][L] breaks ties exactly. The smallest feasible memory limit is found by the
// same minimax DP on memory excess (memory_s - limit_s with everything that helps checkpointed),
// in exact integer arithmetic.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

namespace pippy_xla {

// Bound to Python with these field names (csrc/bindings.cpp, pippy_xla/_C.pyi); the Python
// planner uses the bound classes, so there is one definition of each.
struct LayerCost {
  double fwd = 0.0;              // forward time
  double bwd = 0.0;              // backward time (without recomputation)
  double recompute = 0.0;        // extra backward time when checkpointed (measured)
  int64_t saved_bytes = 0;       // bytes saved for backward per microbatch, not checkpointed
  int64_t saved_bytes_ckpt = 0;  // bytes saved for backward per microbatch, checkpointed
  int64_t static_bytes = 0;      // parameters + gradients + optimizer state
  int64_t transient_bytes = 0;   // largest working set of its forward or backward (see above)
};

struct StageExtra {
  double fwd = 0.0;
  double bwd = 0.0;
  int64_t saved_bytes = 0;  // per microbatch
  int64_t static_bytes = 0;
  int64_t transient_bytes = 0;
  int64_t buffer_bytes = 0;  // transfer buffers live during the step (receives posted ahead)
};

struct PlanProblem {
  std::vector<LayerCost> layers;
  std::vector<StageExtra> extras;     // per stage
  std::vector<int64_t> inflight;      // per stage
  std::vector<int64_t> memory_limit;  // per stage (device)
  bool allow_checkpoint = true;
};

struct StageEval {
  int32_t start = 0;
  int32_t stop = 0;
  std::vector<int32_t> checkpoint;  // global layer indices
  double forward = 0.0;
  double backward = 0.0;
  double time = 0.0;
  int64_t activation_bytes = 0;  // inflight * per-microbatch saved bytes
  int64_t static_bytes = 0;
  int64_t transient_bytes = 0;
  int64_t buffer_bytes = 0;
  int64_t memory = 0;  // static + activations + buffers + transient
};

struct PlanResult {
  bool feasible = false;
  std::vector<StageEval> stages;  // empty when infeasible
  double bottleneck = 0.0;
  double total_time = 0.0;
  // Smallest limits that admit a plan: memory_limit[s] + delta with the smallest such delta (one
  // shift for every device; with equal limits this is the smallest common limit).
  std::vector<int64_t> min_memory_limit;
};

// Throws c10::Error on malformed input (sizes, negative values, more stages than layers).
PlanResult solve_plan(const PlanProblem& problem);

// The cost model applied to a given plan (ranges and checkpointed global layer indices).
std::vector<StageEval> evaluate_plan(const PlanProblem& problem,
                                     const std::vector<std::pair<int32_t, int32_t>>& ranges,
                                     const std::vector<std::vector<int32_t>>& checkpoint);

}  // namespace pippy_xla
