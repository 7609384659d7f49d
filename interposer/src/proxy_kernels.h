// Proxy mode's kernels: what nvcc's registration code told the client (host stub -> mangled name),
// and, once a kernel was first launched, the id and parameter layout the proxy gave it. A launch
// is then one message with no reply. cudaKernel_t handles given to the application are the
// entries' addresses.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "call_protocol.h"

namespace jitckpt {

struct ClientKernel {
  std::string name;
  const void* host_fun = nullptr;
  int64_t proxy_id = -1;  // -1 until registered with the proxy
  std::vector<proxy::KernelParam> params;
  uint32_t param_bytes = 0;
};

class ProxyKernels {
 public:
  void add(const void* host_fun, const char* name) {
    std::lock_guard<std::mutex> lock(mu_);
    auto& k = by_host_fun_[host_fun];
    if (!k) k = std::make_unique<ClientKernel>();
    k->name = name ? name : "";
    k->host_fun = host_fun;
    entries_.insert(k.get());
  }
  // By host stub (cudaLaunchKernel's func) or by cudaKernel_t; nullptr if unknown.
  ClientKernel* find(const void* func) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = by_host_fun_.find(func);
    if (it != by_host_fun_.end()) return it->second.get();
    auto* e = static_cast<ClientKernel*>(const_cast<void*>(func));
    return entries_.count(e) ? e : nullptr;
  }
  std::mutex& registration_mutex() { return registration_mu_; }

 private:
  std::mutex mu_;
  std::mutex registration_mu_;  // one registration round trip per kernel
  std::map<const void*, std::unique_ptr<ClientKernel>> by_host_fun_;
  std::set<const ClientKernel*> entries_;
};

}  // namespace jitckpt
