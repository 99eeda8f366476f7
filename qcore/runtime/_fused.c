/* Fused per-batch kernels of the numeric suite and of fake quantization (see native.py).
 *
 * qcore_compare_sums adds sum(ref^2), sum(act^2), sum(ref*act) and sum((ref-act)^2) of two float32 arrays to
 * four float64 sums: what StreamingComparator's torch path computes with nine ops and two float64 copies.
 * Products of two float32 values are exact in float64; each of LANES accumulators per sum takes every
 * LANES-th value, so the loop runs as vectors without reordering any one accumulator's additions.
 *
 * qcore_compare_sums_by_run adds them for each run of consecutive values (an MoE expert's rows of a grouped
 * projection) to that run's four sums, each run as qcore_compare_sums alone sums it, with the threads the caller
 * would give it alone (one below `parallel_min` values).
 *
 * qcore_fake_quantize_per_tensor writes clamp(round_half_even(x * inv_scale), low, high) * scale + 0.0 in
 * float32, the same roundings as the torch path (qparams.fake_quantize_per_tensor), which this file is
 * compiled to keep: ISO C (-std=c99) does not contract a*b+c into one fused multiply-add.
 *
 * qcore_fake_quantize_per_row does the same per row of a contiguous array, with each row's own scale and
 * bounds (axis-0 per-channel fake quantization of a weight, an integer zero point folded into the bounds:
 * clamp(round(v) + zp, min, max) - zp == clamp(round(v), min - zp, max - zp) for the small ranges it is given).
 *
 * qcore_fake_quantize_by_run does the same with one scale and bounds per run of consecutive rows (an MoE expert's
 * rows of a grouped projection, each run `counts[e]` rows long): the per-row kernel's values with each run's
 * arguments repeated over its rows, without the repeated copies. It returns 1, writing nothing, for counts that
 * are negative or do not add up to `rows`.
 *
 * qcore_histogram_update is HistogramObserver's update of one float32 batch: its range, the old histogram spread
 * over the new range, and the new values' counts, with the roundings of the observer's torch path (observers.py):
 * what takes that path some thirty small torch ops and an int64 copy of the batch.
 *
 * With OpenMP (the runtime torch already loaded), up to `threads` threads take contiguous parts.
 *
 * The per-row kernels write with streaming (non-temporal) stores when asked (`stream`): a weight quantized where it
 * is read goes into a reused buffer that the matmul's threads read next, each its own share, which need not be
 * the share each of these threads wrote. With plain stores, each line another core read last time is fetched back
 * before it is written; when the two cores sit in different core complexes (as a cloud VM's vCPUs can, from one
 * second to the next) that costs five times the kernel. A streamed full line needs no fetch. The values are the
 * same.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__SSE2__)
#include <immintrin.h>
#endif

#define LANES 8
#define TILE 64 /* values a streamed row is computed into, in L1, before they are streamed out: 4 lines */
#define MAX_PARTS 64

int64_t qcore_usable_threads(int64_t threads, int64_t most); /* _stats.c */

#if defined(__has_builtin)
#if __has_builtin(__builtin_convertvector)
#define HAS_LANE_VECTORS 1
/* LANES values as one vector each: the compiler widens LANES floats to LANES doubles with the CPU's packed
 * conversions, in whatever registers it prefers, where its own vectorizer packs the four sums of one value instead
 * and converts and multiplies one value at a time. */
typedef float lane_floats __attribute__((vector_size(LANES * sizeof(float))));
typedef double lane_doubles __attribute__((vector_size(LANES * sizeof(double))));
#endif
#endif

