/* A small lease's kernels of the compact index (gcache/meta/fewrows.py): its rows
 * pinned, touched and read for the reply in one pass (lease_rows), and unpinned
 * (unpin_rows); see _index.c's header for both signatures. Every row is checked
 * before anything is written. Part of the gcache._native._index module. */
#include "_index.h"

/* ---- small leases ------------------------------------------------------------------ */

#define LEASE_MAX 64 /* rows per call (a small lease: the caller sends at most SMALL) */

/* Each row of the list `ids` as a C int into out[]; -1 (an error set) when one is
 * not an int, or there are more than LEASE_MAX. */
static Py_ssize_t row_list(PyObject *ids, int64_t *out) {
    if (!PyList_Check(ids)) { PyErr_SetString(PyExc_TypeError, "rows must be a list"); return -1; }
    Py_ssize_t n = PyList_GET_SIZE(ids);
    if (n > LEASE_MAX) {
        PyErr_Format(PyExc_ValueError, "%zd rows (at most %d a call)", n, LEASE_MAX);
        return -1;
    }
    for (Py_ssize_t j = 0; j < n; j++) {
        long long v = PyLong_AsLongLong(PyList_GET_ITEM(ids, j));
        if (v == -1 && PyErr_Occurred()) return -1;
        out[j] = v;
    }
    return n;
}

PyObject *gc_lease_rows(PyObject *self, PyObject *args) {
    PyObject *ids, *slabs, *o[14], *h0o, *h1o;
    unsigned long long tick, seq0, seq1;
    double atime;
    Py_ssize_t size0, size1;
    if (!PyArg_ParseTuple(args, "O!KdOOOOOOOOOOOOOOO!OnKOnK", &PyList_Type, &ids, &tick, &atime,
                          &o[0], &o[1], &o[2], &o[3], &o[4], &o[5], &o[6], &o[7], &o[8], &o[9],
                          &o[10], &o[11], &o[12], &o[13], &PyDict_Type, &slabs, &h0o, &size0,
                          &seq0, &h1o, &size1, &seq1))
        return NULL;
    /* pins block tick atime hpos hseq tier server offset length group sums_len sums_slot pos */
    static const Py_ssize_t width[14] = {4, 4, 8, 8, 4, 8, 1, 2, 8, 4, 1, 2, 4, 4};
    static const int writes[14] = {1, 0, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0};
    static const char *names[14] = {"pins", "block", "tick", "atime", "hpos", "hseq", "tier",
                                    "server", "offset", "length", "group", "sums_len",
                                    "sums_slot", "pos"};
    buf_t b[14], hb[2], sb[LEASE_MAX];
    memset(b, 0, sizeof b);
    memset(hb, 0, sizeof hb);
    memset(sb, 0, sizeof sb);
    long sw[LEASE_MAX];
    int nslab = 0;
    int64_t rows[LEASE_MAX];
    PyObject *res = NULL, *out = NULL;
    Py_ssize_t n = row_list(ids, rows);
    if (n < 0) return NULL;
    for (int c = 0; c < 14; c++)
        if (get(o[c], &b[c], width[c], writes[c], names[c]) < 0) goto done;
    if (get(h0o, &hb[0], 4, 1, "heap") < 0 || get(h1o, &hb[1], 4, 1, "heap") < 0) goto done;
    Py_ssize_t nrows = N(b[0], int32_t);
    for (int c = 1; c < 13; c++)
        if (b[c].b.len / width[c] < nrows) nrows = b[c].b.len / width[c];
    Py_ssize_t npos = N(b[13], uint32_t);
    int32_t *pins = b[0].b.buf, *block = b[1].b.buf, *hpos = b[4].b.buf, *slot = b[12].b.buf;
    uint64_t *tk = b[2].b.buf, *hseq = b[5].b.buf;
    double *at = b[3].b.buf;
    const uint8_t *tier = b[6].b.buf, *group = b[10].b.buf;
    const uint16_t *server = b[7].b.buf, *slen = b[11].b.buf;
    const uint64_t *offset = b[8].b.buf;
    const uint32_t *length = b[9].b.buf, *pos = b[13].b.buf;
    Py_ssize_t size[2] = {size0, size1};
    uint64_t seq[2] = {seq0, seq1};
    for (int t = 0; t < 2; t++)
        if (size[t] < 0 || size[t] > N(hb[t], int32_t)) { oob("heap size", size[t]); goto done; }
    const uint8_t *sbase[LEASE_MAX];
    /* every row checked before anything changes: live, its heap place and its
     * checksums where they say */
    for (Py_ssize_t j = 0; j < n; j++) {
        int64_t r = rows[j];
        if (r < 0 || r >= nrows || block[r] < 0 || block[r] >= npos || tier[r] > 1) {
            PyErr_SetString(PyExc_ValueError, "unknown object ids");
            goto done;
        }
        int32_t hp = hpos[r];
        if (hp >= 0 && (hp >= size[tier[r]] || ((int32_t *)hb[tier[r]].b.buf)[hp] != r)) {
            oob("heap place of row", r);
            goto done;
        }
        long w = slen[r];
        sbase[j] = NULL;
        if (!w) continue;
        int k = 0;
        while (k < nslab && sw[k] != w) k++;
        if (k == nslab) {
            PyObject *key = PyLong_FromLong(w);
            if (!key) goto done;
            PyObject *arr = PyDict_GetItemWithError(slabs, key);
            Py_DECREF(key);
            if (!arr) {
                if (!PyErr_Occurred())
                    PyErr_Format(PyExc_ValueError, "no checksum slab of %ld bytes", w);
                goto done;
            }
            if (get(arr, &sb[k], 1, 0, "slab") < 0) goto done;
            sw[k] = w;
            nslab++;
        }
        if (slot[r] < 0 || (slot[r] + 1) * (Py_ssize_t)w > sb[k].b.len) {
            oob("checksum slot of row", r);
            goto done;
        }
        sbase[j] = (const uint8_t *)sb[k].b.buf + slot[r] * (Py_ssize_t)w;
    }
    out = PyList_New(n);
    if (!out) goto done;
    for (Py_ssize_t j = 0; j < n; j++) {
        int64_t r = rows[j];
        PyObject *t = Py_BuildValue("(HKIBBIy#)", server[r], (unsigned long long)offset[r],
                                    length[r], tier[r], group[r], pos[block[r]],
                                    sbase[j] ? (const char *)sbase[j] : "",
                                    (Py_ssize_t)(sbase[j] ? slen[r] : 0));
        if (!t) goto done;
        PyList_SET_ITEM(out, j, t);
    }
    /* (nothing fails past here but a heap row out of range, checked above) */
    for (Py_ssize_t j = 0; j < n; j++) {
        int64_t r = rows[j];
        pins[r] += 1; /* lazy: a pinned row leaves its heap when it reaches the top */
        tk[r] = tick;
        at[r] = atime;
        if (hpos[r] >= 0) {
            int t = tier[r];
            hseq[r] = seq[t]++;
            if (sift(hb[t].b.buf, size[t], tk, hseq, hpos, nrows, hpos[r]) < 0) goto done;
        }
    }
    res = Py_BuildValue("(OKK)", out, seq[0], seq[1]);
done:
    Py_XDECREF(out);
    for (int c = 0; c < 14; c++) put(&b[c]);
    put(&hb[0]); put(&hb[1]);
    for (int k = 0; k < nslab; k++) put(&sb[k]);
    return res;
}

