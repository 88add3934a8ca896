/* A step's LoRA deltas (actorserve.engine.kernels.lora_kernel); built as part of decode_step.c, after
 * qgemv.c (whose step pool and `spread` split the work over threads).
 *
 * For a targeted linear y[T, N] = base(x[T, K]) and a step whose rows each run under one of
 * `nad` adapters (or the base model: row_ad -1, left alone), every adapter row t of adapter i
 * gets   y[t] += B_i (A_i x[t])   with A_i [r, K] and B_i^T [r, N] float32 (B scaled), the
 * products float32 whatever the model's dtype and the delta added in float32 and rounded once
 * into y (a bfloat16 y as torch's ``y.add_(delta)`` rounds it). Only the row's own adapter is
 * computed: the bytes read are each adapter's A and B once per step of rows, the work r (K + N)
 * multiply-adds a row. Linears that share their input (q/k/v, gate/up) go in one call as
 * `parts`, their outputs side by side or apart (each part its own y pointer and row stride).
 *
 * The rows go by adapter, a group each (one adapter's rows: two halves), and the groups are spread
 * over the step pool's threads (or OpenMP's): one hand-off a call, each thread writing its own
 * rows. A group computes u[t, p] = A x[t] for its rows, then adds u[t, p] B^T to them 64
 * columns at a time. */

#define LORA_MAXPARTS 3
#define LORA_BLOCK 64

typedef struct {
    const float *a, *bt;        /* A [r, K], B^T [r, N] (scaled); NULL: the adapter leaves it */
} lora_pair_t;

typedef struct {
    int T, nad, nmod;
    const int32_t *row_ad;      /* [T]: each row's adapter, -1 for the base model */
    const int32_t *rank;        /* [nad] */
    const lora_pair_t *pairs;   /* [layers][nmod][nad] */
} lora_t;

typedef struct {
    int mod, N, y_stride;       /* module index, output width, y's row stride (elements) */
    void *y;                    /* row 0, column 0 of this part's output */
} lora_out_t;

typedef struct {
    const lora_t *L;
    const lora_out_t *outs;
    const int *rows;            /* the adapter rows the call computes [nrows], by adapter */
    const int *group;           /* [ngroups + 1]: where each group of rows starts in `rows` */
    const float *xf;            /* their input, float32 [nrows, K] */
    float *u;                   /* [nrows, nparts, rmax] */
    int li, K, nparts, nrows, rmax, y_bf16, ngroups;
} lora_job_t;

#if defined(__AVX512F__)
static inline float lora_dot(const float *a, const float *x, int K) {
    __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps();
    int k = 0;
    for (; k + 32 <= K; k += 32) {
        s0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + k), _mm512_loadu_ps(x + k), s0);
        s1 = _mm512_fmadd_ps(_mm512_loadu_ps(a + k + 16), _mm512_loadu_ps(x + k + 16), s1);
    }
    float s = _mm512_reduce_add_ps(_mm512_add_ps(s0, s1));
    for (; k < K; k++) s += a[k] * x[k];
    return s;
}

/* acc[0, nc) = sum_j u[j] bt[j * N + c]: 64 columns in four independent sums */
static inline void lora_block(const float *u, int r, const float *bt, int N, int nc, float *acc) {
    if (nc == LORA_BLOCK) {
        __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (int j = 0; j < r; j++, bt += N) {
            const __m512 uj = _mm512_set1_ps(u[j]);
            a0 = _mm512_fmadd_ps(uj, _mm512_loadu_ps(bt), a0);
            a1 = _mm512_fmadd_ps(uj, _mm512_loadu_ps(bt + 16), a1);
            a2 = _mm512_fmadd_ps(uj, _mm512_loadu_ps(bt + 32), a2);
            a3 = _mm512_fmadd_ps(uj, _mm512_loadu_ps(bt + 48), a3);
        }
        _mm512_store_ps(acc, a0), _mm512_store_ps(acc + 16, a1);
        _mm512_store_ps(acc + 32, a2), _mm512_store_ps(acc + 48, a3);
        return;
    }
    for (int c = 0; c < nc; c++) acc[c] = 0.f;
    for (int j = 0; j < r; j++, bt += N)
        for (int c = 0; c < nc; c++) acc[c] += u[j] * bt[c];
}

/* y[0, n) = bf16(float(y) + acc), rounded to nearest even (finite values: float_to_bf16's) */
static inline void lora_add_bf16(uint16_t *y, const float *acc, int n) {
    int c = 0;
    for (; c + 16 <= n; c += 16) {
        __m512i yi = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(y + c)));
        __m512 v = _mm512_add_ps(_mm512_castsi512_ps(_mm512_slli_epi32(yi, 16)), _mm512_loadu_ps(acc + c));
        __m512i b = _mm512_castps_si512(v);
        const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        __m512i odd = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
        __m512i rb = _mm512_srli_epi32(_mm512_add_epi32(b, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
        if (nan) rb = _mm512_mask_or_epi32(rb, nan, _mm512_srli_epi32(b, 16), _mm512_set1_epi32(0x40));
        _mm256_storeu_si256((__m256i *)(y + c), _mm512_cvtepi32_epi16(rb));
    }
    for (; c < n; c++) y[c] = float_to_bf16(bf16_to_float(y[c]) + acc[c]);
}
#else
static inline float lora_dot(const float *a, const float *x, int K) {
    float s = 0.f;
    #pragma omp simd reduction(+:s)
    for (int k = 0; k < K; k++) s += a[k] * x[k];
    return s;
}

