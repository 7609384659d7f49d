#include "watchdog.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include "diagnostics.h"
#include "real_api.h"
#include "registry.h"

namespace jitckpt {
namespace {

std::chrono::steady_clock::duration poll_interval(double hang_timeout_s) {
  // A twentieth of the timeout bounds detection latency to 105% of it, within [5 ms, 200 ms].
  double s = std::clamp(hang_timeout_s / 20.0, 0.005, 0.2);
  return std::chrono::duration_cast<std::chrono::steady_clock::duration>(std::chrono::duration<double>(s));
}

std::string cuda_error_name(cudaError_t e) {
  auto name = real_cuda.getErrorName.get();
  return name ? name(e) : std::to_string(static_cast<int>(e));
}

}  // namespace

void Watchdog::ensure_started() {
  std::call_once(started_, [this] {
    running_.store(true, std::memory_order_release);
    std::thread([this] { run(); }).detach();  // lives until exit; the registry is never destroyed
    log_verbose("watchdog started (hang timeout %.3f s)", registry_.hang_timeout());
  });
}

thread_local bool Watchdog::on_watchdog_thread_ = false;

void Watchdog::run() {
  on_watchdog_thread_ = true;
  for (;;) {
    if (auto failure = registry_.failures().wait_for_report(poll_interval(registry_.hang_timeout()))) {
      dispatch(*failure);
      continue;
    }
    if (!registry_.failures().triggered()) poll();
  }
}

void Watchdog::ping_proxy(double timeout) {
  const auto now = Clock::now();
  if (!registry_.proxy().enabled() || registry_.proxy().waiting_for_s() <= timeout ||
      std::chrono::duration<double>(now - last_ping_).count() <= timeout)
    return;
  last_ping_ = now;
  int device = 0;
  if (auto get_device = real_cuda.getDevice.get()) get_device(&device);  // answered, or the proxy is replaced
}

void Watchdog::poll() {
  auto query = real_cuda.eventQuery.get();
  const auto now = Clock::now();
  const double timeout = registry_.hang_timeout();
  ping_proxy(timeout);
  std::vector<uint64_t> done;
  bool asked_peers = false;
  for (const CollectiveRecord& r : registry_.collectives().snapshot()) {
    if (r.sentinel != nullptr && query != nullptr) {
      cudaError_t st = query(r.sentinel);  // our event: nobody destroys it concurrently
      if (st == cudaSuccess) {
        done.push_back(r.seq);
        // Seen complete within a poll interval of its end: what the adaptive timeout learns from.
        registry_.hang_timeouts().record(std::chrono::duration<double>(now - r.since).count());
        continue;
      }
      if (st != cudaErrorNotReady) {
        char detail[256];
        std::snprintf(detail, sizeof detail, "cudaEventQuery after %s (seq %llu) returned %s", r.op,
                      static_cast<unsigned long long>(r.seq), cuda_error_name(st).c_str());
        registry_.report_failure("cuda_error", detail);
        return;
      }
    }
    double age = std::chrono::duration<double>(now - r.since).count();
    // Proxy mode: a collective pending for two polls asks (once a poll) whether a peer already found
    // a failure and is recovering; then this one will not complete either.
    if (!asked_peers && age > 2 * std::chrono::duration<double>(poll_interval(timeout)).count() && age <= timeout &&
        registry_.proxy().enabled()) {
      asked_peers = true;
      if (std::string peer = registry_.proxy().peer_found_failure(); !peer.empty()) {
        char detail[512];
        std::snprintf(detail, sizeof detail, "%s (seq %llu, step %lld, phase %s) not complete after %.3f s: %s",
                      r.op, static_cast<unsigned long long>(r.seq), static_cast<long long>(r.step), r.phase.c_str(),
                      age, peer.c_str());
        if (!registry_.proxy().recover_from_hang(detail, r.phase == "optimizer", r.sentinel))
          registry_.report_failure("hang", detail, r.phase);
        return;
      }
    }
    if (age > timeout) {
      char detail[256];
      std::snprintf(detail, sizeof detail, "%s (seq %llu, step %lld, phase %s) %s for %.3f s > hang timeout %.3f s",
                    r.op, static_cast<unsigned long long>(r.seq), static_cast<long long>(r.step),
                    r.phase.c_str(), r.in_host_call ? "blocked in the host call" : "not complete on the device",
                    age, timeout);
      // In proxy mode with the journal on, every rank of the communicator rebuilds it and replays
      // its minibatch (issue 16 case 1); else the failure callback (user-level JIT) takes it.
      if (registry_.proxy().enabled() && registry_.proxy().recover_from_hang(detail, r.phase == "optimizer", r.sentinel)) return;
      registry_.report_failure("hang", detail, r.phase);
      return;
    }
  }
  registry_.collectives().retire(done);

  auto get_async = real_nccl.commGetAsyncError.get();
  if (get_async == nullptr) return;
  std::string error;
  registry_.collectives().poll_comms([&](ncclComm_t comm) {
    ncclResult_t async = ncclSuccess;
    ncclResult_t rc = get_async(comm, &async);
    if (error.empty() && rc == ncclSuccess && async != ncclSuccess && async != ncclInProgress) {
      auto str = real_nccl.getErrorString.get();
      char detail[256];
      std::snprintf(detail, sizeof detail, "ncclCommGetAsyncError(comm %p) = %d (%s)", static_cast<void*>(comm),
                    static_cast<int>(async), str ? str(async) : "?");
      error = detail;
    }
  });
  // In proxy mode a process that can rebuild its device state alone gets a new proxy instead.
  if (!error.empty() && !registry_.proxy().recover_now(error)) registry_.report_failure("nccl_async_error", error);
}

void Watchdog::dispatch(const Failure& failure) {
  log_always("failure detected: %s: %s", failure.kind.c_str(), failure.detail.c_str());
  // SWIFT: the messages this process sent are what a replacement of the failed peer replays;
  // write them out before the handler (which may end the process). Bounded: a copy behind the
  // hung operation never completes, and neither did its send.
  std::string log_error;
  if (registry_.send_log().enabled() && !registry_.send_log().flush(2.0, &log_error))
    log_always("send log at the failure: %s", log_error.c_str());
  int device = std::max(registry_.collectives().first_device(), 0);
  registry_.set_saving(true);
  registry_.redirect().begin(device);  // on failure the save runs unredirected (logged)
  auto [handler, ctx] = registry_.failure_handler();
  bool keep_saving = false;
  if (handler != nullptr) {
    SaveThreadScope save_thread;  // the handler may save right here
    keep_saving = handler(failure.kind.c_str(), failure.detail.c_str(), ctx) != 0;
  } else {
    log_always("no failure callback registered (jitckpt._native.set_failure_callback); nothing saved");
  }
  if (!keep_saving) registry_.end_save_mode();
  registry_.failures().mark_handled();
}

}  // namespace jitckpt
