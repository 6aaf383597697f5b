// Where stages sit: on ranks (placements), and over the model's decoder layers.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace pippy_xla {

// Throws c10::Error unless `placement` is "loop" or "v".
void check_placement(const std::string& placement);
// The rank that runs `stage` under `placement`: "loop" puts chunk c of rank r at stage
// c * num_ranks + r (stage s on rank s % num_ranks); "v" reverses every odd chunk, so with two
// chunks rank r runs stages r and 2 * num_ranks - 1 - r (the last rank runs two adjacent stages,
// the first rank the first and the last).
int32_t stage_rank(int32_t stage, int32_t num_ranks, const std::string& placement = "loop");
// Throws c10::ValueError unless `num_layers` decoder layers split into `num_stages` stages of at
// least one layer each.
void check_stage_count(int64_t num_layers, int64_t num_stages);
// Contiguous layer ranges [start, stop) of `num_stages` stages whose sizes differ by at most one
// (earlier stages get more). Throws c10::ValueError as check_stage_count does, or for no stage.
std::vector<std::pair<int32_t, int32_t>> balanced_ranges(int32_t num_layers, int32_t num_stages);

}  // namespace pippy_xla
