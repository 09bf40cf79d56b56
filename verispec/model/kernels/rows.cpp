// Row-invariant CPU kernels for verispec's lean forward (verispec/model/kernels/rows.py).
//
// A verification block multiplies every weight by 2..17 rows; torch's int4 kernel is a
// matrix-vector kernel and costs nearly a full pass per row. These kernels read (and for 4-bit
// codes, unpack) each weight tile once and apply it to every row of the block, and each row's
// arithmetic is the same sequence of instructions whatever the number of rows, the row's place
// in the block, or the thread that runs it: a row's result is a function of that row alone
// (row invariance by construction, docs/invariance.md).
//
// Products (x [M, K] -> [M, N], float32 accumulation):
//   * codes: weights w[n, k] = code[n, k] * scale[n, g] + min[n, g] over groups g of G = 16 or 32
//     input columns, codes stored as 4-bit nibbles (GGUF Q4_0 / Q4_1 / Q4_K) or signed bytes
//     (up to 8-bit codes: Q5_0, Q6_K, Q8_0). The codes are exact in bfloat16, so each group's
//     sum(code * x) is a chain of bfloat16 dot products (AVX512-BF16 vdpbf16ps) on x rounded to
//     bfloat16; then y += sum * scale + sum(x over the group) * min, in float32.
//   * dense: bfloat16 weights (a bfloat16 target's layers, LM heads), the same dot products.
// Attention: each query row over exactly the keys it sees, in cache order (a causal row i over
// the first L - n + i + 1 keys, a tree row over its mask's keys), float32 arithmetic (the AMX
// class's scores over a bfloat16 cache: tiles, see attention_tiles).
//
// Layouts (made once at load by rows.py): output columns come in tiles of 16 (one 512-bit lane
// each). For tile t and group g, codes are 16 * G / 2 bytes: byte 32 q + 2 j + e holds, in its
// low nibble, the code of output 16 t + j at input g G + 4 q + e, and in its high nibble the one
// at g G + 4 q + 2 + e (byte codes: G * 16 bytes, byte 32 p + 2 j + e the code at g G + 2 p + e).
// Scales and minimums: [tiles, groups, 16] float32. Dense weights: [tiles, K / 32, 16, 16, 2]
// bfloat16, element [t, c, p, j, e] the weight of output 16 t + j at input 32 c + 2 p + e.
//
// Kernel classes (rows.py's CLASSES; `isa` arguments): AVX512-BF16 (the above), AVX2/FMA (the
// same bits, eight lanes at a time) and AMX-BF16 (16-row tiles). Each is compiled for its
// instruction set by function attributes; the rest of the file is plain x86-64, so the library
// loads anywhere and `features()` says which classes this CPU can run.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define VERISPEC_X86 1
#define AVX512_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma,f16c")))
#define AVX2 __attribute__((target("avx2,fma,f16c")))
#else
#define VERISPEC_X86 0
#endif

// AMX where the compiler has its intrinsics (GCC 11+, clang); elsewhere the class is left out.
// VERISPEC_AMX_EMULATED (build.py, for the tests only) runs the same class with the tile
// instructions emulated in AVX-512 on a CPU without AMX: see the AMX section.
#if VERISPEC_X86 && defined(VERISPEC_AMX_EMULATED)
#define VERISPEC_AMX 1
#define AMX_BF16 AVX512_BF16
#elif VERISPEC_X86 && (defined(__clang__) || __GNUC__ >= 11)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#define VERISPEC_AMX 1
#define AMX_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma,f16c,amx-tile,amx-bf16")))
#else
#define VERISPEC_AMX 0
#endif

namespace {

// Rows whose accumulators a product keeps at once (a larger M runs in chunks of this many rows;
// a row's arithmetic does not depend on its chunk).
constexpr int64_t ROW_CHUNK = 32;
constexpr int64_t TILE = 16;
// How far ahead (bytes) the products prefetch the weights they stream: the hardware prefetcher
// alone left a 16-row product over weights from memory at a fifth of its in-cache speed.
constexpr int64_t PREFETCH = 4096;

bool avx512_bf16() {
#if VERISPEC_X86
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
         __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("fma");
#else
  return false;
#endif
}

bool avx2() {
#if VERISPEC_X86
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
  return false;
#endif
}

// AMX-BF16 tiles, with the process's permission to use them (Linux grants tile state on request:
// arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA), asked once).
bool amx_bf16() {
#if defined(VERISPEC_AMX_EMULATED)
  return avx512_bf16();  // the emulation's tiles are AVX-512 code
#elif VERISPEC_AMX
  static const bool granted = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    const bool tile = d & (1u << 24), bf16 = d & (1u << 22);
    constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return tile && bf16 && avx512_bf16() && syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  }();
  return granted;
#else
  return false;
#endif
}

// The kernel classes (rows.py's CLASSES). AVX2 spells AVX512-BF16's arithmetic with float32 FMAs
// (the same bits, see the AVX2 section); AMX-BF16 runs products as 16-row tiles (its own bits)
// and attends as AVX512-BF16 does.
enum Isa : int64_t { ISA_AVX2 = 0, ISA_AVX512_BF16 = 1, ISA_AMX_BF16 = 2 };

bool runs(int64_t isa) {
  return isa == ISA_AVX2 ? avx2() : isa == ISA_AVX512_BF16 ? avx512_bf16() : isa == ISA_AMX_BF16 && amx_bf16();
}

void check(bool ok, const char* what) { TORCH_CHECK(ok, "verispec row kernels: ", what); }

#if VERISPEC_X86

// x [M, K] (float32 or bfloat16) -> bfloat16 bits [M, K], rounded to nearest even.
AVX512_BF16 void to_bf16(const at::Tensor& x, uint16_t* out) {
  const int64_t numel = x.numel();
  if (x.scalar_type() == at::kBFloat16) {
    std::memcpy(out, x.data_ptr(), numel * 2);
    return;
  }
  const float* src = x.data_ptr<float>();
  int64_t i = 0;
  for (; i + 16 <= numel; i += 16) {
    __m256bh h = _mm512_cvtneps_pbh(_mm512_loadu_ps(src + i));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), (__m256i)h);
  }
  if (i < numel) {
    __mmask16 tail = (__mmask16)((1u << (numel - i)) - 1);
    __m256bh h = _mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(tail, src + i));
    _mm256_mask_storeu_epi16(out + i, tail, (__m256i)h);
  }
}

// Sum of each group of G bfloat16 values of a row, in float32 (pairs, then a fixed tree).
template <int G>
AVX512_BF16 void group_sums(const uint16_t* xb, int64_t M, int64_t K, float* sums) {
  const __m512bh ones = (__m512bh)_mm512_set1_epi16(0x3f80);
  for (int64_t r = 0; r < M; ++r) {
    for (int64_t g = 0; g < K / G; ++g) {
      const uint16_t* p = xb + r * K + g * G;
      __m512 pairs = _mm512_setzero_ps();
      for (int i = 0; i < G; i += 32) {
        __m512i v = G >= 32 ? _mm512_loadu_si512(p + i)
                            : _mm512_maskz_loadu_epi16(0xffff, p + i);
        pairs = _mm512_dpbf16_ps(pairs, (__m512bh)v, ones);
      }
      sums[r * (K / G) + g] = _mm512_reduce_add_ps(pairs);
    }
  }
}

// One row's sum over a tile-group: P pair registers against the row's G inputs, four chains.
template <int P>
AVX512_BF16 inline __m512 dot_rows(const __m512bh* w, const uint32_t* x) {
  __m512 c0 = _mm512_setzero_ps(), c1 = _mm512_setzero_ps();
  __m512 c2 = _mm512_setzero_ps(), c3 = _mm512_setzero_ps();
#pragma GCC unroll 16
  for (int i = 0; i < P; i += 4) {
    c0 = _mm512_dpbf16_ps(c0, w[i], (__m512bh)_mm512_set1_epi32(x[i]));
    c1 = _mm512_dpbf16_ps(c1, w[i + 1], (__m512bh)_mm512_set1_epi32(x[i + 1]));
    c2 = _mm512_dpbf16_ps(c2, w[i + 2], (__m512bh)_mm512_set1_epi32(x[i + 2]));
    c3 = _mm512_dpbf16_ps(c3, w[i + 3], (__m512bh)_mm512_set1_epi32(x[i + 3]));
  }
  return _mm512_add_ps(_mm512_add_ps(c0, c1), _mm512_add_ps(c2, c3));
}

// Unpacks one tile-group of codes into P registers of bfloat16 pairs.
template <int P, bool NIBBLES>
AVX512_BF16 inline void unpack(const uint8_t* codes, __m512bh* w) {
  if constexpr (NIBBLES) {
    // bfloat16 of 0..15 in words 0..15: the codes index it
    const __m512i table = _mm512_set_epi16(
        0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
        0x4170, 0x4160, 0x4150, 0x4140, 0x4130, 0x4120, 0x4110, 0x4100,
        0x40e0, 0x40c0, 0x40a0, 0x4080, 0x4040, 0x4000, 0x3f80, 0x0000);
    const __m512i low = _mm512_set1_epi16(0x0f);
#pragma GCC unroll 8
    for (int q = 0; q < P / 2; ++q) {
      __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + 32 * q)));
      w[2 * q] = (__m512bh)_mm512_permutexvar_epi16(_mm512_and_si512(v, low), table);
      w[2 * q + 1] = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(v, 4), table);
    }
  } else {
#pragma GCC unroll 16
    for (int p = 0; p < P; ++p) {
      __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + 32 * p));
      __m128i b2 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + 32 * p + 16));
      __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
      __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b2));
      w[p] = _mm512_cvtne2ps_pbh(hi, lo);  // exact: codes are small integers
    }
  }
}

template <bool HALF>
AVX512_BF16 inline __m512 load_scales(const void* p, int64_t at) {
  if constexpr (HALF) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(p) + at)));
  } else {
    return _mm512_loadu_ps(static_cast<const float*>(p) + at);
  }
}

// NIBBLES: 4-bit codes (else bytes); HALF: scales and minimums stored as float16 (exactly the
// float32 values: a GGUF block's own); MINS: w = code * scale + min (else code * scale).
template <int G, bool NIBBLES, bool HALF, bool MINS>
AVX512_BF16 void codes_tiles(const uint16_t* xb, const float* xsum, int64_t M, int64_t K,
                             const uint8_t* codes, const void* scales, const void* mins,
                             float* out, int64_t N, int64_t t0, int64_t t1) {
  constexpr int P = G / 2;
  constexpr int64_t BYTES = NIBBLES ? TILE * G / 2 : TILE * G;
  const int64_t groups = K / G;
  alignas(64) float acc[ROW_CHUNK * TILE];
  for (int64_t t = t0; t < t1; ++t) {
    for (int64_t r0 = 0; r0 < M; r0 += ROW_CHUNK) {
      const int64_t rows = std::min(ROW_CHUNK, M - r0);
      for (int64_t r = 0; r < rows; ++r) _mm512_store_ps(acc + r * TILE, _mm512_setzero_ps());
      for (int64_t g = 0; g < groups; ++g) {
        const int64_t tg = t * groups + g;
        for (int64_t line = 0; line < BYTES; line += 64)
          _mm_prefetch(reinterpret_cast<const char*>(codes + tg * BYTES + PREFETCH + line), _MM_HINT_T0);
        _mm_prefetch(static_cast<const char*>(scales) + (tg * TILE) * (HALF ? 2 : 4) + PREFETCH / 4, _MM_HINT_T0);
        if constexpr (MINS)
          _mm_prefetch(static_cast<const char*>(mins) + (tg * TILE) * (HALF ? 2 : 4) + PREFETCH / 4, _MM_HINT_T0);
        __m512bh w[P];
        unpack<P, NIBBLES>(codes + tg * BYTES, w);
        const __m512 s = load_scales<HALF>(scales, tg * TILE);
        __m512 m = _mm512_setzero_ps();
        if constexpr (MINS) m = load_scales<HALF>(mins, tg * TILE);
        for (int64_t r = 0; r < rows; ++r) {
          const uint32_t* x = reinterpret_cast<const uint32_t*>(xb + (r0 + r) * K + g * G);
          __m512 sum = dot_rows<P>(w, x);
          __m512 a = _mm512_load_ps(acc + r * TILE);
          a = _mm512_fmadd_ps(sum, s, a);
          if constexpr (MINS) a = _mm512_fmadd_ps(_mm512_set1_ps(xsum[(r0 + r) * groups + g]), m, a);
          _mm512_store_ps(acc + r * TILE, a);
        }
      }
      for (int64_t r = 0; r < rows; ++r)
        _mm512_storeu_ps(out + (r0 + r) * N + t * TILE, _mm512_load_ps(acc + r * TILE));
    }
  }
}

using CodesKernel = void (*)(const uint16_t*, const float*, int64_t, int64_t, const uint8_t*,
                             const void*, const void*, float*, int64_t, int64_t, int64_t);

template <int G, bool NIBBLES>
CodesKernel pick_codes(bool half, bool mins) {
  if (half) return mins ? codes_tiles<G, NIBBLES, true, true> : codes_tiles<G, NIBBLES, true, false>;
  return mins ? codes_tiles<G, NIBBLES, false, true> : codes_tiles<G, NIBBLES, false, false>;
}

template <bool BF16_OUT>
AVX512_BF16 void dense_tiles(const uint16_t* xb, int64_t M, int64_t K, const uint16_t* weight,
                             void* out, int64_t N, int64_t t0, int64_t t1) {
  constexpr int P = 16;
  const int64_t chunks = K / 32;
  alignas(64) float acc[ROW_CHUNK * TILE];
  for (int64_t t = t0; t < t1; ++t) {
    for (int64_t r0 = 0; r0 < M; r0 += ROW_CHUNK) {
      const int64_t rows = std::min(ROW_CHUNK, M - r0);
      for (int64_t r = 0; r < rows; ++r) _mm512_store_ps(acc + r * TILE, _mm512_setzero_ps());
      for (int64_t c = 0; c < chunks; ++c) {
        const uint16_t* tile = weight + (t * chunks + c) * (TILE * 32);
        for (int64_t line = 0; line < TILE * 32 * 2; line += 64)
          _mm_prefetch(reinterpret_cast<const char*>(tile) + PREFETCH + line, _MM_HINT_T0);
        __m512bh w[P];
#pragma GCC unroll 16
        for (int p = 0; p < P; ++p) w[p] = (__m512bh)_mm512_loadu_si512(tile + 32 * p);
        for (int64_t r = 0; r < rows; ++r) {
          const uint32_t* x = reinterpret_cast<const uint32_t*>(xb + (r0 + r) * K + c * 32);
          __m512 a = _mm512_load_ps(acc + r * TILE);
          _mm512_store_ps(acc + r * TILE, _mm512_add_ps(a, dot_rows<P>(w, x)));
        }
      }
      for (int64_t r = 0; r < rows; ++r) {
        __m512 a = _mm512_load_ps(acc + r * TILE);
        if constexpr (BF16_OUT) {
          uint16_t* o = static_cast<uint16_t*>(out) + (r0 + r) * N + t * TILE;
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(o), (__m256i)_mm512_cvtneps_pbh(a));
        } else {
          _mm512_storeu_ps(static_cast<float*>(out) + (r0 + r) * N + t * TILE, a);
        }
      }
    }
  }
}

