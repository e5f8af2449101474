/*
 * tierkv.policy._leaves: the compiled LeafHeaps (see tierkv/policy/leaves.py).
 *
 * The resident pages of one tier as a prefix forest, with the leaves of each class in
 * two indexed binary heaps (oldest first, youngest first). Same contract, same
 * candidates in the same order and the same tie-breaking as the pure-Python class,
 * which stays as the fallback; tests/policy/test_leaves_native.py drives both with
 * the same random operations and compares every answer.
 *
 * Layout: the keys in a key table (keytab.h: each key once under a dense id, and the
 * map from keys to ids), which GittinsPolicy shares with the tier's ghost (a LeafHeaps
 * made without one has its own); its 18-byte Node per key lives in the key's record
 * there (records never move); what only a leaf or a pending victim needs (its sequence number, heap positions,
 * pending index) in a 20-byte Rec of its own, which most nodes of a prefix chain never
 * have; per class and end an int32 heap whose entries record their position in the
 * node's Rec, so a leaf that stops being one leaves its heaps at once (no stale entries).
 * Nodes also exist for absent parents that still have resident children, as the
 * Python class's _kids does. Nothing here creates a Python object per page except what
 * candidates returns and the key it passes to evictable.
 *
 * Node lifetime: a node whose key is absent and has no resident children is freed, but
 * only once no victim is pending: a pending victim's parent link must stay valid until
 * undo() re-adopts it. Such nodes wait on the zombie list until then.
 *
 * Not thread-safe (callers hold the GIL and serialize, as for the Python class). A
 * failed allocation while the structure is half-updated marks it broken: every later
 * call raises instead of answering from an inconsistent state.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>

#include <stdint.h>
#include <string.h>

#include "keytab.h"

#define KEY_MAX KT_KEY
#define OLD 0
#define YOUNG 1

/* INMAP: the node is in use (this structure holds its key's id; 0 once freed).
 * ALLOWED: evictable said yes to it in this victims call (it cannot change until
 * settle), so a head re-read after another class member was taken is not asked again.
 * HASREC: the node has a Rec (kr is its index), so it has no resident children. */
enum { PRESENT = 1, ZOMBIE = 2, INMAP = 4, ALLOWED = 8, HASREC = 16 };

/* 18 bytes, at the index of its key's id. A node of an id this structure does not hold
 * is never read: it is blank (flags 0) if it was ever used, else uninitialized. Only a
 * node without resident children has a Rec (a leaf or a pending victim: every call
 * that adds a child first puts pending victims back), so one word holds either: the
 * Rec's index where HASREC is set, else the count of resident (not taken) children.
 * Packed to 2: it starts 2 bytes past an 8-byte boundary (keytab.h's layouts). */
#pragma pack(push, 2)
typedef struct {
    double last;          /* last access */
    int32_t parent;       /* node of the parent key, -1 for none */
    int32_t kr;           /* HASREC: its Rec; else its resident (not taken) children */
    uint8_t flags;
    uint8_t cls;
} Node;
#pragma pack(pop)

/* 20 bytes: what a node needs only while it is a leaf (seq != 0) or a pending victim
 * (pend >= 0); a free Rec's pend is the free-list link. */
#pragma pack(push, 4)
typedef struct {
    uint64_t seq;         /* insertion sequence number while a leaf, else 0 */
    int32_t pos[2];       /* position in the OLD / YOUNG heap of its class, -1 if not in it */
    int32_t pend;         /* index in the pending array, -1 if not a pending victim */
} Rec;
#pragma pack(pop)

_Static_assert(sizeof(Node) == KT_LEAVES_NODE, "Node is 18 bytes");
_Static_assert(sizeof(Rec) == 20, "Rec is 20 bytes");

typedef struct {
    int32_t *a;
    int32_t n, cap;
} Heap;

typedef struct {
    uint64_t seq;
    int32_t node;
    int32_t which;
} Stashed;

typedef struct {
    PyObject_HEAD
    Rec *recs;
    int32_t rcap, rused, rfree;
    KeyTab *kt;           /* the keys (held with KT_LEAVES) */
    PyObject *keys;       /* the capsule that owns kt */
    int attached;         /* kt_attach'ed: this structure uses kt */
    int own_keys;         /* kt is this structure's alone */
    Py_ssize_t present;   /* resident keys (pending victims included) */
    int classes, young, broken;
    Heap *heaps;          /* heaps[2 * cls + which] */
    uint8_t *dirty;
    PyObject **heads;     /* heads[2 * cls + which]: cached candidate tuple or NULL */
    int32_t *pend;        /* pending victims in take order; -1 marks one discarded since */
    int32_t npend, pcap, plive;
    Stashed *stash;
    int32_t nstash, scap;
    int32_t *allowed;     /* nodes flagged ALLOWED in this victims call */
    int32_t nallowed, acap;
    int32_t *zombies;
    int32_t nzomb, zcap;
    uint64_t next_seq;
} LeafHeapsObject;

static PyObject *InputError; /* tierkv.errors.InputError */

#define NODE(s, i) ((Node *)(KT_REC((s)->kt, (i)) + (s)->kt->leaves_off))
#define REC(s, nd) (&(s)->recs[(nd)->kr])   /* only where nd has one (HASREC) */

/* Resident (not taken) children of nd: none while it has a Rec. */
static inline int32_t
kids_of(const Node *nd)
{
    return (nd->flags & HASREC) ? 0 : nd->kr;
}

/* ------------------------------------------------------------------ small helpers */

/* Grows *arr (of elem-byte items, capacity *cap) to hold at least need items. */
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

static inline uint64_t
seq_of(const LeafHeapsObject *s, const Node *nd)
{
    return (nd->flags & HASREC) ? s->recs[nd->kr].seq : 0;
}

static inline int32_t
pos_of(const LeafHeapsObject *s, const Node *nd, int which)
{
    return (nd->flags & HASREC) ? s->recs[nd->kr].pos[which] : -1;
}

static inline int32_t
pend_of(const LeafHeapsObject *s, const Node *nd)
{
    return (nd->flags & HASREC) ? s->recs[nd->kr].pend : -1;
}

/* Room for n more Recs (1 or 2), so that the next n rec_make calls cannot fail. */
static int
rec_reserve(LeafHeapsObject *s, int n)
{
    int spare = s->rfree < 0 ? 0 : s->recs[s->rfree].pend < 0 ? 1 : 2;   /* free ones, up to two */
    return spare >= n ? 0 : grow((void **)&s->recs, &s->rcap, s->rused + n - spare, sizeof(Rec));
}

/* The Rec of node idx (which has no resident children), a blank one if it has none;
 * NULL with MemoryError (SystemError where idx has resident children: a bug). Recs move. */
