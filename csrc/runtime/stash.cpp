#include "runtime/stash.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <sstream>

namespace pippy_xla {

int64_t Stash::bytes_of(const StashSlot& slot) {
  int64_t n = 0;
  for (const auto* list : {&slot.inputs, &slot.outputs}) {
    for (const auto& t : *list) {
      if (t.defined()) n += static_cast<int64_t>(t.nbytes());
    }
  }
  return n;
}

void Stash::push(int64_t stage, int64_t mb, StashSlot slot) {
  auto key = std::make_pair(stage, mb);
  TORCH_CHECK(slots_.find(key) == slots_.end(), "stash: slot (stage ", stage, ", microbatch ", mb,
              ") is already full; forward ran twice for it without a backward");
  live_bytes_ += bytes_of(slot);
  peak_bytes_ = std::max(peak_bytes_, live_bytes_);
  slots_.emplace(key, std::move(slot));
}

StashSlot Stash::pop(int64_t stage, int64_t mb) {
  auto it = slots_.find(std::make_pair(stage, mb));
  TORCH_CHECK(it != slots_.end(), "stash: no slot for (stage ", stage, ", microbatch ", mb,
              "); backward ran before forward or twice");
  StashSlot slot = std::move(it->second);
  slots_.erase(it);
  live_bytes_ -= bytes_of(slot);
  return slot;
}

const StashSlot& Stash::peek(int64_t stage, int64_t mb) const {
  auto it = slots_.find(std::make_pair(stage, mb));
  TORCH_CHECK(it != slots_.end(), "stash: no slot for (stage ", stage, ", microbatch ", mb, ")");
  return it->second;
}

bool Stash::contains(int64_t stage, int64_t mb) const {
  return slots_.count(std::make_pair(stage, mb)) > 0;
}

void Stash::check_empty() const {
  if (slots_.empty()) return;
  std::ostringstream os;
  for (const auto& kv : slots_)
    os << " (stage " << kv.first.first << ", mb " << kv.first.second << ")";
  TORCH_CHECK(false, "stash: ", slots_.size(), " slot(s) left at the end of the step:", os.str(),
              "; the schedule ran a forward without its backward");
}

void Stash::clear() {
  slots_.clear();
  live_bytes_ = 0;
}

}  // namespace pippy_xla
