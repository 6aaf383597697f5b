// The same-host transport of [Note: same-host transport] in shm.h.
#include "transport/shm.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <dirent.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <ctime>
#include <fstream>
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

// What every rank of a group tells the others when it attaches, by group rank.
struct Peers {
  std::vector<int64_t> pid;
  int64_t job = 0;            // rank 0's nonce: the names of this attach
  std::vector<int64_t> here;  // the other ranks on this rank's host
};

Peers exchange_hosts(const std::string& group_name, int64_t rank, int64_t size,
                     std::chrono::milliseconds timeout) {
  std::random_device rd;
  const int64_t nonce = static_cast<int64_t>((static_cast<uint64_t>(rd()) << 31) ^ rd());
  const auto info =
      all_gather_int64({host_key(), nonce, static_cast<int64_t>(getpid())}, group_name,
                       c10::Device(c10::kCPU), timeout, "same-host transport: exchanging hosts");
  Peers peers;
  peers.job = info[0][1] & 0x7fffffffffffLL;
  for (int64_t p = 0; p < size; ++p) {
    peers.pid.push_back(info[p][2]);
    if (p != rank && info[p][0] == info[rank][0]) peers.here.push_back(p);
  }
  return peers;
}

// Whether every rank of the group reports `ok` (a collective).
bool all_ok(const std::string& group_name, bool ok, std::chrono::milliseconds timeout,
            const char* what) {
  const auto all =
      all_gather_int64({ok ? 1 : 0}, group_name, c10::Device(c10::kCPU), timeout, what);
  return std::all_of(all.begin(), all.end(), [](const auto& v) { return v[0] == 1; });
}

// Every rank creates the channels it receives on; false (`*error` set) if one cannot.
bool create_channels(Attached& a, const Peers& peers, std::string* error) {
  const int64_t me = a.rank;
  for (int64_t p : peers.here) {
    a.from[p] = Channel::create(shm_name(peers.pid[me], peers.job, p, me),
                                shm_name(peers.pid[p], peers.job, p, me), peers.pid[p],
                                peers.pid[me], p, a.spin_us, error);
    if (!a.from[p]) return false;
  }
  return true;
}

// Unlinks the names of the channels this rank created, which no peer will open.
void unlink_channels(int64_t me, const Peers& peers) {
  for (int64_t p : peers.here) shm_unlink(shm_name(peers.pid[me], peers.job, p, me).c_str());
}

// Then maps those it sends on, which its peers created.
bool open_channels(Attached& a, const Peers& peers, std::string* error) {
  const int64_t me = a.rank;
  for (int64_t p : peers.here) {
    a.to[p] =
        Channel::open(shm_name(peers.pid[p], peers.job, me, p),
                      shm_name(peers.pid[me], peers.job, me, p), peers.pid[p], p, a.spin_us, error);
    if (!a.to[p]) return false;
  }
  return true;
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
  auto a = std::make_shared<Attached>(pg);
  const Peers peers = exchange_hosts(group_name, a->rank, a->size, timeout);
  unlink_stale_names();
  a->to.resize(a->size);
  a->from.resize(a->size);
  const auto ranks_here = static_cast<int64_t>(peers.here.size()) + 1;
  a->spin_us->store(spin_us >= 0 ? spin_us : spin_budget_us(ranks_here));
  // If one rank cannot create or open its channels, no rank uses shared memory; nobody sends
  // through it before every rank has mapped every channel.
  std::string error;
  bool ok = all_ok(group_name, create_channels(*a, peers, &error), timeout,
                   "same-host transport: creating channels");
  if (!ok) unlink_channels(a->rank, peers);
  ok = all_ok(group_name, ok && open_channels(*a, peers, &error), timeout,
              "same-host transport: opening channels");
  if (ok) {
    a->peers = static_cast<int64_t>(peers.here.size());
  } else {
    a->to.assign(a->size, nullptr);
    a->from.assign(a->size, nullptr);
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
