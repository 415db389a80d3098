/* What the compact index's kernels (_index.c, _lease.c) share: buffer access
 * to numpy columns with their lengths checked, the IndexError of a bad row, and
 * the heap sift. One extension module, gcache._native._index. */
#ifndef GCACHE_INDEX_H
#define GCACHE_INDEX_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

#define MIX 0x9E3779B97F4A7C15ULL
#define EMPTY (-1)

typedef struct {
    Py_buffer b;
    int held;
} buf_t;

static inline int get(PyObject *o, buf_t *out, Py_ssize_t itemsize, int writable, const char *what) {
    int flags = PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(o, &out->b, flags) < 0) return -1;
    out->held = 1;
    if (out->b.len % itemsize) {
        PyErr_Format(PyExc_ValueError, "%s: %zd bytes is not a whole number of %zd-byte items",
                     what, out->b.len, itemsize);
        return -1;
    }
    return 0;
}

static inline void put(buf_t *b) {
    if (b->held) PyBuffer_Release(&b->b);
    b->held = 0;
}

#define N(buf, T) ((Py_ssize_t)((buf).b.len / (Py_ssize_t)sizeof(T)))

static inline PyObject *oob(const char *what, long long v) {
    PyErr_Format(PyExc_IndexError, "%s %lld out of range", what, v);
    return NULL;
}

/* Restore the min-heap order around position i (sift up, then down) over raw
 * arrays; `nrows` bounds every row read. Returns the item's final position, or -1
 * with an IndexError set. */
static inline Py_ssize_t sift(int32_t *heap, Py_ssize_t size, const uint64_t *tick, const uint64_t *seq,
                       int32_t *hpos, Py_ssize_t nrows, Py_ssize_t i) {
#define ROW_OK(r) ((r) >= 0 && (r) < nrows)
/* row a before row b: by tick, then by seq */
#define LESS(a, b) (tick[a] < tick[b] || (tick[a] == tick[b] && seq[a] < seq[b]))
    int32_t item = heap[i];
    if (!ROW_OK(item)) { oob("heap row", item); return -1; }
    while (i) {
        Py_ssize_t up = (i - 1) >> 1;
        int32_t above = heap[up];
        if (!ROW_OK(above)) { oob("heap row", above); return -1; }
        if (!LESS(item, above)) break;
        heap[i] = above;
        hpos[above] = (int32_t)i;
        i = up;
    }
    for (;;) {
        Py_ssize_t c = 2 * i + 1;
        if (c >= size) break;
        int32_t a = heap[c], b = c + 1 < size ? heap[c + 1] : a;
        if (!ROW_OK(a) || !ROW_OK(b)) { oob("heap row", ROW_OK(a) ? b : a); return -1; }
        if (LESS(b, a)) { c++; a = b; }
        if (!LESS(a, item)) break;
        heap[i] = a;
        hpos[a] = (int32_t)i;
        i = c;
    }
#undef LESS
#undef ROW_OK
    heap[i] = item;
    hpos[item] = (int32_t)i;
    return i;
}

#define MIN3(a, b, c) ((a) < (b) ? ((a) < (c) ? (a) : (c)) : ((b) < (c) ? (b) : (c)))

PyObject *gc_lease_rows(PyObject *self, PyObject *args);
PyObject *gc_unpin_rows(PyObject *self, PyObject *args);

#endif
