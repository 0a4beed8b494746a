// Matrix-vector products of quantized weights (Q4_K, Q6_K, Q4_0/Q4_1, Q8_0) with int8 activations, the
// way llama.cpp's CPU kernels multiply: the activations are quantized to int8 once a call, and each code
// byte multiplies an activation byte in integer arithmetic, four to a 32-bit lane (vpdpbusd on
// AVX512-VNNI, vpmaddubsw and vpmaddwd on AVX2: int8_vectors.h).
// bubo/kernels/int8_matvec.py builds this file, registers the ops and describes the layouts.
//
// The weights are tiled as bubo/kernels/codes.py says: a tile's output rows one per 32-bit lane (16 with
// AVX-512, 8 with AVX2), a tile's words together. Q4_K keeps bubo/kernels/super_block_matvec.py's layout:
// a word holds 8 consecutive 4-bit codes of its row, so `w & 0x0F0F0F0F` holds, as bytes, the codes of
// inputs k, k+2, k+4, k+6 and `(w >> 4) & 0x0F0F0F0F` those of k+1, k+3, k+5, k+7: the activations are
// stored in that order (an "even" and an "odd" dword a code word), and each is one dot product against a
// broadcast dword. Q6_K has a layout of its own (int8_matvec.py): the low 4 bits of its codes in such
// words, the high 2 bits of 16 codes in one word arranged so that a shift and an AND put them beside the
// low bits.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "int8_vectors.h"

namespace {

using vec::kLanes;
using Int = vec::Int;
using Float = vec::Float;

constexpr int64_t kSuper = 256;      // weights of a K-quant super-block
constexpr int64_t kBlock = 32;       // activations sharing one int8 scale
constexpr int64_t kWorkGrain = 16;   // super-block rows of work a thread takes at least

// One row of activations as int8: per code word of 8 inputs two dwords (inputs 0, 2, 4, 6 and 1, 3,
// 5, 7), a float scale a block of 32, the block's sum (Q4_K's min term) and the int8 values' sum per 16
// (Q6_K's code bias). The sums are the quantized values' (llama.cpp's bsums): every term of a product
// then multiplies the same activations, d * q.
struct Activations {
  std::vector<int32_t> dwords;
  std::vector<int32_t> natural;  // the same bytes in input order (PackedQ8's byte codes)
  std::vector<float> scale;
  std::vector<float> sum;
  std::vector<int32_t> qsum16;
};

// Quantizes x [n] into `a` (its buffers reused from call to call), a block of 32 at a time.
void quantize(const float* x, int64_t n, Activations& a) {
  a.dwords.resize(n / 4);
  a.natural.resize(n / 4);
  a.scale.resize(n / kBlock);
  a.sum.resize(n / kBlock);
  a.qsum16.resize(n / 16);
  // Within each 8 inputs: the even ones' bytes, then the odd ones'.
  const __m128i order = _mm_setr_epi8(0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15);
  for (int64_t b = 0; b < n / kBlock; ++b) {
    int32_t* natural = a.natural.data() + b * 8;
    const float d = vec::quantize_block(x + b * kBlock, reinterpret_cast<int8_t*>(natural), a.qsum16.data() + 2 * b);
    for (int half = 0; half < 2; ++half) {
      const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(natural + 4 * half));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(a.dwords.data() + b * 8 + 4 * half), _mm_shuffle_epi8(bytes, order));
    }
    a.scale[b] = d;
    a.sum[b] = d * static_cast<float>(a.qsum16[2 * b] + a.qsum16[2 * b + 1]);
  }
}

inline Int low_nibbles(Int v) { return vec::and_bits(v, vec::splat(0x0F0F0F0F)); }
inline Int high_nibbles(Int v) { return low_nibbles(vec::shift_right(v, 4)); }
inline Int byte_of(Int v, int byte) { return vec::and_bits(vec::shift_right(v, 8 * byte), vec::splat(0xFF)); }

