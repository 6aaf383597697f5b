// Pipeline schedules as data: the action IR every schedule is written in. The other files of
// this folder read and write it (csv.cpp), generate it (generators.h), state each generated
// schedule's facts (facts.h) and check and time it (simulator.h).
#pragma once

#include <cstdint>
#include <string>
#include <tuple>
#include <variant>
#include <vector>

namespace pippy_xla {

// F: forward. B: backward (input and, unless the schedule splits backward, weight gradients).
// W: weight gradients of a split backward. SEND_*/RECV_*: post an asynchronous transfer of the
// activations (F) or gradients (B) of (stage, mb) to / from the neighbouring stage's rank; a
// compute action waits for its receives, and sends are waited lazily.
enum class Op : uint8_t { F, B, W, SEND_F, RECV_F, SEND_B, RECV_B };

struct Action {
  Op op;
  int32_t stage;
  int32_t mb;
  bool operator==(const Action& o) const { return op == o.op && stage == o.stage && mb == o.mb; }
  bool operator<(const Action& o) const {
    return std::tie(op, stage, mb) < std::tie(o.op, o.stage, o.mb);
  }
};

const char* op_name(Op op);
// The op named `name` (op_name's inverse); throws c10::Error naming the valid names otherwise.
Op parse_op(const std::string& name);
std::string to_string(const Action& a);
bool is_compute(Op op);

// An action as schedule tables write it: (op name, stage, microbatch).
using ActionRow = std::tuple<std::string, int32_t, int32_t>;
Action parse_action(const std::string& op, int32_t stage, int32_t mb);
// An Action, or a row of a schedule table.
using ActionSpec = std::variant<Action, ActionRow>;
Action to_action(const ActionSpec& spec);

struct Schedule {
  std::string name;
  int32_t num_ranks = 0;
  int32_t num_stages = 0;
  int32_t num_microbatches = 0;
  bool backward = true;             // false: forward only (evaluation)
  bool split_backward = false;      // B computes input gradients only; W computes weight gradients
  std::vector<int32_t> stage_rank;  // stage -> rank
  std::vector<std::vector<Action>> actions;  // rank -> ordered actions
  // 0, or a decode schedule of that many groups (forward only): see [Note: decode schedules].
  int32_t decode_groups = 0;

  // [Note: decode schedules] Pipelined generation (decode_schedule in generators.h) as a ring of
  // stages: microbatch m is token m / G of group m % G (G = decode_groups), and the last stage's
  // forward of m, which samples that group's next token ids, feeds the first stage's forward of
  // m + G (the group's next token) besides the usual stage s -> s + 1 edges. That edge is an
  // ordinary pair of actions, SEND_F on the last stage and RECV_F on stage 0 (the receiver's
  // (stage, microbatch) as always), so the engine moves the token ids as it moves activations:
  // the same transfers, boundary headers, tags, waits and failures. next_forward and
  // prev_forward name the edges; everything that follows them (transfers, validator, simulator,
  // engine, send release) is written with them.
  //
  // The forward of (stage, mb) whose outputs (stage, mb)'s feed, if any: (stage + 1, mb), or on
  // a decode schedule's last stage (0, mb + decode_groups) while that microbatch exists.
  bool next_forward(int32_t stage, int32_t mb, Action* next = nullptr) const;
  // The forward whose outputs (stage, mb) takes as inputs, if any (next_forward's inverse).
  bool prev_forward(int32_t stage, int32_t mb, Action* prev = nullptr) const;

  // A hand-written schedule: `stage_rank` gives the number of stages.
  static Schedule from_parts(std::string name, int32_t num_ranks, int32_t num_microbatches,
                             std::vector<int32_t> stage_rank,
                             const std::vector<std::vector<ActionSpec>>& actions,
                             bool backward = true, bool split_backward = false);

  // [Note: CSV schedules] torch.distributed.pipelining's CSV action format: one row per rank,
  // one cell per action, "<stage><type><microbatch>" with type F, I (input gradients), W, B (full
  // backward), SEND_F, RECV_F, SEND_B, RECV_B, UNSHARD, RESHARD, REDUCE_GRAD, and
  // "(a;b)OVERLAP_F_B" for actions run together; empty cells are idle slots. from_csv takes the
  // compute actions in order (I is our split B; a full B in a schedule with I or W becomes B and
  // its W), reads each stage's rank from the row it runs in, and adds the transfers by the
  // generated schedules' rules (the file's own transfer, FSDP and overlap actions are not kept:
  // the engine posts transfers and data-parallel reductions itself); then validates. Both are
  // written in csv.cpp.
  static Schedule from_csv(const std::string& text, std::string name = "csv");
  // This schedule in that format: compute actions only, or with `comms` its transfers too.
  std::string to_csv(bool comms = false) const;

  std::vector<int32_t> stages_of(int32_t rank) const;
  // One line per rank, e.g. "rank 0: F0.0 SF0.0 F0.1 ..." (stage.microbatch).
  std::string table() const;
};

// `s` (its placement set, its actions ignored) with per-rank compute orders `compute` turned into
// full action lists: the transfers every generated schedule and every CSV schedule gets.
// Receives are posted one compute action ahead of the computation that needs them (so the
// transfer overlaps that action), but a gradient receive never before its own forward (its
// buffer's shape comes from that forward). Sends follow the computation that produces their data.
Schedule with_transfers(Schedule s, const std::vector<std::vector<Action>>& compute);

}  // namespace pippy_xla
