// Split backward for zero-bubble schedules: B computes a microbatch's input gradients only and
// keeps what W needs to compute its weight gradients later, without re-running anything of B.
// See [Note: split backward] in split_backward.cpp.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "runtime/compat.h"

namespace pippy_xla {

// What a split backward's W step runs for one (stage, microbatch).
struct WeightWork {
  struct Frontier {
    compat::NodePtr node;
    std::shared_ptr<std::vector<at::Tensor>> grads;    // gradients into `node`, recorded in B
    std::shared_ptr<std::vector<at::Tensor>> outputs;  // what `node` computed in B
    std::vector<size_t> input_edges;                   // its edges into the input path, cut after B
    void* pre_hook = nullptr;                          // the recording hooks, while in B
    uintptr_t post_hook = 0;
  };
  std::vector<Frontier> frontier;
  std::vector<at::Tensor> roots, grads;  // no stage inputs need gradients: a full backward
};

// B: the gradients of `leaves` (the stage inputs that require grad) from `roots` with incoming
// `grads` (undefined for a leaf no root depends on). Fills `work` with what W needs and frees the
// rest of the graph below `roots`. Throws c10::ValueError without leaves, or unless there is one
// gradient per root.
std::vector<at::Tensor> input_gradients(const std::vector<at::Tensor>& roots,
                                        const std::vector<at::Tensor>& grads,
                                        const std::vector<at::Tensor>& leaves, WeightWork& work);
// The same with a WeightWork of its own, returned with the gradients.
std::pair<std::vector<at::Tensor>, std::unique_ptr<WeightWork>> input_gradients(
    const std::vector<at::Tensor>& roots, const std::vector<at::Tensor>& grads,
    const std::vector<at::Tensor>& leaves);

// W: accumulates the weight gradients B left in `work` into the parameters' `.grad`.
void weight_gradients(WeightWork& work);

}  // namespace pippy_xla
