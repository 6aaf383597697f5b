#include "engine.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/ones_like.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/zeros_like.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <set>
#include <sstream>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <tuple>
#include <unordered_map>
#include <unordered_set>

namespace pippy_xla {

namespace {

constexpr int64_t kHeaderLen = 512;
constexpr int64_t kMaxBoundaryTensors = 64;
enum TagKind { kActivation = 0, kGradient = 1, kHeader = 2 };

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

TensorSpec spec_of(const at::Tensor& t) {
  return TensorSpec{t.sizes().vec(), t.scalar_type(), t.requires_grad()};
}

std::string specs_str(const std::vector<TensorSpec>& specs) {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < specs.size(); ++i) os << (i ? ", " : "") << specs[i].str();
  os << "]";
  return os.str();
}

at::Tensor encode_header(const std::vector<TensorSpec>& specs, const std::string& where) {
  std::vector<int64_t> h{static_cast<int64_t>(specs.size())};
  for (const auto& s : specs) {
    h.push_back(static_cast<int64_t>(s.dtype));
    h.push_back(s.requires_grad ? 1 : 0);
    h.push_back(static_cast<int64_t>(s.shape.size()));
    h.insert(h.end(), s.shape.begin(), s.shape.end());
  }
  TORCH_CHECK(static_cast<int64_t>(h.size()) <= kHeaderLen, where,
              ": boundary specs too large for one header: ", specs_str(specs));
  auto out = at::zeros({kHeaderLen}, at::TensorOptions().dtype(at::kLong));
  std::copy(h.begin(), h.end(), out.data_ptr<int64_t>());
  return out;
}

std::vector<TensorSpec> decode_header(const at::Tensor& received) {
  const at::Tensor header = received.cpu();
  const int64_t* h = header.data_ptr<int64_t>();
  std::vector<TensorSpec> specs(static_cast<size_t>(h[0]));
  int64_t i = 1;
  for (auto& s : specs) {
    s.dtype = static_cast<at::ScalarType>(h[i++]);
    s.requires_grad = h[i++] != 0;
    const int64_t nd = h[i++];
    s.shape.assign(h + i, h + i + nd);
    i += nd;
  }
  return specs;
}

using torch::autograd::Edge;
using torch::autograd::Node;
using torch::autograd::variable_list;

// Records the gradients flowing into a node the first time it runs.
struct CaptureGrads : torch::autograd::FunctionPreHook {
  explicit CaptureGrads(std::shared_ptr<variable_list> out) : out_(std::move(out)) {}
  variable_list operator()(const variable_list& grads) override {
    if (out_->empty()) *out_ = grads;
    return grads;
  }
  std::shared_ptr<variable_list> out_;
};

// Records the gradients a node computed (its outputs) the first time it runs.
struct CaptureOutputs : torch::autograd::FunctionPostHook {
  explicit CaptureOutputs(std::shared_ptr<variable_list> out) : out_(std::move(out)) {}
  variable_list operator()(const variable_list& outputs, const variable_list& /*inputs*/) override {
    if (out_->empty()) *out_ = outputs;
    return outputs;
  }
  std::shared_ptr<variable_list> out_;
};

// Backward from `edges` (with gradients `values`) into the parameters' `.grad`, freeing what
// the nodes saved as they run.
void accumulate_from(const torch::autograd::edge_list& edges, const variable_list& values) {
  if (edges.empty()) return;
  torch::autograd::Engine::get_default_engine().execute(
      edges, values, /*keep_graph=*/false, /*create_graph=*/false, /*accumulate_grad=*/true);
}

// Nodes of the graph below `roots` from which one of `leaves` (accumulators of the stage inputs)
// can be reached: the nodes an input-gradient backward runs.
std::unordered_set<Node*> input_closure(const std::vector<Node*>& roots,
                                        const std::unordered_set<Node*>& leaves) {
  std::unordered_map<Node*, int> state;  // 1: on stack, 2: done
  std::unordered_set<Node*> reach;
  std::vector<std::pair<Node*, size_t>> stack;
  for (Node* r : roots) {
    if (!r || state.count(r)) continue;
    stack.emplace_back(r, 0);
    state[r] = 1;
    while (!stack.empty()) {
      auto& [node, next] = stack.back();
      const auto& edges = node->next_edges();
      if (next < edges.size()) {
        Node* child = edges[next++].function.get();
        if (child && !state.count(child)) {
          state[child] = 1;
          stack.emplace_back(child, 0);
        }
        continue;
      }
      bool hit = leaves.count(node) > 0;
      for (const auto& e : edges)
        if (e.function && (reach.count(e.function.get()) || leaves.count(e.function.get())))
          hit = true;
      if (hit) reach.insert(node);
      state[node] = 2;
      stack.pop_back();
    }
  }
  return reach;
}

}  // namespace

