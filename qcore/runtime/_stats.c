/* One-pass report-observer statistics for a small float32 CPU activation (see native.py).
 *
 * The activation is a contiguous [outer, channels, inner] block. One qcore_observe call computes, per batch,
 * the per-channel min and max, the whole tensor's min and max, and the requested per-channel order
 * statistics: exact from each channel's k largest values, or, when the torch path would sample, selected
 * exactly from the same sample. It then folds them into the observer's state exactly as ReportObserver's
 * torch path does. qcore_observe_range does the whole-tensor min and max only. Nothing is allocated here:
 * the caller passes `scratch` of qcore_scratch_floats(...) floats. With OpenMP (the runtime torch already
 * loaded), up to `threads` threads share the work.
 *
 * Both return 0, or 1 without touching the state when the batch holds a NaN (the torch path handles it).
 * qcore_observe returns 2, touching nothing, when its arguments do not fit the buffer sizes it is given.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

/* The threads a kernel may use: at most `threads`, `most` and the OpenMP runtime's maximum, at least 1 (also
 * used by _fused.c, built into the same library). */
int64_t qcore_usable_threads(int64_t threads, int64_t most) {
#ifdef _OPENMP
    if (threads > omp_get_max_threads()) threads = omp_get_max_threads();
#else
    threads = 1;
#endif
    if (threads > most) threads = most;
    return threads < 1 ? 1 : threads;
}

#define BLOCK 16 /* rows per block: each block keeps its three largest values per channel */
#define CHUNK 32 /* channels one register-resident step of the first pass handles */
#define MAX_TOP 128 /* the largest k: the per-channel top buffers are this long (NATIVE_MAX_TOP in observer.py) */

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

/* The rows of one block, CHUNK channels from x: minimum into low, the block's three largest values into
 * first, second and third, sums into sum. Fixed width, so that the accumulators live in registers. */
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
        third[j] = m3[j];
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
        third[j] = m3;
    }
}

/* Channels last (inner == 1), [rows, channels]. Each channel's k largest values end in `levels`
 * (descending down the levels, [k, channels]), exact, in one pass over the data:
 *   1. (scan_blocks) per-channel min, and each block's three largest values (rows of `tops`); threads
 *      take ranges of blocks;
 *   2. (finish_channels) the k largest of U, the blocks' two largest values, by branchless insertion;
 *      the k-th of them, `bound`, is at most the true k-th. Where no block's third-largest value exceeds
 *      bound, every value above bound is in U, so U's top k are the exact top k. A channel with such a
 *      block (it holds three of the k largest; rare) takes that block's every value instead of its two
 *      largest. Threads take ranges of channels. */
static void scan_blocks(const float *x, int64_t rows, int64_t channels, int64_t b0, int64_t b1, float *low,
                        float *sum, float *tops) {
    fill(low, channels, INFINITY);
    fill(sum, channels, 0.0f);
    for (int64_t b = b0; b < b1; ++b) {
        int64_t r0 = b * BLOCK, n = rows - r0 < BLOCK ? rows - r0 : BLOCK;
        float *first = tops + 3 * b * channels, *second = first + channels, *third = second + channels;
        const float *block = x + r0 * channels;
        int64_t c = 0;
        for (; c + CHUNK <= channels; c += CHUNK)
            scan_chunk(block + c, channels, n, low + c, first + c, second + c, third + c, sum + c);
        if (c < channels)
            scan_tail(block + c, channels, n, channels - c, low + c, first + c, second + c, third + c, sum + c);
    }
}

/* Channel c's k largest values from scratch, given bound: every block's two largest values, and all the
 * values of blocks whose third-largest exceeds bound. */
static void rebuild_channel(const float *x, int64_t rows, int64_t channels, int64_t k, int64_t c, float bound,
                            const float *tops, float *levels) {
    float top[MAX_TOP]; /* k <= MAX_TOP (checked by qcore_observe); at least k values are >= bound */
    fill(top, k, bound);
    for (int64_t b = 0; b * BLOCK < rows; ++b) {
        const float *block_tops = tops + 3 * b * channels + c;
        if (block_tops[2 * channels] > bound) {
            int64_t r1 = (b + 1) * BLOCK < rows ? (b + 1) * BLOCK : rows;
            for (int64_t r = b * BLOCK; r < r1; ++r) push_top(top, k, x[r * channels + c]);
        } else {
            push_top(top, k, block_tops[0]);
            push_top(top, k, block_tops[channels]);
        }
    }
    for (int64_t j = 0; j < k; ++j) levels[j * channels + c] = top[k - 1 - j];
}

