/*
 * tierkv.codec._codec: the lossless float codec for KV pages (format v1), in C.
 *
 * This file holds the Python bindings only. The codec itself: codec_common.c (layout,
 * tables, header), codec_enc.c + codec_scan.c (encoder), codec_dec.c + codec_planes.c +
 * codec_rows.c (decoder), codec_simd*.c (AVX-512, AVX2 and BMI2 paths), declared in codec_core.h;
 * tierkv/codec/FORMAT.md describes the format. Called by tierkv.codec.codec, which
 * validates arguments and threads batches; both entry points release the GIL while
 * they touch only the caller's buffers and their own scratch.
 *
 * Built by setup.py against xxhash.h (0.8.x, header-only through XXH_INLINE_ALL);
 * optional: without it tierkv.codec falls back to its portable implementation
 * (tierkv/codec/portable, numpy and Python).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>

#include "codec_core.h"
#include "codec_gpu.h"

/* ---------------------------------------------------------------- bindings -- */

static int
parse_geometry(PyObject *args, Py_ssize_t off, Layout *lay)
{
    long v[6];
    for (int i = 0; i < 6; i++) {
        PyObject *o = PyTuple_GET_ITEM(args, off + i);
        v[i] = PyLong_AsLong(o);
        if (v[i] == -1 && PyErr_Occurred())
            return -1;
    }
    lay->dtype = (int)v[0];
    lay->kind = (int)v[1];
    lay->layers = (uint32_t)v[2];
    lay->tokens = (uint32_t)v[3];
    lay->heads = (uint32_t)v[4];
    lay->head_dim = (uint32_t)v[5];
    if (layout_init(lay) != 0) {
        PyErr_Format(PyExc_ValueError, "unsupported codec layout (dtype code %ld, kind %ld, "
                     "%ld layers, %ld tokens, %ld heads, head_dim %ld)", v[0], v[1], v[2], v[3], v[4], v[5]);
        return -1;
    }
    return 0;
}

static int
get_buffer(PyObject *o, Py_buffer *view, int writable, const char *what)
{
    if (PyObject_GetBuffer(o, view, PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0)) != 0) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError, "%s must be a C-contiguous%s buffer, got %.100s", what,
                     writable ? " writable" : "", Py_TYPE(o)->tp_name);
        return -1;
    }
    return 0;
}

PyDoc_STRVAR(encode_rows_doc,
"encode_rows(src, dst, sizes, dtype, kind, layers, tokens, heads, head_dim) -> None\n\n"
"Encodes each row of src (n x page_bytes) into the matching row of dst (n x stride,\n"
"stride >= page_bytes + HEADER_BYTES) and stores each blob's length in sizes (int64[n]).");

static PyObject *
encode_rows(PyObject *self, PyObject *args)
{
    Py_buffer src = {0}, dst = {0}, sizes = {0};
    Layout lay;
    PyObject *ret = NULL;
    if (PyTuple_GET_SIZE(args) != 9) {
        PyErr_SetString(PyExc_TypeError, "encode_rows takes 9 arguments");
        return NULL;
    }
    if (parse_geometry(args, 3, &lay) != 0)
        return NULL;
    if (get_buffer(PyTuple_GET_ITEM(args, 0), &src, 0, "src") != 0)
        return NULL;
    if (get_buffer(PyTuple_GET_ITEM(args, 1), &dst, 1, "dst") != 0)
        goto done;
    if (get_buffer(PyTuple_GET_ITEM(args, 2), &sizes, 1, "sizes") != 0)
        goto done;
    size_t pb = lay.page_bytes;
    size_t n = (size_t)sizes.len / sizeof(int64_t);
    if ((size_t)src.len != n * pb || n == 0 || (size_t)dst.len % n != 0
            || (size_t)dst.len / n < pb + HEADER_BYTES) {
        PyErr_Format(PyExc_ValueError, "encode_rows: %zd sizes, %zd source bytes and %zd destination "
                     "bytes do not fit pages of %zu bytes", sizes.len / (Py_ssize_t)sizeof(int64_t),
                     src.len, dst.len, pb);
        goto done;
    }
    size_t stride = (size_t)dst.len / n;
    int rc = 0;
    Py_BEGIN_ALLOW_THREADS
    for (size_t i = 0; i < n && rc == 0; i++) {
        size_t out = 0;
        rc = encode_page(&lay, (const uint8_t *)src.buf + i * pb, (uint8_t *)dst.buf + i * stride,
                         stride, &out);
        ((int64_t *)sizes.buf)[i] = (int64_t)out;
    }
    scratch_trim();
    Py_END_ALLOW_THREADS
    if (rc != 0) {
        PyErr_NoMemory();
        goto done;
    }
    ret = Py_None;
    Py_INCREF(ret);
done:
    if (src.obj) PyBuffer_Release(&src);
    if (dst.obj) PyBuffer_Release(&dst);
    if (sizes.obj) PyBuffer_Release(&sizes);
    return ret;
}