std::string TensorSpec::str() const {
  std::ostringstream os;
  os << c10::toString(dtype) << c10::IntArrayRef(shape) << (requires_grad ? " requires_grad" : "");
  return os.str();
}

/* [Note: gradients ready]
A data-parallel wrapper (pipeline.py, with FSDP2 or replicate) reduces a stage's gradients over its
replicas once the stage's last gradient action of the step is done: its last B, or its last W when
backward is split. run() calls grads_ready(stage) then, but only after the sends that directly
follow that action were posted, so the previous stage's rank gets its gradients before this rank
blocks in the reduction: the reduction runs while earlier stages finish their cooldown. */
static std::map<size_t, int64_t> last_gradient_actions(const Schedule& s, int64_t rank) {
  if (!s.backward) return {};
  const Op grad_op = s.split_backward ? Op::W : Op::B;
  std::map<int64_t, size_t> last;  // stage -> index of its last gradient action
  const auto& actions = s.actions[rank];
  for (size_t i = 0; i < actions.size(); ++i)
    if (actions[i].op == grad_op) last[actions[i].stage] = i;
  std::map<size_t, int64_t> out;
  for (const auto& [stage, i] : last) out[i] = stage;
  return out;
}

Engine::Engine(Schedule schedule, EngineOptions options)
    : schedule_(std::move(schedule)), options_(std::move(options)) {
  validate(schedule_);
  rank_ = group_rank(options_.group_name);
  last_grad_ = last_gradient_actions(schedule_, rank_);
  send_release_ = send_releases(schedule_, static_cast<int32_t>(rank_));
  const int64_t size = group_size(options_.group_name);
  TORCH_CHECK(size == schedule_.num_ranks, "schedule '", schedule_.name, "' is for ",
              schedule_.num_ranks, " ranks but process group '", options_.group_name, "' has ",
              size);
  TORCH_CHECK(options_.timeout_ms > 0, "timeout must be positive, got ", options_.timeout_ms,
              " ms");
  // Tags at and above 2^30 belong to transfers outside the engine (tied weights, pipeline.py).
  TORCH_CHECK(tag(kHeader, schedule_.num_stages - 1, schedule_.num_microbatches - 1,
                  kMaxBoundaryTensors - 1) < (int64_t{1} << 30),
              "schedule '", schedule_.name, "': ", schedule_.num_stages, " stages x ",
              schedule_.num_microbatches,
              " microbatches need more transfer tags than the engine has");
}

std::string Engine::where(const Action& a, const char* what) const {
  return c10::str("[rank ", rank_, " stage ", a.stage, "] ", op_name(a.op), " microbatch ", a.mb,
                  ": ", what);
}

int64_t Engine::tag(int kind, int64_t stage, int64_t mb, int64_t idx) const {
  return ((stage * schedule_.num_microbatches + mb) * 3 + kind) * kMaxBoundaryTensors + idx;
}

