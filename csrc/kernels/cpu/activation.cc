// Step 5 on the CPU: gated act(h[..., :I]) * h[..., I:] or plain act(h), in
// f32, and its backward.
#include "kernels/cpu/activation.h"

#include "kernels/cpu/act_math.h"

namespace jax_moe {

void ActivationRows(DType dtype, const void* in, int64_t rows, int64_t width, int64_t inter,
                    int64_t activation, bool gated, void* out) {
  WithDType(dtype, [&]<DType DT>() {
    using S = HostScalar<DT>;
    ActRows<S>(static_cast<const typename S::Storage*>(in), rows, width, inter, activation, gated,
               static_cast<typename S::Storage*>(out));
  });
}

void ActivationGradRows(DType dtype, const void* in, const void* d, int64_t rows, int64_t width,
                        int64_t inter, int64_t activation, bool gated, void* out) {
  WithDType(dtype, [&]<DType DT>() {
    using S = HostScalar<DT>;
    using T = typename S::Storage;
    ActGradRows<S>(static_cast<const T*>(in), static_cast<const T*>(d), rows, width, inter,
                   activation, gated, static_cast<T*>(out));
  });
}

void ActivationScaledGradRows(DType dtype, const void* in, const void* d, const float* scale,
                              int64_t rows, int64_t width, int64_t inter, int64_t activation,
                              bool gated, void* dh, void* as, float* dot) {
  WithDType(dtype, [&]<DType DT>() {
    using S = HostScalar<DT>;
    using T = typename S::Storage;
    ActScaledGradRows<S>(static_cast<const T*>(in), static_cast<const T*>(d), scale, rows, width,
                         inter, activation, gated, static_cast<T*>(dh), static_cast<T*>(as), dot);
  });
}

}  // namespace jax_moe
