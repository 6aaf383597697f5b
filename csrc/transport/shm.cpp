// The same-host transport of [Note: same-host transport] in shm.h.
#include "transport/shm.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <dirent.h>
#include <fcntl.h>
#include <linux/futex.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <fstream>
#include <functional>
#include <memory>
#include <mutex>
#include <random>
#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <unordered_map>
#include <vector>

#include "transport/p2p.h"

namespace pippy_xla {

namespace {

constexpr uint64_t kMagic = 0x31766e6863787870ULL;  // "ppxchnv1"
enum SlotState : uint32_t { kFree = 0, kWriting = 1, kFull = 2, kReading = 3 };

// One message slot. `tag`, `nbytes`, `order` and `gen` are written by the sender while it holds
// the slot (kWriting) and read by the receiver while it holds it (kReading); `state` hands the
// slot over (release / acquire).
struct alignas(64) Slot {
  std::atomic<uint32_t> state;
  uint32_t gen;  // generation of the slot's data segment (a new segment when one must grow)
  int64_t tag;
  uint64_t nbytes;
  uint64_t order;  // the sender's post count: equal tags are received oldest first
};

// The shared part of a channel (one direction of one pair). Atomics of 32 and 64 bits are
// lock-free and address-free, so they work across processes.
struct Header {
  uint64_t magic;
  int64_t sender_pid;
  int64_t receiver_pid;
  alignas(64) std::atomic<uint32_t> seq;      // futex word: bumped by every post and every free
  alignas(64) std::atomic<uint32_t> waiters;  // threads of either side asleep on `seq`
  alignas(64) std::atomic<uint64_t> posts;
  std::atomic<uint32_t> used;  // 1 + the highest slot ever claimed: receives scan no further
  Slot slots[kShmSlots];
};

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

// [Note: spinning before sleeping] Waking a thread asleep on a futex costs the waker a syscall
// and the sleeper the time to be scheduled again: measured on the 2-core CI machine (a VM), a
// send that wakes its receiver took 25-30 us instead of 8-10, and the receiver started 20-25 us
// after the send returned. In a pipeline every microbatch crosses ranks twice per stage
// boundary and the crossing is on the critical path, so over 2 ranks x 32 microbatches this
// cost 1.5-2.5 ms of a 60-80 ms step. A wait therefore polls the channel for up to kShmSpinUs
// before it sleeps (without registering as a waiter, so the peer's post skips the wake), but
// only where polling takes a core from nobody: when every rank on this host, with all of its
// intra-op threads, has a CPU of its own (this rank's affinity mask counts the CPUs;
// LOCAL_WORLD_SIZE, which torchrun sets, counts ranks of other groups on the host). With more
// ranks than cores (the CI's 4-rank tests) a poller would steal the core of the rank it waits
// for, so there waits sleep at once.
int64_t spin_budget_us(int64_t ranks_on_host) {
  int64_t ranks = ranks_on_host;
  if (const char* env = std::getenv("LOCAL_WORLD_SIZE"))
    ranks = std::max<int64_t>(ranks, std::atoll(env));
  cpu_set_t set;
  CPU_ZERO(&set);
  const int64_t cpus = sched_getaffinity(0, sizeof(set), &set) == 0 ? CPU_COUNT(&set) : 1;
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  return ranks * threads <= cpus ? kShmSpinUs : 0;
}

void futex_wait(std::atomic<uint32_t>* word, uint32_t expected, int64_t ms) {
  struct timespec ts{static_cast<time_t>(ms / 1000), static_cast<long>((ms % 1000) * 1000000)};
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, expected, &ts, nullptr, 0);
}

void futex_wake_all(std::atomic<uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

// Whether process `pid` still runs: its /proc entry exists and it is not a zombie (a peer that
// exited stays a zombie until its parent reaps it, and kill(pid, 0) still succeeds then).
bool process_alive(int64_t pid) {
  if (pid <= 0) return true;  // not visible from here: no check
  std::ifstream stat(c10::str("/proc/", pid, "/stat"));
  std::string text;
  if (!std::getline(stat, text)) return false;
  const auto close = text.rfind(')');  // the command name may hold spaces and parentheses
  return close == std::string::npos || close + 2 >= text.size() ||
         (text[close + 2] != 'Z' && text[close + 2] != 'X');
}

// This process's mapping of one slot's data segment.
struct Segment {
  void* addr = nullptr;
  size_t bytes = 0;
  uint32_t gen = 0;
};

class Channel {
 public:
  // `data_prefix`: the names of the slots' data segments start with it.
  // `spin_us`: how long a wait polls before it sleeps, shared by the group's channels ([Note:
  // spinning before sleeping]).
  Channel(Header* header, std::string data_prefix, bool sender, int64_t peer_pid, int64_t peer,
          std::shared_ptr<const std::atomic<int64_t>> spin_us)
      : h_(header),
        data_prefix_(std::move(data_prefix)),
        sender_(sender),
        peer_pid_(peer_pid),
        peer_(peer),
        spin_us_(std::move(spin_us)),
        segments_(kShmSlots) {}
  ~Channel() {
    for (auto& s : segments_)
      if (s.addr) munmap(s.addr, s.bytes);
    munmap(h_, sizeof(Header));
  }
  Channel(const Channel&) = delete;
  Channel& operator=(const Channel&) = delete;

  // Sender: copies `t` into a free slot; false if every slot is full.
  bool try_post(int64_t tag, const at::Tensor& t) {
    const size_t nbytes = t.nbytes();
    for (uint32_t i = 0; i < kShmSlots; ++i) {
      Slot& slot = h_->slots[i];
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

  // Receiver: copies the oldest message with `tag` into `buffer`; false if none is there.
  bool try_take(int64_t tag, const at::Tensor& buffer) {
    for (;;) {
      int64_t best = -1;
      uint64_t best_order = UINT64_MAX;
      const uint32_t used = h_->used.load(std::memory_order_acquire);
      for (uint32_t i = 0; i < used; ++i) {
        const Slot& slot = h_->slots[i];
        if (slot.state.load(std::memory_order_acquire) == kFull && slot.tag == tag &&
            slot.order < best_order) {
          best = i;
          best_order = slot.order;
        }
      }
      if (best < 0) return false;
      Slot& slot = h_->slots[best];
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
                    "): the message has ", nbytes, " bytes but the receive buffer ",
                    buffer.nbytes());
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

  // Calls `attempt` until it returns true, sleeping on the channel between tries. False when the
  // deadline passes or `aborted` is set; throws if the peer's process is gone.
  bool wait_for(const std::function<bool()>& attempt, std::chrono::milliseconds timeout,
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
      const auto left =
          std::chrono::duration_cast<std::chrono::milliseconds>(deadline - now).count();
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

  // Wakes every thread asleep on this channel (either process), e.g. for Work::abort.
  void wake() { futex_wake_all(&h_->seq); }

 private:
  static size_t round_up(size_t n) { return std::max<size_t>((n + 4095) & ~size_t{4095}, 4096); }
  std::string data_name(uint32_t slot, uint32_t gen) const {
    return c10::str(data_prefix_, ".", slot, ".", gen);
  }
  void notify() {
    h_->seq.fetch_add(1, std::memory_order_seq_cst);
    if (h_->waiters.load(std::memory_order_seq_cst) > 0) futex_wake_all(&h_->seq);
  }

  Header* h_;
  std::string data_prefix_;
  bool sender_;
  int64_t peer_pid_;
  int64_t peer_;
  std::shared_ptr<const std::atomic<int64_t>> spin_us_;
  std::vector<Segment> segments_;
};

}  // namespace

// Outside the anonymous namespace: p2p.h declares Attached (a Route holds one).
struct Attached;

class ShmWork : public c10d::Work {
 public:
  // `group`: for a receive, whose deferred sends it pushes while it waits.
  ShmWork(std::shared_ptr<Channel> channel, std::shared_ptr<Attached> group, bool send, int64_t tag,
          at::Tensor tensor, int rank)
      : c10d::Work(rank, send ? c10d::OpType::SEND : c10d::OpType::RECV),
        channel_(std::move(channel)),
        group_(std::move(group)),
        send_(send),
        tag_(tag),
        tensor_(std::move(tensor)) {}

  bool isCompleted() override { return attempt(); }
  bool isSuccess() const override { return done_; }
  bool wait(std::chrono::milliseconds timeout) override {
    if (done_) return true;
    if (timeout.count() <= 0) timeout = std::chrono::milliseconds(kDefaultTimeoutMs);
    const bool done = channel_->wait_for([this] { return attempt(); }, timeout, aborted_);
    TORCH_CHECK(done || !aborted_, "the wait was aborted");
    return done;
  }
  void abort() override {
    aborted_ = true;
    channel_->wake();
  }

  // Posts (a send) or takes (a receive) if it can now; true once done. Thread-safe: a deferred
  // send may be pushed by its own wait and by a receive's wait at once.
  bool attempt();

 private:
  std::shared_ptr<Channel> channel_;
  std::shared_ptr<Attached> group_;
  bool send_;
  int64_t tag_;
  at::Tensor tensor_;
  std::mutex mutex_;
  std::atomic<bool> done_{false};
  std::atomic<bool> aborted_{false};
};

// The channels of one attached process group on this rank.
struct Attached {
  explicit Attached(const c10::intrusive_ptr<c10d::ProcessGroup>& pg)
      : group(pg), raw(pg.get()), rank(pg->getRank()), size(pg->getSize()) {}
  c10::weak_intrusive_ptr<c10d::ProcessGroup> group;
  const c10d::ProcessGroup* raw;
  int rank;
  int64_t size;
  std::vector<std::shared_ptr<Channel>> to;    // by peer: this rank's sends (null: not attached)
  std::vector<std::shared_ptr<Channel>> from;  // by peer: this rank's receives
  int64_t peers = 0;
  // How long its waits poll before sleeping (every channel of the group reads it).
  std::shared_ptr<std::atomic<int64_t>> spin_us = std::make_shared<std::atomic<int64_t>>(0);

  // [Note: deferred sends] A send that finds every slot of its channel full stays pending until
  // a slot frees. Its own wait pushes it, and so does every receive's wait on this rank: an
  // engine that waits on a receive whose message the peer sends only after consuming ours still
  // gets ours out. (kShmSlots messages unreceived in one direction is far beyond any schedule's
  // transfers in flight: a safety net, not the common path.)
  void defer(c10::intrusive_ptr<ShmWork> work) {
    std::lock_guard<std::mutex> lock(pending_mutex_);
    pending_.push_back(std::move(work));
    num_pending_.store(pending_.size());
  }
  void push_pending() {
    if (num_pending_.load() == 0) return;
    std::lock_guard<std::mutex> lock(pending_mutex_);
    pending_.erase(std::remove_if(pending_.begin(), pending_.end(),
                                  [](const auto& w) { return w->attempt(); }),
                   pending_.end());
    num_pending_.store(pending_.size());
  }

 private:
  std::mutex pending_mutex_;
  std::vector<c10::intrusive_ptr<ShmWork>> pending_;
  std::atomic<size_t> num_pending_{0};
};

bool ShmWork::attempt() {
  if (done_) return true;
  if (!send_) group_->push_pending();
  std::lock_guard<std::mutex> lock(mutex_);
  if (!done_) done_ = send_ ? channel_->try_post(tag_, tensor_) : channel_->try_take(tag_, tensor_);
  return done_;
}

namespace {

std::mutex registry_mutex;
std::unordered_map<std::string, std::shared_ptr<Attached>>& registry() {
  static auto* r = new std::unordered_map<std::string, std::shared_ptr<Attached>>();
  return *r;
}

std::shared_ptr<Attached> attached(const c10d::ProcessGroup& group, const std::string& name) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  auto it = registry().find(name);
  if (it == registry().end()) return nullptr;
  if (it->second->raw != &group || it->second->group.expired()) return nullptr;
  return it->second;
}

// Same machine and same boot: the host name and the kernel's boot id.
int64_t host_key() {
  char host[256] = {};
  gethostname(host, sizeof(host) - 1);
  std::string key(host);
  std::ifstream boot("/proc/sys/kernel/random/boot_id");
  std::string id;
  std::getline(boot, id);
  key += "|" + id;
  uint64_t h = 0xcbf29ce484222325ULL;
  for (unsigned char c : key) h = (h ^ c) * 0x100000001b3ULL;
  return static_cast<int64_t>(h >> 1);
}

// The peer's pid for liveness checks, or 0 (no check) where this process cannot see it (another
// pid namespace sharing /dev/shm).
int64_t peer_pid(int64_t pid) { return process_alive(pid) ? pid : 0; }

// [Note: shared-memory names] /pippy_xla.<uid>.<creator's pid>.<job>.<src>.<dst> for a
// channel (created by its receiver, dst), the same with .<slot>.<generation> for a data segment
// (created by the sender, src). A name is unlinked once both sides have mapped it; what a
// failure leaves (a message never received) names a dead creator, and an attach on the machine
// an hour or more later unlinks it.
std::string shm_name(int64_t creator, int64_t job, int64_t src, int64_t dst) {
  return c10::str("/pippy_xla.", getuid(), ".", creator, ".", job, ".", src, ".", dst);
}

// A name whose creator is not running here, last written over kShmStaleSeconds ago: a process
// of another pid namespace sharing /dev/shm looks dead from here, and the age keeps the cleanup
// off the names of such a job that is still running (a name lives from its creation until the
// peer maps it).
constexpr int64_t kShmStaleSeconds = 3600;

void unlink_stale_names() {
  const std::string mine = c10::str("pippy_xla.", getuid(), ".");
  DIR* dir = opendir("/dev/shm");
  if (!dir) return;
  const auto now = time(nullptr);
  while (const dirent* e = readdir(dir)) {
    const std::string name(e->d_name);
    if (name.rfind(mine, 0) != 0) continue;
    const int64_t creator = std::atoll(name.c_str() + mine.size());
    struct stat st{};
    if (creator > 0 && stat(("/dev/shm/" + name).c_str(), &st) == 0 &&
        now - st.st_mtime > kShmStaleSeconds && !process_alive(creator))
      shm_unlink(("/" + name).c_str());
  }
  closedir(dir);
}

}  // namespace

int64_t shm_attach(const std::string& group_name, std::chrono::milliseconds timeout,
                   int64_t spin_us) {
  auto pg = c10d::resolve_process_group(group_name);
  TORCH_CHECK(pg, "no process group registered under the name '", group_name, "'");
  if (auto a = attached(*pg, group_name)) {
    if (spin_us >= 0 && a->peers) a->spin_us->store(spin_us);
    return a->peers;
  }
  const int64_t rank = pg->getRank();
  const int64_t size = pg->getSize();
  std::random_device rd;
  const int64_t nonce = static_cast<int64_t>((static_cast<uint64_t>(rd()) << 31) ^ rd());
  const auto cpu = c10::Device(c10::kCPU);
  const auto info =
      all_gather_int64({host_key(), nonce, static_cast<int64_t>(getpid())}, group_name, cpu,
                       timeout, "same-host transport: exchanging hosts");
  const int64_t job = info[0][1] & 0x7fffffffffffLL;
  unlink_stale_names();
  auto a = std::make_shared<Attached>(pg);
  a->to.resize(size);
  a->from.resize(size);
  std::vector<int64_t> peers;
  for (int64_t p = 0; p < size; ++p)
    if (p != rank && info[p][0] == info[rank][0]) peers.push_back(p);
  const auto ranks_here = static_cast<int64_t>(peers.size()) + 1;
  a->spin_us->store(spin_us >= 0 ? spin_us : spin_budget_us(ranks_here));
  // Every rank creates the channels it receives on; if one cannot, no rank uses shared memory.
  std::string error;
  for (int64_t p : peers) {
    void* mem = create_segment(shm_name(info[rank][2], job, p, rank), sizeof(Header), &error);
    if (!mem) break;
    auto* h = new (mem) Header();
    h->magic = kMagic;
    h->sender_pid = info[p][2];
    h->receiver_pid = info[rank][2];
    a->from[p] = std::make_shared<Channel>(h, shm_name(info[p][2], job, p, rank), false,
                                           peer_pid(info[p][2]), p, a->spin_us);
  }
  const auto created = all_gather_int64({error.empty() ? 1 : 0}, group_name, cpu, timeout,
                                        "same-host transport: creating channels");
  bool ok = true;
  for (const auto& c : created) ok = ok && c[0] == 1;
  if (ok) {
    for (int64_t p : peers) {
      size_t bytes = 0;
      void* mem = open_segment(shm_name(info[p][2], job, rank, p), &bytes, &error);
      if (!mem) break;
      auto* h = static_cast<Header*>(mem);
      if (bytes != sizeof(Header) || h->magic != kMagic) {
        error = "a peer's channel has another layout (another pippy_xla build?)";
        munmap(mem, bytes);
        break;
      }
      a->to[p] = std::make_shared<Channel>(h, shm_name(info[rank][2], job, rank, p), true,
                                           peer_pid(info[p][2]), p, a->spin_us);
    }
  } else {
    for (int64_t p : peers) shm_unlink(shm_name(info[rank][2], job, p, rank).c_str());
  }
  // Nobody sends through shared memory before every rank has mapped every channel.
  const auto opened = all_gather_int64({error.empty() ? 1 : 0}, group_name, cpu, timeout,
                                       "same-host transport: opening channels");
  for (const auto& c : opened) ok = ok && c[0] == 1;
  if (!ok) {
    a->to.assign(size, nullptr);
    a->from.assign(size, nullptr);
  } else {
    a->peers = static_cast<int64_t>(peers.size());
  }
  std::lock_guard<std::mutex> lock(registry_mutex);
  registry()[group_name] = a;
  return a->peers;
}

namespace {

// A send's or a receive's work over the channel to / from `peer`, or empty if not attached.
c10::intrusive_ptr<ShmWork> shm_work(const std::shared_ptr<Attached>& a, int64_t peer, int64_t tag,
                                     const at::Tensor& tensor, bool send) {
  if (!a || peer < 0 || peer >= a->size) return {};
  const auto& channel = send ? a->to[peer] : a->from[peer];
  if (!channel) return {};
  TORCH_CHECK(tensor.device().is_cpu(), "same-host transfers move CPU tensors, got one on ",
              tensor.device());
  auto work = c10::make_intrusive<ShmWork>(channel, a, send, tag, tensor, a->rank);
  if (send && !work->attempt()) a->defer(work);  // see [Note: deferred sends]
  return work;
}

}  // namespace

std::shared_ptr<Attached> shm_channels(const c10d::ProcessGroup& group,
                                       const std::string& group_name) {
  return attached(group, group_name);
}

c10::intrusive_ptr<c10d::Work> shm_send(const std::shared_ptr<Attached>& channels, int64_t peer,
                                        int64_t tag, const at::Tensor& tensor) {
  return shm_work(channels, peer, tag, tensor, true);
}

c10::intrusive_ptr<c10d::Work> shm_recv(const std::shared_ptr<Attached>& channels, int64_t peer,
                                        int64_t tag, const at::Tensor& buffer) {
  return shm_work(channels, peer, tag, buffer, false);
}

bool shm_whole_group(const c10d::ProcessGroup& group, const std::string& group_name) {
  auto a = attached(group, group_name);
  return a && a->peers == group.getSize() - 1;
}

namespace {

// The channels attached to the group that `group_name` resolves to now, if any.
std::shared_ptr<Attached> attached_by_name(const std::string& group_name) {
  auto pg = c10d::resolve_process_group(group_name);
  return pg ? attached(*pg, group_name) : nullptr;
}

}  // namespace

int64_t shm_peers(const std::string& group_name) {
  auto a = attached_by_name(group_name);
  return a ? a->peers : 0;
}

bool shm_whole_group(const std::string& group_name) {
  auto pg = c10d::resolve_process_group(group_name);
  return pg && shm_whole_group(*pg, group_name);
}

int64_t shm_spin_us(const std::string& group_name) {
  auto a = attached_by_name(group_name);
  return a && a->peers ? a->spin_us->load() : 0;
}

}  // namespace pippy_xla
