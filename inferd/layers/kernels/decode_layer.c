// A Llama-family decoder's layers for a step of decodes only, for CPUs.
//
// At a few rows a decode step is about thirty small tensor operations per
// layer, and on a CPU each PyTorch call costs microseconds of dispatch:
// more, at batch 1, than reading the layer's weights. This runs all the
// layers in one call and one OpenMP parallel region, over the same kernels
// the per-op path uses (linear.c, paged_attention.c): their work-sharing
// loops split each matmul and the attention among the threads, and the
// small element-wise work between them (norms, rotary, cache writes, SiLU)
// runs on one thread while the others wait at the barrier. Per layer:
//
//   residual = x (+ residual);  h = rms_norm(residual) * w_in
//   q, k, v = h @ Wqkv (+ bias);  q, k rotated;  k, v written to their slots
//   a = paged attention of q over the cache;  residual += a @ Wo
//   h = rms_norm(residual) * w_post;  g, u = h @ Wgate_up
//   x = (silu(g) * u) @ Wdown
//
// Every intermediate is stored in the model dtype, as the per-op path
// stores it; element-wise math is float32. x and residual are updated in
// place, as the layer's output and the residual stream before it.

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

// A linear layer's weight as linear_small takes it, and an optional bias
// (out_features values in the model dtype).
struct linear_weight {
    const void *weight;
    const uint16_t *scales;
    const void *bias;
    int32_t kind, group, out_features, in_features;
};

struct layer_weights {
    struct linear_weight qkv, o, gate_up, down;
    const void *input_norm, *post_norm;  // (hidden,) in the model dtype
    void *k_cache, *v_cache;             // (num_blocks, block_size, num_kv_heads, head_dim)
};

// What every layer of the step shares.
struct step {
    int32_t rows, hidden, num_heads, num_kv_heads, head_dim, intermediate, dtype, num_threads;
    int32_t block_size, max_blocks;
    int64_t num_blocks;
    float eps, scale;
    const float *cos, *sin;  // (rows, head_dim), sin with the rotate-half sign
    const int64_t *slots;    // (rows,) cache slot of each row's new K/V
    const int64_t *tables;   // (rows, max_blocks)
    const int64_t *seq_lens; // (rows,)
};

static inline float get(const void *p, int dtype, int64_t i) {
    return dtype == 0 ? ((const float *)p)[i] : bf16_to_f32(((const uint16_t *)p)[i]);
}

static inline void put(void *p, int dtype, int64_t i, float v) {
    if (dtype == 0) ((float *)p)[i] = v;
    else ((uint16_t *)p)[i] = f32_to_bf16(v);
}

// The rounding the model dtype applies to a value it stores.
static inline float round_to(int dtype, float v) { return dtype == 0 ? v : bf16_to_f32(f32_to_bf16(v)); }

// residual = x + residual (or x), h = rms_norm(residual) * weight, as
// Hugging Face computes it: the sum stored in the model dtype, normalised in
// float32, stored, then scaled by the weight in the model dtype.
static void add_rms_norm(const struct step *s, void *x, void *residual, int first, const void *weight, void *h) {
    const int n = s->hidden, dt = s->dtype;
    for (int m = 0; m < s->rows; m++) {
        int64_t base = (int64_t)m * n;
        float sumsq = 0.0f;
        for (int i = 0; i < n; i++) {
            float v = get(x, dt, base + i) + (first ? 0.0f : get(residual, dt, base + i));
            v = round_to(dt, v);
            put(residual, dt, base + i, v);
            sumsq += v * v;
        }
        float inv = 1.0f / sqrtf(sumsq / (float)n + s->eps);
        for (int i = 0; i < n; i++) {
            float normed = round_to(dt, get(residual, dt, base + i) * inv);
            put(h, dt, base + i, normed * get(weight, dt, i));
        }
    }
}

