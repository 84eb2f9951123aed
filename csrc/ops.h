// Handler symbols defined in csrc/cpu/*.cc and csrc/cuda/*.cu, registered by module.cc.
#pragma once

#include "xla/ffi/api/ffi.h"

namespace jax_moe {

#define JAX_MOE_DECLARE(name) XLA_FFI_DECLARE_HANDLER_SYMBOL(name)

JAX_MOE_DECLARE(kTopkSoftmaxCpu);
JAX_MOE_DECLARE(kTokenIndexCpu);
JAX_MOE_DECLARE(kExpandCpu);
JAX_MOE_DECLARE(kCombineCpu);
JAX_MOE_DECLARE(kGroupGemmCpu);
JAX_MOE_DECLARE(kGatedActCpu);
JAX_MOE_DECLARE(kWriteKvCpu);
JAX_MOE_DECLARE(kPagedDecodeCpu);

#ifdef JAX_MOE_WITH_CUDA
JAX_MOE_DECLARE(kTopkSoftmaxCuda);
JAX_MOE_DECLARE(kTokenIndexCuda);
JAX_MOE_DECLARE(kExpandCuda);
JAX_MOE_DECLARE(kCombineCuda);
JAX_MOE_DECLARE(kGroupGemmCuda);
JAX_MOE_DECLARE(kGatedActCuda);
JAX_MOE_DECLARE(kWriteKvCuda);
JAX_MOE_DECLARE(kPagedDecodeCuda);
#endif

#undef JAX_MOE_DECLARE

}  // namespace jax_moe
