/*
 * tierkv.tiers._copy: pages copied into a tier's buffer, and large batches out of it,
 * with non-temporal stores.
 *
 * A page put into the DRAM tier is not read again soon (a later get, a demotion), so
 * its bytes need not pass through the cache: streaming stores write whole lines
 * without first reading them in (a regular store reads the line it writes). glibc's
 * memcpy streams only above a threshold derived from the cache size, which per-page
 * copies of 16 KiB to 2 MiB stay below: on the project's VM they ran at about 6 GB/s
 * against 9-10 with streaming stores and 10 for one memcpy of the whole batch
 * (docs/benchmarks.md). AVX-512 stores where the CPU has them, SSE2 on any other
 * x86-64, memcpy elsewhere; the bytes written are the same.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define HAVE_X86 1
#else
#define HAVE_X86 0
#endif

typedef void (*copy_fn)(char *dst, const char *src, size_t n);

static void
copy_plain(char *dst, const char *src, size_t n)
{
    memcpy(dst, src, n);
}

#if HAVE_X86
/* Streams the whole 64-byte lines of n bytes to a 64-byte aligned dst; returns the
 * bytes it copied (the rest, under a line, is the caller's). */
typedef size_t (*lines_fn)(char *dst, const char *src, size_t n);

/* The lines past the destination's first 64-byte boundary go four 4 KiB stretches at a
 * time while 16 KiB of them are left, 128 bytes from each stretch in turn (as glibc's
 * memcpy moves its largest copies): four streams of loads and of stores at once (each
 * within one page where source and destination are page-aligned). One stretch after
 * another ran 9.0 / 11.0 GB/s (out of / into a tier) against 11.3 / 13.1 so on the
 * project's VM (docs/benchmarks.md). */
#define GROUP_PAGES 4
#define GROUP_PAGE 4096
#define GROUP_STEP 128

/* One 64-byte line, streamed to a 64-byte aligned d. */
static inline void
line_sse2(char *d, const char *s)
{
    __m128i a = _mm_loadu_si128((const __m128i *)s);
    __m128i b = _mm_loadu_si128((const __m128i *)(s + 16));
    __m128i c = _mm_loadu_si128((const __m128i *)(s + 32));
    __m128i e = _mm_loadu_si128((const __m128i *)(s + 48));
    _mm_stream_si128((__m128i *)d, a);
    _mm_stream_si128((__m128i *)(d + 16), b);
    _mm_stream_si128((__m128i *)(d + 32), c);
    _mm_stream_si128((__m128i *)(d + 48), e);
}

static size_t
lines_sse2(char *dst, const char *src, size_t n)
{
    size_t i = 0;
    for (; i + GROUP_PAGES * GROUP_PAGE <= n; i += GROUP_PAGES * GROUP_PAGE)
        for (size_t o = 0; o < GROUP_PAGE; o += GROUP_STEP)
            for (size_t p = 0; p < GROUP_PAGES; p++)
                for (size_t k = 0; k < GROUP_STEP; k += 64)
                    line_sse2(dst + i + p * GROUP_PAGE + o + k, src + i + p * GROUP_PAGE + o + k);
    for (; i + 64 <= n; i += 64)
        line_sse2(dst + i, src + i);
    return i;
}

__attribute__((target("avx512f"))) static size_t
lines_avx512(char *dst, const char *src, size_t n)
{
    size_t i = 0;
    for (; i + GROUP_PAGES * GROUP_PAGE <= n; i += GROUP_PAGES * GROUP_PAGE)
        for (size_t o = 0; o < GROUP_PAGE; o += GROUP_STEP)
            for (size_t p = 0; p < GROUP_PAGES; p++) {
                const char *s = src + i + p * GROUP_PAGE + o;
                char *d = dst + i + p * GROUP_PAGE + o;
                __m512i a = _mm512_loadu_si512((const void *)s);
                __m512i b = _mm512_loadu_si512((const void *)(s + 64));
                _mm512_stream_si512((void *)d, a);
                _mm512_stream_si512((void *)(d + 64), b);
            }
    for (; i + 256 <= n; i += 256) {
        __m512i a = _mm512_loadu_si512((const void *)(src + i));
        __m512i b = _mm512_loadu_si512((const void *)(src + i + 64));
        __m512i c = _mm512_loadu_si512((const void *)(src + i + 128));
        __m512i d = _mm512_loadu_si512((const void *)(src + i + 192));
        _mm512_stream_si512((void *)(dst + i), a);
        _mm512_stream_si512((void *)(dst + i + 64), b);
        _mm512_stream_si512((void *)(dst + i + 128), c);
        _mm512_stream_si512((void *)(dst + i + 192), d);
    }
    for (; i + 64 <= n; i += 64)
        _mm512_stream_si512((void *)(dst + i), _mm512_loadu_si512((const void *)(src + i)));
    return i;
}

