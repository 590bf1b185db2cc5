/*
 * CUDA twins of two of vllm_saguaro's draft-device ops (pure CUDA + CUB: no torch, ATen or
 * c10 header here; csrc/bindings.cpp wraps the launchers below as torch ops).
 *
 * They must pick bit-identical tokens and indices to the torch references, and q to
 * within one count:
 *   - saguaro_sample  <-> vllm_saguaro/ops/saguaro_sampling.py::saguaro_sample_reference
 *   - cache_lookup    <-> vllm_saguaro/ops/cache_lookup.py::cache_lookup_reference
 * and they run the same passes as the Triton kernels (vllm_saguaro/ops/triton_kernels.py),
 * with the same integer keys (vllm_saguaro/ops/keys.py). Change one, change them all.
 *
 * saguaro_sample: one block per row, kSampleThreads threads looping over the row. For a row
 * of logits x[0..V) with temperature T, top_k, top_p, fan-out F, scale C and a seed:
 *
 *   key(i)  = sortable_key(x[i]): the float's bits as an int whose order is the float order
 *             (-0.0 and +0.0 share the key 0);
 *   rank(i) = key(i) * 2^32 + (2^32 - 1 - i): distinct per token, the lower index wins ties;
 *   e(i)    = exp(x[i] / T - max_j x[j] / T), in float64.
 *
 *   pass 1      max x, min key, max key (the bisections' range).
 *   pass 2      top-k (0 < top_k < V; else off): thr = the largest t with #(key >= t) >= k,
 *               i.e. the k-th largest key (ties at the cut are all kept), by 33 bisection
 *               steps over the int keys, each a counting pass over the row: exact, no sort.
 *   pass 3      top-p (top_p < 1; else off): thr = the smallest t >= thr with
 *               mass(key >= thr_k and key > t) / mass(key >= thr_k) < top_p, by 33
 *               bisection steps (one mass pass each, plus one for the total): token i is
 *               kept iff the mass strictly above its logit is < top_p, as the reference's
 *               sorted cumsum (equal logits stay or go together).
 *   pass 4      sigma_{F,C} (C < 1; else off, every weight scaled by 1, as the reference's
 *               untouched p): nth = the (F+1)-th largest rank (F clamped to [0, V-1] as the
 *               reference; F+1 >= V puts every token in the top set), by F+1 max passes,
 *               each the largest rank below the previous one.
 *   pass 5      s = sum of e over kept tokens (key >= thr), sig = the same with the top set
 *               (rank >= nth) scaled by C. sig == 0 (C = 0 with all the kept mass on top):
 *               unscaled, q = e / s, as the reference's `total > 0` fallback.
 *   pass 6      p(i) = e'(i) / norm; steps(i) = min(floor(cumsum(p)(i) * Q + 0.5), Q), the last
 *               one forced to Q (Q = Q_SCALE = 2^15, core/sampling.py); the cumsum is chunked
 *               (cub::BlockScan in float64, plus the carry of the chunks before). The draw
 *               r = hash32(seed) & (Q - 1), token = #(steps <= r) (= the first token whose
 *               step exceeds r; steps[V-1] = Q > r). Steps go to the scratch buffer.
 *   pass 7      q(i) = (steps(i) - steps(i-1)) / Q: the integer counts the verifier is told.
 *
 * All probabilities are float64 (the reference's reason: a float32 softmax moves ~1% of a
 * 16k row's counts by one between two summation orders; float64 makes that ~1e-11), and
 * no fast-math: divisions are IEEE, products that feed sums are __dmul_rn (no FMA
 * contraction); cum * Q is exact (a power of two), so an FMA there changes nothing.
 * Integer passes (counts, max, min) are exact in any order, so each thread accumulates over
 * its strided share of the row and the block reduces once per pass.
 *
 * cache_lookup: one block per query (row, k, token); each thread scans its strided share of
 * the [N, 3] key table and keeps its first hit, and a block min gives the first matching
 * index overall, or -1 for none.
 *
 * Launchers return the cudaError_t of the launch as an int (0 = cudaSuccess).
 */
