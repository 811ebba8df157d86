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

// Streaming multiprocessors of the current device (0 when it cannot be queried), cached per device.
int device_sm_count();

// Resolves kAuto to the device's best tag; returns kAuto for an explicit tag the device cannot run.
Arch resolve_arch(Arch requested, int compute_capability);

// True when tag's kernels compute in bf16 (the Sm80 tag and newer; copies such as gather_kv move
// bf16 on every tag). The write and attention entry points return kUnsupportedDType otherwise.
bool tag_has_bf16(Arch tag);

// Shared memory a kernel launch may use: per CTA (the opt-in maximum), per SM, and the part of each
// resident CTA's share the driver keeps for itself (sm80+: 1 KB). A field of 0 means the current
// device's value; smaller values make a launch plan (and check) as it would on a smaller GPU.
struct SmemLimits {
  int per_block = 0;
  int per_sm = 0;
  int reserved_per_block = 0;
};

// The current device's limits (cudaDevAttrMaxSharedMemoryPerBlockOptin,
// ...MaxSharedMemoryPerMultiprocessor, ...ReservedSharedMemoryPerBlock), cached per device.
SmemLimits device_smem_limits();

// `requested` with its zero fields filled from the device and its sizes held to the device's (a
// requested limit can only shrink what the device allows; without a device, `requested`); the
// reserve is the requested one when per_block is given (the GPU being emulated), else the device's.
SmemLimits effective_smem_limits(SmemLimits requested);

// The GPU classes the kernel variants serve, by the smallest shared-memory budget in each class.
// Every tile configuration is asserted at compile time against the class it is meant for, and the
// GPU tests impose these limits on a larger GPU to run the configuration each class would get.
struct GpuClass {
  const char* name;
  Arch tag;  // the variant that runs there
  SmemLimits smem;
};
inline constexpr SmemLimits kSmemV100{98304, 98304, 0};
inline constexpr SmemLimits kSmemTuring{65536, 65536, 0};          // T4, RTX 20
inline constexpr SmemLimits kSmemA100{166912, 167936, 1024};       // A100, A30 (sm80)
inline constexpr SmemLimits kSmemAmpereAda{101376, 102400, 1024};  // A10, A40, RTX 30 (sm86); L40, RTX 40 (sm89)
inline constexpr SmemLimits kSmemHopper{232448, 233472, 1024};     // H100, H200
inline constexpr GpuClass kGpuClasses[] = {
    {"V100", Arch::kSm70, kSmemV100},
    {"T4 / RTX 20", Arch::kSm75, kSmemTuring},
    {"A10 / A40 / RTX 30", Arch::kSm80, kSmemAmpereAda},
    {"L40 / RTX 40", Arch::kSm80, kSmemAmpereAda},
    {"A100", Arch::kSm80, kSmemA100},
    {"H100 / H200", Arch::kSm90, kSmemHopper},
};

// Arch targets (e.g. 75, 80, 90) this library was compiled for, as a comma-separated string.
const char* compiled_cuda_archs();

}  // namespace mla_kv
