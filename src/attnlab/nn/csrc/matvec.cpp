// attnlab's decode matvecs: y (M, N) = x (M, K) · Wᵀ for a few rows of fp32 activations and a
// weight matrix in fp32, per-row int8, or GGUF-style blocks of 32 (4-bit d·q + m, Q8_0 d·q).
// Built on first use by torch.utils.cpp_extension for the CPU it runs on (src/attnlab/nn/matvec.py
// picks -march); the loops are written so the compiler vectorises them: each weight row is read
// once, its products accumulate in LANES independent fp32 lanes (several FMA chains in flight),
// and rows are split over torch's intra-op threads (at::parallel_for). The row-level pieces are
// in rows.h; step.cpp runs a whole decode step with them.
#include "rows.h"

namespace attnlab {
void register_step(pybind11::module& mod);   // step.cpp
void register_paged(pybind11::module& mod);  // paged.cpp
}

using namespace attnlab;

namespace {

void check(const torch::Tensor& x, int64_t k, const char* what) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == k && x.scalar_type() == torch::kFloat &&
                  x.is_contiguous() && x.device().is_cpu(),
              what, ": x must be a contiguous fp32 CPU (M, K) tensor with K = ", k);
}

// 4-bit blocks: p (N, G, 16) uint8, d and m (N, G) fp32; Q8_0: q (N, G, 32) int8, d (N, G) fp32,
// or (N, 2G): a scale per 16 (Q6_K's sub-blocks)
void check_q4(const torch::Tensor& p, const torch::Tensor& d, const torch::Tensor& mn, const char* what) {
  TORCH_CHECK(p.dim() == 3 && p.size(2) == 16 && p.scalar_type() == torch::kByte && p.is_contiguous() && p.device().is_cpu(),
              what, ": p");
  const int64_t ng = p.size(0) * p.size(1);
  TORCH_CHECK(d.numel() == ng && mn.numel() == ng && d.is_contiguous() && d.device().is_cpu() && mn.is_contiguous() && mn.device().is_cpu() &&
                  d.scalar_type() == torch::kFloat && mn.scalar_type() == torch::kFloat,
              what, ": d, m");
}

// returns H, the scales per block of 32 (rows.h q8_row)
int check_q8(const torch::Tensor& q, const torch::Tensor& d, const char* what) {
  TORCH_CHECK(q.dim() == 3 && q.size(2) == 32 && q.scalar_type() == torch::kChar && q.is_contiguous() && q.device().is_cpu(),
              what, ": q");
  const int64_t ng = q.size(0) * q.size(1);
  TORCH_CHECK((d.numel() == ng || d.numel() == 2 * ng) && d.is_contiguous() && d.device().is_cpu() && d.scalar_type() == torch::kFloat,
              what, ": d must be (N, G) or (N, 2G) fp32");
  return d.numel() == ng ? 1 : 2;
}

}  // namespace

torch::Tensor mv_f32(torch::Tensor x, torch::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kFloat && w.is_contiguous() && w.device().is_cpu(), "mv_f32: w");
  const int64_t n = w.size(0), k = w.size(1);
  check(x, k, "mv_f32");
  const int64_t m = x.size(0);
  auto y = torch::empty({m, n}, x.options());
  const float *xp = x.data_ptr<float>(), *wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  over_rows(n, k * 4, [&](int64_t r) {
    for (int64_t i = 0; i < m; ++i) yp[i * n + r] = row_dot(wp + r * k, xp + i * k, k);
  });
  return y;
}

torch::Tensor mv_int8(torch::Tensor x, torch::Tensor q, torch::Tensor s) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == torch::kChar && q.is_contiguous() && q.device().is_cpu(), "mv_int8: q");
  const int64_t n = q.size(0), k = q.size(1);
  check(x, k, "mv_int8");
  const int64_t m = x.size(0);
  TORCH_CHECK(s.numel() == n && s.scalar_type() == torch::kFloat && s.is_contiguous() && s.device().is_cpu(), "mv_int8: s");
  auto y = torch::empty({m, n}, x.options());
  const float *xp = x.data_ptr<float>(), *sp = s.data_ptr<float>();
  const int8_t* qp = q.data_ptr<int8_t>();
  float* yp = y.data_ptr<float>();
  over_rows(n, k, [&](int64_t r) {
    for (int64_t i = 0; i < m; ++i) yp[i * n + r] = row_i8(qp + r * k, xp + i * k, k) * sp[r];
  });
  return y;
}

