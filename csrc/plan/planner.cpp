#include "plan/planner.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <limits>
#include <optional>

#include "schedule/layout.h"
#include "schedule/simulator.h"

namespace pippy_xla {

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

// One Pareto-optimal (recompute time, saved bytes, kept bytes, any) choice of checkpointed layers
// for a range [i, j). `parent` indexes the frontier of [i, j - 1); `ckpt` says whether layer j - 1
// is checkpointed. See [Note: planner exactness].
struct Point {
  double time;
  int64_t bytes;   // saved for backward, per microbatch
  int64_t wbytes;  // kept from B to W, per microbatch
  int32_t parent;
  bool ckpt;
  bool any;  // some layer of the range is checkpointed
};

struct Frontiers {
  int32_t num_layers = 0;
  bool split = false;  // built for stages that split their backward
  // by_start[i][j - i - 1]: frontier of [i, j), sorted by time ascending.
  std::vector<std::vector<std::vector<Point>>> by_start;
  std::vector<std::vector<double>> base_time;         // sum of fwd + bwd over [i, j)
  std::vector<std::vector<double>> weight_time;       // sum of weight over [i, j)
  std::vector<std::vector<int64_t>> static_bytes;     // sum of static bytes over [i, j)
  std::vector<std::vector<int64_t>> transient;        // max transient_i over [i, j)
  std::vector<std::vector<int64_t>> recompute;        // max saved_i - saved_ckpt_i + transient_i
  std::vector<std::vector<int64_t>> recorded;         // sum of recorded bytes over [i, j)
  std::vector<std::vector<int64_t>> split_transient;  // max split_transient_i over [i, j)

