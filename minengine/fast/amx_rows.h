/* amx_rows.c's entry points, for dot8_rows.c. */
#ifndef REQSCOPE_AMX_ROWS_H
#define REQSCOPE_AMX_ROWS_H
#include <stdint.h>

#define AMX_ROWS 16     /* from this many rows a product takes the tiles (below, VNNI is as fast) */
#define AMX_MAX_ROWS 64 /* rows of one `amx_group` call: its sums stay in L1 */

int amx_built(void);    /* compiled with the tiles (-mamx-int8), or their emulation */
int amx_emulated(void); /* the tile instructions emulated in C (`REQSCOPE_AMX=emulate`: amx_emulated.h) */
int amx_ready(void);    /* the CPU has AMX-INT8 and Linux granted this process the tile state */
int amx_on(void);       /* amx_ready, and not turned off (`amx_use`) */
void amx_use(int on);
void amx_begin(void);   /* the calling thread's tile configuration; then amx_group calls; then amx_end */
void amx_end(void);
/* Rows [r0, r0 + rows) (rows <= AMX_MAX_ROWS) of a group's DW columns into y, which holds row r0 first
 * (ldy apart; the first `columns` only), as dot8_rows.c's VNNI tiles take theirs: lo/hi the rounded rows
 * split into bytes [>= r0 + rows rounded up to 16][K], dx/sx/n their block scales (dot8_rows.c's Acts),
 * G the group's DOT8 blocks, q8_0's (`q8`) or q4_1's. With `stream` (a y too large to stay in the
 * caches) whole lines of y are written around the caches. */
void amx_group(int q8, const uint8_t *lo, const int8_t *hi, const float *dx, const float *sx, const int32_t *n,
               long rows, long r0, long K, const uint8_t *G, float *y, long ldy, long columns, int stream);
#define AMX_STREAM_BYTES (1L << 20) /* a y from this size is written around the caches */
#endif
