/* tierkv._table: the block manager's page table core, in C.
 *
 * Maps 16-byte page keys to dense row numbers and keeps, per row, the key and the level
 * of the fastest tier the page is published in (0xFF: not published, so not resident).
 * Everything else the manager knows of a page lives in numpy columns indexed by row
 * (tierkv/store/table.py), so a page costs no Python object anywhere.
 *
 * The keys, their map and the levels live in a key table (tierkv/policy/keytab.h): a
 * row is an id of it that the table holds. A table makes one of its own (20 bytes a
 * key, and its map), or is given the one its store's slowest tier's policy made
 * (PageTable(keys=...)): then each of that tier's pages has its key, map entry and
 * level once for the table, the tier's ghost and its leaf heaps together, and the
 * table adds no byte a row. Ids are dense and reused (last freed, first reused), so
 * columns grow with `capacity`; with a shared key table, ids the policy alone holds
 * (pages it remembers that the store does not have) are never rows, and their columns
 * stay zero. Every call holds the GIL throughout; the caller (the manager, under the
 * store lock) serializes compound use.
 *
 * The lookup half (prefix_len, prefix_values, get, __contains__, __len__) has the
 * contract of tierkv._native.KeySet over the *published* rows, so the table is the
 * store's resident-key index too: a lookup is one C scan.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "policy/keytab.h"

#define KEY_BYTES 16
#define NO_LEVEL KT_NO_LEVEL
#define ROWS_MIN 1024

typedef struct {
    PyObject_HEAD
    KeyTab *kt;           /* the keys: a row is an id the table holds (KT_TABLE) */
    PyObject *keys;       /* the capsule holding kt (a reference) */
    int own;              /* kt is this table's alone (made for it, not passed in) */
    int attached;         /* kt_attach'ed: this table uses kt */
    Py_ssize_t count;     /* rows held */
    Py_ssize_t published; /* rows held with a level */
} TableObject;

static inline int
held(const TableObject *t, int32_t id)
{
    return (KT_META(t->kt, id) & KT_TABLE) != 0;
}

/* The row of key k (16 bytes), or -1. */
static inline int32_t
row_of(const TableObject *t, const uint8_t *k)
{
    int32_t id = kt_find(t->kt, k, KEY_BYTES);
    return id >= 0 && held(t, id) ? id : -1;
}

/* ------------------------------------------------------------------ argument helpers */

static int
key_from(PyObject *obj, uint8_t out[KEY_BYTES])
{
    Py_buffer view;
    if (PyObject_GetBuffer(obj, &view, PyBUF_SIMPLE) < 0) {
        PyErr_Format(PyExc_TypeError, "page key must be bytes, got %.100s", Py_TYPE(obj)->tp_name);
        return -1;
    }
    int rc = 0;
    if (view.len != KEY_BYTES) {
        PyErr_Format(PyExc_ValueError, "page key must be %d bytes, got %zd", KEY_BYTES, view.len);
        rc = -1;
    } else {
        memcpy(out, view.buf, KEY_BYTES);
    }
    PyBuffer_Release(&view);
    return rc;
}

static int
check_blob(const Py_buffer *blob)
{
    if (blob->len % KEY_BYTES != 0) {
        PyErr_Format(PyExc_ValueError, "blob must hold whole %d-byte keys, got %zd bytes", KEY_BYTES, blob->len);
        return -1;
    }
    return 0;
}

static inline int
is_row(const TableObject *t, Py_ssize_t r)
{
    return r >= 0 && r < t->kt->high && held(t, (int32_t)r);
}

/* Rows of a buffer of int32 row numbers; each must be held. */
static int
check_rows(const TableObject *t, const Py_buffer *rows)
{
    if (rows->len % 4 != 0) {
        PyErr_Format(PyExc_ValueError, "rows must be int32 values, got %zd bytes", rows->len);
        return -1;
    }
    const int32_t *r = rows->buf;
    Py_ssize_t n = rows->len / 4;
    for (Py_ssize_t i = 0; i < n; i++)
        if (!is_row(t, r[i])) {
            PyErr_Format(PyExc_KeyError, "row %d is not a page of this table", (int)r[i]);
            return -1;
        }
    return 0;
}

/* ------------------------------------------------------------------ methods */

static PyObject *
t_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"keys", NULL};
    PyObject *keys = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "|O:PageTable", kwlist, &keys))
        return NULL;
    if (keys != Py_None && kt_from(keys, PyExc_ValueError, "keys", KT_TABLE) == NULL)
        return NULL;
    TableObject *t = (TableObject *)type->tp_alloc(type, 0);
    if (t == NULL)
        return NULL;
    t->own = keys == Py_None;
    if ((t->kt = kt_use(keys, KT_TABLE, &t->keys)) == NULL) {
        Py_DECREF(t);
        return NULL;
    }
    kt_attach(t->kt, KT_TABLE);
    t->attached = 1;
    return (PyObject *)t;
}

