/*
 * keytab.h: page keys held once for the structures that share them (a tier's compiled
 * policy structures, and the store's page table).
 *
 * GittinsPolicy keeps a tier's resident pages in LeafHeaps (tierkv.policy._leaves) and
 * the pages it remembers in its ghost (tierkv.policy._ghost): mostly the same keys; the
 * store's page table (tierkv._table) holds every page the store has, so the keys of its
 * slowest tier's policy as well. A KeyTab holds each key once (16 zero-padded bytes and
 * its length) under a dense id and maps keys to ids; each id's record also holds the
 * structures' nodes for that key (the page table's is its published level, a byte), and
 * the ids each holds are marked (holder bits), so a key they share costs one copy, one
 * map entry and, on a lookup, one cache line past the map. An id is freed, and may be
 * handed out again, once no holder is left. The page table's rows are its ids.
 *
 * The three extension modules compile this file; the one KeyTab they share travels
 * between them in a PyCapsule named KT_CAPSULE (see kt_capsule_new and kt_from). The
 * layout is the same in all because they are built from the same header in one build.
 *
 * Layout: one record per id, in chunks of KT_CHUNK records aligned to 64 bytes (no
 * slack beyond one chunk, records never move): the key (16 bytes), a meta byte (the
 * key's length - 1 in the low 4 bits, holder bits above), the page table's level byte
 * (in every layout: NO_LEVEL wherever the page table does not hold the id), then the
 * node of each policy structure the table was made for, at a fixed offset (for both: the
 * leaf heaps' 18-byte node at 18, the ghost's 20-byte node at 36, 56 bytes in all; for
 * the leaf heaps alone 40, the ghost alone 40, none a 20-byte record). Records start 8
 * bytes apart; each node is packed to the alignment its offset has (the leaf heaps'
 * to 2, the ghost's to 4). A holder's node is its own while it holds
 * the id; otherwise nobody reads it. An open-addressing table
 * (linear probing, backward-shift deletion, load up to 0.8) of ids tagged with 4 hash
 * bits; freed ids on a stack threaded through their key bytes. Not thread-safe: every
 * caller holds the GIL.
 */
#ifndef TIERKV_KEYTAB_H
#define TIERKV_KEYTAB_H

#include <Python.h>
#include <stdint.h>
#include <string.h>
#ifdef __linux__
#include <sys/mman.h>
#endif

#define KT_KEY 16
#define KT_MAP_MIN 16
#define KT_CHUNK_BITS 10
#define KT_CHUNK ((int32_t)1 << KT_CHUNK_BITS)
#define KT_EMPTY UINT32_MAX
#define KT_IDX_BITS 28
#define KT_IDX_MASK ((UINT32_C(1) << KT_IDX_BITS) - 1)
#define KT_MAX_IDS ((int32_t)KT_IDX_MASK - 1)
#define KT_TAG(h) ((uint32_t)((h) >> 60))
/* The capsule's name carries the layout's version: a module built from another version
 * of this header (a stale build beside a fresh one) refuses the table instead of reading
 * it with the wrong layout. Bump it with any change to KeyTab or the records. */
#define KT_CAPSULE "tierkv.policy.keytab/3"

/* Holder bits (the meta byte's high half). */
#define KT_LEAVES 0x10
#define KT_GHOST 0x20
#define KT_TABLE 0x40
#define KT_HOLDERS 0xF0
/* The page table's level of an id it does not hold, or holds unpublished. */
#define KT_NO_LEVEL 0xFF
/* The holders' node sizes (each module checks its Node against these). */
#define KT_LEAVES_NODE 18
#define KT_GHOST_NODE 20

typedef struct {
    uint8_t **chunks;   /* KT_CHUNK records of rec_size bytes each, 64-byte aligned */
    void **raw;         /* the allocation of each chunk (PyMem, so that tracemalloc sees it) */
    int32_t nchunks, chunkcap;
    int32_t high;       /* ids ever handed out */
    int32_t free_head;  /* last freed id, -1 for none */
    int32_t nfree;      /* freed ids on that stack */
    uint32_t *slots;
    size_t smask;
    Py_ssize_t count;   /* ids held */
    uint32_t rec_size;  /* bytes a record */
    uint32_t leaves_off, ghost_off;   /* where each holder's node is in a record; 0: no room */
    uint8_t attached;   /* the holder bits of the structures using the table: one of each kind */
} KeyTab;

#define KT_REC(kt, id) ((kt)->chunks[(id) >> KT_CHUNK_BITS] + (size_t)((id) & (KT_CHUNK - 1)) * (kt)->rec_size)
#define KT_KEYOF(kt, id) (KT_REC(kt, id))
#define KT_META(kt, id) (KT_REC(kt, id)[KT_KEY])
#define KT_LEVEL(kt, id) (KT_REC(kt, id)[KT_KEY + 1])

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