#include <cstdint>

#include <cuda_runtime.h>
#include <math_constants.h>

#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

namespace {

constexpr int kSampleThreads = 512;
constexpr int kScanItems = 4;  // consecutive tokens per thread in the cumsum pass
constexpr int64_t kScanChunk = int64_t(kSampleThreads) * kScanItems;
constexpr int kLookupThreads = 256;

constexpr int kQ = 1 << 15;         // Q_SCALE (vllm_saguaro/core/sampling.py)
constexpr int kBisectSteps = 33;    // int32 key range: 2^32 values, halved 32 times, +1
constexpr int64_t kBig = INT64_MAX;  // above every rank (the Triton kernel's BIG)
constexpr int64_t kKeyAbove = int64_t(1) << 40;  // above every key (min's identity)
constexpr int64_t kKeyBelow = -(int64_t(1) << 40);  // below every key (NONE)
constexpr uint64_t kMask32 = 0xFFFFFFFFull;
constexpr uint64_t kMix = 0x45D9F3Bull;  // ops/keys.py MIX (= 73244475)

struct MaxOp {
  template <class T>
  __device__ __forceinline__ T operator()(const T& a, const T& b) const {
    return a < b ? b : a;
  }
};

struct MinOp {
  template <class T>
  __device__ __forceinline__ T operator()(const T& a, const T& b) const {
    return b < a ? b : a;
  }
};

// ops/keys.py sortable_key: bits ^ ((bits >> 31) & 0x7FFFFFFF), an arithmetic shift of the
// int32 bits: negative floats get their low 31 bits flipped. -0.0 first becomes +0.0: equal
// floats, one key (0).
__device__ __forceinline__ int64_t sortable_key(float x) {
  int32_t bits = __float_as_int(x);
  if (bits == INT32_MIN) bits = 0;  // the bits of -0.0
  return static_cast<int64_t>(bits ^ ((bits >> 31) & 0x7FFFFFFF));
}

// ops/keys.py rank_key: key * 2^32 + (2^32 - 1 - index); key in int32 range, so it fits.
__device__ __forceinline__ int64_t rank_key(int64_t key, int64_t index) {
  return key * int64_t(4294967296) + (int64_t(4294967295) - index);
}

// ops/keys.py hash32. The first fold only keeps the low 32 bits of seed ^ (seed >> 32),
// which are low32(seed) ^ high32(seed) for an arithmetic and a logical shift alike, so
// unsigned arithmetic gives the torch (signed int64) result; after it every value is
// below 2^32 and each product below 2^59.
__device__ __forceinline__ uint64_t hash32(int64_t seed) {
  const uint64_t s = static_cast<uint64_t>(seed);
  uint64_t x = (s ^ (s >> 32)) & kMask32;
  x = (((x >> 16) ^ x) * kMix) & kMask32;
  x = (((x >> 16) ^ x) * kMix) & kMask32;
  return (x >> 16) ^ x;
}

// e(i) = exp(x / T - zmax) in float64 (zmax = max x / T: the same as max(x / T) for T > 0).
__device__ __forceinline__ double weight(float x, double temp, double zmax) {
  return exp(static_cast<double>(x) / temp - zmax);
}

using ReduceI64 = cub::BlockReduce<int64_t, kSampleThreads>;
using ReduceF64 = cub::BlockReduce<double, kSampleThreads>;
using ReduceF32 = cub::BlockReduce<float, kSampleThreads>;
using ScanF64 = cub::BlockScan<double, kSampleThreads>;
using ReduceLookup = cub::BlockReduce<int64_t, kLookupThreads>;

struct SampleShared {
  union {
    ReduceI64::TempStorage i64;
    ReduceF64::TempStorage f64;
    ReduceF32::TempStorage f32;
    ScanF64::TempStorage scan;
  } temp;
  int64_t i64;   // broadcast slots: a reduction's result, from thread 0 to all
  double f64;
  float f32;
  double carry;  // the cumsum of the chunks before the current one
};

// Block-wide reductions whose result every thread gets. The trailing barrier lets the
// next call reuse the temp storage and the broadcast slot.
__device__ __forceinline__ int64_t block_sum(int64_t v, SampleShared& sh) {
  const int64_t r = ReduceI64(sh.temp.i64).Sum(v);
  if (threadIdx.x == 0) sh.i64 = r;
  __syncthreads();
  const int64_t out = sh.i64;
  __syncthreads();
  return out;
}

template <class Op>
__device__ __forceinline__ int64_t block_reduce(int64_t v, Op op, SampleShared& sh) {
  const int64_t r = ReduceI64(sh.temp.i64).Reduce(v, op);
  if (threadIdx.x == 0) sh.i64 = r;
  __syncthreads();
  const int64_t out = sh.i64;
  __syncthreads();
  return out;
}

__device__ __forceinline__ double block_sum(double v, SampleShared& sh) {
  const double r = ReduceF64(sh.temp.f64).Sum(v);
  if (threadIdx.x == 0) sh.f64 = r;
  __syncthreads();
  const double out = sh.f64;
  __syncthreads();
  return out;
}

__device__ __forceinline__ float block_max(float v, SampleShared& sh) {
  const float r = ReduceF32(sh.temp.f32).Reduce(v, MaxOp());
  if (threadIdx.x == 0) sh.f32 = r;
  __syncthreads();
  const float out = sh.f32;
  __syncthreads();
  return out;
}

__global__ void __launch_bounds__(kSampleThreads)
saguaro_sample_kernel(const float* __restrict__ logits, int64_t stride,
                      const float* __restrict__ temperature, const int32_t* __restrict__ top_k,
                      const float* __restrict__ top_p, const int32_t* __restrict__ fanout,
                      const int64_t* __restrict__ seeds, int64_t V, float c,
                      int64_t* __restrict__ tokens, float* __restrict__ q,
                      int32_t* steps_scratch) {
  __shared__ SampleShared sh;
  const int64_t row = blockIdx.x;
  const int tid = threadIdx.x;
  const float* x_row = logits + row * stride;
  float* q_row = q + row * V;
  int32_t* steps_row = steps_scratch + row * V;

  const double temp = static_cast<double>(temperature[row]);
  const int64_t k = top_k[row];
  const double tp = static_cast<double>(top_p[row]);
  const int64_t fan = fanout[row];

  // Pass 1: max logit (for the softmax's shift) and the key range the bisections search.
  float xmax = -CUDART_INF_F;
  int64_t kmin = kKeyAbove;
  int64_t kmax = kKeyBelow;
  for (int64_t i = tid; i < V; i += kSampleThreads) {
    const float x = x_row[i];
    const int64_t key = sortable_key(x);
    xmax = x > xmax ? x : xmax;
    kmin = key < kmin ? key : kmin;
    kmax = key > kmax ? key : kmax;
  }
  xmax = block_max(xmax, sh);
  kmin = block_reduce(kmin, MinOp(), sh);
  kmax = block_reduce(kmax, MaxOp(), sh);
  const double zmax = static_cast<double>(xmax) / temp;

  // Pass 2: top-k. #(key >= t) falls as t grows; the largest t where it is still >= k is
  // the k-th largest key. Invariant: #(key >= lo) >= k (true at lo = kmin: V >= k).
  int64_t thr = kmin;  // off: every token kept
  if (k > 0 && k < V) {
    int64_t lo = kmin, hi = kmax;
    for (int step = 0; step < kBisectSteps; ++step) {
      const int64_t mid = lo + (hi - lo + 1) / 2;
      int64_t n = 0;
      for (int64_t i = tid; i < V; i += kSampleThreads) n += sortable_key(x_row[i]) >= mid;
      n = block_sum(n, sh);
      if (n >= k) {
        lo = mid;
      } else {
        hi = mid - 1;
      }
    }
    thr = lo;
  }

  // Pass 3: top-p, within the top-k set. m(t) = mass(key >= thr, key > t) falls as t grows
  // and m(kmax) = 0; the smallest t with m(t) / s < top_p keeps exactly the tokens whose
  // strictly-higher mass is < top_p. (hi - lo) / 2 truncates, as Triton's `//` on ints.
  if (tp < 1.0) {
    double s = 0.0;
    for (int64_t i = tid; i < V; i += kSampleThreads) {
      const float x = x_row[i];
      if (sortable_key(x) >= thr) s += weight(x, temp, zmax);
    }
    s = block_sum(s, sh);
    int64_t lo = thr, hi = kmax;
    for (int step = 0; step < kBisectSteps; ++step) {
      const int64_t mid = lo + (hi - lo) / 2;
      double m = 0.0;
      for (int64_t i = tid; i < V; i += kSampleThreads) {
        const float x = x_row[i];
        const int64_t key = sortable_key(x);
        if (key >= thr && key > mid) m += weight(x, temp, zmax);
      }
      m = block_sum(m, sh);
      if (m / s < tp) {
        hi = mid;
      } else {
        lo = mid + 1;
      }
    }
    thr = lo;
  }

  // Pass 4: sigma's top set, the F+1 largest ranks (over the whole row, as the reference:
  // tokens cut by top-k/top-p may be among them, with e = 0). Ranks are distinct, so each
  // max pass below the previous maximum finds the next place.
  const bool sigma_on = c < 1.0f;
  int64_t nth = -kBig;  // every rank >= -BIG: with sigma off, everything scaled by 1
  if (sigma_on) {
    const int64_t places = fan < 0 ? 1 : (fan >= V ? V : fan + 1);  // F clamped to [0, V-1]
    int64_t prev = kBig;
    for (int64_t place = 0; place < places; ++place) {
      int64_t best = -kBig;
      for (int64_t i = tid; i < V; i += kSampleThreads) {
        const int64_t rank = rank_key(sortable_key(x_row[i]), i);
        if (rank < prev && rank > best) best = rank;
      }
      prev = block_reduce(best, MaxOp(), sh);
    }
    nth = prev;
  }
  const double scale = sigma_on ? static_cast<double>(c) : 1.0;

  // Pass 5: the kept mass, plain (s) and with the top set scaled (sig).
  double s = 0.0, sig = 0.0;
  for (int64_t i = tid; i < V; i += kSampleThreads) {
    const float x = x_row[i];
    const int64_t key = sortable_key(x);
    if (key >= thr) {
      const double e = weight(x, temp, zmax);
      s += e;
      sig += rank_key(key, i) >= nth ? __dmul_rn(e, scale) : e;
    }
  }
  s = block_sum(s, sh);
  sig = block_sum(sig, sh);
  const double top_scale = sig > 0.0 ? scale : 1.0;  // sig == 0: unscaled, normalised by s
  const double norm = sig > 0.0 ? sig : s;

  // Pass 6: steps of round(cumsum(p) * Q), chunk by chunk with a carry, and the draw.
  const int64_t r = static_cast<int64_t>(hash32(seeds[row]) & uint64_t(kQ - 1));
  const double qd = static_cast<double>(kQ);
  int64_t below = 0;  // #(steps <= r) over this thread's tokens
  if (tid == 0) sh.carry = 0.0;
  __syncthreads();
  for (int64_t start = 0; start < V; start += kScanChunk) {
    const int64_t first = start + int64_t(tid) * kScanItems;
    double p[kScanItems];
#pragma unroll
    for (int j = 0; j < kScanItems; ++j) {
      const int64_t i = first + j;
      p[j] = 0.0;
      if (i < V) {
        const float x = x_row[i];
        const int64_t key = sortable_key(x);
        if (key >= thr) {
          double e = weight(x, temp, zmax);
          if (rank_key(key, i) >= nth) e = __dmul_rn(e, top_scale);
          p[j] = e / norm;
        }
      }
    }
    ScanF64(sh.temp.scan).InclusiveSum(p, p);
    const double carry = sh.carry;
    const int64_t last = (start + kScanChunk < V ? start + kScanChunk : V) - 1;
    double last_cum = 0.0;
    bool owns_last = false;
#pragma unroll
    for (int j = 0; j < kScanItems; ++j) {
      const int64_t i = first + j;
      if (i < V) {
        const double cum = carry + p[j];
        double step = floor(cum * qd + 0.5);
        step = step > qd ? qd : step;
        if (i == V - 1) step = qd;
        const int32_t step_i = static_cast<int32_t>(step);
        steps_row[i] = step_i;
        below += step_i <= r;
        if (i == last) {
          last_cum = cum;
          owns_last = true;
        }
      }
    }
    __syncthreads();  // everyone has read the carry, and the scan's temp storage is free
    if (owns_last) sh.carry = last_cum;
    __syncthreads();
  }
  below = block_sum(below, sh);  // its barriers also publish steps_row to the whole block
  if (tid == 0) tokens[row] = below;

  // Pass 7: counts = differences of consecutive steps, q = counts / Q (exact in float32).
  for (int64_t i = tid; i < V; i += kSampleThreads) {
    const int32_t cur = steps_row[i];
    const int32_t prv = i > 0 ? steps_row[i - 1] : 0;
    q_row[i] = static_cast<float>(cur - prv) / static_cast<float>(kQ);
  }
}

__global__ void __launch_bounds__(kLookupThreads)
cache_lookup_kernel(const int64_t* __restrict__ keys, int64_t n,
                    const int64_t* __restrict__ queries, int64_t* __restrict__ out) {
  __shared__ ReduceLookup::TempStorage temp;
  const int64_t b = blockIdx.x;
  const int64_t row = queries[b * 3], k = queries[b * 3 + 1], tok = queries[b * 3 + 2];
  int64_t first = kBig;
  // A thread's indices only grow, so its first hit is its smallest.
  for (int64_t i = threadIdx.x; i < n; i += kLookupThreads) {
    if (keys[i * 3] == row && keys[i * 3 + 1] == k && keys[i * 3 + 2] == tok) {
      first = i;
      break;
    }
  }
  first = ReduceLookup(temp).Reduce(first, MinOp());
  if (threadIdx.x == 0) out[b] = first < n ? first : -1;
}

constexpr int64_t kMaxGrid = 2147483647;  // gridDim.x limit

}  // namespace

