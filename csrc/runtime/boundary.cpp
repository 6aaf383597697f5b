#include "runtime/boundary.h"

#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <sstream>

namespace pippy_xla {

std::string TensorSpec::str() const {
  std::ostringstream os;
  os << c10::toString(dtype) << c10::IntArrayRef(shape) << (requires_grad ? " requires_grad" : "");
  return os.str();
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

}  // namespace pippy_xla
