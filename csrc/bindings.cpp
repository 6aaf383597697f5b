// The one pybind11 translation unit: pippy_xla._C.
#include <dlfcn.h>
#include <pybind11/operators.h>
#include <torch/extension.h>

#include <locale>

#include "engine.h"
#include "memory.h"
#include "ops/shm.h"
#include "planner.h"
#include "schedule.h"
#include "split_backward.h"
#include "stash.h"

namespace py = pybind11;
using namespace pippy_xla;

namespace {

// The fields of `T::action` (op, stage, mb) as fields of `T`.
template <typename T>
py::class_<T> def_action_fields(py::class_<T> c) {
  return c.def_property_readonly("op", [](const T& t) { return op_name(t.action.op); })
      .def_property_readonly("stage", [](const T& t) { return t.action.stage; })
      .def_property_readonly("mb", [](const T& t) { return t.action.mb; });
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.def(
      "libstdcxx_file",
      [] {
        // std::locale::classic is never inline: the file holding the definition this module
        // calls is the libstdc++ it runs with ([Note: one libstdc++] in setup.py).
        Dl_info info{};
        auto fn = reinterpret_cast<void*>(&std::locale::classic);
        return dladdr(fn, &info) != 0 && info.dli_fname ? std::string(info.dli_fname)
                                                         : std::string();
      },
      "The shared object that defines the libstdc++ functions this module calls ('' if unknown).");
  m.doc() = "pippy_xla C++ core: schedules, stash, engine, planner (see _C.pyi for the types)";
  // A failed or timed-out transfer or collective (as opposed to an error of the stage's own
  // code): Python tells a dead peer apart by it (see [Note: naming a dead rank] in errors.py).
  py::register_exception<TransferError>(m, "TransferError", PyExc_RuntimeError);

  py::class_<Action>(m, "Action", "One action of a rank's list: op, stage and microbatch.")
      .def(py::init(&parse_action), py::arg("op"), py::arg("stage"), py::arg("mb"))
      .def_property_readonly("op", [](const Action& a) { return op_name(a.op); })
      .def_readonly("stage", &Action::stage)
      .def_readonly("mb", &Action::mb)
      .def(py::self == py::self)
      .def("__hash__",
           [](const Action& a) { return py::hash(py::make_tuple(op_name(a.op), a.stage, a.mb)); })
      .def("__repr__", [](const Action& a) {
        return c10::str("Action('", op_name(a.op), "', ", a.stage, ", ", a.mb, ")");
      });

  def_action_fields(py::class_<TimedAction>(m, "TimedAction", "An action of a simulated timeline."))
      .def_readonly("rank", &TimedAction::rank)
      .def_readonly("start", &TimedAction::start)
      .def_readonly("end", &TimedAction::end);

  py::class_<SimResult>(m, "SimResult", "What Schedule.simulate predicts.")
      .def_readonly("timeline", &SimResult::timeline)
      .def_readonly("makespan", &SimResult::makespan)
      .def_readonly("bubble", &SimResult::bubble)
      .def_readonly("peak_inflight", &SimResult::peak_inflight)
      .def_readonly("live_states", &SimResult::live_states,
                    "per rank, per stage of the rank: the states while it computes, counts per "
                    "stage of the rank, [forwarded not backwarded, backwarded not weighted, "
                    "running split B] each (see [Note: live states])");

  const Schedule schedule_defaults;
  py::class_<Schedule>(m, "Schedule")
      .def(py::init(&Schedule::from_parts), py::arg("name"), py::arg("num_ranks"),
           py::arg("num_microbatches"), py::arg("stage_rank"), py::arg("actions"),
           py::arg("backward") = schedule_defaults.backward,
           py::arg("split_backward") = schedule_defaults.split_backward)
      .def_readonly("name", &Schedule::name)
      .def_readonly("num_ranks", &Schedule::num_ranks)
      .def_readonly("num_stages", &Schedule::num_stages)
      .def_readonly("num_microbatches", &Schedule::num_microbatches)
      .def_readonly("backward", &Schedule::backward)
      .def_readonly("split_backward", &Schedule::split_backward)
      .def_readonly("stage_rank", &Schedule::stage_rank)
      .def_static("from_csv", &Schedule::from_csv, py::arg("text"), py::arg("name") = "csv",
                  "A schedule in torch.distributed.pipelining's CSV action format (the file's "
                  "text), validated: see [Note: CSV schedules] in csrc/schedule.h.")
      .def("to_csv", &Schedule::to_csv, py::arg("comms") = false,
           "This schedule in torch.distributed.pipelining's CSV action format.")
      .def_readonly("actions", &Schedule::actions)
      .def("table", &Schedule::table)
      .def("stages_of", &Schedule::stages_of)
      .def("validate", [](const Schedule& s) { validate(s); })
      .def(
          "simulate",
          [](const Schedule& s, std::vector<double> forward, std::vector<double> backward,
             std::vector<double> weight, double comm, double send, double recv) {
            return simulate(s, Costs{std::move(forward), std::move(backward), std::move(weight),
                                     comm, send, recv});
          },
          py::arg("forward") = std::vector<double>{}, py::arg("backward") = std::vector<double>{},
          py::arg("weight") = std::vector<double>{}, py::arg("comm") = Costs{}.comm,
          py::arg("send") = Costs{}.send, py::arg("recv") = Costs{}.recv);

  py::class_<ScheduleInfo>(m, "ScheduleInfo", "The facts of one schedule ([Note: schedule facts])")
      .def_readonly("name", &ScheduleInfo::name)
      .def_readonly("description", &ScheduleInfo::description)
      .def_readonly("trains", &ScheduleInfo::trains)
      .def_readonly("split_backward", &ScheduleInfo::split_backward)
      .def_readonly("min_chunks", &ScheduleInfo::min_chunks)
      .def_readonly("max_chunks", &ScheduleInfo::max_chunks)
      .def_readonly("default_chunks", &ScheduleInfo::default_chunks)
      .def_readonly("equal_stages", &ScheduleInfo::equal_stages)
      .def_readonly("placement", &ScheduleInfo::placement)
      .def_readonly("list_scheduled", &ScheduleInfo::list_scheduled)
      .def("__repr__", [](const ScheduleInfo& i) { return "<ScheduleInfo " + i.name + ">"; });
  m.def("schedule_table", &schedule_table, py::return_value_policy::reference);
  m.def("schedule_info", &schedule_info, py::arg("name"), py::return_value_policy::reference);
  m.def(
      "make_schedule",
      [](const std::string& name, int32_t num_ranks, int32_t num_microbatches, int32_t chunks,
         const std::string& placement, std::vector<double> forward, std::vector<double> backward,
         std::vector<double> weight) {
        return make_schedule(name, num_ranks, num_microbatches, chunks, placement,
                             Costs{std::move(forward), std::move(backward), std::move(weight)});
      },
      py::arg("name"), py::arg("num_ranks"), py::arg("num_microbatches"), py::arg("chunks") = 0,
      py::arg("placement") = "", py::kw_only(), py::arg("forward") = std::vector<double>{},
      py::arg("backward") = std::vector<double>{}, py::arg("weight") = std::vector<double>{},
      "A generated schedule; `forward` / `backward` / `weight` (per-stage costs) order a "
      "list-scheduled one ([Note: list scheduling at costs]).");
  m.def("forward_schedule", &forward_schedule, py::arg("stage_rank"), py::arg("num_ranks"),
        py::arg("num_microbatches"),
        "Evaluation on the stages where `stage_rank` puts them (any placement).");
  m.def("schedule_names", &schedule_names);
  m.def("train_schedule_names", &train_schedule_names);
  m.def("default_chunks", &default_chunks, py::arg("name"));
  m.def("stage_rank", &stage_rank, py::arg("stage"), py::arg("num_ranks"),
        py::arg("placement") = "loop");
  m.def("check_stage_count", &check_stage_count, py::arg("num_layers"), py::arg("num_stages"));
  m.def("balanced_ranges", &balanced_ranges, py::arg("num_layers"), py::arg("num_stages"),
        "Contiguous layer ranges (start, stop) whose sizes differ by at most one (earlier stages "
        "get more); ValueError as check_stage_count.");
  m.attr("TIED_WEIGHT_TAG_BASE") = kTiedWeightTagBase;
  m.def("tied_weight_tag", &tied_weight_tag, py::arg("tie"));

  py::class_<StashSlot>(m, "StashSlot", "What the stash keeps of one (stage, microbatch).")
      .def_readonly("inputs", &StashSlot::inputs)
      .def_readonly("outputs", &StashSlot::outputs);

  py::class_<Stash>(m, "Stash")
      .def(py::init<>())
      .def("push",
           [](Stash& s, int64_t stage, int64_t mb, std::vector<at::Tensor> inputs,
              std::vector<at::Tensor> outputs) {
             s.push(stage, mb, StashSlot{std::move(inputs), std::move(outputs)});
           })
      .def("pop", &Stash::pop)
      .def("peek", &Stash::peek, py::return_value_policy::copy)
      .def("contains", &Stash::contains)
      .def("__len__", &Stash::size)
      .def_property_readonly("live_bytes", &Stash::live_bytes)
      .def_property_readonly("peak_bytes", &Stash::peak_bytes)
      .def("reset_peak", &Stash::reset_peak)
      .def("check_empty", &Stash::check_empty);

  py::class_<Abortable, std::shared_ptr<Abortable>>(
      m, "Abortable",
      "Lets another thread end a collective's waits: pass it as `abortable` to a collective "
      "over shared memory and call abort() (see [Note: watched collectives] in "
      "pippy_xla/errors.py).")
      .def(py::init<>())
      .def("abort", &Abortable::abort, py::call_guard<py::gil_scoped_release>(),
           "Ends the waits of the collective it was given to, and of any it is given to later, "
           "with an error (thread-safe).")
      .def_property_readonly("aborted", &Abortable::aborted);
  m.def(
      "all_gather_int64",
      [](const std::vector<int64_t>& values, const std::string& group_name,
         const std::string& device, int64_t timeout_ms, std::string what,
         Abortable* abortable) {
        return all_gather_int64(values, group_name, c10::Device(device),
                                std::chrono::milliseconds(timeout_ms), std::move(what), abortable);
      },
      py::arg("values"), py::arg("group_name"), py::arg("device"), py::arg("timeout_ms"),
      py::arg("what"), py::arg("abortable") = nullptr, py::call_guard<py::gil_scoped_release>(),
      "Every rank's values (the same count on every rank), gathered on buffers that never reach "
      "Python (see [Note: collectives on C++-owned buffers] in csrc/ops/p2p.h).");
  m.def(
      "shm_attach",
      [](const std::string& group_name, int64_t timeout_ms, int64_t spin_us) {
        return shm_attach(group_name, std::chrono::milliseconds(timeout_ms), spin_us);
      },
      py::arg("group_name"), py::arg("timeout_ms"), py::arg("spin_us") = -1,
      py::call_guard<py::gil_scoped_release>(),
      "Collective: moves the group's point-to-point transfers between ranks of this host onto "
      "shared memory (see [Note: same-host transport] in csrc/ops/shm.h). Returns how many peers "
      "this rank reaches that way (0: none, the group's own transport stays). `spin_us`: how "
      "long this rank's waits on the group poll before they sleep (negative: decided from the "
      "host's ranks and cores, [Note: spinning before sleeping]); attaching again with "
      "`spin_us` >= 0 sets it anew.");
  m.def("shm_peers", &shm_peers, py::arg("group_name"),
        "How many peers of the group this rank reaches through shared memory.");
  m.def(
      "shm_whole_group", [](const std::string& name) { return shm_whole_group(name); },
      py::arg("group_name"),
      "Whether this rank reaches every other rank of the group through shared memory (its "
      "small collectives then run there, and an Abortable can end their waits).");
  m.def("shm_spin_us", &shm_spin_us, py::arg("group_name"),
        "How many microseconds this rank's waits on the group's shared-memory channels poll "
        "before they sleep (0: they sleep at once; see [Note: spinning before sleeping] in "
        "csrc/ops/shm.cpp).");
  m.def(
      "_receive_checked_at_step_end",
      [](at::Tensor buffer, int64_t peer, int64_t tag, const std::string& group_name,
         int64_t timeout_ms) {
        const std::chrono::milliseconds timeout(timeout_ms);
        DeviceWaits waits;
        Abortable live;
        waits.add(irecv(buffer, peer, tag, group_name, "a receive checked at the end of a step"),
                  timeout);
        waits.finish(timeout, live);
        return buffer;
      },
      py::arg("buffer"), py::arg("peer"), py::arg("tag"), py::arg("group_name"),
      py::arg("timeout_ms"), py::call_guard<py::gil_scoped_release>(),
      "For tests: a receive into `buffer` that DeviceWaits checks (see [Note: waits on a GPU]): "
      "returns `buffer` once it arrived, or raises TransferError at `timeout_ms`.");
  m.def("content_digest", &content_digest, py::arg("tensor"),
        py::call_guard<py::gil_scoped_release>(),
        "A 64-bit fingerprint of the tensor's bytes (not a cryptographic hash).");
  m.def(
      "batch_key",
      [](const std::vector<std::string>& names, const std::vector<at::Tensor>& tensors,
         bool check_content) {
        auto key = batch_key(names, tensors, check_content);
        return py::make_tuple(key.signature, key.content, key.contents);
      },
      py::arg("names"), py::arg("tensors"), py::arg("check_content"),
      "`(signature, content, contents)`: fingerprints of a batch's input names, dtypes and shapes "
      "and (with `check_content`, else 0 and []) of its values, whole and per input "
      "(content_digest), for the step handshake.");
  m.def(
      "broadcast_copy",
      [](const at::Tensor& tensor, int64_t root, const std::string& group_name, int64_t timeout_ms,
         std::string what, Abortable* abortable) {
        return broadcast_copy(tensor, root, group_name, std::chrono::milliseconds(timeout_ms),
                              std::move(what), abortable);
      },
      py::arg("tensor"), py::arg("root"), py::arg("group_name"), py::arg("timeout_ms"),
      py::arg("what"), py::arg("abortable") = nullptr, py::call_guard<py::gil_scoped_release>(),
      "A copy of group rank `root`'s tensor, broadcast on a buffer that never reaches Python.");
  m.def(
      "all_reduce_sum_copy",
      [](const at::Tensor& tensor, const std::string& group_name, int64_t timeout_ms,
         std::string what, Abortable* abortable) {
        return all_reduce_sum_copy(tensor, group_name, std::chrono::milliseconds(timeout_ms),
                                   std::move(what), abortable);
      },
      py::arg("tensor"), py::arg("group_name"), py::arg("timeout_ms"), py::arg("what"),
      py::arg("abortable") = nullptr, py::call_guard<py::gil_scoped_release>(),
      "The sum of every rank's tensor, all-reduced on a buffer that never reaches Python.");

  m.attr("RECV_LOOKAHEAD") = kRecvLookahead;
  m.attr("SHM_SLOTS") = kShmSlots;
  m.attr("SHM_SPIN_US") = kShmSpinUs;
  m.attr("DEFAULT_TIMEOUT_MS") = kDefaultTimeoutMs;
  py::class_<WeightWork>(m, "WeightWork",
                         "What a split backward's W runs for one microbatch of a stage "
                         "(from input_gradients).")
      .def("run", &weight_gradients, py::call_guard<py::gil_scoped_release>(),
           "W: accumulates the weight gradients into the parameters' .grad (once).");
  m.def("input_gradients",
        py::overload_cast<const std::vector<at::Tensor>&, const std::vector<at::Tensor>&,
                          const std::vector<at::Tensor>&>(&input_gradients),
        py::arg("roots"), py::arg("grads"), py::arg("leaves"),
        py::call_guard<py::gil_scoped_release>(),
        "B of a split backward, as the engine runs it for zbh1: the gradients of `leaves` from "
        "`roots` with incoming `grads`, and the WeightWork W runs later (see [Note: split "
        "backward] in csrc/split_backward.cpp). The profiler measures W's time and what a "
        "microbatch keeps from B to W with it.");
  m.def("peak_receive_buffers", &peak_receive_buffers, py::arg("schedule"),
        "Per rank, the most receive buffers alive at once during a step (a replay of the "
        "engine's posting rule; see [Note: receives posted ahead]).");
  // See [Note: counting CPU allocator] in memory.h.
  m.def("memory_tracker_install", &MemoryTracker::install,
        "Installs the counting CPU allocator (for tests and benchmarks; stays installed).");
  py::class_<MemoryStats>(m, "MemoryStats", "What the counting CPU allocator counted.")
      .def_readonly("live_bytes", &MemoryStats::live_bytes)
      .def_readonly("peak_bytes", &MemoryStats::peak_bytes)
      .def_readonly("allocations", &MemoryStats::allocations)
      .def(py::pickle(  // results of spawned test processes travel pickled
          [](const MemoryStats& s) {
            return py::make_tuple(s.live_bytes, s.peak_bytes, s.allocations);
          },
          [](const py::tuple& t) {
            return MemoryStats{t[0].cast<int64_t>(), t[1].cast<int64_t>(), t[2].cast<int64_t>()};
          }));
  m.def("memory_stats", &MemoryTracker::stats,
        "The counting allocator's counts now (RuntimeError unless installed).");
  m.def("memory_reset_peak", &MemoryTracker::reset_peak,
        "Sets the counted peak to the live bytes now.");

  def_action_fields(
      py::class_<ActionTiming>(m, "ActionTiming", "When an action of the last step ran."))
      .def_readonly("start_ns", &ActionTiming::start_ns)
      .def_readonly("end_ns", &ActionTiming::end_ns);

  py::class_<Failure>(m, "Failure", "Where a failed step failed.")
      .def_readonly("stage", &Failure::stage)
      .def_readonly("microbatch", &Failure::microbatch)
      .def_readonly("peer", &Failure::peer)
      .def_readonly("action", &Failure::action)
      .def_readonly("aborted", &Failure::aborted);

  py::class_<Engine>(m, "Engine")
      .def(py::init([](Schedule schedule, std::string group_name, int64_t timeout_ms,
                       const std::string& device, std::vector<std::string> in_order) {
             EngineOptions options{std::move(group_name), timeout_ms, c10::Device(device), {}};
             if (!in_order.empty()) {
               TORCH_CHECK(in_order.size() == 3,
                           "in_order names three process groups (up, down, header), got ",
                           in_order.size());
               options.in_order = InOrderGroups{in_order[0], in_order[1], in_order[2]};
             }
             return std::make_unique<Engine>(std::move(schedule), std::move(options));
           }),
           py::arg("schedule"), py::arg("group_name"), py::arg("timeout_ms"),
           py::arg("device") = EngineOptions{}.device.str(),
           py::arg("in_order") = std::vector<std::string>{},
           "`in_order`: the names of the up, down and header groups of an engine whose transfers "
           "are matched in posting order (NCCL); see [Note: transfers matched in order].")
      .def(
          "run",
          [](Engine& e, int64_t signature, py::function forward, py::object grads_ready) {
            StageFn fn = [&forward](int64_t stage, int64_t mb, std::vector<at::Tensor> inputs) {
              py::gil_scoped_acquire gil;
              return forward(stage, mb, std::move(inputs)).cast<std::vector<at::Tensor>>();
            };
            GradsReadyFn ready;
            if (!grads_ready.is_none())
              ready = [&grads_ready](int64_t stage) {
                py::gil_scoped_acquire gil;
                grads_ready(stage);
              };
            py::gil_scoped_release nogil;
            e.run(signature, fn, ready);
          },
          py::arg("signature"), py::arg("forward"), py::arg("grads_ready") = py::none(),
          "Runs one step. `forward(stage, mb, inputs)` runs a stage's forward; "
          "`grads_ready(stage)`, if given, is called once per local stage as soon as its "
          "gradients of the step are complete (after its last B, or W, and the sends that "
          "follow it were posted): see [Note: gradients ready] in schedule_analysis.cpp.")
      .def("abort", &Engine::abort, py::call_guard<py::gil_scoped_release>(),
           "Wakes the running step's transfer waits so that run() fails now (thread-safe).")
      .def("failure", &Engine::failure, py::return_value_policy::copy)
      .def_property_readonly("rank", &Engine::rank)
      .def_property_readonly("schedule", &Engine::schedule)
      .def("timings", &Engine::timings, py::return_value_policy::copy)
      .def_property_readonly("stash_live_bytes",
                             [](const Engine& e) { return e.stash().live_bytes(); })
      .def_property_readonly("stash_peak_bytes",
                             [](const Engine& e) { return e.stash().peak_bytes(); })
      .def("reset_stash_peak", [](Engine& e) { e.stash().reset_peak(); })
      .def("stash_contains",
           [](const Engine& e, int64_t stage, int64_t mb) { return e.stash().contains(stage, mb); })
      .def(
          "stash_peek",
          [](const Engine& e, int64_t stage, int64_t mb) { return e.stash().peek(stage, mb); },
          py::return_value_policy::copy);

  // Planner types: the structs of planner.h with their field names, keyword-only constructors.
  // The Python planner uses these classes (pippy_xla/cost_model.py re-exports them).
  const LayerCost layer_defaults;
  py::class_<LayerCost>(m, "LayerCost",
                        "Per-microbatch cost of one decoder layer (see [Note: planner cost "
                        "model] in csrc/planner.h).")
      .def(py::init(&make_layer_cost), py::kw_only(), py::arg("fwd"), py::arg("bwd"),
           py::arg("recompute") = py::none(), py::arg("saved_bytes"), py::arg("saved_bytes_ckpt"),
           py::arg("static_bytes"), py::arg("transient_bytes") = layer_defaults.transient_bytes,
           py::arg("weight") = layer_defaults.weight, py::arg("weight_ckpt") = py::none(),
           py::arg("weight_bytes") = layer_defaults.weight_bytes,
           py::arg("weight_bytes_ckpt") = py::none(),
           py::arg("recorded_bytes") = layer_defaults.recorded_bytes,
           py::arg("split_transient_bytes") = layer_defaults.split_transient_bytes)
      .def_readwrite("fwd", &LayerCost::fwd)
      .def_readwrite("bwd", &LayerCost::bwd)
      .def_readwrite("recompute", &LayerCost::recompute)
      .def_readwrite("saved_bytes", &LayerCost::saved_bytes)
      .def_readwrite("saved_bytes_ckpt", &LayerCost::saved_bytes_ckpt)
      .def_readwrite("static_bytes", &LayerCost::static_bytes)
      .def_readwrite("transient_bytes", &LayerCost::transient_bytes)
      .def_readwrite("weight", &LayerCost::weight)
      .def_readwrite("weight_ckpt", &LayerCost::weight_ckpt)
      .def_readwrite("weight_bytes", &LayerCost::weight_bytes)
      .def_readwrite("weight_bytes_ckpt", &LayerCost::weight_bytes_ckpt)
      .def_readwrite("recorded_bytes", &LayerCost::recorded_bytes)
      .def_readwrite("split_transient_bytes", &LayerCost::split_transient_bytes)
      .def("__repr__", py::overload_cast<const LayerCost&>(&to_string));
  const StageExtra extra_defaults;
  py::class_<StageExtra>(m, "StageExtra",
                         "Per-microbatch cost a stage has besides its layers (prologue, "
                         "epilogue, shared tensors, transfer buffers).")
      .def(py::init<double, double, int64_t, int64_t, int64_t, int64_t, double, int64_t, int64_t,
                    int64_t, bool>(),
           py::kw_only(), py::arg("fwd") = extra_defaults.fwd, py::arg("bwd") = extra_defaults.bwd,
           py::arg("saved_bytes") = extra_defaults.saved_bytes,
           py::arg("static_bytes") = extra_defaults.static_bytes,
           py::arg("transient_bytes") = extra_defaults.transient_bytes,
           py::arg("buffer_bytes") = extra_defaults.buffer_bytes,
           py::arg("weight") = extra_defaults.weight,
           py::arg("weight_bytes") = extra_defaults.weight_bytes,
           py::arg("recorded_bytes") = extra_defaults.recorded_bytes,
           py::arg("split_transient_bytes") = extra_defaults.split_transient_bytes,
           py::arg("split_backward") = extra_defaults.split_backward)
      .def_readwrite("fwd", &StageExtra::fwd)
      .def_readwrite("bwd", &StageExtra::bwd)
      .def_readwrite("saved_bytes", &StageExtra::saved_bytes)
      .def_readwrite("static_bytes", &StageExtra::static_bytes)
      .def_readwrite("transient_bytes", &StageExtra::transient_bytes)
      .def_readwrite("buffer_bytes", &StageExtra::buffer_bytes)
      .def_readwrite("weight", &StageExtra::weight)
      .def_readwrite("weight_bytes", &StageExtra::weight_bytes)
      .def_readwrite("recorded_bytes", &StageExtra::recorded_bytes)
      .def_readwrite("split_transient_bytes", &StageExtra::split_transient_bytes)
      .def_readwrite("split_backward", &StageExtra::split_backward)
      .def("__repr__", py::overload_cast<const StageExtra&>(&to_string));
  // A list field reads as a copy (pybind11 converts vectors): assign a whole new list to change
  // it; an in-place edit such as `problem.layers.append(x)` changes only the copy.
  const PlanProblem problem_defaults;
  py::class_<PlanProblem>(m, "PlanProblem",
                          "Solver input: layers, per-stage extras, the stages' devices, the "
                          "schedule's live states and memory limits per device, and optionally "
                          "given layer ranges.")
      .def(py::init<std::vector<LayerCost>, std::vector<StageExtra>,
                    std::vector<std::vector<std::vector<std::vector<int32_t>>>>,
                    std::vector<int64_t>, std::vector<int32_t>,
                    std::vector<std::pair<int32_t, int32_t>>, bool>(),
           py::kw_only(), py::arg("layers"), py::arg("extras"), py::arg("live_states"),
           py::arg("memory_limit"), py::arg("stage_device") = problem_defaults.stage_device,
           py::arg("ranges") = problem_defaults.ranges,
           py::arg("allow_checkpoint") = problem_defaults.allow_checkpoint)
      .def_readwrite("layers", &PlanProblem::layers)
      .def_readwrite("extras", &PlanProblem::extras)
      .def_readwrite("stage_device", &PlanProblem::stage_device)
      .def_readwrite("live_states", &PlanProblem::live_states)
      .def_readwrite("memory_limit", &PlanProblem::memory_limit)
      .def_readwrite("ranges", &PlanProblem::ranges)
      .def_readwrite("allow_checkpoint", &PlanProblem::allow_checkpoint);
  py::class_<StageEval>(m, "StageEval",
                        "One stage of a solved or evaluated plan; transient_bytes, buffer_bytes "
                        "and memory are its device's.")
      .def_property_readonly("range",
                             [](const StageEval& e) { return py::make_tuple(e.start, e.stop); })
      .def_readonly("checkpoint", &StageEval::checkpoint, "global indices of checkpointed layers")
      .def_readonly("device", &StageEval::device)
      .def_readonly("forward", &StageEval::forward)
      .def_readonly("backward", &StageEval::backward, "including recomputation and W")
      .def_readonly("weight", &StageEval::weight, "W's part of backward (a splitting stage)")
      .def_readonly("time", &StageEval::time)
      .def_readonly("saved_bytes", &StageEval::saved_bytes, "per microbatch, forward to backward")
      .def_readonly("weight_bytes", &StageEval::weight_bytes, "per microbatch, B to W")
      .def_readonly("inflight", &StageEval::inflight, "at the device's peak live state")
      .def_readonly("pending_weight", &StageEval::pending_weight, "at the device's peak")
      .def_readonly("in_backward", &StageEval::in_backward, "its split B runs at the peak")
      .def_readonly("recorded_bytes", &StageEval::recorded_bytes,
                    "gradients its split B records for W")
      .def_readonly("activation_bytes", &StageEval::activation_bytes)
      .def_readonly("static_bytes", &StageEval::static_bytes)
      .def_readonly("transient_bytes", &StageEval::transient_bytes)
      .def_readonly("buffer_bytes", &StageEval::buffer_bytes)
      .def_readonly("memory", &StageEval::memory, "predicted peak bytes of its device");
  py::class_<PlanResult>(m, "PlanResult", "The solver's answer.")
      .def_readonly("feasible", &PlanResult::feasible)
      .def_readonly("stages", &PlanResult::stages, "empty when infeasible")
      .def_readonly("bottleneck", &PlanResult::bottleneck)
      .def_readonly("total_time", &PlanResult::total_time)
      .def_readonly("min_memory_limit", &PlanResult::min_memory_limit);
  m.def("solve_plan", &solve_plan, py::arg("problem"), py::call_guard<py::gil_scoped_release>(),
        "Exact planner: contiguous layer ranges and checkpointed layers per stage minimizing "
        "the bottleneck device time under per-device memory limits (see csrc/planner.h).");
  m.def("evaluate_plan", &evaluate_plan, py::arg("problem"), py::arg("ranges"),
        py::arg("checkpoint"), "The planner's cost model applied to a given plan.");
}
