/* kvtier.server.hostmem._copy: copies of host memory that plain memcpy does badly.
 *
 * replace(dst, undo, src): a WriteKV into named slots writes the new rows in place and keeps the rows
 * it replaces in an undo buffer, so that a stream that breaks off can put them back (all or nothing;
 * server/daemon/kv_write.py). Done as two copies (dst -> undo, then src -> dst) that moves each row
 * through the cache twice and reads every undo line before writing it (the store's read for
 * ownership): measured on 221 MB in 1 MiB pieces, 41.7 ms against 24.3 ms for the write alone. Here
 * one pass loads each 64-byte line of dst and of src, stores the old line to undo with streaming
 * (non-temporal) stores -- the undo buffer is read again only if the write aborts -- and the new one
 * to dst: 25.0 ms (BENCHMARKS.md, fix 20). The undo bytes are complete and visible to every thread
 * when the call returns (a store fence).
 *
 * Every buffer is checked before anything is written (same length, contiguous, dst and undo
 * writable); the GIL is released for the copy. Where the CPU has no AVX2, the two memcpys.
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

static int use_streaming = 0;

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
    {"replace", replace, METH_VARARGS,
     "replace(dst, undo, src) -> None: copy dst's bytes into undo and src's into dst, in one pass (undo with "
     "streaming stores where STREAMING). Three contiguous buffers of one length, not overlapping; dst and undo "
     "writable. ValueError (nothing written) otherwise."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_copy", "Copies of host memory: the undo-keeping write of WriteKV's rows.", -1, methods,
};

PyMODINIT_FUNC PyInit__copy(void) {
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
#if HAVE_X86
    __builtin_cpu_init();
    use_streaming = __builtin_cpu_supports("avx2") ? 1 : 0;
#endif
    if (PyModule_AddIntConstant(m, "STREAMING", use_streaming) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
