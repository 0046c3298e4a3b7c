// Paged prefill attention for the CPU: see servelab_kernels/cpu_attention.py. Built as one translation unit
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

// A vector kernel's unit of work: one KV head `h` of the query positions t0.. of sequence s's chunk.
struct PrefillTask { int64_t s, h, t0, cost; };

// Every chunk's tasks of `qt` positions, longest first (the last tiles of a chunk see the most
// keys), for the threads to take one by one.
[[maybe_unused]] static std::vector<PrefillTask> prefill_tasks(const int64_t* ctx_lens, const int64_t* starts, int64_t S,
                                                               int64_t KVH, int64_t qt) {
  std::vector<PrefillTask> tasks;
  for (int64_t s = 0; s < S; ++s) {
    const int64_t qlen = starts[s + 1] - starts[s], first = ctx_lens[s] - qlen;
    for (int64_t t0 = 0; t0 < qlen; t0 += qt)
      for (int64_t h = 0; h < KVH; ++h) tasks.push_back({s, h, t0, first + std::min(qlen, t0 + qt)});
  }
  std::sort(tasks.begin(), tasks.end(), [](const PrefillTask& a, const PrefillTask& b) { return a.cost > b.cost; });
  return tasks;
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
  const std::vector<PrefillTask> tasks = prefill_tasks(ctx_lens, starts, S, KVH, QT);
  std::atomic<int64_t> next{0};
  const int64_t n_tasks = static_cast<int64_t>(tasks.size());
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    std::vector<uint32_t> qp(R * DP);            // the rows' queries as bf16 pairs
    std::vector<__m512> acc(R * 4);              // their outputs, d in value_pairs' unpack order
    std::vector<float> m(R), l(R);
    alignas(64) __m512i kt[DP], vp[8][4];
    for (int64_t i = next++; i < n_tasks; i = next++) {
      const PrefillTask& tk = tasks[i];
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
          // three rows a step (at SmolLM2's group of 3, one query position's heads): with four, the
          // choice before 2026-12-06, the kernel ran 1.2-1.8x slower on a 2-core Zen 4 (gcc 12; six
          // pairs of builds alternating, medians 1.40-1.54x by shape); measured, the cause in the
          // compiled code not pinned down
          for (; r + 3 <= rows; r += 3) rows_step<3>(r, kpos, n, first + tk.t0, G, kt, vp, qp.data(), acc.data(), m.data(), l.data(), scale);
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

#if defined(SERVELAB_AMX_DECODE) && defined(__AVX512BF16__)
// bf16 q and cache on AMX tiles: block size a multiple of 16, head_dim a multiple of 64. A task is
// 16 query rows of one KV head of one chunk (row r = position r / G, query head r % G, each with its
// own causal end), in two passes like the decode tile kernel: (1) S^T = K . Q^T, 16 keys a tile
// straight from the cache against the rows' queries packed as bf16 pairs, stored [key][row], so
// the exact softmax runs down the keys with a row per lane (a row's causal mask is one compare, and
// none below the first row's end) and no scores are gathered; its probabilities, paired (key,
// key + 1) a dword per row, are transposed 32 keys at a time into a P tile [row][key]; (2) O = P . V
// against value rows paired as the tiles read them (value_pairs), packed once per (sequence, KV
// head) for all of its tasks, zero past the context. Tiles: 0-3 O [16 rows][16 d]; 4 S^T; 5 K;
// 6 Q^T, then P; 7 V.
static bool amx_prefill_on = true;

bool amx_prefill_fits(int64_t BS, int64_t D) {
  return amx_prefill_on && BS % 16 == 0 && D % 64 == 0 && amx::permitted();
}

static void prefill_amx_bf16(const at::BFloat16* q, const at::BFloat16* kc, const at::BFloat16* vc,
                             const int64_t* tables, const int64_t* ctx_lens, const int64_t* starts, float* out,
                             int64_t S, int64_t H, int64_t KVH, int64_t BS, int64_t D, int64_t W, int64_t stride_blk,
                             float scale) {
  const int64_t G = H / KVH, NS = D / 32, NT = D / 16;  // NT: value tiles of 16 dims
  // value pairs per (sequence, KV head): per 32 keys, NT tiles of [16 key pairs][16 d x 2]
  std::vector<int64_t> vp_off(S * KVH + 1, 0), cap(S);
  int64_t max_cap = 0;
  for (int64_t s = 0; s < S; ++s) {
    cap[s] = (ctx_lens[s] + 31) / 32 * 32;
    max_cap = std::max(max_cap, cap[s]);
    for (int64_t h = 0; h < KVH; ++h) vp_off[s * KVH + h + 1] = vp_off[s * KVH + h] + D * cap[s];
  }
  std::vector<uint16_t> vpk(vp_off[S * KVH]);
  at::parallel_for(0, S * KVH, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t s = task / KVH, h = task % KVH, ctx = ctx_lens[s];
      uint16_t* dst = vpk.data() + vp_off[task];
      for (int64_t kp = 0; kp < cap[s] / 2; ++kp) {
        const int64_t t = 2 * kp;
        for (int64_t dc = 0; dc < D / 64; ++dc) {
          __m512i pair[4];
          if (t < ctx) {  // keys t, t + 1 (never across a block: BS is even)
            const at::BFloat16* row = vc + tables[s * W + t / BS] * stride_blk + (h * BS + t % BS) * D + dc * 64;
            value_pairs<2>(row, t + 1 < ctx ? row + D : nullptr, pair);
          } else {
            for (auto& p : pair) p = _mm512_setzero_si512();
          }
          for (int c = 0; c < 4; ++c)
            _mm512_storeu_si512(dst + ((kp / 16) * NT + dc * 4 + c) * 512 + (kp % 16) * 32, pair[c]);
        }
      }
    }
  });
  struct Task { int64_t s, h, r0, cost; };
  std::vector<Task> tasks;
  for (int64_t s = 0; s < S; ++s) {
    const int64_t qlen = starts[s + 1] - starts[s], first = ctx_lens[s] - qlen;
    for (int64_t r0 = 0; r0 < qlen * G; r0 += 16)
      for (int64_t h = 0; h < KVH; ++h)
        tasks.push_back({s, h, r0, first + (std::min(qlen * G, r0 + 16) - 1) / G + 1});
  }
  // longest first, handed out one by one: the last rows of a chunk see the most keys
  std::sort(tasks.begin(), tasks.end(), [](const Task& a, const Task& b) { return a.cost > b.cost; });
  std::atomic<int64_t> next{0};
  const int64_t n_tasks = static_cast<int64_t>(tasks.size());
  // two rows of 16 bf16 probabilities (keys t, t + 1) into 16 dwords (p[t][r], p[t + 1][r])
  const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                         21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    amx::configure_full();
    std::vector<uint16_t> qt(NS * 512);
    std::vector<float> st(max_cap * 16);     // S^T [key][row]
    std::vector<uint16_t> pt(max_cap * 16);  // P tiles [32 keys a tile][row][32]
    alignas(64) int32_t row_ctx[16];
    for (int64_t i = next++; i < n_tasks; i = next++) {
      const Task& tk = tasks[i];
      const int64_t qlen = starts[tk.s + 1] - starts[tk.s], first = ctx_lens[tk.s] - qlen;
      const int64_t rows = std::min<int64_t>(16, qlen * G - tk.r0), ctx = tk.cost;
      std::fill(qt.begin(), qt.end(), 0);
      for (int64_t r = 0; r < 16; ++r) {  // rows past the chunk: no keys, never stored
        row_ctx[r] = r < rows ? static_cast<int32_t>(first + (tk.r0 + r) / G + 1) : 0;
        if (r >= rows) continue;
        const int64_t t = starts[tk.s] + (tk.r0 + r) / G, hq = tk.h * G + (tk.r0 + r) % G;
        const uint16_t* qrow = reinterpret_cast<const uint16_t*>(q + (t * H + hq) * D);
        for (int64_t d = 0; d < D; ++d) qt[qt_slot(d, r)] = qrow[d];
      }
      const int64_t* table = tables + tk.s * W;
      // pass 1: S^T, 16 keys a tile (a tile never crosses a block: BS is a multiple of 16)
      for (int64_t k0 = 0; k0 < ctx; k0 += 16) {
        const at::BFloat16* kb = kc + table[k0 / BS] * stride_blk + (tk.h * BS + k0 % BS) * D;
        _tile_zero(4);
        for (int64_t sl = 0; sl < NS; ++sl) {
          _tile_loadd(5, kb + sl * 32, D * 2);
          _tile_loadd(6, qt.data() + sl * 512, 64);
          _tile_dpbf16ps(4, 5, 6);
        }
        _tile_stored(4, st.data() + k0 * 16, 64);
      }
      // the softmax down the keys, a row per lane; keys below the first row's end are every row's
      const __m512i rc = _mm512_load_si512(row_ctx);
      const int64_t all_live = row_ctx[0], padded = (ctx + 31) / 32 * 32;
      const __m512 sc = _mm512_set1_ps(scale);
      auto live_at = [&](int64_t t) -> __mmask16 {
        return t < all_live ? __mmask16(0xFFFF) : _mm512_cmpgt_epi32_mask(rc, _mm512_set1_epi32(int32_t(t)));
      };
      // four running maxima and two sums, so that no add or max waits on the one before it
      const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
      __m512 mxs[4] = {ninf, ninf, ninf, ninf};
      int64_t t = 0;
      for (; t + 4 <= std::min(ctx, all_live); t += 4)
        for (int j = 0; j < 4; ++j) mxs[j] = _mm512_max_ps(mxs[j], _mm512_loadu_ps(st.data() + (t + j) * 16));
      for (; t < ctx; ++t) mxs[0] = _mm512_mask_max_ps(mxs[0], live_at(t), mxs[0], _mm512_loadu_ps(st.data() + t * 16));
      const __m512 mx = _mm512_mul_ps(_mm512_max_ps(_mm512_max_ps(mxs[0], mxs[1]), _mm512_max_ps(mxs[2], mxs[3])), sc);
      __m512 sums[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
      for (int64_t t0 = 0; t0 < padded; t0 += 32) {
        __m512i m[16];  // m[kp][r] = (p[t0 + 2kp][r], p[t0 + 2kp + 1][r])
        for (int kp = 0; kp < 16; ++kp) {
          __m512 p[2];
          for (int j = 0; j < 2; ++j) {
            const int64_t t = t0 + 2 * kp + j;
            const __mmask16 live = t < ctx ? live_at(t) : __mmask16(0);
            const __m512 sv = _mm512_fmsub_ps(_mm512_maskz_loadu_ps(live, st.data() + t * 16), sc, mx);
            p[j] = _mm512_maskz_mov_ps(live, exp16(sv));
            sums[j] = _mm512_add_ps(sums[j], p[j]);
          }
          const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512((__m256i)_mm512_cvtneps_pbh(p[0])),
                                                  (__m256i)_mm512_cvtneps_pbh(p[1]), 1);
          m[kp] = _mm512_permutexvar_epi16(pairs, both);
        }
        transpose16(m);  // m[r] = row r's 32 probabilities in key order
        for (int r = 0; r < 16; ++r) _mm512_storeu_si512(pt.data() + t0 * 16 + r * 32, m[r]);
      }
      const __m512 sum = _mm512_add_ps(sums[0], sums[1]);
      alignas(64) float inv[16];
      _mm512_store_ps(inv, _mm512_maskz_div_ps(_mm512_cmplt_ps_mask(_mm512_setzero_ps(), sum), _mm512_set1_ps(1.f), sum));
      // pass 2: O = P . V, 64 dims at a time, 32 keys a tile
      const uint16_t* vh = vpk.data() + vp_off[tk.s * KVH + tk.h];
      for (int64_t dc = 0; dc < D / 64; ++dc) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t t0 = 0; t0 < padded; t0 += 32) {
          const uint16_t* vt = vh + ((t0 / 32) * NT + dc * 4) * 512;
          _tile_loadd(6, pt.data() + t0 * 16, 64);
          _tile_loadd(7, vt, 64);
          _tile_dpbf16ps(0, 6, 7);
          _tile_loadd(7, vt + 512, 64);
          _tile_dpbf16ps(1, 6, 7);
          _tile_loadd(7, vt + 1024, 64);
          _tile_dpbf16ps(2, 6, 7);
          _tile_loadd(7, vt + 1536, 64);
          _tile_dpbf16ps(3, 6, 7);
        }
        store_o_tiles(rows, [&](int64_t r) {
          const int64_t t = starts[tk.s] + (tk.r0 + r) / G, hq = tk.h * G + (tk.r0 + r) % G;
          return out + (t * H + hq) * D + dc * 64;
        }, [&](int64_t r) { return inv[r]; });
      }
    }
    _tile_release();
  });
}
#endif

