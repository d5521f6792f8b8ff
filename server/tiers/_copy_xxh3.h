/* One pass that copies a record and computes its xxh3_64 (_copy_xxh3.c). */
#ifndef KVTIER_COPY_XXH3_H
#define KVTIER_COPY_XXH3_H

#include <stddef.h>
#include <stdint.h>

/* Longer inputs than this take xxh3's long path, the only one kv_copy_xxh3 computes. */
#define KV_COPY_XXH3_MIN_LEN 241

/* Whether kv_copy_xxh3 can run here (an x86-64 CPU with AVX2). */
int kv_copy_xxh3_available(void);

/* Copy len bytes src -> dst (not overlapping) and return XXH3_64bits of src with the 8 bytes at
 * zero_at read as zeros. Needs len >= KV_COPY_XXH3_MIN_LEN, zero_at + 8 <= 64, and
 * kv_copy_xxh3_available(). */
uint64_t kv_copy_xxh3(void *dst, const void *src, size_t len, size_t zero_at);

#endif