// ---- AVX2 / FMA: the same arithmetic, eight lanes at a time ------------------------------------
//
// Every x86 CPU since 2013 has these. They compute the AVX512-BF16 kernels' bits: vdpbf16ps adds
// a pair's two products to a float32 lane one after the other (odd element first), each product of
// two bfloat16 values exact in float32, each addition rounded to nearest even, so two float32 FMAs
// (odd, then even) on bfloat16-valued operands give the same sums; the reductions below spell the
// trees of _mm512_reduce_add_ps and lane_sums. (vdpbf16ps also reads subnormal inputs as zero and
// flushes subnormal sums: the conversion to bfloat16 here does the first; the second, sums under
// 1e-38, is not reproduced.) A 16-output tile is two 8-lane halves; weights are unpacked to float32
// once per tile and group into a buffer in L1, then applied to every row, four rows at a time
// (dot_block_avx2: each row's instructions in a lone row's order, so its bits do not depend on
// whether it came in a block of four). A lone row and a pair of rows read 4-bit and 8-bit codes
// straight into their chains instead (dot_codes_avx2, dot_codes_pair_rows_avx2).

// x [M, K] (float32 or bfloat16) -> its values rounded to bfloat16 (nearest even, subnormals to
// zero: _mm512_cvtneps_pbh's rounding), as float32.
AVX2 void to_bf16_floats(const at::Tensor& x, float* out) {
  const int64_t numel = x.numel();
  if (x.scalar_type() == at::kBFloat16) {
    const uint16_t* src = reinterpret_cast<const uint16_t*>(x.data_ptr());
    int64_t i = 0;
    for (; i + 8 <= numel; i += 8) {
      __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i)));
      _mm256_storeu_ps(out + i, _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)));
    }
    for (; i < numel; ++i) {
      uint32_t bits = static_cast<uint32_t>(src[i]) << 16;
      std::memcpy(out + i, &bits, 4);
    }
    return;
  }
  const float* src = x.data_ptr<float>();
  const __m256i one = _mm256_set1_epi32(1), half = _mm256_set1_epi32(0x7fff);
  const __m256i exponent = _mm256_set1_epi32(0x7f800000), sign = _mm256_set1_epi32(static_cast<int>(0x80000000u));
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
  int64_t i = 0;
  for (; i + 8 <= numel; i += 8) {
    __m256i b = _mm256_castps_si256(_mm256_loadu_ps(src + i));
    const __m256i subnormal = _mm256_cmpeq_epi32(_mm256_and_si256(b, exponent), _mm256_setzero_si256());
    b = _mm256_blendv_epi8(b, _mm256_and_si256(b, sign), subnormal);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), one);
    b = _mm256_and_si256(_mm256_add_epi32(b, _mm256_add_epi32(half, lsb)), high);
    _mm256_storeu_ps(out + i, _mm256_castsi256_ps(b));
  }
  for (; i < numel; ++i) {
    uint32_t b;
    std::memcpy(&b, src + i, 4);
    if ((b & 0x7f800000u) == 0) b &= 0x80000000u;
    b = (b + 0x7fffu + ((b >> 16) & 1u)) & 0xffff0000u;
    std::memcpy(out + i, &b, 4);
  }
}

// _mm512_reduce_add_ps of the 16 lanes (lo: 0..7, hi: 8..15), by its tree.
AVX2 inline float reduce16(__m256 lo, __m256 hi) {
  const __m256 t3 = _mm256_add_ps(hi, lo);
  const __m128 t6 = _mm_add_ps(_mm256_extractf128_ps(t3, 1), _mm256_castps256_ps128(t3));
  const __m128 t8 = _mm_add_ps(t6, _mm_permute_ps(t6, 0x4e));
  return _mm_cvtss_f32(_mm_add_ss(t8, _mm_movehdup_ps(t8)));
}

// group_sums' values: per group, lane l = x[2l + 1] + x[2l] (a vdpbf16ps against ones), reduced.
template <int G>
AVX2 void group_sums_avx2(const float* xf, int64_t M, int64_t K, float* sums) {
  for (int64_t r = 0; r < M; ++r) {
    for (int64_t g = 0; g < K / G; ++g) {
      const float* p = xf + r * K + g * G;
      __m256 lanes[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};  // lanes 0..7, 8..15
      for (int h = 0; h < G / 16; ++h) {
        const __m256 a = _mm256_loadu_ps(p + 16 * h), b = _mm256_loadu_ps(p + 16 * h + 8);
        // even elements (x[2l]) and odd (x[2l + 1]) of 16 inputs, lanes l = 0..7 in order
        const __m256i order = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
        const __m256 pa = _mm256_permutevar8x32_ps(a, order), pb = _mm256_permutevar8x32_ps(b, order);
        const __m256 even = _mm256_permute2f128_ps(pa, pb, 0x20), odd = _mm256_permute2f128_ps(pa, pb, 0x31);
        lanes[h] = _mm256_add_ps(_mm256_add_ps(_mm256_setzero_ps(), odd), even);
      }
      sums[r * (K / G) + g] = reduce16(lanes[0], lanes[1]);
    }
  }
}

// A pair's step of dot_rows_avx2's chain c (c[0]: outputs 0..7, c[1]: 8..15): e1 = the odd
// element's weights, e0 the even's, each [lo, hi]; x the row's inputs of the pair.
AVX2 inline void pair_step_avx2(__m256* c, __m256 e0lo, __m256 e0hi, __m256 e1lo, __m256 e1hi, const float* x) {
  const __m256 x1 = _mm256_broadcast_ss(x + 1), x0 = _mm256_broadcast_ss(x);
  c[0] = _mm256_fmadd_ps(e1lo, x1, c[0]);
  c[1] = _mm256_fmadd_ps(e1hi, x1, c[1]);
  c[0] = _mm256_fmadd_ps(e0lo, x0, c[0]);
  c[1] = _mm256_fmadd_ps(e0hi, x0, c[1]);
}

AVX2 inline void sum_chains_avx2(__m256 (*c)[2], __m256& lo, __m256& hi) {
  lo = _mm256_add_ps(_mm256_add_ps(c[0][0], c[1][0]), _mm256_add_ps(c[2][0], c[3][0]));
  hi = _mm256_add_ps(_mm256_add_ps(c[0][1], c[1][1]), _mm256_add_ps(c[2][1], c[3][1]));
}

// One row's sum over a tile-group: wf [P][2][16] float32 (pair p, element e, output j), x the row's
// G inputs; four chains as dot_rows, each pair odd element first. Returns outputs 0..7, 8..15.
template <int P>
AVX2 inline void dot_rows_avx2(const float* wf, const float* x, __m256& lo, __m256& hi) {
  __m256 c[4][2];
  for (int k = 0; k < 4; ++k) c[k][0] = c[k][1] = _mm256_setzero_ps();
#pragma GCC unroll 16
  for (int i = 0; i < P; ++i) {
    const float* w = wf + i * 32;
    pair_step_avx2(c[i % 4], _mm256_load_ps(w), _mm256_load_ps(w + 8), _mm256_load_ps(w + 16),
                   _mm256_load_ps(w + 24), x + 2 * i);
  }
  sum_chains_avx2(c, lo, hi);
}

// dot_rows_avx2 for R rows at once, each row's sums the same instructions in the same order (so
// the same bits): one chain at a time, its weights loaded once for the R rows. One row at a time
// loads six values (four weight vectors, two inputs) per four FMAs, which bounds it by loads;
// four rows load twelve per sixteen. (For fewer rows the chains interleave: dot_rows_avx2.)
template <int P, int R>
AVX2 inline void dot_block_avx2(const float* wf, const float* const* xs, __m256* lo, __m256* hi) {
  __m256 c[4][R][2];
#pragma GCC unroll 4
  for (int k = 0; k < 4; ++k) {
    __m256 a[R][2];
    for (int r = 0; r < R; ++r) a[r][0] = a[r][1] = _mm256_setzero_ps();
#pragma GCC unroll 4
    for (int i = k; i < P; i += 4) {
      const float* w = wf + i * 32;
      const __m256 w0 = _mm256_load_ps(w), w1 = _mm256_load_ps(w + 8);
      const __m256 w2 = _mm256_load_ps(w + 16), w3 = _mm256_load_ps(w + 24);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const __m256 x1 = _mm256_broadcast_ss(xs[r] + 2 * i + 1), x0 = _mm256_broadcast_ss(xs[r] + 2 * i);
        a[r][0] = _mm256_fmadd_ps(w2, x1, a[r][0]);
        a[r][1] = _mm256_fmadd_ps(w3, x1, a[r][1]);
        a[r][0] = _mm256_fmadd_ps(w0, x0, a[r][0]);
        a[r][1] = _mm256_fmadd_ps(w1, x0, a[r][1]);
      }
    }
    for (int r = 0; r < R; ++r) c[k][r][0] = a[r][0], c[k][r][1] = a[r][1];
  }
  for (int r = 0; r < R; ++r) {
    lo[r] = _mm256_add_ps(_mm256_add_ps(c[0][r][0], c[1][r][0]), _mm256_add_ps(c[2][r][0], c[3][r][0]));
    hi[r] = _mm256_add_ps(_mm256_add_ps(c[0][r][1], c[1][r][1]), _mm256_add_ps(c[2][r][1], c[3][r][1]));
  }
}

constexpr int64_t AVX2_BLOCK = 4;  // rows dot_block_avx2 takes at once

// unpack_avx2's values in registers: the 4 bits at `shift` of each 32-bit lane; a lane's signed
// low and high 16 bits.
AVX2 inline __m256 nibble_avx2(__m256i v, int shift, __m256i low) {
  return _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(v, shift), low));
}
AVX2 inline __m256 low_half_avx2(__m256i v) { return _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(v, 16), 16)); }
AVX2 inline __m256 high_half_avx2(__m256i v) { return _mm256_cvtepi32_ps(_mm256_srai_epi32(v, 16)); }

// A lone row's dot_rows_avx2 straight from a tile-group's codes (unpack_avx2's values, never
// stored): the same values in the same chains and order, so the same bits, without writing and
// reading back the unpacked buffer, which a lone row, using each value once, cannot amortise.
template <int P, bool NIBBLES>
AVX2 inline void dot_codes_avx2(const uint8_t* codes, const float* x, __m256& lo, __m256& hi) {
  __m256 c[4][2];
  for (int k = 0; k < 4; ++k) c[k][0] = c[k][1] = _mm256_setzero_ps();
  if constexpr (NIBBLES) {
    const __m256i low = _mm256_set1_epi32(0x0f);
#pragma GCC unroll 8
    for (int q = 0; q < P / 2; ++q) {  // pairs 2q (low nibbles) and 2q + 1 (high)
      const uint8_t* b = codes + 32 * q;
      const __m256i v0 = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b)));
      const __m256i v1 = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 16)));
      pair_step_avx2(c[(2 * q) % 4], nibble_avx2(v0, 0, low), nibble_avx2(v1, 0, low), nibble_avx2(v0, 16, low),
                     nibble_avx2(v1, 16, low), x + 4 * q);
      pair_step_avx2(c[(2 * q + 1) % 4], nibble_avx2(v0, 4, low), nibble_avx2(v1, 4, low),
                     nibble_avx2(v0, 20, low), nibble_avx2(v1, 20, low), x + 4 * q + 2);
    }
  } else {
#pragma GCC unroll 16
    for (int p = 0; p < P; ++p) {
      const uint8_t* b = codes + 32 * p;
      const __m256i v0 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b)));
      const __m256i v1 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 16)));
      pair_step_avx2(c[p % 4], low_half_avx2(v0), low_half_avx2(v1), high_half_avx2(v0), high_half_avx2(v1),
                     x + 2 * p);
    }
  }
  sum_chains_avx2(c, lo, hi);
}

// A lone row's dot_rows_avx2 straight from a bfloat16 tile chunk [16 outputs][32 inputs] in pair
// words (dense_tiles_avx2's values, never stored).
AVX2 inline void dot_dense_avx2(const uint16_t* tile, const float* x, __m256& lo, __m256& hi) {
  __m256 c[4][2];
  for (int k = 0; k < 4; ++k) c[k][0] = c[k][1] = _mm256_setzero_ps();
  const __m256i top = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
#pragma GCC unroll 16
  for (int p = 0; p < 16; ++p) {
    const __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(tile + 32 * p));
    const __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(tile + 32 * p + 16));
    pair_step_avx2(c[p % 4], _mm256_castsi256_ps(_mm256_slli_epi32(v0, 16)),
                   _mm256_castsi256_ps(_mm256_slli_epi32(v1, 16)), _mm256_castsi256_ps(_mm256_and_si256(v0, top)),
                   _mm256_castsi256_ps(_mm256_and_si256(v1, top)), x + 2 * p);
  }
  sum_chains_avx2(c, lo, hi);
}

