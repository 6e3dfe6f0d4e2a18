// tandem/strategy/tensor_parallel.h — Megatron-LM's tensor-parallel communication as graph ops.
//
// Tensor parallelism computes one layer on several devices, each holding a piece of its weights
// (arXiv:1909.08053). Two operators carry all of its communication, and autodiff pairs them:
//   copy_to_group(x)      Megatron's f: the identity forward; backward, the gradients every device
//                         computed for x are summed (all-reduced) over the group. Placed before a
//                         column-parallel layer (its weights split by output features), whose
//                         devices each take the whole input.
//   reduce_from_group(x)  Megatron's g: forward, the devices' partial results are summed
//                         (all-reduced); backward, the identity. Placed after a row-parallel
//                         layer (its weights split by input features).
// A column-parallel Dense followed by a row-parallel one thus communicates once forward and once
// backward, each an all-reduce of a (rows x features) activation. A layer split by output
// channels whose output the next layer needs whole (Conv2D) ends in gather_from_group instead.
//
// Who calls: code that builds a replica's graph (a layer's call, a hand-written graph), once per
// graph; every device of the group runs its own executor of a graph with the same collectives in
// the same order (Strategy::run's replica threads). A node's kernel finds its device's
// communicator through the Group its attributes name; the Group must outlive the executors.
// What blocks: the kernels, in the collective, until every device of the group reaches it (the
// communicator's timeout and abort apply: DeadlineExceeded / Unavailable, as for any collective).
// What throws: InvalidArgument when a Group is made of mismatched lists, and at run time when an
// executor's device is not in the node's group (naming the device and the group's devices);
// FailedPrecondition when the group was destroyed.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "tandem/collective/communicator.h"
#include "tandem/devices/device.h"
#include "tandem/graph/graph.h"

namespace tandem::strategy::tensor_parallel {

// The devices that compute the pieces of one layer together, each with its rank's communicator of
// one group (communicators[i] is devices[i]'s). A process may hold some of the group's devices
// only (one process per device: each its own Group of one local device); the group's size is the
// communicators'.
class Group {
 public:
  static std::shared_ptr<Group> create(std::vector<devices::Device*> devices,
                                       std::vector<collective::Communicator*> communicators);
  // Groups of local devices made in one: the devices with the same group_of index form one group
  // (in-process communicators the Group owns; every group as large). Ranks follow the devices'
  // order within each group. How keras::distribution::ModelParallel makes the groups along its
  // model axis, one per position on the other axes: a kernel finds its device's own group.
  static std::shared_ptr<Group> create_in_process(std::vector<devices::Device*> devices,
                                                  const std::vector<int>& group_of);
  // Groups of local devices whose communicators the caller made (each device's of its own group:
  // groups spread over several processes), all of one size; the caller keeps them alive.
  static std::shared_ptr<Group> create_grouped(std::vector<devices::Device*> devices,
                                               std::vector<collective::Communicator*> communicators);
  ~Group();
  Group(const Group&) = delete;
  Group& operator=(const Group&) = delete;

  std::int64_t id() const { return id_; }
  int size() const { return communicators_.front()->size(); }
  // The rank of `device` in the group; InvalidArgument naming it and the group's local devices.
  int rank_of(const devices::Device& device) const;
  collective::Communicator& communicator(const devices::Device& device) const;
  std::string to_string() const;  // "tensor-parallel group 3 (CPU:0, CPU:1 here of 2)"
  // Aborts the communicators the group owns (create_in_process), so that devices waiting in its
  // collectives fail at once: a failed replica's strategy calls it.
  void abort(const std::string& reason);
  // Replaces the owned communicators by fresh ones of the same membership (after an abort, before
  // the next step: no device may be in a collective of the group). The old ones stay alive.
  void renew();
  // What the owned communicators did (since the group was made, renewed ones included), added up.
  collective::CommunicationStats stats() const;

 private:
  // A new group under a fresh id in the registry through which kernels find it.
  static std::shared_ptr<Group> registered(std::vector<devices::Device*> devices,
                                           std::vector<collective::Communicator*> communicators);
  std::size_t local_index(const devices::Device& device) const;
  Group(std::int64_t id, std::vector<devices::Device*> devices, std::vector<collective::Communicator*> communicators);
  std::int64_t id_;
  std::vector<devices::Device*> devices_;
  std::vector<collective::Communicator*> communicators_;
  std::vector<std::unique_ptr<collective::Communicator>> owned_, retired_;
  int size_of_groups_ = 0;
};

// Megatron's f and g (above). x: a floating-point tensor of any shape.
graph::Output copy_to_group(graph::Output x, const Group& group);
graph::Output reduce_from_group(graph::Output x, const Group& group);
// The element-wise maximum over the group; no gradient flows through it.
graph::Output max_over_group(graph::Output x, const Group& group);
// Every device's x concatenated along `axis` in rank order (the output of a layer split by output
// features or channels, made whole). Backward, this device's part of the gradient (the gradient
// of the whole is the same on every device when what follows is replicated).
graph::Output gather_from_group(graph::Output x, int axis, const Group& group);
// The reverse (Megatron's scatter): this device's part of x along `axis` (x's size there divided
// by the group's, which must divide it), for a row-parallel layer whose input arrives whole.
// Backward, the parts' gradients gathered. Each device's rank is found when its executor runs,
// so one graph serves every device of the group.
graph::Output scatter_to_group(graph::Output x, int axis, const Group& group);

// vocab_start for a device holding piece `rank` of a vocabulary split evenly: rank x rows, the
// rank found when the executor runs (one graph serves every device of the group).
inline constexpr std::int64_t kVocabStartOfRank = -1;

// Megatron's vocabulary-parallel embedding: this device holds rows [vocab_start, vocab_start +
// rows) of the table (table_piece: [rows, dim]); an id outside them looks up zeros, and the
// group's sum is every id's row: one all-reduce of (ids x dim) forward, none backward (the
// table's gradient stays on its device). ids: integers of any shape; the result is ids' shape +
// [dim]. The lookup is a one-hot product (ids x rows x dim multiply-adds), not a gather.
graph::Output vocab_parallel_embedding(graph::Output ids, graph::Output table_piece, std::int64_t vocab_start,
                                       const Group& group);

// Megatron's vocabulary-parallel cross-entropy: logits_piece [rows, V / t] holds this device's
// vocabulary columns [vocab_start, vocab_start + V / t) of the logits, labels [rows] integers in
// [0, V). Returns each row's loss, -log softmax(logits)[label], the same on every device, from
// three all-reduces of [rows] values forward (the maximum, the sum of exponentials, the label's
// logit) and none backward: the full logits are never gathered. Its gradient with respect to
// logits_piece is this device's columns of softmax(logits) - one_hot(label).
graph::Output vocab_parallel_cross_entropy(graph::Output logits_piece, graph::Output labels, std::int64_t vocab_start,
                                           const Group& group);

}  // namespace tandem::strategy::tensor_parallel
