/* Exact, batch-invariant fp32 kernels for the CPU (kernels/_native.py builds and loads this file).

Every output element is a sum over a reduction index k of exact fp32 products x[k] * w[k], added in
exactly the order of kernels._common.tree_sum (a fixed binary tree of adjacent pairs whose shape
depends only on the reduction length). That tree equals: cut the length n into blocks of
decreasing powers of two (the binary digits of n, left to right), reduce each block as a perfect
pair tree, then add the block sums from the right: B1 + (B2 + (B3 + ...)). Below, blocks of 8 are
reduced in registers and merged like a binary counter; the remainder (< 8) gives blocks of 4, 2, 1.

SIMD runs across 16 independent outputs (lanes = output columns), never across k: each lane does
the same IEEE operations a scalar loop would, so the result of an output does not depend on M, N,
the other rows or columns, where the row sits, the vector width, the thread count or alignment.
Build with -ffp-contract=off (no fused multiply-add: every product is rounded once, as in torch).
*/

#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <pthread.h>

#define NL 16      /* lanes: output columns computed together */
#define RB 4       /* rows per register block */
#define MAXLEV 64

typedef ptrdiff_t idx_t;

/* out[r][l] = tree over k < len of x[r][k] * wp[k * NL + l], for r < nr (nr <= RB).
   x rows are contiguous in k. wp is a packed tile [len][NL]. */
static inline __attribute__((always_inline)) void tree_block(const int nr, const float *const *xr,
                                                             const float *wp, int len, float (*out)[NL])
{
    float stk[MAXLEV][RB][NL];
    int lev[MAXLEV];
    int sp = 0;
    int k = 0;
    float s[RB][NL];
    for (; k + 8 <= len; k += 8) {
        const float *w = wp + (idx_t)k * NL;
        for (int r = 0; r < nr; r++) {
            const float *x = xr[r] + k;
            const float x0 = x[0], x1 = x[1], x2 = x[2], x3 = x[3], x4 = x[4], x5 = x[5], x6 = x[6], x7 = x[7];
            for (int l = 0; l < NL; l++) {
                float p0 = x0 * w[l], p1 = x1 * w[NL + l], p2 = x2 * w[2 * NL + l], p3 = x3 * w[3 * NL + l];
                float p4 = x4 * w[4 * NL + l], p5 = x5 * w[5 * NL + l], p6 = x6 * w[6 * NL + l], p7 = x7 * w[7 * NL + l];
                float a = p0 + p1, b = p2 + p3, c = p4 + p5, d = p6 + p7;
                float ab = a + b, cd = c + d;
                s[r][l] = ab + cd;
            }
        }
        int L = 3;
        while (sp > 0 && lev[sp - 1] == L) {
            for (int r = 0; r < nr; r++)
                for (int l = 0; l < NL; l++) s[r][l] = stk[sp - 1][r][l] + s[r][l];
            sp--;
            L++;
        }
        for (int r = 0; r < nr; r++) memcpy(stk[sp][r], s[r], sizeof(float) * NL);
        lev[sp++] = L;
    }
    int rem = len - k;
    if (rem & 4) {
        const float *w = wp + (idx_t)k * NL;
        for (int r = 0; r < nr; r++) {
            const float *x = xr[r] + k;
            const float x0 = x[0], x1 = x[1], x2 = x[2], x3 = x[3];
            for (int l = 0; l < NL; l++) {
                float p0 = x0 * w[l], p1 = x1 * w[NL + l], p2 = x2 * w[2 * NL + l], p3 = x3 * w[3 * NL + l];
                float a = p0 + p1, b = p2 + p3;
                stk[sp][r][l] = a + b;
            }
        }
        lev[sp++] = 2;
        k += 4;
    }
    if (rem & 2) {
        const float *w = wp + (idx_t)k * NL;
        for (int r = 0; r < nr; r++) {
            const float *x = xr[r] + k;
            const float x0 = x[0], x1 = x[1];
            for (int l = 0; l < NL; l++) {
                float p0 = x0 * w[l], p1 = x1 * w[NL + l];
                stk[sp][r][l] = p0 + p1;
            }
        }
        lev[sp++] = 1;
        k += 2;
    }
    if (rem & 1) {
        const float *w = wp + (idx_t)k * NL;
        for (int r = 0; r < nr; r++) {
            const float x0 = xr[r][k];
            for (int l = 0; l < NL; l++) stk[sp][r][l] = x0 * w[l];
        }
        lev[sp++] = 0;
        k += 1;
    }
    if (sp == 0) {
        for (int r = 0; r < nr; r++)
            for (int l = 0; l < NL; l++) out[r][l] = 0.0f;
        return;
    }
    for (int r = 0; r < nr; r++) {
        for (int l = 0; l < NL; l++) s[r][l] = stk[sp - 1][r][l];
        for (int i = sp - 2; i >= 0; i--)
            for (int l = 0; l < NL; l++) s[r][l] = stk[i][r][l] + s[r][l];
        for (int l = 0; l < NL; l++) out[r][l] = s[r][l];
    }
}