static Rec *
rec_make(LeafHeapsObject *s, int32_t idx)
{
    Node *nd = NODE(s, idx);
    if (nd->flags & HASREC)
        return &s->recs[nd->kr];
    if (nd->kr != 0) {   /* its word counts children: callers never get here */
        PyErr_SetString(PyExc_SystemError, "LeafHeaps: a Rec for a node with resident children");
        return NULL;
    }
    if (rec_reserve(s, 1) < 0)
        return NULL;
    int32_t r;
    if (s->rfree >= 0) {
        r = s->rfree;
        s->rfree = s->recs[r].pend;
    } else {
        r = s->rused++;
    }
    Rec *rc = &s->recs[r];
    rc->seq = 0;
    rc->pos[OLD] = rc->pos[YOUNG] = -1;
    rc->pend = -1;
    nd = NODE(s, idx);
    nd->kr = r;
    nd->flags |= HASREC;
    return rc;
}

/* Frees node idx's Rec once it is neither a leaf nor a pending victim (nor on a heap). */
static void
rec_drop(LeafHeapsObject *s, int32_t idx)
{
    Node *nd = NODE(s, idx);
    if (!(nd->flags & HASREC))
        return;
    Rec *rc = &s->recs[nd->kr];
    if (rc->seq != 0 || rc->pend >= 0 || rc->pos[OLD] >= 0 || rc->pos[YOUNG] >= 0)
        return;
    rc->pend = s->rfree;
    s->rfree = nd->kr;
    nd->kr = 0;
    nd->flags &= (uint8_t)~HASREC;
}

/* A page key as 16 zero-padded bytes and its length: 1 if ok, 0 if obj cannot be a key
 * (not bytes, or not 1 to 16 bytes long), with InputError set when strict. */
static int
parse_key(PyObject *obj, uint8_t out[KEY_MAX], int *len, int strict, const char *what)
{
    if (!PyBytes_Check(obj)) {
        if (strict)
            PyErr_Format(InputError, "%s must be bytes of 1 to %d bytes, got %.100s", what, KEY_MAX,
                         Py_TYPE(obj)->tp_name);
        return 0;
    }
    Py_ssize_t n = PyBytes_GET_SIZE(obj);
    if (n < 1 || n > KEY_MAX) {
        if (strict)
            PyErr_Format(InputError, "%s must be 1 to %d bytes long, got %zd bytes", what, KEY_MAX, n);
        return 0;
    }
    memset(out, 0, KEY_MAX);
    memcpy(out, PyBytes_AS_STRING(obj), (size_t)n);
    *len = (int)n;
    return 1;
}

static PyObject *
key_bytes(const LeafHeapsObject *s, int32_t idx)
{
    return PyBytes_FromStringAndSize((const char *)KT_KEYOF(s->kt, idx), kt_len(s->kt, idx));
}

/* Positional and keyword arguments of a METH_FASTCALL | METH_KEYWORDS method, all required. */
static int
parse_args(PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames, const char *const *names, int n,
           PyObject **out, const char *fname)
{
    if (nargs > n) {
        PyErr_Format(PyExc_TypeError, "%s() takes %d arguments (%zd given)", fname, n, nargs);
        return -1;
    }
    for (int i = 0; i < n; i++)
        out[i] = i < nargs ? args[i] : NULL;
    Py_ssize_t nkw = kwnames != NULL ? PyTuple_GET_SIZE(kwnames) : 0;
    for (Py_ssize_t j = 0; j < nkw; j++) {
        PyObject *name = PyTuple_GET_ITEM(kwnames, j);
        int i = 0;
        while (i < n && PyUnicode_CompareWithASCIIString(name, names[i]) != 0)
            i++;
        if (i == n) {
            PyErr_Format(PyExc_TypeError, "%s() got an unexpected keyword argument '%U'", fname, name);
            return -1;
        }
        if (out[i] != NULL) {
            PyErr_Format(PyExc_TypeError, "%s() got multiple values for argument '%s'", fname, names[i]);
            return -1;
        }
        out[i] = args[nargs + j];
    }
    for (int i = 0; i < n; i++) {
        if (out[i] == NULL) {
            PyErr_Format(PyExc_TypeError, "%s() missing required argument '%s'", fname, names[i]);
            return -1;
        }
    }
    return 0;
}

static int
check_ok(LeafHeapsObject *s)
{
    if (s->broken) {
        PyErr_SetString(PyExc_RuntimeError, "LeafHeaps is unusable after a failed allocation");
        return -1;
    }
    return 0;
}

static int
fail(LeafHeapsObject *s)
{
    s->broken = 1;
    return -1;
}

static int
parse_class(LeafHeapsObject *s, PyObject *obj, int *cls)
{
    long c = PyLong_AsLong(obj);
    if (c == -1 && PyErr_Occurred())
        return -1;
    if (c < 0 || c >= s->classes) {
        PyErr_Format(InputError, "class must be 0 to %d (this LeafHeaps has %d classes), got %ld",
                     s->classes - 1, s->classes, c);
        return -1;
    }
    *cls = (int)c;
    return 0;
}

/* ------------------------------------------------------------------ key -> node table */

/* The node of key, -1 if this structure has none. */
static inline int32_t
map_find(const LeafHeapsObject *s, const uint8_t key[KEY_MAX], int len)
{
    int32_t id = kt_find(s->kt, key, len);
    return id >= 0 && kt_held(s->kt, id, KT_LEAVES) ? id : -1;
}

/* The node of key, created (absent, no children) if there is none. -1 on failure. */
static int32_t
node_get(LeafHeapsObject *s, const uint8_t key[KEY_MAX], int len)
{
    int32_t idx = map_find(s, key, len);
    if (idx >= 0)
        return idx;
    if (kt_reserve(s->kt, 1) < 0)
        return -1;
    idx = kt_find(s->kt, key, len);    /* the ghost may hold it */
    if (idx < 0)
        idx = kt_add(s->kt, key, len);
    kt_hold(s->kt, idx, KT_LEAVES);
    Node *nd = NODE(s, idx);
    memset(nd, 0, sizeof(Node));
    nd->parent = -1;
    nd->flags = INMAP;
    return idx;
}

/* ------------------------------------------------------------------ indexed heaps */

/* Whether node a leaves before node b at this end: the Python heaps' (t, seq) and (-t, -seq). */
static inline int
before(const LeafHeapsObject *s, int which, int32_t a, int32_t b)
{
    const Node *x = NODE(s, a), *y = NODE(s, b);
    if (which == OLD)
        return x->last < y->last || (x->last == y->last && s->recs[x->kr].seq < s->recs[y->kr].seq);
    return x->last > y->last || (x->last == y->last && s->recs[x->kr].seq > s->recs[y->kr].seq);
}

static void
sift_up(LeafHeapsObject *s, Heap *h, int which, int32_t i)
{
    int32_t idx = h->a[i];
    while (i > 0) {
        int32_t p = (i - 1) / 2;
        if (!before(s, which, idx, h->a[p]))
            break;
        h->a[i] = h->a[p];
        REC(s, NODE(s, h->a[i]))->pos[which] = i;
        i = p;
    }
    h->a[i] = idx;
    REC(s, NODE(s, idx))->pos[which] = i;
}

