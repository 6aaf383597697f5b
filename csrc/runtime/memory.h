// [Note: counting CPU allocator] The peak of live CPU tensor bytes, measured at the allocator.
//
// The planner predicts each stage's peak memory; on CPU ranks (tests, CI) there is no
// torch.cuda.max_memory_allocated to check it against, and the profiler's memory events miss
// allocations made on threads it does not follow. So MemoryTracker installs, once, a CPU
// allocator that forwards to the one it replaces (c10's default) and counts the bytes of every
// tensor storage it hands out until that storage is freed, on every thread: the CPU analogue of
// the CUDA caching allocator's "allocated bytes" counters (without the caching allocator's
// rounding, so it is what the tensors ask for). Storages allocated before install(), and memory
// that does not come from c10's CPU allocator (numpy arrays, gloo's internal buffers, the Python
// heap) are not counted.
//
// Once installed it stays installed (tensors it allocated free through it); each allocation then
// costs one extra small heap allocation, so only tests and benchmarks install it.
#pragma once

#include <cstdint>

namespace pippy_xla {

struct MemoryStats {
  int64_t live_bytes = 0;   // bytes of counted storages alive now
  int64_t peak_bytes = 0;   // most live bytes since install() or the last reset_peak()
  int64_t allocations = 0;  // storages counted since install()
};

class MemoryTracker {
 public:
  // Installs the counting allocator as c10's CPU allocator (idempotent).
  static void install();
  static bool installed();
  // Throws c10::Error unless installed.
  static MemoryStats stats();
  // Sets the peak to the live bytes now.
  static void reset_peak();
};

}  // namespace pippy_xla
