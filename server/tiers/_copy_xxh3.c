/* kvtier.server.tiers._recordio, part 2: one pass that copies a record and computes its xxh3_64.
 *
 * The disk tier's read copies each record out of LMDB's map (memory the record has not been in since
 * it was written: it comes from DRAM) and checks its xxh3_64. Copying first and hashing the copy
 * afterwards reads the bytes twice: the copy runs at DRAM speed and the hash, from L2, adds ~30%
 * (BENCHMARKS.md, fix 20: 194 KB records, 15.6 us the copy alone, 21.9 us copy then hash). Here each
 * 64-byte stripe is loaded once, stored to the destination and folded into xxh3's accumulators from
 * the same registers, with a prefetch 1 KiB ahead: 1.05-1.09x the copy alone.
 *
 * The result is XXH3_64bits (seed 0, the default secret) of the source with 8 bytes at `zero_at`
 * read as zeros (the record's checksum field): the long-input algorithm of xxHash 0.8
 * (XXH3_hashLong_64b: 64-byte stripes, a scramble every 16 stripes, the last stripe at len - 64,
 * mergeAccs), written with AVX2 intrinsics; the secret, initial accumulators and the final merge
 * are the library's own (xxhash.h inlined). Tests compare it with the library on every length class
 * and with the field at every offset.
 *
 * Only for inputs longer than 240 bytes (shorter ones take xxh3's other paths: the caller hashes
 * them with the library) and only where the CPU has AVX2 (kv_copy_xxh3_available()).
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "_copy_xxh3.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define XXH_INLINE_ALL
#include <xxhash.h>

#define STRIPE 64
#define PREFETCH_AHEAD 1024 /* bytes: measured best of 0-4096 on the 2-core EPYC (fix 20) */

int kv_copy_xxh3_available(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") ? 1 : 0;
}

/* xxh3's accumulate_512 on a stripe already in registers (d0, d1) with the secret at sec */
__attribute__((target("avx2"))) static inline void accumulate(__m256i *a0, __m256i *a1, __m256i d0, __m256i d1,
                                                              const unsigned char *sec) {
    __m256i k0 = _mm256_loadu_si256((const __m256i *)sec), k1 = _mm256_loadu_si256((const __m256i *)(sec + 32));
    __m256i dk0 = _mm256_xor_si256(d0, k0), dk1 = _mm256_xor_si256(d1, k1);
    __m256i p0 = _mm256_mul_epu32(dk0, _mm256_shuffle_epi32(dk0, _MM_SHUFFLE(0, 3, 0, 1)));
    __m256i p1 = _mm256_mul_epu32(dk1, _mm256_shuffle_epi32(dk1, _MM_SHUFFLE(0, 3, 0, 1)));
    *a0 = _mm256_add_epi64(p0, _mm256_add_epi64(*a0, _mm256_shuffle_epi32(d0, _MM_SHUFFLE(1, 0, 3, 2))));
    *a1 = _mm256_add_epi64(p1, _mm256_add_epi64(*a1, _mm256_shuffle_epi32(d1, _MM_SHUFFLE(1, 0, 3, 2))));
}

/* xxh3's scrambleAcc on one 32-byte half of the accumulators */
__attribute__((target("avx2"))) static inline __m256i scramble(__m256i a, const unsigned char *sec) {
    const __m256i prime32 = _mm256_set1_epi32((int)XXH_PRIME32_1);
    __m256i dk = _mm256_xor_si256(_mm256_xor_si256(a, _mm256_srli_epi64(a, 47)), _mm256_loadu_si256((const __m256i *)sec));
    __m256i hi = _mm256_shuffle_epi32(dk, _MM_SHUFFLE(0, 3, 0, 1));
    return _mm256_add_epi64(_mm256_mul_epu32(dk, prime32), _mm256_slli_epi64(_mm256_mul_epu32(hi, prime32), 32));
}

__attribute__((target("avx2"))) uint64_t kv_copy_xxh3(void *dst_, const void *src_, size_t len, size_t zero_at) {
    unsigned char *dst = dst_;
    const unsigned char *src = src_;
    const unsigned char *secret = XXH3_kSecret;
    const size_t secret_size = XXH_SECRET_DEFAULT_SIZE;
    const size_t per_block = (secret_size - STRIPE) / XXH_SECRET_CONSUME_RATE; /* 16 stripes */
    const size_t block_len = STRIPE * per_block;
    const size_t nb_blocks = (len - 1) / block_len;
    XXH_ALIGN(32) uint64_t acc[XXH_ACC_NB] = XXH3_INIT_ACC;
    __m256i a0 = _mm256_load_si256((const __m256i *)acc), a1 = _mm256_load_si256((const __m256i *)(acc + 4));
    /* the field read as zeros lies in the first stripe */
    XXH_ALIGN(32) unsigned char mask[STRIPE];
    memset(mask, 0xff, sizeof mask);
    memset(mask + zero_at, 0, 8);
    const __m256i m0 = _mm256_load_si256((const __m256i *)mask), m1 = _mm256_load_si256((const __m256i *)(mask + 32));
    size_t off = 0;
    for (size_t b = 0; b <= nb_blocks; b++) {
        size_t stripes = b < nb_blocks ? per_block : ((len - 1) - block_len * nb_blocks) / STRIPE;
        for (size_t s = 0; s < stripes; s++, off += STRIPE) {
            _mm_prefetch((const char *)src + off + PREFETCH_AHEAD, _MM_HINT_T0);
            __m256i d0 = _mm256_loadu_si256((const __m256i *)(src + off));
            __m256i d1 = _mm256_loadu_si256((const __m256i *)(src + off + 32));
            _mm256_storeu_si256((__m256i *)(dst + off), d0);
            _mm256_storeu_si256((__m256i *)(dst + off + 32), d1);
            if (off == 0) {
                d0 = _mm256_and_si256(d0, m0);
                d1 = _mm256_and_si256(d1, m1);
            }
            accumulate(&a0, &a1, d0, d1, secret + s * XXH_SECRET_CONSUME_RATE);
        }
        if (b < nb_blocks) {
            a0 = scramble(a0, secret + secret_size - STRIPE);
            a1 = scramble(a1, secret + secret_size - STRIPE + 32);
        }
    }
    memcpy(dst + off, src + off, len - off); /* the bytes after the last whole stripe */
    {   /* the last stripe (overlapping the one before), from the copy, which is in L1 */
        const unsigned char *p = dst + len - STRIPE;
        accumulate(&a0, &a1, _mm256_loadu_si256((const __m256i *)p), _mm256_loadu_si256((const __m256i *)(p + 32)),
                   secret + secret_size - STRIPE - 7);
    }
    _mm256_store_si256((__m256i *)acc, a0);
    _mm256_store_si256((__m256i *)(acc + 4), a1);
    return XXH3_mergeAccs(acc, secret + 11, (uint64_t)len * XXH_PRIME64_1);
}

#else

int kv_copy_xxh3_available(void) { return 0; }

uint64_t kv_copy_xxh3(void *dst, const void *src, size_t len, size_t zero_at) {
    (void)dst, (void)src, (void)len, (void)zero_at;
    return 0; /* never called: kv_copy_xxh3_available() is 0 */
}

#endif
