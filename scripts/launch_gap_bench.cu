// What a launch shaped like moe_decode's costs between kernels: a kernel that
// spins for a fixed time (globaltimer, 20 µs from its first block's start)
// launched back to back, 128 blocks of 512 threads, one block per SM, with
// and without 212 KB of dynamic shared memory, the cooperative attribute and
// a grid barrier; per call µs minus the spin is the gap. Each variant is
// timed over plain stream launches and over a CUDA graph of the same
// launches (XLA may run custom calls inside command buffers). Not part of
// the build; needs a GPU. From the repository root:
//   nvcc -O3 -std=c++20 -arch=sm_90a scripts/launch_gap_bench.cu -o /tmp/launch_gap \
//     && /tmp/launch_gap
#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include "bench_util.cuh"

namespace {

constexpr int kThreads = 512, kBlocks = 128, kCalls = 40, kReps = 7;
constexpr unsigned long long kSpinNs = 20000;

__device__ unsigned long long Now() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Every block spins until kSpinNs after the start it reads from t0 (written
// by block 0 at its start; the others start within a fraction of a µs).
template <bool kGridSync>
__global__ void __launch_bounds__(kThreads, 1) Spin(unsigned long long* t0) {
  const unsigned long long start = Now();
  while (Now() - start < kSpinNs) {
  }
  if constexpr (kGridSync) cooperative_groups::this_grid().sync();
  if (threadIdx.x == 0 && blockIdx.x == 0) *t0 = start;
}

template <bool kGridSync>
cudaError_t Launch(cudaStream_t s, int smem, bool coop, unsigned long long* t0) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(kBlocks);
  cfg.blockDim = dim3(kThreads);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = s;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeCooperative;
  attr[0].val.cooperative = 1;
  cfg.attrs = attr;
  cfg.numAttrs = coop ? 1 : 0;
  return cudaLaunchKernelEx(&cfg, Spin<kGridSync>, t0);
}

template <bool kGridSync>
void Variant(const char* name, int smem, bool coop, unsigned long long* t0) {
  CK(cudaFuncSetAttribute(Spin<kGridSync>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  for (int c = 0; c < 4; ++c) CK(Launch<kGridSync>(s, smem, coop, t0));  // warm-up
  CK(cudaStreamSynchronize(s));
  const double plain =
      MedianLaunchMicros([&](int) { CK(Launch<kGridSync>(s, smem, coop, t0)); }, kCalls, kReps, s);
  printf("%-44s stream %.2f us a call (gap %.2f)", name, plain, plain - kSpinNs / 1e3);
  // The graph: reported, not fatal, where capture refuses a variant.
  cudaGraph_t g = nullptr;
  cudaGraphExec_t ge = nullptr;
  cudaError_t e = cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal);
  for (int c = 0; c < kCalls && e == cudaSuccess; ++c) e = Launch<kGridSync>(s, smem, coop, t0);
  const cudaError_t e_end = cudaStreamEndCapture(s, &g);
  if (e == cudaSuccess) e = e_end;
  if (e == cudaSuccess) e = cudaGraphInstantiate(&ge, g, 0);
  if (e == cudaSuccess) e = cudaGraphLaunch(ge, s);
  if (e == cudaSuccess) e = cudaStreamSynchronize(s);
  if (e == cudaSuccess) {
    const double graph =
        MedianLaunchMicros([&](int) { CK(cudaGraphLaunch(ge, s)); }, 1, kReps, s) / kCalls;
    printf(", graph %.2f (gap %.2f)\n", graph, graph - kSpinNs / 1e3);
  } else {
    printf(", graph: %s\n", cudaGetErrorString(e));
    cudaGetLastError();
  }
  if (ge) cudaGraphExecDestroy(ge);
  if (g) cudaGraphDestroy(g);
  CK(cudaStreamDestroy(s));
}

}  // namespace

int main() {
  unsigned long long* t0;
  CK(cudaMalloc(&t0, 8));
  constexpr int kBig = 212 * 1024;  // about moe_decode's at Qwen3-30B-A3B
  for (int round = 0; round < 2; ++round) {
    Variant<false>("no shared memory, plain", 0, false, t0);
    Variant<false>("212 KB shared memory, plain", kBig, false, t0);
    Variant<false>("212 KB, cooperative", kBig, true, t0);
    Variant<true>("212 KB, cooperative, grid barrier", kBig, true, t0);
    Variant<true>("no shared memory, cooperative, grid barrier", 0, true, t0);
  }
  CK(cudaFree(t0));
  return 0;
}
