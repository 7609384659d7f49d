// Latency of the proxy ring between two processes (issue 15's targets: an asynchronous call
// enqueued in < 1 us median, a synchronous round trip in < 10 us median).
//   enqueue:    the client pushes a 64-byte call record (a kernel launch's size) that needs no
//               reply; the proxy process drains the ring meanwhile.
//   round trip: the client pushes a request and waits for the proxy's reply on a second ring.
// Prints one JSON object. Usage: ring_latency_bench [iterations]
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "shm_ring.h"

using jitckpt::proxy::RingStatus;
using jitckpt::proxy::ShmRing;
using Clock = std::chrono::steady_clock;

namespace {

constexpr uint32_t kAsync = 1, kSync = 2, kStop = 3;

double median_ns(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

double pct_ns(std::vector<double> v, double p) {
  std::sort(v.begin(), v.end());
  return v[static_cast<size_t>(p * (v.size() - 1))];
}

// The proxy side: drain requests, answer the synchronous ones.
[[noreturn]] void serve(int req_fd, int rep_fd) {
  ShmRing req = ShmRing::attach(req_fd);
  ShmRing rep = ShmRing::attach(rep_fd);
  while (true) {
    uint32_t tag;
    const uint8_t* data;
    size_t len;
    std::string err;
    RingStatus s = req.peek(&tag, &data, &len, Clock::now() + std::chrono::seconds(30), &err);
    if (s != RingStatus::kOk) _exit(2);
    if (tag == kStop) _exit(0);
    if (tag == kSync) {
      int result = 0;
      req.release();
      rep.push(kSync, &result, sizeof result, Clock::now() + std::chrono::seconds(5));
    } else {
      req.release();
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  const int n = argc > 1 ? std::atoi(argv[1]) : 200000;
  ShmRing req = ShmRing::create(1 << 22);
  ShmRing rep = ShmRing::create(1 << 16);
  pid_t pid = fork();
  if (pid < 0) return 1;
  if (pid == 0) serve(req.fd(), rep.fd());
  const auto deadline = [] { return Clock::now() + std::chrono::seconds(5); };
  char record[64] = {};
  std::vector<double> enqueue, round_trip, clock_cost;
  enqueue.reserve(n);
  round_trip.reserve(n / 4);
  for (int i = 0; i < 1000; ++i) {  // what timing one call costs by itself
    auto a = Clock::now();
    auto b = Clock::now();
    clock_cost.push_back(std::chrono::duration<double, std::nano>(b - a).count());
  }
  for (int i = 0; i < n; ++i) {
    auto t0 = Clock::now();
    if (req.push(kAsync, record, sizeof record, deadline()) != RingStatus::kOk) return 3;
    enqueue.push_back(std::chrono::duration<double, std::nano>(Clock::now() - t0).count());
  }
  for (int i = 0; i < n / 4; ++i) {
    auto t0 = Clock::now();
    if (req.push(kSync, record, 16, deadline()) != RingStatus::kOk) return 4;
    uint32_t tag;
    const uint8_t* data;
    size_t len;
    std::string err;
    if (rep.peek(&tag, &data, &len, deadline(), &err) != RingStatus::kOk) return 5;
    rep.release();
    round_trip.push_back(std::chrono::duration<double, std::nano>(Clock::now() - t0).count());
  }
  req.push(kStop, nullptr, 0, deadline());
  int status = 0;
  waitpid(pid, &status, 0);
  std::printf(
      "{\"iterations\": %d, \"clock_overhead_ns\": %.1f, \"enqueue_median_ns\": %.1f, \"enqueue_p99_ns\": %.1f, "
      "\"round_trip_median_ns\": %.1f, \"round_trip_p99_ns\": %.1f, \"server_exit\": %d}\n",
      n, median_ns(clock_cost), median_ns(enqueue), pct_ns(enqueue, 0.99), median_ns(round_trip),
      pct_ns(round_trip, 0.99), WIFEXITED(status) ? WEXITSTATUS(status) : -1);
  return 0;
}
