// The facts table: see [Note: schedule facts] in facts.h.
#include "schedule/facts.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <sstream>

namespace pippy_xla {

namespace {

ScheduleInfo row(const char* name, const char* description) {
  ScheduleInfo info;
  info.name = name;
  info.description = description;
  return info;
}

// Two or more equal stages per rank, two by default, placed in a loop.
ScheduleInfo looped_chunks(ScheduleInfo info) {
  info.min_chunks = 2;
  info.max_chunks = 0;
  info.default_chunks = 2;
  info.equal_stages = true;
  return info;
}

// Exactly two equal stages per rank, placed in a V.
ScheduleInfo v_shape(ScheduleInfo info) {
  info.min_chunks = info.max_chunks = info.default_chunks = 2;
  info.equal_stages = true;
  info.placement = "v";
  return info;
}

ScheduleInfo split_backward(ScheduleInfo info) {
  info.split_backward = true;
  return info;
}

ScheduleInfo list_scheduled(ScheduleInfo info) {
  info.list_scheduled = true;
  return info;
}

ScheduleInfo evaluation(ScheduleInfo info) {
  info.trains = false;
  info.max_chunks = 0;
  return info;
}

std::vector<ScheduleInfo> make_table() {
  return {
      row("1f1b", "one forward, one backward: at most ranks - rank microbatches in flight"),
      row("gpipe", "every forward, then every backward"),
      looped_chunks(
          row("interleaved", "interleaved 1F1B (Megatron): chunks >= 2 equal stages per rank")),
      list_scheduled(split_backward(
          row("zbh1", "zero bubble ZB-H1: split backward, weight steps fill the bubble"))),
      looped_chunks(row("looped_bfs",
                        "breadth-first: each chunk's forwards in turn, then backwards in reverse")),
      list_scheduled(split_backward(looped_chunks(
          row("interleaved_zb",
              "interleaved 1F1B with a split backward (weight steps fill the bubble)")))),
      list_scheduled(split_backward(v_shape(row(
          "zbv", "zero bubble ZB-V: 2 stages per rank in a V, split backward, 1F1B's memory")))),
      split_backward(v_shape(row(
          "dualpipev", "DualPipeV: 2 stages per rank in a V, split backward, >= 2 x ranks mbs"))),
      evaluation(row("forward", "evaluation: forwards only, any chunks and placement")),
  };
}

}  // namespace

const std::vector<ScheduleInfo>& schedule_table() {
  static const std::vector<ScheduleInfo> table = make_table();
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

std::string list_scheduled_names() {
  std::ostringstream os;
  for (const auto& info : schedule_table())
    if (info.list_scheduled) os << (os.tellp() > 0 ? ", '" : "'") << info.name << "'";
  return os.str();
}

int32_t default_chunks(const std::string& name) { return schedule_info(name).default_chunks; }

}  // namespace pippy_xla
