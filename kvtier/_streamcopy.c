/* kvtier._streamcopy: a copy into a large buffer that is not read back soon, with streaming stores.
 *
 * copy_into(dst, offset, src): the client's ReadKV receive puts each message's bytes at their place
 * in the one buffer the whole result lives in (client/pool.py). A plain copy (numpy's, memcpy below
 * glibc's non-temporal threshold) reads every destination line before writing it (the store's read
 * for ownership) and leaves it in the cache, where the next message's bytes push it out again: 17.8 ms
 * for 221 MB in 1 MiB pieces here. Streaming (non-temporal) stores write whole lines straight to
 * memory: 11.7 ms (BENCHMARKS.md, fix 22). The bytes are visible to every thread when the call returns
 * (a store fence). The GIL is released for the copy, so gRPC's threads receive the next message
 * meanwhile.
 *
 * The offset and length are checked before anything is written; copies under STREAM_MIN_BYTES, and
 * every copy where the CPU has no AVX2, are a plain memcpy.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define HAVE_X86 1
#else
#define HAVE_X86 0
#endif

#define STREAM_MIN_BYTES (64 * 1024)

static int use_streaming = 0;

#if HAVE_X86
__attribute__((target("avx2"))) static void copy_streaming(unsigned char *dst, const unsigned char *src, size_t n) {
    /* the head, until dst is 32-byte aligned (streaming stores need it) */
    size_t head = (32 - ((uintptr_t)dst & 31)) & 31;
    if (head > n) head = n;
    memcpy(dst, src, head);
    size_t i = head;
    for (; i + 128 <= n; i += 128) {
        __m256i a = _mm256_loadu_si256((const __m256i *)(src + i)), b = _mm256_loadu_si256((const __m256i *)(src + i + 32));
        __m256i c = _mm256_loadu_si256((const __m256i *)(src + i + 64)), d = _mm256_loadu_si256((const __m256i *)(src + i + 96));
        _mm256_stream_si256((__m256i *)(dst + i), a);
        _mm256_stream_si256((__m256i *)(dst + i + 32), b);
        _mm256_stream_si256((__m256i *)(dst + i + 64), c);
        _mm256_stream_si256((__m256i *)(dst + i + 96), d);
    }
    memcpy(dst + i, src + i, n - i);
    _mm_sfence(); /* the streamed lines are ordered before anything this thread does next */
}
#endif

static PyObject *copy_into(PyObject *self, PyObject *args) {
    Py_buffer d, s;
    Py_ssize_t offset;
    if (!PyArg_ParseTuple(args, "w*ny*:copy_into", &d, &offset, &s)) return NULL;
    PyObject *result = NULL;
    if (offset < 0 || offset > d.len || s.len > d.len - offset) {
        PyErr_Format(PyExc_ValueError, "copy_into: %zd bytes at offset %zd do not fit a %zd-byte buffer", s.len, offset, d.len);
    } else {
        unsigned char *dst = (unsigned char *)d.buf + offset;
        const unsigned char *src = s.buf;
        size_t n = (size_t)s.len;
        if (dst < src + n && src < dst + n) {
            PyErr_SetString(PyExc_ValueError, "copy_into needs a source that does not overlap the destination");
        } else {
            Py_BEGIN_ALLOW_THREADS
#if HAVE_X86
            if (use_streaming && n >= STREAM_MIN_BYTES) copy_streaming(dst, src, n);
            else memcpy(dst, src, n);
#else
            memcpy(dst, src, n);
#endif
            Py_END_ALLOW_THREADS
            result = Py_None;
            Py_INCREF(result);
        }
    }
    PyBuffer_Release(&d);
    PyBuffer_Release(&s);
    return result;
}

static PyMethodDef methods[] = {
    {"copy_into", copy_into, METH_VARARGS,
     "copy_into(dst, offset, src) -> None: copy src's bytes to dst[offset:offset + len(src)] (streaming stores "
     "where STREAMING and at least STREAM_MIN_BYTES). dst a writable contiguous buffer, src a contiguous one not "
     "overlapping it; ValueError (nothing written) when it does not fit or overlaps."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_streamcopy", "A copy into a large buffer with streaming stores (the ReadKV receive).", -1,
    methods,
};

PyMODINIT_FUNC PyInit__streamcopy(void) {
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
#if HAVE_X86
    __builtin_cpu_init();
    use_streaming = __builtin_cpu_supports("avx2") ? 1 : 0;
#endif
    if (PyModule_AddIntConstant(m, "STREAMING", use_streaming) < 0 ||
        PyModule_AddIntConstant(m, "STREAM_MIN_BYTES", STREAM_MIN_BYTES) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
