// Bindings of the transport wing (csrc/transport/): the small collectives on C++-owned buffers,
// the same-host transport, the batch fingerprints of the step handshake.
#include <torch/csrc/utils/pybind.h>

#include <chrono>

#include "bindings/bindings.h"
#include "transport/p2p.h"
#include "transport/shm.h"

namespace pippy_xla::bindings {

namespace {

using std::chrono::milliseconds;

void bind_collectives(py::module_& m) {
  m.def(
      "all_gather_int64",
      [](const std::vector<int64_t>& values, const std::string& group_name,
         const std::string& device, int64_t timeout_ms, std::string what, Abortable* abortable) {
        return all_gather_int64(values, group_name, c10::Device(device), milliseconds(timeout_ms),
                                std::move(what), abortable);
      },
      py::arg("values"), py::arg("group_name"), py::arg("device"), py::arg("timeout_ms"),
      py::arg("what"), py::arg("abortable") = nullptr, py::call_guard<py::gil_scoped_release>(),
      "Every rank's values (the same count on every rank), gathered on buffers that never reach "
      "Python (see [Note: collectives on C++-owned buffers] in csrc/transport/p2p.h).");
  m.def(
      "broadcast_copy",
      [](const at::Tensor& tensor, int64_t root, const std::string& group_name, int64_t timeout_ms,
         std::string what, Abortable* abortable) {
        return broadcast_copy(tensor, root, group_name, milliseconds(timeout_ms), std::move(what),
                              abortable);
      },
      py::arg("tensor"), py::arg("root"), py::arg("group_name"), py::arg("timeout_ms"),
      py::arg("what"), py::arg("abortable") = nullptr, py::call_guard<py::gil_scoped_release>(),
      "A copy of group rank `root`'s tensor, broadcast on a buffer that never reaches Python.");
  m.def(
      "all_reduce_sum_copy",
      [](const at::Tensor& tensor, const std::string& group_name, int64_t timeout_ms,
         std::string what, Abortable* abortable) {
        return all_reduce_sum_copy(tensor, group_name, milliseconds(timeout_ms), std::move(what),
                                   abortable);
      },
      py::arg("tensor"), py::arg("group_name"), py::arg("timeout_ms"), py::arg("what"),
      py::arg("abortable") = nullptr, py::call_guard<py::gil_scoped_release>(),
      "The sum of every rank's tensor, all-reduced on a buffer that never reaches Python.");
}

void bind_shared_memory(py::module_& m) {
  m.def(
      "shm_attach",
      [](const std::string& group_name, int64_t timeout_ms, int64_t spin_us) {
        return shm_attach(group_name, milliseconds(timeout_ms), spin_us);
      },
      py::arg("group_name"), py::arg("timeout_ms"), py::arg("spin_us") = -1,
      py::call_guard<py::gil_scoped_release>(),
      "Collective: moves the group's point-to-point transfers between ranks of this host onto "
      "shared memory (see [Note: same-host transport] in csrc/transport/shm.h). Returns how many "
      "peers this rank reaches that way (0: none, the group's own transport stays). `spin_us`: "
      "how long this rank's waits on the group poll before they sleep (negative: decided from "
      "the host's ranks and cores, [Note: spinning before sleeping]); attaching again with "
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
        "csrc/transport/shm.cpp).");
  m.attr("SHM_SLOTS") = kShmSlots;
  m.attr("SHM_SPIN_US") = kShmSpinUs;
}

at::Tensor receive_checked_at_step_end(at::Tensor buffer, int64_t peer, int64_t tag,
                                       const std::string& group_name, int64_t timeout_ms) {
  const milliseconds timeout(timeout_ms);
  DeviceWaits waits;
  Abortable live;
  waits.add(irecv(buffer, peer, tag, group_name, "a receive checked at the end of a step"),
            timeout);
  waits.finish(timeout, live);
  return buffer;
}

void bind_fingerprints(py::module_& m) {
  m.def("content_digest", &content_digest, py::arg("tensor"),
        py::call_guard<py::gil_scoped_release>(),
        "A 64-bit fingerprint of the tensor's bytes (not a cryptographic hash).");
  py::class_<BatchKey>(m, "BatchKey",
                       "What the step handshake compares of a batch ([Note: step handshake] in "
                       "pippy_xla/runtime/_batch.py).")
      .def_readonly("signature", &BatchKey::signature,
                    "fingerprint of the input names, dtypes and shapes")
      .def_readonly("content", &BatchKey::content, "fingerprint of the values (0: not checked)")
      .def_readonly("contents", &BatchKey::contents,
                    "each input's content_digest in the order given (empty: not checked)");
  m.def("batch_key", &batch_key, py::arg("names"), py::arg("tensors"), py::arg("check_content"),
        "Fingerprints of a batch's input names, dtypes and shapes and (with `check_content`) of "
        "its values, whole and per input (content_digest), for the step handshake.");
}

}  // namespace

void bind_transport(py::module_& m) {
  // A failed or timed-out transfer or collective (as opposed to an error of the stage's own
  // code): Python tells a dead peer apart by it (see [Note: naming a dead rank] in
  // pippy_xla/runtime/failures.py).
  py::register_exception<TransferError>(m, "TransferError", PyExc_RuntimeError);
  m.attr("DEFAULT_TIMEOUT_MS") = kDefaultTimeoutMs;
  py::class_<Abortable, std::shared_ptr<Abortable>>(
      m, "Abortable",
      "Lets another thread end a collective's waits: pass it as `abortable` to a collective "
      "over shared memory and call abort() (see [Note: watched collectives] in "
      "pippy_xla/runtime/failures.py).")
      .def(py::init<>())
      .def("abort", &Abortable::abort, py::call_guard<py::gil_scoped_release>(),
           "Ends the waits of the collective it was given to, and of any it is given to later, "
           "with an error (thread-safe).")
      .def_property_readonly("aborted", &Abortable::aborted);
  bind_collectives(m);
  bind_shared_memory(m);
  bind_fingerprints(m);
  m.def("_receive_checked_at_step_end", &receive_checked_at_step_end, py::arg("buffer"),
        py::arg("peer"), py::arg("tag"), py::arg("group_name"), py::arg("timeout_ms"),
        py::call_guard<py::gil_scoped_release>(),
        "For tests: a receive into `buffer` that DeviceWaits checks (see [Note: waits on a "
        "GPU]): returns `buffer` once it arrived, or raises TransferError at `timeout_ms`.");
}

}  // namespace pippy_xla::bindings
