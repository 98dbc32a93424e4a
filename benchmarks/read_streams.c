#include <stddef.h>
/* Sum n floats as `streams` interleaved sequential streams (stream s reads [s*n/streams, (s+1)*n/streams)),
   each prefetching `ahead` bytes in front of itself: how fast one thread can read memory when it keeps
   several hardware prefetch streams and its own prefetches in flight. */
float read_streams(const float *x, long n, int streams, long ahead) {
    long chunk = n / streams / 64 * 64;
    float total = 0.f;
    for (long i = 0; i < chunk; i += 64) {
        for (int s = 0; s < streams; s++) {
            const float *p = x + (long)s * chunk + i;
            __builtin_prefetch((const char *)p + ahead, 0, 3);
            __builtin_prefetch((const char *)p + ahead + 64, 0, 3);
            __builtin_prefetch((const char *)p + ahead + 128, 0, 3);
            __builtin_prefetch((const char *)p + ahead + 192, 0, 3);
            float acc = 0.f;
#pragma omp simd reduction(+ : acc)
            for (int k = 0; k < 64; k++) acc += p[k];
            total += acc;
        }
    }
    return total;
}
