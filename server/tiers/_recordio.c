/* kvtier.server.tiers._recordio: the disk tier's read of a window of records in one native call.
 *
 * copy_check(srcs, dsts, verify) copies each source record (a buffer: LMDB's view of the value in its
 * map) into its destination buffer and, with verify, checks it as record.verify_record does: magic,
 * format version, lengths against the header, src_loc bytes (all read from the source first), and
 * xxh3_64 over the whole record with the checksum field read as zeros (record.py's docstring). The
 * copy and the hash are one pass over the bytes where the CPU has AVX2 (_copy_xxh3.c); elsewhere the
 * record is copied, the field zeroed in the copy for one hash by Debian's libxxhash and put back.
 * The GIL is released for the whole window.
 *
 * Every destination is checked to be large enough before anything is copied (ValueError otherwise).
 * Returns a list with one int per record: n_tokens (>= 0) when the record is good (with verify False:
 * 0), NONE_SOURCE (-1) where the source is None, or a negative code naming the failed check (the
 * destination then holds the copied bytes, which the caller must not hand out).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#include <xxhash.h>
/* the library's run-time dispatch to the CPU's widest vectors (AVX2/AVX-512): XXH3_64bits itself is
 * its SSE2 build, ~8 GB/s here against ~40 for the dispatched one */
#include <xxh_x86dispatch.h>

#include "_copy_xxh3.h"

/* set at import: the one-pass copy and hash runs on this CPU */
static int fused_copy_hash = 0;

/* record.py: _FIXED = "<4sHHIIIIQQQQ" (56 bytes), the checksum in its last 8, payload 64-aligned */
#define FIXED_BYTES 56
#define CHECKSUM_AT 48
#define ALIGN 64
#define FORMAT_VERSION 1

enum {
    NONE_SOURCE = -1,
    ERR_SHORT = -2,
    ERR_MAGIC = -3,
    ERR_VERSION = -4,
    ERR_LENGTH = -5,
    ERR_SRC_LOC = -6,
    ERR_CHECKSUM = -7,
};

static inline uint16_t rd16(const unsigned char *p) { uint16_t v; memcpy(&v, p, 2); return v; }
static inline uint32_t rd32(const unsigned char *p) { uint32_t v; memcpy(&v, p, 4); return v; }
static inline uint64_t rd64(const unsigned char *p) { uint64_t v; memcpy(&v, p, 8); return v; }

/* xxh3_64 of the n bytes at src, copied to dst, with the checksum field read as zeros */
static uint64_t copy_and_hash(unsigned char *dst, const unsigned char *src, size_t n) {
    if (fused_copy_hash && n >= KV_COPY_XXH3_MIN_LEN) return kv_copy_xxh3(dst, src, n, CHECKSUM_AT);
    memcpy(dst, src, n);
    unsigned char stored[8];
    memcpy(stored, dst + CHECKSUM_AT, 8);
    memset(dst + CHECKSUM_AT, 0, 8);
    XXH64_hash_t digest = XXH3_64bits_dispatch(dst, n);
    memcpy(dst + CHECKSUM_AT, stored, 8);
    return digest;
}

/* Copy n bytes src -> dst; with verify, check the header (read from the source) and the checksum
 * (computed as the bytes are copied). Little-endian host (x86-64, aarch64). A record that fails a
 * header check is not copied. */
static long long copy_one(unsigned char *dst, const unsigned char *src, Py_ssize_t n, int verify) {
    if (!verify) {
        memcpy(dst, src, (size_t)n);
        return 0;
    }
    if (n < FIXED_BYTES) return ERR_SHORT;
    if (memcmp(src, "KVTR", 4) != 0) return ERR_MAGIC;
    if (rd16(src + 4) != FORMAT_VERSION) return ERR_VERSION;
    uint32_t n_tokens = rd32(src + 8), num_layers = rd32(src + 16), fp_len = rd32(src + 20);
    uint64_t lat = rd64(src + 24), idx = rd64(src + 32), srcb = rd64(src + 40), stored = rd64(src + CHECKSUM_AT);
    uint64_t header = ((uint64_t)FIXED_BYTES + fp_len + num_layers + ALIGN - 1) / ALIGN * ALIGN;
    /* the sum cannot wrap unless a field is absurd; check each against n first */
    if (lat > (uint64_t)n || idx > (uint64_t)n || srcb > (uint64_t)n || header + lat + idx + srcb != (uint64_t)n)
        return ERR_LENGTH;
    if (srcb != 8ull * n_tokens) return ERR_SRC_LOC;
    if (copy_and_hash(dst, src, (size_t)n) != stored) return ERR_CHECKSUM;
    return (long long)n_tokens;
}