  const std::vector<Point>& at(int32_t i, int32_t j) const { return by_start[i][j - i - 1]; }
};

int32_t device_of(const PlanProblem& p, int32_t s) {
  return p.stage_device.empty() ? s : p.stage_device[s];
}

// Per device, its stages ascending.
std::vector<std::vector<int32_t>> stages_by_device(const PlanProblem& p) {
  std::vector<std::vector<int32_t>> out(p.memory_limit.size());
  for (int32_t s = 0; s < static_cast<int32_t>(p.extras.size()); ++s)
    out[device_of(p, s)].push_back(s);
  return out;
}

void check_ranges(const std::vector<std::pair<int32_t, int32_t>>& ranges, int32_t num_layers,
                  const char* who) {
  int32_t expected = 0;
  for (size_t s = 0; s < ranges.size(); ++s) {
    const auto [start, stop] = ranges[s];
    TORCH_CHECK(start == expected && stop > start && stop <= num_layers, who,
                ": ranges must be contiguous, non-empty and cover all ", num_layers,
                " layers; stage ", s, " has [", start, ", ", stop, ")");
    expected = stop;
  }
  TORCH_CHECK(expected == num_layers, who, ": ranges end at layer ", expected, ", not ",
              num_layers);
}

// Every device runs a stage (one, unless ranges are given), with one list of live states per
// stage of the device, each state kLiveCounts non-negative counts per stage.
void check_devices(const PlanProblem& p) {
  const auto num_devices = static_cast<int64_t>(p.memory_limit.size());
  const auto by_device = stages_by_device(p);
  for (int64_t d = 0; d < num_devices; ++d) {
    TORCH_CHECK(!by_device[d].empty(), "planner: device ", d, " runs no stage");
    TORCH_CHECK(by_device[d].size() == 1 || !p.ranges.empty(), "planner: device ", d, " runs ",
                by_device[d].size(),
                " stages; give the layer ranges (the solver chooses ranges "
                "only with one stage per device)");
    TORCH_CHECK(p.live_states[d].size() == by_device[d].size(), "planner: device ", d, " has ",
                p.live_states[d].size(),
                " lists of live states; need one per stage of the device (", by_device[d].size(),
                ")");
    for (const auto& of_stage : p.live_states[d]) {
      TORCH_CHECK(!of_stage.empty(), "planner: a stage of device ", d, " has no live state");
      for (const auto& x : of_stage) {
        TORCH_CHECK(x.size() == kLiveCounts * by_device[d].size(),
                    "planner: a live state of device ", d, " has ", x.size(), " counts; need ",
                    kLiveCounts, " per stage of the device (", kLiveCounts * by_device[d].size(),
                    ")");
        for (int32_t c : x) TORCH_CHECK(c >= 0, "planner: negative live count on device ", d);
      }
    }
  }
}

// No cost is negative, and W takes no more than the backward it is part of.
void check_costs_valid(const PlanProblem& p) {
  for (size_t i = 0; i < p.layers.size(); ++i) {
    const LayerCost& l = p.layers[i];
    TORCH_CHECK(l.fwd >= 0 && l.bwd >= 0 && l.recompute >= 0 && l.saved_bytes >= 0 &&
                    l.saved_bytes_ckpt >= 0 && l.static_bytes >= 0 && l.transient_bytes >= 0 &&
                    l.weight >= 0 && l.weight <= l.bwd && l.weight_ckpt >= 0 &&
                    l.weight_bytes >= 0 && l.weight_bytes_ckpt >= 0 && l.recorded_bytes >= 0 &&
                    l.split_transient_bytes >= 0,
                "planner: layer ", i, " has a negative cost (or weight > bwd)");
  }
  for (size_t s = 0; s < p.extras.size(); ++s) {
    const StageExtra& e = p.extras[s];
    TORCH_CHECK(e.fwd >= 0 && e.bwd >= 0 && e.saved_bytes >= 0 && e.static_bytes >= 0 &&
                    e.transient_bytes >= 0 && e.buffer_bytes >= 0 && e.weight >= 0 &&
                    e.weight <= e.bwd && e.weight_bytes >= 0 && e.recorded_bytes >= 0 &&
                    e.split_transient_bytes >= 0,
                "planner: stage ", s, " extras have a negative cost (or weight > bwd)");
  }
}

void check_problem(const PlanProblem& p) {
  const auto num_layers = static_cast<int64_t>(p.layers.size());
  const auto num_stages = static_cast<int64_t>(p.extras.size());
  const auto num_devices = static_cast<int64_t>(p.memory_limit.size());
  TORCH_CHECK(num_stages >= 1 && num_devices >= 1,
              "planner: need at least one stage and one device (memory limit)");
  check_stage_count(num_layers, num_stages);
  TORCH_CHECK(p.stage_device.empty() || static_cast<int64_t>(p.stage_device.size()) == num_stages,
              "planner: stage_device has ", p.stage_device.size(), " entries for ", num_stages,
              " stages");
  TORCH_CHECK(!p.stage_device.empty() || num_devices == num_stages, "planner: ", num_devices,
              " memory limits for ", num_stages, " stages on their own devices");
  TORCH_CHECK(static_cast<int64_t>(p.live_states.size()) == num_devices, "planner: live_states (",
              p.live_states.size(), ") needs one entry per device (", num_devices, ")");
  for (int64_t s = 0; s < num_stages; ++s) {
    const int32_t d = device_of(p, static_cast<int32_t>(s));
    TORCH_CHECK(d >= 0 && d < num_devices, "planner: stage ", s, " on device ", d, " of ",
                num_devices);
  }
  check_devices(p);
  if (!p.ranges.empty()) {
    TORCH_CHECK(static_cast<int64_t>(p.ranges.size()) == num_stages, "planner: ", p.ranges.size(),
                " ranges for ", num_stages, " stages");
    check_ranges(p.ranges, static_cast<int32_t>(num_layers), "planner");
  }
  check_costs_valid(p);
}

// What a checkpointed layer's backward holds on top of the stage: its recomputed activations
// (beyond the inputs the checkpoint kept) and its own working set.
int64_t recompute_bytes(const LayerCost& l) {
  return std::max<int64_t>(0, l.saved_bytes - l.saved_bytes_ckpt) + l.transient_bytes;
}

// The largest working set of a stage: its extras', its layers', and with checkpointed layers the
// recomputation's (of the backward, or of a split B with the split working sets).
int64_t stage_transient(int64_t extra_transient, int64_t layers_transient, int64_t layers_recompute,
                        bool any_checkpointed) {
  return std::max({extra_transient, layers_transient, any_checkpointed ? layers_recompute : 0});
}

// `a` is at least as good as `b` in every respect the memory and time depend on.
bool dominates(const Point& a, const Point& b) {
  return a.time <= b.time && a.bytes <= b.bytes && a.wbytes <= b.wbytes && (!a.any || b.any);
}

// The extra backward time of checkpointing layer `l` on a stage that splits (or not).
double checkpoint_time(const LayerCost& l, bool split) {
  return l.recompute + (split ? l.weight_ckpt - l.weight : 0.0);
}

// The frontier of a range extended by layer `l` from `prev`, the frontier without it: every
// point of `prev` with `l` kept and (if allowed) checkpointed, pruned of dominated points.
// `cand` is scratch space, kept by the caller across calls.
std::vector<Point> next_front(const std::vector<Point>& prev, const LayerCost& l, bool split,
                              bool allow_checkpoint, std::vector<Point>& cand) {
  cand.clear();
  for (int32_t k = 0; k < static_cast<int32_t>(prev.size()); ++k) {
    const Point& q = prev[k];
    // A stage that does not split keeps its saved bytes until W: no separate kept bytes.
    cand.push_back({q.time, q.bytes + l.saved_bytes, q.wbytes + (split ? l.weight_bytes : 0), k,
                    false, q.any});
    if (allow_checkpoint)
      cand.push_back({q.time + checkpoint_time(l, split), q.bytes + l.saved_bytes_ckpt,
                      q.wbytes + (split ? l.weight_bytes_ckpt : 0), k, true, true});
  }
  // Exact ties go to checkpointing `l`, the later layer: see [Note: planner cost model] on why
  // upper layers are the better choice.
  std::stable_sort(cand.begin(), cand.end(), [](const Point& a, const Point& b) {
    if (a.time != b.time) return a.time < b.time;
    if (a.bytes != b.bytes) return a.bytes < b.bytes;
    if (a.wbytes != b.wbytes) return a.wbytes < b.wbytes;
    if (a.any != b.any) return !a.any;
    return a.ckpt && !b.ckpt;
  });
  std::vector<Point> front;
  for (const Point& q : cand)
    if (std::none_of(front.begin(), front.end(), [&](const Point& k) { return dominates(k, q); }))
      front.push_back(q);
  return front;
}

Frontiers build_frontiers(const PlanProblem& p, bool split) {
  const auto n = static_cast<int32_t>(p.layers.size());
  Frontiers f;
  f.num_layers = n;
  f.split = split;
  f.by_start.resize(n);
  f.base_time.resize(n);
  f.weight_time.resize(n);
  f.static_bytes.resize(n);
  f.transient.resize(n);
  f.recompute.resize(n);
  f.recorded.resize(n);
  f.split_transient.resize(n);
  std::vector<Point> cand;
  for (int32_t i = 0; i < n; ++i) {
    auto& fronts = f.by_start[i];
    fronts.reserve(n - i);
    std::vector<Point> prev{{0.0, 0, 0, -1, false, false}};
    double base = 0.0, weight = 0.0;
    int64_t stat = 0, trans = 0, recomp = 0, rec = 0, split_trans = 0;
    for (int32_t j = i + 1; j <= n; ++j) {
      const LayerCost& l = p.layers[j - 1];
      base += l.fwd + l.bwd;
      weight += split ? l.weight : 0.0;
      stat += l.static_bytes;
      trans = std::max(trans, l.transient_bytes);
      recomp = std::max(recomp, recompute_bytes(l));
      rec += split ? l.recorded_bytes : 0;
      split_trans = std::max(split_trans, l.split_transient_bytes);
      f.recorded[i].push_back(rec);
      f.split_transient[i].push_back(split_trans);
      f.base_time[i].push_back(base);
      f.weight_time[i].push_back(weight);
      f.static_bytes[i].push_back(stat);
      f.transient[i].push_back(trans);
      f.recompute[i].push_back(recomp);
      fronts.push_back(next_front(prev, l, split, p.allow_checkpoint, cand));
      prev = fronts.back();
    }
  }
  return f;
}

// What one stage contributes to its device's memory for a choice of checkpointed layers.
struct StageBytes {
  int64_t saved = 0, kept = 0, recorded = 0, fixed = 0;  // fixed: static + buffers
  int64_t transient = 0, split_transient = 0;            // working sets: any action, a split B
};

using DeviceStates = std::vector<std::vector<std::vector<int32_t>>>;  // per stage of a device

// The peak of a device whose `n` stages (ascending) take `parts[0..n)`: `at` gets the (stage of
// the device, state) where it is reached. (A pointer and a count, not a vector: the solver calls
// this for every frontier point of every range.)
int64_t device_memory(const DeviceStates& states, const StageBytes* parts, size_t n,
                      std::pair<size_t, size_t>* at = nullptr) {
  int64_t fixed = 0, live = -1;
  for (size_t k = 0; k < n; ++k) fixed += parts[k].fixed;
  for (size_t t = 0; t < states.size(); ++t) {
    for (size_t x = 0; x < states[t].size(); ++x) {
      const bool in_b = states[t][x][kLiveCounts * t + 2] > 0;
      int64_t v = in_b ? parts[t].split_transient : parts[t].transient;
      for (size_t k = 0; k < n; ++k)
        v += states[t][x][kLiveCounts * k] * parts[k].saved +
             states[t][x][kLiveCounts * k + 1] * parts[k].kept +
             states[t][x][kLiveCounts * k + 2] * parts[k].recorded;
      if (v > live) {
        live = v;
        if (at) *at = {t, x};
      }
    }
  }
  return fixed + live;
}

struct StageCost {
  double time = kInf;  // +inf: no choice of checkpoints fits the memory limit
  int32_t point = -1;
};

// Frontiers for the stages that split their backward and for those that do not (each built only
// if some stage needs it), and the stage costs over them.
class StageCosts {
 public:
  explicit StageCosts(const PlanProblem& p) : p_(p) {
    for (const StageExtra& e : p.extras) (e.split_backward ? need_split_ : need_plain_) = true;
    if (need_plain_) plain_ = build_frontiers(p, false);
    if (need_split_) split_ = build_frontiers(p, true);
  }