// Q4_K, a super-block of one tile against R activation rows at once (the rows of a batched step share the
// codes, unpacked once): words [32, lanes] (sub-block j's codes in words 4j..4j+3), fields [4, lanes]
// (scale bytes, then min bytes, sub-block j at byte j % 4 of word j / 4), factors [2, lanes] (d, dmin).
// weight = d * sc_j * q - dmin * m_j, so the dot product is d * sum_j sc_j * (x_j . q_j) - dmin * sum_j
// m_j * sum(x_j): the first sum from the int8 products, the second from the activations' block sums.
// Row r's activations are a[r]'s from super-block s on.
template <int R>
inline void q4_k_super_block(const int32_t* words, const int32_t* fields, const float* factors,
                             const Activations* const* a, int64_t s, Float* acc) {
  Float scaled[R], mins[R];
  for (int r = 0; r < R; ++r) scaled[r] = mins[r] = vec::zero_float();
  for (int j = 0; j < 8; ++j) {
    vec::Products even[R], odd[R];
    for (int r = 0; r < R; ++r) even[r] = odd[r] = vec::no_products();
    for (int w = 0; w < 4; ++w) {
      const Int v = vec::load_int(words + (4 * j + w) * kLanes);
      const Int low = low_nibbles(v), high = high_nibbles(v);
      for (int r = 0; r < R; ++r) {
        const int32_t* x = a[r]->dwords.data() + s * (kSuper / 4) + (4 * j + w) * 2;
        even[r] = vec::dot_products(even[r], low, x[0]);
        odd[r] = vec::dot_products(odd[r], high, x[1]);
      }
    }
    const Int sc = byte_of(vec::load_int(fields + (j / 4) * kLanes), j % 4);
    const Float m = vec::to_float(byte_of(vec::load_int(fields + (2 + j / 4) * kLanes), j % 4));
    for (int r = 0; r < R; ++r) {
      const int64_t block = s * (kSuper / kBlock) + j;
      const Int isum = vec::scaled_sum(even[r], odd[r], sc);
      scaled[r] = vec::fmadd(vec::to_float(isum), vec::splat(a[r]->scale[block]), scaled[r]);
      mins[r] = vec::fmadd(m, vec::splat(a[r]->sum[block]), mins[r]);
    }
  }
  const Float d = vec::load_float(factors), dmin = vec::load_float(factors + kLanes);
  for (int r = 0; r < R; ++r) acc[r] = vec::fnmadd(dmin, mins[r], vec::fmadd(d, scaled[r], acc[r]));
}

// Q6_K, a super-block of one tile against R rows, as Q4_K's: words [52, lanes] stored in the order they are
// read, so that they stream from memory as one sequence (stored as three runs read interleaved, they
// streamed at under half the speed): 4 words of int8 scales (sub-block j at byte j % 4 of word j / 4), then
// sub-block j's three words at q6_k_word(j): two of low nibbles (its 16 codes, 8 a word) and one of high
// bits (byte b holds, two bits each from the bottom, those of codes 2b, 2b + 1, 8 + 2b, 9 + 2b); factors
// [1, lanes] (d). Codes are stored unsigned (q + 32): weight = d * sc_j * (q - 32), so x_j . (q_j - 32) =
// x_j . q_j - 32 * sum(x_j), the latter from the int8 sums.
constexpr int64_t q6_k_word(int64_t j) { return 4 + 3 * j; }

