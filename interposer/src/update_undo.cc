#include "update_undo.h"

#include <cstdlib>
#include <cstring>

#include "call_protocol.h"
#include "proxy_functions.h"
#include "real_api.h"

namespace jitckpt {
namespace {

bool undo_plugin_named() {
  const char* env = std::getenv("JITCKPT_PLUGINS");
  if (env == nullptr) return false;
  std::string list = std::string(",") + env + ",";
  return list.find(",undo,") != std::string::npos;
}

}  // namespace

int query_event(proxy::ProxyChannel& ch, cudaEvent_t event, std::string* error) {
  const uint64_t handle = static_cast<uint64_t>(reinterpret_cast<uintptr_t>(event));
  const uint32_t tag = proxy::kGenericBase + static_cast<uint32_t>(proxy::FunctionId::k_cudaEventQuery);
  const proxy::CallResult r = ch.call(tag, &handle, sizeof handle, std::chrono::seconds(10));
  if (r.status == 999) *error = r.error;
  return r.status;
}

UpdateUndo::UpdateUndo() : enabled_(undo_plugin_named()) {}

void UpdateUndo::add(uint32_t kernel, int64_t inverse) {
  std::lock_guard<std::mutex> lock(mu_);
  inverses_[kernel] = inverse;
}

void UpdateUndo::minibatch() {
  optimizer_.store(false, std::memory_order_relaxed);
  std::lock_guard<std::mutex> lock(mu_);
  for (const Launch& l : launches_)
    if (l.done != nullptr) events_.push_back(l.done);
  launches_.clear();
}

void UpdateUndo::launched(int64_t id, uint32_t kernel, const std::string& name, cudaStream_t stream) {
  cudaEvent_t event = nullptr;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!events_.empty()) {
      event = events_.back();
      events_.pop_back();
    }
  }
  // Through the proxy, as the program's own calls (journaled: a replay recreates the events).
  if (event == nullptr && real_cuda.eventCreateWithFlags.get()(&event, cudaEventDisableTiming) != cudaSuccess)
    event = nullptr;
  if (event != nullptr && real_cuda.eventRecord.get()(event, stream) != cudaSuccess) {
    std::lock_guard<std::mutex> lock(mu_);
    events_.push_back(event);
    event = nullptr;
  }
  std::lock_guard<std::mutex> lock(mu_);
  launches_.push_back({id, kernel, name, event});
}

bool UpdateUndo::plan(proxy::ProxyChannel& ch, const ReplayJournal& journal, int64_t before,
                      std::vector<UndoLaunch>* out, std::string* why) const {
  std::vector<Launch> launches;
  std::map<uint32_t, int64_t> inverses;
  {
    std::lock_guard<std::mutex> lock(mu_);
    launches = launches_;
    inverses = inverses_;
  }
  out->clear();
  for (auto it = launches.rbegin(); it != launches.rend(); ++it) {
    if (it->id < 0 || it->id >= before) continue;  // posted after the failed call: a fenced proxy never ran it
    if (it->done == nullptr) {
      *why = "no event could be recorded behind the optimizer step's launch of " + it->name;
      return false;
    }
    std::string error;
    const int status = query_event(ch, it->done, &error);
    if (status == cudaErrorNotReady) continue;  // queued behind the failed or hung call: it never ran
    if (status != cudaSuccess) {
      *why = "cannot tell whether " + it->name + " ran (cudaEventQuery: " +
             (error.empty() ? std::to_string(status) : error) + ")";
      return false;
    }
    auto inverse = inverses.find(it->kernel);
    if (inverse == inverses.end()) {
      *why = "the optimizer step had run " + it->name + ", which has no inverse registered "
             "(jitckpt_register_inverse, jitckpt/undo.h)";
      return false;
    }
    if (inverse->second < 0) continue;  // it writes nothing that outlives the minibatch
    UndoLaunch u;
    if (!journal.request(it->id, &u.request, &u.channel) ||
        u.request.size() < sizeof(proxy::RequestHead) + sizeof(proxy::LaunchKernel)) {
      *why = "the replay journal does not hold the optimizer step's launch of " + it->name;
      return false;
    }
    const uint32_t id = static_cast<uint32_t>(inverse->second);
    std::memcpy(u.request.data() + sizeof(proxy::RequestHead) + offsetof(proxy::LaunchKernel, kernel_id), &id, sizeof id);
    out->push_back(std::move(u));
  }
  return true;
}

}  // namespace jitckpt
