// Facts of a schedule that the engine runs by, computed once per schedule next to the validator
// and simulator (schedule/simulator.h), so that the engine's loop (engine.cpp) only runs actions:
// which receives it posts ahead of a blocked wait, which sends are known complete, and each stage's
// last gradient action; and the receive-buffer replay that the planner counts buffers with.
#pragma once

#include <cstdint>
#include <map>
#include <vector>

#include "schedule/schedule.h"

namespace pippy_xla {

// Receive actions a rank posts ahead of the one it waits on (see [Note: receives posted ahead] in
// engine.cpp); their buffers are allocated then, which the planner's memory model counts.
constexpr int kRecvLookahead = 4;

// Positions of the receive actions that the engine posts ahead when action `pos` of `actions`
// waits on its own receives: the next kRecvLookahead receive actions after it.
std::vector<size_t> receives_ahead(const std::vector<Action>& actions, size_t pos);

// Per rank, the most receive buffers alive at once during a step: receives posted (in action
// order, or ahead by receives_ahead while an F or B waits) and not yet consumed by their F or
// B, counting the one being consumed. A replay of Engine::run's posting rule, for the planner.
std::vector<int64_t> peak_receive_buffers(const Schedule& schedule);

// For each action position of `rank`, the positions of its send actions that are known complete
// once the F or B at that position has its receives in. See [Note: send release].
std::vector<std::vector<size_t>> send_releases(const Schedule& schedule, int32_t rank);

// Per action position of `rank` that is a stage's last gradient action of the step (its last B,
// or its last W when backward is split): that stage. See [Note: gradients ready].
std::map<size_t, int64_t> last_gradient_actions(const Schedule& schedule, int64_t rank);

}  // namespace pippy_xla
