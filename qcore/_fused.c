/* Fused per-batch kernels of the numeric suite and of fake quantization (see native.py).
 *
 * qcore_compare_sums adds sum(ref^2), sum(act^2), sum(ref*act) and sum((ref-act)^2) of two float32 arrays to
 * four float64 sums: what StreamingComparator's torch path computes with nine ops and two float64 copies.
 * Products of two float32 values are exact in float64; each of LANES accumulators per sum takes every
 * LANES-th value, so the compiler vectorizes the loop without reordering any one accumulator's additions.
 *
 * qcore_fake_quantize_per_tensor writes clamp(round_half_even(x * inv_scale), low, high) * scale + 0.0 in
 * float32, the same roundings as the torch path (qparams.fake_quantize_per_tensor), which this file is
 * compiled to keep: ISO C (-std=c99) does not contract a*b+c into one fused multiply-add.
 *
 * qcore_fake_quantize_per_row does the same per row of a contiguous array, with each row's own scale and
 * bounds (axis-0 per-channel fake quantization of a weight, an integer zero point folded into the bounds:
 * clamp(round(v) + zp, min, max) - zp == clamp(round(v), min - zp, max - zp) for the small ranges it is given).
 *
 * With OpenMP (the runtime torch already loaded), up to `threads` threads take contiguous parts.
 */
#include <math.h>
#include <stdint.h>

#define LANES 8
#define MAX_PARTS 64

int64_t qcore_usable_threads(int64_t threads, int64_t most); /* _stats.c */

static void sums_part(const float *restrict ref, const float *restrict act, int64_t n, double *restrict out) {
    double rr[LANES] = {0}, aa[LANES] = {0}, ra[LANES] = {0}, ee[LANES] = {0};
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int j = 0; j < LANES; ++j) {
            double r = ref[i + j], a = act[i + j], d = r - a;
            rr[j] += r * r;
            aa[j] += a * a;
            ra[j] += r * a;
            ee[j] += d * d;
        }
    for (int j = 0; i < n; ++i, ++j) {
        double r = ref[i], a = act[i], d = r - a;
        rr[j] += r * r;
        aa[j] += a * a;
        ra[j] += r * a;
        ee[j] += d * d;
    }
    out[0] = out[1] = out[2] = out[3] = 0.0;
    for (int j = 0; j < LANES; ++j) {
        out[0] += rr[j];
        out[1] += aa[j];
        out[2] += ra[j];
        out[3] += ee[j];
    }
}

void qcore_compare_sums(const float *ref, const float *act, int64_t n, int64_t threads, double *sums) {
    threads = qcore_usable_threads(threads, MAX_PARTS);
    double parts[MAX_PARTS][4];
#pragma omp parallel for num_threads(threads) if (threads > 1)
    for (int64_t t = 0; t < threads; ++t) {
        int64_t start = n * t / threads, stop = n * (t + 1) / threads;
        sums_part(ref + start, act + start, stop - start, parts[t]);
    }
    for (int64_t t = 0; t < threads; ++t)
        for (int k = 0; k < 4; ++k) sums[k] += parts[t][k];
}

void qcore_fake_quantize_per_tensor(const float *x, float *out, int64_t n, float inv_scale, float scale, float low,
                                    float high, int64_t threads) {
    threads = qcore_usable_threads(threads, MAX_PARTS);
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
    for (int64_t i = 0; i < n; ++i) {
        float v = nearbyintf(x[i] * inv_scale);
        v = v < low ? low : v; /* a NaN fails both tests and stays NaN, as in torch.clamp */
        v = v > high ? high : v;
        out[i] = v * scale + 0.0f;
    }
}

void qcore_fake_quantize_per_row(const float *x, float *out, int64_t rows, int64_t cols, const float *inv_scale,
                                 const float *scale, const float *low, const float *high, int64_t threads) {
    threads = qcore_usable_threads(threads, MAX_PARTS);
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
        const float inv = inv_scale[r], step = scale[r], lo = low[r], hi = high[r];
        const float *row = x + r * cols;
        float *written = out + r * cols;
        for (int64_t i = 0; i < cols; ++i) {
            float v = nearbyintf(row[i] * inv);
            v = v < lo ? lo : v;
            v = v > hi ? hi : v;
            written[i] = v * step + 0.0f;
        }
    }
}
