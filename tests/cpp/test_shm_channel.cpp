// The shared-memory channel of the same-host transport (transport/shm_channel.h), both ends in
// this process.
#include <ATen/ops/arange.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <string>

#include "transport/shm_channel.h"

namespace pippy_xla {
namespace {

// A receiving and a sending end of one channel, named for this process and test.
struct Pair {
  explicit Pair(const std::string& test) {
    const std::string name = "/pippy_xla_test." + std::to_string(getpid()) + "." + test;
    const int64_t pid = getpid();
    std::string error;
    receiver = Channel::create(name, name + ".data", pid, pid, 1, spin, &error);
    EXPECT_TRUE(receiver) << error;
    sender = Channel::open(name, name + ".data", pid, 0, spin, &error);
    EXPECT_TRUE(sender) << error;
  }
  std::shared_ptr<std::atomic<int64_t>> spin = std::make_shared<std::atomic<int64_t>>(0);
  std::shared_ptr<Channel> receiver, sender;
};

at::Tensor floats(int64_t n) { return at::empty({n}); }

TEST(ShmChannel, MessagesArriveByTagInOrderAndWhole) {
  Pair p("order");
  ASSERT_TRUE(p.receiver && p.sender);
  ASSERT_TRUE(p.sender->try_post(7, at::arange(3.0)));
  ASSERT_TRUE(p.sender->try_post(5, at::arange(10.0, 11.0)));
  ASSERT_TRUE(p.sender->try_post(7, at::arange(20.0, 23.0)));
  at::Tensor got = floats(3);
  ASSERT_TRUE(p.receiver->try_take(7, got));
  EXPECT_TRUE(got.equal(at::arange(3.0)));
  ASSERT_TRUE(p.receiver->try_take(7, got));  // the older of the two with tag 7 came first
  EXPECT_TRUE(got.equal(at::arange(20.0, 23.0)));
  at::Tensor one = floats(1);
  ASSERT_TRUE(p.receiver->try_take(5, one));
  EXPECT_EQ(one.item<float>(), 10.0f);
  EXPECT_FALSE(p.receiver->try_take(5, one));  // nothing left
}

TEST(ShmChannel, GrowsASlotForALargeMessage) {
  Pair p("large");
  ASSERT_TRUE(p.receiver && p.sender);
  const at::Tensor big = at::arange(1 << 20, at::kFloat);  // 4 MiB, past a slot's first segment
  ASSERT_TRUE(p.sender->try_post(1, big));
  at::Tensor got = floats(1 << 20);
  ASSERT_TRUE(p.receiver->try_take(1, got));
  EXPECT_TRUE(got.equal(big));
}

TEST(ShmChannel, RefusesAReceiveBufferOfAnotherSize) {
  Pair p("size");
  ASSERT_TRUE(p.receiver && p.sender);
  ASSERT_TRUE(p.sender->try_post(3, at::arange(3.0)));
  at::Tensor small = floats(2);
  EXPECT_THROW(p.receiver->try_take(3, small), c10::Error);
  at::Tensor right = floats(3);
  EXPECT_TRUE(p.receiver->try_take(3, right));  // the message stayed
}

TEST(ShmChannel, WaitsEndAtTheDeadlineOrWhenAborted) {
  Pair p("wait");
  ASSERT_TRUE(p.receiver && p.sender);
  at::Tensor buffer = floats(1);
  const auto take = [&] { return p.receiver->try_take(9, buffer); };
  std::atomic<bool> aborted{false};
  EXPECT_FALSE(p.receiver->wait_for(take, std::chrono::milliseconds(50), aborted));
  aborted = true;
  EXPECT_FALSE(p.receiver->wait_for(take, std::chrono::milliseconds(60000), aborted));
  aborted = false;
  ASSERT_TRUE(p.sender->try_post(9, at::arange(1.0)));
  EXPECT_TRUE(p.receiver->wait_for(take, std::chrono::milliseconds(1000), aborted));
}

}  // namespace
}  // namespace pippy_xla