static void
sift_down(LeafHeapsObject *s, Heap *h, int which, int32_t i)
{
    int32_t idx = h->a[i];
    for (;;) {
        int32_t c = 2 * i + 1;
        if (c >= h->n)
            break;
        if (c + 1 < h->n && before(s, which, h->a[c + 1], h->a[c]))
            c++;
        if (!before(s, which, h->a[c], idx))
            break;
        h->a[i] = h->a[c];
        REC(s, NODE(s, h->a[i]))->pos[which] = i;
        i = c;
    }
    h->a[i] = idx;
    REC(s, NODE(s, idx))->pos[which] = i;
}

static int
heap_push(LeafHeapsObject *s, int which, int32_t idx)
{
    Heap *h = &s->heaps[2 * NODE(s, idx)->cls + which];
    if (grow((void **)&h->a, &h->cap, h->n + 1, sizeof(int32_t)) < 0)
        return -1;
    h->a[h->n++] = idx;
    sift_up(s, h, which, h->n - 1);
    return 0;
}

static void
heap_remove(LeafHeapsObject *s, int which, int32_t idx)
{
    Node *nd = NODE(s, idx);
    Heap *h = &s->heaps[2 * nd->cls + which];
    int32_t i = REC(s, nd)->pos[which];
    REC(s, nd)->pos[which] = -1;
    int32_t last = h->a[--h->n];
    if (i < h->n) {
        h->a[i] = last;
        REC(s, NODE(s, last))->pos[which] = i;
        sift_down(s, h, which, i);
        sift_up(s, h, which, REC(s, NODE(s, last))->pos[which]);
    }
}

/* ------------------------------------------------------------------ the forest */

static int
leaf(LeafHeapsObject *s, int32_t idx)
{
    Rec *rc = rec_make(s, idx);
    if (rc == NULL)
        return fail(s);
    rc->seq = ++s->next_seq;
    Node *nd = NODE(s, idx);
    s->dirty[nd->cls] = 1;
    for (int w = OLD; w <= (s->young ? YOUNG : OLD); w++) {
        if (REC(s, nd)->pos[w] >= 0) {  /* already in (a re-leaf): move it */
            Heap *h = &s->heaps[2 * nd->cls + w];
            sift_down(s, h, w, REC(s, nd)->pos[w]);
            sift_up(s, h, w, REC(s, nd)->pos[w]);
        } else if (heap_push(s, w, idx) < 0) {
            return fail(s);
        }
    }
    return 0;
}

static void
unleaf(LeafHeapsObject *s, int32_t idx)
{
    Node *nd = NODE(s, idx);
    if (seq_of(s, nd) == 0)
        return;
    REC(s, nd)->seq = 0;
    s->dirty[nd->cls] = 1;
    for (int w = OLD; w <= YOUNG; w++)
        if (REC(s, nd)->pos[w] >= 0)
            heap_remove(s, w, idx);
    rec_drop(s, idx);
}

/* Class and last access change only off the heaps, so a heap entry never moves class. */
static void
set_state(LeafHeapsObject *s, int32_t idx, int cls, double t)
{
    if (seq_of(s, NODE(s, idx)) != 0)
        unleaf(s, idx);
    NODE(s, idx)->cls = (uint8_t)cls;
    NODE(s, idx)->last = t;
}

static int
zombie(LeafHeapsObject *s, int32_t idx)
{
    if (NODE(s, idx)->flags & ZOMBIE)
        return 0;
    if (grow((void **)&s->zombies, &s->zcap, s->nzomb + 1, sizeof(int32_t)) < 0)
        return fail(s);
    NODE(s, idx)->flags |= ZOMBIE;
    s->zombies[s->nzomb++] = idx;
    return 0;
}

/* Frees the zombies still absent and childless; only while no victim is pending. */
static void
sweep(LeafHeapsObject *s)
{
    if (s->plive != 0)
        return;
    for (int32_t i = 0; i < s->nzomb; i++) {
        int32_t idx = s->zombies[i];
        Node *nd = NODE(s, idx);
        nd->flags &= (uint8_t)~ZOMBIE;
        if ((nd->flags & (PRESENT | INMAP)) != INMAP || kids_of(nd) != 0 || pend_of(s, nd) >= 0)
            continue;
        unleaf(s, idx);
        nd = NODE(s, idx);
        nd->flags = 0;
        nd->parent = -1;
        kt_drop(s->kt, idx, KT_LEAVES);
    }
    s->nzomb = 0;
}

/* A node whose word should count children has a Rec: a bug, and the structure is
 * unusable (SystemError now, RuntimeError from every later call). */
static int
lost_count(LeafHeapsObject *s)
{
    PyErr_SetString(PyExc_SystemError, "LeafHeaps: a child count asked of a node that has a Rec");
    return fail(s);
}

/* One more resident child of node p (resident or not: it may arrive later). A pending
 * victim never gets one (every call that adds puts them back first), so once p stops
 * being a leaf its Rec is gone. */
static int
adopt(LeafHeapsObject *s, int32_t p)
{
    Node *nd = NODE(s, p);
    if (kids_of(nd) == 0 && (nd->flags & PRESENT))
        unleaf(s, p);
    nd = NODE(s, p);
    if (nd->flags & HASREC)
        return lost_count(s);
    nd->kr++;
    return 0;
}

static int
orphan(LeafHeapsObject *s, int32_t idx)
{
    int32_t p = NODE(s, idx)->parent;
    if (p < 0)
        return 0;
    Node *nd = NODE(s, p);
    if (nd->flags & HASREC)
        return lost_count(s);
    if (--nd->kr != 0)
        return 0;
    if (nd->flags & PRESENT)
        return leaf(s, p);
    return zombie(s, p);
}

/* Ends a victims call's memo of evictable's answers. */
static void
forget_allowed(LeafHeapsObject *s)
{
    for (int32_t i = 0; i < s->nallowed; i++)
        if (s->allowed[i] < s->kt->high)
            NODE(s, s->allowed[i])->flags &= (uint8_t)~ALLOWED;
    s->nallowed = 0;
}

static int
undo_all(LeafHeapsObject *s)
{
    forget_allowed(s);   /* every undo starts a new victims call, as the Python twin's does */
    int32_t n = s->npend;
    s->npend = 0;
    s->plive = 0;
    for (int32_t i = n - 1; i >= 0; i--) {
        int32_t idx = s->pend[i];
        if (idx < 0)
            continue;
        REC(s, NODE(s, idx))->pend = -1;   /* its Rec stays: leaf() below uses it */
        int32_t p = NODE(s, idx)->parent;
        if (p >= 0 && adopt(s, p) < 0)
            return -1;
        if (leaf(s, idx) < 0)
            return -1;
    }
    sweep(s);
    return 0;
}

