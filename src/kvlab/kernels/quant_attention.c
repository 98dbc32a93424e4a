/* Decode-step attention read straight from packed quantized K/V (kvlab.kernels.quant_attention).
 *
 * Per-token codes (kvq_scores, kvq_values): a segment stores, per KV head h and slot t,
 * `D * bits / 8` bytes of codes (pack_bits' layout: byte j holds codes (8/bits)*j + r at bit bits*r),
 * one fp16 scale per group of `group` channels, optionally an fp16 zero point per group, and
 * optionally an fp16 coefficient on the segment's mean. A key is
 *     k_t = R_h^T (scale * level[code] + zero) + coef_t * RoPE(mean_h, pos_t)
 * and a value the same without RoPE (R = identity for plain per-token codes). The Python side
 * rotates the queries (R q) and turns the mean term into per-frequency weights A, B and a constant C:
 *     q . RoPE(mean, p) = C + sum_i cos(p w_i) A_i + sin(p w_i) B_i.
 * Per-channel keys (kvq_scores_channel, KIVI): codes [H][D][n] along tokens, one fp16 scale and zero
 * per channel and group of `tgroup` tokens, so q . k_t = sum_d (q_d scale_dg) level[code_dt] + q . zero_g.
 * Nothing here allocates more than one row (or one token group) on the stack: the history is read
 * once per step and never expanded to full precision.
 */
#include <stdint.h>
#include <string.h>

typedef _Float16 f16;

#define MAX_D 512

/* byte -> its 8/bits levels, so one table read decodes a whole byte */
static void byte_table(const float *levels, int bits, float *table) {
    int per = 8 / bits, mask = (1 << bits) - 1;
    for (int b = 0; b < 256; b++)
        for (int r = 0; r < per; r++) table[b * per + r] = levels[(b >> (bits * r)) & mask];
}

/* What both kernels need to decode rows: bytes and groups per row, and the byte -> levels table. */
typedef struct {
    int per, rowbytes, ng;
    float table[256 * 4];
} Rows;

static int rows_setup(Rows *r, int D, int bits, int group, const float *levels) {
    if (D > MAX_D || (bits != 2 && bits != 4 && bits != 8) || group < 1 || D % group || (D * bits) % 8)
        return -1;
    r->per = 8 / bits;
    r->rowbytes = D * bits / 8;
    r->ng = D / group;
    byte_table(levels, bits, r->table);
    return 0;
}

static inline void decode_row(const uint8_t *codes, int nbytes, int per, const float *table, float *y) {
    if (per == 2) {
        for (int j = 0; j < nbytes; j++) memcpy(y + 2 * j, table + 2 * codes[j], 2 * sizeof(float));
    } else {
        for (int j = 0; j < nbytes; j++) memcpy(y + per * j, table + per * codes[j], per * sizeof(float));
    }
}

/* Segment s of KV head h: its slot count and where its codes, scales, zeros (or NULL) and mean
 * coefficients (or NULL) start. */
typedef struct {
    int64_t n;
    const uint8_t *codes;
    const f16 *scales, *zeros, *coef;
} Seg;

static inline Seg seg_at(const Rows *r, int s, int h, const uint8_t *const *codes,
                         const f16 *const *scales, const f16 *const *zeros, const f16 *const *coef,
                         const int64_t *n) {
    Seg g;
    g.n = n[s];
    g.codes = codes[s] + (int64_t)h * g.n * r->rowbytes;
    g.scales = scales[s] + (int64_t)h * g.n * r->ng;
    g.zeros = zeros[s] ? zeros[s] + (int64_t)h * g.n * r->ng : NULL;
    g.coef = coef[s] ? coef[s] + (int64_t)h * g.n : NULL;
    return g;
}

