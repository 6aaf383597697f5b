// The `pippy_xla` op namespace: functional, token-ordered send/recv over c10d.
// See [Note: one send/recv implementation] in p2p.h.
#include "transport/p2p.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/scalar_tensor.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <mutex>
#include <thread>
#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <unordered_map>

#include "transport/shm.h"

namespace pippy_xla {

Transfer::Transfer(c10::intrusive_ptr<c10d::Work> work, at::Tensor tensor, std::string what,
                   TransferContext context, bool done_when_posted)
    : work_(std::move(work)),
      tensor_(std::move(tensor)),
      what_(std::move(what)),
      context_(std::move(context)),
      done_when_posted_(done_when_posted) {}

Transfer::~Transfer() = default;
Transfer::Transfer(Transfer&&) noexcept = default;
Transfer& Transfer::operator=(Transfer&&) noexcept = default;

std::string describe(const std::string& what, const TransferContext& c) {
  if (!what.empty() || c.object == nullptr) return what;
  const bool send = !c.action.empty() && c.action[0] == 'S';
  return c10::str("[rank ", c.rank, " stage ", c.stage, "] ", c.action, " microbatch ",
                  c.microbatch, ": ", send ? "send of " : "receive of ", c.object,
                  c.index >= 0 ? c10::str(" ", c.index) : std::string(),
                  send ? " to rank " : " from rank ", c.peer);
}

bool Transfer::completed() const { return !work_ || work_->isCompleted(); }

at::Tensor Transfer::wait(std::chrono::milliseconds timeout) {
  TORCH_CHECK(work_, describe(what_, context_), ": waited twice or never posted");
  if (on_device()) {
    // NCCL's own wait with a timeout polls with a sleep of a millisecond or more between checks
    // ([Note: waits on a GPU]); this one checks every 20 us, and NCCL's then returns at once.
    poll(std::chrono::steady_clock::now() + timeout, timeout, nullptr);
  }
  bool ok = false;
  std::string error;
  try {
    ok = work_->wait(timeout);
  } catch (const std::exception& e) {
    error = e.what();
  }
  // Backends report a timeout either by returning false or by throwing (gloo: "Timed out"); an
  // aborted wait (Work::abort) returns false too, and the engine says why it aborted.
  const bool timed_out = (error.empty() && !ok) || error.find("Timed out") != std::string::npos;
  if (timed_out) throw_timed_out(timeout);
  if (!error.empty()) {
    throw TransferError(c10::str(describe(what_, context_), " failed: ", error,
                                 " (the peer may have died or raised an error; see its log)"),
                        context_);
  }
  work_.reset();
  return tensor_;
}

void Transfer::poll(std::chrono::steady_clock::time_point deadline,
                    std::chrono::milliseconds timeout, const Abortable* live) const {
  while (!completed()) {
    if (live && live->aborted()) {
      // Not left to the wait that follows: an aborted NCCL work may never report completion,
      // and Transfer::wait would poll it until the timeout.
      throw TransferError(c10::str(describe(what_, context_), " aborted (another rank failed)"),
                          context_);
    }
    if (std::chrono::steady_clock::now() >= deadline) throw_timed_out(timeout);
    std::this_thread::sleep_for(std::chrono::microseconds(20));
  }
}

void Transfer::throw_timed_out(std::chrono::milliseconds timeout) const {
  throw TransferError(
      c10::str(describe(what_, context_), " did not complete within ", timeout.count(),
               " ms (the peer may be stuck or dead; raise `timeout` if it is just slow)"),
      context_);
}

at::Tensor Transfer::wait_on_stream() {
  TORCH_CHECK(work_, describe(what_, context_), ": waited twice or never posted");
  try {
    work_->wait(::kNoTimeout);  // the stream waits; see [Note: waits on a GPU]
  } catch (const std::exception& e) {
    throw TransferError(c10::str(describe(what_, context_), " failed: ", e.what(),
                                 " (the peer may have died or raised an error; see its log)"),
                        context_);
  }
  return tensor_;
}

void DeviceWaits::add(Transfer t, std::chrono::milliseconds timeout) {
  size_t kept = 0;
  for (size_t i = 0; i < pending_.size(); ++i) {
    if (pending_[i].completed()) {
      pending_[i].wait(timeout);  // returns at once, or raises the transfer's error
    } else {
      if (kept != i) pending_[kept] = std::move(pending_[i]);
      ++kept;
    }
  }
  pending_.resize(kept);
  pending_.push_back(std::move(t));
}

void DeviceWaits::finish(std::chrono::milliseconds timeout, const Abortable& live) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (auto& t : pending_) {
    t.poll(deadline, timeout, &live);
    t.wait(timeout);  // complete: returns at once or raises its error
  }
  pending_.clear();
}

