// The eager CPU forward's elementwise ops, one pass each: see servelab_kernels/cpu_ops.py.
//
// Plain loops the compiler vectorizes (-O3 -march=native, `omp simd` for the reductions), rounded
// the way their torch twins round: every intermediate their twin stores in the model's dtype is
// rounded here too, and the build keeps float contraction off, so rotary is bit-exact and the
// others differ from torch only by the order of a row's sum and by exp's last bit.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

inline float load_f(const float* p, int64_t i) { return p[i]; }
inline float load_f(const at::BFloat16* p, int64_t i) {
  const uint32_t u = uint32_t(reinterpret_cast<const uint16_t*>(p)[i]) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t bf16_bits(float f) {  // round to nearest even, as c10::BFloat16 does; NaN stays NaN
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7FFFu + ((u >> 16) & 1u);
  return f != f ? uint16_t(0x7FC0) : uint16_t(u >> 16);
}

inline void store_f(float* p, int64_t i, float v) { p[i] = v; }
inline void store_f(at::BFloat16* p, int64_t i, float v) { reinterpret_cast<uint16_t*>(p)[i] = bf16_bits(v); }

// v as the element type stores it (what torch's twin reads back after writing an intermediate)
inline float as_stored(float v, const float*) { return v; }
inline float as_stored(float v, const at::BFloat16*) {
  const uint32_t u = uint32_t(bf16_bits(v)) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline float exp_f(float x) {  // 2^n * p(r) with |r| <= ln2 / 2: within 2 ulp, and it vectorizes
  x = std::min(std::max(x, -87.3f), 88.3f);
  const float n = std::rint(x * 1.44269504088896341f);
  const float r = (x - n * 0.693145751953125f) - n * 1.42860682030941723212e-6f;
  const float p = 1.f + r * (1.f + r * (0.5f + r * (1.6666667e-1f + r * (4.1666668e-2f + r * (8.3333338e-3f +
                  r * 1.3888889e-3f)))));
  const uint32_t bits = uint32_t(int32_t(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  return p * scale;
}

int64_t grain_rows(int64_t width) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(width, 1)); }

template <typename T>
void rms_rows(const T* x, int64_t x_stride, const T* res, int64_t res_stride, const T* w, T* out, T* res_out,
              int64_t rows, int64_t n, float eps) {
  at::parallel_for(0, rows, grain_rows(n), [&](int64_t begin, int64_t end) {
    std::vector<float> s(n);
    for (int64_t i = begin; i < end; ++i) {
      const T* xr = x + i * x_stride;
      float acc = 0.f;
      if (res) {  // the residual add first, stored (and so rounded) as the new residual
        const T* rr = res + i * res_stride;
        T* ro = res_out + i * n;
#pragma omp simd reduction(+ : acc)
        for (int64_t j = 0; j < n; ++j) {
          const float v = as_stored(load_f(xr, j) + load_f(rr, j), xr);
          store_f(ro, j, v);
          s[j] = v;
          acc += v * v;
        }
      } else {
#pragma omp simd reduction(+ : acc)
        for (int64_t j = 0; j < n; ++j) {
          const float v = load_f(xr, j);
          s[j] = v;
          acc += v * v;
        }
      }
      const float inv = 1.f / std::sqrt(acc / float(n) + eps);
      T* o = out + i * n;
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) store_f(o, j, load_f(w, j) * as_stored(s[j] * inv, xr));
    }
  });
}

template <typename T>
void rotate(const T* x, int64_t s0, int64_t s1, T* out, int64_t tokens, int64_t heads, int64_t dim,
            const int64_t* pos, const float* cos, const float* sin, int64_t table_stride) {
  const int64_t half = dim / 2;
  at::parallel_for(0, tokens, grain_rows(heads * dim), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cos + pos[t] * table_stride;
      const float* sn = sin + pos[t] * table_stride;
      for (int64_t h = 0; h < heads; ++h) {
        const T* xr = x + t * s0 + h * s1;
        T* o = out + (t * heads + h) * dim;
#pragma omp simd
        for (int64_t j = 0; j < half; ++j) {
          const float x1 = load_f(xr, j), x2 = load_f(xr, j + half);
          store_f(o, j, x1 * c[j] - x2 * sn[j]);
          store_f(o, j + half, x2 * c[j] + x1 * sn[j]);
        }
      }
    }
  });
}

