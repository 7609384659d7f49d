#include "journal_replay.h"

#include <cuda_runtime_api.h>
#include <nccl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <vector>

#include "call_protocol.h"
#include "proxy_failure.h"
#include "proxy_functions.h"
#include "shared_memfd.h"

namespace jitckpt {
namespace {

constexpr auto kWhileTheProxyLives = std::chrono::hours(24 * 365);

// A new memfd with the contents of `fd`, or -1 (errno set).
int private_copy(int fd) {
  struct stat st {};
  if (fstat(fd, &st) != 0) return -1;
  const size_t size = static_cast<size_t>(st.st_size);
  void* src = size ? mmap(nullptr, size, PROT_READ, MAP_SHARED, fd, 0) : nullptr;
  if (src == MAP_FAILED) return -1;
  const int copy = shared_memfd("jitckpt-replay-copy", size, {{src, size}});
  const int saved = errno;
  if (src != nullptr) munmap(src, size);
  errno = saved;
  return copy;
}

uint32_t sync_tag() { return proxy::kGenericBase + static_cast<uint32_t>(proxy::FunctionId::k_cudaDeviceSynchronize); }

proxy::CallResult synchronize(proxy::ProxyChannel& ch, std::chrono::milliseconds wait) {
  return ch.call(sync_tag(), nullptr, 0, wait);
}

// The undo plugin's inverse launches on the restored buffers, waited for (update_undo.h).
bool run_undo(ReplayTarget& target, std::string* why) {
  for (const UndoLaunch& u : target.undo) {
    proxy::ProxyChannel* ch = target.channels.get(u.channel, why);
    if (ch == nullptr) return false;
    std::vector<uint8_t> request = u.request;
    const proxy::RequestHead head{ch->next_seq(), proxy::kNoReply, 0};
    std::memcpy(request.data(), &head, sizeof head);
    if (std::string err = ch->post(static_cast<uint32_t>(proxy::Call::kLaunchKernel), request.data(), request.size(),
                                   kWhileTheProxyLives);
        !err.empty()) {
      *why = "undoing the optimizer step: " + err;
      return false;
    }
  }
  proxy::ProxyChannel* ch = target.channels.get(0, why);
  if (ch == nullptr) return false;
  const proxy::CallResult r = synchronize(*ch, kWhileTheProxyLives);
  if (r.status != 0 || r.async_status != 0) {
    *why = "undoing the optimizer step failed: " +
           (r.error.empty() ? "status " + std::to_string(r.status != 0 ? r.status : r.async_status) : r.error);
    return false;
  }
  return true;
}

}  // namespace

std::string fresh_unique_id(proxy::ProxyChannel& ch, std::string* why) {
  std::vector<uint8_t> args(1 + sizeof(ncclUniqueId), 0);
  args[0] = 1;  // the id's presence byte (see the generated fwd_ncclGetUniqueId)
  const proxy::CallResult r = ch.call(ReplayJournal::unique_id_tag(), args.data(), args.size(), std::chrono::seconds(60));
  if (r.status == 0 && r.results.size() == sizeof(ncclUniqueId))
    return std::string(r.results.begin(), r.results.end());
  *why = "ncclGetUniqueId in the new proxy failed (" + (r.error.empty() ? "status " + std::to_string(r.status) : r.error) + ")";
  return "";
}

bool replay_journal(const ReplayJournal& journal, ReplayTarget& target, const DeviceBuffers* buffers,
                    ReplayOutcome* out, std::string* why) {
  proxy::ProxyClient& client = target.client;
  std::vector<uint8_t> request;
  std::map<std::string, std::string> unique_ids;  // recorded -> the new proxy's
  out->recreated = out->restored = std::chrono::steady_clock::now();
  bool restore = buffers != nullptr;
  bool peers = false;  // a communicator was rebuilt with other processes: their calls wait on them
  for (size_t i = 0; i <= journal.size(); ++i) {
    // The buffers go back once what existed at the minibatch's start exists again.
    if (restore && (i == journal.size() || journal.entry(i).id >= journal.minibatch_start())) {
      restore = false;
      out->recreated = std::chrono::steady_clock::now();
      proxy::ProxyChannel* ch = target.channels.get(0, why);
      if (ch == nullptr || !buffers->restore(client, *ch, target.next_token(), why)) return false;
      if (!target.undo.empty() && !run_undo(target, why)) return false;
      out->restored = std::chrono::steady_clock::now();
    }
    if (i == journal.size()) break;
    const ReplayJournal::Entry& e = journal.entry(i);
    if (target.skip_minibatch && e.id >= journal.minibatch_start()) break;
    // A call that failed changed nothing (cudaHostAlloc's retries at another address, a query
    // that was not ready, an NCCL call refused): the replay leaves it out.
    if (e.completed && e.status != 0) continue;
    proxy::ProxyChannel* ch = target.channels.get(e.channel, why);
    if (ch == nullptr) return false;
    const char* name = proxy::call_name(e.tag);
    auto fail = [&](const std::string& problem) {
      *why = "replaying call " + std::to_string(e.id) + " (" + (name ? name : "?") + "): " + problem;
      return false;
    };
    if (e.fd >= 0) {
      const int fd = target.private_memfds ? private_copy(e.fd) : e.fd;
      const bool sent = fd >= 0 && client.send_fd(fd, e.fd_token);
      if (fd >= 0 && fd != e.fd) close(fd);
      if (!sent) return fail("cannot hand over its memfd: " + (fd < 0 ? std::string(std::strerror(errno)) : client.death()));
    }
    if (e.has_source) {  // a copy from shared host memory, from the bytes it read at the call
      const uint8_t* src = journal.bytes(e);
      constexpr size_t kChunk = size_t{1} << 20;
      for (size_t off = 0; off < e.size; off += kChunk) {
        const size_t n = std::min(kChunk, e.size - off);
        request.resize(sizeof(proxy::RequestHead));
        const uint64_t seq = ch->next_seq();
        uint32_t tag;
        if (e.source.async) {
          const proxy::MemcpyInline m{e.source.dst + off, n, e.source.stream};
          request.insert(request.end(), reinterpret_cast<const uint8_t*>(&m), reinterpret_cast<const uint8_t*>(&m + 1));
          tag = static_cast<uint32_t>(proxy::Call::kMemcpyToDeviceAsync);
        } else {
          const proxy::MemcpyToDevice m{e.source.dst + off, n};
          request.insert(request.end(), reinterpret_cast<const uint8_t*>(&m), reinterpret_cast<const uint8_t*>(&m + 1));
          tag = static_cast<uint32_t>(proxy::Call::kMemcpyToDevice);
        }
        request.insert(request.end(), src + off, src + off + n);
        const proxy::RequestHead head{seq, e.source.async ? proxy::kNoReply : 0u, 0};
        std::memcpy(request.data(), &head, sizeof head);
        proxy::CallResult r;
        if (e.source.async) {
          r.error = ch->post(tag, request.data(), request.size(), kWhileTheProxyLives);
          if (!r.error.empty()) return fail(r.error);
        } else {
          r = ch->call_raw(tag, request.data(), request.size(), seq, kWhileTheProxyLives);
          if (!r.error.empty() && r.status == 999) return fail(r.error);
          if (!e.completed) out->results[static_cast<int64_t>(e.id)] = r;
        }
      }
      continue;
    }
    request.assign(journal.bytes(e), journal.bytes(e) + e.size);
    // A unique id names a rendezvous of the proxy that made it: the replay uses the new proxy's, or
    // for a communicator with peers elsewhere, the one its rank 0 made and put in the store.
    const bool init = ReplayJournal::inits_comm_from_id(e.tag) &&
                      request.size() >= ReplayJournal::kCommRankOffset + sizeof(int32_t);
    const auto init_began = std::chrono::steady_clock::now();
    if (init) {
      const std::string old_id(reinterpret_cast<const char*>(request.data()) + ReplayJournal::kCommIdOffset, sizeof(ncclUniqueId));
      int32_t nranks = 0, rank = 0;
      std::memcpy(&nranks, request.data() + sizeof(proxy::RequestHead) + 1, sizeof nranks);
      std::memcpy(&rank, request.data() + ReplayJournal::kCommRankOffset, sizeof rank);
      if (nranks > 1 && target.rendezvous) {
        std::string fresh, agreed;
        if (rank == 0 && (fresh = fresh_unique_id(*ch, why)).empty()) return fail(*why);
        if (!target.rendezvous(old_id, rank, fresh, &agreed, why) || agreed.size() != sizeof(ncclUniqueId))
          return fail("no unique id agreed with the communicator's other ranks: " + *why);
        std::memcpy(request.data() + ReplayJournal::kCommIdOffset, agreed.data(), agreed.size());
        peers = true;
      } else if (auto it = unique_ids.find(old_id); it != unique_ids.end()) {
        std::memcpy(request.data() + ReplayJournal::kCommIdOffset, it->second.data(), it->second.size());
      }
    }
    const auto wait = peers ? target.peer_wait : kWhileTheProxyLives;
    const uint64_t seq = ch->next_seq();
    const proxy::RequestHead head{seq, e.no_reply ? proxy::kNoReply : 0u, 0};
    std::memcpy(request.data(), &head, sizeof head);
    if (e.no_reply) {
      if (std::string err = ch->post(e.tag, request.data(), request.size(), kWhileTheProxyLives); !err.empty())
        return fail(err);
      continue;
    }
    proxy::CallResult r = ch->call_raw(e.tag, request.data(), request.size(), seq, wait);
    if (init) out->communicators_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - init_began).count();
    if (r.status == 999 && !client.death().empty()) return fail(client.death());
    if (r.status == 999) return fail(r.error + " (its peers did not rebuild it with this process)");
    if (std::string again = proxy_unusable(e.tag, r); !again.empty()) return fail(again + ", again");
    if (e.completed && ReplayJournal::creates(e.tag) && (r.status != e.status || r.results != e.results))
      return fail("it did not give the pointer or handle the application holds (status " + std::to_string(r.status) +
                  "): the replay diverged");
    if (e.tag == ReplayJournal::unique_id_tag() && e.completed && r.status == 0 && r.results.size() == e.results.size())
      unique_ids[std::string(e.results.begin(), e.results.end())] = std::string(r.results.begin(), r.results.end());
    if (!e.completed) out->results[static_cast<int64_t>(e.id)] = std::move(r);
  }
  out->replayed = std::chrono::steady_clock::now();
  for (size_t i = 0; i < journal.size(); ++i) out->minibatch_calls += journal.entry(i).id >= journal.minibatch_start();
  // The replayed work has run before the application goes on: a fault it hits again (a
  // deterministic one, which a replay cannot get past) is found here, not by a later call.
  proxy::ProxyChannel* ch = target.channels.get(0, why);
  if (ch == nullptr) return false;
  proxy::CallResult r = synchronize(*ch, peers ? target.peer_wait : kWhileTheProxyLives);
  if (r.status == 999) {
    *why = "after the replay: " + (client.death().empty() ? r.error + " (the peers did not replay with this process)"
                                                           : client.death());
    return false;
  }
  if (std::string again = proxy_unusable(sync_tag(), r); !again.empty()) {
    *why = "the replayed work failed again: " + again + " (a fault in the program, not the device?)";
    return false;
  }
  return true;
}

}  // namespace jitckpt
