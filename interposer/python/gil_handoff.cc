#include "gil_handoff.h"

#include <signal.h>

#include <cerrno>
#include <condition_variable>
#include <mutex>
#include <thread>

namespace jitckpt {

GilHandoff& gil_handoff() {
  static GilHandoff* const instance = new GilHandoff();  // used from signal handlers: never destroyed
  return *instance;
}

GilHandoff::GilHandoff() : signo_(SIGRTMIN + 4) { sem_init(&resume_, 0, 0); }

bool GilHandoff::install(const char** why) {
  if (installed_) return true;
  struct sigaction old {};
  sigaction(signo_, nullptr, &old);
  if ((old.sa_flags & SA_SIGINFO) ? old.sa_sigaction != nullptr
                                  : (old.sa_handler != SIG_DFL && old.sa_handler != SIG_IGN)) {
    *why = "the GIL hand-off signal (SIGRTMIN+4) already has a handler in this process";
    return false;
  }
  struct sigaction sa {};
  sa.sa_sigaction = &GilHandoff::on_signal;
  sa.sa_flags = SA_SIGINFO | SA_RESTART;  // interrupted blocking calls resume after the hand-back
  sigemptyset(&sa.sa_mask);
  if (sigaction(signo_, &sa, nullptr) != 0) {
    *why = "sigaction failed for the GIL hand-off signal";
    return false;
  }
  installed_ = true;
  return true;
}

void GilHandoff::on_signal(int, siginfo_t*, void*) {
  GilHandoff& self = gil_handoff();
  if (!self.active_.load() || pthread_equal(pthread_self(), self.acquirer_)) return;
  // A thread running Python or arbitrary native code may hold locks or half-updated objects; only a
  // thread parked in a blocking CUDA/NCCL call is known to be at a safe point.
  if (self.blocking_probe_ == nullptr || self.blocking_probe_() == 0) return;
  // True only on the thread whose thread state currently owns the GIL.
  if (!PyGILState_Check()) return;
  int saved_errno = errno;
  // Counted before the GIL is released, so the new holder already sees them.
  self.preemptions_.fetch_add(1);
  self.parked_.fetch_add(1);
  PyThreadState* state = PyEval_SaveThread();
  while (sem_wait(&self.resume_) != 0 && errno == EINTR) {
  }
  self.parked_.fetch_sub(1);
  PyEval_RestoreThread(state);
  errno = saved_errno;
}

void GilHandoff::signal_python_threads() {
  // Walked without the GIL: the holder is stuck and every other Python thread waits for the GIL, so
  // the thread list is not changing under us.
  for (PyInterpreterState* interp = PyInterpreterState_Head(); interp != nullptr;
       interp = PyInterpreterState_Next(interp)) {
    for (PyThreadState* ts = PyInterpreterState_ThreadHead(interp); ts != nullptr; ts = PyThreadState_Next(ts)) {
      auto tid = static_cast<pthread_t>(ts->thread_id);
      if (pthread_equal(tid, acquirer_)) continue;
      union sigval value {};
      pthread_sigqueue(tid, signo_, value);
    }
  }
}

PyGILState_STATE GilHandoff::acquire(std::chrono::milliseconds grace) {
  acquirer_ = pthread_self();
  active_.store(true);
  std::mutex mu;
  std::condition_variable cv;
  bool got = false;
  std::thread rescuer([&] {
    std::unique_lock<std::mutex> lock(mu);
    // Re-signal every grace period: a holder may have been running Python (and not parked) before.
    while (!cv.wait_for(lock, grace, [&] { return got; })) signal_python_threads();
  });
  PyGILState_STATE state = PyGILState_Ensure();
  {
    std::lock_guard<std::mutex> lock(mu);
    got = true;
  }
  cv.notify_all();
  rescuer.join();
  return state;
}

void GilHandoff::release(PyGILState_STATE state, bool resume_parked) {
  active_.store(false);
  int parked = parked_.load();
  PyGILState_Release(state);
  if (resume_parked)
    for (int i = 0; i < parked; ++i) sem_post(&resume_);
}

}  // namespace jitckpt