static void tree_rows(int nr, const float *const *xr, const float *wp, int len, float (*out)[NL])
{
    switch (nr) {
    case 4: tree_block(4, xr, wp, len, out); break;
    case 3: tree_block(3, xr, wp, len, out); break;
    case 2: tree_block(2, xr, wp, len, out); break;
    default: tree_block(1, xr, wp, len, out); break;
    }
}

/* Scalar tree_sum of x[0..n-1] (same order). */
static float tree1(const float *x, int n)
{
    float stk[MAXLEV];
    int lev[MAXLEV];
    int sp = 0, k = 0;
    for (; k + 8 <= n; k += 8) {
        float a = x[k] + x[k + 1], b = x[k + 2] + x[k + 3], c = x[k + 4] + x[k + 5], d = x[k + 6] + x[k + 7];
        float ab = a + b, cd = c + d;
        float s = ab + cd;
        int L = 3;
        while (sp > 0 && lev[sp - 1] == L) { s = stk[sp - 1] + s; sp--; L++; }
        stk[sp] = s; lev[sp++] = L;
    }
    int rem = n - k;
    if (rem & 4) { float a = x[k] + x[k + 1], b = x[k + 2] + x[k + 3]; stk[sp] = a + b; lev[sp++] = 2; k += 4; }
    if (rem & 2) { stk[sp] = x[k] + x[k + 1]; lev[sp++] = 1; k += 2; }
    if (rem & 1) { stk[sp] = x[k]; lev[sp++] = 0; k += 1; }
    if (sp == 0) return 0.0f;
    float s = stk[sp - 1];
    for (int i = sp - 2; i >= 0; i--) s = stk[i] + s;
    return s;
}

/* wp[k * NL + l] = W[n0 + l, k] for k < K (0 for lanes past N); W[n, k] = w[n * swn + k * swk]. */
static void pack_tile(const float *w, idx_t swn, idx_t swk, int n0, int N, int K, float *wp)
{
    int nv = N - n0 < NL ? N - n0 : NL;
    if (nv < NL) memset(wp, 0, sizeof(float) * (size_t)K * NL);
    if (swn == 1) {
        for (int k = 0; k < K; k++) {
            const float *src = w + (idx_t)n0 + (idx_t)k * swk;
            float *dst = wp + (idx_t)k * NL;
            for (int l = 0; l < nv; l++) dst[l] = src[l];
        }
    } else {
        for (int l = 0; l < nv; l++) {
            const float *src = w + (idx_t)(n0 + l) * swn;
            for (int k = 0; k < K; k++) wp[(idx_t)k * NL + l] = src[(idx_t)k * swk];
        }
    }
}

/* ------------------------------------------------------------------------------------ threads */

typedef void (*work_fn)(void *ctx, int item, float *scratch);

typedef struct {
    work_fn fn;
    void *ctx;
    int n_items, stride, first;
    size_t scratch_floats;
    int err;
} job_t;

static void *run_job(void *arg)
{
    job_t *j = (job_t *)arg;
    float *scratch = (float *)malloc(sizeof(float) * (j->scratch_floats ? j->scratch_floats : 1));
    if (!scratch) { j->err = 1; return NULL; }
    for (int it = j->first; it < j->n_items; it += j->stride) j->fn(j->ctx, it, scratch);
    free(scratch);
    return NULL;
}

