/*
 * keytab.h: the page keys of one tier's compiled policy structures, held once.
 *
 * GittinsPolicy keeps a tier's resident pages in LeafHeaps (tierkv.policy._leaves) and
 * the pages it remembers in its ghost (tierkv.policy._ghost): mostly the same keys. A
 * KeyTab holds each key once (16 zero-padded bytes and its length) under a dense id
 * and maps keys to ids; both structures index their per-page nodes by that id and
 * mark the ids they hold (holder bits), so a key the two share costs one copy and one
 * map entry. An id is freed, and may be handed out again, once no holder is left.
 *
 * Both extension modules compile this file; the one KeyTab they share travels between
 * them in a PyCapsule named KT_CAPSULE (see kt_capsule_new and kt_from). The layout is
 * the same in both because they are built from the same header in one build.
 *
 * Layout: ids in chunks of KT_CHUNK (a key and a meta byte each: the key's length - 1
 * in the low 4 bits, holder bits above; 17 bytes an id, no slack beyond one chunk); an
 * open-addressing table (linear probing, backward-shift deletion, load up to 0.8) of
 * ids tagged with 4 hash bits; freed ids on a stack threaded through their key bytes.
 * Not thread-safe: every caller holds the GIL.
 */
#ifndef TIERKV_KEYTAB_H
#define TIERKV_KEYTAB_H

#include <Python.h>
#include <stdint.h>
#include <string.h>

#define KT_KEY 16
#define KT_MAP_MIN 16
#define KT_CHUNK_BITS 12
#define KT_CHUNK ((int32_t)1 << KT_CHUNK_BITS)
#define KT_EMPTY UINT32_MAX
#define KT_IDX_BITS 28
#define KT_IDX_MASK ((UINT32_C(1) << KT_IDX_BITS) - 1)
#define KT_MAX_IDS ((int32_t)KT_IDX_MASK - 1)
#define KT_TAG(h) ((uint32_t)((h) >> 60))
#define KT_CAPSULE "tierkv.policy.keytab"

/* Holder bits (the meta byte's high half). */
#define KT_LEAVES 0x10
#define KT_GHOST 0x20
#define KT_HOLDERS 0xF0

typedef struct {
    uint8_t key[KT_CHUNK][KT_KEY];
    uint8_t meta[KT_CHUNK];
} KtChunk;

typedef struct {
    KtChunk **chunks;
    int32_t nchunks, chunkcap;
    int32_t high;       /* ids ever handed out */
    int32_t free_head;  /* last freed id, -1 for none */
    uint32_t *slots;
    size_t smask;
    Py_ssize_t count;   /* ids held */
} KeyTab;

#define KT_KEYOF(kt, id) ((kt)->chunks[(id) >> KT_CHUNK_BITS]->key[(id) & (KT_CHUNK - 1)])
#define KT_META(kt, id) ((kt)->chunks[(id) >> KT_CHUNK_BITS]->meta[(id) & (KT_CHUNK - 1)])

static inline int
kt_len(const KeyTab *kt, int32_t id)
{
    return (KT_META(kt, id) & 0x0F) + 1;
}

static inline int
kt_held(const KeyTab *kt, int32_t id, int bit)
{
    return (KT_META(kt, id) & bit) != 0;
}

static inline uint64_t
kt_hash(const uint8_t *k, int len)
{
    uint64_t a, b;
    memcpy(&a, k, 8);
    memcpy(&b, k + 8, 8);
    uint64_t h = a * UINT64_C(0x9E3779B97F4A7C15) ^ (b + (uint64_t)len) * UINT64_C(0xC2B2AE3D27D4EB4F);
    h ^= h >> 29;
    h *= UINT64_C(0xBF58476D1CE4E5B9);
    h ^= h >> 32;
    return h;
}

