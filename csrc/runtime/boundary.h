// What crosses a stage boundary, and the header that describes it.
// [Note: boundary specs] Shapes, dtypes and requires_grad of the tensors that cross a stage
// boundary are agreed once per batch signature: the first step with a new signature sends a small
// int64 header before each microbatch's activations, and the receiver records it; later steps
// post receives straight from the recorded specs, and a sender whose outputs differ from them fails
// with an error instead of letting the transport see mismatched byte counts.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <vector>

namespace pippy_xla {

// int64 words of a boundary header (what encode_header writes and decode_header reads).
constexpr int64_t kHeaderLen = 512;

struct TensorSpec {
  std::vector<int64_t> shape;
  at::ScalarType dtype = at::kFloat;
  bool requires_grad = false;
  bool operator==(const TensorSpec& o) const {
    return shape == o.shape && dtype == o.dtype && requires_grad == o.requires_grad;
  }
  std::string str() const;
};

TensorSpec spec_of(const at::Tensor& t);
// "[Float[2, 3] requires_grad, Long[2]]".
std::string specs_str(const std::vector<TensorSpec>& specs);
// The header of `specs`: a CPU int64 tensor of kHeaderLen words. `where` prefixes the error
// when they do not fit.
at::Tensor encode_header(const std::vector<TensorSpec>& specs, const std::string& where);
std::vector<TensorSpec> decode_header(const at::Tensor& received);

}  // namespace pippy_xla
