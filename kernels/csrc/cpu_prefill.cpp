// Paged prefill attention for the CPU: see kernels/cpu_attention.py. Built as one translation unit
// after cpu_attention.cpp, whose helpers (to_f, exp16, SERVELAB_AVX512) it uses.
#include <algorithm>
#include <atomic>

// Each chunk's queries (positions ctx - qlen .. ctx - 1) against its sequence's cache, causal,
// one query row at a time: the portable twin of the vector path, and the path for other dtypes.
template <typename Q, typename KV>
static void prefill_rows(const Q* q, const KV* kc, const KV* vc, const int64_t* tables, const int64_t* ctx_lens,
                         const int64_t* starts, float* out, int64_t S, int64_t H, int64_t KVH, int64_t BS, int64_t D,
                         int64_t W, int64_t stride_blk, float scale) {
  const int64_t T = starts[S], G = H / KVH;
  std::vector<int64_t> seq_of(T);
  for (int64_t s = 0; s < S; ++s)
    for (int64_t t = starts[s]; t < starts[s + 1]; ++t) seq_of[t] = s;
  at::parallel_for(0, T * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> p, acc(D);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t t = task / H, hq = task % H, h = hq / G, s = seq_of[t];
      const int64_t pos = ctx_lens[s] - (starts[s + 1] - starts[s]) + (t - starts[s]);  // sees keys 0..pos
      p.assign(pos + 1, 0.f);
      float mx = -std::numeric_limits<float>::infinity();
      for (int64_t j = 0; j <= pos; ++j) {
        const KV* kr = kc + tables[s * W + j / BS] * stride_blk + (h * BS + j % BS) * D;
        float dot = 0.f;
        for (int64_t d = 0; d < D; ++d) dot += to_f(q[(t * H + hq) * D + d]) * to_f(kr[d]);
        p[j] = dot * scale;
        mx = std::max(mx, p[j]);
      }
      float sum = 0.f;
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t j = 0; j <= pos; ++j) {
        const float e = std::exp(p[j] - mx);
        sum += e;
        const KV* vr = vc + tables[s * W + j / BS] * stride_blk + (h * BS + j % BS) * D;
        for (int64_t d = 0; d < D; ++d) acc[d] += e * to_f(vr[d]);
      }
      for (int64_t d = 0; d < D; ++d) out[(t * H + hq) * D + d] = acc[d] / sum;
    }
  });
}

#if defined(SERVELAB_AVX512) && defined(__AVX512BF16__)
// Rows r[0..15] of 16 dwords in, their transpose out: r[c] = column c.
static inline void transpose16(__m512i* r) {
  __m512i t[16], u[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // u[i + c]: in 128-bit chunk L, column 4L + c of rows i..i+3
    u[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    u[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    u[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    u[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int c = 0; c < 4; ++c) {
    const __m512i v0 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x88), v1 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xDD);
    const __m512i w0 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x88), w1 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xDD);
    r[c] = _mm512_shuffle_i32x4(v0, w0, 0x88);
    r[8 + c] = _mm512_shuffle_i32x4(v0, w0, 0xDD);
    r[4 + c] = _mm512_shuffle_i32x4(v1, w1, 0x88);
    r[12 + c] = _mm512_shuffle_i32x4(v1, w1, 0xDD);
  }
}

