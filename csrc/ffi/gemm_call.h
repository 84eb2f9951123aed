// The operands that the Hopper kernels' call structs (Sm90GemmCall,
// WgmmaGemmCall) share, filled from a handler's buffers and checked dims in
// one place. CUDA builds only.
#pragma once

#include <cstdint>

#include "ffi/ffi_common.h"
#include "kernels/common/gemm_dims.h"

namespace jax_moe {

// x (bf16, else f16) and w with dims d; rows: the gather's dst_to_src, or null.
template <typename Call>
void FillGemmOperands(Call& c, cudaStream_t stream, const ffi::AnyBuffer& x,
                      const ffi::AnyBuffer& w, const ffi::Buffer<ffi::S32>& expert_sizes,
                      const int32_t* rows, int64_t topk, const GemmDims& d,
                      const ffi::AnyBuffer& out) {
  c.stream = stream;
  c.bf16 = x.element_type() == ffi::DataType::BF16;
  c.x = x.untyped_data();
  c.w = w.untyped_data();
  c.sizes = expert_sizes.typed_data();
  c.rows = rows;
  c.topk = topk;
  c.out = out.untyped_data();
  c.m = d.m;
  c.n = d.n;
  c.k = d.k;
  c.groups = d.groups;
  c.x_rows = d.x_rows;
}

}  // namespace jax_moe
