/* tierkv._table: the block manager's page table core, in C.
 *
 * Maps 16-byte page keys to dense row numbers and keeps, per row, the key and the level
 * of the fastest tier the page is published in (0xFF: not published, so not resident).
 * Everything else the manager knows of a page lives in numpy columns indexed by row
 * (tierkv/store/table.py), so a page costs no Python object anywhere.
 *
 * Rows are handed out from a free stack (last freed, first reused) and are dense:
 * columns grow with `capacity`. The map is open addressing with linear probing and
 * backward-shift deletion over int32 row numbers (-1 free), load below 0.7; a probe
 * compares the row's key in the key column. Every call holds the GIL throughout; the
 * caller (the manager, under the store lock) serializes compound use.
 *
 * The lookup half (prefix_len, prefix_values, get, __contains__, __len__) has the
 * contract of tierkv._native.KeySet over the *published* rows, so the table is the
 * store's resident-key index too: a lookup is one C scan.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#ifdef __linux__
#include <sys/mman.h>
#endif

#define KEY_BYTES 16
#define NO_LEVEL 0xFF
#define MAP_MIN_LOG2 10
#define ROWS_MIN 1024
#define MAX_ROWS ((Py_ssize_t)INT32_MAX)
#define PREFETCH_AHEAD 8

#if defined(__GNUC__) || defined(__clang__)
#define PREFETCH(p) __builtin_prefetch(p)
#else
#define PREFETCH(p) ((void)0)
#endif

typedef struct {
    uint64_t w[2];
} Key;

typedef struct {
    PyObject_HEAD
    Key *keys;            /* per row */
    uint8_t *level;       /* per row: fastest published level, NO_LEVEL if none */
    uint8_t *live;        /* per row: 1 while the row is allocated */
    int32_t *free_rows;   /* stack of freed rows */
    Py_ssize_t nfree;
    Py_ssize_t high;      /* rows ever handed out: rows >= high are fresh */
    Py_ssize_t cap;       /* length of the per-row arrays */
    Py_ssize_t count;     /* live rows */
    Py_ssize_t published; /* live rows with a level */
    int32_t *map;         /* slot -> row, -1 free */
    size_t mask;
    int shift;
} TableObject;

static inline size_t
home_of(const TableObject *t, const Key *k)
{
    /* Both halves mixed in by multiplication: keys whose halves XOR to one value (made on
     * purpose; real keys are xxh3 digests) must not share one probe chain. */
    uint64_t x = (k->w[0] ^ (k->w[1] * UINT64_C(0xC2B2AE3D27D4EB4F))) * UINT64_C(0x9E3779B97F4A7C15);
    return (size_t)((x ^ (x >> 29)) >> t->shift);
}

static inline int
key_eq(const Key *a, const Key *b)
{
    return a->w[0] == b->w[0] && a->w[1] == b->w[1];
}

/* Map slot holding key k, probing from slot i on (its home slot, or the one after a slot
 * already checked), or -1. */
static Py_ssize_t
slot_from(const TableObject *t, const Key *k, size_t i)
{
    for (;;) {
        int32_t r = t->map[i];
        if (r < 0)
            return -1;
        if (key_eq(&t->keys[r], k))
            return (Py_ssize_t)i;
        i = (i + 1) & t->mask;
    }
}

/* Map slot holding key k, or -1. */
static Py_ssize_t
slot_of(const TableObject *t, const Key *k)
{
    return slot_from(t, k, home_of(t, k));
}

static inline int32_t
row_of(const TableObject *t, const Key *k)
{
    Py_ssize_t s = slot_of(t, k);
    return s < 0 ? -1 : t->map[s];
}

static void
map_insert(TableObject *t, int32_t row)
{
    size_t i = home_of(t, &t->keys[row]);
    while (t->map[i] >= 0)
        i = (i + 1) & t->mask;
    t->map[i] = row;
}

/* Ask for transparent huge pages over the whole 2 MiB pages of a large array (Linux, where
 * THP is "madvise"): a lookup's random reads of the map and the keys then miss the TLB far
 * less (a 4M-row table: 30 -> 17-19 ns a key when its lines are cached). Best effort. */
static void
advise_huge(void *p, size_t bytes)
{
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    const uintptr_t huge = (uintptr_t)2 << 20;
    uintptr_t start = ((uintptr_t)p + huge - 1) & ~(huge - 1), end = ((uintptr_t)p + bytes) & ~(huge - 1);
    if (end > start)
        (void)madvise((void *)start, end - start, MADV_HUGEPAGE);
#else
    (void)p;
    (void)bytes;
#endif
}