  const Frontiers& frontiers(int32_t s) const {
    return p_.extras[s].split_backward ? split_ : plain_;
  }

  StageBytes bytes(int32_t s, int32_t i, int32_t j, const Point& q) const {
    const StageExtra& e = p_.extras[s];
    const Frontiers& f = frontiers(s);
    const int32_t r = j - i - 1;
    const int64_t saved = e.saved_bytes + q.bytes;
    const bool split = e.split_backward;
    return {saved,
            split ? e.weight_bytes + q.wbytes : saved,
            split ? e.recorded_bytes + f.recorded[i][r] : 0,
            e.static_bytes + f.static_bytes[i][r] + e.buffer_bytes,
            stage_transient(e.transient_bytes, f.transient[i][r], f.recompute[i][r], q.any),
            stage_transient(e.split_transient_bytes, f.split_transient[i][r], f.recompute[i][r],
                            q.any)};
  }

  double time(int32_t s, int32_t i, int32_t j, const Point& q) const {
    const StageExtra& e = p_.extras[s];
    return e.fwd + e.bwd + frontiers(s).base_time[i][j - i - 1] + q.time;
  }

  // With one stage per device: the fastest frontier point of [i, j) that fits stage s's device.
  StageCost cost(int32_t s, int32_t i, int32_t j) const {
    const int32_t d = device_of(p_, s);
    const auto& front = frontiers(s).at(i, j);
    for (int32_t k = 0; k < static_cast<int32_t>(front.size()); ++k) {
      const StageBytes b = bytes(s, i, j, front[k]);
      if (device_memory(p_.live_states[d], &b, 1) <= p_.memory_limit[d])
        return {time(s, i, j, front[k]), k};
    }
    return {};
  }

