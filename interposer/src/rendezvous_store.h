// The launcher's rendezvous store, as the workers' libjit.so reaches it (issue 16 case 1): through a
// Unix socket that `jitckpt run --transparent` serves (jitckpt/launcher/store_relay.py) and names
// in JITCKPT_STORE_SOCKET. The launcher forwards each request to its torch.distributed store, so the
// ranks of a communicator agree through the same store as the rest of the job. Native code cannot
// be a client of c10d's TCPStore itself (that needs libtorch), hence the relay.
//
// A request: op ('S' set, 'G' get), u32 key length, key, then for 'S' u32 value length and value,
// for 'G' u32 milliseconds to wait. A reply: u8 status (0 ok, 1 timed out, 2 error), u32 length,
// the value or the error's text. One request per connection.
#pragma once

#include <chrono>
#include <string>

namespace jitckpt {

class RendezvousStore {
 public:
  RendezvousStore();  // reads JITCKPT_STORE_SOCKET
  bool available() const { return !path_.empty(); }
  bool set(const std::string& key, const std::string& value, std::string* why) const;
  // Waits for `key` up to `timeout` (0: only whether it is there now).
  bool get(const std::string& key, std::chrono::milliseconds timeout, std::string* value, std::string* why) const;

 private:
  bool request(const std::string& message, std::chrono::milliseconds timeout, std::string* reply, std::string* why) const;

  std::string path_;
};

}  // namespace jitckpt
