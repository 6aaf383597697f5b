// See schedule.h.
#include "schedule/schedule.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <map>
#include <sstream>
#include <utility>

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

bool Schedule::next_forward(int32_t stage, int32_t mb, Action* next) const {
  Action a{Op::F, stage + 1, mb};
  if (stage == num_stages - 1) {
    if (decode_groups <= 0 || mb + decode_groups >= num_microbatches) return false;
    a = {Op::F, 0, mb + decode_groups};
  }
  if (next) *next = a;
  return true;
}

bool Schedule::prev_forward(int32_t stage, int32_t mb, Action* prev) const {
  Action a{Op::F, stage - 1, mb};
  if (stage == 0) {
    if (decode_groups <= 0 || mb < decode_groups) return false;
    a = {Op::F, num_stages - 1, mb - decode_groups};
  }
  if (prev) *prev = a;
  return true;
}

bool is_compute(Op op) { return op == Op::F || op == Op::B || op == Op::W; }

Schedule with_transfers(Schedule s, const std::vector<std::vector<Action>>& compute) {
  const int32_t last = s.num_stages - 1;
  Action other;  // a neighbouring forward (see [Note: decode schedules])
  s.actions.assign(s.num_ranks, {});
  for (int32_t r = 0; r < s.num_ranks; ++r) {
    const auto& c = compute[r];
    std::vector<std::vector<Action>> before(c.size());
    std::map<std::pair<int32_t, int32_t>, size_t> f_index;
    for (size_t i = 0; i < c.size(); ++i) {
      const Action& a = c[i];
      if (a.op == Op::F) f_index[{a.stage, a.mb}] = i;
      size_t at = i == 0 ? 0 : i - 1;
      if (a.op == Op::F && s.prev_forward(a.stage, a.mb, &other) &&
          s.stage_rank[other.stage] != r) {
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
      if (a.op == Op::F && s.next_forward(a.stage, a.mb, &other) &&
          s.stage_rank[other.stage] != r) {
        out.push_back({Op::SEND_F, a.stage, a.mb});
      } else if (a.op == Op::B && a.stage > 0 && s.stage_rank[a.stage - 1] != r) {
        out.push_back({Op::SEND_B, a.stage, a.mb});
      }
    }
  }
  return s;
}

}  // namespace pippy_xla
