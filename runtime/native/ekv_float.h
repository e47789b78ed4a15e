/* Float helpers the native kernels share (ekv_score.c, ekv_attend.c, ekv_qattn.c): bfloat16 widening, a dot
 * product, an e^x the compiler vectorises, and a vector of floats.  A change here rebuilds every library that includes it (runtime/native_build.py hashes its headers). */
#ifndef EKV_FLOAT_H
#define EKV_FLOAT_H

#include <math.h>
#include <stdint.h>
#include <string.h>

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

static inline float bf16_to_float(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
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

#endif
