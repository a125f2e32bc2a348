// Decode attention straight over a paged KV cache, for CPUs.
//
// One query token per sequence. Keys and values are read where they lie in
// the cache, block by block through the sequence's block table, never
// gathered into a copy: at batch 32 and 320 tokens of context the copy was
// most of a step. Query heads that share a KV head (grouped-query attention)
// are done together, so each K/V row is read once for all of them. Softmax
// is online (a running max and sum per head, rescaled per block), in float32
// whatever the cache dtype.
//
// Layouts (all contiguous, row-major):
//   q        [num_seqs, num_heads, head_dim]
//   k_cache  [num_blocks, block_size, num_kv_heads, head_dim]  (v_cache alike)
//   tables   [num_seqs, max_blocks]  int64 block ids
//   seq_lens [num_seqs]              int64 tokens to attend, >= 1
//   out      [num_seqs, num_heads, head_dim]
// dtype: 0 = float32, 1 = bfloat16 (q, caches and out share it).
//
// An explicit AVX-512 version (query and accumulators in registers) measured
// no faster than what the compiler makes of the loops below, so it is not here.
// Work is split over (sequence, KV head) pairs with OpenMP. Built with
// -ffast-math so the exp and max loops vectorize (glibc's vector expf); no
// value here is ever infinite or NaN for finite inputs.

#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "kernels.h"

#define MAX_GROUP 16
#define MAX_HEAD_DIM 256
#define MAX_BLOCK 128

static inline void load_row(const void *base, int64_t offset, int dtype, int n, float *dst) {
    if (dtype == 0) {
        memcpy(dst, (const float *)base + offset, (size_t)n * sizeof(float));
    } else {
        const uint16_t *src = (const uint16_t *)base + offset;
        for (int i = 0; i < n; i++) dst[i] = bf16_to_f32(src[i]);
    }
}

// One (sequence, KV head) pair: everything a worker needs.
struct task {
    const void *q, *k_cache, *v_cache;
    void *out;
    const int64_t *table;
    int64_t len;
    int s, kvh, num_heads, group, head_dim, block_size;
    int64_t row;
    float scale;
    int dtype;
};

static void store_out(const struct task *t, float acc[][MAX_HEAD_DIM], const float *run_sum) {
    for (int g = 0; g < t->group; g++) {
        int64_t ooff = ((int64_t)t->s * t->num_heads + t->kvh * t->group + g) * t->head_dim;
        float inv = 1.0f / run_sum[g];
        if (t->dtype == 0) {
            float *o = (float *)t->out + ooff;
            for (int d = 0; d < t->head_dim; d++) o[d] = acc[g][d] * inv;
        } else {
            uint16_t *o = (uint16_t *)t->out + ooff;
            for (int d = 0; d < t->head_dim; d++) o[d] = f32_to_bf16(acc[g][d] * inv);
        }
    }
}

// Online-softmax update of one block's scores: returns nothing, rescales
// the running sums and turns scores into weights; `correction` per head
// is what the accumulators must be multiplied by.
static void softmax_block(int group, int n, float scores[][MAX_BLOCK], float *run_max, float *run_sum,
                          float *correction) {
    for (int g = 0; g < group; g++) {
        float m = run_max[g];
        for (int i = 0; i < n; i++) m = scores[g][i] > m ? scores[g][i] : m;
        correction[g] = expf(run_max[g] - m);  // 0 on the first block
        run_sum[g] *= correction[g];
        for (int i = 0; i < n; i++) {
            scores[g][i] = expf(scores[g][i] - m);
            run_sum[g] += scores[g][i];
        }
        run_max[g] = m;
    }
}

