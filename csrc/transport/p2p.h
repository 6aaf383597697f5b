// Point-to-point transfers over a c10d process group, shared by the custom ops and the engine,
// and the pipeline's two small collectives.
// [Note: one send/recv implementation] The `pippy_xla::send/recv/wait_*` ops (p2p.cpp) and the
// engine (engine.cpp) both go through `isend` / `irecv` below, so there is exactly one code path
// that touches c10d.
#pragma once

#include <ATen/core/Tensor.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "transport/c10d_fwd.h"

namespace pippy_xla {

// How long a transfer waits when the caller names no timeout: the engine's default
// (EngineOptions::timeout_ms) and the ops' Python wrappers' (pippy_xla/runtime/ops.py, which reads
// it as _C.DEFAULT_TIMEOUT_MS).
constexpr int64_t kDefaultTimeoutMs = 300000;

// What a transfer is part of, for errors: set by the engine (the ops leave it empty). With
// `object` set and no `what`, a transfer's description is written from these fields only when an
// error needs it: formatting it for every transfer cost more than posting the transfer.
struct TransferContext {
  int64_t stage = -1;
  int64_t microbatch = -1;
  int64_t peer = -1;
  std::string action;  // "RF", "SF", "RB", "SB"
  int64_t rank = -1;
  const char* object = nullptr;  // "activation", "gradient", "the boundary header"
  int64_t index = -1;            // which activation or gradient (-1: none)
};

// `what`, or (empty) the description the engine's context makes:
// "[rank 1 stage 2] SF microbatch 3: send of activation 0 to rank 2".
std::string describe(const std::string& what, const TransferContext& context);

// A transfer that failed or timed out; `what()` starts with the transfer's description.
class TransferError : public std::runtime_error {
 public:
  TransferError(const std::string& message, TransferContext context)
      : std::runtime_error(message), context(std::move(context)) {}
  TransferContext context;
};

class Abortable;

// An in-flight transfer. Owns its c10d Work and keeps the tensor it reads from or writes into
// alive until it completes (gloo and NCCL write into / read from the buffer asynchronously).
class Transfer {
 public:
  Transfer() = default;
  // `done_when_posted`: the work completed as it was posted (a send over shared memory).
  Transfer(c10::intrusive_ptr<c10d::Work> work, at::Tensor tensor, std::string what,
           TransferContext context = {}, bool done_when_posted = false);
  Transfer(Transfer&&) noexcept;
  Transfer& operator=(Transfer&&) noexcept;
  Transfer(const Transfer&) = delete;
  Transfer& operator=(const Transfer&) = delete;
  ~Transfer();

  bool completed() const;
  // Waits up to `timeout`; on failure throws a TransferError that starts with its description
  // (`describe`: it names rank, stage, microbatch and action). Returns the tensor (the received
  // data for a receive).
  at::Tensor wait(std::chrono::milliseconds timeout);
  // A transfer of a CUDA tensor (see [Note: waits on a GPU]).
  bool on_device() const { return tensor_.defined() && tensor_.is_cuda(); }
  // Makes the current stream wait for the transfer, not the host, and returns the tensor; the
  // transfer stays posted until a DeviceWaits checks it.
  at::Tensor wait_on_stream();
  // Checks the work every 20 us until it completes; throws a TransferError once `live` (if given)
  // aborts, or past `deadline` the error of a wait that ran out of `timeout`.
  void poll(std::chrono::steady_clock::time_point deadline, std::chrono::milliseconds timeout,
            const Abortable* live) const;
  // The c10d work, for aborting it from another thread (Work::abort wakes a blocked wait).
  const c10::intrusive_ptr<c10d::Work>& work() const { return work_; }
  bool done_when_posted() const { return done_when_posted_; }

 private:
  c10::intrusive_ptr<c10d::Work> work_;
  at::Tensor tensor_;
  std::string what_;
  TransferContext context_;
  bool done_when_posted_ = false;

  [[noreturn]] void throw_timed_out(std::chrono::milliseconds timeout) const;
};

// Transfers that another thread may abort (c10d::Work::abort wakes their waits): an engine's
// step, or a watched collective over shared memory (see [Note: watched collectives] in
// pippy_xla/runtime/failures.py). Thread-safe.
class Abortable {
 public:
  Abortable();
  ~Abortable();  // out of line: c10d::Work is incomplete here
  // Registers `t`'s work for abort() (unless it completed when posted); aborts it at once if
  // abort() already ran.
  void track(const Transfer& t);
  void abort();
  bool aborted() const { return aborted_.load(); }
  // Forgets the registered works (their step or collective ended).
  void clear();

