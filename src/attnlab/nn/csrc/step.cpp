// One decode step of a pre-norm decoder (Llama's family) in one call: every layer's RMSNorm,
// q/k/v, qk-norm (Qwen3), RoPE, the KV-cache write, attention over the cached keys, o_proj, the gated FFN and the
// residual adds, then the final norm and the output head, for one token of one sequence. The
// weights stay where the model keeps them (fp32, per-row int8, 4-bit or Q8_0 blocks: rows.h);
// src/attnlab/decode/native_step.py checks that a model is of this shape, hands its tensors over once per
// generation and computes the embedding and cos/sin in Python (any RoPE scaling).
//
// Why: at batch 1 a small model's step is ~1,000 eager torch ops around ~120 matvecs; each op costs
// microseconds of dispatch, which summed to more than the matvecs themselves (SmolLM2-135M packed:
// 7.5 of 14.1 ms, benchmarks/cpu_decode.py). Here the same arithmetic runs in fp32 in one native call
// (the eager model's values up to fp32 rounding and summation order;
// tests/decode/test_native_step.py).
#include "rows.h"

#include <pybind11/stl.h>

#ifdef _OPENMP
#include <omp.h>
#endif

namespace attnlab {
namespace {

namespace py = pybind11;

// Q4_X8, Q8_X8: the same blocks with int8 activation blocks (rows.h: llama.cpp's scheme)
enum Kind : int64_t { F32 = 0, I8 = 1, Q4 = 2, Q8 = 3, Q4_X8 = 4, Q8_X8 = 5 };

struct Input;

// one weight matrix W (n, in) in one of the kinds, and its bias: y = W x + b
struct Mat {
  int64_t kind = -1, n = 0, in = 0, k = 0, g = 0;  // k: the width the kernel reads (32·g for blocks)
  int64_t h = 1;                                   // Q8 scales per block of 32 (2: Q6_K's per 16)
  torch::Tensor a, b, c, bias;                     // the kind's tensors, kept alive
  const void* pa = nullptr;
  const float *pb = nullptr, *pc = nullptr, *pbias = nullptr;

  Mat() = default;
  Mat(int64_t kind_, int64_t in_, torch::Tensor a_, torch::Tensor b_, torch::Tensor c_,
      c10::optional<torch::Tensor> bias_)
      : kind(kind_), in(in_), a(a_), b(b_), c(c_) {
    auto cpu = [](const torch::Tensor& t, c10::ScalarType s) {
      return t.defined() && t.device().is_cpu() && t.is_contiguous() && t.scalar_type() == s;
    };
    if (kind == F32) {
      TORCH_CHECK(cpu(a, torch::kFloat) && a.dim() == 2 && a.size(1) == in, "Step: an fp32 weight must be (N, K) contiguous");
      n = a.size(0);
      k = in;
    } else if (kind == I8) {
      TORCH_CHECK(cpu(a, torch::kChar) && a.dim() == 2 && a.size(1) == in, "Step: an int8 weight must be (N, K)");
      n = a.size(0);
      k = in;
      TORCH_CHECK(cpu(b, torch::kFloat) && b.numel() == n, "Step: int8 scales must be (N,) fp32");
      pb = b.data_ptr<float>();
    } else if (kind == Q4 || kind == Q4_X8) {
      TORCH_CHECK(cpu(a, torch::kByte) && a.dim() == 3 && a.size(2) == 16, "Step: 4-bit blocks must be (N, G, 16) uint8");
      n = a.size(0);
      g = a.size(1);
      k = g * 32;
      TORCH_CHECK(k >= in && k - in < 32, "Step: 4-bit blocks of ", k, " inputs for K = ", in);
      TORCH_CHECK(cpu(b, torch::kFloat) && cpu(c, torch::kFloat) && b.numel() == n * g && c.numel() == n * g,
                  "Step: 4-bit d, m must be (N, G) fp32");
      pb = b.data_ptr<float>();
      pc = c.data_ptr<float>();
    } else if (kind == Q8 || kind == Q8_X8) {
      TORCH_CHECK(cpu(a, torch::kChar) && a.dim() == 3 && a.size(2) == 32, "Step: Q8_0 blocks must be (N, G, 32) int8");
      n = a.size(0);
      g = a.size(1);
      k = g * 32;
      TORCH_CHECK(k >= in && k - in < 32, "Step: Q8_0 blocks of ", k, " inputs for K = ", in);
      TORCH_CHECK(cpu(b, torch::kFloat) && (b.numel() == n * g || b.numel() == 2 * n * g),
                  "Step: Q8_0 d must be (N, G) or (N, 2G) fp32");
      h = n * g > 0 && b.numel() == 2 * n * g ? 2 : 1;
      pb = b.data_ptr<float>();
    } else {
      TORCH_CHECK(false, "Step: unknown weight kind ", kind);
    }
    pa = a.data_ptr();
    if (bias_.has_value() && bias_->defined()) {
      bias = *bias_;
      TORCH_CHECK(cpu(bias, torch::kFloat) && bias.numel() == n, "Step: a bias must be (N,) fp32");
      pbias = bias.data_ptr<float>();
    }
  }