template <int R>
inline void q6_k_super_block(const int32_t* words, const float* factors, const Activations* const* a, int64_t s,
                             Float* acc) {
  const Int high_mask = vec::splat(0x30303030);
  Float scaled[R];
  for (int r = 0; r < R; ++r) scaled[r] = vec::zero_float();
  for (int pair = 0; pair < 8; ++pair) {
    // Sub-blocks 2 * pair and 2 * pair + 1 share an activation block (one scale): their integer sums times
    // their scales add up before one conversion.
    Int isum[R];
    for (int r = 0; r < R; ++r) isum[r] = vec::zero_int();
    for (int j = 2 * pair; j < 2 * pair + 2; ++j) {
      const int32_t* sub_block = words + q6_k_word(j) * kLanes;
      const Int l0 = vec::load_int(sub_block), l1 = vec::load_int(sub_block + kLanes);
      const Int h = vec::load_int(sub_block + 2 * kLanes);
      const Int c0 = vec::or_bits(low_nibbles(l0), vec::and_bits(vec::shift_left(h, 4), high_mask));
      const Int c1 = vec::or_bits(high_nibbles(l0), vec::and_bits(vec::shift_left(h, 2), high_mask));
      const Int c2 = vec::or_bits(low_nibbles(l1), vec::and_bits(h, high_mask));
      const Int c3 = vec::or_bits(high_nibbles(l1), vec::and_bits(vec::shift_right(h, 2), high_mask));
      const Int sc_word = vec::load_int(words + (j / 4) * kLanes);
      const Int sc = vec::shift_right_signed(vec::shift_left(sc_word, 24 - 8 * (j % 4)), 24);
      // 6-bit codes leave no room for int16 sums of more than two dots: these widen to 32 bits at once.
      for (int r = 0; r < R; ++r) {
        const int32_t* x = a[r]->dwords.data() + s * (kSuper / 4) + 4 * j;
        Int even = vec::dot(vec::splat(-32 * a[r]->qsum16[s * (kSuper / 16) + j]), c0, x[0]);
        Int odd = vec::dot(vec::zero_int(), c1, x[1]);
        even = vec::dot(even, c2, x[2]);
        odd = vec::dot(odd, c3, x[3]);
        isum[r] = vec::add(isum[r], vec::mul(vec::add(even, odd), sc));
      }
    }
    for (int r = 0; r < R; ++r)
      scaled[r] = vec::fmadd(vec::to_float(isum[r]), vec::splat(a[r]->scale[s * (kSuper / kBlock) + pair]),
                             scaled[r]);
  }
  const Float d = vec::load_float(factors);
  for (int r = 0; r < R; ++r) acc[r] = vec::fmadd(d, scaled[r], acc[r]);
}

// Q4_0 / Q4_1 (bubo/kernels/q4_matvec.py's PackedQ4), a block of 32 weights of one tile: words [4, lanes] as
// a Q4_K sub-block's, scale and offset [2, lanes] (float16 or float32): weight = code * scale + offset, so
// the dot product is scale * (x . codes) + offset * sum(x).
inline Float q4_block(const int32_t* words, Float scale, Float offset, const int32_t* x, float x_scale,
                      float x_sum, Float acc) {
  vec::Products even = vec::no_products(), odd = vec::no_products();
  for (int w = 0; w < 4; ++w) {
    const Int v = vec::load_int(words + w * kLanes);
    even = vec::dot_products(even, low_nibbles(v), x[2 * w]);
    odd = vec::dot_products(odd, high_nibbles(v), x[2 * w + 1]);
  }
  const Float dots = vec::to_float(vec::scaled_sum(even, odd, vec::splat(1)));
  acc = vec::fmadd(dots, vec::mul(scale, vec::splat(x_scale)), acc);
  return vec::fmadd(offset, vec::splat(x_sum), acc);
}

// Q8_0, Q5_0 and IQ4_NL (bubo/kernels/q8_matvec.py's PackedQ8), a block of 32 weights of one tile: words
// [9, lanes], byte s of word w the code of weight 4w + s stored as code + 128, then the scale's float32
// bits. x . codes = x . (stored - 128) = x . stored - 128 * sum(x), the latter from the int8 sums.
inline Float q8_block(const int32_t* words, const int32_t* x, float x_scale, int32_t x_qsum, Float acc) {
  Int isum = vec::splat(-128 * x_qsum);
  for (int w = 0; w < 8; ++w) isum = vec::dot_bytes(isum, vec::load_int(words + w * kLanes), x[w]);
  const Float scale = vec::as_float(vec::load_int(words + 8 * kLanes));
  return vec::fmadd(vec::to_float(isum), vec::mul(scale, vec::splat(x_scale)), acc);
}

enum class Format { Q4_K, Q6_K, Q4, Q8 };

struct Weights {
  Format format;
  const int32_t* words;
  const int32_t* fields;  // Q4_K only
  const float* factors;   // Q4's scale and offset where float32
  const at::Half* half_factors;  // Q4's where float16
  int64_t supers;         // blocks a row: super-blocks of 256 weights, or (Q4, Q8) blocks of 32
  int64_t words_a_super;  // a tile's words a block
  int64_t fields_a_super;
  int64_t factors_a_super;

  int64_t block_inputs() const { return format == Format::Q4_K || format == Format::Q6_K ? kSuper : kBlock; }
};

inline Float load_factor(const Weights& w, int64_t offset) {
  if (w.half_factors != nullptr) return vec::load_half(w.half_factors + offset);
  return vec::load_float(w.factors + offset);
}