 private:
  std::atomic<bool> aborted_{false};
  std::mutex mu_;
  // Weak: a strong reference would keep the Work, and with it the tensor it sends or receives
  // into, alive until the end of the step (measured: one boundary tensor per transfer).
  std::vector<c10::weak_intrusive_ptr<c10d::Work>> live_;
};

// [Note: waits on a GPU] torch's `WorkNCCL::wait(timeout)` makes the current stream wait for the
// NCCL stream and then, whenever a timeout is given, blocks the calling thread until the work has
// completed on the GPU, polling with a sleep in between (torch 2.11's ProcessGroupNCCL.cpp; without
// a timeout it only makes the stream wait). An engine that waited for each transfer with its
// timeout stopped its host at every receive until the data had arrived, and at every send release
// until the peer had taken it; the GPU then idled while the host launched the next kernels (one
// H100, two ranks over NCCL: gaps of 0.3-5 ms between actions, `benchmarks/results/gpu_check.md`).
// So a transfer of a CUDA tensor is waited for on the stream (a receive: the kernels that read the
// data are queued behind it) or not at all (a send: NCCL keeps its tensor until it completes), and
// its work goes to a DeviceWaits, which checks it on the host, with the timeout, at the end of the
// step: a dead peer still ends the step with an error within the timeout, not a hang. Transfers
// of CPU tensors (gloo, shared memory) wait on the host as before: their data is needed there.
// Where the host must wait for a CUDA transfer (the small collectives, whose results it reads),
// Transfer::wait polls the work itself every 20 us before NCCL's wait, which would sleep a
// millisecond or more between its checks.
// DeviceWaits polls `Work::isCompleted`, which NCCL's and the shared-memory works answer as the
// transfer progresses (gloo's point-to-point works only learn it in their wait).
class DeviceWaits {
 public:
  // Keeps `t` until it is checked. Kept transfers already complete are checked on the way (their
  // errors raised) and dropped, so that their tensors go.
  void add(Transfer t, std::chrono::milliseconds timeout);
  // Waits on the host until every kept transfer has completed, `timeout` for all of them, and
  // raises the first failure (as Transfer::wait); an abort of `live` ends the wait at once, with
  // an error.
  void finish(std::chrono::milliseconds timeout, const Abortable& live);

 private:
  std::vector<Transfer> pending_;
};

struct Attached;  // a group's same-host channels (shm.cpp)

// [Note: routes] A transfer goes through the process group registered under its group's name and,
// where its ranks share a host, that group's shared-memory channels ([Note: same-host transport]).
// Looking both up by name (two registries, each behind a lock) took 0.6-1 us of every transfer
// on the 2-core machine, a fifth of an engine's send action. A Route holds both, looked up once:
// the engine resolves its groups at the start of each step (so a group registered again under the
// same name between steps is found) and posts its transfers through them.
struct Route {
  Route();
  // The group registered under `group_name` now (an error if none is) and its channels, if any.
  explicit Route(const std::string& group_name);
  Route(const Route&);
  Route& operator=(const Route&);
  ~Route();  // out of line: c10d::ProcessGroup is incomplete here
  c10::intrusive_ptr<c10d::ProcessGroup> group;
  std::shared_ptr<Attached> channels;  // null: none attached
};

// Posts an asynchronous send of one dense contiguous tensor to group-local rank `peer`.
Transfer isend(const at::Tensor& tensor, int64_t peer, int64_t tag, const Route& route,
               std::string what, TransferContext context = {});
Transfer isend(const at::Tensor& tensor, int64_t peer, int64_t tag, const std::string& group_name,
               std::string what, TransferContext context = {});
// Posts an asynchronous receive into `buffer` (dense, contiguous) from group-local rank `peer`.
Transfer irecv(at::Tensor buffer, int64_t peer, int64_t tag, const Route& route, std::string what,
               TransferContext context = {});
Transfer irecv(at::Tensor buffer, int64_t peer, int64_t tag, const std::string& group_name,
               std::string what, TransferContext context = {});

// [Note: collectives on C++-owned buffers] torch keeps a tensor's Python object alive while C++
// holds references to it, and drops it (taking the GIL) when the last C++ reference goes. gloo's
// worker threads release a collective's tensors after the caller's wait has returned (NCCL's
// watchdog thread holds its works in the same way); if the caller's interpreter is finalizing by
// then (the program's last step, then exit), that GIL acquire ends the thread inside a noexcept
// destructor and the process dies with "terminate called without an active exception" (SIGABRT). So
// the collectives a step runs go through these two functions: their buffers are created here and
// never reach Python, and what they return is a copy made after the wait. Where they run over
// shared memory ([Note: small collectives over shared memory] in p2p.cpp) `abortable`, if given,
// can end their waits from another thread; over the group's backend it is not used.

// Every rank's `values` (the same count on every rank), in group rank order, gathered on `device`
// (the group's backend's device).
std::vector<std::vector<int64_t>> all_gather_int64(
    const std::vector<int64_t>& values, const std::string& group_name, c10::Device device,
    std::chrono::milliseconds timeout, std::string what, Abortable* abortable = nullptr);
// A 64-bit fingerprint of `tensor`'s bytes (copied to the host first if it lives elsewhere), to
// compare the batches that ranks were given; not a cryptographic hash.
int64_t content_digest(const at::Tensor& tensor);

// What the step handshake compares ([Note: step handshake] in pippy_xla/runtime/_batch.py): a
// fingerprint of a batch's input names, dtypes and shapes, and, when `check_content`, of its values
// (`contents`: each input's content_digest, in the order given; `content`: theirs, 0 when off).
struct BatchKey {
  int64_t signature = 0;
  int64_t content = 0;
  std::vector<int64_t> contents;
};
BatchKey batch_key(const std::vector<std::string>& names, const std::vector<at::Tensor>& tensors,
                   bool check_content);
// A copy of group-local rank `root`'s `tensor` (every rank passes a tensor of the same shape and
// dtype).
at::Tensor broadcast_copy(const at::Tensor& tensor, int64_t root, const std::string& group_name,
                          std::chrono::milliseconds timeout, std::string what,
                          Abortable* abortable = nullptr);
// The element-wise sum of every rank's `tensor` (same shape and dtype on every rank), as a copy.
at::Tensor all_reduce_sum_copy(const at::Tensor& tensor, const std::string& group_name,
                               std::chrono::milliseconds timeout, std::string what,
                               Abortable* abortable = nullptr);

int64_t group_rank(const std::string& group_name);
int64_t group_size(const std::string& group_name);

}  // namespace pippy_xla
