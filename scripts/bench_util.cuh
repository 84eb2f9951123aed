// Shared by the standalone kernel benches in scripts/ (nvcc, GPU): a CUDA
// error check that exits, and event timing of a launch sequence.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
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
// fn(call index), timed with events on the default stream.
template <class F>
double MedianLaunchMicros(F&& fn, int calls, int reps) {
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  std::vector<float> ts;
  for (int rep = 0; rep < reps; ++rep) {
    CK(cudaEventRecord(e0));
    for (int c = 0; c < calls; ++c) fn(c);
    CK(cudaEventRecord(e1));
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
