/*
 * tierkv.policy._ghost: the compiled ghost of GittinsPolicy (see tierkv/policy/gittins.py).
 *
 * The pages one tier's policy remembers, resident or not: per key its last access, how
 * often it has been accessed (saturating at 15: only min(bit_length, 4) is ever read),
 * its class and the page after it in the last request that used it. Keys are kept in
 * the order of their last access (an intrusive doubly linked list: move to the end on
 * access, forget the oldest first), exactly as the pure-Python path's OrderedDict.
 *
 * on_request() runs GittinsPolicy's whole per-request pass over the keys in one call:
 * the prefix walk that decides whether the request continues a prompt (and marks an
 * abandoned branch), the per-key ghost update and class, the next-page links, and the
 * forgetting of the oldest. It returns the reuse model's observations in the order the
 * Python path makes them (ReuseModel.record_many applies them in that order) and the
 * keys moved to the abandoned class, which the caller re-classes in its leaf heaps.
 *
 * gittins_index() computes the reuse model's index table (tierkv.policy.hazard's refresh):
 * the numpy formula's operations in the same order, so the same bits.
 *
 * Layout: the keys in a key table (keytab.h: each key once under a dense id, and the
 * map from keys to ids), which GittinsPolicy shares with the tier's LeafHeaps (a Ghost
 * made without one has its own); its 20-byte node per key lives in the key's record
 * there. Not thread-safe (callers hold the GIL). A failed allocation while
 * half-updated marks the object broken: later calls raise.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "keytab.h"

#define KEY_MAX KT_KEY
#define IDX_BITS 28
#define IDX_MASK ((UINT32_C(1) << IDX_BITS) - 1)
#define COUNT_MAX 15

/* Classes, as in tierkv.policy.gittins. */
#define HOT_CLASS 4
#define CONTINUING 5
#define ABANDONED 6
/* Observation kinds, as in tierkv.policy.hazard. */
#define OBS_START 0
#define OBS_REUSE 1
#define OBS_CENSOR 2

/* 20 bytes, at the index of its key's id: three links of 28 bits (IDX_MASK for none),
 * whose high 4 bits hold nothing (W_OLDER), the access count (saturating at COUNT_MAX)
 * and the class. */
#pragma pack(push, 4)
typedef struct {
    double last;          /* last access */
    uint32_t w[3];        /* W_OLDER, W_NEWER (the access order), W_AFTER */
} Node;
#pragma pack(pop)
_Static_assert(sizeof(Node) == KT_GHOST_NODE, "a ghost node is 20 bytes");

enum { W_OLDER = 0, W_NEWER = 1, W_AFTER = 2 };

static inline int32_t
link_of(const Node *nd, int f)
{
    uint32_t i = nd->w[f] & IDX_MASK;
    return i == IDX_MASK ? -1 : (int32_t)i;
}

static inline void
set_link(Node *nd, int f, int32_t i)
{
    nd->w[f] = (nd->w[f] & ~IDX_MASK) | (i < 0 ? IDX_MASK : (uint32_t)i);
}

static inline int
high_of(const Node *nd, int f)
{
    return (int)(nd->w[f] >> IDX_BITS);
}

static inline void
set_high(Node *nd, int f, int v)
{
    nd->w[f] = (nd->w[f] & IDX_MASK) | ((uint32_t)v << IDX_BITS);
}

#define COUNT(nd) high_of((nd), W_NEWER)
#define CLS(nd) high_of((nd), W_AFTER)

typedef struct {
    PyObject_HEAD
    int32_t oldest, newest;
    KeyTab *kt;           /* the keys (held with KT_GHOST) */
    PyObject *keys;       /* the capsule that owns kt */
    int attached;         /* kt_attach'ed: this structure uses kt */
    int own_keys;         /* kt is this ghost's alone */
    Py_ssize_t count;
    double max_age;
    int broken;
    /* The observation log of one on_request call, reused between calls. */
    uint8_t *kinds, *classes;
    double *times;
    int32_t nlog, lcap;
} GhostObject;

static PyObject *InputError; /* tierkv.errors.InputError */

#define NODE(s, i) ((Node *)(KT_REC((s)->kt, (i)) + (s)->kt->ghost_off))