// 4-bit blocks: p (N, G, 16) uint8 (element j low nibble, j + 16 high), d, m (N, G) fp32
torch::Tensor mv_q4(torch::Tensor x, torch::Tensor p, torch::Tensor d, torch::Tensor mn) {
  check_q4(p, d, mn, "mv_q4");
  const int64_t n = p.size(0), g = p.size(1), k = g * 32;
  check(x, k, "mv_q4");
  const int64_t m = x.size(0);
  auto y = torch::empty({m, n}, x.options());
  auto xs = x.view({m, g, 32}).sum(-1).contiguous();  // (M, G): Σ_j x per block, for the m term
  const float *xp = x.data_ptr<float>(), *dp = d.data_ptr<float>(), *mp = mn.data_ptr<float>();
  const float* sp = xs.data_ptr<float>();
  const uint8_t* pp = p.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  over_rows(n, k / 2 + g * 8, [&](int64_t r) {
    const uint8_t* pr = pp + r * g * 16;
    const float *dr = dp + r * g, *mr = mp + r * g;
    if (m > 1) {  // several rows: the weight row dequantized once, then an fp32 dot per row
      thread_local std::vector<float> buf;
      buf.resize(k);
      q4_values(pr, dr, mr, g, buf.data());
      for (int64_t i = 0; i < m; ++i) yp[i * n + r] = row_dot(buf.data(), xp + i * k, k);
      return;
    }
    for (int64_t i = 0; i < m; ++i) yp[i * n + r] = row_q4(pr, dr, mr, xp + i * k, sp + i * g, g);
  });
  return y;
}

// Q8_0 blocks: q (N, G, 32) int8, d (N, G·H) fp32
template <int H>
torch::Tensor mv_q8_h(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& d) {
  const int64_t n = q.size(0), g = q.size(1), k = g * 32;
  const int64_t m = x.size(0);
  auto y = torch::empty({m, n}, x.options());
  const float *xp = x.data_ptr<float>(), *dp = d.data_ptr<float>();
  const int8_t* qp = q.data_ptr<int8_t>();
  float* yp = y.data_ptr<float>();
  over_rows(n, k + g * 4, [&](int64_t r) {
    const int8_t* qr = qp + r * k;
    const float* dr = dp + r * g * H;
    if (m > 1) {
      thread_local std::vector<float> buf;
      buf.resize(k);
      q8_values<H>(qr, dr, g, buf.data());
      for (int64_t i = 0; i < m; ++i) yp[i * n + r] = row_dot(buf.data(), xp + i * k, k);
      return;
    }
    for (int64_t i = 0; i < m; ++i) yp[i * n + r] = row_q8<H>(qr, dr, xp + i * k, g);
  });
  return y;
}

torch::Tensor mv_q8(torch::Tensor x, torch::Tensor q, torch::Tensor d) {
  const int h = check_q8(q, d, "mv_q8");
  check(x, q.size(1) * 32, "mv_q8");
  return h == 1 ? mv_q8_h<1>(x, q, d) : mv_q8_h<2>(x, q, d);
}

// the whole matrix dequantized in one pass (a prefill's weights, for torch's GEMM):
// 4-bit blocks -> (N, G*32) fp32, w = d·q + m
torch::Tensor dequant_q4(torch::Tensor p, torch::Tensor d, torch::Tensor mn) {
  check_q4(p, d, mn, "dequant_q4");
  const int64_t n = p.size(0), g = p.size(1);
  auto w = torch::empty({n, g * 32}, d.options());
  const uint8_t* pp = p.data_ptr<uint8_t>();
  const float *dp = d.data_ptr<float>(), *mp = mn.data_ptr<float>();
  float* wp = w.data_ptr<float>();
  over_rows(n, g * 16, [&](int64_t r) { q4_values(pp + r * g * 16, dp + r * g, mp + r * g, g, wp + r * g * 32); });
  return w;
}