#if defined(SERVELAB_AVX2_DECODE)
static bool avx2_prefill_on = true;

// S^T for keys j0..j0+NK-1 of a tile (fp32 rows kb, D apart) and 16 rows (Q^T columns r0..r0+15):
// 2 NK accumulators, and per dim 2 vector loads and NK broadcasts for 2 NK FMAs.
template <int NK>
static inline void scores_tile(const float* qt, const float* kb, float* pt, int64_t D, int64_t RP, int64_t r0, int j0) {
  __m256 s[NK][2];
  for (int u = 0; u < NK; ++u) s[u][0] = s[u][1] = _mm256_setzero_ps();
  for (int64_t d = 0; d < D; ++d) {
    const __m256 q0 = _mm256_loadu_ps(qt + d * RP + r0), q1 = _mm256_loadu_ps(qt + d * RP + r0 + 8);
    for (int u = 0; u < NK; ++u) {
      const __m256 k = _mm256_broadcast_ss(kb + (j0 + u) * D + d);
      s[u][0] = _mm256_fmadd_ps(k, q0, s[u][0]);
      s[u][1] = _mm256_fmadd_ps(k, q1, s[u][1]);
    }
  }
  for (int u = 0; u < NK; ++u) {
    _mm256_storeu_ps(pt + (j0 + u) * RP + r0, s[u][0]);
    _mm256_storeu_ps(pt + (j0 + u) * RP + r0 + 8, s[u][1]);
  }
}

