// Linear layers for a few input rows (decoding), for CPUs.
//
// y[m, n] = sum_k x[m, k] * W[n, k] for M small: every weight is read once
// per call and used for all M rows while it is in registers, so the cost is
// reading W, at memory bandwidth. Weights come in four forms:
//   0 float32   W[N][K]
//   1 bfloat16  W[N][K]
//   2 int8      codes[N][K], one bf16 scale per row: W = code * scale[n]
//   3 int4      two codes a byte, in 32-input blocks of 16 bytes: byte j of
//               a block holds input j in its low nibble and input j + 16 in
//               its high one; per group of `group` inputs one bf16 scale and
//               zero, interleaved as sz[n][k / group][2]:
//               W = (code - 8) * scale + zero.
// x and y are float32 or bfloat16 (codes 0, 1); sums are float32. x is
// widened to float32 once per call. For int4 the scale factors out of each
// group's sum, so the inner loop is a widen and one multiply-add per
// weight: sum_g = s * sum(x * code) + (z - 8 s) * sum(x).
//
// Work is split over output rows with OpenMP (the process's one runtime:
// PyTorch's libgomp is already loaded, and it is the one this resolves to).
// With AVX2 and FMA the inner loops are written with intrinsics; elsewhere
// plain C does the same sums.

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define HAVE_AVX2 1
#else
#define HAVE_AVX2 0
#endif

enum { DT_F32 = 0, DT_BF16 = 1 };
enum { W_F32 = 0, W_BF16 = 1, W_INT8 = 2, W_INT4 = 3 };
#define MAX_ROWS 64
// Multiply-adds below which a call stays on one thread.
#define PARALLEL_MIN_WORK (1 << 16)
// int4 inputs per row at most (32-input blocks), and rows done together.
#define MAX_BLOCKS 2048
#define INT4_ROWS 4

// The widened input lives in a buffer per calling thread, kept between
// calls: an allocation per call cost more than small layers' work.
static _Thread_local float *scratch_buf;
static _Thread_local size_t scratch_size;

static void *scratch(size_t bytes) {
    if (bytes > scratch_size) {
        free(scratch_buf);
        scratch_buf = aligned_alloc(64, bytes);
        scratch_size = scratch_buf ? bytes : 0;
    }
    return scratch_buf;
}


static inline void store(void *out, int dtype, int64_t i, float v) {
    if (dtype == DT_F32) ((float *)out)[i] = v;
    else ((uint16_t *)out)[i] = f32_to_bf16(v);
}

#if HAVE_AVX2
static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline __m256 load_bf16x8(const uint16_t *p) {
    __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}

static inline __m256 load_i8x8(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

static inline __m256 load_w8(const void *w, int kind, int64_t i) {
    if (kind == W_F32) return _mm256_loadu_ps((const float *)w + i);
    if (kind == W_BF16) return load_bf16x8((const uint16_t *)w + i);
    return load_i8x8((const int8_t *)w + i);
}
#endif

static inline float load_w1(const void *w, int kind, int64_t i) {
    if (kind == W_F32) return ((const float *)w)[i];
    if (kind == W_BF16) return bf16_to_f32(((const uint16_t *)w)[i]);
    return (float)((const int8_t *)w)[i];
}

// Row n of a float, bf16 or int8 weight against rows [m0, m0 + mr) of x
// (mr <= 2), unscaled.
static void dot_dense(const void *w, int kind, int64_t row, const float *x, int K, int mr, float *res) {
    int k = 0;
    float r0 = 0.0f, r1 = 0.0f;
    const float *x1 = x + (mr > 1 ? K : 0);
#if HAVE_AVX2
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
    __m256 b0 = _mm256_setzero_ps(), b1 = _mm256_setzero_ps(), b2 = _mm256_setzero_ps(), b3 = _mm256_setzero_ps();
    for (; k + 32 <= K; k += 32) {
        __m256 w0 = load_w8(w, kind, row + k), w1 = load_w8(w, kind, row + k + 8);
        __m256 w2 = load_w8(w, kind, row + k + 16), w3 = load_w8(w, kind, row + k + 24);
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + k), w0, a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(x + k + 8), w1, a1);
        a2 = _mm256_fmadd_ps(_mm256_loadu_ps(x + k + 16), w2, a2);
        a3 = _mm256_fmadd_ps(_mm256_loadu_ps(x + k + 24), w3, a3);
        if (mr > 1) {
            b0 = _mm256_fmadd_ps(_mm256_loadu_ps(x1 + k), w0, b0);
            b1 = _mm256_fmadd_ps(_mm256_loadu_ps(x1 + k + 8), w1, b1);
            b2 = _mm256_fmadd_ps(_mm256_loadu_ps(x1 + k + 16), w2, b2);
            b3 = _mm256_fmadd_ps(_mm256_loadu_ps(x1 + k + 24), w3, b3);
        }
    }
    r0 = hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
    r1 = hsum(_mm256_add_ps(_mm256_add_ps(b0, b1), _mm256_add_ps(b2, b3)));
