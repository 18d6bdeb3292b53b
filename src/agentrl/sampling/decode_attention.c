/* The sampler's decode-step attention on a CPU (cpu_attention.py builds and loads it).

   One decode step's attention per (row, KV head): the G query heads of the KV head (GQA folded:
   K and V are read once for all G) over the row's unmasked keys. Two passes over memory: the
   scores of every unmasked key (K read once), then the softmax and the weighted sum of V (V read
   once); masked keys are never read. SDPA's CPU kernel runs these G-row products as small GEMMs
   over blocks of 512 keys and spends most of its time outside memory traffic (~16 GB/s fp32,
   ~8 GB/s bf16 on the 2-core workplace CPU, whose reads run at ~29 GB/s).

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
