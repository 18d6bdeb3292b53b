/* The sampler's attention on a CPU (cpu_attention.py builds and loads it): a decode step's
   (agentrl_decode_attention) and a prefill's, M new tokens at once (agentrl_prefill_attention).

   A decode step, per (row, KV head): the G query heads of the KV head (GQA folded: K and V are
   read once for all G) over the row's unmasked keys. Two passes over memory: the scores of every
   unmasked key (K read once), then the softmax and the weighted sum of V (V read once); masked
   keys are never read. SDPA's CPU kernel runs these G-row products as small GEMMs over blocks of
   512 keys and spends most of its time outside memory traffic (~16 GB/s fp32, ~8 GB/s bf16 on the
   2-core workplace CPU, whose reads run at ~29 GB/s).

   A prefill is compute: see the second half of this file.

   Numbers are fp32 throughout (bf16 inputs are widened, the output rounded to nearest even); a
   row with no unmasked key gets zeros, as SDPA's CPU kernels give. Threads: OpenMP over the
   (row, head) tasks, built against the libgomp torch loaded (the same soname), so the kernel runs
   on torch's own thread team: a second runtime's threads would contend with torch's, which spin
   a while after each op (measured: 0.91 -> 1.81 ms a call after a matmul). */

#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define HAVE_DPBF16 1
#endif

enum { MAX_G = 16, MAX_D = 256 };

/* the call's shape and strides, in elements; the last dimension of q, k, v, mask and out is
   contiguous */
typedef struct {
    int64_t B, H, G, D, L;
    int64_t qsb, qsh, qsg;
    int64_t ksb, ksh, ksl;
    int64_t vsb, vsh, vsl;
    int64_t msb;
    int64_t osb, osh, osg;
} shape_t;

typedef struct {
    const shape_t *s;
    const void *q, *k, *v;
    const uint8_t *mask;
    void *out;
    float scale;
    int bf16;
} job_t;

#ifdef HAVE_DPBF16
/* the sums of four vectors' lanes, [sum a, sum b, sum c, sum d]: one tree for the four (13
   instructions) instead of four reductions (~32) */
static inline __m128 reduce4(__m512 a, __m512 b, __m512 c, __m512 d) {
#define HALVES(x) _mm256_add_ps(_mm512_castps512_ps256(x), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)))
    __m256 ab = _mm256_hadd_ps(HALVES(a), HALVES(b)); /* [a01 a23 b01 b23 | a45 a67 b45 b67] */
    __m256 cd = _mm256_hadd_ps(HALVES(c), HALVES(d));
#undef HALVES
    __m256 abcd = _mm256_hadd_ps(ab, cd); /* [a0-3 b0-3 c0-3 d0-3 | a4-7 b4-7 c4-7 d4-7] */
    return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}
#endif

static inline float bf16_to_f32(uint16_t x) {
    union { uint32_t u; float f; } c;
    c.u = (uint32_t)x << 16;
    return c.f;
}

static inline uint16_t f32_to_bf16(float f) {
    union { uint32_t u; float f; } c;
    c.f = f;
    if ((c.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((c.u >> 16) | 0x40u); /* NaN stays NaN */
    return (uint16_t)((c.u + 0x7fffu + ((c.u >> 16) & 1u)) >> 16);
}

static inline void load_row(const void *base, int64_t offset, int64_t D, int bf16, float *dst) {
    if (bf16) {
        const uint16_t *p = (const uint16_t *)base + offset;
        for (int64_t d = 0; d < D; d++) dst[d] = bf16_to_f32(p[d]);
    } else {
        memcpy(dst, (const float *)base + offset, (size_t)D * sizeof(float));
    }
}

#ifdef __AVX512F__
/* pass 2 for a head size of 64 and GN (1-4) query heads: acc[x] = sum over the n keys of
   p[x * L + t] * V[keys[t]], the 4 x GN accumulators in registers (GN and BF16 are constants at
   every call) */
static inline __attribute__((always_inline)) void pass2_d64(const job_t *j, int64_t b, int64_t h, int64_t L,
                                                            int64_t n, const float *p, const int32_t *keys,
                                                            float (*acc)[MAX_D], const int GN, const int BF16) {
    const shape_t *s = j->s;
    __m512 a[4][4];
    for (int x = 0; x < GN; x++)
        for (int c = 0; c < 4; c++) a[x][c] = _mm512_setzero_ps();
    for (int64_t t = 0; t < n; t++) {
        __m512 v[4];
        const int64_t off = b * s->vsb + h * s->vsh + keys[t] * s->vsl;
        if (BF16) {
            const uint16_t *vt = (const uint16_t *)j->v + off;
            for (int c = 0; c < 4; c++)
                v[c] = _mm512_castsi512_ps(
                    _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(vt + 16 * c))), 16));
        } else {
            const float *vt = (const float *)j->v + off;
            for (int c = 0; c < 4; c++) v[c] = _mm512_loadu_ps(vt + 16 * c);
        }
        for (int x = 0; x < GN; x++) {
            const __m512 w = _mm512_set1_ps(p[x * L + t]);
            for (int c = 0; c < 4; c++) a[x][c] = _mm512_fmadd_ps(w, v[c], a[x][c]);
        }
    }
    for (int x = 0; x < GN; x++)
        for (int c = 0; c < 4; c++) _mm512_storeu_ps(acc[x] + 16 * c, a[x][c]);
}
#endif

/* one (row, KV head); D_ is a compile-time head size where the model's is common (so the
   products unroll into whole vectors), else the runtime one */