#if defined(__AVX512F__) && defined(__AVX512BF16__) && !defined(SERVELAB_PORTABLE)
#include <immintrin.h>
#define SERVELAB_SILU16 1
// exp_f on 16 lanes, the same operations in the same order (so the same bits): gcc leaves the
// scalar loop below at 256 bits and spends about 3 cycles an element there (0.7 ms of a 64-row
// decode step's 2 in silu_mul on the AMX Xeon); 512-bit lanes take a third of that.
static inline __m512 exp_f16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.3f)), _mm512_set1_ps(88.3f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_sub_ps(_mm512_sub_ps(x, _mm512_mul_ps(n, _mm512_set1_ps(0.693145751953125f))),
                                 _mm512_mul_ps(n, _mm512_set1_ps(1.42860682030941723212e-6f)));
  __m512 p = _mm512_set1_ps(1.3888889e-3f);
  for (const float c : {8.3333338e-3f, 4.1666668e-2f, 1.6666667e-1f, 0.5f, 1.f, 1.f})
    p = _mm512_add_ps(_mm512_set1_ps(c), _mm512_mul_ps(r, p));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}

// silu(g) rounded to bf16 (as the twin stores it), times u, rounded: 16 elements of a bf16 row
static inline void silu_mul16(const at::BFloat16* g, const at::BFloat16* u, at::BFloat16* o, __mmask16 live) {
  const __m512i gi = _mm512_maskz_cvtepu16_epi32(live, _mm256_maskz_loadu_epi16(live, g));
  const __m512 v = _mm512_castsi512_ps(_mm512_slli_epi32(gi, 16));
  const __m512 ui = _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_maskz_cvtepu16_epi32(live, _mm256_maskz_loadu_epi16(live, u)), 16));
  // v / d as v times 1/d from rcp14 and one Newton step (within an fp32 ulp or two, which the bf16
  // rounding below hides for all but a few elements): a 512-bit divide issues once every ~16 cycles
  // here, and was half of silu_mul's time
  const __m512 d = _mm512_add_ps(_mm512_set1_ps(1.f), exp_f16(_mm512_sub_ps(_mm512_setzero_ps(), v)));
  const __m512 r0 = _mm512_rcp14_ps(d);
  const __m512 s = _mm512_mul_ps(v, _mm512_mul_ps(r0, _mm512_fnmadd_ps(d, r0, _mm512_set1_ps(2.f))));
  const __m512 sb = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(s)), 16));
  _mm256_mask_storeu_epi16(o, live, (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(sb, ui)));
}
#endif

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__) && !defined(SERVELAB_PORTABLE)
#include <immintrin.h>
#define SERVELAB_SILU8 1
// exp_f on 8 lanes, the same operations in the same order (so the same bits): gcc leaves the fp32
// loop below scalar on AVX2 (std::rint), about 18 cycles an element: 0.41 ms for a 64-row decode
// step's 64 x 1,536 on a 2-core Zen 3, 4x torch's silu and multiply; these lanes take under 0.1
static inline __m256 exp_f8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 r = _mm256_sub_ps(_mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(0.693145751953125f))),
                                 _mm256_mul_ps(n, _mm256_set1_ps(1.42860682030941723212e-6f)));
  __m256 p = _mm256_set1_ps(1.3888889e-3f);
  for (const float c : {8.3333338e-3f, 4.1666668e-2f, 1.6666667e-1f, 0.5f, 1.f, 1.f})
    p = _mm256_add_ps(_mm256_set1_ps(c), _mm256_mul_ps(r, p));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

