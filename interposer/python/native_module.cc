// jitckpt._native: Python face of libjit.so. Talks to the preloaded library through the C ABI in
// jit_abi.h, found at run time, so importing this module never loads libjit.so itself.
#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <nccl.h>
#include <pybind11/functional.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <string>

#include "gil_handoff.h"
#include "hang_timeout.h"
#include "jitckpt/jit_abi.h"

namespace py = pybind11;

namespace {

const char* const kNotPreloaded =
    "libjit.so is not loaded in this process: start it with LD_PRELOAD=<build>/lib/libjit.so "
    "(or through `jitckpt run`)";

const char* const kPhases[] = {"idle", "forward", "backward", "allreduce", "optimizer", "checkpoint", "eval"};

// The module's single registry: the located libjit.so API and the Python failure callback.
class NativeState {
 public:
  static NativeState& instance() {
    static NativeState* const state = new NativeState();  // used by the watchdog thread until exit
    return *state;
  }

  const jitckpt_api* api() const { return api_; }
  std::string library_path() const { return library_path_; }

  // Called with the GIL held.
  void set_callback(py::object cb, double gil_grace_s, bool resume) {
    resume_ = resume;
    PyObject* old = callback_;
    callback_ = cb.is_none() ? nullptr : cb.release().ptr();
    Py_XDECREF(old);
    gil_grace_ = std::chrono::milliseconds(static_cast<int64_t>(std::ceil(gil_grace_s * 1000.0)));
    if (api_ != nullptr) api_->set_failure_handler(callback_ ? &NativeState::on_failure : nullptr, this);
  }
  bool has_callback() const { return callback_ != nullptr; }

 private:
  NativeState() {
    void* sym = dlsym(RTLD_DEFAULT, "jitckpt_api_v1");
    if (sym == nullptr) return;
    auto get = reinterpret_cast<const jitckpt_api* (*)()>(sym);
    const jitckpt_api* api = get();
    if (api == nullptr || api->abi_version != JITCKPT_ABI_VERSION) return;
    api_ = api;
    Dl_info info{};
    if (dladdr(sym, &info) != 0 && info.dli_fname != nullptr) library_path_ = info.dli_fname;
  }

  // libjit.so's watchdog thread, no GIL. Takes the GIL (pre-empting a stuck holder), runs cb.
  static int on_failure(const char* kind, const char* detail, void* ctx) {
    auto* self = static_cast<NativeState*>(ctx);
    if (!Py_IsInitialized()) return 0;
    jitckpt::GilHandoff& handoff = jitckpt::gil_handoff();
    PyGILState_STATE gil = handoff.acquire(self->gil_grace_);
    if (self->callback_ != nullptr) {
      PyObject* cb = self->callback_;
      Py_INCREF(cb);
      PyObject* result = PyObject_CallFunction(cb, "ss", kind, detail);
      Py_DECREF(cb);
      if (result != nullptr) {
        Py_DECREF(result);
      } else if (PyErr_ExceptionMatches(PyExc_SystemExit)) {
        exit_from_system_exit();
      } else {
        PyErr_Print();
      }
    }
    // Default: the failure is terminal. Threads stuck in CUDA stay parked without the GIL and device
    // work stays redirected, so a save the callback only scheduled (another Python thread) can run.
    if (self->resume_) self->api_->end_save_mode();  // before the parked threads run again
    handoff.release(gil, self->resume_);
    return self->resume_ ? 0 : 1;
  }

  // A normal interpreter shutdown would wait for the thread parked in a blocked CUDA call, so
  // SystemExit raised by the callback ends the process directly, after flushing Python's stdio.
  static void exit_from_system_exit() {
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    int code = 1;
    PyObject* arg = value ? PyObject_GetAttrString(value, "code") : nullptr;
    if (arg == nullptr || arg == Py_None) {
      code = 0;
    } else if (PyLong_Check(arg)) {
      code = static_cast<int>(PyLong_AsLong(arg));
    } else {
      PyObject_Print(arg, stderr, Py_PRINT_RAW);
      fputc('\n', stderr);
    }
    PyErr_Clear();
    for (const char* name : {"stdout", "stderr"}) {
      PyObject* stream = PySys_GetObject(name);  // borrowed
      if (stream != nullptr && stream != Py_None) {
        PyObject* r = PyObject_CallMethod(stream, "flush", nullptr);
        Py_XDECREF(r);
        PyErr_Clear();
      }
    }
    fflush(nullptr);
    _exit(code);
  }

