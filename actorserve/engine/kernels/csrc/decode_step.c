/* A quantized decode step's transformer layers in one call (actorserve.engine.kernels.fused_step).
 *
 * The library the quantized path loads (`quant._Lib`, `glue.load`): the q4/q8 kernels and their
 * step pool (qgemv.c), the norm and RoPE glue (glue.c), and `decode_layers`, which runs every
 * layer of a Llama-shaped model for a step of decode rows: per layer the norm, the q/k/v
 * product, RoPE, the K/V write, attention over the paged cache (the decode kernel of
 * paged_decode.c, through the pointer the caller passes: that kernel lives in its own library),
 * the output product, the residual add and norm, gate/up, SiLU times up, down. The same
 * operations, in the same order, that `PagedLlamaRunner._forward_glued` calls one by one from
 * Python; one call instead of about twenty a layer. With `lora` (a step with adapter rows)
 * each product is followed by its adapters' deltas (lora.c), where the glued loop's hooks add
 * them. */
#include "qgemv.c"
#include "glue.c"
#include "lora.c"

#define ATTENTION_PARALLEL_MIN ((size_t)1 << 18)   /* K elements: paged_decode.c's threshold */
#define ATTENTION_POOL_MIN ((size_t)1 << 14)       /* K elements: over the spinning step pool */

typedef int (*attention_fn)(const float *q, const void *K, const void *V, int bf16,
                            const int32_t *table, int nb, const int32_t *ctx, int D, int nkv, int g,
                            int d, int bs, float scale, float softcap, float *out, int nthreads);
/* paged_decode.c's `paged_decode_part`: the units of the attention that start in [w0, w1) */
typedef int (*attention_part_fn)(const float *q, const void *K, const void *V, int bf16,
                                 const int32_t *table, int nb, const int32_t *ctx, int D, int nkv,
                                 int g, int d, int bs, float scale, float softcap, float *out,
                                 int split, long w0, long w1);

/* One quantized product's operands: q (packed), d, m (q4), bias (float32 or NULL), N, K. */
typedef struct {
    const void *q;
    const uint16_t *d, *m;
    const float *bias;
    int N, K, bits;
} qmat_t;

typedef struct {
    qmat_t qkv, o, gate_up, down;   /* q/k/v and gate/up concatenated along N */
    const void *in_norm, *post_norm;
    float in_eps, post_eps;
    void *k_cache, *v_cache;         /* [slots, nkv, d] in the model's dtype */
} layer_t;

typedef struct {
    int T, D, nh, nkv, hd, inter, rd, bf16, block_size, nb, nthreads;
    float scale;
    void *h;                          /* [T, D] the residual stream, updated in place */
    void *x;                          /* [T, D] normed rows */
    void *qkv;                        /* [T, (nh + 2 nkv) hd] */
    float *qf, *of;                   /* [T, nh hd] float32: attention's query and output */
    void *attn;                       /* [T, nh hd] attention output in the model's dtype */
    void *o;                          /* [T, D] */
    void *gu;                         /* [T, 2 inter] */
    void *act;                        /* [T, inter] SiLU(gate) * up */
    const void *cos, *sin;            /* [T, rd] */
    const int64_t *slots;             /* [T] */
    const int32_t *table, *ctx;       /* [T, nb], [T] */
    attention_fn attention;
    const lora_t *lora;               /* the step's adapters, or NULL */
    attention_part_fn attention_part; /* the same attention in parts (for the step pool), or NULL */
    const int32_t *stop;              /* the scheduler's ask to give the step up, or NULL */
} step_t;

/* Attention shared out over the step pool (`spread`, as the products are): its threads are
 * already spinning for the next product, so no OpenMP team has to wake (and no third thread
 * competes for the cores with the pool's worker). */
typedef struct {
    const step_t *S;
    const layer_t *l;
    int split;
    atomic_int failed;
} attn_job_t;

static void attn_units(const void *ext, int w0, int w1) {
    attn_job_t *a = (attn_job_t *)ext;
    const step_t *S = a->S;
    if (S->attention_part(S->qf, a->l->k_cache, a->l->v_cache, S->bf16, S->table, S->nb, S->ctx, S->T,
                          S->nkv, S->nh / S->nkv, S->hd, S->block_size, S->scale, 0.0f, S->of,
                          a->split, w0, w1))
        atomic_store(&a->failed, 1);
}

