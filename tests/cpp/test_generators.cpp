// The generated schedules against stored tables: each rank's compute actions in
// torch.distributed.pipelining's CSV form ("<stage><type><microbatch>", I for a split B).
#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <string>

#include "schedule/facts.h"
#include "schedule/generators.h"
#include "schedule/simulator.h"

namespace pippy_xla {
namespace {

std::string compute_table(const std::string& name, int32_t ranks, int32_t mbs, int32_t chunks) {
  const Schedule s = make_schedule(name, ranks, mbs, chunks);
  validate(s);
  return s.to_csv();
}

TEST(Schedule, OneFOneBWarmup) {
  // Rank r runs ranks - 1 - r forwards before its first backward, then alternates.
  EXPECT_EQ(compute_table("1f1b", 4, 6, 0),
            "0F0,0F1,0F2,0F3,0B0,0F4,0B1,0F5,0B2,0B3,0B4,0B5\n"
            "1F0,1F1,1F2,1B0,1F3,1B1,1F4,1B2,1F5,1B3,1B4,1B5\n"
            "2F0,2F1,2B0,2F2,2B1,2F3,2B2,2F4,2B3,2F5,2B4,2B5\n"
            "3F0,3B0,3F1,3B1,3F2,3B2,3F3,3B3,3F4,3B4,3F5,3B5\n");
}

TEST(Schedule, OneFOneBTransfers) {
  // Receives one compute action ahead, a gradient receive never before its forward, sends right
  // after the compute that produced their data.
  EXPECT_EQ(make_schedule("1f1b", 2, 3).table(),
            "rank 0: F0.0 SF0.0 RB0.0 F0.1 SF0.1 B0.0 RB0.1 F0.2 SF0.2 RB0.2 B0.1 B0.2\n"
            "rank 1: RF1.0 F1.0 RF1.1 B1.0 SB1.0 F1.1 RF1.2 B1.1 SB1.1 F1.2 B1.2 SB1.2\n");
}

TEST(Schedule, GPipe) {
  EXPECT_EQ(compute_table("gpipe", 2, 3, 0),
            "0F0,0F1,0F2,0B0,0B1,0B2\n"
            "1F0,1F1,1F2,1B0,1B1,1B2\n");
}

TEST(Schedule, InterleavedWarmup) {
  // Rank r warms up with (ranks - r - 1) * 2 + (chunks - 1) * ranks forwards.
  EXPECT_EQ(compute_table("interleaved", 2, 4, 2),
            "0F0,0F1,2F0,2F1,0F2,2B0,0F3,2B1,2F2,0B0,2F3,0B1,2B2,2B3,0B2,0B3\n"
            "1F0,1F1,3F0,3B0,3F1,3B1,1F2,1B0,1F3,1B1,3F2,3B2,3F3,3B3,1B2,1B3\n");
}

TEST(Schedule, LoopedBreadthFirst) {
  EXPECT_EQ(compute_table("looped_bfs", 2, 4, 2),
            "0F0,0F1,0F2,0F3,2F0,2F1,2F2,2F3,2B0,2B1,2B2,2B3,0B0,0B1,0B2,0B3\n"
            "1F0,1F1,1F2,1F3,3F0,3F1,3F2,3F3,3B0,3B1,3B2,3B3,1B0,1B1,1B2,1B3\n");
}

TEST(Schedule, ZeroBubbleH1) {
  EXPECT_EQ(compute_table("zbh1", 3, 6, 0),
            "0F0,0F1,0F2,0I0,0F3,0I1,0W0,0I2,0F4,0I3,0W1,0F5,0W2,0I4,0W3,0W4,0I5,0W5\n"
            "1F0,1F1,1I0,1F2,1I1,1F3,1I2,1W0,1I3,1F4,1W1,1W2,1I4,1F5,1W3,1W4,1I5,1W5\n"
            "2F0,2I0,2F1,2I1,2F2,2I2,2F3,2I3,2W0,2W1,2F4,2I4,2W2,2W3,2F5,2I5,2W4,2W5\n");
}

TEST(Schedule, InterleavedZeroBubble) {
  EXPECT_EQ(compute_table("interleaved_zb", 2, 4, 2),
            "0F0,0F1,2F0,2F1,0F2,2I0,2W0,0I0,0F3,2I1,0W0,0I1,2F2,2W1,2F3,0W1,2I2,2W2,0I2,0W2,"
            "2I3,2W3,0I3,0W3\n"
            "1F0,1F1,3F0,3I0,3W0,1I0,3F1,3I1,1W0,1I1,1F2,3W1,1F3,1W1,3F2,3I2,3W2,1I2,3F3,3I3,"
            "1W2,1I3,3W3,1W3\n");
}

TEST(Schedule, ZeroBubbleV) {
  EXPECT_EQ(compute_table("zbv", 2, 4, 0),
            "0F0,0F1,0F2,3F0,3I0,3W0,3F1,0I0,3I1,0W0,0F3,0I1,3W1,3F2,3I2,0W1,3W2,0I2,0W2,3F3,"
            "3I3,3W3,0I3,0W3\n"
            "1F0,2F0,1F1,2F1,2I0,1I0,2W0,1F2,2I1,1I1,1W0,2F2,2W1,1F3,2I2,1I2,1W1,2F3,2W2,1W2,"
            "2I3,1I3,2W3,1W3\n");
}

TEST(Schedule, DualPipeV) {
  EXPECT_EQ(compute_table("dualpipev", 2, 4, 0),
            "0F0,0F1,0F2,3F0,3I0,3W0,3F1,0F3,3I1,3W1,3F2,0I0,0W0,3I2,3W2,3F3,0I1,0W1,3I3,3W3,"
            "0I2,0W2,0I3,0W3\n"
            "1F0,2F0,1F1,2F1,1F2,2I0,2W0,2F2,1I0,1W0,1F3,2I1,2W1,2F3,1I1,1W1,2I2,2W2,1I2,1W2,"
            "2I3,1I3,2W3,1W3\n");
}

TEST(Schedule, ForwardOnly) {
  EXPECT_EQ(compute_table("forward", 2, 2, 2), "0F0,0F1,2F0,2F1\n1F0,1F1,3F0,3F1\n");
}

TEST(Schedule, DecodeRing) {
  // [Note: decode schedules]: the last stage's F of group g's token t feeds stage 0's F of
  // microbatch (t + 1) * groups + g; the wavefront order puts both groups' token on each stage.
  const Schedule s = decode_schedule({0, 1}, 2, 2, 2);
  EXPECT_EQ(s.decode_groups, 2);
  EXPECT_EQ(s.table(),
            "rank 0: F0.0 SF0.0 RF0.2 F0.1 SF0.1 RF0.3 F0.2 SF0.2 F0.3 SF0.3\n"
            "rank 1: RF1.0 RF1.1 F1.0 SF1.0 RF1.2 F1.1 SF1.1 RF1.3 F1.2 F1.3\n");
  Action next;
  EXPECT_TRUE(s.next_forward(1, 1, &next));
  EXPECT_EQ(next, (Action{Op::F, 0, 3}));
  EXPECT_FALSE(s.next_forward(1, 2));
  EXPECT_FALSE(s.prev_forward(0, 1));
  // As many groups as stages: no rank waits once the first group reached it.
  EXPECT_EQ(simulate(decode_schedule({0, 1, 2}, 3, 3, 4), Costs{}).makespan, 3 * 4 + 2);
  EXPECT_THROW(decode_schedule({0, 1}, 2, 0, 2), c10::Error);
}

TEST(Schedule, EveryTrainingScheduleValidates) {
  for (const std::string& name : train_schedule_names()) {
    const ScheduleInfo& info = schedule_info(name);
    const Schedule s = make_schedule(name, 4, 8);
    EXPECT_EQ(s.num_stages, 4 * info.default_chunks) << name;
    EXPECT_EQ(s.split_backward, info.split_backward) << name;
    EXPECT_NO_THROW(validate(s)) << name;
  }
}

TEST(Schedule, RefusesWhatItsFactsRule) {
  EXPECT_THROW(make_schedule("1f1b", 2, 4, 2), c10::Error);         // one stage per rank
  EXPECT_THROW(make_schedule("interleaved", 2, 3, 2), c10::Error);  // microbatches % ranks
  EXPECT_THROW(make_schedule("dualpipev", 2, 3), c10::Error);       // fewer than 2 x ranks
  EXPECT_THROW(make_schedule("gpipe", 2, 4, 0, "", Costs{{1, 1}}), c10::Error);  // fixed order
  EXPECT_THROW(make_schedule("nope", 2, 4), c10::Error);
}

TEST(Schedule, ListScheduledAtCostsNeverLosesToThePublishedOrder) {
  const Costs costs{{1, 1}, {0.2, 2}, {1.5, 0.5}};
  const Schedule tuned = make_schedule("zbh1", 2, 8, 0, "", costs);
  const Schedule published = make_schedule("zbh1", 2, 8);
  EXPECT_LE(simulate(tuned, costs).makespan, simulate(published, costs).makespan);
}

}  // namespace
}  // namespace pippy_xla
