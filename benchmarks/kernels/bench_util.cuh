// Shared by the kernel micro-benchmarks in benchmarks/kernels (CUDA, GPU):
// a CUDA error check that exits, event timing of a launch sequence, random
// routings, the models' layer shapes and buffers, and the reference
// kernels' expert lookup.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <utility>
#include <vector>

#define CK(x)                                                               \
  do {                                                                      \
    cudaError_t e_ = (x);                                                   \
    if (e_ != cudaSuccess) {                                                \
      printf("CUDA %s at %d: %s\n", #x, __LINE__, cudaGetErrorString(e_)); \
      exit(1);                                                              \
    }                                                                       \
  } while (0)

// The expert of row r of the expert-sorted rows (expert_sizes in order, a
// negative size taken as 0), or -1 for a row past them: the reference
// kernels' lookup.
__device__ inline int ExpertOfRow(const int32_t* sizes, int experts, int64_t r) {
  int64_t start = 0;
  for (int i = 0; i < experts; ++i) {
    start += sizes[i] > 0 ? sizes[i] : 0;
    if (r < start) return i;
  }
  return -1;
}

// Median over `reps` repeats of the mean µs per call of `calls` calls of
// fn(call index), timed with events on `stream` (fn launches there).
template <class F>
double MedianLaunchMicros(F&& fn, int calls, int reps, cudaStream_t stream = 0) {
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  std::vector<float> ts;
  for (int rep = 0; rep < reps; ++rep) {
    CK(cudaEventRecord(e0, stream));
    for (int c = 0; c < calls; ++c) fn(c);
    CK(cudaEventRecord(e1, stream));
    CK(cudaEventSynchronize(e1));
    float ms = 0.f;
    CK(cudaEventElapsedTime(&ms, e0, e1));
    ts.push_back(ms * 1000.f / calls);
  }
  CK(cudaGetLastError());
  CK(cudaEventDestroy(e0));
  CK(cudaEventDestroy(e1));
  std::sort(ts.begin(), ts.end());
  return ts[reps / 2];
}

// `rotations` random routings of `tokens` tokens, each to `topk` distinct
// experts of `experts` (seed 7): expert_sizes laid out [rotation][expert],
// and the mean number of experts a routing touches. With `dst_to_src`, also
// each routing's slots in expert order as the layer's token index lays them
// out (an expert's slots by token; slot t * topk + j is token t's j-th pick),
// laid out [rotation][tokens * topk].
inline std::vector<int32_t> RandomExpertSizes(int experts, int tokens, int topk, int rotations,
                                              double* mean_active,
                                              std::vector<int32_t>* dst_to_src = nullptr) {
  std::vector<int32_t> sizes(static_cast<size_t>(rotations) * experts, 0);
  const size_t slots = static_cast<size_t>(tokens) * topk;
  std::vector<int32_t> picks(slots);
  if (dst_to_src != nullptr) dst_to_src->assign(static_cast<size_t>(rotations) * slots, -1);
  std::mt19937 rng(7);
  int64_t active = 0;
  for (int r = 0; r < rotations; ++r) {
    int32_t* s = sizes.data() + static_cast<size_t>(r) * experts;
    for (int t = 0; t < tokens; ++t) {
      std::vector<int> ids(experts);
      for (int i = 0; i < experts; ++i) ids[i] = i;
      for (int j = 0; j < topk; ++j) {  // a partial Fisher-Yates shuffle
        std::uniform_int_distribution<int> pick(j, experts - 1);
        std::swap(ids[j], ids[pick(rng)]);
        s[ids[j]]++;
        picks[static_cast<size_t>(t) * topk + j] = ids[j];
      }
    }
    for (int i = 0; i < experts; ++i) active += s[i] > 0;
    if (dst_to_src != nullptr) {  // a counting sort of the slots by expert, stable in slot order
      std::vector<int64_t> next(experts, 0);
      for (int i = 1; i < experts; ++i) next[i] = next[i - 1] + s[i - 1];
      int32_t* d = dst_to_src->data() + static_cast<size_t>(r) * slots;
      for (size_t slot = 0; slot < slots; ++slot) d[next[picks[slot]]++] = static_cast<int32_t>(slot);
    }
  }
  *mean_active = static_cast<double>(active) / rotations;
  return sizes;
}

// A MoE layer's shape for the decode GEMM pair benches: E experts, hidden
// size H, expert FFN width I, T tokens, topk experts per token.
struct Layer {
  const char* name;
  int E, H, I, T, topk;
};

// The models the decode benches time (E, H, I, topk), and a layer of T tokens of one.
struct Model {
  int E, H, I, topk;
};
constexpr Model kQwen3_30B{128, 2048, 768, 8}, kQwen3_235B{128, 4096, 1536, 8},
    kDeepSeekV3{256, 7168, 2048, 8};
constexpr Layer LayerOf(const char* name, Model m, int tokens) {
  return {name, m.E, m.H, m.I, tokens, m.topk};
}

// The device buffers of a layer's two GEMMs in bf16, M = T * topk rows:
// gate/up x (M, H) @ w1 (E, 2I, H) -> h (M, 2I), down act (M, I) @ w2 (E, H, I)
// -> y (M, H), and `rotations` rows of expert_sizes. Contents are left to the
// caller; freed with the object.
struct PairBuffers {
  int64_t m, n1, k1, n2, k2, w1n, w2n;
  uint16_t *w1, *w2, *x, *h, *act, *y;
  int32_t* sizes;
  PairBuffers(const Layer& L, int rotations)
      : m(static_cast<int64_t>(L.T) * L.topk), n1(2 * int64_t{L.I}), k1(L.H), n2(L.H),
        k2(L.I), w1n(L.E * n1 * k1), w2n(L.E * n2 * k2) {
    CK(cudaMalloc(&w1, w1n * 2));
    CK(cudaMalloc(&w2, w2n * 2));
    CK(cudaMalloc(&x, m * k1 * 2));
    CK(cudaMalloc(&h, m * n1 * 2));
    CK(cudaMalloc(&act, m * k2 * 2));
    CK(cudaMalloc(&y, m * n2 * 2));
    CK(cudaMalloc(&sizes, static_cast<size_t>(rotations) * L.E * 4));
  }
  ~PairBuffers() {
    for (void* p : {static_cast<void*>(w1), static_cast<void*>(w2), static_cast<void*>(x),
                    static_cast<void*>(h), static_cast<void*>(act), static_cast<void*>(y),
                    static_cast<void*>(sizes)})
      CK(cudaFree(p));
  }
  PairBuffers(const PairBuffers&) = delete;
  PairBuffers& operator=(const PairBuffers&) = delete;
};