/* The element-wise work of a layer, by rows: `fn` over rows [r0, r1) of the step. */
typedef struct {
    const step_t *S;
    const layer_t *l;
    int what;                  /* ROWS_QKV, ROWS_ATTN_OUT, ROWS_ADD_NORM, ROWS_SILU */
    const void *norm;          /* ROWS_ADD_NORM: h += o, then x = this norm of h (NULL: the add alone) */
    float eps;
} rows_job_t;

enum { ROWS_QKV, ROWS_ATTN_OUT, ROWS_ADD_NORM, ROWS_SILU };

static inline float load_el(const void *p, size_t i, int bf16);
static inline void store_el(void *p, size_t i, float v, int bf16);

static void rows_units(const void *ext, int r0, int r1) {
    const rows_job_t *j = (const rows_job_t *)ext;
    const step_t *S = j->S;
    const layer_t *l = j->l;
    const int D = S->D, nh = S->nh, nkv = S->nkv, hd = S->hd, I = S->inter, bf16 = S->bf16;
    const int nq = nh * hd, nk = nkv * hd, nqkv = nq + 2 * nk, es = bf16 ? 2 : 4, n = r1 - r0;
    switch (j->what) {
    case ROWS_QKV: {            /* RoPE on q and k, K/V into the cache, q to float32 */
        char *at = (char *)S->qkv + (size_t)r0 * nqkv * es;
        const char *c = (const char *)S->cos + (size_t)r0 * S->rd * es, *sn = (const char *)S->sin + (size_t)r0 * S->rd * es;
        rope(at, nqkv, n, nh, hd, c, sn, S->rd, bf16);
        rope(at + (size_t)nq * es, nqkv, n, nkv, hd, c, sn, S->rd, bf16);
        for (int t = r0; t < r1; t++) {
            const char *row = (const char *)S->qkv + (size_t)t * nqkv * es;
            memcpy((char *)l->k_cache + (size_t)S->slots[t] * nk * es, row + (size_t)nq * es, (size_t)nk * es);
            memcpy((char *)l->v_cache + (size_t)S->slots[t] * nk * es, row + (size_t)(nq + nk) * es, (size_t)nk * es);
            for (int i = 0; i < nq; i++) S->qf[(size_t)t * nq + i] = load_el(row, i, bf16);
        }
        break;
    }
    case ROWS_ATTN_OUT:
        for (size_t i = (size_t)r0 * nq; i < (size_t)r1 * nq; i++) store_el(S->attn, i, S->of[i], bf16);
        break;
    case ROWS_SILU:
        silu_mul(S->gu, S->act, I, r0, r1, bf16);
        break;
    case ROWS_ADD_NORM:
        if (j->norm) {
            add_rmsnorm((char *)S->h + (size_t)r0 * D * es, (const char *)S->o + (size_t)r0 * D * es, D,
                        j->norm, j->eps, (char *)S->x + (size_t)r0 * D * es, D, n, D, bf16);
        } else {
            for (size_t i = (size_t)r0 * D; i < (size_t)r1 * D; i++)
                store_el(S->h, i, load_el(S->h, i, bf16) + load_el(S->o, i, bf16), bf16);
        }
        break;
    }
}

/* Rows [0, T) of `what` for layer l: shared out over the step pool while it spins (a step of
 * several rows), else here. Each row is computed by one thread with the same code: the same
 * bits either way. */
static void by_rows(const step_t *S, const layer_t *l, int what, const void *norm, float eps) {
    rows_job_t r = {S, l, what, norm, eps};
    if (S->T < 2) {
        rows_units(&r, 0, S->T);
        return;
    }
    job_t job = {0};
    job.ext_fn = rows_units;
    job.ext = &r;
    job.n1 = S->T;
    spread(&job, 1, 1);
}

static int product(const qmat_t *w, const void *x, int M, void *y, int bf16) {
    return qgemv(w->bits, x, bf16, M, w->K, w->q, w->d, w->m, w->N, w->bias, y, bf16, 1);
}

/* The deltas of layer li's linears reading x (row stride xs, width K) into `n` outputs given as
 * (module, N, y, y's row stride) quadruples; 0 without adapters. */
static int deltas(const step_t *S, int li, const void *x, int xs, int K, int n, const lora_out_t *o) {
    return S->lora ? lora_apply(S->lora, li, x, S->bf16, xs, K, n, o, S->bf16, S->nthreads) : 0;
}

static inline float load_el(const void *p, size_t i, int bf16) {
    return bf16 ? bf16_load((const uint16_t *)p, i) : ((const float *)p)[i];
}

