// The pybind11 bindings of pippy_xla._C, one file per wing (schedule.cpp, runtime.cpp,
// transport.cpp, plan.cpp) and the module that calls them (module.cpp). Only these files see
// pybind11; the wings' C++ builds and is tested without it (CMakeLists.txt).
#pragma once

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "schedule/schedule.h"

namespace pippy_xla::bindings {

namespace py = pybind11;

void bind_schedule(py::module_& m);
void bind_transport(py::module_& m);
void bind_runtime(py::module_& m);
void bind_plan(py::module_& m);

// The fields of `T::action` (op, stage, mb) as fields of `T`.
template <typename T>
py::class_<T> def_action_fields(py::class_<T> c) {
  return c.def_property_readonly("op", [](const T& t) { return op_name(t.action.op); })
      .def_property_readonly("stage", [](const T& t) { return t.action.stage; })
      .def_property_readonly("mb", [](const T& t) { return t.action.mb; });
}

}  // namespace pippy_xla::bindings