static void
t_dealloc(TableObject *t)
{
    if (t->attached && !t->own)   /* a table of its own goes with the capsule */
        kt_detach(t->kt, KT_TABLE);
    Py_XDECREF(t->keys);
    Py_TYPE(t)->tp_free((PyObject *)t);
}

/* Rows of n keys back to back into dst (-1 for keys not in the table). */
static void
rows_of_keys(const TableObject *t, const uint8_t *p, Py_ssize_t n, int32_t *dst)
{
    kt_find16_many(t->kt, p, n, dst);
    for (Py_ssize_t i = 0; i < n; i++)
        if (dst[i] >= 0 && !held(t, dst[i]))
            dst[i] = -1;
}

static PyObject *
t_find(TableObject *t, PyObject *arg)
{
    Py_buffer blob;
    if (PyObject_GetBuffer(arg, &blob, PyBUF_SIMPLE) < 0)
        return NULL;
    if (check_blob(&blob) < 0) {
        PyBuffer_Release(&blob);
        return NULL;
    }
    Py_ssize_t n = blob.len / KEY_BYTES;
    PyObject *out = PyBytes_FromStringAndSize(NULL, n * 4);
    if (out != NULL)
        rows_of_keys(t, blob.buf, n, (int32_t *)PyBytes_AS_STRING(out));
    PyBuffer_Release(&blob);
    return out;
}

static PyObject *
t_row(TableObject *t, PyObject *arg)
{
    uint8_t k[KEY_BYTES];
    if (key_from(arg, k) < 0)
        return NULL;
    return PyLong_FromLong(row_of(t, k));
}

/* ensure(blob) -> (rows, fresh): the row of every key, a new one for keys not in the
 * table (fresh[i] = 1). A key repeated in the blob gets one row. */
static PyObject *
t_ensure(TableObject *t, PyObject *arg)
{
    Py_buffer blob;
    if (PyObject_GetBuffer(arg, &blob, PyBUF_SIMPLE) < 0)
        return NULL;
    if (check_blob(&blob) < 0) {
        PyBuffer_Release(&blob);
        return NULL;
    }
    KeyTab *kt = t->kt;
    Py_ssize_t n = blob.len / KEY_BYTES;
    PyObject *rows = NULL, *fresh = NULL;
    rows = PyBytes_FromStringAndSize(NULL, n * 4);
    fresh = PyBytes_FromStringAndSize(NULL, n);
    if (rows == NULL || fresh == NULL)
        goto done;
    int32_t *dst = (int32_t *)PyBytes_AS_STRING(rows);
    uint8_t *isnew = (uint8_t *)PyBytes_AS_STRING(fresh);
    const uint8_t *p = blob.buf;
    /* Every key looked up first (a window of lookups fetched ahead at a time), then room
     * made once for the keys not in the key table (a repeated one counted twice): a
     * blob of keys mostly there already (a reopen's parents) grows nothing, a blob of
     * new ones grows the map once, and a failed growth leaves everything as it was. */
    kt_find16_many(kt, p, n, dst);   /* ids, held by the table or not */
    Py_ssize_t absent = 0;
    for (Py_ssize_t i = 0; i < n; i++)
        absent += dst[i] < 0;
    if (absent && kt_reserve(kt, absent) < 0)
        goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        const uint8_t *k = p + i * KEY_BYTES;
        int32_t id = dst[i];
        if (id < 0) {   /* added by an earlier repeat in this blob, or new */
            uint64_t h = kt_hash(k, KEY_BYTES);
            id = kt_find_h(kt, k, KEY_BYTES, h);
            if (id < 0)
                id = kt_add_h(kt, k, KEY_BYTES, h);
        }
        isnew[i] = !held(t, id);
        if (isnew[i]) {
            kt_hold(kt, id, KT_TABLE);   /* its level: NO_LEVEL (kt_add, release, detach) */
            t->count++;
        }
        dst[i] = id;
    }
    PyBuffer_Release(&blob);
    PyObject *res = PyTuple_Pack(2, rows, fresh);
    Py_DECREF(rows);
    Py_DECREF(fresh);
    return res;
done:
    Py_XDECREF(rows);
    Py_XDECREF(fresh);
    PyBuffer_Release(&blob);
    return NULL;
}

static PyObject *
t_release(TableObject *t, PyObject *arg)
{
    Py_buffer rows;
    if (PyObject_GetBuffer(arg, &rows, PyBUF_SIMPLE) < 0)
        return NULL;
    if (check_rows(t, &rows) < 0) {
        PyBuffer_Release(&rows);
        return NULL;
    }
    KeyTab *kt = t->kt;
    const int32_t *r = rows.buf;
    Py_ssize_t n = rows.len / 4;
    for (Py_ssize_t i = 0; i < n; i++) {
        int32_t row = r[i];
        if (!held(t, row))  /* repeated in the buffer */
            continue;
        if (KT_LEVEL(kt, row) != NO_LEVEL)
            t->published--;
        KT_LEVEL(kt, row) = NO_LEVEL;
        t->count--;
        kt_drop(kt, row, KT_TABLE);
    }
    PyBuffer_Release(&rows);
    Py_RETURN_NONE;
}

