/*
 * Byte-moving kernels for hicache_async: xxh3-64 computed while the bytes are copied, page
 * reads and writes that checksum on the way, and span copies with streaming stores.
 *
 * Why native: on the paths that move whole pages (storage reads and writes, host <-> device
 * copies on a CPU) a separate checksum pass reads every byte a second time, and a Python loop
 * over many spans takes the GIL between them. Here one pass reads each byte once, hashes it
 * from registers and stores it, with the GIL released for the whole call.
 *
 * The hash is XXH3-64 with seed 0 and the default secret, implemented from the published
 * specification (doc/xxhash_spec.md of the xxHash project); the test suite checks it against
 * python-xxhash for every length class and arbitrary segmentations.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <stdint.h>
#include <string.h>
#include <unistd.h>
#include <sys/types.h>
#include <sys/uio.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define HC_X86 1
#else
#define HC_X86 0
#endif

/* ---- XXH3-64 constants (specification) ---------------------------------------------------- */

#define P32_1 0x9E3779B1U
#define P32_2 0x85EBCA77U
#define P32_3 0xC2B2AE3DU
#define P64_1 0x9E3779B185EBCA87ULL
#define P64_2 0xC2B2AE3D27D4EB4FULL
#define P64_3 0x165667B19E3779F9ULL
#define P64_4 0x85EBCA77C2B2AE63ULL
#define P64_5 0x27D4EB2F165667C5ULL
#define PMX_1 0x165667919E3779F9ULL
#define PMX_2 0x9FB21C651E98DF25ULL

#define SECRET_LEN 192
#define STRIPE 64
#define STRIPES_PER_BLOCK ((SECRET_LEN - STRIPE) / 8) /* 16 */
#define SMALL_MAX 240

static const uint8_t SECRET[SECRET_LEN] = {
    0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c, 0xf7, 0x21, 0xad, 0x1c,
    0xde, 0xd4, 0x6d, 0xe9, 0x83, 0x90, 0x97, 0xdb, 0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3, 0x67, 0x1f,
    0xcb, 0x79, 0xe6, 0x4e, 0xcc, 0xc0, 0xe5, 0x78, 0x82, 0x5a, 0xd0, 0x7d, 0xcc, 0xff, 0x72, 0x21,
    0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43, 0x24, 0x8e, 0xe0, 0x35, 0x90, 0xe6, 0x81, 0x3a, 0x26, 0x4c,
    0x3c, 0x28, 0x52, 0xbb, 0x91, 0xc3, 0x00, 0xcb, 0x88, 0xd0, 0x65, 0x8b, 0x1b, 0x53, 0x2e, 0xa3,
    0x71, 0x64, 0x48, 0x97, 0xa2, 0x0d, 0xf9, 0x4e, 0x38, 0x19, 0xef, 0x46, 0xa9, 0xde, 0xac, 0xd8,
    0xa8, 0xfa, 0x76, 0x3f, 0xe3, 0x9c, 0x34, 0x3f, 0xf9, 0xdc, 0xbb, 0xc7, 0xc7, 0x0b, 0x4f, 0x1d,
    0x8a, 0x51, 0xe0, 0x4b, 0xcd, 0xb4, 0x59, 0x31, 0xc8, 0x9f, 0x7e, 0xc9, 0xd9, 0x78, 0x73, 0x64,
    0xea, 0xc5, 0xac, 0x83, 0x34, 0xd3, 0xeb, 0xc3, 0xc5, 0x81, 0xa0, 0xff, 0xfa, 0x13, 0x63, 0xeb,
    0x17, 0x0d, 0xdd, 0x51, 0xb7, 0xf0, 0xda, 0x49, 0xd3, 0x16, 0x55, 0x26, 0x29, 0xd4, 0x68, 0x9e,
    0x2b, 0x16, 0xbe, 0x58, 0x7d, 0x47, 0xa1, 0xfc, 0x8f, 0xf8, 0xb8, 0xd1, 0x7a, 0xd0, 0x31, 0xce,
    0x45, 0xcb, 0x3a, 0x8f, 0x95, 0x16, 0x04, 0x28, 0xaf, 0xd7, 0xfb, 0xca, 0xbb, 0x4b, 0x40, 0x7e,
};

/* Copy modes of the fused loops. */
enum { HASH_ONLY = 0, COPY = 1, COPY_STREAM = 2 };

/* The spec reads every word little-endian; the kernels are only built for little-endian CPUs. */
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "hicache_async kernels assume a little-endian CPU"
#endif

