// Bindings of the plan wing (csrc/plan/): the planner's structs with their field names and
// keyword-only constructors, and its solver. The Python planner uses these classes
// (pippy_xla/plan/cost_model.py re-exports them).
#include "bindings/bindings.h"
#include "plan/planner.h"

namespace pippy_xla::bindings {

namespace {

void bind_costs(py::module_& m) {
  const LayerCost layer_defaults;
  py::class_<LayerCost>(m, "LayerCost",
                        "Per-microbatch cost of one decoder layer (see [Note: planner cost "
                        "model] in csrc/plan/planner.h).")
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
}

void bind_problem(py::module_& m) {
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
}

void bind_solver(py::module_& m) {
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
        "the bottleneck device time under per-device memory limits (see csrc/plan/planner.h).");
  m.def("evaluate_plan", &evaluate_plan, py::arg("problem"), py::arg("ranges"),
        py::arg("checkpoint"), "The planner's cost model applied to a given plan.");
}

}  // namespace

void bind_plan(py::module_& m) {
  bind_costs(m);
  bind_problem(m);
  bind_solver(m);
}

}  // namespace pippy_xla::bindings