/* The id of key (16 zero-padded bytes, len of them the key), -1 if no holder has it. */
static inline int32_t
kt_find(const KeyTab *kt, const uint8_t key[KT_KEY], int len)
{
    uint64_t h = kt_hash(key, len);
    uint32_t tag = KT_TAG(h);
    size_t i = (size_t)h & kt->smask;
    for (;;) {
        uint32_t e = kt->slots[i];
        if (e == KT_EMPTY)
            return -1;
        if (e >> KT_IDX_BITS == tag) {
            int32_t id = (int32_t)(e & KT_IDX_MASK);
            if (kt_len(kt, id) == len && memcmp(KT_KEYOF(kt, id), key, KT_KEY) == 0)
                return id;
        }
        i = (i + 1) & kt->smask;
    }
}

static inline size_t
kt_home(const KeyTab *kt, int32_t id)
{
    return (size_t)kt_hash(KT_KEYOF(kt, id), kt_len(kt, id)) & kt->smask;
}

static void
kt_place(KeyTab *kt, int32_t id)
{
    uint64_t h = kt_hash(KT_KEYOF(kt, id), kt_len(kt, id));
    size_t i = (size_t)h & kt->smask;
    while (kt->slots[i] != KT_EMPTY)
        i = (i + 1) & kt->smask;
    kt->slots[i] = KT_TAG(h) << KT_IDX_BITS | (uint32_t)id;
}

/* Room for extra more keys (map and ids), so that as many kt_add calls cannot fail;
 * -1 with MemoryError (nothing changed that matters). */
