// Executes one rank's action list (see schedule.h) every step: transfers, the boundary-shape
// protocol of boundary.h, the stash, backward (split_backward.h for zero-bubble schedules).
#pragma once

#include <c10/core/Device.h>

#include <atomic>
#include <chrono>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "boundary.h"
#include "ops/p2p.h"
#include "schedule.h"
#include "schedule_analysis.h"
#include "split_backward.h"
#include "stash.h"

namespace pippy_xla {

// forward(stage, microbatch, inputs) -> outputs. On the last stage the outputs that require grad
// are the backward roots (the microbatch loss).
using StageFn = std::function<std::vector<at::Tensor>(int64_t, int64_t, std::vector<at::Tensor>)>;

// [Note: transfer tags] The engine's transfers use tags below kTiedWeightTagBase (Engine::tag);
// tied-weight transfers outside the engine (pippy_xla/_ties.py) use two tags per tie from it.
constexpr int64_t kTiedWeightTagBase = int64_t{1} << 30;
inline int64_t tied_weight_tag(int64_t tie) { return kTiedWeightTagBase + 2 * tie; }

// grads_ready(stage): the stage's parameter gradients of this step are complete.
using GradsReadyFn = std::function<void(int64_t)>;

struct EngineOptions {
  std::string group_name;
  int64_t timeout_ms = kDefaultTimeoutMs;
  c10::Device device = c10::Device(c10::kCPU);
};

struct ActionTiming {
  Action action;
  int64_t start_ns;  // system clock, so ranks on one host share a time base; for F and B, the
                     // moment their received inputs were there (waiting is not counted)
  int64_t end_ns;
};

// Where a step failed: the action and, for a transfer, the peer (-1 if none).
struct Failure {
  int64_t stage = -1;
  int64_t microbatch = -1;
  int64_t peer = -1;
  std::string action;
  bool aborted = false;  // the step was aborted by abort() (a peer failed), not by its own error
};

class Engine {
 public:
  Engine(Schedule schedule, EngineOptions options);
  ~Engine();  // out of line: c10d::Work is incomplete here

  // Runs one step of the schedule. `signature` identifies the batch's shapes and dtypes and must
  // be the same on every rank (the caller checks that). Throws on any error; the engine then
  // refuses further steps, since peers are left mid-step.
  void run(int64_t signature, const StageFn& forward, const GradsReadyFn& grads_ready = {});

  // [Note: aborting a step] Thread-safe: wakes every transfer wait of the running step (c10d's
  // Work::abort), so run() throws instead of waiting out the timeout, and refuses later steps.
  // AbortChannel.watch (pippy_xla/errors.py) calls it when another rank reports a failure.
  void abort();
  // Where the failed step failed; nullopt while no step has failed.
  const std::optional<Failure>& failure() const { return failure_; }

  const Schedule& schedule() const { return schedule_; }
  int64_t rank() const { return rank_; }
  const std::vector<ActionTiming>& timings() const { return timings_; }
  const Stash& stash() const { return stash_; }
  Stash& stash() { return stash_; }

 private:
  using Slot = std::pair<int64_t, int64_t>;  // (stage, microbatch)
  struct SignatureSpecs {
    std::map<Slot, std::vector<TensorSpec>> in;   // tensors entering (stage, mb)
    std::map<Slot, std::vector<TensorSpec>> out;  // tensors leaving (stage, mb) forward
  };
  struct StepState {
    bool discover = false;
    SignatureSpecs* specs = nullptr;
    std::map<Slot, Transfer> headers;  // discovery: posted header receives
    std::map<Slot, std::vector<Transfer>> recv_f, recv_b;
    std::map<Slot, std::vector<at::Tensor>> fwd_out, local_in, grads_out, local_grads;
    std::map<size_t, std::vector<Transfer>> sends;  // by the position of their send action
    size_t pos = 0;            // index of the running action in this rank's list
    std::vector<bool> posted;  // receive actions already posted (in order, or ahead)
    // Split backward: what W still has to do, per (stage, mb) (see split_backward.h).
    std::map<Slot, WeightWork> weight_work;
  };

  void post_ahead(StepState& st, const std::vector<Transfer>& waiting);
  void do_recv_f(StepState& st, const Action& a);
  void post_activation_recvs(StepState& st, const Action& a);
  void do_forward(StepState& st, const Action& a, const StageFn& forward);
  void do_send_f(StepState& st, const Action& a);
  void do_recv_b(StepState& st, const Action& a);
  void do_backward(StepState& st, const Action& a);
  void do_send_b(StepState& st, const Action& a);
  void do_weight(StepState& st, const Action& a);
  std::vector<at::Tensor> wait_all(std::vector<Transfer>& ts);
  Transfer track(Transfer t);  // registers its work for abort()
  // A transfer of `a` with `peer`, described only if it fails (see TransferContext).
  TransferContext context(const Action& a, int64_t peer, const char* object,
                          int64_t index = -1) const;
  Failure failure_of(const StepState& st, std::exception_ptr error) const;
  std::string where(const Action& a, const char* what) const;
  int64_t tag(int kind, int64_t stage, int64_t mb, int64_t idx) const;

  Schedule schedule_;
  EngineOptions options_;
  int64_t rank_ = 0;
  std::map<int64_t, SignatureSpecs> specs_;
  std::map<size_t, int64_t> last_grad_;            // index of a stage's last B (or W) -> its stage
  std::vector<std::vector<size_t>> send_release_;  // see [Note: send release] (schedule_analysis)
  std::vector<std::vector<size_t>> receives_ahead_;  // per action position, see receives_ahead
  Stash stash_;
  std::vector<ActionTiming> timings_;
  int64_t compute_start_ns_ = 0;  // set by F / B once their inputs are there
  bool broken_ = false;
  std::optional<Failure> failure_;
  Abortable live_;  // the running step's transfers (abort() runs on another thread)
  std::vector<std::unique_ptr<StepState>>
      failed_;  // transfers of failed steps stay alive: peers may still write
};

}  // namespace pippy_xla