// O[r..r+NR-1] = alpha O + P . V over a tile's n keys, 16 dims at a time: 2 NR accumulators, and per
// key 2 vector loads (a value row's 16 dims) and NR broadcasts (the rows' probabilities) for 2 NR FMAs.
template <int NR>
static inline void values_tile(const float* pt, const float* vb, const float* alpha, float* o, int64_t D, int64_t RP,
                               int64_t r, int n) {
  for (int64_t d0 = 0; d0 < D; d0 += 16) {
    __m256 acc[NR][2];
    for (int i = 0; i < NR; ++i) {
      const __m256 a = _mm256_broadcast_ss(alpha + r + i);
      acc[i][0] = _mm256_mul_ps(_mm256_loadu_ps(o + (r + i) * D + d0), a);
      acc[i][1] = _mm256_mul_ps(_mm256_loadu_ps(o + (r + i) * D + d0 + 8), a);
    }
    for (int j = 0; j < n; ++j) {
      const __m256 v0 = _mm256_loadu_ps(vb + j * D + d0), v1 = _mm256_loadu_ps(vb + j * D + d0 + 8);
      for (int i = 0; i < NR; ++i) {
        const __m256 p = _mm256_broadcast_ss(pt + j * RP + r + i);
        acc[i][0] = _mm256_fmadd_ps(p, v0, acc[i][0]);
        acc[i][1] = _mm256_fmadd_ps(p, v1, acc[i][1]);
      }
    }
    for (int i = 0; i < NR; ++i) {
      _mm256_storeu_ps(o + (r + i) * D + d0, acc[i][0]);
      _mm256_storeu_ps(o + (r + i) * D + d0 + 8, acc[i][1]);
    }
  }
}