static PyObject *
t_keys(TableObject *t, PyObject *arg)
{
    Py_buffer rows;
    if (PyObject_GetBuffer(arg, &rows, PyBUF_SIMPLE) < 0)
        return NULL;
    if (check_rows(t, &rows) < 0) {
        PyBuffer_Release(&rows);
        return NULL;
    }
    Py_ssize_t n = rows.len / 4;
    PyObject *out = PyBytes_FromStringAndSize(NULL, n * KEY_BYTES);
    if (out != NULL) {
        const int32_t *r = rows.buf;
        uint8_t *dst = (uint8_t *)PyBytes_AS_STRING(out);
        for (Py_ssize_t i = 0; i < n; i++)
            memcpy(dst + i * KEY_BYTES, KT_KEYOF(t->kt, r[i]), KEY_BYTES);
    }
    PyBuffer_Release(&rows);
    return out;
}

static PyObject *
t_key(TableObject *t, PyObject *arg)
{
    Py_ssize_t r = PyLong_AsSsize_t(arg);
    if (r == -1 && PyErr_Occurred())
        return NULL;
    if (!is_row(t, r)) {
        PyErr_Format(PyExc_KeyError, "row %zd is not a page of this table", r);
        return NULL;
    }
    return PyBytes_FromStringAndSize((const char *)KT_KEYOF(t->kt, (int32_t)r), KEY_BYTES);
}

/* set_levels(rows, levels): levels is bytes (one per row) or one int for all. */
static PyObject *
t_set_levels(TableObject *t, PyObject *args)
{
    PyObject *rows_obj, *lv_obj;
    if (!PyArg_ParseTuple(args, "OO:set_levels", &rows_obj, &lv_obj))
        return NULL;
    Py_buffer rows, lv = {0};
    long one = -1;
    if (PyLong_Check(lv_obj)) {
        one = PyLong_AsLong(lv_obj);
        if (one < 0 || one > NO_LEVEL) {
            if (!PyErr_Occurred())
                PyErr_Format(PyExc_ValueError, "a level is in [0, 255], got %ld", one);
            return NULL;
        }
    } else if (PyObject_GetBuffer(lv_obj, &lv, PyBUF_SIMPLE) < 0) {
        return NULL;
    }
    if (PyObject_GetBuffer(rows_obj, &rows, PyBUF_SIMPLE) < 0) {
        if (one < 0)
            PyBuffer_Release(&lv);
        return NULL;
    }
    PyObject *res = NULL;
    Py_ssize_t n = rows.len / 4;
    if (check_rows(t, &rows) < 0)
        goto done;
    if (one < 0 && lv.len != n) {
        PyErr_Format(PyExc_ValueError, "set_levels: %zd rows but %zd levels", n, lv.len);
        goto done;
    }
    const int32_t *r = rows.buf;
    const uint8_t *l = one < 0 ? lv.buf : NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint8_t v = l ? l[i] : (uint8_t)one;
        uint8_t *cur = &KT_LEVEL(t->kt, r[i]);
        t->published += (*cur == NO_LEVEL) - (v == NO_LEVEL);
        *cur = v;
    }
    res = Py_None;
    Py_INCREF(res);
done:
    PyBuffer_Release(&rows);
    if (one < 0)
        PyBuffer_Release(&lv);
    return res;
}

static PyObject *
t_levels(TableObject *t, PyObject *arg)
{
    Py_buffer rows;
    if (PyObject_GetBuffer(arg, &rows, PyBUF_SIMPLE) < 0)
        return NULL;
    if (check_rows(t, &rows) < 0) {
        PyBuffer_Release(&rows);
        return NULL;
    }
    Py_ssize_t n = rows.len / 4;
    PyObject *out = PyBytes_FromStringAndSize(NULL, n);
    if (out != NULL) {
        const int32_t *r = rows.buf;
        uint8_t *dst = (uint8_t *)PyBytes_AS_STRING(out);
        for (Py_ssize_t i = 0; i < n; i++)
            dst[i] = KT_LEVEL(t->kt, r[i]);
    }
    PyBuffer_Release(&rows);
    return out;
}

/* live_rows() -> bytes of int32: every row held, ascending. */
static PyObject *
t_live_rows(TableObject *t, PyObject *Py_UNUSED(ignored))
{
    PyObject *out = PyBytes_FromStringAndSize(NULL, t->count * 4);
    if (out == NULL)
        return NULL;
    int32_t *dst = (int32_t *)PyBytes_AS_STRING(out);
    Py_ssize_t j = 0;
    for (int32_t r = 0; r < t->kt->high; r++)
        if (held(t, r))
            dst[j++] = r;
    return out;
}

/* -- the KeySet contract over published rows -- */