static int
grow(void **arr, int32_t *cap, int32_t need, size_t elem)
{
    if (need <= *cap)
        return 0;
    int64_t c = *cap < 16 ? 16 : *cap;
    while (c < need)
        c += c / 2;
    if (c > INT32_MAX)
        c = INT32_MAX;
    if (c < need) {
        PyErr_NoMemory();
        return -1;
    }
    void *p = PyMem_Realloc(*arr, (size_t)c * elem);
    if (p == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    *arr = p;
    *cap = (int32_t)c;
    return 0;
}

/* A page key as 16 zero-padded bytes: 1 if ok, 0 if not a key (InputError set when strict). */
static int
parse_key(PyObject *obj, uint8_t out[KEY_MAX], int *len, int strict)
{
    if (!PyBytes_Check(obj)) {
        if (strict)
            PyErr_Format(InputError, "page key must be bytes of 1 to %d bytes, got %.100s", KEY_MAX,
                         Py_TYPE(obj)->tp_name);
        return 0;
    }
    Py_ssize_t n = PyBytes_GET_SIZE(obj);
    if (n < 1 || n > KEY_MAX) {
        if (strict)
            PyErr_Format(InputError, "page key must be 1 to %d bytes long, got %zd bytes", KEY_MAX, n);
        return 0;
    }
    memset(out, 0, KEY_MAX);
    memcpy(out, PyBytes_AS_STRING(obj), (size_t)n);
    *len = (int)n;
    return 1;
}

static int
check_ok(GhostObject *s)
{
    if (s->broken) {
        PyErr_SetString(PyExc_RuntimeError, "ghost is inconsistent after a failed allocation");
        return -1;
    }
    return 0;
}

/* ------------------------------------------------------------------ key -> node */

/* The node of key, -1 if this ghost does not remember it. */
static inline int32_t
map_find(const GhostObject *s, const uint8_t key[KEY_MAX], int len)
{
    int32_t id = kt_find(s->kt, key, len);
    return id >= 0 && kt_held(s->kt, id, KT_GHOST) ? id : -1;
}

static inline PyObject *
key_bytes(const GhostObject *s, int32_t idx)
{
    return PyBytes_FromStringAndSize((const char *)KT_KEYOF(s->kt, idx), kt_len(s->kt, idx));
}

/* ------------------------------------------------------------------ access order */

static void
list_unlink(GhostObject *s, int32_t idx)
{
    Node *nd = NODE(s, idx);
    int32_t older = link_of(nd, W_OLDER), newer = link_of(nd, W_NEWER);
    if (older >= 0)
        set_link(NODE(s, older), W_NEWER, newer);
    else
        s->oldest = newer;
    if (newer >= 0)
        set_link(NODE(s, newer), W_OLDER, older);
    else
        s->newest = older;
}

static void
list_append(GhostObject *s, int32_t idx)
{
    Node *nd = NODE(s, idx);
    set_link(nd, W_OLDER, s->newest);
    set_link(nd, W_NEWER, -1);
    if (s->newest >= 0)
        set_link(NODE(s, s->newest), W_NEWER, idx);
    else
        s->oldest = idx;
    s->newest = idx;
}

/* A new node for key, newest in the order, with last access t. -1 on failure (nothing changed). */
static int32_t
node_new(GhostObject *s, const uint8_t key[KEY_MAX], int len, uint64_t h, double t, int32_t id)
{
    /* id: the key's id in the table (the leaf heaps hold it), or -1 if it has none; the
     * caller made room (kt_reserve) for a new one. */
    int32_t idx = id >= 0 ? id : kt_add_h(s->kt, key, len, h);
    kt_hold(s->kt, idx, KT_GHOST);
    Node *nd = NODE(s, idx);
    nd->last = t;
    nd->w[W_OLDER] = IDX_MASK;
    nd->w[W_NEWER] = IDX_MASK;                 /* count 0 */
    nd->w[W_AFTER] = IDX_MASK;                 /* class 0, no next page */
    s->count++;
    list_append(s, idx);
    return idx;
}

static void
node_free(GhostObject *s, int32_t idx)
{
    list_unlink(s, idx);
    kt_drop(s->kt, idx, KT_GHOST);
    s->count--;
}

static int
log_obs(GhostObject *s, int kind, int cls, double t)
{
    if (s->nlog >= s->lcap) {
        int32_t cap = s->lcap;
        if (grow((void **)&s->kinds, &cap, s->nlog + 1, 1) < 0)
            return -1;
        cap = s->lcap;
        if (grow((void **)&s->classes, &cap, s->nlog + 1, 1) < 0)
            return -1;
        cap = s->lcap;
        if (grow((void **)&s->times, &cap, s->nlog + 1, sizeof(double)) < 0)
            return -1;
        s->lcap = cap;
    }
    s->kinds[s->nlog] = (uint8_t)kind;
    s->classes[s->nlog] = (uint8_t)cls;
    s->times[s->nlog] = t;
    s->nlog++;
    return 0;
}

static inline int
access_class(int count)
{
    int b = 0;
    while (count) {
        b++;
        count >>= 1;
    }
    return b < HOT_CLASS ? b : HOT_CLASS;
}

/* ------------------------------------------------------------------ the request pass */

/* The branch from node idx on, last seen together at t0, moves to ABANDONED (gittins'
 * _abandon); each key moved is appended to moved. */
static int
abandon(GhostObject *s, int32_t idx, double t0, PyObject *moved)
{
    while (idx >= 0) {
        Node *nd = NODE(s, idx);
        if (nd->last != t0 || CLS(nd) == ABANDONED)
            return 0;
        if (log_obs(s, OBS_CENSOR, CLS(nd), t0) < 0 || log_obs(s, OBS_START, ABANDONED, t0) < 0)
            return -1;
        set_high(nd, W_AFTER, ABANDONED);
        PyObject *k = key_bytes(s, idx);
        if (k == NULL || PyList_Append(moved, k) < 0) {
            Py_XDECREF(k);
            return -1;
        }
        Py_DECREF(k);
        idx = link_of(nd, W_AFTER);
    }
    return 0;
}

/* The class of a new page of this request (gittins' _continues), abandoning as it says. */
static int
new_class(GhostObject *s, const int32_t *ids, Py_ssize_t n, PyObject *moved)
{
    int32_t deepest = -1;
    Py_ssize_t depth = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        int32_t idx = ids[i];
        if (idx < 0 || !kt_held(s->kt, idx, KT_GHOST))
            break;
        deepest = idx;
        depth++;
    }
    if (deepest < 0 || access_class(COUNT(NODE(s, deepest))) >= HOT_CLASS)
        return 0;
    int32_t left = link_of(NODE(s, deepest), W_AFTER);
    if (left >= 0 && (depth == n || ids[depth] != left)) {   /* left is remembered: held */
        if (abandon(s, left, NODE(s, deepest)->last, moved) < 0)
            return -1;
    }
    return CONTINUING;
}

