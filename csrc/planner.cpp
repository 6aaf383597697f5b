#include "planner.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <limits>

#include "schedule.h"

namespace pippy_xla {

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

// One Pareto-optimal (recompute time, activation bytes) choice of checkpointed layers for a
// range [i, j). `parent` indexes the frontier of [i, j - 1); `ckpt` says whether layer j - 1 is
// checkpointed. See [Note: planner exactness].
struct Point {
  double time;
  int64_t bytes;
  int32_t parent;
  bool ckpt;
  bool any;  // some layer of the range is checkpointed
};

struct Frontiers {
  int32_t num_layers = 0;
  // by_start[i][j - i - 1]: frontier of [i, j), sorted by time ascending, bytes strictly
  // descending.
  std::vector<std::vector<std::vector<Point>>> by_start;
  std::vector<std::vector<double>> base_time;      // sum of fwd + bwd over [i, j)
  std::vector<std::vector<int64_t>> static_bytes;  // sum of static bytes over [i, j)
  std::vector<std::vector<int64_t>> transient;     // max transient_i over [i, j)
  std::vector<std::vector<int64_t>> recompute;     // max saved_i - saved_ckpt_i + transient_i

  const std::vector<Point>& at(int32_t i, int32_t j) const { return by_start[i][j - i - 1]; }
};

void check_problem(const PlanProblem& p) {
  const auto num_layers = static_cast<int64_t>(p.layers.size());
  const auto num_stages = static_cast<int64_t>(p.memory_limit.size());
  TORCH_CHECK(num_stages >= 1, "planner: need at least one stage (one memory limit per stage)");
  check_stage_count(num_layers, num_stages);
  TORCH_CHECK(static_cast<int64_t>(p.extras.size()) == num_stages &&
                  static_cast<int64_t>(p.inflight.size()) == num_stages,
              "planner: extras (", p.extras.size(), ") and inflight (", p.inflight.size(),
              ") need one entry per stage (", num_stages, ")");
  for (size_t i = 0; i < p.layers.size(); ++i) {
    const LayerCost& l = p.layers[i];
    TORCH_CHECK(l.fwd >= 0 && l.bwd >= 0 && l.recompute >= 0 && l.saved_bytes >= 0 &&
                    l.saved_bytes_ckpt >= 0 && l.static_bytes >= 0 && l.transient_bytes >= 0,
                "planner: layer ", i, " has a negative cost");
  }
  for (int64_t s = 0; s < num_stages; ++s) {
    const StageExtra& e = p.extras[s];
    TORCH_CHECK(e.fwd >= 0 && e.bwd >= 0 && e.saved_bytes >= 0 && e.static_bytes >= 0 &&
                    e.transient_bytes >= 0 && e.buffer_bytes >= 0,
                "planner: stage ", s, " extras have a negative cost");
    TORCH_CHECK(p.inflight[s] >= 0, "planner: stage ", s, " has negative in-flight count ",
                p.inflight[s]);
  }
}

// What a checkpointed layer's backward holds on top of the stage: its recomputed activations
// (beyond the inputs the checkpoint kept) and its own working set.
int64_t recompute_bytes(const LayerCost& l) {
  return std::max<int64_t>(0, l.saved_bytes - l.saved_bytes_ckpt) + l.transient_bytes;
}

int64_t stage_transient(const StageExtra& e, int64_t layers_transient, int64_t layers_recompute,
                        bool any_checkpointed) {
  return std::max({e.transient_bytes, layers_transient, any_checkpointed ? layers_recompute : 0});
}

Frontiers build_frontiers(const PlanProblem& p) {
  const auto n = static_cast<int32_t>(p.layers.size());
  Frontiers f;
  f.num_layers = n;
  f.by_start.resize(n);
  f.base_time.resize(n);
  f.static_bytes.resize(n);
  f.transient.resize(n);
  f.recompute.resize(n);
  std::vector<Point> merged;
  for (int32_t i = 0; i < n; ++i) {
    auto& fronts = f.by_start[i];
    fronts.reserve(n - i);
    std::vector<Point> prev{{0.0, 0, -1, false, false}};
    double base = 0.0;
    int64_t stat = 0, trans = 0, recomp = 0;
    for (int32_t j = i + 1; j <= n; ++j) {
      const LayerCost& l = p.layers[j - 1];
      base += l.fwd + l.bwd;
      stat += l.static_bytes;
      trans = std::max(trans, l.transient_bytes);
      recomp = std::max(recomp, recompute_bytes(l));
      f.base_time[i].push_back(base);
      f.static_bytes[i].push_back(stat);
      f.transient[i].push_back(trans);
      f.recompute[i].push_back(recomp);
      // Merge "layer j-1 kept" (a) with "layer j-1 checkpointed" (b), both sorted by time.
      merged.clear();
      const auto m = static_cast<int32_t>(prev.size());
      int32_t ia = 0, ib = 0;
      auto push = [&](const Point& q) {
        if (merged.empty() || q.bytes < merged.back().bytes) {
          if (!merged.empty() && q.time == merged.back().time)
            merged.back() = q;
          else
            merged.push_back(q);
        }
      };
      while (ia < m || (p.allow_checkpoint && ib < m)) {
        bool take_a;
        if (!p.allow_checkpoint || ib >= m) {
          take_a = true;
        } else if (ia >= m) {
          take_a = false;
        } else {
          const double ta = prev[ia].time, tb = prev[ib].time + l.recompute;
          const int64_t ba = prev[ia].bytes + l.saved_bytes,
                        bb = prev[ib].bytes + l.saved_bytes_ckpt;
          // Exact ties go to checkpointing layer j - 1, the later layer: see [Note: planner cost
          // model] on why upper layers are the better choice.
          take_a = ta < tb || (ta == tb && ba < bb);
        }
        if (take_a) {
          push({prev[ia].time, prev[ia].bytes + l.saved_bytes, ia, false, prev[ia].any});
          ++ia;
        } else {
          push({prev[ib].time + l.recompute, prev[ib].bytes + l.saved_bytes_ckpt, ib, true, true});
          ++ib;
        }
      }
      fronts.push_back(merged);
      prev = fronts.back();
    }
  }
  return f;
}

struct StageCost {
  double time = kInf;  // +inf: no choice of checkpoints fits the memory limit
  int32_t point = -1;
};

class StageCosts {
 public:
  StageCosts(const PlanProblem& p, const Frontiers& f) : p_(p), f_(f) {}