/* scores[h][j][off_s + t] = (R q)_hj . y_t (per group scaled) + zero term + coef_t * mean term.
 * Per segment s: codes[s] [H][n_s][D*bits/8], scales[s] and zeros[s] (or NULL) [H][n_s][D/group],
 * coef[s] [H][n_s] or NULL, has_mean[s]; qsum [H][G][D/group] (the query's sum over each group, read
 * where a segment has zeros); A, B [S][H][G][half], C [S][H][G]; cos_t, sin_t [positions][half]. */
int kvq_scores(int S, const uint8_t *const *codes, const f16 *const *scales, const f16 *const *zeros,
               const f16 *const *coef, const int64_t *n, const int64_t *pos0, const int32_t *has_mean,
               int H, int G, int D, int bits, int group, const float *levels, const float *qrot,
               const float *qsum, const float *A, const float *B, const float *C, int half,
               const float *cos_t, const float *sin_t, float *out, int64_t stride) {
    Rows r;
    if (rows_setup(&r, D, bits, group, levels)) return -1;
    const int rowbytes = r.rowbytes, ng = r.ng;
    float y[MAX_D];
    for (int h = 0; h < H; h++) {
        int64_t off = 0;
        for (int s = 0; s < S; s++) {
            const Seg sg = seg_at(&r, s, h, codes, scales, zeros, coef, n);
            if (sg.zeros && !qsum) return -1;
            for (int64_t t = 0; t < sg.n; t++) {
                decode_row(sg.codes + t * rowbytes, rowbytes, r.per, r.table, y);
                const f16 *sc = sg.scales + t * ng, *zr = sg.zeros ? sg.zeros + t * ng : NULL;
                for (int j = 0; j < G; j++) {
                    const float *q = qrot + ((int64_t)h * G + j) * D;
                    float acc = 0.f;
                    for (int g = 0; g < ng; g++) {
                        float d = 0.f;
                        const float *qg = q + g * group, *yg = y + g * group;
#pragma omp simd reduction(+ : d)
                        for (int c = 0; c < group; c++) d += qg[c] * yg[c];
                        acc += (float)sc[g] * d;
                    }
                    if (zr) {
                        const float *qs = qsum + ((int64_t)h * G + j) * ng;
                        for (int g = 0; g < ng; g++) acc += (float)zr[g] * qs[g];
                    }
                    if (has_mean[s]) {
                        int64_t k = ((int64_t)s * H + h) * G + j;
                        const float *a = A + k * half, *b = B + k * half;
                        const float *cr = cos_t + (pos0[s] + t) * half, *sr = sin_t + (pos0[s] + t) * half;
                        float m = 0.f;
#pragma omp simd reduction(+ : m)
                        for (int i = 0; i < half; i++) m += cr[i] * a[i] + sr[i] * b[i];
                        m += C[k];
                        acc += (sg.coef ? (float)sg.coef[t] : 1.f) * m;
                    }
                    out[((int64_t)h * G + j) * stride + off + t] = acc;
                }
            }
            off += sg.n;
        }
    }
    return 0;
}

/* acc[h][j][:] = sum_t w[h][j][off_s + t] * (scale_t * level[code_t] + zero_t)  (rotated frame), and
 * wmean[s][h][j] = sum_t w * coef_t over segment s (the weight the segment's mean value gets). */
