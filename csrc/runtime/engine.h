// Executes one rank's action list (see schedule/schedule.h) every step: transfers, the
// boundary-shape protocol of boundary.h, the stash, backward (split_backward.h for zero-bubble
// schedules).
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

#include "runtime/boundary.h"
#include "runtime/schedule_analysis.h"
#include "runtime/split_backward.h"
#include "runtime/stash.h"
#include "schedule/simulator.h"
#include "transport/p2p.h"

namespace pippy_xla {

// forward(stage, microbatch, inputs) -> outputs. On the last stage the outputs that require grad
// are the backward roots (the microbatch loss).
using StageFn = std::function<std::vector<at::Tensor>(int64_t, int64_t, std::vector<at::Tensor>)>;

// [Note: transfer tags] The engine's transfers use tags below kTiedWeightTagBase (Engine::tag);
// tied-weight transfers outside the engine (pippy_xla/runtime/_ties.py) use two tags per tie from
// it.
constexpr int64_t kTiedWeightTagBase = int64_t{1} << 30;
// The one tag of every activation and gradient transfer of an engine whose transfers are matched
// in order ([Note: transfers matched in order]).
constexpr int64_t kInOrderTag = kTiedWeightTagBase - 1;
inline int64_t tied_weight_tag(int64_t tie) { return kTiedWeightTagBase + 2 * tie; }

// grads_ready(stage): the stage's parameter gradients of this step are complete.
using GradsReadyFn = std::function<void(int64_t)>;

// [Note: transfers matched in order] NCCL ignores tags: the transfers between two ranks match in
// the order each side posts them, and one stream per pair of ranks runs both directions, so a
// receive posted before a send blocks that send until the receive completes. The engine's
// receivers post in their own action order (and ahead of it, [Note: receives posted ahead]),
// which differs from the sender's order in most schedules (a header posted before the previous
// microbatch's activation, a gradient before an activation). With `in_order` set, the engine
// (1) posts its receives from each source in the order the source's action list sends them,
// posting the earlier ones first where it posts one (post_in_order; every rank knows every
// rank's list), (2) sends to higher ranks over `up_group` and to lower ranks over `down_group`,
// two groups of the pipeline's ranks, so that each pair's stream carries one direction, and (3)
// moves the boundary headers of a discovery step over `header_group` (gloo, CPU tensors, matched
// by tag), whose activation receives cannot be posted before their header is read. On the CPU
// the same path runs over gloo groups with one tag (gloo matches a source's messages of one tag
// in order), which is how the tests check the order without a GPU.
struct InOrderGroups {
  std::string up_group, down_group, header_group;
};

struct EngineOptions {
  std::string group_name;
  int64_t timeout_ms = kDefaultTimeoutMs;
  c10::Device device = c10::Device(c10::kCPU);
  std::optional<InOrderGroups> in_order;  // see [Note: transfers matched in order]
};

// Where an engine's boundary headers travel, and with them the step handshake of the Python
// step runner (pippy_xla/runtime/_step.py): the pipeline's group on its device; where transfers are
// matched in order, the header group in host memory, so that on NCCL neither waits behind the
// GPU's queue nor copies its few integers to the GPU and back.
struct HeaderChannel {
  std::string group_name;
  c10::Device device = c10::Device(c10::kCPU);
};
HeaderChannel header_channel(const EngineOptions& options);

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
  // AbortChannel.run_armed (pippy_xla/runtime/failures.py) arms it; its watcher calls it when
  // another rank reports a failure.
  void abort();
  // Where the failed step failed; nullopt while no step has failed.
  const std::optional<Failure>& failure() const { return failure_; }
  // Fault injection, for tests: the next step that runs action `at` on this rank fails right
  // after it (a plain error, as if the stage's code had raised there), so a send or a receive it
  // posted stays in flight, as when a real failure interrupts a step. See [Note: a pipeline's
  // own groups] in pippy_xla/runtime/_build.py.
  void inject_fault(Action at) { fault_ = at; }

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
    size_t pos = 0;                           // index of the running action in this rank's list
    std::vector<bool> posted;                 // receive actions already posted (in order, or ahead)
    std::map<int64_t, size_t> in_order_next;  // by source: receives posted of in_order_[source]
    // Split backward: what W still has to do, per (stage, mb) (see split_backward.h).
    std::map<Slot, WeightWork> weight_work;
    // Transfers of CUDA tensors not waited for on the host ([Note: waits on a GPU],
    // transport/p2p.h).
    DeviceWaits on_device;
  };

  void index_in_order();  // fills in_order_, in_order_index_ and recv_f_pos_
  // Runs action `a` of the step and records its timing.
  void run_action(StepState& st, const Action& a, const StageFn& forward);
  // Releases the sends that the action at st.pos proved complete ([Note: send release]).
  void release_known_sends(StepState& st);
  // Releases the step's last sends, checks its device transfers and that the stash is empty.
  void finish_step(StepState& st);
  void post_ahead(StepState& st, const std::vector<Transfer>& waiting);
  void post_in_order(StepState& st, size_t pos);
  void read_header(StepState& st, const Action& a);
  void do_recv_f(StepState& st, const Action& a);
  void post_header_recv(StepState& st, const Action& a);
  void post_activation_recvs(StepState& st, const Action& a);
  void post_gradient_recvs(StepState& st, const Action& a);
  void do_forward(StepState& st, const Action& a, const StageFn& forward);
  void do_send_f(StepState& st, const Action& a);
  void do_recv_b(StepState& st, const Action& a);
  // The outputs of (stage, mb) that B differentiates and their incoming gradients: ones for the
  // last stage's loss, else the next stage's input gradients (received, or from this rank).
  void backward_roots(StepState& st, const Action& a, const StashSlot& saved,
                      std::vector<at::Tensor>& roots, std::vector<at::Tensor>& grads);
  void do_backward(StepState& st, const Action& a);
  void do_send_b(StepState& st, const Action& a);
  void do_weight(StepState& st, const Action& a);
  // The received tensors of `ts`: waited for on the host, or on the stream for CUDA tensors.
  std::vector<at::Tensor> wait_all(StepState& st, std::vector<Transfer>& ts);
  // A send that may go: waited for on the host, or (a CUDA tensor) checked at the end of the step.
  void release_send(StepState& st, Transfer& t);
  Transfer track(Transfer t);  // registers its work for abort()
  // A transfer of `a` with `peer`, described only if it fails (see TransferContext).
  TransferContext context(const Action& a, int64_t peer, const char* object,
                          int64_t index = -1) const;
  Failure failure_of(const StepState& st, std::exception_ptr error) const;
  std::string where(const Action& a, const char* what) const;
  // The stage whose forward sends `a`'s (a RECV_F's or F's) inputs (see Schedule::prev_forward).
  int32_t prev_stage(const Action& a) const;
  int64_t tag(int kind, int64_t stage, int64_t mb, int64_t idx) const;
  // Looks up the step's groups (see [Note: routes] in transport/p2p.h).
  void resolve_routes();
  // The group and tag of an activation or gradient transfer from rank `from` to rank `to`.
  const Route& group_of(int64_t from, int64_t to) const;
  int64_t data_tag(int kind, int64_t stage, int64_t mb, int64_t idx) const;

  Schedule schedule_;
  EngineOptions options_;
  HeaderChannel header_;  // header_channel(options_)
  int64_t rank_ = 0;
  std::map<int64_t, SignatureSpecs> specs_;
  std::map<size_t, int64_t> last_grad_;            // index of a stage's last B (or W) -> its stage
  std::vector<std::vector<size_t>> send_release_;  // see [Note: send release] (schedule_analysis)
  std::vector<std::vector<size_t>> receives_ahead_;  // per action position, see receives_ahead
  // With options_.in_order: by source rank, the positions of this rank's receive actions from it
  // in the order the source sends them; by position, (source, index there) of a receive action.
  std::map<int64_t, std::vector<size_t>> in_order_;
  std::map<size_t, std::pair<int64_t, size_t>> in_order_index_;
  std::map<Slot, size_t> recv_f_pos_;  // in order: the receive action of a slot's inputs
  Stash stash_;
  std::vector<ActionTiming> timings_;
  int64_t compute_start_ns_ = 0;  // set by F / B once their inputs are there
  bool broken_ = false;
  std::optional<Failure> failure_;
  std::optional<Action> fault_;  // see inject_fault
  Abortable live_;  // the running step's transfers (abort() runs on another thread)
  // The running step's groups: options_.group_name's, header_'s and, in order, the up and down
  // groups (resolve_routes; released when the step ends).
  Route route_, up_route_, down_route_, header_route_;
  std::vector<std::unique_ptr<StepState>>
      failed_;  // transfers of failed steps stay alive: peers may still write
};

}  // namespace pippy_xla
