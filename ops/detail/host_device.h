// tandem/ops/detail/host_device.h — TANDEM_HOST_DEVICE: functions compiled for the CPU and, under
// nvcc, for the GPU as well (the update rules, the GPU kernels' index arithmetic, dropout's hash).
#pragma once

#if defined(__CUDACC__)
#define TANDEM_HOST_DEVICE __host__ __device__
#else
#define TANDEM_HOST_DEVICE
#endif