  int64_t excess(int32_t s, int32_t i, int32_t j) const {
    const int32_t d = device_of(p_, s);
    int64_t best = std::numeric_limits<int64_t>::max();
    for (const Point& q : frontiers(s).at(i, j)) {
      const StageBytes b = bytes(s, i, j, q);
      best = std::min(best, device_memory(p_.live_states[d], &b, 1));
    }
    return best - p_.memory_limit[d];
  }

 private:
  const PlanProblem& p_;
  bool need_plain_ = false, need_split_ = false;
  Frontiers plain_, split_;
};

// The checkpointed layers of frontier point `point` of [i, j), ascending.
std::vector<int32_t> checkpointed(const Frontiers& fr, int32_t i, int32_t j, int32_t point) {
  std::vector<int32_t> out;
  for (int32_t k = j; k > i; --k) {
    const Point& q = fr.at(i, k)[point];
    if (q.ckpt) out.push_back(k - 1);
    point = q.parent;
  }
  std::reverse(out.begin(), out.end());
  return out;
}

// Layer ranges given, several stages per device allowed: each device takes the fastest
// combination of its stages' frontier points that fits (ties: the least memory). Fills
// `result.min_memory_limit`; returns the checkpointed layers per stage, or nothing if infeasible.
std::optional<std::vector<std::vector<int32_t>>> solve_given_ranges(const PlanProblem& p,
                                                                    const StageCosts& costs,
                                                                    PlanResult& result) {
  constexpr int64_t kMaxCombinations = 10'000'000;
  const auto by_device = stages_by_device(p);
  std::vector<std::vector<int32_t>> ckpt(p.extras.size());
  int64_t delta = std::numeric_limits<int64_t>::min();
  bool feasible = true;
  for (size_t d = 0; d < by_device.size(); ++d) {
    const auto& mine = by_device[d];
    int64_t combos = 1;
    for (int32_t s : mine) {
      combos *=
          static_cast<int64_t>(costs.frontiers(s).at(p.ranges[s].first, p.ranges[s].second).size());
      TORCH_CHECK(combos <= kMaxCombinations, "planner: device ", d, " has over ", kMaxCombinations,
                  " combinations of checkpointed layers to search; use fewer "
                  "layers per stage or fewer stages per device");
    }
    std::vector<int32_t> pick(mine.size(), 0), best_pick;
    double best_time = kInf;
    int64_t best_mem = 0, least = std::numeric_limits<int64_t>::max();
    std::vector<StageBytes> parts(mine.size());
    for (int64_t c = 0; c < combos; ++c) {
      int64_t rest = c;
      double t = 0.0;
      for (size_t k = 0; k < mine.size(); ++k) {
        const auto [i, j] = p.ranges[mine[k]];
        const auto& front = costs.frontiers(mine[k]).at(i, j);
        pick[k] = static_cast<int32_t>(rest % static_cast<int64_t>(front.size()));
        rest /= static_cast<int64_t>(front.size());
        parts[k] = costs.bytes(mine[k], i, j, front[pick[k]]);
        t += costs.time(mine[k], i, j, front[pick[k]]);
      }
      const int64_t mem = device_memory(p.live_states[d], parts.data(), parts.size());
      least = std::min(least, mem);
      if (mem <= p.memory_limit[d] && (t < best_time || (t == best_time && mem < best_mem))) {
        best_time = t, best_mem = mem, best_pick = pick;
      }
    }
    delta = std::max(delta, least - p.memory_limit[d]);
    if (best_pick.empty()) {
      feasible = false;
      continue;
    }
    for (size_t k = 0; k < mine.size(); ++k)
      ckpt[mine[k]] = checkpointed(costs.frontiers(mine[k]), p.ranges[mine[k]].first,
                                   p.ranges[mine[k]].second, best_pick[k]);
  }
  for (int64_t limit : p.memory_limit) result.min_memory_limit.push_back(limit + delta);
  if (!feasible) return std::nullopt;
  return ckpt;
}

}  // namespace