// keys [n, 3], queries [b, 3] int64 contiguous, on the device -> out [b] int64.
extern "C" int saguaro_cache_lookup_launch(const int64_t* keys, int64_t n,
                                           const int64_t* queries, int64_t b, int64_t* out,
                                           cudaStream_t stream) {
  if (b <= 0) return static_cast<int>(cudaSuccess);
  if (n < 0 || b > kMaxGrid) return static_cast<int>(cudaErrorInvalidValue);
  cache_lookup_kernel<<<static_cast<unsigned int>(b), kLookupThreads, 0, stream>>>(
      keys, n, queries, out);
  return static_cast<int>(cudaGetLastError());
}

// logits [rows, vocab] float32 with row stride `stride` (elements) and unit column stride;
// temperature, top_p [rows] float32; top_k, fanout [rows] int32; seeds [rows] int64 ->
// tokens [rows] int64, q [rows, vocab] float32 contiguous; steps_scratch [rows, vocab] int32.
extern "C" int saguaro_sample_launch(const float* logits, int64_t stride,
                                     const float* temperature, const int32_t* top_k,
                                     const float* top_p, const int32_t* fanout,
                                     const int64_t* seeds, int64_t rows, int64_t vocab, float c,
                                     int64_t* tokens, float* q, int32_t* steps_scratch,
                                     cudaStream_t stream) {
  if (rows <= 0) return static_cast<int>(cudaSuccess);
  if (vocab <= 0 || rows > kMaxGrid) return static_cast<int>(cudaErrorInvalidValue);
  saguaro_sample_kernel<<<static_cast<unsigned int>(rows), kSampleThreads, 0, stream>>>(
      logits, stride, temperature, top_k, top_p, fanout, seeds, vocab, c, tokens, q,
      steps_scratch);
  return static_cast<int>(cudaGetLastError());
}