std::vector<at::Tensor> Engine::wait_all(std::vector<Transfer>& ts) {
  std::vector<at::Tensor> out;
  out.reserve(ts.size());
  for (auto& t : ts) out.push_back(t.wait(std::chrono::milliseconds(options_.timeout_ms)));
  ts.clear();
  return out;
}

void Engine::run(int64_t signature, const StageFn& forward, const GradsReadyFn& grads_ready) {
  TORCH_CHECK(!broken_ && !aborted_, "[rank ", rank_,
              "] the pipeline engine failed in an earlier step and its peers were left mid-step; "
              "restart the job");
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
      // F and B record their start after their receives completed: waiting is idle time (a
      // gap in the timeline), not part of the action's cost.
      timings_.push_back({a, compute_start_ns_ ? compute_start_ns_ : t0, now_ns()});
      // Sends known complete now (their wait returns at once) free their tensors here rather
      // than at the end of the step. See [Note: send release].
      for (size_t i : send_release_[st.pos]) {
        auto it = st.sends.find(i);
        if (it == st.sends.end()) continue;
        for (auto& t : it->second) t.wait(std::chrono::milliseconds(options_.timeout_ms));
        st.sends.erase(it);
      }
      if (auto it = last_grad_.find(st.pos); grads_ready && it != last_grad_.end())
        ready.push_back(it->second);
      const bool send_next = st.pos + 1 < actions.size() && (actions[st.pos + 1].op == Op::SEND_B ||
                                                             actions[st.pos + 1].op == Op::SEND_F);
      if (!send_next) {
        for (int64_t stage : ready) grads_ready(stage);
        ready.clear();
      }
    }
    for (auto& [pos, ts] : st.sends)
      for (auto& t : ts) t.wait(std::chrono::milliseconds(options_.timeout_ms));
    st.sends.clear();
    if (schedule_.backward) stash_.check_empty();
  } catch (...) {
    broken_ = true;
    failure_ = failure_of(st, std::current_exception());
    stash_.clear();
    failed_.push_back(std::make_unique<StepState>(std::move(st)));
    {
      std::lock_guard<std::mutex> g(live_mu_);
      live_.clear();
    }
    throw;
  }
  {
    std::lock_guard<std::mutex> g(live_mu_);
    live_.clear();
  }
  if (st.discover) specs_.emplace(signature, std::move(fresh));
}

Engine::~Engine() = default;

