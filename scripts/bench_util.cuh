// Shared by the standalone kernel benches in scripts/ (nvcc, GPU): a CUDA
// error check that exits, and event timing of a launch sequence.
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
// and the mean number of experts a routing touches.
inline std::vector<int32_t> RandomExpertSizes(int experts, int tokens, int topk, int rotations,
                                              double* mean_active) {
  std::vector<int32_t> sizes(static_cast<size_t>(rotations) * experts, 0);
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
      }
    }
    for (int i = 0; i < experts; ++i) active += s[i] > 0;
  }
  *mean_active = static_cast<double>(active) / rotations;
  return sizes;
}