static inline uint64_t rd64(const uint8_t *p) { uint64_t v; memcpy(&v, p, 8); return v; }
static inline uint32_t rd32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }
static inline uint64_t rotl64(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }

static inline uint64_t mul128_fold64(uint64_t a, uint64_t b) {
    __uint128_t p = (__uint128_t)a * b;
    return (uint64_t)p ^ (uint64_t)(p >> 64);
}

static inline uint64_t avalanche_xxh64(uint64_t x) {
    x ^= x >> 33;
    x *= P64_2;
    x ^= x >> 29;
    x *= P64_3;
    x ^= x >> 32;
    return x;
}

static inline uint64_t avalanche_xxh3(uint64_t x) {
    x ^= x >> 37;
    x *= PMX_1;
    x ^= x >> 32;
    return x;
}

static inline uint64_t mix16(const uint8_t *data, const uint8_t *sec) {
    return mul128_fold64(rd64(data) ^ rd64(sec), rd64(data + 8) ^ rd64(sec + 8));
}

/* Inputs of at most 240 bytes, whole (seed 0). */
static uint64_t xxh3_small(const uint8_t *in, size_t len) {
    if (len == 0) {
        return avalanche_xxh64(rd64(SECRET + 56) ^ rd64(SECRET + 64));
    }
    if (len <= 3) {
        uint32_t combined = ((uint32_t)in[len - 1]) | ((uint32_t)len << 8) |
                            ((uint32_t)in[0] << 16) | ((uint32_t)in[len >> 1] << 24);
        uint64_t value = (uint64_t)(rd32(SECRET) ^ rd32(SECRET + 4)) ^ (uint64_t)combined;
        return avalanche_xxh64(value);
    }
    if (len <= 8) {
        uint64_t first = rd32(in), last = rd32(in + len - 4);
        uint64_t combined = last | (first << 32);
        uint64_t value = (rd64(SECRET + 8) ^ rd64(SECRET + 16)) ^ combined;
        value ^= rotl64(value, 49) ^ rotl64(value, 24);
        value *= PMX_2;
        value ^= (value >> 35) + len;
        value *= PMX_2;
        value ^= value >> 28;
        return value;
    }
    if (len <= 16) {
        uint64_t low = (rd64(SECRET + 24) ^ rd64(SECRET + 32)) ^ rd64(in);
        uint64_t high = (rd64(SECRET + 40) ^ rd64(SECRET + 48)) ^ rd64(in + len - 8);
        uint64_t value = len + __builtin_bswap64(low) + high + mul128_fold64(low, high);
        return avalanche_xxh3(value);
    }
    uint64_t acc = (uint64_t)len * P64_1;
    if (len <= 128) {
        size_t rounds = ((len - 1) >> 5) + 1;
        for (size_t i = rounds; i-- > 0;) {
            acc += mix16(in + 16 * i, SECRET + 32 * i);
            acc += mix16(in + len - 16 * i - 16, SECRET + 32 * i + 16);
        }
        return avalanche_xxh3(acc);
    }
    size_t chunks = len >> 4;
    for (size_t i = 0; i < 8; i++) acc += mix16(in + 16 * i, SECRET + 16 * i);
    acc = avalanche_xxh3(acc);
    for (size_t i = 8; i < chunks; i++) acc += mix16(in + 16 * i, SECRET + 16 * (i - 8) + 3);
    acc += mix16(in + len - 16, SECRET + 119);
    return avalanche_xxh3(acc);
}

/* ---- Streaming state ------------------------------------------------------------------------
 * Stripes are accumulated only once a byte is known to follow them: the spec treats the last
 * 64 bytes of the input specially, and a stream does not know where it ends. `buf` holds the
 * 1..64 bytes not yet accumulated, `last` the most recent accumulated stripe (the final stripe
 * may overlap it), `small` the first 240 bytes in case the whole input turns out that short.
 */
typedef struct {
    uint64_t acc[8];
    uint64_t total;
    size_t stripes; /* accumulated in the current block */
    size_t buf_len;
    uint8_t buf[STRIPE];
    uint8_t last[STRIPE];
    uint8_t small[SMALL_MAX];
} hstate;

static void hstate_init(hstate *s) {
    static const uint64_t init[8] = {P32_3, P64_1, P64_2, P64_3, P64_4, P32_2, P64_5, P32_1};
    memcpy(s->acc, init, sizeof init);
    s->total = 0;
    s->stripes = 0;
    s->buf_len = 0;
}

