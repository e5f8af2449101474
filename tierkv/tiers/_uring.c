/* tierkv.tiers._uring: a minimal io_uring ring for vectored reads, on raw syscalls.
 *
 * No liburing: only <linux/io_uring.h> (the kernel's UAPI header, part of the libc
 * development headers), so the extension builds wherever gcc does, and the NVMe tier
 * falls back to its thread pool where it is not built or where the kernel (or a
 * seccomp filter) refuses io_uring_setup.
 *
 * Ring(entries) keeps at most ``entries`` reads in flight. ``readv(fd, offset,
 * buffers, tag)`` queues one IORING_OP_READV into the caller's writable buffers
 * (held until the read completes); ``submit()`` hands the queued reads to the kernel
 * without waiting; ``wait(n)`` submits what is queued and returns the (tag, result)
 * of at least ``n`` finished reads (fewer only when fewer are in flight), with the GIL
 * released while it blocks. A read that comes back short but not empty is resubmitted
 * for its remainder here, so ``result`` is the bytes read in all (less than asked only
 * at end of file) or -errno. Not thread-safe: one thread drives a ring at a time.
 * ``close()`` waits for the reads in flight (the kernel may still be filling their
 * buffers) before it unmaps the ring.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <linux/io_uring.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

#define MAX_IOV 1024 /* Linux's IOV_MAX */

typedef struct {
    PyObject *tag;      /* owned; NULL when the slot is free */
    Py_buffer *views;   /* one per iovec, released when the read finishes */
    struct iovec *iov;
    int niov;
    int first;          /* first iovec not yet filled (advanced on a short read) */
    int fd;
    unsigned long long offset; /* file offset of iov[first] */
    size_t left;        /* bytes still to read */
    size_t done;        /* bytes read so far */
} Req;

typedef struct {
    PyObject_HEAD
    int ring_fd;
    unsigned entries;
    void *sq_ptr, *cq_ptr;
    size_t sq_len, cq_len, sqes_len;
    struct io_uring_sqe *sqes;
    unsigned *sq_head, *sq_tail, *sq_mask, *sq_array;
    unsigned *cq_head, *cq_tail, *cq_mask;
    struct io_uring_cqe *cqes;
    Req *reqs;
    unsigned *free_ids;
    unsigned nfree;
    unsigned queued;    /* SQEs written but not yet submitted */
    unsigned inflight;  /* reads queued or submitted, not finished */
} Ring;

static int sys_setup(unsigned entries, struct io_uring_params *p) {
    return (int)syscall(__NR_io_uring_setup, entries, p);
}

static int sys_enter(int fd, unsigned submit, unsigned min_complete, unsigned flags) {
    return (int)syscall(__NR_io_uring_enter, fd, submit, min_complete, flags, NULL, 0);
}

static void ring_unmap(Ring *r) {
    if (r->sqes) munmap(r->sqes, r->sqes_len);
    if (r->cq_ptr && r->cq_ptr != r->sq_ptr) munmap(r->cq_ptr, r->cq_len);
    if (r->sq_ptr) munmap(r->sq_ptr, r->sq_len);
    r->sqes = NULL; r->cq_ptr = NULL; r->sq_ptr = NULL;
    if (r->ring_fd >= 0) close(r->ring_fd);
    r->ring_fd = -1;
}

static void req_release(Ring *r, unsigned id) {
    Req *q = &r->reqs[id];
    for (int i = 0; i < q->niov; i++) PyBuffer_Release(&q->views[i]);
    PyMem_Free(q->views);
    PyMem_Free(q->iov);
    q->views = NULL; q->iov = NULL; q->niov = 0;
    Py_CLEAR(q->tag);
    r->free_ids[r->nfree++] = id;
    r->inflight--;
}

static void push_sqe(Ring *r, unsigned id) {
    Req *q = &r->reqs[id];
    unsigned tail = *r->sq_tail;
    unsigned idx = tail & *r->sq_mask;
    struct io_uring_sqe *sqe = &r->sqes[idx];
    memset(sqe, 0, sizeof *sqe);
    sqe->opcode = IORING_OP_READV;
    sqe->fd = q->fd;
    sqe->off = q->offset;
    sqe->addr = (unsigned long long)(uintptr_t)(q->iov + q->first);
    sqe->len = (unsigned)(q->niov - q->first);
    sqe->user_data = id;
    r->sq_array[idx] = idx;
    __atomic_store_n(r->sq_tail, tail + 1, __ATOMIC_RELEASE);
    r->queued++;
}