  const jitckpt_api* api_ = nullptr;
  std::string library_path_;
  PyObject* callback_ = nullptr;
  std::chrono::milliseconds gil_grace_{200};
  bool resume_ = false;
};

const jitckpt_api& require_api() {
  const jitckpt_api* api = NativeState::instance().api();
  if (api == nullptr) throw std::runtime_error(kNotPreloaded);
  return *api;
}

bool preloaded() { return NativeState::instance().api() != nullptr; }

bool configure(const std::string& mode, py::object hang_timeout) {
  if (mode != "observe") throw py::value_error("unknown mode '" + mode + "': only mode='observe' is supported");
  std::string text;
  if (!hang_timeout.is_none()) {
    // A number means fixed seconds; a string is the policy grammar, parsed by libjit.so's own parser.
    text = py::isinstance<py::str>(hang_timeout) ? hang_timeout.cast<std::string>()
                                                 : std::string(py::str(py::float_(hang_timeout)));
    std::string error;
    if (!jitckpt::HangTimeoutPolicy::parse(text, &error)) throw py::value_error(error);
  }
  const jitckpt_api* api = NativeState::instance().api();
  if (api == nullptr) return false;
  char err[256] = {0};
  if (api->configure(mode.c_str(), text.c_str(), err, sizeof err) != 0) throw py::value_error(err);
  return true;
}

void mark_minibatch(int64_t step) {
  if (step < 0) throw py::value_error("mark_minibatch: step must be >= 0, got " + std::to_string(step));
  if (const jitckpt_api* api = NativeState::instance().api()) api->mark_minibatch(step);
}

void set_phase(const std::string& phase) {
  bool known = false;
  for (const char* p : kPhases) known = known || phase == p;
  if (!known) {
    std::string list;
    for (const char* p : kPhases) list += std::string(list.empty() ? "" : ", ") + p;
    throw py::value_error("set_phase: unknown phase '" + phase + "'; expected one of " + list);
  }
  if (const jitckpt_api* api = NativeState::instance().api()) api->set_phase(phase.c_str());
}

py::dict status() {
  NativeState& state = NativeState::instance();
  py::dict out;
  if (state.api() == nullptr) {
    out["preloaded"] = false;
    out["reason"] = kNotPreloaded;
  } else {
    // The status grows between two calls while collectives are issued: retry until it fits.
    std::string buf(4096, '\0');
    size_t n = state.api()->status_json(buf.data(), buf.size());
    while (n >= buf.size()) {
      buf.assign(2 * n + 1, '\0');
      n = state.api()->status_json(buf.data(), buf.size());
    }
    buf.resize(n);
    out = py::module_::import("json").attr("loads")(buf).cast<py::dict>();
    out["library"] = state.library_path();
  }
  out["failure_callback"] = state.has_callback();
  out["gil_signal"] = jitckpt::gil_handoff().signal_number();
  out["gil_preemptions"] = jitckpt::gil_handoff().preemptions();
  return out;
}

void set_failure_callback(py::object cb, double gil_grace_s, bool resume) {
  if (!cb.is_none() && !PyCallable_Check(cb.ptr()))
    throw py::type_error("set_failure_callback: cb must be callable as cb(kind: str, detail: str) or None");
  if (!std::isfinite(gil_grace_s) || gil_grace_s <= 0 || gil_grace_s > 60)
    throw py::value_error("set_failure_callback: gil_grace_s must be in (0, 60] seconds");
  const char* why = nullptr;
  if (!cb.is_none() && !jitckpt::gil_handoff().install(&why)) throw std::runtime_error(why);
  if (const jitckpt_api* api = NativeState::instance().api()) jitckpt::gil_handoff().set_blocking_probe(api->in_blocking_call);
  NativeState::instance().set_callback(cb, gil_grace_s, resume);
}

void set_save_thread(bool on) {
  if (const jitckpt_api* api = NativeState::instance().api()) api->set_save_thread(on ? 1 : 0);
}

void trigger_failure(const std::string& kind, const std::string& detail) {
  const jitckpt_api& api = require_api();
  py::gil_scoped_release release;  // the watchdog thread needs the GIL to run the callback
  api.trigger_failure(kind.c_str(), detail.c_str());
}

void set_log_context(int64_t iteration, int micro_batch, const std::string& payload) {
  if (payload != "activation" && payload != "gradient")
    throw py::value_error("set_log_context: payload must be 'activation' or 'gradient', got '" + payload + "'");
  if (const jitckpt_api* api = NativeState::instance().api()) api->set_log_context(iteration, micro_batch, payload.c_str());
}

void flush_send_log(double timeout_s) {
  if (!std::isfinite(timeout_s) || timeout_s <= 0)
    throw py::value_error("flush_send_log: timeout must be a positive number of seconds");
  const jitckpt_api* api = NativeState::instance().api();
  if (api == nullptr) return;
  char err[512] = {0};
  int rc;
  {
    py::gil_scoped_release release;
    rc = api->flush_send_log(timeout_s, err, sizeof err);
  }
  if (rc != 0) throw std::runtime_error(std::string("send log: ") + err);
}

int drop_send_logs_through(int64_t iteration) {
  const jitckpt_api* api = NativeState::instance().api();
  return api == nullptr ? 0 : api->drop_send_logs_through(iteration);
}

}  // namespace

