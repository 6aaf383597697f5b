// Engine::run, the per-step loop of engine.h: walks this rank's action list, posts receives in
// order and a few ahead of a blocked wait ([Note: receives posted ahead]; in each sender's order
// where transfers match in order, [Note: transfers matched in order] in engine.h), posts sends
// asynchronously and drops them once causally complete, calls the stage's forward on F and
// stashes what B needs, runs B (and W) with the C++ autograd API, reports a stage's gradients
// ready early, and turns a failure into a Failure that abort() can also cause. What it runs by
// and builds on lives beside it: the facts of its schedule in schedule_analysis.cpp (receives to
// post ahead, [Note: send release], [Note: gradients ready]), the boundary header protocol in
// boundary.cpp ([Note: boundary specs] in boundary.h), the split backward of zero-bubble
// schedules in split_backward.cpp ([Note: split backward]), the transfers in transport/p2p.cpp
// ([Note: one send/recv implementation] in transport/p2p.h).
#include "runtime/engine.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/ones_like.h>
#include <ATen/ops/zeros_like.h>
#include <c10/util/Exception.h>
#include <c10/util/ScopeExit.h>
#include <torch/csrc/autograd/autograd.h>

#include <algorithm>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <tuple>

namespace pippy_xla {

namespace {

constexpr int64_t kMaxBoundaryTensors = 64;
enum TagKind { kActivation = 0, kGradient = 1, kHeader = 2 };

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

}  // namespace

HeaderChannel header_channel(const EngineOptions& options) {
  if (options.in_order) return {options.in_order->header_group, c10::Device(c10::kCPU)};
  return {options.group_name, options.device};
}

Engine::Engine(Schedule schedule, EngineOptions options)
    : schedule_(std::move(schedule)),
      options_(std::move(options)),
      header_(header_channel(options_)) {
  validate(schedule_);
  rank_ = group_rank(options_.group_name);
  last_grad_ = last_gradient_actions(schedule_, rank_);
  send_release_ = send_releases(schedule_, static_cast<int32_t>(rank_));
  const auto& mine = schedule_.actions[rank_];
  for (size_t i = 0; i < mine.size(); ++i) receives_ahead_.push_back(receives_ahead(mine, i));
  const int64_t size = group_size(options_.group_name);
  TORCH_CHECK(size == schedule_.num_ranks, "schedule '", schedule_.name, "' is for ",
              schedule_.num_ranks, " ranks but process group '", options_.group_name, "' has ",
              size);
  if (options_.in_order) index_in_order();
  TORCH_CHECK(options_.timeout_ms > 0, "timeout must be positive, got ", options_.timeout_ms,
              " ms");
  // See [Note: transfer tags] in engine.h.
  TORCH_CHECK(tag(kHeader, schedule_.num_stages - 1, schedule_.num_microbatches - 1,
                  kMaxBoundaryTensors - 1) < kInOrderTag,
              "schedule '", schedule_.name, "': ", schedule_.num_stages, " stages x ",
              schedule_.num_microbatches,
              " microbatches need more transfer tags than the engine has");
}

// See [Note: transfers matched in order] in engine.h: by source, this rank's receives in the
// order the source sends them.
void Engine::index_in_order() {
  const auto& mine = schedule_.actions[rank_];
  const int64_t size = schedule_.num_ranks;
  std::map<std::tuple<Op, int64_t, int64_t>, size_t> receive_at;  // (op, stage, mb) -> position
  for (size_t i = 0; i < mine.size(); ++i) {
    const Action& a = mine[i];
    if (a.op == Op::RECV_F || a.op == Op::RECV_B) receive_at[{a.op, a.stage, a.mb}] = i;
    if (a.op == Op::RECV_F) recv_f_pos_[{a.stage, a.mb}] = i;
  }
  const auto& g = *options_.in_order;
  for (const std::string* name : {&g.up_group, &g.down_group, &g.header_group})
    TORCH_CHECK(group_size(*name) == size && group_rank(*name) == rank_, "process group '", *name,
                "' must hold the ranks of '", options_.group_name, "' in its order");
  for (int64_t src = 0; src < schedule_.num_ranks; ++src) {
    if (src == rank_) continue;
    for (const Action& a : schedule_.actions[src]) {
      std::tuple<Op, int64_t, int64_t> key;
      Action next;
      if (a.op == Op::SEND_F && schedule_.next_forward(a.stage, a.mb, &next) &&
          schedule_.stage_rank[next.stage] == rank_) {
        key = {Op::RECV_F, next.stage, next.mb};
      } else if (a.op == Op::SEND_B && schedule_.stage_rank[a.stage - 1] == rank_) {
        key = {Op::RECV_B, a.stage - 1, a.mb};
      } else {
        continue;
      }
      auto it = receive_at.find(key);
      TORCH_CHECK(it != receive_at.end(), "schedule '", schedule_.name, "': rank ", src, " ",
                  op_name(a.op), "s stage ", a.stage, " microbatch ", a.mb, " to rank ", rank_,
                  ", which has no receive for it");
      auto& order = in_order_[src];
      in_order_index_[it->second] = {src, order.size()};
      order.push_back(it->second);
    }
  }
  for (const auto& [key, pos] : receive_at)
    TORCH_CHECK(in_order_index_.count(pos), "schedule '", schedule_.name, "': rank ", rank_,
                " has a receive at position ", pos, " that no rank sends");
}

int32_t Engine::prev_stage(const Action& a) const {
  Action prev;
  TORCH_CHECK(schedule_.prev_forward(a.stage, a.mb, &prev), where(a, "receives from no forward"));
  return prev.stage;
}

std::string Engine::where(const Action& a, const char* what) const {
  return c10::str("[rank ", rank_, " stage ", a.stage, "] ", op_name(a.op), " microbatch ", a.mb,
                  ": ", what);
}

int64_t Engine::tag(int kind, int64_t stage, int64_t mb, int64_t idx) const {
  return ((stage * schedule_.num_microbatches + mb) * 3 + kind) * kMaxBoundaryTensors + idx;
}

void Engine::resolve_routes() {
  route_ = Route(options_.group_name);
  header_route_ = header_.group_name == options_.group_name ? route_ : Route(header_.group_name);
  if (!options_.in_order) return;
  up_route_ = Route(options_.in_order->up_group);
  down_route_ = Route(options_.in_order->down_group);
}

const Route& Engine::group_of(int64_t from, int64_t to) const {
  if (!options_.in_order) return route_;
  return from < to ? up_route_ : down_route_;
}

int64_t Engine::data_tag(int kind, int64_t stage, int64_t mb, int64_t idx) const {
  return options_.in_order ? kInOrderTag : tag(kind, stage, mb, idx);
}

std::vector<at::Tensor> Engine::wait_all(StepState& st, std::vector<Transfer>& ts) {
  const std::chrono::milliseconds timeout(options_.timeout_ms);
  std::vector<at::Tensor> out;
  out.reserve(ts.size());
  for (auto& t : ts) {
    if (t.on_device()) {  // [Note: waits on a GPU] in transport/p2p.h
      out.push_back(t.wait_on_stream());
      st.on_device.add(std::move(t), timeout);
    } else {
      out.push_back(t.wait(timeout));
    }
  }
  ts.clear();
  return out;
}

void Engine::release_send(StepState& st, Transfer& t) {
  const std::chrono::milliseconds timeout(options_.timeout_ms);
  if (t.on_device()) {
    st.on_device.add(std::move(t), timeout);
  } else {
    t.wait(timeout);
  }
}

void Engine::run_action(StepState& st, const Action& a, const StageFn& forward) {
  const int64_t t0 = now_ns();
  compute_start_ns_ = 0;
  switch (a.op) {
    case Op::RECV_F:
      do_recv_f(st, a);
      break;
    case Op::F:
      do_forward(st, a, forward);
      break;
    case Op::SEND_F:
      do_send_f(st, a);
      break;
    case Op::RECV_B:
      do_recv_b(st, a);
      break;
    case Op::B:
      do_backward(st, a);
      break;
    case Op::SEND_B:
      do_send_b(st, a);
      break;
    case Op::W:
      do_weight(st, a);
      break;
  }
  // F and B record their start after their receives completed: waiting is idle time (a gap in
  // the timeline), not part of the action's cost.
  timings_.push_back({a, compute_start_ns_ ? compute_start_ns_ : t0, now_ns()});
}

void Engine::release_known_sends(StepState& st) {
  // Sends known complete now (their wait returns at once) free their tensors here rather than at
  // the end of the step. See [Note: send release].
  for (size_t i : send_release_[st.pos]) {
    auto it = st.sends.find(i);
    if (it == st.sends.end()) continue;
    for (auto& t : it->second) release_send(st, t);
    st.sends.erase(it);
  }
}

void Engine::finish_step(StepState& st) {
  for (auto& [pos, ts] : st.sends)
    for (auto& t : ts) release_send(st, t);
  st.sends.clear();
  st.on_device.finish(std::chrono::milliseconds(options_.timeout_ms), live_);
  if (schedule_.backward) stash_.check_empty();
}

void Engine::run(int64_t signature, const StageFn& forward, const GradsReadyFn& grads_ready) {
  TORCH_CHECK(!broken_ && !live_.aborted(), "[rank ", rank_,
              "] the pipeline engine failed in an earlier step and its peers were left mid-step; "
              "build a new pipeline to go on");
  resolve_routes();
  // Between steps the engine holds no group: one destroyed after a step must be free to go (see
  // [Note: releasing the group at exit] in pippy_xla/runtime/_exit.py).
  const auto release =
      c10::make_scope_exit([this] { route_ = up_route_ = down_route_ = header_route_ = Route(); });
  StepState st;
  st.discover = !specs_.count(signature);
  SignatureSpecs fresh;
  st.specs = st.discover ? &fresh : &specs_.at(signature);
  timings_.clear();
  timings_.reserve(schedule_.actions[rank_].size());
  try {
    const auto& actions = schedule_.actions[rank_];
    st.posted.assign(actions.size(), false);
    std::vector<int64_t> ready;  // stages whose gradients are complete, not yet reported
    for (st.pos = 0; st.pos < actions.size(); ++st.pos) {
      const Action& a = actions[st.pos];
      if (st.posted[st.pos]) continue;  // a receive posted early (see post_ahead)
      if (a.op == Op::RECV_F || a.op == Op::RECV_B) st.posted[st.pos] = true;
      run_action(st, a, forward);
      if (fault_ && *fault_ == a) {
        fault_.reset();
        TORCH_CHECK(false, where(a, "a fault injected after this action"));
      }
      release_known_sends(st);
      if (auto it = last_grad_.find(st.pos); grads_ready && it != last_grad_.end())
        ready.push_back(it->second);
      const bool send_next = st.pos + 1 < actions.size() && (actions[st.pos + 1].op == Op::SEND_B ||
                                                             actions[st.pos + 1].op == Op::SEND_F);
      if (!send_next) {
        for (int64_t stage : ready) grads_ready(stage);
        ready.clear();
      }
    }
    finish_step(st);
  } catch (...) {
    broken_ = true;
    failure_ = failure_of(st, std::current_exception());
    stash_.clear();
    failed_.push_back(std::make_unique<StepState>(std::move(st)));
    live_.clear();
    throw;
  }
  live_.clear();
  if (st.discover) specs_.emplace(signature, std::move(fresh));
}

Engine::~Engine() = default;

void Engine::abort() { live_.abort(); }

Transfer Engine::track(Transfer t) {
  live_.track(t);
  return t;
}

TransferContext Engine::context(const Action& a, int64_t peer, const char* object,
                                int64_t index) const {
  return TransferContext{a.stage, a.mb, peer, op_name(a.op), rank_, object, index};
}

Failure Engine::failure_of(const StepState& st, std::exception_ptr error) const {
  Failure f;
  try {
    std::rethrow_exception(error);
  } catch (const TransferError& e) {
    f.stage = e.context.stage;
    f.microbatch = e.context.microbatch;
    f.peer = e.context.peer;
    f.action = e.context.action;
  } catch (...) {
    const auto& actions = schedule_.actions[rank_];
    if (st.pos < actions.size()) {
      f.stage = actions[st.pos].stage;
      f.microbatch = actions[st.pos].mb;
      f.action = op_name(actions[st.pos].op);
    } else {
      f.action = "end of step (waiting for sends)";
    }
  }
  f.aborted = live_.aborted();
  return f;
}

void Engine::post_ahead(StepState& st, const std::vector<Transfer>& waiting) {
  // [Note: receives posted ahead] Before blocking on a receive, post the next few receives of
  // the action list: the time would be spent waiting anyway, and a gloo send whose receive is
  // already posted goes out at once from the sender, while one that arrives first waits for the
  // receiver's "ready" message (a round trip, and a wake-up of the sender's transport thread
  // during its compute). The window is small so that buffers of microbatches far ahead are not
  // allocated early. Not on a discovery step: its receive shapes come with the headers.
  bool done = true;
  for (const auto& t : waiting) done = done && t.completed();
  if (st.discover || done) return;
  const auto& actions = schedule_.actions[rank_];
  for (size_t j : receives_ahead_[st.pos]) {
    const Action& b = actions[j];
    if (st.posted[j]) continue;
    if (options_.in_order) {
      post_in_order(st, j);
      continue;
    }
    st.posted[j] = true;
    const int64_t t0 = now_ns();
    if (b.op == Op::RECV_F) {
      post_activation_recvs(st, b);
    } else {
      post_gradient_recvs(st, b);
    }
    timings_.push_back({b, t0, now_ns()});
  }
}

void Engine::post_in_order(StepState& st, size_t pos) {
  // [Note: transfers matched in order] Every receive from this source that it sends before the
  // one at `pos` is posted first. Posting one of a discovery step needs its header: the source
  // sent that header before the message this rank is about to wait for, so reading it here
  // waits no longer than that wait would.
  const auto [src, k] = in_order_index_.at(pos);
  const auto& order = in_order_.at(src);
  const auto& actions = schedule_.actions[rank_];
  for (size_t& next = st.in_order_next[src]; next <= k; ++next) {
    const size_t q = order[next];
    const Action& b = actions[q];
    const int64_t t0 = now_ns();
    if (b.op == Op::RECV_F) {
      if (st.discover) {
        if (!st.posted[q]) post_header_recv(st, b);
        read_header(st, b);
      }
      post_activation_recvs(st, b);
    } else {
      post_gradient_recvs(st, b);
    }
    if (!st.posted[q] && q != st.pos) timings_.push_back({b, t0, now_ns()});
    st.posted[q] = true;
  }
}

void Engine::read_header(StepState& st, const Action& a) {
  const Slot slot{a.stage, a.mb};
  auto it = st.headers.find(slot);
  TORCH_CHECK(it != st.headers.end(), where(a, "no header receive was posted"));
  const auto header = it->second.wait(std::chrono::milliseconds(options_.timeout_ms));
  st.specs->in[slot] = decode_header(header);
  st.headers.erase(it);
}

void Engine::do_recv_f(StepState& st, const Action& a) {
  if (st.discover) {
    post_header_recv(st, a);
  } else if (options_.in_order) {
    post_in_order(st, st.pos);
  } else {
    post_activation_recvs(st, a);
  }
}

void Engine::post_header_recv(StepState& st, const Action& a) {
  const int64_t peer = schedule_.stage_rank[prev_stage(a)];
  auto buf = at::empty({kHeaderLen}, at::TensorOptions().dtype(at::kLong).device(header_.device));
  st.headers.emplace(Slot{a.stage, a.mb},
                     track(irecv(buf, peer, tag(kHeader, a.stage, a.mb, 0), header_route_, {},
                                 context(a, peer, "the boundary header"))));
}

void Engine::post_activation_recvs(StepState& st, const Action& a) {
  const int64_t peer = schedule_.stage_rank[prev_stage(a)];
  const Slot slot{a.stage, a.mb};
  auto& ts = st.recv_f[slot];
  const auto& specs = st.specs->in.at(slot);
  for (size_t i = 0; i < specs.size(); ++i) {
    auto buf = at::empty(specs[i].shape,
                         at::TensorOptions().dtype(specs[i].dtype).device(options_.device));
    ts.push_back(track(irecv(buf, peer, data_tag(kActivation, a.stage, a.mb, i),
                             group_of(peer, rank_), {}, context(a, peer, "activation", i))));
  }
}

void Engine::do_forward(StepState& st, const Action& a, const StageFn& forward) {
  const Slot slot{a.stage, a.mb};
  std::vector<at::Tensor> inputs;
  Action prev, next;
  const bool has_prev = schedule_.prev_forward(a.stage, a.mb, &prev);
  if (has_prev && schedule_.stage_rank[prev.stage] != rank_) {
    if (options_.in_order) {
      post_in_order(st, recv_f_pos_.at(slot));
    } else if (st.discover) {
      read_header(st, a);
      post_activation_recvs(st, a);
    }
    post_ahead(st, st.recv_f[slot]);
    inputs = wait_all(st, st.recv_f[slot]);
    st.recv_f.erase(slot);
    const auto& specs = st.specs->in.at(slot);
    for (size_t i = 0; i < inputs.size(); ++i)
      if (specs[i].requires_grad) inputs[i].requires_grad_(true);
  } else if (has_prev) {
    inputs = std::move(st.local_in.at(slot));
    st.local_in.erase(slot);
  }
  compute_start_ns_ = now_ns();
  std::vector<at::Tensor> outputs = forward(a.stage, a.mb, inputs);
  // Outputs that feed another forward: the next stage's, or the next token's on a decode
  // schedule's last stage ([Note: decode schedules] in schedule.h).
  const bool feeds = schedule_.next_forward(a.stage, a.mb, &next);
  if (feeds) {
    TORCH_CHECK(static_cast<int64_t>(outputs.size()) <= kMaxBoundaryTensors,
                where(a, "too many boundary tensors"));
    std::vector<TensorSpec> specs;
    for (const auto& o : outputs) {
      TORCH_CHECK(o.defined(), where(a, "stage returned an undefined tensor"));
      specs.push_back(spec_of(o));
    }
    auto& known = st.specs->out[slot];
    if (st.discover) {
      known = specs;
    } else {
      TORCH_CHECK(known == specs,
                  where(a, c10::str("stage outputs are ", specs_str(specs), " but stage ",
                                    next.stage, " expects ", specs_str(known),
                                    " (agreed the first time this batch shape was seen); boundary "
                                    "tensors must depend only on the batch's shapes")
                               .c_str()));
    }
    if (schedule_.stage_rank[next.stage] == rank_) {
      auto& local = st.local_in[{next.stage, next.mb}];
      for (const auto& o : outputs) local.push_back(o.detach().requires_grad_(o.requires_grad()));
      st.specs->in[{next.stage, next.mb}] = specs;
    }
  }
  if (schedule_.backward) stash_.push(a.stage, a.mb, StashSlot{inputs, outputs});
  // Kept for SEND_F only: a reference held longer would keep the microbatch's graph alive.
  if (feeds && schedule_.stage_rank[next.stage] != rank_) st.fwd_out[slot] = std::move(outputs);
}

void Engine::do_send_f(StepState& st, const Action& a) {
  const Slot slot{a.stage, a.mb};
  Action next;
  TORCH_CHECK(schedule_.next_forward(a.stage, a.mb, &next), where(a, "sends to no forward"));
  const int64_t peer = schedule_.stage_rank[next.stage];
  auto outputs = std::move(st.fwd_out.at(slot));
  st.fwd_out.erase(slot);
  if (st.discover) {
    auto header = encode_header(st.specs->out.at(slot), where(a, "header")).to(header_.device);
    st.sends[st.pos].push_back(
        track(isend(header, peer, tag(kHeader, next.stage, next.mb, 0), header_route_, {},
                    context(a, peer, "the boundary header"))));
  }
  for (size_t i = 0; i < outputs.size(); ++i) {
    st.sends[st.pos].push_back(track(
        isend(outputs[i].detach().contiguous(), peer, data_tag(kActivation, next.stage, next.mb, i),
              group_of(rank_, peer), {}, context(a, peer, "activation", i))));
  }
}

void Engine::do_recv_b(StepState& st, const Action& a) {
  if (options_.in_order) {
    post_in_order(st, st.pos);
  } else {
    post_gradient_recvs(st, a);
  }
}

void Engine::post_gradient_recvs(StepState& st, const Action& a) {
  const Slot slot{a.stage, a.mb};
  const int64_t peer = schedule_.stage_rank[a.stage + 1];
  auto& ts = st.recv_b[slot];
  const auto& specs = st.specs->out.at(slot);
  for (size_t i = 0; i < specs.size(); ++i) {
    if (!specs[i].requires_grad) continue;
    auto buf = at::empty(specs[i].shape,
                         at::TensorOptions().dtype(specs[i].dtype).device(options_.device));
    ts.push_back(track(irecv(buf, peer, data_tag(kGradient, a.stage, a.mb, i),
                             group_of(peer, rank_), {}, context(a, peer, "gradient", i))));
  }
}

void Engine::backward_roots(StepState& st, const Action& a, const StashSlot& saved,
                            std::vector<at::Tensor>& roots, std::vector<at::Tensor>& grads) {
  const Slot slot{a.stage, a.mb};
  if (a.stage == schedule_.num_stages - 1) {
    for (const auto& o : saved.outputs) {
      if (!o.requires_grad()) continue;
      roots.push_back(o);
      grads.push_back(at::ones_like(o));
    }
    TORCH_CHECK(!roots.empty(), where(a,
                                      "the last stage's outputs do not require grad; is the "
                                      "loss detached, or did forward run under no_grad?"));
  } else {
    std::vector<at::Tensor> incoming;
    if (schedule_.stage_rank[a.stage + 1] == rank_) {
      incoming = std::move(st.local_grads.at(slot));
      st.local_grads.erase(slot);
    } else {
      post_ahead(st, st.recv_b.at(slot));
      incoming = wait_all(st, st.recv_b.at(slot));
      st.recv_b.erase(slot);
    }
    size_t j = 0;
    for (const auto& o : saved.outputs) {
      if (!o.requires_grad()) continue;
      TORCH_CHECK(j < incoming.size(), where(a, "fewer gradients than outputs requiring grad"));
      roots.push_back(o);
      grads.push_back(incoming[j++]);
    }
  }
}

void Engine::do_backward(StepState& st, const Action& a) {
  const Slot slot{a.stage, a.mb};
  // With a split backward the slot stays stashed until W when W is the whole backward (no
  // stage inputs need gradients); otherwise W needs only what B hands it.
  const StashSlot saved = stash_.pop(a.stage, a.mb);
  std::vector<at::Tensor> roots, grads;
  backward_roots(st, a, saved, roots, grads);
  compute_start_ns_ = now_ns();
  std::vector<at::Tensor> leaves;
  for (const auto& in : saved.inputs)
    if (in.requires_grad()) leaves.push_back(in);
  std::vector<at::Tensor> input_grads;
  if (schedule_.split_backward) {
    WeightWork work;
    if (!leaves.empty() && !roots.empty()) {
      input_grads = input_gradients(roots, grads, leaves, work);
    } else {
      // No input gradients: W is the whole backward, and the graph stays stashed until then.
      if (!roots.empty()) stash_.push(a.stage, a.mb, saved);
      work.roots = std::move(roots);
      work.grads = std::move(grads);
    }
    st.weight_work[slot] = std::move(work);
  } else {
    if (!roots.empty()) torch::autograd::backward(roots, grads);
    for (const auto& in : leaves) input_grads.push_back(in.grad());
  }
  for (size_t i = 0; i < input_grads.size(); ++i)
    if (!input_grads[i].defined()) input_grads[i] = at::zeros_like(leaves[i]);
  if (a.stage == 0) return;
  if (schedule_.stage_rank[a.stage - 1] == rank_) {
    st.local_grads[{a.stage - 1, a.mb}] = std::move(input_grads);
  } else {
    st.grads_out[slot] = std::move(input_grads);
  }
}

void Engine::do_weight(StepState& st, const Action& a) {
  const Slot slot{a.stage, a.mb};
  auto it = st.weight_work.find(slot);
  TORCH_CHECK(it != st.weight_work.end(), where(a, "W before its B"));
  WeightWork work = std::move(it->second);
  st.weight_work.erase(it);
  if (!work.roots.empty()) {
    torch::autograd::backward(work.roots, work.grads);
    stash_.pop(a.stage, a.mb);
    return;
  }
  weight_gradients(work);  // from what B left: see [Note: split backward]
}

void Engine::do_send_b(StepState& st, const Action& a) {
  const Slot slot{a.stage, a.mb};
  const int64_t peer = schedule_.stage_rank[a.stage - 1];
  auto grads = std::move(st.grads_out.at(slot));
  st.grads_out.erase(slot);
  // Gradient i goes to the i-th input that requires grad, which is output i' of the previous
  // stage; the receiver numbers its gradient receives by output index, so map back.
  const auto& specs = st.specs->in.at(slot);
  size_t j = 0;
  for (size_t i = 0; i < specs.size(); ++i) {
    if (!specs[i].requires_grad) continue;
    st.sends[st.pos].push_back(
        track(isend(grads.at(j++).contiguous(), peer, data_tag(kGradient, a.stage - 1, a.mb, i),
                    group_of(rank_, peer), {}, context(a, peer, "gradient", i))));
  }
}

}  // namespace pippy_xla