static int
map_rebuild(TableObject *t, int log2cap)
{
    if (log2cap > 40) {
        PyErr_NoMemory();
        return -1;
    }
    size_t cap = (size_t)1 << log2cap;
    int32_t *map = PyMem_Malloc(cap * sizeof(int32_t));
    if (map == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    advise_huge(map, cap * sizeof(int32_t));
    memset(map, 0xFF, cap * sizeof(int32_t));
    PyMem_Free(t->map);
    t->map = map;
    t->mask = cap - 1;
    t->shift = 64 - log2cap;
    for (Py_ssize_t r = 0; r < t->high; r++)
        if (t->live[r])
            map_insert(t, (int32_t)r);
    return 0;
}

static void
map_delete(TableObject *t, Py_ssize_t found)
{
    size_t hole = (size_t)found, j = hole;
    for (;;) {
        j = (j + 1) & t->mask;
        int32_t r = t->map[j];
        if (r < 0)
            break;
        size_t home = home_of(t, &t->keys[r]);
        int stays = j > hole ? (hole < home && home <= j) : (hole < home || home <= j);
        if (!stays) {
            t->map[hole] = r;
            hole = j;
        }
    }
    t->map[hole] = -1;
}

static int
grow_rows(TableObject *t, Py_ssize_t want)
{
    if (want <= t->cap)
        return 0;
    if (want > MAX_ROWS) {
        PyErr_Format(PyExc_OverflowError, "the page table holds at most %zd pages", MAX_ROWS);
        return -1;
    }
    Py_ssize_t cap = t->cap ? t->cap : ROWS_MIN;
    while (cap < want)
        cap = cap > MAX_ROWS / 2 ? MAX_ROWS : cap * 2;
    Key *keys = PyMem_Realloc(t->keys, (size_t)cap * sizeof(Key));
    if (keys == NULL)
        goto fail;
    t->keys = keys;
    advise_huge(keys, (size_t)cap * sizeof(Key));
    uint8_t *level = PyMem_Realloc(t->level, (size_t)cap);
    if (level == NULL)
        goto fail;
    t->level = level;
    advise_huge(level, (size_t)cap);
    uint8_t *live = PyMem_Realloc(t->live, (size_t)cap);
    if (live == NULL)
        goto fail;
    t->live = live;
    int32_t *fr = PyMem_Realloc(t->free_rows, (size_t)cap * sizeof(int32_t));
    if (fr == NULL)
        goto fail;
    t->free_rows = fr;
    memset(t->level + t->cap, NO_LEVEL, (size_t)(cap - t->cap));
    memset(t->live + t->cap, 0, (size_t)(cap - t->cap));
    t->cap = cap;
    return 0;
fail:
    PyErr_NoMemory();
    return -1;
}

/* ------------------------------------------------------------------ argument helpers */

static int
key_from(PyObject *obj, Key *out)
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

/* Rows of a buffer of int32 row numbers; each must be live. */
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
        if (r[i] < 0 || r[i] >= t->high || !t->live[r[i]]) {
            PyErr_Format(PyExc_KeyError, "row %d is not a page of this table", (int)r[i]);
            return -1;
        }
    return 0;
}

/* ------------------------------------------------------------------ methods */

static PyObject *
t_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, ":PageTable", kwlist))
        return NULL;
    TableObject *t = (TableObject *)type->tp_alloc(type, 0);
    if (t == NULL)
        return NULL;
    if (grow_rows(t, ROWS_MIN) < 0 || map_rebuild(t, MAP_MIN_LOG2) < 0) {
        Py_DECREF(t);
        return NULL;
    }
    return (PyObject *)t;
}

static void
t_dealloc(TableObject *t)
{
    PyMem_Free(t->keys);
    PyMem_Free(t->level);
    PyMem_Free(t->live);
    PyMem_Free(t->free_rows);
    PyMem_Free(t->map);
    Py_TYPE(t)->tp_free((PyObject *)t);
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
    if (out != NULL) {
        int32_t *dst = (int32_t *)PyBytes_AS_STRING(out);
        const uint8_t *p = blob.buf;
        for (Py_ssize_t i = 0; i < n; i++) {
            Key k;
            if (i + PREFETCH_AHEAD < n) {
                memcpy(&k, p + (i + PREFETCH_AHEAD) * KEY_BYTES, KEY_BYTES);
                PREFETCH(&t->map[home_of(t, &k)]);
            }
            memcpy(&k, p + i * KEY_BYTES, KEY_BYTES);
            dst[i] = row_of(t, &k);
        }
    }
    PyBuffer_Release(&blob);
    return out;
}