/* discard() of a key that is not a pending victim (after undo). */
static int
remove_resident(LeafHeapsObject *s, int32_t idx)
{
    if (kids_of(NODE(s, idx)) == 0)
        unleaf(s, idx);
    if (orphan(s, idx) < 0)
        return -1;
    return 0;
}

static int
forget(LeafHeapsObject *s, int32_t idx)
{
    Node *nd = NODE(s, idx);
    if (seq_of(s, nd) != 0)
        unleaf(s, idx);
    nd = NODE(s, idx);
    nd->flags &= (uint8_t)~PRESENT;
    nd->parent = -1;
    s->present--;
    if (kids_of(nd) == 0)
        return zombie(s, idx);
    return 0;
}

static int32_t
find_present(LeafHeapsObject *s, PyObject *key)
{
    uint8_t k[KEY_MAX];
    int len;
    if (!parse_key(key, k, &len, 0, "key"))
        return -1;
    int32_t idx = map_find(s, k, len);
    return idx >= 0 && (NODE(s, idx)->flags & PRESENT) ? idx : -1;
}

/* ------------------------------------------------------------------ the type */

static void
lh_dealloc(LeafHeapsObject *s)
{
    if (s->heads != NULL)
        for (int i = 0; i < 2 * s->classes; i++)
            Py_XDECREF(s->heads[i]);
    if (s->heaps != NULL)
        for (int i = 0; i < 2 * s->classes; i++)
            PyMem_Free(s->heaps[i].a);
    PyMem_Free(s->heaps);
    PyMem_Free(s->heads);
    PyMem_Free(s->dirty);
    PyMem_Free(s->recs);
    if (s->attached && !s->own_keys)   /* a shared table outlives this: let go of its keys */
        kt_detach(s->kt, KT_LEAVES);
    Py_XDECREF(s->keys);
    PyMem_Free(s->pend);
    PyMem_Free(s->stash);
    PyMem_Free(s->allowed);
    PyMem_Free(s->zombies);
    Py_TYPE(s)->tp_free((PyObject *)s);
}

static PyObject *
lh_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"classes", "young", "keys", NULL};
    Py_ssize_t classes;
    int young = 1;
    PyObject *keys = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "n|pO:LeafHeaps", kwlist, &classes, &young, &keys))
        return NULL;
    if (classes < 0 || classes > 255) {
        PyErr_Format(InputError, "classes must be 0 to 255, got %zd", classes);
        return NULL;
    }
    if (keys != Py_None && kt_from(keys, InputError, "keys", KT_LEAVES) == NULL)
        return NULL;
    LeafHeapsObject *s = (LeafHeapsObject *)type->tp_alloc(type, 0);
    if (s == NULL)
        return NULL;
    s->classes = (int)classes;
    s->young = young;
    s->rfree = -1;
    s->own_keys = keys == Py_None;
    if ((s->kt = kt_use(keys, KT_LEAVES, &s->keys)) == NULL) {
        Py_DECREF(s);
        return NULL;
    }
    size_t nh = 2 * (size_t)classes + 1;
    s->heaps = PyMem_Calloc(nh, sizeof(Heap));
    s->heads = PyMem_Calloc(nh, sizeof(PyObject *));
    s->dirty = PyMem_Malloc(nh);
    if (s->heaps == NULL || s->heads == NULL || s->dirty == NULL) {
        Py_DECREF(s);
        return PyErr_NoMemory();
    }
    memset(s->dirty, 1, nh);
    kt_attach(s->kt, KT_LEAVES);
    s->attached = 1;
    return (PyObject *)s;
}

static Py_ssize_t
lh_len(LeafHeapsObject *s)
{
    return s->present;
}

static int
lh_contains(LeafHeapsObject *s, PyObject *key)
{
    return find_present(s, key) >= 0;
}

/* The body of add() for one parsed page (pk NULL: no parent); -1 with an exception set.
 * parent_next: the next add (of the same call) names this key as its parent, so the page
 * is not made a leaf only to stop being one then (adopt's unleaf of a non-leaf is a
 * no-op); nothing between the two adds can look at the heaps. */
static int
add_one(LeafHeapsObject *s, const uint8_t *k, int klen, const uint8_t *pk, int plen, int cls, double t,
        int parent_next)
{
    if (undo_all(s) < 0)
        return -1;
    int32_t idx = map_find(s, k, klen);
    if (idx >= 0 && (NODE(s, idx)->flags & PRESENT)) {
        if (remove_resident(s, idx) < 0 || forget(s, idx) < 0)
            return -1;
    }
    /* Room for the key and its parent first, so that nothing below fails half-way. */
    if (kt_reserve(s->kt, 2) < 0)
        return -1;
    idx = node_get(s, k, klen);
    if (idx < 0)
        return -1;
    set_state(s, idx, cls, t);
    NODE(s, idx)->flags |= PRESENT;
    s->present++;
    if (pk != NULL) {
        int32_t p = node_get(s, pk, plen);
        if (p < 0)
            return fail(s), -1;
        NODE(s, idx)->parent = p;
        if (adopt(s, p) < 0)
            return -1;
    }
    if (kids_of(NODE(s, idx)) == 0) {
        /* Skipped, a chain's page still marks its class as the leaf and unleaf it saves
         * would (the Python twin's): a victims call left unsettled must not reuse its head. */
        if (parent_next)
            s->dirty[NODE(s, idx)->cls] = 1;
        else if (leaf(s, idx) < 0)
            return -1;
    }
    sweep(s);
    return 0;
}

PyDoc_STRVAR(add_many_doc, "add_many(keys, parents, has_parent, classes, t0, step)\n\n"
"add() of n pages in order, one call: keys and parents are bytes of n 16-byte keys\n"
"(parents[i] used where has_parent[i] is nonzero), has_parent and classes one byte per\n"
"page; page i is added at time t0 + i * step.");

