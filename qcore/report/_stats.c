/* One-pass report-observer statistics for a small float32 CPU activation (see native.py).
 *
 * The activation is a contiguous [outer, channels, inner] block. One call computes, per batch: the
 * per-channel min and max, the whole tensor's min and max, and (when k > 0) each channel's k largest
 * values, exact, from which it reads the requested order statistics. It then folds them into the
 * observer's state exactly as ReportObserver's torch path does. Nothing is allocated here: the caller
 * passes `scratch` of qcore_scratch_floats(...) floats. With OpenMP (the runtime torch already loaded), up
 * to `threads` threads split the channels.
 *
 * Returns 0, or 1 without touching the state when the batch holds a NaN (the torch path handles it).
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define BLOCK 8  /* rows per block: each block keeps its two largest values per channel */
#define CHUNK 16 /* channels one register-resident step of the first pass handles */

static void fill(float *values, int64_t n, float v) {
    for (int64_t i = 0; i < n; ++i) values[i] = v;
}

/* Insert v into the ascending top-k list `top` (top[0] is the k-th largest so far) if it belongs. */
static inline void push_top(float *top, int64_t k, float v) {
    if (!(v > top[0])) return;
    int64_t i = 0;
    while (i + 1 < k && top[i + 1] < v) {
        top[i] = top[i + 1];
        ++i;
    }
    top[i] = v;
}

/* Branchless insertion of one row of values into k rows `levels` that are descending down the rows
 * (vectorized over the channels; `ld` is the distance between two levels). */
static void insert_row(float *restrict levels, int64_t ld, float *restrict carry, const float *restrict values,
                       int64_t width, int64_t k) {
    for (int64_t c = 0; c < width; ++c) carry[c] = values[c];
    for (int64_t j = 0; j < k; ++j) {
        float *restrict level = levels + j * ld;
        for (int64_t c = 0; c < width; ++c) {
            float kept = level[c], v = carry[c];
            level[c] = v > kept ? v : kept;
            carry[c] = v > kept ? kept : v;
        }
    }
}

/* One step of the scan: v into a channel's running minimum, its block's three largest values, and a sum
 * that only a NaN (or inf - inf) makes NaN, which is cheaper than testing every value. */
#define SCAN_STEP(v, lo, m1, m2, m3, sum)          \
    do {                                           \
        float t1_ = (v) < (m1) ? (v) : (m1);       \
        (m1) = (v) > (m1) ? (v) : (m1);            \
        float t2_ = t1_ < (m2) ? t1_ : (m2);       \
        (m2) = t1_ > (m2) ? t1_ : (m2);            \
        (m3) = t2_ > (m3) ? t2_ : (m3);            \
        (lo) = (v) < (lo) ? (v) : (lo);            \
        (sum) += (v);                              \
    } while (0)

/* The rows of one block, CHUNK channels from x: minimum into low, the block's two largest values into
 * first and second, the largest third-largest so far into third, sums into sum. Fixed width, so that the
 * accumulators live in registers. */
static void scan_chunk(const float *restrict x, int64_t stride, int64_t rows, float *restrict low,
                       float *restrict first, float *restrict second, float *restrict third, float *restrict sum) {
    float lo[CHUNK], m1[CHUNK], m2[CHUNK], m3[CHUNK], total[CHUNK];
    for (int j = 0; j < CHUNK; ++j) {
        lo[j] = low[j];
        m1[j] = m2[j] = m3[j] = -INFINITY;
        total[j] = 0.0f;
    }
    for (int64_t r = 0; r < rows; ++r) {
        const float *restrict row = x + r * stride;
        for (int j = 0; j < CHUNK; ++j) SCAN_STEP(row[j], lo[j], m1[j], m2[j], m3[j], total[j]);
    }
    for (int j = 0; j < CHUNK; ++j) {
        low[j] = lo[j];
        first[j] = m1[j];
        second[j] = m2[j];
        third[j] = m3[j] > third[j] ? m3[j] : third[j];
        sum[j] += total[j];
    }
}