// dot_codes_avx2 for two rows (inputs x0, x1) at once: each pair's codes unpacked in registers
// once for both (unpacking costs three instructions a vector, a row's multiply-add one), each
// row's sums the same instructions in the same order as a lone row's, so the same bits. Two of
// the four chains at a time (pairs 4j + 2h and 4j + 2h + 1 share their bytes), so that the eight
// sums stay in registers; the passes are a loop of two, not unrolled, so that the compiler cannot
// interleave them, and this is a function of its own, so that the lone row's code beside it
// compiles as before (docs/kernels.md, "Two to four rows straight from the codes").
template <int P, bool NIBBLES>
AVX2 __attribute__((noinline)) void dot_codes_pair_rows_avx2(const uint8_t* codes, const float* x0,
                                                             const float* x1, __m256* lo, __m256* hi) {
  __m256 c[2][4][2];  // [row][chain][outputs 0..7, 8..15]
  const __m256i low = _mm256_set1_epi32(0x0f);
#pragma GCC unroll 1
  for (int h = 0; h < 2; ++h) {  // chains 2h and 2h + 1
    __m256 a[2][2][2];
    for (int k = 0; k < 2; ++k)
      for (int r = 0; r < 2; ++r) a[k][r][0] = a[k][r][1] = _mm256_setzero_ps();
#pragma GCC unroll 4
    for (int j = 0; j < P / 4; ++j) {
      const int i = 4 * j + 2 * h;  // pairs i and i + 1
      if constexpr (NIBBLES) {  // pair i the low nibbles of bytes 16i.., i + 1 the high ones
        const __m256i v0 = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + 16 * i)));
        const __m256i v1 = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + 16 * i + 16)));
        for (int e = 0; e < 2; ++e) {
          const __m256 e0lo = nibble_avx2(v0, 4 * e, low), e0hi = nibble_avx2(v1, 4 * e, low);
          const __m256 e1lo = nibble_avx2(v0, 4 * e + 16, low), e1hi = nibble_avx2(v1, 4 * e + 16, low);
          pair_step_avx2(a[e][0], e0lo, e0hi, e1lo, e1hi, x0 + 2 * (i + e));
          pair_step_avx2(a[e][1], e0lo, e0hi, e1lo, e1hi, x1 + 2 * (i + e));
        }
      } else {
        for (int e = 0; e < 2; ++e) {
          const uint8_t* b = codes + 32 * (i + e);
          const __m256i v0 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b)));
          const __m256i v1 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 16)));
          const __m256 e0lo = low_half_avx2(v0), e0hi = low_half_avx2(v1);
          const __m256 e1lo = high_half_avx2(v0), e1hi = high_half_avx2(v1);
          pair_step_avx2(a[e][0], e0lo, e0hi, e1lo, e1hi, x0 + 2 * (i + e));
          pair_step_avx2(a[e][1], e0lo, e0hi, e1lo, e1hi, x1 + 2 * (i + e));
        }
      }
    }
    for (int k = 0; k < 2; ++k)
      for (int r = 0; r < 2; ++r) c[r][2 * h + k][0] = a[k][r][0], c[r][2 * h + k][1] = a[k][r][1];
  }
  for (int r = 0; r < 2; ++r) sum_chains_avx2(c[r], lo[r], hi[r]);
}

// A row's tile-group sums into its accumulators a [16]: a += sum * scale (+ sum(x) * min).
template <bool MINS>
AVX2 inline void scale_into_avx2(float* a, __m256 lo, __m256 hi, __m256 s0, __m256 s1, __m256 m0,
                                 __m256 m1, const float* row_sums, int64_t at) {
  __m256 a0 = _mm256_fmadd_ps(lo, s0, _mm256_load_ps(a)), a1 = _mm256_fmadd_ps(hi, s1, _mm256_load_ps(a + 8));
  if constexpr (MINS) {
    const __m256 sum = _mm256_set1_ps(row_sums[at]);
    a0 = _mm256_fmadd_ps(sum, m0, a0), a1 = _mm256_fmadd_ps(sum, m1, a1);
  }
  _mm256_store_ps(a, a0), _mm256_store_ps(a + 8, a1);
}

AVX2 inline void add_into_avx2(float* a, __m256 lo, __m256 hi) {
  _mm256_store_ps(a, _mm256_add_ps(_mm256_load_ps(a), lo));
  _mm256_store_ps(a + 8, _mm256_add_ps(_mm256_load_ps(a + 8), hi));
}

// Sixteen codes of one pair register (bytes 2j + e of `bytes`, j = 0..7 per 16 bytes) -> wf's
// [2][16] float32 for that pair; NIBBLES: the low nibbles for `pair` and the high for `pair + 1`.
template <bool NIBBLES>
AVX2 inline void unpack_avx2(const uint8_t* bytes, float* wf) {
  for (int half = 0; half < 2; ++half) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes + 16 * half));
    if constexpr (NIBBLES) {
      const __m256i v = _mm256_cvtepu8_epi16(b);  // 32-bit lane j: e = 0 in bits 0..7, e = 1 in 16..23
      const __m256i low = _mm256_set1_epi32(0x0f);
      _mm256_store_ps(wf + 8 * half, _mm256_cvtepi32_ps(_mm256_and_si256(v, low)));
      _mm256_store_ps(wf + 16 + 8 * half, _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(v, 16), low)));
      _mm256_store_ps(wf + 32 + 8 * half, _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(v, 4), low)));
      _mm256_store_ps(wf + 48 + 8 * half, _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(v, 20), low)));
    } else {
      const __m256i v = _mm256_cvtepi8_epi16(b);
      _mm256_store_ps(wf + 8 * half, _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(v, 16), 16)));
      _mm256_store_ps(wf + 16 + 8 * half, _mm256_cvtepi32_ps(_mm256_srai_epi32(v, 16)));
    }
  }
}

template <bool HALF>
AVX2 inline __m256 load_scales_avx2(const void* p, int64_t at) {
  if constexpr (HALF) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(p) + at)));
  } else {
    return _mm256_loadu_ps(static_cast<const float*>(p) + at);
  }
}

template <int G, bool NIBBLES, bool HALF, bool MINS>
AVX2 void codes_tiles_avx2(const float* xf, const float* xsum, int64_t M, int64_t K,
                           const uint8_t* codes, const void* scales, const void* mins,
                           float* out, int64_t N, int64_t t0, int64_t t1) {
  constexpr int P = G / 2;
  constexpr int64_t BYTES = NIBBLES ? TILE * G / 2 : TILE * G;
  const int64_t groups = K / G;
  alignas(64) float acc[ROW_CHUNK * TILE];
  alignas(64) float wf[P * 32];
  for (int64_t t = t0; t < t1; ++t) {
    for (int64_t r0 = 0; r0 < M; r0 += ROW_CHUNK) {
      const int64_t rows = std::min(ROW_CHUNK, M - r0);
      std::fill(acc, acc + rows * TILE, 0.0f);
      for (int64_t g = 0; g < groups; ++g) {
        const int64_t tg = t * groups + g;
        for (int64_t line = 0; line < BYTES; line += 64)
          _mm_prefetch(reinterpret_cast<const char*>(codes + tg * BYTES + PREFETCH + line), _MM_HINT_T0);
        const uint8_t* c = codes + tg * BYTES;
        const __m256 s0 = load_scales_avx2<HALF>(scales, tg * TILE), s1 = load_scales_avx2<HALF>(scales, tg * TILE + 8);
        __m256 m0 = _mm256_setzero_ps(), m1 = _mm256_setzero_ps();
        if constexpr (MINS) m0 = load_scales_avx2<HALF>(mins, tg * TILE), m1 = load_scales_avx2<HALF>(mins, tg * TILE + 8);
        const float* row_sums = MINS ? xsum + r0 * groups + g : nullptr;  // row r's: [r * groups]
        if (rows == 1) {  // a lone row: the codes straight into the chains (the same bits)
          __m256 lo, hi;
          dot_codes_avx2<P, NIBBLES>(c, xf + r0 * K + g * G, lo, hi);
          scale_into_avx2<MINS>(acc, lo, hi, s0, s1, m0, m1, row_sums, 0);
          continue;
        }
        if (rows == 2) {  // two rows (a draft of one token and its check): the codes straight in too
          __m256 lo[2], hi[2];
          dot_codes_pair_rows_avx2<P, NIBBLES>(c, xf + r0 * K + g * G, xf + (r0 + 1) * K + g * G, lo, hi);
          for (int64_t r = 0; r < 2; ++r)
            scale_into_avx2<MINS>(acc + r * TILE, lo[r], hi[r], s0, s1, m0, m1, row_sums, r * groups);
          continue;
        }
        if constexpr (NIBBLES) {
          for (int q = 0; q < P / 2; ++q) unpack_avx2<true>(c + 32 * q, wf + 64 * q);
        } else {
          for (int p = 0; p < P; ++p) unpack_avx2<false>(c + 32 * p, wf + 32 * p);
        }
        int64_t r = 0;
        for (; r + AVX2_BLOCK <= rows; r += AVX2_BLOCK) {
          const float* xs[AVX2_BLOCK];
          for (int64_t b = 0; b < AVX2_BLOCK; ++b) xs[b] = xf + (r0 + r + b) * K + g * G;
          __m256 lo[AVX2_BLOCK], hi[AVX2_BLOCK];
          dot_block_avx2<P, AVX2_BLOCK>(wf, xs, lo, hi);
          for (int64_t b = 0; b < AVX2_BLOCK; ++b)
            scale_into_avx2<MINS>(acc + (r + b) * TILE, lo[b], hi[b], s0, s1, m0, m1, row_sums, (r + b) * groups);
        }
        for (; r < rows; ++r) {
          __m256 lo, hi;
          dot_rows_avx2<P>(wf, xf + (r0 + r) * K + g * G, lo, hi);
          scale_into_avx2<MINS>(acc + r * TILE, lo, hi, s0, s1, m0, m1, row_sums, r * groups);
        }
      }
      for (int64_t r = 0; r < rows; ++r) std::memcpy(out + (r0 + r) * N + t * TILE, acc + r * TILE, TILE * 4);
    }
  }
}

using CodesKernelAvx2 = void (*)(const float*, const float*, int64_t, int64_t, const uint8_t*,
                                 const void*, const void*, float*, int64_t, int64_t, int64_t);

template <int G, bool NIBBLES>
CodesKernelAvx2 pick_codes_avx2(bool half, bool mins) {
  if (half) return mins ? codes_tiles_avx2<G, NIBBLES, true, true> : codes_tiles_avx2<G, NIBBLES, true, false>;
  return mins ? codes_tiles_avx2<G, NIBBLES, false, true> : codes_tiles_avx2<G, NIBBLES, false, false>;
}

// float32 lanes -> bfloat16 bits (nearest even; finite values as _mm512_cvtneps_pbh).
AVX2 inline void store_bf16_avx2(uint16_t* o, __m256 v) {
  __m256i b = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  b = _mm256_srli_epi32(_mm256_add_epi32(b, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb)), 16);
  const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(o), packed);
}

template <bool BF16_OUT>
AVX2 void dense_tiles_avx2(const float* xf, int64_t M, int64_t K, const uint16_t* weight,
                           void* out, int64_t N, int64_t t0, int64_t t1) {
  constexpr int P = 16;
  const int64_t chunks = K / 32;
  alignas(64) float acc[ROW_CHUNK * TILE];
  alignas(64) float wf[P * 32];
  const __m256i top = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
  for (int64_t t = t0; t < t1; ++t) {
    for (int64_t r0 = 0; r0 < M; r0 += ROW_CHUNK) {
      const int64_t rows = std::min(ROW_CHUNK, M - r0);
      std::fill(acc, acc + rows * TILE, 0.0f);
      for (int64_t c = 0; c < chunks; ++c) {
        const uint16_t* tile = weight + (t * chunks + c) * (TILE * 32);
        for (int64_t line = 0; line < TILE * 32 * 2; line += 64)
          _mm_prefetch(reinterpret_cast<const char*>(tile) + PREFETCH + line, _MM_HINT_T0);
        if (rows == 1) {  // a lone row: the weights straight into the chains (the same bits)
          __m256 lo, hi;
          dot_dense_avx2(tile, xf + r0 * K + c * 32, lo, hi);
          add_into_avx2(acc, lo, hi);
          continue;
        }
#pragma GCC unroll 16
        for (int p = 0; p < P; ++p) {
          for (int half = 0; half < 2; ++half) {  // a 32-bit word: element 0 low, 1 high
            const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(tile + 32 * p + 16 * half));
            _mm256_store_ps(wf + 32 * p + 8 * half, _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)));
            _mm256_store_ps(wf + 32 * p + 16 + 8 * half, _mm256_castsi256_ps(_mm256_and_si256(v, top)));
          }
        }
        int64_t r = 0;
        for (; r + AVX2_BLOCK <= rows; r += AVX2_BLOCK) {
          const float* xs[AVX2_BLOCK];
          for (int64_t b = 0; b < AVX2_BLOCK; ++b) xs[b] = xf + (r0 + r + b) * K + c * 32;
          __m256 lo[AVX2_BLOCK], hi[AVX2_BLOCK];
          dot_block_avx2<P, AVX2_BLOCK>(wf, xs, lo, hi);
          for (int64_t b = 0; b < AVX2_BLOCK; ++b) add_into_avx2(acc + (r + b) * TILE, lo[b], hi[b]);
        }
        for (; r < rows; ++r) {
          __m256 lo, hi;
          dot_rows_avx2<P>(wf, xf + (r0 + r) * K + c * 32, lo, hi);
          add_into_avx2(acc + r * TILE, lo, hi);
        }
      }
      for (int64_t r = 0; r < rows; ++r) {
        const float* a = acc + r * TILE;
        if constexpr (BF16_OUT) {
          uint16_t* o = static_cast<uint16_t*>(out) + (r0 + r) * N + t * TILE;
          store_bf16_avx2(o, _mm256_load_ps(a));
          store_bf16_avx2(o + 8, _mm256_load_ps(a + 8));
        } else {
          std::memcpy(static_cast<float*>(out) + (r0 + r) * N + t * TILE, a, TILE * 4);
        }
      }
    }
  }
}

// exp_nonpositive's lanes: scalef(p, n) is p * 2^n, exact but for its one rounding, as is the
// product by 2^n built in the exponent field (n >= -126 here: 2^n normal).
AVX2 inline __m256 exp_nonpositive_avx2(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i scale = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(scale));
}

template <typename T>
AVX2 inline __m256 load8(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return _mm256_loadu_ps(p);
  } else {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
}

// (s0 + s1) of u's two 128-bit quarters, s_k = (u[4k] + u[4k+2]) + (u[4k+1] + u[4k+3]).
AVX2 inline float quarter_sums(__m256 u) {
  const __m256 a = _mm256_add_ps(u, _mm256_permute_ps(u, 0x4e));  // [u0+u2, u1+u3, ...]
  const __m256 b = _mm256_add_ps(a, _mm256_permute_ps(a, 0xb1));  // lane 0: s_k
  return _mm_cvtss_f32(_mm_add_ss(_mm256_castps256_ps128(b), _mm256_extractf128_ps(b, 1)));
}

// lane_sums' value for one vector (lanes lo: 0..7, hi: 8..15): (s0 + s1) + (s2 + s3).
AVX2 inline float lane_sum_avx2(__m256 lo, __m256 hi) { return quarter_sums(lo) + quarter_sums(hi); }

