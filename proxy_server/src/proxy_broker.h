// Starts jitckpt-proxy through the node daemon (`jitckpt daemon run`), so the proxy is the
// daemon's child, not the application's: it is listed with the node's processes, reaped by the
// daemon, and outlives the application process that asked for it (it exits when that process's
// end of its socket closes).
//
// The daemon serves a Unix SOCK_SEQPACKET socket, JITCKPT_PROXY_BROKER. One request per
// connection: "jitckpt-proxy-spawn/1\0<binary>\0<NAME=value>\0..." (the proxy's environment).
// The reply is "ok <pid>" with the proxy's end of a new socket pair attached (SCM_RIGHTS; the
// proxy has the other end as fd 3, as when ProxyClient spawns it), or "error <why>".
#pragma once

#include <sys/types.h>

#include <chrono>
#include <string>
#include <vector>

namespace jitckpt::proxy {

class ProxyBroker {
 public:
  explicit ProxyBroker(std::string socket_path) : socket_path_(std::move(socket_path)) {}

  // The broker this process was given (JITCKPT_PROXY_BROKER), or "" for none.
  static std::string from_environment();

  struct Spawned {
    pid_t pid;
    int socket;  // the client's end of the proxy's handshake socket (close-on-exec)
  };
  // Asks the daemon to start `binary` with `env`; throws std::runtime_error naming the problem.
  Spawned spawn(const std::string& binary, const std::vector<std::string>& env,
                std::chrono::milliseconds timeout) const;

 private:
  std::string socket_path_;
};

}  // namespace jitckpt::proxy