Abortable::Abortable() = default;
Abortable::~Abortable() = default;

void Abortable::track(const Transfer& t) {
  // A send that went out when it was posted has nothing left to abort. Not tracking these (most
  // of a step's sends over shared memory) keeps the list, which every track() sweeps, to the
  // transfers still pending: tracking every one cost 0.6-0.8 us per transfer.
  if (t.done_when_posted()) return;
  std::lock_guard<std::mutex> g(mu_);
  live_.erase(std::remove_if(live_.begin(), live_.end(), [](const auto& w) { return w.expired(); }),
              live_.end());
  live_.push_back(c10::weak_intrusive_ptr<c10d::Work>(t.work()));
  if (aborted_) {  // abort() ran just before this transfer was posted
    try {
      t.work()->abort();
    } catch (const std::exception&) {
    }
  }
}

void Abortable::abort() {
  aborted_ = true;
  std::lock_guard<std::mutex> g(mu_);
  for (auto& weak : live_) {
    auto w = weak.lock();
    if (!w) continue;  // finished and dropped
    try {
      w->abort();
    } catch (const std::exception&) {
      // A backend without Work::abort: the wait ends at its timeout instead.
    }
  }
}

void Abortable::clear() {
  std::lock_guard<std::mutex> g(mu_);
  live_.clear();
}

namespace {

c10::intrusive_ptr<c10d::ProcessGroup> group(const std::string& name) {
  auto pg = c10d::resolve_process_group(name);
  TORCH_CHECK(pg, "no process group registered under the name '", name, "'");
  return pg;
}

void check_wire_tensor(const at::Tensor& t, const std::string& what,
                       const TransferContext& context) {
  TORCH_CHECK(t.defined(), describe(what, context), ": tensor is undefined");
  TORCH_CHECK(t.layout() == at::kStrided && t.is_contiguous(), describe(what, context),
              ": only dense contiguous tensors can be transferred, got a tensor with strides ",
              t.strides());
}

}  // namespace

Route::Route() = default;
Route::Route(const std::string& group_name)
    : group(pippy_xla::group(group_name)), channels(shm_channels(*group, group_name)) {}
Route::Route(const Route&) = default;
Route& Route::operator=(const Route&) = default;
Route::~Route() = default;

Transfer isend(const at::Tensor& tensor, int64_t peer, int64_t tag, const Route& route,
               std::string what, TransferContext context) {
  check_wire_tensor(tensor, what, context);
  auto work = shm_send(route.channels, peer, tag, tensor);
  // Asked only of shared memory's works, where it costs nothing (a CUDA event query elsewhere).
  const bool done = work && work->isCompleted();
  if (!work) {
    std::vector<at::Tensor> ts{tensor};
    work = route.group->send(ts, static_cast<int>(peer), static_cast<int>(tag));
  }
  return Transfer(std::move(work), tensor, std::move(what), std::move(context), done);
}

Transfer isend(const at::Tensor& tensor, int64_t peer, int64_t tag, const std::string& group_name,
               std::string what, TransferContext context) {
  return isend(tensor, peer, tag, Route(group_name), std::move(what), std::move(context));
}

Transfer irecv(at::Tensor buffer, int64_t peer, int64_t tag, const Route& route, std::string what,
               TransferContext context) {
  check_wire_tensor(buffer, what, context);
  auto work = shm_recv(route.channels, peer, tag, buffer);
  if (!work) {
    std::vector<at::Tensor> ts{buffer};
    work = route.group->recv(ts, static_cast<int>(peer), static_cast<int>(tag));
  }
  return Transfer(std::move(work), std::move(buffer), std::move(what), std::move(context));
}

Transfer irecv(at::Tensor buffer, int64_t peer, int64_t tag, const std::string& group_name,
               std::string what, TransferContext context) {
  return irecv(std::move(buffer), peer, tag, Route(group_name), std::move(what),
               std::move(context));
}