static PyObject *copy_check(PyObject *self, PyObject *args) {
    PyObject *srcs_in, *dsts_in;
    int verify;
    if (!PyArg_ParseTuple(args, "OOp:copy_check", &srcs_in, &dsts_in, &verify)) return NULL;
    PyObject *srcs = PySequence_Fast(srcs_in, "srcs must be a sequence");
    if (srcs == NULL) return NULL;
    PyObject *dsts = PySequence_Fast(dsts_in, "dsts must be a sequence");
    if (dsts == NULL) { Py_DECREF(srcs); return NULL; }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(srcs), got = 0;
    PyObject *result = NULL;
    Py_buffer *sb = NULL, *db = NULL;
    long long *codes = NULL;
    if (PySequence_Fast_GET_SIZE(dsts) != n) {
        PyErr_Format(PyExc_ValueError, "copy_check got %zd sources but %zd destinations", n,
                     PySequence_Fast_GET_SIZE(dsts));
        goto done;
    }
    sb = PyMem_Calloc((size_t)(n ? n : 1), sizeof(Py_buffer));
    db = PyMem_Calloc((size_t)(n ? n : 1), sizeof(Py_buffer));
    codes = PyMem_Calloc((size_t)(n ? n : 1), sizeof(long long));
    if (sb == NULL || db == NULL || codes == NULL) { PyErr_NoMemory(); goto done; }
    /* every buffer acquired and every size checked before the first copy */
    for (; got < n; got++) {
        PyObject *s = PySequence_Fast_GET_ITEM(srcs, got), *d = PySequence_Fast_GET_ITEM(dsts, got);
        if (s == Py_None) continue;
        if (PyObject_GetBuffer(s, &sb[got], PyBUF_C_CONTIGUOUS) < 0) goto done;
        if (PyObject_GetBuffer(d, &db[got], PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
            PyBuffer_Release(&sb[got]);
            sb[got].obj = NULL;
            goto done;
        }
        if (db[got].len < sb[got].len) {
            PyErr_Format(PyExc_ValueError, "destination %zd holds %zd bytes, too small for its %zd-byte record",
                         got, db[got].len, sb[got].len);
            got++;
            goto done;
        }
    }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        codes[i] = sb[i].obj == NULL ? NONE_SOURCE
                 : copy_one(db[i].buf, sb[i].buf, sb[i].len, verify);
    }
    Py_END_ALLOW_THREADS
    result = PyList_New(n);
    if (result == NULL) goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *v = PyLong_FromLongLong(codes[i]);
        if (v == NULL) { Py_CLEAR(result); goto done; }
        PyList_SET_ITEM(result, i, v);
    }
done:
    for (Py_ssize_t i = 0; i < got; i++) {
        if (sb[i].obj != NULL) PyBuffer_Release(&sb[i]);
        if (db[i].obj != NULL) PyBuffer_Release(&db[i]);
    }
    PyMem_Free(sb);
    PyMem_Free(db);
    PyMem_Free(codes);
    Py_DECREF(srcs);
    Py_DECREF(dsts);
    return result;
}

static PyObject *xxh3_64(PyObject *self, PyObject *arg) {
    Py_buffer b;
    if (PyObject_GetBuffer(arg, &b, PyBUF_C_CONTIGUOUS) < 0) return NULL;
    XXH64_hash_t h;
    Py_BEGIN_ALLOW_THREADS
    h = XXH3_64bits_dispatch(b.buf, (size_t)b.len);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&b);
    return PyLong_FromUnsignedLongLong(h);
}

static PyObject *copy_xxh3(PyObject *self, PyObject *args) {
    Py_buffer d, s;
    if (!PyArg_ParseTuple(args, "w*y*:copy_xxh3", &d, &s)) return NULL;
    PyObject *result = NULL;
    if (d.len < s.len) {
        PyErr_Format(PyExc_ValueError, "destination holds %zd bytes, too small for %zd", d.len, s.len);
    } else if (s.len < FIXED_BYTES) {
        PyErr_Format(PyExc_ValueError, "copy_xxh3 needs at least %d bytes, got %zd", FIXED_BYTES, s.len);
    } else {
        uint64_t h;
        Py_BEGIN_ALLOW_THREADS
        h = copy_and_hash(d.buf, s.buf, (size_t)s.len);
        Py_END_ALLOW_THREADS
        result = PyLong_FromUnsignedLongLong(h);
    }
    PyBuffer_Release(&d);
    PyBuffer_Release(&s);
    return result;
}

static PyMethodDef methods[] = {
    {"copy_check", copy_check, METH_VARARGS,
     "copy_check(srcs, dsts, verify) -> list[int]: copy each record of srcs into dsts (None: no record) and, "
     "with verify, check it (magic, version, lengths, xxh3_64 with the checksum field as zeros).\n"
     "Each int: n_tokens (0 without verify) for a good record, -1 for a None source, another negative code "
     "for a failed check. ValueError, before any copy, when a destination is smaller than its source."},
    {"copy_xxh3", copy_xxh3, METH_VARARGS,
     "copy_xxh3(dst, src) -> int: copy src into dst and return xxh3_64 of src with its checksum field (bytes "
     "48-55) read as zeros, by the path copy_check takes (one pass where FUSED_COPY_HASH; tests)."},
    {"xxh3_64", xxh3_64, METH_O, "xxh3_64(buffer) -> int: the linked xxHash library's XXH3_64bits (tests)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_recordio",
    "The disk tier's native window read: copy, header checks and xxh3_64 for a window of records.", -1, methods,
};

PyMODINIT_FUNC PyInit__recordio(void) {
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    fused_copy_hash = kv_copy_xxh3_available();
    if (PyModule_AddIntConstant(m, "FUSED_COPY_HASH", fused_copy_hash) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    if (PyModule_AddIntConstant(m, "NONE_SOURCE", NONE_SOURCE) < 0 || PyModule_AddIntConstant(m, "ERR_SHORT", ERR_SHORT) < 0
        || PyModule_AddIntConstant(m, "ERR_MAGIC", ERR_MAGIC) < 0 || PyModule_AddIntConstant(m, "ERR_VERSION", ERR_VERSION) < 0
        || PyModule_AddIntConstant(m, "ERR_LENGTH", ERR_LENGTH) < 0 || PyModule_AddIntConstant(m, "ERR_SRC_LOC", ERR_SRC_LOC) < 0
        || PyModule_AddIntConstant(m, "ERR_CHECKSUM", ERR_CHECKSUM) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