static void add_bias(const struct step *s, const struct linear_weight *w, void *out) {
    if (w->bias == NULL) return;
    for (int m = 0; m < s->rows; m++)
        for (int i = 0; i < w->out_features; i++) {
            int64_t j = (int64_t)m * w->out_features + i;
            put(out, s->dtype, j, get(out, s->dtype, j) + get(w->bias, s->dtype, i));
        }
}

// Rotates q and k of each row in place, copies q out contiguous for the
// attention kernel, and writes k and v to their cache slots.
static void rotate_and_cache(const struct step *s, void *qkv, void *q, void *k_cache, void *v_cache) {
    const int D = s->head_dim, half = D / 2, dt = s->dtype;
    const int qk_heads = s->num_heads + s->num_kv_heads, width = (qk_heads + s->num_kv_heads) * D;
    const int64_t kv_row = (int64_t)s->num_kv_heads * D;
    float tmp[1024];
    for (int m = 0; m < s->rows; m++) {
        const float *cs = s->cos + (int64_t)m * D, *sn = s->sin + (int64_t)m * D;
        for (int hd = 0; hd < qk_heads; hd++) {
            int64_t base = (int64_t)m * width + (int64_t)hd * D;
            for (int d = 0; d < D; d++) tmp[d] = get(qkv, dt, base + d);
            for (int d = 0; d < D; d++) put(qkv, dt, base + d, tmp[d] * cs[d] + tmp[(d + half) % D] * sn[d]);
        }
        size_t esize = dt == 0 ? 4 : 2;
        const char *row = (const char *)qkv + (size_t)m * width * esize;
        memcpy((char *)q + (size_t)m * s->num_heads * D * esize, row, (size_t)s->num_heads * D * esize);
        int64_t slot = s->slots[m];
        memcpy((char *)k_cache + (size_t)(slot * kv_row) * esize, row + (size_t)s->num_heads * D * esize,
               (size_t)kv_row * esize);
        memcpy((char *)v_cache + (size_t)(slot * kv_row) * esize, row + (size_t)qk_heads * D * esize,
               (size_t)kv_row * esize);
    }
}

// Shared among the threads of the enclosing parallel region.
static void silu_mul(const struct step *s, const void *gate_up, void *act) {
    const int n = s->intermediate, dt = s->dtype;
    #pragma omp for schedule(static)
    for (int64_t j = 0; j < (int64_t)s->rows * n; j++) {
        const int64_t m = j / n, i = j % n;
        float g = get(gate_up, dt, m * 2 * n + i), u = get(gate_up, dt, m * 2 * n + n + i);
        put(act, dt, j, round_to(dt, g / (1.0f + expf(-g))) * u);
    }
}

static int check_linear(const struct step *s, const struct linear_weight *w, int in_features, int out_features) {
    if (w->in_features != in_features || w->out_features != out_features) return -12;
    return linear_check(s->dtype, s->rows, w->in_features, w->kind, w->group, s->dtype);
}

static size_t max_size(size_t a, size_t b) { return a > b ? a : b; }

static _Thread_local void *buf;
static _Thread_local size_t buf_size;