// One output tile for R activation rows: a dot product a lane and row over its blocks, into out[r]. The K-quants
// unpack each block's codes once for the R rows; Q4 and Q8, whose codes take an instruction or none to
// unpack, run the rows one after the other.
template <int R>
inline void tile_product(const Weights& w, int64_t tile, const Activations* const* a, float* const* out) {
  Float acc[R];
  for (int r = 0; r < R; ++r) acc[r] = vec::zero_float();
  for (int64_t s = 0; s < w.supers; ++s) {
    const int64_t block = tile * w.supers + s;
    const int32_t* words = w.words + block * w.words_a_super * kLanes;
    const int64_t factors = block * w.factors_a_super * kLanes;
    switch (w.format) {
      case Format::Q4_K:
        q4_k_super_block<R>(words, w.fields + block * w.fields_a_super * kLanes, w.factors + factors, a, s, acc);
        break;
      case Format::Q6_K:
        q6_k_super_block<R>(words, w.factors + factors, a, s, acc);
        break;
      case Format::Q4:
        for (int r = 0; r < R; ++r)
          acc[r] = q4_block(words, load_factor(w, factors), load_factor(w, factors + kLanes),
                            a[r]->dwords.data() + s * (kBlock / 4), a[r]->scale[s], a[r]->sum[s], acc[r]);
        break;
      case Format::Q8:
        for (int r = 0; r < R; ++r)
          acc[r] = q8_block(words, a[r]->natural.data() + s * (kBlock / 4), a[r]->scale[s],
                            a[r]->qsum16[2 * s] + a[r]->qsum16[2 * s + 1], acc[r]);
        break;
    }
  }
  for (int r = 0; r < R; ++r) vec::store(out[r], acc[r]);
}

// Tile `tile` for `n` rows, up to four at a time: row k's activations are `row(k)`, its tile of results goes to
// `out(k)`.
template <typename Row, typename Out>
inline void tile_products(const Weights& w, int64_t tile, int64_t n, Row row, Out out) {
  for (int64_t first = 0; first < n; first += 4) {
    const Activations* a[4];
    float* o[4];
    const int64_t count = std::min<int64_t>(4, n - first);
    for (int64_t k = 0; k < count; ++k) {
      a[k] = row(first + k);
      o[k] = out(first + k);
    }
    switch (count) {
      case 4: tile_product<4>(w, tile, a, o); break;
      case 3: tile_product<3>(w, tile, a, o); break;
      case 2: tile_product<2>(w, tile, a, o); break;
      default: tile_product<1>(w, tile, a, o); break;
    }
  }
}

const int32_t* word_data(const at::Tensor& t) {
  TORCH_CHECK(t.is_contiguous() && t.element_size() == 4 && t.device().is_cpu(),
              "packed words must be contiguous 32-bit CPU tensors");
  return static_cast<const int32_t*>(t.data_ptr());
}

// The weights' tensors as the format stores them: words [tiles, blocks, words, lanes], with Q4_K's fields and
// factors, Q6_K's factors, or Q4's scale and offset (float16 or float32) as `factors`.
Weights weights_of(Format format, const at::Tensor& words, const at::Tensor& fields, const at::Tensor& factors) {
  TORCH_CHECK(words.dim() == 4 && words.size(3) == kLanes, "words must be [tiles, blocks, words, lanes]");
  Weights w{format, word_data(words), nullptr, nullptr, nullptr, words.size(1), words.size(2), 0, 0};
  if (format == Format::Q8) return w;
  TORCH_CHECK(factors.is_contiguous() && factors.size(0) == words.size(0) && factors.size(1) == words.size(1),
              "factors must be contiguous [tiles, blocks, n, lanes]");
  w.factors_a_super = factors.size(2);
  if (format == Format::Q4 && factors.scalar_type() == at::kHalf) {
    w.half_factors = factors.data_ptr<at::Half>();
  } else {
    TORCH_CHECK(factors.scalar_type() == at::kFloat, "factors must be float32 (or Q4's float16)");
    w.factors = factors.data_ptr<float>();
  }
  if (format == Format::Q4_K) {
    w.fields = word_data(fields);
    w.fields_a_super = fields.size(2);
  }
  return w;
}