namespace {

// [Note: small collectives over shared memory] The step's own collectives (the handshake's
// all-gather, the loss broadcast, the gradient norm's all-reduce) are a few bytes each. Through
// gloo on one host each cost a median of 0.2-0.3 ms and a mean of 0.7-1.1 ms on the 2-core VM
// (stalls of several ms, as its sends have: [Note: same-host transport]); as point-to-point
// messages over shared memory, 0.03 ms and 0.04 ms. So when every rank of the group is attached,
// `exchange` runs them: each rank in `senders` sends its tensor to every other rank under
// kShmCollectiveTag, and every rank receives from every sender. Collectives of one group run one
// after another, and messages of one tag match in order, so they cannot mix; a rank that runs
// another collective than its peers fails on the message's size instead of mixing them up.
// Sums add the ranks' tensors in rank order, so every rank gets the same bits.
std::vector<at::Tensor> exchange(const Route& route, const at::Tensor& mine,
                                 const std::vector<int64_t>& senders,
                                 std::chrono::milliseconds timeout, const std::string& what,
                                 Abortable* abortable) {
  const auto posted = [abortable](Transfer t) {
    if (abortable) abortable->track(t);
    return t;
  };
  const int64_t rank = route.group->getRank(), size = route.group->getSize();
  const auto data = mine.contiguous();
  std::vector<Transfer> sends;
  std::vector<at::Tensor> out(size);
  for (int64_t s : senders) {
    if (s != rank) continue;
    for (int64_t p = 0; p < size; ++p)
      if (p != rank) sends.push_back(posted(isend(data, p, kShmCollectiveTag, route, what)));
    out[rank] = data;
  }
  for (int64_t s : senders) {
    if (s == rank) continue;
    out[s] = posted(irecv(at::empty_like(data), s, kShmCollectiveTag, route, what)).wait(timeout);
  }
  for (auto& t : sends) t.wait(timeout);
  if (abortable) abortable->clear();
  return out;
}

std::vector<int64_t> every_rank(int64_t size) {
  std::vector<int64_t> ranks(size);
  for (int64_t r = 0; r < size; ++r) ranks[r] = r;
  return ranks;
}

}  // namespace

std::vector<std::vector<int64_t>> all_gather_int64(const std::vector<int64_t>& values,
                                                   const std::string& group_name,
                                                   c10::Device device,
                                                   std::chrono::milliseconds timeout,
                                                   std::string what, Abortable* abortable) {
  const Route route(group_name);
  const auto& pg = route.group;
  const auto n = static_cast<int64_t>(values.size());
  if (device.is_cpu() && shm_whole_group(*pg, group_name)) {
    auto mine = at::empty({n}, at::TensorOptions().dtype(at::kLong));
    std::memcpy(mine.data_ptr<int64_t>(), values.data(), n * sizeof(int64_t));
    std::vector<std::vector<int64_t>> out;
    for (const auto& t : exchange(route, mine, every_rank(pg->getSize()), timeout, what, abortable))
      out.emplace_back(t.data_ptr<int64_t>(), t.data_ptr<int64_t>() + n);
    return out;
  }
  const auto options = at::TensorOptions().dtype(at::kLong).device(device);
  auto host = at::empty({n}, at::TensorOptions().dtype(at::kLong));
  std::memcpy(host.data_ptr<int64_t>(), values.data(), n * sizeof(int64_t));
  std::vector<at::Tensor> input{host.to(device)};
  std::vector<std::vector<at::Tensor>> outputs(1);
  for (int r = 0; r < pg->getSize(); ++r) outputs[0].push_back(at::empty({n}, options));
  Transfer(pg->allgather(outputs, input), input[0], std::move(what)).wait(timeout);
  std::vector<std::vector<int64_t>> out;
  for (const auto& t : outputs[0]) {
    const auto gathered = t.cpu();
    const auto* data = gathered.data_ptr<int64_t>();
    out.emplace_back(data, data + n);
  }
  return out;
}

namespace {

// FNV-1a over 64-bit words with a final mix: fingerprints to compare what ranks were given, not a
// cryptographic hash.
struct Fingerprint {
  uint64_t h = 0xcbf29ce484222325ULL;
  void add(uint64_t word) { h = (h ^ word) * 0x100000001b3ULL; }
  void add_bytes(const uint8_t* bytes, size_t size) {
    size_t i = 0;
    for (; i + 8 <= size; i += 8) {
      uint64_t word;
      std::memcpy(&word, bytes + i, 8);
      add(word);
    }
    for (; i < size; ++i) add(bytes[i]);
  }
  int64_t done() const {
    uint64_t x = h;
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdULL;
    x ^= x >> 33;
    return static_cast<int64_t>(x);
  }
};

}  // namespace

int64_t content_digest(const at::Tensor& tensor) {
  const auto t = tensor.detach().cpu().contiguous();
  Fingerprint f;
  f.add_bytes(static_cast<const uint8_t*>(t.data_ptr()), t.numel() * t.element_size());
  return f.done();
}