PyDoc_STRVAR(on_request_doc,
"on_request(keys, t, limit) -> (kinds, classes, times, abandoned)\n\n"
"A request for keys (a sequence of bytes of 1 to 16 bytes) at clock t; then the oldest\n"
"keys are forgotten while more than limit are remembered or they are max_age old.\n"
"Returns the reuse model's observations in order (kinds: bytes of 0 start, 1 reuse,\n"
"2 censor; classes: bytes; times: float64 bytes, the access or the last access) and\n"
"the keys moved to the abandoned class, in order.");

static PyObject *
gh_on_request(GhostObject *s, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_Format(PyExc_TypeError, "on_request() takes 3 arguments (%zd given)", nargs);
        return NULL;
    }
    if (check_ok(s) < 0)
        return NULL;
    double t = PyFloat_AsDouble(args[1]);
    if (t == -1.0 && PyErr_Occurred())
        return NULL;
    Py_ssize_t limit = PyLong_AsSsize_t(args[2]);
    if (limit == -1 && PyErr_Occurred())
        return NULL;
    PyObject *seq = PySequence_Fast(args[0], "keys must be a sequence of page keys");
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    uint8_t (*keys)[KEY_MAX] = PyMem_Malloc((size_t)(n ? n : 1) * KEY_MAX);
    int *lens = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(int));
    int32_t *ids = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(int32_t));
    uint64_t *hs = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(uint64_t));
    PyObject *moved = PyList_New(0);
    PyObject *out = NULL;
    if (keys == NULL || lens == NULL || ids == NULL || hs == NULL || moved == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++)
        if (!parse_key(items[i], keys[i], &lens[i], 1))
            goto done;
    /* Room for every key up front, so that the pass below fails only in the log. */
    if (kt_reserve(s->kt, n) < 0)
        goto done;
    /* Each key's id in the table (-1: none), looked up for all at once: nothing below
     * frees an id before the forgetting at the end. new_class asks which are remembered. */
    kt_find_many(s->kt, (const uint8_t (*)[KEY_MAX])keys, lens, n, ids, hs);
    s->nlog = 0;
    s->broken = 1;
    int fresh = new_class(s, ids, n, moved);
    if (fresh < 0)
        goto done;
    int32_t prev = -1;
    uint64_t added[64] = {0};   /* hash bits of the keys this pass gave an id: a key twice */
    for (Py_ssize_t i = 0; i < n; i++) {
        int32_t idx = ids[i];
        uint32_t bit = (uint32_t)(hs[i] >> 52);   /* 12 bits */
        if (idx < 0 && (added[bit >> 6] >> (bit & 63) & 1))
            idx = kt_find_h(s->kt, keys[i], lens[i], hs[i]);   /* maybe added earlier in this pass */
        Node *nd;
        if (idx < 0 || !kt_held(s->kt, idx, KT_GHOST)) {
            if (idx < 0)
                added[bit >> 6] |= UINT64_C(1) << (bit & 63);
            idx = node_new(s, keys[i], lens[i], hs[i], t, idx);
            if (idx < 0)
                goto done;
            nd = NODE(s, idx);
        } else {
            nd = NODE(s, idx);
            if (log_obs(s, OBS_REUSE, CLS(nd), nd->last) < 0)
                goto done;
            list_unlink(s, idx);
            list_append(s, idx);
            nd->last = t;
        }
        int count = COUNT(nd);
        int c = count ? access_class(count) : fresh;
        if (count < COUNT_MAX)
            set_high(nd, W_NEWER, count + 1);
        set_high(nd, W_AFTER, c);
        if (log_obs(s, OBS_START, c, t) < 0)
            goto done;
        if (prev >= 0)
            set_link(NODE(s, prev), W_AFTER, idx);
        prev = idx;
    }
    if (prev >= 0)
        set_link(NODE(s, prev), W_AFTER, -1);
    /* Forget the oldest. */
    while (s->oldest >= 0) {
        Node *nd = NODE(s, s->oldest);
        if (s->count <= limit && t - nd->last < s->max_age)
            break;
        if (log_obs(s, OBS_CENSOR, CLS(nd), nd->last) < 0)
            goto done;
        node_free(s, s->oldest);
    }
    s->broken = 0;
    /* y# makes None of a NULL buffer: an empty request before any log was allocated gives "" */
    out = Py_BuildValue("(y#y#y#O)", s->kinds ? (const char *)s->kinds : "", (Py_ssize_t)s->nlog,
                        s->classes ? (const char *)s->classes : "", (Py_ssize_t)s->nlog,
                        s->times ? (const char *)s->times : "", (Py_ssize_t)s->nlog * (Py_ssize_t)sizeof(double),
                        moved);