  int64_t memory(int32_t s, int32_t i, int32_t j, const Point& q) const {
    const StageExtra& e = p_.extras[s];
    const int32_t r = j - i - 1;
    return p_.inflight[s] * (e.saved_bytes + q.bytes) + e.static_bytes + f_.static_bytes[i][r] +
           e.buffer_bytes + stage_transient(e, f_.transient[i][r], f_.recompute[i][r], q.any);
  }

  // Fastest frontier point of [i, j) that fits stage s's limit. Along the frontier bytes fall as
  // time rises; only its first point can lack checkpointed layers (and recomputation's
  // transient), so memory falls monotonically from the second point on.
  StageCost cost(int32_t s, int32_t i, int32_t j) const {
    const auto& front = f_.at(i, j);
    const int64_t limit = p_.memory_limit[s];
    int32_t lo = 0;
    if (memory(s, i, j, front[0]) > limit) {
      lo = 1;
      int32_t hi = static_cast<int32_t>(front.size());
      while (lo < hi) {
        const int32_t mid = (lo + hi) / 2;
        if (memory(s, i, j, front[mid]) <= limit)
          hi = mid;
        else
          lo = mid + 1;
      }
      if (lo == static_cast<int32_t>(front.size())) return {};
    }
    const StageExtra& e = p_.extras[s];
    return {e.fwd + e.bwd + f_.base_time[i][j - i - 1] + front[lo].time, lo};
  }

  int64_t excess(int32_t s, int32_t i, int32_t j) const {
    const auto& front = f_.at(i, j);
    return std::min(memory(s, i, j, front.front()), memory(s, i, j, front.back())) -
           p_.memory_limit[s];
  }

 private:
  const PlanProblem& p_;
  const Frontiers& f_;
};

}  // namespace

std::vector<StageEval> evaluate_plan(const PlanProblem& p,
                                     const std::vector<std::pair<int32_t, int32_t>>& ranges,
                                     const std::vector<std::vector<int32_t>>& checkpoint) {
  check_problem(p);
  const auto num_stages = static_cast<int32_t>(p.memory_limit.size());
  const auto num_layers = static_cast<int32_t>(p.layers.size());
  TORCH_CHECK(static_cast<int32_t>(ranges.size()) == num_stages &&
                  static_cast<int32_t>(checkpoint.size()) == num_stages,
              "evaluate_plan: need one range and one checkpoint list per stage (", num_stages,
              "), got ", ranges.size(), " and ", checkpoint.size());
  std::vector<StageEval> out;
  int32_t expected = 0;
  for (int32_t s = 0; s < num_stages; ++s) {
    const auto [start, stop] = ranges[s];
    TORCH_CHECK(start == expected && stop > start && stop <= num_layers,
                "evaluate_plan: ranges must be contiguous, non-empty and cover all ", num_layers,
                " layers; stage ", s, " has [", start, ", ", stop, ")");
    expected = stop;
    std::vector<bool> ck(stop - start, false);
    for (int32_t k : checkpoint[s]) {
      TORCH_CHECK(k >= start && k < stop, "evaluate_plan: checkpointed layer ", k,
                  " is not in stage ", s, "'s range [", start, ", ", stop, ")");
      ck[k - start] = true;
    }
    const StageExtra& e = p.extras[s];
    int64_t layers_transient = 0, layers_recompute = 0;
    for (int32_t k = start; k < stop; ++k) {
      layers_transient = std::max(layers_transient, p.layers[k].transient_bytes);
      layers_recompute = std::max(layers_recompute, recompute_bytes(p.layers[k]));
    }
    StageEval ev;
    ev.start = start;
    ev.stop = stop;
    ev.forward = e.fwd;
    ev.backward = e.bwd;
    int64_t bytes = e.saved_bytes;
    ev.static_bytes = e.static_bytes;
    for (int32_t k = start; k < stop; ++k) {
      const LayerCost& l = p.layers[k];
      ev.forward += l.fwd;
      ev.backward += l.bwd + (ck[k - start] ? l.recompute : 0.0);
      bytes += ck[k - start] ? l.saved_bytes_ckpt : l.saved_bytes;
      ev.static_bytes += l.static_bytes;
      if (ck[k - start]) ev.checkpoint.push_back(k);
    }
    ev.time = ev.forward + ev.backward;
    ev.activation_bytes = p.inflight[s] * bytes;
    ev.transient_bytes =
        stage_transient(e, layers_transient, layers_recompute, !ev.checkpoint.empty());
    ev.buffer_bytes = e.buffer_bytes;
    ev.memory = ev.activation_bytes + ev.static_bytes + ev.buffer_bytes + ev.transient_bytes;
    out.push_back(std::move(ev));
  }
  TORCH_CHECK(expected == num_layers, "evaluate_plan: ranges end at layer ", expected, ", not ",
              num_layers);
  return out;
}

