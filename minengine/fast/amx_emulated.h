/* AMX's tile instructions as amx_rows.c uses them, in plain C: its logic run on a CPU without tiles.
 *
 * Built in only where `REQSCOPE_AMX=emulate` asked for it (cpu_kernels.py adds -DREQSCOPE_AMX_EMULATED
 * and leaves out -mamx-*). Then amx_rows.c's every line runs as on a Xeon with AMX (the rows split
 * into bytes, the 64-row windows, the float chain, the streamed stores, the gated product's scratch)
 * except the tile instructions themselves, which run here, per Intel's pseudocode, one multiply-add at
 * a time: the tests hold that path to the VNNI tiles' bits on any AVX-512 VNNI CPU, and a prompt runs
 * many times slower than on either. A thread's tiles are thread-local, as a core's tile registers are
 * to its thread.
 */
#ifndef REQSCOPE_AMX_EMULATED_H
#define REQSCOPE_AMX_EMULATED_H
#include <stdint.h>
#include <string.h>

/* The tile configuration LDTILECFG reads: 64 bytes, palette 1. */
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} EmulatedTileConfig;

static __thread EmulatedTileConfig emulated_config;
static __thread uint8_t emulated_tiles[8][16][64]; /* 8 tiles of at most 16 rows of 64 bytes */

/* Where the CPU would fault (#GP at LDTILECFG, #UD at a tile product), the emulation traps too: palette 1 has
 * 8 tiles of at most 16 rows of 64 bytes, and a product's shapes must agree. */
static inline void emulated_check(int ok) {
    if (!ok) __builtin_trap();
}

static inline void emulated_loadconfig(const void *config) {
    memcpy(&emulated_config, config, sizeof emulated_config);
    emulated_check(emulated_config.palette == 1);
    for (int t = 0; t < 8; t++) emulated_check(emulated_config.rows[t] <= 16 && emulated_config.colsb[t] <= 64);
}

static inline void emulated_release(void) {
    memset(&emulated_config, 0, sizeof emulated_config);
    memset(emulated_tiles, 0, sizeof emulated_tiles);
}

static inline void emulated_zero(int t) {
    emulated_check(emulated_config.palette == 1);  /* no LDTILECFG yet, or released: the CPU faults */
    memset(emulated_tiles[t], 0, sizeof emulated_tiles[t]);
}

/* TILELOADD: the tile's rows, each its colsb bytes from base + row * stride; the rest of the tile zeroed. */
static inline void emulated_loadd(int t, const void *base, long stride) {
    emulated_zero(t);
    for (int r = 0; r < emulated_config.rows[t]; r++)
        memcpy(emulated_tiles[t][r], (const uint8_t *)base + r * stride, emulated_config.colsb[t]);
}

static inline void emulated_stored(int t, void *base, long stride) {
    emulated_check(emulated_config.palette == 1);
    for (int r = 0; r < emulated_config.rows[t]; r++)
        memcpy((uint8_t *)base + r * stride, emulated_tiles[t][r], emulated_config.colsb[t]);
}

/* TDPB[SU]UD: c's int32 [m][n] += the 4 byte products of a's dword [m][k] and b's dword [k][n], over k
 * (a's colsb / 4), a's bytes signed (`a_signed`) or unsigned, b's unsigned. Exact in int32 as on the
 * tiles (wrapping, which these products never reach). */
static inline void emulated_dp(int c, int a, int b, int a_signed) {
    int rows = emulated_config.rows[c], cols = emulated_config.colsb[c] / 4, ks = emulated_config.colsb[a] / 4;
    emulated_check(rows > 0 && rows == emulated_config.rows[a] && ks == emulated_config.rows[b]
                   && emulated_config.colsb[c] == emulated_config.colsb[b] && c != a && c != b && a != b);
    for (int m = 0; m < rows; m++) {
        int32_t *out = (int32_t *)emulated_tiles[c][m];
        for (int n = 0; n < cols; n++) {
            uint32_t sum = (uint32_t)out[n];
            for (int k = 0; k < ks; k++)
                for (int i = 0; i < 4; i++) {
                    uint8_t x = emulated_tiles[a][m][4 * k + i], w = emulated_tiles[b][k][4 * n + i];
                    int32_t xv = a_signed ? (int32_t)(int8_t)x : (int32_t)x;
                    sum += (uint32_t)(xv * (int32_t)w);
                }
            out[n] = (int32_t)sum;
        }
    }
}

/* The intrinsics' names (immintrin.h may define them as macros over the real instructions). */
#undef _tile_loadconfig
#undef _tile_release
#undef _tile_zero
#undef _tile_loadd
#undef _tile_stored
#undef _tile_dpbuud
#undef _tile_dpbsud
#define _tile_loadconfig(config) emulated_loadconfig(config)
#define _tile_release() emulated_release()
#define _tile_zero(t) emulated_zero(t)
#define _tile_loadd(t, base, stride) emulated_loadd(t, base, stride)
#define _tile_stored(t, base, stride) emulated_stored(t, base, stride)
#define _tile_dpbuud(c, a, b) emulated_dp(c, a, b, 0)
#define _tile_dpbsud(c, a, b) emulated_dp(c, a, b, 1)
#endif