BatchKey batch_key(const std::vector<std::string>& names, const std::vector<at::Tensor>& tensors,
                   bool check_content) {
  TORCH_CHECK(names.size() == tensors.size(), "batch_key: ", names.size(), " names for ",
              tensors.size(), " tensors");
  BatchKey key;
  Fingerprint layout, content;
  for (size_t i = 0; i < names.size(); ++i) {
    layout.add_bytes(reinterpret_cast<const uint8_t*>(names[i].data()), names[i].size());
    layout.add(~uint64_t{0});  // ends the name
    layout.add(static_cast<uint64_t>(tensors[i].scalar_type()));
    layout.add(static_cast<uint64_t>(tensors[i].dim()));
    for (int64_t size : tensors[i].sizes()) layout.add(static_cast<uint64_t>(size));
    if (check_content) {
      key.contents.push_back(content_digest(tensors[i]));
      content.add(static_cast<uint64_t>(key.contents.back()));
    }
  }
  key.signature = layout.done();
  key.content = check_content ? content.done() : 0;
  return key;
}

namespace {

// Runs `collective` on a C++-owned copy of `tensor` and returns a copy of the result made after
// the wait (see [Note: collectives on C++-owned buffers]).
template <typename Collective>
at::Tensor on_copy(const at::Tensor& tensor, std::chrono::milliseconds timeout, std::string what,
                   Collective collective) {
  std::vector<at::Tensor> buffer{tensor.clone(at::MemoryFormat::Contiguous)};
  Transfer(collective(buffer), buffer[0], std::move(what)).wait(timeout);
  return buffer[0].clone();
}

}  // namespace

at::Tensor broadcast_copy(const at::Tensor& tensor, int64_t root, const std::string& group_name,
                          std::chrono::milliseconds timeout, std::string what,
                          Abortable* abortable) {
  const Route route(group_name);
  const auto& pg = route.group;
  if (tensor.device().is_cpu() && shm_whole_group(*pg, group_name))
    return exchange(route, tensor, {root}, timeout, what, abortable)[root].clone();
  c10d::BroadcastOptions options;
  options.rootRank = root;
  return on_copy(tensor, timeout, std::move(what),
                 [&](std::vector<at::Tensor>& buffer) { return pg->broadcast(buffer, options); });
}

at::Tensor all_reduce_sum_copy(const at::Tensor& tensor, const std::string& group_name,
                               std::chrono::milliseconds timeout, std::string what,
                               Abortable* abortable) {
  const Route route(group_name);
  const auto& pg = route.group;
  if (tensor.device().is_cpu() && shm_whole_group(*pg, group_name)) {
    const auto parts = exchange(route, tensor, every_rank(pg->getSize()), timeout, what, abortable);
    auto sum = parts[0].clone();
    for (size_t r = 1; r < parts.size(); ++r) sum.add_(parts[r]);
    return sum;
  }
  c10d::AllreduceOptions options;
  options.reduceOp = c10d::ReduceOp::SUM;
  return on_copy(tensor, timeout, std::move(what),
                 [&](std::vector<at::Tensor>& buffer) { return pg->allreduce(buffer, options); });
}

int64_t group_rank(const std::string& group_name) { return group(group_name)->getRank(); }
int64_t group_size(const std::string& group_name) { return group(group_name)->getSize(); }

namespace {

// [Note: p2p tokens] An op-level transfer is identified by a token: a 0-d int64 CPU tensor holding
// a key into this registry. Tokens order the ops (every op takes the previous token as `dep`), and
// the registry owns the Transfer until a `wait_*` op consumes it.
class TransferRegistry {
 public:
  static TransferRegistry& get() {
    static TransferRegistry r;
    return r;
  }
  at::Tensor add(Transfer t) {
    const int64_t key = next_.fetch_add(1);
    std::lock_guard<std::mutex> g(mu_);
    live_.emplace(key, std::move(t));
    return at::scalar_tensor(key, at::TensorOptions().dtype(at::kLong));
  }
  Transfer take(const at::Tensor& token) {
    TORCH_CHECK(token.numel() == 1 && token.scalar_type() == at::kLong,
                "pippy_xla: expected a transfer token (0-d int64 tensor), got ", token.sizes(), " ",
                token.scalar_type());
    const int64_t key = token.item<int64_t>();
    std::lock_guard<std::mutex> g(mu_);
    auto it = live_.find(key);
    TORCH_CHECK(it != live_.end(), "pippy_xla: token ", key,
                " names no pending transfer (already waited, or never posted)");
    Transfer t = std::move(it->second);
    live_.erase(it);
    return t;
  }