// fp32 or bf16 cache, head_dim a multiple of 16, on AVX2 + FMA (CPUs without AVX-512; fp32 arithmetic).
// A task is one KV head of a tile of QT query positions of one chunk: R = QT x G query rows (position
// t0 + r / G, query head h * G + r % G), padded to groups of 16 rows with rows that see no key. The
// queries (scaled), the scores and probabilities of a tile of KT keys, and the rows' running max, sum
// and causal end are kept with the rows in lanes (Q^T [D][R], S^T = P^T [KT][R]), so the softmax runs
// down the keys with no horizontal reduction and the causal mask is one compare a key; the outputs are
// rows [R][D]. Each key tile is copied as fp32 rows (across block boundaries, zero past its end) and
// both products broadcast one operand's scalars against the other's vectors in 6 x 16 register tiles
// (scores_tile, values_tile). PyTorch's CPU flash attention (SDPA) runs fresh 512-token chunks at
// about 40 GFLOP/s on a 2-core Zen 3, and needs the prefix gathered and a mask built first.
template <typename KV>
static void prefill_avx2(const float* q, const KV* kc, const KV* vc, const int64_t* tables, const int64_t* ctx_lens,
                         const int64_t* starts, float* out, int64_t S, int64_t H, int64_t KVH, int64_t BS, int64_t D,
                         int64_t W, int64_t stride_blk, float scale) {
  constexpr int KT = 24;
  const int64_t G = H / KVH, QT = std::max<int64_t>(1, 48 / G), RP = (QT * G + 15) / 16 * 16;
  const std::vector<PrefillTask> tasks = prefill_tasks(ctx_lens, starts, S, KVH, QT);
  std::atomic<int64_t> next{0};
  const int64_t n_tasks = static_cast<int64_t>(tasks.size());
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    std::vector<float> qt(D * RP), o(RP * D), pt(KT * RP), kb(KT * D), vb(KT * D), m(RP), l(RP), posf(RP), alpha(RP);
    const __m256 neg_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
    for (int64_t i = next++; i < n_tasks; i = next++) {
      const PrefillTask& tk = tasks[i];
      const int64_t qlen = starts[tk.s + 1] - starts[tk.s], first = ctx_lens[tk.s] - qlen;
      const int64_t nq = std::min(QT, qlen - tk.t0), rows = nq * G, last = first + tk.t0 + nq - 1;
      for (int64_t r = 0; r < RP; ++r) {
        m[r] = -std::numeric_limits<float>::max();  // finite: alpha = exp(m - max) is then 0, not a NaN
        l[r] = 0.f;
        if (r >= rows) {  // a pad row: no query, masked before the diagonal, never stored
          posf[r] = -1.f;
          for (int64_t d = 0; d < D; ++d) qt[d * RP + r] = 0.f;
          continue;
        }
        posf[r] = static_cast<float>(first + tk.t0 + r / G);
        const float* qr = q + ((starts[tk.s] + tk.t0 + r / G) * H + tk.h * G + r % G) * D;
        for (int64_t d = 0; d < D; ++d) qt[d * RP + r] = qr[d] * scale;
      }
      std::fill(o.begin(), o.end(), 0.f);
      for (int64_t kpos = 0; kpos <= last; kpos += KT) {
        const int n = static_cast<int>(std::min<int64_t>(KT, last + 1 - kpos)), nk = (n + 5) / 6 * 6;
        for (int j = 0; j < nk; ++j) {
          float* kd = &kb[j * D];
          if (j >= n) {  // zero keys: scores of 0, masked below
            std::fill(kd, kd + D, 0.f);
            continue;
          }
          const int64_t p = kpos + j, off = tables[tk.s * W + p / BS] * stride_blk + (tk.h * BS + p % BS) * D;
          for (int64_t d = 0; d < D; d += 8) {
            _mm256_storeu_ps(kd + d, load8(kc + off + d));
            _mm256_storeu_ps(&vb[j * D + d], load8(vc + off + d));
          }
        }
        for (int64_t r0 = 0; r0 < rows; r0 += 16) {
          if (posf[std::min(r0 + 15, rows - 1)] < static_cast<float>(kpos)) continue;  // every key in their future
          for (int j0 = 0; j0 < nk; j0 += 6) scores_tile<6>(qt.data(), kb.data(), pt.data(), D, RP, r0, j0);
          // online softmax down the keys, 8 rows a vector; key j is visible to a row iff kpos + j <= its
          // position: past the causal diagonal (every row of the 16 sees the whole tile) no mask is needed
          const bool all_seen = static_cast<float>(kpos + n - 1) <= posf[r0];
          for (int64_t v = r0; v < r0 + 16; v += 8) {
            const __m256 pos = _mm256_loadu_ps(&posf[v]);
            __m256 mx = neg_inf;
            for (int j = 0; j < n; ++j) {
              __m256 sv = _mm256_loadu_ps(&pt[j * RP + v]);
              if (!all_seen) {
                const __m256 seen = _mm256_cmp_ps(_mm256_set1_ps(static_cast<float>(kpos + j)), pos, _CMP_LE_OQ);
                sv = _mm256_blendv_ps(neg_inf, sv, seen);
                _mm256_storeu_ps(&pt[j * RP + v], sv);
              }
              mx = _mm256_max_ps(mx, sv);
            }
            const __m256 m_old = _mm256_loadu_ps(&m[v]), m_new = _mm256_max_ps(m_old, mx);
            const __m256 a = exp8(_mm256_sub_ps(m_old, m_new));
            __m256 sum = _mm256_setzero_ps();
            for (int j = 0; j < n; ++j) {  // masked scores are -inf: exp8 clamps them, the compare zeroes them
              const __m256 x = _mm256_loadu_ps(&pt[j * RP + v]);
              __m256 e = exp8(_mm256_sub_ps(x, m_new));
              if (!all_seen) e = _mm256_and_ps(_mm256_cmp_ps(x, neg_inf, _CMP_NEQ_OQ), e);
              _mm256_storeu_ps(&pt[j * RP + v], e);
              sum = _mm256_add_ps(sum, e);
            }
            _mm256_storeu_ps(&m[v], m_new);
            _mm256_storeu_ps(&l[v], _mm256_fmadd_ps(_mm256_loadu_ps(&l[v]), a, sum));
            _mm256_storeu_ps(&alpha[v], a);
          }
          values_tile<6>(pt.data(), vb.data(), alpha.data(), o.data(), D, RP, r0, n);
          values_tile<6>(pt.data(), vb.data(), alpha.data(), o.data(), D, RP, r0 + 6, n);
          values_tile<4>(pt.data(), vb.data(), alpha.data(), o.data(), D, RP, r0 + 12, n);
        }
      }
      for (int64_t r = 0; r < rows; ++r) {
        float* dst = out + ((starts[tk.s] + tk.t0 + r / G) * H + tk.h * G + r % G) * D;
        const float inv = 1.f / l[r];
        for (int64_t d = 0; d < D; ++d) dst[d] = o[r * D + d] * inv;
      }
    }
  });
}
#endif

