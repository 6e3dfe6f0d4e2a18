// tandem/strategy/detail/device_staging.h — input batches copied to the replicas' devices ahead of
// the step that uses them (DistributionOptions::fetch_to_device).
//
// Why a thread: a step's host-to-device input copy, done when the step starts, leaves the GPU idle
// for its length (and a copy from pageable memory blocks the host too). Staged by a thread, batch
// k+1 is packed into page-locked memory and copied on the device's input stream while step k's
// kernels run on the compute stream; the compute stream waits for the copy with an event, so the
// host never blocks on it. PyTorch users get the same from DataLoader(pin_memory=True) and
// .to(device, non_blocking=True), TF users from distribute_dataset's prefetch to device.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "tandem/data/dataset.h"
#include "tandem/devices/device.h"
#include "tandem/strategy/strategy.h"

namespace tandem::strategy::detail {

struct StagingOptions {
  // Batches staged and waiting for next(), beyond the one the caller holds.
  int batches_ahead = kDefaultDevicePrefetchBatches;
  std::string owner;  // who stages (the strategy's name), for messages
};

// One shard per device, in device order (Strategy::split_batch).
using SplitBatch = std::function<std::vector<data::Element>(const data::Element&)>;

// Wraps `source`: a staging thread, started by the first next(), takes its batches, splits each
// with `split`, packs every device's shard into that device's page-locked staging memory and
// queues its copy to the device on the device's input stream. next() returns the batch with
// replica_shards on the devices and makes each device's compute stream wait for its copy; the
// returned `staging` handle keeps the buffers until dropped, after which they are refilled only
// once the device has finished the work queued before the drop.
//
// Memory: a set of buffers (pinned host + device, as large as the largest batch seen) per batch
// in flight: batches_ahead waiting, one being filled, and those the caller holds.
// Errors: an exception of the source or of a copy is rethrown by the next() that would have
// returned that batch; later calls return nullopt. Destroying the iterator stops the thread
// (waiting for a source next() already under way). Callers: one thread, the one that queues the
// steps (it owns the devices' compute streams between steps).
std::unique_ptr<Strategy::WorkerIterator> stage_on_devices(std::unique_ptr<Strategy::WorkerIterator> source,
                                                           std::vector<devices::Device*> devices, SplitBatch split,
                                                           StagingOptions options);

}  // namespace tandem::strategy::detail
