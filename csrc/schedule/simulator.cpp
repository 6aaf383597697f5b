// The simulator: runs each rank's action list in order, every action as soon as its rank is free
// and its inputs are there, at the given costs; a schedule it cannot finish deadlocks.
#include "schedule/simulator.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <sstream>

namespace pippy_xla {

double stage_cost(const std::vector<double>& per_stage, int32_t stage) {
  return per_stage.empty() ? 1.0 : per_stage[stage];
}

void check_costs(const Schedule& s, const Costs& costs, const char* what) {
  for (const auto* v : {&costs.forward, &costs.backward, &costs.weight}) {
    TORCH_CHECK(v->empty() || static_cast<int32_t>(v->size()) == s.num_stages, what,
                ": per-stage costs need one entry per stage (", s.num_stages, "), got ", v->size(),
                "; pass an empty list for unit costs");
    for (double c : *v)
      TORCH_CHECK(std::isfinite(c) && c >= 0, what, ": costs must be finite and >= 0, got ", c);
  }
  for (double c : {costs.comm, costs.send, costs.recv})
    TORCH_CHECK(std::isfinite(c) && c >= 0, what, ": costs must be finite and >= 0, got ", c);
}

namespace {

double cost_of(const Costs& costs, const Action& a) {
  switch (a.op) {
    case Op::F:
      return stage_cost(costs.forward, a.stage);
    case Op::B:
      return stage_cost(costs.backward, a.stage);
    case Op::W:
      return stage_cost(costs.weight, a.stage);
    case Op::SEND_F:
    case Op::SEND_B:
      return costs.send;
    case Op::RECV_F:
    case Op::RECV_B:
      return costs.recv;
  }
  return 0.0;
}

// The actions run so far, by their end times.
class Timeline {
 public:
  Timeline(const Schedule& s, const Costs& costs) : s_(s), costs_(costs) {}

  // Whether `a` of rank `r` can start; if so, `*t` is the earliest time its inputs are there.
  bool ready(int32_t r, const Action& a, double* t) const {
    *t = 0.0;
    switch (a.op) {
      case Op::F: {
        Action prev;
        if (!s_.prev_forward(a.stage, a.mb, &prev)) return true;
        return input(r, prev, Op::SEND_F, t);
      }
      case Op::B:
        if (!end_of({Op::F, a.stage, a.mb}, t)) return false;
        if (a.stage == s_.num_stages - 1) return true;
        return input(r, {Op::B, a.stage + 1, a.mb}, Op::SEND_B, t);
      case Op::W:
        return end_of({Op::B, a.stage, a.mb}, t);
      case Op::SEND_F:
        return end_of({Op::F, a.stage, a.mb}, t);
      case Op::SEND_B:
        return end_of({Op::B, a.stage, a.mb}, t);
      case Op::RECV_F:
      case Op::RECV_B:
        return true;
    }
    return false;
  }

  void record(const Action& a, double end) { done_[a] = end; }

 private:
  bool end_of(const Action& a, double* t) const {
    auto it = done_.find(a);
    if (it == done_.end()) return false;
    *t = it->second;
    return true;
  }

  // The input that compute action `from` produces for rank `r`: at its end on the same rank,
  // else `comm` after the end of its send.
  bool input(int32_t r, const Action& from, Op send, double* t) const {
    if (s_.stage_rank[from.stage] == r) return end_of(from, t);
    if (!end_of({send, from.stage, from.mb}, t)) return false;
    *t += costs_.comm;
    return true;
  }

  const Schedule& s_;
  const Costs& costs_;
  std::map<Action, double> done_;
};

// Runs every rank's actions as far as they can go; returns the busy compute time.
double run(const Schedule& s, const Costs& costs, SimResult& res, std::vector<size_t>& pc,
           std::vector<double>& clock) {
  Timeline timeline(s, costs);
  double busy = 0.0;
  for (bool progress = true; progress;) {
    progress = false;
    for (int32_t r = 0; r < s.num_ranks; ++r) {
      while (pc[r] < s.actions[r].size()) {
        const Action& a = s.actions[r][pc[r]];
        double t = 0.0;
        if (!timeline.ready(r, a, &t)) break;
        const double start = std::max(clock[r], t), end = start + cost_of(costs, a);
        clock[r] = end;
        timeline.record(a, end);
        res.timeline.push_back({a, r, start, end});
        if (is_compute(a.op)) busy += end - start;
        ++pc[r];
        progress = true;
      }
    }
  }
  return busy;
}

}  // namespace

SimResult simulate(const Schedule& s, const Costs& costs) {
  check_actions(s);
  check_costs(s, costs, "simulate");
  SimResult res;
  res.live_states = live_states(s);
  res.peak_inflight = peak_inflight(s, res.live_states);
  std::vector<size_t> pc(s.num_ranks, 0);
  std::vector<double> clock(s.num_ranks, 0.0);
  const double busy = run(s, costs, res, pc, clock);
  std::ostringstream blocked;
  for (int32_t r = 0; r < s.num_ranks; ++r)
    if (pc[r] < s.actions[r].size())
      blocked << " rank " << r << " waits at " << to_string(s.actions[r][pc[r]]) << ";";
  TORCH_CHECK(blocked.str().empty(), "schedule '", s.name, "' deadlocks:", blocked.str());
  std::stable_sort(res.timeline.begin(), res.timeline.end(),
                   [](const TimedAction& x, const TimedAction& y) { return x.start < y.start; });
  for (double c : clock) res.makespan = std::max(res.makespan, c);
  res.bubble = res.makespan > 0 ? 1.0 - busy / (s.num_ranks * res.makespan) : 0.0;
  return res;
}

void validate(const Schedule& s) { simulate(s, Costs{}); }

}  // namespace pippy_xla