/* Up to the destination's next 64-byte boundary, and the tail past the last whole line,
 * are copied as usual; the lines between are streamed. */
static inline void
copy_lines(lines_fn lines, char *dst, const char *src, size_t n)
{
    size_t head = (size_t)(-(uintptr_t)dst & 63);
    if (head >= n) {
        memcpy(dst, src, n);
        return;
    }
    memcpy(dst, src, head);
    size_t done = head + lines(dst + head, src + head, n - head);
    memcpy(dst + done, src + done, n - done);
}

static void
copy_sse2(char *dst, const char *src, size_t n)
{
    copy_lines(lines_sse2, dst, src, n);
}

static void
copy_avx512(char *dst, const char *src, size_t n)
{
    copy_lines(lines_avx512, dst, src, n);
}
#endif

static copy_fn stream_copy = copy_plain;
static const char *stream_kind = "memcpy";

static void
stream_fence(void)
{
#if HAVE_X86
    _mm_sfence();   /* streamed lines are weakly ordered: visible before we return */
#endif
}

/* A private copy of the slots, each checked to leave ``width`` bytes at ``slot * stride``
 * inside ``len`` bytes: the caller's may change once the GIL is released. NULL with an
 * error set otherwise; PyMem_Free the result. */
static int64_t *
own_slots(const char *who, const Py_buffer *slots, Py_ssize_t len, Py_ssize_t stride, Py_ssize_t width)
{
    Py_ssize_t n = slots->len / 8;
    int64_t *slot = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(int64_t));
    if (slot == NULL) {
        PyErr_NoMemory();
        return NULL;
    }
    memcpy(slot, slots->buf, (size_t)n * sizeof(int64_t));
    for (Py_ssize_t i = 0; i < n; i++) {
        if (slot[i] < 0 || len < width || slot[i] > (len - width) / stride) {
            PyErr_Format(PyExc_ValueError, "%s: slot %lld of row %zd lies outside the buffer", who,
                         (long long)slot[i], i);
            PyMem_Free(slot);
            return NULL;
        }
    }
    return slot;
}

PyDoc_STRVAR(scatter_doc,
"scatter_rows(dst, stride, slots, rows, width)\n\n"
"Copy the first ``width`` bytes of each buffer of ``rows`` (a list or tuple of\n"
"C-contiguous buffers) to ``dst`` (a writable C-contiguous buffer) at byte\n"
"``slots[i] * stride`` (``slots``: a buffer of int64), with streaming stores and\n"
"without the GIL. Every buffer and bound is checked before a byte is copied:\n"
"ValueError, TypeError or BufferError, and nothing written, otherwise.");

