// The two halves of a grouped GEMM's backward on Hopper, one after the other
// and at once: the dgrad (GroupGemmSm90Kn: dx = dy @ w[e], reads the
// weights) and the weight gradient (GroupGemmWgradSm90: dw[e] = dy_e^T x_e,
// writes a weight-sized gradient). Both depend only on dy, so they can run
// on two streams, the SMs split between their persistent grids (max_ctas):
// one streams reads, the other writes.
//
// Per case (bf16, a random top-k routing of m / topk tokens), µs: each half
// alone on every SM, both in sequence on one stream, and both at once for
// several splits (dgrad CTAs + weight-gradient CTAs = the SM count). Every
// overlapped run is checked to give the same bits as the sequence.
// Times: the median of 5 repeats of the mean of 3 calls, after warm-ups.
//
// Build: -DJAX_MOE_BUILD_KERNEL_BENCHMARKS=ON with the sm90 build; then
//   build/benchmarks/kernels/grad_overlap_bench [substring of case names]
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "bench_util.cuh"

#ifdef JAX_MOE_WITH_SM90
#include "kernels/cuda/group_gemm/gemm_sm90a.h"
#include "kernels/cuda/group_gemm/wgrad_sm90a.h"

namespace {

// Pseudo-random bf16 values in [-1, 1), a hash of (index, seed).
__global__ void FillKernel(uint16_t* p, int64_t count, uint32_t seed) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < count;
       i += stride) {
    uint32_t h = static_cast<uint32_t>(i) * 0x9E3779B1u ^ static_cast<uint32_t>(i >> 32) ^ seed;
    h ^= h >> 16;
    h *= 0x7feb352du;
    h ^= h >> 15;
    const float v = static_cast<float>(h >> 8) * (2.0f / 16777216.0f) - 1.0f;
    p[i] = static_cast<uint16_t>(__float_as_uint(v) >> 16);  // bf16 by truncation
  }
}

// Counts the 16-byte words where a and b differ.
__global__ void DiffKernel(const uint4* a, const uint4* b, int64_t words,
                           unsigned long long* count) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  unsigned long long c = 0;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < words;
       i += stride) {
    const uint4 u = a[i], v = b[i];
    c += (u.x != v.x || u.y != v.y || u.z != v.z || u.w != v.w) ? 1 : 0;
  }
  if (c != 0) atomicAdd(count, c);
}

struct Case {
  const char* name;
  int E;
  int64_t n, k, m;  // dy (m, n), x (m, k), w and dw (E, n, k)
  int topk;
};

struct Backward {
  const Case& c;
  uint16_t *dy, *x, *w, *dx, *dw, *dx_ref, *dw_ref;
  int32_t* sizes;
  void *scratch_d, *scratch_w;
  size_t bytes_d, bytes_w;
  explicit Backward(const Case& cs) : c(cs) {
    double active = 0;
    const std::vector<int32_t> h =
        RandomExpertSizes(c.E, static_cast<int>(c.m / c.topk), c.topk, 1, &active);
    CK(cudaMalloc(&sizes, h.size() * 4));
    CK(cudaMemcpy(sizes, h.data(), h.size() * 4, cudaMemcpyHostToDevice));
    const int64_t wn = c.E * c.n * c.k;
    for (auto [p, count] : {std::pair{&dy, c.m * c.n}, {&x, c.m * c.k}, {&w, wn}, {&dx, c.m * c.k},
                            {&dw, wn}, {&dx_ref, c.m * c.k}, {&dw_ref, wn}})
      CK(cudaMalloc(p, count * 2));
    FillKernel<<<1024, 256>>>(dy, c.m * c.n, 1);
    FillKernel<<<1024, 256>>>(x, c.m * c.k, 2);
    FillKernel<<<1024, 256>>>(w, wn, 3);
    bytes_d = static_cast<size_t>(jax_moe::GroupGemmSm90KnScratchBytes(c.m, c.n, c.E, false));
    bytes_w = static_cast<size_t>(jax_moe::GroupGemmWgradSm90ScratchBytes(c.m, c.k, c.E, false));
    CK(cudaMalloc(&scratch_d, bytes_d));
    CK(cudaMalloc(&scratch_w, bytes_w));
    CK(cudaDeviceSynchronize());  // the fills ran on the legacy stream; the calls run on others
  }
  ~Backward() {
    for (void* p : {static_cast<void*>(dy), static_cast<void*>(x), static_cast<void*>(w),
                    static_cast<void*>(dx), static_cast<void*>(dw), static_cast<void*>(dx_ref),
                    static_cast<void*>(dw_ref), static_cast<void*>(sizes), scratch_d, scratch_w})
      CK(cudaFree(p));
  }
  Backward(const Backward&) = delete;
  Backward& operator=(const Backward&) = delete;

