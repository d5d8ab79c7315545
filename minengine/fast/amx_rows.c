/* dot8_rows.c's int16 products on AMX tiles: the same integer sums, 16 rows at a time, the same bits.
 *
 * dot8_rows.c's VNNI tiles spend most of a shared step's time in VPDPWSSD: 32 multiply-adds an
 * instruction. An AMX tile dot product (TDPBUUD, TDPBSUD) multiplies a 16-row tile of bytes by a
 * 16-column tile, 16 x 16 x 64 multiply-adds an instruction. It takes bytes, not int16, so each
 * rounded row is split once into its low bytes (unsigned) and high bytes (signed): x = 256 hi + lo,
 * and a block's sum S = 256 S_hi + S_lo, computed by two tile products, is the same exact integer
 * dot8_rows.c sums. What follows is dot8_rows.c's float chain, block by block in order,
 *
 *   acc = fma((float)S, d[c] * dx[r], acc),  then q4_1's  acc = fma(m[c], sx[r], acc),
 *
 * in the same instructions, so a row's outputs are the same bits on either path, alone or beside
 * any rows (the tests hold the two against each other). That chain, two FMAs per row, column and
 * block of 32 inputs, is now most of the work, so the tiles gain far less than their width
 * (measured: docs/performance.md, "AMX tiles").
 *
 * The B tile of a half group (16 columns, 32 inputs) is the DOT8 block's bytes as they lie: q8_0's
 * 8 quads x 64 bytes (weights + 128, unsigned) load straight; q4_1's nibbles are split into the
 * same shape first (inputs 0..15 low, 16..31 high). Tiles: 0-3 the sums (lo and hi of each half),
 * 4-5 the rows' low and high bytes, 6-7 the two halves' weights.
 *
 * Linux hands a process the tile state only when asked (arch_prctl ARCH_REQ_XCOMP_PERM); `amx_ready`
 * asks once. Built only where the compiler was given -mamx-int8 (cpu_kernels.py, on a CPU that has it),
 * or with the tile instructions emulated (below).
 */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "amx_rows.h"
#include "block_layout.h"

#define DW (GP * PW)
#define D4_BLOCK (DW * 2 * 2 + DW * QB / 2)
#define D8_BLOCK (DW * 4 + DW * QB)

static int enabled = 1;
void amx_use(int on) { enabled = on; }

/* Where the tile instructions come from: the CPU's (-mamx-int8), or C's (`REQSCOPE_AMX=emulate`:
 * amx_emulated.h, this file's every other line as on AMX, for the tests on a CPU without tiles). */
#if defined(REQSCOPE_AMX_EMULATED) && defined(__AVX512BW__)
#include "amx_emulated.h"
#define AMX_TILES 1
#define AMX_EMULATED 1
#elif defined(__AMX_INT8__) && defined(__AMX_TILE__) && defined(__AVX512BW__)
#define AMX_TILES 1
#define AMX_EMULATED 0
#else
#define AMX_TILES 0
#define AMX_EMULATED 0
#endif

int amx_emulated(void) { return AMX_EMULATED; }

#if AMX_TILES
int amx_built(void) { return 1; }

#if AMX_EMULATED
int amx_ready(void) { return 1; } /* no tile state to ask Linux for */
#else
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

int amx_ready(void) {
    static int ready = -1;
    if (ready < 0) {
        unsigned a, b, c, d;
        int tiles = __get_cpuid_count(7, 0, &a, &b, &c, &d) && (d & (1u << 24)) && (d & (1u << 25));
        ready = tiles && syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    }
    return ready;
}
#endif

int amx_on(void) { return enabled && amx_ready(); }

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;

/* The tiles as this file uses them: 0-3 sums (16 rows x 16 int32), 4-5 a block of 16 rows' bytes, 6-7
 * a half group's block (8 quads x 16 columns). A constant: gcc dropped the stores to a local one as
 * dead, not seeing LDTILECFG read them. */
static const TileConfig config = {
    .palette = 1,
    .colsb = {64, 64, 64, 64, QB, QB, 64, 64},
    .rows = {16, 16, 16, 16, 16, 16, QB / 4, QB / 4},
};

/* The calling thread's tiles as this file uses them (another library, oneDNN, may have set its own). */
void amx_begin(void) { _tile_loadconfig(&config); }

void amx_end(void) { _tile_release(); }