static PyObject *
lh_add_many(LeafHeapsObject *s, PyObject *args)
{
    Py_buffer keys, parents, has, classes;
    double t0, step;
    if (check_ok(s) < 0)
        return NULL;
    if (!PyArg_ParseTuple(args, "y*y*y*y*dd:add_many", &keys, &parents, &has, &classes, &t0, &step))
        return NULL;
    PyObject *res = NULL;
    Py_ssize_t n = keys.len / 16;
    if (keys.len % 16 || parents.len != keys.len || has.len != n || classes.len != n) {
        PyErr_Format(InputError, "add_many: %zd bytes of 16-byte keys, %zd of parents, %zd has_parent and %zd "
                     "classes do not describe one batch", keys.len, parents.len, has.len, classes.len);
        goto done;
    }
    const uint8_t *kp = keys.buf, *pp = parents.buf, *hp = has.buf, *cp = classes.buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (cp[i] >= s->classes) {
            PyErr_Format(InputError, "add_many: class %d of page %zd is out of range [0, %d)", cp[i], i, s->classes);
            goto done;
        }
        if (hp[i] && memcmp(kp + 16 * i, pp + 16 * i, 16) == 0) {
            PyErr_Format(InputError, "add_many: page %zd cannot be its own parent", i);
            goto done;
        }
    }
    /* Room for the whole batch up front where it is most of what the table will hold
     * (a reopen's pages): one growth of the map, not one per doubling. Otherwise each
     * add makes its own: most keys may be held by the ghost already. */
    if (n > s->kt->count && kt_reserve(s->kt, n) < 0)
        goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        if ((i & 63) == 0)
            kt_prefetch16(s->kt, kp + 16 * i, n - i);
        uint8_t k[KEY_MAX] = {0}, pk[KEY_MAX] = {0};
        memcpy(k, kp + 16 * i, 16);
        if (hp[i])
            memcpy(pk, pp + 16 * i, 16);
        /* A chain (page i + 1's parent is page i: a prompt's pages) pushes only its last
         * page onto the heaps. */
        int parent_next = i + 1 < n && hp[i + 1] && memcmp(pp + 16 * (i + 1), kp + 16 * i, 16) == 0;
        if (add_one(s, k, 16, hp[i] ? pk : NULL, 16, cp[i], t0 + (double)i * step, parent_next) < 0) {
            /* This add failed before it adopted its parent: the page before, kept off the
             * heaps for it, goes on them after all. */
            if (i > 0 && hp[i] && memcmp(pp + 16 * i, kp + 16 * (i - 1), 16) == 0) {
                uint8_t prev[KEY_MAX];
                memcpy(prev, kp + 16 * (i - 1), 16);
                int32_t p = map_find(s, prev, 16);
                if (p >= 0 && (NODE(s, p)->flags & PRESENT) && kids_of(NODE(s, p)) == 0 && seq_of(s, NODE(s, p)) == 0)
                    (void)leaf(s, p);   /* on failure it marks the heaps broken */
            }
            goto done;
        }
    }
    res = Py_None;
    Py_INCREF(res);
done:
    PyBuffer_Release(&keys);
    PyBuffer_Release(&parents);
    PyBuffer_Release(&has);
    PyBuffer_Release(&classes);
    return res;
}

PyDoc_STRVAR(add_doc, "add(key, parent, cls, t)\n\n"
"key became resident (a leaf, since its children cannot be resident yet).\n"
"key and parent (or None) are bytes of 1 to 16 bytes; t is converted to float.\n"
"Parent links must form a forest; a page that is its own parent is refused.");

static PyObject *
lh_add(LeafHeapsObject *s, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    static const char *const names[] = {"key", "parent", "cls", "t"};
    PyObject *a[4];
    uint8_t k[KEY_MAX], pk[KEY_MAX];
    int klen, plen = 0, cls;
    if (check_ok(s) < 0 || parse_args(args, nargs, kwnames, names, 4, a, "add") < 0)
        return NULL;
    if (!parse_key(a[0], k, &klen, 1, "page key"))
        return NULL;
    int has_parent = a[1] != Py_None;
    if (has_parent && !parse_key(a[1], pk, &plen, 1, "parent key"))
        return NULL;
    if (parse_class(s, a[2], &cls) < 0)
        return NULL;
    double t = PyFloat_AsDouble(a[3]);
    if (t == -1.0 && PyErr_Occurred())
        return NULL;
    if (has_parent && plen == klen && memcmp(pk, k, KEY_MAX) == 0) {
        PyErr_Format(InputError, "page key %R cannot be its own parent", a[0]);
        return NULL;
    }
    if (check_ok(s) < 0 || add_one(s, k, klen, has_parent ? pk : NULL, plen, cls, t, 0) < 0)
        return NULL;
    Py_RETURN_NONE;
}

PyDoc_STRVAR(touch_doc, "touch(key, cls, t)\n\nkey was accessed at t and now belongs to class cls.");

static PyObject *
lh_touch(LeafHeapsObject *s, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    static const char *const names[] = {"key", "cls", "t"};
    PyObject *a[3];
    int cls;
    if (check_ok(s) < 0 || parse_args(args, nargs, kwnames, names, 3, a, "touch") < 0)
        return NULL;
    /* The class and time first: converting them may run Python code (__index__,
     * __float__) that changes this structure, which must not come between the lookup
     * and its use. The class's range is checked once the key is known to be here. */
    long c = PyLong_AsLong(a[1]);
    if (c == -1 && PyErr_Occurred())
        return NULL;
    double t = PyFloat_AsDouble(a[2]);
    if (t == -1.0 && PyErr_Occurred())
        return NULL;
    if (check_ok(s) < 0 || undo_all(s) < 0)
        return NULL;
    int32_t idx = find_present(s, a[0]);
    if (idx < 0)
        Py_RETURN_NONE;
    if (c < 0 || c >= s->classes) {
        PyErr_Format(InputError, "class must be 0 to %d (this LeafHeaps has %d classes), got %ld",
                     s->classes - 1, s->classes, c);
        return NULL;
    }
    cls = (int)c;
    set_state(s, idx, cls, t);
    if (kids_of(NODE(s, idx)) == 0 && leaf(s, idx) < 0)
        return NULL;
    Py_RETURN_NONE;
}

PyDoc_STRVAR(touch_many_doc, "touch_many(keys, classes, t0, step)\n\n"
"touch() of n pages in order, one call: keys is bytes of n 16-byte keys, classes one\n"
"byte per page; page i is touched at time t0 + i * step. Absent keys are skipped.");

static PyObject *
lh_touch_many(LeafHeapsObject *s, PyObject *args)
{
    Py_buffer keys, classes;
    double t0, step;
    if (check_ok(s) < 0)
        return NULL;
    if (!PyArg_ParseTuple(args, "y*y*dd:touch_many", &keys, &classes, &t0, &step))
        return NULL;
    PyObject *res = NULL;
    Py_ssize_t n = keys.len / 16;
    if (keys.len % 16 || classes.len != n) {
        PyErr_Format(InputError, "touch_many: %zd bytes of 16-byte keys and %zd classes do not describe one batch",
                     keys.len, classes.len);
        goto done;
    }
    const uint8_t *kp = keys.buf, *cp = classes.buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (cp[i] >= s->classes) {
            PyErr_Format(InputError, "touch_many: class %d of page %zd is out of range [0, %d)", cp[i], i, s->classes);
            goto done;
        }
    }
    if (undo_all(s) < 0)
        goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        if ((i & 63) == 0)
            kt_prefetch16(s->kt, kp + 16 * i, n - i);
        uint8_t k[KEY_MAX] = {0};
        memcpy(k, kp + 16 * i, 16);
        int32_t idx = map_find(s, k, 16);
        if (idx < 0 || !(NODE(s, idx)->flags & PRESENT))
            continue;
        set_state(s, idx, cp[i], t0 + (double)i * step);
        if (kids_of(NODE(s, idx)) == 0 && leaf(s, idx) < 0)
            goto done;
    }
    res = Py_None;
    Py_INCREF(res);
