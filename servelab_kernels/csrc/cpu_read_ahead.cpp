// The read-ahead schedule of the two-pass decode kernels (the AVX-512 one in cpu_attention.cpp, the
// AVX2 one in cpu_decode_avx2.cpp): a prelude of both. Per (sequence, KV head) task the key pass asks
// for the block after next while a block computes, then, past the last key block, for the task's
// first value blocks; the value pass asks for the block after next, then for the next task's first
// key blocks. Each is asked for into L2 a tile's slice at a time (a burst at a block's start evicted
// the lines in use). Only addresses: a prefetch changes no result.
#include <algorithm>
#include <cstdint>

template <typename KV>
struct ReadAhead {
  const KV* kc;
  const KV* vc;
  const int64_t* tables;    // [sequences, W] block ids
  const int64_t* ctx_lens;  // [sequences]
  int64_t KVH, BS, D, W, stride_blk;

  // KV head h's run of block j of sequence b
  const char* block(const KV* cache, int64_t b, int64_t h, int64_t j) const {
    return reinterpret_cast<const char*>(cache + tables[b * W + j] * stride_blk + h * BS * D);
  }
  // while key block j of nblk computes
  const char* during_keys(int64_t b, int64_t h, int64_t j, int64_t nblk) const {
    if (j + 2 < nblk) return block(kc, b, h, j + 2);
    return j + 2 - nblk < std::min<int64_t>(2, nblk) ? block(vc, b, h, j + 2 - nblk) : nullptr;
  }
  // while value block j of nblk of `task` computes; null past the thread's last task
  const char* during_values(int64_t task, int64_t end, int64_t j, int64_t nblk) const {
    const int64_t b = task / KVH, h = task % KVH;
    if (j + 2 < nblk) return block(vc, b, h, j + 2);
    if (task + 1 >= end) return nullptr;
    const int64_t nb = (task + 1) / KVH, nh = (task + 1) % KVH, u = j + 2 - nblk;
    return u * BS < ctx_lens[nb] ? block(kc, nb, nh, u) : nullptr;
  }
  // an INT8 cache's fp16 scales of key block j + 2 (both caches'), while key block j computes
  void scales(const void* ks, const void* vs, int64_t b, int64_t h, int64_t j, int64_t nblk) const {
    if (j + 2 >= nblk) return;
    const int64_t at = (tables[b * W + j + 2] * KVH + h) * BS * 2;
    slice(static_cast<const char*>(ks) + at, 0, BS * 2);
    slice(static_cast<const char*>(vs) + at, 0, BS * 2);
  }
  // bytes [from, to) of p into L2, a line at a time (nothing for a null p)
  static void slice(const char* p, int64_t from, int64_t to) {
    if (p)
      for (int64_t off = from; off < to; off += 64) __builtin_prefetch(p + off, 0, 2);
  }
};