static void sums_part(const float *restrict ref, const float *restrict act, int64_t n, double *restrict out) {
    double rr[LANES] = {0}, aa[LANES] = {0}, ra[LANES] = {0}, ee[LANES] = {0};
    int64_t i = 0;
#if defined(HAS_LANE_VECTORS) && !defined(QCORE_SCALAR_SUMS) /* bench_moe.py --compare-sums builds both */
    /* the same additions into the same accumulators, lane j taking every LANES-th value, so the sums are the
     * scalar loop's to the bit (-std=c99 contracts no multiply-add here either) */
    lane_doubles vrr = {0}, vaa = {0}, vra = {0}, vee = {0};
    for (; i + LANES <= n; i += LANES) {
        lane_floats rf, af;
        memcpy(&rf, ref + i, sizeof rf);
        memcpy(&af, act + i, sizeof af);
        lane_doubles r = __builtin_convertvector(rf, lane_doubles), a = __builtin_convertvector(af, lane_doubles);
        lane_doubles d = r - a;
        vrr += r * r;
        vaa += a * a;
        vra += r * a;
        vee += d * d;
    }
    memcpy(rr, &vrr, sizeof rr);
    memcpy(aa, &vaa, sizeof aa);
    memcpy(ra, &vra, sizeof ra);
    memcpy(ee, &vee, sizeof ee);
#else
    for (; i + LANES <= n; i += LANES)
        for (int j = 0; j < LANES; ++j) {
            double r = ref[i + j], a = act[i + j], d = r - a;
            rr[j] += r * r;
            aa[j] += a * a;
            ra[j] += r * a;
            ee[j] += d * d;
        }
#endif
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

void qcore_compare_sums_by_run(const float *ref, const float *act, const int64_t *lengths, int64_t runs,
                               int64_t threads, int64_t parallel_min, double *sums) {
    int64_t start = 0;
    for (int64_t r = 0; r < runs; ++r) {
        int64_t n = lengths[r];
        if (n > 0) qcore_compare_sums(ref + start, act + start, n, n < parallel_min ? 1 : threads, sums + 4 * r);
        start += n;
    }
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

/* clamp(round_half_even(v * inv), lo, hi) * step + 0.0: one value's fake quantization, the torch path's roundings. */
static inline float fake_quantized(float v, float inv, float step, float lo, float hi) {
    v = nearbyintf(v * inv);
    v = v < lo ? lo : v;
    v = v > hi ? hi : v;
    return v * step + 0.0f;
}

/* n floats of `tile` copied to `out` with streaming stores where the CPU has them (plain stores up to the first
 * aligned address and after the last full vector). */
static void store_streaming(float *out, const float *tile, int64_t n) {
    int64_t i = 0;
#if defined(__SSE2__) /* AVX and AVX-512 builds define it too */
#if defined(__AVX512F__)
    const int64_t width = 16;
#elif defined(__AVX__)
    const int64_t width = 8;
#else
    const int64_t width = 4;
#endif
    for (; i < n && ((uintptr_t)(out + i) & (uintptr_t)(width * 4 - 1)); ++i) out[i] = tile[i];
    for (; i + width <= n; i += width) {
#if defined(__AVX512F__)
        _mm512_stream_ps(out + i, _mm512_loadu_ps(tile + i));
#elif defined(__AVX__)
        _mm256_stream_ps(out + i, _mm256_loadu_ps(tile + i));
#else
        _mm_stream_ps(out + i, _mm_loadu_ps(tile + i));
#endif
    }
#endif
    if (i < n) memcpy(out + i, tile + i, (size_t)(n - i) * sizeof(float));
}

/* Orders this thread's streaming stores before whatever it does next (the team's barrier, the return). */
static void streamed(int stream) {
#if defined(__SSE2__)
    if (stream) _mm_sfence();
#else
    (void)stream;
#endif
}

/* One row's fake quantization: of `row` itself, or of row[i] * column_factor[i] (row[i] / column_factor[i] with
 * `divide`; rounded to float32 first, as torch's mul and div), into `written`; with `stream`, a tile at a time,
 * streamed out. */
static void fake_quantize_row(const float *row, const float *column_factor, int divide, float *written, int64_t cols,
                              float inv, float step, float lo, float hi, int stream) {
    float tile[TILE];
    const int64_t span = stream ? TILE : cols; /* plain stores: the whole row in one loop */
    for (int64_t start = 0; start < cols; start += span) {
        const int64_t n = cols - start < span ? cols - start : span;
        const float *from = row + start;
        float *to = stream ? tile : written + start;
        if (column_factor == NULL)
            for (int64_t i = 0; i < n; ++i) to[i] = fake_quantized(from[i], inv, step, lo, hi);
        else if (divide)
            for (int64_t i = 0; i < n; ++i)
                to[i] = fake_quantized(from[i] / column_factor[start + i], inv, step, lo, hi);
        else
            for (int64_t i = 0; i < n; ++i)
                to[i] = fake_quantized(from[i] * column_factor[start + i], inv, step, lo, hi);
        if (stream) store_streaming(written + start, tile, n);
    }
}

/* Every row's fake quantization (see fake_quantize_row), rows split among up to `threads` threads. */
static void fake_quantize_rows(const float *x, const float *column_factor, int divide, float *out, int64_t rows,
                               int64_t cols, const float *inv_scale, const float *scale, const float *low,
                               const float *high, int64_t threads, int64_t stream) {
    threads = qcore_usable_threads(threads, MAX_PARTS);
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
#pragma omp for schedule(static) nowait
        for (int64_t r = 0; r < rows; ++r)
            fake_quantize_row(x + r * cols, column_factor, divide, out + r * cols, cols, inv_scale[r], scale[r],
                              low[r], high[r], stream != 0);
        streamed(stream != 0);
    }
}

void qcore_fake_quantize_per_row(const float *x, float *out, int64_t rows, int64_t cols, const float *inv_scale,
                                 const float *scale, const float *low, const float *high, int64_t threads,
                                 int64_t stream) {
    fake_quantize_rows(x, NULL, 0, out, rows, cols, inv_scale, scale, low, high, threads, stream);
}

int64_t qcore_fake_quantize_by_run(const float *x, float *out, int64_t rows, int64_t cols, int64_t runs,
                                   const int64_t *counts, const float *inv_scale, const float *scale, const float *low,
                                   const float *high, int64_t threads) {
    int64_t *starts = malloc((size_t)(runs + 1) * sizeof(int64_t));
    if (starts == NULL)
        return 1;
    starts[0] = 0;
    for (int64_t e = 0; e < runs; ++e) {
        if (counts[e] < 0) {
            free(starts);
            return 1;
        }
        starts[e + 1] = starts[e] + counts[e];
    }
    if (starts[runs] != rows) { /* counts that are not these rows' runs: nothing written */
        free(starts);
        return 1;
    }
    threads = qcore_usable_threads(threads, MAX_PARTS);
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
        int64_t first = 0, last = runs - 1; /* the run holding row r: the last whose start is at most r */
        while (first < last) {
            int64_t middle = (first + last + 1) / 2;
            if (starts[middle] <= r)
                first = middle;
            else
                last = middle - 1;
        }
        const float inv = inv_scale[first], step = scale[first], lo = low[first], hi = high[first];
        const float *row = x + r * cols;
        float *written = out + r * cols;
        for (int64_t i = 0; i < cols; ++i)
            written[i] = fake_quantized(row[i], inv, step, lo, hi);
    }
    free(starts);
    return 0;
}