static inline __attribute__((always_inline)) void task_d(const job_t *j, int64_t b, int64_t h, float *scores,
                                                         int32_t *keys, const int64_t D_) {
    const shape_t *s = j->s;
    const int64_t G = s->G, D = D_, L = s->L;
    float q[MAX_G][MAX_D], acc[MAX_G][MAX_D], row[MAX_D];
    float top[MAX_G], total[MAX_G];

    for (int64_t g = 0; g < G; g++) {
        load_row(j->q, b * s->qsb + h * s->qsh + g * s->qsg, D, j->bf16, q[g]);
        for (int64_t d = 0; d < D; d++) q[g][d] *= j->scale;
        top[g] = -FLT_MAX;
    }
    /* pass 1: the scores of the unmasked keys, stored compactly [G][n] */
    const uint8_t *m = j->mask + b * s->msb;
    int64_t n = 0;
    for (int64_t l = 0; l < L; l++)
        if (m[l]) keys[n++] = (int32_t)l;
#ifdef HAVE_DPBF16
    /* bf16 with AVX512-BF16 and a head size of whole vectors: bf16 pairs multiplied into fp32
       sums (the query in bf16 as given, the scale applied to the sum) */
    if (j->bf16 && D % 32 == 0) {
        __m512i qb[MAX_G][MAX_D / 32];
        for (int64_t g = 0; g < G; g++) {
            const uint16_t *qg = (const uint16_t *)j->q + b * s->qsb + h * s->qsh + g * s->qsg;
            for (int64_t c = 0; c < D / 32; c++) qb[g][c] = _mm512_loadu_si512(qg + 32 * c);
        }
        /* four keys at a time: their four sums per query head reduced together (reduce4) */
        const __m128 scale4 = _mm_set1_ps(j->scale);
        int64_t t = 0;
        for (; t + 4 <= n; t += 4) {
            __m512i kc[4][MAX_D / 32];
            for (int r = 0; r < 4; r++) {
                const uint16_t *kt = (const uint16_t *)j->k + b * s->ksb + h * s->ksh + keys[t + r] * s->ksl;
                for (int64_t c = 0; c < D / 32; c++) kc[r][c] = _mm512_loadu_si512(kt + 32 * c);
            }
            for (int64_t g = 0; g < G; g++) {
                __m512 sum[4];
                for (int r = 0; r < 4; r++) {
                    sum[r] = _mm512_setzero_ps();
                    for (int64_t c = 0; c < D / 32; c++)
                        sum[r] = _mm512_dpbf16_ps(sum[r], (__m512bh)qb[g][c], (__m512bh)kc[r][c]);
                }
                __m128 dots = _mm_mul_ps(reduce4(sum[0], sum[1], sum[2], sum[3]), scale4);
                _mm_storeu_ps(scores + g * L + t, dots);
                float d4[4];
                _mm_storeu_ps(d4, dots);
                for (int r = 0; r < 4; r++)
                    if (d4[r] > top[g]) top[g] = d4[r];
            }
        }
        for (; t < n; t++) {
            const uint16_t *kt = (const uint16_t *)j->k + b * s->ksb + h * s->ksh + keys[t] * s->ksl;
            __m512i kc[MAX_D / 32];
            for (int64_t c = 0; c < D / 32; c++) kc[c] = _mm512_loadu_si512(kt + 32 * c);
            for (int64_t g = 0; g < G; g++) {
                __m512 sum = _mm512_setzero_ps();
                for (int64_t c = 0; c < D / 32; c++) sum = _mm512_dpbf16_ps(sum, (__m512bh)qb[g][c], (__m512bh)kc[c]);
                float dot = _mm512_reduce_add_ps(sum) * j->scale;
                scores[g * L + t] = dot;
                if (dot > top[g]) top[g] = dot;
            }
        }
    } else
#endif
    for (int64_t t = 0; t < n; t++) {
        load_row(j->k, b * s->ksb + h * s->ksh + keys[t] * s->ksl, D, j->bf16, row);
        for (int64_t g = 0; g < G; g++) {
            float dot = 0.0f;
            for (int64_t d = 0; d < D; d++) dot += q[g][d] * row[d];
            scores[g * L + t] = dot;
            if (dot > top[g]) top[g] = dot;
        }
    }
    /* the softmax's numerators and sums */
    for (int64_t g = 0; g < G; g++) {
        float *sg = scores + g * L, mg = top[g], sum = 0.0f;
        for (int64_t t = 0; t < n; t++) {
            sg[t] = expf(sg[t] - mg);
            sum += sg[t];
        }
        total[g] = sum;
        memset(acc[g], 0, (size_t)D * sizeof(float));
    }
    /* pass 2: the weighted sum of V */
#ifdef __AVX512F__
    if (D == 64) {
        for (int64_t g0 = 0; g0 < G; g0 += 4) {
            const int64_t gn = G - g0 < 4 ? G - g0 : 4;
            float (*a)[MAX_D] = acc + g0;
            const float *p = scores + g0 * L;
            switch (gn * 2 + (j->bf16 != 0)) { /* constants, so the accumulators live in registers */
            case 2: pass2_d64(j, b, h, L, n, p, keys, a, 1, 0); break;
            case 3: pass2_d64(j, b, h, L, n, p, keys, a, 1, 1); break;
            case 4: pass2_d64(j, b, h, L, n, p, keys, a, 2, 0); break;
            case 5: pass2_d64(j, b, h, L, n, p, keys, a, 2, 1); break;
            case 6: pass2_d64(j, b, h, L, n, p, keys, a, 3, 0); break;
            case 7: pass2_d64(j, b, h, L, n, p, keys, a, 3, 1); break;
            case 8: pass2_d64(j, b, h, L, n, p, keys, a, 4, 0); break;
            default: pass2_d64(j, b, h, L, n, p, keys, a, 4, 1); break;
            }
        }
    } else
#endif
    for (int64_t t = 0; t < n; t++) {
        load_row(j->v, b * s->vsb + h * s->vsh + keys[t] * s->vsl, D, j->bf16, row);
        for (int64_t g = 0; g < G; g++) {
            float p = scores[g * L + t];
            for (int64_t d = 0; d < D; d++) acc[g][d] += p * row[d];
        }
    }
    for (int64_t g = 0; g < G; g++) {
        float inv = n ? 1.0f / total[g] : 0.0f;
        int64_t o = b * s->osb + h * s->osh + g * s->osg;
        if (j->bf16) {
            uint16_t *out = (uint16_t *)j->out + o;
            for (int64_t d = 0; d < D; d++) out[d] = f32_to_bf16(acc[g][d] * inv);
        } else {
            float *out = (float *)j->out + o;
            for (int64_t d = 0; d < D; d++) out[d] = acc[g][d] * inv;
        }
    }
}

static void task(const job_t *j, int64_t b, int64_t h, float *scores, int32_t *keys) {
    switch (j->s->D) {
    case 64: task_d(j, b, h, scores, keys, 64); break;
    case 128: task_d(j, b, h, scores, keys, 128); break;
    default: task_d(j, b, h, scores, keys, j->s->D);
    }
}

/* Returns 0 on success; 1 for a shape the kernel does not take (G > 16 or D > 256), 2 when
   memory could not be had (the caller then runs SDPA). */
int agentrl_decode_attention(const int64_t *shape, const void *q, const void *k, const void *v,
                             const uint8_t *mask, void *out, float scale, int bf16, int nthreads) {
    const shape_t *s = (const shape_t *)shape;
    if (s->G > MAX_G || s->D > MAX_D || s->G < 1 || s->D < 1) return 1;
    const int64_t tasks = s->B * s->H;
    if (nthreads < 1) nthreads = 1;
    if (nthreads > tasks) nthreads = (int)tasks;
    const job_t job = {s, q, k, v, mask, out, scale, bf16};
    int failed = 0;
#pragma omp parallel num_threads(nthreads) if (nthreads > 1)
    {
        float *scores = (float *)malloc((size_t)(s->G * s->L) * sizeof(float) + 64);
        int32_t *keys = (int32_t *)malloc((size_t)s->L * sizeof(int32_t) + 64);
        const int ok = scores && keys;
        if (!ok) {
#pragma omp atomic write
            failed = 1;
        }
        /* dynamic: rows of different lengths balance */
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < tasks; t++)
            if (ok) task(&job, t / s->H, t % s->H, scores, keys);
        free(scores);
        free(keys);
    }
    return failed ? 2 : 0;
}


