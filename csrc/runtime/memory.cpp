#include "runtime/memory.h"

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>

#include <atomic>
#include <mutex>
#include <unordered_map>

namespace pippy_xla {
namespace {

std::atomic<int64_t> live{0};
std::atomic<int64_t> peak{0};
std::atomic<int64_t> count{0};

void add(int64_t n) {
  const int64_t now = live.fetch_add(n) + n;
  int64_t p = peak.load();
  while (now > p && !peak.compare_exchange_weak(p, now)) {
  }
}

// The inner allocator's DataPtr and byte count of every counted storage, by data pointer: the
// DataPtr we hand out is a simple one (context == data), so that raw_allocate works (CPU kernels
// that take scratch memory that way, e.g. oneDNN's depthwise convolution).
struct Counted {
  c10::DataPtr inner;
  int64_t nbytes;
};
std::mutex table_mutex;
std::unordered_map<void*, Counted>& table() {
  static auto* t = new std::unordered_map<void*, Counted>();  // never destroyed, like storages
  return *t;
}

void free_counted(void* data) {
  if (data == nullptr) {
    return;
  }
  Counted c;
  {
    std::lock_guard<std::mutex> lock(table_mutex);
    auto it = table().find(data);
    if (it == table().end()) {
      // A deleter runs while a storage is destroyed: throwing there ends in std::terminate.
      TORCH_WARN("counting allocator: freeing an unknown pointer (left allocated)");
      return;
    }
    c = std::move(it->second);
    table().erase(it);
  }
  live.fetch_sub(c.nbytes);
  // c.inner frees the storage through the inner allocator's deleter on scope exit
}

class CountingAllocator final : public c10::Allocator {
 public:
  explicit CountingAllocator(c10::Allocator* inner) : inner_(inner) {}

  c10::DataPtr allocate(size_t n) override {
    c10::DataPtr inner = inner_->allocate(n);
    void* data = inner.get();
    if (data == nullptr) {
      return inner;  // nothing to count (zero bytes)
    }
    const c10::Device device = inner.device();
    {
      std::lock_guard<std::mutex> lock(table_mutex);
      table().emplace(data, Counted{std::move(inner), static_cast<int64_t>(n)});
    }
    add(static_cast<int64_t>(n));
    count.fetch_add(1);
    return {data, data, &free_counted, device};
  }

  c10::DeleterFnPtr raw_deleter() const override { return &free_counted; }

  void copy_data(void* dest, const void* src, std::size_t n) const override {
    default_copy_data(dest, src, n);
  }

 private:
  c10::Allocator* inner_;
};

std::once_flag once;
std::atomic<bool> is_installed{false};

}  // namespace

void MemoryTracker::install() {
  std::call_once(once, [] {
    // Never destroyed: storages it allocated may outlive any scope.
    static auto* counting = new CountingAllocator(c10::GetCPUAllocator());
    c10::SetCPUAllocator(counting, /*priority=*/100);
    is_installed = true;
  });
}

bool MemoryTracker::installed() { return is_installed; }

MemoryStats MemoryTracker::stats() {
  TORCH_CHECK(installed(),
              "the CPU memory tracker is not installed: call _C.memory_tracker_install() first");
  return {live.load(), peak.load(), count.load()};
}

void MemoryTracker::reset_peak() { peak = live.load(); }

}  // namespace pippy_xla