/* Each row's min and max of x scaled per column, for each of `count` column scalings: low[k * rows + r] and
 * high[k * rows + r] of x[r, :] * column_scales[k, :] (each product rounded to float32, as torch's mul); both NaN
 * where a product is NaN (torch.aminmax's answer). The smoothing alpha search's weight ranges without the scaled
 * copies. */
void qcore_scaled_row_extremes(const float *x, const float *column_scales, int64_t count, int64_t rows, int64_t cols,
                               float *low, float *high, int64_t threads) {
    threads = qcore_usable_threads(threads, MAX_PARTS);
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
        const float *row = x + r * cols;
        for (int64_t k = 0; k < count; ++k) {
            const float *scales = column_scales + k * cols;
            float lo = INFINITY, hi = -INFINITY;
            int nan = 0;
            for (int64_t i = 0; i < cols; ++i) {
                float v = row[i] * scales[i];
                lo = v < lo ? v : lo;
                hi = v > hi ? v : hi;
                nan |= v != v;
            }
            low[k * rows + r] = nan ? NAN : lo;
            high[k * rows + r] = nan ? NAN : hi;
        }
    }
}

/* The smoothing alpha search's weight per alpha: each column multiplied by its scale, quantized per row. */
void qcore_fake_quantize_scaled_rows(const float *x, const float *column_scale, float *out, int64_t rows,
                                     int64_t cols, const float *inv_scale, const float *scale, const float *low,
                                     const float *high, int64_t threads, int64_t stream) {
    fake_quantize_rows(x, column_scale, 0, out, rows, cols, inv_scale, scale, low, high, threads, stream);
}