// The rows of x quantized, in buffers this thread keeps for its next call.
const std::vector<Activations>& quantize_rows(const at::Tensor& x, int64_t in_features) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.size(1) == in_features,
              "x must be float32 [rows, in_features]");
  const at::Tensor xc = x.contiguous();
  static thread_local std::vector<Activations> rows;
  rows.resize(xc.size(0));
  for (int64_t r = 0; r < xc.size(0); ++r) quantize(xc.data_ptr<float>() + r * in_features, in_features, rows[r]);
  return rows;
}

// x [rows, in] times every tile of the weights -> [rows, tiles * lanes]; with `experts` [n] (ids into a stack of
// experts of `expert_rows` rows each, n a multiple of x's rows) -> [n, expert_rows]: expert experts[i] times
// row i / (n / rows) of x, so that a row's k picked experts (k ids in a row) share it.
at::Tensor matvec(Format format, const at::Tensor& x, const at::Tensor& words, const at::Tensor& fields,
                  const at::Tensor& factors, const std::optional<at::Tensor>& experts, int64_t expert_rows) {
  const Weights w = weights_of(format, words, fields, factors);
  const std::vector<Activations>& rows = quantize_rows(x, w.supers * w.block_inputs());
  const int64_t tiles = words.size(0);
  const int64_t work = std::max<int64_t>(1, w.supers * w.block_inputs() / kSuper);  // super-blocks a tile
  if (!experts.has_value()) {
    at::Tensor out = at::empty({x.size(0), tiles * kLanes}, x.options());
    float* o = out.data_ptr<float>();
    const int64_t n_rows = x.size(0);
    const int64_t grain = std::max<int64_t>(1, kWorkGrain / (work * n_rows));
    at::parallel_for(0, tiles, grain, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t)
        tile_products(
            w, t, n_rows, [&](int64_t r) { return &rows[r]; },
            [&](int64_t r) { return o + r * tiles * kLanes + t * kLanes; });
    });
    return out;
  }
  TORCH_CHECK(expert_rows > 0 && expert_rows % kLanes == 0 && tiles * kLanes % expert_rows == 0,
              "expert_rows must be a whole number of tiles dividing the stack");
  const at::Tensor ids = experts->to(at::kLong).contiguous();
  const int64_t n = ids.numel(), expert_tiles = expert_rows / kLanes, n_experts = tiles / expert_tiles;
  TORCH_CHECK(x.size(0) > 0 && n % x.size(0) == 0, "experts must be a whole number of ids for each row of x");
  const int64_t ids_a_row = n / x.size(0);
  const int64_t* id = ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) TORCH_CHECK(id[i] >= 0 && id[i] < n_experts, "expert id out of range");
  at::Tensor out = at::empty({n, expert_rows}, x.options());
  float* o = out.data_ptr<float>();
  // The pairs grouped by expert: an expert that several rows picked (a batch's sequences, a verify pass's
  // tokens) is read once for all of them, its codes unpacked once for up to four rows.
  std::vector<int64_t> order(n);
  for (int64_t i = 0; i < n; ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return id[a] < id[b]; });
  std::vector<int64_t> group_start;  // where each expert's pairs begin in `order`, and the end
  for (int64_t k = 0; k < n; ++k)
    if (k == 0 || id[order[k]] != id[order[k - 1]]) group_start.push_back(k);
  const int64_t groups = static_cast<int64_t>(group_start.size());
  group_start.push_back(n);
  at::parallel_for(0, groups * expert_tiles, std::max<int64_t>(1, kWorkGrain / work), [&](int64_t begin, int64_t end) {
    for (int64_t job = begin; job < end; ++job) {
      const int64_t g = job / expert_tiles, t = job % expert_tiles;
      const int64_t* pairs = order.data() + group_start[g];  // this expert's, in order
      tile_products(
          w, id[pairs[0]] * expert_tiles + t, group_start[g + 1] - group_start[g],
          [&](int64_t k) { return &rows[pairs[k] / ids_a_row]; },
          [&](int64_t k) { return o + pairs[k] * expert_rows + t * kLanes; });
    }
  });
  return out;
}

at::Tensor q4_k_matvec(const at::Tensor& x, const at::Tensor& words, const at::Tensor& fields,
                       const at::Tensor& factors, const std::optional<at::Tensor>& experts, int64_t expert_rows) {
  return matvec(Format::Q4_K, x, words, fields, factors, experts, expert_rows);
}