/* ------------------------------------------------------------------------------------------------
   A prefill: M new tokens of each row attend over the row's keys, the store's boolean mask saying
   which (pads, the causal order, other turns' holes). Compute, not memory: SDPA's CPU flash kernel
   runs it at ~100 GFLOP/s in bf16 (less than in fp32) on the 2-core workplace CPU, whose bf16
   matmuls run at ~300-370.

   Per (row, KV head), K is packed once into blocks of 16 keys laid out for 16 keys' scores in one
   vector (bf16: [D/2][16] pairs for AVX512-BF16's pair products; fp32: [D][16]) and V into rows
   (bf16: key pairs interleaved, [D][2]); then per tile of 16 query positions x G query heads:
   1. which blocks of 16 keys any of the tile's rows may see (a block every row masks is skipped);
   2. the scores of each such block (16 keys a vector, the rows' queries broadcast), masked keys
      set to -1e30, the scale applied to the fp32 sums;
   3. per row the softmax's numerators exp(s - max) and their fp32 sum (bf16: the numerators
      rounded to bf16 for the products with V, as SDPA's CPU kernel does);
   4. the weighted sum of V over the visible blocks, 4 (D 64) or 8 (D 128) accumulators a row in
      registers, divided by the sum; a row with no visible key gets zeros.
   The packed K and V of at most PACK_BYTES are held at once ((row, head) pairs in chunks); each
   thread keeps its scratch (the tile's scores) between calls, grown as needed. */

#ifdef __AVX512F__

enum { KB = 16, TM = 16, MAX_ROWS = TM * MAX_G };
#define NEG_SCORE (-1e30f) /* a masked key's score: exp underflows to 0 (no infinities under -ffast-math) */
#define PACK_BYTES ((int64_t)32 << 20)

typedef struct {
    int64_t B, H, G, M, D, L;
    int64_t qsb, qsh, qsm;       /* q [B, H * G, M, D] */
    int64_t ksb, ksh, ksl;       /* k, v [B, H, L, D] */
    int64_t vsb, vsh, vsl;
    int64_t msb, msm;            /* mask [B, M, L] */
    int64_t osb, osm, osh;       /* out [B, M, H * G, D] */
} pshape_t;

typedef struct {
    const pshape_t *s;
    const void *q, *k, *v;
    const uint8_t *mask;
    void *out;
    float scale;
    int64_t nblk;
    float *lse; /* [B, H * G, M]: each query's log-sum-exp of its scaled scores (the learner's forward), or NULL */
} pjob_t;

/* the mask bits of the 16 keys from `start` (keys past L masked) */
static inline __mmask16 mask16(const uint8_t *row, int64_t start, int64_t L) {
    if (start + KB <= L) return _mm_test_epi8_mask(_mm_loadu_si128((const __m128i *)(row + start)), _mm_set1_epi8(1));
    __mmask16 m = 0;
    for (int64_t t = start; t < L; t++)
        if (row[t]) m |= (__mmask16)(1u << (t - start));
    return m;
}

/* elements of one (row, head)'s packed K, and as many of its packed V */
static inline int64_t packed_elems(const pshape_t *s, int64_t nblk) { return nblk * KB * s->D; }

/* a 16 x 16 transpose of 32-bit units in registers: r[i] lane x <- r[x] lane i */
static inline void transpose16(__m512i *r) {
    __m512i t[16], u[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    /* u[4i + j], 128-bit lane k: column 4k + j of rows 4i .. 4i + 3 */
    for (int i = 0; i < 4; i++) {
        u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    /* the 4 x 4 transpose of 128-bit lanes: column 4k + j = lane k of u[j], u[4 + j], u[8 + j], u[12 + j] */
    for (int j = 0; j < 4; j++) {
        const __m512i v0 = _mm512_shuffle_i32x4(u[j], u[4 + j], 0x44), v1 = _mm512_shuffle_i32x4(u[j], u[4 + j], 0xEE);
        const __m512i v2 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0x44);
        const __m512i v3 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0xEE);
        r[j] = _mm512_shuffle_i32x4(v0, v2, 0x88);
        r[4 + j] = _mm512_shuffle_i32x4(v0, v2, 0xDD);
        r[8 + j] = _mm512_shuffle_i32x4(v1, v3, 0x88);
        r[12 + j] = _mm512_shuffle_i32x4(v1, v3, 0xDD);
    }
}

/* rows [L, D] of one (b, h) of a tensor (its base at `src`, row stride `sl`) packed as keys: blocks
   [D/2][16] (bf16 pairs as 32-bit units) or [D][16] (fp32), rows past L zero */
static void pack_keys(const void *src, int64_t sl, int64_t D, int64_t L, int64_t nblk, void *dst_, int BF16) {
    const int64_t U = BF16 ? D / 2 : D; /* 32-bit units of a row: a multiple of 16 (D is 64 or 128) */
    uint32_t *kd = (uint32_t *)dst_;
    for (int64_t blk = 0; blk < nblk; blk++) {
        const uint32_t *row[KB];
        for (int64_t x = 0; x < KB; x++) {
            const int64_t l = blk * KB + x;
            row[x] = l >= L ? NULL
                     : BF16 ? (const uint32_t *)((const uint16_t *)src + l * sl)
                            : (const uint32_t *)((const float *)src + l * sl);
        }
        for (int64_t c = 0; c < U; c += 16) {
            __m512i r[KB];
            for (int x = 0; x < KB; x++) r[x] = row[x] ? _mm512_loadu_si512(row[x] + c) : _mm512_setzero_si512();
            transpose16(r);
            for (int i = 0; i < 16; i++) _mm512_storeu_si512(kd + (blk * U + c + i) * KB, r[i]);
        }
    }
}

/* the same rows packed as values: [16 * nblk / 2][D][2] (bf16, pairs of rows interleaved) or
   [16 * nblk][D] (fp32), rows past L zero */
