#include "communicator.h"

#include <cstring>

#include "reduction.h"

namespace simcuda::nccl {

Communicator::Communicator(int nranks, int rank, int device, RendezvousId id)
    : nranks_(nranks), rank_(rank), device_(device), id_(id), mesh_(rank, nranks) {}

ncclResult_t Communicator::initialize() {
  ncclResult_t result = ncclSuccess;
  auto ports = exchange_ports(id_, nranks_, rank_, mesh_.listen_port(), bootstrap_);
  if (!ports || !mesh_.connect(*ports, id_.nonce)) result = ncclSystemError;
  async_error_.store(result);
  {
    std::lock_guard<std::mutex> lock(state_mu_);
    init_result_ = result;
    initialized_ = true;
    init_running_ = false;
  }
  state_cv_.notify_all();
  return result;
}

void Communicator::set_async_error(ncclResult_t e) {
  ncclResult_t expected = ncclSuccess;
  async_error_.compare_exchange_strong(expected, e);
}

bool Communicator::wait_initialized() {
  std::unique_lock<std::mutex> lock(state_mu_);
  state_cv_.wait(lock, [&] { return initialized_ || mesh_.aborted(); });
  return initialized_ && init_result_ == ncclSuccess && !mesh_.aborted();
}

void Communicator::execute(const std::vector<Collective>& batch) {
  if (!wait_initialized()) return;
  std::lock_guard<std::mutex> lock(exec_mu_);
  ExchangeStatus st = ExchangeStatus::Ok;
  if (!batch.empty() && batch.front().is_p2p()) {
    st = run_p2p(batch);
  } else {
    for (const Collective& c : batch)
      if ((st = run(c)) != ExchangeStatus::Ok) break;
  }
  if (st == ExchangeStatus::SizeMismatch) set_async_error(ncclInvalidUsage);
  // A vanished peer leaves the collective unfinished on a GPU: hang until ncclCommAbort.
  if (st == ExchangeStatus::PeerLost) mesh_.wait_for_abort();
}

bool Communicator::allgather_host(const void* mine, void* all, size_t bytes) {
  if (!wait_initialized()) return false;
  wait_idle();
  std::lock_guard<std::mutex> lock(exec_mu_);
  std::vector<Transfer> xfers;
  for (int p = 0; p < nranks_; ++p) {
    if (p == rank_) continue;
    xfers.push_back({p, true, const_cast<void*>(mine), bytes});
    xfers.push_back({p, false, static_cast<char*>(all) + static_cast<size_t>(p) * bytes, bytes});
  }
  std::memcpy(static_cast<char*>(all) + static_cast<size_t>(rank_) * bytes, mine, bytes);
  return mesh_.exchange(xfers) == ExchangeStatus::Ok;
}

void Communicator::hang_until_abort() { mesh_.wait_for_abort(); }

void Communicator::init_started() {
  std::lock_guard<std::mutex> lock(state_mu_);
  init_running_ = true;
}

void Communicator::abort() {
  mesh_.abort();
  bootstrap_.interrupt();
  std::unique_lock<std::mutex> lock(state_mu_);
  state_cv_.notify_all();
  state_cv_.wait(lock, [&] { return !init_running_; });
}

void Communicator::op_enqueued() {
  std::lock_guard<std::mutex> lock(state_mu_);
  ++outstanding_;
}

void Communicator::op_finished() {
  {
    std::lock_guard<std::mutex> lock(state_mu_);
    --outstanding_;
  }
  state_cv_.notify_all();
}

void Communicator::wait_idle() {
  std::unique_lock<std::mutex> lock(state_mu_);
  state_cv_.wait(lock, [&] { return outstanding_ == 0 || mesh_.aborted(); });
}

void Communicator::reduce_in_rank_order(std::vector<const void*>& inputs, void* out, size_t count,
                                        const Collective& c) {
  // Same order on every rank, so all ranks get bitwise-identical results.
  const size_t bytes = count * type_size(c.type);
  std::vector<char> acc(static_cast<const char*>(inputs[0]), static_cast<const char*>(inputs[0]) + bytes);
  for (size_t k = 1; k < inputs.size(); ++k) reduce_into(acc.data(), inputs[k], count, c.type, c.op);
  if (c.op == ncclAvg) finish_average(acc.data(), count, c.type, nranks_);
  std::memcpy(out, acc.data(), bytes);
}

ExchangeStatus Communicator::run(const Collective& c) {
  const size_t es = type_size(c.type);
  const size_t bytes = c.count * es;
  const auto n = static_cast<size_t>(nranks_);
  const auto me = static_cast<size_t>(rank_);
  std::vector<Transfer> xfers;
  std::vector<std::vector<char>> scratch(n);
  std::vector<const void*> inputs(n);
  switch (c.kind) {
    case Collective::Kind::AllReduce: {
      for (size_t p = 0; p < n; ++p) {
        if (p == me) continue;
        scratch[p].resize(bytes);
        xfers.push_back({static_cast<int>(p), true, const_cast<void*>(c.send), bytes});
        xfers.push_back({static_cast<int>(p), false, scratch[p].data(), bytes});
        inputs[p] = scratch[p].data();
      }
      inputs[me] = c.send;
      auto st = mesh_.exchange(xfers);
      if (st == ExchangeStatus::Ok) reduce_in_rank_order(inputs, c.recv, c.count, c);
      return st;
    }
    case Collective::Kind::Broadcast: {
      if (rank_ == c.peer) {
        for (size_t p = 0; p < n; ++p)
          if (p != me) xfers.push_back({static_cast<int>(p), true, const_cast<void*>(c.send), bytes});
        auto st = mesh_.exchange(xfers);
        if (st == ExchangeStatus::Ok && c.recv != c.send) std::memmove(c.recv, c.send, bytes);
        return st;
      }
      xfers.push_back({c.peer, false, c.recv, bytes});
      return mesh_.exchange(xfers);
    }
    case Collective::Kind::Reduce: {
      if (rank_ != c.peer) {
        xfers.push_back({c.peer, true, const_cast<void*>(c.send), bytes});
        return mesh_.exchange(xfers);
      }
      for (size_t p = 0; p < n; ++p) {
        if (p == me) continue;
        scratch[p].resize(bytes);
        xfers.push_back({static_cast<int>(p), false, scratch[p].data(), bytes});
        inputs[p] = scratch[p].data();
      }
      inputs[me] = c.send;
      auto st = mesh_.exchange(xfers);
      if (st == ExchangeStatus::Ok) reduce_in_rank_order(inputs, c.recv, c.count, c);
      return st;
    }
    case Collective::Kind::AllGather: {
      std::vector<char> mine(static_cast<const char*>(c.send), static_cast<const char*>(c.send) + bytes);
      for (size_t p = 0; p < n; ++p) {
        if (p == me) continue;
        xfers.push_back({static_cast<int>(p), true, mine.data(), bytes});
        xfers.push_back({static_cast<int>(p), false, static_cast<char*>(c.recv) + p * bytes, bytes});
      }
      auto st = mesh_.exchange(xfers);
      if (st == ExchangeStatus::Ok) std::memcpy(static_cast<char*>(c.recv) + me * bytes, mine.data(), bytes);
      return st;
    }
    case Collective::Kind::ReduceScatter: {
      for (size_t p = 0; p < n; ++p) {
        if (p == me) continue;
        scratch[p].resize(bytes);
        xfers.push_back({static_cast<int>(p), true, const_cast<char*>(static_cast<const char*>(c.send)) + p * bytes,
                         bytes});
        xfers.push_back({static_cast<int>(p), false, scratch[p].data(), bytes});
        inputs[p] = scratch[p].data();
      }
      std::vector<char> mine(static_cast<const char*>(c.send) + me * bytes,
                             static_cast<const char*>(c.send) + (me + 1) * bytes);
      inputs[me] = mine.data();
      auto st = mesh_.exchange(xfers);
      if (st == ExchangeStatus::Ok) reduce_in_rank_order(inputs, c.recv, c.count, c);
      return st;
    }
    case Collective::Kind::AllToAll: {
      std::vector<char> src(static_cast<const char*>(c.send), static_cast<const char*>(c.send) + n * bytes);
      for (size_t p = 0; p < n; ++p) {
        if (p == me) continue;
        xfers.push_back({static_cast<int>(p), true, src.data() + p * bytes, bytes});
        xfers.push_back({static_cast<int>(p), false, static_cast<char*>(c.recv) + p * bytes, bytes});
      }
      auto st = mesh_.exchange(xfers);
      if (st == ExchangeStatus::Ok) std::memcpy(static_cast<char*>(c.recv) + me * bytes, src.data() + me * bytes, bytes);
      return st;
    }
    case Collective::Kind::Gather: {
      if (rank_ != c.peer) {
        xfers.push_back({c.peer, true, const_cast<void*>(c.send), bytes});
        return mesh_.exchange(xfers);
      }
      std::vector<char> mine(static_cast<const char*>(c.send), static_cast<const char*>(c.send) + bytes);
      for (size_t p = 0; p < n; ++p)
        if (p != me) xfers.push_back({static_cast<int>(p), false, static_cast<char*>(c.recv) + p * bytes, bytes});
      auto st = mesh_.exchange(xfers);
      if (st == ExchangeStatus::Ok) std::memcpy(static_cast<char*>(c.recv) + me * bytes, mine.data(), bytes);
      return st;
    }
    default: return run_p2p({c});
  }
}

ExchangeStatus Communicator::run_p2p(const std::vector<Collective>& batch) {
  std::vector<Transfer> xfers;
  std::vector<const Collective*> self_sends, self_recvs;
  for (const Collective& c : batch) {
    const size_t bytes = c.count * type_size(c.type);
    const bool send = c.kind == Collective::Kind::Send;
    if (c.peer == rank_) {
      (send ? self_sends : self_recvs).push_back(&c);
      continue;
    }
    xfers.push_back({c.peer, send, send ? const_cast<void*>(c.send) : c.recv, bytes});
  }
  for (size_t i = 0; i < self_sends.size() && i < self_recvs.size(); ++i)
    std::memmove(self_recvs[i]->recv, self_sends[i]->send, self_recvs[i]->count * type_size(self_recvs[i]->type));
  return mesh_.exchange(xfers);
}

}  // namespace simcuda::nccl