static inline int
published_level(const TableObject *t, const uint8_t *k)
{
    int32_t id = kt_find(t->kt, k, KEY_BYTES);   /* NO_LEVEL where the table does not hold it */
    return id < 0 ? NO_LEVEL : KT_LEVEL(t->kt, id);
}

/* Keys a scan reads the map slot of ahead (prefetched SCAN_AHEAD keys before that),
 * and the ring that carries each key's hash between the stages. */
#define SCAN_AHEAD 8
#define SCAN_RING 32   /* a power of two >= 2 * SCAN_AHEAD */

/* The leading keys of blob[start:n] that are published: their levels into dst (if not
 * NULL, dst[i] for key i), returns where the run ends. A staged scan: key i + 2A's
 * map slot is prefetched, key i + A's slot read and the record it names prefetched,
 * key i resolved; so a table far larger than the caches costs about one memory latency
 * per A keys, not two or three dependent misses a key (a 4M-row table: 80-90 ns a key
 * before). Reads only: the caller holds the GIL throughout. */
static Py_ssize_t
prefix_scan(const TableObject *t, const uint8_t *p, Py_ssize_t start, Py_ssize_t n, uint8_t *dst)
{
    const KeyTab *kt = t->kt;
    uint64_t hs[SCAN_RING];
    Py_ssize_t i;
    for (i = start; i < n && i < start + 2 * SCAN_AHEAD; i++) {
        hs[i & (SCAN_RING - 1)] = kt_hash(p + i * KEY_BYTES, KEY_BYTES);
        KT_PREFETCH(&kt->slots[hs[i & (SCAN_RING - 1)] & kt->smask]);
    }
    for (i = start; i < n && i < start + SCAN_AHEAD; i++) {
        uint32_t e = kt->slots[hs[i & (SCAN_RING - 1)] & kt->smask];
        if (e != KT_EMPTY)
            KT_PREFETCH(KT_REC(kt, (int32_t)(e & KT_IDX_MASK)));
    }
    for (i = start; i < n; i++) {
        Py_ssize_t a = i + 2 * SCAN_AHEAD, b = i + SCAN_AHEAD;
        if (a < n) {
            hs[a & (SCAN_RING - 1)] = kt_hash(p + a * KEY_BYTES, KEY_BYTES);
            KT_PREFETCH(&kt->slots[hs[a & (SCAN_RING - 1)] & kt->smask]);
        }
        if (b < n) {
            uint32_t e = kt->slots[hs[b & (SCAN_RING - 1)] & kt->smask];
            if (e != KT_EMPTY)
                KT_PREFETCH(KT_REC(kt, (int32_t)(e & KT_IDX_MASK)));
        }
        int32_t id = kt_find_h(kt, p + i * KEY_BYTES, KEY_BYTES, hs[i & (SCAN_RING - 1)]);
        int v = id < 0 ? NO_LEVEL : KT_LEVEL(kt, id);
        if (v == NO_LEVEL)
            break;
        if (dst != NULL)
            dst[i] = (uint8_t)v;
    }
    return i;
}

static PyObject *
t_prefix_len(TableObject *t, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"blob", "start", NULL};
    Py_buffer blob;
    Py_ssize_t start = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "y*|n:prefix_len", kwlist, &blob, &start))
        return NULL;
    Py_ssize_t n = blob.len / KEY_BYTES;
    if (check_blob(&blob) < 0 || start < 0 || start > n) {
        if (!PyErr_Occurred())
            PyErr_Format(PyExc_ValueError, "start must lie in [0, %zd], got %zd", n, start);
        PyBuffer_Release(&blob);
        return NULL;
    }
    Py_ssize_t end = prefix_scan(t, blob.buf, start, n, NULL);
    PyBuffer_Release(&blob);
    return PyLong_FromSsize_t(end - start);
}

static PyObject *
t_prefix_values(TableObject *t, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"blob", NULL};
    Py_buffer blob;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "y*:prefix_values", kwlist, &blob))
        return NULL;
    if (check_blob(&blob) < 0) {
        PyBuffer_Release(&blob);
        return NULL;
    }
    Py_ssize_t n = blob.len / KEY_BYTES;
    PyObject *out = PyBytes_FromStringAndSize(NULL, n);
    if (out == NULL) {
        PyBuffer_Release(&blob);
        return NULL;
    }
    Py_ssize_t i = prefix_scan(t, blob.buf, 0, n, (uint8_t *)PyBytes_AS_STRING(out));
    PyBuffer_Release(&blob);
    if (i < n && _PyBytes_Resize(&out, i) < 0)
        return NULL;
    return out;
}