/* One row of x scaled elementwise: row[i] * factor[i] (or / with `divide`), with `per_column` one factor a column,
 * else row[i] * *factor for the row's one factor; rounded to float32 as torch's mul and div; with `stream`, a tile at
 * a time, streamed out. */
static void scale_row(const float *row, const float *factor, int per_column, int divide, float *written,
                      int64_t cols, int stream) {
    float tile[TILE];
    const int64_t span = stream ? TILE : cols;
    for (int64_t start = 0; start < cols; start += span) {
        const int64_t n = cols - start < span ? cols - start : span;
        const float *from = row + start;
        float *to = stream ? tile : written + start;
        if (per_column && divide)
            for (int64_t i = 0; i < n; ++i) to[i] = from[i] / factor[start + i];
        else if (per_column)
            for (int64_t i = 0; i < n; ++i) to[i] = from[i] * factor[start + i];
        else if (divide)
            for (int64_t i = 0; i < n; ++i) to[i] = from[i] / factor[0];
        else
            for (int64_t i = 0; i < n; ++i) to[i] = from[i] * factor[0];
        if (stream) store_streaming(written + start, tile, n);
    }
}

/* A rewritten weight (input-weight equalization, smoothing) computed where it is read: x [rows, cols] times or
 * divided by one factor a column (`per_column`) or one a row, into `out`, rows split among up to `threads` threads. */
void qcore_scale_lines(const float *x, const float *factor, int64_t per_column, int64_t divide, float *out,
                       int64_t rows, int64_t cols, int64_t threads, int64_t stream) {
    threads = qcore_usable_threads(threads, MAX_PARTS);
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
#pragma omp for schedule(static) nowait
        for (int64_t r = 0; r < rows; ++r)
            scale_row(x + r * cols, per_column ? factor : factor + r, per_column != 0, divide != 0, out + r * cols,
                      cols, stream != 0);
        streamed(stream != 0);
    }
}

/* An equalization variant's weight quantized where it is read: each column divided by its factor, quantized per
 * row. */
void qcore_fake_quantize_divided_rows(const float *x, const float *column_divisor, float *out, int64_t rows,
                                      int64_t cols, const float *inv_scale, const float *scale, const float *low,
                                      const float *high, int64_t threads, int64_t stream) {
    fake_quantize_rows(x, column_divisor, 1, out, rows, cols, inv_scale, scale, low, high, threads, stream);
}

/* min and max of x; the return is NaN when x holds a NaN or an infinity (0 * inf is NaN). */
static float extremes_part(const float *restrict x, int64_t n, float *restrict low, float *restrict high) {
    float lo[LANES], hi[LANES], bad[LANES];
    for (int j = 0; j < LANES; ++j) lo[j] = INFINITY, hi[j] = -INFINITY, bad[j] = 0.0f;
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int j = 0; j < LANES; ++j) {
            float v = x[i + j];
            lo[j] = v < lo[j] ? v : lo[j];
            hi[j] = v > hi[j] ? v : hi[j];
            bad[j] += v * 0.0f;
        }
    for (int j = 0; i < n; ++i, ++j) {
        float v = x[i];
        lo[j] = v < lo[j] ? v : lo[j];
        hi[j] = v > hi[j] ? v : hi[j];
        bad[j] += v * 0.0f;
    }
    float flag = 0.0f;
    *low = INFINITY, *high = -INFINITY;
    for (int j = 0; j < LANES; ++j) {
        *low = lo[j] < *low ? lo[j] : *low;
        *high = hi[j] > *high ? hi[j] : *high;
        flag += bad[j];
    }
    return flag;
}