static PyObject *
t_row(TableObject *t, PyObject *arg)
{
    Key k;
    if (key_from(arg, &k) < 0)
        return NULL;
    return PyLong_FromLong(row_of(t, &k));
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
    Py_ssize_t n = blob.len / KEY_BYTES;
    PyObject *rows = NULL, *fresh = NULL;
    rows = PyBytes_FromStringAndSize(NULL, n * 4);
    fresh = PyBytes_FromStringAndSize(NULL, n);
    if (rows == NULL || fresh == NULL)
        goto done;
    int32_t *dst = (int32_t *)PyBytes_AS_STRING(rows);
    uint8_t *isnew = (uint8_t *)PyBytes_AS_STRING(fresh);
    const uint8_t *p = blob.buf;
    /* The map and the rows grow as new keys come (doubling), not by n up front: a blob of
     * keys mostly in the table already (a reopen's parents) must not double them. A
     * failed growth takes back this call's new rows, so nothing is half done. */
    for (Py_ssize_t i = 0; i < n; i++) {
        Key k;
        memcpy(&k, p + i * KEY_BYTES, KEY_BYTES);
        int32_t r = row_of(t, &k);
        isnew[i] = r < 0;
        if (r < 0) {
            if (((size_t)(t->count + 1) * 10 > (t->mask + 1) * 7 && map_rebuild(t, 65 - t->shift) < 0)
                || (!t->nfree && grow_rows(t, t->high + 1) < 0)) {
                /* Newest first: the free stack as it was, then the rows taken from `high` on
                 * top of it, in the order `high` would have handed them out. */
                for (Py_ssize_t j = i - 1; j >= 0; j--) {
                    if (!isnew[j])
                        continue;
                    int32_t q = dst[j];
                    map_delete(t, slot_of(t, &t->keys[q]));
                    t->live[q] = 0;
                    t->count--;
                    t->free_rows[t->nfree++] = q;
                }
                goto done;
            }
            r = t->nfree ? t->free_rows[--t->nfree] : (int32_t)t->high++;
            t->keys[r] = k;
            t->live[r] = 1;
            t->level[r] = NO_LEVEL;
            t->count++;
            map_insert(t, r);
        }
        dst[i] = r;
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
    const int32_t *r = rows.buf;
    Py_ssize_t n = rows.len / 4;
    for (Py_ssize_t i = 0; i < n; i++) {
        int32_t row = r[i];
        if (!t->live[row])  /* repeated in the buffer */
            continue;
        map_delete(t, slot_of(t, &t->keys[row]));
        if (t->level[row] != NO_LEVEL)
            t->published--;
        t->level[row] = NO_LEVEL;
        t->live[row] = 0;
        t->count--;
        t->free_rows[t->nfree++] = row;
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
            memcpy(dst + i * KEY_BYTES, &t->keys[r[i]], KEY_BYTES);
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
    if (r < 0 || r >= t->high || !t->live[r]) {
        PyErr_Format(PyExc_KeyError, "row %zd is not a page of this table", r);
        return NULL;
    }
    return PyBytes_FromStringAndSize((const char *)&t->keys[r], KEY_BYTES);
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
        uint8_t *cur = &t->level[r[i]];
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
            dst[i] = t->level[r[i]];
    }
    PyBuffer_Release(&rows);
    return out;
}

/* live_rows() -> bytes of int32: every allocated row, ascending. */
static PyObject *
t_live_rows(TableObject *t, PyObject *Py_UNUSED(ignored))
{
    PyObject *out = PyBytes_FromStringAndSize(NULL, t->count * 4);
    if (out == NULL)
        return NULL;
    int32_t *dst = (int32_t *)PyBytes_AS_STRING(out);
    Py_ssize_t j = 0;
    for (Py_ssize_t r = 0; r < t->high; r++)
        if (t->live[r])
            dst[j++] = (int32_t)r;
    return out;
}

/* -- the KeySet contract over published rows -- */

static inline int
published_level(const TableObject *t, const Key *k)
{
    int32_t r = row_of(t, k);
    return r < 0 ? NO_LEVEL : t->level[r];
}

/* Keys a scan reads the map slot of ahead (prefetched SCAN_AHEAD keys before that),
 * and the ring that carries each key's home slot and first row between the stages. */
#define SCAN_AHEAD 8
#define SCAN_RING 32   /* a power of two >= 2 * SCAN_AHEAD */

/* The leading keys of blob[start:n] that are published: their levels into dst (if not
 * NULL, dst[i] for key i), returns where the run ends. A staged scan: key i + 2A's
 * home slot is prefetched, key i + A's slot read and its row's key and level
 * prefetched, key i resolved; so a table far larger than the caches costs about one
 * memory latency per A keys, not two or three dependent misses a key (a 4M-row table:
 * 80-90 ns a key before). Reads only: the caller holds the GIL throughout. */
static Py_ssize_t
prefix_scan(const TableObject *t, const uint8_t *p, Py_ssize_t start, Py_ssize_t n, uint8_t *dst)
{
    size_t home[SCAN_RING];
    int32_t first[SCAN_RING];
    Key k;
    Py_ssize_t i;
    for (i = start; i < n && i < start + 2 * SCAN_AHEAD; i++) {
        memcpy(&k, p + i * KEY_BYTES, KEY_BYTES);
        home[i & (SCAN_RING - 1)] = home_of(t, &k);
        PREFETCH(&t->map[home[i & (SCAN_RING - 1)]]);
    }
    for (i = start; i < n && i < start + SCAN_AHEAD; i++) {
        int32_t r = t->map[home[i & (SCAN_RING - 1)]];
        first[i & (SCAN_RING - 1)] = r;
        if (r >= 0) {
            PREFETCH(&t->keys[r]);
            PREFETCH(&t->level[r]);
        }
    }
    for (i = start; i < n; i++) {
        Py_ssize_t a = i + 2 * SCAN_AHEAD, b = i + SCAN_AHEAD;
        if (a < n) {
            memcpy(&k, p + a * KEY_BYTES, KEY_BYTES);
            home[a & (SCAN_RING - 1)] = home_of(t, &k);
            PREFETCH(&t->map[home[a & (SCAN_RING - 1)]]);
        }
        if (b < n) {
            int32_t r = t->map[home[b & (SCAN_RING - 1)]];
            first[b & (SCAN_RING - 1)] = r;
            if (r >= 0) {
                PREFETCH(&t->keys[r]);
                PREFETCH(&t->level[r]);
            }
        }
        memcpy(&k, p + i * KEY_BYTES, KEY_BYTES);
        int32_t r = first[i & (SCAN_RING - 1)];
        int v;
        if (r < 0)
            v = NO_LEVEL;
        else if (key_eq(&t->keys[r], &k))
            v = t->level[r];
        else {   /* another key holds the home slot: probe on from the next one */
            Py_ssize_t slot = slot_from(t, &k, (home[i & (SCAN_RING - 1)] + 1) & t->mask);
            v = slot < 0 ? NO_LEVEL : t->level[t->map[slot]];
        }
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
        Key k;
        memcpy(&k, p + i * KEY_BYTES, KEY_BYTES);
        int32_t r = row_of(t, &k);
        if (r < 0 || t->level[r] == NO_LEVEL)
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
    Key k;
    if (key_from(arg, &k) < 0)
        return NULL;
    int v = published_level(t, &k);
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
    Key k;
    if (key_from(arg, &k) < 0)
        return -1;
    return published_level(t, &k) != NO_LEVEL;
}

static PyObject *
t_get_rows(TableObject *t, void *Py_UNUSED(closure))
{
    return PyLong_FromSsize_t(t->count);
}

static PyObject *
t_get_capacity(TableObject *t, void *Py_UNUSED(closure))
{
    return PyLong_FromSsize_t(t->cap);
}

static PyObject *
t_get_nbytes(TableObject *t, void *Py_UNUSED(closure))
{
    /* per row: key, level, live flag, free-stack entry; the map's slots */
    size_t n = (size_t)t->cap * (sizeof(Key) + 2 + sizeof(int32_t)) + (t->map != NULL ? (t->mask + 1) * sizeof(int32_t) : 0);
    return PyLong_FromSize_t(n);
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
    {"capacity", (getter)t_get_capacity, NULL, "length of the per-row arrays: every row is below it", NULL},
    {"nbytes", (getter)t_get_nbytes, NULL, "bytes allocated for the keys, per-row arrays and map", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PySequenceMethods t_as_sequence = {
    .sq_length = (lenfunc)t_len,
    .sq_contains = (objobjproc)t_contains,
};

PyDoc_STRVAR(t_doc,
"PageTable()\n\n"
"16-byte page keys to dense int32 rows, with each row's published level. len() and\n"
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

static struct PyModuleDef table_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "tierkv._table",
    .m_doc = "The block manager's page table core: keys to rows, published levels.",
    .m_size = -1,
};

PyMODINIT_FUNC
PyInit__table(void)
{
    if (PyType_Ready(&TableType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&table_module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddObjectRef(m, "PageTable", (PyObject *)&TableType) < 0
        || PyModule_AddIntConstant(m, "NO_LEVEL", NO_LEVEL) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