  // rows r0..r1-1 of y = W x + b, x prepared for this map's kind (`Input`); serial: the caller
  // splits the rows over its threads
  void rows(const Input& in, float* y, int64_t r0, int64_t r1) const;
};

// one input vector as the kinds read it: zero-padded to the blocks' K, with its fp32 block sums
// (4-bit) or its int8 blocks (the _X8 kinds); each thread prepares its own copy, once per vector
struct Input {
  const float* src = nullptr;
  int64_t k = 0;
  bool x8 = false;
  std::vector<float> x, xs, dx;
  std::vector<int8_t> xq;

  void prepare(const float* from, int64_t in, const Mat& m) {
    const bool want8 = m.kind == Q4_X8 || m.kind == Q8_X8;
    if (from == src && m.k == k && want8 == x8) return;  // the same vector, prepared already
    src = from, k = m.k, x8 = want8;
    x.assign(k, 0.f);
    std::copy(from, from + in, x.begin());
    const int64_t g = k / 32;
    if (k % 32 == 0) {
      xs.resize(g);
      if (want8) {
        xq.resize(k);
        dx.resize(g);
        quantize_blocks(x.data(), g, xq.data(), dx.data(), xs.data());
      } else {
        block_sums(x.data(), g, xs.data());
      }
    }
  }
};

void Mat::rows(const Input& in, float* y, int64_t r0, int64_t r1) const {
  const float* x = in.x.data();
  switch (kind) {
    case F32: {
      const float* w = static_cast<const float*>(pa);
      for (int64_t r = r0; r < r1; ++r) y[r] = row_dot(w + r * k, x, k);
      break;
    }
    case I8: {
      const int8_t* q = static_cast<const int8_t*>(pa);
      for (int64_t r = r0; r < r1; ++r) y[r] = row_i8(q + r * k, x, k) * pb[r];
      break;
    }
    case Q4: {
      const uint8_t* p = static_cast<const uint8_t*>(pa);
      for (int64_t r = r0; r < r1; ++r) y[r] = row_q4(p + r * g * 16, pb + r * g, pc + r * g, x, in.xs.data(), g);
      break;
    }
    case Q8: {
      const int8_t* q = static_cast<const int8_t*>(pa);
      if (h == 1)
        for (int64_t r = r0; r < r1; ++r) y[r] = row_q8<1>(q + r * k, pb + r * g, x, g);
      else
        for (int64_t r = r0; r < r1; ++r) y[r] = row_q8<2>(q + r * k, pb + r * g * 2, x, g);
      break;
    }
    case Q4_X8: {
      const uint8_t* p = static_cast<const uint8_t*>(pa);
      for (int64_t r = r0; r < r1; ++r)
        y[r] = row_q4_x8(p + r * g * 16, pb + r * g, pc + r * g, in.xq.data(), in.dx.data(), in.xs.data(), g);
      break;
    }
    case Q8_X8: {
      const int8_t* q = static_cast<const int8_t*>(pa);
      if (h == 1)
        for (int64_t r = r0; r < r1; ++r) y[r] = row_q8_x8<1>(q + r * k, pb + r * g, in.xq.data(), in.dx.data(), g);
      else
        for (int64_t r = r0; r < r1; ++r) y[r] = row_q8_x8<2>(q + r * k, pb + r * g * 2, in.xq.data(), in.dx.data(), g);
      break;
    }
  }
  if (pbias)
    for (int64_t r = r0; r < r1; ++r) y[r] += pbias[r];
}

Mat mat_of(const py::tuple& t) {
  TORCH_CHECK(t.size() == 6, "Step: a weight is (kind, K, a, b, c, bias)");
  auto opt = [](const py::handle& h) { return h.is_none() ? torch::Tensor() : h.cast<torch::Tensor>(); };
  return Mat(t[0].cast<int64_t>(), t[1].cast<int64_t>(), opt(t[2]), opt(t[3]), opt(t[4]),
             t[5].is_none() ? c10::optional<torch::Tensor>() : c10::optional<torch::Tensor>(t[5].cast<torch::Tensor>()));
}

std::vector<Mat> mats_of(const py::list& l) {
  std::vector<Mat> out;
  for (auto h : l) out.push_back(mat_of(h.cast<py::tuple>()));
  return out;
}

// y = w ⊙ x / sqrt(mean(x²) + eps), fp32 (torch.rms_norm's formula, then the gain)
void rms_norm(const float* x, const float* w, float eps, int64_t d, float* y) {
  float acc[16] = {0.f};
  int64_t i = 0;
  for (; i + 16 <= d; i += 16)
#pragma omp simd
    for (int j = 0; j < 16; ++j) acc[j] += x[i + j] * x[i + j];
  float ss = hsum(acc, 16);
  for (; i < d; ++i) ss += x[i] * x[i];
  const float r = 1.f / std::sqrt(ss / static_cast<float>(d) + eps);
  for (int64_t j = 0; j < d; ++j) y[j] = w[j] * (x[j] * r);
}

enum Act : int64_t { SILU = 0, GELU = 1, GELU_TANH = 2 };

inline float activate(float v, int64_t act) {
  if (act == SILU) return v / (1.f + std::exp(-v));
  if (act == GELU) return 0.5f * v * (1.f + std::erf(v * 0.70710678118654752f));
  const float c = 0.79788456080286536f;  // sqrt(2/π)
  return 0.5f * v * (1.f + std::tanh(c * (v + 0.044715f * v * v * v)));
}

struct Layer {
  torch::Tensor attn_norm, ffn_norm, q_norm, k_norm;  // q_norm, k_norm: qk-norm over each head, or undefined
  float attn_eps = 0.f, ffn_eps = 0.f, q_eps = 0.f, k_eps = 0.f;
  std::vector<Mat> qkv;      // one fused map (q rows, then k, then v) or three
  Mat o;
  std::vector<Mat> gate_up;  // one fused map (gate rows, then up) or two
  Mat down;
};

class Step {
 public:
  Step(int64_t d, int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t rot, bool interleaved,
       double scale, int64_t d_ff, int64_t act, double residual, torch::Tensor final_norm,
       double final_eps, py::tuple head, double logit_multiplier)
      : d_(d), H_(heads), Hkv_(kv_heads), D_(head_dim), R_(rot), interleaved_(interleaved),
        scale_(static_cast<float>(scale)), dff_(d_ff), act_(act),
        residual_(static_cast<float>(residual)), final_norm_(final_norm),
        final_eps_(static_cast<float>(final_eps)), head_(mat_of(head)),
        logit_multiplier_(static_cast<float>(logit_multiplier)) {
    TORCH_CHECK(H_ % Hkv_ == 0 && R_ <= D_ && R_ % 2 == 0, "Step: heads / rotary sizes");
    check_norm(final_norm_);
    TORCH_CHECK(head_.in == d_, "Step: the head's K must be d_model");
  }