/* io_uring_enter, retried on EINTR/EAGAIN/EBUSY; the GIL is released around it. */
static int enter(Ring *r, unsigned min_complete) {
    int ret;
    unsigned flags = min_complete ? IORING_ENTER_GETEVENTS : 0;
    for (;;) {
        unsigned submit = r->queued;
        Py_BEGIN_ALLOW_THREADS
        ret = sys_enter(r->ring_fd, submit, min_complete, flags);
        Py_END_ALLOW_THREADS
        if (ret >= 0) {
            r->queued -= (unsigned)ret < submit ? (unsigned)ret : submit;
            if (r->queued == 0 || min_complete) return 0;
            continue;  /* the kernel took only some: hand it the rest */
        }
        if (errno == EINTR || errno == EAGAIN || errno == EBUSY) {
            if (PyErr_CheckSignals() < 0) return -1;
            continue;
        }
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
}

/* Reap every CQE there is; append finished reads to ``out`` (a list). */
static int reap(Ring *r, PyObject *out) {
    unsigned head = *r->cq_head;
    unsigned tail = __atomic_load_n(r->cq_tail, __ATOMIC_ACQUIRE);
    for (; head != tail; head++) {
        struct io_uring_cqe *cqe = &r->cqes[head & *r->cq_mask];
        unsigned id = (unsigned)cqe->user_data;
        int res = cqe->res;
        Req *q = &r->reqs[id];
        long long result;
        if (res == -EAGAIN || res == -EINTR) {
            push_sqe(r, id);  /* try the same read again */
            continue;
        }
        if (res > 0 && (size_t)res < q->left) {
            /* Short but not empty: read the remainder from where it stopped. */
            size_t adv = (size_t)res;
            q->done += adv; q->left -= adv; q->offset += adv;
            while (adv && adv >= q->iov[q->first].iov_len) adv -= q->iov[q->first++].iov_len;
            q->iov[q->first].iov_base = (char *)q->iov[q->first].iov_base + adv;
            q->iov[q->first].iov_len -= adv;
            push_sqe(r, id);
            continue;
        }
        result = res < 0 ? (long long)res : (long long)(q->done + (size_t)res);
        PyObject *item = Py_BuildValue("(OL)", q->tag, result);
        if (item == NULL || PyList_Append(out, item) < 0) {
            Py_XDECREF(item);
            __atomic_store_n(r->cq_head, head + 1, __ATOMIC_RELEASE);
            req_release(r, id);
            return -1;
        }
        Py_DECREF(item);
        req_release(r, id);
    }
    __atomic_store_n(r->cq_head, head, __ATOMIC_RELEASE);
    return 0;
}

static int ring_init(Ring *r, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"entries", NULL};
    unsigned entries;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "I", kwlist, &entries)) return -1;
    if (r->ring_fd >= 0 || r->reqs) {
        PyErr_SetString(PyExc_RuntimeError, "Ring is already initialised");
        return -1;
    }
    if (entries < 1 || entries > 4096) {
        PyErr_SetString(PyExc_ValueError, "Ring entries must be 1 to 4096");
        return -1;
    }
    struct io_uring_params p;
    memset(&p, 0, sizeof p);
    int fd = sys_setup(entries, &p);
    if (fd < 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    r->ring_fd = fd;
    r->entries = p.sq_entries;
    r->sq_len = p.sq_off.array + p.sq_entries * sizeof(unsigned);
    r->cq_len = p.cq_off.cqes + p.cq_entries * sizeof(struct io_uring_cqe);
    if (p.features & IORING_FEAT_SINGLE_MMAP) {
        if (r->cq_len > r->sq_len) r->sq_len = r->cq_len;
        r->cq_len = r->sq_len;
    }
    r->sq_ptr = mmap(NULL, r->sq_len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, IORING_OFF_SQ_RING);
    if (r->sq_ptr == MAP_FAILED) { r->sq_ptr = NULL; goto fail; }
    if (p.features & IORING_FEAT_SINGLE_MMAP) {
        r->cq_ptr = r->sq_ptr;
    } else {
        r->cq_ptr = mmap(NULL, r->cq_len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, IORING_OFF_CQ_RING);
        if (r->cq_ptr == MAP_FAILED) { r->cq_ptr = NULL; goto fail; }
    }
    r->sqes_len = p.sq_entries * sizeof(struct io_uring_sqe);
    r->sqes = mmap(NULL, r->sqes_len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, IORING_OFF_SQES);
    if (r->sqes == MAP_FAILED) { r->sqes = NULL; goto fail; }
    char *sq = r->sq_ptr, *cq = r->cq_ptr;
    r->sq_head = (unsigned *)(sq + p.sq_off.head);
    r->sq_tail = (unsigned *)(sq + p.sq_off.tail);
    r->sq_mask = (unsigned *)(sq + p.sq_off.ring_mask);
    r->sq_array = (unsigned *)(sq + p.sq_off.array);
    r->cq_head = (unsigned *)(cq + p.cq_off.head);
    r->cq_tail = (unsigned *)(cq + p.cq_off.tail);
    r->cq_mask = (unsigned *)(cq + p.cq_off.ring_mask);
    r->cqes = (struct io_uring_cqe *)(cq + p.cq_off.cqes);
    r->reqs = PyMem_Calloc(r->entries, sizeof(Req));
    r->free_ids = PyMem_Calloc(r->entries, sizeof(unsigned));
    if (!r->reqs || !r->free_ids) {
        PyErr_NoMemory();
        ring_unmap(r);
        return -1;
    }
    for (unsigned i = 0; i < r->entries; i++) r->free_ids[i] = r->entries - 1 - i;
    r->nfree = r->entries;
    return 0;
fail:
    PyErr_SetFromErrno(PyExc_OSError);
    ring_unmap(r);
    return -1;
}

