// See shm_channel.h.
#include "transport/shm_channel.h"

#include <c10/util/Exception.h>
#include <fcntl.h>
#include <linux/futex.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>
#include <ctime>
#include <fstream>
#include <new>

namespace pippy_xla {

namespace {

constexpr uint64_t kMagic = 0x31766e6863787870ULL;  // "ppxchnv1"
enum SlotState : uint32_t { kFree = 0, kWriting = 1, kFull = 2, kReading = 3 };

}  // namespace

// One message slot. `tag`, `nbytes`, `order` and `gen` are written by the sender while it holds
// the slot (kWriting) and read by the receiver while it holds it (kReading); `state` hands the
// slot over (release / acquire).
struct alignas(64) ChannelSlot {
  std::atomic<uint32_t> state;
  uint32_t gen;  // generation of the slot's data segment (a new segment when one must grow)
  int64_t tag;
  uint64_t nbytes;
  uint64_t order;  // the sender's post count: equal tags are received oldest first
};

// The shared part of a channel (one direction of one pair). Atomics of 32 and 64 bits are
// lock-free and address-free, so they work across processes.
struct ChannelHeader {
  uint64_t magic;
  int64_t sender_pid;
  int64_t receiver_pid;
  alignas(64) std::atomic<uint32_t> seq;      // futex word: bumped by every post and every free
  alignas(64) std::atomic<uint32_t> waiters;  // threads of either side asleep on `seq`
  alignas(64) std::atomic<uint64_t> posts;
  std::atomic<uint32_t> used;  // 1 + the highest slot ever claimed: receives scan no further
  ChannelSlot slots[kShmSlots];
};

namespace {

std::string errno_text() { return std::strerror(errno); }

void* map_shared(int fd, size_t bytes) {
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  return p == MAP_FAILED ? nullptr : p;
}

// Creates and maps a new shared-memory object of `bytes`. posix_fallocate reserves the pages
// now, so a full /dev/shm fails here with ENOSPC instead of killing the process with SIGBUS on
// first touch.
void* create_segment(const std::string& name, size_t bytes, std::string* error) {
  const int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0) {
    *error = c10::str("shm_open(", name, "): ", errno_text());
    return nullptr;
  }
  void* p = nullptr;
  const int rc = posix_fallocate(fd, 0, static_cast<off_t>(bytes));
  if (rc != 0) {
    *error = c10::str("reserving ", bytes, " bytes of shared memory (", name,
                      "): ", std::strerror(rc), "; /dev/shm may be too small");
  } else if (!(p = map_shared(fd, bytes))) {
    *error = c10::str("mmap(", name, "): ", errno_text());
  }
  close(fd);
  if (!p) shm_unlink(name.c_str());
  return p;
}

// Maps an existing object and unlinks its name (both sides have it mapped from here on).
void* open_segment(const std::string& name, size_t* bytes, std::string* error) {
  const int fd = shm_open(name.c_str(), O_RDWR, 0600);
  if (fd < 0) {
    *error = c10::str("shm_open(", name, "): ", errno_text());
    return nullptr;
  }
  struct stat st{};
  void* p = nullptr;
  if (fstat(fd, &st) != 0) {
    *error = c10::str("fstat(", name, "): ", errno_text());
  } else if (!(p = map_shared(fd, static_cast<size_t>(st.st_size)))) {
    *error = c10::str("mmap(", name, "): ", errno_text());
  }
  close(fd);
  shm_unlink(name.c_str());
  *bytes = static_cast<size_t>(st.st_size);
  return p;
}

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

void futex_wait(std::atomic<uint32_t>* word, uint32_t expected, int64_t ms) {
  struct timespec ts{static_cast<time_t>(ms / 1000), static_cast<long>((ms % 1000) * 1000000)};
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, expected, &ts, nullptr, 0);
}

void futex_wake_all(std::atomic<uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

size_t round_up(size_t n) { return std::max<size_t>((n + 4095) & ~size_t{4095}, 4096); }

}  // namespace