  bool Dgrad(cudaStream_t s, int ctas) const {
    jax_moe::Sm90GemmCall g{};
    g.stream = s;
    g.bf16 = true;
    g.w_kn = true;  // w (E, n, k) read as (groups, K = n, N = k)
    g.x = dy;
    g.w = w;
    g.sizes = sizes;
    g.topk = 1;
    g.out = dx;
    g.m = c.m;
    g.n = c.k;
    g.k = c.n;
    g.groups = c.E;
    g.x_rows = c.m;
    g.scratch = scratch_d;
    g.scratch_bytes = bytes_d;
    g.max_ctas = ctas;
    bool ran = false;
    CK(jax_moe::GroupGemmSm90Kn(g, &ran));
    return ran;
  }
  bool Wgrad(cudaStream_t s, int ctas) const {
    jax_moe::Sm90WgradCall g{};
    g.stream = s;
    g.bf16 = true;
    g.dy = dy;
    g.x = x;
    g.sizes = sizes;
    g.topk = 1;
    g.out = dw;
    g.m = c.m;
    g.n = c.n;
    g.k = c.k;
    g.groups = c.E;
    g.x_rows = c.m;
    g.scratch = scratch_w;
    g.scratch_bytes = bytes_w;
    g.max_ctas = ctas;
    bool ran = false;
    CK(jax_moe::GroupGemmWgradSm90(g, &ran));
    return ran;
  }
  // Words of dx and dw that differ from the sequence's.
  unsigned long long Differs() const {
    unsigned long long* d;
    CK(cudaMalloc(&d, 8));
    CK(cudaMemset(d, 0, 8));
    DiffKernel<<<1024, 256>>>(reinterpret_cast<const uint4*>(dx),
                              reinterpret_cast<const uint4*>(dx_ref), c.m * c.k / 8, d);
    DiffKernel<<<1024, 256>>>(reinterpret_cast<const uint4*>(dw),
                              reinterpret_cast<const uint4*>(dw_ref), c.E * c.n * c.k / 8, d);
    unsigned long long h = 0;
    CK(cudaMemcpy(&h, d, 8, cudaMemcpyDeviceToHost));
    CK(cudaFree(d));
    return h;
  }
};

int Run(const std::string& only) {
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  cudaStream_t s0, s1;
  CK(cudaStreamCreateWithFlags(&s0, cudaStreamNonBlocking));
  CK(cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking));
  cudaEvent_t fork, join;
  CK(cudaEventCreateWithFlags(&fork, cudaEventDisableTiming));
  CK(cudaEventCreateWithFlags(&join, cudaEventDisableTiming));
  // w13: n = 2I, k = H; w2: n = H, k = I. t<T>: a training step of T tokens.
  const Case cases[] = {
      {"ds w13 t4096", 256, 4096, 7168, 32768, 8},
      {"ds w2 t4096", 256, 7168, 2048, 32768, 8},
      {"ds w13 t16384", 256, 4096, 7168, 131072, 8},
      {"mix w13 t4096", 8, 28672, 4096, 8192, 2},
      {"mix w2 t4096", 8, 4096, 14336, 8192, 2},
      {"q30 w13 t4096", 128, 1536, 2048, 32768, 8},
      {"q30 w2 t4096", 128, 2048, 768, 32768, 8},
  };
  const int splits[] = {8, 16, 24, 32, 48, 66};
  bool ok = true;
  for (const Case& cs : cases) {
    if (std::string(cs.name).find(only) == std::string::npos) continue;
    Backward b(cs);
    if (!(b.Dgrad(s0, 0) && b.Wgrad(s0, 0))) {
      printf("%-14s declined\n", cs.name);
      ok = false;
      continue;
    }
    CK(cudaStreamSynchronize(s0));
    CK(cudaMemcpy(b.dx_ref, b.dx, cs.m * cs.k * 2, cudaMemcpyDeviceToDevice));
    CK(cudaMemcpy(b.dw_ref, b.dw, cs.E * cs.n * cs.k * 2, cudaMemcpyDeviceToDevice));
    const double us_d = MedianLaunchMicros([&](int) { b.Dgrad(s0, 0); }, 3, 5, s0);
    const double us_w = MedianLaunchMicros([&](int) { b.Wgrad(s0, 0); }, 3, 5, s0);
    const double us_seq = MedianLaunchMicros(
        [&](int) {
          b.Dgrad(s0, 0);
          b.Wgrad(s0, 0);
        },
        3, 5, s0);
    const double gb = 2.0 * 2.0 * cs.E * cs.n * cs.k / 1e9;  // weights read + gradient written
    printf("%-14s dgrad %8.1f  wgrad %8.1f  in sequence %8.1f us (%.2f TB/s)\n", cs.name, us_d,
           us_w, us_seq, gb / us_seq * 1e3);
    for (int d : splits) {
      if (d >= sms) continue;
      auto both = [&](int) {
        CK(cudaEventRecord(fork, s0));
        CK(cudaStreamWaitEvent(s1, fork));
        b.Wgrad(s1, sms - d);
        b.Dgrad(s0, d);
        CK(cudaEventRecord(join, s1));
        CK(cudaStreamWaitEvent(s0, join));
      };
      CK(cudaMemsetAsync(b.dx, 0xff, cs.m * cs.k * 2, s0));
      CK(cudaMemsetAsync(b.dw, 0xff, cs.E * cs.n * cs.k * 2, s0));
      both(0);
      CK(cudaStreamSynchronize(s0));
      const unsigned long long diff = b.Differs();
      ok = ok && diff == 0;
      const double us = MedianLaunchMicros(both, 3, 5, s0);
      printf("%-14s   at once, %3d dgrad + %3d wgrad CTAs %8.1f us (%.2f TB/s, %.2fx)  %s\n",
             cs.name, d, sms - d, us, gb / us * 1e3, us_seq / us,
             diff == 0 ? "same bits" : "DIFFERS");
    }
  }
  return ok ? 0 : 1;
}

}  // namespace
#endif  // JAX_MOE_WITH_SM90

// argv[1] (optional): run only the cases whose name contains it.
int main(int argc, char** argv) {
#ifdef JAX_MOE_WITH_SM90
  return Run(argc > 1 ? argv[1] : "");
#else
  (void)argc;
  (void)argv;
  printf("built without the sm90 path (no CUTLASS headers): nothing to run\n");
  return 2;
#endif
}
