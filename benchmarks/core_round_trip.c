/* The round trip of one cache line between the machine's first two CPUs, every half second: two threads, pinned to
 * CPU 0 and CPU 1, hand a flag back and forth. Two cores that share an L3 (one core complex) take some 50 ns; two
 * in different complexes take several times that. On a cloud VM the host moves the vCPUs, so the figure can change
 * from one second to the next: bench_moe.py --where-read-stores shows what that does to a weight quantized where
 * read and read by a matmul's two threads.
 *
 *     cc -O2 -pthread benchmarks/core_round_trip.c -o /tmp/core_round_trip && /tmp/core_round_trip 30
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static _Alignas(64) atomic_int flag;
static atomic_int stop;

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static void pin(int cpu) {
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpu, &set);
    pthread_setaffinity_np(pthread_self(), sizeof set, &set);
}

static void *answer(void *unused) {
    (void)unused;
    pin(1);
    while (!atomic_load(&stop)) {
        while (atomic_load_explicit(&flag, memory_order_acquire) != 1)
            if (atomic_load(&stop)) return NULL;
        atomic_store_explicit(&flag, 0, memory_order_release);
    }
    return NULL;
}

int main(int argc, char **argv) {
    double seconds = argc > 1 ? atof(argv[1]) : 30.0;
    pthread_t other;
    pin(0);
    pthread_create(&other, NULL, answer, NULL);
    double start = now();
    while (now() - start < seconds) {
        double window = now();
        long trips = 0;
        while (now() - window < 0.5) {
            for (int i = 0; i < 1000; ++i) {
                atomic_store_explicit(&flag, 1, memory_order_release);
                while (atomic_load_explicit(&flag, memory_order_acquire) != 0) {
                }
            }
            trips += 1000;
        }
        printf("%5.1f s: round trip %.0f ns\n", now() - start, (now() - window) / (double)trips * 1e9);
        fflush(stdout);
    }
    atomic_store(&stop, 1);
    atomic_store(&flag, 1);
    pthread_join(other, NULL);
    return 0;
}
