// Takes the GIL on a native thread even when the thread holding it is stuck in a blocking native
// call (e.g. cudaStreamSynchronize behind a hung collective, called through ctypes.PyDLL, which does
// not release the GIL). The paper's technique: after a grace period in which a healthy holder would
// have dropped the GIL (the eval loop drops it every sys.getswitchinterval()), signal the Python
// threads with pthread_sigqueue; the handler, on the thread that holds the GIL while it is inside a
// blocking CUDA/NCCL call intercepted by libjit.so (never while it runs Python), releases it
// (PyEval_SaveThread) and parks inside the handler until release() lets it take the GIL back, so it
// never runs Python without the GIL.
#pragma once

#include <Python.h>
#include <pthread.h>
#include <semaphore.h>
#include <signal.h>

#include <atomic>
#include <chrono>

namespace jitckpt {

class GilHandoff {
 public:
  GilHandoff();
  // Tells whether the calling thread is inside a blocking CUDA/NCCL call (async-signal-safe).
  void set_blocking_probe(int (*probe)(void)) { blocking_probe_ = probe; }
  // Installs the signal handler (idempotent). Returns false with errno-style reason if the signal
  // already has a foreign handler.
  bool install(const char** why);
  int signal_number() const { return signo_; }

  // On a thread that does not hold the GIL.
  PyGILState_STATE acquire(std::chrono::milliseconds grace);
  // Releases the GIL; with resume_parked, threads parked in the handler take it back and return
  // into their blocked call, otherwise they stay parked (until the process exits).
  void release(PyGILState_STATE state, bool resume_parked);

  // Number of threads currently parked in the handler (status/tests).
  int parked() const { return parked_.load(); }
  uint64_t preemptions() const { return preemptions_.load(); }

 private:
  static void on_signal(int signo, siginfo_t* info, void* uctx);
  void signal_python_threads();

  int signo_;
  int (*blocking_probe_)(void) = nullptr;
  bool installed_ = false;
  std::atomic<bool> active_{false};
  pthread_t acquirer_{};
  sem_t resume_;
  std::atomic<int> parked_{0};
  std::atomic<uint64_t> preemptions_{0};
};

GilHandoff& gil_handoff();

}  // namespace jitckpt