/* The same for the last, narrower chunk. */
static void scan_tail(const float *restrict x, int64_t stride, int64_t rows, int64_t width, float *restrict low,
                      float *restrict first, float *restrict second, float *restrict third, float *restrict sum) {
    for (int64_t j = 0; j < width; ++j) {
        float m1 = -INFINITY, m2 = -INFINITY, m3 = -INFINITY;
        for (int64_t r = 0; r < rows; ++r) SCAN_STEP(x[r * stride + j], low[j], m1, m2, m3, sum[j]);
        first[j] = m1;
        second[j] = m2;
        third[j] = m3 > third[j] ? m3 : third[j];
    }
}

/* Channels last (inner == 1), [rows, channels]. Each channel's k largest values end in `levels`
 * (descending down the levels, [k, channels]), exact, in one pass over the data:
 *   1. (scan_blocks) per-channel min, each block's two largest values (U: 2 per block and channel, in
 *      `tops`), and the largest third-largest value of any block; threads take ranges of blocks, so each
 *      reads the rows it most likely wrote in the op before;
 *   2. (finish_channels) the k largest of U by branchless insertion; the k-th of them, `bound`, is at most
 *      the true k-th. When no block's third-largest value exceeds bound, every value above bound is in U,
 *      so U's top k are the exact top k. Otherwise (a block holds three of the k largest; rare) that
 *      channel is rescanned. Threads take ranges of channels. */
static void scan_blocks(const float *x, int64_t rows, int64_t channels, int64_t b0, int64_t b1, float *low,
                        float *third, float *sum, float *tops) {
    fill(low, channels, INFINITY);
    fill(third, channels, -INFINITY);
    fill(sum, channels, 0.0f);
    for (int64_t b = b0; b < b1; ++b) {
        int64_t r0 = b * BLOCK, n = rows - r0 < BLOCK ? rows - r0 : BLOCK;
        float *first = tops + 2 * b * channels, *second = first + channels;
        const float *block = x + r0 * channels;
        int64_t c = 0;
        for (; c + CHUNK <= channels; c += CHUNK)
            scan_chunk(block + c, channels, n, low + c, first + c, second + c, third + c, sum + c);
        if (c < channels)
            scan_tail(block + c, channels, n, channels - c, low + c, first + c, second + c, third + c, sum + c);
    }
}

/* Channels c0..c1: merge the threads' partial results (`parts`: per thread low, third, sum), then step 2. */
static int finish_channels(const float *x, int64_t rows, int64_t channels, int64_t k, int64_t c0, int64_t c1,
                           const float *parts, int64_t threads, float *low, float *high, float *bound,
                           float *levels, float *tops) {
    int64_t blocks = (rows + BLOCK - 1) / BLOCK, width = c1 - c0;
    for (int64_t c = c0; c < c1; ++c) {
        float lo = INFINITY, sum = 0.0f;
        for (int64_t t = 0; t < threads; ++t) {
            const float *part = parts + 3 * t * channels;
            lo = part[c] < lo ? part[c] : lo;
            sum += part[2 * channels + c] * 0.0f;
        }
        low[c] = lo;
        if (sum != sum) /* NaN, or +inf and -inf: look closer */
            for (int64_t r = 0; r < rows; ++r)
                if (x[r * channels + c] != x[r * channels + c]) return 1;
    }
    int64_t depth = k > 0 ? k : 1; /* the largest value is level 0 */
    for (int64_t j = 0; j < depth; ++j) fill(levels + j * channels + c0, width, -INFINITY);
    for (int64_t b = 0; b < 2 * blocks; ++b)
        insert_row(levels + c0, channels, bound + c0, tops + b * channels + c0, width, depth);
    memcpy(high + c0, levels + c0, (size_t)width * sizeof(float));
    if (k == 0) return 0;
    const float *last = levels + (k - 1) * channels;
    for (int64_t c = c0; c < c1; ++c) {
        float most = -INFINITY;
        for (int64_t t = 0; t < threads; ++t) {
            const float *part = parts + 3 * t * channels + channels;
            most = part[c] > most ? part[c] : most;
        }
        if (most <= last[c]) continue;
        float top[64], floor = last[c]; /* k <= NATIVE_MAX_TOP == 64; at least k values are >= floor */
        fill(top, k, floor);
        for (int64_t r = 0; r < rows; ++r) {
            float v = x[r * channels + c];
            if (v > floor) push_top(top, k, v);
        }
        for (int64_t j = 0; j < k; ++j) levels[j * channels + c] = top[k - 1 - j];
    }
    return 0;
}