done:
    PyBuffer_Release(&keys);
    PyBuffer_Release(&classes);
    return res;
}

PyDoc_STRVAR(discard_doc, "discard(key)\n\nkey left the tier. Removing a pending victim settles it.");

/* discard of the present node idx (see lh_discard); -1 on error. */
static int
discard_node(LeafHeapsObject *s, int32_t idx)
{
    Node *nd = NODE(s, idx);
    if (pend_of(s, nd) >= 0) {
        s->pend[REC(s, nd)->pend] = -1;
        REC(s, nd)->pend = -1;
        rec_drop(s, idx);
        if (--s->plive == 0)
            s->npend = 0;
    } else if (undo_all(s) < 0 || remove_resident(s, idx) < 0) {
        return -1;
    }
    if (forget(s, idx) < 0)
        return -1;
    sweep(s);
    return 0;
}

PyDoc_STRVAR(discard_many_doc,
"discard_many(keys)\n\n"
"discard() of each 16-byte key of keys (back to back), in order.");

static PyObject *
lh_discard_many(LeafHeapsObject *s, PyObject *arg)
{
    Py_buffer keys;
    if (check_ok(s) < 0)
        return NULL;
    if (PyObject_GetBuffer(arg, &keys, PyBUF_SIMPLE) < 0)
        return NULL;
    PyObject *res = NULL;
    if (keys.len % 16) {
        PyErr_Format(InputError, "discard_many: %zd bytes are not 16-byte keys back to back", keys.len);
        goto done;
    }
    const uint8_t *kp = keys.buf;
    for (Py_ssize_t i = 0; i < keys.len / 16; i++) {
        if ((i & 63) == 0)
            kt_prefetch16(s->kt, kp + 16 * i, keys.len / 16 - i);
        uint8_t k[KEY_MAX] = {0};
        memcpy(k, kp + 16 * i, 16);
        int32_t idx = map_find(s, k, 16);
        if (idx < 0 || !(NODE(s, idx)->flags & PRESENT))
            continue;
        if (discard_node(s, idx) < 0)
            goto done;
    }
    res = Py_None;
    Py_INCREF(res);
done:
    PyBuffer_Release(&keys);
    return res;
}

static PyObject *
lh_discard(LeafHeapsObject *s, PyObject *key)
{
    if (check_ok(s) < 0)
        return NULL;
    int32_t idx = find_present(s, key);
    if (idx < 0)
        Py_RETURN_NONE;
    if (discard_node(s, idx) < 0)
        return NULL;
    Py_RETURN_NONE;
}

/* The first evictable leaf at one end of class c, as a new candidate tuple; Py_None if
 * there is none (borrowed), NULL on error. Unevictable heads are popped to the stash.
 * ``exclude`` (a dict or set, or NULL): keys in it are not evictable, asked before
 * ``evictable`` (no Python call for them). */
static PyObject *
head(LeafHeapsObject *s, PyObject *evictable, PyObject *exclude, int c, int which)
{
    Heap *h = &s->heaps[2 * c + which];
    while (h->n > 0) {
        int32_t idx = h->a[0];
        PyObject *key = key_bytes(s, idx);
        if (key == NULL)
            return NULL;
        int ok = 1;
        if (!(NODE(s, idx)->flags & ALLOWED)) {
            int out = exclude == NULL ? 0 : PyDict_Check(exclude) ? PyDict_Contains(exclude, key)
                                                                : PySet_Contains(exclude, key);
            if (out != 0) {
                ok = out < 0 ? -1 : 0;
            } else {
                PyObject *r = PyObject_CallOneArg(evictable, key);
                ok = r == NULL ? -1 : PyObject_IsTrue(r);
                Py_XDECREF(r);
            }
            if (ok > 0 && grow((void **)&s->allowed, &s->acap, s->nallowed + 1, sizeof(int32_t)) < 0)
                ok = -1;
            if (ok < 0) {
                Py_DECREF(key);
                return NULL;
            }
            if (ok) {   /* evictable may have called back into us: nodes may have moved */
                NODE(s, idx)->flags |= ALLOWED;
                s->allowed[s->nallowed++] = idx;
            }
        }
        h = &s->heaps[2 * c + which];  /* evictable may have called back into us */
        if (ok) {
            PyObject *last = PyFloat_FromDouble(NODE(s, idx)->last);
            PyObject *cls = PyLong_FromLong(c);
            if (last == NULL || cls == NULL) {
                Py_DECREF(key);
                Py_XDECREF(last);
                Py_XDECREF(cls);
                return NULL;
            }
            PyObject *cand = PyTuple_New(4);
            if (cand == NULL) {
                Py_DECREF(key);
                Py_DECREF(last);
                Py_DECREF(cls);
                return NULL;
            }
            PyTuple_SET_ITEM(cand, 0, key);
            PyTuple_SET_ITEM(cand, 1, cls);
            PyTuple_SET_ITEM(cand, 2, last);
            PyTuple_SET_ITEM(cand, 3, Py_NewRef(which == YOUNG ? Py_True : Py_False));
            return cand;
        }
        Py_DECREF(key);
        if (h->n > 0 && h->a[0] == idx) {
            if (grow((void **)&s->stash, &s->scap, s->nstash + 1, sizeof(Stashed)) < 0)
                return NULL;
            s->stash[s->nstash++] = (Stashed){seq_of(s, NODE(s, idx)), idx, which};
            heap_remove(s, which, idx);
        }
    }
    return Py_None;
}

PyDoc_STRVAR(candidates_doc, "candidates(evictable) -> list of (key, class, last access, young end)\n\n"
"The oldest (and, if enabled, the youngest) evictable leaf of every class, by class.\n"
"Within one victims call (until settle) evictable must not change: the heads of\n"
"classes untouched since the last call are reused, and a leaf it allowed is not asked again.");

static PyObject *
candidates_excluding(LeafHeapsObject *s, PyObject *evictable, PyObject *exclude)
{
    if (check_ok(s) < 0)
        return NULL;
    for (int c = 0; c < s->classes; c++) {
        if (!s->dirty[c])
            continue;
        for (int w = OLD; w <= YOUNG; w++)
            Py_CLEAR(s->heads[2 * c + w]);
        for (int w = OLD; w <= (s->young ? YOUNG : OLD); w++) {
            PyObject *cand = head(s, evictable, exclude, c, w);
            if (cand == NULL)
                return NULL;
            if (cand != Py_None)
                s->heads[2 * c + w] = cand;
        }
    }
    memset(s->dirty, 0, (size_t)s->classes);
    PyObject *out = PyList_New(0);
    if (out == NULL)
        return NULL;
    for (int i = 0; i < 2 * s->classes; i++) {
        if (s->heads[i] != NULL && PyList_Append(out, s->heads[i]) < 0) {
            Py_DECREF(out);
            return NULL;
        }
    }
    return out;
}

