// tandem/base/wait_policy.h — how tandem's threads wait for each other: spin first, or sleep at once.
//
// Who calls it: the owners of waiting threads take their spin budget from spin_budget() when they
// are built (the CPU devices' thread pools, the strategy's replica threads, the in-process and
// shared-memory collectives; the NCCL poll loop per call); poll_for (base/spin.h) asks
// spin_allowed() before and during each spin and reports a spin that lost its core with
// spinner_preempted(). Nothing here blocks. wait_policy() and spin_budget() throw InvalidArgument
// when TANDEM_WAIT_POLICY holds an unknown value (so the owners' constructors report it); the
// rest never throws.
//
// Why a policy: a training step is a chain of short waits (kernel to kernel, replica to replica,
// barrier to barrier), and a thread woken from a futex takes tens of microseconds on a VM, so
// waiters spin before they sleep: the main sample's steps take up to 2x as long without spinning.
// Spinning pays only while every spinning thread has a core. When another process wants the
// cores, a spinner keeps a core from the thread it waits for, and a step that takes 200 µs alone
// costs scheduler time slices (milliseconds) instead: 10x slower and more. Like OpenMP's
// OMP_WAIT_POLICY, TANDEM_WAIT_POLICY chooses:
//   adaptive (default) spin as `active` does while the machine has room. A spinning thread that
//            loses its core (two of its clock reads kPreemptionGap apart: the scheduler gave the
//            core to someone else) while another process's threads want the cores (the load
//            check below; a core lost to one of our own threads, such as the input pipeline's,
//            changes nothing) starts a quiet period of 50 ms in which every waiter of the
//            process stops after its first few polls and sleeps. At its end, if more threads are
//            runnable than there are cores, some of another process, the next period follows,
//            twice as long (up to 2 s); else spinning resumes. See detail/spin_gate.h.
//   active   spin up to each waiter's budget, then sleep (tandem's behaviour before the policy).
//   passive  sleep at once: never spin.
#pragma once

#include <chrono>
#include <string_view>

namespace tandem {

enum class WaitPolicy { kAdaptive, kActive, kPassive };

// "adaptive", "active" or "passive" (any case, blanks around; blank means the default,
// adaptive: the env table's rules). Anything else throws InvalidArgument naming
// TANDEM_WAIT_POLICY and the value.
WaitPolicy parse_wait_policy(std::string_view value);

// The process's policy: TANDEM_WAIT_POLICY, read at the first call.
WaitPolicy wait_policy();

// The spin budget of a waiter whose owner is being built: `nominal`, or zero under the passive
// policy or when the `threads` that wait for each other outnumber the `cores` they may run on (a
// spinner would then take the core of the very thread it waits for; 3 replicas on 2 cores ran
// 150x slower with spinning).
std::chrono::microseconds spin_budget(std::chrono::microseconds nominal, int threads = 1, int cores = 1);

// Whether a waiter may spin now: always under active, never under passive, and under adaptive
// unless a quiet period is on. Called before each spin and between a spin's clock reads.
bool spin_allowed() noexcept;

// A spin loop whose consecutive clock reads lie this far apart lost its core in between.
// Interrupts and VM exits take microseconds; a thread that lost its core to another runnable
// thread is away for at least that thread's time slice (about a millisecond).
inline constexpr std::chrono::microseconds kPreemptionGap{250};

// Reports that a spinning thread lost its core; returns whether it should stop spinning (adaptive:
// yes, and a quiet period starts or grows; active: no, spinning goes on to the budget).
bool spinner_preempted() noexcept;

}  // namespace tandem
