// What the kernel sources share: decode_layer.c runs the other two's
// checked pieces inside one parallel region.
#ifndef INFERD_KERNELS_H
#define INFERD_KERNELS_H

#include <stddef.h>
#include <stdint.h>

static inline float bf16_to_f32(uint16_t x) {
    union { uint32_t u; float f; } v;
    v.u = (uint32_t)x << 16;
    return v.f;
}

static inline uint16_t f32_to_bf16(float f) {
    union { uint32_t u; float f; } v;
    v.f = f;
    if ((v.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((v.u >> 16) | 0x40u);  // NaN stays NaN
    uint32_t rounding = 0x7fffu + ((v.u >> 16) & 1u);  // round to nearest even
    return (uint16_t)((v.u + rounding) >> 16);
}

// The input rows of a linear layer as its inner loops read them (linear_prepare).
struct xrows {
    const float *xf;    // [M][K] float32
    const int8_t *xq;   // [M][K] int8 per 32-input block (int4 only)
    const float *xd;    // [M][K / 32] the blocks' scales (int4 only)
    const float *xsum;  // [M][K / group] group sums of the inputs the int4 loop uses
};

int linear_check(int x_dtype, int M, int K, int kind, int group, int out_dtype);
size_t linear_prepare_bytes(int M, int K, int kind, int group);
struct xrows xrows_layout(void *buf, int M, int K, int kind, int group);
void linear_prepare(const void *x, int x_dtype, int M, int K, int kind, int group, const struct xrows *xr);
void linear_rows(const struct xrows *xr, int M, int K, const void *w, int kind, int N, const uint16_t *scales,
                 int group, void *out, int out_dtype);

int paged_attention_check(const int64_t *tables, const int64_t *seq_lens, int num_seqs, int num_heads,
                          int num_kv_heads, int head_dim, int block_size, int max_blocks, int64_t num_blocks,
                          int dtype);
void paged_attention_rows(const void *q, const void *k_cache, const void *v_cache, void *out,
                          const int64_t *tables, const int64_t *seq_lens, int num_seqs, int num_heads,
                          int num_kv_heads, int head_dim, int block_size, int max_blocks, float scale, int dtype);

#endif