done:
    PyMem_Free(keys);
    PyMem_Free(lens);
    PyMem_Free(ids);
    PyMem_Free(hs);
    Py_XDECREF(moved);
    Py_DECREF(seq);
    return out;
}

/* ------------------------------------------------------------------ lookups */

static int32_t
find(GhostObject *s, PyObject *key)
{
    uint8_t k[KEY_MAX];
    int len;
    if (!parse_key(key, k, &len, 0))
        return -1;
    return map_find(s, k, len);
}

PyDoc_STRVAR(class_of_doc, "class_of(key) -> int\n\nThe class of a remembered key, 0 for any other.");

static PyObject *
gh_class_of(GhostObject *s, PyObject *key)
{
    if (check_ok(s) < 0)
        return NULL;
    int32_t idx = find(s, key);
    return PyLong_FromLong(idx < 0 ? 0 : CLS(NODE(s, idx)));
}

PyDoc_STRVAR(classes_of_doc, "classes_of(blob) -> bytes\n\n"
"class_of of each 16-byte key of blob, one byte per key.");

static PyObject *
gh_classes_of(GhostObject *s, PyObject *arg)
{
    if (check_ok(s) < 0)
        return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0)
        return NULL;
    PyObject *out = NULL;
    if (view.len % KEY_MAX) {
        PyErr_Format(InputError, "classes_of takes 16-byte keys back to back, got %zd bytes", view.len);
        goto done;
    }
    Py_ssize_t n = view.len / KEY_MAX;
    out = PyBytes_FromStringAndSize(NULL, n);
    if (out == NULL)
        goto done;
    uint8_t *dst = (uint8_t *)PyBytes_AS_STRING(out);
    const uint8_t *src = (const uint8_t *)view.buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        if ((i & 63) == 0 && s->count)
            kt_prefetch16(s->kt, src + i * KEY_MAX, n - i);
        int32_t idx = s->count ? map_find(s, src + i * KEY_MAX, KEY_MAX) : -1;
        dst[i] = (uint8_t)(idx < 0 ? 0 : CLS(NODE(s, idx)));
    }