// Q8_0 blocks -> (N, G*32) fp32, w = d·q
torch::Tensor dequant_q8(torch::Tensor q, torch::Tensor d) {
  const int h = check_q8(q, d, "dequant_q8");
  const int64_t n = q.size(0), g = q.size(1);
  auto w = torch::empty({n, g * 32}, d.options());
  const int8_t* qp = q.data_ptr<int8_t>();
  const float* dp = d.data_ptr<float>();
  float* wp = w.data_ptr<float>();
  over_rows(n, g * 32, [&](int64_t r) {
    if (h == 1)
      q8_values<1>(qp + r * g * 32, dp + r * g, g, wp + r * g * 32);
    else
      q8_values<2>(qp + r * g * 32, dp + r * g * 2, g, wp + r * g * 32);
  });
  return w;
}


// Many rows (a batched decode step, a prefill): W dequantized a tile of rows at a time into a
// buffer that stays in cache, each tile times x by torch's GEMM on one thread into its columns of
// y, the tiles split over the threads. Never the whole fp32 matrix in memory, one pass over the
// packed bytes: faster than torch's GEMM on the fp32 matrix itself (1.2-2x at 16-256 rows).
template <class Deq>
torch::Tensor mm_tiles(const torch::Tensor& x, int64_t n, int64_t k, const Deq& deq) {
  const int64_t m = x.size(0);
  auto y = torch::empty({m, n}, x.options());
  // 256 KB of fp32 weights a tile (an L2's share; on an AMD EPYC, 2 threads, the maps of
  // SmolLM2-135M at 16-256 rows: 64 KB tiles 1.5x slower, 512 KB-1 MB no faster)
  const int64_t tile = std::max<int64_t>(16, (256 * 1024) / (k * 4));
  const int64_t tiles = (n + tile - 1) / tile;
  at::parallel_for(0, tiles, 1, [&](int64_t b, int64_t e) {
    // the pool's threads do not inherit the caller's inference mode: writing into y (an inference
    // tensor when the caller is in one) needs it here too; no gradient flows through these products
    c10::InferenceMode guard;
    auto buf = torch::empty({tile, k}, x.options());
    float* bp = buf.data_ptr<float>();
    for (int64_t t = b; t < e; ++t) {
      const int64_t r0 = t * tile, rows = std::min(tile, n - r0);
      for (int64_t r = 0; r < rows; ++r) deq(r0 + r, bp + r * k);
      auto out = y.narrow(1, r0, rows);  // columns r0.. of y: row-major with its leading dimension
      at::mm_out(out, x, buf.narrow(0, 0, rows).t());
    }
  });
  return y;
}

torch::Tensor mm_q4(torch::Tensor x, torch::Tensor p, torch::Tensor d, torch::Tensor mn) {
  check_q4(p, d, mn, "mm_q4");
  const int64_t n = p.size(0), g = p.size(1), k = g * 32;
  check(x, k, "mm_q4");
  const uint8_t* pp = p.data_ptr<uint8_t>();
  const float *dp = d.data_ptr<float>(), *mp = mn.data_ptr<float>();
  return mm_tiles(x, n, k, [&](int64_t r, float* w) { q4_values(pp + r * g * 16, dp + r * g, mp + r * g, g, w); });
}

torch::Tensor mm_q8(torch::Tensor x, torch::Tensor q, torch::Tensor d) {
  const int h = check_q8(q, d, "mm_q8");
  const int64_t n = q.size(0), g = q.size(1), k = g * 32;
  check(x, k, "mm_q8");
  const int8_t* qp = q.data_ptr<int8_t>();
  const float* dp = d.data_ptr<float>();
  if (h == 1) return mm_tiles(x, n, k, [&](int64_t r, float* w) { q8_values<1>(qp + r * k, dp + r * g, g, w); });
  return mm_tiles(x, n, k, [&](int64_t r, float* w) { q8_values<2>(qp + r * k, dp + r * g * 2, g, w); });
}