/* Items are independent and each writes only its own outputs, so how they are spread over threads
   does not change any bit. Returns 0 on success. */
static int run_items(work_fn fn, void *ctx, int n_items, size_t scratch_floats, int nthreads)
{
    if (nthreads < 1) nthreads = 1;
    if (nthreads > n_items) nthreads = n_items;
    if (nthreads > 64) nthreads = 64;
    if (n_items <= 0) return 0;
    job_t jobs[64];
    pthread_t tid[64];
    int started[64];
    for (int t = 0; t < nthreads; t++) {
        jobs[t].fn = fn; jobs[t].ctx = ctx; jobs[t].n_items = n_items; jobs[t].stride = nthreads;
        jobs[t].first = t; jobs[t].scratch_floats = scratch_floats; jobs[t].err = 0;
        started[t] = 0;
    }
    for (int t = 1; t < nthreads; t++) started[t] = pthread_create(&tid[t], NULL, run_job, &jobs[t]) == 0;
    /* an item a thread could not take is run here: the split never changes the result */
    for (int t = 1; t < nthreads; t++)
        if (!started[t]) { jobs[t].stride = nthreads; run_job(&jobs[t]); }
    run_job(&jobs[0]);
    int err = jobs[0].err;
    for (int t = 1; t < nthreads; t++) {
        if (started[t]) pthread_join(tid[t], NULL);
        err |= jobs[t].err;
    }
    return err;
}

/* ---------------------------------------------------------------------------------------- GEMM */

#define ROW_CHUNK 64

typedef struct {
    int M, N, K;
    const float *x; idx_t sxm;
    const float *w; idx_t swn, swk;
    float *out; idx_t som;
    int n_chunks;
} gemm_ctx;

static void gemm_item(void *vctx, int item, float *wp)
{
    gemm_ctx *c = (gemm_ctx *)vctx;
    int tile = item / c->n_chunks, chunk = item % c->n_chunks;
    int n0 = tile * NL;
    int nv = c->N - n0 < NL ? c->N - n0 : NL;
    pack_tile(c->w, c->swn, c->swk, n0, c->N, c->K, wp);
    int m1 = (chunk + 1) * ROW_CHUNK < c->M ? (chunk + 1) * ROW_CHUNK : c->M;
    float o[RB][NL];
    const float *xr[RB];
    for (int m = chunk * ROW_CHUNK; m < m1; m += RB) {
        int nr = m1 - m < RB ? m1 - m : RB;
        for (int r = 0; r < nr; r++) xr[r] = c->x + (idx_t)(m + r) * c->sxm;
        tree_rows(nr, xr, wp, c->K, o);
        for (int r = 0; r < nr; r++) memcpy(c->out + (idx_t)(m + r) * c->som + n0, o[r], sizeof(float) * nv);
    }
}

/* out[m, n] = tree over k of x[m, k] * W[n, k]; x rows contiguous (x[m * sxm + k]),
   W[n, k] = w[n * swn + k * swk], out[m * som + n]. */
int rz_tree_gemm(int M, int N, int K, const float *x, idx_t sxm, const float *w, idx_t swn, idx_t swk,
                 float *out, idx_t som, int nthreads)
{
    if (M <= 0 || N <= 0) return 0;
    gemm_ctx c = {M, N, K, x, sxm, w, swn, swk, out, som, (M + ROW_CHUNK - 1) / ROW_CHUNK};
    int n_tiles = (N + NL - 1) / NL;
    return run_items(gemm_item, &c, n_tiles * c.n_chunks, (size_t)(K > 0 ? K : 1) * NL, nthreads);
}

/* ----------------------------------------------------------------------------------- attention */

/* Sequences i < nseq: query tokens q_start[i] .. q_start[i] + nq[i] - 1 (rows of q), keys
   key_start[i] .. key_start[i] + n_keys[i] - 1 (rows of k / v); query token t sits at position
   pos[t] and sees keys 0..pos[t] of its sequence. Score rows: for token t (in order) and query head
   hq < Hq, a row of pos[t] + 1 floats at sbuf + row_off, row_off running over tokens then heads, from
   s_start[i] for sequence i. q[t, hq, d] = q[t * sqt + hq * sqh + d]; k[j, h, d] = k[j * skj + h * skh + d];
   v likewise; out[t, hq, d] = out[t * sot + hq * soh + d]. */