bool process_alive(int64_t pid) {
  if (pid <= 0) return true;  // not visible from here: no check
  std::ifstream stat(c10::str("/proc/", pid, "/stat"));
  std::string text;
  if (!std::getline(stat, text)) return false;
  const auto close = text.rfind(')');  // the command name may hold spaces and parentheses
  return close == std::string::npos || close + 2 >= text.size() ||
         (text[close + 2] != 'Z' && text[close + 2] != 'X');
}

std::shared_ptr<Channel> Channel::create(const std::string& name, std::string data_prefix,
                                         int64_t sender_pid, int64_t receiver_pid, int64_t peer,
                                         SpinUs spin_us, std::string* error) {
  void* mem = create_segment(name, sizeof(ChannelHeader), error);
  if (!mem) return nullptr;
  auto* h = new (mem) ChannelHeader();
  h->magic = kMagic;
  h->sender_pid = sender_pid;
  h->receiver_pid = receiver_pid;
  const int64_t live = process_alive(sender_pid) ? sender_pid : 0;
  return std::shared_ptr<Channel>(
      new Channel(h, std::move(data_prefix), false, live, peer, std::move(spin_us)));
}

std::shared_ptr<Channel> Channel::open(const std::string& name, std::string data_prefix,
                                       int64_t receiver_pid, int64_t peer, SpinUs spin_us,
                                       std::string* error) {
  size_t bytes = 0;
  void* mem = open_segment(name, &bytes, error);
  if (!mem) return nullptr;
  auto* h = static_cast<ChannelHeader*>(mem);
  if (bytes != sizeof(ChannelHeader) || h->magic != kMagic) {
    *error = "a peer's channel has another layout (another pippy_xla build?)";
    munmap(mem, bytes);
    return nullptr;
  }
  const int64_t live = process_alive(receiver_pid) ? receiver_pid : 0;
  return std::shared_ptr<Channel>(
      new Channel(h, std::move(data_prefix), true, live, peer, std::move(spin_us)));
}

Channel::Channel(ChannelHeader* header, std::string data_prefix, bool sender, int64_t peer_pid,
                 int64_t peer, SpinUs spin_us)
    : h_(header),
      data_prefix_(std::move(data_prefix)),
      sender_(sender),
      peer_pid_(peer_pid),
      peer_(peer),
      spin_us_(std::move(spin_us)),
      segments_(kShmSlots) {}

Channel::~Channel() {
  for (auto& s : segments_)
    if (s.addr) munmap(s.addr, s.bytes);
  munmap(h_, sizeof(ChannelHeader));
}

bool Channel::try_post(int64_t tag, const at::Tensor& t) {
  const size_t nbytes = t.nbytes();
  for (uint32_t i = 0; i < kShmSlots; ++i) {
    ChannelSlot& slot = h_->slots[i];
    uint32_t expected = kFree;
    if (!slot.state.compare_exchange_strong(expected, kWriting, std::memory_order_acquire))
      continue;
    for (uint32_t u = h_->used.load(); u < i + 1 && !h_->used.compare_exchange_weak(u, i + 1);) {
    }
    Segment& seg = segments_[i];  // slot i is ours until we mark it full
    if (seg.bytes < nbytes) {
      std::string error;
      const size_t bytes = std::max<size_t>(round_up(nbytes), 2 * seg.bytes);
      void* p = create_segment(data_name(i, seg.gen + 1), bytes, &error);
      if (!p) {
        slot.state.store(kFree, std::memory_order_release);
        TORCH_CHECK(false, "same-host send to rank ", peer_, ": ", error);
      }
      if (seg.addr) munmap(seg.addr, seg.bytes);
      seg = Segment{p, bytes, seg.gen + 1};
    }
    if (nbytes) std::memcpy(seg.addr, t.data_ptr(), nbytes);
    slot.gen = seg.gen;
    slot.tag = tag;
    slot.nbytes = nbytes;
    slot.order = h_->posts.fetch_add(1, std::memory_order_relaxed);
    slot.state.store(kFull, std::memory_order_release);
    notify();
    return true;
  }
  return false;
}