/* prefix_rows(blob) -> bytes of int32: rows of the leading published keys. */
static PyObject *
t_prefix_rows(TableObject *t, PyObject *arg)
{
    Py_buffer blob;
    if (PyObject_GetBuffer(arg, &blob, PyBUF_SIMPLE) < 0)
        return NULL;
    if (check_blob(&blob) < 0) {
        PyBuffer_Release(&blob);
        return NULL;
    }
    Py_ssize_t n = blob.len / KEY_BYTES, i;
    PyObject *out = PyBytes_FromStringAndSize(NULL, n * 4);
    if (out == NULL) {
        PyBuffer_Release(&blob);
        return NULL;
    }
    int32_t *dst = (int32_t *)PyBytes_AS_STRING(out);
    const uint8_t *p = blob.buf;
    for (i = 0; i < n; i++) {
        if ((i & 63) == 0)
            kt_prefetch16(t->kt, p + i * KEY_BYTES, n - i);
        int32_t r = kt_find(t->kt, p + i * KEY_BYTES, KEY_BYTES);   /* NO_LEVEL where not held */
        if (r < 0 || KT_LEVEL(t->kt, r) == NO_LEVEL)
            break;
        dst[i] = r;
    }
    PyBuffer_Release(&blob);
    if (i < n && _PyBytes_Resize(&out, i * 4) < 0)
        return NULL;
    return out;
}

static PyObject *
t_get(TableObject *t, PyObject *arg)
{
    uint8_t k[KEY_BYTES];
    if (key_from(arg, k) < 0)
        return NULL;
    int v = published_level(t, k);
    if (v == NO_LEVEL)
        Py_RETURN_NONE;
    return PyLong_FromLong(v);
}

static Py_ssize_t
t_len(TableObject *t)
{
    return t->published;
}

static int
t_contains(TableObject *t, PyObject *arg)
{
    uint8_t k[KEY_BYTES];
    if (key_from(arg, k) < 0)
        return -1;
    return published_level(t, k) != NO_LEVEL;
}

static PyObject *
t_get_rows(TableObject *t, void *Py_UNUSED(closure))
{
    return PyLong_FromSsize_t(t->count);
}

static PyObject *
t_get_capacity(TableObject *t, void *Py_UNUSED(closure))
{
    Py_ssize_t cap = ROWS_MIN;   /* doubling, so that the columns are not copied per row */
    while (cap < t->kt->high)
        cap *= 2;
    return PyLong_FromSsize_t(cap);
}

static PyObject *
t_get_nbytes(TableObject *t, void *Py_UNUSED(closure))
{
    /* the key table where it is the table's own; a shared one is counted by the policy
     * that made it (GittinsPolicy.memory_bytes) */
    return PyLong_FromSize_t(t->own ? kt_nbytes(t->kt) : 0);
}

