// The CSV form of a schedule: see [Note: CSV schedules] in schedule.h.
#include <c10/util/Exception.h>

#include <algorithm>
#include <cctype>
#include <iterator>
#include <map>
#include <set>
#include <sstream>
#include <tuple>

#include "schedule/schedule.h"
#include "schedule/simulator.h"

namespace pippy_xla {

namespace {

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
  const bool transfer =
      std::find(std::begin(kCsvTypes) + 3, std::end(kCsvTypes), type) != std::end(kCsvTypes);
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

// The rows of a CSV schedule, one per rank; `split` is set if any names an I or W.
std::vector<CsvCell> read_rows(const std::string& text, const std::string& name, bool& split) {
  std::vector<CsvCell> rows;
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
  return rows;
}

// Sets the stage count, microbatch count and placement of `s` from the rank each stage runs on.
void place_stages(Schedule& s, const std::vector<CsvCell>& rows) {
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
}

// Rank `r`'s compute order: its row's actions, each full backward of a split schedule followed
// by its W.
std::vector<Action> compute_order(const Schedule& s, int32_t r, const CsvCell& row) {
  std::vector<Action> compute;
  std::set<std::tuple<Op, int32_t, int32_t>> seen;
  for (size_t k = 0; k < row.compute.size(); ++k) {
    const Action& a = row.compute[k];
    const Op before = a.op == Op::W ? Op::B : Op::F;
    TORCH_CHECK(a.op == Op::F || seen.count({before, a.stage, a.mb}), "CSV schedule '", s.name,
                "': rank ", r, " runs ", to_string(a), " before ",
                to_string({before, a.stage, a.mb}));
    seen.insert({a.op, a.stage, a.mb});
    compute.push_back(a);
    if (s.split_backward && row.full[k]) compute.push_back({Op::W, a.stage, a.mb});
  }
  return compute;
}

}  // namespace

Schedule Schedule::from_csv(const std::string& text, std::string name) {
  bool split = false;
  const std::vector<CsvCell> rows = read_rows(text, name, split);
  Schedule s;
  s.name = std::move(name);
  s.num_ranks = static_cast<int32_t>(rows.size());
  s.split_backward = split;
  place_stages(s, rows);
  std::vector<std::vector<Action>> compute;
  for (int32_t r = 0; r < s.num_ranks; ++r) compute.push_back(compute_order(s, r, rows[r]));
  s.backward = std::any_of(compute.begin(), compute.end(), [](const auto& acts) {
    return std::any_of(acts.begin(), acts.end(), [](const Action& a) { return a.op != Op::F; });
  });
  s = with_transfers(std::move(s), compute);
  validate(s);
  return s;
}

std::string Schedule::to_csv(bool comms) const {
  std::ostringstream os;
  for (const auto& rank : actions) {
    bool first = true;
    for (const Action& a : rank) {
      const char* type = a.op == Op::B && split_backward ? "I" : kCsvTypes[static_cast<int>(a.op)];
      if (!comms && !is_compute(a.op)) continue;
      os << (first ? "" : ",") << a.stage << type << a.mb;
      first = false;
    }
    os << "\n";
  }
  return os.str();
}

}  // namespace pippy_xla
