// A same-host transport for CPU point-to-point transfers: shared memory instead of a socket.
//
// [Note: same-host transport] gloo moves a CPU tensor between two ranks of one machine through a
// loopback TCP socket: the sender's call takes the pair's lock and writes; the receiver's gloo
// loop thread (a second thread per process) wakes on the socket, reads into the buffer and wakes
// the waiting thread. With one core per rank that thread competes with the ranks' compute, and a
// send stalls for milliseconds whenever it holds the lock while descheduled (measured: sends of
// 2 KiB with a median of 45-110 us and stalls of 2-5 ms, one or two per step per rank). For the
// pairs of a pipeline group that share a host, `shm_attach` maps a channel per direction instead
// and `isend` / `irecv` (p2p.cpp) use it, so the engine and the ops keep one code path:
// - A channel (shm_channel.h; created by its receiver, mapped by both) holds kShmSlots message
//   slots. A send claims a free slot, copies the tensor into that slot's data segment (created by
//   the sender, grown when a message does not fit) and marks it full; it is complete on return.
//   A receive takes the full slot with its tag (the oldest, if several) and copies out. No
//   thread besides the caller's ever runs.
// - Waiting (a receive whose message is not there yet, a send that finds every slot full) sleeps
//   (after polling for up to kShmSpinUs where every rank of the host has a core of its own,
//   [Note: spinning before sleeping] in shm.cpp) on a futex word of the channel that every post
//   and every freed slot bumps, for at most kShmWakeMs at a time: in between it checks its
//   deadline, Work::abort and, once per slice, whether the peer's process still exists (a dead
//   peer fails the wait within a slice, as a closed socket fails gloo's; a wait shorter than a
//   slice never reads /proc).
// - Every name under /dev/shm is unlinked as soon as both sides have mapped it, so nothing stays
//   behind after the processes end; what a crash leaves, a later attach on the machine unlinks
//   ([Note: shared-memory names] in shm.cpp).
// Only CPU tensors; pairs on different hosts (and every pair, where /dev/shm cannot be used) keep
// the process group's own send and receive.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/intrusive_ptr.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

#include "transport/c10d_fwd.h"
#include "transport/shm_channel.h"

namespace pippy_xla {

// How long a wait polls before it sleeps, where every rank of the host has a core of its own
// ([Note: spinning before sleeping] in shm.cpp).
constexpr int64_t kShmSpinUs = 2000;

// Collective over the process group `group_name` (every rank calls it, in the same order as the
// group's other collectives): maps a channel to and from every rank of the group on this host.
// Returns how many peers are attached (0 if the group has no same-host pair or some rank could
// not create its channels; then every rank keeps the group's transport). Attaching a group
// twice returns the first count. `spin_us`: how long this rank's waits on the group poll before
// they sleep; negative: decided from the ranks and cores of the host ([Note: spinning before
// sleeping] in shm.cpp). Attaching again with `spin_us` >= 0 sets it anew.
int64_t shm_attach(const std::string& group_name, std::chrono::milliseconds timeout,
                   int64_t spin_us = -1);

struct Attached;  // one process group's same-host channels on this rank (shm.cpp)

// The channels attached to `group` under `group_name`, or null when none are (channels attached
// to an earlier group of the same name are not used). Resolved once, they serve any number of
// transfers: the engine resolves its groups once per step ([Note: routes] in p2p.h).
std::shared_ptr<Attached> shm_channels(const c10d::ProcessGroup& group,
                                       const std::string& group_name);

// The same-host transfer to / from group rank `peer` over `channels` (shm_channels'), or an
// empty pointer when that pair is not attached. A send's work is complete on return unless
// every slot was full ([Note: deferred sends] in shm.cpp); a receive's wait fails if the
// message's size differs from `buffer`'s.
c10::intrusive_ptr<c10d::Work> shm_send(const std::shared_ptr<Attached>& channels, int64_t peer,
                                        int64_t tag, const at::Tensor& tensor);
c10::intrusive_ptr<c10d::Work> shm_recv(const std::shared_ptr<Attached>& channels, int64_t peer,
                                        int64_t tag, const at::Tensor& buffer);

// How many peers of `group_name` this rank reaches through shared memory (0: none attached).
int64_t shm_peers(const std::string& group_name);

// How many microseconds this rank's waits on `group_name`'s channels poll before they sleep
// (0: they sleep at once, or the group is not attached).
int64_t shm_spin_us(const std::string& group_name);

// Whether this rank reaches every other rank of `group` through shared memory: then the small
// collectives of p2p.h run over it too ([Note: small collectives over shared memory] in p2p.cpp).
bool shm_whole_group(const c10d::ProcessGroup& group, const std::string& group_name);
// The same for the group registered under `group_name` (false if none is).
bool shm_whole_group(const std::string& group_name);

// The tag of those collectives' messages: above every tag gloo can carry (31 bits), so no
// transfer of the engine, the ties or the ops can share it.
constexpr int64_t kShmCollectiveTag = int64_t{1} << 40;

}  // namespace pippy_xla