done:
    PyBuffer_Release(&view);
    return out;
}

PyDoc_STRVAR(entry_doc,
"entry(key) -> (last, count, class, next key or None) or None\n\n"
"What is remembered of key (count saturates at 15).");

static PyObject *
gh_entry(GhostObject *s, PyObject *key)
{
    if (check_ok(s) < 0)
        return NULL;
    int32_t idx = find(s, key);
    if (idx < 0)
        Py_RETURN_NONE;
    Node *nd = NODE(s, idx);
    int32_t after = link_of(nd, W_AFTER);
    if (after < 0)
        return Py_BuildValue("(diiO)", nd->last, COUNT(nd), CLS(nd), Py_None);
    return Py_BuildValue("(diiy#)", nd->last, COUNT(nd), CLS(nd), (const char *)KT_KEYOF(s->kt, after),
                         (Py_ssize_t)kt_len(s->kt, after));
}

PyDoc_STRVAR(keys_doc, "keys() -> list of bytes\n\nThe remembered keys, oldest access first.");

static PyObject *
gh_keys(GhostObject *s, PyObject *Py_UNUSED(ignored))
{
    if (check_ok(s) < 0)
        return NULL;
    PyObject *out = PyList_New(0);
    if (out == NULL)
        return NULL;
    for (int32_t i = s->oldest; i >= 0; i = link_of(NODE(s, i), W_NEWER)) {
        PyObject *k = key_bytes(s, i);
        if (k == NULL || PyList_Append(out, k) < 0) {
            Py_XDECREF(k);
            Py_DECREF(out);
            return NULL;
        }
        Py_DECREF(k);
    }
    return out;
}

PyDoc_STRVAR(nbytes_doc, "nbytes() -> int\n\nBytes of memory held for the remembered keys (nodes, table, log).");

static PyObject *
gh_nbytes(GhostObject *s, PyObject *Py_UNUSED(ignored))
{
    size_t n = (s->own_keys ? kt_nbytes(s->kt) : 0) +
               (size_t)s->lcap * (2 + sizeof(double));
    return PyLong_FromSize_t(n);
}

static Py_ssize_t
gh_len(GhostObject *s)
{
    return s->count;
}

static int
gh_contains(GhostObject *s, PyObject *key)
{
    if (check_ok(s) < 0)
        return -1;
    return find(s, key) >= 0;
}

static void
gh_dealloc(GhostObject *s)
{
    if (s->attached && !s->own_keys)   /* a shared table outlives this: let go of its keys */
        kt_detach(s->kt, KT_GHOST);
    Py_XDECREF(s->keys);
    PyMem_Free(s->kinds);
    PyMem_Free(s->classes);
    PyMem_Free(s->times);
    Py_TYPE(s)->tp_free((PyObject *)s);
}

static PyObject *
gh_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"max_age", "keys", NULL};
    double max_age;
    PyObject *keys = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "d|O:Ghost", kwlist, &max_age, &keys))
        return NULL;
    if (keys != Py_None && kt_from(keys, InputError, "keys", KT_GHOST) == NULL)
        return NULL;
    GhostObject *s = (GhostObject *)type->tp_alloc(type, 0);
    if (s == NULL)
        return NULL;
    s->oldest = s->newest = -1;
    s->max_age = max_age;
    s->own_keys = keys == Py_None;
    if ((s->kt = kt_use(keys, KT_GHOST, &s->keys)) == NULL) {
        Py_DECREF(s);
        return NULL;
    }
    kt_attach(s->kt, KT_GHOST);
    s->attached = 1;
    return (PyObject *)s;
}

/* ------------------------------------------------------------------ the reuse model's histograms */