// NR query rows against one tile of n keys (the first at position kpos): scores, online softmax,
// P.V. Rows go NR at a time so that their dependency chains (products, reductions, exp)
// overlap; a row's running max rarely moves after the first tiles, so alpha's exp is skipped then.
template <int NR>
static inline void rows_step(int64_t r0, int64_t kpos, int n, int64_t pos0, int64_t G, const __m512i* kt,
                             const __m512i (*vp)[4], const uint32_t* qp, __m512* acc, float* m, float* l, float scale) {
  constexpr int DP = 32;
  __m512 s0[NR], s1[NR];
  for (int i = 0; i < NR; ++i) s0[i] = s1[i] = _mm512_setzero_ps();
  for (int dp = 0; dp < DP; dp += 2)
    for (int i = 0; i < NR; ++i) {
      s0[i] = _mm512_dpbf16_ps(s0[i], (__m512bh)kt[dp], (__m512bh)_mm512_set1_epi32(static_cast<int>(qp[(r0 + i) * DP + dp])));
      s1[i] = _mm512_dpbf16_ps(s1[i], (__m512bh)kt[dp + 1], (__m512bh)_mm512_set1_epi32(static_cast<int>(qp[(r0 + i) * DP + dp + 1])));
    }
  alignas(64) uint16_t pb[NR][16];
  __m512 a[NR][4];
  int span = 0;  // keys any of the rows sees
  for (int i = 0; i < NR; ++i) {
    const int64_t r = r0 + i, pos = pos0 + r / G;
    const int visible = static_cast<int>(std::min<int64_t>(n, pos - kpos + 1));
    span = std::max(span, visible);
    const __mmask16 live = static_cast<__mmask16>((1u << visible) - 1);
    __m512 sv = _mm512_mul_ps(_mm512_add_ps(s0[i], s1[i]), _mm512_set1_ps(scale));
    sv = _mm512_mask_mov_ps(_mm512_set1_ps(-std::numeric_limits<float>::infinity()), live, sv);
    const float bmax = _mm512_reduce_max_ps(sv);
    float alpha = 1.f;
    if (bmax > m[r]) {
      alpha = std::exp(m[r] - bmax);
      m[r] = bmax;
    }
    const __m512 p = _mm512_maskz_mov_ps(live, exp16(_mm512_sub_ps(sv, _mm512_set1_ps(m[r]))));
    l[r] = l[r] * alpha + _mm512_reduce_add_ps(p);
    _mm256_store_si256((__m256i*)pb[i], (__m256i)_mm512_cvtneps_pbh(p));
    const __m512 av = _mm512_set1_ps(alpha);
    for (int c = 0; c < 4; ++c) a[i][c] = alpha == 1.f ? acc[r * 4 + c] : _mm512_mul_ps(acc[r * 4 + c], av);
  }
  for (int j = 0; j < span; j += 2)
    for (int i = 0; i < NR; ++i) {
      uint32_t pp;  // (p[j], p[j+1]); 0 past a row's visible keys
      std::memcpy(&pp, pb[i] + j, 4);
      const __m512bh pv = (__m512bh)_mm512_set1_epi32(static_cast<int>(pp));
      for (int c = 0; c < 4; ++c) a[i][c] = _mm512_dpbf16_ps(a[i][c], (__m512bh)vp[j / 2][c], pv);
    }
  for (int i = 0; i < NR; ++i)
    for (int c = 0; c < 4; ++c) acc[(r0 + i) * 4 + c] = a[i][c];
}

// bf16 q and cache, head_dim 64. A task is one KV head of one chunk's tile of QT query positions:
// its QT x G query rows walk the key blocks up to the tile's last position. Per block, the keys
// are transposed once into (d, d+1) pairs with a key per lane, so each row's 16 scores are 32
// AVX512-BF16 pair products and no horizontal sums; P.V is pair products too (value_pairs).
static void prefill_bf16_d64(const at::BFloat16* q, const at::BFloat16* kc, const at::BFloat16* vc,
                             const int64_t* tables, const int64_t* ctx_lens, const int64_t* starts, float* out,
                             int64_t S, int64_t H, int64_t KVH, int64_t BS, int64_t W, int64_t stride_blk, float scale) {
  constexpr int64_t D = 64, DP = D / 2, QT = 16;
  const int64_t G = H / KVH, R = QT * G;
  struct Task { int64_t s, h, t0, cost; };
  std::vector<Task> tasks;
  for (int64_t s = 0; s < S; ++s) {
    const int64_t qlen = starts[s + 1] - starts[s], first = ctx_lens[s] - qlen;
    for (int64_t t0 = 0; t0 < qlen; t0 += QT)
      for (int64_t h = 0; h < KVH; ++h) tasks.push_back({s, h, t0, first + std::min(qlen, t0 + QT)});
  }
  // longest first, handed out one by one: the last tiles of a chunk see the most keys
  std::sort(tasks.begin(), tasks.end(), [](const Task& a, const Task& b) { return a.cost > b.cost; });
  std::atomic<int64_t> next{0};
  const int64_t n_tasks = static_cast<int64_t>(tasks.size());
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    std::vector<uint32_t> qp(R * DP);            // the rows' queries as bf16 pairs
    std::vector<__m512> acc(R * 4);              // their outputs, d in value_pairs' unpack order
    std::vector<float> m(R), l(R);
    alignas(64) __m512i kt[DP], vp[8][4];
    for (int64_t i = next++; i < n_tasks; i = next++) {
      const Task& tk = tasks[i];
      const int64_t qlen = starts[tk.s + 1] - starts[tk.s], first = ctx_lens[tk.s] - qlen;
      const int64_t nq = std::min(QT, qlen - tk.t0), rows = nq * G;
      for (int64_t r = 0; r < rows; ++r) {  // row r = (query t0 + r / G, head h * G + r % G)
        const int64_t t = starts[tk.s] + tk.t0 + r / G, hq = tk.h * G + r % G;
        std::memcpy(&qp[r * DP], q + (t * H + hq) * D, D * sizeof(at::BFloat16));
        for (int c = 0; c < 4; ++c) acc[r * 4 + c] = _mm512_setzero_ps();
        m[r] = -std::numeric_limits<float>::max();  // finite: alpha = exp(m - max) is then 0, not a NaN
        l[r] = 0.f;
      }
      const int64_t last = first + tk.t0 + nq - 1;  // the tile's last position: keys 0..last
      for (int64_t start = 0; start <= last; start += BS) {
        const int64_t blk = tables[tk.s * W + start / BS];
        const at::BFloat16* kb = kc + blk * stride_blk + tk.h * BS * D;
        const at::BFloat16* vb = vc + blk * stride_blk + tk.h * BS * D;
        for (int64_t j0 = 0; j0 < BS && start + j0 <= last; j0 += 16) {
          const int n = static_cast<int>(std::min<int64_t>({16, BS - j0, last + 1 - start - j0}));
          for (int half = 0; half < 2; ++half) {  // d pairs 0..15, then 16..31
            __m512i rows16[16];
            for (int j = 0; j < 16; ++j)
              rows16[j] = j < n ? _mm512_loadu_si512(kb + (j0 + j) * D + half * 32) : _mm512_setzero_si512();
            transpose16(rows16);
            for (int c = 0; c < 16; ++c) kt[half * 16 + c] = rows16[c];
          }
          for (int j = 0; j < n; j += 2)
            value_pairs<2>(vb + (j0 + j) * D, j + 1 < n ? vb + (j0 + j + 1) * D : nullptr, vp[j / 2]);
          const int64_t kpos = start + j0;  // position of lane 0's key
          int64_t r = 0;
          while (r < rows && first + tk.t0 + r / G < kpos) ++r;  // rows whose keys here are all in the future
          for (; r + 4 <= rows; r += 4) rows_step<4>(r, kpos, n, first + tk.t0, G, kt, vp, qp.data(), acc.data(), m.data(), l.data(), scale);
          for (; r < rows; ++r) rows_step<1>(r, kpos, n, first + tk.t0, G, kt, vp, qp.data(), acc.data(), m.data(), l.data(), scale);
        }
      }
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t t = starts[tk.s] + tk.t0 + r / G, hq = tk.h * G + r % G;
        store_unpacked<2>(out + (t * H + hq) * D, &acc[r * 4], _mm512_set1_ps(1.f / l[r]));
      }
    }
  });
}
#endif