static PyMethodDef t_methods[] = {
    {"find", (PyCFunction)t_find, METH_O, "find(blob) -> bytes: the int32 row of each 16-byte key, -1 if absent."},
    {"row", (PyCFunction)t_row, METH_O, "row(key) -> int: the key's row, -1 if absent."},
    {"ensure", (PyCFunction)t_ensure, METH_O,
     "ensure(blob) -> (rows, fresh): the int32 row of each key, allocating rows for absent keys\n"
     "(fresh: one byte per key, 1 where the row is new). New rows are unpublished."},
    {"release", (PyCFunction)t_release, METH_O, "release(rows): free int32 rows (their keys leave the table)."},
    {"keys", (PyCFunction)t_keys, METH_O, "keys(rows) -> bytes: the 16-byte keys of int32 rows."},
    {"key", (PyCFunction)t_key, METH_O, "key(row) -> bytes: one row's key."},
    {"set_levels", (PyCFunction)t_set_levels, METH_VARARGS,
     "set_levels(rows, levels): publish rows at levels (bytes, one per row, or one int; 255 unpublishes)."},
    {"levels", (PyCFunction)t_levels, METH_O, "levels(rows) -> bytes: each row's level (255: unpublished)."},
    {"live_rows", (PyCFunction)t_live_rows, METH_NOARGS, "live_rows() -> bytes: every allocated int32 row, ascending."},
    {"prefix_len", (PyCFunction)(void (*)(void))t_prefix_len, METH_VARARGS | METH_KEYWORDS,
     "prefix_len(blob, start=0) -> int: how many consecutive keys from start on are published."},
    {"prefix_values", (PyCFunction)(void (*)(void))t_prefix_values, METH_VARARGS | METH_KEYWORDS,
     "prefix_values(blob) -> bytes: the level of each leading published key."},
    {"prefix_rows", (PyCFunction)t_prefix_rows, METH_O, "prefix_rows(blob) -> bytes: int32 rows of the leading published keys."},
    {"get", (PyCFunction)t_get, METH_O, "get(key): the key's level if published, else None."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef t_getset[] = {
    {"rows", (getter)t_get_rows, NULL, "allocated rows (published or not)", NULL},
    {"capacity", (getter)t_get_capacity, NULL, "length the per-row arrays need: every row is below it", NULL},
    {"nbytes", (getter)t_get_nbytes, NULL, "bytes allocated for the keys, levels and map (0: a key table passed in)", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PySequenceMethods t_as_sequence = {
    .sq_length = (lenfunc)t_len,
    .sq_contains = (objobjproc)t_contains,
};

PyDoc_STRVAR(t_doc,
"PageTable(keys=None)\n\n"
"16-byte page keys to dense int32 rows, with each row's published level. keys: a key\n"
"table from tierkv.policy._ghost.new_keys() to keep them in (shared with the policy\n"
"structures that use it; one page table a key table). len() and\n"
"`in` count published rows only (the KeySet contract). Keys are bytes-like of 16 bytes\n"
"(ValueError otherwise); rows are int32 buffers (KeyError for a row not allocated).");

static PyTypeObject TableType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "tierkv._table.PageTable",
    .tp_basicsize = sizeof(TableObject),
    .tp_dealloc = (destructor)t_dealloc,
    .tp_as_sequence = &t_as_sequence,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = t_doc,
    .tp_methods = t_methods,
    .tp_getset = t_getset,
    .tp_new = t_new,
};

/* ------------------------------------------------------------------ RowMap */

/* Rows to nonzero int64 values: one level's column of the page table where few rows
 * have a value (a fast tier's slots and cached-child counts: tierkv/store/table.py's
 * SparseColumn). Open addressing on the row (Fibonacci hashing, linear probing,
 * backward-shift deletion), load at most 0.7, shrinking below 0.1; a value set to 0
 * removes its row. Rows are int64 buffers (each 0 to 2**31 - 2), values int64 buffers. */

#define RM_EMPTY (-1)
#define RM_MIN_BITS 4

typedef struct {
    PyObject_HEAD
    int32_t *rows;        /* RM_EMPTY: free */
    int64_t *vals;
    int bits;             /* capacity 2**bits */
    Py_ssize_t count;
} RowMapObject;

static inline size_t
rm_home(const RowMapObject *m, int32_t row)
{
    return (size_t)(((uint64_t)(uint32_t)row * UINT64_C(0x9E3779B97F4A7C15)) >> (64 - m->bits));
}

/* Where row is, or the free slot where it would go. */
static inline size_t
rm_probe(const RowMapObject *m, int32_t row)
{
    size_t mask = ((size_t)1 << m->bits) - 1, i = rm_home(m, row);
    while (m->rows[i] != RM_EMPTY && m->rows[i] != row)
        i = (i + 1) & mask;
    return i;
}

/* Rehash into 2**bits slots; -1 with MemoryError (the map unchanged). */
static int
rm_resize(RowMapObject *m, int bits)
{
    size_t cap = (size_t)1 << bits;
    int32_t *rows = PyMem_Malloc(cap * sizeof(int32_t));
    int64_t *vals = PyMem_Malloc(cap * sizeof(int64_t));
    if (rows == NULL || vals == NULL) {
        PyMem_Free(rows);
        PyMem_Free(vals);
        PyErr_NoMemory();
        return -1;
    }
    memset(rows, 0xff, cap * sizeof(int32_t));
    int32_t *orows = m->rows;
    int64_t *ovals = m->vals;
    size_t ocap = orows == NULL ? 0 : (size_t)1 << m->bits;
    m->rows = rows;
    m->vals = vals;
    m->bits = bits;
    for (size_t j = 0; j < ocap; j++) {
        if (orows[j] == RM_EMPTY)
            continue;
        size_t i = rm_probe(m, orows[j]);
        m->rows[i] = orows[j];
        m->vals[i] = ovals[j];
    }
    PyMem_Free(orows);
    PyMem_Free(ovals);
    return 0;
}

/* Room for n more rows without a resize; -1 with MemoryError. */
static int
rm_reserve(RowMapObject *m, Py_ssize_t n)
{
    int bits = m->bits;
    while ((double)(m->count + n) > 0.7 * (double)((size_t)1 << bits))
        bits++;
    return bits == m->bits ? 0 : rm_resize(m, bits);
}

static void
rm_delete_at(RowMapObject *m, size_t i)
{
    size_t mask = ((size_t)1 << m->bits) - 1, j = i;
    for (;;) {
        j = (j + 1) & mask;
        if (m->rows[j] == RM_EMPTY)
            break;
        size_t h = rm_home(m, m->rows[j]);
        /* move j back to i unless its home lies cyclically in (i, j] */
        if ((j > i && (h <= i || h > j)) || (j < i && (h <= i && h > j))) {
            m->rows[i] = m->rows[j];
            m->vals[i] = m->vals[j];
            i = j;
        }
    }
    m->rows[i] = RM_EMPTY;
    m->count--;
}

/* Set row to v (0 removes it); room must be reserved for an insert. */
static void
rm_set(RowMapObject *m, int32_t row, int64_t v)
{
    size_t i = rm_probe(m, row);
    if (m->rows[i] == row) {
        if (v != 0)
            m->vals[i] = v;
        else
            rm_delete_at(m, i);
    } else if (v != 0) {
        m->rows[i] = row;
        m->vals[i] = v;
        m->count++;
    }
}

static inline int64_t
rm_get(const RowMapObject *m, int32_t row)
{
    size_t i = rm_probe(m, row);
    return m->rows[i] == row ? m->vals[i] : 0;
}

/* After removals: back to a smaller table where it is mostly empty (failing to is harmless). */
static void
rm_maybe_shrink(RowMapObject *m)
{
    int bits = m->bits;
    while (bits > RM_MIN_BITS && (double)m->count < 0.1 * (double)((size_t)1 << bits))
        bits--;
    while (bits < m->bits && (double)m->count > 0.35 * (double)((size_t)1 << bits))
        bits++;
    if (bits < m->bits && rm_resize(m, bits) < 0)
        PyErr_Clear();
}

static int
rm_row_ok(int64_t r)
{
    if (r < 0 || r > INT32_MAX - 1) {
        PyErr_Format(PyExc_ValueError, "a row is 0 to %d, got %lld", INT32_MAX - 1, (long long)r);
        return 0;
    }
    return 1;
}

/* A contiguous buffer of int64 (or, with narrow, int32: a numpy array of either) items:
 * their number, and in *wide whether they are 8 bytes; -1 with an exception. bytes and
 * bytearray are int64; any other byte buffer (a numpy uint8 array) is refused. */
static Py_ssize_t
rm_buffer(PyObject *obj, Py_buffer *view, const char *what, int narrow, int *wide)
{
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
        return -1;
    const char *f = view->format == NULL ? "B" : view->format;
    if (*f == '<' || *f == '=' || *f == '@')
        f++;
    *wide = !(narrow && view->itemsize == 4 && (*f == 'i' || (*f == 'l' && sizeof(long) == 4)));
    int raw = PyBytes_Check(obj) || PyByteArray_Check(obj);
    int ok = *wide ? (view->itemsize == 8 && (*f == 'q' || *f == 'l')) || (raw && view->len % 8 == 0) : 1;
    if (!ok) {
        PyErr_Format(PyExc_ValueError, "%s must be int64%s values, got a buffer of %zd bytes of format %s", what,
                     narrow ? " or int32" : "", view->len, f);
        PyBuffer_Release(view);
        return -1;
    }
    return view->len / (*wide ? 8 : 4);
}

static inline int64_t
rm_at(const Py_buffer *view, int wide, Py_ssize_t i)
{
    return wide ? ((const int64_t *)view->buf)[i] : ((const int32_t *)view->buf)[i];
}

static PyObject *
rm_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, ":RowMap", kwlist))
        return NULL;
    RowMapObject *m = (RowMapObject *)type->tp_alloc(type, 0);
    if (m == NULL)
        return NULL;
    if (rm_resize(m, RM_MIN_BITS) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return (PyObject *)m;
}

static void
rm_dealloc(RowMapObject *m)
{
    PyMem_Free(m->rows);
    PyMem_Free(m->vals);
    Py_TYPE(m)->tp_free((PyObject *)m);
}

static Py_ssize_t
rm_len(RowMapObject *m)
{
    return m->count;
}

static PyObject *
rm_get_many(RowMapObject *m, PyObject *arg)
{
    Py_buffer rv;
    int wide;
    Py_ssize_t n = rm_buffer(arg, &rv, "rows", 1, &wide);
    if (n < 0)
        return NULL;
    PyObject *out = PyBytes_FromStringAndSize(NULL, n * 8);
    if (out != NULL) {
        int64_t *o = (int64_t *)PyBytes_AS_STRING(out);
        for (Py_ssize_t i = 0; i < n; i++) {
            int64_t r = rm_at(&rv, wide, i);
            if (!rm_row_ok(r)) {
                Py_CLEAR(out);
                break;
            }
            o[i] = rm_get(m, (int32_t)r);
        }
    }
    PyBuffer_Release(&rv);
    return out;
}

/* put (add == 0: rows[i] = vals[i], the last of a repeated row wins) or add (rows[i] +=
 * vals[i], each occurrence counted). All or nothing: bad rows and memory are checked first. */
static PyObject *
rm_update(RowMapObject *m, PyObject *args, int add)
{
    PyObject *ro, *vo;
    if (!PyArg_ParseTuple(args, add ? "OO:add" : "OO:put", &ro, &vo))
        return NULL;
    Py_buffer rv, vv;
    int wide, vwide;
    Py_ssize_t n = rm_buffer(ro, &rv, "rows", 1, &wide);
    if (n < 0)
        return NULL;
    Py_ssize_t nv = rm_buffer(vo, &vv, "values", 0, &vwide);
    if (nv < 0) {
        PyBuffer_Release(&rv);
        return NULL;
    }
    PyObject *res = NULL;
    const int64_t *vals = vv.buf;
    if (nv != n) {
        PyErr_Format(PyExc_ValueError, "%zd rows and %zd values", n, nv);
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++)
        if (!rm_row_ok(rm_at(&rv, wide, i)))
            goto done;
    if (rm_reserve(m, n) < 0)
        goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        int32_t r = (int32_t)rm_at(&rv, wide, i);
        rm_set(m, r, add ? (int64_t)((uint64_t)rm_get(m, r) + (uint64_t)vals[i]) : vals[i]);
    }
    rm_maybe_shrink(m);
    res = Py_None;
    Py_INCREF(res);
done:
    PyBuffer_Release(&rv);
    PyBuffer_Release(&vv);
    return res;
}

