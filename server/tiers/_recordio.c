/* kvtier.server.tiers._recordio: the disk tier's read of a window of records in one native call.
 *
 * copy_check(srcs, dsts, verify) copies each source record (a buffer: LMDB's view of the value in its
 * map) into its destination buffer and, with verify, checks it as record.check_record_in_place does:
 * magic, format version, lengths against the header, src_loc bytes, and xxh3_64 over the whole record
 * with the checksum field read as zeros (record.py's docstring; Debian's libxxhash): the field is
 * zeroed in the copy for one one-shot hash and put back. The GIL is released for the whole window.
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

/* Copy n bytes src -> dst; with verify, check the copy. Little-endian host (x86-64, aarch64). */
static long long copy_one(unsigned char *dst, const unsigned char *src, Py_ssize_t n, int verify) {
    if (!verify) {
        memcpy(dst, src, (size_t)n);
        return 0;
    }
    if (n < FIXED_BYTES) {
        memcpy(dst, src, (size_t)n);
        return ERR_SHORT;
    }
    memcpy(dst, src, (size_t)n);
    if (memcmp(dst, "KVTR", 4) != 0) return ERR_MAGIC;
    if (rd16(dst + 4) != FORMAT_VERSION) return ERR_VERSION;
    uint32_t n_tokens = rd32(dst + 8), num_layers = rd32(dst + 16), fp_len = rd32(dst + 20);
    uint64_t lat = rd64(dst + 24), idx = rd64(dst + 32), srcb = rd64(dst + 40), stored = rd64(dst + CHECKSUM_AT);
    uint64_t header = ((uint64_t)FIXED_BYTES + fp_len + num_layers + ALIGN - 1) / ALIGN * ALIGN;
    /* the sum cannot wrap unless a field is absurd; check each against n first */
    if (lat > (uint64_t)n || idx > (uint64_t)n || srcb > (uint64_t)n || header + lat + idx + srcb != (uint64_t)n)
        return ERR_LENGTH;
    if (srcb != 8ull * n_tokens) return ERR_SRC_LOC;
    /* one one-shot hash of the copy (still in L2) with the checksum field zeroed, then put back:
     * measured faster than streaming the pieces, or copying and hashing 16 KiB blocks in turn */
    memset(dst + CHECKSUM_AT, 0, 8);
    XXH64_hash_t digest = XXH3_64bits_dispatch(dst, (size_t)n);
    memcpy(dst + CHECKSUM_AT, &stored, 8);
    if (digest != stored) return ERR_CHECKSUM;
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

static PyMethodDef methods[] = {
    {"copy_check", copy_check, METH_VARARGS,
     "copy_check(srcs, dsts, verify) -> list[int]: copy each record of srcs into dsts (None: no record) and, "
     "with verify, check it (magic, version, lengths, xxh3_64 with the checksum field as zeros).\n"
     "Each int: n_tokens (0 without verify) for a good record, -1 for a None source, another negative code "
     "for a failed check. ValueError, before any copy, when a destination is smaller than its source."},
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
    if (PyModule_AddIntConstant(m, "NONE_SOURCE", NONE_SOURCE) < 0 || PyModule_AddIntConstant(m, "ERR_SHORT", ERR_SHORT) < 0
        || PyModule_AddIntConstant(m, "ERR_MAGIC", ERR_MAGIC) < 0 || PyModule_AddIntConstant(m, "ERR_VERSION", ERR_VERSION) < 0
        || PyModule_AddIntConstant(m, "ERR_LENGTH", ERR_LENGTH) < 0 || PyModule_AddIntConstant(m, "ERR_SRC_LOC", ERR_SRC_LOC) < 0
        || PyModule_AddIntConstant(m, "ERR_CHECKSUM", ERR_CHECKSUM) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