// attend's arithmetic for one query head (GB = 1: a head's bits do not depend on GB).
template <int C, typename T>
AVX2 void attend_avx2(const T* q, const T* keys, const T* values, const int32_t* index,
                      int64_t count, int64_t stride, float scale, float* scores, T* out) {
  constexpr int64_t D = 16 * C;
  __m256 qv[2 * C];
  for (int c = 0; c < 2 * C; ++c) qv[c] = load8(q + 8 * c);
  float top = -INFINITY;
  for (int64_t j = 0; j < count; ++j) {
    const T* k = keys + static_cast<int64_t>(index[j]) * D;
    _mm_prefetch(reinterpret_cast<const char*>(keys + static_cast<int64_t>(index[std::min<int64_t>(j + 16, stride - 1)]) * D), _MM_HINT_T0);
    __m256 lo = _mm256_mul_ps(qv[0], load8(k)), hi = _mm256_mul_ps(qv[1], load8(k + 8));
    for (int c = 1; c < C; ++c) {
      lo = _mm256_fmadd_ps(qv[2 * c], load8(k + 16 * c), lo);
      hi = _mm256_fmadd_ps(qv[2 * c + 1], load8(k + 16 * c + 8), hi);
    }
    scores[j] = lane_sum_avx2(lo, hi) * scale;
    top = std::max(top, scores[j]);
  }
  const __m256 peak = _mm256_set1_ps(top);
  __m256 total[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
  for (int64_t j0 = 0; j0 < count; j0 += 8) {  // lanes j0 % 16 / 8 of 16
    const __m256 e = exp_nonpositive_avx2(_mm256_sub_ps(_mm256_loadu_ps(scores + j0), peak));
    const int64_t valid = std::min<int64_t>(8, count - j0);
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256 kept = _mm256_and_ps(e, _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(valid)), lanes)));
    _mm256_storeu_ps(scores + j0, kept);
    total[(j0 / 8) % 2] = _mm256_add_ps(total[(j0 / 8) % 2], kept);
  }
  const __m256 inverse = _mm256_set1_ps(1.0f / reduce16(total[0], total[1]));
  __m256 o[2 * C];
  for (int c = 0; c < 2 * C; ++c) o[c] = _mm256_setzero_ps();
  for (int64_t j = 0; j < count; ++j) {
    const T* v = values + static_cast<int64_t>(index[j]) * D;
    _mm_prefetch(reinterpret_cast<const char*>(values + static_cast<int64_t>(index[std::min<int64_t>(j + 16, stride - 1)]) * D), _MM_HINT_T0);
    const __m256 e = _mm256_set1_ps(scores[j]);
    for (int c = 0; c < 2 * C; ++c) o[c] = _mm256_fmadd_ps(e, load8(v + 8 * c), o[c]);
  }
  for (int c = 0; c < 2 * C; ++c) {
    const __m256 r = _mm256_mul_ps(o[c], inverse);
    if constexpr (std::is_same_v<T, float>) {
      _mm256_storeu_ps(out + 8 * c, r);
    } else {
      store_bf16_avx2(reinterpret_cast<uint16_t*>(out + 8 * c), r);
    }
  }
}

// ---- AMX-BF16: 16-row tiles --------------------------------------------------------------------
//
// A product runs every block of rows as 16-row tiles (the last padded with zero rows), so each
// tdpbf16ps is the same instruction on the same shape whatever the row count: a row's sums are a
// function of its own activations (row invariance by construction; tests/test_row_kernels.py
// checks it on a CPU with AMX). Dense products' tile registers: 0 the 16 x 16 float32 sums, 1 / 2
// a 16 x 32 bfloat16 block of rows and the weights' 16 pairs x 16 outputs (rows.py's packed layout
// is tdpbf16ps's B layout); the codes kernels' are code_tile_config's. A group's sums go through
// memory to the AVX-512 code that scales them, as codes_tiles does. The hardware's order within a
// pair may differ from vdpbf16ps's, so this class's bits are its own.

#if VERISPEC_AMX

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

#if defined(VERISPEC_AMX_EMULATED)
// The tile instructions spelt in AVX-512, so that the tests run this class's own code (its
// layouts, padding and loops) on a CPU without AMX; built only for them (build.py), ~100 times
// slower than the hardware. tdpbf16ps as Intel's intrinsics guide writes it: per row, for each
// pair k, sum += a[2k] * b[k][2n], then sum += a[2k+1] * b[k][2n+1], each rounded to nearest even
// (a product of two bfloat16 values is exact in float32: one FMA each), denormal inputs read as
// zero and denormal results flushed (MXCSR's DAZ and FTZ while it runs). The hardware may order
// its sums otherwise, so the emulation checks the kernels, not AMX's bits.
namespace emulated {

struct Tiles {
  alignas(64) uint8_t data[8][16 * 64];
  uint8_t rows[8];
  uint16_t colsb[8];
};
thread_local Tiles tiles;

inline void load_config(const TileConfig* config) {  // as ldtilecfg: every tile zeroed
  for (int t = 0; t < 8; ++t) tiles.rows[t] = config->rows[t], tiles.colsb[t] = config->colsb[t];
  std::memset(tiles.data, 0, sizeof(tiles.data));
}

inline void zero(int t) { std::memset(tiles.data[t], 0, sizeof(tiles.data[t])); }

inline void load(int t, const void* base, int64_t stride) {
  zero(t);
  for (int r = 0; r < tiles.rows[t]; ++r)
    std::memcpy(tiles.data[t] + r * 64, static_cast<const uint8_t*>(base) + r * stride, tiles.colsb[t]);
}

inline void store(int t, void* base, int64_t stride) {
  for (int r = 0; r < tiles.rows[t]; ++r)
    std::memcpy(static_cast<uint8_t*>(base) + r * stride, tiles.data[t] + r * 64, tiles.colsb[t]);
}

AVX512_BF16 inline float bits_float(uint32_t bits) {
  float value;
  std::memcpy(&value, &bits, 4);
  return value;
}

AVX512_BF16 inline void dpbf16ps(int c, int a, int b) {
  const int pairs = tiles.colsb[a] / 4;
  check(pairs == tiles.rows[b] && tiles.colsb[b] == 64 && tiles.colsb[c] == 64 && tiles.rows[a] == tiles.rows[c],
        "emulated tdpbf16ps: the tiles' shapes disagree");
  const unsigned mxcsr = _mm_getcsr();
  _mm_setcsr(mxcsr | 0x8040);  // FTZ and DAZ
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int m = 0; m < tiles.rows[c]; ++m) {
    float* sums = reinterpret_cast<float*>(tiles.data[c] + m * 64);
    const uint8_t* row = tiles.data[a] + m * 64;
    __m512 acc = _mm512_load_ps(sums);
    for (int k = 0; k < pairs; ++k) {
      uint32_t pair;
      std::memcpy(&pair, row + 4 * k, 4);
      const __m512i weights = _mm512_load_si512(tiles.data[b] + k * 64);  // 16 outputs' pair k
      acc = _mm512_fmadd_ps(_mm512_set1_ps(bits_float(pair << 16)),
                            _mm512_castsi512_ps(_mm512_slli_epi32(weights, 16)), acc);
      acc = _mm512_fmadd_ps(_mm512_set1_ps(bits_float(pair & 0xFFFF0000u)),
                            _mm512_castsi512_ps(_mm512_and_si512(weights, high)), acc);
    }
    _mm512_store_ps(sums, acc);
  }
  _mm_setcsr(mxcsr);
}

}  // namespace emulated

#define TILE_LOADCONFIG(config) emulated::load_config(config)
#define TILE_ZERO(t) emulated::zero(t)
#define TILE_LOAD(t, base, stride) emulated::load(t, base, stride)
#define TILE_STORE(t, base, stride) emulated::store(t, base, stride)
#define TILE_DPBF16PS(c, a, b) emulated::dpbf16ps(c, a, b)
#define TILE_RELEASE() ((void)0)
#else
#define TILE_LOADCONFIG(config) _tile_loadconfig(config)
#define TILE_ZERO(t) _tile_zero(t)
#define TILE_LOAD(t, base, stride) _tile_loadd(t, base, stride)
#define TILE_STORE(t, base, stride) _tile_stored(t, base, stride)
#define TILE_DPBF16PS(c, a, b) _tile_dpbf16ps(c, a, b)
#define TILE_RELEASE() _tile_release()
#endif

// Tile configurations as constants (ldtilecfg reads them from memory): GCC 12 drops a local
// configuration's stores as dead when ldtilecfg is the only reader, and the tile loads then fault.
constexpr TileConfig dense_tile_config() {
  TileConfig config;
  config.colsb[0] = 64, config.rows[0] = 16;  // sums: 16 rows x 16 float32
  config.colsb[1] = 64, config.rows[1] = 16;  // rows: 16 x 32 bfloat16
  config.colsb[2] = 64, config.rows[2] = 16;  // weights: 16 pairs x 16 outputs x 2
  return config;
}

// The codes kernels': 0..2 the sums of three output tiles, 3 a block of rows' G inputs, 4..6 the
// three output tiles' weights for the group (G / 2 pairs x 16 outputs).
template <int G>
constexpr TileConfig code_tile_config() {
  TileConfig config;
  for (int t = 0; t < 3; ++t) config.colsb[t] = 64, config.rows[t] = 16;
  config.colsb[3] = 2 * G, config.rows[3] = 16;
  for (int t = 4; t < 7; ++t) config.colsb[t] = 64, config.rows[t] = G / 2;
  return config;
}

constexpr TileConfig DENSE_TILES = dense_tile_config();
// Attention's (attention_tiles): 0 the scores of 16 keys x 16 queries, 1 16 keys' 32 dimensions,
// 2..7 the queries' dimensions 32 at a time (tdpbf16ps's B layout).
constexpr TileConfig attention_tile_config() {
  TileConfig config;
  for (int t = 0; t < 8; ++t) config.colsb[t] = 64, config.rows[t] = 16;
  return config;
}

constexpr TileConfig ATTENTION_TILES = attention_tile_config();
template <int G>
constexpr TileConfig CODE_TILES = code_tile_config<G>();

// NT (1..3) output tiles t.. for the rows r0..r0 + rows of xb. A group's NT tdpbf16ps write
// their own sum tiles, so they overlap (one output tile's groups, run in turn, would each wait on
// the last one's sums); each group's sums are then scaled into acc [NT][16][16] in group order,
// as in codes_tiles.
template <int G, bool NIBBLES, bool HALF, bool MINS, int NT>
AMX_BF16 inline void code_tiles_amx(const uint16_t* xb, const float* xsum, int64_t r0, int64_t rows, int64_t K,
                                    const uint8_t* codes, const void* scales, const void* mins, float* out,
                                    int64_t N, int64_t t, float* acc, float* sums, uint16_t* weights) {
  constexpr int P = G / 2;
  constexpr int64_t BYTES = NIBBLES ? TILE * G / 2 : TILE * G;
  const int64_t groups = K / G;
  for (int i = 0; i < NT; ++i)
    for (int64_t r = 0; r < rows; ++r) _mm512_store_ps(acc + (i * 16 + r) * TILE, _mm512_setzero_ps());
  for (int64_t g = 0; g < groups; ++g) {
    for (int i = 0; i < NT; ++i) {
      const int64_t tg = (t + i) * groups + g;
      for (int64_t line = 0; line < BYTES; line += 64)
        _mm_prefetch(reinterpret_cast<const char*>(codes + tg * BYTES + PREFETCH + line), _MM_HINT_T0);
      __m512bh w[P];
      unpack<P, NIBBLES>(codes + tg * BYTES, w);
      for (int p = 0; p < P; ++p) _mm512_store_si512(weights + (i * P + p) * 32, (__m512i)w[p]);
    }
    TILE_LOAD(3, xb + r0 * K + g * G, K * 2);
    TILE_ZERO(0);
    TILE_LOAD(4, weights, 64);
    TILE_DPBF16PS(0, 3, 4);
    if constexpr (NT > 1) {
      TILE_ZERO(1);
      TILE_LOAD(5, weights + P * 32, 64);
      TILE_DPBF16PS(1, 3, 5);
    }
    if constexpr (NT > 2) {
      TILE_ZERO(2);
      TILE_LOAD(6, weights + 2 * P * 32, 64);
      TILE_DPBF16PS(2, 3, 6);
    }
    TILE_STORE(0, sums, 64);
    if constexpr (NT > 1) TILE_STORE(1, sums + 16 * TILE, 64);
    if constexpr (NT > 2) TILE_STORE(2, sums + 32 * TILE, 64);
    for (int i = 0; i < NT; ++i) {
      const int64_t tg = (t + i) * groups + g;
      const __m512 s = load_scales<HALF>(scales, tg * TILE);
      __m512 m = _mm512_setzero_ps();
      if constexpr (MINS) m = load_scales<HALF>(mins, tg * TILE);
      for (int64_t r = 0; r < rows; ++r) {
        float* a_at = acc + (i * 16 + r) * TILE;
        __m512 a = _mm512_fmadd_ps(_mm512_load_ps(sums + (i * 16 + r) * TILE), s, _mm512_load_ps(a_at));
        if constexpr (MINS) a = _mm512_fmadd_ps(_mm512_set1_ps(xsum[(r0 + r) * groups + g]), m, a);
        _mm512_store_ps(a_at, a);
      }
    }
  }
  for (int i = 0; i < NT; ++i)
    for (int64_t r = 0; r < rows; ++r)
      _mm512_storeu_ps(out + (r0 + r) * N + (t + i) * TILE, _mm512_load_ps(acc + (i * 16 + r) * TILE));
}

// xb: [Mp, K] bfloat16, Mp = M rounded up to 16, padding rows zero.
template <int G, bool NIBBLES, bool HALF, bool MINS>
AMX_BF16 void codes_tiles_amx(const uint16_t* xb, const float* xsum, int64_t M, int64_t K,
                              const uint8_t* codes, const void* scales, const void* mins,
                              float* out, int64_t N, int64_t t0, int64_t t1) {
  alignas(64) float acc[3 * 16 * TILE];
  alignas(64) float sums[3 * 16 * TILE];
  alignas(64) uint16_t weights[3 * G / 2 * 32];
  TILE_LOADCONFIG(&CODE_TILES<G>);
  for (int64_t r0 = 0; r0 < M; r0 += 16) {
    const int64_t rows = std::min<int64_t>(16, M - r0);
    int64_t t = t0;
    for (; t + 3 <= t1; t += 3)
      code_tiles_amx<G, NIBBLES, HALF, MINS, 3>(xb, xsum, r0, rows, K, codes, scales, mins, out, N, t, acc, sums, weights);
    if (t1 - t == 2)
      code_tiles_amx<G, NIBBLES, HALF, MINS, 2>(xb, xsum, r0, rows, K, codes, scales, mins, out, N, t, acc, sums, weights);
    else if (t1 - t == 1)
      code_tiles_amx<G, NIBBLES, HALF, MINS, 1>(xb, xsum, r0, rows, K, codes, scales, mins, out, N, t, acc, sums, weights);
  }
  TILE_RELEASE();
}

