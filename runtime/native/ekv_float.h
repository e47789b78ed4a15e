/* Float helpers the native kernels share (ekv_score.c, ekv_attend.c, ekv_qattn.c): bfloat16 and float16 widening,
 * int8 / int4 codes widened (runtime/quant.py's formats), a dot product, an e^x the compiler vectorises, and a vector
 * of floats.  A change here rebuilds every library that includes it (runtime/native_build.py hashes its headers). */
#ifndef EKV_FLOAT_H
#define EKV_FLOAT_H

#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__F16C__)
#include <immintrin.h>
#endif

/* CHUNK floats as one vector register of the target (GCC and Clang vector extensions), so loops over an array of
 * them with constant bounds keep it in registers.  Never wider than the target's registers: GCC splits a wider
 * vector badly (64-byte vectors built for AVX2 scored 13x slower than this scorer's plain loops). */
#if defined(__AVX512F__)
enum { CHUNK = 16 };
#elif defined(__AVX__)
enum { CHUNK = 8 };
#else
enum { CHUNK = 4 }; /* SSE, NEON (a Jetson's) */
#endif
typedef float vfloat __attribute__((vector_size(CHUNK * sizeof(float))));

typedef int32_t vint __attribute__((vector_size(CHUNK * sizeof(int32_t))));

/* The largest of x[0..n) and `start`, four vectors of CHUNK lanes at a time: the plain loop `top = x > top ? x : top`
 * is not vectorised without -ffinite-math-only (which the libraries never take), and ran one compare a float, each
 * waiting on the last (SmolLM2 8K, 9 queries: about half of the scorer's time once its dot products took the int8
 * instruction).  Exact, as any order of a maximum is. */
static inline float max_of(const float *x, int64_t n, float start) {
    vfloat best[4];
    for (int a = 0; a < 4; a++)
        for (int c = 0; c < CHUNK; c++) best[a][c] = start;
    int64_t i = 0;
    for (; i + 4 * CHUNK <= n; i += 4 * CHUNK)
        for (int a = 0; a < 4; a++) { /* four chains: a compare and a blend wait on the last */
            vfloat v;
            memcpy(&v, x + i + a * CHUNK, sizeof v);
            vint larger = v > best[a];
            best[a] = (vfloat)((larger & (vint)v) | (~larger & (vint)best[a]));
        }
    float top = start;
    for (int a = 0; a < 4; a++)
        for (int c = 0; c < CHUNK; c++) top = best[a][c] > top ? best[a][c] : top;
    for (; i < n; i++) top = x[i] > top ? x[i] : top;
    return top;
}

static inline float bf16_to_float(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* a float16's bits as float (the codes' scales and zeros): the conversion instruction where the target has it (F16C),
 * else from the bits (no compiler's half type needed); every float16 is a float, so the two give the same value */
static inline float half_to_float(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exponent = (h >> 10) & 31, mantissa = h & 1023, bits;
    if (exponent == 31) {
        bits = sign | 0x7f800000u | (mantissa << 13);
    } else if (exponent) {
        bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
    } else { /* zero or subnormal: mantissa * 2^-24, exact in float */
        float f = (float)mantissa * 5.9604644775390625e-8f;
        return sign ? -f : f;
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
#endif
}

/* n float16s as floats, eight an instruction where the target converts them (a record's per-channel scales;
 * SmolLM2 8K, 205 int4 records a call, the records' attention 100 -> 96 us with the scalar conversion on F16C too) */
static inline void halves_to_floats(float *restrict out, const uint16_t *restrict in, int n) {
    int i = 0;
#if defined(__F16C__)
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(in + i))));
#endif
    for (; i < n; i++) out[i] = half_to_float(in[i]);
}

/* d codes of `bits` (8, or 4: two a byte, the even index in the low nibble) as float, unscaled */
static inline void widen_codes(float *restrict out, const uint8_t *restrict codes, int d, int bits) {
    if (bits == 8) {
        for (int i = 0; i < d; i++) out[i] = (float)codes[i];
    } else {
        for (int i = 0; i < d / 2; i++) {
            out[2 * i] = (float)(codes[i] & 15);
            out[2 * i + 1] = (float)(codes[i] >> 4);
        }
    }
}

/* a . b over d floats (vectorised where reassociation is allowed, as the libraries build) */
static inline float dot(const float *restrict a, const float *restrict b, int d) {
    float acc = 0.0f;
    for (int i = 0; i < d; i++) acc += a[i] * b[i];
    return acc;
}

/* e^x for x <= 0, within 1.3 ulp of the exact value for every float in [-87, 0]: x = n ln2 + r with |r| <= ln2 / 2
 * (ln2 split in two so n ln2 is exact), e^r by its Taylor series to r^7 / 7!, times 2^n built in the exponent bits.
 * Below -87 (e^x < 2^-125, nothing beside the row's maximum, whose term is 1) it returns e^-87, not a subnormal. */
static inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    float n = rintf(x * 1.44269504088896341f);
    float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
    float p = 1.0f + r * (1.0f + r * (0.5f + r * (1.0f / 6 + r * (1.0f / 24 + r * (1.0f / 120 + r * (1.0f / 720
              + r * (1.0f / 5040)))))));
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

/* A decode attention's three passes over a block of rows, shared by the kernels that attend (ekv_attend.c's records,
 * ekv_dense.c's in-memory caches); always inlined, so a caller's constant d unrolls them. */

/* s[t] = scaling * (q . keys[t]) for `rows` rows d apart; returns the largest of them and `best` */
static inline __attribute__((always_inline)) float scores_of(const float *restrict q, const float *restrict keys,
                                                             int rows, int d, float scaling, float *restrict s,
                                                             float best) {
    for (int t = 0; t < rows; t++) {
        s[t] = scaling * dot(q, keys + t * d, d);
        best = s[t] > best ? s[t] : best;
    }
    return best;
}

/* s[t] = e^(s[t] - top) in place; returns their sum */
static inline __attribute__((always_inline)) float exponentials(float *restrict s, int64_t n, float top) {
    float sum = 0.0f;
    for (int64_t t = 0; t < n; t++) {
        s[t] = exp_nonpositive(s[t] - top);
        sum += s[t];
    }
    return sum;
}

/* o[0..d) += w[t] * values[t] over `rows` rows d apart (d at most 256): the output in registers over the block,
 * d / CHUNK independent chains (one chain waited on its own adds: 61 -> 50 us a call in cache, ekv_attend.c) */
static inline __attribute__((always_inline)) void weigh_values(float *restrict o, const float *restrict w,
                                                               const float *restrict values, int rows, int d) {
    if (d % CHUNK) {
        for (int t = 0; t < rows; t++)
            for (int j = 0; j < d; j++) o[j] += w[t] * values[t * d + j];
        return;
    }
    vfloat acc[256 / CHUNK];
    for (int c = 0; c < d / CHUNK; c++) memcpy(&acc[c], o + c * CHUNK, sizeof(vfloat));
    for (int t = 0; t < rows; t++)
        for (int c = 0; c < d / CHUNK; c++) {
            vfloat row;
            memcpy(&row, values + t * d + c * CHUNK, sizeof row);
            acc[c] += w[t] * row;
        }
    for (int c = 0; c < d / CHUNK; c++) memcpy(o + c * CHUNK, &acc[c], sizeof(vfloat));
}

#endif