PyDoc_STRVAR(decode_rows_doc,
"decode_rows(blobs, dst, status, dtype, kind, layers, tokens, heads, head_dim) -> None\n\n"
"Decodes blobs[i] (a sequence of buffers) into row i of dst (n x page_bytes) and writes\n"
"0 (decoded) or an error code into status (int32[n]). A failed row's bytes are\n"
"unspecified; it must not be used. Error codes: see tierkv.codec.format.ERROR_TEXT.");

static PyObject *
decode_rows(PyObject *self, PyObject *args)
{
    Py_buffer dst = {0}, status = {0};
    Py_buffer *views = NULL;
    Py_ssize_t n = 0, got = 0;
    Layout lay;
    PyObject *seq = NULL, *ret = NULL;
    if (PyTuple_GET_SIZE(args) != 9) {
        PyErr_SetString(PyExc_TypeError, "decode_rows takes 9 arguments");
        return NULL;
    }
    if (parse_geometry(args, 3, &lay) != 0)
        return NULL;
    seq = PySequence_Fast(PyTuple_GET_ITEM(args, 0), "blobs must be a sequence of buffers");
    if (seq == NULL)
        return NULL;
    n = PySequence_Fast_GET_SIZE(seq);
    if (get_buffer(PyTuple_GET_ITEM(args, 1), &dst, 1, "dst") != 0)
        goto done;
    if (get_buffer(PyTuple_GET_ITEM(args, 2), &status, 1, "status") != 0)
        goto done;
    size_t pb = lay.page_bytes;
    if (n == 0 || (size_t)dst.len != (size_t)n * pb || (size_t)status.len != (size_t)n * sizeof(int32_t)) {
        PyErr_Format(PyExc_ValueError, "decode_rows: %zd blobs, %zd destination bytes and %zd status "
                     "bytes do not fit pages of %zu bytes", n, dst.len, status.len, pb);
        goto done;
    }
    views = PyMem_Calloc((size_t)n, sizeof(Py_buffer));
    if (views == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (got = 0; got < n; got++) {
        if (get_buffer(PySequence_Fast_GET_ITEM(seq, got), &views[got], 0, "each blob") != 0)
            goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i += MAX_GROUP) {   /* decode_pages interleaves their symbols */
        int m = n - i < MAX_GROUP ? (int)(n - i) : MAX_GROUP;
        const uint8_t *b[MAX_GROUP];
        size_t l[MAX_GROUP];
        uint8_t *d[MAX_GROUP];
        for (int g = 0; g < m; g++) {
            b[g] = (const uint8_t *)views[i + g].buf;
            l[g] = (size_t)views[i + g].len;
            d[g] = (uint8_t *)dst.buf + (size_t)(i + g) * pb;
        }
        decode_pages(&lay, m, b, l, d, (int32_t *)status.buf + i);
    }
    scratch_trim();
    Py_END_ALLOW_THREADS
    ret = Py_None;
    Py_INCREF(ret);
done:
    for (Py_ssize_t i = 0; i < got; i++)
        PyBuffer_Release(&views[i]);
    PyMem_Free(views);
    if (dst.obj) PyBuffer_Release(&dst);
    if (status.obj) PyBuffer_Release(&status);
    Py_XDECREF(seq);
    return ret;
}

PyDoc_STRVAR(set_simd_doc,
"set_simd(level) -> None\n\n"
"Which SIMD paths may run where the CPU has them: 2 (or True) all (AVX-512 rANS symbols\n"
"of up to four pages of a batch at once, from 16-bit halves of the states where VBMI2\n"
"runs, else partly by gathers on AMD, by a register search elsewhere), 3 all but VBMI2\n"
"with the search alone and one page at a time, 4 all but VBMI2 with gathers and one\n"
"page at a time, 5 as 2, 6 as 2 with two pages at a time, 7 as 2 without VBMI2, 1 AVX2\n"
"and BMI2 but not AVX-512, 0 (or False) the scalar ones; all read and write the same\n"
"bytes.\n"
"For tests and comparisons: not meant to change while other threads code pages.");

static PyObject *
set_simd_py(PyObject *self, PyObject *arg)
{
    long level = PyLong_AsLong(arg);
    if (level == -1 && PyErr_Occurred())
        return NULL;
    set_simd(level >= 1 ? (int)(level > 7 ? 2 : level) : 0);
    if (level == 1 && PyBool_Check(arg))
        set_simd(2);   /* True means every path */
    Py_RETURN_NONE;
}

PyDoc_STRVAR(gpu_prepare_doc,
"gpu_prepare(buf, offsets, lengths, desc, status, geo, dtype, kind, layers, tokens, heads, head_dim) -> bytes\n\n"
"The GPU decoder's host side for the blobs buf[offsets[i]:offsets[i] + lengths[i]] (uint8\n"
"buf, int64 offsets and lengths): checks each blob as the C decoder does and writes its\n"
"descriptor into desc (uint32 [n, GPU_DESC_WORDS]) and 0 or the error code into status\n"
"(int32 [n]); fills geo (uint32 [GPU_GEO_WORDS]); returns the side blocks (uint32 words).");

static PyObject *
gpu_prepare(PyObject *self, PyObject *args)
{
    Py_buffer v[6] = {{0}};
    static const char *what[6] = {"buf", "offsets", "lengths", "desc", "status", "geo"};
    Layout lay;
    GpuSink side = {NULL, 0, 0};
    PyObject *ret = NULL;
    if (PyTuple_GET_SIZE(args) != 12) {
        PyErr_SetString(PyExc_TypeError, "gpu_prepare takes 12 arguments");
        return NULL;
    }
    if (parse_geometry(args, 6, &lay) != 0)
        return NULL;
    for (int i = 0; i < 6; i++)
        if (get_buffer(PyTuple_GET_ITEM(args, i), &v[i], i >= 3, what[i]) != 0)
            goto done;
    size_t n = (size_t)v[1].len / sizeof(int64_t);
    if ((size_t)v[2].len != n * sizeof(int64_t) || (size_t)v[3].len != n * GD_DESC_WORDS * sizeof(uint32_t)
            || (size_t)v[4].len != n * sizeof(int32_t) || (size_t)v[5].len != GG_WORDS * sizeof(uint32_t)) {
        PyErr_Format(PyExc_ValueError, "gpu_prepare: %zu offsets, %zd length, %zd descriptor, %zd status and %zd "
                     "geometry bytes do not match", n, v[2].len, v[3].len, v[4].len, v[5].len);
        goto done;
    }
    const int64_t *off = v[1].buf, *len = v[2].buf;
    for (size_t i = 0; i < n; i++) {
        if (off[i] < 0 || len[i] < 0 || off[i] > v[0].len - len[i]) {
            PyErr_Format(PyExc_ValueError, "gpu_prepare: blob %zu at %lld, %lld bytes, is outside the %zd-byte "
                         "buffer", i, (long long)off[i], (long long)len[i], v[0].len);
            goto done;
        }
    }
    Py_BEGIN_ALLOW_THREADS
    gpu_geometry(&lay, v[5].buf);
    for (size_t i = 0; i < n; i++)   /* a page that finds no memory fails alone, as decode_rows' do */
        ((int32_t *)v[4].buf)[i] = gpu_prepare_page(&lay, (const uint8_t *)v[0].buf + off[i], (size_t)len[i],
                                                    (uint64_t)off[i], (uint32_t *)v[3].buf + i * GD_DESC_WORDS,
                                                    &side);
    scratch_trim();
    Py_END_ALLOW_THREADS
    ret = PyBytes_FromStringAndSize((const char *)side.w, (Py_ssize_t)(side.len * sizeof(uint32_t)));
done:
    free(side.w);
    for (int i = 0; i < 6; i++)
        if (v[i].obj) PyBuffer_Release(&v[i]);
    return ret;
}

PyDoc_STRVAR(gpu_emulate_doc,
"gpu_emulate(buf, desc, side, geo, out, status) -> None\n\n"
"Runs the GPU decoder's kernel on the CPU (an emulated thread block per page) over what\n"
"gpu_prepare made: decodes page i into out[i] (uint8 [n, page_bytes]) where status[i] is\n"
"0, and sets status[i] where its streams do not check out. For tests: slow, one call at\n"
"a time (it holds the GIL); it trusts the descriptors and side blocks to be gpu_prepare's.");

static PyObject *
gpu_emulate_py(PyObject *self, PyObject *args)
{
    Py_buffer v[6] = {{0}};
    static const char *what[6] = {"buf", "desc", "side", "geo", "out", "status"};
    PyObject *ret = NULL;
    if (PyTuple_GET_SIZE(args) != 6) {
        PyErr_SetString(PyExc_TypeError, "gpu_emulate takes 6 arguments");
        return NULL;
    }
    for (int i = 0; i < 6; i++)
        if (get_buffer(PyTuple_GET_ITEM(args, i), &v[i], i >= 4, what[i]) != 0)
            goto done;
    size_t n = (size_t)v[5].len / sizeof(int32_t);
    const uint32_t *geo = v[3].buf;
    if ((size_t)v[3].len != GG_WORDS * sizeof(uint32_t) || (size_t)v[1].len != n * GD_DESC_WORDS * sizeof(uint32_t)
            || (size_t)v[4].len != n * ((size_t)geo[GG_PAGE_LO] | (size_t)geo[GG_PAGE_HI] << 32)) {
        PyErr_SetString(PyExc_ValueError, "gpu_emulate: the descriptors, geometry, output and status do not match");
        goto done;
    }
    if (gpu_emulate(v[0].buf, v[1].buf, v[2].buf, geo, v[4].buf, v[5].buf, n) != 0) {
        PyErr_NoMemory();
        goto done;
    }
    ret = Py_None;
    Py_INCREF(ret);
done:
    for (int i = 0; i < 6; i++)
        if (v[i].obj) PyBuffer_Release(&v[i]);
    return ret;
}

static PyMethodDef methods[] = {
    {"gpu_prepare", gpu_prepare, METH_VARARGS, gpu_prepare_doc},
    {"gpu_emulate", gpu_emulate_py, METH_VARARGS, gpu_emulate_doc},
    {"set_simd", set_simd_py, METH_O, set_simd_doc},
    {"encode_rows", encode_rows, METH_VARARGS, encode_rows_doc},
    {"decode_rows", decode_rows, METH_VARARGS, decode_rows_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "tierkv.codec._codec",
    "The lossless KV page codec (format v1) in C; see tierkv.codec.", -1, methods,
};

PyMODINIT_FUNC
PyInit__codec(void)
{
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddIntConstant(m, "FORMAT_VERSION", FORMAT_VERSION) < 0
            || PyModule_AddIntConstant(m, "HEADER_BYTES", HEADER_BYTES) < 0
            || PyModule_AddIntConstant(m, "LANES", LANES) < 0
            || PyModule_AddIntConstant(m, "PROB_BITS", PROB_BITS) < 0
            || PyModule_AddIntConstant(m, "GPU_DESC_WORDS", GD_DESC_WORDS) < 0
            || PyModule_AddIntConstant(m, "GPU_GEO_WORDS", GG_WORDS) < 0
            || PyModule_AddIntConstant(m, "GPU_THREADS", GD_THREADS) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