typedef struct {
    int nseq, Hq, Hkv, D, Dv;
    const int64_t *q_start, *nq, *key_start, *pos, *s_start;
    const float *q; idx_t sqt, sqh;
    const float *k; idx_t skj, skh;
    const float *v; idx_t svj, svh;
    float *sbuf;
    float *out; idx_t sot, soh;
    float scale;
    int max_keys;
} attn_ctx;

static void scores_item(void *vctx, int item, float *wp)
{
    attn_ctx *c = (attn_ctx *)vctx;
    int i = item / c->Hkv, h = item % c->Hkv;
    int G = c->Hq / c->Hkv;
    int64_t t0 = c->q_start[i], nq = c->nq[i];
    if (nq <= 0) return;
    int64_t maxpos = 0;
    for (int64_t t = t0; t < t0 + nq; t++) if (c->pos[t] > maxpos) maxpos = c->pos[t];
    int L = (int)maxpos + 1;
    const float *kb = c->k + (idx_t)c->key_start[i] * c->skj + (idx_t)h * c->skh;
    float o[RB][NL];
    const float *xr[RB];
    float *rowp[RB];
    int rlen[RB];
    for (int j0 = 0; j0 < L; j0 += NL) {
        /* keys j0 .. j0 + 15 as lanes; the reduction runs over d < D */
        pack_tile(kb, c->skj, 1, j0, L, c->D, wp);
        int nr = 0;
        int64_t off = c->s_start[i];
        for (int64_t t = t0; t < t0 + nq; t++) {
            int len = (int)c->pos[t] + 1;
            for (int hq = 0; hq < c->Hq; hq++, off += len) {
                if (hq / G != h || len <= j0) continue;
                xr[nr] = c->q + (idx_t)t * c->sqt + (idx_t)hq * c->sqh;
                rowp[nr] = c->sbuf + off;
                rlen[nr] = len;
                if (++nr == RB) {
                    tree_rows(nr, xr, wp, c->D, o);
                    for (int r = 0; r < nr; r++) {
                        int nv = rlen[r] - j0 < NL ? rlen[r] - j0 : NL;
                        for (int l = 0; l < nv; l++) rowp[r][j0 + l] = o[r][l] * c->scale;
                    }
                    nr = 0;
                }
            }
        }
        if (nr) {
            tree_rows(nr, xr, wp, c->D, o);
            for (int r = 0; r < nr; r++) {
                int nv = rlen[r] - j0 < NL ? rlen[r] - j0 : NL;
                for (int l = 0; l < nv; l++) rowp[r][j0 + l] = o[r][l] * c->scale;
            }
        }
    }
    /* s - max(s) per row (the row max is exact; exp is taken by torch afterwards) */
    int64_t off = c->s_start[i];
    for (int64_t t = t0; t < t0 + nq; t++) {
        int len = (int)c->pos[t] + 1;
        for (int hq = 0; hq < c->Hq; hq++, off += len) {
            if (hq / G != h) continue;
            float *row = c->sbuf + off;
            float m = row[0];
            for (int j = 1; j < len; j++) if (row[j] > m) m = row[j];
            for (int j = 0; j < len; j++) row[j] = row[j] - m;
        }
    }
}