static PyObject *
rm_put(RowMapObject *m, PyObject *args)
{
    return rm_update(m, args, 0);
}

static PyObject *
rm_add(RowMapObject *m, PyObject *args)
{
    return rm_update(m, args, 1);
}

static PyObject *
rm_get1(RowMapObject *m, PyObject *arg)
{
    long long r = PyLong_AsLongLong(arg);
    if (r == -1 && PyErr_Occurred())
        return NULL;
    if (!rm_row_ok(r))
        return NULL;
    return PyLong_FromLongLong(rm_get(m, (int32_t)r));
}

static PyObject *
rm_put1(RowMapObject *m, PyObject *args)
{
    long long r, v;
    if (!PyArg_ParseTuple(args, "LL:put1", &r, &v))
        return NULL;
    if (!rm_row_ok(r) || rm_reserve(m, 1) < 0)
        return NULL;
    rm_set(m, (int32_t)r, v);
    if (v == 0)
        rm_maybe_shrink(m);
    Py_RETURN_NONE;
}

static PyObject *
rm_items(RowMapObject *m, PyObject *Py_UNUSED(ignored))
{
    PyObject *rows = PyBytes_FromStringAndSize(NULL, m->count * 8);
    PyObject *vals = PyBytes_FromStringAndSize(NULL, m->count * 8);
    if (rows == NULL || vals == NULL) {
        Py_XDECREF(rows);
        Py_XDECREF(vals);
        return NULL;
    }
    int64_t *ro = (int64_t *)PyBytes_AS_STRING(rows), *vo = (int64_t *)PyBytes_AS_STRING(vals);
    Py_ssize_t k = 0;
    for (size_t j = 0; j < (size_t)1 << m->bits; j++) {
        if (m->rows[j] != RM_EMPTY) {
            ro[k] = m->rows[j];
            vo[k++] = m->vals[j];
        }
    }
    return Py_BuildValue("(NN)", rows, vals);
}