static int
kt_reserve(KeyTab *kt, Py_ssize_t extra)
{
    if (extra < 0)
        extra = 0;
    size_t cap = kt->smask + 1;
    if ((size_t)(kt->count + extra) * 5 > cap * 4) {
        size_t ncap = cap;
        while ((size_t)(kt->count + extra) * 5 > ncap * 4)
            ncap *= 2;
        uint32_t *slots = PyMem_Malloc(ncap * sizeof(uint32_t));
        if (slots == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        memset(slots, 0xff, ncap * sizeof(uint32_t));
        uint32_t *old = kt->slots;
        kt->slots = slots;
        kt->smask = ncap - 1;
        for (size_t i = 0; i < cap; i++)
            if (old[i] != KT_EMPTY)
                kt_place(kt, (int32_t)(old[i] & KT_IDX_MASK));
        PyMem_Free(old);
    }
    /* Freed ids are reused first; only the rest need fresh ones. */
    int64_t fresh = extra;
    for (int32_t f = kt->free_head; f >= 0 && fresh > 0; fresh--)
        memcpy(&f, KT_KEYOF(kt, f), sizeof(f));
    int64_t need = (int64_t)kt->high + fresh;
    if (need > KT_MAX_IDS) {
        PyErr_Format(PyExc_MemoryError, "a policy's key table holds at most %d keys", (int)KT_MAX_IDS);
        return -1;
    }
    while ((int64_t)kt->nchunks * KT_CHUNK < need) {
        if (kt->nchunks == kt->chunkcap) {
            int32_t ncap = kt->chunkcap < 16 ? 16 : kt->chunkcap * 2;
            KtChunk **c = PyMem_Realloc(kt->chunks, (size_t)ncap * sizeof(KtChunk *));
            if (c == NULL) {
                PyErr_NoMemory();
                return -1;
            }
            kt->chunks = c;
            kt->chunkcap = ncap;
        }
        KtChunk *c = PyMem_Malloc(sizeof(KtChunk));
        if (c == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        memset(c->meta, 0, sizeof(c->meta));
        kt->chunks[kt->nchunks++] = c;
    }
    return 0;
}

/* A new id for key (absent: kt_find said -1), held by nobody yet: the caller holds it
 * at once. Only after kt_reserve made room for it. */
static int32_t
kt_add(KeyTab *kt, const uint8_t key[KT_KEY], int len)
{
    int32_t id;
    if (kt->free_head >= 0) {
        id = kt->free_head;
        memcpy(&kt->free_head, KT_KEYOF(kt, id), sizeof(int32_t));
    } else {
        id = kt->high++;
    }
    memcpy(KT_KEYOF(kt, id), key, KT_KEY);
    KT_META(kt, id) = (uint8_t)(len - 1);
    kt_place(kt, id);
    kt->count++;
    return id;
}

static inline void
kt_hold(KeyTab *kt, int32_t id, int bit)
{
    KT_META(kt, id) |= (uint8_t)bit;
}

static void
kt_unmap(KeyTab *kt, int32_t id)
{
    size_t i = kt_home(kt, id);
    while (kt->slots[i] == KT_EMPTY || (kt->slots[i] & KT_IDX_MASK) != (uint32_t)id)
        i = (i + 1) & kt->smask;
    size_t j = i;
    for (;;) {
        j = (j + 1) & kt->smask;
        uint32_t o = kt->slots[j];
        if (o == KT_EMPTY)
            break;
        size_t h = kt_home(kt, (int32_t)(o & KT_IDX_MASK));
        /* o may move back to i unless its home lies cyclically in (i, j]. */
        int stays = i <= j ? (h > i && h <= j) : (h > i || h <= j);
        if (!stays) {
            kt->slots[i] = o;
            i = j;
        }
    }
    kt->slots[i] = KT_EMPTY;
}

/* The holder bit lets go of id; the id is freed when no holder is left. */
static void
kt_drop(KeyTab *kt, int32_t id, int bit)
{
    uint8_t m = KT_META(kt, id);
    if (!(m & bit))
        return;
    m &= (uint8_t)~bit;
    KT_META(kt, id) = m;
    if (m & KT_HOLDERS)
        return;
    kt_unmap(kt, id);
    memset(KT_KEYOF(kt, id), 0, KT_KEY);
    memcpy(KT_KEYOF(kt, id), &kt->free_head, sizeof(int32_t));
    KT_META(kt, id) = 0;
    kt->free_head = id;
    kt->count--;
}

static size_t
kt_nbytes(const KeyTab *kt)
{
    return (size_t)kt->nchunks * sizeof(KtChunk) + (size_t)kt->chunkcap * sizeof(KtChunk *) +
           (kt->smask + 1) * sizeof(uint32_t);
}

static void
kt_free(KeyTab *kt)
{
    if (kt == NULL)
        return;
    for (int32_t i = 0; i < kt->nchunks; i++)
        PyMem_Free(kt->chunks[i]);
    PyMem_Free(kt->chunks);
    PyMem_Free(kt->slots);
    PyMem_Free(kt);
}

static void
kt_capsule_free(PyObject *cap)
{
    kt_free(PyCapsule_GetPointer(cap, KT_CAPSULE));
}

/* A new, empty key table in a capsule; NULL with an exception. */
static PyObject *
kt_capsule_new(void)
{
    KeyTab *kt = PyMem_Calloc(1, sizeof(KeyTab));
    if (kt == NULL)
        return PyErr_NoMemory();
    kt->free_head = -1;
    kt->slots = PyMem_Malloc(KT_MAP_MIN * sizeof(uint32_t));
    if (kt->slots == NULL) {
        PyMem_Free(kt);
        return PyErr_NoMemory();
    }
    memset(kt->slots, 0xff, KT_MAP_MIN * sizeof(uint32_t));
    kt->smask = KT_MAP_MIN - 1;
    PyObject *cap = PyCapsule_New(kt, KT_CAPSULE, kt_capsule_free);
    if (cap == NULL)
        kt_free(kt);
    return cap;
}

/* The key table in capsule obj; NULL with InputError set (named from `what`) otherwise. */
static KeyTab *
kt_from(PyObject *obj, PyObject *error, const char *what)
{
    if (!PyCapsule_IsValid(obj, KT_CAPSULE)) {
        PyErr_Format(error, "%s must be a key table from tierkv.policy._ghost.new_keys(), got %.100s", what,
                     Py_TYPE(obj)->tp_name);
        return NULL;
    }
    return PyCapsule_GetPointer(obj, KT_CAPSULE);
}

#endif