static inline void lora_block(const float *u, int r, const float *bt, int N, int nc, float *acc) {
    for (int c = 0; c < nc; c++) acc[c] = 0.f;
    for (int j = 0; j < r; j++, bt += N) {
        const float uj = u[j];
        #pragma omp simd
        for (int c = 0; c < nc; c++) acc[c] += uj * bt[c];
    }
}

static inline void lora_add_bf16(uint16_t *y, const float *acc, int n) {
    for (int c = 0; c < n; c++) y[c] = float_to_bf16(bf16_to_float(y[c]) + acc[c]);
}
#endif

static inline const lora_pair_t *lora_pair(const lora_job_t *w, int p, int row) {
    const lora_t *L = w->L;
    const int ad = L->row_ad[row];
    const lora_pair_t *pr = &L->pairs[((size_t)w->li * L->nmod + w->outs[p].mod) * L->nad + ad];
    return pr->a ? pr : NULL;
}

/* Unit g: the rows [group[g], group[g + 1]) of `rows` (all of one adapter): u = A x for each
 * part, then y += u B^T block by block, so that adapter's B is read once for them. */
static void lora_units(const void *ext, int g0, int g1) {
    const lora_job_t *w = ext;
    const int K = w->K;
    for (int g = g0; g < g1; g++) {
        const int i0 = w->group[g], i1 = w->group[g + 1], r = w->L->rank[w->L->row_ad[w->rows[i0]]];
        for (int p = 0; p < w->nparts; p++) {
            const lora_pair_t *pr = lora_pair(w, p, w->rows[i0]);
            if (!pr) continue;
            for (int i = i0; i < i1; i++) {
                float *u = w->u + ((size_t)i * w->nparts + p) * w->rmax;
                for (int j = 0; j < r; j++) u[j] = lora_dot(pr->a + (size_t)j * K, w->xf + (size_t)i * K, K);
            }
            const lora_out_t *o = &w->outs[p];
            for (int c0 = 0; c0 < o->N; c0 += LORA_BLOCK) {
                const int nc = o->N - c0 < LORA_BLOCK ? o->N - c0 : LORA_BLOCK;
                for (int i = i0; i < i1; i++) {
                    float acc[LORA_BLOCK] __attribute__((aligned(64)));
                    const size_t at = (size_t)w->rows[i] * o->y_stride + c0;
                    lora_block(w->u + ((size_t)i * w->nparts + p) * w->rmax, r, pr->bt + c0, o->N, nc, acc);
                    if (w->y_bf16) lora_add_bf16((uint16_t *)o->y + at, acc, nc);
                    else for (int c = 0; c < nc; c++) ((float *)o->y)[at + c] += acc[c];
                }
            }
        }
    }
}

/* Add the deltas of layer `li`'s `nparts` linears that read x [T, K] (row stride x_stride);
 * 0, or -1 for a call it does not take (too many parts, no memory). */
int lora_apply(const lora_t *L, int li, const void *x, int x_bf16, int x_stride, int K, int nparts,
               const lora_out_t *outs, int y_bf16, int nthreads) {
    if (nparts < 1 || nparts > LORA_MAXPARTS || L->T < 1) return -1;
    lora_job_t w = {L, outs, NULL, NULL, NULL, NULL, li, K, nparts, 0, 0, y_bf16, 0};
    int *rows = malloc(sizeof(int) * (2 * (size_t)L->T + 2));
    if (!rows) return -1;
    int *group = rows + L->T;
    for (int ad = 0; ad < L->nad; ad++) {            /* the rows by adapter, a group each */
        int any = 0, first = w.nrows;
        for (int p = 0; p < nparts; p++)
            any |= L->pairs[((size_t)li * L->nmod + outs[p].mod) * L->nad + ad].a != NULL;
        if (!any) continue;
        for (int t = 0; t < L->T; t++)
            if (L->row_ad[t] == ad) rows[w.nrows++] = t;
        if (w.nrows == first) continue;
        group[w.ngroups++] = first;
        if (L->rank[ad] > w.rmax) w.rmax = L->rank[ad];
    }
    if (w.nrows == 0) {
        free(rows);
        return 0;
    }
    if (w.ngroups == 1 && w.nrows > 1) group[w.ngroups++] = w.nrows / 2;   /* one adapter: two halves */
    group[w.ngroups] = w.nrows;
    float *xf = malloc(sizeof(float) * ((size_t)w.nrows * K + (size_t)w.nrows * nparts * w.rmax));
    if (!xf) {
        free(rows);
        return -1;
    }
    for (int i = 0; i < w.nrows; i++) {
        const size_t from = (size_t)rows[i] * x_stride;
        float *to = xf + (size_t)i * K;
        if (x_bf16) for (int k = 0; k < K; k++) to[k] = bf16_to_float(((const uint16_t *)x)[from + k]);
        else memcpy(to, (const float *)x + from, sizeof(float) * (size_t)K);
    }
    w.rows = rows, w.group = group, w.xf = xf, w.u = xf + (size_t)w.nrows * K;
    job_t job = {0};
    job.ext = &w;
    job.ext_fn = lora_units;
    job.n1 = w.ngroups;
    spread(&job, w.ngroups > 1, nthreads < w.ngroups ? nthreads : w.ngroups);
    free(xf);
    free(rows);
    return 0;
}