/* The old histogram (of range [old_min, old_max]; none yet when old_min is not finite) spread over `bins` bins
 * from new_min, new_width wide, by interpolating its cumulative counts: observers._rebin, op by op. */
static int rebin(double *histogram, int64_t bins, float old_min, float old_max, float new_min, float new_width) {
    double *cumulative = malloc((size_t)(bins + 1) * sizeof(double));
    double *at_edges = malloc((size_t)(bins + 1) * sizeof(double));
    if (!cumulative || !at_edges) {
        free(cumulative);
        free(at_edges);
        return 1;
    }
    int finite = isfinite(old_min);
    float old_width = old_max - old_min;
    old_width = finite ? (old_width < FLT_EPSILON ? FLT_EPSILON : old_width) : 1.0f;
    old_min = finite ? old_min : new_min;
    cumulative[0] = 0.0;
    double running = 0.0;
    for (int64_t k = 0; k < bins; ++k) cumulative[k + 1] = running += histogram[k];
    for (int64_t k = 0; k <= bins; ++k) {
        float edge = new_min + new_width * (float)k / (float)bins;
        float place = (edge - old_min) / old_width * (float)bins;
        place = place < 0.0f ? 0.0f : place > (float)bins ? (float)bins : place;
        double position = (double)place;
        int64_t left = (int64_t)floor(position);
        left = left > bins - 1 ? bins - 1 : left;
        double fraction = position - (double)left;
        at_edges[k] = cumulative[left] + fraction * (cumulative[left + 1] - cumulative[left]);
    }
    for (int64_t k = 0; k < bins; ++k) histogram[k] = at_edges[k + 1] - at_edges[k];
    free(cumulative);
    free(at_edges);
    return 0;
}

/* min_val, max_val and the histogram are the observer's state, updated in place. Returns 0; 1, touching nothing,
 * when x holds a NaN or an infinity or memory is short (the torch path then runs). */
int64_t qcore_histogram_update(const float *x, int64_t n, int64_t threads, double *histogram, int64_t bins,
                               float *min_val, float *max_val) {
    threads = qcore_usable_threads(threads, MAX_PARTS);
    float lows[MAX_PARTS], highs[MAX_PARTS], flags[MAX_PARTS];
#pragma omp parallel for num_threads(threads) if (threads > 1)
    for (int64_t t = 0; t < threads; ++t) {
        int64_t start = n * t / threads, stop = n * (t + 1) / threads;
        flags[t] = extremes_part(x + start, stop - start, &lows[t], &highs[t]);
    }
    float low = INFINITY, high = -INFINITY;
    for (int64_t t = 0; t < threads; ++t) {
        if (flags[t] != 0.0f) return 1;
        low = lows[t] < low ? lows[t] : low;
        high = highs[t] > high ? highs[t] : high;
    }
    float new_min = *min_val < low ? *min_val : low, new_max = *max_val > high ? *max_val : high;
    float width = new_max - new_min;
    width = width < FLT_EPSILON ? FLT_EPSILON : width;
    int64_t *counts = calloc((size_t)(threads * bins), sizeof(int64_t));
    if (!counts || rebin(histogram, bins, *min_val, *max_val, new_min, width)) {
        free(counts);
        return 1;
    }
    const float scale = (float)bins;
#pragma omp parallel for num_threads(threads) if (threads > 1)
    for (int64_t t = 0; t < threads; ++t) {
        int64_t start = n * t / threads, stop = n * (t + 1) / threads, *own = counts + t * bins;
        for (int64_t i = start; i < stop; ++i) {
            int64_t index = (int64_t)((x[i] - new_min) / width * scale);
            index = index < 0 ? 0 : index > bins - 1 ? bins - 1 : index;
            ++own[index];
        }
    }
    for (int64_t t = 1; t < threads; ++t)
        for (int64_t k = 0; k < bins; ++k) counts[k] += counts[t * bins + k];
    for (int64_t k = 0; k < bins; ++k) histogram[k] += (double)counts[k]; /* one addition, as torch's */
    free(counts);
    *min_val = new_min;
    *max_val = new_max;
    return 0;
}
