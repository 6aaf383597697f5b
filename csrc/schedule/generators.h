// The generated schedules: orders of compute actions for each schedule of the facts table
// (facts.h), with their transfers added (with_transfers in schedule.h) and validated by the
// tests against stored tables.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "schedule/schedule.h"
#include "schedule/simulator.h"

namespace pippy_xla {

// `chunks` 0: the schedule's default (ScheduleInfo::default_chunks). `placement` empty: the
// schedule's own (ScheduleInfo::placement); "forward" takes either, so that
// evaluation runs on the stages where training put them. `costs` (F, B, W per stage; empty:
// unit costs) orders a list-scheduled schedule (ScheduleInfo::list_scheduled): the order list-
// scheduled at those costs if the simulator puts it ahead of the published one at them, else the
// published one. The other schedules, whose order does not depend on costs, refuse costs.
Schedule make_schedule(const std::string& name, int32_t num_ranks, int32_t num_microbatches,
                       int32_t chunks = 0, const std::string& placement = "",
                       const Costs& costs = {});

// Evaluation on any stage placement: every rank runs its stages' forwards, stages ascending, each
// for every microbatch (what make_schedule("forward") generates for its placements).
Schedule forward_schedule(std::vector<int32_t> stage_rank, int32_t num_ranks,
                          int32_t num_microbatches);

// Pipelined decoding of `tokens` tokens for `groups` groups of rows on any stage placement (see
// [Note: decode schedules] in schedule.h): microbatch t * groups + g is group g's token t, and the
// last stage's forward of it feeds stage 0's forward of the group's token t + 1 (its sampled
// token ids). Every rank runs its forwards in wavefront order, by (t * stages + stage, g): a
// rank holding stage s runs group g's token t while the rank of stage s - 1 runs group g + 1's,
// so with groups >= stages every stage has a group to work on at every step.
Schedule decode_schedule(std::vector<int32_t> stage_rank, int32_t num_ranks, int32_t groups,
                         int32_t tokens);

}  // namespace pippy_xla
