#include "next_symbol.h"

#include <dlfcn.h>

#include "diagnostics.h"

namespace jitckpt {

// Defined by proxy mode (proxy_session.cc); absent from the unit tests, which have no proxy mode.
__attribute__((weak)) bool proxy_mode_resolve(const char* name, void** fn);

void* resolve_next_symbol(const char* name, const char* soname) {
  void* forwarded = nullptr;
  if (proxy_mode_resolve != nullptr && proxy_mode_resolve(name, &forwarded)) {
    if (forwarded == nullptr) log_always("proxy mode defines no %s: the call fails", name);
    return forwarded;
  }
  return resolve_real_symbol(name, soname);
}

void* resolve_real_symbol(const char* name, const char* soname) {
  void* fn = dlsym(RTLD_NEXT, name);
  if (fn == nullptr && soname != nullptr) {
    if (void* handle = dlopen(soname, RTLD_LAZY | RTLD_NOLOAD)) {
      fn = dlsym(handle, name);
      dlclose(handle);  // drops only the reference RTLD_NOLOAD added
    }
  }
  if (fn == nullptr) {
    log_always("cannot find the next definition of %s (is %s loaded?)", name, soname ? soname : "-");
  } else {
    log_verbose("interposed %s -> %p", name, fn);
  }
  return fn;
}

}  // namespace jitckpt