static int
get_buffer(PyObject *obj, Py_buffer *view, int writable, Py_ssize_t itemsize, const char *what)
{
    if (PyObject_GetBuffer(obj, view, (writable ? PyBUF_WRITABLE : 0) | PyBUF_C_CONTIGUOUS) < 0)
        return -1;
    if (view->len % itemsize != 0) {
        PyErr_Format(PyExc_ValueError, "%s: %zd bytes is not a whole number of %zd-byte items", what, view->len,
                     itemsize);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

/* Python's int(t) // d % m for a float t (floor division, non-negative remainder). */
static inline int64_t
bucket_of(double t, int64_t d, int64_t m)
{
    int64_t i = (int64_t)t;
    int64_t q = i / d - ((i % d != 0) && (i < 0));
    int64_t r = q % m;
    return r < 0 ? r + m : r;
}

PyDoc_STRVAR(record_doc,
"record(open, resolved, reuses, kinds, classes, times, now, t_ref, memory, log_growth, bucket, ring)\n\n"
"ReuseModel.record_many's updates of its float64 histograms open (classes x ring),\n"
"resolved (classes x (bins + 1)) and reuses (classes x bins), in place, observation by\n"
"observation in order, with the arithmetic of ReuseModel.start / reuse / censor: the\n"
"weight exp((t - t_ref) / memory) and the age bin int(log1p(age) / log_growth) come from\n"
"the C library's exp and log1p, which Python's math module calls too.");

static PyObject *
gh_record(PyObject *Py_UNUSED(mod), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 12) {
        PyErr_Format(PyExc_TypeError, "record() takes 12 arguments (%zd given)", nargs);
        return NULL;
    }
    double d[4];
    for (int i = 0; i < 4; i++) {
        d[i] = PyFloat_AsDouble(args[6 + i]);
        if (d[i] == -1.0 && PyErr_Occurred())
            return NULL;
    }
    double now = d[0], t_ref = d[1], memory = d[2], log_growth = d[3];
    int64_t bucket = PyLong_AsLongLong(args[10]), ring = PyLong_AsLongLong(args[11]);
    if (PyErr_Occurred())
        return NULL;
    if (bucket < 1 || ring < 1) {
        PyErr_Format(PyExc_ValueError, "record() needs bucket >= 1 and ring >= 1, got %lld, %lld",
                     (long long)bucket, (long long)ring);
        return NULL;
    }
    Py_buffer v[6];
    static const char *what[6] = {"open", "resolved", "reuses", "kinds", "classes", "times"};
    static const int wr[6] = {1, 1, 1, 0, 0, 0};
    static const Py_ssize_t size[6] = {8, 8, 8, 1, 1, 8};
    int got = 0;
    PyObject *out = NULL;
    for (; got < 6; got++)
        if (get_buffer(args[got], &v[got], wr[got], size[got], what[got]) < 0)
            goto done;
    Py_ssize_t n = v[3].len;
    Py_ssize_t nopen = v[0].len / 8;
    if (nopen % ring != 0 || v[4].len != n || v[5].len != n * 8) {
        PyErr_SetString(PyExc_ValueError, "record(): histogram or observation sizes do not match");
        goto done;
    }
    Py_ssize_t classes = nopen / ring;
    if (classes < 1 || v[1].len / 8 % classes != 0 || v[2].len / 8 != v[1].len / 8 - classes) {
        PyErr_SetString(PyExc_ValueError, "record(): histogram shapes do not match");
        goto done;
    }
    Py_ssize_t bins = v[2].len / 8 / classes;
    double *open = v[0].buf, *resolved = v[1].buf, *reuses = v[2].buf;
    const uint8_t *kinds = v[3].buf, *cls = v[4].buf;
    const double *times = v[5].buf;
    for (Py_ssize_t i = 0; i < n; i++)
        if (cls[i] >= classes || kinds[i] > OBS_CENSOR) {
            PyErr_Format(PyExc_ValueError, "record(): observation %zd has class %d of %zd, kind %d", i,
                         (int)cls[i], classes, (int)kinds[i]);
            goto done;
        }
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t c = cls[i];
        double t = times[i];
        double w = exp((t - t_ref) / memory);
        double *slot = &open[c * ring + bucket_of(t, bucket, ring)];
        if (kinds[i] == OBS_START) {
            *slot += w;
            continue;
        }
        double age = now - t;
        Py_ssize_t b = 0;
        if (age > 0.0) {
            b = (Py_ssize_t)(log1p(age) / log_growth);
            if (b >= bins)
                b = bins - 1;
        }
        *slot -= w;
        resolved[c * (bins + 1)] += w;
        resolved[c * (bins + 1) + b + 1] -= w;
        if (kinds[i] == OBS_REUSE)
            reuses[c * bins + b] += w;
    }
    out = Py_NewRef(Py_None);
done:
    for (int i = 0; i < got; i++)
        PyBuffer_Release(&v[i]);
    return out;
}