static PyObject *
rm_get_nbytes(RowMapObject *m, void *Py_UNUSED(closure))
{
    return PyLong_FromSize_t(((size_t)1 << m->bits) * (sizeof(int32_t) + sizeof(int64_t)));
}

static PyMethodDef rm_methods[] = {
    {"get", (PyCFunction)rm_get_many, METH_O, "get(rows) -> bytes: each row's value as int64 (0: none)."},
    {"put", (PyCFunction)rm_put, METH_VARARGS,
     "put(rows, values): set each row's value in order (0 removes it), all or nothing."},
    {"add", (PyCFunction)rm_add, METH_VARARGS,
     "add(rows, deltas): add each delta to its row's value, a repeated row once per occurrence."},
    {"get1", (PyCFunction)rm_get1, METH_O, "get1(row) -> int: one row's value (0: none)."},
    {"put1", (PyCFunction)rm_put1, METH_VARARGS, "put1(row, value): set one row's value (0 removes it)."},
    {"items", (PyCFunction)rm_items, METH_NOARGS, "items() -> (rows, values): int64 bytes of every row held, in no order."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef rm_getset[] = {
    {"nbytes", (getter)rm_get_nbytes, NULL, "bytes allocated", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PySequenceMethods rm_as_sequence = {
    .sq_length = (lenfunc)rm_len,
};

PyDoc_STRVAR(rm_doc,
"RowMap()\n\n"
"Rows (0 to 2**31 - 2) to nonzero int64 values: a page table column where few rows\n"
"have a value. Rows are contiguous int64 or int32 buffers (numpy arrays; bytes are\n"
"int64), values int64. Not thread-safe.");

static PyTypeObject RowMapType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "tierkv._table.RowMap",
    .tp_basicsize = sizeof(RowMapObject),
    .tp_dealloc = (destructor)rm_dealloc,
    .tp_as_sequence = &rm_as_sequence,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = rm_doc,
    .tp_methods = rm_methods,
    .tp_getset = rm_getset,
    .tp_new = rm_new,
};

static struct PyModuleDef table_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "tierkv._table",
    .m_doc = "The block manager's page table core: keys to rows, published levels; sparse columns.",
    .m_size = -1,
};

PyMODINIT_FUNC
PyInit__table(void)
{
    if (PyType_Ready(&TableType) < 0 || PyType_Ready(&RowMapType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&table_module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddObjectRef(m, "PageTable", (PyObject *)&TableType) < 0
        || PyModule_AddObjectRef(m, "RowMap", (PyObject *)&RowMapType) < 0
        || PyModule_AddIntConstant(m, "NO_LEVEL", NO_LEVEL) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
