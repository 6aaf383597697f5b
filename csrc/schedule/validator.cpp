// The validator's structural half (see simulator.h); simulate() runs it before timing a schedule.
#include <c10/util/Exception.h>

#include <map>
#include <set>

#include "schedule/simulator.h"

namespace pippy_xla {

namespace {

void check_sizes(const Schedule& s) {
  TORCH_CHECK(s.num_ranks >= 1 && s.num_stages >= 1 && s.num_microbatches >= 1, "schedule '",
              s.name, "': ranks, stages and microbatches must be >= 1");
  TORCH_CHECK(static_cast<int32_t>(s.stage_rank.size()) == s.num_stages, "schedule '", s.name,
              "': stage_rank has ", s.stage_rank.size(), " entries for ", s.num_stages, " stages");
  TORCH_CHECK(static_cast<int32_t>(s.actions.size()) == s.num_ranks, "schedule '", s.name,
              "': ", s.actions.size(), " action lists for ", s.num_ranks, " ranks");
  TORCH_CHECK(!s.split_backward || s.backward, "schedule '", s.name,
              "': split backward without backward");
  TORCH_CHECK(s.decode_groups >= 0 && (s.decode_groups == 0 || !s.backward), "schedule '", s.name,
              "': a decode schedule (decode_groups ", s.decode_groups,
              ") must be forward only and have >= 1 group");
  for (int32_t st = 0; st < s.num_stages; ++st) {
    const int32_t r = s.stage_rank[st];
    TORCH_CHECK(r >= 0 && r < s.num_ranks, "schedule '", s.name, "': stage ", st,
                " placed on rank ", r, " of ", s.num_ranks);
  }
}

// Every action the schedule must run once, derived from the stage placement alone.
std::set<Action> expected_actions(const Schedule& s) {
  const int32_t last = s.num_stages - 1;
  std::set<Action> expected;
  for (int32_t st = 0; st < s.num_stages; ++st) {
    const int32_t r = s.stage_rank[st];
    for (int32_t m = 0; m < s.num_microbatches; ++m) {
      expected.insert({Op::F, st, m});
      Action next;
      if (s.next_forward(st, m, &next) && s.stage_rank[next.stage] != r) {
        expected.insert({Op::SEND_F, st, m});
        expected.insert({Op::RECV_F, next.stage, next.mb});
      }
      if (!s.backward) continue;
      expected.insert({Op::B, st, m});
      if (s.split_backward) expected.insert({Op::W, st, m});
      if (st > 0 && s.stage_rank[st - 1] != r) {
        expected.insert({Op::SEND_B, st, m});
        expected.insert({Op::RECV_B, st - 1, m});
      }
    }
  }
  return expected;
}

// The order each (stage, microbatch)'s actions keep within their rank: each pair's first runs
// before its second.
constexpr Op kOrder[][2] = {{Op::RECV_F, Op::F}, {Op::F, Op::SEND_F}, {Op::F, Op::RECV_B},
                            {Op::RECV_B, Op::B}, {Op::F, Op::B},      {Op::B, Op::SEND_B},
                            {Op::B, Op::W}};

// Checks rank `r`'s actions: in range, on the rank of their stage, expected, not repeated, and
// in order; records them in `seen`.
void check_rank(const Schedule& s, int32_t r, const std::set<Action>& expected,
                std::set<Action>& seen) {
  std::map<Action, size_t> pos;
  for (size_t i = 0; i < s.actions[r].size(); ++i) {
    const Action& a = s.actions[r][i];
    TORCH_CHECK(a.stage >= 0 && a.stage < s.num_stages && a.mb >= 0 && a.mb < s.num_microbatches,
                "schedule '", s.name, "': rank ", r, " action ", to_string(a), " out of range");
    TORCH_CHECK(s.stage_rank[a.stage] == r, "schedule '", s.name, "': rank ", r, " runs ",
                to_string(a), " but stage ", a.stage, " lives on rank ", s.stage_rank[a.stage]);
    TORCH_CHECK(expected.count(a), "schedule '", s.name, "': rank ", r,
                " has an unexpected action ", to_string(a));
    TORCH_CHECK(seen.insert(a).second, "schedule '", s.name, "': rank ", r, " repeats ",
                to_string(a));
    pos[a] = i;
  }
  for (int32_t st : s.stages_of(r)) {
    for (int32_t m = 0; m < s.num_microbatches; ++m) {
      for (const auto& [first, second] : kOrder) {
        const auto ia = pos.find({first, st, m}), ib = pos.find({second, st, m});
        if (ia == pos.end() || ib == pos.end()) continue;
        TORCH_CHECK(ia->second < ib->second, "schedule '", s.name, "': rank ", r, " runs ",
                    to_string({second, st, m}), " before ", to_string({first, st, m}));
      }
    }
  }
}

}  // namespace

void check_actions(const Schedule& s) {
  check_sizes(s);
  const std::set<Action> expected = expected_actions(s);
  std::set<Action> seen;
  for (int32_t r = 0; r < s.num_ranks; ++r) check_rank(s, r, expected, seen);
  for (const Action& a : expected) {
    TORCH_CHECK(seen.count(a), "schedule '", s.name, "': action ", to_string(a),
                " is missing on rank ", s.stage_rank[a.stage]);
  }
}

}  // namespace pippy_xla
