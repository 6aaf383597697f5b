// The validator and simulator of schedules (schedule.h): a schedule is valid when its actions
// are complete and well placed (validator.cpp) and the simulator runs it to the end without a
// deadlock (simulator.cpp); the simulator also turns per-action costs into per-rank timelines and
// records what each rank holds while it computes (memory_model.cpp).
#pragma once

#include <cstdint>
#include <vector>

#include "schedule/schedule.h"

namespace pippy_xla {

// Per-action costs (any unit; the engine records nanoseconds), for the simulator and for the
// orders of the list-scheduled schedules (see [Note: list scheduling at costs]). Each per-stage
// list is empty (unit costs) or has one entry per stage.
struct Costs {
  std::vector<double> forward;   // per stage
  std::vector<double> backward;  // per stage (input + weight gradients unless split)
  std::vector<double> weight;    // per stage (split backward only)
  double comm = 0.0;             // latency from a send's post to the data being receivable
  double send = 0.0;             // time a rank spends posting one send (SF, SB)
  double recv = 0.0;             // time a rank spends posting one receive (RF, RB)

  // Whether any per-stage list is given (a schedule ordered at these costs).
  bool per_stage() const { return !forward.empty() || !backward.empty() || !weight.empty(); }
};

// The cost of one compute action of `stage` from a per-stage list of Costs (1 when it is empty).
double stage_cost(const std::vector<double>& per_stage, int32_t stage);

// Throws c10::Error unless each per-stage list of `costs` is empty or has one entry per stage of
// `s`, and every cost is finite and not negative. `what` starts the message.
void check_costs(const Schedule& s, const Costs& costs, const char* what);

struct TimedAction {
  Action action;
  int32_t rank;
  double start;
  double end;
};

// Counts per stage in a live state: [forwarded not backwarded, backwarded not weighted, running
// split B]; see [Note: live states].
constexpr int32_t kLiveCounts = 3;

// [Note: live states] Per rank, what its stages hold while each compute action runs, as
// kLiveCounts counts per stage of the rank (stages ascending): microbatches forwarded and not yet
// backwarded (their saved activations); microbatches backwarded and not yet weighted (what a
// split backward keeps from B to W); and 1 while a split B runs on the stage (the gradients it
// records for W pile up on top of the microbatch's graph until B ends). The last two are 0
// without a split backward. While an action runs, both what it consumes and what it produces are
// alive, so its state is the entrywise max of the counts before and after it; a split B, which
// turns the microbatch's graph into what it keeps for W (the graph freed as B ends), has two:
// the counts before it with the running-B count set, and the counts after it.
// live_states[r][k] lists the states of the actions of the rank's k-th stage that no other of
// them covers entrywise: the rank's peak is the largest, over k and those states, of the
// non-negative per-microbatch bytes weighted by the state plus stage k's working set.
using LiveStates = std::vector<std::vector<std::vector<std::vector<int32_t>>>>;

struct SimResult {
  std::vector<TimedAction> timeline;  // sorted by start time (stable: rank order on ties)
  double makespan = 0.0;
  double bubble = 0.0;                 // 1 - busy compute time / (ranks * makespan)
  std::vector<int32_t> peak_inflight;  // per stage: most forwards whose backward was pending
                                       // (all zero for a forward-only schedule)
  LiveStates live_states;              // see [Note: live states]
};

// The validator's structural half: throws c10::Error naming the first missing, duplicated,
// misplaced or misordered action of `s`.
void check_actions(const Schedule& s);

// The memory model: the live states of every rank of `s` (see [Note: live states]), which follow
// each rank's action list regardless of timing.
LiveStates live_states(const Schedule& s);
// Per stage of `s`, the most microbatches forwarded and not yet done with (weighted, or fully
// backwarded) at once: the largest such count over `states` (live_states(s)).
std::vector<int32_t> peak_inflight(const Schedule& s, const LiveStates& states);

// Throws c10::Error naming the first problem: a missing, duplicated or misplaced action, a receive
// without a send, or a deadlock (with the action each rank is blocked on).
void validate(const Schedule& s);
SimResult simulate(const Schedule& s, const Costs& costs);

}  // namespace pippy_xla