#endif
    for (; k < K; k++) {
        float wk = load_w1(w, kind, row + k);
        r0 += x[k] * wk;
        if (mr > 1) r1 += x1[k] * wk;
    }
    res[0] = r0;
    if (mr > 1) res[1] = r1;
}

// Row n of an int4 weight against rows [m0, m0 + mr) of x (mr <= 2).
// x arrives twice: as float32 (xf, for the scalar path) and, for the AVX2
// path, as int8 per 32-input block (xq, with scales xd): codes 0..15 times
// int8 inputs summed in 16 and 32 bits (maddubs, madd) is a third of the
// instructions of widening every code to float, and the kernel is then
// bound by memory again. As in llama.cpp's Q4 x Q8 dot products, the
// inputs' rounding (half a step of max|x| / 127 per block) is the price.
// xsum holds each group's sum of the inputs the codes meet, for the zero term.

// Per block of one row: the weight scale times the input's block scale
// (sd), and the row's zero term, sum over groups of (z - 8 s) * sum(x).
static float block_scales(const uint16_t *sz, int groups, int group_shift, const float *xd, const float *xsum,
                          float *sd) {
    float zterm = 0.0f;
    int g = 0;
#if HAVE_AVX2
    if (group_shift == 0) {  // a group per block: 8 (scale, zero) pairs at a time
        __m256 zacc = _mm256_setzero_ps();
        for (; g + 8 <= groups; g += 8) {
            __m256i pairs = _mm256_loadu_si256((const __m256i *)(sz + 2 * g));  // lane: scale | zero << 16
            __m256 sv = _mm256_castsi256_ps(_mm256_slli_epi32(pairs, 16));
            __m256 zv = _mm256_castsi256_ps(_mm256_and_si256(pairs, _mm256_set1_epi32((int)0xffff0000u)));
            __m256 zs = _mm256_fnmadd_ps(_mm256_set1_ps(8.0f), sv, zv);
            zacc = _mm256_fmadd_ps(zs, _mm256_loadu_ps(xsum + g), zacc);
            _mm256_storeu_ps(sd + g, _mm256_mul_ps(sv, _mm256_loadu_ps(xd + g)));
        }
        zterm = hsum(zacc);
    }
#endif
    for (; g < groups; g++) {
        float s = bf16_to_f32(sz[2 * g]);
        zterm += (bf16_to_f32(sz[2 * g + 1]) - 8.0f * s) * xsum[g];
        if (group_shift == 0) {
            sd[g] = s * xd[g];
        } else {
            for (int b = g << group_shift; b < (g + 1) << group_shift; b++) sd[b] = s * xd[b];
        }
    }
    return zterm;
}