// Runs layers [0, n_layers) over x (rows, hidden): the step's embeddings in,
// the last layer's output out, and residual the stream before it.
// Returns 0, or a negative code: linear_check's (-1 .. -3), -10 for a
// head_dim over 1024 or odd, -11 out of memory, -12 a layer whose shapes
// do not chain, or the attention check's minus 20 (-21 .. -25).
int decode_layers(const struct layer_weights *layers, int n_layers, const struct step *s, void *x,
                  void *residual) {
    if (s->head_dim > 1024 || s->head_dim % 2) return -10;
    const int H = s->hidden, qkv_width = (s->num_heads + 2 * s->num_kv_heads) * s->head_dim;
    const int q_width = s->num_heads * s->head_dim;
    size_t prep = 0;
    for (int l = 0; l < n_layers; l++) {
        const struct layer_weights *L = layers + l;
        int code;
        if ((code = check_linear(s, &L->qkv, H, qkv_width)) || (code = check_linear(s, &L->o, q_width, H)) ||
            (code = check_linear(s, &L->gate_up, H, 2 * s->intermediate)) ||
            (code = check_linear(s, &L->down, s->intermediate, H)))
            return code;
        const struct linear_weight *all[4] = {&L->qkv, &L->o, &L->gate_up, &L->down};
        for (int i = 0; i < 4; i++)
            prep = max_size(prep, linear_prepare_bytes(s->rows, all[i]->in_features, all[i]->kind, all[i]->group));
    }
    int code = paged_attention_check(s->tables, s->seq_lens, s->rows, s->num_heads, s->num_kv_heads, s->head_dim,
                                     s->block_size, s->max_blocks, s->num_blocks, s->dtype);
    if (code) return code - 20;

    const size_t esize = s->dtype == 0 ? 4 : 2, rows = (size_t)s->rows;
    const size_t n_h = rows * H, n_qkv = rows * qkv_width, n_q = rows * q_width;
    const size_t n_gu = rows * 2 * s->intermediate, n_act = rows * s->intermediate;
    size_t need = prep + ((n_h + n_qkv + 2 * n_q + n_gu + n_act) * esize + 63) / 64 * 64;
    if (need > buf_size) {
        free(buf);
        buf = aligned_alloc(64, need);
        buf_size = buf ? need : 0;
        if (buf == NULL) return -11;
    }
    char *xbuf = buf;  // first: linear_prepare wants it aligned
    char *h = xbuf + prep;
    char *qkv = h + n_h * esize;
    char *q = qkv + n_qkv * esize;
    char *attn = q + n_q * esize;
    char *gate_up = attn + n_q * esize;
    char *act = gate_up + n_gu * esize;
    const int dt = s->dtype, M = s->rows;

    #pragma omp parallel num_threads(s->num_threads)
    for (int l = 0; l < n_layers; l++) {
        const struct layer_weights *L = layers + l;
        // Each linear's prepared input in the same buffer; the barriers at
        // the ends of the work-sharing loops order its reuse.
        struct xrows xr;
        #pragma omp single
        add_rms_norm(s, x, residual, l == 0, L->input_norm, h);
        xr = xrows_layout(xbuf, M, H, L->qkv.kind, L->qkv.group);
        linear_prepare(h, dt, M, H, L->qkv.kind, L->qkv.group, &xr);
        linear_rows(&xr, M, H, L->qkv.weight, L->qkv.kind, qkv_width, L->qkv.scales, L->qkv.group, qkv, dt);
        #pragma omp single
        {
            add_bias(s, &L->qkv, qkv);
            rotate_and_cache(s, qkv, q, L->k_cache, L->v_cache);
        }
        paged_attention_rows(q, L->k_cache, L->v_cache, attn, s->tables, s->seq_lens, M, s->num_heads,
                             s->num_kv_heads, s->head_dim, s->block_size, s->max_blocks, s->scale, dt);
        xr = xrows_layout(xbuf, M, q_width, L->o.kind, L->o.group);
        linear_prepare(attn, dt, M, q_width, L->o.kind, L->o.group, &xr);
        linear_rows(&xr, M, q_width, L->o.weight, L->o.kind, H, L->o.scales, L->o.group, x, dt);
        #pragma omp single
        add_rms_norm(s, x, residual, 0, L->post_norm, h);
        xr = xrows_layout(xbuf, M, H, L->gate_up.kind, L->gate_up.group);
        linear_prepare(h, dt, M, H, L->gate_up.kind, L->gate_up.group, &xr);
        linear_rows(&xr, M, H, L->gate_up.weight, L->gate_up.kind, 2 * s->intermediate, L->gate_up.scales,
                    L->gate_up.group, gate_up, dt);
        silu_mul(s, gate_up, act);
        xr = xrows_layout(xbuf, M, s->intermediate, L->down.kind, L->down.group);
        linear_prepare(act, dt, M, s->intermediate, L->down.kind, L->down.group, &xr);
        linear_rows(&xr, M, s->intermediate, L->down.weight, L->down.kind, H, L->down.scales, L->down.group, x, dt);
    }
    return 0;
}