static void pack_values(const void *src, int64_t sl, int64_t D, int64_t L, int64_t nblk, void *dst_, int BF16) {
    if (BF16) {
        /* lane d of each 32-bit unit = (v[l][d], v[l + 1][d]) */
        const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6,
                                            37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
        const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
        const uint16_t *v = (const uint16_t *)src;
        uint16_t *vd = (uint16_t *)dst_;
        for (int64_t l = 0; l < nblk * KB; l += 2) {
            uint16_t *dst = vd + l * D;
            for (int64_t c = 0; c < D; c += 32) {
                const __m512i a = l < L ? _mm512_loadu_si512(v + l * sl + c) : _mm512_setzero_si512();
                const __m512i n = l + 1 < L ? _mm512_loadu_si512(v + (l + 1) * sl + c) : _mm512_setzero_si512();
                _mm512_storeu_si512(dst + 2 * c, _mm512_permutex2var_epi16(a, lo, n));
                _mm512_storeu_si512(dst + 2 * c + 32, _mm512_permutex2var_epi16(a, hi, n));
            }
        }
    } else {
        const float *v = (const float *)src;
        float *vd = (float *)dst_;
        for (int64_t l = 0; l < nblk * KB; l++) {
            if (l < L)
                memcpy(vd + l * D, v + l * sl, (size_t)D * sizeof(float));
            else
                memset(vd + l * D, 0, (size_t)D * sizeof(float));
        }
    }
}

static inline const void *at(const void *base, int64_t off, int BF16) {
    return BF16 ? (const void *)((const uint16_t *)base + off) : (const void *)((const float *)base + off);
}

/* K of (b, h) as keys, V as values */
static void pack(const pjob_t *j, int64_t b, int64_t h, void *kp, void *vp, int BF16) {
    const pshape_t *s = j->s;
    pack_keys(at(j->k, b * s->ksb + h * s->ksh, BF16), s->ksl, s->D, s->L, j->nblk, kp, BF16);
    pack_values(at(j->v, b * s->vsb + h * s->vsh, BF16), s->vsl, s->D, s->L, j->nblk, vp, BF16);
}

/* the scores of N rows (a constant) against one block of 16 keys: acc[x] lane t = q_x . k_t */
static inline __attribute__((always_inline)) void block_scores(const uint32_t *kb, const uint32_t *const *q, int64_t U,
                                                               __m512 *acc, const int N, const int BF16) {
    for (int x = 0; x < N; x++) acc[x] = _mm512_setzero_ps();
    for (int64_t i = 0; i < U; i++) {
        const __m512i kv = _mm512_loadu_si512(kb + i * KB);
        for (int x = 0; x < N; x++) {
#ifdef HAVE_DPBF16
            if (BF16) {
                acc[x] = _mm512_dpbf16_ps(acc[x], (__m512bh)kv, (__m512bh)_mm512_set1_epi32((int)q[x][i]));
                continue;
            }
#endif
            acc[x] = _mm512_fmadd_ps(_mm512_castsi512_ps(kv), _mm512_castsi512_ps(_mm512_set1_epi32((int)q[x][i])),
                                     acc[x]);
        }
    }
}

/* out[x] = sum over the visible blocks of p_x . V, N rows and D = 16 C (constants); p rows are
   bf16 (pairs, 32-bit units) or fp32 */
static inline __attribute__((always_inline)) void rows_times_v(const void *vp, const int32_t *active, int64_t nact,
                                                               const uint32_t *const *p, float (*out)[MAX_D],
                                                               const int N, const int C, const int BF16) {
    __m512 acc[6][8];
    for (int x = 0; x < N; x++)
        for (int c = 0; c < C; c++) acc[x][c] = _mm512_setzero_ps();
    for (int64_t a = 0; a < nact; a++) {
        const int64_t key0 = (int64_t)active[a] * KB;
#ifdef HAVE_DPBF16
        if (BF16) {
            const uint16_t *vb = (const uint16_t *)vp + key0 * 16 * C;
            for (int jp = 0; jp < KB / 2; jp++) {
                __m512i vv[8];
                for (int c = 0; c < C; c++) vv[c] = _mm512_loadu_si512(vb + jp * 32 * C + 32 * c);
                for (int x = 0; x < N; x++) {
                    const __m512i w = _mm512_set1_epi32((int)p[x][a * (KB / 2) + jp]);
                    for (int c = 0; c < C; c++) acc[x][c] = _mm512_dpbf16_ps(acc[x][c], (__m512bh)vv[c], (__m512bh)w);
                }
            }
            continue;
        }
#endif
        const float *vb = (const float *)vp + key0 * 16 * C;
        for (int t = 0; t < KB; t++) {
            __m512 vv[8];
            for (int c = 0; c < C; c++) vv[c] = _mm512_loadu_ps(vb + t * 16 * C + 16 * c);
            for (int x = 0; x < N; x++) {
                const __m512 w = _mm512_set1_ps(((const float *)p[x])[a * KB + t]);
                for (int c = 0; c < C; c++) acc[x][c] = _mm512_fmadd_ps(w, vv[c], acc[x][c]);
            }
        }
    }
    for (int x = 0; x < N; x++)
        for (int c = 0; c < C; c++) _mm512_storeu_ps(out[x] + 16 * c, acc[x][c]);
}

/* a thread's scratch, kept between calls (grown, never shrunk): a tile's scores [rows][width],
   its numerators in bf16, the visible blocks */
typedef struct {
    float *scores;
    uint16_t *probs;
    int32_t *active;
    size_t cap, blocks;
} scratch_t;

static __thread scratch_t scratch;

static int reserve(int64_t rows, int64_t nblk) {
    const size_t need = (size_t)rows * (size_t)(nblk * KB + 32);
    if (need > scratch.cap || (size_t)nblk > scratch.blocks) {
        free(scratch.scores);
        free(scratch.probs);
        free(scratch.active);
        scratch.scores = (float *)malloc(need * sizeof(float));
        scratch.probs = (uint16_t *)malloc(need * sizeof(uint16_t));
        scratch.active = (int32_t *)malloc((size_t)nblk * sizeof(int32_t));
        const int ok = scratch.scores && scratch.probs && scratch.active;
        scratch.cap = ok ? need : 0;
        scratch.blocks = ok ? (size_t)nblk : 0;
        return ok;
    }
    return 1;
}

#define ROWS_CASES(F, ...) \
    switch (n) {           \
    case 8: F(8, __VA_ARGS__); break; \
    case 7: F(7, __VA_ARGS__); break; \
    case 6: F(6, __VA_ARGS__); break; \
    case 5: F(5, __VA_ARGS__); break; \
    case 4: F(4, __VA_ARGS__); break; \
    case 3: F(3, __VA_ARGS__); break; \
    case 2: F(2, __VA_ARGS__); break; \
    default: F(1, __VA_ARGS__);       \
    }