// Rows [n, n + nr) (nr <= INT4_ROWS) of an int4 weight against input row m.
// Four rows at a time share each block's input load and the loop, and give
// the core four independent sums to interleave.
static void int4_rows(const uint8_t *codes, const uint16_t *sz, const struct xrows *xr, int m, int K, int group,
                      int64_t n, int nr, float *res) {
    const int groups = K / group, blocks = K / 32;
    const float *xs = xr->xsum + (int64_t)m * groups;
#if HAVE_AVX2
    const int8_t *q = xr->xq + (int64_t)m * K;
    const float *xd = xr->xd + (int64_t)m * blocks;
    const __m256i nibble = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
    // The 16 bytes in both halves; the upper half shifted down a nibble.
    const __m256i high_half = _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4);
    int group_shift = 0;  // blocks per group is a power of two (1, 2, 4)
    while ((32 << group_shift) < group) group_shift++;
    float sd[INT4_ROWS][blocks], z[INT4_ROWS];
    const uint8_t *c[INT4_ROWS];
    for (int r = 0; r < nr; r++) {
        c[r] = codes + (n + r) * (K / 2);
        z[r] = block_scales(sz + (n + r) * groups * 2, groups, group_shift, xd, xs, sd[r]);
    }
    // One block of row r: 32 codes in input order (low nibbles are inputs
    // 0..15, high ones 16..31) times the int8 inputs, summed in 32 bits.
#define INT4_BLOCK(r, acc)                                                                              \
    do {                                                                                                \
        __m256i v = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(c[r] + b * 16)));      \
        __m256i codes32 = _mm256_and_si256(_mm256_srlv_epi32(v, high_half), nibble);                    \
        __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(codes32, qv), ones);                          \
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_broadcast_ss(&sd[r][b]), acc);              \
    } while (0)
    if (nr == INT4_ROWS) {
        __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
        for (int b = 0; b < blocks; b++) {
            __m256i qv = _mm256_loadu_si256((const __m256i *)(q + b * 32));
            INT4_BLOCK(0, a0);
            INT4_BLOCK(1, a1);
            INT4_BLOCK(2, a2);
            INT4_BLOCK(3, a3);
        }
        res[0] = hsum(a0) + z[0];
        res[1] = hsum(a1) + z[1];
        res[2] = hsum(a2) + z[2];
        res[3] = hsum(a3) + z[3];
    } else {
        for (int r = 0; r < nr; r++) {
            __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
            int b = 0;
            for (; b + 2 <= blocks; b += 2) {
                __m256i qv = _mm256_loadu_si256((const __m256i *)(q + b * 32));
                INT4_BLOCK(r, a0);
                b++;
                qv = _mm256_loadu_si256((const __m256i *)(q + b * 32));
                INT4_BLOCK(r, a1);
                b--;
            }
            if (b < blocks) {
                __m256i qv = _mm256_loadu_si256((const __m256i *)(q + b * 32));
                INT4_BLOCK(r, a0);
            }
            res[r] = hsum(_mm256_add_ps(a0, a1)) + z[r];
        }
    }
#undef INT4_BLOCK
#else
    const float *x = xr->xf + (int64_t)m * K;
    for (int r = 0; r < nr; r++) {
        const uint8_t *row = codes + (n + r) * (K / 2);
        const uint16_t *pairs = sz + (n + r) * groups * 2;
        float sum = 0.0f;
        for (int g = 0; g < groups; g++) {
            float a = 0.0f;
            for (int k = g * group; k < (g + 1) * group; k += 32) {
                const uint8_t *p = row + k / 2;
                for (int j = 0; j < 16; j++) a += x[k + j] * (float)(p[j] & 15) + x[k + j + 16] * (float)(p[j] >> 4);
            }
            float s = bf16_to_f32(pairs[2 * g]);
            sum += s * a + (bf16_to_f32(pairs[2 * g + 1]) - 8.0f * s) * xs[g];
        }
        res[r] = sum;
    }
#endif
}

// Symmetric int8 per 32 inputs: xq = round(x / d), d = max|x| / 127.
static void quantize_rows(const float *xf, int64_t n, int8_t *xq, float *xd) {
    for (int64_t b = 0; b < n / 32; b++) {
        const float *x = xf + b * 32;
        float amax = 0.0f;
        for (int j = 0; j < 32; j++) amax = fabsf(x[j]) > amax ? fabsf(x[j]) : amax;
        float d = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        xd[b] = d;
        // Round half away from zero; |x * inv| <= 127 so the int8 never wraps.
        for (int j = 0; j < 32; j++) xq[b * 32 + j] = (int8_t)(int)(x[j] * inv + (x[j] < 0.0f ? -0.5f : 0.5f));
    }
}

