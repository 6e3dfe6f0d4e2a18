// tandem/base/env.h — every TANDEM_* environment variable tandem reads, and how it reads them.
//
// One table (kAll below): name, type, default and meaning of each variable. Library code reads a
// variable only through these accessors, so that every variable follows the same rules and the
// README's "Environment variables" table can be checked against this one (tests/base). Callers:
// any module, usually once (at first use of the thing the variable configures); the accessors
// read the process environment on every call, never block, and are safe to call from any thread
// that does not race a setenv.
//
// The rules, the same for every variable:
//   - unset, empty or blank: the default (a variable without a default is "not set");
//   - surrounding blanks are ignored; otherwise the whole text must parse;
//   - booleans: 1, true, yes, on / 0, false, no, off, in any case;
//   - integers: decimal, in the variable's range; seconds: a positive decimal number;
//   - choices: one of the listed words, in any case.
// Anything else throws InvalidArgument naming the variable, quoting its value and saying what was
// expected, e.g.
//   environment variable TANDEM_CUDA_GRAPHS="maybe": expected 1, true, yes, on, 0, false, no or off
#pragma once

#include <chrono>
#include <cstdint>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <string_view>

namespace tandem::env {

enum class Type {
  kBool,     // see the rules above
  kInt,      // decimal, in [min, max]
  kSeconds,  // a positive number of seconds (fractions allowed)
  kString,   // any text (a path)
  kChoice,   // one of `choices`
};

struct Variable {
  std::string_view name;
  Type type;
  std::string_view default_value;  // written as a user would set it; empty: no default
  std::string_view meaning;        // one line, as the README shows it
  std::int64_t min = 0;            // kInt only
  std::int64_t max = 0;
  std::span<const std::string_view> choices = {};  // kChoice only, lower case
};

inline constexpr std::int64_t kMaxInt = std::numeric_limits<int>::max();

// ---------------------------------------------------------------------------------------------
// The table. The README's "Environment variables" section lists exactly these, in this order.

// Devices (devices/registry.cc; strategies ask it for their layouts there).
inline constexpr Variable kNumCpuDevices{
    .name = "TANDEM_NUM_CPU_DEVICES",
    .type = Type::kInt,
    .default_value = "1",
    .meaning = "logical CPU devices (MirroredStrategy's replicas on a machine without GPUs); unset: 1, or one per "
               "usable core (at most 8) when a MirroredStrategy with default devices comes first; fixed at first use",
    .min = 1,
    .max = 1024};
inline constexpr Variable kIntraOpThreads{
    .name = "TANDEM_INTRA_OP_THREADS",
    .type = Type::kInt,
    .default_value = "",
    .meaning = "threads of each logical CPU device; unset: the usable cores shared out among the devices",
    .min = 1,
    .max = 1024};
inline constexpr std::string_view kWaitPolicyChoices[] = {"adaptive", "active", "passive"};
inline constexpr Variable kWaitPolicy{
    .name = "TANDEM_WAIT_POLICY",
    .type = Type::kChoice,
    .default_value = "adaptive",
    .meaning =
        "how replica threads, thread pools and collectives wait: spin briefly then sleep, and sleep at once "
        "while other processes want the cores (adaptive); always spin first (active); sleep at once (passive)",
    .choices = kWaitPolicyChoices};

// Kernels (ops/).
inline constexpr std::string_view kGemmChoices[] = {"auto", "eigen", "openblas"};
inline constexpr Variable kGemm{
    .name = "TANDEM_GEMM",
    .type = Type::kChoice,
    .default_value = "auto",
    .meaning =
        "matrix products on CPUs: auto (float32 in tandem's register tiles on AVX2 and AVX-512 CPUs, the rest "
        "with OpenBLAS when libopenblas loads, else Eigen), eigen or openblas (that library for every product)",
    .choices = kGemmChoices};
inline constexpr std::string_view kCpuIsaChoices[] = {"auto", "avx512", "avx2", "baseline"};
inline constexpr Variable kCpuIsa{
    .name = "TANDEM_CPU_ISA",
    .type = Type::kChoice,
    .default_value = "auto",
    .meaning =
        "which build of the CPU kernels runs: auto (the newest this CPU can run), avx512, avx2 or baseline "
        "(x86-64 with SSE2); a path the CPU lacks is refused; fixed at first use",
    .choices = kCpuIsaChoices};
inline constexpr Variable kAllowTf32{
    .name = "TANDEM_ALLOW_TF32",
    .type = Type::kBool,
    .default_value = "0",
    .meaning = "float32 GEMMs on GPUs may use TF32 tensor cores (also ops::enable_tensor_float_32_execution)"};
inline constexpr Variable kCudnn{
    .name = "TANDEM_CUDNN",
    .type = Type::kBool,
    .default_value = "1",
    .meaning = "convolution and pooling on GPUs use cuDNN when it loads; 0: tandem's own kernels"};
inline constexpr Variable kCudnnLibrary{
    .name = "TANDEM_CUDNN_LIBRARY",
    .type = Type::kString,
    .default_value = "",
    .meaning = "the cuDNN library to try first; unset: libcudnn.so.9, then libcudnn.so"};

// Execution (graph/, keras_like/).
inline constexpr Variable kCudaGraphs{
    .name = "TANDEM_CUDA_GRAPHS",
    .type = Type::kBool,
    .default_value = "1",
    .meaning = "on GPUs, replay each step as one CUDA graph (compile's cuda_graphs = false also turns it off)"};
inline constexpr Variable kProfile{
    .name = "TANDEM_PROFILE",
    .type = Type::kBool,
    .default_value = "0",
    .meaning =
        "time every kernel; each model's trainer reports its step time and kernel time per op (an info "
        "message) when it goes away"};
// In logging::Level's order (base/log.cc relies on it).
inline constexpr std::string_view kLogLevelChoices[] = {"trace", "debug", "info", "warn", "error", "off"};
inline constexpr Variable kLogLevel{
    .name = "TANDEM_LOG_LEVEL",
    .type = Type::kChoice,
    .default_value = "info",
    .meaning =
        "the least severe of tandem's messages to print on stderr: info shows warnings and the reports "
        "asked for (TANDEM_PROFILE), debug adds what tandem chose (devices, kernels, libraries)",
    .choices = kLogLevelChoices};

// Many processes (strategy/, collective/; tools/tandem-run sets TANDEM_RESTART_COUNT).
inline constexpr Variable kRendezvousTimeout{
    .name = "TANDEM_RENDEZVOUS_TIMEOUT",
    .type = Type::kSeconds,
    .default_value = "300",
    .meaning = "how long a multi-worker start waits for every worker (MultiWorkerOptions::rendezvous_timeout wins)"};
inline constexpr Variable kRendezvousPort{
    .name = "TANDEM_RENDEZVOUS_PORT",
    .type = Type::kInt,
    .default_value = "",
    .meaning =
        "the chief's rendezvous port under torchrun or SLURM; unset: MASTER_PORT (the next port when "
        "torchrun's agent serves it), else 29500",
    .min = 1,
    .max = 65535};
inline constexpr Variable kRestartCount{
    .name = "TANDEM_RESTART_COUNT",
    .type = Type::kInt,
    .default_value = "0",
    .meaning =
        "set by tandem-run: the restart round all nodes' launchers agreed on (0, then 1, 2, ...); each round "
        "meets under its own keys",
    .min = 0,
    .max = kMaxInt};
inline constexpr Variable kLauncherStore{
    .name = "TANDEM_LAUNCHER_STORE",
    .type = Type::kBool,
    .default_value = "0",
    .meaning =
        "set by tandem-run: the launcher serves the rendezvous store on the chief's address for the whole "
        "job, so the chief worker connects to it instead of serving one"};
inline constexpr Variable kCheckCollectives{
    .name = "TANDEM_CHECK_COLLECTIVES",
    .type = Type::kBool,
    .default_value = "0",
    .meaning =
        "check that every collective call matches across workers; the first mismatch is reported with "
        "both sides"};

inline constexpr Variable kStoreSecret{
    .name = "TANDEM_STORE_SECRET",
    .type = Type::kString,
    .default_value = "",
    .meaning =
        "the shared secret every worker proves it holds before the chief's store serves it (TcpStoreOptions::secret "
        "wins); the same on every node; unset: no authentication. Never logged"};

// Every variable, in the README's order.
inline constexpr const Variable* kAll[] = {&kNumCpuDevices,  &kIntraOpThreads, &kWaitPolicy,    &kGemm,
                                           &kCpuIsa,         &kAllowTf32,      &kCudnn,         &kCudnnLibrary,
                                           &kCudaGraphs,     &kProfile,        &kLogLevel,      &kRendezvousTimeout,
                                           &kRendezvousPort, &kRestartCount,   &kLauncherStore, &kCheckCollectives,
                                           &kStoreSecret};

// ---------------------------------------------------------------------------------------------
// Reading. Each accessor checks that the variable has the type it reads (else Internal: a bug);
// get_* of a variable without a default and unset is Internal too (use find_* or is_set).

// Whether the variable is set to something other than blanks.
bool is_set(const Variable& variable);
bool get_bool(const Variable& variable);
std::int64_t get_int(const Variable& variable);
// The variable's value, or nullopt when unset: the default is not applied.
std::optional<std::int64_t> find_int(const Variable& variable);
std::chrono::milliseconds get_seconds(const Variable& variable);
// kString: the text as set (blanks trimmed), else the default (possibly empty). kChoice: the
// choice, in lower case.
std::string get_string(const Variable& variable);

// The same rules, for a value that comes from elsewhere (a launcher's environment passed in as a
// map, a test). `text` is what the variable is set to; the errors name the variable.
bool parse_bool(const Variable& variable, std::string_view text);
std::int64_t parse_int(const Variable& variable, std::string_view text);
std::chrono::milliseconds parse_seconds(const Variable& variable, std::string_view text);
std::string parse_choice(const Variable& variable, std::string_view text);

// What the variable accepts, in words: "an integer from 1 to 1024", "1, true, yes, on, 0, false,
// no or off", "a positive number of seconds", "trace, debug, info, warn, error or off", "any text".
std::string expected_values(const Variable& variable);

}  // namespace tandem::env
