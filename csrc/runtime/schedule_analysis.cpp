// See schedule_analysis.h.
#include "runtime/schedule_analysis.h"

#include <algorithm>
#include <set>
#include <tuple>

namespace pippy_xla {

/* [Note: gradients ready]
A data-parallel wrapper (pipeline.py, with FSDP2 or replicate) reduces a stage's gradients over its
replicas once the stage's last gradient action of the step is done: its last B, or its last W when
backward is split. run() calls grads_ready(stage) then, but only after the sends that directly
follow that action were posted, so the previous stage's rank gets its gradients before this rank
blocks in the reduction: the reduction runs while earlier stages finish their cooldown. */
std::map<size_t, int64_t> last_gradient_actions(const Schedule& s, int64_t rank) {
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
  auto position = [&](int32_t r, Op op, int32_t stage, int32_t mb) {
    const auto& acts = s.actions[r];
    for (size_t k = 0; k < acts.size(); ++k)
      if (acts[k].op == op && acts[k].stage == stage && acts[k].mb == mb) return k;
    return acts.size();
  };
  // The F or B on the receiving rank that waits for the data of send action `a`.
  auto consumer = [&](const Action& a) {
    Action use{Op::B, a.stage - 1, a.mb};
    if (a.op == Op::SEND_F) s.next_forward(a.stage, a.mb, &use);
    return std::make_pair(s.stage_rank[use.stage], use);
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

}  // namespace pippy_xla
