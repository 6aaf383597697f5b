// The simulator's memory model: see [Note: live states] in simulator.h.
#include <algorithm>

#include "schedule/simulator.h"

namespace pippy_xla {

namespace {

using State = std::vector<int32_t>;

bool covers(const State& x, const State& y) {
  for (size_t i = 0; i < x.size(); ++i)
    if (x[i] < y[i]) return false;
  return true;
}

// Adds `x` to `states` unless one of them covers it, dropping those it covers.
void add_state(std::vector<State>& states, State x) {
  if (std::any_of(states.begin(), states.end(), [&](const State& y) { return covers(y, x); }))
    return;
  states.erase(
      std::remove_if(states.begin(), states.end(), [&](const State& y) { return covers(x, y); }),
      states.end());
  states.push_back(std::move(x));
}

// The counts after compute action `op` of the stage whose counts start at `k` of `before`.
State after_action(const Schedule& s, Op op, size_t k, const State& before) {
  State after = before;
  if (op == Op::F) {
    ++after[k];
  } else if (op == Op::B) {
    --after[k];
    if (s.split_backward) ++after[k + 1];
  } else {
    --after[k + 1];
  }
  return after;
}

// The states while the action runs, from the counts before and after it.
std::vector<State> states_during(const Schedule& s, Op op, size_t k, const State& before,
                                 const State& after) {
  if (op == Op::B && s.split_backward) {
    std::vector<State> during = {before, after};
    during[0][k + 2] = 1;
    return during;
  }
  State both(before.size());
  for (size_t i = 0; i < before.size(); ++i) both[i] = std::max(before[i], after[i]);
  return {both};
}

std::vector<std::vector<State>> rank_states(const Schedule& s, int32_t r) {
  const auto mine = s.stages_of(r);
  std::vector<std::vector<State>> out(mine.size());
  State before(kLiveCounts * mine.size(), 0);
  for (const Action& a : s.actions[r]) {
    if (!s.backward || !is_compute(a.op)) continue;
    const size_t local = std::find(mine.begin(), mine.end(), a.stage) - mine.begin();
    const size_t k = kLiveCounts * local;
    State after = after_action(s, a.op, k, before);
    for (State& x : states_during(s, a.op, k, before, after)) add_state(out[local], std::move(x));
    before = std::move(after);
  }
  return out;
}

}  // namespace

LiveStates live_states(const Schedule& s) {
  LiveStates out;
  for (int32_t r = 0; r < s.num_ranks; ++r) out.push_back(rank_states(s, r));
  return out;
}

std::vector<int32_t> peak_inflight(const Schedule& s, const LiveStates& states) {
  // A stage's most microbatches in flight come right after one of its own forwards, a state of
  // its own list.
  std::vector<int32_t> peak(s.num_stages, 0);
  for (int32_t r = 0; r < s.num_ranks; ++r) {
    const auto mine = s.stages_of(r);
    for (size_t local = 0; local < mine.size(); ++local) {
      const size_t k = kLiveCounts * local;
      for (const State& x : states[r][local])
        peak[mine[local]] = std::max(peak[mine[local]], x[k] + x[k + 1]);
    }
  }
  return peak;
}

}  // namespace pippy_xla