  void add_layer(torch::Tensor attn_norm, double attn_eps, py::list qkv, py::tuple o,
                 torch::Tensor ffn_norm, double ffn_eps, py::list gate_up, py::tuple down,
                 c10::optional<torch::Tensor> q_norm, double q_eps, c10::optional<torch::Tensor> k_norm,
                 double k_eps) {
    Layer l;
    for (auto* w : {&q_norm, &k_norm})
      if (w->has_value())
        TORCH_CHECK((*w)->scalar_type() == torch::kFloat && (*w)->is_contiguous() && (*w)->numel() == D_ &&
                        (*w)->device().is_cpu(),
                    "Step: a qk-norm gain must be (head_dim,) fp32");
    if (q_norm.has_value()) l.q_norm = *q_norm;
    if (k_norm.has_value()) l.k_norm = *k_norm;
    l.q_eps = static_cast<float>(q_eps);
    l.k_eps = static_cast<float>(k_eps);
    check_norm(attn_norm);
    check_norm(ffn_norm);
    l.attn_norm = attn_norm;
    l.ffn_norm = ffn_norm;
    l.attn_eps = static_cast<float>(attn_eps);
    l.ffn_eps = static_cast<float>(ffn_eps);
    l.qkv = mats_of(qkv);
    l.o = mat_of(o);
    l.gate_up = mats_of(gate_up);
    l.down = mat_of(down);
    int64_t nqkv = 0, ngu = 0;
    for (auto& m : l.qkv) {
      TORCH_CHECK(m.in == d_, "Step: q/k/v take d_model inputs");
      nqkv += m.n;
    }
    for (auto& m : l.gate_up) {
      TORCH_CHECK(m.in == d_, "Step: gate/up take d_model inputs");
      ngu += m.n;
    }
    TORCH_CHECK(nqkv == (H_ + 2 * Hkv_) * D_, "Step: q/k/v give ", nqkv, " outputs, not (H + 2 H_kv) D");
    TORCH_CHECK(ngu == 2 * dff_ && l.down.in == dff_ && l.down.n == d_, "Step: gate/up/down sizes");
    TORCH_CHECK(l.o.in == H_ * D_ && l.o.n == d_, "Step: o_proj sizes");
    layers_.push_back(std::move(l));
  }

