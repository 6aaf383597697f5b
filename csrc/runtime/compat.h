// Types that differ between the torch versions pippy_xla builds against (2.11 to 2.13).
#pragma once

#include <torch/csrc/autograd/edge.h>
#include <torch/csrc/autograd/function.h>

#include <memory>
#include <type_traits>

namespace pippy_xla::compat {

// An owning pointer to an autograd node: c10::intrusive_ptr<Node> from torch 2.13,
// std::shared_ptr<Node> before. Edge::function has the right type in each.
using NodePtr = decltype(torch::autograd::Edge::function);

// An owning pointer to a node the graph keeps alive, from its raw pointer. (Templated so that
// only the branch of the installed torch is compiled.)
template <typename P = NodePtr, typename N = torch::autograd::Node>
P node_ptr(N* node) {
  if constexpr (std::is_same_v<P, std::shared_ptr<N>>) {
    return node->shared_from_this();
  } else {
    return P::reclaim_copy(node);
  }
}

}  // namespace pippy_xla::compat
