/* attention_rows.c's arguments and entry point, shared with decode_layers.c. */
#ifndef REQSCOPE_ATTENTION_ROWS_H
#define REQSCOPE_ATTENTION_ROWS_H

/* The arguments of one call: set once per step (shapes, indices), per layer (pointers). */
typedef struct {
    long rows, hq, hkv, d;     /* rows of queries; query and KV heads; head size */
    float scale;               /* applied to q.k */
    int threads;
    const float *q;            /* row r's heads at q + q_at[r] * q_rs, heads d apart */
    long q_rs;
    const long *q_at;          /* NULL: row r is q's row r */
    const float *k, *v;        /* the rows' new K/V, written before attending; k NULL: none */
    long k_rs, v_rs;
    const long *kv_at;         /* NULL: row r is k's and v's row r */
    const long *slots;         /* the cache position each row's new K/V go to */
    float *kc, *vc;            /* the cache: head h, position p at kc + h * kc_hs + p * d */
    long kc_hs, vc_hs;
    const long *pos;           /* row r's positions: pos[ends[r-1] .. ends[r]); NULL: 0 .. length - 1 */
    const long *ends;
    float *out;                /* row r's attended heads at out + r * out_rs, heads d apart */
    long out_rs;
} AttendArgs;

void attend_rows(const AttendArgs *a);
/* Inside a parallel region every thread enters (decode_layers.c): each thread's scores room, in floats,
 * and its share of the units, taken from *taken (0 before the first thread takes one). */
long attend_scratch(const AttendArgs *a);
void attend_units(const AttendArgs *a, long *taken, float *s);

#endif