/* the blocks of 16 keys some of a tile's rows (`mrow`, tm of them) sees, into `active`; their count */
static int64_t visible_blocks(const uint8_t *const *mrow, int64_t tm, int64_t nblk, int64_t L, int32_t *active) {
    int64_t nact = 0;
    for (int64_t blk = 0; blk < nblk; blk++) {
        __mmask16 any = 0;
        for (int64_t i = 0; i < tm && !any; i++) any = mask16(mrow[i], blk * KB, L);
        if (any) active[nact++] = (int32_t)blk;
    }
    return nact;
}

/* a row of weights (W written, the row Wp wide) as bf16 pairs for AVX512-BF16's products: zeros
   past W, then 32 at a time */
static inline void bf16_row(float *src, int64_t W, int64_t Wp, uint16_t *dst) {
    for (int64_t x = W; x < Wp; x++) src[x] = 0.0f;
#ifdef HAVE_DPBF16
    for (int64_t x = 0; x < Wp; x += 32)
        _mm512_storeu_si512(dst + x, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(src + x + 16), _mm512_loadu_ps(src + x)));
#else
    (void)dst;
#endif
}

/* rows_times_v for n rows (6 at most for D 64, 3 for D 128: ROWS_PER), their count a constant */
#define ROWS_PER(C) ((C) == 4 ? 6 : 3)
static inline __attribute__((always_inline)) void rows_times_v_n(const void *vp, const int32_t *active, int64_t nact,
                                                                 const uint32_t *const *p, float (*acc)[MAX_D],
                                                                 int64_t n, const int C, const int BF16) {
    if (C == 4) {
#define PV4(N, ...) rows_times_v(vp, active, nact, p, acc, (N) < 6 ? (N) : 6, 4, BF16)
        ROWS_CASES(PV4, 0)
#undef PV4
    } else {
#define PV8(N, ...) rows_times_v(vp, active, nact, p, acc, (N) < 3 ? (N) : 3, 8, BF16)
        ROWS_CASES(PV8, 0)
#undef PV8
    }
}

/* D sums times `factor` into a row of the output's dtype */
static inline void write_row(void *base, int64_t off, const float *sums, int64_t D, float factor, int BF16) {
    if (BF16) {
        uint16_t *o = (uint16_t *)base + off;
        for (int64_t d = 0; d < D; d++) o[d] = f32_to_bf16(sums[d] * factor);
    } else {
        float *o = (float *)base + off;
        for (int64_t d = 0; d < D; d++) o[d] = sums[d] * factor;
    }
}

/* one tile: query positions m0 .. m0 + 15 of (b, h), each with its G query heads; 0 when the
   thread's scratch could not be had */
static inline __attribute__((always_inline)) int tile(const pjob_t *j, const void *kp, const void *vp, int64_t b,
                                                      int64_t h, int64_t m0, const int BF16) {
    const pshape_t *s = j->s;
    const int64_t G = s->G, D = s->D, L = s->L, nblk = j->nblk;
    const int64_t U = BF16 ? D / 2 : D;
    const int64_t tm = s->M - m0 < TM ? s->M - m0 : TM, R = tm * G;
    if (!reserve(R, nblk)) return 0;
    const uint8_t *mrow[TM];
    for (int64_t i = 0; i < tm; i++) mrow[i] = j->mask + b * s->msb + (m0 + i) * s->msm;
    /* 1. the blocks some row of the tile sees */
    const int64_t nact = visible_blocks(mrow, tm, nblk, L, scratch.active);
    const uint32_t *q[MAX_ROWS]; /* row r = (position r / G, query head h * G + r % G) */
    for (int64_t r = 0; r < R; r++) {
        const int64_t off = b * s->qsb + (h * G + r % G) * s->qsh + (m0 + r / G) * s->qsm;
        q[r] = BF16 ? (const uint32_t *)((const uint16_t *)j->q + off) : (const uint32_t *)((const float *)j->q + off);
    }
    /* 2. the scores, rows' stride W rounded to 32 (bf16 numerators convert 32 at a time) */
    const int64_t W = nact * KB, Wp = (W + 31) / 32 * 32;
    float top[MAX_ROWS];
    const __m512 neg = _mm512_set1_ps(NEG_SCORE), scale = _mm512_set1_ps(j->scale);
    for (int64_t r0 = 0; r0 < R; r0 += 8) {
        const int64_t n = R - r0 < 8 ? R - r0 : 8;
        __m512 best[8];
        for (int64_t x = 0; x < n; x++) best[x] = neg;
        for (int64_t a = 0; a < nact; a++) {
            const int64_t blk = scratch.active[a];
            const uint32_t *kb = (const uint32_t *)kp + blk * U * KB;
            __m512 acc[8];
#define SCORES(N, ...) block_scores(kb, q + r0, U, acc, N, BF16)
            ROWS_CASES(SCORES, 0)
#undef SCORES
            for (int64_t x = 0; x < n; x++) {
                const __mmask16 seen = mask16(mrow[(r0 + x) / G], blk * KB, L);
                const __m512 sv = _mm512_mask_mul_ps(neg, seen, acc[x], scale);
                _mm512_storeu_ps(scratch.scores + (r0 + x) * Wp + a * KB, sv);
                best[x] = _mm512_max_ps(best[x], sv);
            }
        }
        for (int64_t x = 0; x < n; x++) top[r0 + x] = _mm512_reduce_max_ps(best[x]);
    }
    /* 3. the numerators and their sums */
    float total[MAX_ROWS];
    for (int64_t r = 0; r < R; r++) {
        float *sr = scratch.scores + r * Wp, sum = 0.0f;
        const float mx = top[r];
        if (mx > 0.5f * NEG_SCORE) {
            for (int64_t x = 0; x < W; x++) {
                sr[x] = expf(sr[x] - mx);
                sum += sr[x];
            }
        } else { /* no visible key */
            memset(sr, 0, (size_t)W * sizeof(float));
        }
        total[r] = sum;
        if (j->lse)
            j->lse[(b * s->H * G + h * G + r % G) * s->M + m0 + r / G] = mx > 0.5f * NEG_SCORE ? mx + logf(sum) : NEG_SCORE;
        if (BF16) bf16_row(sr, W, Wp, scratch.probs + r * Wp);
    }
    /* 4. the weighted sums of V */
    float acc[6][MAX_D];
    const uint32_t *p[6];
    const int C = (int)(D / 16);
    for (int64_t r0 = 0; r0 < R; r0 += ROWS_PER(C)) {
        const int64_t n = R - r0 < ROWS_PER(C) ? R - r0 : ROWS_PER(C);
        for (int64_t x = 0; x < n; x++)
            p[x] = BF16 ? (const uint32_t *)(scratch.probs + (r0 + x) * Wp) : (const uint32_t *)(scratch.scores + (r0 + x) * Wp);
        rows_times_v_n(vp, scratch.active, nact, p, acc, n, C, BF16);
        for (int64_t x = 0; x < n; x++) {
            const int64_t r = r0 + x;
            write_row(j->out, b * s->osb + (m0 + r / G) * s->osm + (h * G + r % G) * s->osh, acc[x], D,
                      total[r] > 0.0f ? 1.0f / total[r] : 0.0f, BF16);
        }
    }
    return 1;
}