PyObject *gc_unpin_rows(PyObject *self, PyObject *args) {
    PyObject *ids, *o[9];
    if (!PyArg_ParseTuple(args, "O!OOOOOOOOO", &PyList_Type, &ids, &o[0], &o[1], &o[2], &o[3],
                          &o[4], &o[5], &o[6], &o[7], &o[8]))
        return NULL;
    /* objects: pins block hpos group tier; blocks: ns hot children; full (per ns) */
    static const Py_ssize_t width[9] = {4, 4, 4, 1, 1, 2, 4, 4, 1};
    static const char *names[9] = {"pins", "block", "hpos", "group", "tier", "ns", "hot",
                                   "children", "full"};
    buf_t b[9];
    memset(b, 0, sizeof b);
    int64_t rows[LEASE_MAX];
    PyObject *res = NULL;
    Py_ssize_t n = row_list(ids, rows);
    if (n < 0) return NULL;
    for (int c = 0; c < 9; c++)
        if (get(o[c], &b[c], width[c], c == 0, names[c]) < 0) goto done;
    Py_ssize_t nrows = MIN3(N(b[0], int32_t), N(b[1], int32_t), N(b[2], int32_t));
    nrows = MIN3(nrows, N(b[3], uint8_t), N(b[4], uint8_t));
    Py_ssize_t nblocks = MIN3(N(b[5], uint16_t), N(b[6], int32_t), N(b[7], int32_t));
    Py_ssize_t nfull = N(b[8], uint8_t);
    int32_t *pins = b[0].b.buf;
    const int32_t *block = b[1].b.buf, *hpos = b[2].b.buf, *hot = b[6].b.buf, *kids = b[7].b.buf;
    const uint8_t *group = b[3].b.buf, *tier = b[4].b.buf, *full = b[8].b.buf;
    const uint16_t *bns = b[5].b.buf;
    for (Py_ssize_t j = 0; j < n; j++) { /* every row held as often as named */
        int64_t r = rows[j];
        Py_ssize_t times = 0;
        for (Py_ssize_t k = 0; k < n; k++) times += rows[k] == r;
        if (r < 0 || r >= nrows || pins[r] < times || block[r] >= nblocks) {
            PyErr_SetString(PyExc_ValueError, "unpin of an object no lease holds");
            goto done;
        }
        if (block[r] >= 0 && bns[block[r]] >= nfull) { oob("namespace of row", r); goto done; }
    }
    res = PyList_New(0);
    if (!res) goto done;
    for (Py_ssize_t j = 0; j < n; j++) {
        int64_t r = rows[j];
        pins[r] -= 1;
        if (pins[r] || hpos[r] >= 0) continue; /* held still, or in its heap (lazy pins) */
        int32_t bid = block[r];
        int want = bid < 0; /* detached (or freed): the caller frees it */
        if (!want) {
            int fg = full[bns[bid]];
            want = group[r] != fg || (tier[r] == 0 ? hot[bid] : kids[bid]) == 0;
        }
        if (want) {
            PyObject *v = PyLong_FromLongLong(r);
            if (!v || PyList_Append(res, v) < 0) { Py_XDECREF(v); Py_CLEAR(res); goto done; }
            Py_DECREF(v);
        }
    }
done:
    for (int c = 0; c < 9; c++) put(&b[c]);
    return res;
}

