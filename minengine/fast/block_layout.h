/* The block formats' panels as panel_rows.c and dot8_rows.c read them: q4_1's and q8_0's groups.
 *
 * Included by both sources, so the layout is written down once (panel_kernels.py lays it out).
 */
#ifndef REQSCOPE_BLOCK_LAYOUT_H
#define REQSCOPE_BLOCK_LAYOUT_H

#define PW 8    /* columns per panel: one AVX2 vector */
#define GP 4    /* panels per group: the unit of work a thread takes */
#define RB 64   /* rows per block: a block of x stays in L2 while every panel passes over it */
#define QB 32   /* inputs per q8_0 scale */

/* Q4_1 LAYOUT. Panels in groups of GP (the last group may hold fewer, gp), each group one run of
 * blocks of QB inputs, a block of a group of gp panels gp * Q4_PANEL_BLOCK bytes:
 *   gp x 8 fp16 scales d (panel after panel), gp x 8 fp16 minimums m, then the block's 16 input
 *   pairs, each gp x 8 bytes (panel after panel): byte c of a panel's 8 holds its column c at the
 *   pair's even input (low nibble) and odd one (high).
 * Every group before the last is whole, so group g starts g * GP * (K / QB) * Q4_PANEL_BLOCK bytes in. */
#define Q4_PANEL_BLOCK (2 * PW * 2 + QB / 2 * PW)  /* 160 bytes: a panel's d, m and 32 x 8 nibbles */
#define Q4_GROUP(Q, g, K) ((Q) + (g) * GP * ((K) / QB) * Q4_PANEL_BLOCK)
#define Q4_BLOCK(G, gp, kb) ((G) + ((kb) / QB) * (gp) * Q4_PANEL_BLOCK)
/* Q8_0 LAYOUT, the same way: a block of a group of gp panels is gp x 8 float32 scales (panel after
 * panel), then its 32 inputs, each gp x 8 int8 (panel after panel): gp * Q8_PANEL_BLOCK bytes. */
#define Q8_PANEL_BLOCK (PW * 4 + QB * PW)  /* 288 bytes: a panel's 8 scales and 32 x 8 weights */
#define Q8_GROUP(Q, g, K) ((Q) + (g) * GP * ((K) / QB) * Q8_PANEL_BLOCK)
#define Q8_BLOCK(G, gp, kb) ((G) + ((kb) / QB) * (gp) * Q8_PANEL_BLOCK)
/* Panel j's 8 weights at input i of block blk of gp panels. */
#define Q8_AT(blk, gp, i, j) ((const int8_t *)(blk) + (gp) * PW * 4 + (i) * (gp) * PW + (j) * PW)
/* Panel j's 8 bytes of input pair i (inputs 2i, 2i + 1 of the block) in block blk of gp panels. */
#define Q4_PAIR(blk, gp, i2, j) ((blk) + (gp) * 2 * PW * 2 + ((i2) / 2) * (gp) * PW + (j) * PW)
#endif