/* Channels c0..c1: merge the threads' partial results (`parts`: per thread low and sum), then step 2. */
static int finish_channels(const float *x, int64_t rows, int64_t channels, int64_t k, int64_t c0, int64_t c1,
                           const float *parts, int64_t threads, float *low, float *high, float *bound,
                           float *levels, float *tops) {
    int64_t blocks = (rows + BLOCK - 1) / BLOCK, width = c1 - c0;
    float *probe = bound + c0; /* free until the insertion below */
    fill(low + c0, width, INFINITY);
    fill(probe, width, 0.0f);
    for (int64_t t = 0; t < threads; ++t) {
        const float *part_low = parts + 2 * t * channels + c0, *part_sum = part_low + channels;
        for (int64_t c = 0; c < width; ++c) {
            low[c0 + c] = part_low[c] < low[c0 + c] ? part_low[c] : low[c0 + c];
            probe[c] += part_sum[c] * 0.0f; /* NaN only if some value was NaN (or inf) */
        }
    }
    for (int64_t c = c0; c < c1; ++c) {
        if (bound[c] == bound[c]) continue;
        for (int64_t r = 0; r < rows; ++r) /* NaN, or an infinity: look closer */
            if (x[r * channels + c] != x[r * channels + c]) return 1;
    }
    int64_t depth = k > 0 ? k : 1; /* the largest value is level 0 */
    for (int64_t j = 0; j < depth; ++j) fill(levels + j * channels + c0, width, -INFINITY);
    for (int64_t b = 0; b < blocks; ++b) {
        const float *first = tops + 3 * b * channels + c0;
        insert_row(levels + c0, channels, bound + c0, first, width, depth);
        if (k > 1) insert_row(levels + c0, channels, bound + c0, first + channels, width, depth);
    }
    memcpy(high + c0, levels + c0, (size_t)width * sizeof(float));
    if (k == 0) return 0;
    const float *last = levels + (k - 1) * channels;
    float *most = bound + c0; /* the largest third-largest value of any block */
    fill(most, width, -INFINITY);
    for (int64_t b = 0; b < blocks; ++b) {
        const float *third = tops + (3 * b + 2) * channels + c0;
        for (int64_t c = 0; c < width; ++c) most[c] = third[c] > most[c] ? third[c] : most[c];
    }
    for (int64_t c = c0; c < c1; ++c)
        if (bound[c] > last[c]) rebuild_channel(x, rows, channels, k, c, last[c], tops, levels);
    return 0;
}

/* Thread t of `threads`: scan its blocks, wait for the others, then finish its channels. */
static int rows_part(const float *x, int64_t rows, int64_t channels, int64_t k, int64_t t, int64_t threads,
                     float *low, float *high, float *bound, float *levels, float *tops, float *parts) {
    int64_t blocks = (rows + BLOCK - 1) / BLOCK;
    int64_t span = (blocks + threads - 1) / threads;
    int64_t width = ((channels + threads - 1) / threads + CHUNK - 1) / CHUNK * CHUNK;
    float *part = parts + 2 * t * channels;
    int64_t b0 = t * span, b1 = b0 + span < blocks ? b0 + span : blocks;
    scan_blocks(x, rows, channels, b0 < b1 ? b0 : b1, b1, part, part + channels, tops);
#ifdef _OPENMP
    if (threads > 1) {
#pragma omp barrier
    }
#endif
    int64_t c0 = t * width, c1 = c0 + width < channels ? c0 + width : channels;
    return c0 < c1 ? finish_channels(x, rows, channels, k, c0, c1, parts, threads, low, high, bound, levels, tops)
                   : 0;
}

static int rows_pass(const float *x, int64_t rows, int64_t channels, int64_t k, int64_t threads, float *low,
                     float *high, float *bound, float *levels, float *tops, float *parts) {
    if (threads == 1) return rows_part(x, rows, channels, k, 0, 1, low, high, bound, levels, tops, parts);
    int bad = 0;
#ifdef _OPENMP
#pragma omp parallel num_threads(threads) reduction(| : bad)
    {
        if (omp_get_num_threads() == threads)
            bad |= rows_part(x, rows, channels, k, omp_get_thread_num(), threads, low, high, bound, levels, tops,
                             parts);
        else if (omp_get_thread_num() == 0) /* the runtime gave fewer threads: do it all here */
            bad |= rows_part(x, rows, channels, k, 0, 1, low, high, bound, levels, tops, parts);
    }
#endif
    return bad;
}

static inline void swap(float *a, float *b) {
    float t = *a;
    *a = *b;
    *b = t;
}