PYBIND11_MODULE(_native, m) {
  m.doc() = "Native side of jitckpt: control and status of the LD_PRELOADed libjit.so (observe mode).";
  py::dict built;  // what the native parts were compiled against (jitckpt doctor)
  built["cuda_runtime_version"] = CUDART_VERSION;
  built["nccl_version"] = std::to_string(NCCL_MAJOR) + "." + std::to_string(NCCL_MINOR) + "." + std::to_string(NCCL_PATCH);
  built["cuda_include"] = JITCKPT_CUDA_INCLUDE;
  built["nccl_include"] = JITCKPT_NCCL_INCLUDE;
  m.attr("built_with") = built;
  m.def("preloaded", &preloaded, "True if libjit.so is loaded in this process (LD_PRELOAD).");
  m.def("configure", &configure, py::kw_only(), py::arg("mode") = "observe", py::arg("hang_timeout") = py::none(),
        "Validate and apply settings: mode ('observe') and the hang timeout: seconds, or the policy text "
        "'auto[:floor=S,mult=X,startup=S,window=N,warmup=N]' (None keeps the current one: "
        "$JITCKPT_HANG_TIMEOUT, else auto). Returns False if libjit.so is not loaded.");
  m.def("mark_minibatch", &mark_minibatch, py::arg("step"),
        "Record the minibatch (step) now running; shown in status() and failure reports.");
  m.def("set_phase", &set_phase, py::arg("phase"),
        "Record the training phase: idle, forward, backward, allreduce, optimizer, checkpoint or eval.");
  m.def("status", &status,
        "dict: preloaded, mode, hang_timeout, step, phase, nccl_streams, dependent_streams, communicators, "
        "collectives_completed, in_flight [{seq, op, stream, step, phase, in_host_call, age_s}], last_error, "
        "saving, redirect_active, send_log {enabled, dir, queued, written, files, bytes, error}, "
        "watchdog_running, library, failure_callback, gil_signal, gil_preemptions.");
  m.def("set_failure_callback", &set_failure_callback, py::arg("cb"), py::kw_only(), py::arg("gil_grace_s") = 0.2,
        py::arg("resume") = false,
        "Register cb(kind, detail), run once on libjit.so's watchdog thread with the GIL held when a failure "
        "is detected (a GIL holder stuck in a blocking CUDA/NCCL call is pre-empted after gil_grace_s). "
        "Device work goes to a fresh stream from then on. cb should save and exit (os._exit or SystemExit). "
        "If cb returns: by default stuck threads stay parked and the redirection stays on (the failure is "
        "terminal; another thread may finish the save); with resume=True they take the GIL back and return "
        "into their blocked call, and the redirection ends.");
  m.def("set_save_thread", &set_save_thread, py::arg("on"),
        "Mark (True) or unmark the calling thread as one that runs the JIT save: while save mode is on, only "
        "save threads' device work goes to the fresh save stream; other threads keep their streams and "
        "block behind a hung one. The watchdog thread is marked while the failure callback runs.");
  m.def("trigger_failure", &trigger_failure, py::arg("kind"), py::arg("detail") = "",
        "Report a failure as if the watchdog had detected it (runs the callback on the watchdog thread).");
  m.def("set_log_context", &set_log_context, py::arg("iteration"), py::arg("micro_batch"), py::arg("payload"),
        "Send log ($JITCKPT_SEND_LOG_DIR): what the next ncclSend calls carry (iteration, micro-batch, "
        "'activation' or 'gradient'). No-op when libjit.so is not loaded.");
  m.def("flush_send_log", &flush_send_log, py::arg("timeout") = 30.0,
        "Wait until every logged ncclSend is written to a chunk file; RuntimeError on a timeout (a copy "
        "waits behind a blocked stream) or after a failed copy/write.");
  m.def("drop_send_logs_through", &drop_send_logs_through, py::arg("iteration"),
        "Delete the send-log chunk files holding only iterations <= iteration; returns how many.");
  m.def("library_path", []() { return NativeState::instance().library_path(); },
        "Path of the loaded libjit.so, or '' if it is not loaded.");
}