#if defined(__GNUC__) || defined(__clang__)
#define KT_PREFETCH(p) __builtin_prefetch(p)
#else
#define KT_PREFETCH(p) ((void)(p))
#endif

/* The id of key (16 zero-padded bytes, len of them the key) whose hash is h, -1 if no
 * holder has it. */
static inline int32_t
kt_find_h(const KeyTab *kt, const uint8_t key[KT_KEY], int len, uint64_t h)
{
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

static inline int32_t
kt_find(const KeyTab *kt, const uint8_t key[KT_KEY], int len)
{
    return kt_find_h(kt, key, len, kt_hash(key, len));
}

/* Fetch ahead the record of the first entry along key h's probe sequence whose tag
 * matches (a probe that ends first, at an empty slot, fetches nothing): the record a
 * lookup of a key the map holds reads, also where another key sits in its first slot.
 * A key the map lacks fetches one only on a false tag match (1 in 16 entries probed).
 * The map's line is in the cache already (fetched ahead itself); KT_PROBE_AHEAD slots
 * at most, so a long cluster costs a few compares, not a walk. */
#define KT_PROBE_AHEAD 8
static inline void
kt_prefetch_rec_h(const KeyTab *kt, uint64_t h)
{
    uint32_t tag = KT_TAG(h);
    size_t i = (size_t)h & kt->smask;
    for (int j = 0; j < KT_PROBE_AHEAD; j++) {
        uint32_t e = kt->slots[i];
        if (e == KT_EMPTY)
            return;
        if (e >> KT_IDX_BITS == tag) {
            KT_PREFETCH(KT_REC(kt, (int32_t)(e & KT_IDX_MASK)));
            return;
        }
        i = (i + 1) & kt->smask;
    }
}

/* kt_find of n keys into ids, with the map's lines and then the records' fetched ahead
 * for all of them first, so that the misses of a batch overlap instead of queueing. */
static inline void
kt_find_many(const KeyTab *kt, const uint8_t (*keys)[KT_KEY], const int *lens, Py_ssize_t n, int32_t *ids,
             uint64_t *hs)
{
    for (Py_ssize_t i = 0; i < n; i++) {
        hs[i] = kt_hash(keys[i], lens[i]);
        KT_PREFETCH(&kt->slots[hs[i] & kt->smask]);
    }
    for (Py_ssize_t i = 0; i < n; i++)
        kt_prefetch_rec_h(kt, hs[i]);
    for (Py_ssize_t i = 0; i < n; i++)
        ids[i] = kt_find_h(kt, keys[i], lens[i], hs[i]);
}

/* Fetch ahead what looking up n 16-byte keys back to back will read: the map's lines,
 * then the record each key's first tag match names; their hashes into hs. For a window
 * of a batch (at most 64 keys), before its lookups. */
static inline void
kt_prefetch16_h(const KeyTab *kt, const uint8_t *keys, Py_ssize_t n, uint64_t hs[64])
{
    if (n > 64)
        n = 64;
    for (Py_ssize_t i = 0; i < n; i++) {
        hs[i] = kt_hash(keys + KT_KEY * i, KT_KEY);
        KT_PREFETCH(&kt->slots[hs[i] & kt->smask]);
    }
    for (Py_ssize_t i = 0; i < n; i++)
        kt_prefetch_rec_h(kt, hs[i]);
}

static inline void
kt_prefetch16(const KeyTab *kt, const uint8_t *keys, Py_ssize_t n)
{
    uint64_t hs[64];
    kt_prefetch16_h(kt, keys, n, hs);
}

/* kt_find of n 16-byte keys back to back into ids, a window of 64 at a time: each key
 * hashed once, the window's map lines and then the records they name fetched ahead. */
static inline void
kt_find16_many(const KeyTab *kt, const uint8_t *keys, Py_ssize_t n, int32_t *ids)
{
    uint64_t hs[64];
    for (Py_ssize_t i = 0; i < n; i += 64) {
        Py_ssize_t m = n - i < 64 ? n - i : 64;
        const uint8_t *k = keys + KT_KEY * i;
        kt_prefetch16_h(kt, k, m, hs);
        for (Py_ssize_t j = 0; j < m; j++)
            ids[i + j] = kt_find_h(kt, k + KT_KEY * j, KT_KEY, hs[j]);
    }
}

static inline size_t
kt_home(const KeyTab *kt, int32_t id)
{
    return (size_t)kt_hash(KT_KEYOF(kt, id), kt_len(kt, id)) & kt->smask;
}

static inline void
kt_place_h(KeyTab *kt, int32_t id, uint64_t h)
{
    size_t i = (size_t)h & kt->smask;
    while (kt->slots[i] != KT_EMPTY)
        i = (i + 1) & kt->smask;
    kt->slots[i] = KT_TAG(h) << KT_IDX_BITS | (uint32_t)id;
}

static void
kt_place(KeyTab *kt, int32_t id)
{
    kt_place_h(kt, id, kt_hash(KT_KEYOF(kt, id), kt_len(kt, id)));
}

/* Ask for transparent huge pages over the whole 2 MiB pages of a large map (Linux, where
 * THP is "madvise"): a lookup's random read of it then misses the TLB far less (the page
 * table's map, in arrays of its own before: 30 -> 17-19 ns a key at 4M keys when its
 * lines are cached). Best effort. */
static void
kt_advise_huge(void *p, size_t bytes)
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
        kt_advise_huge(slots, ncap * sizeof(uint32_t));
        memset(slots, 0xff, ncap * sizeof(uint32_t));
        PyMem_Free(kt->slots);
        kt->slots = slots;
        kt->smask = ncap - 1;
        for (int32_t id = 0; id < kt->high; id++)   /* the records in order, not the map's */
            if (KT_META(kt, id) & KT_HOLDERS)
                kt_place(kt, id);
    }
    /* Freed ids are reused first; only the rest need fresh ones. */
    int64_t fresh = extra > kt->nfree ? extra - kt->nfree : 0;
    int64_t need = (int64_t)kt->high + fresh;
    if (need > KT_MAX_IDS) {
        PyErr_Format(PyExc_MemoryError, "a key table holds at most %d keys", (int)KT_MAX_IDS);
        return -1;
    }
    while ((int64_t)kt->nchunks * KT_CHUNK < need) {
        if (kt->nchunks == kt->chunkcap) {
            int32_t ncap = kt->chunkcap < 16 ? 16 : kt->chunkcap * 2;
            uint8_t **c = PyMem_Realloc(kt->chunks, (size_t)ncap * sizeof(uint8_t *));
            if (c == NULL) {
                PyErr_NoMemory();
                return -1;
            }
            kt->chunks = c;
            void **r = PyMem_Realloc(kt->raw, (size_t)ncap * sizeof(void *));
            if (r == NULL) {
                PyErr_NoMemory();
                return -1;
            }
            kt->raw = r;
            kt->chunkcap = ncap;
        }
        void *raw = PyMem_Malloc((size_t)KT_CHUNK * kt->rec_size + 63);
        if (raw == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        uint8_t *c = (uint8_t *)(((uintptr_t)raw + 63) & ~(uintptr_t)63);
        for (int32_t i = 0; i < KT_CHUNK; i++)   /* nobody holds these ids yet */
            c[(size_t)i * kt->rec_size + KT_KEY] = 0;
        kt->raw[kt->nchunks] = raw;
        kt->chunks[kt->nchunks++] = c;
    }
    return 0;
}

