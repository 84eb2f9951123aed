// Paged KV cache on the CPU: write_kv (scatter new K/V rows into their slots),
// single-token decode attention over the pages of each sequence, and
// fill_rows.
#include "kernels/cpu/attention.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace jax_moe {
namespace {

// PagedDecode for one dtype.
template <DType DT>
void DecodeRows(const void* q_raw, const void* k_raw, const void* v_raw, const int32_t* table,
                const int32_t* lengths, const DecodeDims& d, float scale, void* out_raw) {
  using S = HostScalar<DT>;
  using T = typename S::Storage;
  const T* q = static_cast<const T*>(q_raw);
  const T* kc = static_cast<const T*>(k_raw);
  const T* vc = static_cast<const T*>(v_raw);
  T* out = static_cast<T*>(out_raw);
  const int64_t D = d.k_dim, Dv = d.v_dim, ps = d.page_size;
  const int64_t krow = d.hkv * D, vrow = d.hkv * Dv;  // elements per cache slot
  std::vector<float> scores(d.max_tokens), qf(D), acc(Dv);
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
        const T* kr = kc + slot[i] * krow + kvh * D;
        float s = 0.f;
        for (int64_t e = 0; e < D; ++e) s += qf[e] * S::Load(kr[e]);
        scores[i] = s;
        m = std::max(m, s);
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      float l = 0.f;
      for (int64_t i = 0; i < n; ++i) {
        const float p = std::exp(scores[i] - m);
        l += p;
        const T* vr = vc + slot[i] * vrow + kvh * Dv;
        for (int64_t e = 0; e < Dv; ++e) acc[e] += p * S::Load(vr[e]);
      }
      const float inv = l > 0.f ? 1.f / l : 0.f;
      T* orow = out + (b * d.hq + h) * Dv;
      for (int64_t e = 0; e < Dv; ++e) orow[e] = S::Store(acc[e] * inv);
    }
  }
}

}  // namespace

void WriteKvSlots(const void* k, const void* v, const int32_t* slots, int64_t n,
                  int64_t k_row_bytes, int64_t v_row_bytes, int64_t num_slots, void* k_out,
                  void* v_out) {
  char* ko = static_cast<char*>(k_out);
  char* vo = static_cast<char*>(v_out);
  const char* ks = static_cast<const char*>(k);
  const char* vs = static_cast<const char*>(v);
  const size_t kb = static_cast<size_t>(k_row_bytes), vb = static_cast<size_t>(v_row_bytes);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t s = slots[i];
    if (s < 0 || s >= num_slots) continue;
    std::memcpy(ko + s * kb, ks + i * kb, kb);
    std::memcpy(vo + s * vb, vs + i * vb, vb);
  }
}

void PagedDecode(DType dtype, const void* q, const void* k_pages, const void* v_pages,
                 const int32_t* page_table, const int32_t* lengths, const DecodeDims& d,
                 float scale, void* out) {
  switch (dtype) {
    case DType::F32:
      return DecodeRows<DType::F32>(q, k_pages, v_pages, page_table, lengths, d, scale, out);
    case DType::BF16:
      return DecodeRows<DType::BF16>(q, k_pages, v_pages, page_table, lengths, d, scale, out);
    case DType::F16:
      return DecodeRows<DType::F16>(q, k_pages, v_pages, page_table, lengths, d, scale, out);
  }
}

void FillRows(DType dtype, void* x, const int32_t* ctrl, int64_t rows, int64_t row_bytes) {
  const bool poison = ctrl[1] != 0;
  const int64_t start = poison ? 0 : std::clamp<int64_t>(ctrl[0], 0, rows);
  char* p = static_cast<char*>(x) + start * row_bytes;
  const size_t bytes = static_cast<size_t>((rows - start) * row_bytes);
  if (!poison) {
    std::memset(p, 0, bytes);
    return;
  }
  const uint32_t nan = NanBits(dtype);
  const size_t width = dtype == DType::F32 ? 4 : 2;
  for (size_t i = 0; i < bytes; i += width) std::memcpy(p + i, &nan, width);  // little endian
}

}  // namespace jax_moe
