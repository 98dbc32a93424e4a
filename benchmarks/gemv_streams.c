#include <stddef.h>
/* y[n] = sum_k W[n, k] x[k]: one row of input through a row-major float32 weight W [N, K] (K a multiple of
   16), its rows split into S bands read at once, S sequential streams, each prefetching `ahead` bytes in
   front of itself (the way read_streams.c reads fastest). GCC vector extensions: the compiler picks the
   machine's widest registers. */
#define S 4
typedef float v16 __attribute__((vector_size(64)));

static inline v16 load16(const float *p) {
    v16 v;
    __builtin_memcpy(&v, p, sizeof v);
    return v;
}

static inline float total(v16 v) {
    float s = 0.f;
    for (int i = 0; i < 16; i++) s += v[i];
    return s;
}

void gemv_streams(const float *W, const float *x, float *y, long N, long K, long ahead) {
    long band = N / S;
    for (long r = 0; r < band; r++) {
        v16 acc[S] = {0};
        const float *rows[S];
        for (int s = 0; s < S; s++) rows[s] = W + ((long)s * band + r) * K;
        for (long k = 0; k < K; k += 16) {
            v16 xv = load16(x + k);
            for (int s = 0; s < S; s++) {
                __builtin_prefetch((const char *)(rows[s] + k) + ahead, 0, 3);
                acc[s] += load16(rows[s] + k) * xv;
            }
        }
        for (int s = 0; s < S; s++) y[s * band + r] = total(acc[s]);
    }
    for (long n = band * S; n < N; n++) {
        v16 a = {0};
        for (long k = 0; k < K; k += 16) a += load16(W + n * K + k) * load16(x + k);
        y[n] = total(a);
    }
}
