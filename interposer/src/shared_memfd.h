// A memfd of `size` bytes that starts with `contents` (written in order): what proxy mode hands the
// proxy on the socket for pinned buffers, registered pages and modules. -1 (errno set) on failure.
#pragma once

#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <initializer_list>
#include <utility>

namespace jitckpt {

inline int shared_memfd(const char* name, size_t size,
                        std::initializer_list<std::pair<const void*, size_t>> contents = {}) {
  const int fd = memfd_create(name, MFD_CLOEXEC);
  if (fd < 0) return -1;
  bool ok = ftruncate(fd, static_cast<off_t>(size)) == 0;
  size_t at = 0;
  for (const auto& [data, n] : contents) {
    for (size_t done = 0; ok && done < n;) {
      const ssize_t w = pwrite(fd, static_cast<const char*>(data) + done, n - done, static_cast<off_t>(at + done));
      if (w < 0 && errno == EINTR) continue;
      ok = w > 0;
      if (ok) done += static_cast<size_t>(w);
    }
    at += n;
  }
  if (!ok) {
    const int saved = errno;
    close(fd);
    errno = saved;
    return -1;
  }
  return fd;
}

}  // namespace jitckpt
