/*
 * CRC-32C (Castagnoli, reflected polynomial 0x82F63B78) of KV records, called from Python via ctypes.
 *
 * One call checks a whole read batch without the GIL, so verification runs beside the model's compute
 * instead of taking turns with it.  x86-64 uses the SSE4.2 crc32 instruction when the CPU has it,
 * aarch64 the ARMv8 CRC32C instruction when the compiler targets it; elsewhere a slice-by-8 table.
 * Values chain like zlib's crc32 and the `crc32c` package: crc(b, crc(a)) == crc(a + b).
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#if defined(__aarch64__) && defined(__ARM_FEATURE_CRC32)
#include <arm_acle.h>
#endif

static uint32_t table[8][256];
static int table_ready;

static void build_table(void) {
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++) c = (c >> 1) ^ (0x82F63B78u & (0u - (c & 1u)));
        table[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; i++)
        for (int t = 1; t < 8; t++) table[t][i] = (table[t - 1][i] >> 8) ^ table[0][table[t - 1][i] & 0xFF];
    table_ready = 1;
}

static uint32_t crc_table(uint32_t c, const uint8_t *p, size_t n) {
    if (!table_ready) build_table();
    while (n >= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        w ^= c;
        c = table[7][w & 0xFF] ^ table[6][(w >> 8) & 0xFF] ^ table[5][(w >> 16) & 0xFF] ^ table[4][(w >> 24) & 0xFF] ^
            table[3][(w >> 32) & 0xFF] ^ table[2][(w >> 40) & 0xFF] ^ table[1][(w >> 48) & 0xFF] ^ table[0][w >> 56];
        p += 8;
        n -= 8;
    }
    while (n--) c = (c >> 8) ^ table[0][(c ^ *p++) & 0xFF];
    return c;
}

#if defined(__x86_64__)
#define HW_TARGET __attribute__((target("sse4.2")))
#define CRC_WORD(c, w) ((uint32_t)__builtin_ia32_crc32di((c), (w)))
#define CRC_BYTE(c, b) __builtin_ia32_crc32qi((c), (b))
static int has_hw(void) { return __builtin_cpu_supports("sse4.2"); }
#elif defined(__aarch64__) && defined(__ARM_FEATURE_CRC32)
#define HW_TARGET
#define CRC_WORD(c, w) __crc32cd((c), (w))
#define CRC_BYTE(c, b) __crc32cb((c), (b))
static int has_hw(void) { return 1; }
#endif

#ifdef CRC_WORD
/* 8 bytes per instruction, then the tail byte by byte: one loop, the instructions named per architecture above */
HW_TARGET static uint32_t crc_hw(uint32_t c, const uint8_t *p, size_t n) {
    while (n >= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        c = CRC_WORD(c, w);
        p += 8;
        n -= 8;
    }
    while (n--) c = CRC_BYTE(c, *p++);
    return c;
}

/* LANES records at once, each its own chain: one record's chain waits out the instruction's latency (3 cycles on
 * x86-64 for 8 bytes), so interleaving independent records keeps the unit busy every cycle (four named chains:
 * an array indexed in a loop stays in memory at -O2).  c: the chains after the seeds; p: the payloads, n bytes each. */
#define LANES 4
HW_TARGET static void crc_hw_lanes(uint32_t *c, const uint8_t *const *p, size_t n) {
    uint32_t c0 = c[0], c1 = c[1], c2 = c[2], c3 = c[3];
    size_t w = 0;
    for (; w + 8 <= n; w += 8) {
        uint64_t x0, x1, x2, x3;
        memcpy(&x0, p[0] + w, 8);
        memcpy(&x1, p[1] + w, 8);
        memcpy(&x2, p[2] + w, 8);
        memcpy(&x3, p[3] + w, 8);
        c0 = CRC_WORD(c0, x0);
        c1 = CRC_WORD(c1, x1);
        c2 = CRC_WORD(c2, x2);
        c3 = CRC_WORD(c3, x3);
    }
    c[0] = crc_hw(c0, p[0] + w, n - w);
    c[1] = crc_hw(c1, p[1] + w, n - w);
    c[2] = crc_hw(c2, p[2] + w, n - w);
    c[3] = crc_hw(c3, p[3] + w, n - w);
}
#else
static uint32_t crc_hw(uint32_t c, const uint8_t *p, size_t n) { return crc_table(c, p, n); }
static int has_hw(void) { return 0; }
#endif

const char *ekv_crc32c_impl(void) { return has_hw() ? "hardware" : "table"; }

uint32_t ekv_crc32c(uint32_t crc, const void *data, size_t n) {
    uint32_t c = ~crc;
    c = has_hw() ? crc_hw(c, data, n) : crc_table(c, data, n);
    return ~c;
}

/* out[i] = crc32c(seeds[i] as 8 little-endian bytes, then the nbytes at addresses[i]): a record's checksum
 * bound to its (layer, group), so a record read from another one's place fails too. */
void ekv_record_sums(int64_t n, const int64_t *addresses, int64_t nbytes, const uint64_t *seeds, uint32_t *out) {
    int64_t i = 0;
#ifdef CRC_WORD
    for (; has_hw() && i + LANES <= n; i += LANES) {
        uint32_t c[LANES];
        const uint8_t *p[LANES];
        for (int l = 0; l < LANES; l++) {
            uint8_t seed[8];
            for (int b = 0; b < 8; b++) seed[b] = (uint8_t)(seeds[i + l] >> (8 * b));
            c[l] = crc_hw(~0u, seed, 8);
            p[l] = (const uint8_t *)(intptr_t)addresses[i + l];
        }
        crc_hw_lanes(c, p, (size_t)nbytes);
        for (int l = 0; l < LANES; l++) out[i + l] = ~c[l];
    }
#endif
    for (; i < n; i++) {
        uint8_t seed[8];
        for (int b = 0; b < 8; b++) seed[b] = (uint8_t)(seeds[i] >> (8 * b));
        out[i] = ekv_crc32c(ekv_crc32c(0, seed, 8), (const void *)(intptr_t)addresses[i], (size_t)nbytes);
    }
}