// Whether paged_prefill has a vector path for this cache and head size here (else it is a loop).
bool prefill_fast(torch::Tensor k_cache) {
#if defined(SERVELAB_AVX512) && defined(__AVX512BF16__)
  return k_cache.scalar_type() == torch::kBFloat16 && k_cache.size(3) == 64;
#else
  (void)k_cache;
  return false;
#endif
}

// Packed prefill chunks q [T, H, D] (sequence s's rows starts[s]..starts[s+1], the last tokens of its
// context_lens[s], their K/V already in the cache) -> [T, H, D] in q's dtype.
torch::Tensor paged_prefill(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor block_tables,
                            torch::Tensor context_lens, torch::Tensor query_start_loc, double scale) {
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.scalar_type() != torch::kChar,
              "paged_prefill: a contiguous bf16 / fp32 cache");
  auto tables = block_tables.to(torch::kInt64).contiguous();
  auto lens = context_lens.to(torch::kInt64).contiguous();
  auto starts = query_start_loc.to(torch::kInt64).contiguous();
  const int64_t S = lens.size(0), T = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t KVH = k_cache.size(1), BS = k_cache.size(2), W = tables.size(1), stride = k_cache.stride(0);
  TORCH_CHECK(starts.size(0) == S + 1 && starts[S].item<int64_t>() == T, "paged_prefill: query_start_loc must end at T");
  auto out = torch::empty({T, H, D}, q.options().dtype(torch::kFloat32));
#if defined(SERVELAB_AVX512) && defined(__AVX512BF16__)
  if (prefill_fast(k_cache) && q.scalar_type() == torch::kBFloat16) {
    auto qc = q.contiguous();
    prefill_bf16_d64(qc.data_ptr<at::BFloat16>(), k_cache.data_ptr<at::BFloat16>(), v_cache.data_ptr<at::BFloat16>(),
                     tables.data_ptr<int64_t>(), lens.data_ptr<int64_t>(), starts.data_ptr<int64_t>(),
                     out.data_ptr<float>(), S, H, KVH, BS, W, stride, static_cast<float>(scale));
    return out.to(q.scalar_type());
  }
#endif
  auto qf = q.to(torch::kFloat32).contiguous();
  if (k_cache.scalar_type() == torch::kBFloat16)
    prefill_rows(qf.data_ptr<float>(), k_cache.data_ptr<at::BFloat16>(), v_cache.data_ptr<at::BFloat16>(),
                 tables.data_ptr<int64_t>(), lens.data_ptr<int64_t>(), starts.data_ptr<int64_t>(), out.data_ptr<float>(),
                 S, H, KVH, BS, D, W, stride, static_cast<float>(scale));
  else
    prefill_rows(qf.data_ptr<float>(), k_cache.data_ptr<float>(), v_cache.data_ptr<float>(),
                 tables.data_ptr<int64_t>(), lens.data_ptr<int64_t>(), starts.data_ptr<int64_t>(), out.data_ptr<float>(),
                 S, H, KVH, BS, D, W, stride, static_cast<float>(scale));
  return out.to(q.scalar_type());
}
