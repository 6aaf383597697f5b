// The planner's exact solver against plans found by hand ([Note: planner cost model] in
// plan/planner.h).
#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <optional>

#include "plan/planner.h"
#include "schedule/generators.h"

namespace pippy_xla {
namespace {

LayerCost layer(double fwd, double bwd, int64_t saved = 0, int64_t saved_ckpt = 0) {
  return make_layer_cost(fwd, bwd, std::nullopt, saved, saved_ckpt, /*static_bytes=*/0,
                         /*transient_bytes=*/0, /*weight=*/0, std::nullopt, /*weight_bytes=*/0,
                         std::nullopt, /*recorded_bytes=*/0, /*split_transient_bytes=*/0);
}

PlanProblem two_stage_problem(std::vector<LayerCost> layers) {
  PlanProblem p;
  p.layers = std::move(layers);
  p.extras.assign(2, StageExtra{});
  p.live_states = simulate(make_schedule("1f1b", 2, 2), {}).live_states;
  p.memory_limit = {int64_t{1} << 40, int64_t{1} << 40};
  return p;
}

using Ranges = std::vector<std::pair<int32_t, int32_t>>;

Ranges ranges_of(const PlanResult& r) {
  Ranges out;
  for (const StageEval& s : r.stages) out.emplace_back(s.start, s.stop);
  return out;
}

TEST(Planner, EqualLayersSplitEvenly) {
  const PlanResult r = solve_plan(two_stage_problem(std::vector<LayerCost>(4, layer(1, 2))));
  ASSERT_TRUE(r.feasible);
  EXPECT_EQ(ranges_of(r), (Ranges{{0, 2}, {2, 4}}));
  EXPECT_DOUBLE_EQ(r.bottleneck, 6.0);  // two layers of 1 + 2
}

TEST(Planner, HeavyFirstLayerStandsAlone) {
  const PlanResult r =
      solve_plan(two_stage_problem({layer(3, 0), layer(1, 0), layer(1, 0), layer(1, 0)}));
  ASSERT_TRUE(r.feasible);
  EXPECT_EQ(ranges_of(r), (Ranges{{0, 1}, {1, 4}}));
  EXPECT_DOUBLE_EQ(r.bottleneck, 3.0);
}

// One stage of two layers that save 100 bytes per microbatch, or 10 checkpointed (whose
// recomputation needs the other 90 as working set), with one microbatch in flight.
PlanProblem one_stage_under(int64_t limit) {
  PlanProblem p;
  p.layers = {layer(1, 1, 100, 10), layer(1, 1, 100, 10)};
  p.extras = {StageExtra{}};
  p.live_states = {{{{1, 0, 0}}}};
  p.memory_limit = {limit};
  return p;
}

TEST(Planner, CheckpointsOnlyUnderMemoryPressure) {
  const PlanResult roomy = solve_plan(one_stage_under(200));
  ASSERT_TRUE(roomy.feasible);
  EXPECT_TRUE(roomy.stages[0].checkpoint.empty());
  EXPECT_DOUBLE_EQ(roomy.bottleneck, 4.0);
  EXPECT_EQ(roomy.stages[0].memory, 200);

  // One checkpointed layer still peaks at 110 + 90; both: 20 saved + 90 working set, and each
  // recomputes its forward (1) in backward.
  const PlanResult tight = solve_plan(one_stage_under(150));
  ASSERT_TRUE(tight.feasible);
  EXPECT_EQ(tight.stages[0].checkpoint, (std::vector<int32_t>{0, 1}));
  EXPECT_DOUBLE_EQ(tight.bottleneck, 6.0);
  EXPECT_EQ(tight.stages[0].memory, 110);
}

TEST(Planner, ReportsTheSmallestLimitThatFits) {
  const PlanResult r = solve_plan(one_stage_under(100));
  EXPECT_FALSE(r.feasible);
  EXPECT_TRUE(r.stages.empty());
  EXPECT_EQ(r.min_memory_limit, (std::vector<int64_t>{110}));
}

TEST(Planner, RefusesMoreStagesThanLayers) {
  EXPECT_THROW(solve_plan(two_stage_problem({layer(1, 1)})), c10::Error);
}

}  // namespace
}  // namespace pippy_xla