static PyObject *
lh_candidates(LeafHeapsObject *s, PyObject *evictable)
{
    return candidates_excluding(s, evictable, NULL);
}

PyDoc_STRVAR(take_doc, "take(key)\n\nMark the leaf key as a victim; its parent may become a leaf.\n"
"KeyError if key is not resident, InputError if it has resident children; a key\n"
"taken already (and not discarded or put back since) is left as it is.");

static PyObject *
lh_take(LeafHeapsObject *s, PyObject *key)
{
    if (check_ok(s) < 0)
        return NULL;
    int32_t idx = find_present(s, key);
    if (idx < 0) {
        PyErr_SetObject(PyExc_KeyError, key);
        return NULL;
    }
    if (pend_of(s, NODE(s, idx)) >= 0)   /* taken already: its parent lost it then */
        Py_RETURN_NONE;
    if (kids_of(NODE(s, idx)) != 0) {
        PyErr_Format(InputError, "take: page %R has resident children: only a leaf can be a victim", key);
        return NULL;
    }
    if (grow((void **)&s->pend, &s->pcap, s->npend + 1, sizeof(int32_t)) < 0 || rec_reserve(s, 2) < 0)
        return NULL;
    unleaf(s, idx);
    if (orphan(s, idx) < 0)
        return NULL;
    Rec *rc = rec_make(s, idx);   /* cannot fail: two reserved above, for it and a parent orphan() made a leaf */
    rc->pend = s->npend;
    s->pend[s->npend++] = idx;
    s->plive++;
    Py_RETURN_NONE;
}

PyDoc_STRVAR(choose_doc,
"choose_victims(n, evictable, index, support, now, z, use_rank, requests, log_growth, bins[, exclude]) -> list\n\n"
"GittinsPolicy's victims loop in one call: up to n times, candidates(evictable), the\n"
"choice among them, take(key). index and support are float64 tables [classes][bins]\n"
"(bytes), use_rank one byte per class; a candidate's score is index[c][b] with relative\n"
"error z / sqrt(max(support[c][b], 1)), b the bin of its age now - last (log1p(age) /\n"
"log_growth, at most bins - 1). The oldest candidate goes unless, with request hints,\n"
"one of no higher use rank scores lower beyond both error bars (GittinsPolicy._choose).\n"
"exclude (a dict or set, optional): keys never evictable, asked in C before evictable is\n"
"called (the request's pages, without a Python call each). Does not settle: the caller does.");

static void
score(const double *index, const double *support, int bins, int c, double age, double z, double log_growth,
      double *err, double *value)
{
    int b = 0;
    if (age > 0.0) {
        double x = log1p(age) / log_growth;
        b = x >= (double)(bins - 1) ? bins - 1 : (int)x;
    }
    double sup = support[c * bins + b];
    *value = index[c * bins + b];
    *err = z / sqrt(sup > 1.0 ? sup : 1.0);
}

static PyObject *
lh_choose_victims(LeafHeapsObject *s, PyObject *args)
{
    Py_ssize_t n;
    PyObject *evictable, *exclude = Py_None;
    Py_buffer index, support, rank;
    double now, z, log_growth;
    int requests, bins;
    if (check_ok(s) < 0)
        return NULL;
    if (!PyArg_ParseTuple(args, "nOy*y*ddy*pdi|O:choose_victims", &n, &evictable, &index, &support, &now, &z, &rank,
                          &requests, &log_growth, &bins, &exclude))
        return NULL;
    if (exclude == Py_None) {
        exclude = NULL;
    } else if (!PyDict_Check(exclude) && !PyAnySet_Check(exclude)) {
        PyErr_Format(PyExc_TypeError, "choose_victims: exclude must be a dict or a set, not %.100s",
                     Py_TYPE(exclude)->tp_name);
        PyBuffer_Release(&index);
        PyBuffer_Release(&support);
        PyBuffer_Release(&rank);
        return NULL;
    }
    PyObject *out = NULL, *cands = NULL;
    const double *ix = index.buf, *sp = support.buf;
    const uint8_t *rk = rank.buf;
    if (bins < 1 || index.len != (Py_ssize_t)s->classes * bins * (Py_ssize_t)sizeof(double)
        || support.len != index.len || rank.len < s->classes || !(log_growth > 0.0)) {
        PyErr_Format(InputError, "choose_victims: tables of %zd and %zd bytes, %zd ranks and %d bins do not fit %d "
                     "classes", index.len, support.len, rank.len, bins, s->classes);
        goto done;
    }
    out = PyList_New(0);
    if (out == NULL)
        goto done;
    while (PyList_GET_SIZE(out) < n) {
        cands = candidates_excluding(s, evictable, exclude);
        if (cands == NULL) {
            Py_CLEAR(out);
            goto done;
        }
        Py_ssize_t m = PyList_GET_SIZE(cands);
        if (m == 0)
            break;
        Py_ssize_t best = 0, oldest = 0;
        double best_err = 0, best_v = 0, old_err = 0, old_v = 0, old_last = 0;
        int old_young = 0, best_c = 0, old_c = 0;
        for (Py_ssize_t i = 0; i < m; i++) {
            PyObject *t = PyList_GET_ITEM(cands, i);
            long c = PyLong_AsLong(PyTuple_GET_ITEM(t, 1));
            double last = PyFloat_AsDouble(PyTuple_GET_ITEM(t, 2));
            int young = PyObject_IsTrue(PyTuple_GET_ITEM(t, 3));
            if ((c == -1 || last == -1.0) && PyErr_Occurred()) {
                Py_CLEAR(out);
                goto done;
            }
            double err, v;
            score(ix, sp, bins, (int)c, now - last, z, log_growth, &err, &v);
            if (i == 0) {
                best_err = old_err = err;
                best_v = old_v = v;
                best_c = old_c = (int)c;
                old_last = last;
                old_young = young;
                continue;
            }
            if (v < best_v) {
                best = i, best_err = err, best_v = v, best_c = (int)c;
            }
            if (!young && (old_young || last < old_last)) {
                oldest = i, old_err = err, old_v = v, old_c = (int)c, old_last = last, old_young = young;
            }
        }
        Py_ssize_t pick = oldest;
        if (best != oldest && requests && !(rk[best_c] > rk[old_c])) {
            double upper = best_v * (1.0 + best_err);
            double lower = old_v * (1.0 - old_err > 0.0 ? 1.0 - old_err : 0.0);
            if (upper < lower)
                pick = best;
        }
        PyObject *key = PyTuple_GET_ITEM(PyList_GET_ITEM(cands, pick), 0);
        Py_INCREF(key);
        Py_CLEAR(cands);
        PyObject *r = lh_take(s, key);
        if (r == NULL || PyList_Append(out, key) < 0) {
            Py_XDECREF(r);
            Py_DECREF(key);
            Py_CLEAR(out);
            goto done;
        }
        Py_DECREF(r);
        Py_DECREF(key);
    }
done:
    Py_XDECREF(cands);
    PyBuffer_Release(&index);
    PyBuffer_Release(&support);
    PyBuffer_Release(&rank);
    return out;
}

