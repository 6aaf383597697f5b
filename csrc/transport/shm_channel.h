// One channel of the same-host transport ([Note: same-host transport] in shm.h): one direction
// of one pair of processes, kShmSlots message slots in a shared-memory segment that the receiver
// creates and the sender maps, and a data segment per slot that the sender creates (and grows).
#pragma once

#include <ATen/core/Tensor.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace pippy_xla {

constexpr uint32_t kShmSlots = 1024;
constexpr int64_t kShmWakeMs = 100;

// Whether process `pid` still runs: its /proc entry exists and it is not a zombie (a peer that
// exited stays a zombie until its parent reaps it, and kill(pid, 0) still succeeds then). True
// for a pid <= 0 (not visible from here: no check).
bool process_alive(int64_t pid);

struct ChannelHeader;  // the shared part of a channel (shm_channel.cpp)

class Channel {
 public:
  // How long a wait polls before it sleeps, shared by a group's channels ([Note: spinning before
  // sleeping] in shm.cpp).
  using SpinUs = std::shared_ptr<const std::atomic<int64_t>>;

  // Receiver: creates the channel `name` for the messages of `peer` (process `sender_pid`) to
  // this process (`receiver_pid`); the sender names the slots' data segments from `data_prefix`.
  // Null, with `*error` set, where shared memory cannot hold it.
  static std::shared_ptr<Channel> create(const std::string& name, std::string data_prefix,
                                         int64_t sender_pid, int64_t receiver_pid, int64_t peer,
                                         SpinUs spin_us, std::string* error);
  // Sender: maps the channel `name` that `peer` (process `receiver_pid`) created and unlinks the
  // name. Null, with `*error` set, where it cannot (or the channel has another layout).
  static std::shared_ptr<Channel> open(const std::string& name, std::string data_prefix,
                                       int64_t receiver_pid, int64_t peer, SpinUs spin_us,
                                       std::string* error);
  ~Channel();
  Channel(const Channel&) = delete;
  Channel& operator=(const Channel&) = delete;

  // Sender: copies `t` into a free slot; false if every slot is full.
  bool try_post(int64_t tag, const at::Tensor& t);
  // Receiver: copies the oldest message with `tag` into `buffer`; false if none is there.
  // Throws c10::Error if its size differs from `buffer`'s.
  bool try_take(int64_t tag, const at::Tensor& buffer);
  // Calls `attempt` until it returns true, sleeping on the channel between tries. False when the
  // deadline passes or `aborted` is set; throws if the peer's process is gone.
  bool wait_for(const std::function<bool()>& attempt, std::chrono::milliseconds timeout,
                const std::atomic<bool>& aborted);
  // Wakes every thread asleep on this channel (either process), e.g. for Work::abort.
  void wake();

 private:
  // This process's mapping of one slot's data segment.
  struct Segment {
    void* addr = nullptr;
    size_t bytes = 0;
    uint32_t gen = 0;
  };

  Channel(ChannelHeader* header, std::string data_prefix, bool sender, int64_t peer_pid,
          int64_t peer, SpinUs spin_us);
  std::string data_name(uint32_t slot, uint32_t gen) const;
  void notify();

  ChannelHeader* h_;
  std::string data_prefix_;
  bool sender_;
  int64_t peer_pid_;  // for liveness checks; 0: none
  int64_t peer_;
  SpinUs spin_us_;
  std::vector<Segment> segments_;
};

}  // namespace pippy_xla
