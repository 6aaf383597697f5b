// The module pippy_xla._C: its own two entries, then each wing's bindings (bindings.h).
#include <dlfcn.h>

#include <locale>
#include <string>

#include "bindings/bindings.h"

namespace {

std::string libstdcxx_file() {
  // std::locale::classic is never inline: the file holding the definition this module calls is
  // the libstdc++ it runs with ([Note: one libstdc++] in setup.py).
  Dl_info info{};
  auto fn = reinterpret_cast<void*>(&std::locale::classic);
  return dladdr(fn, &info) != 0 && info.dli_fname ? std::string(info.dli_fname) : std::string();
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  using namespace pippy_xla::bindings;
  m.doc() = "pippy_xla C++ core: schedules, stash, engine, planner (see _C.pyi for the types)";
  m.def(
      "libstdcxx_file", &libstdcxx_file,
      "The shared object that defines the libstdc++ functions this module calls ('' if unknown).");
  bind_schedule(m);
  bind_transport(m);
  bind_runtime(m);
  bind_plan(m);
}
