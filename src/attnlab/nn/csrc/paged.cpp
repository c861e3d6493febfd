// Decode attention over the continuous-batching engine's paged KV pool, read in place
// (src/attnlab/nn/attention/paged_decode.py says when it applies; the pool is
// src/attnlab/cache/blocks.py's). One new query per row: row b attends to its first n_b slots,
// slots[b, 0 .. n_b-1] of the pool, which hold its positions 0 .. n_b-1 (its own key included:
// the caller wrote it first). Gathering those slots into a padded (B, H_kv, S, D) copy per layer
// for torch's kernel cost more than the attention itself: every step copies every row's whole
// context twice (K and V) in every layer.
//
// softmax(scale · q·Kᵀ) V in fp32, the maximum subtracted first; (row, head) pairs split over
// torch's intra-op threads, each one sum in one order, so the thread count changes no bit.
#include "rows.h"

namespace attnlab {
namespace {

// q (B, H, D); kl, vl (H_kv, P, D): one layer of the pool; slots (B, S) int64; lengths (B,)
// int64, 1 <= n_b <= S. Returns (B, H, D).
torch::Tensor paged_decode(torch::Tensor q, torch::Tensor kl, torch::Tensor vl, torch::Tensor slots,
                           torch::Tensor lengths, double scale) {
  auto fp32 = [](const torch::Tensor& t, int64_t dim) {
    return t.scalar_type() == torch::kFloat && t.is_contiguous() && t.device().is_cpu() && t.dim() == dim;
  };
  TORCH_CHECK(fp32(q, 3) && fp32(kl, 3) && fp32(vl, 3), "paged_decode: q (B, H, D), k, v (H_kv, P, D) must be contiguous fp32 CPU tensors");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), Hkv = kl.size(0), P = kl.size(1);
  TORCH_CHECK(kl.sizes() == vl.sizes() && kl.size(2) == D && Hkv > 0 && H % Hkv == 0, "paged_decode: k, v must be (H_kv, P, D) with H a multiple of H_kv");
  TORCH_CHECK(slots.scalar_type() == torch::kLong && slots.is_contiguous() && slots.dim() == 2 && slots.size(0) == B,
              "paged_decode: slots must be (B, S) int64");
  TORCH_CHECK(lengths.scalar_type() == torch::kLong && lengths.is_contiguous() && lengths.numel() == B,
              "paged_decode: lengths must be (B,) int64");
  const int64_t S = slots.size(1);
  const int64_t *sp = slots.data_ptr<int64_t>(), *np = lengths.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(np[b] >= 1 && np[b] <= S, "paged_decode: row ", b, " has ", np[b], " keys, outside 1..", S);
    for (int64_t j = 0; j < np[b]; ++j)
      TORCH_CHECK(sp[b * S + j] >= 0 && sp[b * S + j] < P, "paged_decode: slot ", sp[b * S + j], " outside the pool's ", P);
  }
  auto out = torch::empty({B, H, D}, q.options());
  const float *qp = q.data_ptr<float>(), *kp = kl.data_ptr<float>(), *vp = vl.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  const int64_t group = H / Hkv;
  at::parallel_for(0, B * H, 1, [&](int64_t first, int64_t last) {
    std::vector<float> w;
    for (int64_t i = first; i < last; ++i) {
      const int64_t b = i / H, h = i % H, g = h / group, n = np[b];
      const int64_t* row = sp + b * S;
      const float* qh = qp + i * D;
      const float *kh = kp + g * P * D, *vh = vp + g * P * D;
      w.resize(n);
      float mx = -INFINITY;
      for (int64_t j = 0; j < n; ++j) {
        w[j] = row_dot(kh + row[j] * D, qh, D) * sc;
        mx = std::max(mx, w[j]);
      }
      float sum = 0.f;
      for (int64_t j = 0; j < n; ++j) sum += (w[j] = std::exp(w[j] - mx));
      const float inv = 1.f / sum;
      float* oh = op + i * D;
      std::fill(oh, oh + D, 0.f);
      for (int64_t j = 0; j < n; ++j) {
        const float p = w[j] * inv;
        const float* vj = vh + row[j] * D;
#pragma omp simd
        for (int64_t e = 0; e < D; ++e) oh[e] += p * vj[e];
      }
    }
  });
  return out;
}

}  // namespace

void register_paged(pybind11::module& mod) {
  mod.def("paged_decode", &paged_decode);
}

}  // namespace attnlab
