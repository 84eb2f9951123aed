// The own Hopper kernel's launch from the handlers that use it (group_gemm,
// group_gemm_act): its call built from the handler's buffers and checked
// dims, and a failed launch turned into an ffi::Error. Only with the sm90
// objects (JAX_MOE_WITH_SM90).
#pragma once

#include <cstdint>

#include "ffi/ffi_common.h"
#include "ffi/gemm_call.h"
#include "kernels/common/gemm_dims.h"
#include "kernels/cuda/group_gemm/wgmma_sm90a.h"

namespace jax_moe {

// How a launch sits in a chain of kernels (moe_layer): WgmmaGemmCall's pdl,
// wait_first and counter_zeroed.
struct WgmmaChain {
  bool pdl = false, wait_first = false, counter_zeroed = false;
};

// GroupGemmWgmma on x (bf16, else f16) and w with dims d; rows: the gather's
// dst_to_src, or null; act: WgmmaGemmCall::act; counter: the kernel's tile
// counter (4 bytes of device memory). *ran: whether the kernel took the call
// (false: nothing was launched).
inline ffi::Error RunGroupGemmWgmma(cudaStream_t stream, const ffi::AnyBuffer& x,
                                    const ffi::AnyBuffer& w,
                                    const ffi::Buffer<ffi::S32>& expert_sizes,
                                    const int32_t* rows, int64_t topk, int64_t act,
                                    const GemmDims& d, const ffi::AnyBuffer& out, int* counter,
                                    const char* what, bool* ran, WgmmaChain chain = {}) {
  WgmmaGemmCall c{};
  FillGemmOperands(c, stream, x, w, expert_sizes, rows, topk, d, out);
  c.counter = counter;
  c.act = act;
  c.pdl = chain.pdl;
  c.wait_first = chain.wait_first;
  c.counter_zeroed = chain.counter_zeroed;
  *ran = false;
  const cudaError_t err = GroupGemmWgmma(c, ran);
  return err == cudaSuccess ? ffi::Error::Success() : CudaError(err, what);
}

}  // namespace jax_moe