// x (M, K) -> (xq (M, K) int8, dx (M, K/32), xs (M, K/32)): the activation blocks the _x8 kernels use
std::vector<torch::Tensor> quantize_x8(torch::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) % 32 == 0 && x.scalar_type() == torch::kFloat && x.is_contiguous() && x.device().is_cpu(),
              "quantize_x8: x must be a contiguous fp32 CPU (M, K) tensor, K a multiple of 32");
  const int64_t m = x.size(0), k = x.size(1), g = k / 32;
  auto xq = torch::empty({m, k}, x.options().dtype(torch::kChar));
  auto dx = torch::empty({m, g}, x.options()), xs = torch::empty({m, g}, x.options());
  for (int64_t i = 0; i < m; ++i)
    quantize_blocks(x.data_ptr<float>() + i * k, g, xq.data_ptr<int8_t>() + i * k, dx.data_ptr<float>() + i * g, xs.data_ptr<float>() + i * g);
  return {xq, dx, xs};
}

// the 4-bit and Q8_0 matvecs with int8 activations (rows.h): x (M, K) quantized per block of 32
torch::Tensor mv_q4_x8(torch::Tensor x, torch::Tensor p, torch::Tensor d, torch::Tensor mn) {
  check_q4(p, d, mn, "mv_q4_x8");
  const int64_t n = p.size(0), g = p.size(1), k = g * 32;
  check(x, k, "mv_q4_x8");
  const int64_t m = x.size(0);
  auto y = torch::empty({m, n}, x.options());
  const auto blocks = quantize_x8(x);
  const int8_t* xq = blocks[0].data_ptr<int8_t>();
  const float *dx = blocks[1].data_ptr<float>(), *xs = blocks[2].data_ptr<float>();
  const float *dp = d.data_ptr<float>(), *mp = mn.data_ptr<float>();
  const uint8_t* pp = p.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  over_rows(n, k / 2 + g * 8, [&](int64_t r) {
    for (int64_t i = 0; i < m; ++i)
      yp[i * n + r] = row_q4_x8(pp + r * g * 16, dp + r * g, mp + r * g, xq + i * k, dx + i * g, xs + i * g, g);
  });
  return y;
}

torch::Tensor mv_q8_x8(torch::Tensor x, torch::Tensor q, torch::Tensor d) {
  const int h = check_q8(q, d, "mv_q8_x8");
  const int64_t n = q.size(0), g = q.size(1), k = g * 32;
  check(x, k, "mv_q8_x8");
  const int64_t m = x.size(0);
  auto y = torch::empty({m, n}, x.options());
  const auto blocks = quantize_x8(x);
  const int8_t* xq = blocks[0].data_ptr<int8_t>();
  const float* dx = blocks[1].data_ptr<float>();
  const float* dp = d.data_ptr<float>();
  const int8_t* qp = q.data_ptr<int8_t>();
  float* yp = y.data_ptr<float>();
  over_rows(n, k + g * 4, [&](int64_t r) {
    for (int64_t i = 0; i < m; ++i)
      yp[i * n + r] = h == 1 ? row_q8_x8<1>(qp + r * k, dp + r * g, xq + i * k, dx + i * g, g)
                             : row_q8_x8<2>(qp + r * k, dp + r * g * 2, xq + i * k, dx + i * g, g);
  });
  return y;
}

// The kernels keep the GIL while they run. Released, the server's event loop (the engine steps in
// a thread: src/attnlab/serve/worker.py) runs beside the two OpenMP threads on a 2-core machine
// and their barriers wait on it. Measured with benchmarks/serve_http.py --hostile (2 runs each):
// all kernels released, 41 against 45 tokens/s held; the tiled GEMMs and dequantizations alone
// released (a prefill chunk's calls, ~25 ms each), 33.6 / 33.0 against 42.8 / 39.3 tokens/s on
// the mixed workload, and /health's worst answer no better (94.7 / 119.2 against 121.8 / 97.1 ms).
PYBIND11_MODULE(TORCH_EXTENSION_NAME, mod) {
  mod.def("dequant_q4", &dequant_q4);
  mod.def("dequant_q8", &dequant_q8);
  mod.def("mv_f32", &mv_f32);
  mod.def("mv_int8", &mv_int8);
  mod.def("mv_q4", &mv_q4);
  mod.def("mv_q8", &mv_q8);
  mod.def("mv_q4_x8", &mv_q4_x8);
  mod.def("mm_q4", &mm_q4);
  mod.def("mm_q8", &mm_q8);
  mod.def("mv_q8_x8", &mv_q8_x8);
  mod.def("quantize_x8", &quantize_x8);
  attnlab::register_step(mod);
  attnlab::register_paged(mod);
}