static void pv_item(void *vctx, int item, float *wp)
{
    attn_ctx *c = (attn_ctx *)vctx;
    int i = item / c->Hkv, h = item % c->Hkv;
    int G = c->Hq / c->Hkv;
    int64_t t0 = c->q_start[i], nq = c->nq[i];
    if (nq <= 0) return;
    int64_t maxpos = 0;
    for (int64_t t = t0; t < t0 + nq; t++) if (c->pos[t] > maxpos) maxpos = c->pos[t];
    int L = (int)maxpos + 1;
    const float *vb = c->v + (idx_t)c->key_start[i] * c->svj + (idx_t)h * c->svh;
    float o[RB][NL];
    const float *xr[RB];
    float *outp[RB];
    float lsum[RB];
    for (int d0 = 0; d0 < c->Dv; d0 += NL) {
        int nv = c->Dv - d0 < NL ? c->Dv - d0 : NL;
        /* channels d0 .. d0 + 15 as lanes; the reduction runs over keys j < pos + 1 */
        pack_tile(vb, 1, c->svj, d0, c->Dv, L, wp);
        int64_t off = c->s_start[i];
        for (int64_t t = t0; t < t0 + nq; t++) {
            int len = (int)c->pos[t] + 1;
            int nr = 0;
            for (int hq = 0; hq < c->Hq; hq++, off += len) {
                if (hq / G != h) continue;
                xr[nr] = c->sbuf + off;
                outp[nr] = c->out + (idx_t)t * c->sot + (idx_t)hq * c->soh + d0;
                lsum[nr] = tree1(c->sbuf + off, len);
                if (++nr == RB) {
                    tree_rows(nr, xr, wp, len, o);
                    for (int r = 0; r < nr; r++)
                        for (int l = 0; l < nv; l++) outp[r][l] = o[r][l] / lsum[r];
                    nr = 0;
                }
            }
            if (nr) {
                tree_rows(nr, xr, wp, len, o);
                for (int r = 0; r < nr; r++)
                    for (int l = 0; l < nv; l++) outp[r][l] = o[r][l] / lsum[r];
            }
        }
    }
}

static int attn_phase(int phase, int nseq, int Hq, int Hkv, int D, int Dv, const int64_t *q_start, const int64_t *nq,
                      const int64_t *key_start, const int64_t *pos, const int64_t *s_start, const float *q, idx_t sqt,
                      idx_t sqh, const float *k, idx_t skj, idx_t skh, const float *v, idx_t svj, idx_t svh,
                      float *sbuf, float *out, idx_t sot, idx_t soh, float scale, int max_keys, int nthreads)
{
    if (nseq <= 0 || Hkv <= 0 || Hq % Hkv) return nseq <= 0 ? 0 : 2;
    attn_ctx c = {nseq, Hq, Hkv, D, Dv, q_start, nq, key_start, pos, s_start, q, sqt, sqh, k, skj, skh,
                  v, svj, svh, sbuf, out, sot, soh, scale, max_keys};
    int maxdim = D > max_keys ? D : max_keys;
    return run_items(phase == 0 ? scores_item : pv_item, &c, nseq * Hkv, (size_t)(maxdim > 0 ? maxdim : 1) * NL,
                     nthreads);
}

/* Phase 1: sbuf rows = fp32 scores tree_d(q * k) * scale minus the row max (causal keys only). */
int rz_attn_scores(int nseq, int Hq, int Hkv, int D, const int64_t *q_start, const int64_t *nq,
                   const int64_t *key_start, const int64_t *pos, const int64_t *s_start, const float *q, idx_t sqt,
                   idx_t sqh, const float *k, idx_t skj, idx_t skh, float *sbuf, float scale, int max_keys,
                   int nthreads)
{
    return attn_phase(0, nseq, Hq, Hkv, D, 0, q_start, nq, key_start, pos, s_start, q, sqt, sqh, k, skj, skh,
                      NULL, 0, 0, sbuf, NULL, 0, 0, scale, max_keys, nthreads);
}

/* Phase 2 (after sbuf = exp(sbuf)): out = tree_j(e_j * v_j) / tree_j(e_j). */
int rz_attn_pv(int nseq, int Hq, int Hkv, int Dv, const int64_t *q_start, const int64_t *nq,
               const int64_t *key_start, const int64_t *pos, const int64_t *s_start, const float *v, idx_t svj,
               idx_t svh, const float *sbuf, float *out, idx_t sot, idx_t soh, int max_keys, int nthreads)
{
    return attn_phase(1, nseq, Hq, Hkv, 0, Dv, q_start, nq, key_start, pos, s_start, NULL, 0, 0, NULL, 0, 0,
                      v, svj, svh, (float *)sbuf, out, sot, soh, 1.0f, max_keys, nthreads);
}

/* Row sums: out[m] = tree over k < n of x[m * sxm + k]. */
int rz_tree_rows(int M, int n, const float *x, idx_t sxm, float *out)
{
    for (int m = 0; m < M; m++) out[m] = tree1(x + (idx_t)m * sxm, n);
    return 0;
}

int rz_abi_version(void) { return 1; }
