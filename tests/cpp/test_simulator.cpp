// The simulator against makespans computed by hand, its deadlock detection and its memory model.
#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include "schedule/generators.h"
#include "schedule/simulator.h"

namespace pippy_xla {
namespace {

double makespan(const std::string& name, int32_t ranks, int32_t mbs, const Costs& costs = {}) {
  return simulate(make_schedule(name, ranks, mbs), costs).makespan;
}

TEST(Simulator, OneFOneBAndGPipeAtUnitCosts) {
  // Every rank computes 2m units and waits (p - 1) units on each side: 2 (m + p - 1).
  EXPECT_DOUBLE_EQ(makespan("1f1b", 2, 2), 6.0);
  EXPECT_DOUBLE_EQ(makespan("gpipe", 2, 2), 6.0);
  EXPECT_DOUBLE_EQ(makespan("1f1b", 4, 8), 22.0);
}

TEST(Simulator, ZeroBubbleH1Bubble) {
  // F = B = W = 1: 3m of compute plus a bubble of (p - 1)(F + B - W) = p - 1.
  EXPECT_DOUBLE_EQ(makespan("zbh1", 2, 4), 13.0);
  EXPECT_DOUBLE_EQ(makespan("zbh1", 4, 8), 27.0);
}

TEST(Simulator, TransferLatency) {
  // One microbatch over 2 ranks: F0 [0, 1], F1 [1.5, 2.5], B1 [2.5, 3.5], B0 [4, 5].
  Costs costs;
  costs.comm = 0.5;
  EXPECT_DOUBLE_EQ(makespan("1f1b", 2, 1, costs), 5.0);
}

TEST(Simulator, PerStageCosts) {
  // F0 [0, 1], F1 [1, 3], B1 [3, 7], B0 [7, 9].
  const SimResult r = simulate(make_schedule("1f1b", 2, 1), Costs{{1, 2}, {2, 4}});
  EXPECT_DOUBLE_EQ(r.makespan, 9.0);
  EXPECT_DOUBLE_EQ(r.bubble, 1.0 - 9.0 / (2 * 9.0));  // busy: 3 and 6 of 2 x 9
  ASSERT_EQ(r.timeline.size(), 8u);                   // with the transfers (cost 0)
  EXPECT_EQ(to_string(r.timeline.back().action), "B0.0");
  EXPECT_DOUBLE_EQ(r.timeline.back().start, 7.0);
}

TEST(Simulator, DetectsDeadlock) {
  // Rank 0 waits for the gradient before it sends the activation that produces it.
  const Schedule s = Schedule::from_parts("stuck", 2, 1, {0, 1},
                                          {{Action{Op::F, 0, 0}, Action{Op::RECV_B, 0, 0},
                                            Action{Op::B, 0, 0}, Action{Op::SEND_F, 0, 0}},
                                           {Action{Op::RECV_F, 1, 0}, Action{Op::F, 1, 0},
                                            Action{Op::B, 1, 0}, Action{Op::SEND_B, 1, 0}}});
  try {
    validate(s);
    FAIL() << "validate accepted a deadlocking schedule";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what_without_backtrace()).find("deadlocks"), std::string::npos);
  }
}

TEST(Simulator, DetectsMissingAction) {
  const Schedule s =
      Schedule::from_parts("short", 1, 2, {0}, {{Action{Op::F, 0, 0}, Action{Op::B, 0, 0}}});
  EXPECT_THROW(validate(s), c10::Error);
}

TEST(Simulator, LiveStatesOfOneFOneB) {
  // 1F1B on stage s holds min(stages - s, microbatches) microbatches at its peak.
  const SimResult r = simulate(make_schedule("1f1b", 4, 8), {});
  EXPECT_EQ(r.peak_inflight, (std::vector<int32_t>{4, 3, 2, 1}));
  ASSERT_EQ(r.live_states[0].size(), 1u);  // one stage on rank 0, one state covering the rest
  EXPECT_EQ(r.live_states[0][0], (std::vector<std::vector<int32_t>>{{4, 0, 0}}));
}

TEST(Simulator, LiveStatesOfASplitBackward) {
  // ZB-H1's last rank: F, then B (keeps its microbatch for W, with B's gradients while it runs),
  // then W: states (1, 0, 0) for F, (1, 0, 1) and (0, 1, 0) for B, covered ones dropped.
  const SimResult r = simulate(make_schedule("zbh1", 2, 1), {});
  EXPECT_EQ(r.live_states[1][0], (std::vector<std::vector<int32_t>>{{1, 0, 1}, {0, 1, 0}}));
}

}  // namespace
}  // namespace pippy_xla