template <int G, bool NIBBLES>
CodesKernel pick_codes_amx(bool half, bool mins) {
  if (half) return mins ? codes_tiles_amx<G, NIBBLES, true, true> : codes_tiles_amx<G, NIBBLES, true, false>;
  return mins ? codes_tiles_amx<G, NIBBLES, false, true> : codes_tiles_amx<G, NIBBLES, false, false>;
}

template <bool BF16_OUT>
AMX_BF16 void dense_tiles_amx(const uint16_t* xb, int64_t M, int64_t K, const uint16_t* weight,
                              void* out, int64_t N, int64_t t0, int64_t t1) {
  const int64_t chunks = K / 32;
  alignas(64) float sums[16 * TILE];
  TILE_LOADCONFIG(&DENSE_TILES);
  for (int64_t t = t0; t < t1; ++t) {
    for (int64_t r0 = 0; r0 < M; r0 += 16) {
      const int64_t rows = std::min<int64_t>(16, M - r0);
      TILE_ZERO(0);
      for (int64_t c = 0; c < chunks; ++c) {
        const uint16_t* tile = weight + (t * chunks + c) * (TILE * 32);
        for (int64_t line = 0; line < TILE * 32 * 2; line += 64)
          _mm_prefetch(reinterpret_cast<const char*>(tile) + PREFETCH + line, _MM_HINT_T0);
        TILE_LOAD(1, xb + r0 * K + c * 32, K * 2);
        TILE_LOAD(2, tile, 64);
        TILE_DPBF16PS(0, 1, 2);
      }
      TILE_STORE(0, sums, 64);
      for (int64_t r = 0; r < rows; ++r) {
        const __m512 a = _mm512_load_ps(sums + r * TILE);
        if constexpr (BF16_OUT) {
          uint16_t* o = static_cast<uint16_t*>(out) + (r0 + r) * N + t * TILE;
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(o), (__m256i)_mm512_cvtneps_pbh(a));
        } else {
          _mm512_storeu_ps(static_cast<float*>(out) + (r0 + r) * N + t * TILE, a);
        }
      }
    }
  }
  TILE_RELEASE();
}

#endif  // VERISPEC_AMX

// ---- attention -------------------------------------------------------------------------------

// exp(x) for x <= 0 (softmax after subtracting the maximum): Cody-Waite reduction, a degree-6
// polynomial, 2^n by scalef. The same lane arithmetic for every element.
AVX512_BF16 inline __m512 exp_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}

template <typename T>
AVX512_BF16 inline __m512 load16(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return _mm512_loadu_ps(p);
  } else {
    __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
}

// Lane i of the result: the sum of v[i]'s 16 lanes, by the same tree for every i (so a key's
// score does not depend on its slot among 16).
AVX512_BF16 inline __m512 lane_sums(const __m512* v) {
  __m512 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i)
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i)
    b[i] = _mm512_add_ps(_mm512_shuffle_ps(a[2 * i], a[2 * i + 1], 0x44), _mm512_shuffle_ps(a[2 * i], a[2 * i + 1], 0xee));
  for (int i = 0; i < 2; ++i)
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xdd));
  return _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88), _mm512_shuffle_f32x4(c[0], c[1], 0xdd));
}

// The softmax and the values of GB query heads (of one kv head's group) of one row, from their
// scaled scores over the keys index[0..count) (scores [GB][stride], stride >= count rounded up to 16;
// top[b]: each lane's maximum of head b's scores over its lanes of the valid keys). values: one kv
// head's cache rows [slots, 16 C]; out[b]: [16 C]. A head's arithmetic does not depend on GB, on
// the other heads, or on how its scores were made.
template <int C, int GB, typename T>
AVX512_BF16 void attend_scored(const T* values, const int32_t* index, int64_t count, int64_t stride,
                               float* scores, const __m512* top, T* const* out) {
  constexpr int64_t D = 16 * C;
  __m512 inverse[GB];
  for (int b = 0; b < GB; ++b) {
    const __m512 peak = _mm512_set1_ps(_mm512_reduce_max_ps(top[b]));
    float* sc = scores + b * stride;
    __m512 total = _mm512_setzero_ps();
    for (int64_t j0 = 0; j0 < count; j0 += 16) {
      const __mmask16 valid = count - j0 >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (count - j0)) - 1);
      const __m512 e = _mm512_maskz_mov_ps(valid, exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(sc + j0), peak)));
      _mm512_storeu_ps(sc + j0, e);
      total = _mm512_add_ps(total, e);
    }
    inverse[b] = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(total));
  }
  __m512 o[GB][C];
  for (int b = 0; b < GB; ++b)
    for (int c = 0; c < C; ++c) o[b][c] = _mm512_setzero_ps();
  for (int64_t j = 0; j < count; ++j) {
    const T* v = values + static_cast<int64_t>(index[j]) * D;
    _mm_prefetch(reinterpret_cast<const char*>(values + static_cast<int64_t>(index[std::min<int64_t>(j + 16, stride - 1)]) * D), _MM_HINT_T0);
    __m512 vv[C];
    for (int c = 0; c < C; ++c) vv[c] = load16(v + 16 * c);
    for (int b = 0; b < GB; ++b) {
      const __m512 e = _mm512_set1_ps(scores[b * stride + j]);
      for (int c = 0; c < C; ++c) o[b][c] = _mm512_fmadd_ps(e, vv[c], o[b][c]);
    }
  }
  for (int b = 0; b < GB; ++b)
    for (int c = 0; c < C; ++c) {
      const __m512 r = _mm512_mul_ps(o[b][c], inverse[b]);
      if constexpr (std::is_same_v<T, float>) {
        _mm512_storeu_ps(out[b] + 16 * c, r);
      } else {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out[b] + 16 * c), (__m256i)_mm512_cvtneps_pbh(r));
      }
    }
}

// GB query heads (of one kv head's group) of one row over the keys index[0..count) (cache
// slots, in order; the index is padded to a multiple of 16 with its last slot), loading each key
// and value once for the GB heads. q[b]: [16 C]; keys, values: one kv head's cache rows
// [slots, 16 C]; scores: scratch [GB][count rounded up to 16]; out[b]: [16 C].
// A head's arithmetic does not depend on GB or on the other heads.
template <int C, int GB, typename T>
AVX512_BF16 void attend(const T* const* q, const T* keys, const T* values, const int32_t* index,
                        int64_t count, int64_t stride, float scale, float* scores, T* const* out) {
  constexpr int64_t D = 16 * C;
  __m512 qv[GB][C];
  for (int b = 0; b < GB; ++b)
    for (int c = 0; c < C; ++c) qv[b][c] = load16(q[b] + 16 * c);
  const __m512 scaling = _mm512_set1_ps(scale);
  __m512 top[GB];
  for (int b = 0; b < GB; ++b) top[b] = _mm512_set1_ps(-INFINITY);
  alignas(64) __m512 dots[GB][16];
  for (int64_t j0 = 0; j0 < count; j0 += 16) {
    for (int i = 0; i < 16; ++i) {
      const T* k = keys + static_cast<int64_t>(index[j0 + i]) * D;
      _mm_prefetch(reinterpret_cast<const char*>(keys + static_cast<int64_t>(index[std::min<int64_t>(j0 + i + 16, stride - 1)]) * D), _MM_HINT_T0);
      __m512 kv[C];
      for (int c = 0; c < C; ++c) kv[c] = load16(k + 16 * c);
      for (int b = 0; b < GB; ++b) {
        __m512 a = _mm512_mul_ps(qv[b][0], kv[0]);
        for (int c = 1; c < C; ++c) a = _mm512_fmadd_ps(qv[b][c], kv[c], a);
        dots[b][i] = a;
      }
    }
    const __mmask16 valid = count - j0 >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (count - j0)) - 1);
    for (int b = 0; b < GB; ++b) {
      const __m512 s = _mm512_mul_ps(lane_sums(dots[b]), scaling);
      _mm512_storeu_ps(scores + b * stride + j0, s);
      top[b] = _mm512_mask_max_ps(top[b], valid, top[b], s);
    }
  }
  attend_scored<C, GB, T>(values, index, count, stride, scores, top, out);
}

// Heads attended together: as many as keep their queries and sums in registers (at most 4).
template <int C>
constexpr int head_block() { return C >= 8 ? 1 : C >= 4 ? 3 : 4; }

#if VERISPEC_AMX
// Attention over a bfloat16 cache on AMX tiles (the AMX class's own bits, as its products are):
// the scores of up to 16 query vectors (a tile's columns: rows and heads of one kv head) against
// 16 cache slots at a time (a tile's rows, read from the cache as they lie), each a tdpbf16ps
// chain over the head's dimensions 32 at a time. A score is a function of its query and its key
// alone, never of the tile's other rows or columns, so a row's scores, and with them its softmax
// and values (attend_scored, as the other classes), are the same bits whatever rows, heads or
// keys share its tiles: a one-token step, a block, a tree. The tiles are ATTENTION_TILES.
//
// queries: [C / 2][16 pairs][16 columns][2] bfloat16, tdpbf16ps's B layout (columns past
// `columns` zero); keys: one kv head's cache [capacity, 16 C]; S: [columns][stride], S[m][k] query
// m's score of slot lo + k (k up to hi - lo rounded up to 16; past hi, whatever the slots there
// hold). Each tile of scores goes through a 1 KB buffer into its columns, so a one-token step's
// few columns stay in the L1 cache over a long cache (16 columns of 3000 keys would not).
template <int C>
AMX_BF16 void tile_scores(const uint16_t* queries, const uint16_t* keys, int64_t lo, int64_t hi,
                          int64_t capacity, int64_t columns, float* S, int64_t stride) {
  constexpr int64_t D = 16 * C;
  constexpr int HELD = C / 2 <= 6 ? C / 2 : 0;  // query tiles held in tiles 2.. for every key block
  alignas(64) uint16_t tail[16 * D];
  alignas(64) float block[16 * 16];
  const __m512i rows16 = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                            _mm512_set1_epi32(16));  // key j's score of a column at 16 j
  if constexpr (HELD > 0) TILE_LOAD(2, queries, 64);
  if constexpr (HELD > 1) TILE_LOAD(3, queries + 512, 64);
  if constexpr (HELD > 2) TILE_LOAD(4, queries + 2 * 512, 64);
  if constexpr (HELD > 3) TILE_LOAD(5, queries + 3 * 512, 64);
  if constexpr (HELD > 4) TILE_LOAD(6, queries + 4 * 512, 64);
  if constexpr (HELD > 5) TILE_LOAD(7, queries + 5 * 512, 64);
  for (int64_t k0 = lo; k0 < hi; k0 += 16) {
    const uint16_t* a = keys + k0 * D;
    if (k0 + 16 > capacity) {  // the tile would read past the cache: its slots, then zeros
      std::memset(tail, 0, sizeof(tail));
      std::memcpy(tail, a, (hi - k0) * D * 2);
      a = tail;
    }
    TILE_ZERO(0);
    if constexpr (HELD == 0) {
      for (int c = 0; c < C / 2; ++c) {
        TILE_LOAD(1, a + 32 * c, D * 2);
        TILE_LOAD(2, queries + c * 512, 64);
        TILE_DPBF16PS(0, 1, 2);
      }
    } else {
      // tile register numbers are immediates: each chunk spelt out
      TILE_LOAD(1, a, D * 2);
      TILE_DPBF16PS(0, 1, 2);
      if constexpr (HELD > 1) { TILE_LOAD(1, a + 32, D * 2); TILE_DPBF16PS(0, 1, 3); }
      if constexpr (HELD > 2) { TILE_LOAD(1, a + 64, D * 2); TILE_DPBF16PS(0, 1, 4); }
      if constexpr (HELD > 3) { TILE_LOAD(1, a + 96, D * 2); TILE_DPBF16PS(0, 1, 5); }
      if constexpr (HELD > 4) { TILE_LOAD(1, a + 128, D * 2); TILE_DPBF16PS(0, 1, 6); }
      if constexpr (HELD > 5) { TILE_LOAD(1, a + 160, D * 2); TILE_DPBF16PS(0, 1, 7); }
    }
    TILE_STORE(0, block, 64);
    for (int64_t m = 0; m < columns; ++m)
      _mm512_storeu_ps(S + m * stride + (k0 - lo), _mm512_i32gather_ps(_mm512_add_epi32(rows16, _mm512_set1_epi32(static_cast<int32_t>(m))), block, 4));
  }
}

// One query's scaled scores of the keys index[0..count) from its column of S (slot lo + k's at
// k), into scores[0..count), and its lanes' maximum over them. first >= 0: the keys are the slots
// first, first + 1, ... (a causal row), read as they lie; else gathered.
AMX_BF16 inline __m512 gather_scores(const float* column, int64_t lo, int64_t first, const int32_t* index,
                                     int64_t count, float scale, float* scores) {
  const __m512 factor = _mm512_set1_ps(scale);
  const __m512i base = _mm512_set1_epi32(static_cast<int32_t>(-lo));
  __m512 top = _mm512_set1_ps(-INFINITY);
  for (int64_t j0 = 0; j0 < count; j0 += 16) {
    const __mmask16 valid = count - j0 >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (count - j0)) - 1);
    const __m512 raw = first >= 0
        ? _mm512_maskz_loadu_ps(valid, column + first - lo + j0)
        : _mm512_mask_i32gather_ps(_mm512_setzero_ps(), valid,
                                   _mm512_add_epi32(_mm512_loadu_si512(index + j0), base), column, 4);
    const __m512 s = _mm512_mul_ps(raw, factor);
    _mm512_storeu_ps(scores + j0, s);
    top = _mm512_mask_max_ps(top, valid, top, s);
  }
  return top;
}

// What attention_tiles' tasks share: as attention_rows takes it, bfloat16 throughout.
struct TileAttention {
  const uint16_t* q;  // [heads, n, D], strides q_head and q_row
  int64_t q_head, q_row;
  const uint16_t* keys;  // [kv_heads, capacity, D]
  const at::BFloat16* values;  // [kv_heads, capacity, D]
  const bool* mask;  // [n, length] or null: causal
  at::BFloat16* out;  // [n, heads, D]
  int64_t heads, n, group, kv_heads, capacity, length, window, padded, tasks;
  float scale;
};