LayerCost make_layer_cost(double fwd, double bwd, std::optional<double> recompute,
                          int64_t saved_bytes, int64_t saved_bytes_ckpt, int64_t static_bytes,
                          int64_t transient_bytes, double weight, std::optional<double> weight_ckpt,
                          int64_t weight_bytes, std::optional<int64_t> weight_bytes_ckpt,
                          int64_t recorded_bytes, int64_t split_transient_bytes) {
  return LayerCost{fwd,
                   bwd,
                   recompute.value_or(fwd),
                   saved_bytes,
                   saved_bytes_ckpt,
                   static_bytes,
                   transient_bytes,
                   weight,
                   weight_ckpt.value_or(weight),
                   weight_bytes,
                   weight_bytes_ckpt.value_or(weight_bytes),
                   recorded_bytes,
                   split_transient_bytes};
}

std::string to_string(const LayerCost& l) {
  return c10::str("LayerCost(fwd=", l.fwd, ", bwd=", l.bwd, ", recompute=", l.recompute,
                  ", saved_bytes=", l.saved_bytes, ", saved_bytes_ckpt=", l.saved_bytes_ckpt,
                  ", static_bytes=", l.static_bytes, ", transient_bytes=", l.transient_bytes,
                  ", weight=", l.weight, ", weight_ckpt=", l.weight_ckpt,
                  ", weight_bytes=", l.weight_bytes, ", weight_bytes_ckpt=", l.weight_bytes_ckpt,
                  ", recorded_bytes=", l.recorded_bytes,
                  ", split_transient_bytes=", l.split_transient_bytes, ")");
}