static PyMethodDef gh_methods[] = {
    {"on_request", (PyCFunction)(void (*)(void))gh_on_request, METH_FASTCALL, on_request_doc},
    {"class_of", (PyCFunction)gh_class_of, METH_O, class_of_doc},
    {"classes_of", (PyCFunction)gh_classes_of, METH_O, classes_of_doc},
    {"entry", (PyCFunction)gh_entry, METH_O, entry_doc},
    {"keys", (PyCFunction)gh_keys, METH_NOARGS, keys_doc},
    {"nbytes", (PyCFunction)gh_nbytes, METH_NOARGS, nbytes_doc},
    {NULL, NULL, 0, NULL},
};

static PySequenceMethods gh_as_sequence = {
    .sq_length = (lenfunc)gh_len,
    .sq_contains = (objobjproc)gh_contains,
};

PyDoc_STRVAR(gh_doc, "Ghost(max_age)\n\n"
"The pages a GittinsPolicy remembers, compiled: last access, count, class and next page\n"
"per key, in access order; keys of 1 to 16 bytes. Not thread-safe.");

static PyTypeObject GhostType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "tierkv.policy._ghost.Ghost",
    .tp_basicsize = sizeof(GhostObject),
    .tp_dealloc = (destructor)gh_dealloc,
    .tp_as_sequence = &gh_as_sequence,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = gh_doc,
    .tp_methods = gh_methods,
    .tp_new = gh_new,
};

/* ------------------------------------------------------------------ the index table */

/* One class's row of tierkv.policy.hazard._gittins: the same operations in the same order
 * as its numpy (cumulative products and sums left to right, each cost term as written
 * there; built without FMA contraction), so the same bits. cp and cq hold nb + 1. */
static void
index_row(const double *h, const double *edges, const double *mids, Py_ssize_t nb, double *out, double *cp,
          double *cq)
{
    double surv = 1.0;   /* survive[i]: no reuse in bins before i */
    cp[0] = cq[0] = 0.0;
    for (Py_ssize_t i = 0; i < nb; i++) {
        double p = surv * h[i];
        double pm = p * mids[i];
        surv = i == 0 ? 1.0 - h[0] : surv * (1.0 - h[i]);
        cp[i + 1] = i == 0 ? p : cp[i] + p;
        cq[i + 1] = i == 0 ? pm : cq[i] + pm;
    }
    double never = surv;
    for (Py_ssize_t b = 0; b < nb; b++) {
        double start = edges[b], alive = (cp[nb] - cp[b]) + never, best = 0.0;
        int nan = 0;
        for (Py_ssize_t t = 0; t < nb; t++) {   /* ratio 0 where t < b or the cost is not positive */
            double r = 0.0;
            if (t >= b) {
                double hits = cp[t + 1] - cp[b];
                double cost = ((cq[t + 1] - cq[b]) - start * hits) + (alive - hits) * (edges[t + 1] - start);
                if (cost > 0)
                    r = hits / cost;
            }
            if (isnan(r))
                nan = 1;
            else if (t == 0 || r > best)
                best = r;
        }
        out[b] = nan ? NAN : best;   /* numpy's max: NaN wins */
    }
    Py_ssize_t peak = 0;   /* numpy's argmax: the first maximum, or the first NaN */
    for (Py_ssize_t b = 1; b < nb && !isnan(out[peak]); b++)
        if (isnan(out[b]) || out[b] > out[peak])
            peak = b;
    for (Py_ssize_t b = peak + 1; b < nb; b++)   /* np.minimum.accumulate: NaN carries on */
        if (isnan(out[b - 1]) || (!isnan(out[b]) && out[b - 1] < out[b]))
            out[b] = out[b - 1];
}

PyDoc_STRVAR(gittins_index_doc, "gittins_index(hazards, edges, mids, out)\n\n"
"The index table of tierkv.policy.hazard: _gittins of each row of hazards (float64\n"
"[classes][bins], C-contiguous) into out (the same shape), with the bins' edges\n"
"(bins + 1) and midpoints (bins). The same bits as the numpy function.");

