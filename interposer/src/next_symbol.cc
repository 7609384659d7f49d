#include "next_symbol.h"

#include <dlfcn.h>

#include "diagnostics.h"

namespace jitckpt {

void* resolve_next_symbol(const char* name, const char* soname) {
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