std::string to_string(const StageExtra& e) {
  return c10::str("StageExtra(fwd=", e.fwd, ", bwd=", e.bwd, ", saved_bytes=", e.saved_bytes,
                  ", static_bytes=", e.static_bytes, ", transient_bytes=", e.transient_bytes,
                  ", buffer_bytes=", e.buffer_bytes, ", weight=", e.weight,
                  ", weight_bytes=", e.weight_bytes, ", recorded_bytes=", e.recorded_bytes,
                  ", split_transient_bytes=", e.split_transient_bytes,
                  ", split_backward=", e.split_backward, ")");
}

namespace {

// Stage `s` of a plan that gives it layers `range` and checkpoints `checkpoint` (global indices),
// its device totals not yet set; `*part` gets what the device's memory model needs of it.
StageEval evaluate_stage(const PlanProblem& p, int32_t s, std::pair<int32_t, int32_t> range,
                         const std::vector<int32_t>& checkpoint, StageBytes* part) {
  const auto [start, stop] = range;
  std::vector<bool> ck(stop - start, false);
  for (int32_t k : checkpoint) {
    TORCH_CHECK(k >= start && k < stop, "evaluate_plan: checkpointed layer ", k,
                " is not in stage ", s, "'s range [", start, ", ", stop, ")");
    ck[k - start] = true;
  }
  const StageExtra& e = p.extras[s];
  const bool split = e.split_backward;
  int64_t layers_transient = 0, layers_recompute = 0, layers_split = 0;
  StageEval ev;
  ev.start = start;
  ev.stop = stop;
  ev.device = device_of(p, s);
  ev.forward = e.fwd;
  ev.backward = e.bwd;
  ev.weight = split ? e.weight : 0.0;
  ev.saved_bytes = e.saved_bytes;
  ev.weight_bytes = e.weight_bytes;
  ev.recorded_bytes = split ? e.recorded_bytes : 0;
  ev.static_bytes = e.static_bytes;
  for (int32_t k = start; k < stop; ++k) {
    const LayerCost& l = p.layers[k];
    const bool c = ck[k - start];
    layers_transient = std::max(layers_transient, l.transient_bytes);
    layers_recompute = std::max(layers_recompute, recompute_bytes(l));
    layers_split = std::max(layers_split, l.split_transient_bytes);
    ev.forward += l.fwd;
    ev.backward += l.bwd + (c ? checkpoint_time(l, split) : 0.0);
    if (split) ev.weight += c ? l.weight_ckpt : l.weight;
    ev.saved_bytes += c ? l.saved_bytes_ckpt : l.saved_bytes;
    ev.weight_bytes += c ? l.weight_bytes_ckpt : l.weight_bytes;
    if (split) ev.recorded_bytes += l.recorded_bytes;
    ev.static_bytes += l.static_bytes;
    if (c) ev.checkpoint.push_back(k);
  }
  if (!split) ev.weight_bytes = ev.saved_bytes;  // W, if any, is the whole backward
  ev.time = ev.forward + ev.backward;
  const bool any = !ev.checkpoint.empty();
  ev.transient_bytes = stage_transient(e.transient_bytes, layers_transient, layers_recompute, any);
  ev.buffer_bytes = e.buffer_bytes;
  *part = {ev.saved_bytes,
           ev.weight_bytes,
           ev.recorded_bytes,
           ev.static_bytes + e.buffer_bytes,
           ev.transient_bytes,
           stage_transient(e.split_transient_bytes, layers_split, layers_recompute, any)};
  return ev;
}

// Device totals, and each stage's counts at its device's peak state.
void add_device_peaks(const PlanProblem& p, const std::vector<StageBytes>& parts,
                      std::vector<StageEval>& out) {
  const auto by_device = stages_by_device(p);
  for (size_t d = 0; d < by_device.size(); ++d) {
    const auto& mine = by_device[d];
    std::vector<StageBytes> dev_parts;
    for (int32_t s : mine) dev_parts.push_back(parts[s]);
    std::pair<size_t, size_t> at{0, 0};
    const int64_t memory = device_memory(p.live_states[d], dev_parts.data(), dev_parts.size(), &at);
    const auto& acting = dev_parts[at.first];
    const auto& x = p.live_states[d][at.first][at.second];
    const bool in_b = x[kLiveCounts * at.first + 2] > 0;
    const int64_t transient = in_b ? acting.split_transient : acting.transient;
    int64_t buffers = 0;
    for (int32_t s : mine) buffers += out[s].buffer_bytes;
    for (size_t k = 0; k < mine.size(); ++k) {
      StageEval& ev = out[mine[k]];
      ev.inflight = x[kLiveCounts * k];
      ev.pending_weight = x[kLiveCounts * k + 1];
      ev.in_backward = x[kLiveCounts * k + 2] > 0;
      ev.activation_bytes = ev.inflight * ev.saved_bytes + ev.pending_weight * ev.weight_bytes +
                            (ev.in_backward ? ev.recorded_bytes : 0);
      ev.transient_bytes = transient;
      ev.buffer_bytes = buffers;
      ev.memory = memory;
    }
  }
}

}  // namespace