/* The value of ascending rank i (0-based) among a[0..n), reordering a: quickselect with a median-of-three
 * pivot and a three-way partition (ties end a round), sorting what is left if it stops shrinking. */
static float select_rank(float *a, int64_t n, int64_t i) {
    int64_t lo = 0, hi = n - 1, rounds = 0;
    while (lo < hi) {
        if (++rounds > 64) { /* adversarial order: finish with an insertion sort of the range */
            for (int64_t p = lo + 1; p <= hi; ++p)
                for (int64_t q = p; q > lo && a[q - 1] > a[q]; --q) swap(a + q - 1, a + q);
            return a[i];
        }
        float x = a[lo], y = a[lo + (hi - lo) / 2], z = a[hi];
        float pivot = x < y ? (y < z ? y : (x < z ? z : x)) : (x < z ? x : (y < z ? z : y));
        int64_t lt = lo, gt = hi, j = lo;
        while (j <= gt) {
            if (a[j] < pivot) swap(a + lt++, a + j++);
            else if (a[j] > pivot) swap(a + j, a + gt--);
            else ++j;
        }
        if (i < lt) hi = lt - 1;
        else if (i > gt) lo = gt + 1;
        else return pivot;
    }
    return a[lo];
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

/* The same as select_rank, faster for large n: brackets rank i between two values read off an evenly spaced
 * subsample, keeps what lies between them (branchless), and selects among those. Exact either way: if the
 * bracket misses (rare), it falls back to select_rank on everything. `spare` holds n floats. */
static float select_rank_bracketed(float *a, int64_t n, int64_t i, float *spare) {
    enum { SUB = 256 };
    if (n < 8 * SUB) return select_rank(a, n, i);
    int64_t step = n / SUB;
    for (int64_t j = 0; j < SUB; ++j) spare[j] = a[j * step];
    double f = (i + 0.5) / (double)n, spread = 3.0 * sqrt(SUB * f * (1.0 - f)) + 2.0;
    int64_t lo_rank = (int64_t)(f * SUB - spread), hi_rank = (int64_t)(f * SUB + spread);
    lo_rank = lo_rank < 0 ? 0 : lo_rank;
    hi_rank = hi_rank > SUB - 1 ? SUB - 1 : hi_rank;
    float lo = select_rank(spare, SUB, lo_rank), hi = select_rank(spare, SUB, hi_rank);
    int64_t below = 0, kept = 0;
    for (int64_t j = 0; j < n; ++j) {
        float v = a[j];
        below += v < lo;
        spare[kept] = v;
        kept += (v >= lo) & (v <= hi);
    }
    if (i >= below && i < below + kept) return select_rank(spare, kept, i - below);
    return select_rank(a, n, i);
}

#ifdef _OPENMP
#define THREAD_ID() omp_get_thread_num()
#else
#define THREAD_ID() 0
#endif

/* Channel-major (inner > 1): each channel is `outer` contiguous runs of `inner` values. Per channel: min and
 * max of every value, then either its k largest (exact, m == 0) or, from the m values at `sample` offsets
 * (the torch path's sample), the values of the ascending ranks in picks (one level each). */
static int runs_pass(const float *x, int64_t outer, int64_t channels, int64_t inner, int64_t k,
                     const int64_t *sample, int64_t m, const int64_t *picks, int64_t n_picks, float *low,
                     float *high, float *levels, float *buffers, int64_t threads) {
    int32_t bad = 0;
#pragma omp parallel for reduction(| : bad) num_threads(threads) if (threads > 1)
    for (int64_t c = 0; c < channels; ++c) {
        float lo = INFINITY, hi = -INFINITY, top[MAX_TOP], run_range[3];
        fill(top, m ? 0 : k, -INFINITY);
        int32_t nan = 0;
        for (int64_t o = 0; o < outer; ++o) {
            const float *run = x + (o * channels + c) * inner;
            range_part(run, inner, run_range);
            lo = run_range[0] < lo ? run_range[0] : lo;
            hi = run_range[1] > hi ? run_range[1] : hi;
            nan |= run_range[2] != 0.0f;
            if (k && !m)
                for (int64_t i = 0; i < inner; ++i) push_top(top, k, run[i]);
        }
        low[c] = lo;
        high[c] = hi;
        bad |= nan;
        if (m && !nan) {
            float *buffer = buffers + 2 * THREAD_ID() * m;
            const float *base = x + c * inner;
            for (int64_t j = 0; j < m; ++j) buffer[j] = base[sample[j]];
            for (int64_t j = 0; j < n_picks; ++j)
                levels[j * channels + c] = select_rank_bracketed(buffer, m, picks[j], buffer + m);
        } else {
            for (int64_t j = 0; j < k; ++j) levels[j * channels + c] = top[k - 1 - j];
        }
    }
    return bad ? 1 : 0;
}

/* Floats of scratch: low, high, bound (one per channel), k levels, and for channels last three per block
 * plus two per thread (partial low and sum), or 2m per thread when sampling (inner > 1). */
int64_t qcore_scratch_floats(int64_t outer, int64_t channels, int64_t inner, int64_t k, int64_t m,
                             int64_t threads) {
    if (threads < 1) threads = 1;
    int64_t extra = inner == 1 ? (3 * ((outer + BLOCK - 1) / BLOCK) + 2 * threads) * channels : 2 * m * threads;
    return (3 + (k > 0 ? k : 1)) * channels + extra;
}

/* Whether the arguments fit the buffers: scratch of scratch_floats floats, per-channel state of state_channels
 * floats, ratio sums and counts of ratio_slots values, picks within the top k (exact) or the sample (sampled),
 * and sample offsets inside x. */
static int arguments_fit(int64_t outer, int64_t channels, int64_t inner, int64_t k, const int64_t *picks,
                         int64_t n_picks, const int64_t *sample, int64_t m, int64_t threads, int64_t scratch_floats,
                         int64_t state_channels, int64_t ratio_slots) {
    if (outer < 1 || channels < 1 || inner < 1 || k < 0 || k > MAX_TOP || n_picks < 0 || m < 0) return 0;
    if (outer > INT64_MAX / channels / inner) return 0;
    if (m && inner == 1) return 0;
    if (state_channels != channels || n_picks > ratio_slots / channels) return 0;
    if (m && n_picks > (k > 0 ? k : 1)) return 0; /* sampled: one level per pick */
    if (qcore_scratch_floats(outer, channels, inner, k, m, threads) > scratch_floats) return 0;
    for (int64_t j = 0; j < n_picks; ++j)
        if (picks[j] < 0 || picks[j] >= (m ? m : k)) return 0;
    for (int64_t j = 0; j < m; ++j)
        if (sample[j] < 0 || sample[j] > (outer * channels - channels + 1) * inner - 1) return 0;
    return 1;
}

int64_t qcore_observe(const float *x, int64_t outer, int64_t channels, int64_t inner, int64_t k,
                      const int64_t *picks, int64_t n_picks, const int64_t *sample, int64_t m, float *scratch,
                      int64_t scratch_floats, int64_t threads, float *extremes, double *extreme_sums, float *min_val,
                      float *max_val, float *constant_channels, int64_t state_channels, double *ratio_sums,
                      float *ratio_counts, int64_t ratio_slots) {
    float *low = scratch, *high = scratch + channels, *bound = scratch + 2 * channels;
    float *levels = scratch + 3 * channels, *tops = levels + (k > 0 ? k : 1) * channels;
    float *parts = tops + 3 * ((outer + BLOCK - 1) / BLOCK) * channels;
    threads = qcore_usable_threads(threads, threads); /* never more than the caller sized scratch for */
    if (!arguments_fit(outer, channels, inner, k, picks, n_picks, sample, m, threads, scratch_floats, state_channels,
                       ratio_slots))
        return 2;
    int bad = inner == 1 ? rows_pass(x, outer, channels, k, threads, low, high, bound, levels, tops, parts)
                         : runs_pass(x, outer, channels, inner, k, sample, m, picks, n_picks, low, high, levels,
                                     tops, threads);
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
        /* exact: picks are ascending positions in the top k; sampled: level j holds pick j */
        const float *level = levels + (m ? j : k - 1 - picks[j]) * channels;
        for (int64_t c = 0; c < channels; ++c) {
            float q = level[c] + 0.0f, peak = high[c], ratio = peak / q; /* + 0: -0 and +0 tie in selection */
            ratio = ratio != ratio ? 0.0f : ratio == INFINITY ? FLT_MAX : ratio == -INFINITY ? -FLT_MAX : ratio;
            ratio_sums[j * channels + c] += (double)ratio; /* torch.nan_to_num(high / q) */
            ratio_counts[j * channels + c] += (q != 0.0f) | (peak != 0.0f);
        }
    }
    return 0;
}

/* Whole-tensor min and max only (per_channel=False observers); threads take contiguous parts, most likely
 * the parts they wrote in the op before. Returns 1 on NaN, state untouched. */
int64_t qcore_observe_range(const float *x, int64_t n, int64_t threads, float *extremes, double *extreme_sums) {
    enum { MAX_PARTS = 64 };
    threads = qcore_usable_threads(threads, MAX_PARTS);
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