void Engine::abort() {
  aborted_ = true;
  std::lock_guard<std::mutex> g(live_mu_);
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

Transfer Engine::track(Transfer t) {
  std::lock_guard<std::mutex> g(live_mu_);
  // Weak: a strong reference would keep the Work, and with it the tensor it sends or receives
  // into, alive until the end of the step (measured: one boundary tensor per transfer).
  live_.erase(std::remove_if(live_.begin(), live_.end(), [](const auto& w) { return w.expired(); }),
              live_.end());
  live_.push_back(c10::weak_intrusive_ptr<c10d::Work>(t.work()));
  if (aborted_) {  // abort() ran just before this transfer was posted
    try {
      t.work()->abort();
    } catch (const std::exception&) {
    }
  }
  return t;
}

TransferContext Engine::context(const Action& a, int64_t peer) const {
  return TransferContext{a.stage, a.mb, peer, op_name(a.op)};
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
  f.aborted = aborted_;
  return f;
}

// [Note: send release] A gloo send's Work reports completion only once waited on (is_completed()
// stays false until wait(), measured with torch 2.13), so finished sends cannot be polled, and
// until the end of the step they would keep every sent activation and gradient alive: on a middle
// stage one or more boundary tensors per microbatch. Causality tells when a send is done: a peer
// consumes it in an F or B that first waits on its receive; any transfer the peer sends this rank
// after that action was posted after our data arrived. So once this rank's F or B has received
// that later transfer, waiting on our send returns at once, and the engine drops it there.
std::vector<std::vector<size_t>> send_releases(const Schedule& s, int32_t rank) {
  const auto& mine = s.actions[rank];
  std::vector<std::vector<size_t>> out(mine.size());
  auto position = [&](int32_t r, Op op, int32_t stage, int32_t mb, size_t from = 0) {
    const auto& acts = s.actions[r];
    for (size_t k = from; k < acts.size(); ++k)
      if (acts[k].op == op && acts[k].stage == stage && acts[k].mb == mb) return k;
    return acts.size();
  };
  // The F or B on the receiving rank that waits for the data of send action `a`.
  auto consumer = [&](const Action& a) {
    const int32_t to = a.op == Op::SEND_F ? a.stage + 1 : a.stage - 1;
    return std::make_pair(s.stage_rank[to], Action{a.op == Op::SEND_F ? Op::F : Op::B, to, a.mb});
  };
  for (size_t i = 0; i < mine.size(); ++i) {
    if (mine[i].op != Op::SEND_F && mine[i].op != Op::SEND_B) continue;
    const auto [peer, use] = consumer(mine[i]);
    const auto& theirs = s.actions[peer];
    const size_t c = position(peer, use.op, use.stage, use.mb);
    for (size_t k = c + 1; k < theirs.size(); ++k) {
      const Action& b = theirs[k];
      if (b.op != Op::SEND_F && b.op != Op::SEND_B) continue;
      const auto [to, back] = consumer(b);
      if (to != rank) continue;
      const size_t j = position(rank, back.op, back.stage, back.mb);
      if (j < mine.size() && j > i) out[j].push_back(i);
      break;
    }
  }
  return out;
}

std::vector<size_t> receives_ahead(const std::vector<Action>& actions, size_t pos) {
  std::vector<size_t> out;
  for (size_t j = pos + 1; j < actions.size() && out.size() < kRecvLookahead; ++j)
    if (actions[j].op == Op::RECV_F || actions[j].op == Op::RECV_B) out.push_back(j);
  return out;
}

std::vector<int64_t> peak_receive_buffers(const Schedule& schedule) {
  std::vector<int64_t> peaks;
  for (const auto& actions : schedule.actions) {
    std::vector<bool> posted(actions.size(), false);
    // Posted and not yet consumed, by the (op, stage, microbatch) of the action consuming them.
    std::multiset<std::tuple<Op, int32_t, int32_t>> alive;
    int64_t peak = 0;
    auto post = [&](size_t j) {
      if (posted[j]) return;
      posted[j] = true;
      const Action& r = actions[j];
      alive.insert({r.op == Op::RECV_F ? Op::F : Op::B, r.stage, r.mb});
    };
    for (size_t i = 0; i < actions.size(); ++i) {
      const Action& a = actions[i];
      if (a.op == Op::RECV_F || a.op == Op::RECV_B) post(i);
      if (a.op != Op::F && a.op != Op::B) continue;
      for (size_t j : receives_ahead(actions, i)) post(j);
      peak = std::max(peak, static_cast<int64_t>(alive.size()));
      if (auto it = alive.find({a.op, a.stage, a.mb}); it != alive.end()) alive.erase(it);
    }
    peaks.push_back(peak);
  }
  return peaks;
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
  for (size_t j : receives_ahead(actions, st.pos)) {
    const Action& b = actions[j];
    if (st.posted[j]) continue;
    st.posted[j] = true;
    const int64_t t0 = now_ns();
    if (b.op == Op::RECV_F) {
      post_activation_recvs(st, b);
    } else {
      do_recv_b(st, b);
    }
    timings_.push_back({b, t0, now_ns()});
  }
}

void Engine::do_recv_f(StepState& st, const Action& a) {
  const int64_t peer = schedule_.stage_rank[a.stage - 1];
  if (st.discover) {
    auto buf =
        at::empty({kHeaderLen}, at::TensorOptions().dtype(at::kLong).device(options_.device));
    st.headers.emplace(
        Slot{a.stage, a.mb},
        track(irecv(buf, peer, tag(kHeader, a.stage, a.mb, 0), options_.group_name,
                    where(a, c10::str("receive of the boundary header from rank ", peer).c_str()),
                    context(a, peer))));
  } else {
    post_activation_recvs(st, a);
  }
}

void Engine::post_activation_recvs(StepState& st, const Action& a) {
  const int64_t peer = schedule_.stage_rank[a.stage - 1];
  const Slot slot{a.stage, a.mb};
  auto& ts = st.recv_f[slot];
  const auto& specs = st.specs->in.at(slot);
  for (size_t i = 0; i < specs.size(); ++i) {
    auto buf = at::empty(specs[i].shape,
                         at::TensorOptions().dtype(specs[i].dtype).device(options_.device));
    ts.push_back(
        track(irecv(buf, peer, tag(kActivation, a.stage, a.mb, i), options_.group_name,
                    where(a, c10::str("receive of activation ", i, " from rank ", peer).c_str()),
                    context(a, peer))));
  }
}

void Engine::do_forward(StepState& st, const Action& a, const StageFn& forward) {
  const Slot slot{a.stage, a.mb};
  std::vector<at::Tensor> inputs;
  if (a.stage > 0 && schedule_.stage_rank[a.stage - 1] != rank_) {
    if (st.discover) {
      auto it = st.headers.find(slot);
      TORCH_CHECK(it != st.headers.end(), where(a, "no header receive was posted"));
      auto specs = decode_header(it->second.wait(std::chrono::milliseconds(options_.timeout_ms)));
      st.headers.erase(it);
      st.specs->in[slot] = std::move(specs);
      post_activation_recvs(st, a);
    }
    post_ahead(st, st.recv_f[slot]);
    inputs = wait_all(st.recv_f[slot]);
    st.recv_f.erase(slot);
    const auto& specs = st.specs->in.at(slot);
    for (size_t i = 0; i < inputs.size(); ++i)
      if (specs[i].requires_grad) inputs[i].requires_grad_(true);
  } else if (a.stage > 0) {
    inputs = std::move(st.local_in.at(slot));
    st.local_in.erase(slot);
  }
  compute_start_ns_ = now_ns();
  std::vector<at::Tensor> outputs = forward(a.stage, a.mb, inputs);
  const bool last = a.stage == schedule_.num_stages - 1;
  if (!last) {
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
                                    a.stage + 1, " expects ", specs_str(known),
                                    " (agreed the first time this batch shape was seen); boundary "
                                    "tensors must depend only on the batch's shapes")
                               .c_str()));
    }
    if (schedule_.stage_rank[a.stage + 1] == rank_) {
      auto& next = st.local_in[{a.stage + 1, a.mb}];
      for (const auto& o : outputs) next.push_back(o.detach().requires_grad_(o.requires_grad()));
      st.specs->in[{a.stage + 1, a.mb}] = specs;
    }
  }
  if (schedule_.backward) stash_.push(a.stage, a.mb, StashSlot{inputs, outputs});
  // Kept for SEND_F only: a reference held longer would keep the microbatch's graph alive.
  if (!last && schedule_.stage_rank[a.stage + 1] != rank_) st.fwd_out[slot] = std::move(outputs);
}