static inline void store_el(void *p, size_t i, float v, int bf16) {
    if (bf16) ((uint16_t *)p)[i] = bf16_round(v);
    else ((float *)p)[i] = v;
}

/* Run all `n` layers for the step `S`: 0; the first failing product's -1; or, when `S->stop`
 * reads non-zero at the start of layer li (the scheduler gave the step up), 1 + li. */
int decode_layers(const layer_t *L, int n, const step_t *S) {
    const int T = S->T, D = S->D, nh = S->nh, nkv = S->nkv, hd = S->hd, I = S->inter, bf16 = S->bf16;
    const int nq = nh * hd, nk = nkv * hd, nqkv = nq + 2 * nk, es = bf16 ? 2 : 4;
    /* attention over long contexts goes parallel (paged_decode.c's rule): the pool's spinning
     * worker would hold the core its OpenMP thread needs, so it sleeps through attention then */
    size_t total = 0;
    for (int t = 0; t < T; t++) total += (size_t)S->ctx[t];
    const size_t elements = total * (size_t)nkv * (size_t)hd;
    const int big = S->nthreads > 1 && elements >= ATTENTION_PARALLEL_MIN;
    /* the pool's threads spin through the step anyway: sharing the attention out costs them a
     * hand-off, not a wake-up, so it pays from far fewer elements than OpenMP's team does */
    const int pooled = S->nthreads > 1 && elements >= ATTENTION_POOL_MIN && S->attention_part
                       && atomic_load(&pool.active) && pool.workers > 0;
    const int pause = big && !pooled && atomic_load(&pool.active);
    /* pooled: whole sequences when each thread gets several, else a unit per KV head */
    const int split = T < 4 * (pool.workers + 1) ? nkv : 1;
    add_rmsnorm(S->h, NULL, 0, L[0].in_norm, L[0].in_eps, S->x, D, T, D, bf16);
    for (int li = 0; li < n; li++) {
        if (S->stop && __atomic_load_n(S->stop, __ATOMIC_RELAXED)) return 1 + li;
        const layer_t *l = &L[li];
        if (product(&l->qkv, S->x, T, S->qkv, bf16)) return -1;
        const lora_out_t qkv[3] = {{0, nq, nqkv, S->qkv}, {1, nk, nqkv, (char *)S->qkv + (size_t)nq * es},
                                   {2, nk, nqkv, (char *)S->qkv + (size_t)(nq + nk) * es}};
        if (deltas(S, li, S->x, D, D, 3, qkv)) return -1;
        by_rows(S, l, ROWS_QKV, NULL, 0.f);
        if (pooled) {
            attn_job_t a = {S, l, split, 0};
            job_t job = {0};
            job.ext_fn = attn_units;
            job.ext = &a;
            job.n1 = (int)(total * (size_t)split);
            spread(&job, 1, 1);
            if (atomic_load(&a.failed)) return -1;
        } else {
            if (pause) qpool_active(0, 0);
            const int rc = S->attention(S->qf, l->k_cache, l->v_cache, bf16, S->table, S->nb, S->ctx, T,
                                        nkv, nh / nkv, hd, S->block_size, S->scale, 0.0f, S->of, S->nthreads);
            if (pause) qpool_active(1, 0);
            if (rc) return -1;
        }
        by_rows(S, l, ROWS_ATTN_OUT, NULL, 0.f);
        if (product(&l->o, S->attn, T, S->o, bf16)) return -1;
        const lora_out_t o[1] = {{3, D, D, S->o}};
        if (deltas(S, li, S->attn, nq, nq, 1, o)) return -1;
        by_rows(S, l, ROWS_ADD_NORM, l->post_norm, l->post_eps);
        if (product(&l->gate_up, S->x, T, S->gu, bf16)) return -1;
        const lora_out_t gu[2] = {{4, I, 2 * I, S->gu}, {5, I, 2 * I, (char *)S->gu + (size_t)I * es}};
        if (deltas(S, li, S->x, D, D, 2, gu)) return -1;
        by_rows(S, l, ROWS_SILU, NULL, 0.f);             /* SiLU(gate) * up, each rounded as torch's */
        if (product(&l->down, S->act, T, S->o, bf16)) return -1;
        const lora_out_t down[1] = {{6, D, D, S->o}};
        if (deltas(S, li, S->act, I, I, 1, down)) return -1;
        by_rows(S, l, ROWS_ADD_NORM, li + 1 < n ? L[li + 1].in_norm : NULL,   /* the residual, the */
                li + 1 < n ? L[li + 1].in_eps : 0.f);                          /* next layer's norm */
    }
    return 0;
}