PlanResult solve_plan(const PlanProblem& p) {
  check_problem(p);
  const auto S = static_cast<int32_t>(p.memory_limit.size());
  const auto L = static_cast<int32_t>(p.layers.size());
  const Frontiers fr = build_frontiers(p);
  const StageCosts costs(p, fr);
  PlanResult result;

  // Smallest uniform shift of the limits that admits a plan (minimax over memory excess).
  {
    constexpr int64_t kBig = std::numeric_limits<int64_t>::max();
    std::vector<std::vector<int64_t>> X(S, std::vector<int64_t>(L + 1, kBig));
    for (int32_t j = 1; j <= L - (S - 1); ++j) X[0][j] = costs.excess(0, 0, j);
    for (int32_t s = 1; s < S; ++s)
      for (int32_t j = s + 1; j <= L - (S - 1 - s); ++j)
        for (int32_t i = s; i < j; ++i)
          if (X[s - 1][i] != kBig)
            X[s][j] = std::min(X[s][j], std::max(X[s - 1][i], costs.excess(s, i, j)));
    const int64_t delta = X[S - 1][L];
    for (int32_t s = 0; s < S; ++s) result.min_memory_limit.push_back(p.memory_limit[s] + delta);
    if (delta > 0) return result;
  }

  // Minimax DP on the bottleneck stage time.
  std::vector<std::vector<double>> D(S, std::vector<double>(L + 1, kInf));
  for (int32_t j = 1; j <= L - (S - 1); ++j) D[0][j] = costs.cost(0, 0, j).time;
  for (int32_t s = 1; s < S; ++s)
    for (int32_t j = s + 1; j <= L - (S - 1 - s); ++j)
      for (int32_t i = s; i < j; ++i)
        if (D[s - 1][i] < kInf)
          D[s][j] = std::min(D[s][j], std::max(D[s - 1][i], costs.cost(s, i, j).time));
  const double best = D[S - 1][L];
  TORCH_CHECK(best < kInf, "planner: internal error: feasible memory but no finite plan");

  // Tie-break: least total time among plans whose stages all take at most `best`.
  std::vector<std::vector<double>> E(S, std::vector<double>(L + 1, kInf));
  std::vector<std::vector<int32_t>> arg(S, std::vector<int32_t>(L + 1, -1));
  for (int32_t j = 1; j <= L - (S - 1); ++j) {
    const double c = costs.cost(0, 0, j).time;
    if (c <= best) E[0][j] = c, arg[0][j] = 0;
  }
  for (int32_t s = 1; s < S; ++s)
    for (int32_t j = s + 1; j <= L - (S - 1 - s); ++j)
      for (int32_t i = s; i < j; ++i) {
        if (E[s - 1][i] == kInf) continue;
        const double c = costs.cost(s, i, j).time;
        if (c > best) continue;
        const double total = E[s - 1][i] + c;
        if (total < E[s][j]) E[s][j] = total, arg[s][j] = i;
      }
  TORCH_CHECK(E[S - 1][L] < kInf, "planner: internal error: tie-break DP found no plan");

  std::vector<std::pair<int32_t, int32_t>> ranges(S);
  std::vector<std::vector<int32_t>> ckpt(S);
  int32_t j = L;
  for (int32_t s = S - 1; s >= 0; --s) {
    const int32_t i = arg[s][j];
    ranges[s] = {i, j};
    int32_t point = costs.cost(s, i, j).point;
    for (int32_t k = j; k > i; --k) {
      const Point& q = fr.at(i, k)[point];
      if (q.ckpt) ckpt[s].push_back(k - 1);
      point = q.parent;
    }
    std::reverse(ckpt[s].begin(), ckpt[s].end());
    j = i;
  }
  result.feasible = true;
  result.stages = evaluate_plan(p, ranges, ckpt);
  for (const auto& st : result.stages) {
    result.bottleneck = std::max(result.bottleneck, st.time);
    result.total_time += st.time;
  }
  return result;
}

}  // namespace pippy_xla
