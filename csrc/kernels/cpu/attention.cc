// Paged KV cache on the CPU: write_kv (scatter new K/V rows into their slots,
// in place) and single-token decode attention over the pages of each sequence.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "ffi/attention_checks.h"
#include "ffi/ffi_common.h"
#include "ffi/targets.h"

namespace jax_moe {
namespace {

// The outputs alias the caches (input_output_aliases in Python), so only the
// rows named by slot_mapping are written; slots outside [0, P*page_size) are
// skipped (negative = padding). Duplicate slots: the last token wins here
// (Python rejects them eagerly).
ffi::Error WriteKvCpu(ffi::AnyBuffer k_pages, ffi::AnyBuffer v_pages, ffi::AnyBuffer k,
                      ffi::AnyBuffer v, ffi::Buffer<ffi::S32> slots,
                      ffi::Result<ffi::AnyBuffer> k_out, ffi::Result<ffi::AnyBuffer> v_out) {
  WriteKvDims d;
  if (auto err = CheckWriteKv(k_pages, v_pages, k, v, slots, *k_out, *v_out, &d); err.failure())
    return err;
  const size_t row_bytes = d.row_elems * ffi::ByteWidth(k.element_type());
  char* ko = static_cast<char*>(k_out->untyped_data());
  char* vo = static_cast<char*>(v_out->untyped_data());
  // Without donation XLA copies the cache into the output first; if it ever
  // hands us distinct buffers, copy here so the result is still complete.
  if (ko != k_pages.untyped_data()) std::memcpy(ko, k_pages.untyped_data(), k_pages.size_bytes());
  if (vo != v_pages.untyped_data()) std::memcpy(vo, v_pages.untyped_data(), v_pages.size_bytes());
  const char* ks = static_cast<const char*>(k.untyped_data());
  const char* vs = static_cast<const char*>(v.untyped_data());
  const int32_t* sl = slots.typed_data();
  for (int64_t i = 0; i < d.n; ++i) {
    const int64_t s = sl[i];
    if (s < 0 || s >= d.num_slots) continue;
    std::memcpy(ko + s * row_bytes, ks + i * row_bytes, row_bytes);
    std::memcpy(vo + s * row_bytes, vs + i * row_bytes, row_bytes);
  }
  return ffi::Error::Success();
}

// out[b, h] = softmax(scale * q[b, h] . K[b, :L]) V[b, :L] over the tokens of
// sequence b, L = clamp(lengths[b], 0, max_pages * page_size); tokens on a page
// id outside [0, P) are skipped (masked out). No valid token: the output is 0.
// Scores, softmax and accumulation in f32, in token order.
template <DType DT>
void DecodeRows(const void* q_raw, const void* k_raw, const void* v_raw, const int32_t* table,
                const int32_t* lengths, const DecodeDims& d, float scale, void* out_raw) {
  using S = HostScalar<DT>;
  using T = typename S::Storage;
  const T* q = static_cast<const T*>(q_raw);
  const T* kc = static_cast<const T*>(k_raw);
  const T* vc = static_cast<const T*>(v_raw);
  T* out = static_cast<T*>(out_raw);
  const int64_t D = d.head_dim, ps = d.page_size;
  const int64_t row = d.hkv * D;  // elements per cache slot
  std::vector<float> scores(d.max_tokens), qf(D), acc(D);
  std::vector<int64_t> slot(d.max_tokens);
  for (int64_t b = 0; b < d.batch; ++b) {
    const int64_t len = std::clamp<int64_t>(lengths[b], 0, d.max_tokens);
    int64_t n = 0;  // valid tokens, their slots in token order
    for (int64_t t = 0; t < len; ++t) {
      const int64_t page = table[b * d.max_pages + t / ps];
      if (page < 0 || page >= d.num_pages) continue;
      slot[n++] = page * ps + t % ps;
    }
    for (int64_t h = 0; h < d.hq; ++h) {
      const int64_t kvh = h / d.group;
      const T* qrow = q + (b * d.hq + h) * D;
      for (int64_t e = 0; e < D; ++e) qf[e] = S::Load(qrow[e]) * scale;
      float m = -std::numeric_limits<float>::infinity();
      for (int64_t i = 0; i < n; ++i) {
        const T* krow = kc + slot[i] * row + kvh * D;
        float s = 0.f;
        for (int64_t e = 0; e < D; ++e) s += qf[e] * S::Load(krow[e]);
        scores[i] = s;
        m = std::max(m, s);
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      float l = 0.f;
      for (int64_t i = 0; i < n; ++i) {
        const float p = std::exp(scores[i] - m);
        l += p;
        const T* vrow = vc + slot[i] * row + kvh * D;
        for (int64_t e = 0; e < D; ++e) acc[e] += p * S::Load(vrow[e]);
      }
      const float inv = l > 0.f ? 1.f / l : 0.f;
      T* orow = out + (b * d.hq + h) * D;
      for (int64_t e = 0; e < D; ++e) orow[e] = S::Store(acc[e] * inv);
    }
  }
}

ffi::Error PagedDecodeCpu(ffi::AnyBuffer q, ffi::AnyBuffer k_pages, ffi::AnyBuffer v_pages,
                          ffi::Buffer<ffi::S32> page_table, ffi::Buffer<ffi::S32> lengths,
                          float scale, int64_t split_tokens, ffi::Result<ffi::AnyBuffer> out,
                          ffi::Result<ffi::Buffer<ffi::F32>> part_out,
                          ffi::Result<ffi::Buffer<ffi::F32>> part_stats) {
  DecodeDims d;
  if (auto err = CheckDecode(q, k_pages, v_pages, page_table, lengths, *out, *part_out,
                             *part_stats, split_tokens, &d);
      err.failure())
    return err;
  // The scratch outputs are the CUDA kernel's; the CPU path does not need them.
  return DispatchFloat(q.element_type(), "q", [&]<DType DT>() {
    DecodeRows<DT>(q.untyped_data(), k_pages.untyped_data(), v_pages.untyped_data(),
                   page_table.typed_data(), lengths.typed_data(), d, scale,
                   out->untyped_data());
    return ffi::Error::Success();
  });
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(kWriteKvCpu, WriteKvCpu, WriteKvSignature(ffi::Ffi::Bind()));

// fill_rows: rows >= ctrl[0] of x (N, ...) become 0, or with ctrl[1] != 0
// every element becomes NaN; in place (the output aliases x).
ffi::Error FillRowsCpu(ffi::AnyBuffer x, ffi::Buffer<ffi::S32> ctrl,
                       ffi::Result<ffi::AnyBuffer> out) {
  int64_t rows = 0, row_bytes = 0;
  if (auto err = CheckFillRows(x, ctrl, *out, &rows, &row_bytes); err.failure()) return err;
  char* o = static_cast<char*>(out->untyped_data());
  if (o != x.untyped_data()) std::memcpy(o, x.untyped_data(), x.size_bytes());
  const bool poison = ctrl.typed_data()[1] != 0;
  const int64_t start = poison ? 0 : std::clamp<int64_t>(ctrl.typed_data()[0], 0, rows);
  char* p = o + start * row_bytes;
  const size_t bytes = static_cast<size_t>((rows - start) * row_bytes);
  if (!poison) {
    std::memset(p, 0, bytes);
    return ffi::Error::Success();
  }
  const uint32_t nan = NanBits(x.element_type());
  const size_t width = ffi::ByteWidth(x.element_type());
  for (size_t i = 0; i < bytes; i += width) std::memcpy(p + i, &nan, width);  // little endian
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(kFillRowsCpu, FillRowsCpu, FillRowsSignature(ffi::Ffi::Bind()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(kPagedDecodeCpu, PagedDecodeCpu,
                              PagedDecodeSignature(ffi::Ffi::Bind()));

}  // namespace jax_moe