static void accumulate_scalar(uint64_t *acc, const uint8_t *stripe, const uint8_t *sec) {
    for (int i = 0; i < 8; i++) {
        uint64_t v = rd64(stripe + 8 * i);
        uint64_t k = v ^ rd64(sec + 8 * i);
        acc[i ^ 1] += v;
        acc[i] += (uint64_t)(uint32_t)k * (k >> 32);
    }
}

static void scramble_scalar(uint64_t *acc) {
    const uint8_t *sec = SECRET + SECRET_LEN - STRIPE;
    for (int i = 0; i < 8; i++) {
        uint64_t a = acc[i];
        a ^= a >> 47;
        a ^= rd64(sec + 8 * i);
        acc[i] = a * P32_1;
    }
}

/* `n` stripes of `src` into the accumulators, starting `*in_block` stripes into a block and
 * scrambling at every block end; the stripes are copied to `dst` as `mode` says. */
static void stripes_scalar(uint64_t *acc, size_t *in_block, const uint8_t *src, uint8_t *dst,
                           size_t n, int mode) {
    /* Hash the copy, not the source: the digest must be of the bytes the caller got, even if
     * the source changes meanwhile (memory another process may reuse). */
    if (mode != HASH_ONLY) {
        memcpy(dst, src, n * STRIPE);
        src = dst;
    }
    size_t b = *in_block;
    for (size_t j = 0; j < n; j++) {
        accumulate_scalar(acc, src + STRIPE * j, SECRET + 8 * b);
        if (++b == STRIPES_PER_BLOCK) {
            scramble_scalar(acc);
            b = 0;
        }
    }
    *in_block = b;
}

#if HC_X86
/* How a fused loop stores each stripe: not at all, plainly, or bypassing the cache with
 * whole-register or half-register streaming stores (which need that much alignment). */
enum { ST_NONE = 0, ST_PLAIN = 1, ST_STREAM = 2, ST_STREAM_HALF = 3 };

static int store_kind(int mode, const uint8_t *dst, uintptr_t whole, uintptr_t half) {
    if (mode == HASH_ONLY) return ST_NONE;
    if (mode == COPY_STREAM && ((uintptr_t)dst & (whole - 1)) == 0) return ST_STREAM;
    if (mode == COPY_STREAM && ((uintptr_t)dst & (half - 1)) == 0) return ST_STREAM_HALF;
    return ST_PLAIN;
}

/* Inlined once per store kind, so each loop is free of per-stripe branches. */
__attribute__((target("avx2"), always_inline)) static inline void
avx2_loop(uint64_t *acc, size_t *in_block, const uint8_t *src, uint8_t *dst, size_t n,
          const int kind) {
    __m256i a0 = _mm256_loadu_si256((const __m256i *)acc);
    __m256i a1 = _mm256_loadu_si256((const __m256i *)(acc + 4));
    const __m256i s0 = _mm256_loadu_si256((const __m256i *)(SECRET + SECRET_LEN - STRIPE));
    const __m256i s1 = _mm256_loadu_si256((const __m256i *)(SECRET + SECRET_LEN - 32));
    const __m256i prime = _mm256_set1_epi32((int)P32_1);
    size_t b = *in_block;
    while (n > 0) {
        size_t run = STRIPES_PER_BLOCK - b;
        if (run > n) run = n;
        const uint8_t *key = SECRET + 8 * b;
        for (size_t j = 0; j < run; j++) {
            __m256i d0 = _mm256_loadu_si256((const __m256i *)src);
            __m256i d1 = _mm256_loadu_si256((const __m256i *)(src + 32));
            __m256i k0 = _mm256_xor_si256(d0, _mm256_loadu_si256((const __m256i *)key));
            __m256i k1 = _mm256_xor_si256(d1, _mm256_loadu_si256((const __m256i *)(key + 32)));
            __m256i m0 = _mm256_mul_epu32(k0, _mm256_srli_epi64(k0, 32));
            __m256i m1 = _mm256_mul_epu32(k1, _mm256_srli_epi64(k1, 32));
            /* acc[i ^ 1] += lane i: swap the 64-bit halves of each 128-bit lane. */
            a0 = _mm256_add_epi64(a0, _mm256_add_epi64(m0, _mm256_shuffle_epi32(d0, 0x4E)));
            a1 = _mm256_add_epi64(a1, _mm256_add_epi64(m1, _mm256_shuffle_epi32(d1, 0x4E)));
            if (kind == ST_STREAM) {
                _mm256_stream_si256((__m256i *)dst, d0);
                _mm256_stream_si256((__m256i *)(dst + 32), d1);
            } else if (kind == ST_STREAM_HALF) {
                _mm_stream_si128((__m128i *)dst, _mm256_castsi256_si128(d0));
                _mm_stream_si128((__m128i *)(dst + 16), _mm256_extracti128_si256(d0, 1));
                _mm_stream_si128((__m128i *)(dst + 32), _mm256_castsi256_si128(d1));
                _mm_stream_si128((__m128i *)(dst + 48), _mm256_extracti128_si256(d1, 1));
            } else if (kind == ST_PLAIN) {
                _mm256_storeu_si256((__m256i *)dst, d0);
                _mm256_storeu_si256((__m256i *)(dst + 32), d1);
            }
            src += STRIPE;
            if (kind != ST_NONE) dst += STRIPE;
            key += 8;
        }
        n -= run;
        b += run;
        if (b == STRIPES_PER_BLOCK) {
            /* acc = (acc ^ acc >> 47 ^ secret) * PRIME32_1, a 64 x 32-bit multiply. */
            __m256i x0 = _mm256_xor_si256(_mm256_xor_si256(a0, _mm256_srli_epi64(a0, 47)), s0);
            __m256i x1 = _mm256_xor_si256(_mm256_xor_si256(a1, _mm256_srli_epi64(a1, 47)), s1);
            a0 = _mm256_add_epi64(
                _mm256_mul_epu32(x0, prime),
                _mm256_slli_epi64(_mm256_mul_epu32(_mm256_srli_epi64(x0, 32), prime), 32));
            a1 = _mm256_add_epi64(
                _mm256_mul_epu32(x1, prime),
                _mm256_slli_epi64(_mm256_mul_epu32(_mm256_srli_epi64(x1, 32), prime), 32));
            b = 0;
        }
    }
    *in_block = b;
    _mm256_storeu_si256((__m256i *)acc, a0);
    _mm256_storeu_si256((__m256i *)(acc + 4), a1);
}

