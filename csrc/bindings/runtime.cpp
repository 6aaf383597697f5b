// Bindings of the runtime wing (csrc/runtime/): the engine, the stash, the split backward, the
// counting allocator.
#include <torch/csrc/utils/pybind.h>

#include <optional>

#include "bindings/bindings.h"
#include "runtime/engine.h"
#include "runtime/memory.h"
#include "runtime/schedule_analysis.h"
#include "runtime/split_backward.h"
#include "runtime/stash.h"

namespace pippy_xla::bindings {

namespace {

void bind_stash(py::module_& m) {
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
}

void bind_split_backward(py::module_& m) {
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
        "backward] in csrc/runtime/split_backward.cpp). The profiler measures W's time and what "
        "a microbatch keeps from B to W with it.");
}

void bind_memory(py::module_& m) {
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
}

void bind_step_records(py::module_& m) {
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
}

void bind_in_order(py::module_& m) {
  py::class_<InOrderGroups>(m, "InOrderGroups",
                            "The process groups of an engine whose transfers are matched in "
                            "posting order (see [Note: transfers matched in order] in "
                            "csrc/runtime/engine.h).")
      .def(py::init<std::string, std::string, std::string>(), py::kw_only(), py::arg("up_group"),
           py::arg("down_group"), py::arg("header_group"))
      .def_readonly("up_group", &InOrderGroups::up_group, "sends to higher ranks")
      .def_readonly("down_group", &InOrderGroups::down_group, "sends to lower ranks")
      .def_readonly("header_group", &InOrderGroups::header_group,
                    "gloo: boundary headers and the step handshake, in host memory");
  py::class_<HeaderChannel>(m, "HeaderChannel",
                            "Where boundary headers and the step handshake travel.")
      .def_readonly("group_name", &HeaderChannel::group_name)
      .def_property_readonly("device", [](const HeaderChannel& c) { return c.device.str(); });
  m.def(
      "header_channel",
      [](std::string group_name, const std::string& device, std::optional<InOrderGroups> in_order) {
        return header_channel(
            EngineOptions{std::move(group_name), kDefaultTimeoutMs, c10::Device(device), in_order});
      },
      py::arg("group_name"), py::arg("device"), py::arg("in_order") = py::none(),
      "The group and device of an engine's boundary headers and of the step handshake: the "
      "pipeline's group on its device, or the header group on the CPU where transfers are "
      "matched in order.");
}

void run_step(Engine& e, int64_t signature, const py::function& forward,
              const py::object& grads_ready) {
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
}

std::unique_ptr<Engine> make_engine(Schedule schedule, std::string group_name, int64_t timeout_ms,
                                    const std::string& device,
                                    std::optional<InOrderGroups> in_order) {
  return std::make_unique<Engine>(
      std::move(schedule),
      EngineOptions{std::move(group_name), timeout_ms, c10::Device(device), std::move(in_order)});
}

void bind_engine(py::module_& m) {
  py::class_<Engine>(m, "Engine")
      .def(py::init(&make_engine), py::arg("schedule"), py::arg("group_name"),
           py::arg("timeout_ms"), py::arg("device") = EngineOptions{}.device.str(),
           py::arg("in_order") = py::none(),
           "`in_order`: the groups of an engine whose transfers are matched in posting order "
           "(NCCL); see [Note: transfers matched in order].")
      .def("run", &run_step, py::arg("signature"), py::arg("forward"),
           py::arg("grads_ready") = py::none(),
           "Runs one step. `forward(stage, mb, inputs)` runs a stage's forward; "
           "`grads_ready(stage)`, if given, is called once per local stage as soon as its "
           "gradients of the step are complete (after its last B, or W, and the sends that "
           "follow it were posted): see [Note: gradients ready] in "
           "csrc/runtime/schedule_analysis.cpp.")
      .def("abort", &Engine::abort, py::call_guard<py::gil_scoped_release>(),
           "Wakes the running step's transfer waits so that run() fails now (thread-safe).")
      .def("failure", &Engine::failure, py::return_value_policy::copy)
      .def(
          "inject_fault",
          [](Engine& e, const std::string& op, int32_t stage, int32_t mb) {
            e.inject_fault(Action{parse_op(op), stage, mb});
          },
          py::arg("op"), py::arg("stage"), py::arg("mb"),
          "Fault injection, for tests: the next step that runs action (op, stage, mb) on this "
          "rank fails right after it, its transfers left in flight.")
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
}

}  // namespace

void bind_runtime(py::module_& m) {
  m.attr("TIED_WEIGHT_TAG_BASE") = kTiedWeightTagBase;
  m.def("tied_weight_tag", &tied_weight_tag, py::arg("tie"));
  m.attr("RECV_LOOKAHEAD") = kRecvLookahead;
  m.def("peak_receive_buffers", &peak_receive_buffers, py::arg("schedule"),
        "Per rank, the most receive buffers alive at once during a step (a replay of the "
        "engine's posting rule; see [Note: receives posted ahead]).");
  bind_stash(m);
  bind_split_backward(m);
  bind_memory(m);
  bind_step_records(m);
  bind_in_order(m);
  bind_engine(m);
}

}  // namespace pippy_xla::bindings