static int tile_any(const pjob_t *j, const void *kp, const void *vp, int64_t b, int64_t h, int64_t m0, int bf16) {
    return bf16 ? tile(j, kp, vp, b, h, m0, 1) : tile(j, kp, vp, b, h, m0, 0);
}

#endif /* __AVX512F__ */

/* Whether this build runs a prefill of this dtype at all (AVX-512; bf16: also AVX512-BF16). */
int agentrl_prefill_supported(int bf16) {
#if defined(__AVX512F__) && defined(HAVE_DPBF16)
    (void)bf16;
    return 1;
#elif defined(__AVX512F__)
    return !bf16;
#else
    (void)bf16;
    return 0;
#endif
}

/* Returns 0 on success; 1 for what the kernel does not take (no AVX-512, bf16 without
   AVX512-BF16, a head size other than 64 or 128, G > 16), 2 when memory could not be had (the
   caller then runs SDPA). */
static int attention_forward(const int64_t *shape, const void *q, const void *k, const void *v, const uint8_t *mask,
                             void *out, float *lse, float scale, int bf16, int nthreads) {
#ifndef __AVX512F__
    (void)shape, (void)q, (void)k, (void)v, (void)mask, (void)out, (void)lse, (void)scale, (void)bf16, (void)nthreads;
    return 1;
#else
    const pshape_t *s = (const pshape_t *)shape;
#ifndef HAVE_DPBF16
    if (bf16) return 1;
#endif
    if ((s->D != 64 && s->D != 128) || s->G < 1 || s->G > MAX_G || s->L < 1) return 1;
    if (s->B < 1 || s->M < 1) return 0;
    const pjob_t job = {s, q, k, v, mask, out, scale, (s->L + KB - 1) / KB, lse};
    const int64_t elem = bf16 ? 2 : 4, per = packed_elems(s, job.nblk), bh = s->B * s->H;
    /* (row, head) pairs packed at once: PACK_BYTES of K and V, at least one pair */
    int64_t chunk = PACK_BYTES / (2 * per * elem);
    if (chunk < 1) chunk = 1;
    if (chunk > bh) chunk = bh;
    static __thread char *packed = NULL;
    static __thread size_t packed_cap = 0;
    const size_t need = (size_t)(2 * chunk * per * elem);
    if (need > packed_cap) {
        free(packed);
        packed = (char *)malloc(need);
        packed_cap = packed ? need : 0;
        if (!packed) return 2;
    }
    char *const kbase = packed, *const vbase = packed + chunk * per * elem;
    const int64_t tiles = (s->M + TM - 1) / TM;
    if (nthreads < 1) nthreads = 1;
    int failed = 0;
#pragma omp parallel num_threads(nthreads) if (nthreads > 1)
    for (int64_t c0 = 0; c0 < bh; c0 += chunk) {
        const int64_t cn = bh - c0 < chunk ? bh - c0 : chunk;
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < cn; t++)
            pack(&job, (c0 + t) / s->H, (c0 + t) % s->H, kbase + t * per * elem, vbase + t * per * elem, bf16);
        /* dynamic: tiles of rows of different lengths balance */
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < cn * tiles; t++) {
            const int64_t x = t / tiles;
            if (!tile_any(&job, kbase + x * per * elem, vbase + x * per * elem, (c0 + x) / s->H, (c0 + x) % s->H,
                          (t % tiles) * TM, bf16)) {
#pragma omp atomic write
                failed = 1;
            }
        }
    }
    return failed ? 2 : 0;
#endif
}

int agentrl_prefill_attention(const int64_t *shape, const void *q, const void *k, const void *v,
                              const uint8_t *mask, void *out, float scale, int bf16, int nthreads) {
    return attention_forward(shape, q, k, v, mask, out, NULL, scale, bf16, nthreads);
}

/* The learner's forward: the prefill's attention of every query, and each query's log-sum-exp of its
   scaled scores into lse [B, H * G, M] (-1e30 where it sees no key), which its backward reads. */
int agentrl_attention_forward(const int64_t *shape, const void *q, const void *k, const void *v,
                              const uint8_t *mask, void *out, float *lse, float scale, int bf16, int nthreads) {
    return attention_forward(shape, q, k, v, mask, out, lse, scale, bf16, nthreads);
}

/* ------------------------------------------------------------------------------------------------
   The learner's backward: dQ, dK, dV of the forward above, from its output O, the output's
   gradient dO and each query's log-sum-exp. Per tile of 16 query positions x G heads (the
   forward's), over the blocks of 16 keys the tile sees:
   1. P = exp(S - lse), S recomputed as in the forward (masked keys 0);
   2. dP = dO . V (V packed as keys, the rows of dO as queries), dS = P * (dP - rowsum(dO * O));
   3. dQ = scale * dS . K (K packed as values; bf16: dS rounded to bf16 pairs, as the numerators are
      in the forward);
   4. dV += P^T dO and dK += dS^T Q, in fp32, into the task's own accumulators.
   A (row, KV head)'s tiles are split between two tasks (every other tile: the causal triangle's
   long and short tiles alike), each with its own dK, dV sums, added at the end: no two threads
   write one sum, so a result does not depend on the thread count. */

#ifdef __AVX512F__

typedef struct {
    const pshape_t *s;  /* q, k, v, mask as in the forward; out, dout and dq [B, M, H * G, D] at out's strides */
    const void *q, *out, *dout;
    const uint8_t *mask;
    const float *lse;
    void *dq;
    const char *kpk, *vpk, *kpv; /* per (b, h): K as keys, V as keys, K as values */
    int64_t per, elem, nblk;
    float scale;
} bjob_t;

typedef struct {
    float *p, *ds, *rows; /* [R][width] P and dS; [2][R][D] the tile's Q and dO rows in fp32 */
    uint16_t *pb;         /* dS in bf16 */
    int32_t *active;
    size_t cap, blocks, rows_cap;
} bscratch_t;

static __thread bscratch_t bscratch;