__attribute__((target("avx2"))) static void stripes_avx2(uint64_t *acc, size_t *in_block,
                                                         const uint8_t *src, uint8_t *dst,
                                                         size_t n, int mode) {
    switch (store_kind(mode, dst, 32, 16)) {
        case ST_NONE: avx2_loop(acc, in_block, src, dst, n, ST_NONE); break;
        case ST_PLAIN: avx2_loop(acc, in_block, src, dst, n, ST_PLAIN); break;
        case ST_STREAM: avx2_loop(acc, in_block, src, dst, n, ST_STREAM); break;
        default: avx2_loop(acc, in_block, src, dst, n, ST_STREAM_HALF); break;
    }
}

__attribute__((target("avx2"))) static void copy_stream_avx2(uint8_t *dst, const uint8_t *src,
                                                             size_t n) {
    size_t head = (32 - ((uintptr_t)dst & 31)) & 31;
    if (head > n) head = n;
    memcpy(dst, src, head);
    size_t i = head;
    for (; i + 128 <= n; i += 128) {
        __m256i a = _mm256_loadu_si256((const __m256i *)(src + i));
        __m256i b = _mm256_loadu_si256((const __m256i *)(src + i + 32));
        __m256i c = _mm256_loadu_si256((const __m256i *)(src + i + 64));
        __m256i d = _mm256_loadu_si256((const __m256i *)(src + i + 96));
        _mm256_stream_si256((__m256i *)(dst + i), a);
        _mm256_stream_si256((__m256i *)(dst + i + 32), b);
        _mm256_stream_si256((__m256i *)(dst + i + 64), c);
        _mm256_stream_si256((__m256i *)(dst + i + 96), d);
    }
    memcpy(dst + i, src + i, n - i);
}
#endif

/* Instruction sets the fused loops can use. (An AVX-512 loop measured slower than AVX2 on the
 * Xeons here: every 64-byte secret load splits a cache line.) */
enum { SIMD_SCALAR = 0, SIMD_AVX2 = 1 };
static int simd_level = SIMD_SCALAR;

static int cpu_supports(int level) {
#if HC_X86
    if (level == SIMD_AVX2) return __builtin_cpu_supports("avx2");
#endif
    return level == SIMD_SCALAR;
}

static int best_simd(void) { return cpu_supports(SIMD_AVX2) ? SIMD_AVX2 : SIMD_SCALAR; }

static void stripes(uint64_t *acc, size_t *in_block, const uint8_t *src, uint8_t *dst,
                    size_t n, int mode) {
#if HC_X86
    if (simd_level == SIMD_AVX2) {
        stripes_avx2(acc, in_block, src, dst, n, mode);
        return;
    }
#endif
    stripes_scalar(acc, in_block, src, dst, n, mode);
}