// silu(g) * u on 8 fp32 lanes, divided as the scalar loop divides
static inline void silu_mul8(const float* g, const float* u, float* o) {
  const __m256 v = _mm256_loadu_ps(g);
  const __m256 d = _mm256_add_ps(_mm256_set1_ps(1.f), exp_f8(_mm256_sub_ps(_mm256_setzero_ps(), v)));
  _mm256_storeu_ps(o, _mm256_mul_ps(_mm256_div_ps(v, d), _mm256_loadu_ps(u)));
}
#endif

template <typename T>
void silu_mul_rows(const T* gate, int64_t g_stride, const T* up, int64_t u_stride, T* out, int64_t rows,
                   int64_t n) {
  at::parallel_for(0, rows, grain_rows(n), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const T* g = gate + i * g_stride;
      const T* u = up + i * u_stride;
      T* o = out + i * n;
#ifdef SERVELAB_SILU16
      if constexpr (std::is_same_v<T, at::BFloat16>) {
        for (int64_t j = 0; j < n; j += 16)
          silu_mul16(g + j, u + j, o + j, n - j >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (n - j)) - 1));
        continue;
      }
#endif
      int64_t j0 = 0;
#ifdef SERVELAB_SILU8
      if constexpr (std::is_same_v<T, float>)
        for (; j0 + 8 <= n; j0 += 8) silu_mul8(g + j0, u + j0, o + j0);
#endif
#pragma omp simd
      for (int64_t j = j0; j < n; ++j) {
        const float v = load_f(g, j);
        store_f(o, j, as_stored(v / (1.f + exp_f(-v)), g) * load_f(u, j));
      }
    }
  });
}

// Each row's first maximum (NaN counts as the largest, as torch's max does), in one pass: a vector
// max a chunk of 256, keeping the first chunk that raised the row's maximum (or held its first NaN),
// then the first element in that chunk equal to it. Rows in parallel; a 49,152-wide bf16 row is 96 KB.
template <typename T>
void argmax_rows(const T* x, int64_t stride, int64_t* out, int64_t rows, int64_t n) {
  constexpr int64_t CHUNK = 256;
  at::parallel_for(0, rows, grain_rows(n), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const T* r = x + i * stride;
      float m = -std::numeric_limits<float>::infinity();
      int64_t best = 0;
      bool nan = false;
      for (int64_t c0 = 0; c0 < n; c0 += CHUNK) {
        const int64_t c1 = std::min(n, c0 + CHUNK);
        float cm = -std::numeric_limits<float>::infinity();
        int cn = 0;
#pragma omp simd reduction(max : cm) reduction(| : cn)
        for (int64_t j = c0; j < c1; ++j) {
          const float v = load_f(r, j);
          cm = std::max(cm, v);
          cn |= v != v;
        }
        if (cn) {
          best = c0, nan = true;
          break;
        }
        if (cm > m) m = cm, best = c0;
      }
      int64_t at = best;
      for (int64_t j = best, last = std::min(n, best + CHUNK); j < last; ++j) {
        const float v = load_f(r, j);
        if (nan ? v != v : v == m) {
          at = j;
          break;
        }
      }
      out[i] = at;
    }
  });
}

template <typename F>
void by_dtype(at::ScalarType dtype, F&& f) {  // bf16 or fp32, as check_rows allows
  if (dtype == at::kBFloat16) f(at::BFloat16{});
  else f(float{});
}

void check_rows(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, " must be 2-D with contiguous rows");
  TORCH_CHECK(t.scalar_type() == at::kBFloat16 || t.scalar_type() == at::kFloat, name, " must be bf16 or fp32");
}

}  // namespace