static int breserve(int64_t R, int64_t nblk, int64_t D) {
    const size_t need = (size_t)R * (size_t)(nblk * KB + 32), rows = (size_t)(2 * R * D);
    if (need <= bscratch.cap && (size_t)nblk <= bscratch.blocks && rows <= bscratch.rows_cap) return 1;
    free(bscratch.p), free(bscratch.ds), free(bscratch.rows), free(bscratch.pb), free(bscratch.active);
    bscratch.p = (float *)malloc(need * sizeof(float));
    bscratch.ds = (float *)malloc(need * sizeof(float));
    bscratch.pb = (uint16_t *)malloc(need * sizeof(uint16_t));
    bscratch.rows = (float *)malloc(rows * sizeof(float));
    bscratch.active = (int32_t *)malloc((size_t)nblk * sizeof(int32_t));
    const int ok = bscratch.p && bscratch.ds && bscratch.pb && bscratch.rows && bscratch.active;
    bscratch.cap = ok ? need : 0;
    bscratch.blocks = ok ? (size_t)nblk : 0;
    bscratch.rows_cap = ok ? rows : 0;
    return ok;
}

static inline float elem_at(const void *base, int64_t off, int BF16) {
    return BF16 ? bf16_to_f32(((const uint16_t *)base)[off]) : ((const float *)base)[off];
}

/* dV[key0 + t] += sum_r P[r][a * 16 + t] dO_r, dK likewise with dS and Q, for the 16 keys of one
   visible block; KS keys at a time, D = 16 C (constants) */
static inline __attribute__((always_inline)) void block_grads(const float *p, const float *ds, int64_t Wp, int64_t R,
                                                              const float *rq, const float *rdo, int64_t a,
                                                              float *dk, float *dv, const int C, const int KS) {
    const int64_t D = 16 * C;
    for (int t0 = 0; t0 < KB; t0 += KS) {
        __m512 av[2][8], ak[2][8];
        for (int x = 0; x < KS; x++)
            for (int c = 0; c < C; c++) av[x][c] = ak[x][c] = _mm512_setzero_ps();
        for (int64_t r = 0; r < R; r++) {
            const float *pr = p + r * Wp + a * KB + t0, *dr = ds + r * Wp + a * KB + t0;
            __m512 wp[2], wd[2];
            for (int x = 0; x < KS; x++) wp[x] = _mm512_set1_ps(pr[x]), wd[x] = _mm512_set1_ps(dr[x]);
            for (int c = 0; c < C; c++) {
                const __m512 o = _mm512_loadu_ps(rdo + r * D + 16 * c), qv = _mm512_loadu_ps(rq + r * D + 16 * c);
                for (int x = 0; x < KS; x++) {
                    av[x][c] = _mm512_fmadd_ps(wp[x], o, av[x][c]);
                    ak[x][c] = _mm512_fmadd_ps(wd[x], qv, ak[x][c]);
                }
            }
        }
        for (int x = 0; x < KS; x++)
            for (int c = 0; c < C; c++) {
                float *v = dv + (t0 + x) * D + 16 * c, *k = dk + (t0 + x) * D + 16 * c;
                _mm512_storeu_ps(v, _mm512_add_ps(_mm512_loadu_ps(v), av[x][c]));
                _mm512_storeu_ps(k, _mm512_add_ps(_mm512_loadu_ps(k), ak[x][c]));
            }
    }
}

/* one tile's gradients (see above); dk, dv: the task's sums [nblk * 16][D]; 0 when the thread's
   scratch could not be had */
static inline __attribute__((always_inline)) int btile(const bjob_t *j, int64_t b, int64_t h, int64_t m0, float *dk,
                                                       float *dv, const int BF16) {
    const pshape_t *s = j->s;
    const int64_t G = s->G, D = s->D, L = s->L, nblk = j->nblk, U = BF16 ? D / 2 : D;
    const int64_t tm = s->M - m0 < TM ? s->M - m0 : TM, R = tm * G;
    if (!breserve(R, nblk, D)) return 0;
    const int64_t x0 = (b * s->H + h) * j->per * j->elem;
    const char *kk = j->kpk + x0, *vk = j->vpk + x0, *kv = j->kpv + x0;
    const uint8_t *mrow[TM];
    for (int64_t i = 0; i < tm; i++) mrow[i] = j->mask + b * s->msb + (m0 + i) * s->msm;
    const int64_t nact = visible_blocks(mrow, tm, nblk, L, bscratch.active);
    const uint32_t *q[MAX_ROWS], *dout[MAX_ROWS];
    int64_t orow[MAX_ROWS]; /* each row's offset in out, dout and dq */
    float lse[MAX_ROWS], delta[MAX_ROWS];
    float *rq = bscratch.rows, *rdo = bscratch.rows + R * D;
    for (int64_t r = 0; r < R; r++) {
        const int64_t head = h * G + r % G, m = m0 + r / G;
        q[r] = (const uint32_t *)at(j->q, b * s->qsb + head * s->qsh + m * s->qsm, BF16);
        orow[r] = b * s->osb + m * s->osm + head * s->osh;
        dout[r] = (const uint32_t *)at(j->dout, orow[r], BF16);
        lse[r] = j->lse[(b * s->H * G + head) * s->M + m];
        float dl = 0.0f;
        for (int64_t d = 0; d < D; d++) {
            const float o = elem_at(j->out, orow[r] + d, BF16), g = elem_at(j->dout, orow[r] + d, BF16);
            dl += o * g;
            rdo[r * D + d] = g;
            rq[r * D + d] = elem_at(j->q, b * s->qsb + head * s->qsh + m * s->qsm + d, BF16);
        }
        delta[r] = dl;
    }
    const int64_t W = nact * KB, Wp = (W + 31) / 32 * 32;
    float *P = bscratch.p, *DS = bscratch.ds;
    const __m512 neg = _mm512_set1_ps(NEG_SCORE), scale = _mm512_set1_ps(j->scale);
    /* 1, 2: the scores (scaled, masked) into P, dP into DS */
    for (int64_t r0 = 0; r0 < R; r0 += 8) {
        const int64_t n = R - r0 < 8 ? R - r0 : 8;
        for (int64_t a = 0; a < nact; a++) {
            const int64_t blk = bscratch.active[a];
            __m512 acc[8];
            const uint32_t *kb = (const uint32_t *)kk + blk * U * KB, *vb = (const uint32_t *)vk + blk * U * KB;
#define SCORES(N, ...) block_scores(kb, q + r0, U, acc, N, BF16)
            ROWS_CASES(SCORES, 0)
#undef SCORES
            for (int64_t x = 0; x < n; x++) {
                const __mmask16 seen = mask16(mrow[(r0 + x) / G], blk * KB, L);
                _mm512_storeu_ps(P + (r0 + x) * Wp + a * KB, _mm512_mask_mul_ps(neg, seen, acc[x], scale));
            }
#define DPS(N, ...) block_scores(vb, dout + r0, U, acc, N, BF16)
            ROWS_CASES(DPS, 0)
#undef DPS
            for (int64_t x = 0; x < n; x++) _mm512_storeu_ps(DS + (r0 + x) * Wp + a * KB, acc[x]);
        }
    }
    for (int64_t r = 0; r < R; r++) {
        float *pr = P + r * Wp, *dr = DS + r * Wp;
        const float l = lse[r], dl = delta[r];
        if (l > 0.5f * NEG_SCORE) {
            for (int64_t x = 0; x < W; x++) {
                pr[x] = expf(pr[x] - l);
                dr[x] = pr[x] * (dr[x] - dl);
            }
        } else { /* a query that sees no key: no gradient */
            memset(pr, 0, (size_t)W * sizeof(float));
            memset(dr, 0, (size_t)W * sizeof(float));
        }
        for (int64_t x = W; x < Wp; x++) pr[x] = dr[x] = 0.0f;
        if (BF16) bf16_row(dr, W, Wp, bscratch.pb + r * Wp);
    }
    /* 3. dQ = scale * dS . K */
    float acc[6][MAX_D];
    const uint32_t *p[6];
    const int C = (int)(D / 16);
    for (int64_t r0 = 0; r0 < R; r0 += ROWS_PER(C)) {
        const int64_t n = R - r0 < ROWS_PER(C) ? R - r0 : ROWS_PER(C);
        for (int64_t x = 0; x < n; x++)
            p[x] = BF16 ? (const uint32_t *)(bscratch.pb + (r0 + x) * Wp) : (const uint32_t *)(DS + (r0 + x) * Wp);
        rows_times_v_n(kv, bscratch.active, nact, p, acc, n, C, BF16);
        for (int64_t x = 0; x < n; x++) write_row(j->dq, orow[r0 + x], acc[x], D, j->scale, BF16);
    }
    /* 4. dV += P^T dO, dK += dS^T Q (scaled when the tasks' sums are added) */
    for (int64_t a = 0; a < nact; a++) {
        const int64_t key0 = (int64_t)bscratch.active[a] * KB;
        if (C == 4)
            block_grads(P, DS, Wp, R, rq, rdo, a, dk + key0 * D, dv + key0 * D, 4, 2);
        else
            block_grads(P, DS, Wp, R, rq, rdo, a, dk + key0 * D, dv + key0 * D, 8, 1);
    }
    return 1;
}