void Engine::do_send_f(StepState& st, const Action& a) {
  const Slot slot{a.stage, a.mb};
  const int64_t peer = schedule_.stage_rank[a.stage + 1];
  auto outputs = std::move(st.fwd_out.at(slot));
  st.fwd_out.erase(slot);
  if (st.discover) {
    st.sends[st.pos].push_back(
        track(isend(encode_header(st.specs->out.at(slot), where(a, "header")).to(options_.device),
                    peer, tag(kHeader, a.stage + 1, a.mb, 0), options_.group_name,
                    where(a, c10::str("send of the boundary header to rank ", peer).c_str()),
                    context(a, peer))));
  }
  for (size_t i = 0; i < outputs.size(); ++i) {
    st.sends[st.pos].push_back(
        track(isend(outputs[i].detach().contiguous(), peer, tag(kActivation, a.stage + 1, a.mb, i),
                    options_.group_name,
                    where(a, c10::str("send of activation ", i, " to rank ", peer).c_str()),
                    context(a, peer))));
  }
}

void Engine::do_recv_b(StepState& st, const Action& a) {
  const Slot slot{a.stage, a.mb};
  const int64_t peer = schedule_.stage_rank[a.stage + 1];
  auto& ts = st.recv_b[slot];
  const auto& specs = st.specs->out.at(slot);
  for (size_t i = 0; i < specs.size(); ++i) {
    if (!specs[i].requires_grad) continue;
    auto buf = at::empty(specs[i].shape,
                         at::TensorOptions().dtype(specs[i].dtype).device(options_.device));
    ts.push_back(
        track(irecv(buf, peer, tag(kGradient, a.stage, a.mb, i), options_.group_name,
                    where(a, c10::str("receive of gradient ", i, " from rank ", peer).c_str()),
                    context(a, peer))));
  }
}

