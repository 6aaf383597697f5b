// See list_scheduling.h.
#include "schedule/list_scheduling.h"

#include <c10/util/Exception.h>

#include <deque>
#include <set>

namespace pippy_xla {

namespace {

// The times of a list scheduler: when each rank is free, and the times at which something may
// change.
class ListClock {
 public:
  explicit ListClock(int32_t ranks) : free_at_(ranks, 0.0) { times_.insert(0.0); }
  // The earliest time something may change (false: none, the generator is stuck).
  bool next(double* t) {
    if (times_.empty()) return false;
    *t = *times_.begin();
    times_.erase(times_.begin());
    return true;
  }
  bool free(int32_t r, double t) const { return free_at_[r] <= t; }
  // Rank `r` runs an action of `cost` from `t`; returns its end.
  double run(int32_t r, double t, double cost) {
    free_at_[r] = t + cost;
    times_.insert(t + cost);
    return t + cost;
  }

 private:
  std::vector<double> free_at_;
  std::set<double> times_;
};

// Whether an action that ends at `end` (-1: not run) is done by time `t`.
bool done_by(double end, double t) { return end >= 0 && end <= t; }

// One pass of the rule of [Note: greedy schedules]. With `reserve`, a forward leaves one slot of
// the bound for each deeper stage of its rank.
class GreedyPass {
 public:
  GreedyPass(const Schedule& s, const Orders& f_order, const Orders& b_order,
             const std::vector<int32_t>& max_held, const Costs& costs, bool reserve)
      : s_(s),
        f_order_(f_order),
        b_order_(b_order),
        max_held_(max_held),
        costs_(costs),
        reserve_(reserve),
        order_(s.num_ranks),
        f_end_(s.num_stages * s.num_microbatches, -1),
        b_end_(s.num_stages * s.num_microbatches, -1),
        f_taken_(s.num_ranks),
        b_taken_(s.num_ranks),
        pending_w_(s.num_ranks),
        held_(s.num_ranks, 0),
        deeper_(s.num_stages, 0),
        clock_(s.num_ranks) {
    for (int32_t r = 0; r < s.num_ranks; ++r) {
      const auto mine = s.stages_of(r);  // ascending
      for (size_t i = 0; i < mine.size(); ++i)
        deeper_[mine[i]] = static_cast<int32_t>(mine.size() - 1 - i);
      f_taken_[r].assign(f_order[r].size(), false);
      b_taken_[r].assign(b_order[r].size(), false);
      remaining_ += 3 * static_cast<int64_t>(f_order[r].size());
    }
  }

  // False if every rank came to wait on another (the order is then partial).
  bool run() {
    while (remaining_ > 0) {
      if (!clock_.next(&t_)) return false;
      for (int32_t r = 0; r < s_.num_ranks; ++r)
        if (clock_.free(r, t_)) try_backward(r) || try_forward(r) || try_weight(r);
    }
    return true;
  }

  Orders& order() { return order_; }

 private:
  int32_t at(int32_t stage, int32_t mb) const { return stage * s_.num_microbatches + mb; }

  double start(int32_t r, const Action& a, const std::vector<double>& cost) {
    order_[r].push_back(a);
    --remaining_;
    return clock_.run(r, t_, stage_cost(cost, a.stage));
  }

  bool try_backward(int32_t r) {
    for (size_t k = 0; k < b_order_[r].size(); ++k) {
      const Action& a = b_order_[r][k];
      if (b_taken_[r][k] || !done_by(f_end_[at(a.stage, a.mb)], t_)) continue;
      if (a.stage < s_.num_stages - 1 && !done_by(b_end_[at(a.stage + 1, a.mb)], t_)) continue;
      b_taken_[r][k] = true;
      pending_w_[r].push_back({Op::W, a.stage, a.mb});
      b_end_[at(a.stage, a.mb)] = start(r, a, costs_.backward);
      return true;
    }
    return false;
  }

  bool try_forward(int32_t r) {
    for (size_t k = 0; k < f_order_[r].size() && held_[r] < max_held_[r]; ++k) {
      const Action& a = f_order_[r][k];
      if (f_taken_[r][k] || (a.stage > 0 && !done_by(f_end_[at(a.stage - 1, a.mb)], t_))) continue;
      if (reserve_ && held_[r] + deeper_[a.stage] >= max_held_[r]) continue;
      f_taken_[r][k] = true;
      ++held_[r];
      f_end_[at(a.stage, a.mb)] = start(r, a, costs_.forward);
      return true;
    }
    return false;
  }

  bool try_weight(int32_t r) {
    if (pending_w_[r].empty()) return false;
    const Action w = pending_w_[r].front();
    pending_w_[r].pop_front();
    --held_[r];
    start(r, w, costs_.weight);
    return true;
  }

  const Schedule& s_;
  const Orders& f_order_;
  const Orders& b_order_;
  const std::vector<int32_t>& max_held_;
  const Costs& costs_;
  const bool reserve_;
  Orders order_;
  std::vector<double> f_end_, b_end_;  // when F / B of (stage, mb) end; -1 while not run
  std::vector<std::vector<bool>> f_taken_, b_taken_;
  std::vector<std::deque<Action>> pending_w_;
  std::vector<int32_t> held_;
  std::vector<int32_t> deeper_;  // stages of the same rank after each stage
  ListClock clock_;
  int64_t remaining_ = 0;
  double t_ = 0.0;
};

}  // namespace

Orders zero_bubble_h1(int32_t p, int32_t m, const Costs& costs) {
  Orders order(p);
  // Time at which F / B of (stage, mb) finish; -1 while not run.
  std::vector<double> f_end(p * m, -1), b_end(p * m, -1);
  std::vector<int32_t> next_f(p, 0), next_b(p, 0), next_w(p, 0);
  ListClock clock(p);
  for (int32_t remaining = 3 * p * m; remaining > 0;) {
    double t = 0.0;
    TORCH_CHECK(clock.next(&t), "zero-bubble generator made no progress");
    for (int32_t r = 0; r < p; ++r) {
      if (!clock.free(r, t)) continue;
      const int32_t b = next_b[r], f = next_f[r];
      const bool b_ready = b < f && done_by(f_end[r * m + b], t) &&
                           (r == p - 1 || done_by(b_end[(r + 1) * m + b], t));
      const bool f_ready = f < m && f - next_b[r] < p - r && f - next_w[r] < p + 1 &&
                           (r == 0 || done_by(f_end[(r - 1) * m + f], t));
      if (b_ready) {
        order[r].push_back({Op::B, r, b});
        b_end[r * m + b] = clock.run(r, t, stage_cost(costs.backward, r));
        ++next_b[r];
      } else if (f_ready) {
        order[r].push_back({Op::F, r, f});
        f_end[r * m + f] = clock.run(r, t, stage_cost(costs.forward, r));
        ++next_f[r];
      } else if (next_w[r] < next_b[r]) {
        order[r].push_back({Op::W, r, next_w[r]++});
        clock.run(r, t, stage_cost(costs.weight, r));
      } else {
        continue;
      }
      --remaining;
    }
  }
  return order;
}

Orders greedy(const Schedule& s, const Orders& f_order, const Orders& b_order,
              const std::vector<int32_t>& max_held, const Costs& costs) {
  GreedyPass published(s, f_order, b_order, max_held, costs, false);
  if (published.run()) return std::move(published.order());
  GreedyPass reserving(s, f_order, b_order, max_held, costs, true);
  TORCH_CHECK(reserving.run(), "schedule '", s.name, "': the generator made no progress");
  return std::move(reserving.order());
}

}  // namespace pippy_xla