// Whether prefill on a CPU without AVX-512 takes the AVX2 kernel (fp32 / bf16 cache, head_dim a
// multiple of 16); set_avx2_prefill(false) keeps the loop (A/B runs, tests). Returns the setting before.
bool set_avx2_prefill(bool on) {
#if defined(SERVELAB_AVX2_DECODE)
  const bool before = avx2_prefill_on;
  avx2_prefill_on = on;
  return before;
#else
  (void)on;
  return false;
#endif
}

// Whether bf16 prefill takes the AMX kernel (where it fits); set_amx_prefill(false) keeps the vector
// kernel or the loop (A/B runs, tests). Returns the setting before.
bool set_amx_prefill(bool on) {
#if defined(SERVELAB_AMX_DECODE) && defined(__AVX512BF16__)
  const bool before = amx_prefill_on;
  amx_prefill_on = on;
  return before;
#else
  (void)on;
  return false;
#endif
}

// Whether paged_prefill runs this cache on AMX tiles here (bf16, block size a multiple of 16,
// head_dim a multiple of 64, the tiles granted and not switched off).
bool prefill_on_tiles(torch::Tensor k_cache) {
#if defined(SERVELAB_AMX_DECODE) && defined(__AVX512BF16__)
  return k_cache.scalar_type() == torch::kBFloat16 && amx_prefill_fits(k_cache.size(2), k_cache.size(3));
#else
  (void)k_cache;
  return false;
#endif
}