bool Channel::try_take(int64_t tag, const at::Tensor& buffer) {
  for (;;) {
    int64_t best = -1;
    uint64_t best_order = UINT64_MAX;
    const uint32_t used = h_->used.load(std::memory_order_acquire);
    for (uint32_t i = 0; i < used; ++i) {
      const ChannelSlot& slot = h_->slots[i];
      if (slot.state.load(std::memory_order_acquire) == kFull && slot.tag == tag &&
          slot.order < best_order) {
        best = i;
        best_order = slot.order;
      }
    }
    if (best < 0) return false;
    ChannelSlot& slot = h_->slots[best];
    uint32_t expected = kFull;
    const bool taken =
        slot.state.compare_exchange_strong(expected, kReading, std::memory_order_acquire);
    if (!taken || slot.tag != tag) {
      // Another thread of this process took it first (and the sender may have refilled it):
      // give back what we took, then look again.
      if (taken) slot.state.store(kFull, std::memory_order_release);
      continue;
    }
    const size_t nbytes = slot.nbytes;
    if (nbytes != buffer.nbytes()) {
      slot.state.store(kFull, std::memory_order_release);
      TORCH_CHECK(false, "same-host receive from rank ", peer_, " (tag ", tag,
                  "): the message has ", nbytes, " bytes but the receive buffer ", buffer.nbytes());
    }
    Segment& seg = segments_[best];
    if (nbytes && seg.gen != slot.gen) {
      std::string error;
      size_t bytes = 0;
      void* p = open_segment(data_name(static_cast<uint32_t>(best), slot.gen), &bytes, &error);
      if (!p) {
        slot.state.store(kFull, std::memory_order_release);
        TORCH_CHECK(false, "same-host receive from rank ", peer_, ": ", error);
      }
      if (seg.addr) munmap(seg.addr, seg.bytes);
      seg = Segment{p, bytes, slot.gen};
    }
    if (nbytes) std::memcpy(buffer.data_ptr(), seg.addr, nbytes);
    slot.state.store(kFree, std::memory_order_release);
    notify();
    return true;
  }
}

bool Channel::wait_for(const std::function<bool()>& attempt, std::chrono::milliseconds timeout,
                       const std::atomic<bool>& aborted) {
  const auto start = std::chrono::steady_clock::now();
  const auto deadline = start + timeout;
  // The peer's liveness is read from /proc (10-20 us), so only once per full sleep slice: a
  // wait that ends within the first slice, the common case, never pays for it.
  auto next_check = start + std::chrono::milliseconds(kShmWakeMs);
  const auto spin_end = std::min(
      start + std::chrono::microseconds(spin_us_->load(std::memory_order_relaxed)), deadline);
  for (;;) {
    const uint32_t seen = h_->seq.load(std::memory_order_seq_cst);
    if (attempt()) return true;
    if (aborted.load()) return false;
    const auto now = std::chrono::steady_clock::now();
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - now).count();
    if (left <= 0) return false;
    if (now >= next_check) {
      TORCH_CHECK(process_alive(peer_pid_), "rank ", peer_, " (pid ", peer_pid_,
                  ") exited while this rank waited on a same-host ",
                  sender_ ? "send to" : "receive from", " it");
      next_check = now + std::chrono::milliseconds(kShmWakeMs);
    }
    if (now < spin_end) {  // [Note: spinning before sleeping]
      while (h_->seq.load(std::memory_order_seq_cst) == seen && !aborted.load() &&
             std::chrono::steady_clock::now() < spin_end)
        cpu_relax();
      continue;
    }
    h_->waiters.fetch_add(1, std::memory_order_seq_cst);
    futex_wait(&h_->seq, seen, std::min<int64_t>(left, kShmWakeMs));
    h_->waiters.fetch_sub(1, std::memory_order_seq_cst);
  }
}

void Channel::wake() { futex_wake_all(&h_->seq); }

std::string Channel::data_name(uint32_t slot, uint32_t gen) const {
  return c10::str(data_prefix_, ".", slot, ".", gen);
}

void Channel::notify() {
  h_->seq.fetch_add(1, std::memory_order_seq_cst);
  if (h_->waiters.load(std::memory_order_seq_cst) > 0) futex_wake_all(&h_->seq);
}

}  // namespace pippy_xla
