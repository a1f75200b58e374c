// Row-invariant bf16 attention on a CPU with AVX512-BF16: graft_cli/models/native.py builds it once per machine,
// graft_cli/models/invariant.py calls it.
//
// Every row (with the query heads that share its key head) is one task, computed start to end by one thread in a
// fixed order: each key's score by the same dot-product instructions, the softmax's sum lane by lane over the
// row's keys in their canonical order (its shared prefix of the cache, then its own keys: a tree row's ancestors
// by depth, then itself), the values summed key after key in that order. So a row gets the same bits whatever
// rows travel with it, however many threads run, and whether it comes as a step, a tree's node or a chunk's row:
// what lets bf16 graft give bf16 plain decoding's tokens. Scores, softmax and sums stay in fp32 until the output.
#include <immintrin.h>
#include <omp.h>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

inline __m512 widen(const uint16_t* p) {  // 16 bf16 values as fp32, exactly
  __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

inline __m512 exp_below_zero(__m512 x) {  // e^x for x <= 0 as 2^n * e^r, |r| <= ln(2)/2, a degree-7 polynomial in r
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);  // ln 2 in two parts: r stays exact
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), r);
  return _mm512_scalef_ps(_mm512_add_ps(y, _mm512_set1_ps(1.0f)), n);
}

inline __mmask16 lanes(int64_t left) { return left >= 16 ? 0xFFFF : (__mmask16)((1u << left) - 1); }

struct Row {  // where one row's keys are: the first `shared` of the cache, then `count` more at `own`
  int64_t shared, count;
  const int64_t* own;
  int64_t key(int64_t j) const { return j < shared ? j : own[j - shared]; }
  int64_t size() const { return shared + count; }
};

// The G query heads of one key head for one row: scores into `scores` ([G][keys rounded up to 16]), then out.
template <int D, int G>
void one_row(const uint16_t* q, int64_t q_head, const uint16_t* k, const uint16_t* v, const Row& row, float scale,
             uint16_t* out, float* scores) {
  constexpr int P = D / 32, C = D / 16;  // vectors of 32 bf16 (a dot product's pairs), of 16 fp32
  const int64_t n = row.size(), stride = (n + 15) / 16 * 16;
  __m512bh queries[G][P];
  for (int g = 0; g < G; ++g)
    for (int p = 0; p < P; ++p) queries[g][p] = (__m512bh)_mm512_loadu_si512(q + g * q_head + p * 32);
  for (int64_t j = 0; j < n; ++j) {
    const uint16_t* key = k + row.key(j) * D;
    __m512bh keys[P];
    for (int p = 0; p < P; ++p) keys[p] = (__m512bh)_mm512_loadu_si512(key + p * 32);
    for (int g = 0; g < G; ++g) {
      __m512 dot = _mm512_setzero_ps();
      for (int p = 0; p < P; ++p) dot = _mm512_dpbf16_ps(dot, queries[g][p], keys[p]);
      scores[g * stride + j] = _mm512_reduce_add_ps(dot) * scale;
    }
  }
  float total[G];
  for (int g = 0; g < G; ++g) {
    float* s = scores + g * stride;
    __m512 top = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (int64_t j = 0; j < n; j += 16)
      top = _mm512_mask_max_ps(top, lanes(n - j), top, _mm512_maskz_loadu_ps(lanes(n - j), s + j));
    const __m512 most = _mm512_set1_ps(_mm512_reduce_max_ps(top));
    __m512 sum = _mm512_setzero_ps();  // key j adds into lane j % 16: the order is the keys' own
    for (int64_t j = 0; j < n; j += 16) {
      const __mmask16 m = lanes(n - j);
      __m512 e = _mm512_maskz_mov_ps(m, exp_below_zero(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, s + j), most)));
      _mm512_mask_storeu_ps(s + j, m, e);
      sum = _mm512_add_ps(sum, e);
    }
    total[g] = _mm512_reduce_add_ps(sum);
  }
  __m512 acc[G][C];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) acc[g][c] = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; ++j) {  // the values key after key, each read once for the G heads
    const uint16_t* value = v + row.key(j) * D;
    __m512 values[C];
    for (int c = 0; c < C; ++c) values[c] = widen(value + c * 16);
    for (int g = 0; g < G; ++g) {
      const __m512 w = _mm512_set1_ps(scores[g * stride + j]);
      for (int c = 0; c < C; ++c) acc[g][c] = _mm512_fmadd_ps(w, values[c], acc[g][c]);
    }
  }
  for (int g = 0; g < G; ++g) {
    const __m512 inverse = _mm512_set1_ps(1.0f / total[g]);
    for (int c = 0; c < C; ++c) {
      __m256bh rounded = _mm512_cvtneps_pbh(_mm512_mul_ps(acc[g][c], inverse));
      std::memcpy(out + g * q_head + c * 16, &rounded, 32);
    }
  }
}

template <int D, int G>
void every_row(const uint16_t* q, int64_t q_head, int64_t q_row, const uint16_t* k, int64_t k_head,
               const uint16_t* v, int64_t v_head, const int64_t* shared, const int64_t* own, int64_t width,
               const int64_t* counts, int64_t kv_heads, int64_t rows, float scale, uint16_t* out, int threads) {
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> scores;
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < kv_heads * rows; ++task) {
      const int64_t h = task / rows, r = task % rows;
      const Row row{shared[r], counts[r], own + r * width};
      scores.resize(G * ((row.size() + 15) / 16 * 16));
      const int64_t at = h * G * q_head + r * q_row;
      one_row<D, G>(q + at, q_head, k + h * k_head, v + h * v_head, row, scale, out + at, scores.data());
    }
  }
}

}  // namespace

// q and out: [heads, rows, D] with heads' stride q_head and rows' q_row; k and v: [kv_heads, keys, D], each key's
// D values contiguous; row r sees keys 0 .. shared[r]-1, then own[r * width .. + counts[r]]. Returns 0, or 1 where
// no kernel serves this head size and grouping (the caller then takes another path).
extern "C" int graft_attend(const uint16_t* q, int64_t q_head, int64_t q_row, const uint16_t* k, int64_t k_head,
                            const uint16_t* v, int64_t v_head, const int64_t* shared, const int64_t* own,
                            int64_t width, const int64_t* counts, int64_t kv_heads, int64_t rows, int64_t groups,
                            int64_t dim, float scale, uint16_t* out, int threads) {
#define GRAFT_KERNEL(d, g)                                                                                      \
  if (dim == d && groups == g) {                                                                                \
    every_row<d, g>(q, q_head, q_row, k, k_head, v, v_head, shared, own, width, counts, kv_heads, rows, scale, \
                    out, threads);                                                                              \
    return 0;                                                                                                   \
  }
  GRAFT_KERNEL(64, 1) GRAFT_KERNEL(64, 2) GRAFT_KERNEL(64, 3) GRAFT_KERNEL(64, 4) GRAFT_KERNEL(64, 5)
  GRAFT_KERNEL(64, 6) GRAFT_KERNEL(64, 7) GRAFT_KERNEL(64, 8) GRAFT_KERNEL(128, 1) GRAFT_KERNEL(128, 2)
  GRAFT_KERNEL(128, 3) GRAFT_KERNEL(128, 4) GRAFT_KERNEL(128, 5) GRAFT_KERNEL(128, 6) GRAFT_KERNEL(128, 7)
  GRAFT_KERNEL(128, 8)
#undef GRAFT_KERNEL
  return 1;
}
