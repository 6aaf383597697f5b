// See generators.h.
#include "schedule/generators.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <deque>
#include <functional>
#include <tuple>

#include "schedule/facts.h"
#include "schedule/layout.h"
#include "schedule/list_scheduling.h"

namespace pippy_xla {

namespace {

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

void check_divisible(const Schedule& s) {
  TORCH_CHECK(s.num_microbatches % s.num_ranks == 0, "schedule '", s.name,
              "' needs num_microbatches divisible by the number of ranks (", s.num_ranks, "), got ",
              s.num_microbatches);
}

// A one-forward-one-backward order of `total` units: `warmup` forwards, then a forward and a
// backward in turn, then the backwards left. `unit(op, k)` is the k-th forward or backward.
std::vector<Action> one_forward_one_backward(int32_t total, int32_t warmup,
                                             const std::function<Action(Op, int32_t)>& unit) {
  warmup = std::min(warmup, total);
  std::vector<Action> c;
  for (int32_t k = 0; k < warmup; ++k) c.push_back(unit(Op::F, k));
  for (int32_t k = 0; k < total - warmup; ++k) {
    c.push_back(unit(Op::F, warmup + k));
    c.push_back(unit(Op::B, k));
  }
  for (int32_t k = total - warmup; k < total; ++k) c.push_back(unit(Op::B, k));
  return c;
}

Orders one_f_one_b(const Schedule& s) {
  const int32_t p = s.num_ranks, m = s.num_microbatches;
  Orders order;
  for (int32_t r = 0; r < p; ++r)
    order.push_back(
        one_forward_one_backward(m, p - 1 - r, [r](Op op, int32_t k) { return Action{op, r, k}; }));
  return order;
}

Orders gpipe(const Schedule& s) {
  Orders order(s.num_ranks);
  for (int32_t r = 0; r < s.num_ranks; ++r) {
    for (int32_t i = 0; i < s.num_microbatches; ++i) order[r].push_back({Op::F, r, i});
    for (int32_t i = 0; i < s.num_microbatches; ++i) order[r].push_back({Op::B, r, i});
  }
  return order;
}

// Megatron's interleaved 1F1B: microbatches advance in groups of `p` through the `v` chunks.
// The k-th forward (or backward) unit of rank r.
Action interleaved_unit(Op op, int32_t p, int32_t v, int32_t r, int32_t k) {
  const int32_t chunk = (k / p) % v, mb = (k / (p * v)) * p + k % p;
  return Action{op, (op == Op::F ? chunk : v - 1 - chunk) * p + r, mb};
}

// The forwards rank r runs before its first backward in interleaved 1F1B.
int32_t interleaved_warmup(int32_t p, int32_t v, int32_t r) {
  return (p - r - 1) * 2 + (v - 1) * p;
}

Orders interleaved(const Schedule& s, int32_t v) {
  check_divisible(s);
  const int32_t p = s.num_ranks;
  Orders order;
  for (int32_t r = 0; r < p; ++r)
    order.push_back(one_forward_one_backward(
        s.num_microbatches * v, interleaved_warmup(p, v, r),
        [=](Op op, int32_t k) { return interleaved_unit(op, p, v, r, k); }));
  return order;
}

// Looped BFS (breadth-first pipelining): every forward of a rank's first chunk, then of its next
// chunk, ...; then the backwards, last chunk first. GPipe's memory (every microbatch of every
// chunk in flight), fewer stalls between chunks.
Orders looped_bfs(const Schedule& s, int32_t v) {
  const int32_t p = s.num_ranks, m = s.num_microbatches;
  Orders order(p);
  for (int32_t r = 0; r < p; ++r) {
    for (int32_t c = 0; c < v; ++c)
      for (int32_t i = 0; i < m; ++i) order[r].push_back({Op::F, c * p + r, i});
    for (int32_t c = v - 1; c >= 0; --c)
      for (int32_t i = 0; i < m; ++i) order[r].push_back({Op::B, c * p + r, i});
  }
  return order;
}

// Interleaved 1F1B with a split backward (torch's InterleavedZeroBubble): the interleaved
// schedule's forward and backward orders and its activation bound (rank r's warm-up plus one),
// list-scheduled with weight steps filling the waits (see [Note: greedy schedules]).
Orders interleaved_zero_bubble(const Schedule& s, int32_t v, const Costs& costs) {
  check_divisible(s);
  const int32_t p = s.num_ranks, m = s.num_microbatches;
  Orders f(p), b(p);
  std::vector<int32_t> held(p);
  for (int32_t r = 0; r < p; ++r) {
    for (int32_t k = 0; k < m * v; ++k) {
      f[r].push_back(interleaved_unit(Op::F, p, v, r, k));
      b[r].push_back(interleaved_unit(Op::B, p, v, r, k));
    }
    held[r] = interleaved_warmup(p, v, r) + 1;
  }
  return greedy(s, f, b, held, costs);
}

// ZB-V (arXiv 2405.15362): two stages per rank in a V (stage r and 2p-1-r on rank r), a split
// backward, and on every rank at most 2p microbatch-stages of activations: each stage is half a
// 1F1B stage, so that is 1F1B's peak (its first rank's p microbatches), now on every rank. Forwards
// and backwards of the deeper stage (nearer the loss) go first (see [Note: greedy schedules]).
Orders zero_bubble_v(const Schedule& s, const Costs& costs) {
  const int32_t p = s.num_ranks, m = s.num_microbatches;
  Orders f(p), b(p);
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

// One rank's DualPipeV order as it is written: forwards and backwards of its first (0) and
// second (1) stage, a backward split (its W kept for later) or full (its W right after it).
class DualPipeRank {
 public:
  DualPipeRank(int32_t p, int32_t r) : stage_{r, 2 * p - 1 - r} {}
  void fwd(int c) { out_.push_back({Op::F, stage_[c], next_f_[c]++}); }
  void bwd(int c, bool split) {
    const Action w{Op::W, stage_[c], next_b_[c]};
    out_.push_back({Op::B, stage_[c], next_b_[c]++});
    if (split) {
      weights_.push_back(w);
    } else {
      out_.push_back(w);
    }
  }
  void weight() {
    out_.push_back(weights_.front());
    weights_.pop_front();
  }
  bool weights_pending() const { return !weights_.empty(); }
  std::vector<Action> take() { return std::move(out_); }

 private:
  const int32_t stage_[2];
  int32_t next_f_[2] = {0, 0}, next_b_[2] = {0, 0};
  std::deque<Action> weights_;
  std::vector<Action> out_;
};

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
std::vector<Action> dualpipe_v_rank(int32_t p, int32_t m, int32_t r) {
  DualPipeRank d(p, r);
  for (int32_t i = 0; i < 2 * (p - r - 1); ++i) d.fwd(0);
  for (int32_t i = 0; i < r + 1; ++i) d.fwd(0), d.fwd(1);
  for (int32_t i = 0; i < p - r - 1; ++i) d.bwd(1, true), d.weight(), d.fwd(1);
  for (int32_t i = 0; i < m - 2 * p + r + 1; ++i)
    d.fwd(0), d.bwd(1, false), d.fwd(1), d.bwd(0, false);
  for (int32_t i = 0; i < p - r - 1; ++i) d.bwd(1, false), d.fwd(1), d.bwd(0, false);
  bool split = false;
  for (int32_t i = 0; i < r + 1; ++i) {
    if (i == (r + 1) / 2 && r % 2 == 1) split = true;
    d.bwd(1, split);
    if (i == (r + 1) / 2 && r % 2 == 0) split = true;
    d.bwd(0, split);
  }
  for (int32_t i = 0; i < p - r - 1; ++i) d.weight(), d.bwd(0, true);
  while (d.weights_pending()) d.weight();
  return d.take();
}

Orders dualpipe_v(const Schedule& s) {
  const int32_t p = s.num_ranks, m = s.num_microbatches;
  TORCH_CHECK(m >= 2 * p, "schedule 'dualpipev' needs at least 2 x ranks microbatches (", 2 * p,
              "), got ", m);
  Orders order;
  for (int32_t r = 0; r < p; ++r) order.push_back(dualpipe_v_rank(p, m, r));
  return order;
}

// Throws c10::Error unless schedule `info` runs with `chunks` stages per rank placed as `where`.
void check_layout(const ScheduleInfo& info, int32_t chunks, const std::string& where) {
  const std::string& name = info.name;
  check_placement(where);
  TORCH_CHECK(info.trains == false || where == info.placement, "schedule '", name, "' places ",
              "its stages as '", info.placement, "', not '", where, "'");
  TORCH_CHECK(info.max_chunks != 1 || chunks == 1, "schedule '", name, "' runs one stage per ",
              "rank, so chunks must be 1, got ", chunks,
              "; use 'interleaved' for several stages per rank");
  TORCH_CHECK(chunks >= info.min_chunks && (info.max_chunks == 0 || chunks <= info.max_chunks),
              "schedule '", name, "' needs chunks >= ", info.min_chunks, " (stages per rank), got ",
              chunks);
}

// The compute orders of training schedule `s` (named as in the facts table) with `v` chunks.
Orders training_orders(const Schedule& s, int32_t v, const Costs& costs) {
  const std::string& name = s.name;
  if (name == "1f1b") return one_f_one_b(s);
  if (name == "gpipe") return gpipe(s);
  if (name == "interleaved") return interleaved(s, v);
  if (name == "zbh1") return zero_bubble_h1(s.num_ranks, s.num_microbatches, costs);
  if (name == "looped_bfs") return looped_bfs(s, v);
  if (name == "interleaved_zb") return interleaved_zero_bubble(s, v, costs);
  if (name == "zbv") return zero_bubble_v(s, costs);
  TORCH_CHECK(name == "dualpipev", "schedule '", name, "' has no generator");
  return dualpipe_v(s);
}

}  // namespace

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
  Orders compute(num_ranks);
  for (int32_t r = 0; r < num_ranks; ++r)
    for (int32_t stage : s.stages_of(r))
      for (int32_t i = 0; i < num_microbatches; ++i) compute[r].push_back({Op::F, stage, i});
  return with_transfers(std::move(s), compute);
}

Schedule decode_schedule(std::vector<int32_t> stage_rank, int32_t num_ranks, int32_t groups,
                         int32_t tokens) {
  TORCH_CHECK(groups >= 1 && tokens >= 1,
              "decode schedule: need at least 1 group and 1 token, got ", groups, " and ", tokens);
  Schedule s = forward_schedule(std::move(stage_rank), num_ranks, groups * tokens);
  s.name = "decode";
  s.decode_groups = groups;
  const int32_t p = s.num_stages;
  Orders compute(num_ranks);
  for (int32_t r = 0; r < num_ranks; ++r) {
    std::vector<std::tuple<int32_t, int32_t, int32_t>> order;  // (wavefront, group, stage)
    for (int32_t stage : s.stages_of(r))
      for (int32_t t = 0; t < tokens; ++t)
        for (int32_t g = 0; g < groups; ++g) order.emplace_back(t * p + stage, g, stage);
    std::sort(order.begin(), order.end());
    for (const auto& [wave, g, stage] : order)
      compute[r].push_back({Op::F, stage, (wave - stage) / p * groups + g});
  }
  return with_transfers(std::move(s), compute);
}

Schedule make_schedule(const std::string& name, int32_t num_ranks, int32_t num_microbatches,
                       int32_t chunks, const std::string& placement, const Costs& costs) {
  const ScheduleInfo& info = schedule_info(name);
  if (chunks == 0) chunks = info.default_chunks;
  const std::string& where = placement.empty() ? info.placement : placement;
  check_layout(info, chunks, where);
  Schedule s = base(name, num_ranks, num_microbatches, chunks, where);
  TORCH_CHECK(!costs.per_stage() || info.list_scheduled, "schedule '", name,
              "' has a fixed order that costs do not change; costs order the list-scheduled "
              "schedules (",
              list_scheduled_names(), ")");
  check_costs(s, costs, "make_schedule");
  if (!info.trains) return forward_schedule(s.stage_rank, num_ranks, num_microbatches);
  s.split_backward = info.split_backward;
  const Orders compute = training_orders(s, chunks, costs);
  Schedule generated = with_transfers(std::move(s), compute);
  if (!costs.per_stage()) return generated;
  // A list scheduler is a heuristic: keep the published order where the simulator puts it no
  // later at these costs (see [Note: list scheduling at costs]).
  Schedule published = make_schedule(name, num_ranks, num_microbatches, chunks, placement);
  const Costs at{costs.forward, costs.backward, costs.weight};
  return simulate(generated, at).makespan < simulate(published, at).makespan ? generated
                                                                             : published;
}

}  // namespace pippy_xla
