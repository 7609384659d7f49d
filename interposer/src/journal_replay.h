// Replays a ReplayJournal into a proxy (issue 16): into the new proxy that replaces a lost one, or
// into a scratch proxy that checks the journal (replay validation). Entries go on the target's
// channel of the index they were made on; NCCL unique ids are mapped to the target's; what a call
// created must come back bitwise equal, else the replay has diverged and stops. With saved buffers,
// they are put back once the objects of the minibatch's start exist again, before its calls.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "device_buffers.h"
#include "indexed_channels.h"
#include "proxy_client.h"
#include "replay_journal.h"

namespace jitckpt {

// Agrees with a communicator's ranks in other processes on the unique id its replay uses (issue 16
// case 1): rank 0 offers `fresh` (made by the target), every rank gets back the agreed id.
using CommRendezvous = std::function<bool(const std::string& recorded_id, int rank, const std::string& fresh,
                                          std::string* agreed, std::string* why)>;

// A request posted right after the buffers are restored, before the minibatch's calls: the undo
// plugin's inverse of an optimizer-step kernel that had run (update_undo.h). Its head is filled in.
struct UndoLaunch {
  uint32_t channel = 0;          // the index of the channel the undone launch was made on
  std::vector<uint8_t> request;  // RequestHead, LaunchKernel (the inverse's id), the parameters
};

struct ReplayTarget {
  proxy::ProxyClient& client;
  IndexedChannels& channels;  // the target's
  std::function<uint64_t()> next_token;  // names memfds on the target's socket
  // Hand the target copies of the journal's memfds instead of the memfds themselves, so that what
  // it writes into pinned memory does not reach the application's (a scratch proxy).
  bool private_memfds = false;
  // Unset: a communicator with peers elsewhere keeps its recorded id (nobody replays with it).
  CommRendezvous rendezvous;
  // How long a call that needs the peers (a communicator's init, the minibatch's collectives,
  // waited for by the closing synchronize) may wait for them: they detect the failure by a hang
  // timeout, then rebuild as this process does.
  std::chrono::milliseconds peer_wait{std::chrono::minutes(5)};
  // The buffers are a replica's of the next minibatch's start (case 4): the current minibatch's
  // calls are not replayed.
  bool skip_minibatch = false;
  // Run on the restored buffers, in order, and waited for, before the minibatch's calls.
  std::vector<UndoLaunch> undo;
};

// A new unique id from `ch`'s proxy (a communicator's rendezvous root), or "" with `why`.
std::string fresh_unique_id(proxy::ProxyChannel& ch, std::string* why);

struct ReplayOutcome {
  std::map<int64_t, proxy::CallResult> results;  // of calls the application was still waiting for
  size_t minibatch_calls = 0;                    // entries of the current minibatch
  double communicators_s = 0;                    // in communicators' inits, waiting for peers included
  // When the objects were recreated, the buffers restored, the calls replayed (steady clock).
  std::chrono::steady_clock::time_point recreated, restored, replayed;
};

// Replays `journal` (under the caller's guarantee that nobody appends meanwhile) into `target`,
// restoring `buffers` (if any) before the current minibatch's first entry, and ends with a device
// synchronize. False with `why`.
bool replay_journal(const ReplayJournal& journal, ReplayTarget& target, const DeviceBuffers* buffers,
                    ReplayOutcome* out, std::string* why);

}  // namespace jitckpt