// Returns 0, or a negative code for arguments the kernel cannot take:
//  -1 M outside 1..MAX_ROWS, -2 unknown dtype or weight kind,
//  -3 int4 with K or group not multiples of 32, group not dividing K or not
//     32 times a power of two, or K over 32 * MAX_BLOCKS.
int linear_check(int x_dtype, int M, int K, int kind, int group, int out_dtype) {
    if (M < 1 || M > MAX_ROWS) return -1;
    if ((x_dtype != DT_F32 && x_dtype != DT_BF16) || (out_dtype != DT_F32 && out_dtype != DT_BF16) ||
        kind < W_F32 || kind > W_INT4)
        return -2;
    if (kind == W_INT4 &&
        (K % 32 || group % 32 || group <= 0 || K % group || (group / 32) & (group / 32 - 1) || K / 32 > MAX_BLOCKS))
        return -3;
    return 0;
}

// Bytes linear_prepare needs for M rows of K inputs.
size_t linear_prepare_bytes(int M, int K, int kind, int group) {
    size_t groups = kind == W_INT4 ? (size_t)(K / group) : 0, blocks = kind == W_INT4 ? (size_t)(K / 32) : 0;
    return (((size_t)M * (K + groups + blocks)) * sizeof(float) + (size_t)M * K + 63) / 64 * 64;
}

// Where linear_prepare puts each part of the prepared rows in `buf`.
struct xrows xrows_layout(void *buf, int M, int K, int kind, int group) {
    const size_t groups = kind == W_INT4 ? (size_t)(K / group) : 0, blocks = kind == W_INT4 ? (size_t)(K / 32) : 0;
    float *xf = buf;
    struct xrows xr = {xf, (const int8_t *)(xf + (size_t)M * (K + groups + blocks)), xf + (size_t)M * (K + groups),
                       xf + (size_t)M * K};
    return xr;
}

// Widens x into xr (laid out by xrows_layout over linear_prepare_bytes,
// 64-byte aligned), and for int4 quantizes each 32-input block and sums
// each group. The rows' groups are shared among the threads of the
// enclosing parallel region (an orphaned worksharing loop).
void linear_prepare(const void *x, int x_dtype, int M, int K, int kind, int group, const struct xrows *xr) {
    // A unit of work: one group of one row (for float kinds, 32 inputs).
    const int unit = kind == W_INT4 ? group : 32, per_row = (K + unit - 1) / unit;
    float *xf = (float *)xr->xf;
    #pragma omp for schedule(static)
    for (int u = 0; u < M * per_row; u++) {
        const int m = u / per_row, g = u % per_row;
        const int64_t start = (int64_t)m * K + (int64_t)g * unit;
        const int n = K - g * unit < unit ? K - g * unit : unit;
        if (x_dtype == DT_F32) memcpy(xf + start, (const float *)x + start, (size_t)n * sizeof(float));
        else
            for (int i = 0; i < n; i++) xf[start + i] = bf16_to_f32(((const uint16_t *)x)[start + i]);
        if (kind != W_INT4) continue;
        int8_t *xq = (int8_t *)xr->xq + start;
        float *xd = (float *)xr->xd + start / 32;
        quantize_rows(xf + start, n, xq, xd);
        // The group sum for the zero term, of the same inputs the codes
        // meet: with the AVX2 loop, the int8-rounded ones. The two terms
        // nearly cancel when the zero is about -8 scales, so a sum of the
        // exact inputs beside products of rounded ones would magnify the
        // rounding; this way the result is exactly sum(rounded x * W).
        float sum = 0.0f;
#if HAVE_AVX2
        for (int b = 0; b < n / 32; b++) {
            int32_t q = 0;
            for (int i = 0; i < 32; i++) q += xq[b * 32 + i];
            sum += (float)q * xd[b];
        }
#else
        for (int i = 0; i < n; i++) sum += xf[start + i];
#endif
        ((float *)xr->xsum)[(int64_t)m * per_row + g] = sum;
    }
}