static PyObject *
scatter_rows(PyObject *Py_UNUSED(module), PyObject *args)
{
    Py_buffer dst, slots;
    Py_ssize_t stride, width;
    PyObject *rows;
    if (!PyArg_ParseTuple(args, "w*ny*On:scatter_rows", &dst, &stride, &slots, &rows, &width))
        return NULL;
    PyObject *seq = NULL, *out = NULL;
    Py_buffer *bufs = NULL;
    int64_t *slot = NULL;
    Py_ssize_t n = 0, got = 0;
    if (!PyBuffer_IsContiguous(&dst, 'C') || !PyBuffer_IsContiguous(&slots, 'C')) {
        PyErr_SetString(PyExc_ValueError, "scatter_rows: dst and slots must be C-contiguous");
        goto done;
    }
    if (slots.len % 8 || stride <= 0 || width < 0 || width > stride || (slots.len && dst.len < width)) {
        PyErr_Format(PyExc_ValueError, "scatter_rows: slots must be int64 and 0 <= width <= stride, got "
                     "%zd bytes of slots, stride %zd, width %zd", slots.len, stride, width);
        goto done;
    }
    seq = PySequence_Tuple(rows);   /* a tuple of our own: a row's buffer hook cannot empty it */
    if (seq == NULL)
        goto done;
    n = PyTuple_GET_SIZE(seq);
    if (n != slots.len / 8) {
        PyErr_Format(PyExc_ValueError, "scatter_rows: %zd rows for %zd slots", n, slots.len / 8);
        goto done;
    }
    slot = own_slots("scatter_rows", &slots, dst.len, stride, width);
    if (slot == NULL)
        goto done;
    bufs = PyMem_Calloc((size_t)(n ? n : 1), sizeof(Py_buffer));
    if (bufs == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (; got < n; got++) {
        if (PyObject_GetBuffer(PyTuple_GET_ITEM(seq, got), &bufs[got], PyBUF_C_CONTIGUOUS) < 0)
            goto done;
        if (bufs[got].len < width) {
            PyErr_Format(PyExc_ValueError, "scatter_rows: row %zd holds %zd bytes, fewer than %zd", got,
                         bufs[got].len, width);
            got++;
            goto done;
        }
    }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++)
        stream_copy((char *)dst.buf + slot[i] * stride, (const char *)bufs[i].buf, (size_t)width);
    stream_fence();
    Py_END_ALLOW_THREADS
    out = Py_NewRef(Py_None);
done:
    for (Py_ssize_t i = 0; i < got; i++)
        PyBuffer_Release(&bufs[i]);
    PyMem_Free(bufs);
    PyMem_Free(slot);
    Py_XDECREF(seq);
    PyBuffer_Release(&slots);
    PyBuffer_Release(&dst);
    return out;
}

/* The copy between a slotted buffer (``tier``: row ``slots[i]`` at ``slots[i] * stride``)
 * and a strided one (``rows``: row ``i`` at ``i * row_stride``) of scatter_block (scatter:
 * rows into the tier) and gather_rows (out of it): ``rows_name`` names the strided buffer
 * in errors. Takes the buffers over: each is released before it returns. */
static PyObject *
strided_copy(const char *who, const char *rows_name, int scatter, Py_buffer *tier, Py_ssize_t stride,
             Py_buffer *slots, Py_buffer *rows, Py_ssize_t row_stride, Py_ssize_t width)
{
    PyObject *res = NULL;
    int64_t *slot = NULL;
    Py_ssize_t n = slots->len / 8;
    if (!PyBuffer_IsContiguous(tier, 'C') || !PyBuffer_IsContiguous(slots, 'C') || !PyBuffer_IsContiguous(rows, 'C')) {
        PyErr_Format(PyExc_ValueError, "%s: the buffers and slots must be C-contiguous", who);
        goto done;
    }
    /* rows holds row n - 1 at (n - 1) * row_stride: asked without the product overflowing */
    if (slots->len % 8 || stride <= 0 || width < 0 || width > stride || width > row_stride
            || (n && (rows->len < width || (n > 1 && row_stride > (rows->len - width) / (n - 1))))) {
        PyErr_Format(PyExc_ValueError, "%s: slots must be int64, 0 <= width <= stride and %s_stride, and %s "
                     "must hold every row; got %zd bytes of slots, stride %zd, %s_stride %zd, width %zd, %s of %zd "
                     "bytes", who, rows_name, rows_name, slots->len, stride, rows_name, row_stride, width, rows_name,
                     rows->len);
        goto done;
    }
    slot = own_slots(who, slots, tier->len, stride, width);
    if (slot == NULL)
        goto done;
    char *t = tier->buf, *r = rows->buf;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        if (scatter)
            stream_copy(t + slot[i] * stride, r + i * row_stride, (size_t)width);
        else
            stream_copy(r + i * row_stride, t + slot[i] * stride, (size_t)width);
    }
    stream_fence();
    Py_END_ALLOW_THREADS
    res = Py_NewRef(Py_None);
