// The CSV form of schedules (see [Note: CSV schedules] in schedule/schedule.h).
#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include "schedule/facts.h"
#include "schedule/generators.h"

namespace pippy_xla {
namespace {

TEST(Csv, RoundTripOfEveryGeneratedSchedule) {
  for (const std::string& name : schedule_names()) {
    const Schedule s = make_schedule(name, 2, 4);
    const Schedule back = Schedule::from_csv(s.to_csv(), name);
    EXPECT_EQ(back.stage_rank, s.stage_rank) << name;
    EXPECT_EQ(back.split_backward, s.split_backward) << name;
    EXPECT_EQ(back.backward, s.backward) << name;
    EXPECT_EQ(back.actions, s.actions) << name;  // the transfers are added by the same rules
  }
}

TEST(Csv, WithTransfersWritesThemAndReadsThemBack) {
  const Schedule s = make_schedule("1f1b", 2, 2);
  const std::string text = s.to_csv(/*comms=*/true);
  EXPECT_EQ(text,
            "0F0,0SEND_F0,0RECV_B0,0F1,0SEND_F1,0RECV_B1,0B0,0B1\n"
            "1RECV_F0,1F0,1RECV_F1,1B0,1SEND_B0,1F1,1B1,1SEND_B1\n");
  EXPECT_EQ(Schedule::from_csv(text).actions, s.actions);
}

TEST(Csv, FullBackwardOfASplitScheduleBecomesBAndW) {
  const Schedule s = Schedule::from_csv("0F0,0B0\n1F0,1I0,1W0\n");
  EXPECT_TRUE(s.split_backward);
  EXPECT_EQ(s.to_csv(), "0F0,0I0,0W0\n1F0,1I0,1W0\n");
}

TEST(Csv, SkipsIdleCellsOverlapAndFsdpActions) {
  const Schedule s = Schedule::from_csv(
      "0UNSHARD0,0F0,,0F1,0B0,0B1,0REDUCE_GRAD0\n,1F0,(1F1;1B0)OVERLAP_F_B,1B1\n");
  EXPECT_EQ(s.to_csv(), "0F0,0F1,0B0,0B1\n1F0,1F1,1B0,1B1\n");
}

TEST(Csv, RefusesMalformedSchedules) {
  EXPECT_THROW(Schedule::from_csv(""), c10::Error);                    // no rows
  EXPECT_THROW(Schedule::from_csv("0F0,0X0\n"), c10::Error);           // unknown type
  EXPECT_THROW(Schedule::from_csv("0B0,0F0\n"), c10::Error);           // B before its F
  EXPECT_THROW(Schedule::from_csv("0F0,0B0\n0F1,0B1\n"), c10::Error);  // a stage on two ranks
}

}  // namespace
}  // namespace pippy_xla