static PyObject *
gh_gittins_index(PyObject *Py_UNUSED(mod), PyObject *args)
{
    Py_buffer hz, ed, md, out;
    if (!PyArg_ParseTuple(args, "y*y*y*w*:gittins_index", &hz, &ed, &md, &out))
        return NULL;
    PyObject *res = NULL;
    double *cp = NULL;
    Py_ssize_t nb = md.len / (Py_ssize_t)sizeof(double);
    if (nb < 1 || md.len % (Py_ssize_t)sizeof(double) || ed.len != (nb + 1) * (Py_ssize_t)sizeof(double)
            || hz.len % (nb * (Py_ssize_t)sizeof(double)) || out.len != hz.len) {
        PyErr_Format(PyExc_ValueError, "gittins_index: hazards of [classes][bins] float64, bins + 1 edges, bins "
                     "mids and an output the hazards' size; got %zd, %zd, %zd and %zd bytes", hz.len, ed.len,
                     md.len, out.len);
        goto done;
    }
    cp = PyMem_Malloc(2 * (size_t)(nb + 1) * sizeof(double));
    if (cp == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    Py_ssize_t rows = hz.len / (nb * (Py_ssize_t)sizeof(double));
    for (Py_ssize_t c = 0; c < rows; c++)
        index_row((const double *)hz.buf + c * nb, ed.buf, md.buf, nb, (double *)out.buf + c * nb, cp, cp + nb + 1);
    res = Py_NewRef(Py_None);
done:
    PyMem_Free(cp);
    PyBuffer_Release(&hz);
    PyBuffer_Release(&ed);
    PyBuffer_Release(&md);
    PyBuffer_Release(&out);
    return res;
}

PyDoc_STRVAR(new_keys_doc, "new_keys() -> key table\n\n"
"An empty key table for a Ghost and a LeafHeaps of one tier to share (keys=): each key\n"
"they both hold is stored once. Their nbytes() leave a shared table out: keys_nbytes()\n"
"counts it.");

static PyObject *
gh_new_keys(PyObject *Py_UNUSED(mod), PyObject *Py_UNUSED(ignored))
{
    return kt_capsule_new(KT_GHOST | KT_LEAVES);
}

PyDoc_STRVAR(keys_nbytes_doc, "keys_nbytes(keys) -> int\n\nBytes of memory a key table holds.");

static PyObject *
gh_keys_nbytes(PyObject *Py_UNUSED(mod), PyObject *keys)
{
    KeyTab *kt = kt_from(keys, InputError, "keys", 0);
    return kt == NULL ? NULL : PyLong_FromSize_t(kt_nbytes(kt));
}

PyDoc_STRVAR(keys_len_doc, "keys_len(keys) -> int\n\nHow many keys a key table holds (for any holder).");

static PyObject *
gh_keys_len(PyObject *Py_UNUSED(mod), PyObject *keys)
{
    KeyTab *kt = kt_from(keys, InputError, "keys", 0);
    return kt == NULL ? NULL : PyLong_FromSsize_t(kt->count);
}

static PyMethodDef module_methods[] = {
    {"new_keys", gh_new_keys, METH_NOARGS, new_keys_doc},
    {"keys_len", gh_keys_len, METH_O, keys_len_doc},
    {"keys_nbytes", gh_keys_nbytes, METH_O, keys_nbytes_doc},
    {"record", (PyCFunction)(void (*)(void))gh_record, METH_FASTCALL, record_doc},
    {"gittins_index", gh_gittins_index, METH_VARARGS, gittins_index_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef ghost_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "tierkv.policy._ghost",
    .m_doc = "The compiled ghost of tierkv.policy.gittins and the updates of its reuse model.",
    .m_size = -1,
    .m_methods = module_methods,
};

PyMODINIT_FUNC
PyInit__ghost(void)
{
    PyObject *errors = PyImport_ImportModule("tierkv.errors");
    if (errors == NULL)
        return NULL;
    InputError = PyObject_GetAttrString(errors, "InputError");
    Py_DECREF(errors);
    if (InputError == NULL)
        return NULL;
    if (PyType_Ready(&GhostType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&ghost_module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddObjectRef(m, "Ghost", (PyObject *)&GhostType) < 0 ||
        PyModule_AddIntConstant(m, "HOT_CLASS", HOT_CLASS) < 0 ||
        PyModule_AddIntConstant(m, "CONTINUING", CONTINUING) < 0 ||
        PyModule_AddIntConstant(m, "ABANDONED", ABANDONED) < 0 ||
        PyModule_AddIntConstant(m, "START", OBS_START) < 0 ||
        PyModule_AddIntConstant(m, "REUSE", OBS_REUSE) < 0 ||
        PyModule_AddIntConstant(m, "CENSOR", OBS_CENSOR) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
