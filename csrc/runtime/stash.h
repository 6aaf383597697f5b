// Activation stash: what a stage keeps from forward until backward, one slot per (stage,
// microbatch). [Note: zero-copy stash] Slots hold references to the very tensors forward produced
// and consumed (never copies into stacked buffers), so a stashed tensor keeps its storage.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <utility>
#include <vector>

namespace pippy_xla {

struct StashSlot {
  std::vector<at::Tensor> inputs;   // received boundary tensors (autograd leaves)
  std::vector<at::Tensor> outputs;  // stage outputs (autograd roots)
};

class Stash {
 public:
  void push(int64_t stage, int64_t mb, StashSlot slot);
  StashSlot pop(int64_t stage, int64_t mb);
  const StashSlot& peek(int64_t stage, int64_t mb) const;
  bool contains(int64_t stage, int64_t mb) const;
  size_t size() const { return slots_.size(); }
  int64_t live_bytes() const { return live_bytes_; }
  int64_t peak_bytes() const { return peak_bytes_; }
  void reset_peak() { peak_bytes_ = live_bytes_; }
  // Throws if any slot is left (called at the end of every training step).
  void check_empty() const;
  // Drops every slot (after a failed step).
  void clear();

  static int64_t bytes_of(const StashSlot& slot);

 private:
  std::map<std::pair<int64_t, int64_t>, StashSlot> slots_;
  int64_t live_bytes_ = 0;
  int64_t peak_bytes_ = 0;
};

}  // namespace pippy_xla