PyDoc_STRVAR(settle_doc, "settle()\n\nEnd of a victims call: leaves skipped as unevictable go back.");

static PyObject *
lh_settle(LeafHeapsObject *s, PyObject *Py_UNUSED(ignored))
{
    if (check_ok(s) < 0)
        return NULL;
    forget_allowed(s);
    for (int32_t i = 0; i < s->nstash; i++) {
        Stashed e = s->stash[i];
        Node *nd = NODE(s, e.node);
        /* Still the same leaf (same sequence number) and not back in already. */
        if (seq_of(s, nd) == e.seq && REC(s, nd)->pos[e.which] < 0 && heap_push(s, e.which, e.node) < 0)
            return fail(s), NULL;
    }
    s->nstash = 0;
    memset(s->dirty, 1, (size_t)s->classes);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(undo_doc, "undo()\n\nVictims handed out but never removed stay resident after all.");

static PyObject *
lh_undo(LeafHeapsObject *s, PyObject *Py_UNUSED(ignored))
{
    if (check_ok(s) < 0 || undo_all(s) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static int32_t
present_or_keyerror(LeafHeapsObject *s, PyObject *key)
{
    if (check_ok(s) < 0)
        return -1;
    int32_t idx = find_present(s, key);
    if (idx < 0)
        PyErr_SetObject(PyExc_KeyError, key);
    return idx;
}

PyDoc_STRVAR(last_of_doc, "last_of(key) -> float\n\nThe last access of the resident key; KeyError if absent.");

static PyObject *
lh_last_of(LeafHeapsObject *s, PyObject *key)
{
    int32_t idx = present_or_keyerror(s, key);
    return idx < 0 ? NULL : PyFloat_FromDouble(NODE(s, idx)->last);
}

PyDoc_STRVAR(class_of_doc, "class_of(key) -> int\n\nThe class of the resident key; KeyError if absent.");

static PyObject *
lh_class_of(LeafHeapsObject *s, PyObject *key)
{
    int32_t idx = present_or_keyerror(s, key);
    return idx < 0 ? NULL : PyLong_FromLong(NODE(s, idx)->cls);
}

PyDoc_STRVAR(parent_of_doc, "parent_of(key) -> bytes or None\n\nThe parent of the resident key; KeyError if absent.");

static PyObject *
lh_parent_of(LeafHeapsObject *s, PyObject *key)
{
    int32_t idx = present_or_keyerror(s, key);
    if (idx < 0)
        return NULL;
    int32_t p = NODE(s, idx)->parent;
    if (p < 0)
        Py_RETURN_NONE;
    return key_bytes(s, p);
}

PyDoc_STRVAR(nbytes_doc, "nbytes() -> int\n\nBytes of memory held for the pages (arrays, table, heaps).");

static PyObject *
lh_nbytes(LeafHeapsObject *s, PyObject *Py_UNUSED(ignored))
{
    size_t n = (size_t)s->rcap * sizeof(Rec) + (s->own_keys ? kt_nbytes(s->kt) : 0) +
               (size_t)s->pcap * sizeof(int32_t) + (size_t)s->scap * sizeof(Stashed) +
               (size_t)s->zcap * sizeof(int32_t);
    for (int i = 0; i < 2 * s->classes; i++)
        n += (size_t)s->heaps[i].cap * sizeof(int32_t);
    return PyLong_FromSize_t(n);
}

static PyMethodDef lh_methods[] = {
    {"add", (PyCFunction)(void (*)(void))lh_add, METH_FASTCALL | METH_KEYWORDS, add_doc},
    {"add_many", (PyCFunction)lh_add_many, METH_VARARGS, add_many_doc},
    {"touch", (PyCFunction)(void (*)(void))lh_touch, METH_FASTCALL | METH_KEYWORDS, touch_doc},
    {"touch_many", (PyCFunction)lh_touch_many, METH_VARARGS, touch_many_doc},
    {"discard", (PyCFunction)lh_discard, METH_O, discard_doc},
    {"discard_many", (PyCFunction)lh_discard_many, METH_O, discard_many_doc},
    {"candidates", (PyCFunction)lh_candidates, METH_O, candidates_doc},
    {"take", (PyCFunction)lh_take, METH_O, take_doc},
    {"choose_victims", (PyCFunction)lh_choose_victims, METH_VARARGS, choose_doc},
    {"settle", (PyCFunction)lh_settle, METH_NOARGS, settle_doc},
    {"undo", (PyCFunction)lh_undo, METH_NOARGS, undo_doc},
    {"last_of", (PyCFunction)lh_last_of, METH_O, last_of_doc},
    {"class_of", (PyCFunction)lh_class_of, METH_O, class_of_doc},
    {"parent_of", (PyCFunction)lh_parent_of, METH_O, parent_of_doc},
    {"nbytes", (PyCFunction)lh_nbytes, METH_NOARGS, nbytes_doc},
    {NULL, NULL, 0, NULL},
};

static PySequenceMethods lh_as_sequence = {
    .sq_length = (lenfunc)lh_len,
    .sq_contains = (objobjproc)lh_contains,
};

PyDoc_STRVAR(lh_doc, "LeafHeaps(classes, young=True)\n\n"
"Parent links, resident-child counts and per-class leaf heaps of one tier's pages,\n"
"compiled: the contract of tierkv.policy.leaves.PyLeafHeaps, keys of 1 to 16 bytes.\n"
"Not thread-safe.");

static PyTypeObject LeafHeapsType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "tierkv.policy._leaves.LeafHeaps",
    .tp_basicsize = sizeof(LeafHeapsObject),
    .tp_dealloc = (destructor)lh_dealloc,
    .tp_as_sequence = &lh_as_sequence,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = lh_doc,
    .tp_methods = lh_methods,
    .tp_new = lh_new,
};

static struct PyModuleDef leaves_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "tierkv.policy._leaves",
    .m_doc = "The compiled LeafHeaps of tierkv.policy.leaves.",
    .m_size = -1,
};

PyMODINIT_FUNC
PyInit__leaves(void)
{
    PyObject *errors = PyImport_ImportModule("tierkv.errors");
    if (errors == NULL)
        return NULL;
    InputError = PyObject_GetAttrString(errors, "InputError");
    Py_DECREF(errors);
    if (InputError == NULL)
        return NULL;
    if (PyType_Ready(&LeafHeapsType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&leaves_module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddObjectRef(m, "LeafHeaps", (PyObject *)&LeafHeapsType) < 0 ||
        PyModule_AddIntConstant(m, "KEY_MAX_BYTES", KEY_MAX) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
