#include "runtime/split_backward.h"

#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <unordered_map>
#include <unordered_set>

namespace pippy_xla {

/* [Note: split backward] B computes input gradients only. The nodes it runs form the "input
closure"; a node of it with an edge leaving the closure (towards parameters: a matmul whose weight
gradient B skipped) is a frontier node. B records the gradients flowing into each frontier node;
afterwards the frontier nodes' edges into the closure are cut, so that they lead only to parameters.
W is then one autograd run from all frontier nodes with the recorded gradients: it does the
weight-gradient work and nothing of B's again, accumulates into `.grad` like any backward (parameter
hooks run), and frees the saved tensors as it goes. Between B and W a microbatch holds only what the
frontier nodes saved (the inputs of the weight GEMMs) and the recorded gradients; the rest of its
graph is freed at B. A frontier node that computes every output regardless (a compiled stage's
backward) is not run twice: see finish(). */

namespace {

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

// Records the gradients a node computed (its outputs) the first time it runs, except those along
// `skip` (its edges into the input path: B passes them on, and keeping them until B ends would
// hold a gradient per frontier node for nothing).
struct CaptureOutputs : torch::autograd::FunctionPostHook {
  CaptureOutputs(std::shared_ptr<variable_list> out, std::vector<size_t> skip)
      : out_(std::move(out)), skip_(std::move(skip)) {}
  variable_list operator()(const variable_list& outputs, const variable_list& /*inputs*/) override {
    if (out_->empty()) {
      *out_ = outputs;
      for (size_t i : skip_)
        if (i < out_->size()) (*out_)[i] = at::Tensor();
    }
    return outputs;
  }
  std::shared_ptr<variable_list> out_;
  std::vector<size_t> skip_;
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

// Hooks the frontier nodes of the graph below `roots` and lists them in `work`.
void prepare(const std::vector<at::Tensor>& roots, const std::vector<at::Tensor>& grads,
             const std::vector<at::Tensor>& leaves, WeightWork& work) {
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
    f.post_hook = n->add_post_hook(std::make_unique<CaptureOutputs>(f.outputs, f.input_edges));
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

void finish(WeightWork& work) {
  // After B: unhook the frontier nodes and cut them off the input path, so that W computes only
  // their weight branches and the rest of the input path is freed with the stage outputs. A node
  // that computed its weight-edge gradients in B anyway (one that ignores which outputs the
  // graph task needs) is not run again. Where such a gradient is a parameter's (a compiled
  // stage's single backward node) it is accumulated now; where it feeds a node of its own (a
  // compiled stage's weight node, see [Note: compiled W] in _split_compile.py) that node becomes
  // a frontier node fed that gradient, and W runs it.
  torch::autograd::edge_list edges;
  variable_list values;
  std::vector<WeightWork::Frontier> deferred;
  std::unordered_map<Node*, size_t> fed;  // a node fed by computed gradients -> its entry
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
      Node* child = next[i].function.get();
      if (dynamic_cast<torch::autograd::AccumulateGrad*>(child)) {
        edges.push_back(next[i]);
        values.push_back(std::move((*f.outputs)[i]));
        continue;
      }
      auto [it, fresh] = fed.try_emplace(child, deferred.size());
      if (fresh) {
        WeightWork::Frontier g;
        g.node = next[i].function;
        g.grads = std::make_shared<variable_list>(child->num_inputs());
        deferred.push_back(std::move(g));
      }
      auto& slot = (*deferred[it->second].grads)[next[i].input_nr];
      slot = slot.defined() ? slot + (*f.outputs)[i] : std::move((*f.outputs)[i]);
    }
  }
  work.frontier = std::move(deferred);
  accumulate_from(edges, values);
}

}  // namespace

std::vector<at::Tensor> input_gradients(const std::vector<at::Tensor>& roots,
                                        const std::vector<at::Tensor>& grads,
                                        const std::vector<at::Tensor>& leaves, WeightWork& work) {
  TORCH_CHECK_VALUE(!leaves.empty() && roots.size() == grads.size(),
                    "input_gradients: need leaves, and one gradient per root");
  prepare(roots, grads, leaves, work);
  // Input gradients only: autograd runs just the nodes on paths to the stage inputs and skips
  // their weight-gradient outputs; the frontier hooks record what W needs.
  auto input_grads = torch::autograd::grad(roots, leaves, grads, /*retain_graph=*/true,
                                           /*create_graph=*/false, /*allow_unused=*/true);
  finish(work);
  return input_grads;
}

std::pair<std::vector<at::Tensor>, std::unique_ptr<WeightWork>> input_gradients(
    const std::vector<at::Tensor>& roots, const std::vector<at::Tensor>& grads,
    const std::vector<at::Tensor>& leaves) {
  auto work = std::make_unique<WeightWork>();
  auto out = input_gradients(roots, grads, leaves, *work);
  return {std::move(out), std::move(work)};
}

void weight_gradients(WeightWork& work) {
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

}  // namespace pippy_xla