// Tasks begin..end of attention_tiles on one thread: a task is a run of the (kv head, row, head)
// units, kv head major, taken a piece at a time (one kv head's, at most 16: a tile's columns).
template <int C>
AMX_BF16 void tile_tasks(const TileAttention& a, int64_t begin, int64_t end) {
  using T = at::BFloat16;
  constexpr int64_t D = 16 * C;
  constexpr int BLOCK = head_block<C>();
  const int64_t units = a.n * a.group, group = a.group, length = a.length, n = a.n, padded = a.padded;
  std::vector<int32_t> index(padded);
  std::vector<float> scores(BLOCK * padded);
  std::vector<float> S((padded + 16) * 16);  // [16 columns][padded + 16]
  alignas(64) uint16_t queries[C / 2 * 512];
  TILE_LOADCONFIG(&ATTENTION_TILES);
  const int64_t total = a.kv_heads * units;
  for (int64_t task = begin; task < end; ++task) {
    const int64_t run_end = (task + 1) * total / a.tasks;
    for (int64_t unit = task * total / a.tasks; unit < run_end;) {  // pieces: one kv head, at most 16 units
      const int64_t h = unit / units, u0 = unit % units, u1 = std::min({units, u0 + 16, run_end - h * units});
      unit = h * units + u1;
      std::memset(queries, 0, sizeof(queries));
      for (int64_t u = u0; u < u1; ++u) {
        const uint16_t* qv = a.q + (h * group + u % group) * a.q_head + u / group * a.q_row;
        for (int64_t d = 0; d < D; ++d) queries[d / 32 * 512 + d % 32 / 2 * 32 + (u - u0) * 2 + d % 2] = qv[d];
      }
      int64_t lo = 0, hi = length;
      if (!a.mask) {
        hi = length - n + (u1 - 1) / group + 1;
        lo = a.window > 0 ? std::max<int64_t>(0, length - n + u0 / group + 1 - a.window) : 0;
      }
      tile_scores<C>(queries, a.keys + h * a.capacity * D, lo, hi, a.capacity, u1 - u0, S.data(), a.padded + 16);
      const T* v = a.values + h * a.capacity * D;
      for (int64_t u = u0; u < u1;) {
        const int64_t i = u / group, stop = std::min(u1, (i + 1) * group);
        int64_t count = 0;
        if (!a.mask) {
          const int64_t last = length - n + i + 1, first = a.window > 0 ? std::max<int64_t>(0, last - a.window) : 0;
          count = last - first;
          for (int64_t j = 0; j < count; ++j) index[j] = static_cast<int32_t>(first + j);
        } else {
          for (int64_t j = 0; j < length; ++j)
            if (a.mask[i * length + j]) index[count++] = static_cast<int32_t>(j);
        }
        check(count > 0, "a row that sees no key");
        for (int64_t j = count; j < padded; ++j) index[j] = index[count - 1];
        for (int64_t g0 = u; g0 < stop; g0 += BLOCK) {
          const int64_t block = std::min<int64_t>(BLOCK, stop - g0);
          __m512 top[BLOCK];
          T* os[BLOCK];
          for (int64_t b = 0; b < block; ++b) {
            top[b] = gather_scores(S.data() + (g0 + b - u0) * (padded + 16), lo, a.mask ? -1 : index[0],
                                   index.data(), count, a.scale, scores.data() + b * padded);
            os[b] = a.out + i * a.heads * D + (h * group + (g0 + b) % group) * D;
          }
          if (block == BLOCK) attend_scored<C, BLOCK, T>(v, index.data(), count, padded, scores.data(), top, os);
          else if (block == 1) attend_scored<C, 1, T>(v, index.data(), count, padded, scores.data(), top, os);
          else if (block == 2) attend_scored<C, BLOCK >= 2 ? 2 : 1, T>(v, index.data(), count, padded, scores.data(), top, os);
          else attend_scored<C, BLOCK >= 3 ? 3 : 1, T>(v, index.data(), count, padded, scores.data(), top, os);
        }
        u = stop;
      }
    }
  }
  TILE_RELEASE();
}

template <int C>
void attention_tiles(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                     const at::Tensor& mask, int64_t length, int64_t window, double scale, at::Tensor& out) {
  // as attention_rows, bfloat16 throughout, 16 C a multiple of 32. The kv_heads * n * group (kv
  // head, row, head) units are cut into equal runs: few rows (a one-token step), one a thread, as
  // attention_rows cuts them; else as many as a kv head's tiles of 16 units, rounded up to a
  // multiple of the threads so that each has as many units.
  const int64_t heads = q.size(0), n = q.size(1), kv_heads = keys.size(0), group = heads / kv_heads;
  const int64_t threads = at::get_num_threads(), units = n * group;
  const int64_t tiles = kv_heads * ((units + 15) / 16);
  const int64_t tasks = std::min(kv_heads * units,
                                 n * kv_heads < 2 * threads ? threads : (tiles + threads - 1) / threads * threads);
  const TileAttention a{reinterpret_cast<const uint16_t*>(q.data_ptr()), q.stride(0), q.stride(1),
                        reinterpret_cast<const uint16_t*>(keys.data_ptr()),
                        reinterpret_cast<const at::BFloat16*>(values.data_ptr()),
                        mask.defined() ? mask.data_ptr<bool>() : nullptr,
                        reinterpret_cast<at::BFloat16*>(out.data_ptr()), heads, n, group, kv_heads, keys.size(1),
                        length, window, (length + 15) / 16 * 16, tasks, static_cast<float>(scale)};
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) { tile_tasks<C>(a, begin, end); });
}
#endif  // VERISPEC_AMX

template <int C, typename T>
void attention_rows(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                    const at::Tensor& mask, int64_t length, int64_t window, double scale, at::Tensor& out,
                    int64_t isa) {
  // q: [heads, n, D] (any strides but D's); keys, values: [kv_heads, capacity, D] contiguous;
  // window > 0: a causal row sees only its last `window` keys (its own included)
#if VERISPEC_AMX
  if constexpr (std::is_same_v<T, at::BFloat16> && C % 2 == 0) {
    if (isa == ISA_AMX_BF16) return attention_tiles<C>(q, keys, values, mask, length, window, scale, out);
  }
#endif
  constexpr int64_t D = 16 * C;
  constexpr int BLOCK = head_block<C>();
  const int64_t heads = q.size(0), n = q.size(1), kv_heads = keys.size(0);
  const int64_t group = heads / kv_heads, capacity = keys.size(1);
  const bool causal = !mask.defined();
  const bool* m = causal ? nullptr : mask.data_ptr<bool>();
  const T* qp = reinterpret_cast<const T*>(q.data_ptr());
  const T* kp = reinterpret_cast<const T*>(keys.data_ptr());
  const T* vp = reinterpret_cast<const T*>(values.data_ptr());
  T* op = reinterpret_cast<T*>(out.data_ptr());
  const int64_t padded = (length + 15) / 16 * 16;
  // Few rows (a one-token step): the n * heads query heads, in (row, head) order, cut into one
  // contiguous chunk a thread, so that every thread has work while the heads of a kv head stay
  // together (a one-token step over a long cache then reads each kv head's cache about once, not
  // once a query head). Else a task per (kv head, row), kv head major, so that a thread's
  // consecutive tasks read one kv head's cache (from its own cache, while that fits). Each task
  // attends its heads in blocks of BLOCK that load each key and value once. A head's arithmetic is
  // the same however the heads are cut.
  const int64_t threads = at::get_num_threads();
  const int64_t units = n * heads;
  const bool few = n * kv_heads < 2 * threads;
  const int64_t tasks = few ? std::min(threads, units) : n * kv_heads;
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    std::vector<int32_t> index(padded);
    std::vector<float> scores(BLOCK * padded);
    // query heads [lo, hi) of row i, all of one kv head
    auto attend_row = [&](int64_t i, int64_t lo, int64_t hi) {
      const int64_t h = lo / group;
      int64_t count = 0;
      if (causal) {
        const int64_t stop = length - n + i + 1, start = window > 0 ? std::max<int64_t>(0, stop - window) : 0;
        count = stop - start;
        for (int64_t j = 0; j < count; ++j) index[j] = static_cast<int32_t>(start + j);
      } else {
        for (int64_t j = 0; j < length; ++j)
          if (m[i * length + j]) index[count++] = static_cast<int32_t>(j);
      }
      check(count > 0, "a row that sees no key");
      for (int64_t j = count; j < padded; ++j) index[j] = index[count - 1];
      for (int64_t g0 = lo; g0 < hi; g0 += BLOCK) {
        const T* qs[BLOCK];
        T* os[BLOCK];
        const int64_t block = std::min<int64_t>(BLOCK, hi - g0);
        for (int64_t b = 0; b < block; ++b) {
          qs[b] = qp + (g0 + b) * q.stride(0) + i * q.stride(1);
          os[b] = op + i * heads * D + (g0 + b) * D;
        }
        if (isa == ISA_AVX2) {
          for (int64_t b = 0; b < block; ++b)
            attend_avx2<C, T>(qs[b], kp + h * capacity * D, vp + h * capacity * D, index.data(), count, padded,
                              static_cast<float>(scale), scores.data(), os[b]);
          continue;
        }
        auto run = [&](auto kernel) {
          kernel(qs, kp + h * capacity * D, vp + h * capacity * D, index.data(), count, padded,
                 static_cast<float>(scale), scores.data(), os);
        };
        if (block == BLOCK) run(attend<C, BLOCK, T>);
        else if (block == 1) run(attend<C, 1, T>);
        else if (block == 2) run(attend<C, BLOCK >= 2 ? 2 : 1, T>);
        else run(attend<C, BLOCK >= 3 ? 3 : 1, T>);
      }
    };
    for (int64_t task = begin; task < end; ++task) {
      if (!few) {
        const int64_t h = task / n;
        attend_row(task % n, h * group, (h + 1) * group);
        continue;
      }
      const int64_t u1 = (task + 1) * units / tasks;
      for (int64_t u = task * units / tasks; u < u1;) {
        const int64_t i = u / heads, lo = u % heads;
        const int64_t hi = std::min(u1 - i * heads, (lo / group + 1) * group);  // within one kv head
        attend_row(i, lo, hi);
        u = i * heads + hi;
      }
    }
  });
}

template <typename T>
void attention_dispatch(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                        const at::Tensor& mask, int64_t length, int64_t window, double scale, at::Tensor& out,
                        int64_t isa) {
  switch (q.size(2) / 16) {
    case 1: attention_rows<1, T>(q, keys, values, mask, length, window, scale, out, isa); break;
    case 2: attention_rows<2, T>(q, keys, values, mask, length, window, scale, out, isa); break;
    case 4: attention_rows<4, T>(q, keys, values, mask, length, window, scale, out, isa); break;
    case 5: attention_rows<5, T>(q, keys, values, mask, length, window, scale, out, isa); break;
    case 6: attention_rows<6, T>(q, keys, values, mask, length, window, scale, out, isa); break;
    case 8: attention_rows<8, T>(q, keys, values, mask, length, window, scale, out, isa); break;
    case 16: attention_rows<16, T>(q, keys, values, mask, length, window, scale, out, isa); break;
    default: check(false, "head_dim of 16, 32, 64, 80, 96, 128 or 256");
  }
}

#endif  // VERISPEC_X86

// Tiles per task: enough work to amortise a fork (a one-row product over 8 tiles is a few
// microseconds), so small products run on one thread.
int64_t tiles_per_task(int64_t rows) { return std::max<int64_t>(1, 8 / std::max<int64_t>(rows, 1)); }

}  // namespace

std::vector<std::string> features() {
  std::vector<std::string> found;
  if (avx2()) found.push_back("avx2");
  if (avx512_bf16()) found.push_back("avx512_bf16");
  if (amx_bf16()) found.push_back("amx_bf16");
  return found;
}

// Rows of x [..., K] as a contiguous [M, K] matrix, and the sizes of a result [..., N]: the
// kernels take any leading dimensions, so that a caller makes no reshape of its own (each one a
// Python-level op, microseconds on a one-token step).
at::Tensor as_rows(const at::Tensor& x) {
  check(x.dim() >= 1, "x must have an input dimension");
  return x.dim() == 2 && x.is_contiguous() ? x : x.reshape({-1, x.size(-1)}).contiguous();
}

std::vector<int64_t> sizes_with_last(const at::Tensor& x, int64_t last) {
  std::vector<int64_t> sizes = x.sizes().vec();
  sizes.back() = last;
  return sizes;
}

at::Tensor linear_codes_rows(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                             const c10::optional<at::Tensor>& mins, int64_t group, bool nibbles, int64_t N,
                             int64_t isa);

// x [..., K] float32 or bfloat16 -> x @ w.T [..., N] float32, w given as group codes; scales and
// mins float32 or float16 alike, mins None for w = code * scale.
at::Tensor linear_codes(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                        const c10::optional<at::Tensor>& mins, int64_t group, bool nibbles, int64_t N,
                        int64_t isa) {
  return linear_codes_rows(as_rows(x), codes, scales, mins, group, nibbles, N, isa).view(sizes_with_last(x, N));
}

