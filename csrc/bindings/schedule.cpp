// Bindings of the schedule wing (csrc/schedule/).
#include <c10/util/StringUtil.h>
#include <pybind11/operators.h>

#include "bindings/bindings.h"
#include "schedule/facts.h"
#include "schedule/generators.h"
#include "schedule/layout.h"
#include "schedule/simulator.h"

namespace pippy_xla::bindings {

namespace {

void bind_actions(py::module_& m) {
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
}

SimResult simulate_at(const Schedule& s, std::vector<double> forward, std::vector<double> backward,
                      std::vector<double> weight, double comm, double send, double recv) {
  return simulate(
      s, Costs{std::move(forward), std::move(backward), std::move(weight), comm, send, recv});
}

void bind_schedule_class(py::module_& m) {
  const Schedule defaults;
  const Costs no_costs;
  py::class_<Schedule>(m, "Schedule")
      .def(py::init(&Schedule::from_parts), py::arg("name"), py::arg("num_ranks"),
           py::arg("num_microbatches"), py::arg("stage_rank"), py::arg("actions"),
           py::arg("backward") = defaults.backward,
           py::arg("split_backward") = defaults.split_backward)
      .def_readonly("name", &Schedule::name)
      .def_readonly("num_ranks", &Schedule::num_ranks)
      .def_readonly("num_stages", &Schedule::num_stages)
      .def_readonly("num_microbatches", &Schedule::num_microbatches)
      .def_readonly("backward", &Schedule::backward)
      .def_readonly("split_backward", &Schedule::split_backward)
      .def_readonly("decode_groups", &Schedule::decode_groups)
      .def_readonly("stage_rank", &Schedule::stage_rank)
      .def_static("from_csv", &Schedule::from_csv, py::arg("text"), py::arg("name") = "csv",
                  "A schedule in torch.distributed.pipelining's CSV action format (the file's "
                  "text), validated: see [Note: CSV schedules] in csrc/schedule/schedule.h.")
      .def("to_csv", &Schedule::to_csv, py::arg("comms") = false,
           "This schedule in torch.distributed.pipelining's CSV action format.")
      .def_readonly("actions", &Schedule::actions)
      .def("table", &Schedule::table)
      .def("stages_of", &Schedule::stages_of)
      .def("validate", [](const Schedule& s) { validate(s); })
      .def("simulate", &simulate_at, py::arg("forward") = std::vector<double>{},
           py::arg("backward") = std::vector<double>{}, py::arg("weight") = std::vector<double>{},
           py::arg("comm") = no_costs.comm, py::arg("send") = no_costs.send,
           py::arg("recv") = no_costs.recv);
}

void bind_facts(py::module_& m) {
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
  m.def("schedule_names", &schedule_names);
  m.def("train_schedule_names", &train_schedule_names);
  m.def("default_chunks", &default_chunks, py::arg("name"));
}

Schedule make_schedule_at(const std::string& name, int32_t num_ranks, int32_t num_microbatches,
                          int32_t chunks, const std::string& placement, std::vector<double> forward,
                          std::vector<double> backward, std::vector<double> weight) {
  return make_schedule(name, num_ranks, num_microbatches, chunks, placement,
                       Costs{std::move(forward), std::move(backward), std::move(weight)});
}

void bind_generators(py::module_& m) {
  m.def("make_schedule", &make_schedule_at, py::arg("name"), py::arg("num_ranks"),
        py::arg("num_microbatches"), py::arg("chunks") = 0, py::arg("placement") = "",
        py::kw_only(), py::arg("forward") = std::vector<double>{},
        py::arg("backward") = std::vector<double>{}, py::arg("weight") = std::vector<double>{},
        "A generated schedule; `forward` / `backward` / `weight` (per-stage costs) order a "
        "list-scheduled one ([Note: list scheduling at costs]).");
  m.def("forward_schedule", &forward_schedule, py::arg("stage_rank"), py::arg("num_ranks"),
        py::arg("num_microbatches"),
        "Evaluation on the stages where `stage_rank` puts them (any placement).");
  m.def("decode_schedule", &decode_schedule, py::arg("stage_rank"), py::arg("num_ranks"),
        py::arg("groups"), py::arg("tokens"),
        "Pipelined decoding of `tokens` tokens for `groups` groups of rows ([Note: decode "
        "schedules]): microbatch t * groups + g is group g's token t.");
}

void bind_layout(py::module_& m) {
  m.def("stage_rank", &stage_rank, py::arg("stage"), py::arg("num_ranks"),
        py::arg("placement") = "loop");
  m.def("check_stage_count", &check_stage_count, py::arg("num_layers"), py::arg("num_stages"));
  m.def("balanced_ranges", &balanced_ranges, py::arg("num_layers"), py::arg("num_stages"),
        "Contiguous layer ranges (start, stop) whose sizes differ by at most one (earlier stages "
        "get more); ValueError as check_stage_count.");
}

}  // namespace

void bind_schedule(py::module_& m) {
  bind_actions(m);
  bind_schedule_class(m);
  bind_facts(m);
  bind_generators(m);
  bind_layout(m);
}

}  // namespace pippy_xla::bindings