static PyObject *ring_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    Ring *r = (Ring *)type->tp_alloc(type, 0);
    if (r) r->ring_fd = -1;
    return (PyObject *)r;
}

static int check_open(Ring *r) {
    if (r->ring_fd < 0) {
        PyErr_SetString(PyExc_ValueError, "Ring is closed");
        return -1;
    }
    return 0;
}

static PyObject *ring_readv(Ring *r, PyObject *args) {
    int fd;
    unsigned long long offset;
    PyObject *bufs, *tag;
    if (!PyArg_ParseTuple(args, "iKOO", &fd, &offset, &bufs, &tag)) return NULL;
    if (check_open(r) < 0) return NULL;
    if (r->nfree == 0) {
        PyErr_SetString(PyExc_RuntimeError, "Ring is full: wait for a read to finish first");
        return NULL;
    }
    PyObject *seq = PySequence_Fast(bufs, "buffers must be a sequence");
    if (!seq) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    if (n < 1 || n > MAX_IOV) {
        Py_DECREF(seq);
        PyErr_Format(PyExc_ValueError, "readv takes 1 to %d buffers, got %zd", MAX_IOV, n);
        return NULL;
    }
    Py_buffer *views = PyMem_Calloc((size_t)n, sizeof(Py_buffer));
    struct iovec *iov = PyMem_Calloc((size_t)n, sizeof(struct iovec));
    if (!views || !iov) {
        PyMem_Free(views); PyMem_Free(iov); Py_DECREF(seq);
        return PyErr_NoMemory();
    }
    size_t total = 0;
    Py_ssize_t got = 0;
    for (; got < n; got++) {
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(seq, got), &views[got], PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
            goto fail;
        iov[got].iov_base = views[got].buf;
        iov[got].iov_len = (size_t)views[got].len;
        total += (size_t)views[got].len;
    }
    Py_DECREF(seq);
    unsigned id = r->free_ids[--r->nfree];
    Req *q = &r->reqs[id];
    Py_INCREF(tag);
    q->tag = tag; q->views = views; q->iov = iov; q->niov = (int)n; q->first = 0;
    q->fd = fd; q->offset = offset; q->left = total; q->done = 0;
    r->inflight++;
    push_sqe(r, id);
    Py_RETURN_NONE;
fail:
    for (Py_ssize_t i = 0; i < got; i++) PyBuffer_Release(&views[i]);
    PyMem_Free(views); PyMem_Free(iov); Py_DECREF(seq);
    return NULL;
}