static void attend_scalar(const struct task *t) {
    float qv[MAX_GROUP][MAX_HEAD_DIM];
    float acc[MAX_GROUP][MAX_HEAD_DIM];
    float run_max[MAX_GROUP], run_sum[MAX_GROUP], correction[MAX_GROUP];
    float scores[MAX_GROUP][MAX_BLOCK];
    float kv[MAX_HEAD_DIM];
    const int D = t->head_dim, G = t->group, BS = t->block_size;
    for (int g = 0; g < G; g++) {
        load_row(t->q, ((int64_t)t->s * t->num_heads + t->kvh * G + g) * D, t->dtype, D, qv[g]);
        for (int d = 0; d < D; d++) { qv[g][d] *= t->scale; acc[g][d] = 0.0f; }
        run_max[g] = -FLT_MAX;  // finite: built with -ffast-math
        run_sum[g] = 0.0f;
    }
    int64_t nblocks = (t->len + BS - 1) / BS;
    for (int64_t b = 0; b < nblocks; b++) {
        int n = (int)(t->len - b * BS < BS ? t->len - b * BS : BS);
        int64_t base = t->table[b] * BS * t->row + (int64_t)t->kvh * D;
        for (int i = 0; i < n; i++) {
            load_row(t->k_cache, base + i * t->row, t->dtype, D, kv);
            for (int g = 0; g < G; g++) {
                float dot = 0.0f;
                for (int d = 0; d < D; d++) dot += qv[g][d] * kv[d];
                scores[g][i] = dot;
            }
        }
        softmax_block(G, n, scores, run_max, run_sum, correction);
        for (int g = 0; g < G; g++)
            for (int d = 0; d < D; d++) acc[g][d] *= correction[g];
        for (int i = 0; i < n; i++) {
            load_row(t->v_cache, base + i * t->row, t->dtype, D, kv);
            for (int g = 0; g < G; g++) {
                float p = scores[g][i];
                for (int d = 0; d < D; d++) acc[g][d] += p * kv[d];
            }
        }
    }
    store_out(t, acc, run_sum);
}


// Returns 0, or a negative code for arguments the kernel cannot take.
int paged_attention_check(const int64_t *tables, const int64_t *seq_lens, int num_seqs, int num_heads,
                          int num_kv_heads, int head_dim, int block_size, int max_blocks, int64_t num_blocks,
                          int dtype) {
    if (num_heads % num_kv_heads) return -1;
    if (num_heads / num_kv_heads > MAX_GROUP || head_dim > MAX_HEAD_DIM || block_size > MAX_BLOCK) return -2;
    if (dtype != 0 && dtype != 1) return -3;
    for (int s = 0; s < num_seqs; s++) {
        if (seq_lens[s] < 1 || seq_lens[s] > (int64_t)max_blocks * block_size) return -4;
        int64_t used = (seq_lens[s] + block_size - 1) / block_size;
        for (int64_t b = 0; b < used; b++) {
            int64_t id = tables[(int64_t)s * max_blocks + b];
            if (id < 0 || id >= num_blocks) return -5;
        }
    }
    return 0;
}

// The (sequence, KV head) pairs, shared among the threads of the enclosing
// parallel region (an orphaned worksharing loop). Arguments already checked.
void paged_attention_rows(const void *q, const void *k_cache, const void *v_cache, void *out,
                          const int64_t *tables, const int64_t *seq_lens, int num_seqs, int num_heads,
                          int num_kv_heads, int head_dim, int block_size, int max_blocks, float scale, int dtype) {
    const int group = num_heads / num_kv_heads;
    const int64_t row = (int64_t)num_kv_heads * head_dim;  // one token's K (or V) for all KV heads
    #pragma omp for collapse(2) schedule(dynamic, 1)
    for (int s = 0; s < num_seqs; s++) {
        for (int kvh = 0; kvh < num_kv_heads; kvh++) {
            struct task t = {q, k_cache, v_cache, out, tables + (int64_t)s * max_blocks, seq_lens[s],
                             s, kvh, num_heads, group, head_dim, block_size, row, scale, dtype};
            attend_scalar(&t);
        }
    }
}

int paged_attention_decode(
    const void *q, const void *k_cache, const void *v_cache, void *out,
    const int64_t *tables, const int64_t *seq_lens,
    int num_seqs, int num_heads, int num_kv_heads, int head_dim,
    int block_size, int max_blocks, int64_t num_blocks,
    float scale, int dtype, int num_threads) {
    int code = paged_attention_check(tables, seq_lens, num_seqs, num_heads, num_kv_heads, head_dim, block_size,
                                     max_blocks, num_blocks, dtype);
    if (code) return code;
    #pragma omp parallel num_threads(num_threads)
    paged_attention_rows(q, k_cache, v_cache, out, tables, seq_lens, num_seqs, num_heads, num_kv_heads, head_dim,
                         block_size, max_blocks, scale, dtype);
    return 0;
}