/* Bytes whose copy would not pay for the streaming stores' fence stay in the cache. */
#define STREAM_MIN 4096

static void copy_bytes(uint8_t *dst, const uint8_t *src, size_t n, int mode) {
    int overlap = dst < src + n && src < dst + n;
#if HC_X86
    if (mode == COPY_STREAM && simd_level >= SIMD_AVX2 && n >= STREAM_MIN && !overlap) {
        copy_stream_avx2(dst, src, n);
        return;
    }
#endif
    (void)overlap;
    memmove(dst, src, n);
}

/* Consume `n` bytes of `src` into the hash, copying them to `dst` unless mode is HASH_ONLY.
 * When copying, the source is read once: the fused stripes hash the registers they store, and
 * every other byte the hash keeps is taken from `dst` after the copy, so the digest is of
 * exactly the bytes copied even if the source changes meanwhile. */
static void hstate_update(hstate *s, const uint8_t *src, uint8_t *dst, size_t n, int mode) {
    if (n == 0) return;
    int copying = mode != HASH_ONLY;
    const uint64_t before = s->total;
    const uint8_t *start = copying ? dst : src;
    const size_t count = n;
    s->total += n;
    if (s->buf_len > 0) {
        size_t take = STRIPE - s->buf_len;
        if (take > n) take = n;
        if (copying) memcpy(dst, src, take);
        memcpy(s->buf + s->buf_len, copying ? dst : src, take);
        s->buf_len += take;
        src += take;
        if (dst) dst += take;
        n -= take;
        if (n > 0) { /* else the buffer may hold the final stripe */
            stripes(s->acc, &s->stripes, s->buf, NULL, 1, HASH_ONLY);
            memcpy(s->last, s->buf, STRIPE);
            s->buf_len = 0;
        }
    }
    if (n > 0) {
        size_t whole = (n - 1) / STRIPE; /* stripes known not to be the last one */
        const uint8_t *p = src + whole * STRIPE;
        uint8_t *q = copying ? dst + whole * STRIPE : NULL;
        if (whole > 0) stripes(s->acc, &s->stripes, src, dst, whole, mode);
        size_t rest = n - whole * STRIPE; /* 1..64 */
        if (copying) {
            memcpy(q, p, rest);
            p = q;
        }
        if (whole > 0) memcpy(s->last, p - STRIPE, STRIPE);
        memcpy(s->buf, p, rest);
        s->buf_len = rest;
    }
    if (before < SMALL_MAX) {
        size_t keep = SMALL_MAX - (size_t)before;
        memcpy(s->small + before, start, keep < count ? keep : count);
    }
}

static uint64_t hstate_digest(const hstate *s) {
    if (s->total <= SMALL_MAX) return xxh3_small(s->small, (size_t)s->total);
    uint64_t acc[8];
    memcpy(acc, s->acc, sizeof acc);
    uint8_t final[STRIPE];
    /* The last 64 bytes of the input: the tail of the last accumulated stripe, then buf. */
    memcpy(final, s->last + s->buf_len, STRIPE - s->buf_len);
    memcpy(final + (STRIPE - s->buf_len), s->buf, s->buf_len);
    accumulate_scalar(acc, final, SECRET + SECRET_LEN - STRIPE - 7);
    uint64_t result = s->total * P64_1;
    for (int i = 0; i < 4; i++) {
        result += mul128_fold64(acc[2 * i] ^ rd64(SECRET + 11 + 16 * i),
                                acc[2 * i + 1] ^ rd64(SECRET + 11 + 16 * i + 8));
    }
    return avalanche_xxh3(result);
}

static inline void fence(int mode) {
#if HC_X86
    /* Streaming stores are weakly ordered: publish them before another thread reads. */
    if (mode == COPY_STREAM) _mm_sfence();
#else
    (void)mode;
#endif
}

/* ---- Buffer lists --------------------------------------------------------------------------- */

typedef struct {
    Py_buffer *views;
    Py_ssize_t count;
    Py_ssize_t total;
} buflist;

static void buflist_release(buflist *b) {
    if (b->views) {
        for (Py_ssize_t i = 0; i < b->count; i++) PyBuffer_Release(&b->views[i]);
        PyMem_Free(b->views);
    }
    b->views = NULL;
    b->count = 0;
}