std::vector<StageEval> evaluate_plan(const PlanProblem& p,
                                     const std::vector<std::pair<int32_t, int32_t>>& ranges,
                                     const std::vector<std::vector<int32_t>>& checkpoint) {
  check_problem(p);
  const auto num_stages = static_cast<int32_t>(p.extras.size());
  const auto num_layers = static_cast<int32_t>(p.layers.size());
  TORCH_CHECK(static_cast<int32_t>(ranges.size()) == num_stages &&
                  static_cast<int32_t>(checkpoint.size()) == num_stages,
              "evaluate_plan: need one range and one checkpoint list per stage (", num_stages,
              "), got ", ranges.size(), " and ", checkpoint.size());
  check_ranges(ranges, num_layers, "evaluate_plan");
  std::vector<StageEval> out;
  std::vector<StageBytes> parts(num_stages);
  for (int32_t s = 0; s < num_stages; ++s)
    out.push_back(evaluate_stage(p, s, ranges[s], checkpoint[s], &parts[s]));
  add_device_peaks(p, parts, out);
  return out;
}

namespace {

// The stage costs of one stage per device, each looked up several times by the DPs below.
class CachedCosts {
 public:
  CachedCosts(const StageCosts& costs, int32_t stages, int32_t layers)
      : costs_(costs),
        layers_(layers),
        cache_(static_cast<size_t>(stages) * (layers + 1) * (layers + 1)),
        have_(cache_.size(), false) {}
  const StageCost& operator()(int32_t s, int32_t i, int32_t j) {
    const size_t k = (static_cast<size_t>(s) * (layers_ + 1) + i) * (layers_ + 1) + j;
    if (!have_[k]) cache_[k] = costs_.cost(s, i, j), have_[k] = true;
    return cache_[k];
  }

