/* Fused fake quantization of the 4- and 8-bit block formats (see formats.py and native.py): one pass over a
 * block computes its scale, rounds its values into the format and writes them back dequantized, where the torch
 * path (which this file reproduces bit for bit, and which the tests compare with torchao) takes a dozen passes.
 *
 * e2m1 codes: sign in bit 3; below 1 the values are subnormal (steps of 0.5), rounded to nearest even by a float
 * addition of 2^22; from 1 on the float32 mantissa is rounded to one bit, to nearest even, with the exponent
 * rebiased from 127 to 1; 6 and above saturate. e4m3 (finite, "fn") values are rounded the same way to three
 * mantissa bits, to multiples of 2^-9 below 2^-6. ISO C (-std=c99) keeps every operation a single rounding.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

int64_t qcore_usable_threads(int64_t threads, int64_t most); /* _stats.c */

#define MAX_PARTS 64

static inline uint32_t bits_of(float value) {
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    return bits;
}

static inline float float_of(uint32_t bits) {
    float value;
    memcpy(&value, &bits, sizeof value);
    return value;
}

/* the e2m1 code of x; written without branches, so that the compiler vectorizes the loops that call it */
static inline uint32_t e2m1_code(float x) {
    uint32_t bits = bits_of(x), sign = bits & 0x80000000u;
    float magnitude = float_of(bits ^ sign);
    uint32_t subnormal = bits_of(magnitude + 4194304.0f) - (149u << 23);
    uint32_t normal = (bits ^ sign) + (uint32_t)(-(126 << 23)) + 2097151u + (((bits ^ sign) >> 22) & 1u);
    uint32_t code = magnitude < 1.0f ? subnormal : normal >> 22;
    code = magnitude >= 6.0f ? 7u : code;
    return (code & 7u) | ((sign >> 28) & 8u); /* a NaN's code, too, is below 8 after the byte cast */
}

/* the value of an e2m1 code, built from its bits: 0.5 * mantissa below 1, else (1 + mantissa / 2) * 2^(e - 1) */
static inline float e2m1_value(uint32_t code) {
    uint32_t exponent = (code >> 1) & 3u, mantissa = code & 1u;
    uint32_t bits = exponent ? ((exponent + 126u) << 23) | (mantissa << 22) : (mantissa ? 0x3F000000u : 0u);
    return float_of(bits | ((code & 8u) << 28));
}

/* x rounded to float8_e4m3fn and back, for |x| <= 448 or NaN (without branches, as e2m1_code) */
static inline float e4m3_round(float x) {
    uint32_t bits = bits_of(x), sign = bits & 0x80000000u, magnitude_bits = bits ^ sign;
    float magnitude = float_of(magnitude_bits);
    float subnormal = (magnitude + 16384.0f) - 16384.0f; /* below 2^-6: multiples of 2^-9 */
    float normal = float_of((magnitude_bits + 0x7FFFFu + ((magnitude_bits >> 20) & 1u)) & 0xFFF00000u);
    float rounded = magnitude < 0.015625f ? subnormal : normal;
    return magnitude != magnitude ? x : float_of(bits_of(rounded) | sign);
}

/* amax of a block, and whether it holds a NaN (torch.amax is then NaN) */
static inline float block_amax(const float *v, int64_t n, int *nan) {
    float amax = 0.0f;
    int seen = 0;
    for (int64_t i = 0; i < n; ++i) {
        float a = fabsf(v[i]);
        seen |= a != a;
        amax = a > amax ? a : amax;
    }
    *nan = seen;
    return amax;
}

/* MX, FLOOR: per block of `block` values along rows, exponent floor(log2 amax) - emax (e8m0), elements e2m1
 * (kind 4) or e4m3 (kind 8) */
void qcore_fake_quantize_mx(const float *x, float *out, int64_t blocks, int64_t block, int64_t kind,
                            int64_t threads) {
    int emax = kind == 4 ? 2 : 8;
    threads = qcore_usable_threads(threads, MAX_PARTS);
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
    for (int64_t b = 0; b < blocks; ++b) {
        const float *v = x + b * block;
        float *o = out + b * block;
        int nan;
        float amax = block_amax(v, block, &nan);
        int32_t exponent = (int32_t)((bits_of(amax) >> 23) & 0xFFu) - 127 - emax;
        exponent = exponent < -127 ? -127 : exponent > 128 ? 128 : exponent;
        uint32_t biased = nan ? 255u : (uint32_t)(exponent + 127);
        float divisor = float_of(biased << 23);
        if (divisor < 1.17549435e-38f) divisor = 1.17549435e-38f;
        float scale = biased == 255u ? NAN : ldexpf(1.0f, (int)biased - 127);
        if (kind == 4)
            for (int64_t i = 0; i < block; ++i) o[i] = e2m1_value(e2m1_code(v[i] / divisor)) * scale;
        else
            for (int64_t i = 0; i < block; ++i) {
                float scaled = v[i] / divisor;
                scaled = scaled < -448.0f ? -448.0f : scaled; /* a NaN fails both tests and stays NaN */
                scaled = scaled > 448.0f ? 448.0f : scaled;
                o[i] = e4m3_round(scaled) * scale;
            }
    }
}

/* NVFP4: per block of 16, scale = e4m3(clamp(amax / 6 / global, 2^-6, 448)); elements e2m1 of
 * x * ((1 / global) / scale), saturated at 6; back as e2m1 value * (global * scale) */
void qcore_fake_quantize_nvfp4(const float *x, float *out, int64_t blocks, float global, int64_t threads) {
    threads = qcore_usable_threads(threads, MAX_PARTS);
    float inverse_global = 1.0f / global;
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
    for (int64_t b = 0; b < blocks; ++b) {
        const float *v = x + b * 16;
        float *o = out + b * 16;
        int nan;
        float amax = block_amax(v, 16, &nan);
        float relative = nan ? NAN : amax / 6.0f / global;
        if (relative == relative) relative = relative < 0.015625f ? 0.015625f : relative > 448.0f ? 448.0f : relative;
        float scale = e4m3_round(relative);
        float reciprocal = inverse_global / scale, dequant = global * scale;
        for (int i = 0; i < 16; ++i) {
            float scaled = v[i] * reciprocal;
            scaled = scaled < -6.0f ? -6.0f : scaled; /* a NaN fails both tests and stays NaN */
            scaled = scaled > 6.0f ? 6.0f : scaled;
            o[i] = e2m1_value(e2m1_code(scaled)) * dequant;
        }
    }
}