done:
    PyMem_Free(slot);
    PyBuffer_Release(rows);
    PyBuffer_Release(slots);
    PyBuffer_Release(tier);
    return res;
}

PyDoc_STRVAR(scatter_block_doc,
"scatter_block(dst, stride, slots, src, src_stride, width)\n\n"
"Copy ``width`` bytes at byte ``i * src_stride`` of ``src`` (a C-contiguous buffer of\n"
"rows, one per slot) to byte ``slots[i] * stride`` of ``dst`` (a writable C-contiguous\n"
"buffer), with streaming stores and without the GIL: scatter_rows of a batch, without\n"
"a buffer object per row. ValueError, nothing written, for a bound that does not hold.");

static PyObject *
scatter_block(PyObject *Py_UNUSED(module), PyObject *args)
{
    Py_buffer dst, slots, src;
    Py_ssize_t stride, src_stride, width;
    if (!PyArg_ParseTuple(args, "w*ny*y*nn:scatter_block", &dst, &stride, &slots, &src, &src_stride, &width))
        return NULL;
    return strided_copy("scatter_block", "src", 1, &dst, stride, &slots, &src, src_stride, width);
}

PyDoc_STRVAR(gather_doc,
"gather_rows(src, stride, slots, out, out_stride, width)\n\n"
"Copy ``width`` bytes at byte ``slots[i] * stride`` of ``src`` (a C-contiguous buffer)\n"
"to byte ``i * out_stride`` of ``out`` (a writable C-contiguous buffer), with streaming\n"
"stores and without the GIL; ValueError, nothing written, for a bound that does not hold.");

static PyObject *
gather_rows(PyObject *Py_UNUSED(module), PyObject *args)
{
    Py_buffer src, slots, out;
    Py_ssize_t stride, out_stride, width;
    if (!PyArg_ParseTuple(args, "y*ny*w*nn:gather_rows", &src, &stride, &slots, &out, &out_stride, &width))
        return NULL;
    return strided_copy("gather_rows", "out", 0, &src, stride, &slots, &out, out_stride, width);
}

PyDoc_STRVAR(set_kind_doc,
"_set_kind(kind)\n\nUse the 'memcpy', 'sse2' or 'avx512' copy from now on (tests run each the CPU\n"
"has); ValueError for one it lacks. KIND names the one in use.");

static PyObject *
set_kind(PyObject *module, PyObject *arg)
{
    const char *kind = PyUnicode_AsUTF8(arg);
    if (kind == NULL)
        return NULL;
    if (strcmp(kind, "memcpy") == 0) {
        stream_copy = copy_plain;
        stream_kind = "memcpy";
#if HAVE_X86
    } else if (strcmp(kind, "sse2") == 0) {
        stream_copy = copy_sse2;
        stream_kind = "sse2";
    } else if (strcmp(kind, "avx512") == 0 && __builtin_cpu_supports("avx512f")) {
        stream_copy = copy_avx512;
        stream_kind = "avx512";
#endif
    } else {
        PyErr_Format(PyExc_ValueError, "_set_kind: %R is not a copy this CPU has (memcpy, sse2, avx512)", arg);
        return NULL;
    }
    if (PyModule_AddStringConstant(module, "KIND", stream_kind) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyMethodDef copy_methods[] = {
    {"scatter_rows", scatter_rows, METH_VARARGS, scatter_doc},
    {"scatter_block", scatter_block, METH_VARARGS, scatter_block_doc},
    {"gather_rows", gather_rows, METH_VARARGS, gather_doc},
    {"_set_kind", set_kind, METH_O, set_kind_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef copy_module = {
    PyModuleDef_HEAD_INIT, "tierkv.tiers._copy",
    "Pages copied into and out of a tier's buffer with streaming (non-temporal) stores.", -1, copy_methods,
};

PyMODINIT_FUNC
PyInit__copy(void)
{
#if HAVE_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f")) {
        stream_copy = copy_avx512;
        stream_kind = "avx512";
    } else {
        stream_copy = copy_sse2;
        stream_kind = "sse2";
    }
#endif
    PyObject *m = PyModule_Create(&copy_module);
    if (m != NULL && PyModule_AddStringConstant(m, "KIND", stream_kind) < 0)
        Py_CLEAR(m);
    return m;
}