/* A new id for key (absent: kt_find said -1) whose hash is h, held by nobody yet: the
 * caller holds it at once. Only after kt_reserve made room for it. */
static int32_t
kt_add_h(KeyTab *kt, const uint8_t key[KT_KEY], int len, uint64_t h)
{
    int32_t id;
    if (kt->free_head >= 0) {
        id = kt->free_head;
        memcpy(&kt->free_head, KT_KEYOF(kt, id), sizeof(int32_t));
        kt->nfree--;
    } else {
        id = kt->high++;
    }
    memcpy(KT_KEYOF(kt, id), key, KT_KEY);
    KT_META(kt, id) = (uint8_t)(len - 1);
    KT_LEVEL(kt, id) = KT_NO_LEVEL;
    kt_place_h(kt, id, h);
    kt->count++;
    return id;
}

static inline int32_t
kt_add(KeyTab *kt, const uint8_t key[KT_KEY], int len)
{
    return kt_add_h(kt, key, len, kt_hash(key, len));
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

/* Puts the unmapped id, held by nobody now, on the free stack. */
static inline void
kt_free_id(KeyTab *kt, int32_t id)
{
    memset(KT_KEYOF(kt, id), 0, KT_KEY);
    memcpy(KT_KEYOF(kt, id), &kt->free_head, sizeof(int32_t));
    KT_META(kt, id) = 0;
    kt->free_head = id;
    kt->nfree++;
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
    kt_free_id(kt, id);
    kt->count--;
}

static size_t
kt_nbytes(const KeyTab *kt)
{
    return (size_t)kt->nchunks * ((size_t)KT_CHUNK * kt->rec_size + 63) + (size_t)kt->chunkcap * 2 * sizeof(void *) +
           (kt->smask + 1) * sizeof(uint32_t);
}

static void
kt_free(KeyTab *kt)
{
    if (kt == NULL)
        return;
    for (int32_t i = 0; i < kt->nchunks; i++)
        PyMem_Free(kt->raw[i]);
    PyMem_Free(kt->chunks);
    PyMem_Free(kt->raw);
    PyMem_Free(kt->slots);
    PyMem_Free(kt);
}

static void
kt_capsule_free(PyObject *cap)
{
    kt_free(PyCapsule_GetPointer(cap, KT_CAPSULE));
}

/* A new, empty key table in a capsule, with room in each record for the nodes of the
 * holders named (KT_LEAVES, KT_GHOST; neither: a page table's own, key, meta and level);
 * NULL with an exception. A page table can use any of them. */
static PyObject *
kt_capsule_new(int holders)
{
    KeyTab *kt = PyMem_Calloc(1, sizeof(KeyTab));
    if (kt == NULL)
        return PyErr_NoMemory();
    kt->free_head = -1;
    if (!(holders & (KT_GHOST | KT_LEAVES))) {
        kt->rec_size = 20;       /* the key, meta, level: a page table's own */
    } else if ((holders & KT_GHOST) && (holders & KT_LEAVES)) {
        kt->leaves_off = 18;     /* right after the level: its node is packed to 2 */
        kt->ghost_off = 36;      /* 4-aligned: its node is packed to 4 */
        kt->rec_size = 56;
    } else if (holders & KT_GHOST) {
        kt->ghost_off = 20;
        kt->rec_size = 40;
    } else {
        kt->leaves_off = 18;
        kt->rec_size = 40;
    }
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

/* The key table in capsule obj, with room for the nodes of holder (0: any); NULL with
 * `error` set (naming `what`) otherwise. */
static KeyTab *
kt_from(PyObject *obj, PyObject *error, const char *what, int holder)
{
    if (!PyCapsule_IsValid(obj, KT_CAPSULE)) {
        PyErr_Format(error, "%s must be a key table from tierkv.policy._ghost.new_keys(), got %.100s", what,
                     Py_TYPE(obj)->tp_name);
        return NULL;
    }
    KeyTab *kt = PyCapsule_GetPointer(obj, KT_CAPSULE);
    const char *kind = holder == KT_LEAVES ? "leaf heaps" : holder == KT_TABLE ? "a page table" : "a ghost";
    if ((holder == KT_LEAVES && kt->leaves_off == 0) || (holder == KT_GHOST && kt->ghost_off == 0)) {
        PyErr_Format(error, "%s: this key table has no room for %s", what, kind);
        return NULL;
    }
    if (kt->attached & holder) {   /* two would take each other's keys and nodes for their own */
        PyErr_Format(error, "%s: this key table serves %s already", what, kind);
        return NULL;
    }
    return kt;
}

/* The key table a new structure of kind holder uses: keys (a capsule kt_from accepted)
 * or, for None, a table of its own; *owner gets a new reference to the capsule. NULL
 * with an exception. */
static KeyTab *
kt_use(PyObject *keys, int holder, PyObject **owner)
{
    *owner = keys == Py_None ? kt_capsule_new(holder) : Py_NewRef(keys);
    return *owner == NULL ? NULL : PyCapsule_GetPointer(*owner, KT_CAPSULE);
}

/* A structure of kind holder (KT_LEAVES, KT_GHOST) starts using kt: after kt_from said
 * it may, once the structure is fully made. */
static inline void
kt_attach(KeyTab *kt, int holder)
{
    kt->attached |= (uint8_t)holder;
}

/* The structure of kind holder stops using kt: its ids are let go of (freed where the
 * other holder does not hold them), and another structure of its kind may attach. One
 * pass over the records and a new map, not an unmapping per id: a policy being dropped
 * lets go of a million ids at once. */
static void
kt_detach(KeyTab *kt, int holder)
{
    kt->attached &= (uint8_t)~holder;
    memset(kt->slots, 0xff, (kt->smask + 1) * sizeof(uint32_t));
    kt->free_head = -1;
    kt->nfree = 0;
    kt->count = 0;
    for (int32_t id = kt->high - 1; id >= 0; id--) {   /* the free stack lowest id first */
        uint8_t m = KT_META(kt, id) & (uint8_t)~holder;
        KT_META(kt, id) = m;
        if (holder & KT_TABLE)
            KT_LEVEL(kt, id) = KT_NO_LEVEL;
        if (m & KT_HOLDERS) {
            kt_place(kt, id);
            kt->count++;
        } else {
            kt_free_id(kt, id);
        }
    }
}

#endif