void Engine::do_backward(StepState& st, const Action& a) {
  const Slot slot{a.stage, a.mb};
  // With a split backward the slot stays stashed until W when W is the whole backward (no
  // stage inputs need gradients); otherwise W needs only what B hands it.
  const StashSlot saved = stash_.pop(a.stage, a.mb);
  std::vector<at::Tensor> roots, grads;
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
      incoming = wait_all(st.recv_b.at(slot));
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
  compute_start_ns_ = now_ns();
  std::vector<at::Tensor> leaves;
  for (const auto& in : saved.inputs)
    if (in.requires_grad()) leaves.push_back(in);
  std::vector<at::Tensor> input_grads;
  if (schedule_.split_backward) {
    WeightWork work;
    if (!leaves.empty() && !roots.empty()) {
      prepare_weight_work(roots, grads, leaves, work);
      // Input gradients only: autograd runs just the nodes on paths to the stage inputs and
      // skips their weight-gradient outputs; the frontier hooks record what W needs.
      input_grads = torch::autograd::grad(roots, leaves, grads, /*retain_graph=*/true,
                                          /*create_graph=*/false, /*allow_unused=*/true);
      finish_weight_work(work);
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

void Engine::prepare_weight_work(const std::vector<at::Tensor>& roots,
                                 const std::vector<at::Tensor>& grads,
                                 const std::vector<at::Tensor>& leaves, WeightWork& work) {
  // [Note: split backward] B computes input gradients only. The nodes it runs form the "input
  // closure"; a node of it with an edge leaving the closure (towards parameters: a matmul whose
  // weight gradient B skipped) is a frontier node. B records the gradients flowing into each
  // frontier node; afterwards the frontier nodes' edges into the closure are cut, so that they
  // lead only to parameters. W is then one autograd run from all frontier nodes with the
  // recorded gradients: it does the weight-gradient work and nothing of B's again, accumulates
  // into `.grad` like any backward (parameter hooks run), and frees the saved tensors as it
  // goes. Between B and W a microbatch holds only what the frontier nodes saved (the inputs of
  // the weight GEMMs) and the recorded gradients; the rest of its graph is freed at B. A
  // frontier node that computes every output regardless (a compiled stage's backward) is not
  // run twice: see finish_weight_work.
  std::unordered_set<Node*> leaf_nodes;
  for (const auto& l : leaves)
    leaf_nodes.insert(torch::autograd::impl::gradient_edge(l).function.get());
  std::vector<Node*> root_nodes;
  for (const auto& r : roots)
    root_nodes.push_back(torch::autograd::impl::gradient_edge(r).function.get());
  const auto closure = input_closure(root_nodes, leaf_nodes);
  auto inside = [&](Node* n) { return closure.count(n) > 0 || leaf_nodes.count(n) > 0; };
  for (Node* n : closure) {
    WeightWork::Frontier f;
    bool leaves_closure = false;
    const auto& edges = n->next_edges();
    for (size_t i = 0; i < edges.size(); ++i) {
      Node* child = edges[i].function.get();
      if (!child) continue;
      if (inside(child)) {
        f.input_edges.push_back(i);
      } else {
        leaves_closure = true;
      }
    }
    if (!leaves_closure) continue;
    f.node = compat::node_ptr(n);
    f.grads = std::make_shared<variable_list>();
    f.outputs = std::make_shared<variable_list>();
    auto hook = std::make_unique<CaptureGrads>(f.grads);
    f.pre_hook = hook.get();
    n->add_pre_hook(std::move(hook));
    f.post_hook = n->add_post_hook(std::make_unique<CaptureOutputs>(f.outputs));
    work.frontier.push_back(std::move(f));
  }
  // Roots outside the closure (outputs that do not depend on the inputs) start W themselves.
  for (size_t i = 0; i < roots.size(); ++i) {
    Node* n = root_nodes[i];
    if (!n || closure.count(n)) continue;
    WeightWork::Frontier f;
    f.node = compat::node_ptr(n);
    f.grads = std::make_shared<variable_list>(n->num_inputs());
    (*f.grads)[torch::autograd::impl::gradient_edge(roots[i]).input_nr] = grads[i];
    work.frontier.push_back(std::move(f));
  }
}

void Engine::finish_weight_work(WeightWork& work) {
  // After B: unhook the frontier nodes and cut them off the input path, so that W computes only
  // their weight branches and the rest of the input path is freed with the stage outputs. A node
  // that computed its weight-edge gradients in B anyway (one that ignores which outputs the
  // graph task needs, like a compiled stage's single backward node) is not run again: its
  // weight branches are fed those gradients now, and W has nothing left to do for it.
  torch::autograd::edge_list edges;
  variable_list values;
  std::vector<WeightWork::Frontier> deferred;
  for (auto& f : work.frontier) {
    auto& pre = f.node->pre_hooks();
    pre.erase(std::remove_if(pre.begin(), pre.end(),
                             [&](const auto& h) { return h.get() == f.pre_hook; }),
              pre.end());
    if (f.post_hook) f.node->del_post_hook(f.post_hook);
    f.pre_hook = nullptr;
    f.post_hook = 0;
    for (size_t i : f.input_edges) f.node->next_edges()[i] = Edge();
    const auto& next = f.node->next_edges();
    bool computed = f.outputs && f.outputs->size() == next.size();
    for (size_t i = 0; computed && i < next.size(); ++i)
      if (next[i].is_valid() && !(*f.outputs)[i].defined()) computed = false;
    if (!computed) {
      f.outputs.reset();
      deferred.push_back(std::move(f));
      continue;
    }
    for (size_t i = 0; i < next.size(); ++i) {
      if (!next[i].is_valid()) continue;
      edges.push_back(next[i]);
      values.push_back(std::move((*f.outputs)[i]));
    }
  }
  work.frontier = std::move(deferred);
  accumulate_from(edges, values);
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
  // Weight gradients from what B left (no forward is re-run). See [Note: split backward].
  torch::autograd::edge_list edges;
  variable_list values;
  for (auto& f : work.frontier) {
    for (size_t i = 0; i < f.grads->size(); ++i) {
      if (!(*f.grads)[i].defined()) continue;
      edges.emplace_back(f.node, static_cast<uint32_t>(i));
      values.push_back(std::move((*f.grads)[i]));
    }
  }
  accumulate_from(edges, values);
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
    st.sends[st.pos].push_back(track(isend(
        grads.at(j++).contiguous(), peer, tag(kGradient, a.stage - 1, a.mb, i), options_.group_name,
        where(a, c10::str("send of gradient ", i, " to rank ", peer).c_str()), context(a, peer))));
  }
}

}  // namespace pippy_xla