  // x (d,) the token's embedding; cos, sin (R/2,) its position's rotation; kc, vc (L, 1, H_kv,
  // S_max, D) the static cache, whose slots 0..slot-1 hold the earlier tokens; this token's K/V go to
  // `slot`. Returns the logits (1, V). With `table` (int64, at least slot + 1 entries), logical
  // slot j is cache slot table[j] instead: one row of the engine's paged pool (L, H_kv, P, D) seen
  // as (L, 1, H_kv, P, D), the row's blocks anywhere in it (src/attnlab/cache/ragged.py).
  //
  // One parallel region for the whole step (torch's intra-op thread count): the rows of every
  // product and the attention heads are split over the threads, with a barrier after each (five a
  // layer); the small per-vector work between them (norms, RoPE, the gated activation, the
  // residual stream) every thread does for itself on private copies, the same instructions on the
  // same values, so no thread waits for one that does it alone. A fork and join per product (~120
  // a token) cost more than the products of a small model.
  torch::Tensor forward(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, torch::Tensor kc,
                        torch::Tensor vc, int64_t slot, c10::optional<torch::Tensor> table) {
    const int64_t L = static_cast<int64_t>(layers_.size());
    TORCH_CHECK(x.scalar_type() == torch::kFloat && x.is_contiguous() && x.numel() == d_, "Step: x must be (d_model,) fp32");
    TORCH_CHECK(cos.scalar_type() == torch::kFloat && sin.scalar_type() == torch::kFloat && cos.is_contiguous() &&
                    sin.is_contiguous() && cos.numel() == R_ / 2 && sin.numel() == R_ / 2,
                "Step: cos, sin must be (R/2,) fp32");
    for (auto* t : {&kc, &vc})
      TORCH_CHECK(t->scalar_type() == torch::kFloat && t->is_contiguous() && t->dim() == 5 && t->size(0) == L &&
                      t->size(1) == 1 && t->size(2) == Hkv_ && t->size(4) == D_ && t->device().is_cpu(),
                  "Step: the cache must be (L, 1, H_kv, S, D) fp32, contiguous");
    const int64_t S = kc.size(3);
    std::vector<int64_t> where(slot + 1);  // logical slot -> cache slot
    if (table.has_value()) {
      const auto& tb = *table;
      TORCH_CHECK(tb.scalar_type() == torch::kLong && tb.is_contiguous() && tb.dim() == 1 && tb.numel() > slot && slot >= 0,
                  "Step: the slot table must be (n,) int64 with n > slot");
      const int64_t* tp = tb.data_ptr<int64_t>();
      for (int64_t j = 0; j <= slot; ++j) {
        TORCH_CHECK(tp[j] >= 0 && tp[j] < S, "Step: table slot ", tp[j], " outside the cache's ", S);
        where[j] = tp[j];
      }
    } else {
      TORCH_CHECK(slot >= 0 && slot < S, "Step: slot ", slot, " outside the cache's ", S);
      for (int64_t j = 0; j <= slot; ++j) where[j] = j;
    }
    const int64_t qw = H_ * D_, kw = Hkv_ * D_;
    // shared: what the threads' rows fill in, read by all after a barrier
    std::vector<float> qkv(qw + 2 * kw), att(qw), ob(d_), gu(2 * dff_), dn(d_);
    auto logits = torch::empty({1, head_.n}, x.options());
    float* lp = logits.data_ptr<float>();
    const float *x0 = x.data_ptr<float>(), *c = cos.data_ptr<float>(), *s = sin.data_ptr<float>();
    float *kp = kc.data_ptr<float>(), *vp = vc.data_ptr<float>();
    const int64_t layer_stride = Hkv_ * S * D_, head_stride = S * D_;
    const int threads = std::max(1, at::get_num_threads());
#pragma omp parallel num_threads(threads)
    {
#ifdef _OPENMP
      const int64_t t = omp_get_thread_num(), T = omp_get_num_threads();
#else
      const int64_t t = 0, T = 1;
#endif
      auto lo = [&](int64_t n) { return n * t / T; };
      auto hi = [&](int64_t n) { return n * (t + 1) / T; };
      std::vector<float> h(x0, x0 + d_), xn(d_), a(dff_), q(qw), k(kw), sc(slot + 1);
      Input in;
      // this thread's rows of each map in [m, end) of one new vector, one after another in `out`
      auto product = [&](const Mat* m, const Mat* end, const float* from, int64_t width, float* out) {
        in.src = nullptr;  // the buffer at `from` holds new values: prepare it again
        for (; m != end; out += (m++)->n) {
          in.prepare(from, width, *m);
          m->rows(in, out, lo(m->n), hi(m->n));
        }
      };
      for (int64_t li = 0; li < L; ++li) {
        const Layer& l = layers_[li];
        rms_norm(h.data(), l.attn_norm.data_ptr<float>(), l.attn_eps, d_, xn.data());
        product(l.qkv.data(), l.qkv.data() + l.qkv.size(), xn.data(), d_, qkv.data());
#pragma omp barrier
        std::copy(qkv.begin(), qkv.begin() + qw, q.begin());
        std::copy(qkv.begin() + qw, qkv.begin() + qw + kw, k.begin());
        const float* v = qkv.data() + qw + kw;
        for (int64_t hd = 0; hd < H_; ++hd) {  // qk-norm (per head, Qwen3), then the rotation
          if (l.q_norm.defined()) rms_norm(q.data() + hd * D_, l.q_norm.data_ptr<float>(), l.q_eps, D_, q.data() + hd * D_);
          rotate(q.data() + hd * D_, c, s);
        }
        for (int64_t hd = 0; hd < Hkv_; ++hd) {
          if (l.k_norm.defined()) rms_norm(k.data() + hd * D_, l.k_norm.data_ptr<float>(), l.k_eps, D_, k.data() + hd * D_);
          rotate(k.data() + hd * D_, c, s);
        }
        float *kl = kp + li * layer_stride, *vl = vp + li * layer_stride;
        if (t == 0)  // the slot is read by no thread in this step: the new key comes from `k`
          for (int64_t hd = 0; hd < Hkv_; ++hd) {
            std::copy(k.data() + hd * D_, k.data() + (hd + 1) * D_, kl + hd * head_stride + where[slot] * D_);
            std::copy(v + hd * D_, v + (hd + 1) * D_, vl + hd * head_stride + where[slot] * D_);
          }
        for (int64_t hd = lo(H_); hd < hi(H_); ++hd)
          attend(q.data(), k.data(), v, kl, vl, head_stride, where.data(), slot, hd, sc.data(), att.data());
#pragma omp barrier
        product(&l.o, &l.o + 1, att.data(), qw, ob.data());
#pragma omp barrier
        for (int64_t j = 0; j < d_; ++j) h[j] += residual_ * ob[j];
        rms_norm(h.data(), l.ffn_norm.data_ptr<float>(), l.ffn_eps, d_, xn.data());
        product(l.gate_up.data(), l.gate_up.data() + l.gate_up.size(), xn.data(), d_, gu.data());
#pragma omp barrier
        for (int64_t j = 0; j < dff_; ++j) a[j] = activate(gu[j], act_) * gu[dff_ + j];
        product(&l.down, &l.down + 1, a.data(), dff_, dn.data());
#pragma omp barrier
        for (int64_t j = 0; j < d_; ++j) h[j] += residual_ * dn[j];
      }
      rms_norm(h.data(), final_norm_.data_ptr<float>(), final_eps_, d_, xn.data());
      product(&head_, &head_ + 1, xn.data(), d_, lp);
      if (logit_multiplier_ != 1.f)
        for (int64_t j = lo(head_.n); j < hi(head_.n); ++j) lp[j] *= logit_multiplier_;
    }
    return logits;
  }

