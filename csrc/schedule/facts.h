// [Note: schedule facts] What the rest of the library needs to know about each generated
// schedule, written once, one named row per schedule: make_schedule checks its arguments against
// it, and Python reads it through _C.schedule_info (the config's checks and default chunks, the
// stage layout, the planner's equal ranges, whether stages compile without buffer donation).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace pippy_xla {

struct ScheduleInfo {
  std::string name;
  std::string description;
  bool trains = true;              // runs backward actions (false: evaluation)
  bool split_backward = false;     // B computes input gradients only, W the weights' gradients
  int32_t min_chunks = 1;          // stages per rank allowed: min_chunks..max_chunks
  int32_t max_chunks = 1;          // 0: no upper bound
  int32_t default_chunks = 1;      // stages per rank when the caller names none
  bool equal_stages = false;       // every stage must hold the same number of layers
  std::string placement = "loop";  // how stages sit on ranks: "loop" or "v" (see stage_rank)
  bool list_scheduled = false;  // the order is list-scheduled at per-stage costs (make_schedule's
                                // `costs`; see [Note: list scheduling at costs])
};

// Every generated schedule, "forward" (evaluation) last.
const std::vector<ScheduleInfo>& schedule_table();
// The facts of schedule `name`; throws (RuntimeError) naming the known schedules otherwise.
const ScheduleInfo& schedule_info(const std::string& name);

// Names: "1f1b", "gpipe", "interleaved" (interleaved 1F1B, `chunks` >= 2 stages per rank), "zbh1"
// (zero-bubble ZB-H1: split backward, weight steps fill the bubble), "looped_bfs",
// "interleaved_zb", "zbv" and "dualpipev" (2 stages per rank in a V), and "forward" (evaluation;
// any `chunks` and placement): the names of schedule_table(), whose descriptions say more.
std::vector<std::string> schedule_names();
// The schedules that train (every name but "forward").
std::vector<std::string> train_schedule_names();
// The list-scheduled schedules' names, quoted and separated by commas, for messages.
std::string list_scheduled_names();
// Stages per rank of schedule `name` when the caller names none (its ScheduleInfo's).
int32_t default_chunks(const std::string& name);

}  // namespace pippy_xla