/* Acquire every buffer of a sequence (contiguous; writable if asked). */
static int buflist_get(PyObject *seq, int writable, buflist *out, const char *what) {
    out->views = NULL;
    out->count = 0;
    out->total = 0;
    PyObject *fast = PySequence_Fast(seq, "expected a sequence of buffers");
    if (!fast) return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    out->views = PyMem_Calloc(n ? (size_t)n : 1, sizeof(Py_buffer));
    if (!out->views) {
        Py_DECREF(fast);
        PyErr_NoMemory();
        return -1;
    }
    PyObject **items = PySequence_Fast_ITEMS(fast);
    int flags = writable ? (PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) : PyBUF_C_CONTIGUOUS;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (PyObject_GetBuffer(items[i], &out->views[i], flags) < 0) {
            PyErr_Format(PyExc_BufferError, "%s[%zd] is not a contiguous%s buffer", what, i,
                         writable ? " writable" : "");
            buflist_release(out);
            Py_DECREF(fast);
            return -1;
        }
        out->count = i + 1;
        out->total += out->views[i].len;
    }
    Py_DECREF(fast);
    return 0;
}

/* Walks a buffer list as one stream of bytes. */
typedef struct {
    const buflist *b;
    Py_ssize_t index;
    Py_ssize_t offset;
} cursor;

static inline Py_ssize_t cursor_span(cursor *c, uint8_t **ptr) {
    while (c->index < c->b->count && c->offset == c->b->views[c->index].len) {
        c->index++;
        c->offset = 0;
    }
    if (c->index >= c->b->count) return 0;
    *ptr = (uint8_t *)c->b->views[c->index].buf + c->offset;
    return c->b->views[c->index].len - c->offset;
}

/* Copy (or only hash, dst NULL) the stream of `src` into `dst`; both hold `n` bytes. */
static void fused(hstate *s, buflist *dst, buflist *src, int mode) {
    cursor cs = {src, 0, 0}, cd = {dst, 0, 0};
    for (;;) {
        uint8_t *sp = NULL, *dp = NULL;
        Py_ssize_t n = cursor_span(&cs, &sp);
        if (n == 0) break;
        if (dst) {
            Py_ssize_t m = cursor_span(&cd, &dp);
            if (m < n) n = m;
            cd.offset += n;
        }
        hstate_update(s, sp, dp, (size_t)n, dst ? mode : HASH_ONLY);
        cs.offset += n;
    }
}

/* ---- Python functions ----------------------------------------------------------------------- */

PyDoc_STRVAR(xxh3_copy_doc,
             "xxh3_copy(dst, src, stream) -> int\n\n"
             "xxh3-64 of the bytes of the buffers in `src`, in order. Unless `dst` is None,\n"
             "they are copied into the buffers of `dst` (same total length) in the same pass,\n"
             "with streaming stores if `stream`. Runs without the GIL.");

static PyObject *py_xxh3_copy(PyObject *self, PyObject *args) {
    PyObject *dst_obj, *src_obj;
    int stream;
    if (!PyArg_ParseTuple(args, "OOp", &dst_obj, &src_obj, &stream)) return NULL;
    buflist src, dst;
    if (buflist_get(src_obj, 0, &src, "src") < 0) return NULL;
    int copy = dst_obj != Py_None;
    if (copy) {
        if (buflist_get(dst_obj, 1, &dst, "dst") < 0) {
            buflist_release(&src);
            return NULL;
        }
        if (dst.total != src.total) {
            PyErr_Format(PyExc_ValueError, "dst holds %zd bytes, src %zd", dst.total, src.total);
            buflist_release(&src);
            buflist_release(&dst);
            return NULL;
        }
    }
    hstate s;
    hstate_init(&s);
    int mode = stream ? COPY_STREAM : COPY;
    Py_BEGIN_ALLOW_THREADS
    fused(&s, copy ? &dst : NULL, &src, mode);
    fence(mode);
    Py_END_ALLOW_THREADS
    uint64_t digest = hstate_digest(&s);
    buflist_release(&src);
    if (copy) buflist_release(&dst);
    return PyLong_FromUnsignedLongLong(digest);
}

PyDoc_STRVAR(pread_xxh3_doc,
             "pread_xxh3(fd, offset, dst, bounce) -> (nread, digest)\n\n"
             "Read from `fd` at `offset` until the buffers of `dst` are full or the file ends,\n"
             "through `bounce` (a writable buffer the size of a few hundred KiB, so that the\n"
             "kernel copies into the CPU cache), copying each piece into `dst` with streaming\n"
             "stores while hashing it. `digest` is the xxh3-64 of the `nread` bytes read.\n"
             "Raises OSError on a read error. Runs without the GIL.");