 private:
  std::atomic<int64_t> next_{1};
  std::mutex mu_;
  std::unordered_map<int64_t, Transfer> live_;
};

std::string op_what(const char* op, int64_t peer, int64_t tag) {
  return c10::str("pippy_xla::", op, " (peer ", peer, ", tag ", tag, ")");
}

at::Tensor send_kernel(const at::Tensor& x, const std::optional<at::Tensor>& /*dep*/, int64_t peer,
                       int64_t tag, c10::string_view group_name) {
  auto what = op_what("send", peer, tag);
  return TransferRegistry::get().add(
      isend(x.contiguous(), peer, tag, std::string(group_name), std::move(what)));
}

at::Tensor recv_kernel(const std::optional<at::Tensor>& /*dep*/, c10::SymIntArrayRef shape,
                       at::ScalarType dtype, at::Device device, int64_t peer, int64_t tag,
                       c10::string_view group_name) {
  auto buffer =
      at::empty(C10_AS_INTARRAYREF_SLOW(shape), at::TensorOptions().dtype(dtype).device(device));
  return TransferRegistry::get().add(
      irecv(buffer, peer, tag, std::string(group_name), op_what("recv", peer, tag)));
}

at::Tensor wait_recv_kernel(const at::Tensor& token, c10::SymIntArrayRef shape,
                            at::ScalarType dtype, at::Device /*device*/, int64_t timeout_ms) {
  auto out = TransferRegistry::get().take(token).wait(std::chrono::milliseconds(timeout_ms));
  TORCH_CHECK(out.sizes() == C10_AS_INTARRAYREF_SLOW(shape) && out.scalar_type() == dtype,
              "pippy_xla::wait_recv: the token's buffer is ", out.sizes(), " ", out.scalar_type(),
              " but the op was asked for ", shape, " ", dtype);
  return out;
}

at::Tensor wait_send_kernel(const at::Tensor& token, int64_t timeout_ms) {
  TransferRegistry::get().take(token).wait(std::chrono::milliseconds(timeout_ms));
  return at::scalar_tensor(0, at::TensorOptions().dtype(at::kLong));
}

// Blocking, differentiable transfers (autograd formulas in pippy_xla/runtime/ops.py): the gradient
// of a send is a receive from the destination, and of a receive a send back to the source.
at::Tensor send_wait_kernel(const at::Tensor& x, int64_t peer, int64_t tag,
                            c10::string_view group_name, int64_t timeout_ms) {
  isend(x.contiguous(), peer, tag, std::string(group_name), op_what("send_wait", peer, tag))
      .wait(std::chrono::milliseconds(timeout_ms));
  return at::zeros({}, x.options().dtype(at::kFloat));
}

at::Tensor recv_wait_kernel(const std::optional<at::Tensor>& /*anchor*/, c10::SymIntArrayRef shape,
                            at::ScalarType dtype, at::Device device, int64_t peer, int64_t tag,
                            c10::string_view group_name, int64_t timeout_ms) {
  auto buffer =
      at::empty(C10_AS_INTARRAYREF_SLOW(shape), at::TensorOptions().dtype(dtype).device(device));
  return irecv(buffer, peer, tag, std::string(group_name), op_what("recv_wait", peer, tag))
      .wait(std::chrono::milliseconds(timeout_ms));
}

}  // namespace

TORCH_LIBRARY(pippy_xla, m) {
  m.def("send(Tensor x, Tensor? dep, int peer, int tag, str group_name) -> Tensor");
  m.def(
      "recv(Tensor? dep, SymInt[] shape, ScalarType dtype, Device device, int peer, int tag, "
      "str group_name) -> Tensor");
  m.def(
      "wait_recv(Tensor token, SymInt[] shape, ScalarType dtype, Device device, int timeout_ms) "
      "-> Tensor");
  m.def("wait_send(Tensor token, int timeout_ms) -> Tensor");
  m.def("send_wait(Tensor x, int peer, int tag, str group_name, int timeout_ms) -> Tensor");
  m.def(
      "recv_wait(Tensor? anchor, SymInt[] shape, ScalarType dtype, Device device, int peer, "
      "int tag, str group_name, int timeout_ms) -> Tensor");
}

TORCH_LIBRARY_IMPL(pippy_xla, CompositeExplicitAutograd, m) {
  m.impl("send", send_kernel);
  m.impl("recv", recv_kernel);
  m.impl("wait_recv", wait_recv_kernel);
  m.impl("wait_send", wait_send_kernel);
  m.impl("send_wait", send_wait_kernel);
  m.impl("recv_wait", recv_wait_kernel);
}

}  // namespace pippy_xla
