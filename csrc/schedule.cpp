#include "schedule.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <deque>
#include <map>
#include <set>
#include <sstream>
#include <tuple>

namespace pippy_xla {

const char* op_name(Op op) {
  switch (op) {
    case Op::F:
      return "F";
    case Op::B:
      return "B";
    case Op::W:
      return "W";
    case Op::SEND_F:
      return "SF";
    case Op::RECV_F:
      return "RF";
    case Op::SEND_B:
      return "SB";
    case Op::RECV_B:
      return "RB";
  }
  return "?";
}

Op parse_op(const std::string& name) {
  constexpr Op kOps[] = {Op::F, Op::B, Op::W, Op::SEND_F, Op::RECV_F, Op::SEND_B, Op::RECV_B};
  std::string names;
  for (Op op : kOps) {
    if (name == op_name(op)) return op;
    names += c10::str(" ", op_name(op));
  }
  TORCH_CHECK(false, "unknown action '", name, "'; expected one of", names);
}

Action parse_action(const std::string& op, int32_t stage, int32_t mb) {
  return {parse_op(op), stage, mb};
}

Action to_action(const ActionSpec& spec) {
  if (const auto* a = std::get_if<Action>(&spec)) return *a;
  const auto& [op, stage, mb] = std::get<ActionRow>(spec);
  return parse_action(op, stage, mb);
}

std::string to_string(const Action& a) {
  std::ostringstream os;
  os << op_name(a.op) << a.stage << "." << a.mb;
  return os.str();
}

Schedule Schedule::from_parts(std::string name, int32_t num_ranks, int32_t num_microbatches,
                              std::vector<int32_t> stage_rank,
                              const std::vector<std::vector<ActionSpec>>& actions, bool backward,
                              bool split_backward) {
  Schedule s;
  s.name = std::move(name);
  s.num_ranks = num_ranks;
  s.num_stages = static_cast<int32_t>(stage_rank.size());
  s.num_microbatches = num_microbatches;
  s.stage_rank = std::move(stage_rank);
  s.backward = backward;
  s.split_backward = split_backward;
  for (const auto& rank : actions) {
    s.actions.emplace_back();
    for (const auto& a : rank) s.actions.back().push_back(to_action(a));
  }
  return s;
}

std::vector<int32_t> Schedule::stages_of(int32_t rank) const {
  std::vector<int32_t> out;
  for (int32_t s = 0; s < num_stages; ++s)
    if (stage_rank[s] == rank) out.push_back(s);
  return out;
}

std::string Schedule::table() const {
  std::ostringstream os;
  for (int32_t r = 0; r < num_ranks; ++r) {
    os << "rank " << r << ":";
    for (const auto& a : actions[r]) os << " " << to_string(a);
    os << "\n";
  }
  return os.str();
}

namespace {

bool is_compute(Op op) { return op == Op::F || op == Op::B || op == Op::W; }

// Turns per-rank compute orders into full action lists. Receives are posted one compute action
// ahead of the computation that needs them (so the transfer overlaps that action), but a gradient
// receive never before its own forward (its buffer's shape comes from that forward). Sends follow
// the computation that produces their data.
Schedule with_comms(Schedule s, const std::vector<std::vector<Action>>& compute) {
  const int32_t last = s.num_stages - 1;
  s.actions.assign(s.num_ranks, {});
  for (int32_t r = 0; r < s.num_ranks; ++r) {
    const auto& c = compute[r];
    std::vector<std::vector<Action>> before(c.size());
    std::map<std::pair<int32_t, int32_t>, size_t> f_index;
    for (size_t i = 0; i < c.size(); ++i) {
      const Action& a = c[i];
      if (a.op == Op::F) f_index[{a.stage, a.mb}] = i;
      size_t at = i == 0 ? 0 : i - 1;
      if (a.op == Op::F && a.stage > 0 && s.stage_rank[a.stage - 1] != r) {
        before[at].push_back({Op::RECV_F, a.stage, a.mb});
      } else if (a.op == Op::B && a.stage < last && s.stage_rank[a.stage + 1] != r) {
        at = std::max(at, f_index.at({a.stage, a.mb}) + 1);
        before[at].push_back({Op::RECV_B, a.stage, a.mb});
      }
    }
    auto& out = s.actions[r];
    for (size_t i = 0; i < c.size(); ++i) {
      const Action& a = c[i];
      out.insert(out.end(), before[i].begin(), before[i].end());
      out.push_back(a);
      if (a.op == Op::F && a.stage < last && s.stage_rank[a.stage + 1] != r) {
        out.push_back({Op::SEND_F, a.stage, a.mb});
      } else if (a.op == Op::B && a.stage > 0 && s.stage_rank[a.stage - 1] != r) {
        out.push_back({Op::SEND_B, a.stage, a.mb});
      }
    }
  }
  return s;
}

Schedule base(const std::string& name, int32_t ranks, int32_t mbs, int32_t chunks,
              const std::string& placement) {
  TORCH_CHECK(ranks >= 1, "schedule '", name, "': need at least 1 rank, got ", ranks);
  TORCH_CHECK(mbs >= 1, "schedule '", name, "': need at least 1 microbatch, got ", mbs);
  TORCH_CHECK(chunks >= 1, "schedule '", name, "': need at least 1 chunk per rank, got ", chunks);
  Schedule s;
  s.name = name;
  s.num_ranks = ranks;
  s.num_stages = ranks * chunks;
  s.num_microbatches = mbs;
  for (int32_t i = 0; i < s.num_stages; ++i)
    s.stage_rank.push_back(stage_rank(i, ranks, placement));
  return s;
}

// [Note: list scheduling at costs] The zero-bubble schedules "zbh1", "interleaved_zb" and "zbv"
// are list-scheduled: every rank that is free at a time runs the first action its rule allows
// with the inputs that exist by then, ranks in order at equal times. Times come from per-stage
// costs of F, B and W (Costs; unit costs when a list is empty, which gives the published orders,
// checked against stored tables). Real costs are uneven, and the order matters: the first stage
// computes no input gradient, so its B is nearly free and its W is its whole backward, and a
// rank that waits on a slower neighbour should fill the wait with work that fits. Measured
// compiled costs on 2 ranks (benchmarks/schedules.py) give a ZB-H1 order that the simulator puts
// 5% ahead of 1F1B, where the unit-cost order ties with it. A rule only ever picks an action
// whose inputs exist at that time, so every order is deadlock-free (the validator checks again).
// List scheduling is a heuristic, and at some costs the published order is the better one
// (measured: interleaved_zb on 2 ranks): make_schedule keeps the published order unless the
// simulator puts the one for the costs strictly ahead of it at those costs.
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

double cost_of_stage(const std::vector<double>& v, int32_t stage) {
  return v.empty() ? 1.0 : v[stage];
}

// Zero-bubble ZB-H1 (see [Note: list scheduling at costs]): each free rank runs, in this
// priority, the oldest backward (input gradients) whose gradient is there, else the next forward
// whose input is there while fewer than `ranks - r` microbatches await their backward (1F1B's
// bound) and at most `ranks` hold a graph (await W), else the oldest pending weight-gradient step.
// Weight steps fill the time a rank would otherwise wait: at unit costs, for up to 4 ranks the
// bubble drops from 1F1B's (p-1)(F+B+W) to ZB-H1's (p-1)(F+B-W), a third (more ranks: about
// 0.4), with every rank holding at most p+1 microbatches' graphs (1F1B: p - r).
std::vector<std::vector<Action>> zero_bubble_h1(int32_t p, int32_t m, const Costs& costs) {
  std::vector<std::vector<Action>> order(p);
  // Time at which F / B of (stage, mb) finish; -1 while not run.
  std::vector<double> f_end(p * m, -1), b_end(p * m, -1);
  std::vector<int32_t> next_f(p, 0), next_b(p, 0), next_w(p, 0);
  ListClock clock(p);
  int32_t remaining = 3 * p * m;
  for (double t = 0; remaining > 0;) {
    TORCH_CHECK(clock.next(&t), "zero-bubble generator made no progress");
    auto done_by = [t](double end) { return end >= 0 && end <= t; };
    for (int32_t r = 0; r < p; ++r) {
      if (!clock.free(r, t)) continue;
      const int32_t b = next_b[r], f = next_f[r];
      const bool b_ready = b < f && done_by(f_end[r * m + b]) &&
                           (r == p - 1 || done_by(b_end[(r + 1) * m + b]));
      const bool f_ready = f < m && f - next_b[r] < p - r && f - next_w[r] < p + 1 &&
                           (r == 0 || done_by(f_end[(r - 1) * m + f]));
      if (b_ready) {
        order[r].push_back({Op::B, r, b});
        b_end[r * m + b] = clock.run(r, t, cost_of_stage(costs.backward, r));
        ++next_b[r];
      } else if (f_ready) {
        order[r].push_back({Op::F, r, f});
        f_end[r * m + f] = clock.run(r, t, cost_of_stage(costs.forward, r));
        ++next_f[r];
      } else if (next_w[r] < next_b[r]) {
        order[r].push_back({Op::W, r, next_w[r]++});
        clock.run(r, t, cost_of_stage(costs.weight, r));
      } else {
        continue;
      }
      --remaining;
    }
  }
  return order;
}

// Looped BFS (breadth-first pipelining): every forward of a rank's first chunk, then of its next
// chunk, ...; then the backwards, last chunk first. GPipe's memory (every microbatch of every
// chunk in flight), fewer stalls between chunks.
std::vector<std::vector<Action>> looped_bfs(const Schedule& s, int32_t v) {
  const int32_t p = s.num_ranks, m = s.num_microbatches;
  std::vector<std::vector<Action>> order(p);
  for (int32_t r = 0; r < p; ++r) {
    for (int32_t c = 0; c < v; ++c)
      for (int32_t i = 0; i < m; ++i) order[r].push_back({Op::F, c * p + r, i});
    for (int32_t c = v - 1; c >= 0; --c)
      for (int32_t i = 0; i < m; ++i) order[r].push_back({Op::B, c * p + r, i});
  }
  return order;
}

// [Note: greedy schedules] List scheduling (see [Note: list scheduling at costs]) for several
// stages per rank with a split backward: each free rank runs the first backward of its `b_order`
// whose forward ran here and whose gradient is there, else the first forward of its `f_order`
// whose input is there while it holds fewer than `max_held[r]` microbatch-stages (forwarded and
// not yet weighted: their activations), else its oldest pending weight step. The orders say which
// of several ready actions goes first (for a V, the deeper chunk: the microbatch nearer its loss);
// the bound is the schedule's activation memory.

// One pass of the rule; false if every rank came to wait on another (`order` is then partial).
// With `reserve`, a forward leaves one slot of the bound for each deeper stage of its rank.
bool greedy_pass(const Schedule& s, const std::vector<std::vector<Action>>& f_order,
                 const std::vector<std::vector<Action>>& b_order,
                 const std::vector<int32_t>& max_held, const Costs& costs, bool reserve,
                 std::vector<std::vector<Action>>* out) {
  const int32_t p = s.num_ranks, m = s.num_microbatches, last = s.num_stages - 1;
  auto& order = *out;
  order.assign(p, {});
  std::vector<double> f_end(s.num_stages * m, -1), b_end(s.num_stages * m, -1);
  std::vector<std::vector<bool>> f_taken(p), b_taken(p);
  std::vector<std::deque<Action>> pending_w(p);
  std::vector<int32_t> held(p, 0);
  std::vector<int32_t> deeper(s.num_stages, 0);  // stages of the same rank after each stage
  for (int32_t r = 0; r < p; ++r) {
    const auto mine = s.stages_of(r);  // ascending
    for (size_t i = 0; i < mine.size(); ++i)
      deeper[mine[i]] = static_cast<int32_t>(mine.size() - 1 - i);
  }
  auto at = [m](int32_t stage, int32_t mb) { return stage * m + mb; };
  int64_t remaining = 0;
  for (int32_t r = 0; r < p; ++r) {
    f_taken[r].assign(f_order[r].size(), false);
    b_taken[r].assign(b_order[r].size(), false);
    remaining += 3 * static_cast<int64_t>(f_order[r].size());
  }
  ListClock clock(p);
  for (double t = 0; remaining > 0;) {
    if (!clock.next(&t)) return false;
    auto done_by = [t](double end) { return end >= 0 && end <= t; };
    for (int32_t r = 0; r < p; ++r) {
      if (!clock.free(r, t)) continue;
      auto run = [&](const Action& a, const std::vector<double>& cost) {
        order[r].push_back(a);
        --remaining;
        return clock.run(r, t, cost_of_stage(cost, a.stage));
      };
      bool ran = false;
      for (size_t k = 0; k < b_order[r].size() && !ran; ++k) {
        const Action& a = b_order[r][k];
        if (b_taken[r][k] || !done_by(f_end[at(a.stage, a.mb)])) continue;
        if (a.stage < last && !done_by(b_end[at(a.stage + 1, a.mb)])) continue;
        b_taken[r][k] = true;
        pending_w[r].push_back({Op::W, a.stage, a.mb});
        b_end[at(a.stage, a.mb)] = run(a, costs.backward);
        ran = true;
      }
      for (size_t k = 0; k < f_order[r].size() && !ran && held[r] < max_held[r]; ++k) {
        const Action& a = f_order[r][k];
        if (f_taken[r][k] || (a.stage > 0 && !done_by(f_end[at(a.stage - 1, a.mb)]))) continue;
        if (reserve && held[r] + deeper[a.stage] >= max_held[r]) continue;
        f_taken[r][k] = true;
        ++held[r];
        f_end[at(a.stage, a.mb)] = run(a, costs.forward);
        ran = true;
      }
      if (!ran && !pending_w[r].empty()) {
        const Action w = pending_w[r].front();
        pending_w[r].pop_front();
        --held[r];
        run(w, costs.weight);
      }
    }
  }
  return true;
}

// The rule as published; at uneven costs a rank can fill its bound with forwards of a shallower
// stage while every slot waits on a gradient that needs a deeper stage's forward first (never at
// unit costs); then the rule again with one slot of the bound kept for each deeper stage.
std::vector<std::vector<Action>> greedy(const Schedule& s,
                                        const std::vector<std::vector<Action>>& f_order,
                                        const std::vector<std::vector<Action>>& b_order,
                                        const std::vector<int32_t>& max_held, const Costs& costs) {
  std::vector<std::vector<Action>> order;
  if (greedy_pass(s, f_order, b_order, max_held, costs, false, &order)) return order;
  TORCH_CHECK(greedy_pass(s, f_order, b_order, max_held, costs, true, &order), "schedule '",
              s.name, "': the generator made no progress");
  return order;
}

// Interleaved 1F1B with a split backward (torch's InterleavedZeroBubble): the interleaved
// schedule's forward and backward orders and its activation bound (rank r's warm-up plus one),
// list-scheduled with weight steps filling the waits (see [Note: greedy schedules]).
std::vector<std::vector<Action>> interleaved_zero_bubble(const Schedule& s, int32_t v,
                                                        const Costs& costs) {
  const int32_t p = s.num_ranks, m = s.num_microbatches;
  TORCH_CHECK(m % p == 0, "schedule 'interleaved_zb' needs num_microbatches divisible by the ",
              "number of ranks (", p, "), got ", m);
  std::vector<std::vector<Action>> f(p), b(p);
  std::vector<int32_t> held(p);
  for (int32_t r = 0; r < p; ++r) {
    for (int32_t k = 0; k < m * v; ++k) {
      const int32_t chunk = (k / p) % v, mb = (k / (p * v)) * p + k % p;
      f[r].push_back({Op::F, chunk * p + r, mb});
      b[r].push_back({Op::B, (v - 1 - chunk) * p + r, mb});
    }
    held[r] = (p - r - 1) * 2 + (v - 1) * p + 1;
  }
  return greedy(s, f, b, held, costs);
}

// ZB-V (arXiv 2405.15362): two stages per rank in a V (stage r and 2p-1-r on rank r), a split
// backward, and on every rank at most 2p microbatch-stages of activations: each stage is half a
// 1F1B stage, so that is 1F1B's peak (its first rank's p microbatches), now on every rank. Forwards
// and backwards of the deeper stage (nearer the loss) go first (see [Note: greedy schedules]).
std::vector<std::vector<Action>> zero_bubble_v(const Schedule& s, const Costs& costs) {
  const int32_t p = s.num_ranks, m = s.num_microbatches;
  std::vector<std::vector<Action>> f(p), b(p);
  for (int32_t r = 0; r < p; ++r) {
    const int32_t down = r, up = 2 * p - 1 - r;
    for (int32_t i = 0; i < m; ++i) {
      f[r].push_back({Op::F, up, i});
      f[r].push_back({Op::F, down, i});
      b[r].push_back({Op::B, up, i});
      b[r].push_back({Op::B, down, i});
    }
  }
  return greedy(s, f, b, std::vector<int32_t>(p, 2 * p), costs);
}

// DualPipeV (DeepSeek's DualPipe cut in half): two stages per rank in a V, in the published
// eight phases per rank r of p: (1) 2(p-r-1) forwards of the first stage; (2) r+1 pairs of
// forwards, first then second stage; (3) p-r-1 times: the second stage's backward split (its
// weight step at once), a forward of the second stage; (4) the steady state, m-2p+r+1 times: a
// forward of the first stage with a full backward of the second, then a forward of the second with
// a full backward of the first; (5) p-r-1 times: a backward of the second stage, a forward of the
// second with a backward of the first; (6) r+1 pairs of backwards, second then first stage,
// splitting from the middle on; (7) p-r-1 times: a pending weight step, a split backward of the
// first stage; (8) the pending weight steps. A full backward is a B with its W right after it.
// DualPipe runs each forward-with-backward pair overlapped; here they run one after the other.
std::vector<std::vector<Action>> dualpipe_v(const Schedule& s) {
  const int32_t p = s.num_ranks, m = s.num_microbatches;
  TORCH_CHECK(m >= 2 * p, "schedule 'dualpipev' needs at least 2 x ranks microbatches (", 2 * p,
              "), got ", m);
  std::vector<std::vector<Action>> order(p);
  for (int32_t r = 0; r < p; ++r) {
    auto& out = order[r];
    const int32_t stage[2] = {r, 2 * p - 1 - r};
    int32_t next_f[2] = {0, 0}, next_b[2] = {0, 0};
    std::deque<Action> weights;
    auto fwd = [&](int c) { out.push_back({Op::F, stage[c], next_f[c]++}); };
    auto bwd = [&](int c, bool split) {
      const Action w{Op::W, stage[c], next_b[c]};
      out.push_back({Op::B, stage[c], next_b[c]++});
      if (split) {
        weights.push_back(w);
      } else {
        out.push_back(w);
      }
    };
    auto weight = [&] {
      out.push_back(weights.front());
      weights.pop_front();
    };
    for (int32_t i = 0; i < 2 * (p - r - 1); ++i) fwd(0);
    for (int32_t i = 0; i < r + 1; ++i) fwd(0), fwd(1);
    for (int32_t i = 0; i < p - r - 1; ++i) bwd(1, true), weight(), fwd(1);
    for (int32_t i = 0; i < m - 2 * p + r + 1; ++i) fwd(0), bwd(1, false), fwd(1), bwd(0, false);
    for (int32_t i = 0; i < p - r - 1; ++i) bwd(1, false), fwd(1), bwd(0, false);
    bool split = false;
    for (int32_t i = 0; i < r + 1; ++i) {
      if (i == (r + 1) / 2 && r % 2 == 1) split = true;
      bwd(1, split);
      if (i == (r + 1) / 2 && r % 2 == 0) split = true;
      bwd(0, split);
    }
    for (int32_t i = 0; i < p - r - 1; ++i) weight(), bwd(0, true);
    while (!weights.empty()) weight();
  }
  return order;
}

// torch.distributed.pipelining's CSV name of each Op, in the enum's order (a split B is "I").
constexpr const char* kCsvTypes[] = {"F", "B", "W", "SEND_F", "RECV_F", "SEND_B", "RECV_B"};
static_assert(static_cast<int>(Op::RECV_B) == 6, "kCsvTypes follows the order of Op");

// One cell of a CSV schedule: its compute actions, in order (see [Note: CSV schedules]); `full`
// marks the full backwards (B in the file).
struct CsvCell {
  std::vector<Action> compute;
  std::vector<bool> full;
};

void parse_csv_action(const std::string& cell, CsvCell& out, bool& split) {
  if (!cell.empty() && cell.front() == '(') {
    const auto close = cell.find(')');
    TORCH_CHECK(close != std::string::npos, "CSV schedule: unbalanced '(' in '", cell, "'");
    std::stringstream inner(cell.substr(1, close - 1));
    for (std::string part; std::getline(inner, part, ';');)
      if (!part.empty()) parse_csv_action(part, out, split);
    return;
  }
  size_t i = 0;
  while (i < cell.size() && std::isdigit(static_cast<unsigned char>(cell[i]))) ++i;
  size_t j = cell.size();
  while (j > i && std::isdigit(static_cast<unsigned char>(cell[j - 1]))) --j;
  const std::string type = cell.substr(i, j - i);
  TORCH_CHECK(i > 0, "CSV schedule: action '", cell, "' names no stage");
  const bool transfer = std::find(std::begin(kCsvTypes) + 3, std::end(kCsvTypes), type) !=
                        std::end(kCsvTypes);
  if (transfer || type == "UNSHARD" || type == "RESHARD" || type == "REDUCE_GRAD") return;
  TORCH_CHECK(type == "F" || type == "I" || type == "B" || type == "W",
              "CSV schedule: unknown action type '", type, "' in '", cell,
              "'; expected F, I, B, W, SEND_F, RECV_F, SEND_B, RECV_B, UNSHARD, RESHARD, "
              "REDUCE_GRAD or (...)OVERLAP_F_B");
  TORCH_CHECK(j < cell.size(), "CSV schedule: action '", cell, "' names no microbatch");
  const int32_t stage = std::stoi(cell.substr(0, i)), mb = std::stoi(cell.substr(j));
  split = split || type == "I" || type == "W";
  const Op op = type == "F" ? Op::F : type == "W" ? Op::W : Op::B;
  out.compute.push_back({op, stage, mb});
  out.full.push_back(type == "B");
}

std::string trim(const std::string& s) {
  const auto b = s.find_first_not_of(" \t\r\"");
  if (b == std::string::npos) return "";
  return s.substr(b, s.find_last_not_of(" \t\r\"") - b + 1);
}

}  // namespace

Schedule Schedule::from_csv(const std::string& text, std::string name) {
  std::vector<CsvCell> rows;
  bool split = false;
  std::stringstream lines(text);
  for (std::string line; std::getline(lines, line);) {
    if (trim(line).empty()) continue;
    CsvCell row;
    std::stringstream cells(line);
    for (std::string cell; std::getline(cells, cell, ',');) {
      cell = trim(cell);
      if (!cell.empty()) parse_csv_action(cell, row, split);
    }
    rows.push_back(std::move(row));
  }
  TORCH_CHECK(!rows.empty(), "CSV schedule '", name, "' has no rows (one per rank)");
  Schedule s;
  s.name = std::move(name);
  s.num_ranks = static_cast<int32_t>(rows.size());
  s.split_backward = split;
  std::map<int32_t, int32_t> rank_of;
  for (int32_t r = 0; r < s.num_ranks; ++r) {
    for (const Action& a : rows[r].compute) {
      TORCH_CHECK(a.stage >= 0 && a.mb >= 0, "CSV schedule '", s.name, "': negative index in ",
                  to_string(a));
      const auto [it, fresh] = rank_of.emplace(a.stage, r);
      TORCH_CHECK(fresh || it->second == r, "CSV schedule '", s.name, "': stage ", a.stage,
                  " runs on rank ", it->second, " and on rank ", r);
      s.num_stages = std::max(s.num_stages, a.stage + 1);
      s.num_microbatches = std::max(s.num_microbatches, a.mb + 1);
    }
  }
  for (int32_t st = 0; st < s.num_stages; ++st) {
    TORCH_CHECK(rank_of.count(st), "CSV schedule '", s.name, "': stage ", st, " has no action");
    s.stage_rank.push_back(rank_of[st]);
  }
  std::vector<std::vector<Action>> compute(s.num_ranks);
  for (int32_t r = 0; r < s.num_ranks; ++r) {
    std::set<std::tuple<Op, int32_t, int32_t>> seen;
    for (size_t k = 0; k < rows[r].compute.size(); ++k) {
      const Action& a = rows[r].compute[k];
      const Op before = a.op == Op::W ? Op::B : Op::F;
      TORCH_CHECK(a.op == Op::F || seen.count({before, a.stage, a.mb}), "CSV schedule '", s.name,
                  "': rank ", r, " runs ", to_string(a), " before ",
                  to_string({before, a.stage, a.mb}));
      seen.insert({a.op, a.stage, a.mb});
      compute[r].push_back(a);
      if (split && rows[r].full[k]) compute[r].push_back({Op::W, a.stage, a.mb});
    }
  }
  s.backward = std::any_of(compute.begin(), compute.end(), [](const auto& acts) {
    return std::any_of(acts.begin(), acts.end(), [](const Action& a) { return a.op != Op::F; });
  });
  s = with_comms(std::move(s), compute);
  validate(s);
  return s;
}

std::string Schedule::to_csv(bool comms) const {
  std::ostringstream os;
  for (const auto& rank : actions) {
    bool first = true;
    for (const Action& a : rank) {
      const char* type =
          a.op == Op::B && split_backward ? "I" : kCsvTypes[static_cast<int>(a.op)];
      if (!comms && !is_compute(a.op)) continue;
      os << (first ? "" : ",") << a.stage << type << a.mb;
      first = false;
    }
    os << "\n";
  }
  return os.str();
}

const std::vector<ScheduleInfo>& schedule_table() {
  // See [Note: schedule facts]
  static const std::vector<ScheduleInfo> table = [] {
    std::vector<ScheduleInfo> t(9);
    t[0].name = "1f1b";
    t[0].description = "one forward, one backward: at most ranks - rank microbatches in flight";
    t[1].name = "gpipe";
    t[1].description = "every forward, then every backward";
    t[2].name = "interleaved";
    t[2].description = "interleaved 1F1B (Megatron): chunks >= 2 equal stages per rank";
    t[3].name = "zbh1";
    t[3].description = "zero bubble ZB-H1: split backward, weight steps fill the bubble";
    t[3].split_backward = true;
    t[4].name = "looped_bfs";
    t[4].description = "breadth-first: each chunk's forwards in turn, then backwards in reverse";
    t[5].name = "interleaved_zb";
    t[5].description = "interleaved 1F1B with a split backward (weight steps fill the bubble)";
    t[5].split_backward = true;
    t[6].name = "zbv";
    t[6].description = "zero bubble ZB-V: 2 stages per rank in a V, split backward, 1F1B's memory";
    t[6].split_backward = true;
    for (int i : {3, 5, 6}) t[i].list_scheduled = true;
    t[7].name = "dualpipev";
    t[7].description = "DualPipeV: 2 stages per rank in a V, split backward, >= 2 x ranks mbs";
    t[7].split_backward = true;
    for (int i : {2, 4, 5}) {
      t[i].min_chunks = 2;
      t[i].max_chunks = 0;
      t[i].default_chunks = 2;
      t[i].equal_stages = true;
    }
    for (int i : {6, 7}) {
      t[i].min_chunks = t[i].max_chunks = t[i].default_chunks = 2;
      t[i].equal_stages = true;
      t[i].placement = "v";
    }
    t[8].name = "forward";
    t[8].description = "evaluation: forwards only, any chunks and placement";
    t[8].trains = false;
    t[8].max_chunks = 0;
    return t;
  }();
  return table;
}

const ScheduleInfo& schedule_info(const std::string& name) {
  const auto& table = schedule_table();
  const auto it = std::find_if(table.begin(), table.end(),
                               [&](const ScheduleInfo& info) { return info.name == name; });
  if (it == table.end()) {
    std::ostringstream os;
    for (const auto& info : table) os << " '" << info.name << "'";
    TORCH_CHECK(false, "unknown schedule '", name, "'; known schedules:", os.str());
  }
  return *it;
}

std::vector<std::string> schedule_names() {
  std::vector<std::string> out;
  for (const auto& info : schedule_table()) out.push_back(info.name);
  return out;
}

std::vector<std::string> train_schedule_names() {
  std::vector<std::string> out;
  for (const auto& info : schedule_table())
    if (info.trains) out.push_back(info.name);
  return out;
}

int32_t default_chunks(const std::string& name) { return schedule_info(name).default_chunks; }

// The list-scheduled schedules' names, quoted, for messages.
std::string list_scheduled() {
  std::ostringstream os;
  for (const auto& info : schedule_table())
    if (info.list_scheduled) os << (os.tellp() > 0 ? ", '" : "'") << info.name << "'";
  return os.str();
}

// Throws c10::Error unless each per-stage list of `costs` is empty or has one entry per stage of
// `s`, and every cost is finite and not negative.
void check_costs(const Schedule& s, const Costs& costs, const char* what) {
  for (const auto* v : {&costs.forward, &costs.backward, &costs.weight}) {
    TORCH_CHECK(v->empty() || static_cast<int32_t>(v->size()) == s.num_stages, what,
                ": per-stage costs need one entry per stage (", s.num_stages, "), got ",
                v->size(), "; pass an empty list for unit costs");
    for (double c : *v)
      TORCH_CHECK(std::isfinite(c) && c >= 0, what, ": costs must be finite and >= 0, got ", c);
  }
  for (double c : {costs.comm, costs.send, costs.recv})
    TORCH_CHECK(std::isfinite(c) && c >= 0, what, ": costs must be finite and >= 0, got ", c);
}

void check_placement(const std::string& placement) {
  TORCH_CHECK(placement == "loop" || placement == "v", "unknown placement '", placement,
              "'; expected 'loop' or 'v'");
}

int32_t stage_rank(int32_t stage, int32_t num_ranks, const std::string& placement) {
  TORCH_CHECK(num_ranks >= 1 && stage >= 0, "stage_rank: need stage >= 0 and num_ranks >= 1, got ",
              stage, " and ", num_ranks);
  check_placement(placement);
  const int32_t chunk = stage / num_ranks, i = stage % num_ranks;
  return placement == "v" && chunk % 2 == 1 ? num_ranks - 1 - i : i;
}

void check_stage_count(int64_t num_layers, int64_t num_stages) {
  TORCH_CHECK_VALUE(
      num_stages <= num_layers, "cannot split ", num_layers, " decoder layers into ", num_stages,
      " stages: every stage needs at least one layer, and the model has only ", num_layers,
      " decoder layers; use at most ", num_layers, " stages (ranks x chunks)");
}

std::vector<std::pair<int32_t, int32_t>> balanced_ranges(int32_t num_layers, int32_t num_stages) {
  check_stage_count(num_layers, num_stages);
  TORCH_CHECK_VALUE(num_stages >= 1, "need at least one stage, got ", num_stages);
  const int32_t base = num_layers / num_stages, extra = num_layers % num_stages;
  std::vector<std::pair<int32_t, int32_t>> out;
  int32_t start = 0;
  for (int32_t s = 0; s < num_stages; ++s) {
    const int32_t stop = start + base + (s < extra ? 1 : 0);
    out.emplace_back(start, stop);
    start = stop;
  }
  return out;
}

Schedule forward_schedule(std::vector<int32_t> stage_rank, int32_t num_ranks,
                          int32_t num_microbatches) {
  TORCH_CHECK(num_ranks >= 1 && num_microbatches >= 1 && !stage_rank.empty(),
              "forward schedule: need ranks, microbatches and stages, got ", num_ranks, ", ",
              num_microbatches, " and ", stage_rank.size());
  Schedule s;
  s.name = "forward";
  s.num_ranks = num_ranks;
  s.num_stages = static_cast<int32_t>(stage_rank.size());
  s.num_microbatches = num_microbatches;
  s.backward = false;
  for (int32_t r : stage_rank)
    TORCH_CHECK(r >= 0 && r < num_ranks, "forward schedule: stage on rank ", r, " of ", num_ranks);
  s.stage_rank = std::move(stage_rank);
  std::vector<std::vector<Action>> compute(num_ranks);
  for (int32_t r = 0; r < num_ranks; ++r)
    for (int32_t stage : s.stages_of(r))
      for (int32_t i = 0; i < num_microbatches; ++i) compute[r].push_back({Op::F, stage, i});
  return with_comms(std::move(s), compute);
}

Schedule make_schedule(const std::string& name, int32_t num_ranks, int32_t num_microbatches,
                       int32_t chunks, const std::string& placement, const Costs& costs) {
  const ScheduleInfo& info = schedule_info(name);
  if (chunks == 0) chunks = info.default_chunks;
  const std::string& where = placement.empty() ? info.placement : placement;
  check_placement(where);
  TORCH_CHECK(info.trains == false || where == info.placement, "schedule '", name, "' places ",
              "its stages as '", info.placement, "', not '", where, "'");
  TORCH_CHECK(info.max_chunks != 1 || chunks == 1, "schedule '", name, "' runs one stage per ",
              "rank, so chunks must be 1, got ", chunks,
              "; use 'interleaved' for several stages per rank");
  TORCH_CHECK(chunks >= info.min_chunks && (info.max_chunks == 0 || chunks <= info.max_chunks),
              "schedule '", name, "' needs chunks >= ", info.min_chunks, " (stages per rank), got ",
              chunks);
  Schedule s = base(name, num_ranks, num_microbatches, chunks, where);
  const bool costed = !costs.forward.empty() || !costs.backward.empty() || !costs.weight.empty();
  TORCH_CHECK(!costed || info.list_scheduled, "schedule '", name, "' has a fixed order that ",
              "costs do not change; costs order the list-scheduled schedules (", list_scheduled(),
              ")");
  check_costs(s, costs, "make_schedule");
  s.backward = info.trains;
  s.split_backward = info.split_backward;
  const int32_t p = num_ranks, m = num_microbatches, v = chunks;
  std::vector<std::vector<Action>> compute(p);
  if (name == "1f1b") {
    for (int32_t r = 0; r < p; ++r) {
      const int32_t warmup = std::min(p - 1 - r, m);
      auto& c = compute[r];
      for (int32_t i = 0; i < warmup; ++i) c.push_back({Op::F, r, i});
      for (int32_t i = 0; i < m - warmup; ++i) {
        c.push_back({Op::F, r, warmup + i});
        c.push_back({Op::B, r, i});
      }
      for (int32_t i = m - warmup; i < m; ++i) c.push_back({Op::B, r, i});
    }
  } else if (name == "gpipe") {
    for (int32_t r = 0; r < p; ++r) {
      for (int32_t i = 0; i < m; ++i) compute[r].push_back({Op::F, r, i});
      for (int32_t i = 0; i < m; ++i) compute[r].push_back({Op::B, r, i});
    }
  } else if (name == "forward") {
    return forward_schedule(s.stage_rank, p, m);
  } else if (name == "interleaved") {
    // Megatron's interleaved 1F1B: microbatches advance in groups of `p` through the chunks;
    // rank r warms up with (p - r - 1) * 2 + (v - 1) * p forwards, then alternates F and B.
    TORCH_CHECK(m % p == 0, "schedule 'interleaved' needs num_microbatches divisible by the ",
                "number of ranks (", p, "), got ", m);
    const int32_t total = m * v;
    auto unit = [&](Op op, int32_t r, int32_t k) {
      const int32_t chunk = (k / p) % v, mb = (k / (p * v)) * p + k % p;
      return Action{op, (op == Op::F ? chunk : v - 1 - chunk) * p + r, mb};
    };
    for (int32_t r = 0; r < p; ++r) {
      const int32_t warmup = std::min(total, (p - r - 1) * 2 + (v - 1) * p);
      auto& c = compute[r];
      for (int32_t k = 0; k < warmup; ++k) c.push_back(unit(Op::F, r, k));
      for (int32_t k = 0; k < total - warmup; ++k) {
        c.push_back(unit(Op::F, r, warmup + k));
        c.push_back(unit(Op::B, r, k));
      }
      for (int32_t k = total - warmup; k < total; ++k) c.push_back(unit(Op::B, r, k));
    }
  } else if (name == "zbh1") {
    compute = zero_bubble_h1(p, m, costs);
  } else if (name == "looped_bfs") {
    compute = looped_bfs(s, v);
  } else if (name == "interleaved_zb") {
    compute = interleaved_zero_bubble(s, v, costs);
  } else if (name == "zbv") {
    compute = zero_bubble_v(s, costs);
  } else {  // "dualpipev"; schedule_info refused any other name
    compute = dualpipe_v(s);
  }
  if (!costed) return with_comms(std::move(s), compute);
  // A list scheduler is a heuristic: keep the published order where the simulator puts it no
  // later at these costs (see [Note: list scheduling at costs]).
  Schedule tuned = with_comms(std::move(s), compute);
  Schedule published = make_schedule(name, num_ranks, num_microbatches, chunks, placement);
  const Costs at{costs.forward, costs.backward, costs.weight};
  return simulate(tuned, at).makespan < simulate(published, at).makespan ? tuned : published;
}

namespace {

using Key = std::tuple<int, int32_t, int32_t>;  // (op, stage, mb)
Key key(Op op, int32_t stage, int32_t mb) { return {static_cast<int>(op), stage, mb}; }

void check_structure(const Schedule& s) {
  TORCH_CHECK(s.num_ranks >= 1 && s.num_stages >= 1 && s.num_microbatches >= 1, "schedule '",
              s.name, "': ranks, stages and microbatches must be >= 1");
  TORCH_CHECK(static_cast<int32_t>(s.stage_rank.size()) == s.num_stages, "schedule '", s.name,
              "': stage_rank has ", s.stage_rank.size(), " entries for ", s.num_stages, " stages");
  TORCH_CHECK(static_cast<int32_t>(s.actions.size()) == s.num_ranks, "schedule '", s.name,
              "': ", s.actions.size(), " action lists for ", s.num_ranks, " ranks");
  TORCH_CHECK(!s.split_backward || s.backward, "schedule '", s.name,
              "': split backward without backward");
  const int32_t last = s.num_stages - 1;
  // Expected count of each action, derived from the stage placement alone.
  std::map<Key, int> expected;
  for (int32_t st = 0; st < s.num_stages; ++st) {
    const int32_t r = s.stage_rank[st];
    TORCH_CHECK(r >= 0 && r < s.num_ranks, "schedule '", s.name, "': stage ", st,
                " placed on rank ", r, " of ", s.num_ranks);
    for (int32_t m = 0; m < s.num_microbatches; ++m) {
      expected[key(Op::F, st, m)] = 1;
      if (st < last && s.stage_rank[st + 1] != r) {
        expected[key(Op::SEND_F, st, m)] = 1;
        expected[key(Op::RECV_F, st + 1, m)] = 1;
      }
      if (!s.backward) continue;
      expected[key(Op::B, st, m)] = 1;
      if (s.split_backward) expected[key(Op::W, st, m)] = 1;
      if (st > 0 && s.stage_rank[st - 1] != r) {
        expected[key(Op::SEND_B, st, m)] = 1;
        expected[key(Op::RECV_B, st - 1, m)] = 1;
      }
    }
  }
  std::map<Key, int> seen;
  for (int32_t r = 0; r < s.num_ranks; ++r) {
    std::map<Key, size_t> pos;
    for (size_t i = 0; i < s.actions[r].size(); ++i) {
      const Action& a = s.actions[r][i];
      TORCH_CHECK(a.stage >= 0 && a.stage < s.num_stages && a.mb >= 0 && a.mb < s.num_microbatches,
                  "schedule '", s.name, "': rank ", r, " action ", to_string(a), " out of range");
      TORCH_CHECK(s.stage_rank[a.stage] == r, "schedule '", s.name, "': rank ", r, " runs ",
                  to_string(a), " but stage ", a.stage, " lives on rank ", s.stage_rank[a.stage]);
      const Key k = key(a.op, a.stage, a.mb);
      TORCH_CHECK(expected.count(k), "schedule '", s.name, "': rank ", r,
                  " has an unexpected action ", to_string(a));
      TORCH_CHECK(++seen[k] == 1, "schedule '", s.name, "': rank ", r, " repeats ", to_string(a));
      pos[k] = i;
    }
    // Order constraints within the rank.
    auto before = [&](Op a, Op b, int32_t st, int32_t m) {
      auto ia = pos.find(key(a, st, m)), ib = pos.find(key(b, st, m));
      if (ia == pos.end() || ib == pos.end()) return;
      TORCH_CHECK(ia->second < ib->second, "schedule '", s.name, "': rank ", r, " runs ",
                  to_string({b, st, m}), " before ", to_string({a, st, m}));
    };
    for (int32_t st : s.stages_of(r)) {
      for (int32_t m = 0; m < s.num_microbatches; ++m) {
        before(Op::RECV_F, Op::F, st, m);
        before(Op::F, Op::SEND_F, st, m);
        before(Op::F, Op::RECV_B, st, m);
        before(Op::RECV_B, Op::B, st, m);
        before(Op::F, Op::B, st, m);
        before(Op::B, Op::SEND_B, st, m);
        before(Op::B, Op::W, st, m);
      }
    }
  }
  for (const auto& kv : expected) {
    if (!seen.count(kv.first)) {
      const Action a{static_cast<Op>(std::get<0>(kv.first)), std::get<1>(kv.first),
                     std::get<2>(kv.first)};
      TORCH_CHECK(false, "schedule '", s.name, "': action ", to_string(a), " is missing on rank ",
                  s.stage_rank[a.stage]);
    }
  }
}

}  // namespace

SimResult simulate(const Schedule& s, const Costs& costs) {
  check_structure(s);
  const int32_t last = s.num_stages - 1;
  check_costs(s, costs, "simulate");
  auto cost_of = [&](const Action& a) -> double {
    auto pick = [&](const std::vector<double>& v) { return v.empty() ? 1.0 : v[a.stage]; };
    switch (a.op) {
      case Op::F:
        return pick(costs.forward);
      case Op::B:
        return pick(costs.backward);
      case Op::W:
        return pick(costs.weight);
      case Op::SEND_F:
      case Op::SEND_B:
        return costs.send;
      case Op::RECV_F:
      case Op::RECV_B:
        return costs.recv;
    }
    return 0.0;
  };
  std::map<Key, double> done;  // action -> end time
  std::vector<size_t> pc(s.num_ranks, 0);
  std::vector<double> clock(s.num_ranks, 0.0);
  SimResult res;
  res.peak_inflight.assign(s.num_stages, 0);
  double busy = 0.0;
  auto end_of = [&](Op op, int32_t st, int32_t m, double* t) {
    auto it = done.find(key(op, st, m));
    if (it == done.end()) return false;
    *t = it->second;
    return true;
  };
  // Returns whether `a` can start, and the earliest time its inputs are there.
  auto ready = [&](int32_t r, const Action& a, double* t) -> bool {
    *t = 0.0;
    switch (a.op) {
      case Op::F:
        if (a.stage == 0) return true;
        if (s.stage_rank[a.stage - 1] == r) return end_of(Op::F, a.stage - 1, a.mb, t);
        if (!end_of(Op::SEND_F, a.stage - 1, a.mb, t)) return false;
        *t += costs.comm;
        return true;
      case Op::B:
        if (!end_of(Op::F, a.stage, a.mb, t)) return false;
        if (a.stage == last) return true;
        if (s.stage_rank[a.stage + 1] == r) return end_of(Op::B, a.stage + 1, a.mb, t);
        if (!end_of(Op::SEND_B, a.stage + 1, a.mb, t)) return false;
        *t += costs.comm;
        return true;
      case Op::W:
        return end_of(Op::B, a.stage, a.mb, t);
      case Op::SEND_F:
        return end_of(Op::F, a.stage, a.mb, t);
      case Op::SEND_B:
        return end_of(Op::B, a.stage, a.mb, t);
      case Op::RECV_F:
      case Op::RECV_B:
        return true;
    }
    return false;
  };
  // Live states per rank: see [Note: live states]. The counts change only at the rank's own
  // compute actions, so they follow its action list regardless of timing.
  auto covers = [](const std::vector<int32_t>& x, const std::vector<int32_t>& y) {
    for (size_t i = 0; i < x.size(); ++i)
      if (x[i] < y[i]) return false;
    return true;
  };
  res.live_states.resize(s.num_ranks);
  for (int32_t r = 0; r < s.num_ranks; ++r) {
    const auto mine = s.stages_of(r);
    std::vector<int32_t> before(kLiveCounts * mine.size(), 0);
    res.live_states[r].resize(mine.size());
    for (const Action& a : s.actions[r]) {
      if (!s.backward || !is_compute(a.op)) continue;
      const size_t local = std::find(mine.begin(), mine.end(), a.stage) - mine.begin();
      const size_t k = kLiveCounts * local;
      std::vector<int32_t> after = before;
      if (a.op == Op::F) {
        ++after[k];
      } else if (a.op == Op::B) {
        --after[k];
        if (s.split_backward) ++after[k + 1];
      } else {
        --after[k + 1];
      }
      std::vector<std::vector<int32_t>> during;
      if (a.op == Op::B && s.split_backward) {
        during = {before, after};
        during[0][k + 2] = 1;
      } else {
        during.emplace_back(before.size());
        for (size_t i = 0; i < before.size(); ++i) during[0][i] = std::max(before[i], after[i]);
      }
      before = std::move(after);
      auto& states = res.live_states[r][local];
      for (auto& x : during) {
        if (std::any_of(states.begin(), states.end(), [&](const auto& y) { return covers(y, x); }))
          continue;
        states.erase(std::remove_if(states.begin(), states.end(),
                                    [&](const auto& y) { return covers(x, y); }),
                     states.end());
        states.push_back(std::move(x));
      }
    }
    // Peak in flight (forwarded, W or full backward not yet done) of each stage: right after
    // one of its own forwards, a state of its own list.
    for (size_t local = 0; local < mine.size(); ++local)
      for (const auto& x : res.live_states[r][local])
        res.peak_inflight[mine[local]] = std::max(
            res.peak_inflight[mine[local]], x[kLiveCounts * local] + x[kLiveCounts * local + 1]);
  }
  for (bool progress = true; progress;) {
    progress = false;
    for (int32_t r = 0; r < s.num_ranks; ++r) {
      while (pc[r] < s.actions[r].size()) {
        const Action& a = s.actions[r][pc[r]];
        double t = 0.0;
        if (!ready(r, a, &t)) break;
        const double start = std::max(clock[r], t);
        const double end = start + cost_of(a);
        clock[r] = end;
        done[key(a.op, a.stage, a.mb)] = end;
        res.timeline.push_back({a, r, start, end});
        if (is_compute(a.op)) busy += end - start;
        ++pc[r];
        progress = true;
      }
    }
  }
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