static int btile_any(const bjob_t *j, int64_t b, int64_t h, int64_t m0, float *dk, float *dv, int bf16) {
    return bf16 ? btile(j, b, h, m0, dk, dv, 1) : btile(j, b, h, m0, dk, dv, 0);
}

#endif /* __AVX512F__ */

/* dq [B, M, H * G, D] (out's strides), dk and dv [B, H, L, D] contiguous, in the inputs' dtype.
   Returns 0 on success, 1 for what the kernel does not take (as the forward), 2 when memory could
   not be had. */
int agentrl_attention_backward(const int64_t *shape, const void *q, const void *k, const void *v, const uint8_t *mask,
                               const void *out, const void *dout, const float *lse, void *dq, void *dk, void *dv,
                               float scale, int bf16, int nthreads) {
#ifndef __AVX512F__
    (void)shape, (void)q, (void)k, (void)v, (void)mask, (void)out, (void)dout, (void)lse, (void)dq, (void)dk, (void)dv;
    (void)scale, (void)bf16, (void)nthreads;
    return 1;
#else
    const pshape_t *s = (const pshape_t *)shape;
#ifndef HAVE_DPBF16
    if (bf16) return 1;
#endif
    if ((s->D != 64 && s->D != 128) || s->G < 1 || s->G > MAX_G || s->L < 1) return 1;
    if (s->B < 1 || s->M < 1) return 0;
    const int64_t nblk = (s->L + KB - 1) / KB, elem = bf16 ? 2 : 4, per = packed_elems(s, nblk), bh = s->B * s->H;
    const int64_t tiles = (s->M + TM - 1) / TM, parts = tiles > 1 ? 2 : 1, rows = nblk * KB * s->D;
    char *packed = (char *)malloc((size_t)(3 * bh * per * elem));
    float *sums = (float *)malloc((size_t)(bh * parts * 2 * rows) * sizeof(float));
    if (!packed || !sums) {
        free(packed), free(sums);
        return 2;
    }
    const bjob_t job = {s, q, out, dout, mask, lse, dq, packed, packed + bh * per * elem, packed + 2 * bh * per * elem,
                        per, elem, nblk, scale};
    if (nthreads < 1) nthreads = 1;
    int failed = 0;
#pragma omp parallel num_threads(nthreads) if (nthreads > 1)
    {
#pragma omp for schedule(dynamic, 1)
        for (int64_t x = 0; x < bh; x++) {
            const int64_t b = x / s->H, h = x % s->H;
            const void *kx = at(k, b * s->ksb + h * s->ksh, bf16), *vx = at(v, b * s->vsb + h * s->vsh, bf16);
            pack_keys(kx, s->ksl, s->D, s->L, nblk, (char *)job.kpk + x * per * elem, bf16);
            pack_keys(vx, s->vsl, s->D, s->L, nblk, (char *)job.vpk + x * per * elem, bf16);
            pack_values(kx, s->ksl, s->D, s->L, nblk, (char *)job.kpv + x * per * elem, bf16);
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < bh * parts; t++) {
            const int64_t x = t / parts, part = t % parts;
            float *dks = sums + (x * parts + part) * 2 * rows, *dvs = dks + rows;
            memset(dks, 0, (size_t)(2 * rows) * sizeof(float));
            for (int64_t tile = part; tile < tiles; tile += parts)
                if (!btile_any(&job, x / s->H, x % s->H, tile * TM, dks, dvs, bf16)) {
#pragma omp atomic write
                    failed = 1;
                }
        }
#pragma omp for schedule(static)
        for (int64_t x = 0; x < bh; x++) {
            const float *d0 = sums + x * parts * 2 * rows;
            const int64_t n = s->L * s->D;
            for (int64_t i = 0; i < n; i++) {
                float gk = d0[i], gv = d0[rows + i];
                if (parts == 2) gk += d0[2 * rows + i], gv += d0[3 * rows + i];
                gk *= scale;
                if (bf16) {
                    ((uint16_t *)dk)[x * n + i] = f32_to_bf16(gk);
                    ((uint16_t *)dv)[x * n + i] = f32_to_bf16(gv);
                } else {
                    ((float *)dk)[x * n + i] = gk;
                    ((float *)dv)[x * n + i] = gv;
                }
            }
        }
    }
    free(packed);
    free(sums);
    return failed ? 2 : 0;
#endif
}