// The output rows, shared among the threads of the enclosing parallel
// region (an orphaned worksharing loop; on its own, one thread does all).
void linear_rows(const struct xrows *xr, int M, int K, const void *w, int kind, int N, const uint16_t *scales,
                 int group, void *out, int out_dtype) {
    if (kind == W_INT4) {
        const int tiles = (N + INT4_ROWS - 1) / INT4_ROWS;
        #pragma omp for schedule(static)
        for (int t = 0; t < tiles; t++) {
            int64_t n = (int64_t)t * INT4_ROWS;
            int nr = N - n < INT4_ROWS ? (int)(N - n) : INT4_ROWS;
            float res[INT4_ROWS];
            for (int m = 0; m < M; m++) {
                int4_rows((const uint8_t *)w, scales, xr, m, K, group, n, nr, res);
                for (int r = 0; r < nr; r++) store(out, out_dtype, (int64_t)m * N + n + r, res[r]);
            }
        }
        return;
    }
    #pragma omp for schedule(static)
    for (int n = 0; n < N; n++) {
        float res[2];
        for (int m = 0; m < M; m += 2) {
            int mr = M - m < 2 ? M - m : 2;
            dot_dense(w, kind, (int64_t)n * K, xr->xf + (int64_t)m * K, K, mr, res);
            if (kind == W_INT8) {
                float s = bf16_to_f32(scales[n]);
                res[0] *= s;
                res[1] *= s;
            }
            for (int j = 0; j < mr; j++) store(out, out_dtype, (int64_t)(m + j) * N + n, res[j]);
        }
    }
}

// linear_check's codes, or -4 out of memory.
// `scales`: int8 [N] bf16, int4 sz[N][K / group][2] bf16, unused otherwise.
int linear_small(const void *x, int x_dtype, int M, int K, const void *w, int kind, int N,
                 const uint16_t *scales, int group, void *out, int out_dtype, int num_threads) {
    int code = linear_check(x_dtype, M, K, kind, group, out_dtype);
    if (code) return code;
    void *buf = scratch(linear_prepare_bytes(M, K, kind, group));
    if (buf == NULL) return -4;
    const struct xrows xr = xrows_layout(buf, M, K, kind, group);
    // Small layers run on the calling thread: waking the others costs more.
    #pragma omp parallel num_threads(num_threads) if ((int64_t)N * K * M >= PARALLEL_MIN_WORK)
    {
        linear_prepare(x, x_dtype, M, K, kind, group, &xr);
        linear_rows(&xr, M, K, w, kind, N, scales, group, out, out_dtype);
    }
    return 0;
}

// Rows [row0, row1) of an int4 weight as float32 or bfloat16, (row1 - row0, K)
// row-major: (code - 8) * scale + zero in float32, rounded once.
int dequantize_int4(const uint8_t *codes, const uint16_t *sz, int K, int group, int row0, int row1, void *out,
                    int out_dtype, int num_threads) {
    if (K % 32 || group % 32 || group <= 0 || K % group) return -3;
    if (out_dtype != DT_F32 && out_dtype != DT_BF16) return -2;
    const int groups = K / group;
    #pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int n = row0; n < row1; n++) {
        const uint8_t *row = codes + (int64_t)n * (K / 2);
        int64_t base = (int64_t)(n - row0) * K;
        for (int k = 0; k < K; k += 32) {
            const uint16_t *pair = sz + ((int64_t)n * groups + k / group) * 2;
            float s = bf16_to_f32(pair[0]), z = bf16_to_f32(pair[1]);
            for (int j = 0; j < 16; j++) {
                store(out, out_dtype, base + k + j, (float)((row[k / 2 + j] & 15) - 8) * s + z);
                store(out, out_dtype, base + k + j + 16, (float)((row[k / 2 + j] >> 4) - 8) * s + z);
            }
        }
    }
    return 0;
}
