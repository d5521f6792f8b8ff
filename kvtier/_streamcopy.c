/* kvtier._streamcopy: copies into large buffers that are not read back soon, with streaming stores.
 *
 * A plain copy (numpy's, or memcpy below glibc's non-temporal threshold) reads every destination line
 * before writing it (the store's read for ownership) and leaves it in the cache, where the next bytes
 * push it out again. Streaming (non-temporal) stores write whole 64-byte lines straight to memory.
 * Both calls below check every buffer before anything is written, release the GIL for the copy and
 * end with a store fence, so the bytes are complete and visible to every thread when they return.
 * Where the CPU has no AVX2 they are plain memcpys. Shared by the client and the daemon.
 *
 * copy_into(dst, offset, src): the client's ReadKV receive puts each message's bytes at their place
 * in the one buffer the whole result lives in (client/pool.py): 17.8 ms for 221 MB in 1 MiB pieces
 * with numpy's copy, 11.7 ms here (BENCHMARKS.md, fix 22). gRPC's threads receive the next message
 * meanwhile. Copies under STREAM_MIN_BYTES are a plain memcpy.
 *
 * replace(dst, undo, src): a WriteKV into named slots writes the new rows in place and keeps the rows
 * it replaces in an undo buffer, so that a stream that breaks off can put them back (all or nothing;
 * server/daemon/kv_write.py). As two copies (dst -> undo, then src -> dst) each row crosses the cache
 * twice: 41.7 ms for 221 MB in 1 MiB pieces, against 24.3 ms for the write alone. Here one pass loads
 * each 64-byte line of dst and of src, streams the old line to undo (read again only if the write
 * aborts) and stores the new one to dst: 25.0 ms (BENCHMARKS.md, fix 20).
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

static void replace_plain(unsigned char *dst, unsigned char *undo, const unsigned char *src, size_t n) {
    memcpy(undo, dst, n);
    memcpy(dst, src, n);
}

#if HAVE_X86
__attribute__((target("avx2"))) static void replace_streaming(unsigned char *dst, unsigned char *undo,
                                                             const unsigned char *src, size_t n) {
    /* the head, until undo is 32-byte aligned (streaming stores need it) */
    size_t head = (32 - ((uintptr_t)undo & 31)) & 31;
    if (head > n) head = n;
    replace_plain(dst, undo, src, head);
    size_t i = head;
    for (; i + 64 <= n; i += 64) {
        __m256i o0 = _mm256_loadu_si256((const __m256i *)(dst + i)), o1 = _mm256_loadu_si256((const __m256i *)(dst + i + 32));
        __m256i s0 = _mm256_loadu_si256((const __m256i *)(src + i)), s1 = _mm256_loadu_si256((const __m256i *)(src + i + 32));
        _mm256_stream_si256((__m256i *)(undo + i), o0);
        _mm256_stream_si256((__m256i *)(undo + i + 32), o1);
        _mm256_storeu_si256((__m256i *)(dst + i), s0);
        _mm256_storeu_si256((__m256i *)(dst + i + 32), s1);
    }
    replace_plain(dst + i, undo + i, src + i, n - i);
    _mm_sfence(); /* the streamed undo lines are ordered before anything this thread does next */
}
#endif

static PyObject *replace(PyObject *self, PyObject *args) {
    Py_buffer d, u, s;
    if (!PyArg_ParseTuple(args, "w*w*y*:replace", &d, &u, &s)) return NULL;
    PyObject *result = NULL;
    if (d.len != u.len || d.len != s.len) {
        PyErr_Format(PyExc_ValueError, "replace needs buffers of one length, got dst %zd, undo %zd, src %zd bytes",
                     d.len, u.len, s.len);
    } else {
        unsigned char *dst = d.buf, *undo = u.buf;
        const unsigned char *src = s.buf;
        size_t n = (size_t)d.len;
        /* overlapping buffers would make the result depend on the order of the copies */
        if ((dst < undo + n && undo < dst + n) || (dst < src + n && src < dst + n) || (undo < src + n && src < undo + n)) {
            PyErr_SetString(PyExc_ValueError, "replace needs three buffers that do not overlap");
        } else {
            Py_BEGIN_ALLOW_THREADS
#if HAVE_X86
            if (use_streaming) replace_streaming(dst, undo, src, n);
            else replace_plain(dst, undo, src, n);
#else
            replace_plain(dst, undo, src, n);
#endif
            Py_END_ALLOW_THREADS
            result = Py_None;
            Py_INCREF(result);
        }
    }
    PyBuffer_Release(&d);
    PyBuffer_Release(&u);
    PyBuffer_Release(&s);
    return result;
}

static PyMethodDef methods[] = {
    {"copy_into", copy_into, METH_VARARGS,
     "copy_into(dst, offset, src) -> None: copy src's bytes to dst[offset:offset + len(src)] (streaming stores "
     "where STREAMING and at least STREAM_MIN_BYTES). dst a writable contiguous buffer, src a contiguous one not "
     "overlapping it; ValueError (nothing written) when it does not fit or overlaps."},
    {"replace", replace, METH_VARARGS,
     "replace(dst, undo, src) -> None: copy dst's bytes into undo and src's into dst, in one pass (undo with "
     "streaming stores where STREAMING). Three contiguous buffers of one length, not overlapping; dst and undo "
     "writable. ValueError (nothing written) otherwise."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_streamcopy", "Copies with streaming stores: the client's ReadKV receive and WriteKV's undo-keeping write.", -1,
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
