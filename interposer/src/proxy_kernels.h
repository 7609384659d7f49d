// Proxy mode's kernels: what nvcc's registration code told the client (each fat binary, and per
// kernel its host stub, mangled name and module), and, once a kernel was first launched, the id and
// parameter layout the proxy gave it. A module goes to the proxy once, before the first use of one
// of its kernels (it stays in the client, ready to be sent to a new proxy); a launch is then one
// message with no reply. cudaKernel_t handles given to the application are the entries' addresses.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "call_protocol.h"

namespace jitckpt {

struct ClientModule {
  const void* image = nullptr;  // the fat binary in the application's memory (its .nv_fatbin)
  size_t image_size = 0;        // 0: not a fat binary this client can size
  std::vector<std::string> kernel_names;  // in registration order
  int64_t proxy_id = -1;        // -1 until sent to the proxy
};

struct ClientKernel {
  std::string name;
  const void* host_fun = nullptr;
  ClientModule* module = nullptr;
  uint32_t index = 0;     // in its module
  int64_t proxy_id = -1;  // -1 until registered with the proxy
  std::vector<proxy::KernelParam> params;
  uint32_t param_bytes = 0;
};

class ProxyKernels {
 public:
  // __cudaRegisterFatBinary: the handle nvcc's code passes back for the module's kernels.
  void** add_module(const void* fatbin_wrapper) {
    auto m = std::make_unique<ClientModule>();
    proxy::FatbinWrapper w{};
    proxy::FatbinHeader h{};
    if (fatbin_wrapper != nullptr) std::memcpy(&w, fatbin_wrapper, sizeof w);
    if (w.magic == proxy::FatbinWrapper::kMagic && w.data != nullptr) {
      std::memcpy(&h, w.data, sizeof h);
      if (h.magic == proxy::FatbinHeader::kMagic) {
        m->image = w.data;
        m->image_size = h.header_size + h.fat_size;
      }
    }
    // libcudart's exit-time cleanup reads a structure behind the handle; keep one zeroed.
    void** handle = static_cast<void**>(std::calloc(1, 0x58));
    std::lock_guard<std::mutex> lock(mu_);
    modules_[handle] = std::move(m);
    return handle;
  }
  // __cudaRegisterFunction.
  void add(void** module_handle, const void* host_fun, const char* name) {
    std::lock_guard<std::mutex> lock(mu_);
    auto& k = by_host_fun_[host_fun];
    if (!k) k = std::make_unique<ClientKernel>();
    k->name = name ? name : "";
    k->host_fun = host_fun;
    auto m = modules_.find(module_handle);
    if (m == modules_.end()) m = modules_.emplace(module_handle, std::make_unique<ClientModule>()).first;
    k->module = m->second.get();
    k->index = static_cast<uint32_t>(k->module->kernel_names.size());
    k->module->kernel_names.push_back(k->name);
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
  std::mutex registration_mu_;  // one registration round trip per module and kernel
  std::map<void**, std::unique_ptr<ClientModule>> modules_;
  std::map<const void*, std::unique_ptr<ClientKernel>> by_host_fun_;
  std::set<const ClientKernel*> entries_;
};

}  // namespace jitckpt
