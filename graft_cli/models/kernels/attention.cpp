// Row-invariant bf16 attention on a CPU with AVX512-BF16: graft_cli/models/native.py builds it once per machine,
// graft_cli/models/invariant.py calls it.
//
// A row's keys are in canonical order: its shared prefix of the cache, then its own (a tree row's ancestors by
// depth, then itself). Every key's score comes from the same dot-product instructions whatever lane and tile it
// falls in; the softmax sums key j into lane j % 16; the values are summed two keys at a time in the keys' order.
// A task (a tile of rows, each with the query heads of its key head) runs start to end in one thread. So a row
// gets the same bits whatever rows travel with it, however many threads run, and whether it comes as a step, a
// tree's node or a chunk's row: what lets bf16 graft give bf16 plain decoding's tokens. Scores and softmax are
// fp32; the weights meet the values in bf16 pairs with fp32 sums, as a bf16 matrix product does.
#include <immintrin.h>
#include <cstdint>
#include <algorithm>
#include <cstring>
#include <limits>
#include <vector>

namespace {

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

template <int D>
alignas(64) const uint16_t ZEROS[D] = {};  // a key past a row's last: zero values, zero scores

inline __mmask16 lanes(int64_t left) { return left >= 16 ? 0xFFFF : (__mmask16)((1u << left) - 1); }

// A 16x16 block of 32-bit elements transposed: out[c] lane i = rows[i] lane c (four stages of shuffles).
inline void transpose16(const __m512i* rows, __m512i* out) {
  __m512i t[16], u[16];
  for (int k = 0; k < 8; ++k) {
    t[2 * k] = _mm512_unpacklo_epi32(rows[2 * k], rows[2 * k + 1]);
    t[2 * k + 1] = _mm512_unpackhi_epi32(rows[2 * k], rows[2 * k + 1]);
  }
  for (int k = 0; k < 4; ++k) {  // u[4k + m], 128-bit lane L: column 4L + m of rows 4k .. 4k + 3
    u[4 * k] = _mm512_unpacklo_epi64(t[4 * k], t[4 * k + 2]);
    u[4 * k + 1] = _mm512_unpackhi_epi64(t[4 * k], t[4 * k + 2]);
    u[4 * k + 2] = _mm512_unpacklo_epi64(t[4 * k + 1], t[4 * k + 3]);
    u[4 * k + 3] = _mm512_unpackhi_epi64(t[4 * k + 1], t[4 * k + 3]);
  }
  for (int m = 0; m < 4; ++m) {
    __m512i a = _mm512_shuffle_i32x4(u[m], u[4 + m], 0x44), b = _mm512_shuffle_i32x4(u[m], u[4 + m], 0xEE);
    __m512i c = _mm512_shuffle_i32x4(u[8 + m], u[12 + m], 0x44), d = _mm512_shuffle_i32x4(u[8 + m], u[12 + m], 0xEE);
    out[m] = _mm512_shuffle_i32x4(a, c, 0x88);
    out[4 + m] = _mm512_shuffle_i32x4(a, c, 0xDD);
    out[8 + m] = _mm512_shuffle_i32x4(b, d, 0x88);
    out[12 + m] = _mm512_shuffle_i32x4(b, d, 0xDD);
  }
}

// The scores of `count` query vectors (bf16, D each, at queries + i * D) against 16 keys: every key's D values
// (nullptr: a key past the row's last, zeros) transposed so that a lane holds one key, then one dot-product
// instruction per pair of dimensions, pair after pair: a key's score is the same arithmetic in any lane and tile.
template <int D, int Q>
inline void some_queries(const __m512i* pairs, const uint16_t* queries, float scale, float* scores, int64_t stride) {
  __m512 dot[Q];  // Q vectors' scores at once: each pair's keys loaded once for all of them
  for (int i = 0; i < Q; ++i) dot[i] = _mm512_setzero_ps();
  for (int p = 0; p < D / 2; ++p) {
    const __m512bh keys = (__m512bh)_mm512_load_si512(pairs + p);
    for (int i = 0; i < Q; ++i) {
      const int32_t pair = reinterpret_cast<const int32_t*>(queries + i * D)[p];
      dot[i] = _mm512_dpbf16_ps(dot[i], keys, (__m512bh)_mm512_set1_epi32(pair));
    }
  }
  for (int i = 0; i < Q; ++i) _mm512_storeu_ps(scores + i * stride, _mm512_mul_ps(dot[i], _mm512_set1_ps(scale)));
}

template <int D>
void sixteen_keys(const uint16_t* const* keys, const uint16_t* queries, int count, float scale, float* scores,
                  int64_t stride) {
  constexpr int PAIRS = D / 2;
  alignas(64) __m512i pairs[PAIRS];
  for (int block = 0; block < PAIRS / 16; ++block) {
    __m512i rows[16];
    for (int i = 0; i < 16; ++i)
      rows[i] = _mm512_loadu_si512((keys[i] ? keys[i] : ZEROS<D>) + block * 32);
    transpose16(rows, pairs + block * 16);
  }
  int i = 0;
  for (; i + 8 <= count; i += 8) some_queries<D, 8>(pairs, queries + i * D, scale, scores + i * stride, stride);
  const uint16_t* q = queries + i * D;
  float* s = scores + i * stride;
  switch (count - i) {
    case 7: some_queries<D, 7>(pairs, q, scale, s, stride); break;
    case 6: some_queries<D, 6>(pairs, q, scale, s, stride); break;
    case 5: some_queries<D, 5>(pairs, q, scale, s, stride); break;
    case 4: some_queries<D, 4>(pairs, q, scale, s, stride); break;
    case 3: some_queries<D, 3>(pairs, q, scale, s, stride); break;
    case 2: some_queries<D, 2>(pairs, q, scale, s, stride); break;
    case 1: some_queries<D, 1>(pairs, q, scale, s, stride); break;
  }
}

struct Row {  // where one row's keys are: the first `shared` of the cache, then `count` more at `own`
  int64_t shared, count;
  const int64_t* own;
  int64_t key(int64_t j) const { return j < shared ? j : own[j - shared]; }
  int64_t size() const { return shared + count; }
};

// One row's G query heads after their scores: the softmax (each head's sum lane by lane, key j into lane j % 16:
// the keys' own order), then the values two keys at a time, each pair read once for the G heads, then the output.
template <int D, int G>
void finish_row(const uint16_t* v, const Row& row, float* scores, int64_t stride, uint16_t* out, int64_t q_head) {
  constexpr int C = D / 16;
  const int64_t n = row.size();
  float total[G];
  for (int g = 0; g < G; ++g) {
    float* s = scores + g * stride;
    __m512 top = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (int64_t j = 0; j < n; j += 16)
      top = _mm512_mask_max_ps(top, lanes(n - j), top, _mm512_maskz_loadu_ps(lanes(n - j), s + j));
    const __m512 most = _mm512_set1_ps(_mm512_reduce_max_ps(top));
    __m512 sum = _mm512_setzero_ps();
    for (int64_t j = 0; j < n; j += 16) {
      const __mmask16 m = lanes(n - j);
      __m512 e = _mm512_maskz_mov_ps(m, exp_below_zero(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, s + j), most)));
      _mm512_mask_storeu_ps(s + j, m, e);
      sum = _mm512_add_ps(sum, e);
    }
    total[g] = _mm512_reduce_add_ps(sum);
  }
  // the values two keys at a time: each head's weights of keys j and j + 1 rounded to bf16 and paired (as a bf16
  // matrix product takes them), the two keys' values paired dimension by dimension, one dot-product instruction
  // per 16 dimensions; pair after pair, the keys' own order (an odd last key pairs with a zero weight)
  uint16_t* weights = reinterpret_cast<uint16_t*>(scores);  // each head's bf16 weights over its own first half
  for (int g = 0; g < G; ++g) {
    const float* e = scores + g * stride;
    uint16_t* w = weights + g * stride * 2;
    for (int64_t j = 0; j < n; j += 16) {  // written behind what is read; lanes past the last key: zero weights
      const __m256bh rounded = _mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(lanes(n - j), e + j));
      std::memcpy(w + j, &rounded, 32);
    }
  }
  __m512 acc[G][C];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) acc[g][c] = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; j += 2) {
    const uint16_t* first = v + row.key(j) * D;
    const uint16_t* second = j + 1 < n ? v + row.key(j + 1) * D : ZEROS<D>;
    __m512bh values[C];
    for (int c = 0; c < C; ++c) {
      const __m512i low = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(first) + c));
      const __m512i high = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(second) + c));
      values[c] = (__m512bh)_mm512_or_si512(low, _mm512_slli_epi32(high, 16));
    }
    for (int g = 0; g < G; ++g) {
      int32_t pair;  // keys j and j + 1, the first in the low half
      std::memcpy(&pair, weights + g * stride * 2 + j, 4);
      const __m512bh w = (__m512bh)_mm512_set1_epi32(pair);
      for (int c = 0; c < C; ++c) acc[g][c] = _mm512_dpbf16_ps(acc[g][c], values[c], w);
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

// A tile of rows (each with the G query heads of one key head): the keys every row of the tile sees first, 16 at
// a time for all of them at once, then each row's own keys, then each row finished alone.
template <int D, int G>
void tile(const uint16_t* q, int64_t q_head, int64_t q_row, const uint16_t* k, const uint16_t* v, const Row* rows,
          int count, float scale, uint16_t* out, std::vector<float>& scores, std::vector<uint16_t>& queries) {
  int64_t longest = 0, common = std::numeric_limits<int64_t>::max();
  for (int r = 0; r < count; ++r) {
    longest = std::max(longest, rows[r].size());
    common = std::min(common, rows[r].shared);
  }
  const int64_t stride = (longest + 15) / 16 * 16;
  common = common / 16 * 16;
  scores.resize(count * G * stride);
  queries.resize(count * G * D);
  for (int r = 0; r < count; ++r)
    for (int g = 0; g < G; ++g) std::memcpy(&queries[(r * G + g) * D], q + r * q_row + g * q_head, D * 2);
  const uint16_t* keys[16];
  for (int64_t j = 0; j < common; j += 16) {
    for (int i = 0; i < 16; ++i) keys[i] = k + (j + i) * D;
    sixteen_keys<D>(keys, queries.data(), count * G, scale, scores.data() + j, stride);
  }
  for (int r = 0; r < count; ++r) {
    const int64_t n = rows[r].size();
    for (int64_t j = common; j < n; j += 16) {
      for (int i = 0; i < 16; ++i) keys[i] = j + i < n ? k + rows[r].key(j + i) * D : nullptr;
      sixteen_keys<D>(keys, &queries[r * G * D], G, scale, scores.data() + r * G * stride + j, stride);
    }
    finish_row<D, G>(v, rows[r], scores.data() + r * G * stride, stride, out + r * q_row, q_head);
  }
}

template <int D, int G>
void every_row(const uint16_t* q, int64_t q_head, int64_t q_row, const uint16_t* k, int64_t k_head,
               const uint16_t* v, int64_t v_head, const int64_t* shared, const int64_t* own, int64_t width,
               const int64_t* counts, int64_t kv_heads, int64_t rows, float scale, uint16_t* out, int threads) {
  constexpr int TILE = G <= 3 ? 8 : 4;  // rows a tile scores together: their query vectors' scores fit the caches
  const int64_t tiles = (rows + TILE - 1) / TILE;
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> scores;
    std::vector<uint16_t> queries;
    Row tile_rows[TILE];
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < kv_heads * tiles; ++task) {
      const int64_t h = task / tiles, first = task % tiles * TILE;
      const int count = (int)std::min<int64_t>(TILE, rows - first);
      for (int r = 0; r < count; ++r)
        tile_rows[r] = Row{shared[first + r], counts[first + r], own + (first + r) * width};
      const int64_t at = h * G * q_head + first * q_row;
      tile<D, G>(q + at, q_head, q_row, k + h * k_head, v + h * v_head, tile_rows, count, scale, out + at, scores,
                 queries);
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