// Whether paged_prefill's vector kernel serves this cache here (bf16, head_dim 64, AVX512-BF16).
bool prefill_vector(torch::Tensor k_cache) {
#if defined(SERVELAB_AVX512) && defined(__AVX512BF16__)
  return k_cache.scalar_type() == torch::kBFloat16 && k_cache.size(3) == 64;
#elif defined(SERVELAB_AVX2_DECODE)
  const auto t = k_cache.scalar_type();
  return avx2_prefill_on && (t == torch::kFloat32 || t == torch::kBFloat16) && k_cache.size(3) % 16 == 0;
#else
  (void)k_cache;
  return false;
#endif
}

// Whether paged_prefill has a tile or vector path for this cache and head size here (else it is a loop).
bool prefill_fast(torch::Tensor k_cache) { return prefill_on_tiles(k_cache) || prefill_vector(k_cache); }

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
#if defined(SERVELAB_AMX_DECODE) && defined(__AVX512BF16__)
  if (q.scalar_type() == torch::kBFloat16 && prefill_on_tiles(k_cache)) {
    auto qc = q.contiguous();
    prefill_amx_bf16(qc.data_ptr<at::BFloat16>(), k_cache.data_ptr<at::BFloat16>(), v_cache.data_ptr<at::BFloat16>(),
                     tables.data_ptr<int64_t>(), lens.data_ptr<int64_t>(), starts.data_ptr<int64_t>(),
                     out.data_ptr<float>(), S, H, KVH, BS, D, W, stride, static_cast<float>(scale));
    return out.to(q.scalar_type());
  }