static int rows_pass(const float *x, int64_t rows, int64_t channels, int64_t k, int64_t threads, float *low,
                     float *high, float *bound, float *levels, float *tops, float *parts) {
    int64_t blocks = (rows + BLOCK - 1) / BLOCK;
    int64_t span = (blocks + threads - 1) / threads;
    int64_t width = ((channels + threads - 1) / threads + CHUNK - 1) / CHUNK * CHUNK;
#pragma omp parallel for num_threads(threads) if (threads > 1)
    for (int64_t t = 0; t < threads; ++t) {
        float *part = parts + 3 * t * channels;
        int64_t b0 = t * span, b1 = b0 + span < blocks ? b0 + span : blocks;
        scan_blocks(x, rows, channels, b0 < b1 ? b0 : b1, b1, part, part + channels, part + 2 * channels, tops);
    }
    int bad = 0;
#pragma omp parallel for reduction(| : bad) num_threads(threads) if (threads > 1)
    for (int64_t t = 0; t < threads; ++t) {
        int64_t c0 = t * width, c1 = c0 + width < channels ? c0 + width : channels;
        if (c0 < c1)
            bad |= finish_channels(x, rows, channels, k, c0, c1, parts, threads, low, high, bound, levels, tops);
    }
    return bad;
}

/* Channel-major (inner > 1): each channel is `outer` contiguous runs of `inner` values. */
static int runs_pass(const float *x, int64_t outer, int64_t channels, int64_t inner, int64_t k, float *low,
                     float *high, float *levels, int parallel) {
    int32_t bad = 0;
#pragma omp parallel for reduction(| : bad) if (parallel)
    for (int64_t c = 0; c < channels; ++c) {
        float lo = INFINITY, hi = -INFINITY, top[64];
        fill(top, k, -INFINITY);
        for (int64_t o = 0; o < outer; ++o) {
            const float *run = x + (o * channels + c) * inner;
            for (int64_t i = 0; i < inner; ++i) {
                float v = run[i];
                bad |= v != v;
                lo = v < lo ? v : lo;
                hi = v > hi ? v : hi;
            }
            if (k)
                for (int64_t i = 0; i < inner; ++i) push_top(top, k, run[i]);
        }
        low[c] = lo;
        high[c] = hi;
        for (int64_t j = 0; j < k; ++j) levels[j * channels + c] = top[k - 1 - j];
    }
    return bad ? 1 : 0;
}

/* Floats of scratch: low, high, bound (one per channel), k levels, and for channels last two per block
 * plus three per thread (partial low, third-largest and sum). */
int64_t qcore_scratch_floats(int64_t outer, int64_t channels, int64_t inner, int64_t k, int64_t threads) {
    int64_t extra = inner == 1 ? 2 * ((outer + BLOCK - 1) / BLOCK) + 3 * (threads > 1 ? threads : 1) : 0;
    return (3 + (k > 0 ? k : 1) + extra) * channels;
}

int64_t qcore_observe(const float *x, int64_t outer, int64_t channels, int64_t inner, int64_t k,
                      const int64_t *picks, int64_t n_picks, float *scratch, int64_t threads, float *extremes,
                      double *extreme_sums, float *min_val, float *max_val, float *constant_channels,
                      double *ratio_sums, float *ratio_counts) {
    float *low = scratch, *high = scratch + channels, *bound = scratch + 2 * channels;
    float *levels = scratch + 3 * channels, *tops = levels + (k > 0 ? k : 1) * channels;
    float *parts = tops + 2 * ((outer + BLOCK - 1) / BLOCK) * channels;
#ifdef _OPENMP
    if (threads > omp_get_max_threads()) threads = omp_get_max_threads();
#else
    threads = 1;
#endif
    if (threads < 1) threads = 1; /* never more than the caller sized scratch for */
    int bad = inner == 1 ? rows_pass(x, outer, channels, k, threads, low, high, bound, levels, tops, parts)
                         : runs_pass(x, outer, channels, inner, k, low, high, levels, threads > 1);
    if (bad) return 1;
    float batch_low = INFINITY, batch_high = -INFINITY;
    for (int64_t c = 0; c < channels; ++c) {
        batch_low = low[c] < batch_low ? low[c] : batch_low;
        batch_high = high[c] > batch_high ? high[c] : batch_high;
        min_val[c] = low[c] < min_val[c] ? low[c] : min_val[c];
        max_val[c] = high[c] > max_val[c] ? high[c] : max_val[c];
        constant_channels[c] += high[c] == low[c];
    }
    extremes[0] = -batch_low > extremes[0] ? -batch_low : extremes[0];
    extremes[1] = batch_high > extremes[1] ? batch_high : extremes[1];
    extreme_sums[0] += (double)-batch_low;
    extreme_sums[1] += (double)batch_high;
    for (int64_t j = 0; j < n_picks; ++j) {
        const float *level = levels + (k - 1 - picks[j]) * channels; /* picks are ascending positions */
        for (int64_t c = 0; c < channels; ++c) {
            float q = level[c] + 0.0f, m = high[c], ratio = m / q; /* + 0: -0 and +0 tie in selection */
            ratio = ratio != ratio ? 0.0f : ratio == INFINITY ? FLT_MAX : ratio == -INFINITY ? -FLT_MAX : ratio;
            ratio_sums[j * channels + c] += (double)ratio; /* torch.nan_to_num(high / q) */
            ratio_counts[j * channels + c] += (q != 0.0f) | (m != 0.0f);
        }
    }
    return 0;
}