 private:
  void check_norm(const torch::Tensor& w) const {
    TORCH_CHECK(w.scalar_type() == torch::kFloat && w.is_contiguous() && w.numel() == d_ && w.device().is_cpu(),
                "Step: a norm's gain must be (d_model,) fp32");
  }

  // RoPE on the first R channels of one head: "half" pairs i with i + R/2, "interleaved" 2i with 2i+1
  void rotate(float* t, const float* c, const float* s) const {
    const int64_t half = R_ / 2;
    for (int64_t i = 0; i < half; ++i) {
      float *a = interleaved_ ? t + 2 * i : t + i, *b = interleaved_ ? t + 2 * i + 1 : t + i + half;
      const float x1 = *a, x2 = *b;
      *a = x1 * c[i] - x2 * s[i];
      *b = x2 * c[i] + x1 * s[i];
    }
  }

  // head hd: softmax(scale · q·Kᵀ) V over the cached keys of logical slots 0..slot-1 (cache slots
  // where[j]) of its KV head (hd / (H / H_kv)) and the new key `k_new` / value `v_new`; fp32, the
  // maximum subtracted first
  void attend(const float* q, const float* k_new, const float* v_new, const float* kl, const float* vl,
              int64_t head_stride, const int64_t* where, int64_t slot, int64_t hd, float* sc, float* out) const {
    const int64_t g = hd / (H_ / Hkv_), n = slot + 1;
    const float* qh = q + hd * D_;
    const float *kh = kl + g * head_stride, *vh = vl + g * head_stride;
    float mx = -INFINITY;
    for (int64_t j = 0; j < n; ++j) {
      sc[j] = row_dot(j < slot ? kh + where[j] * D_ : k_new + g * D_, qh, D_) * scale_;
      mx = std::max(mx, sc[j]);
    }
    float sum = 0.f;
    for (int64_t j = 0; j < n; ++j) sum += (sc[j] = std::exp(sc[j] - mx));
    float* oh = out + hd * D_;
    std::fill(oh, oh + D_, 0.f);
    const float inv = 1.f / sum;
    for (int64_t j = 0; j < n; ++j) {
      const float p = sc[j] * inv;
      const float* vj = j < slot ? vh + where[j] * D_ : v_new + g * D_;
#pragma omp simd
      for (int64_t e = 0; e < D_; ++e) oh[e] += p * vj[e];
    }
  }

  int64_t d_, H_, Hkv_, D_, R_;
  bool interleaved_;
  float scale_;
  int64_t dff_, act_;
  float residual_;
  torch::Tensor final_norm_;
  float final_eps_;
  Mat head_;
  float logit_multiplier_;
  std::vector<Layer> layers_;
};

}  // namespace

void register_step(py::module& mod) {
  py::class_<Step>(mod, "Step")
      .def(py::init<int64_t, int64_t, int64_t, int64_t, int64_t, bool, double, int64_t, int64_t, double,
                    torch::Tensor, double, py::tuple, double>())
      .def("add_layer", &Step::add_layer)
      .def("forward", &Step::forward, py::arg("x"), py::arg("cos"), py::arg("sin"), py::arg("kc"), py::arg("vc"),
           py::arg("slot"), py::arg("table") = py::none());
}

}  // namespace attnlab