static PyObject *ring_submit(Ring *r, PyObject *Py_UNUSED(ignored)) {
    if (check_open(r) < 0) return NULL;
    if (r->queued && enter(r, 0) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *ring_wait(Ring *r, PyObject *args) {
    unsigned want = 1;
    if (!PyArg_ParseTuple(args, "|I", &want)) return NULL;
    if (check_open(r) < 0) return NULL;
    PyObject *out = PyList_New(0);
    if (!out) return NULL;
    if (reap(r, out) < 0) goto fail;
    while ((unsigned)PyList_GET_SIZE(out) < want && r->inflight > 0) {
        if (enter(r, 1) < 0 || reap(r, out) < 0) goto fail;
    }
    if (r->queued && enter(r, 0) < 0) goto fail;  /* resubmitted remainders */
    return out;
fail:
    Py_DECREF(out);
    return NULL;
}

/* Wait out every read in flight, dropping their results; then unmap the ring. */
static void ring_drain_close(Ring *r) {
    if (r->ring_fd >= 0) {
        while (r->inflight > 0) {
            unsigned flags = IORING_ENTER_GETEVENTS;
            int ret;
            unsigned submit = r->queued;
            Py_BEGIN_ALLOW_THREADS
            ret = sys_enter(r->ring_fd, submit, 1, flags);
            Py_END_ALLOW_THREADS
            if (ret < 0 && errno != EINTR && errno != EAGAIN && errno != EBUSY) break;
            if (ret > 0) r->queued -= (unsigned)ret < submit ? (unsigned)ret : submit;
            unsigned head = *r->cq_head, tail = __atomic_load_n(r->cq_tail, __ATOMIC_ACQUIRE);
            for (; head != tail; head++) req_release(r, (unsigned)r->cqes[head & *r->cq_mask].user_data);
            __atomic_store_n(r->cq_head, head, __ATOMIC_RELEASE);
        }
        ring_unmap(r);
    }
    if (r->reqs) {
        /* Only when the kernel refused to wait: leak nothing Python-side that it may still fill. */
        if (r->inflight == 0) PyMem_Free(r->reqs);
        PyMem_Free(r->free_ids);
        r->reqs = NULL; r->free_ids = NULL;
    }
}

static PyObject *ring_close(Ring *r, PyObject *Py_UNUSED(ignored)) {
    ring_drain_close(r);
    Py_RETURN_NONE;
}

static void ring_dealloc(Ring *r) {
    ring_drain_close(r);
    Py_TYPE(r)->tp_free((PyObject *)r);
}

static PyObject *ring_get_entries(Ring *r, void *Py_UNUSED(c)) { return PyLong_FromUnsignedLong(r->entries); }
static PyObject *ring_get_inflight(Ring *r, void *Py_UNUSED(c)) { return PyLong_FromUnsignedLong(r->inflight); }

static PyMethodDef ring_methods[] = {
    {"readv", (PyCFunction)ring_readv, METH_VARARGS, "readv(fd, offset, buffers, tag): queue one vectored read."},
    {"submit", (PyCFunction)ring_submit, METH_NOARGS, "submit(): hand the queued reads to the kernel."},
    {"wait", (PyCFunction)ring_wait, METH_VARARGS,
     "wait(n=1) -> [(tag, bytes read or -errno)]: at least n finished reads (fewer if fewer in flight)."},
    {"close", (PyCFunction)ring_close, METH_NOARGS, "close(): wait for the reads in flight, then free the ring."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef ring_getset[] = {
    {"entries", (getter)ring_get_entries, NULL, "the most reads in flight", NULL},
    {"inflight", (getter)ring_get_inflight, NULL, "reads queued or in flight", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject RingType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "tierkv.tiers._uring.Ring",
    .tp_basicsize = sizeof(Ring),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "An io_uring ring for vectored reads (see the module notes).",
    .tp_new = ring_new,
    .tp_init = (initproc)ring_init,
    .tp_dealloc = (destructor)ring_dealloc,
    .tp_methods = ring_methods,
    .tp_getset = ring_getset,
};

static struct PyModuleDef uring_module = {
    PyModuleDef_HEAD_INIT, "tierkv.tiers._uring", "A minimal io_uring ring for vectored reads.", -1, NULL,
};

PyMODINIT_FUNC PyInit__uring(void) {
    if (PyType_Ready(&RingType) < 0) return NULL;
    PyObject *m = PyModule_Create(&uring_module);
    if (!m) return NULL;
    Py_INCREF(&RingType);
    if (PyModule_AddObject(m, "Ring", (PyObject *)&RingType) < 0) {
        Py_DECREF(&RingType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