// norm(x) [rows, n], or with a residual: [norm(x + residual), x + residual]
std::vector<torch::Tensor> rms_norm(torch::Tensor x, torch::Tensor weight, double eps,
                                    c10::optional<torch::Tensor> residual) {
  check_rows(x, "x");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() && weight.is_contiguous() && weight.numel() == x.size(1),
              "weight must be contiguous, of x's dtype and row length");
  const int64_t rows = x.size(0), n = x.size(1);
  auto out = torch::empty({rows, n}, x.options());
  torch::Tensor res_out;
  if (residual) {
    check_rows(*residual, "residual");
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->scalar_type() == x.scalar_type(),
                "residual must match x");
    res_out = torch::empty({rows, n}, x.options());
  }
  by_dtype(x.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    const scalar_t* res = residual ? residual->data_ptr<scalar_t>() : nullptr;
    rms_rows<scalar_t>(x.data_ptr<scalar_t>(), x.stride(0), res, residual ? residual->stride(0) : 0,
                       weight.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(),
                       residual ? res_out.data_ptr<scalar_t>() : nullptr, rows, n, float(eps));
  });
  if (residual) return {out, res_out};
  return {out};
}

// x [tokens, heads, dim] (any token and head strides, contiguous dim) rotated at `positions`:
// rotate-half against fp32 tables cos / sin [max_len, dim / 2]; a new contiguous tensor
torch::Tensor rotary(torch::Tensor x, torch::Tensor positions, torch::Tensor cos, torch::Tensor sin) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.size(2) % 2 == 0, "x must be [tokens, heads, even dim]");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat, "x must be bf16 or fp32");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() && positions.numel() == x.size(0),
              "positions must be int64, one per token");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
                  sin.is_contiguous() && cos.sizes() == sin.sizes() && cos.size(1) == x.size(2) / 2,
              "cos and sin must be contiguous fp32 [max_len, dim / 2]");
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < positions.numel(); ++t)
    TORCH_CHECK(pos[t] >= 0 && pos[t] < cos.size(0), "position ", pos[t], " is outside the rotary table");
  auto out = torch::empty({x.size(0), x.size(1), x.size(2)}, x.options());
  by_dtype(x.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    rotate<scalar_t>(x.data_ptr<scalar_t>(), x.stride(0), x.stride(1), out.data_ptr<scalar_t>(), x.size(0),
                     x.size(1), x.size(2), pos, cos.data_ptr<float>(), sin.data_ptr<float>(), cos.stride(0));
  });
  return out;
}

// silu(gate) * up, rows [rows, n] each (strided rows: they are halves of one gate-up matmul)
torch::Tensor silu_mul(torch::Tensor gate, torch::Tensor up) {
  check_rows(gate, "gate");
  check_rows(up, "up");
  TORCH_CHECK(gate.sizes() == up.sizes() && gate.scalar_type() == up.scalar_type(), "gate and up must match");
  auto out = torch::empty(gate.sizes(), gate.options());
  by_dtype(gate.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    silu_mul_rows<scalar_t>(gate.data_ptr<scalar_t>(), gate.stride(0), up.data_ptr<scalar_t>(), up.stride(0),
                            out.data_ptr<scalar_t>(), gate.size(0), gate.size(1));
  });
  return out;
}

// The index of each row's maximum [rows, n] -> [rows] int64 (the first, on a tie): greedy sampling.
torch::Tensor argmax(torch::Tensor x) {
  check_rows(x, "x");
  TORCH_CHECK(x.size(1) > 0, "argmax of an empty row");
  auto out = torch::empty({x.size(0)}, x.options().dtype(torch::kInt64));
  by_dtype(x.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    argmax_rows<scalar_t>(x.data_ptr<scalar_t>(), x.stride(0), out.data_ptr<int64_t>(), x.size(0), x.size(1));
  });
  return out;
}

// Also torch ops, for callers in C++ (csrc/cpu_decode.cpp runs a decode step's layers through them);
// Python calls the functions above through the build's module.
TORCH_LIBRARY_FRAGMENT(SERVELAB_NS, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps, Tensor? residual) -> Tensor[]");
  m.def("rotary(Tensor x, Tensor positions, Tensor cos, Tensor sin) -> Tensor");
  m.def("silu_mul(Tensor gate, Tensor up) -> Tensor");
}

TORCH_LIBRARY_IMPL(SERVELAB_NS, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("rotary", &rotary);
  m.impl("silu_mul", &silu_mul);
}