at::Tensor linear_codes_rows(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                             const c10::optional<at::Tensor>& mins, int64_t group, bool nibbles, int64_t N,
                             int64_t isa) {
#if VERISPEC_X86
  check(runs(isa), "this CPU does not run this kernel class");
  check(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "x must be float32 or bfloat16");
  const int64_t M = x.size(0), K = x.size(1);
  check(group == 16 || group == 32, "groups of 16 or 32 inputs");
  check(K % 32 == 0 && N % TILE == 0, "in % 32 == 0 and out % 16 == 0");
  const bool has_mins = mins.has_value() && mins->defined();
  const bool half = scales.scalar_type() == at::kHalf;
  check(half || scales.scalar_type() == at::kFloat, "float32 or float16 scales");
  check(codes.is_contiguous() && scales.is_contiguous() && codes.numel() == N * K / (nibbles ? 2 : 1) &&
            scales.numel() == N * K / group, "codes and scales of this shape");
  check(!has_mins || (mins->scalar_type() == scales.scalar_type() && mins->is_contiguous() &&
                      mins->numel() == scales.numel()), "minimums like the scales");
  at::Tensor out = at::empty({M, N}, x.options().dtype(at::kFloat));
  at::Tensor sums;
  if (has_mins) sums = at::empty({M, K / group}, x.options().dtype(at::kFloat));
  const int64_t tiles = N / TILE;
  float* sp = has_mins ? sums.data_ptr<float>() : nullptr;
  const void* mp = has_mins ? mins->data_ptr() : nullptr;
  const uint8_t* cp = static_cast<const uint8_t*>(codes.data_ptr());
  if (isa == ISA_AVX2) {
    at::Tensor xf = at::empty({M, K}, x.options().dtype(at::kFloat));
    float* xfp = xf.data_ptr<float>();
    to_bf16_floats(x, xfp);
    if (has_mins) {
      if (group == 32) group_sums_avx2<32>(xfp, M, K, sp);
      else group_sums_avx2<16>(xfp, M, K, sp);
    }
    CodesKernelAvx2 kernel = group == 32 ? (nibbles ? pick_codes_avx2<32, true>(half, has_mins) : pick_codes_avx2<32, false>(half, has_mins))
                                         : (nibbles ? pick_codes_avx2<16, true>(half, has_mins) : pick_codes_avx2<16, false>(half, has_mins));
    at::parallel_for(0, tiles, tiles_per_task(M), [&](int64_t t0, int64_t t1) {
      kernel(xfp, sp, M, K, cp, scales.data_ptr(), mp, out.data_ptr<float>(), N, t0, t1);
    });
    return out;
  }
  const bool tiles16 = isa == ISA_AMX_BF16;  // rows padded to 16 with zeros
  const int64_t padded = tiles16 ? (M + 15) / 16 * 16 : M;
  at::Tensor xb = at::empty({padded, K}, x.options().dtype(at::kBFloat16));
  uint16_t* xbp = reinterpret_cast<uint16_t*>(xb.data_ptr());
  to_bf16(x, xbp);
  std::memset(xbp + M * K, 0, (padded - M) * K * 2);
  if (has_mins) {
    if (group == 32) group_sums<32>(xbp, M, K, sp);
    else group_sums<16>(xbp, M, K, sp);
  }
  CodesKernel kernel = group == 32 ? (nibbles ? pick_codes<32, true>(half, has_mins) : pick_codes<32, false>(half, has_mins))
                                   : (nibbles ? pick_codes<16, true>(half, has_mins) : pick_codes<16, false>(half, has_mins));
#if VERISPEC_AMX
  if (tiles16)
    kernel = group == 32 ? (nibbles ? pick_codes_amx<32, true>(half, has_mins) : pick_codes_amx<32, false>(half, has_mins))
                         : (nibbles ? pick_codes_amx<16, true>(half, has_mins) : pick_codes_amx<16, false>(half, has_mins));
#endif
  at::parallel_for(0, tiles, tiles_per_task(M), [&](int64_t t0, int64_t t1) {
    kernel(xbp, sp, M, K, cp, scales.data_ptr(), mp, out.data_ptr<float>(), N, t0, t1);
  });
  return out;
#else
  check(false, "x86-64 only");
  return x;
#endif
}

at::Tensor linear_dense_rows(const at::Tensor& x, const at::Tensor& weight, int64_t N, bool bf16_out, int64_t isa);

// x [..., K] -> x @ w.T [..., N] in `out_dtype` (float32 or bfloat16), w packed bfloat16.
at::Tensor linear_dense(const at::Tensor& x, const at::Tensor& weight, int64_t N, bool bf16_out, int64_t isa) {
  return linear_dense_rows(as_rows(x), weight, N, bf16_out, isa).view(sizes_with_last(x, N));
}

at::Tensor linear_dense_rows(const at::Tensor& x, const at::Tensor& weight, int64_t N, bool bf16_out, int64_t isa) {
#if VERISPEC_X86
  check(runs(isa), "this CPU does not run this kernel class");
  check(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "x must be float32 or bfloat16");
  const int64_t M = x.size(0), K = x.size(1);
  check(K % 32 == 0 && N % TILE == 0 && weight.numel() == N * K, "a packed weight of this shape");
  at::Tensor out = at::empty({M, N}, x.options().dtype(bf16_out ? at::kBFloat16 : at::kFloat));
  const int64_t tiles = N / TILE;
  const uint16_t* w = reinterpret_cast<const uint16_t*>(weight.data_ptr());
  if (isa == ISA_AVX2) {
    at::Tensor xf = at::empty({M, K}, x.options().dtype(at::kFloat));
    to_bf16_floats(x, xf.data_ptr<float>());
    const float* xfp = xf.data_ptr<float>();
    at::parallel_for(0, tiles, tiles_per_task(M), [&](int64_t t0, int64_t t1) {
      if (bf16_out) dense_tiles_avx2<true>(xfp, M, K, w, out.data_ptr(), N, t0, t1);
      else dense_tiles_avx2<false>(xfp, M, K, w, out.data_ptr(), N, t0, t1);
    });
    return out;
  }
  const bool tiles16 = isa == ISA_AMX_BF16;  // rows padded to 16 with zeros
  const int64_t padded = tiles16 ? (M + 15) / 16 * 16 : M;
  at::Tensor xb = x;
  if (x.scalar_type() != at::kBFloat16 || padded != M) {
    xb = at::empty({padded, K}, x.options().dtype(at::kBFloat16));
    to_bf16(x, reinterpret_cast<uint16_t*>(xb.data_ptr()));
    std::memset(reinterpret_cast<uint16_t*>(xb.data_ptr()) + M * K, 0, (padded - M) * K * 2);
  }
  const uint16_t* xbp = reinterpret_cast<const uint16_t*>(xb.data_ptr());
  at::parallel_for(0, tiles, tiles_per_task(M), [&](int64_t t0, int64_t t1) {
#if VERISPEC_AMX
    if (tiles16) {
      if (bf16_out) dense_tiles_amx<true>(xbp, M, K, w, out.data_ptr(), N, t0, t1);
      else dense_tiles_amx<false>(xbp, M, K, w, out.data_ptr(), N, t0, t1);
      return;
    }
#endif
    if (bf16_out) dense_tiles<true>(xbp, M, K, w, out.data_ptr(), N, t0, t1);
    else dense_tiles<false>(xbp, M, K, w, out.data_ptr(), N, t0, t1);
  });
  return out;
#else
  check(false, "x86-64 only");
  return x;
#endif
}

// q [1, heads, n, D] (after rotary), keys / values [1, kv_heads, capacity, D] (a cache's
// buffers), the first `length` slots valid; mask [n, length] bool or None (causal: row i sees the
// first length - n + i + 1, or with window > 0 the last `window` of them). Returns [1, n, heads * D]
// in q's dtype.
at::Tensor attention(const at::Tensor& q4, const at::Tensor& keys4, const at::Tensor& values4,
                     const c10::optional<at::Tensor>& mask, int64_t length, double scale, int64_t isa,
                     int64_t window) {
#if VERISPEC_X86
  check(runs(isa), "this CPU does not run this kernel class");
  check(q4.dim() == 4 && keys4.dim() == 4 && values4.dim() == 4 && q4.size(0) == 1 && keys4.size(0) == 1 &&
            values4.size(0) == 1, "q [1, heads, n, D], keys/values [1, kv_heads, slots, D]");
  const at::Tensor q = q4[0], keys = keys4[0], values = values4[0];
  check(q.stride(2) == 1 && keys.is_contiguous() && values.is_contiguous(), "contiguous head dims and caches");
  check(q.scalar_type() == keys.scalar_type() && keys.scalar_type() == values.scalar_type(), "one dtype");
  const int64_t D = q.size(2);
  check(q.size(0) % keys.size(0) == 0 && D % 16 == 0, "heads % kv_heads == 0, head_dim % 16 == 0");
  check(length <= keys.size(1) && length >= q.size(1), "length within the cache");
  check(window >= 0, "window >= 0 (0: none)");
  at::Tensor m;
  if (mask.has_value() && mask->defined()) {
    m = mask->contiguous();
    check(m.scalar_type() == at::kBool && m.size(0) == q.size(1) && m.size(1) == length, "mask [n, length] bool");
  }
  at::Tensor out = at::empty({q.size(1), q.size(0) * D}, q.options());
  if (q.scalar_type() == at::kFloat) attention_dispatch<float>(q, keys, values, m, length, window, scale, out, isa);
  else if (q.scalar_type() == at::kBFloat16) attention_dispatch<at::BFloat16>(q, keys, values, m, length, window, scale, out, isa);
  else check(false, "float32 or bfloat16 attention");
  return out.unsqueeze(0);
#else
  check(false, "x86-64 only");
  return q4;
#endif
}

// x [..., H] float32 or bfloat16 -> each row RMS-normalised and scaled, in x's dtype:
// y = weight * (x / sqrt(mean(x^2) + eps)), weight [H] in x's dtype, in float32 arithmetic; for a
// bfloat16 x the normalised value is rounded to bfloat16 before the weight multiplies it (Llama's
// order). A row's arithmetic is fixed (squares summed into 16 partial sums in index order, then a
// fixed tree; 1 / sqrt, both correctly rounded), so a row's result is the same in any block. Plain
// C++ (no instruction-set attribute): the same bits on every x86-64 CPU, whichever kernel class
// runs the products. One op in place of torch's rms_norm, which costs ~13 us a call on a one-token
// step here (60 a forward: 15% of the 4-bit target's step).
template <typename T>
void rms_norm_rows(const T* x, const T* weight, T* out, int64_t H, float eps, int64_t r0, int64_t r1) {
  for (int64_t r = r0; r < r1; ++r) {
    const T* row = x + r * H;
    float lanes[16] = {0};
    int64_t i = 0;
    for (; i + 16 <= H; i += 16)
      for (int j = 0; j < 16; ++j) {
        const float v = static_cast<float>(row[i + j]);
        lanes[j] += v * v;
      }
    for (int j = 0; i + j < H; ++j) {
      const float v = static_cast<float>(row[i + j]);
      lanes[j] += v * v;
    }
    for (int width = 8; width >= 1; width /= 2)
      for (int j = 0; j < width; ++j) lanes[j] += lanes[j + width];
    const float inverse = 1.0f / std::sqrt(lanes[0] / static_cast<float>(H) + eps);
    T* y = out + r * H;
    for (int64_t k = 0; k < H; ++k) {
      const T normalised = static_cast<T>(static_cast<float>(row[k]) * inverse);
      y[k] = static_cast<T>(static_cast<float>(weight[k]) * static_cast<float>(normalised));
    }
  }
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check(x.scalar_type() == weight.scalar_type() && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
        "x and weight both float32 or both bfloat16");
  const int64_t H = x.size(-1);
  check(weight.dim() == 1 && weight.size(0) == H && weight.is_contiguous(), "weight [H]");
  const at::Tensor rows = as_rows(x);
  at::Tensor out = at::empty_like(rows);
  const int64_t M = rows.size(0);
  const float e = static_cast<float>(eps);
  at::parallel_for(0, M, 64, [&](int64_t r0, int64_t r1) {  // a step's few rows run inline
    if (x.scalar_type() == at::kFloat)
      rms_norm_rows<float>(rows.data_ptr<float>(), weight.data_ptr<float>(), out.data_ptr<float>(), H, e, r0, r1);
    else
      rms_norm_rows<at::BFloat16>(rows.data_ptr<at::BFloat16>(), weight.data_ptr<at::BFloat16>(),
                                  out.data_ptr<at::BFloat16>(), H, e, r0, r1);
  });
  return out.view(x.sizes());
}

// x [..., H] -> a Hugging Face RMSNorm module's forward by the module's own ATen ops, so its bits,
// in one call (through Python the module costs 16-31 us, and a float target's forward runs 60-110
// of them): h = x in float32, n = h * rsqrt(mean(h^2) + eps); then Llama's order (Mistral's and
// Qwen's too): weight * n in x's dtype, weight [H] in x's dtype; or Gemma 3's (gemma): n * weight
// in x's dtype, weight [H] float32, the module's 1 + weight.
at::Tensor module_norm(const at::Tensor& x, const at::Tensor& weight, double eps, bool gemma) {
  const at::Tensor h = x.to(at::kFloat);
  const at::Tensor n = h * at::rsqrt(h.pow(2).mean(-1, true) + eps);
  return gemma ? (n * weight).to(x.scalar_type()) : weight * n.to(x.scalar_type());
}

// Rotary embedding as lean.rotate computes it with four torch ops, in one call and the same bits:
// out[r, h, d] = x[r, h, d] * cos[r, d] + x[r, h, (d + D / 2) % D] * signed_sin[r, d], each
// product and the sum rounded to x's dtype, as torch's elementwise ops round them (a bfloat16
// product is the float32 product rounded to bfloat16; -ffp-contract=off keeps the compiler from
// fusing them). x [1, n, heads, D] with the last dimension contiguous (a view of a qkv product's
// columns); cos, signed_sin [n, 1, D] in x's dtype. Returns [1, n, heads, D] contiguous.
template <typename T>
inline void rotate_head(const T* v, const T* c, const T* s, T* o, int64_t D) {
  const int64_t half = D / 2;
  for (int64_t d = 0; d < D; ++d) {
    const T straight = v[d] * c[d];
    const T swapped = v[d < half ? d + half : d - half] * s[d];
    o[d] = straight + swapped;
  }
}

template <typename T>
void rotate_rows(const T* x, int64_t row_stride, int64_t head_stride, const T* cos, const T* sin, T* out,
                 int64_t heads, int64_t D, int64_t n) {
  for (int64_t r = 0; r < n; ++r)
    for (int64_t h = 0; h < heads; ++h)
      rotate_head(x + r * row_stride + h * head_stride, cos + r * D, sin + r * D, out + (r * heads + h) * D, D);
}

at::Tensor rotate(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& signed_sin) {
  check(x.dim() == 4 && x.size(0) == 1 && x.stride(3) == 1, "x [1, n, heads, D], last dimension contiguous");
  const int64_t n = x.size(1), heads = x.size(2), D = x.size(3);
  const at::Tensor c = cos.contiguous(), s = signed_sin.contiguous();
  check(D % 2 == 0 && c.numel() == n * D && s.numel() == n * D, "cos, signed_sin [n, 1, D]");
  check(x.scalar_type() == c.scalar_type() && x.scalar_type() == s.scalar_type() &&
            (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16), "one dtype, float32 or bfloat16");
  at::Tensor out = at::empty({1, n, heads, D}, x.options());
  if (x.scalar_type() == at::kFloat)
    rotate_rows<float>(x.data_ptr<float>(), x.stride(1), x.stride(2), c.data_ptr<float>(), s.data_ptr<float>(),
                       out.data_ptr<float>(), heads, D, n);
  else
    rotate_rows<at::BFloat16>(x.data_ptr<at::BFloat16>(), x.stride(1), x.stride(2), c.data_ptr<at::BFloat16>(),
                              s.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>(), heads, D, n);
  return out;
}