/* Min, max and a NaN flag of x[0..n), into out[0..2] (NaN flag as 0/1). */
static void range_part(const float *restrict x, int64_t n, float *restrict out) {
    enum { LANES = 64 };
    float lo[LANES], hi[LANES], total[LANES];
    fill(lo, LANES, INFINITY);
    fill(hi, LANES, -INFINITY);
    fill(total, LANES, 0.0f);
    int64_t full = n - n % LANES;
    for (int64_t i = 0; i < full; i += LANES) {
        for (int j = 0; j < LANES; ++j) {
            float v = x[i + j];
            lo[j] = v < lo[j] ? v : lo[j];
            hi[j] = v > hi[j] ? v : hi[j];
            total[j] += v; /* NaN only through a NaN (or inf - inf) */
        }
    }
    for (int64_t i = full; i < n; ++i) {
        lo[0] = x[i] < lo[0] ? x[i] : lo[0];
        hi[0] = x[i] > hi[0] ? x[i] : hi[0];
        total[0] += x[i];
    }
    float low = lo[0], high = hi[0], sum = 0.0f;
    for (int j = 0; j < LANES; ++j) {
        low = lo[j] < low ? lo[j] : low;
        high = hi[j] > high ? hi[j] : high;
        sum += total[j] * 0.0f;
    }
    int bad = 0;
    if (sum != sum)
        for (int64_t i = 0; i < n && !bad; ++i) bad = x[i] != x[i];
    out[0] = low;
    out[1] = high;
    out[2] = (float)bad;
}

/* Whole-tensor min and max only (per_channel=False observers); threads take contiguous parts, most likely
 * the parts they wrote in the op before. Returns 1 on NaN, state untouched. */
int64_t qcore_observe_range(const float *x, int64_t n, int64_t threads, float *extremes, double *extreme_sums) {
    enum { MAX_PARTS = 64 };
#ifdef _OPENMP
    if (threads > omp_get_max_threads()) threads = omp_get_max_threads();
#else
    threads = 1;
#endif
    if (threads < 1) threads = 1;
    if (threads > MAX_PARTS) threads = MAX_PARTS;
    float parts[MAX_PARTS][3];
    int64_t span = (n + threads - 1) / threads;
    span = (span + 63) / 64 * 64;
#pragma omp parallel for num_threads(threads) if (threads > 1)
    for (int64_t t = 0; t < threads; ++t) {
        int64_t start = t * span, stop = start + span < n ? start + span : n;
        range_part(x + start, stop > start ? stop - start : 0, parts[t]);
    }
    float batch_low = INFINITY, batch_high = -INFINITY;
    for (int64_t t = 0; t < threads; ++t) {
        if (parts[t][2] != 0.0f) return 1;
        batch_low = parts[t][0] < batch_low ? parts[t][0] : batch_low;
        batch_high = parts[t][1] > batch_high ? parts[t][1] : batch_high;
    }
    extremes[0] = -batch_low > extremes[0] ? -batch_low : extremes[0];
    extremes[1] = batch_high > extremes[1] ? batch_high : extremes[1];
    extreme_sums[0] += (double)-batch_low;
    extreme_sums[1] += (double)batch_high;
    return 0;
}
