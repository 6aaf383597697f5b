// Pipeline schedules as data: one action IR shared by every schedule, a validator that proves an
// action list dependency-complete and deadlock-free, and a simulator that turns per-action costs
// into per-rank timelines.
#pragma once

#include <cstdint>
#include <string>
#include <tuple>
#include <utility>
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
};

const char* op_name(Op op);
// The op named `name` (op_name's inverse); throws c10::Error naming the valid names otherwise.
Op parse_op(const std::string& name);
std::string to_string(const Action& a);

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
  // the engine posts transfers and data-parallel reductions itself); then validates.
  static Schedule from_csv(const std::string& text, std::string name = "csv");
  // This schedule in that format: compute actions only, or with `comms` its transfers too.
  std::string to_csv(bool comms = false) const;

  std::vector<int32_t> stages_of(int32_t rank) const;
  // One line per rank, e.g. "rank 0: F0.0 SF0.0 F0.1 ..." (stage.microbatch).
  std::string table() const;
};

// Per-action costs (any unit; the engine records nanoseconds), for the simulator and for the
// orders of the list-scheduled schedules (see [Note: list scheduling at costs]). Each per-stage
// list is empty (unit costs) or has one entry per stage.
struct Costs {
  std::vector<double> forward;   // per stage
  std::vector<double> backward;  // per stage (input + weight gradients unless split)
  std::vector<double> weight;    // per stage (split backward only)
  double comm = 0.0;             // latency from a send's post to the data being receivable
  double send = 0.0;             // time a rank spends posting one send (SF, SB)
  double recv = 0.0;             // time a rank spends posting one receive (RF, RB)
};

// [Note: schedule facts] What the rest of the library needs to know about each generated
// schedule, written once: make_schedule checks its arguments against it, and Python reads it
// through _C.schedule_info (the config's checks and default chunks, the stage layout, the
// planner's equal ranges, whether stages compile without buffer donation).
struct ScheduleInfo {
  std::string name;
  std::string description;
  bool trains = true;           // runs backward actions (false: evaluation)
  bool split_backward = false;  // B computes input gradients only, W the weights' gradients
  int32_t min_chunks = 1;       // stages per rank allowed: min_chunks..max_chunks
  int32_t max_chunks = 1;       // 0: no upper bound
  int32_t default_chunks = 1;   // stages per rank when the caller names none
  bool equal_stages = false;    // every stage must hold the same number of layers
  std::string placement = "loop";  // how stages sit on ranks: "loop" or "v" (see stage_rank)
  bool list_scheduled = false;  // the order is list-scheduled at per-stage costs (make_schedule's
                                // `costs`; see [Note: list scheduling at costs])
};

// Every generated schedule, "forward" (evaluation) last.
const std::vector<ScheduleInfo>& schedule_table();
// The facts of schedule `name`; throws (RuntimeError) naming the known schedules otherwise.
const ScheduleInfo& schedule_info(const std::string& name);

// Names: "1f1b", "gpipe", "interleaved" (interleaved 1F1B, `chunks` >= 2 stages per rank), "zbh1"
// (zero-bubble ZB-H1: split backward, weight steps fill the bubble), "looped_bfs",
// "interleaved_zb", "zbv" and "dualpipev" (2 stages per rank in a V), and "forward" (evaluation;
// any `chunks` and placement): the names of schedule_table(), whose descriptions say more.
std::vector<std::string> schedule_names();
// The schedules that train (every name but "forward").
std::vector<std::string> train_schedule_names();
// Stages per rank of schedule `name` when the caller names none (its ScheduleInfo's).
int32_t default_chunks(const std::string& name);
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
// `chunks` 0: the schedule's default (ScheduleInfo::default_chunks). `placement` empty: the
// schedule's own (ScheduleInfo::placement); "forward" takes either, so that
// evaluation runs on the stages where training put them. `costs` (F, B, W per stage; empty:
// unit costs) orders a list-scheduled schedule (ScheduleInfo::list_scheduled): the order list-
// scheduled at those costs if the simulator puts it ahead of the published one at them, else the
// published one. The other schedules, whose order does not depend on costs, refuse costs.
Schedule make_schedule(const std::string& name, int32_t num_ranks, int32_t num_microbatches,
                       int32_t chunks = 0, const std::string& placement = "",
                       const Costs& costs = {});

// Evaluation on any stage placement: every rank runs its stages' forwards, stages ascending, each
// for every microbatch (what make_schedule("forward") generates for its placements).
Schedule forward_schedule(std::vector<int32_t> stage_rank, int32_t num_ranks,
                          int32_t num_microbatches);

struct TimedAction {
  Action action;
  int32_t rank;
  double start;
  double end;
};

// Counts per stage in a live state: [forwarded not backwarded, backwarded not weighted, running
// split B]; see [Note: live states].
constexpr int32_t kLiveCounts = 3;

struct SimResult {
  std::vector<TimedAction> timeline;  // sorted by start time (stable: rank order on ties)
  double makespan = 0.0;
  double bubble = 0.0;                 // 1 - busy compute time / (ranks * makespan)
  std::vector<int32_t> peak_inflight;  // per stage: most forwards whose backward was pending
                                       // (all zero for a forward-only schedule)
  // [Note: live states] Per rank, what its stages hold while each compute action runs, as
  // kLiveCounts counts per stage of the rank (stages ascending): microbatches forwarded and not yet
  // backwarded (their saved activations); microbatches backwarded and not yet weighted (what a
  // split backward keeps from B to W); and 1 while a split B runs on the stage (the gradients it
  // records for W pile up on top of the microbatch's graph until B ends). The last two are 0
  // without a split backward. While an action runs, both what it consumes and what it produces are
  // alive, so its state is the entrywise max of the counts before and after it; a split B, which
  // turns the microbatch's graph into what it keeps for W (the graph freed as B ends), has two:
  // the counts before it with the running-B count set, and the counts after it.
  // live_states[r][k] lists the states of the actions of the rank's k-th stage that no other of
  // them covers entrywise: the rank's peak is the largest, over k and those states, of the
  // non-negative per-microbatch bytes weighted by the state plus stage k's working set.
  std::vector<std::vector<std::vector<std::vector<int32_t>>>> live_states;
};

// Throws c10::Error naming the first problem: a missing, duplicated or misplaced action, a receive
// without a send, or a deadlock (with the action each rank is blocked on).
void validate(const Schedule& s);
SimResult simulate(const Schedule& s, const Costs& costs);

}  // namespace pippy_xla
