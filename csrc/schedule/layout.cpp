// See layout.h.
#include "schedule/layout.h"

#include <c10/util/Exception.h>

namespace pippy_xla {

void check_placement(const std::string& placement) {
  TORCH_CHECK(placement == "loop" || placement == "v", "unknown placement '", placement,
              "'; expected 'loop' or 'v'");
}

int32_t stage_rank(int32_t stage, int32_t num_ranks, const std::string& placement) {
  TORCH_CHECK(num_ranks >= 1 && stage >= 0, "stage_rank: need stage >= 0 and num_ranks >= 1, got ",
              stage, " and ", num_ranks);
  check_placement(placement);
  const int32_t chunk = stage / num_ranks, i = stage % num_ranks;
  return placement == "v" && chunk % 2 == 1 ? num_ranks - 1 - i : i;
}

void check_stage_count(int64_t num_layers, int64_t num_stages) {
  TORCH_CHECK_VALUE(
      num_stages <= num_layers, "cannot split ", num_layers, " decoder layers into ", num_stages,
      " stages: every stage needs at least one layer, and the model has only ", num_layers,
      " decoder layers; use at most ", num_layers, " stages (ranks x chunks)");
}

std::vector<std::pair<int32_t, int32_t>> balanced_ranges(int32_t num_layers, int32_t num_stages) {
  check_stage_count(num_layers, num_stages);
  TORCH_CHECK_VALUE(num_stages >= 1, "need at least one stage, got ", num_stages);
  const int32_t base = num_layers / num_stages, extra = num_layers % num_stages;
  std::vector<std::pair<int32_t, int32_t>> out;
  int32_t start = 0;
  for (int32_t s = 0; s < num_stages; ++s) {
    const int32_t stop = start + base + (s < extra ? 1 : 0);
    out.emplace_back(start, stop);
    start = stop;
  }
  return out;
}

}  // namespace pippy_xla
