// The activation stash ([Note: zero-copy stash] in runtime/stash.h).
#include <ATen/ops/ones.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include "runtime/stash.h"

namespace pippy_xla {
namespace {

StashSlot slot_of(int64_t in_floats, int64_t out_floats) {
  return StashSlot{{at::zeros({in_floats})}, {at::ones({out_floats})}};
}

TEST(Stash, KeepsTheVeryTensors) {
  Stash stash;
  StashSlot slot = slot_of(4, 8);
  const void* in = slot.inputs[0].data_ptr();
  const void* out = slot.outputs[0].data_ptr();
  stash.push(0, 1, slot);
  EXPECT_TRUE(stash.contains(0, 1));
  EXPECT_EQ(stash.peek(0, 1).inputs[0].data_ptr(), in);
  const StashSlot back = stash.pop(0, 1);
  EXPECT_EQ(back.inputs[0].data_ptr(), in);
  EXPECT_EQ(back.outputs[0].data_ptr(), out);
  EXPECT_FALSE(stash.contains(0, 1));
  EXPECT_EQ(stash.size(), 0u);
}

TEST(Stash, CountsLiveAndPeakBytes) {
  Stash stash;
  stash.push(0, 0, slot_of(4, 8));  // 48 bytes
  stash.push(0, 1, slot_of(2, 2));  // 16 bytes
  EXPECT_EQ(stash.live_bytes(), 64);
  stash.pop(0, 0);
  EXPECT_EQ(stash.live_bytes(), 16);
  EXPECT_EQ(stash.peak_bytes(), 64);
  stash.reset_peak();
  EXPECT_EQ(stash.peak_bytes(), 16);
}

TEST(Stash, RefusesMisuse) {
  Stash stash;
  stash.push(1, 0, slot_of(1, 1));
  EXPECT_THROW(stash.push(1, 0, slot_of(1, 1)), c10::Error);  // slot taken
  EXPECT_THROW(stash.pop(1, 1), c10::Error);                  // nothing stashed
  EXPECT_THROW(stash.check_empty(), c10::Error);              // a slot left at the step's end
  stash.clear();
  EXPECT_NO_THROW(stash.check_empty());
}

}  // namespace
}  // namespace pippy_xla
