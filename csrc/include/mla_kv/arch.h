// Kernel variants are chosen by an explicit arch tag, not only by the compile target, so that the
// Sm70 (Volta) variant can be built for and run on a newer GPU and tested there.
#pragma once

namespace mla_kv {

enum class Arch : int {
  kAuto = 0,   // the best variant for the current device
  kSm70 = 70,  // Volta: fp16/fp32 only, mma.m8n8k4, no cp.async/ldmatrix
  kSm75 = 75,  // Turing: mma.m16n8k8, ldmatrix
  kSm80 = 80,  // Ampere and newer: mma.m16n8k16 (fp16, bf16), cp.async
  kSm90 = 90,  // Hopper: wgmma in attention (other ops run their Sm80 variant)
};

// Compute capability (major * 10 + minor) of the current device, cached per device.
int device_compute_capability();

// Resolves kAuto to the device's best tag; returns kAuto for an explicit tag the device cannot run.
Arch resolve_arch(Arch requested, int compute_capability);

// Arch targets (e.g. 75, 80, 90) this library was compiled for, as a comma-separated string.
const char* compiled_cuda_archs();

}  // namespace mla_kv