void amx_group(int q8, const uint8_t *lo, const int8_t *hi, const float *dx, const float *sx, const int32_t *n,
               long rows, long r0, long K, const uint8_t *G, float *y, long ldy, long columns, int stream) {
    long blocks = K / QB, block = q8 ? D8_BLOCK : D4_BLOCK;
    /* The rows' sums live here, 16 floats a row and half: y's rows are a whole row of the output
     * apart (12 KiB for gate_up), so they would all fall in one L1 set. */
    float acc[AMX_MAX_ROWS * DW] __attribute__((aligned(64)));
    uint8_t w[2][QB * 16] __attribute__((aligned(64)));
    int32_t s[4][256] __attribute__((aligned(64)));
    const __m512i nibble = _mm512_set1_epi8(15);
    memset(acc, 0, sizeof(float) * rows * DW);
    for (long b = 0; b < blocks; b++) {
        const uint8_t *blk = G + b * block;
        for (int at = 0; at < block; at += 64) _mm_prefetch((const char *)blk + 4 * block + at, _MM_HINT_T0);
        if (q8) {
            _tile_loadd(6, blk + DW * 4, 64);
            _tile_loadd(7, blk + DW * 4 + 512, 64);
        } else {
            for (int v = 0; v < 2; v++)
                for (int j4 = 0; j4 < 4; j4++) {
                    __m512i bits = _mm512_loadu_si512(blk + DW * 4 + v * 256 + j4 * 64);
                    _mm512_store_si512(w[v] + j4 * 64, _mm512_and_si512(bits, nibble));
                    _mm512_store_si512(w[v] + (4 + j4) * 64, _mm512_and_si512(_mm512_srli_epi16(bits, 4), nibble));
                }
            _tile_loadd(6, w[0], 64);
            _tile_loadd(7, w[1], 64);
        }
        __m512 d[2], m[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()}; /* m: q4_1's only */
        for (int v = 0; v < 2; v++) {
            if (q8) {
                d[v] = _mm512_loadu_ps((const float *)blk + 16 * v);
            } else {
                d[v] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + 32 * v)));
                m[v] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + 2 * DW + 32 * v)));
            }
        }
        for (long t0 = 0; t0 < rows; t0 += 16) {
            const long at = (r0 + t0) * K + b * QB;
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            _tile_loadd(4, lo + at, K);
            _tile_loadd(5, hi + at, K);
            _tile_dpbuud(0, 4, 6);
            _tile_dpbsud(1, 5, 6);
            _tile_dpbuud(2, 4, 7);
            _tile_dpbsud(3, 5, 7);
            _tile_stored(0, s[0], 64);
            _tile_stored(1, s[1], 64);
            _tile_stored(2, s[2], 64);
            _tile_stored(3, s[3], 64);
            long tile = rows - t0 < 16 ? rows - t0 : 16;
            for (long r = 0; r < tile; r++) {
                long row = (r0 + t0 + r) * blocks + b;
                __m512 dxr = _mm512_set1_ps(dx[row]);
                for (int v = 0; v < 2; v++) {
                    __m512i S = _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(s[2 * v + 1] + 16 * r), 8),
                                                 _mm512_load_si512(s[2 * v] + 16 * r));
                    if (q8) S = _mm512_sub_epi32(S, _mm512_set1_epi32(128 * n[row]));
                    float *o = acc + (t0 + r) * DW + 16 * v;
                    __m512 sum = _mm512_fmadd_ps(_mm512_cvtepi32_ps(S), _mm512_mul_ps(d[v], dxr), _mm512_load_ps(o));
                    if (!q8) sum = _mm512_fmadd_ps(m[v], _mm512_set1_ps(sx[row]), sum);
                    _mm512_store_ps(o, sum);
                }
            }
        }
    }
    if (stream && columns == DW && (((uintptr_t)y | (uintptr_t)(ldy * sizeof(float))) & 63) == 0) {
        for (long r = 0; r < rows; r++) {  /* whole lines, around the caches: y's old lines are never read */
            _mm512_stream_ps(y + r * ldy, _mm512_load_ps(acc + r * DW));
            _mm512_stream_ps(y + r * ldy + 16, _mm512_load_ps(acc + r * DW + 16));
        }
        _mm_sfence();  /* before another thread reads them */
        return;
    }
    for (long r = 0; r < rows; r++) memcpy(y + r * ldy, acc + r * DW, sizeof(float) * columns);
}
#else
int amx_built(void) { return 0; }
int amx_ready(void) { return 0; }
int amx_on(void) { return 0; }
void amx_begin(void) {}
void amx_end(void) {}
void amx_group(int q8, const uint8_t *lo, const int8_t *hi, const float *dx, const float *sx, const int32_t *n,
               long rows, long r0, long K, const uint8_t *G, float *y, long ldy, long columns, int stream) {
    (void)q8, (void)lo, (void)hi, (void)dx, (void)sx, (void)n, (void)rows, (void)r0, (void)K, (void)G, (void)y,
        (void)ldy, (void)columns, (void)stream;
}
#endif