#endif
#if defined(SERVELAB_AVX512) && defined(__AVX512BF16__)
  if (q.scalar_type() == torch::kBFloat16 && prefill_vector(k_cache)) {
    auto qc = q.contiguous();
    prefill_bf16_d64(qc.data_ptr<at::BFloat16>(), k_cache.data_ptr<at::BFloat16>(), v_cache.data_ptr<at::BFloat16>(),
                     tables.data_ptr<int64_t>(), lens.data_ptr<int64_t>(), starts.data_ptr<int64_t>(),
                     out.data_ptr<float>(), S, H, KVH, BS, W, stride, static_cast<float>(scale));
    return out.to(q.scalar_type());
  }
#endif
  auto qf = q.to(torch::kFloat32).contiguous();
#if defined(SERVELAB_AVX2_DECODE)
  if (prefill_vector(k_cache)) {
    if (k_cache.scalar_type() == torch::kBFloat16)
      prefill_avx2(qf.data_ptr<float>(), k_cache.data_ptr<at::BFloat16>(), v_cache.data_ptr<at::BFloat16>(),
                   tables.data_ptr<int64_t>(), lens.data_ptr<int64_t>(), starts.data_ptr<int64_t>(),
                   out.data_ptr<float>(), S, H, KVH, BS, D, W, stride, static_cast<float>(scale));
    else
      prefill_avx2(qf.data_ptr<float>(), k_cache.data_ptr<float>(), v_cache.data_ptr<float>(),
                   tables.data_ptr<int64_t>(), lens.data_ptr<int64_t>(), starts.data_ptr<int64_t>(),
                   out.data_ptr<float>(), S, H, KVH, BS, D, W, stride, static_cast<float>(scale));
    return out.to(q.scalar_type());
  }
#endif
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