int kvq_values(int S, const uint8_t *const *codes, const f16 *const *scales, const f16 *const *zeros,
               const f16 *const *coef, const int64_t *n, const int32_t *has_mean, int H, int G, int D,
               int bits, int group, const float *levels, const float *w, int64_t stride, float *acc,
               float *wmean) {
    Rows r;
    if (rows_setup(&r, D, bits, group, levels)) return -1;
    const int rowbytes = r.rowbytes, ng = r.ng;
    float y[MAX_D];
    memset(acc, 0, sizeof(float) * (size_t)H * G * D);
    memset(wmean, 0, sizeof(float) * (size_t)S * H * G);
    for (int h = 0; h < H; h++) {
        int64_t off = 0;
        for (int s = 0; s < S; s++) {
            const Seg sg = seg_at(&r, s, h, codes, scales, zeros, coef, n);
            for (int64_t t = 0; t < sg.n; t++) {
                decode_row(sg.codes + t * rowbytes, rowbytes, r.per, r.table, y);
                const f16 *sc = sg.scales + t * ng, *zr = sg.zeros ? sg.zeros + t * ng : NULL;
                for (int j = 0; j < G; j++) {
                    float wt = w[((int64_t)h * G + j) * stride + off + t];
                    float *a = acc + ((int64_t)h * G + j) * D;
                    for (int g = 0; g < ng; g++) {
                        float ws = wt * (float)sc[g], wz = zr ? wt * (float)zr[g] : 0.f;
                        float *ag = a + g * group;
                        const float *yg = y + g * group;
#pragma omp simd
                        for (int c = 0; c < group; c++) ag[c] += ws * yg[c] + wz;
                    }
                    if (has_mean[s])
                        wmean[((int64_t)s * H + h) * G + j] += wt * (sg.coef ? (float)sg.coef[t] : 1.f);
                }
            }
            off += sg.n;
        }
    }
    return 0;
}


/* scores[h][j][off_s + t] = sum_d q_hjd * (scale_dg * level[code_dt] + zero_dg), g = t / tgroup: keys
 * coded per channel along tokens (KIVI). Per segment s: codes[s] [H][D][n_s*bits/8], scales[s] and
 * zeros[s] (or NULL) [H][D][n_s/tgroup]; q [H][G][D]. One token group is decoded at a time, channel by
 * channel, into a row on the stack, and the G score rows of that group stay in L1 while it is. */
int kvq_scores_channel(int S, const uint8_t *const *codes, const f16 *const *scales,
                       const f16 *const *zeros, const int64_t *n, int H, int G, int D, int bits,
                       int tgroup, const float *levels, const float *q, float *out, int64_t stride) {
    Rows r;
    /* a token group decodes like a row of `tgroup` channels: at most MAX_D tokens, whole bytes */
    if (rows_setup(&r, tgroup, bits, tgroup, levels) || G < 1 || D < 1) return -1;
    const int gbytes = r.rowbytes;
    float y[MAX_D], bias[G]; /* one running zero-point term per query head of this KV head */
    for (int h = 0; h < H; h++) {
        int64_t off = 0;
        for (int s = 0; s < S; s++) {
            int64_t ns = n[s];
            if (ns % tgroup) return -1;
            int64_t ngr = ns / tgroup, rowbytes = ns * bits / 8;
            const uint8_t *cs = codes[s] + (int64_t)h * D * rowbytes;
            const f16 *ss = scales[s] + (int64_t)h * D * ngr;
            const f16 *zs = zeros[s] ? zeros[s] + (int64_t)h * D * ngr : NULL;
            for (int64_t g = 0; g < ngr; g++) {
                for (int j = 0; j < G; j++) {
                    memset(out + ((int64_t)h * G + j) * stride + off + g * tgroup, 0, sizeof(float) * tgroup);
                    bias[j] = 0.f;
                }
                for (int d = 0; d < D; d++) {
                    decode_row(cs + d * rowbytes + g * gbytes, gbytes, r.per, r.table, y);
                    float sc = (float)ss[d * ngr + g], z = zs ? (float)zs[d * ngr + g] : 0.f;
                    for (int j = 0; j < G; j++) {
                        float qd = q[((int64_t)h * G + j) * D + d], c = qd * sc;
                        float *o = out + ((int64_t)h * G + j) * stride + off + g * tgroup;
#pragma omp simd
                        for (int t = 0; t < tgroup; t++) o[t] += c * y[t];
                        bias[j] += qd * z;
                    }
                }
                for (int j = 0; j < G; j++) {
                    float *o = out + ((int64_t)h * G + j) * stride + off + g * tgroup;
                    for (int t = 0; t < tgroup; t++) o[t] += bias[j];
                }
            }
            off += ns;
        }
    }
    return 0;
}