// A block's qkv product [1, n, (heads + 2 kv_heads) * D] (last dimension contiguous) -> its
// queries rotated, [1, heads, n, D] (attention's layout); its keys rotated and its values copied
// into a cache's buffers [1, kv_heads, capacity, D] at slots length .. length + n - 1. The bits of
// rotate and of the slicing, transposes and copies it replaces (one call instead of ~20 ops).
template <typename T>
void heads_into_cache_rows(const T* qkv, int64_t row_stride, const T* cos, const T* sin, T* q, T* keys, T* values,
                           int64_t capacity, int64_t length, int64_t heads, int64_t kv_heads, int64_t D, int64_t n) {
  for (int64_t r = 0; r < n; ++r) {
    const T* row = qkv + r * row_stride;
    const T* c = cos + r * D;
    const T* s = sin + r * D;
    for (int64_t h = 0; h < heads; ++h) rotate_head(row + h * D, c, s, q + (h * n + r) * D, D);
    for (int64_t h = 0; h < kv_heads; ++h) {
      const int64_t slot = (h * capacity + length + r) * D;
      rotate_head(row + (heads + h) * D, c, s, keys + slot, D);
      std::memcpy(values + slot, row + (heads + kv_heads + h) * D, D * sizeof(T));
    }
  }
}

at::Tensor heads_into_cache(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& signed_sin,
                            at::Tensor& keys, at::Tensor& values, int64_t length, int64_t heads) {
  check(qkv.dim() == 3 && qkv.size(0) == 1 && qkv.stride(2) == 1, "qkv [1, n, width], last dimension contiguous");
  check(keys.dim() == 4 && keys.size(0) == 1 && keys.is_contiguous() && values.sizes() == keys.sizes() &&
            values.is_contiguous(), "keys, values [1, kv_heads, capacity, D] contiguous");
  const int64_t n = qkv.size(1), kv_heads = keys.size(1), capacity = keys.size(2), D = keys.size(3);
  check(qkv.size(2) == (heads + 2 * kv_heads) * D && D % 2 == 0, "qkv width (heads + 2 kv_heads) * D");
  check(length >= 0 && length + n <= capacity, "room in the cache");
  const at::Tensor c = cos.contiguous(), s = signed_sin.contiguous();
  check(c.numel() == n * D && s.numel() == n * D, "cos, signed_sin [n, 1, D]");
  const auto dtype = qkv.scalar_type();
  check(c.scalar_type() == dtype && s.scalar_type() == dtype && keys.scalar_type() == dtype &&
            values.scalar_type() == dtype && (dtype == at::kFloat || dtype == at::kBFloat16),
        "one dtype, float32 or bfloat16");
  at::Tensor q = at::empty({1, heads, n, D}, qkv.options());
  if (dtype == at::kFloat)
    heads_into_cache_rows<float>(qkv.data_ptr<float>(), qkv.stride(1), c.data_ptr<float>(), s.data_ptr<float>(),
                                 q.data_ptr<float>(), keys.data_ptr<float>(), values.data_ptr<float>(), capacity,
                                 length, heads, kv_heads, D, n);
  else
    heads_into_cache_rows<at::BFloat16>(qkv.data_ptr<at::BFloat16>(), qkv.stride(1), c.data_ptr<at::BFloat16>(),
                                        s.data_ptr<at::BFloat16>(), q.data_ptr<at::BFloat16>(),
                                        keys.data_ptr<at::BFloat16>(), values.data_ptr<at::BFloat16>(), capacity,
                                        length, heads, kv_heads, D, n);
  return q;
}

// x [..., in] @ a oneDNN-prepacked weight's transpose (+ bias) -> [..., out]: torch's
// mkldnn::_linear_pointwise, the op packed.packed_linear calls (a float32 target's products).
at::Tensor linear_onednn(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias) {
  static const c10::OperatorHandle op = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  std::vector<c10::IValue> stack{x, packed, bias, std::string("none"), c10::List<c10::optional<at::Scalar>>(),
                                 std::string("")};
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

// A part of a product in the layer loop below: group codes as linear_codes takes them, (dense) a
// packed bfloat16 weight as linear_dense does, or (onednn) a oneDNN-prepacked float weight.
struct Part {
  at::Tensor weight, scales;
  c10::optional<at::Tensor> mins;
  int64_t group, N, isa;
  bool nibbles, dense;
  bool onednn = false;  // weight: prepacked for oneDNN (linear_onednn), with `bias`
  c10::optional<at::Tensor> bias;

  Part(at::Tensor weight, at::Tensor scales, c10::optional<at::Tensor> mins, int64_t group, int64_t N,
       int64_t isa, bool nibbles, bool dense)
      : weight(std::move(weight)), scales(std::move(scales)), mins(std::move(mins)), group(group), N(N),
        isa(isa), nibbles(nibbles), dense(dense) {}
  Part(at::Tensor packed, c10::optional<at::Tensor> bias)
      : weight(std::move(packed)), group(0), N(0), isa(0), nibbles(false), dense(false), onednn(true),
        bias(std::move(bias)) {}

  at::Tensor operator()(const at::Tensor& x) const {
    if (onednn) return linear_onednn(x, weight, bias);
    return dense ? linear_dense(x, weight, N, x.scalar_type() == at::kBFloat16, isa)
                 : linear_codes(x, weight, scales, mins, group, nibbles, N, isa);
  }
};

// A product: its parts' outputs concatenated (a GGUF tensor fused from parts of several forms),
// in x's dtype (as lowbit.Kernel returns it). x [1, n, in] of fewer than `least` rows is
// multiplied with zero rows after its own up to `least` (lean.forward_rows' pad_rows: a product
// that rounds a lone row differently, or streams faster over more rows), and only its rows kept.
at::Tensor multiply(const std::vector<Part>& parts, const at::Tensor& x, int64_t least = 1) {
  const int64_t n = x.size(-2);
  const at::Tensor in = n >= least ? x : at::cat({x, x.new_zeros({x.size(0), least - n, x.size(-1)})}, -2);
  at::Tensor out;
  if (parts.size() == 1) {
    out = parts[0](in);
  } else {
    std::vector<at::Tensor> outs;
    for (const Part& part : parts) outs.push_back(part(in));
    out = at::cat(outs, -1);
  }
  if (n < least) out = out.narrow(-2, 0, n);
  return out.scalar_type() == x.scalar_type() ? out : out.to(x.scalar_type());
}

// A decoder layer as the layer loop runs it: RMSNorm weights (in the activations' dtype) and the
// fused products (q/k/v, o, gate/up, down); where the family has them (lean.Layer), the norms over
// each head of q and of k [D] and after attention and after the MLP [hidden] (undefined: none),
// its sliding window (0: none), and which of run's rotary tables (`kind`) and masks (`sight`)
// it reads.
struct Layer {
  at::Tensor attn_norm, mlp_norm;
  std::vector<Part> qkv, out, gate_up, down;
  at::Tensor q_norm, k_norm, attn_post_norm, mlp_post_norm;
  int64_t window = 0, kind = 0, sight = 0;
};

// The decoder layers of a lean forward over one block, in one call (lean.NativeLayers): the ops
// lean.forward_rows makes for a layer, in its order and on the same tensors (so the same bits),
// without a return to Python between them (~15 a layer, the glue of a one-token step). For
// layers whose products all run here, a SiLU- or tanh-GELU-gated MLP, norms of one kind.
struct Stack {
  std::vector<Layer> layers;
  double eps, scale;
  int64_t heads, isa;
  bool module_norms;  // the norms are Hugging Face's RMSNorm modules (a float target's), not rms_norm
  bool gemma_norms;   // ... of Gemma 3's kind (module_norm's `gemma`: the weight is 1 + the module's)
  bool gelu;          // the MLP's gate is GELU's tanh form (Gemma 3), not SiLU
  // the fewest rows each product multiplies (q/k/v, o, gate/up, down: lean's min_rows)
  std::vector<int64_t> least;

  // A layer's RMSNorm: rms_norm, or the module by its own ops (module_norm: the module's bits).
  at::Tensor norm(const at::Tensor& x, const at::Tensor& weight) const {
    return module_norms ? module_norm(x, weight, eps, gemma_norms) : rms_norm(x, weight, eps);
  }

  // `norm` after x where the layer has that norm (a sandwich norm), else x.
  at::Tensor maybe_norm(const at::Tensor& x, const at::Tensor& weight) const {
    return weight.defined() ? norm(x, weight) : x;
  }

  // A qkv product [1, n, (heads + 2 kv_heads) * D] with each head of q and of k normed (lean's
  // split_heads: each over n * count rows of D), v as it was.
  at::Tensor norm_heads(const at::Tensor& qkv, const Layer& layer, int64_t kv_heads, int64_t D) const {
    const int64_t n = qkv.size(1), q_size = heads * D, kv_size = kv_heads * D;
    const at::Tensor q = norm(qkv.narrow(-1, 0, q_size).reshape({1, n * heads, D}), layer.q_norm);
    const at::Tensor k = norm(qkv.narrow(-1, q_size, kv_size).reshape({1, n * kv_heads, D}), layer.k_norm);
    return at::cat({q.view({1, n, q_size}), k.view({1, n, kv_size}), qkv.narrow(-1, q_size + kv_size, kv_size)}, -1);
  }

  // x [1, n, H] -> (x after every layer, x before each layer in `capture`); each layer's keys and
  // values written into its cache buffers keys[i], values[i] [1, kv_heads, capacity, D] at slots
  // start .. start + n - 1 (claimed: KVCache.claim); cos[kind], signed_sin[kind] [n, 1, D] the
  // rotary tables of each kind a layer reads; masks[sight] [n, start + n] bool or None (causal,
  // a window cutting in by the layer's own), as `attention` takes it. attn_input [1, n, width]:
  // what the first layer's q/k/v product reads instead of norm(x) (an EAGLE-3 drafter's layer
  // reads its normed embedding and normed feature side by side, the feature x its residual), or None.
  std::tuple<at::Tensor, std::vector<at::Tensor>> run(
      at::Tensor x, const std::vector<at::Tensor>& keys, const std::vector<at::Tensor>& values,
      const std::vector<at::Tensor>& cos, const std::vector<at::Tensor>& signed_sin, int64_t start,
      const std::vector<c10::optional<at::Tensor>>& masks, const std::vector<int64_t>& capture,
      const c10::optional<at::Tensor>& attn_input) const {
    check(keys.size() == layers.size() && values.size() == layers.size(), "one cache per layer");
    check(!attn_input || (attn_input->dim() == 3 && attn_input->size(1) == x.size(1) &&
                          attn_input->scalar_type() == x.scalar_type()),
          "attn_input [1, n, width] in x's dtype");
    for (const Layer& layer : layers)
      check(layer.kind >= 0 && layer.kind < static_cast<int64_t>(std::min(cos.size(), signed_sin.size())) &&
                layer.sight >= 0 && layer.sight < static_cast<int64_t>(masks.size()),
            "a rotary table and a mask for each layer's kind and sight");
    const int64_t length = start + x.size(1);
    std::vector<at::Tensor> captured;
    for (size_t i = 0; i < layers.size(); ++i) {
      const Layer& layer = layers[i];
      if (std::find(capture.begin(), capture.end(), static_cast<int64_t>(i)) != capture.end())
        captured.push_back(x[0]);
      at::Tensor k = keys[i], v = values[i];
      const at::Tensor normed = i == 0 && attn_input ? *attn_input : norm(x, layer.attn_norm);
      at::Tensor qkv = multiply(layer.qkv, normed, least[0]);
      if (layer.q_norm.defined()) qkv = norm_heads(qkv, layer, k.size(1), k.size(3));
      const at::Tensor q = heads_into_cache(qkv, cos[layer.kind], signed_sin[layer.kind], k, v, start, heads);
      const c10::optional<at::Tensor>& mask = masks[layer.sight];
      const bool masked = mask.has_value() && mask->defined();  // a tree's mask holds its window
      const at::Tensor attended = attention(q, k, v, mask, length, scale, isa, masked ? 0 : layer.window);
      x = x + maybe_norm(multiply(layer.out, attended, least[1]), layer.attn_post_norm);
      const std::vector<at::Tensor> gate_up =
          multiply(layer.gate_up, norm(x, layer.mlp_norm), least[2]).chunk(2, -1);
      const at::Tensor gated = gelu ? at::gelu(gate_up[0], "tanh") : at::silu(gate_up[0]);
      x = x + maybe_norm(multiply(layer.down, gated * gate_up[1], least[3]), layer.mlp_post_norm);
    }
    return {x, captured};
  }
};

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  module.def("features", &features, "instruction sets this CPU offers the kernels");
  module.def("linear_codes", &linear_codes, "x @ w.T for group-coded weights");
  module.def("linear_dense", &linear_dense, "x @ w.T for packed bfloat16 weights");
  module.def("attention", &attention, "row attention over a cache");
  module.def("rms_norm", &rms_norm, "RMS norm of each row");
  module.def("module_norm", &module_norm, "a Hugging Face RMSNorm module's forward, its own ops");
  module.def("rotate", &rotate, "rotary embedding of each row's heads");
  module.def("heads_into_cache", &heads_into_cache, "a qkv product's rotated queries, and its keys and values cached");
  pybind11::class_<Part>(module, "Part")
      .def(pybind11::init<at::Tensor, at::Tensor, c10::optional<at::Tensor>, int64_t, int64_t, int64_t, bool, bool>())
      .def(pybind11::init<at::Tensor, c10::optional<at::Tensor>>());
  using Parts = std::vector<Part>;
  using Norm = c10::optional<at::Tensor>;
  pybind11::class_<Layer>(module, "Layer")
      .def(pybind11::init([](at::Tensor attn_norm, at::Tensor mlp_norm, Parts qkv, Parts out, Parts gate_up, Parts down,
                             Norm q_norm, Norm k_norm, Norm attn_post_norm, Norm mlp_post_norm, int64_t window,
                             int64_t kind, int64_t sight) {
        check((q_norm.has_value() == k_norm.has_value()) && window >= 0, "q and k norms together, window >= 0");
        return Layer{std::move(attn_norm), std::move(mlp_norm), std::move(qkv), std::move(out), std::move(gate_up),
                     std::move(down), q_norm.value_or(at::Tensor()), k_norm.value_or(at::Tensor()),
                     attn_post_norm.value_or(at::Tensor()), mlp_post_norm.value_or(at::Tensor()), window, kind, sight};
      }));
  pybind11::class_<Stack>(module, "Stack")
      .def(pybind11::init<std::vector<Layer>, double, double, int64_t, int64_t, bool, bool, bool, std::vector<int64_t>>())
      .def("run", &Stack::run, "the decoder layers over one block");
}
