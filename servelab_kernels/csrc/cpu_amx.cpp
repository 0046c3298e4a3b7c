// AMX tiles (Sapphire Rapids and later), shared by the kernels that use them (cpu_quant's INT8
// GEMM, cpu_gemm_amx's bf16 GEMM, cpu_attention's decode and prefill): the tile configuration and
// the request for the tile state. Built in front of those sources (servelab_kernels.cpp_build.build's
// `prelude`), in the same translation unit.
#if defined(__AMX_TILE__) && defined(__AVX512F__) && !defined(SERVELAB_PORTABLE)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <cstdint>
#define SERVELAB_AMX_TILES 1
namespace amx {

struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Linux hands out the tile state only on request (once per process; oneDNN asks the same way).
inline bool permitted() {
  static const bool ok = [] {
    constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  }();
  return ok;
}

// Every tile 16 rows of 64 bytes (the largest), as the GEMMs and the prefill kernel use them.
inline void configure_full() {
  TileConfig c;
  for (int t = 0; t < 8; ++t) {
    c.rows[t] = 16;
    c.colsb[t] = 64;
  }
  _tile_loadconfig(&c);
}

}  // namespace amx
#endif
