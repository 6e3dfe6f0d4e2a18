# Every dependency comes from a Debian package (or the CUDA toolkit when present); nothing is
# downloaded at build time. scripts/install-deps.sh installs the packages named here.
find_package(Threads REQUIRED)
find_package(Eigen3 3.4 REQUIRED NO_MODULE)
find_package(fmt REQUIRED)
find_package(nlohmann_json 3.10 REQUIRED)
find_package(ZLIB REQUIRED)
# Gloo (Debian's libgloo-dev): collectives between processes over TCP (collective/gloo.cc).
find_package(Gloo CONFIG REQUIRED)
# spdlog (libspdlog-dev, built on the same libfmt): the library's leveled messages (base/log.cc).
# Linked privately: no public header includes it.
find_package(spdlog CONFIG REQUIRED)
# OpenSSL's libcrypto (libssl-dev): the TCP store's challenge-response handshake (HMAC-SHA256,
# random nonces, constant-time comparison; collective/detail/store_auth.cc). Linked privately.
find_package(OpenSSL 3 REQUIRED COMPONENTS Crypto)
# Protocol Buffers (libprotobuf-dev, protobuf-compiler): TensorBoard's event files (keras_like's
# TensorBoard callback); protoc compiles keras_like/detail/tensorboard_events.proto at build time.
# Linked privately: no public header includes it.
find_package(Protobuf 3 REQUIRED)
# ONNX (libonnx-dev): Model::export_model writes models with ONNX's own messages and checks them
# with its checker (keras_like/onnx_export.cc); the ONNX node tests (tests/onnx/) read them too.
# Its CMake package needs protobuf's targets, found above. Linked privately.
find_package(ONNX CONFIG REQUIRED)
# CLI11 (libcli11-dev, header-only): the command lines of the samples, benchmarks and tandem-run.
find_package(CLI11 CONFIG REQUIRED)

# OpenBLAS is not linked: ops/cpu/gemm.cc loads it at run time so that it can choose the kernel
# set for this CPU before the library initialises (see the comment there). We only record where
# Debian put it, as the first place to look.
find_library(TANDEM_OPENBLAS_LIBRARY NAMES openblas
             PATHS /usr/lib/x86_64-linux-gnu/openblas-pthread /usr/lib/aarch64-linux-gnu/openblas-pthread)
if(TANDEM_OPENBLAS_LIBRARY)
  message(STATUS "tandem: OpenBLAS found at ${TANDEM_OPENBLAS_LIBRARY} (loaded at run time)")
else()
  message(STATUS "tandem: OpenBLAS not found; matrix products use Eigen")
  set(TANDEM_OPENBLAS_LIBRARY "")
endif()

set(TANDEM_HAVE_CUDA 0)
set(TANDEM_HAVE_CUDNN 0)
if(NOT TANDEM_CUDA STREQUAL "OFF")
  if(NOT DEFINED CUDAToolkit_ROOT AND EXISTS /usr/local/cuda)
    set(CUDAToolkit_ROOT /usr/local/cuda)
  endif()
  find_package(CUDAToolkit QUIET)
  if(CUDAToolkit_FOUND)
    set(TANDEM_HAVE_CUDA 1)
    # NCCL ships with the toolkit here (/usr/local/cuda/lib64) or as Debian's libnccl-dev.
    find_library(TANDEM_NCCL_LIBRARY NAMES nccl HINTS ${CUDAToolkit_LIBRARY_DIR})
    find_path(TANDEM_NCCL_INCLUDE_DIR nccl.h HINTS ${CUDAToolkit_INCLUDE_DIRS})
    if(NOT TANDEM_NCCL_LIBRARY OR NOT TANDEM_NCCL_INCLUDE_DIR)
      message(STATUS "tandem: NCCL not found; GPU replicas would have no collective backend")
      set(TANDEM_NCCL_LIBRARY "")
    endif()
    # cuDNN 9 for convolution and pooling (ops/cuda/cudnn.cc): only its header is needed to build,
    # libcudnn is loaded with dlopen at run time. The toolkit may carry it; on machines where only
    # PyTorch's wheel has it, pass -DTANDEM_CUDNN_INCLUDE_DIR=.../site-packages/nvidia/cudnn/include.
    # Without it the GPU kernels use im2col + cuBLAS and tandem's pooling kernels.
    set(TANDEM_CUDNN_INCLUDE_DIR "" CACHE PATH "Folder holding cuDNN 9's cudnn.h (default: the CUDA toolkit's)")
    find_path(TANDEM_CUDNN_HEADER_DIR cudnn_version.h HINTS ${TANDEM_CUDNN_INCLUDE_DIR} ${CUDAToolkit_INCLUDE_DIRS}
              NO_CACHE)
    string(REGEX REPLACE "/$" "" TANDEM_CUDNN_HEADER_DIR "${TANDEM_CUDNN_HEADER_DIR}")
    if(TANDEM_CUDNN_HEADER_DIR AND EXISTS "${TANDEM_CUDNN_HEADER_DIR}/cudnn.h")
      file(STRINGS "${TANDEM_CUDNN_HEADER_DIR}/cudnn_version.h" tandem_cudnn_major REGEX "^#define CUDNN_MAJOR +[0-9]+")
      string(REGEX REPLACE "^#define CUDNN_MAJOR +([0-9]+).*" "\\1" tandem_cudnn_major "${tandem_cudnn_major}")
      if(tandem_cudnn_major STREQUAL "9")
        set(TANDEM_HAVE_CUDNN 1)
        message(STATUS "tandem: cuDNN 9 header found in ${TANDEM_CUDNN_HEADER_DIR}; libcudnn is loaded at run time")
      else()
        message(STATUS "tandem: cudnn.h in ${TANDEM_CUDNN_HEADER_DIR} is cuDNN ${tandem_cudnn_major}, not 9; "
                       "convolution and pooling use tandem's kernels")
      endif()
    else()
      message(STATUS "tandem: cuDNN's cudnn.h not found (set TANDEM_CUDNN_INCLUDE_DIR); "
                     "convolution and pooling use tandem's kernels")
    endif()
    # The GPU kernels: nvcc from the same toolkit, sm_90 (H100/H200) SASS plus PTX by default.
    if(NOT CMAKE_CUDA_COMPILER)
      set(CMAKE_CUDA_COMPILER ${CUDAToolkit_BIN_DIR}/nvcc)
    endif()
    if(NOT CMAKE_CUDA_ARCHITECTURES)
      set(CMAKE_CUDA_ARCHITECTURES 90)
    endif()
    enable_language(CUDA)
    set(CMAKE_CUDA_STANDARD 17)  # what this CMake knows how to ask nvcc for; the .cu code needs no more
    set(CMAKE_CUDA_STANDARD_REQUIRED ON)
    message(STATUS "tandem: CUDA ${CUDAToolkit_VERSION} found at ${CUDAToolkit_BIN_DIR}; GPU parts are built "
                   "(CUDA architectures: ${CMAKE_CUDA_ARCHITECTURES})")
  elseif(TANDEM_CUDA STREQUAL "ON")
    message(FATAL_ERROR "tandem: TANDEM_CUDA=ON but no CUDA toolkit was found "
                        "(set CUDAToolkit_ROOT, or use -DTANDEM_CUDA=AUTO)")
  else()
    message(STATUS "tandem: no CUDA toolkit found; building the CPU parts only")
  endif()
endif()