 private:
  const StageCosts& costs_;
  int32_t layers_;
  std::vector<StageCost> cache_;
  std::vector<bool> have_;
};

// The smallest uniform shift of the limits that admits a plan (minimax over memory excess).
int64_t smallest_shift(const StageCosts& costs, int32_t S, int32_t L) {
  constexpr int64_t kBig = std::numeric_limits<int64_t>::max();
  std::vector<std::vector<int64_t>> X(S, std::vector<int64_t>(L + 1, kBig));
  for (int32_t j = 1; j <= L - (S - 1); ++j) X[0][j] = costs.excess(0, 0, j);
  for (int32_t s = 1; s < S; ++s)
    for (int32_t j = s + 1; j <= L - (S - 1 - s); ++j)
      for (int32_t i = s; i < j; ++i)
        if (X[s - 1][i] != kBig)
          X[s][j] = std::min(X[s][j], std::max(X[s - 1][i], costs.excess(s, i, j)));
  return X[S - 1][L];
}

// Minimax DP on the bottleneck stage time.
double best_bottleneck(CachedCosts& cost, int32_t S, int32_t L) {
  std::vector<std::vector<double>> D(S, std::vector<double>(L + 1, kInf));
  for (int32_t j = 1; j <= L - (S - 1); ++j) D[0][j] = cost(0, 0, j).time;
  for (int32_t s = 1; s < S; ++s)
    for (int32_t j = s + 1; j <= L - (S - 1 - s); ++j)
      for (int32_t i = s; i < j; ++i)
        if (D[s - 1][i] < kInf)
          D[s][j] = std::min(D[s][j], std::max(D[s - 1][i], cost(s, i, j).time));
  TORCH_CHECK(D[S - 1][L] < kInf, "planner: internal error: feasible memory but no finite plan");
  return D[S - 1][L];
}

// Tie-break: the ranges of least total time among plans whose stages all take at most `best`.
std::vector<std::pair<int32_t, int32_t>> least_total(CachedCosts& cost, int32_t S, int32_t L,
                                                     double best) {
  std::vector<std::vector<double>> E(S, std::vector<double>(L + 1, kInf));
  std::vector<std::vector<int32_t>> arg(S, std::vector<int32_t>(L + 1, -1));
  for (int32_t j = 1; j <= L - (S - 1); ++j) {
    const double c = cost(0, 0, j).time;
    if (c <= best) E[0][j] = c, arg[0][j] = 0;
  }
  for (int32_t s = 1; s < S; ++s)
    for (int32_t j = s + 1; j <= L - (S - 1 - s); ++j)
      for (int32_t i = s; i < j; ++i) {
        if (E[s - 1][i] == kInf) continue;
        const double c = cost(s, i, j).time;
        if (c > best) continue;
        const double total = E[s - 1][i] + c;
        if (total < E[s][j]) E[s][j] = total, arg[s][j] = i;
      }
  TORCH_CHECK(E[S - 1][L] < kInf, "planner: internal error: tie-break DP found no plan");
  std::vector<std::pair<int32_t, int32_t>> ranges(S);
  int32_t j = L;
  for (int32_t s = S - 1; s >= 0; --s) {
    ranges[s] = {arg[s][j], j};
    j = ranges[s].first;
  }
  return ranges;
}

// The plan's totals from its evaluated stages.
void add_totals(const PlanProblem& p, PlanResult& result) {
  std::vector<double> device_time(p.memory_limit.size(), 0.0);
  for (const auto& st : result.stages) {
    device_time[st.device] += st.time;
    result.total_time += st.time;
  }
  result.bottleneck = *std::max_element(device_time.begin(), device_time.end());
}

}  // namespace

PlanResult solve_plan(const PlanProblem& p) {
  check_problem(p);
  const auto S = static_cast<int32_t>(p.extras.size());
  const auto L = static_cast<int32_t>(p.layers.size());
  const StageCosts costs(p);
  PlanResult result;
  std::vector<std::pair<int32_t, int32_t>> ranges = p.ranges;
  std::vector<std::vector<int32_t>> ckpt(S);
  if (!ranges.empty()) {
    auto found = solve_given_ranges(p, costs, result);
    if (!found) return result;
    ckpt = std::move(*found);
  } else {  // one stage per device
    const int64_t delta = smallest_shift(costs, S, L);
    for (int32_t d = 0; d < S; ++d) result.min_memory_limit.push_back(p.memory_limit[d] + delta);
    if (delta > 0) return result;
    CachedCosts cost(costs, S, L);
    ranges = least_total(cost, S, L, best_bottleneck(cost, S, L));
    for (int32_t s = 0; s < S; ++s) {
      const auto [i, j] = ranges[s];
      ckpt[s] = checkpointed(costs.frontiers(s), i, j, cost(s, i, j).point);
    }
  }
  result.feasible = true;
  result.stages = evaluate_plan(p, ranges, ckpt);
  add_totals(p, result);
  return result;
}

}  // namespace pippy_xla
