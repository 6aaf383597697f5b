#include "runtime/memory.h"

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>

#include <atomic>
#include <mutex>

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

// What a counted storage's DataPtr owns: the inner allocator's DataPtr and the byte count.
struct Counted {
  c10::DataPtr inner;
  int64_t nbytes;
  static void free(void* ctx) {
    auto* c = static_cast<Counted*>(ctx);
    live.fetch_sub(c->nbytes);
    delete c;  // frees the storage through the inner allocator's deleter
  }
};

class CountingAllocator final : public c10::Allocator {
 public:
  explicit CountingAllocator(c10::Allocator* inner) : inner_(inner) {}

  c10::DataPtr allocate(size_t n) override {
    c10::DataPtr inner = inner_->allocate(n);
    void* data = inner.get();
    const c10::Device device = inner.device();
    auto* ctx = new Counted{std::move(inner), static_cast<int64_t>(n)};
    add(ctx->nbytes);
    count.fetch_add(1);
    return {data, ctx, &Counted::free, device};
  }

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