at::Tensor q6_k_matvec(const at::Tensor& x, const at::Tensor& words, const at::Tensor& factors,
                       const std::optional<at::Tensor>& experts, int64_t expert_rows) {
  return matvec(Format::Q6_K, x, words, words, factors, experts, expert_rows);
}

at::Tensor q4_matvec(const at::Tensor& x, const at::Tensor& words, const at::Tensor& scale_offset,
                     const std::optional<at::Tensor>& experts, int64_t expert_rows) {
  return matvec(Format::Q4, x, words, words, scale_offset, experts, expert_rows);
}

at::Tensor q8_matvec(const at::Tensor& x, const at::Tensor& words, const std::optional<at::Tensor>& experts,
                     int64_t expert_rows) {
  return matvec(Format::Q8, x, words, words, words, experts, expert_rows);
}

// The Q6_K layout's weights, transposed: [in_features, tiles * lanes] float32 or bfloat16 (a prefill's GEMM
// operand), bit for bit d * sc_j * (q - 32) as the reference dequantizer computes it in float32.
template <typename T>
void q6_k_unpack_into(const Weights& w, int64_t tiles, T* out) {
  const int64_t width = tiles * kLanes;
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t s = 0; s < w.supers; ++s) {
        const int32_t* words = w.words + (t * w.supers + s) * w.words_a_super * kLanes;
        const float* d = w.factors + (t * w.supers + s) * w.factors_a_super * kLanes;
        for (int64_t k = 0; k < kSuper; ++k) {
          const int64_t j = k / 16, i = k % 16, low_word = q6_k_word(j) + i / 8, low_shift = 4 * (i % 8);
          // Code i of sub-block j: its high bits at byte (i % 8) / 2, pair 2 * (i / 8) + i % 2.
          const int64_t high_shift = 8 * ((i % 8) / 2) + 2 * (2 * (i / 8) + i % 2);
          T* row = out + (s * kSuper + k) * width + t * kLanes;
          for (int64_t lane = 0; lane < kLanes; ++lane) {
            const int32_t low = (words[low_word * kLanes + lane] >> low_shift) & 0xF;
            const int32_t high = (words[(q6_k_word(j) + 2) * kLanes + lane] >> high_shift) & 0x3;
            const int32_t sc = static_cast<int8_t>(words[(j / 4) * kLanes + lane] >> (8 * (j % 4)));
            row[lane] = static_cast<T>(d[lane] * static_cast<float>(sc) * static_cast<float>((low | high << 4) - 32));
          }
        }
      }
  });
}

at::Tensor q6_k_unpack(const at::Tensor& words, const at::Tensor& factors, at::ScalarType dtype) {
  const Weights w = weights_of(Format::Q6_K, words, words, factors);
  const int64_t tiles = words.size(0);
  at::Tensor out = at::empty({w.supers * kSuper, tiles * kLanes}, factors.options().dtype(dtype));
  if (dtype == at::kFloat)
    q6_k_unpack_into(w, tiles, out.data_ptr<float>());
  else if (dtype == at::kBFloat16)
    q6_k_unpack_into(w, tiles, out.data_ptr<at::BFloat16>());
  else
    TORCH_CHECK(false, "q6_k_unpack writes float32 or bfloat16");
  return out;
}

}  // namespace

TORCH_LIBRARY(bubo_int8, m) {
  m.def("q4_k_matvec(Tensor x, Tensor words, Tensor fields, Tensor factors, Tensor? experts, int expert_rows) -> Tensor");
  m.def("q6_k_matvec(Tensor x, Tensor words, Tensor factors, Tensor? experts, int expert_rows) -> Tensor");
  m.def("q6_k_unpack(Tensor words, Tensor factors, ScalarType dtype) -> Tensor");
  m.def("q4_matvec(Tensor x, Tensor words, Tensor scale_offset, Tensor? experts, int expert_rows) -> Tensor");
  m.def("q8_matvec(Tensor x, Tensor words, Tensor? experts, int expert_rows) -> Tensor");
}

TORCH_LIBRARY_IMPL(bubo_int8, CPU, m) {
  m.impl("q4_k_matvec", &q4_k_matvec);
  m.impl("q6_k_matvec", &q6_k_matvec);
  m.impl("q6_k_unpack", &q6_k_unpack);
  m.impl("q4_matvec", &q4_matvec);
  m.impl("q8_matvec", &q8_matvec);
}