static PyObject *py_pread_xxh3(PyObject *self, PyObject *args) {
    int fd;
    long long offset;
    PyObject *dst_obj, *bounce_obj;
    if (!PyArg_ParseTuple(args, "iLOO", &fd, &offset, &dst_obj, &bounce_obj)) return NULL;
    if (offset < 0) {
        PyErr_SetString(PyExc_ValueError, "offset must be >= 0");
        return NULL;
    }
    Py_buffer bounce;
    if (PyObject_GetBuffer(bounce_obj, &bounce, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
        return NULL;
    }
    if (bounce.len < STRIPE) {
        PyBuffer_Release(&bounce);
        PyErr_SetString(PyExc_ValueError, "bounce buffer must hold at least 64 bytes");
        return NULL;
    }
    buflist dst;
    if (buflist_get(dst_obj, 1, &dst, "dst") < 0) {
        PyBuffer_Release(&bounce);
        return NULL;
    }
    hstate s;
    hstate_init(&s);
    Py_ssize_t done = 0;
    int err = 0;
    Py_BEGIN_ALLOW_THREADS
    cursor cd = {&dst, 0, 0};
    while (done < dst.total) {
        Py_ssize_t want = dst.total - done;
        if (want > bounce.len) want = bounce.len;
        ssize_t got = pread(fd, bounce.buf, (size_t)want, (off_t)(offset + done));
        if (got < 0) {
            if (errno == EINTR) continue;
            err = errno;
            break;
        }
        if (got == 0) break;
        const uint8_t *p = bounce.buf;
        Py_ssize_t left = got;
        while (left > 0) {
            uint8_t *dp = NULL;
            Py_ssize_t m = cursor_span(&cd, &dp);
            if (m > left) m = left;
            hstate_update(&s, p, dp, (size_t)m, COPY_STREAM);
            cd.offset += m;
            p += m;
            left -= m;
        }
        done += got;
    }
    fence(COPY_STREAM);
    Py_END_ALLOW_THREADS
    buflist_release(&dst);
    PyBuffer_Release(&bounce);
    if (err) {
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return Py_BuildValue("nK", done, (unsigned long long)hstate_digest(&s));
}

#define IOV_BATCH 64

PyDoc_STRVAR(xxh3_pwrite_doc,
             "xxh3_pwrite(fd, offset, src, chunk) -> int\n\n"
             "Write the buffers of `src` to `fd` from `offset`, hashing each piece of at most\n"
             "`chunk` bytes just before the kernel copies it (so the copy reads the cache, not\n"
             "memory). Returns the xxh3-64 of everything written. Raises OSError on a write\n"
             "error (the file is then partly written). Runs without the GIL.");

static PyObject *py_xxh3_pwrite(PyObject *self, PyObject *args) {
    int fd;
    long long offset;
    Py_ssize_t chunk;
    PyObject *src_obj;
    if (!PyArg_ParseTuple(args, "iLOn", &fd, &offset, &src_obj, &chunk)) return NULL;
    if (offset < 0 || chunk < 1) {
        PyErr_SetString(PyExc_ValueError, "offset must be >= 0 and chunk >= 1");
        return NULL;
    }
    buflist src;
    if (buflist_get(src_obj, 0, &src, "src") < 0) return NULL;
    hstate s;
    hstate_init(&s);
    int err = 0;
    Py_BEGIN_ALLOW_THREADS
    cursor cs = {&src, 0, 0};
    off_t at = (off_t)offset;
    for (;;) {
        struct iovec iov[IOV_BATCH];
        int count = 0;
        Py_ssize_t size = 0;
        while (count < IOV_BATCH && size < chunk) {
            uint8_t *sp = NULL;
            Py_ssize_t n = cursor_span(&cs, &sp);
            if (n == 0) break;
            if (n > chunk - size) n = chunk - size;
            hstate_update(&s, sp, NULL, (size_t)n, HASH_ONLY);
            iov[count].iov_base = sp;
            iov[count].iov_len = (size_t)n;
            count++;
            size += n;
            cs.offset += n;
        }
        if (count == 0) break;
        int first = 0;
        while (first < count) {
            ssize_t put = pwritev(fd, iov + first, count - first, at);
            if (put < 0) {
                if (errno == EINTR) continue;
                err = errno;
                break;
            }
            if (put == 0) {
                err = EIO;
                break;
            }
            at += put;
            while (first < count && (size_t)put >= iov[first].iov_len) {
                put -= (ssize_t)iov[first].iov_len;
                first++;
            }
            if (first < count) {
                iov[first].iov_base = (uint8_t *)iov[first].iov_base + put;
                iov[first].iov_len -= (size_t)put;
            }
        }
        if (err) break;
    }
    Py_END_ALLOW_THREADS
    buflist_release(&src);
    if (err) {
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return PyLong_FromUnsignedLongLong(hstate_digest(&s));
}

PyDoc_STRVAR(copy_at_doc,
             "copy_at(dst_addr, src_addr, spans, stream) -> None\n\n"
             "For each (src offset, dst offset, length) row of `spans` (int64, C-contiguous,\n"
             "n x 3), copy that many bytes from src_addr + offset to dst_addr + offset, with\n"
             "streaming stores if `stream`. The caller keeps the memory alive and has checked\n"
             "every span against it (the CPU copy engine's plans). Runs without the GIL.");

static PyObject *py_copy_at(PyObject *self, PyObject *args) {
    unsigned long long dst_addr, src_addr;
    PyObject *spans_obj;
    int stream;
    if (!PyArg_ParseTuple(args, "KKOp", &dst_addr, &src_addr, &spans_obj, &stream)) return NULL;
    Py_buffer spans;
    if (PyObject_GetBuffer(spans_obj, &spans, PyBUF_C_CONTIGUOUS) < 0) return NULL;
    if (spans.len % (3 * (Py_ssize_t)sizeof(int64_t)) != 0) {
        PyBuffer_Release(&spans);
        PyErr_SetString(PyExc_ValueError, "spans must be int64 rows of (src, dst, length)");
        return NULL;
    }
    const int64_t *rows = spans.buf;
    Py_ssize_t n = spans.len / (3 * (Py_ssize_t)sizeof(int64_t));
    int mode = stream ? COPY_STREAM : COPY;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        copy_bytes((uint8_t *)(uintptr_t)dst_addr + rows[3 * i + 1],
                   (const uint8_t *)(uintptr_t)src_addr + rows[3 * i], (size_t)rows[3 * i + 2],
                   mode);
    }
    fence(mode);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&spans);
    Py_RETURN_NONE;
}

static const char *const SIMD_NAMES[] = {"scalar", "avx2"};

PyDoc_STRVAR(simd_doc,
             "simd() -> str\n\nThe instruction set the kernels use: 'avx2' or 'scalar'.");

static PyObject *py_simd(PyObject *self, PyObject *noargs) {
    return PyUnicode_FromString(SIMD_NAMES[simd_level]);
}

PyDoc_STRVAR(set_simd_doc,
             "set_simd(name) -> None\n\nUse the named instruction set ('avx2' or 'scalar', for\n"
             "tests and measurements), or 'auto' for the fastest one. Raises ValueError for a\n"
             "set the CPU lacks.");

static PyObject *py_set_simd(PyObject *self, PyObject *arg) {
    const char *name = PyUnicode_AsUTF8(arg);
    if (!name) return NULL;
    if (strcmp(name, "auto") == 0) {
        simd_level = best_simd();
        Py_RETURN_NONE;
    }
    for (int level = SIMD_SCALAR; level <= SIMD_AVX2; level++) {
        if (strcmp(name, SIMD_NAMES[level]) == 0) {
            if (!cpu_supports(level)) {
                PyErr_Format(PyExc_ValueError, "this CPU does not support %s", name);
                return NULL;
            }
            simd_level = level;
            Py_RETURN_NONE;
        }
    }
    PyErr_Format(PyExc_ValueError, "simd must be 'auto', 'avx2' or 'scalar', got %R",
                 arg);
    return NULL;
}

static PyMethodDef methods[] = {
    {"xxh3_copy", py_xxh3_copy, METH_VARARGS, xxh3_copy_doc},
    {"pread_xxh3", py_pread_xxh3, METH_VARARGS, pread_xxh3_doc},
    {"xxh3_pwrite", py_xxh3_pwrite, METH_VARARGS, xxh3_pwrite_doc},
    {"copy_at", py_copy_at, METH_VARARGS, copy_at_doc},
    {"simd", py_simd, METH_NOARGS, simd_doc},
    {"set_simd", py_set_simd, METH_O, set_simd_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_kernels", "Byte-moving kernels of hicache_async.", -1, methods,
};

PyMODINIT_FUNC PyInit__kernels(void) {
#if HC_X86
    __builtin_cpu_init();
#endif
    simd_level = best_simd();
    return PyModule_Create(&module);
}
